"""The most expensive collectives of a plan's ledger (``--top``), each repeated collective of
identical layers folded into one row, with the node, layer and source line behind it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir import Phase
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.plans.summary import ranges
from autoshard.tools.explain.rebuild import Rebuilt, Source, node_source, plan_mesh


@dataclass(frozen=True)
class TopCollective:
    """One collective of the ledger, or the same collective of identical layers folded: its
    seconds each (alpha-beta on the plan's mesh, times its ``count`` per step on a pipeline) and
    in total over ``instances``."""

    kind: str
    axes: tuple[str, ...]
    phase: Phase
    bytes: int
    seconds_each: float
    instances: int
    node: str              # the node that needs it (the first layer's, when folded)
    op: str
    value: str             # the node whose output moves
    layers: str            # "layers 0-31", or "" outside the repeated layers
    members: tuple[str, ...] = ()     # a gradient bucket's parameters
    source: Source | None = None
    stage: int = -1                   # on a pipeline, the stage whose ranks run it (-1: all)
    module: str = ""                  # the node's module path (from the re-trace)

    @property
    def seconds(self) -> float:
        return self.seconds_each * self.instances

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axes": list(self.axes), "phase": self.phase,
                "bytes": self.bytes, "seconds_each": self.seconds_each,
                "instances": self.instances, "seconds": self.seconds, "node": self.node,
                "op": self.op, "value": self.value, "layers": self.layers,
                "members": list(self.members), "stage": self.stage, "module": self.module,
                "source": self.source.to_json() if self.source else None}


def check_top(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AutoshardError("a number of collectives >= 1", got=repr(n), fix="e.g. --top 10")


def top_collectives(plan: Plan, n: int, *, rebuilt: Rebuilt | None = None,
                    cluster: str | None = None) -> list[TopCollective]:
    """The ``n`` most expensive collectives of ``plan`` by seconds per step, a collective
    repeated by identical layers folded into one entry (the seconds of all of them); source
    lines when ``rebuilt`` is given."""
    check_top(n)
    mesh = rebuilt.mesh if rebuilt is not None else plan_mesh(plan, cluster)
    where = _layer_positions(plan)
    groups: dict[tuple, list] = {}
    for c in plan.collectives:
        w = where.get(c.node) or where.get(c.value)     # the optimizer's: its parameter's layer
        base = w[1] if w else None
        key = (c.phase, c.kind, c.axes, c.bytes, c.count, c.stage, c.members or None,
               _relative(where, c.node, base), _relative(where, c.value, base))
        groups.setdefault(key, []).append((c, w))
    graph = {x.name: x for x in rebuilt.traced.graph.nodes} if rebuilt is not None else {}
    fqns = {p.name: p.fqn for p in rebuilt.traced.placeholders} if rebuilt is not None else {}
    ops = {x.name: x.op for x in plan.nodes}
    out = []
    for members in groups.values():
        c, w = members[0]
        if c.members:
            ws = [where[m] for m in c.members if m in where]
            layers = f"{ws[0][0]} {ranges(x[1] for x in ws)}" if ws else ""
        else:
            numbers = [x[1] for _, x in members if x]
            layers = f"{w[0]} {ranges(numbers)}" if w else ""
        out.append(TopCollective(
            c.kind, c.axes, c.phase, c.bytes, _seconds(c, mesh) * c.count, len(members),
            c.node, ops.get(c.node, ""), fqns.get(c.value, c.value), layers,
            tuple(fqns.get(m, m) for m in c.members), node_source(graph.get(c.node)),
            c.stage, rebuilt.traced.module_of(graph[c.node]) if c.node in graph else ""))
    out.sort(key=lambda t: -t.seconds)
    return out[:n]


def ledger_seconds(plan: Plan, mesh: Mesh) -> float:
    """Every collective of the plan's ledger per step, by alpha-beta on its axis."""
    return sum(_seconds(c, mesh) * c.count for c in plan.collectives)


def _seconds(c: Any, mesh: Mesh) -> float:
    """One run of collective ``c``: alpha-beta on its axis (docs/cost-model.md §1)."""
    from autoshard.cost.comm import link_time
    if len(c.axes) != 1 or c.axes[0] not in mesh.axes:
        raise AutoshardError(f"collectives over one axis of the plan's mesh {mesh.axes}",
                             got=f"{c.kind} over {list(c.axes)} for {c.node}",
                             fix="re-plan: the plan file was edited or is damaged")
    a = mesh.axes.index(c.axes[0])
    return link_time(mesh.links[a], c.kind, mesh.shape[a], c.bytes)


def _layer_positions(plan: Plan) -> dict[str, tuple[str, int, int, str]]:
    """node -> (container, block number, position in its layer, the first identical layer)."""
    out = {}
    for layer in plan.layers:
        container, _, number = layer.name.rpartition(".")
        for pos, name in enumerate(layer.nodes):
            out.setdefault(name, (container, int(number), pos, layer.same_as))
    return out


def _relative(where: dict, name: str, base: int | None) -> Any:
    """Equal for the same node of identical layers (relative to block ``base``)."""
    w = where.get(name)
    if w is None:
        return name
    return (w[3], w[1] - (w[1] if base is None else base), w[2])
