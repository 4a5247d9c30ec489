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

``mse_loss`` is elementwise: any dim shards on input and target; ``mean`` uses the local mean
divided by the shard factor (kernel ``"mean_partial"``), as ``mean`` does.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import Shard, Strategy
from autoshard.ops._common import P, R, Option, arg, shard_index, with_kernel
from autoshard.ops.registry import (ELEMENTWISE, NO, OpInfo, Saves, all_inputs, expand,
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
    strategies = expand(op, mesh_shape, opts)
    if reduction == MEAN:
        strategies = with_kernel(strategies, lambda s: "loss_rows" if any(
            isinstance(p, Shard) for p in s.inputs[0]) else None)
    return strategies


def class_loss_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                        args: tuple, kwargs: dict) -> tuple:
    if strategy.kernel != "loss_rows":
        return op.target, args, kwargs
    x_spec, t_info = strategy.inputs[0], op.inputs[1]
    ignore_index = arg(op, 4, "ignore_index", -100)
    smoothing = (arg(op, 5, "label_smoothing", 0.0),) if op.target == aten.cross_entropy_loss.default else ()
    target_slices = [slice(None)] * t_info.ndim
    for xd, td in _dim_pairs(op):
        i, f = shard_index(x_spec, xd, mesh_shape, coords)
        n = t_info.shape[td] // f
        target_slices[td] = slice(i * n, (i + 1) * n)
    target = op.target

    def loss_rows(x: torch.Tensor, full_target: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
        valid = full_target != ignore_index
        if w is None:
            count = valid.sum()
        else:
            count = (w[full_target.masked_fill(~valid, 0)] * valid).sum()
        local = full_target[tuple(target_slices)]
        return target(x, local, w, SUM, ignore_index, *smoothing) / count

    w_local = args[2] if len(args) > 2 else kwargs.get("weight")
    return loss_rows, (args[0], args[1], w_local), {}


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
            localize=class_loss_localize)
register_op(aten.nll_loss_nd.default, aten.nll_loss.default, strategies=class_loss_strategy,
            family=ELEMENTWISE, saves=all_inputs, follows=NO, flops=per_output_element,
            localize=class_loss_localize)
register_op(aten.mse_loss.default, strategies=mse_strategy, family=ELEMENTWISE, saves=all_inputs,
            follows=NO, flops=per_output_element, localize=mse_localize)
