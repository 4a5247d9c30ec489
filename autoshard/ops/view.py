"""Shape ops: views, reshapes, permutations, expansion, slicing, splitting, concatenation.

Every one is linear, so Partial passes through (float tensors). Their local call is the global
one with sizes made local (``view``/``reshape``/``expand``/``unflatten``); dims, indices and split
sizes stay global because the dims they touch are kept whole.

Reshape groups: input and output dims fall into groups whose products match (``[2, 16, 64] ->
[32, 64]`` has groups ``{0,1}->{0}`` and ``{2}->{1}``). Only the outermost dim of a group may be
sharded, on both sides: its shards are contiguous runs of the flattened group, the same elements
before and after. An inner dim (``16`` above) would interleave, and two dims merged into one may
not both be sharded. ``spec_fits`` then demands that the combined N-D factor divides both sides.
"""
from __future__ import annotations

import bisect
import dataclasses
from typing import Any, Callable

import torch

from autoshard.ir import Shard, Strategy, local_shape, shard_factor
from autoshard.ops._common import (P, R, Option, arg, is_float, mapped_options, norm_dim,
                                            plain_localize)
from autoshard.ops.registry import (ELEMENTWISE, INPUT, LARGEST, NO, NOTHING, VIEW, OpInfo,
                                    WIDENS, all_inputs, amend, expand, per_output_element,
                                    register_op)

aten = torch.ops.aten

RESHAPES = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]]:
    """Groups of (src dims, dst dims) of size > 1 whose flattened extents coincide."""
    def prefix(shape):
        out = [1]
        for s in shape:
            out.append(out[-1] * s)
        return out

    ps, pd = prefix(src), prefix(dst)
    if ps[-1] == 0:
        return []
    cuts = sorted(set(ps) & set(pd))
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for side, (shape, pre) in enumerate(((src, ps), (dst, pd))):
        for d, s in enumerate(shape):
            if s > 1:
                g = bisect.bisect_right(cuts, pre[d]) - 1
                groups.setdefault(g, ([], []))[side].append(d)
    return [groups[g] for g in sorted(groups)]


def _linear(op: OpInfo) -> list[Option]:
    x = op.inputs[0]
    if not is_float(x):
        return []
    return [(tuple(P for _ in op.inputs), tuple(P for _ in op.outputs))]


def reshape_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, out = op.inputs[0], op.outputs[0]
    groups = view_groups(x.shape, out.shape)
    opts: list[Option] = [((Shard(min(i)),), (Shard(min(o)),)) for i, o in groups if i and o]
    # A fused dim viewed as (k groups, rest...): strided in k equal groups, its shards are the
    # second dim's (each rank its heads of Q, of K and of V; ir.py, trace/fused.py).
    marks = dict(x.groups)
    for i, o in groups:
        if len(i) == 1 and len(o) >= 2 and marks.get(i[0]) == (1,) * out.shape[o[0]]:
            opts.append(((Shard(i[0], marks[i[0]]),), (Shard(o[1]),)))
    return expand(op, mesh_shape, opts + _linear(op))


def group_views(op: OpInfo) -> list[tuple[int, int, int]]:
    """``(input dim, output dim, k)`` for each input dim a reshape views as ``(k, ...)``, k >= 2:
    the dim may hold k fused groups (trace/fused.py decides by what later splits the k dim)."""
    x, out = op.inputs[0], op.outputs[0]
    return [(i[0], o[0], out.shape[o[0]]) for i, o in view_groups(x.shape, out.shape)
            if len(i) == 1 and len(o) >= 2]


def reshape_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                     args: tuple, kwargs: dict) -> tuple:
    size = list(local_shape(op.outputs[0].shape, strategy.outputs[0], mesh_shape))
    # reshape, not view: a rank's local tensor may come from a collective with other strides; in
    # a functional graph the two differ only in whether they may copy.
    return aten.reshape.default, (args[0], size), {}


def _as_other(target: Any, strategies_of: Callable) -> Callable:
    """The rule of ``x.reshape_as(other)`` (LeViT) or ``x.expand_as(other)`` (GPT-NeoX-Japanese's
    attention bias, HRM's carried state): ``target``'s strategies to ``other``'s shape,
    ``other`` read for its shape only: it may arrive replicated or laid out as the output
    is."""
    def strategies(op: OpInfo, mesh_shape: tuple) -> list:
        x = dataclasses.replace(op, target=target,
                                args=(op.args[0], list(op.outputs[0].shape)), kwargs={})
        out = []
        for s in strategies_of(x, mesh_shape):
            for other in dict.fromkeys(((R,) * len(mesh_shape), s.outputs[0])):
                out.append(dataclasses.replace(s, inputs=(s.inputs[0], other)))
        return out
    return strategies


