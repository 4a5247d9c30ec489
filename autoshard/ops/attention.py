"""``scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal=False, *,
scale=None, enable_gqa=False)``.

Attention is independent per batch element and per head, so the leading dims (all but the last
two: sequence and head dim) shard through when q, k and v are sharded alike. With grouped-query
attention (``enable_gqa``, fewer k/v heads) the head dim shards on q and k/v together: with both
head counts divisible by the shard factor, rank r holds q heads ``[r*Hq/f, ...)`` and k/v heads
``[r*Hkv/f, ...)``, and local q head j still reads local k/v head ``j // (Hq/Hkv)``.
``spec_fits`` enforces both divisibilities for the combined N-D spec.

A tensor ``attn_mask`` broadcasts against ``[..., L, S]``: it is sharded on a dim it holds at full
size and replicated where it broadcasts. Sharding the query sequence is not offered: ``is_causal``
masks by local row, which would be wrong. ``dropout_p > 0`` draws per-rank masks (see
pointwise.py on dropout).
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import Shard
from autoshard.ops._common import R, Option
from autoshard.ops.registry import ATTENTION, NO, OpInfo, Saves, amend, expand, register_op

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default


def sdpa_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    q, k, v = op.inputs[:3]
    rest = op.inputs[3:]  # attn_mask, when a tensor
    opts: list[Option] = []
    for d in range(q.ndim - 2):
        if q.shape[d] <= 1:
            continue
        gqa_heads = d == q.ndim - 3 and k.shape[d] != q.shape[d] and k.shape[d] > 1
        if k.shape[d] != q.shape[d] and not gqa_heads:
            continue  # k/v broadcast over this dim: keep it whole
        mask_pl = []
        for m in rest:
            md = d - (q.ndim - m.ndim)
            mask_pl.append(Shard(md) if md >= 0 and m.shape[md] == q.shape[d] else R)
        opts.append(((Shard(d),) * 3 + tuple(mask_pl), (Shard(d),)))
    return expand(op, mesh_shape, opts)


def sdpa_flops(op: OpInfo) -> float:
    """4·b·h·s_q·s_k·d: two matmuls (scores and the weighted sum) of 2·s_q·s_k·d each."""
    q, k = op.inputs[:2]
    return 4.0 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]


def sdpa_saves(op: OpInfo) -> Saves:
    """q, k, v (and a mask), the output, and the fp32 logsumexp per query row (FlashAttention)."""
    return Saves(inputs=tuple(range(len(op.inputs))), outputs=(0,), extra=(("in", 0, "row", 4),))


register_op(SDPA, strategies=sdpa_strategy, family=ATTENTION, saves=sdpa_saves, follows=NO,
            flops=sdpa_flops)
# The fused kernels it runs as (what torch's selective checkpointing policy sees).
amend(SDPA, kernels=tuple(getattr(aten, k).default for k in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, k)))
