"""Pooling and upsampling: ``max_pool{1,2,3}d``, ``avg_pool{1,2,3}d``, their adaptive forms,
the variants returning the max's indices, and ``upsample_*`` (``F.interpolate``: nearest,
linear, bilinear, bicubic, trilinear).

An op of ``k`` spatial dims windows (or interpolates) the last ``k`` dims of its input; the
leading ones (batch and channels, or channels alone unbatched) pass through element by element,
so each shards through to every output (the indices too) with no collective. Spatial dims stay
whole: a window wider than its stride, or an interpolation, reads across a shard's edge. The
average pools and the upsamplings are linear, so a Partial input gives a Partial output.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import Shard, Strategy
from autoshard.ops._common import P, Option, arg, plain_localize
from autoshard.ops.registry import ELEMENTWISE, NO, NOTHING, OpInfo, Saves, expand, register_op

aten = torch.ops.aten

MAX = {aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3}
MAX_WITH_INDICES = {aten.max_pool2d_with_indices.default: 2,
                    aten.max_pool3d_with_indices.default: 3}
AVG = {aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}
ADAPTIVE_AVG = {aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2,
                aten.adaptive_avg_pool3d.default: 3, aten._adaptive_avg_pool2d.default: 2}
ADAPTIVE_MAX = {aten.adaptive_max_pool1d.default: 1, aten.adaptive_max_pool2d.default: 2,
                aten.adaptive_max_pool3d.default: 3}
# upsampling -> (spatial dims, interpolation taps per output element)
UPSAMPLE = {getattr(getattr(aten, f"upsample_{mode}"), overload): (k, taps)
            for mode, k, taps in (("nearest1d", 1, 1), ("nearest2d", 2, 1), ("nearest3d", 3, 1),
                                  ("linear1d", 1, 2), ("bilinear2d", 2, 4), ("bicubic2d", 2, 16),
                                  ("trilinear3d", 3, 8))
            for overload in ("default", "vec")}
SPATIAL = {**MAX, **MAX_WITH_INDICES, **AVG, **ADAPTIVE_AVG, **ADAPTIVE_MAX,
           **{op: k for op, (k, _) in UPSAMPLE.items()}}
LINEAR = {**AVG, **ADAPTIVE_AVG, **UPSAMPLE}


def pool_strategy(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    x, n_out = op.inputs[0], len(op.outputs)
    lead = x.ndim - SPATIAL[op.target]
    opts: list[Option] = [((Shard(d),), (Shard(d),) * n_out) for d in range(lead)
                          if x.shape[d] > 1]
    if op.target in LINEAR:
        opts.append(((P,), (P,)))
    return expand(op, mesh_shape, opts)


def window_flops(op: OpInfo) -> float:
    """One comparison or addition per window tap of each output element."""
    taps = math.prod(arg(op, 1, "kernel_size"))
    return float(op.outputs[0].numel * taps)


def adaptive_flops(op: OpInfo) -> float:
    """Every input element read into about one window."""
    return float(op.inputs[0].numel)


def upsample_flops(op: OpInfo) -> float:
    """One multiply-add per interpolation tap of each output element (nearest: one copy)."""
    return float(op.outputs[0].numel * UPSAMPLE[op.target][1])


def adaptive_avg_saves(op: OpInfo) -> Saves:
    """An output of one element per channel is a mean over the spatial dims, whose backward
    needs only the input's shape; other sizes keep the input."""
    return NOTHING if math.prod(arg(op, 1, "output_size")) == 1 else Saves(inputs=(0,))


# Backward of a max pool keeps the input and the max's int64 index per output element.
register_op(*MAX, strategies=pool_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,), extra=(("out", 0, "elem", 8),)), follows=NO,
            flops=window_flops, localize=plain_localize)
register_op(*MAX_WITH_INDICES, strategies=pool_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,), outputs=(1,)), follows=NO, flops=window_flops,
            localize=plain_localize)
register_op(*ADAPTIVE_MAX, strategies=pool_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,), outputs=(1,)), follows=NO, flops=adaptive_flops,
            localize=plain_localize)
register_op(*AVG, strategies=pool_strategy, family=ELEMENTWISE, saves=Saves(inputs=(0,)),
            follows=NO, flops=window_flops, localize=plain_localize)
register_op(*ADAPTIVE_AVG, strategies=pool_strategy, family=ELEMENTWISE,
            saves=adaptive_avg_saves, follows=NO, flops=adaptive_flops, localize=plain_localize)
# Backward of an upsampling needs only the sizes.
register_op(*UPSAMPLE, strategies=pool_strategy, family=ELEMENTWISE, saves=NOTHING, follows=NO,
            flops=upsample_flops, localize=plain_localize)
