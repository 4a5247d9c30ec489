"""Graph helpers shared by trace/ and the passes above it: shapes of values, how nodes read them.

A *value* is one tensor a node makes, ``(node name, output index)``; a getitem on a multi-output
node is that node's i-th output, not a node of its own.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from autoshard.ir import TensorInfo

ValueRef = tuple[str, int]


def tensor_info(val: Any) -> TensorInfo | None:
    if isinstance(val, torch.Tensor):
        return TensorInfo(tuple(int(s) for s in val.shape), val.dtype)
    return None


def flat_values(node: fx.Node) -> list:
    """The traced values a node makes, flattened; a lone tensor skips pytree's walk, which the
    pricing and liveness walks paid for every node of every plan they priced."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [val]
    return torch.utils._pytree.tree_flatten(val)[0]


def output_infos(node: fx.Node) -> tuple[TensorInfo, ...]:
    return tuple(t for t in (tensor_info(v) for v in flat_values(node)) if t is not None)


def first_reads(nodes) -> dict[str, int]:
    """Each node's name -> the position in ``nodes`` of the first node that reads its value:
    forward's order of first use (a parameter read first has its gradient last in backward)."""
    out: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for ref in value_inputs(n):
            out.setdefault(ref[0], i)
    return out


def value_inputs(node: fx.Node) -> list[ValueRef]:
    """The values a node reads, in the order rules number tensor inputs.

    Pricing asks this of every node several times on each pricing of a plan; the answer is kept
    on the node, an attribute of its own (not in ``meta``, which copies of the node share),
    beside the very ``args``/``kwargs`` objects it was read from, so a pass that rewrites a
    node's arguments (which assigns new ones) is never answered from a stale entry."""
    kept = getattr(node, _VALUE_INPUTS, None)
    if kept is not None and kept[0] is node.args and kept[1] is node.kwargs:
        return list(kept[2])
    flat, _ = torch.utils._pytree.tree_flatten((node.args, node.kwargs))
    refs = tuple(value_ref(a) for a in flat if isinstance(a, fx.Node))
    setattr(node, _VALUE_INPUTS, (node.args, node.kwargs, refs))
    return list(refs)


_VALUE_INPUTS = "_autoshard_value_inputs"


def value_ref(node: fx.Node) -> ValueRef:
    """getitem on a multi-output node is that node's i-th output, not a node of its own."""
    if node.op == "call_function" and node.target is operator.getitem:
        src, idx = node.args
        return (src.name, int(idx))
    return (node.name, 0)


def value_shapes(graph: fx.Graph) -> dict[ValueRef, tuple[tuple[int, ...], int]]:
    """(global shape, itemsize) of every value a node makes."""
    out = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "call_function") and n.target is not operator.getitem:
            for i, ti in enumerate(output_infos(n)):
                out[(n.name, i)] = (ti.shape, ti.dtype.itemsize)
    return out
