"""Batch and group normalisation: ``batch_norm`` (what torch.export's training IR keeps for
``nn.BatchNorm*d``) and ``group_norm``.

``batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, ...)``
normalises each channel (dim 1) over every other dim (batch, spatial). Per mesh axis:

- batch or spatial dims sharded, the per-channel tensors replicated -> output sharded alike. In
  eval mode (``training=False``: the running statistics normalise) that is exact with no
  collective. In training the statistics are the whole batch's: kernel ``"sync_batch_norm"``,
  what ``torch.nn.SyncBatchNorm`` computes (Ioffe & Szegedy 2015 for the formulas). Forward
  all-reduces each channel's sum, then its sum of squared deviations from the global mean (two
  passes: no cancellation in ``E[x²] - E[x]²``; PyTorch's all-gathers each rank's mean and
  variance once instead); backward all-reduces each channel's ``Σ dy`` and ``Σ dy·x̂``
  together, as PyTorch's does. The weight's and bias's gradients stay local summands,
  which the planner's gradient sync adds over the axis as it does for any replicated weight.
  Every rank updates its copy of the running statistics with the global ones, so the copies
  stay equal to one device's.
- channels sharded, every per-channel tensor sharded on its dim 0 -> output sharded on dim 1:
  each rank normalises its own channels. In training the kernel updates its channels' running
  statistics in place: the buffers are then stored sharded as they are read, since an op
  writes into them (trace/aliases.py pins the reads, solver/build.py
  ``placeholder_strategies`` offers a written buffer the sharded layouts), and a reshard, whose
  copy would take the update, never comes between.

``group_norm(input, num_groups, weight, bias, eps, ...)`` normalises each sample's groups of
channels: the batch dim shards through, with no collective.

The collectives of ``"sync_batch_norm"`` are declared (:func:`batch_norm_collectives`): priced
as any op's own collectives and written to the plan's and the run's ledgers
(docs/cost-model.md §3.12).
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import CollectiveKind, Phase, Shard, Strategy, local_shape
from autoshard.ops._common import R, Option, arg, plain_localize, with_kernel
from autoshard.ops.registry import (ELEMENTWISE, NO, CollectiveKernel, OpCollective, OpInfo,
                                    Reduce, Saves, amend, expand, per_output_element,
                                    register_op)

aten = torch.ops.aten

BATCH_NORM = aten.batch_norm.default
CHANNEL = 1
# batch_norm's optional tensor arguments after the input, by position
_PER_CHANNEL = ((1, "weight"), (2, "bias"), (3, "running_mean"), (4, "running_var"))
SYNC = "sync_batch_norm"


def _present(op: OpInfo) -> tuple[str, ...]:
    """The names of batch_norm's per-channel tensors the call passes, in ``op.inputs`` order."""
    return tuple(name for i, name in _PER_CHANNEL if arg(op, i, name) is not None)


def _training(op: OpInfo) -> bool:
    return bool(arg(op, 5, "training"))


def _stat_axes(x_spec: tuple, mesh_shape: tuple) -> tuple[int, ...]:
    """The mesh axes that split a dim the statistics reduce over (all but the channels')."""
    return tuple(a for a, (p, n) in enumerate(zip(x_spec, mesh_shape))
                 if isinstance(p, Shard) and p.dim != CHANNEL and n > 1)


