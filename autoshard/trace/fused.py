"""Fused dims: the tensor dims a model later splits into groups, marked for strided sharding.

A fused projection computes Q, K and V (or gate and up) with one weight and splits its output
into the groups: GPT-2's ``c_attn`` output ``.split(h, dim=2)``, Phi-3's ``qkv_proj`` output
sliced at ``[:q], [q:q+kv], [q+kv:]``, its ``gate_up_proj`` output ``.chunk(2, -1)``. Sharding
the weight contiguously hands a rank part of Q and part of K; splitting then needs all-to-alls.
Megatron shards such a weight so that each rank holds its part of every group (Shoeybi et al.
2019, arXiv 1909.08053, §3; DTensor's ``_StridedShard``): a strided shard (ir.py ``Shard``).

This pass finds the groups: each split, chunk, narrow or slice of a dim cuts it at some points;
all the cuts made on one value's dim give its groups (as relative sizes); so does a view of the
dim as ``(k, heads, head_dim)`` whose k dim is later unbound or split in k (a fused QKV viewed
``[b, s, 3, heads, head_dim]``, as timm and many hand-written models do). The groups are then
carried back against the data flow to the dims they came from, through every op whose rule maps
the split dim one to one to an input dim of the same size (a view keeping the dim whole, an
elementwise op, a bias add, the free dim of a matmul, a transpose, a cast): exactly the dims
along which element ``i`` of the output is made from element ``i`` of the input. Only marks that
reach a parameter are kept: a strided layout pays off where it spares moving a weight's output,
and the marks widen the search (ops/registry.py ``strided_variants``) only there.

The marks live in ``node.meta[GROUPS]`` as ``{output index: ((dim, groups), ...)}`` and reach
the rules as ``TensorInfo.groups`` (trace/export.py ``op_info``).
"""
from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from autoshard.ir import Shard, TensorInfo, op_info as make_op_info
from autoshard.ops._common import arg, norm_dim
from autoshard.ops.registry import strategies_for
from autoshard.ops.view import (DIM_MAPPED, RESHAPES, SPLITS, dim_map, group_views,
                                split_pieces)
from autoshard.trace.graph import ValueRef, output_infos, value_inputs

aten = torch.ops.aten
GROUPS = "autoshard_groups"
VIEWS = RESHAPES + (aten.unflatten.int,)

Mark = tuple[ValueRef, int]          # (value, dim)


def _info(node: fx.Node):
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    return make_op_info(node.target, args, kwargs, node.meta.get("val"))


def _cuts(graph: fx.Graph) -> dict[Mark, tuple[int, ...]]:
    """Every (value, dim) some split cuts into two or more pieces, with its groups."""
    points: dict[Mark, set[int]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in SPLITS:
            continue
        found = split_pieces(_info(node))
        if found is None:
            continue
        dim, pieces = found
        size = output_infos(node.args[0])[0].shape[dim]
        points.setdefault((value_inputs(node)[0], dim), {0, size}).update(
            p for lo, hi in pieces for p in (lo, hi))
    for node in graph.nodes:         # a fused dim viewed as (k, ...), the k dim then split
        if node.op != "call_function" or node.target not in VIEWS:
            continue
        for dim, kdim, k in group_views(_info(node)):
            if _split_later(node, kdim, k):
                mark = (value_inputs(node)[0], dim)
                size = output_infos(node.args[0])[0].shape[dim]
                points.setdefault(mark, {0, size}).update(size * j // k for j in range(k))
    out = {}
    for mark, cut in points.items():
        bounds = sorted(cut)
        widths = [b - a for a, b in zip(bounds, bounds[1:]) if b > a]
        if len(widths) >= 2:
            g = math.gcd(*widths)
            out[mark] = tuple(w // g for w in widths)
    return out


def _split_later(node: fx.Node, dim: int, k: int, depth: int = 4) -> bool:
    """Whether ``node``'s output dim ``dim`` (of size k) is unbound, selected from or cut into
    its k pieces, after at most ``depth`` permutes, transposes and the like."""
    for user in node.users:
        t = user.target
        if user.op != "call_function" or t not in DIM_MAPPED:   # (DIM_MAPPED: splits too)
            continue
        info = _info(user)
        if t in (aten.unbind.int, aten.select.int):
            if norm_dim(arg(info, 1, "dim", 0), info.inputs[0].ndim) == dim:
                return True
        elif t in SPLITS:
            found = split_pieces(info)
            if found and found[0] == dim and len(found[1]) == k:
                return True
        elif depth:
            moved = dim_map(info).get(dim)
            if moved is not None and _split_later(user, moved, k, depth - 1):
                return True
    return False


def _sources(node: fx.Node, out: int, dim: int, size: int) -> list[Mark]:
    """The input dims that element ``i`` of ``node``'s output ``out`` along ``dim`` is made
    from, one to one: those the op's rule shards alongside it (on a 2-device axis)."""
    info = _info(node)
    found: set[Mark] = set()
    refs = value_inputs(node)
    want = (Shard(dim),)
    for st in strategies_for(info, (2,)):
        if st.kernel is not None or st.outputs[out] != want:
            continue
        for k, spec in enumerate(st.inputs):
            if spec is not None and isinstance(spec[0], Shard) and k < len(refs) \
                    and info.inputs[k].shape[spec[0].dim] == size:
                found.add((refs[k], spec[0].dim))
    return sorted(found)


def mark_fused_dims(gm: fx.GraphModule, params: set[str]) -> None:
    """Mark (``node.meta[GROUPS]``) every dim a model splits into groups, and the dims back to
    a parameter (``params``: placeholder names) it comes from."""
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    marks = _cuts(graph)
    parents: dict[Mark, list[Mark]] = {}
    todo = list(marks)
    while todo:
        mark = todo.pop()
        (name, out), dim = mark
        node = by_name[name]
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        size = output_infos(node)[out].shape[dim]
        for src in _sources(node, out, dim, size):
            parents.setdefault(mark, []).append(src)
            if src not in marks:
                marks[src] = marks[mark]
                todo.append(src)
    # keep the marks from which a parameter is reached
    kept: set[Mark] = {m for m in marks if m[0][0] in params}
    grew = True
    while grew:
        grew = False
        for mark, srcs in parents.items():
            if mark not in kept and any(s in kept and marks[s] == marks[mark] for s in srcs):
                kept.add(mark)
                grew = True
    for node in graph.nodes:
        node.meta.pop(GROUPS, None)
    for ((name, out), dim) in sorted(kept):
        per_out = by_name[name].meta.setdefault(GROUPS, {})
        per_out[out] = tuple(sorted(per_out.get(out, ()) + ((dim, marks[((name, out), dim)]),)))


def marked_info(node: fx.Node, out: int = 0) -> TensorInfo:
    """Output ``out`` of ``node`` as a TensorInfo with its marks."""
    info = output_infos(node)[out]
    groups = node.meta.get(GROUPS, {}).get(out, ())
    return TensorInfo(info.shape, info.dtype, groups) if groups else info
