"""Sequence dims: the tensor dims that carry an attention's sequence, marked for the causal
load-balanced layout of context parallelism.

Attention may shard its query sequence over a mesh axis in the zigzag layout (ir.py ``ZIGZAG``,
ops/attention.py): rank ``r`` of ``n`` holds chunks ``r`` and ``2n-1-r``. Every op before and
after it that works position by position (the projections, norms, RoPE's products, the MLP, the
head, the loss over the rows) can then keep the sequence in that layout, so nothing moves between
them: context parallelism shards every activation along the sequence, as Llama 3 (arXiv
2407.21783 §3.3) and torchtitan's context parallel do. Those ops are offered the layout as a
strided variant of their contiguous sequence shards (ops/registry.py ``strided_variants``),
which needs the dims marked, as trace/fused.py marks fused dims.

This pass seeds each attention op that may shard its sequence (``context_parallel_ok``) with
its queries', keys', values' and output's sequence dim, and spreads the mark to every dim its
ops shard alongside one to one (the dims a kernel-less strategy on a 2-device axis shards
together, of the same size): through the projections back to the embedding and the input ids,
through RoPE's products to the cos/sin tables, forward through the residual stream to the
logits and the loss's rows and targets. The marks join trace/fused.py's in ``node.meta[GROUPS]``.
"""
from __future__ import annotations

import operator
from collections import defaultdict

import torch.fx as fx

from autoshard.ir import ZIGZAG, Shard, Strategy
from autoshard.ops.attention import SDPA, context_parallel_ok
from autoshard.ops.registry import record_of, strategies_for
from autoshard.trace.fused import GROUPS, _info
from autoshard.trace.graph import ValueRef, output_infos, value_inputs

Mark = tuple[ValueRef, int]          # (value, dim)


def _spread(tensors: list[tuple[ValueRef, tuple[int, ...]]], n_in: int, mark: Mark, size: int,
            strategies: list[Strategy], memo: dict) -> list[Mark]:
    """The dims a node shards alongside ``mark`` (one of its inputs or outputs), one to one.
    ``tensors``: its ``n_in`` inputs then its outputs, each (value, shape); ``memo``: answers by
    position for these ``strategies`` (identical layers ask the same question)."""
    hits = tuple(i for i, (ref, _) in enumerate(tensors) if ref == mark[0])
    key = (id(strategies), hits, mark[1], size)
    if key not in memo:
        found: list[tuple[int, int]] = []
        for st in strategies:
            if st.kernel is not None:
                continue
            specs = [*st.inputs[:n_in], *st.outputs]
            if not any(specs[i] == (Shard(mark[1]),) for i in hits if i < len(specs)):
                continue
            for i, ((_, shape), spec) in enumerate(zip(tensors, specs)):
                if spec is not None and isinstance(spec[0], Shard) and shape[spec[0].dim] == size:
                    found.append((i, spec[0].dim))
        memo[key] = found
    return [(tensors[i][0], dim) for i, dim in memo[key]]


def mark_sequence_dims(gm: fx.GraphModule) -> None:
    """Mark (``node.meta[GROUPS]``, as ``ZIGZAG``) every dim that carries the sequence of an
    attention op which may shard it, and every dim its neighbours shard alongside."""
    graph = gm.graph
    by_name = {n.name: n for n in graph.nodes}
    users: dict[ValueRef, list[fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op == "call_function" and node.target is not operator.getitem:
            for ref in value_inputs(node):
                users[ref].append(node)
    marks: dict[Mark, int] = {}
    todo: list[Mark] = []

    def add(mark: Mark, size: int) -> None:
        if mark not in marks:
            marks[mark] = size
            todo.append(mark)

    for node in graph.nodes:
        if node.op == "call_function" and node.target is SDPA \
                and context_parallel_ok(info := _info(node)):
            seq = info.inputs[0].ndim - 2
            for ref in value_inputs(node)[:3] + [(node.name, 0)]:
                add((ref, seq), info.inputs[0].shape[seq])
    tensors_of: dict[str, tuple[list, int, list[Strategy]]] = {}
    # Strategies by what the rule sees (repeated layers ask the same question once per layer).
    by_info: dict[str, list[Strategy]] = {}
    memo: dict = {}
    while todo:
        mark = todo.pop()
        (name, _), _dim = mark
        producer = by_name[name]
        for node in [producer] + users[mark[0]]:
            if node.op != "call_function" or node.target is operator.getitem \
                    or record_of(node.target).family == "attention":
                continue
            if node.name not in tensors_of:
                info, refs = _info(node), value_inputs(node)
                key = repr((info.target, info.args, info.kwargs, info.outputs))
                if key not in by_info:
                    by_info[key] = strategies_for(info, (2,))
                tensors = [(ref, t.shape) for ref, t in zip(refs, info.inputs)] + \
                    [((node.name, j), t.shape) for j, t in enumerate(output_infos(node))]
                tensors_of[node.name] = (tensors, len(refs), by_info[key])
            tensors, n_in, strategies = tensors_of[node.name]
            for found in _spread(tensors, n_in, mark, marks[mark], strategies, memo):
                add(found, marks[mark])
    for ((name, out), dim) in sorted(marks):
        per_out = by_name[name].meta.setdefault(GROUPS, {})
        if all(d != dim for d, _ in per_out.get(out, ())):
            per_out[out] = tuple(sorted(per_out.get(out, ()) + ((dim, ZIGZAG),)))
