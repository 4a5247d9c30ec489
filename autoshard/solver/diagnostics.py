"""What a plan should tell its user: whether it uses its mesh, and which ops have no rule.

A plan can leave devices repeating the same work: with a small batch
on a large mesh, every weight replicated, the ops of a mesh axis compute the same thing on every
device of it. The planner then says so, with the best plan on the smaller mesh that does the same
work, so that the user can give the devices to something else.

Compute per device is compared with the ideal share (the whole step's compute over the mesh's
devices). An axis is idle when almost none of the compute (by time) is split over it; the smaller
mesh drops the idle axes (all of them: one device) and keeps every other axis's links.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from autoshard.cost.price import Pricer
from autoshard.ir import Replicate, Strategy, work_fraction
from autoshard.mesh import Mesh
from autoshard.ops import modes as op_modes
from autoshard.ops.registry import RECORDS
from autoshard.trace.export import TracedGraph, module_path, op_info

# Compute per device this many times the ideal share, or more, is reported.
REDUNDANCY_REPORTED = 2.0
# An axis splitting less than this share of the compute (by time) counts as idle.
IDLE_SPLIT = 0.1


@dataclass(frozen=True, slots=True)
class MeshUse:
    redundancy: float              # compute per device / ideal share (1.0: no repeated work)
    split: tuple[float, ...]       # per axis, the share of compute (by time) split over it
    idle_axes: tuple[int, ...]

    @property
    def wasteful(self) -> bool:
        return self.redundancy >= REDUNDANCY_REPORTED and bool(self.idle_axes)


def mesh_use(pricer: Pricer, strategies: dict[str, Strategy]) -> MeshUse:
    mesh = pricer.mesh
    ops = [n.name for n in pricer.traced.graph.nodes
           if n.op == "call_function" and n.name in strategies]
    per_device = whole = 0.0
    split = [0.0] * mesh.ndim
    for name in ops:
        s = strategies[name]
        t = pricer.compute(name, s)
        per_device += t
        whole += pricer.compute(name, _replicated(s, mesh.ndim))
        for a, n in enumerate(mesh.shape):
            one_axis = tuple(n if b == a else 1 for b in range(mesh.ndim))
            if n > 1 and work_fraction(s.inputs, s.outputs, one_axis) < 1.0:
                split[a] += t
    if per_device <= 0 or whole <= 0:
        return MeshUse(1.0, tuple(1.0 for _ in mesh.shape), ())
    shares = tuple(x / per_device for x in split)
    idle = tuple(a for a, n in enumerate(mesh.shape) if n > 1 and shares[a] < IDLE_SPLIT)
    return MeshUse(per_device / (whole / mesh.size), shares, idle)


def smaller_mesh(mesh: Mesh, idle: tuple[int, ...]) -> Mesh:
    """``mesh`` without its idle axes, each kept axis on the links it had."""
    keep = [a for a in range(mesh.ndim) if a not in idle]
    if not keep:
        return Mesh((1,), (mesh.axes[0],), cluster=mesh.cluster)
    return Mesh(tuple(mesh.shape[a] for a in keep), tuple(mesh.axes[a] for a in keep), cluster=mesh.cluster,
                links=tuple(mesh.links[a] for a in keep))


def _replicated(s: Strategy, ndim: int) -> Strategy:
    r = (Replicate(),) * ndim
    return Strategy(tuple(None if x is None else r for x in s.inputs),
                    tuple(r for _ in s.outputs))


def unruled_ops(traced: TracedGraph) -> list[tuple[str, str, int]]:
    """Ops without a record, each with a module path it appears at and the bytes of the tensors
    it reads and writes, which every device then holds whole; largest first."""
    found: dict[str, tuple[str, int]] = {}
    for n in traced.graph.nodes:
        if n.op != "call_function" or n.target in RECORDS or n.target is operator.getitem:
            continue
        info = op_info(n)
        nbytes = sum(t.nbytes for t in (*info.inputs, *info.outputs))
        op = str(n.target)
        if nbytes > found.get(op, ("", -1))[1]:
            found[op] = (traced.module_of(n) or "(top level)", nbytes)
    return sorted(((op, where, b) for op, (where, b) in found.items()), key=lambda t: -t[2])


def unruled_note(traced: TracedGraph) -> str:
    ops = unruled_ops(traced)[:3]
    if not ops:
        return ""
    return ("; ops without a sharding rule keep their tensors whole on every device: "
            + ", ".join(f"{op} at {where} ({gib(b)})" for op, where, b in ops))


def grouped_experts_note(traced: TracedGraph) -> str:
    """A model whose experts run transformers' grouped path: a ``sort`` of every token-expert
    pair of the step, then a grouped matmul over the sorted rows (ops/moe.py), which keep the
    tokens whole on every device (docs/cost-model.md §12). Said, naming the first call and the
    conversion that runs each experts call as one op instead."""
    from autoshard.ops.moe import grouped_mm_ops
    calls = [n for n in traced.graph.nodes if n.op == "call_function"
             and n.target in grouped_mm_ops()]
    if not calls:
        return ""
    where = module_path(calls[0]) or calls[0].name
    return (f"the experts at {where} ({len(calls)} grouped matmuls in all) run transformers' "
            f"grouped path, whose sort over every token-expert pair of the step keeps the "
            f"tokens whole on every device; call autoshard.zoo.hf.route_experts_as_one_op(model) "
            f"on the transformers model before planning (from_config and config.json paths do): "
            f"experts of the kinds its op covers (docs/cost-model.md §12) then run as one op "
            f"whose tokens and experts the plan splits")


def gib(nbytes: float) -> str:
    # 4 significant digits: a small model's figure must not print as "0.00 GiB".
    return f"{nbytes / 2**30:.4g} GiB"


def microbatch_statistics_note(traced: TracedGraph, microbatches: int) -> str:
    """A pipeline runs each microbatch through the model on its own, so a batch norm in
    training normalises it by its own statistics (GPipe's micro-batches do too: Huang et al.
    2019), not by the whole batch's as one device does: said, naming the first."""
    norms = [n for n in traced.graph.nodes if n.op == "call_function"
             and n.target in op_modes.BATCH_NORMS and op_modes.trains(n.target, n.args, n.kwargs)]
    if microbatches == 1 or not norms:
        return ""
    return (f"batch norm at {module_path(norms[0]) or norms[0].name} ({len(norms)} in all) "
            f"normalises each of the {microbatches} microbatches by its own statistics, not the "
            f"whole batch's: the pipelined step differs from one device's (plan without a "
            f"pipeline, or with microbatches=1, for the same step)")
