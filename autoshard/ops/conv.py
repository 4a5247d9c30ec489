"""Convolutions: ``conv1d``/``conv2d``/``conv3d`` (what torch.export's training IR keeps for
``nn.Conv*d``) and ``convolution`` (what a decomposed graph holds, transposed ones included).

Per mesh axis, as for a matmul whose spatial window is part of the contraction:

- batch: input sharded on dim 0, weight and bias replicated -> output sharded on dim 0;
- output channels: weight (and bias) sharded on the output-channel dim, input replicated ->
  output sharded on dim 1 (the channel dim);
- input channels: input sharded on dim 1 and weight on its input-channel dim, bias Partial ->
  Partial output (each rank convolves its channels; the bias is added once over the ranks).

Spatial dims stay whole (a kernel wider than its stride reads across a shard edge). Grouped
convolutions (``groups > 1``) shard only the batch: a rank's channel slice would need the local
group count. An unbatched input (no batch dim) shards channels only.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import Shard
from autoshard.ops._common import P, R, Option, arg, plain_localize
from autoshard.ops.registry import MATMUL, NO, OpInfo, Saves, expand, register_op

aten = torch.ops.aten

CONV_ND = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.conv1d.padding,
           aten.conv2d.padding)
CONVOLUTION = aten.convolution.default  # (input, weight, bias, stride, padding, dilation,
                                        #  transposed, output_padding, groups)


def _transposed(op: OpInfo) -> bool:
    return op.target == CONVOLUTION and bool(arg(op, 6, "transposed"))


def _groups(op: OpInfo) -> int:
    return arg(op, 8, "groups", 1) if op.target == CONVOLUTION else arg(op, 6, "groups", 1)


def conv_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, w = op.inputs[:2]
    n_bias = len(op.inputs) - 2          # a bias, when a tensor
    channel = x.ndim - w.ndim + 1        # 1 with a batch dim, 0 without
    w_out, w_in = (1, 0) if _transposed(op) else (0, 1)
    opts: list[Option] = []
    if channel == 1:
        opts.append(((Shard(0), R) + (R,) * n_bias, (Shard(0),)))
    if _groups(op) == 1:
        opts.append(((R, Shard(w_out)) + (Shard(0),) * n_bias, (Shard(channel),)))
        opts.append(((Shard(channel), Shard(w_in)) + (P,) * n_bias, (P,)))
    return expand(op, mesh_shape, opts)


def conv_flops(op: OpInfo) -> float:
    """One multiply-add (2 FLOPs) per output element per kernel tap of its group's input
    channels: 2·N·C_out·H_out·W_out·(C_in/groups)·kH·kW. The weight is
    [C_out, C_in/groups, k...], so that is 2 · output elements · the weight's trailing size. A
    transposed convolution scatters each input element through the kernel instead:
    2 · input elements · the weight's trailing size (its weight is [C_in, C_out/groups, k...])."""
    x, w = op.inputs[:2]
    per_element = 2.0 * math.prod(w.shape[1:])
    return per_element * (x.numel if _transposed(op) else op.outputs[0].numel)


# Backward keeps the input and the weight (each gradient needs the other), not the bias.
register_op(*CONV_ND, CONVOLUTION, strategies=conv_strategy, family=MATMUL,
            saves=Saves(inputs=(0, 1)), follows=NO, flops=conv_flops, localize=plain_localize)
