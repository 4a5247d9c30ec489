"""Losses: ``cross_entropy_loss``, ``nll_loss``/``nll_loss_nd``, ``mse_loss``.

Class-index targets: the class dim (dim 1 of a batched input) stays replicated; any other dim of
the input (batch, tokens, spatial) may be sharded together with the matching target dim.

- ``reduction="none"``: output sharded like the target.
- ``reduction="sum"``: Partial scalar, each rank sums its rows.
- ``reduction="mean"``: Partial scalar with kernel ``"loss_rows"``. The mean divides by the global
  count of non-ignored targets (their total class weight when ``weight`` is given), which a rank
  holding a slice of the target cannot know. We compute it exactly rather than assume no target is
  ignored (Hugging Face causal LMs always pad labels with ``ignore_index``): this strategy takes
  the *whole* target, replicated (it is a small integer tensor), and the local kernel sums the
  loss of its own rows (slicing the target to match) and divides by the global count from the
  whole target. Summed over ranks this is exactly the global mean.

Vocabulary parallel (``cross_entropy_loss`` only, Megatron's vocab-parallel cross-entropy:
Shoeybi et al. 2019 §3; torchtitan's loss parallel): the logits arrive sharded on the class dim,
the target whole on those axes, kernel ``"vocab_parallel"``. The softmax's statistics are
reduced across the axis instead of gathering the logits: a rank takes its rows' local
log-sum-exp ``l`` (one fused log_softmax over its classes), all-reduces its max ``m`` (max) and
``Σ exp(l - m)`` (sum): two collectives of one value per row (b·s, never b·s·V), giving the
row's log-sum-exp ``L = m + log Σ``. Each rank's loss of a row is then
``[first shard]·L - (1-ε)·x[target]·[target in its classes] - ε/C·Σ x``
(``Σ`` over its own classes), so the sum over ranks is the row's loss and the output is Partial: the target's logit is reduced
with the loss (a scalar under ``mean``/``sum``) by the reshard that follows. Backward is local:
``softmax - (1-ε)·onehot - ε/C`` on the rank's classes. The collectives are declared by
:func:`class_loss_collectives` (priced, and listed in the plan's ledger: docs/cost-model.md
§3.8). A class ``weight`` keeps the class dim whole.

``mse_loss`` is elementwise: any dim shards on input and target; ``mean`` uses the local mean
divided by the shard factor (kernel ``"mean_partial"``), as ``mean`` does.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import CollectiveKind, Shard, Strategy, local_shape, to_rank_major
from autoshard.ops._common import P, R, Option, arg, shard_index, with_kernel
from autoshard.ops.registry import (ELEMENTWISE, NO, CollectiveKernel, OpCollective, OpInfo,
                                    Reduce, Saves, all_inputs, amend, expand,
                                    per_output_element, register_op)

aten = torch.ops.aten

CLASS_LOSSES = (aten.cross_entropy_loss.default, aten.nll_loss_nd.default, aten.nll_loss.default)
NONE, MEAN, SUM = 0, 1, 2


def _dim_pairs(op: OpInfo) -> list[tuple[int, int]]:
    """(input dim, target dim) pairs that may shard: every input dim but the class dim."""
    x, t = op.inputs[:2]
    if t.dtype.is_floating_point or x.ndim < 2:
        return []  # class probabilities, or a single unbatched sample: keep whole
    return [(0, 0)] + [(d, d - 1) for d in range(2, x.ndim)]


CLASS_DIM = 1


def _vocab_parallel_ok(op: OpInfo) -> bool:
    """Whether the class dim may shard: a cross-entropy over class indices, batched, without a
    class weight (whose weighted mean would need the weights of every rank's targets)."""
    x, t = op.inputs[:2]
    return (op.target == aten.cross_entropy_loss.default and len(op.inputs) == 2
            and not t.dtype.is_floating_point and x.ndim >= 2 and x.shape[CLASS_DIM] > 1)


def _loss_kernel(s: Strategy, reduction: int) -> str | None:
    if Shard(CLASS_DIM) in s.inputs[0]:
        return "vocab_parallel"
    if reduction == MEAN and any(isinstance(p, Shard) for p in s.inputs[0]):
        return "loss_rows"
    return None


def class_loss_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    reduction = arg(op, 3, "reduction", MEAN)
    n_extra = len(op.inputs) - 2  # class weight, replicated
    opts: list[Option] = []
    for xd, td in _dim_pairs(op):
        if op.inputs[0].shape[xd] <= 1:
            continue
        if reduction == NONE:
            opts.append(((Shard(xd), Shard(td)) + (R,) * n_extra, (Shard(td),)))
        elif reduction == SUM:
            opts.append(((Shard(xd), Shard(td)) + (R,) * n_extra, (P,)))
        else:
            opts.append(((Shard(xd), R) + (R,) * n_extra, (P,)))
    if _vocab_parallel_ok(op):
        opts.append(((Shard(CLASS_DIM), R), (P,)))
    # The classes "sharded" over an axis of one device are whole: that is the replicated
    # strategy, which the vocab-parallel kernel would only price differently.
    strategies = [s for s in expand(op, mesh_shape, opts)
                  if not any(p == Shard(CLASS_DIM) and n == 1
                             for p, n in zip(s.inputs[0], mesh_shape))]
    return with_kernel(strategies, lambda s: _loss_kernel(s, reduction))


def _target_rows(op: OpInfo, x_spec: tuple, mesh_shape: tuple, coords: tuple):
    """This rank's rows of the whole target, for a kernel that takes it whole (``mean``): a
    function of the whole target, cutting each dim as ``x_spec`` cuts the input's (strided
    shards, such as a sequence in the causal load-balanced layout, included: ir.py)."""
    pairs = dict(_dim_pairs(op))
    cuts = [(pairs[p.dim], p.groups, n, c) for p, n, c in zip(x_spec, mesh_shape, coords)
            if isinstance(p, Shard) and p.dim in pairs]

    def rows(t: torch.Tensor) -> torch.Tensor:
        for td, groups, n, c in cuts:
            t = to_rank_major(t, td, n, groups).chunk(n, td)[c]
        return t
    return rows


def class_loss_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                        args: tuple, kwargs: dict) -> tuple:
    if strategy.kernel == "vocab_parallel":
        return vocab_parallel_localize(op, strategy, mesh_shape, coords, args, kwargs)
    if strategy.kernel != "loss_rows":
        return op.target, args, kwargs
    x_spec = strategy.inputs[0]
    ignore_index = arg(op, 4, "ignore_index", -100)
    smoothing = (arg(op, 5, "label_smoothing", 0.0),) if op.target == aten.cross_entropy_loss.default else ()
    my_rows = _target_rows(op, x_spec, mesh_shape, coords)
    target = op.target

    def loss_rows(x: torch.Tensor, full_target: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        valid = full_target != ignore_index
        if w is None:
            count = valid.sum()
        else:
            count = (w[full_target.masked_fill(~valid, 0)] * valid).sum()
        local = my_rows(full_target)
        return target(x, local, w, SUM, ignore_index, *smoothing) / count

    w_local = args[2] if len(args) > 2 else kwargs.get("weight")
    return loss_rows, (args[0], args[1], w_local), {}


def _vocab_axes(x_spec: tuple, mesh_shape: tuple) -> tuple[int, ...]:
    """The mesh axes the class dim is split over (axes of one device move nothing)."""
    return tuple(a for a, p in enumerate(x_spec) if p == Shard(CLASS_DIM) and mesh_shape[a] > 1)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The softmax statistics are reduced in fp32 at least, as Megatron upcasts the logits."""
    return torch.promote_types(dtype, torch.float32)


def class_loss_collectives(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> tuple:
    """The vocabulary-parallel kernel's all-reduces, in the order it runs them: the rows' max
    over each class axis, then their sum-exp over each; each moves one value per local row."""
    if strategy.kernel != "vocab_parallel":
        return ()
    x, x_spec = op.inputs[0], strategy.inputs[0]
    local = local_shape(x.shape, x_spec, mesh_shape)
    rows = math.prod(local) // local[CLASS_DIM]
    nbytes = rows * _stat_dtype(x.dtype).itemsize
    axes = _vocab_axes(x_spec, mesh_shape)
    return tuple(OpCollective(CollectiveKind.ALL_REDUCE, a, nbytes)
                 for _ in ("max", "sum") for a in axes)


def vocab_parallel_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                            args: tuple, kwargs: dict) -> tuple:
    """The kernel of one rank holding classes ``[start, start + C/f)`` of every row it holds."""
    x_spec = strategy.inputs[0]
    reduction = arg(op, 3, "reduction", MEAN)
    ignore_index = arg(op, 4, "ignore_index", -100)
    smoothing = float(arg(op, 5, "label_smoothing", 0.0))
    classes = op.inputs[0].shape[CLASS_DIM]
    index, factor = shard_index(x_spec, CLASS_DIM, mesh_shape, coords)
    start = index * (classes // factor)
    my_rows = _target_rows(op, x_spec, mesh_shape, coords) if reduction == MEAN else None

    def vocab_parallel_cross_entropy(reduce: Reduce, x: torch.Tensor,
                                     target: torch.Tensor) -> torch.Tensor:
        if my_rows is not None:       # mean: the target arrives whole, for the global count
            count = (target != ignore_index).sum()
            target = my_rows(target)
        rows = VocabParallelCrossEntropy.apply(x, target, reduce, start, ignore_index, smoothing,
                                               classes, index == 0)
        if reduction == NONE:
            return rows
        return rows.sum() / count if my_rows is not None else rows.sum()

    kernel = CollectiveKernel(vocab_parallel_cross_entropy, _vocab_axes(x_spec, mesh_shape),
                              "vocab_parallel_cross_entropy")
    return kernel, (args[0], args[1]), {}


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Each row's share of the cross-entropy on this rank's classes (Megatron's
    ``_VocabParallelCrossEntropy``, Shoeybi et al. 2019 §3). ``reduce`` all-reduces over the
    class axes; ``first``: this rank holds the first classes and adds the row's log-sum-exp
    once. Ignored rows give 0.

    The local statistics come from one fused ``log_softmax`` over the rank's classes (in fp32 at
    least): its log-sum-exp ``l`` per row is ``x[0] - log_softmax(x)[0]``. The rows' global
    log-sum-exp ``L`` is ``m + log Σ exp(l - m)`` with ``m`` the max of ``l`` over the ranks:
    the same two all-reduces (max, then sum) of one value per row as ``max`` and ``Σ exp(x -
    max)`` would take, with a handful of passes over the logits instead of one per eager op
    (docs/cost-model.md §3.9). Backward: the global softmax is ``exp(log_softmax(x)) · exp(l -
    L)``, a row scale of the local one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, target: torch.Tensor, reduce: Reduce, start: int,
                ignore_index: int, smoothing: float, classes: int, first: bool) -> torch.Tensor:
        stat = _stat_dtype(x.dtype)
        logp = torch.log_softmax(x, CLASS_DIM, dtype=stat)
        lse = x.select(CLASS_DIM, 0).to(stat) - logp.select(CLASS_DIM, 0)
        top = reduce(lse, "max")
        total = top + reduce((lse - top).exp(), "sum").log()
        local = target - start
        mine = (local >= 0) & (local < x.shape[CLASS_DIM])
        index = local.clamp(0, x.shape[CLASS_DIM] - 1).unsqueeze(CLASS_DIM)
        picked = x.gather(CLASS_DIM, index).squeeze(CLASS_DIM).to(stat) * mine
        rows = -(1.0 - smoothing) * picked
        if smoothing:
            rows = rows - smoothing / classes * x.sum(CLASS_DIM, dtype=stat)
        if first:
            rows = rows + total
        valid = target != ignore_index
        rows = torch.where(valid, rows, torch.zeros_like(rows))
        # Saved as a logits-sized tensor in the logits' dtype, as the composite saves its
        # log-softmax (ops/loss.py cross_entropy_saves).
        ctx.save_for_backward(logp.to(x.dtype), (lse - total).exp(), index, mine, valid)
        ctx.smoothing, ctx.classes = smoothing, classes
        return rows.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logp, share, index, mine, valid = ctx.saved_tensors
        w = grad.to(share.dtype) * valid
        g = logp.exp()                                       # the local softmax
        g.mul_((share * w).to(g.dtype).unsqueeze(CLASS_DIM))  # ... the global one, times grad
        g.scatter_add_(CLASS_DIM, index,
                       (-(1.0 - ctx.smoothing) * mine * w).to(g.dtype).unsqueeze(CLASS_DIM))
        if ctx.smoothing:
            g.sub_((ctx.smoothing / ctx.classes * w).to(g.dtype).unsqueeze(CLASS_DIM))
        return g, None, None, None, None, None, None, None


def mse_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, t = op.inputs
    reduction = arg(op, 2, "reduction", MEAN)
    opts: list[Option] = []
    for d in range(x.ndim):
        if x.shape[d] > 1 and t.shape == x.shape:
            opts.append(((Shard(d), Shard(d)), (Shard(d),) if reduction == NONE else (P,)))
    strategies = expand(op, mesh_shape, opts)
    if reduction == MEAN:
        strategies = with_kernel(strategies, lambda s: "mean_partial" if _factor(
            s.inputs[0], mesh_shape) > 1 else None)
    return strategies


def _factor(spec: tuple, mesh_shape: tuple) -> int:
    return math.prod(n for p, n in zip(spec, mesh_shape) if isinstance(p, Shard))


def mse_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                 args: tuple, kwargs: dict) -> tuple:
    f = _factor(strategy.inputs[0], mesh_shape)
    if strategy.kernel != "mean_partial" or f == 1:
        return op.target, args, kwargs

    def mse_mean_partial(*a, **k):
        return aten.mse_loss.default(*a, **k) / f

    return mse_mean_partial, args, kwargs


def cross_entropy_saves(op: OpInfo) -> Saves:
    """The composite keeps the target and a logits-sized log-softmax."""
    return Saves(inputs=tuple(range(1, len(op.inputs))), extra=(("in", 0, "elem", 0),))


register_op(aten.cross_entropy_loss.default, strategies=class_loss_strategy, family=ELEMENTWISE,
            saves=cross_entropy_saves, follows=NO, flops=per_output_element,
            localize=class_loss_localize, collectives=class_loss_collectives)
# log_softmax, then a gather of the target's entry (docs/cost-model.md §3.7); priced by passes
# over its logits (§3.9), its backward holding the log-softmax's gradient, then the logits'.
amend(aten.cross_entropy_loss.default, specials=(1, 1), logits=True)
register_op(aten.nll_loss_nd.default, aten.nll_loss.default, strategies=class_loss_strategy,
            family=ELEMENTWISE, saves=all_inputs, follows=NO, flops=per_output_element,
            localize=class_loss_localize)
register_op(aten.mse_loss.default, strategies=mse_strategy, family=ELEMENTWISE, saves=all_inputs,
            follows=NO, flops=per_output_element, localize=mse_localize)
