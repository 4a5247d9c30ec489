"""Small mask and bookkeeping ops of Hugging Face graphs (attention-mask building, label shifts).

They act on index-sized tensors, so replicating them costs little; where a dim plainly passes
through (the batch dims of ``triu``/``tril``, the unpadded dims of ``pad``, the dims
``gather``/``scatter`` do not index: a router's tokens; the dims ``repeat`` tiles once and
``flip``/``roll`` leave in place) it may shard. The
replicate-only rules below are real rules, checked like the others, not the loud fallback.
"""
from __future__ import annotations

import torch

from autoshard.ir import Shard
from autoshard.ops._common import P, Option, arg, is_float, plain_localize, replicate_only
from autoshard.ops.registry import (ELEMENTWISE, GATHER, NO, NOTHING, OpInfo, all_but_first,
                                    all_inputs, expand, per_output_element, register_op)

aten = torch.ops.aten


def triangle_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    opts: list[Option] = [((Shard(d),), (Shard(d),)) for d in range(x.ndim - 2) if x.shape[d] > 1]
    if is_float(x):
        opts.append(((P,), (P,)))  # zeroing entries is linear
    return expand(op, mesh_shape, opts)


def along_dim_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """``gather``/``scatter`` along ``dim``: every other dim on which all their tensors have
    one size pairs element ``i`` of each with element ``i`` of the others (``out[i][j] =
    self[i][index[i][j]]`` for ``dim=1``), so all of them split there alike, the output too,
    and backward's scatter or gather of the gradient stays on the rank (a router's top-k
    scores written into its ``[tokens, experts]`` logits split with the tokens)."""
    tensors = [*op.inputs, *op.outputs]
    ndim = tensors[0].ndim
    along = arg(op, 1, "dim") % max(ndim, 1)
    opts: list[Option] = [
        (tuple(Shard(d) for _ in op.inputs), tuple(Shard(d) for _ in op.outputs))
        for d in range(ndim) if d != along and tensors[0].shape[d] > 1
        and all(t.ndim == ndim and t.shape[d] == tensors[0].shape[d] for t in tensors)]
    return expand(op, mesh_shape, opts)


def pad_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """A dim the pads leave alone shards through: the dims before those ``pad`` lists (it pads
    the last dims, a (before, after) pair each from the last back), and a listed dim whose pair
    is (0, 0) (Mamba-2's ``pad_tensor_by_size`` lists every dim of its 4-D tensors, the batch
    with (0, 0), and pads only the sequence, by 0 where it divides into chunks)."""
    x = op.inputs[0]
    pad = list(arg(op, 1, "pad"))
    pairs = {x.ndim - 1 - k: (pad[2 * k], pad[2 * k + 1]) for k in range(len(pad) // 2)}
    opts: list[Option] = [((Shard(d),), (Shard(d),)) for d in range(x.ndim)
                          if x.shape[d] > 1 and pairs.get(d, (0, 0)) == (0, 0)]
    return expand(op, mesh_shape, opts)


def repeat_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """``repeat(x, sizes)`` tiles ``x`` ``sizes[d]`` times along each dim (``sizes`` may be
    longer than ``x.ndim``: new leading dims). A dim tiled once shards through, at its place in
    the output (JetMoE tiles its keys over the heads with ``repeat(1, k, 1, 1)``: the batch
    splits); a dim tiled ``r`` times holds its shard in each of the ``r`` copies: the output
    dim strided in ``r`` equal groups (ir.py ``Shard.groups``), as JetMoE's queries are, ``k``
    choices of the split key-value heads each."""
    x, sizes = op.inputs[0], list(arg(op, 1, "repeats"))
    lead = len(sizes) - x.ndim
    opts: list[Option] = [((Shard(d),), (Shard(lead + d, (1,) * r if r > 1 else ()),))
                          for d, r in enumerate(sizes[lead:]) if x.shape[d] > 1]
    return expand(op, mesh_shape, opts)


def _dims_listed(op: OpInfo, index: int, name: str) -> set[int] | None:
    """The dims argument ``index`` lists, made non-negative (None: it lists none, as ``roll``
    without ``dims`` rolls the flattened tensor)."""
    dims = arg(op, index, name)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return None
    ndim = op.inputs[0].ndim
    return {d % ndim for d in ([dims] if isinstance(dims, int) else dims)}


def flip_roll_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """``flip(x, dims)`` and ``roll(x, shifts, dims)`` move elements along the dims they list
    only: every other dim shards through; ``roll`` without dims (the flattened tensor) stays
    whole."""
    moved = _dims_listed(op, 1, "dims") if op.target == aten.flip.default else \
        _dims_listed(op, 2, "dims")
    if moved is None:
        return replicate_only(op, mesh_shape)
    x = op.inputs[0]
    opts: list[Option] = [((Shard(d),), (Shard(d),)) for d in range(x.ndim)
                          if x.shape[d] > 1 and d not in moved]
    return expand(op, mesh_shape, opts)


_MISC = dict(follows=NO, flops=per_output_element, localize=plain_localize)
# Gathers read a few rows of their first input; backward keeps the indices.
register_op(aten.index.Tensor, aten.index_select.default,
            strategies=replicate_only, family=GATHER, saves=all_but_first, **_MISC)
register_op(aten.gather.default, strategies=along_dim_strategy, family=GATHER,
            saves=all_but_first, **_MISC)
register_op(aten.scatter.src, aten.scatter.value, strategies=along_dim_strategy,
            family=ELEMENTWISE, saves=all_but_first, **_MISC)
register_op(aten.flip.default, aten.roll.default, strategies=flip_roll_strategy,
            family=ELEMENTWISE, saves=NOTHING, **_MISC)
register_op(aten.repeat.default, strategies=repeat_strategy, family=ELEMENTWISE,
            saves=NOTHING, **_MISC)
register_op(aten.diff.default, aten.bincount.default,
            strategies=replicate_only, family=ELEMENTWISE, saves=all_inputs, **_MISC)
register_op(aten.triu.default, aten.tril.default, strategies=triangle_strategy,
            family=ELEMENTWISE, saves=all_inputs, **_MISC)
register_op(aten.pad.default, aten.constant_pad_nd.default, strategies=pad_strategy,
            family=ELEMENTWISE, saves=NOTHING, **_MISC)
