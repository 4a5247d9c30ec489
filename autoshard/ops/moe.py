"""Mixture-of-experts ops of Hugging Face transformers' default experts path (``grouped_mm``;
Mixtral, Qwen-MoE): ``topk`` picks each token's experts, ``sort`` groups the token-expert pairs
by expert, ``histc`` counts the pairs per expert, ``_grouped_mm`` runs every expert on its rows,
and ``index_put`` builds the inverse permutation.

- ``topk``/``sort``: the dim they rank along stays whole; every other dim shards through, both
  outputs (values and their indices along that dim) alike.
- ``histc`` with a fixed range (``min < max``): the histogram of a whole is the sum of its
  parts' histograms, so any input dim may be sharded, giving a Partial output. With
  ``min == max`` the range is the data's own extrema, which a rank cannot know: replicated.
- ``_grouped_mm`` with ``offs`` (a 2-D input [tokens, K] sorted by expert, a 3-D weight
  [experts, K, N]): ``offs`` are global row offsets, so the token rows and the expert dim stay
  whole. The weight's N shards with the output's last dim (column-parallel experts), and K shards
  on both operands into a Partial output (row-parallel experts). Without ``offs`` (3-D x 3-D) it
  is a batched matmul. Other operand ranks, and a bias (no CPU kernel to validate it), are
  replicated.
- ``one_hot``: every input dim shards through to the same output dim, and the class dim the op
  appends is built whole on every rank (GShard's gating one-hots expert indices and buffer slots
  per token, so a token-sharded router stays token-sharded). ``num_classes=-1`` takes the class
  count from the data's maximum, which a rank cannot know: replicated.
- ``index_put``: replicate-only. Its indices address the whole tensor, and the routing tensors
  it writes are small (one entry per token-expert pair), so replicating them costs little.
"""
from __future__ import annotations

import torch

from autoshard.ir import Shard
from autoshard.ops._common import P, R, Option, arg, norm_dim, plain_localize, replicate_only
from autoshard.ops.matmul import einsum_options
from autoshard.ops.registry import (ELEMENTWISE, MATMUL, NO, NOTHING, OpInfo, Saves, expand,
                                    per_output_element, register_op)

aten = torch.ops.aten

SORTS = (aten.sort.default, aten.sort.stable)
GROUPED_MM = aten._grouped_mm.default


def _ranked_dim(op: OpInfo) -> int:
    """The dim ``sort``/``topk`` rank along (``sort.stable`` takes it by keyword only)."""
    pos = 2 if op.target == aten.topk.default else 1
    return norm_dim(arg(op, pos, "dim", -1), op.inputs[0].ndim)


def rank_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, dim = op.inputs[0], _ranked_dim(op)
    n_out = len(op.outputs)
    opts: list[Option] = [((Shard(d),), (Shard(d),) * n_out)
                          for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    return expand(op, mesh_shape, opts)


def one_hot_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    if arg(op, 1, "num_classes", -1) < 0:
        return replicate_only(op, mesh_shape)
    return expand(op, mesh_shape, [((Shard(d),), (Shard(d),)) for d in range(x.ndim)
                                   if x.shape[d] > 1])


def histc_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    if not arg(op, 2, "min", 0) < arg(op, 3, "max", 0):
        return replicate_only(op, mesh_shape)
    return expand(op, mesh_shape, [((Shard(d),), (P,)) for d in range(x.ndim) if x.shape[d] > 1])


def _offs_given(op: OpInfo) -> bool:
    return len(op.inputs) == 3 and arg(op, 3, "bias") is None


def grouped_mm_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, w = op.inputs[:2]
    if len(op.inputs) == 2 and x.ndim == w.ndim == 3:
        return expand(op, mesh_shape, einsum_options(op, ["gmk", "gkn"], "gmn"))
    if _offs_given(op) and (x.ndim, w.ndim) == (2, 3):
        return expand(op, mesh_shape, [((R, Shard(2), R), (Shard(1),)),
                                       ((Shard(1), Shard(1), R), (P,))])
    return replicate_only(op, mesh_shape)


def grouped_mm_flops(op: OpInfo) -> float:
    """2·M·K·N summed over the groups: 2 · output elements · K, except for 2-D x 2-D, whose K
    is what the groups split (2 · input elements · N)."""
    x, w = op.inputs[:2]
    if x.ndim == w.ndim == 2:
        return 2.0 * x.numel * w.shape[-1]
    return 2.0 * op.outputs[0].numel * x.shape[-1]


def _input_elements(op: OpInfo) -> float:
    """One read per input element (a histogram's work is its input, not its bins)."""
    return float(op.inputs[0].numel)


def indices_saved(op: OpInfo) -> Saves:
    """``index_put(self, indices, values)``: backward keeps the indices, not the data."""
    return Saves(inputs=tuple(range(1, len(op.inputs) - 1)))


_ROUTING = dict(family=ELEMENTWISE, follows=NO, localize=plain_localize)
# Backward scatters the gradient back through the indices output.
register_op(*SORTS, aten.topk.default, strategies=rank_strategy, saves=Saves(outputs=(1,)),
            flops=per_output_element, **_ROUTING)
# Integer in, integer out: no gradient, nothing saved.
register_op(aten.one_hot.default, strategies=one_hot_strategy, saves=NOTHING,
            flops=per_output_element, **_ROUTING)
register_op(aten.histc.default, strategies=histc_strategy, saves=NOTHING, flops=_input_elements,
            **_ROUTING)
register_op(aten.index_put.default, strategies=replicate_only, saves=indices_saved,
            flops=per_output_element, **_ROUTING)
# Backward keeps both operands (each gradient needs the other), not the offsets.
register_op(GROUPED_MM, strategies=grouped_mm_strategy, family=MATMUL, saves=Saves(inputs=(0, 1)),
            follows=NO, flops=grouped_mm_flops, localize=plain_localize)
