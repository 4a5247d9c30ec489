"""One ILP on one mesh: built (solver/build.py), solved (solver/ilp.py) with the obvious plans
as starts, its ties broken toward the layouts a user expects, and assembled; the errors that say
why no plan was found."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch.fx as fx

from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, Phase, Replicate, StateMode, Strategy
from autoshard.mesh import AxisMerge, Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.cost.memory import budget_for
from autoshard.solver.build import BuildTimeout, Built, build_problem
from autoshard.solver.descent import descend, solve_by_axes
from autoshard.solver.ilp import BOUNDED_VARIABLES, Infeasible, NoSolution, mip_size, solve, \
    solve_held
from autoshard.solver.deadline import MIN_PART_S, Deadline
from autoshard.solver.ties import break_ties
from autoshard.solver.problem import Problem, Solution
from autoshard.solver.diagnostics import gib, unruled_note
from autoshard.solver.starts import axis_keys, descent_starts, obvious_starts
from autoshard.trace.export import TracedGraph
from autoshard.trace.graph import output_infos, value_ref
from autoshard.trace.layers import regroup
from autoshard.solver.assemble import assemble


class BudgetError(AutoshardError):
    """No plan fits the memory budget. ``least_bytes``: the least ``memory_budget`` a plan found
    needs (cost/memory.py ``budget_for`` of its step's peak, cost/liveness.py), or where the ILP
    found none within the budget, of the least sum the ILP bounds (a lower bound on any plan's
    peak); ``phase``: where that peak is reached ("forward", "backward", "optimizer"; None for
    the ILP's sum)."""

    def __init__(self, expected: str, *, got: str, fix: str, least_bytes: float,
                 phase: Phase | None) -> None:
        super().__init__(expected, got=got, fix=fix)
        self.least_bytes, self.phase = float(least_bytes), phase


def model_dims(traced: TracedGraph) -> set[int]:
    """Every dimension of the model's parameters, buffers and inputs: what a mesh axis can
    split."""
    return {d for p in traced.placeholders if p.info is not None for d in p.info.shape}


def splits_some(dims: set[int], n: int) -> bool:
    """Whether an axis of ``n`` devices can split one of ``dims`` (:func:`model_dims`)."""
    return any(d % n == 0 and d >= n for d in dims)


def check_mesh_fits(traced: TracedGraph, mesh: Mesh) -> None:
    """A mesh larger than every dimension of the problem can only replicate: say so."""
    dims = model_dims(traced)
    if mesh.size > 1 and not any(splits_some(dims, n) for n in mesh.shape if n > 1):
        raise AutoshardError(
            f"a mesh whose axes divide some tensor dimension of the model (mesh {mesh.shape})",
            got=f"no parameter or input dimension divisible by any axis; dims seen: "
                f"{sorted(dims)[:12]}",
            fix="use a smaller mesh, or a larger batch/model")


def grouped(traced: TracedGraph, recompute: dict[str, str]) -> TracedGraph:
    """``traced`` with its identical layers grouped apart by policy where ``recompute`` mixes
    policies in a group (trace/layers.py ``regroup``)."""
    layers = regroup(traced.layers, recompute)
    return traced if layers == traced.layers else replace(traced, layers=layers)


def repriced(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan,
             strategies: dict[str, Strategy], recompute: dict[str, str]) -> Plan:
    """``strategies`` priced as a plan under ``options`` and ``recompute``, nothing solved
    again, with ``plan``'s solver record (the passes after the ILP: solver/offload_split.py,
    the planner's notes)."""
    return assemble(grouped(traced, recompute), mesh, strategies, options,
                    solver=dict(plan.solver), model_name=plan.model,
                    timings=dict(plan.timings), recompute=dict(recompute),
                    joint=plan.joint_groups())


def forced_offload(options: PlanOptions) -> OffloadLevel:
    """The offload level ``options.offload`` forces (see :func:`offload_level`), else none."""
    return OffloadLevel.NONE if options.offload == OffloadLevel.AUTO else options.offload


def offload_level(plan: Plan) -> OffloadLevel:
    """How far offload went in ``plan`` (the ``offload`` argument that plans it again with
    the same state modes offered): "parameters" where a parameter is kept on the host,
    "optimizer" where only optimizer state is, else "none"."""
    modes = {st.mode for st in plan.param_state.values()}
    if StateMode.OFFLOAD_PARAMS in modes or plan.options.offload == OffloadLevel.PARAMETERS:
        return OffloadLevel.PARAMETERS
    if StateMode.OFFLOAD in modes or plan.options.offload == OffloadLevel.OPTIMIZER:
        return OffloadLevel.OPTIMIZER
    return OffloadLevel.NONE


def solve_on(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *, model_name: str,
           fixed: dict[str, Strategy] | None, trace_s: float, merge: AxisMerge | None,
           recompute: dict[str, str], offload: OffloadLevel, deadline: float | None = None,
           cutoff_s: float | None = None, least_exact: bool = True, binds: bool = False,
           stop_if_binds: bool = False, whole_limit: bool = False) -> Plan:
    """One ILP on ``mesh`` (every axis its own, whatever its number), solved and assembled.
    ``deadline`` (``time.perf_counter()`` seconds): building and solving share the time up to it
    (BuildTimeout if building runs past it), and a solve without an incumbent by then raises
    at once (the caller has other plans). ``least_exact=False``: a budget below every decision's
    least memory is refused with that sum as the least memory ("at least"), not the exact figure
    a MIP would take up to the time limit to find (ilp.py ``solve``). ``binds`` and
    ``stop_if_binds`` (MemoryBinds): as ilp.py ``solve`` takes them. ``whole_limit``: the cutoff
    only prunes a solve that is no gamble (the rung the checkpointing search bounded first,
    solver/budget.py), which keeps the whole time limit."""
    t0 = time.perf_counter()
    in_place = frozenset(p.name for p in traced.params if p.name in (fixed or {}))
    with progress.step(f"building the ILP on mesh {'x'.join(map(str, mesh.shape))} "
                       f"({','.join(mesh.axes)})"):
        built = build_problem(traced, mesh, options, in_place=in_place, merge=merge,
                              recompute=recompute, offload=offload, deadline=deadline)
    problem = built.problem
    if fixed:
        problem = _with_fixed(built, fixed)
    build_s = time.perf_counter() - t0
    by_axes = deadline is not None and not fixed and _by_axes(problem)
    if deadline is not None and deadline - time.perf_counter() < (
            MIN_PART_S if by_axes else build_s):
        # As one MIP, solving took longer than building on every 3-axis problem measured
        # (gpt2-tiny, llama-tiny: 1.2x to 2.3x): less time than that left cannot give a plan.
        # By descent, the merged mesh's start and its first steps are small MIPs.
        raise BuildTimeout()
    try:
        with progress.step(f"solving ({len(problem.decisions)} decisions)"):
            # A try that must beat a plan in hand is a gamble: a quarter of the time limit.
            limit = options.time_limit_s if cutoff_s is None or whole_limit else \
                options.time_limit_s / 4
            if deadline is not None:
                limit = max(MIN_PART_S, deadline - time.perf_counter())
            # Never worse than the obvious plans (solver/starts.py); a pinned problem is a
            # baseline's own, and a deadline leaves no time for them.
            starts = () if fixed or deadline is not None else \
                (lambda: obvious_starts(traced, mesh, built))
            if by_axes:
                sol = _solve_by_axes(built, mesh, problem, Deadline(time.perf_counter(), deadline))
            else:
                sol = solve(problem, time_limit_s=limit, cutoff_s=cutoff_s, starts=starts,
                            verdict=deadline is None, highs_first=options.stage_run is not None,
                            least_exact=least_exact, binds=binds, stop_if_binds=stop_if_binds)
    except Infeasible as e:
        least = f"{'' if e.exact else 'at least '}{gib(budget_for(e.least_memory))}"
        if e.least_host is not None:
            raise AutoshardError(
                f"a plan within the memory budget of {gib(budget_for(e.budget))} per device and "
                f"the host memory of {gib(e.host_budget)} per device (cluster field host_memory_bytes)",
                got=f"none fits both: the plans that fit the device keep parameters, gradients "
                    f"or optimizer state on the host, at least {gib(e.least_host)} per device"
                    f"{unruled_note(traced)}",
                fix="use a larger mesh or a smaller batch, or a cluster profile with more host "
                    "memory per device (host_memory_bytes)") from e
        raise BudgetError(
            f"a plan within the memory budget of {gib(budget_for(e.budget))} per device",
            got=f"none fits; the least memory any plan needs is {least} per device"
                f"{unruled_note(traced)}",
            fix="raise memory_budget, use a larger mesh, or a smaller batch",
            least_bytes=budget_for(e.least_memory), phase=None) from e
    except NoSolution as e:
        raise AutoshardError(
            "a plan found within the solver's time limit",
            got=f"none after {e.time_limit_s:.3g} s (solver status {e.status}, best bound "
                f"{e.bound * 1e3:.4g} ms per step)"
                + ("; the memory budget is not the cause" if deadline is None else ""),
            fix="raise time_limit_s (--time-limit), or use a mesh with fewer axes") from e
    if sol.status == "FEASIBLE" and not fixed and deadline is None and mesh.ndim > 1:
        sol = _polished(built, mesh, problem, sol, options.time_limit_s * POLISH_SHARE)
    progress.note(f"{sol.status}: {sol.objective * 1e3:.3f} ms per step")
    return solved_plan(traced, mesh, options, built, problem, sol, model_name=model_name,
                       timings={"trace_s": trace_s, "build_s": build_s, "solve_s": sol.seconds},
                       recompute=recompute)[0]


def _by_axes(problem: Problem) -> bool:
    """Whether a problem over every subset of a 3-axis mesh's axes is solved by descent over
    its axes (solver/descent.py): a MIP this large no backend solves whole within a time limit
    of seconds; smaller ones the MIP settles, to a proven optimum."""
    return mip_size(problem) >= BOUNDED_VARIABLES


def _solve_by_axes(built: Built, mesh: Mesh, problem: Problem, deadline: Deadline) -> Solution:
    sol = solve_by_axes(problem, axis_keys(built, mesh), descent_starts(built, mesh), deadline,
                        solve_held)
    if sol is None:
        raise NoSolution(deadline.limit_s, -1)
    return sol


# Of the time limit, what a plan the solver stopped short of proving may take to improve one
# mesh axis at a time (:func:`_polished`).
POLISH_SHARE = 0.25


def _polished(built: Built, mesh: Mesh, problem: Problem, sol: Solution, limit_s: float
              ) -> Solution:
    """``sol`` improved one mesh axis free at a time, the others held (solver/descent.py),
    where that is faster: on Jamba-8l's 8x8 problem the solver's 77.6 ms plan at its time limit
    descends to 66.7 ms (the optimum, 61.3 ms, takes it 30 s)."""
    deadline = Deadline.after(limit_s)
    with progress.step("improving it one mesh axis at a time"):
        _, choice, step = descend(problem, axis_keys(built, mesh),
                                  ("", sol.choice, sol.objective), deadline, solve_held)
    if step >= sol.objective:
        return sol
    note = "then improved one mesh axis at a time (solver/descent.py)"
    return replace(sol, choice=choice, objective=step, bound=min(sol.bound, step),
                   seconds=sol.seconds + time.perf_counter() - deadline.t0,
                   note=f"{sol.note}; {note}" if sol.note else f"the solver's plan, {note}")


def solved_plan(traced: TracedGraph, mesh: Mesh, options: PlanOptions, built: Built,
                problem: Problem, sol: Solution, *, model_name: str,
                timings: dict[str, float], recompute: dict[str, str] | None = None,
                **record: Any) -> tuple[Plan, tuple[int, ...]]:
    """The Plan of a solution of ``problem`` (``built``'s, with the caller's pins and cuts),
    and its choice: ties broken toward the layouts a user expects (:func:`storage_preferences`)
    within those pins and cuts, assembled and priced as every plan is. ``record``: more fields
    of the plan's solver record (an alternative's label)."""
    choice = break_ties(problem, sol.choice, storage_preferences(traced, built))
    choice = break_ties(problem, choice, reading_as_it_lies(traced, built, choice))
    strategies = {name: built.strategy_of(name, choice) for name in built.template}
    solver = {"status": sol.status, "objective": sol.objective, "gap": sol.gap,
              "variables": sol.variables, "decisions": len(built.problem.decisions),
              **({"note": sol.note} if sol.note else {}),
              **({"start": sol.start} if sol.start else {}), **record}
    return assemble(traced, mesh, strategies, options, solver=solver, model_name=model_name,
                    timings=timings, recompute=recompute), choice


def storage_preferences(traced: TracedGraph, built: Built) -> dict[int, list[int]]:
    """Each parameter's decision with its layouts, fewest sharded mesh axes first: among equally
    fast plans, weights stay replicated (plain data parallelism, one gradient all-reduce) unless
    sharding them buys time or is needed to fit memory."""
    out = {}
    for p in traced.params:
        m = built.members.get(p.name)
        if m is None:
            continue                         # a repeated layer's copy: its template decides
        sharded = [sum(not isinstance(x, Replicate) for x in m.strategies[j].outputs[0])
                   for j in m.index]
        out[m.decision] = sorted(range(len(sharded)), key=lambda i: (sharded[i], i))
    return out


def reading_as_it_lies(traced: TracedGraph, built: Built, choice: tuple[int, ...]
                       ) -> dict[int, list[int]]:
    """Each decision of a check with no output (``aten._assert_tensor_metadata``: export
    writes one beside each ``.to``) with the layouts reading its input as ``choice`` lays it
    out first. Every layout a check reads costs the same, and one read through a reshard of
    local steps (priced 0: a slice, or a partial's zeros on every rank but the first) would
    still run that reshard in the rank program (under Megatron, at each layer's first norm)."""
    out = {}
    for n in traced.graph.nodes:
        if n.op != "call_function" or n.users or output_infos(n) or not n.args \
                or not isinstance(n.args[0], fx.Node):
            continue
        m = built.members.get(n.name)
        if m is None or m.index != list(range(len(m.index))):
            continue                # (a copy of a repeated layer's, or a follower: as its own)
        src, k = value_ref(n.args[0])
        if src not in built.template:
            continue
        lies = built.strategy_of(src, choice).outputs[k]
        out[m.decision] = sorted(range(len(m.strategies)),
                                 key=lambda i: (m.strategies[i].inputs[:1] != (lies,), i))
    return out


def _with_fixed(built: Built, fixed: dict[str, Strategy]):
    pins = []
    for name, strat in fixed.items():
        m = built.members[built.template[name]]
        if name in built.tied_to:
            continue                 # a tied weight's later name: its first name's pin decides
        assert m.index == list(range(len(m.index))), f"can only pin a decision's root: {name}"
        if strat not in m.strategies and strat.kernel is None:
            # A pinned parameter layout with no state mode: the first mode the options allow.
            strat = next((s for s in m.strategies if s.outputs == strat.outputs), strat)
        if strat not in m.strategies:
            raise AutoshardError(f"a strategy {name} supports", got=str(strat),
                                 fix=f"choose among {[str(s) for s in m.strategies][:6]}...")
        pins.append((m.decision, m.strategies.index(strat)))
    return replace(built.problem, fixed=tuple(sorted(set(pins))))