def _to_local_shape_of_output(target: Any) -> Callable:
    """The local call of an ``*_as`` op: ``target`` to the output's local shape; ``other`` is
    not read."""
    def localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                 args: tuple, kwargs: dict) -> tuple:
        size = list(local_shape(op.outputs[0].shape, strategy.outputs[0], mesh_shape))
        return target, (args[0], size), {}
    return localize


def unflatten_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                       args: tuple, kwargs: dict) -> tuple:
    x = op.inputs[0]
    dim = norm_dim(arg(op, 1, "dim"), x.ndim)
    n = len(arg(op, 2, "sizes"))
    loc = local_shape(op.outputs[0].shape, strategy.outputs[0], mesh_shape)
    return op.target, (args[0], dim, list(loc[dim:dim + n])), {}


def expand_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    # A broadcast (size-1 or new) dim may be sharded in the output while the input stays
    # replicated: every rank expands the same data to its local size.
    out = op.outputs[0]
    x = op.inputs[0]
    opts = mapped_options(op, [{d: d + out.ndim - x.ndim for d in range(x.ndim)}], broadcast=True)
    return expand(op, mesh_shape, opts + _linear(op))


def expand_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                    args: tuple, kwargs: dict) -> tuple:
    size = list(local_shape(op.outputs[0].shape, strategy.outputs[0], mesh_shape))
    return op.target, (args[0], size) + tuple(args[2:]), kwargs


SQUEEZES = (aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
MATRIX_T = (aten.mT.default, aten.mH.default, aten.matrix_H.default)
# Complex views: a complex tensor as its real parts (and back, through a trailing dim of 2).
COMPLEX_VIEWS = (aten.view_as_real.default, aten.view_as_complex.default, aten.real.default,
                 aten.imag.default)


def _squeezed(op: OpInfo) -> list[int]:
    """The dims a squeeze drops: those named (all, by default) that have size 1 globally."""
    x = op.inputs[0]
    dims = arg(op, 1, "dim")
    dims = range(x.ndim) if dims is None else [dims] if isinstance(dims, int) else dims
    return sorted({norm_dim(d, x.ndim) for d in dims if x.shape[norm_dim(d, x.ndim)] == 1})


def squeeze_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                     args: tuple, kwargs: dict) -> tuple:
    # Name the globally squeezed dims: a sharded dim may have local size 1, which a local
    # "squeeze every size-1 dim" would drop too.
    return aten.squeeze.dims, (args[0], _squeezed(op)), {}


def _swapped(op: OpInfo) -> tuple[int, int]:
    """The two dims a transpose swaps; ``x.mT``, ``x.mH`` and ``x.H`` swap (and conjugate) the
    last two."""
    ndim = op.inputs[0].ndim
    if op.target == aten.t.default:
        return 0, 1
    if op.target in MATRIX_T:
        return ndim - 2, ndim - 1
    return norm_dim(arg(op, 1, "dim0"), ndim), norm_dim(arg(op, 2, "dim1"), ndim)


def dim_map(op: OpInfo) -> dict[int, int]:
    """Input dim -> output dim for the ops that move, add or drop dims."""
    t, x, out = op.target, op.inputs[0], op.outputs[0]
    if t == aten.permute.default:
        dims = [norm_dim(d, x.ndim) for d in arg(op, 1, "dims")]
        return {d: dims.index(d) for d in range(x.ndim)}
    if t == aten.numpy_T.default:  # ``x.T``: every dim reversed
        return {d: x.ndim - 1 - d for d in range(x.ndim)}
    if t in (aten.transpose.int, aten.t.default, *MATRIX_T):
        d0, d1 = _swapped(op)
        return {d: {d0: d1, d1: d0}.get(d, d) for d in range(x.ndim)}
    if t in COMPLEX_VIEWS:  # ``view_as_complex`` drops the trailing (real, imaginary) dim
        return {d: d for d in range(min(x.ndim, out.ndim))}
    if t == aten.unsqueeze.default:
        dim = norm_dim(arg(op, 1, "dim"), out.ndim)
        return {d: d if d < dim else d + 1 for d in range(x.ndim)}
    if t in SQUEEZES:
        gone = _squeezed(op)
        kept = [d for d in range(x.ndim) if d not in gone]
        return {d: i for i, d in enumerate(kept)}
    if t in (aten.select.int, aten.unbind.int):
        dim = norm_dim(arg(op, 1, "dim", 0), x.ndim)
        return {d: d - (d > dim) for d in range(x.ndim) if d != dim}
    if t in (aten.slice.Tensor, aten.narrow.default, aten.split.Tensor,
             aten.split_with_sizes.default, aten.chunk.default):
        default = 0
        pos = {aten.split.Tensor: 2, aten.split_with_sizes.default: 2, aten.chunk.default: 2}
        dim = norm_dim(arg(op, pos.get(t, 1), "dim", default), x.ndim)
        whole = t in (aten.slice.Tensor, aten.narrow.default) and out.shape[dim] == x.shape[dim]
        return {d: d for d in range(x.ndim) if d != dim or whole}
    raise AssertionError(f"no dim map for {t}")


