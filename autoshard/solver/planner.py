"""trace -> build problem (with cost) -> ILP -> Plan."""
from __future__ import annotations

import operator
import time
from typing import Any, Sequence

import torch

from autoshard.cost.comm import reshard_time
from autoshard.cost.compute import op_time
from autoshard.errors import AutoshardError
from autoshard.ir import Strategy, shard_factor
from autoshard.lowering import reshard_edges
from autoshard.mesh import Mesh
from autoshard.plans import CollectiveRecord, NodePlan, Plan
from autoshard.solver.build import Built, build_problem
from autoshard.solver.ilp import Infeasible, solve
from autoshard.solver.problem import Solution
from autoshard.trace.export import TracedGraph, trace


def check_mesh_fits(traced: TracedGraph, mesh: Mesh) -> None:
    """A mesh larger than every dimension of the problem can only replicate: say so."""
    dims = [d for p in traced.placeholders if p.info is not None for d in p.info.shape]
    if mesh.size > 1 and not any(d % n == 0 and d >= n for d in dims for n in mesh.shape if n > 1):
        raise AutoshardError(
            f"a mesh whose axes divide some tensor dimension of the model (mesh {mesh.shape})",
            got=f"no parameter or input dimension divisible by any axis; dims seen: "
                f"{sorted(set(dims))[:12]}",
            fix="use a smaller mesh, or a larger batch/model")


def plan(model: torch.nn.Module, example_inputs: Sequence[Any], mesh: Mesh, *,
         training: bool = True, memory_budget: float | None = None, time_limit_s: float = 20.0,
         optimizer: str = "adam", model_name: str = "") -> Plan:
    """Choose a sharding for every op of ``model(*example_inputs)`` on ``mesh``."""
    if not isinstance(mesh, Mesh):
        raise AutoshardError("mesh is an autoshard.Mesh", got=type(mesh).__name__,
                             fix="autoshard.Mesh((8, 8), ('dp', 'tp'), cluster='h100')")
    t0 = time.perf_counter()
    traced = trace(model, example_inputs, training=training)
    return plan_traced(traced, mesh, memory_budget=memory_budget, time_limit_s=time_limit_s,
                       optimizer=optimizer, model_name=model_name, trace_s=time.perf_counter() - t0)


def plan_traced(traced: TracedGraph, mesh: Mesh, *, memory_budget: float | None = None,
                time_limit_s: float = 20.0, optimizer: str = "adam", model_name: str = "",
                fixed: dict[str, Strategy] | None = None, trace_s: float = 0.0) -> Plan:
    check_mesh_fits(traced, mesh)
    t0 = time.perf_counter()
    built = build_problem(traced, mesh, memory_budget=memory_budget, optimizer=optimizer)
    problem = built.problem
    if fixed:
        problem = _with_fixed(built, fixed)
    build_s = time.perf_counter() - t0
    try:
        sol = solve(problem, time_limit_s=time_limit_s)
    except Infeasible as e:
        raise AutoshardError(
            f"a plan within the memory budget of {problem.memory_budget / 2**30:.2f} GiB per device",
            got=f"none fits; the least memory any plan needs is {e.least_memory / 2**30:.2f} GiB "
                "per device", fix="raise memory_budget, use a larger mesh, or a smaller batch") from e
    return assemble(traced, mesh, built, sol, model_name=model_name,
                    timings={"trace_s": trace_s, "build_s": build_s})


def _with_fixed(built: Built, fixed: dict[str, Strategy]):
    from dataclasses import replace
    pins = []
    for name, strat in fixed.items():
        m = built.members[built.rep[name]]
        assert m.pick == list(range(len(m.pick))), f"can only pin a group's root: {name}"
        if strat not in m.strategies:
            raise AutoshardError(f"a strategy {name} supports", got=str(strat),
                                 fix=f"choose among {[str(s) for s in m.strategies][:6]}...")
        pins.append((m.group, m.strategies.index(strat)))
    return replace(built.problem, fixed=tuple(sorted(set(pins))))


def assemble(traced: TracedGraph, mesh: Mesh, built: Built, sol: Solution, *, model_name: str,
             timings: dict[str, float]) -> Plan:
    graph = traced.graph
    nodes = [n for n in graph.nodes if n.op == "placeholder"
             or (n.op == "call_function" and n.target is not operator.getitem)]
    strategies = {n.name: built.strategy_of(n.name, sol.choice) for n in nodes}
    params = {p.name: p.fqn for p in traced.params}
    compute_s = memory = 0.0
    member_cost: dict[tuple[str, int], tuple[float, float]] = {}
    for n in nodes:
        r = built.rep[n.name]
        m = built.members[r]
        key = (r, m.pick[sol.choice[m.group]])
        if key not in member_cost:
            s = strategies[n.name]
            c = op_time(built.infos[r], s, mesh, training=traced.training) if n.op != "placeholder" else 0.0
            member_cost[key] = (c, _memory_of(built, r, sol.choice))
        compute_s += member_cost[key][0]
        memory += member_cost[key][1]
    collectives: list[CollectiveRecord] = []
    comm_s = 0.0
    for e in reshard_edges(graph, strategies, mesh.shape, built.shapes, set(params),
                           training=traced.training):
        comm_s += reshard_time(e.reshard, mesh)
        node = e.consumers[0][0]
        for phase, step in e.reshard.collectives:
            if phase == "backward" and e.from_param:
                phase = "grad_sync"
            collectives.append(CollectiveRecord(step.kind, (mesh.axes[step.axis],), step.nbytes,
                                                phase, node, e.value[0]))
    node_plans = tuple(NodePlan(n.name, _op_name(n), strategies[n.name].inputs,
                                strategies[n.name].outputs, strategies[n.name].kernel)
                       for n in nodes)
    return Plan(
        mesh_shape=mesh.shape, mesh_axes=mesh.axes, cluster=mesh.cluster.name,
        fingerprint=traced.fingerprint, training=traced.training, nodes=node_plans,
        params={params[n]: strategies[n].outputs[0] for n in params},
        inputs={p.fqn: strategies[p.name].outputs[0] for p in traced.inputs},
        collectives=tuple(collectives),
        predicted={"step_time_s": compute_s + comm_s, "compute_s": compute_s, "comm_s": comm_s,
                   "peak_memory_bytes": memory},
        solver={"status": sol.status, "objective": sol.objective, "gap": sol.gap,
                "variables": sol.variables, "seconds": sol.seconds,
                "groups": len(built.problem.groups), **timings},
        model=model_name, node_sigs=traced.node_sigs)


def _memory_of(built: Built, rep: str, choice: tuple[int, ...]) -> float:
    # Recomputed per template node through the group: the group's memory is the sum of its
    # members', so price members one by one with the builder's figures kept on the Built.
    return built.member_memory[rep][built.members[rep].pick[choice[built.members[rep].group]]]


def _op_name(n) -> str:
    return "placeholder" if n.op == "placeholder" else str(n.target)