def batch_norm_strategy(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    x = op.inputs[0]
    per_channel = _present(op)
    training = _training(op)
    opts: list[Option] = [((Shard(d),) + (R,) * len(per_channel), (Shard(d),))
                          for d in range(x.ndim) if d != CHANNEL and x.shape[d] > 1]
    opts.append(((Shard(CHANNEL),) + (Shard(0),) * len(per_channel), (Shard(CHANNEL),)))
    strategies = expand(op, mesh_shape, opts)
    if not training:
        return strategies
    return with_kernel(strategies,
                       lambda s: SYNC if _stat_axes(s.inputs[0], mesh_shape) else None)


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Statistics in fp32 at least, as one device's batch norm keeps them for 16-bit inputs."""
    return torch.promote_types(dtype, torch.float32)


def batch_norm_collectives(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> tuple:
    """The sync kernel's all-reduces, in the order it runs them: forward, each channel's sum
    over each statistics axis, then its sum of squared deviations; backward, ``Σ dy`` and
    ``Σ dy·x̂`` of each channel in one. ``C`` local channels, fp32: ``4·C`` bytes forward,
    ``8·C`` backward."""
    if strategy.kernel != SYNC:
        return ()
    x, x_spec = op.inputs[0], strategy.inputs[0]
    channels = local_shape(x.shape, x_spec, mesh_shape)[CHANNEL]
    nbytes = channels * _stat_dtype(x.dtype).itemsize
    axes = _stat_axes(x_spec, mesh_shape)
    forward = [OpCollective(CollectiveKind.ALL_REDUCE, a, nbytes)
               for _ in ("sum", "squared deviations") for a in axes]
    backward = [OpCollective(CollectiveKind.ALL_REDUCE, a, 2 * nbytes, Phase.BACKWARD)
                for a in axes]
    return tuple(forward + backward)


def batch_norm_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                        args: tuple, kwargs: dict) -> tuple:
    if strategy.kernel != SYNC:
        return op.target, args, kwargs
    axes = _stat_axes(strategy.inputs[0], mesh_shape)
    # Every rank of the statistics axes holds as many elements of each channel.
    ranks = math.prod(mesh_shape[a] for a in axes)

    def sync_batch_norm(reduce: Reduce, input: torch.Tensor, weight: torch.Tensor | None,
                        bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                        running_var: torch.Tensor | None, training: bool, momentum: float,
                        eps: float, cudnn_enabled: bool = True) -> torch.Tensor:
        assert training, "eval mode runs the plain op (CollectiveKernel.eval_op)"
        count = input.numel() // input.shape[CHANNEL] * ranks
        return SyncBatchNorm.apply(input, weight, bias, running_mean, running_var, momentum,
                                   eps, count, reduce)

    return CollectiveKernel(sync_batch_norm, axes, SYNC, eval_op=BATCH_NORM), args, kwargs


def _per_channel(t: torch.Tensor, ndim: int) -> torch.Tensor:
    """A ``[C]`` tensor shaped to broadcast over a ``[N, C, ...]`` one."""
    return t.view((1, -1) + (1,) * (ndim - 2))


class SyncBatchNorm(torch.autograd.Function):
    """Training-mode batch norm over the whole batch, of which this rank holds ``count /
    ranks`` elements per channel; ``reduce`` sums over the statistics axes (see the module's
    docstring). Its temporaries, in the statistics' dtype, are :func:`sync_workspace`'s."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                momentum: float, eps: float, count: int, reduce: Reduce) -> torch.Tensor:
        dims = [d for d in range(x.ndim) if d != CHANNEL]
        xs = x.to(_stat_dtype(x.dtype))
        mean = reduce(xs.sum(dims), "sum") / count
        y = xs - _per_channel(mean, x.ndim)                 # centred, then normalised in place
        var = reduce(y.square().sum(dims), "sum") / count
        rstd = torch.rsqrt(var + eps)
        y.mul_(_per_channel(rstd, x.ndim))
        if weight is not None:
            y.mul_(_per_channel(weight, x.ndim))
        if bias is not None:
            y.add_(_per_channel(bias, x.ndim))
        if running_mean is not None:     # as one device: the unbiased variance, n / (n - 1)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            unbiased = var * (count / max(count - 1, 1))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.count, ctx.reduce, ctx.has_bias = count, reduce, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, mean, rstd = ctx.saved_tensors
        dims = [d for d in range(x.ndim) if d != CHANNEL]
        g = dy.to(rstd.dtype)
        xhat = (x.to(rstd.dtype) - _per_channel(mean, x.ndim)).mul_(_per_channel(rstd, x.ndim))
        local = torch.stack([g.sum(dims), (g * xhat).sum(dims)])   # Σ dy, Σ dy·x̂ (this rank's)
        total = ctx.reduce(local, "sum", backward=True) / ctx.count
        scale = rstd if weight is None else rstd * weight.to(rstd.dtype)
        dx = g - _per_channel(total[0], x.ndim)
        dx.sub_(xhat.mul_(_per_channel(total[1], x.ndim))).mul_(_per_channel(scale, x.ndim))
        # The weight's and bias's gradients: this rank's summands (the gradient sync adds them).
        dw = local[1].to(weight.dtype) if weight is not None else None
        db = local[0].to(dy.dtype) if ctx.has_bias else None
        return dx.to(x.dtype), dw, db, None, None, None, None, None, None


def sync_workspace(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> tuple[int, int]:
    """What :class:`SyncBatchNorm` holds beyond its input, output and saved tensors at its
    fullest, (forward, backward), in units of the rank's input in the statistics' dtype:
    forward the squared deviations, backward x̂ and one product (fp32 input: 1, 2). From a
    16-bit input the fp32 copy of the input and the output before its cast in forward, and in
    backward the gradient's fp32 copy, x̂ and the input gradient before its cast (3, 3). The
    plain op's fused kernels hold none of these."""
    if strategy.kernel != SYNC:
        return 0, 0
    x = op.inputs[0]
    stat = _stat_dtype(x.dtype)
    one = math.prod(local_shape(x.shape, strategy.inputs[0], mesh_shape)) * stat.itemsize
    if stat == x.dtype:
        return one, 2 * one
    return 3 * one, 3 * one


def batch_norm_saves(op: OpInfo) -> Saves:
    """The input and the weight (backward scales by it); the per-channel statistics are
    negligible."""
    return Saves(inputs=(0, 1) if arg(op, 1, "weight") is not None else (0,))


register_op(BATCH_NORM, strategies=batch_norm_strategy, family=ELEMENTWISE,
            saves=batch_norm_saves, follows=NO, flops=per_output_element,
            localize=batch_norm_localize, collectives=batch_norm_collectives)
amend(BATCH_NORM, workspace=sync_workspace)


def group_norm_strategy(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    x = op.inputs[0]
    rest = (R,) * (len(op.inputs) - 1)          # weight, bias when given
    opts: list[Option] = [((Shard(0),) + rest, (Shard(0),))] if x.shape[0] > 1 else []
    return expand(op, mesh_shape, opts)


# Backward keeps the input and each sample's group statistics (negligible).
register_op(aten.group_norm.default, strategies=group_norm_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,)), follows=NO, flops=per_output_element,
            localize=plain_localize)
