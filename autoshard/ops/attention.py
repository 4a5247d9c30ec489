"""``scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0, is_causal=False, *,
scale=None, enable_gqa=False)``.

Attention is independent per batch element and per head, so the leading dims (all but the last
two: sequence and head dim) shard through when q, k and v are sharded alike. With grouped-query
attention (``enable_gqa``, fewer k/v heads) the head dim shards on q and k/v together: with both
head counts divisible by the shard factor, rank r holds q heads ``[r*Hq/f, ...)`` and k/v heads
``[r*Hkv/f, ...)``, and local q head j still reads local k/v head ``j // (Hq/Hkv)``.
``spec_fits`` enforces both divisibilities for the combined N-D spec.

A tensor ``attn_mask`` broadcasts against ``[..., L, S]``: it is sharded on a dim it holds at full
size and replicated where it broadcasts. ``dropout_p > 0`` draws per-rank masks (see
pointwise.py on dropout).

Context parallelism (kernel ``"cp_gather"``): the query sequence sharded over a mesh axis in the
causal load-balanced layout (ir.py ``ZIGZAG``: rank ``r`` of ``n`` holds chunks ``r`` and
``2n-1-r`` of ``2n``, Llama 3, arXiv 2407.21783 §3.3), K and V whole on that axis. The K/V
all-gather is the reshard that brings K and V to the op, placed and priced as any other (it may
run before GQA's head repeat, on the small K/V), and the gradients of K and V go back by its
adjoint, a reduce-scatter (docs/design.md "Backward collectives"). Each rank attends its two
query chunks to the keys up to each chunk's end, with a causal mask aligned to the bottom right
(``causal_lower_right``: query ``i`` of chunk ``j`` sees keys ``<= j·c + i``), so under
``is_causal`` every rank does ``1/n`` of the causal work. Offered for self-attention without a
mask tensor or dropout (a mask would have to be sliced to the chunks, dropout drawn per chunk).

Ring attention (kernel ``"cp_ring"``): query, key and value all sharded in the zigzag layout over
the same axes, the K/V blocks passed around the ring of those axes' ranks while each rank
attends its queries to the block it holds (ops/ring.py; Liu et al., arXiv 2310.01889). Nothing is
gathered: the op moves its blocks itself, ``n - 1`` hops in forward and ``2n - 1`` in backward
(ops/ring.py ``ring_hops``), which it declares as its own collectives (``ring_collectives``,
docs/cost-model.md §3.8, §3.11), each hop overlapping one step's block compute. A strategy
never mixes the two: K/V are zigzag on exactly the axes the queries are.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from autoshard.ir import CollectiveKind, Shard, Strategy, ZIGZAG, local_shape
from autoshard.ops._common import R, Option, arg, shard_index
from autoshard.ops.registry import (ATTENTION, NO, OpCollective, OpInfo, Saves, amend, expand,
                                    register_op)
from autoshard.ops.ring import RingKernel, RingLayout, accumulator_dtype, ring_attention, ring_hops

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
    if context_parallel_ok(op):
        seq = Shard(q.ndim - 2, ZIGZAG)
        opts.append(((seq, R, R), (seq,)))
        if ring_ok(op):
            opts.append(((seq, seq, seq), (seq,)))
    return [st for st in expand(op, mesh_shape, opts, kernel=_kernel) if st.kernel != _MIXED]


def context_parallel_ok(op: OpInfo) -> bool:
    """Whether the query sequence may shard (see the module docstring): self-attention, no mask
    tensor, no dropout."""
    q, k = op.inputs[:2]
    return (len(op.inputs) == 3 and q.shape[-2] == k.shape[-2] > 1
            and not arg(op, 4, "dropout_p", 0.0))


def ring_ok(op: OpInfo) -> bool:
    """Whether ring attention runs it: K/V with the queries' leading dims (heads apart, under
    grouped-query attention) and one head size for q, k and v (the flash kernels' blocks)."""
    q, k, v = op.inputs[:3]
    gqa = bool(op.kwargs.get("enable_gqa", False))
    heads_ok = k.shape[-3] == q.shape[-3] or (gqa and q.shape[-3] % k.shape[-3] == 0)
    return (q.ndim >= 3 and k.shape == v.shape and q.shape[:-3] == k.shape[:-3] and heads_ok
            and q.shape[-1] == k.shape[-1])


# The context-parallel kernels by the name PlanOptions.context_parallel gives each alone.
CP_KERNELS = {"gather": "cp_gather", "ring": "cp_ring"}
_MIXED = "mixed"   # K/V zigzag on some but not all of the queries' axes: not offered


def _zigzag(p) -> bool:
    return isinstance(p, Shard) and p.groups == ZIGZAG


def _kernel(combo: tuple) -> str | None:
    """``cp_gather`` where the queries' sequence is sharded on some axis with K/V whole there,
    ``cp_ring`` where K/V are sharded alike (``combo``: the 1-D option taken on each axis,
    ``(input placements, output placements)``)."""
    queries = [_zigzag(o[0][0]) for o in combo]
    keys = [_zigzag(o[0][1]) for o in combo]
    if not any(queries):
        return None
    if any(keys):
        return "cp_ring" if keys == queries else _MIXED
    return "cp_gather"


def ring_axes(strategy: Strategy) -> tuple[int, ...]:
    """The mesh axes the ring runs over: those holding the queries' sequence."""
    return tuple(a for a, p in enumerate(strategy.inputs[0]) if _zigzag(p))


def ring_collectives(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> tuple:
    """The ring's hops (ops/ring.py ``ring_hops``) as point-to-point collectives over its axes:
    a K/V hop moves the rank's K and V blocks, a gradient hop their fp32 accumulators. Each
    overlaps one step of the ring's block compute (``hides``: ``1/n`` of the op's forward or
    backward time, docs/cost-model.md §3.11)."""
    if strategy.kernel != "cp_ring":
        return ()
    axes = ring_axes(strategy)
    n = math.prod(mesh_shape[a] for a in axes)
    k, v = op.inputs[1:3]
    numel = sum(math.prod(local_shape(t.shape, spec, mesh_shape))
                for t, spec in ((k, strategy.inputs[1]), (v, strategy.inputs[2])))
    size = {"kv": numel * k.dtype.itemsize,
            "dkv": numel * accumulator_dtype(k.dtype).itemsize}
    return tuple(OpCollective(CollectiveKind.SEND_RECV, axes[0], sum(size[m] for m in h.moves),
                              h.phase, axes if len(axes) > 1 else (), 1 / n)
                 for h in ring_hops(n))


def sdpa_flops(op: OpInfo) -> float:
    """4·b·h·s_q·s_k·d: two matmuls (scores and the weighted sum) of 2·s_q·s_k·d each; half of
    that under ``is_causal``, whose masked half of the scores a flash kernel skips
    (FlashAttention-2, arXiv 2307.08691: "with causal mask, divide the number by 2")."""
    q, k = op.inputs[:2]
    full = 4.0 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * q.shape[-1]
    return full / 2 if arg(op, 5, "is_causal", False) else full


def sdpa_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                  args: tuple, kwargs: dict) -> tuple:
    """The op itself, or under ``cp_gather`` the rank's two query chunks attended to the whole
    keys, each up to its own end under ``is_causal``, or under ``cp_ring`` the ring's kernel
    (ops/ring.py), its transport left to whoever runs it."""
    if strategy.kernel not in ("cp_gather", "cp_ring"):
        return op.target, args, kwargs
    seq_dim = op.inputs[0].ndim - 2
    rank, n = shard_index(strategy.inputs[0], seq_dim, mesh_shape, coords)
    causal = bool(arg(op, 5, "is_causal", False))
    scale, gqa = arg(op, 6, "scale", None), bool(op.kwargs.get("enable_gqa", False))
    if strategy.kernel == "cp_ring":
        q, k = op.inputs[:2]
        lay = RingLayout(rank, n, causal, scale, q.shape[-3] // k.shape[-3])
        ring = RingKernel(functools.partial(ring_attention, lay=lay), ring_axes(strategy),
                          "cp_ring")
        return ring, args[:3], {}
    chunk = op.inputs[0].shape[-2] // (2 * n)
    ends = ((rank + 1) * chunk, (2 * n - rank) * chunk)    # the two chunks' last keys + 1

    def cp_gather(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if not causal:
            return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=gqa)
        outs = [F.scaled_dot_product_attention(
            qc, k[..., :end, :], v[..., :end, :], attn_mask=causal_lower_right(chunk, end),
            scale=scale, enable_gqa=gqa) for qc, end in zip(q.split(chunk, -2), ends)]
        return torch.cat(outs, -2)
    return cp_gather, args[:3], {}


def sdpa_workspace(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> tuple[int, int]:
    """What ring attention holds beyond its inputs and saves (ops/ring.py), (forward,
    backward): in forward the block being received beside the one computed on (two K/V block
    pairs at most) and the fp32 output accumulator; in backward the same two block pairs, two
    fp32 gradient accumulator pairs (one in flight) and the fp32 dQ. Other kernels: none."""
    if strategy.kernel != "cp_ring":
        return 0, 0
    q, k, v = op.inputs[:3]
    local = [math.prod(local_shape(t.shape, spec, mesh_shape))
             for t, spec in zip((q, k, v), strategy.inputs)]
    acc = accumulator_dtype(q.dtype).itemsize
    blocks = 2 * (local[1] + local[2]) * k.dtype.itemsize
    return blocks + local[0] * acc, blocks + 2 * (local[1] + local[2]) * acc + local[0] * acc


def sdpa_saves(op: OpInfo) -> Saves:
    """q, k, v (and a mask), the output, and the fp32 logsumexp per query row (FlashAttention)."""
    return Saves(inputs=tuple(range(len(op.inputs))), outputs=(0,), extra=(("in", 0, "row", 4),))


register_op(SDPA, strategies=sdpa_strategy, family=ATTENTION, saves=sdpa_saves, follows=NO,
            flops=sdpa_flops, localize=sdpa_localize, collectives=ring_collectives)
# The fused kernels it runs as (what torch's selective checkpointing policy sees).
amend(SDPA, kernels=tuple(getattr(aten, k).default for k in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, k)), workspace=sdpa_workspace)