DIM_MAPPED = (aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default,
              *MATRIX_T, *COMPLEX_VIEWS, aten.unsqueeze.default,
              *SQUEEZES, aten.select.int,
              aten.unbind.int, aten.slice.Tensor, aten.narrow.default, aten.split.Tensor,
              aten.split_with_sizes.default, aten.chunk.default)


SPLITS = (aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          aten.slice.Tensor, aten.narrow.default)


def split_pieces(op: OpInfo) -> tuple[int, list[tuple[int, int]]] | None:
    """``(dim, [(start, end), ...])``: the pieces of its input's dim a split, chunk, narrow or
    (step 1) slice takes, in global elements; None for a strided slice."""
    t, x = op.target, op.inputs[0]
    if t == aten.narrow.default:
        dim = norm_dim(arg(op, 1, "dim"), x.ndim)
        start = arg(op, 2, "start")
        start = start % x.shape[dim] if start < 0 else start
        return dim, [(start, start + arg(op, 3, "length"))]
    if t == aten.slice.Tensor:
        dim = norm_dim(arg(op, 1, "dim", 0), x.ndim)
        if arg(op, 4, "step", 1) != 1:
            return None
        n = x.shape[dim]
        start, end = arg(op, 2, "start"), arg(op, 3, "end")
        start, end = (0 if start is None else start), (n if end is None else end)
        start, end = (min(max(v + n if v < 0 else v, 0), n) for v in (start, end))
        return dim, [(start, max(start, end))]
    dim = norm_dim(arg(op, 2, "dim", 0), x.ndim)
    sizes = [o.shape[dim] for o in op.outputs]
    bounds = [0]
    for size in sizes:
        bounds.append(bounds[-1] + size)
    return dim, list(zip(bounds, bounds[1:]))


def _group_bounds(groups: tuple[int, ...], size: int) -> list[tuple[int, int]]:
    out, lo = [], 0
    for g in Shard(0, groups).group_sizes(size):
        out.append((lo, lo + g))
        lo += g
    return out


def _strided_split_options(op: OpInfo) -> list[Option]:
    """A split whose pieces are the groups of its strided input (ir.py ``Shard``): each piece
    comes out sharded contiguously, each rank taking its own part of every group (Megatron's
    Q, K, V of a fused projection). No data moves."""
    if op.target not in SPLITS:
        return []
    x = op.inputs[0]
    found = split_pieces(op)
    groups = dict(x.groups).get(found[0]) if found else None
    if not groups or not set(found[1]) <= set(_group_bounds(groups, x.shape[found[0]])):
        return []
    return [((Shard(found[0], groups),), tuple(Shard(found[0]) for _ in op.outputs))]


