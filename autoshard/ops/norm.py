"""Normalisation layers: ``layer_norm`` and ``rms_norm``.

The normalised (trailing) dims are reduced over, so they stay replicated, and so do ``weight`` and
``bias``, which span exactly those dims. Leading dims (batch, sequence) shard through. A weight
that is replicated on an axis where the output is sharded gets a partial gradient, which the
planner sums over that axis (data parallel's gradient sync).
"""
from __future__ import annotations

import torch

from autoshard.ir import Shard
from autoshard.ops._common import R, Option, arg, plain_localize
from autoshard.ops.registry import (ELEMENTWISE, NO, OpInfo, Saves, expand, per_output_element,
                                    register_op)

aten = torch.ops.aten

NORMS = (aten.layer_norm.default, aten.rms_norm.default)


def norm_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    lead = x.ndim - len(arg(op, 1, "normalized_shape"))
    rest = (R,) * (len(op.inputs) - 1)  # weight, bias when given
    opts: list[Option] = [((Shard(d),) + rest, (Shard(d),)) for d in range(lead)]
    return expand(op, mesh_shape, opts)


# Backward keeps the input and per-row fp32 statistics: mean and rstd (8 bytes) for layer norm,
# rstd (4 bytes) for RMSNorm.
register_op(aten.layer_norm.default, strategies=norm_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,), extra=(("in", 0, "row", 8),)), follows=NO,
            flops=per_output_element, localize=plain_localize)
register_op(aten.rms_norm.default, strategies=norm_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,), extra=(("in", 0, "row", 4),)), follows=NO,
            flops=per_output_element, localize=plain_localize)
