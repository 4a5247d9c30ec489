"""A plan's graph as its node signatures record it (docs/plan-format.md): which values each node
reads and the shape of each value. Read by the plan's own checks on load (plans.py) and by the
PyTorch export (export.py); it reads a Plan by its fields, so it imports nothing above the IR."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir import Spec

Value = tuple[str, int]          # (node name, output index)


_REF = re.compile(r"'%(\w+)'")
_SHAPES = re.compile(r" \[((?:\(\[[0-9, ]*\], '[\w.]+'\)(?:, )?)*)\]$")
_SHAPE = re.compile(r"\(\[([0-9, ]*)\], '[\w.]+'\)")
_GETITEM = re.compile(r"^call_function getitem \(\('%(\w+)', (\d+)\)")


@dataclass(frozen=True)
class Graph:
    """The plan's graph as its node signatures record it (docs/plan-format.md): which values
    each node reads, in the order its ``inputs`` specs are listed, and the shape of each value.
    A getitem is the i-th output of the node it reads, as everywhere in autoshard."""

    nodes: dict[str, Any]              # name -> plans.records.NodePlan
    reads: dict[str, tuple[Value, ...]]
    users: dict[Value, tuple[tuple[str, int], ...]]     # value -> (reader, input index)
    shapes: dict[Value, tuple[int, ...]]
    param_node: dict[str, str]                          # parameter fqn -> its placeholder

    def spec_in(self, node: str, index: int) -> Spec | None:
        ins = self.nodes[node].inputs
        return ins[index] if index < len(ins) else None

    def spec_out(self, value: Value) -> Spec | None:
        outs = self.nodes[value[0]].outputs
        return outs[value[1]] if value[1] < len(outs) else None

    def rank(self, value: Value) -> int:
        return len(self.shapes.get(value, ()))


def graph_of(plan: Any) -> Graph:
    """Read the wiring and shapes out of ``plan.node_sigs``."""
    if not plan.node_sigs:
        raise AutoshardError("a plan that records its node signatures (the graph's wiring)",
                             got="a plan without node_signatures",
                             fix="re-create the plan with `autoshard plan ... -o plan.json`")
    nodes = {n.name: n for n in plan.nodes}
    alias: dict[str, Value] = {}
    for name, sig in plan.node_sigs.items():
        m = _GETITEM.match(sig)
        if m:
            alias[name] = (m.group(1), int(m.group(2)))
    reads: dict[str, tuple[Value, ...]] = {}
    shapes: dict[Value, tuple[int, ...]] = {}
    for name in nodes:
        sig = plan.node_sigs.get(name, "")
        m = _SHAPES.search(sig)
        head = sig[:m.start()] if m else sig
        for i, s in enumerate(_SHAPE.findall(m.group(1)) if m else []):
            shapes[(name, i)] = tuple(int(x) for x in s.split(",") if x.strip())
        reads[name] = tuple(alias.get(r, (r, 0)) for r in _REF.findall(head))
    users: dict[Value, list[tuple[str, int]]] = {}
    for name, vals in reads.items():
        for i, v in enumerate(vals):
            users.setdefault(v, []).append((name, i))
    return Graph(nodes, reads, {v: tuple(u) for v, u in users.items()}, shapes,
                 _param_nodes(plan, nodes))


def _param_nodes(plan: Any, nodes: dict[str, Any]) -> dict[str, str]:
    """Each parameter's placeholder: torch.export names it ``p_`` + its path with every other
    character an underscore, under the loss wrapper's ``model.`` when the planner added one."""
    out = {}
    for fqn in plan.params:
        flat = re.sub(r"[^0-9a-zA-Z_]", "_", fqn)
        for name in (f"p_{flat}", f"p_model_{flat}"):
            if nodes.get(name) is not None and nodes[name].op == "placeholder":
                out[fqn] = name
                break
    return out
