"""``embedding(weight, indices)``: three ways to shard, per mesh axis.

- indices sharded, weight replicated: the output is sharded like the indices (data parallel);
- weight sharded on the embedding dim: each rank looks up its columns, output sharded on the
  last dim;
- vocab parallel: weight sharded on dim 0 (rows), indices replicated. A rank holds rows
  ``[start, start + V/f)``; its kernel ``"vocab_parallel"`` looks up the indices that fall in its
  range (shifted to local rows) and zeroes the rows of the others, so the output is Partial: the
  sum over ranks has each row from exactly one rank. The gradient of a zeroed row is zero, so
  each rank's weight gradient covers exactly its rows. ``padding_idx`` moves to local rows on the
  rank that owns it and is dropped elsewhere.

``scale_grad_by_freq`` counts index frequencies, which a rank sees only partly (its indices, or
its masked range), so with it only the embedding-dim split is offered.
"""
from __future__ import annotations

import torch

from autoshard.ir import Shard, Strategy
from autoshard.ops._common import P, R, Option, arg, shard_index, with_kernel
from autoshard.ops.registry import (GATHER, NO, OpInfo, all_but_first, expand, per_output_element,
                                    register_op)

aten = torch.ops.aten


def embedding_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    weight, idx = op.inputs
    out_nd = op.outputs[0].ndim
    opts: list[Option] = [((R, R), (R,))]
    opts.append(((Shard(1), R), (Shard(out_nd - 1),)))
    if not arg(op, 3, "scale_grad_by_freq", False):
        opts += [((R, Shard(d)), (Shard(d),)) for d in range(idx.ndim)]
        opts.append(((Shard(0), R), (P,)))
    strategies = expand(op, mesh_shape, opts)
    return with_kernel(strategies, lambda s: "vocab_parallel" if Shard(0) in s.inputs[0] else None)


def embedding_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                       args: tuple, kwargs: dict) -> tuple:
    if strategy.kernel != "vocab_parallel":
        return op.target, args, kwargs
    index, factor = shard_index(strategy.inputs[0], 0, mesh_shape, coords)
    rows = op.inputs[0].shape[0] // factor
    start = index * rows
    padding_idx = arg(op, 2, "padding_idx", -1)
    local_pad = padding_idx - start if padding_idx >= 0 and 0 <= padding_idx - start < rows else -1
    rest = tuple(args[3:])
    extra = {k: v for k, v in kwargs.items() if k != "padding_idx"}

    def vocab_parallel_embedding(weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        local = indices - start
        outside = (local < 0) | (local >= rows)
        out = aten.embedding.default(weight, local.masked_fill(outside, 0), local_pad, *rest, **extra)
        return out.masked_fill(outside.unsqueeze(-1), 0)

    return vocab_parallel_embedding, tuple(args[:2]), {}


# Backward keeps the indices, not the table.
register_op(aten.embedding.default, strategies=embedding_strategy, family=GATHER,
            saves=all_but_first, follows=NO, flops=per_output_element,
            localize=embedding_localize)