def split_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                   args: tuple, kwargs: dict) -> tuple:
    """The op unchanged, unless its input is sharded on the dim it splits (strided, each piece
    a group): then sizes and offsets shrink to the local ones, the shard factor times smaller."""
    found = split_pieces(op)
    if found is None:       # a strided slice: no rule shards the dim it slices
        return op.target, args, kwargs
    dim, pieces = found
    f = shard_factor(strategy.inputs[0], dim, mesh_shape)
    if f == 1:
        return op.target, args, kwargs
    t, args = op.target, list(args)
    if t == aten.split.Tensor:
        args[1] //= f
    elif t == aten.split_with_sizes.default:
        args[1] = [size // f for size in args[1]]
    elif t in (aten.slice.Tensor, aten.narrow.default):
        (start, end), = pieces
        if t == aten.narrow.default:
            args[2:4] = [start // f, (end - start) // f]
        else:
            args = [args[0], dim, start // f, end // f] + args[4:]
            kwargs = {k: v for k, v in kwargs.items() if k not in ("dim", "start", "end")}
    return t, tuple(args), kwargs


def dim_map_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    return expand(op, mesh_shape, mapped_options(op, [dim_map(op)]) + _linear(op)
                  + _strided_split_options(op))


def cat_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    ins = op.inputs
    ndim = max(t.ndim for t in ins)
    if op.target == aten.stack.default:
        dim = norm_dim(arg(op, 1, "dim", 0), ndim + 1)
        maps = [{d: d + (d >= dim) for d in range(t.ndim)} for t in ins]
    else:
        dim = norm_dim(arg(op, 1, "dim", 0), ndim)
        # a legacy 1-D empty operand takes no part; it stays replicated
        maps = [{d: d for d in range(t.ndim) if d != dim} if t.ndim == ndim else {} for t in ins]
    opts = mapped_options(op, maps)
    if all(is_float(t) for t in ins):
        opts.append((tuple(P for _ in ins), (P,)))
    return expand(op, mesh_shape, opts)


def broadcast_tensors_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    out_nd = op.outputs[0].ndim
    maps = [{d: d + out_nd - t.ndim for d in range(t.ndim)} for t in op.inputs]
    opts = mapped_options(op, maps)
    if all(is_float(t) for t in op.inputs):
        opts.append((tuple(P for _ in op.inputs), tuple(P for _ in op.outputs)))
    return expand(op, mesh_shape, opts)


def whole_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """Inputs and outputs whole on every rank: ``meshgrid`` (BEiT and Swin build their relative
    position index from a grid of two ``arange``s, a few hundred elements)."""
    return expand(op, mesh_shape, [])


_VIEW = dict(family=VIEW, saves=NOTHING, flops=per_output_element)
register_op(aten.meshgrid.default, aten.meshgrid.indexing, strategies=whole_strategy,
            follows=NO, localize=plain_localize, **_VIEW)
register_op(*RESHAPES, strategies=reshape_strategy, follows=INPUT, localize=reshape_localize, **_VIEW)
# (reshape, not view: a rank's local tensor may come from a collective with other strides)
for _as, _target, _strategies in ((aten.reshape_as.default, aten.reshape.default,
                                   reshape_strategy),
                                  (aten.expand_as.default, aten.expand.default, expand_strategy)):
    register_op(_as, follows=NO, strategies=_as_other(_target, _strategies),
                localize=_to_local_shape_of_output(_target), **_VIEW)
register_op(aten.flatten.using_ints, strategies=reshape_strategy, follows=NO,
            localize=plain_localize, **_VIEW)
register_op(aten.unflatten.int, strategies=reshape_strategy, follows=NO,
            localize=unflatten_localize, **_VIEW)
register_op(aten.expand.default, strategies=expand_strategy, follows=INPUT,
            localize=expand_localize, **_VIEW)
register_op(aten.squeeze.dim, aten.squeeze.default, strategies=dim_map_strategy, follows=INPUT,
            localize=squeeze_localize, **_VIEW)
register_op(aten.squeeze.dims, strategies=dim_map_strategy, follows=NO,
            localize=squeeze_localize, **_VIEW)
register_op(aten.permute.default, aten.transpose.int, aten.t.default, aten.numpy_T.default,
            *MATRIX_T, *COMPLEX_VIEWS, aten.unsqueeze.default,
            strategies=dim_map_strategy, follows=INPUT, localize=plain_localize, **_VIEW)
register_op(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
            strategies=dim_map_strategy, follows=INPUT, localize=split_localize, **_VIEW)
register_op(aten.select.int, aten.unbind.int,
            strategies=dim_map_strategy, follows=NO, localize=plain_localize, **_VIEW)
register_op(aten.slice.Tensor, aten.narrow.default,
            strategies=dim_map_strategy, follows=NO, localize=split_localize, **_VIEW)
# A part's or an expansion's gradient is a new input-sized tensor (a slice's is zeros with the
# slice written in; an expand's is summed back down).
amend(aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.expand.default,
      aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int,
      grad=WIDENS)
register_op(aten.cat.default, aten.concat.default, strategies=cat_strategy, family=ELEMENTWISE,
            saves=NOTHING, follows=LARGEST, flops=per_output_element, localize=plain_localize)
register_op(aten.stack.default, strategies=cat_strategy, family=ELEMENTWISE, saves=NOTHING,
            follows=NO, flops=per_output_element, localize=plain_localize)
register_op(aten.broadcast_tensors.default, strategies=broadcast_tensors_strategy,
            family=ELEMENTWISE, saves=all_inputs, follows=NO, flops=per_output_element,
            localize=plain_localize)
