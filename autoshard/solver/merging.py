"""One plan with given techniques (checkpointing, offload) on any mesh: a 1- or 2-axis mesh is
one ILP (solver/solve.py); a 3-axis mesh is searched over the groupings of its axes, merged or
each on its own (docs/design.md, "The ILP")."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any


from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, Strategy, work_fraction
from autoshard.mesh import AxisMerge, Merges, Mesh
from autoshard.options import PlanOptions, resolve_options
from autoshard.plans import Plan
from autoshard.solver.build import BuildTimeout
from autoshard.solver.descent import NOTE as DESCENT_NOTE
from autoshard.solver.ilp import Infeasible
from autoshard.trace.export import TracedGraph
from autoshard.solver.assemble import assemble
from autoshard.solver.search import Tried, Try, records_searches, run_search
from autoshard.solver.solve import check_mesh_fits, forced_offload, grouped, solve_on


def plan_once(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *, model_name: str,
                 fixed: dict[str, Strategy] | None, trace_s: float,
                 merge: AxisMerge | None, recompute: dict[str, str], offload: OffloadLevel,
                 cutoff_s: float | None = None, least_exact: bool = True, binds: bool = False,
                 stop_if_binds: bool = False, whole_limit: bool = False) -> Plan:
    """One plan of ``traced`` with these techniques; ``cutoff_s``: only a plan faster than that
    is wanted (the ILP prunes by it, in a quarter of the time limit; :class:`NoBetter` when it
    finds none; 2-D meshes); ``least_exact=False``: a refusal may name a lower bound of the
    least memory instead of the exact figure; ``binds``, ``stop_if_binds``, ``whole_limit``: as
    solve.py ``solve_on`` takes them (2-D meshes)."""
    check_mesh_fits(traced, mesh)
    traced = grouped(traced, recompute)
    if mesh.ndim >= 3:
        return _plan_by_merging(traced, mesh, options, model_name=model_name, fixed=fixed,
                                trace_s=trace_s, recompute=recompute, offload=offload)
    return solve_on(traced, mesh, options, model_name=model_name, fixed=fixed, trace_s=trace_s,
                  merge=merge, recompute=recompute, offload=offload, cutoff_s=cutoff_s,
                  least_exact=least_exact, binds=binds, stop_if_binds=stop_if_binds,
                  whole_limit=whole_limit)


def partitions(n: int) -> list[Merges]:
    """Every grouping of ``n`` axes (set partitions), each group ascending, groups in order of
    their first axis: groups of adjacent axes first, then the others, every axis alone last
    (the first of equally fast plans is kept)."""
    out: list[list[list[int]]] = [[]]
    for a in range(n):
        out = [[*p[:i], [*g, a], *p[i + 1:]] for p in out for i, g in enumerate(p)] + \
              [[*p, [a]] for p in out]
    groups = [tuple(sorted(tuple(g) for g in p)) for p in out]

    def order(p: Merges) -> tuple:
        apart = any(g[-1] - g[0] + 1 != len(g) for g in p)
        return len(p) == n, apart, -len(p), -len(p[0])

    return sorted(groups, key=order)


@records_searches
def plan_merged(traced: TracedGraph, mesh: Mesh, merges: Merges,
                options: PlanOptions | None = None, *, model_name: str = "",
                **overrides: Any) -> Plan:
    """One candidate of the 3-axis search: the plan of ``traced`` on ``mesh`` with each group of
    ``merges`` acting as one axis, its collectives one over the group's joint process group
    (docs/cost-model.md §1.4). ``merges`` lists every axis once, e.g. ``((0, 2), (1,))``."""
    if options is None:
        overrides = {"training": traced.training, **overrides}
    options = resolve_options(options, overrides)
    merge = AxisMerge(mesh, tuple(tuple(g) for g in merges))
    if all(len(g) == 1 for g in merge.merges):
        raise AutoshardError("a grouping that merges two or more axes", got=repr(merges),
                             fix="plan_traced plans with every axis on its own")
    check_mesh_fits(traced, mesh)
    plan = _plan_merged(traced, mesh, options, merge, fixed=None, model_name=model_name,
                        trace_s=0.0, recompute={}, offload=forced_offload(options))
    assert plan is not None                  # only pinned layouts can refuse a merge
    return plan


# A grouping of a 3-axis mesh's axes changes which tensor dims can split over which devices,
# not how many devices share the work: the least memory of the plans with every axis merged into
# one is within a few percent of the other groupings' (Llama-3-70B on 2x2x2, each grouping's
# least memory as ``plan_merged`` reports it). Beyond this multiple of the budget, none of them
# fits either.
OUT_OF_REACH = 1.25


def _plan_by_merging(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                     fixed: dict[str, Strategy] | None, model_name: str, trace_s: float,
                     recompute: dict[str, str], offload: OffloadLevel) -> Plan:
    # Every axis merged into one is the quickest problem (a 1-D mesh): solved first, it tells
    # when memory is far out of reach for every grouping, which then need not be tried.
    whole = (tuple(range(mesh.ndim)),)
    try:
        probe: Plan | None | AutoshardError = _plan_merged(
            traced, mesh, options, AxisMerge(mesh, whole), fixed=fixed, model_name=model_name,
            trace_s=trace_s, recompute=recompute, offload=offload)
    except AutoshardError as e:
        probe = e
        far = e.__cause__ if isinstance(e.__cause__, Infeasible) else None
        if far is not None and far.least_memory > OUT_OF_REACH * far.budget:
            raise AutoshardError(e.expected, got=f"{e.got} with the mesh's axes merged into one "
                                 f"(more than {OUT_OF_REACH:g}x the budget: the other groupings "
                                 f"of its axes, which split the same devices, were not tried)",
                                 fix=e.fix) from far
    solved: dict[Merges, Plan] = {}

    def solve(t: Try) -> Plan | None:
        merges = t.get("merged_axes")
        if not t.get("joint"):      # the grouping's layouts, priced one axis at a time
            joint = solved.get(merges)
            return _one_axis_at_a_time(traced, mesh, options, joint) \
                if joint is not None and joint.joint_axes else None
        if merges == whole:
            if isinstance(probe, AutoshardError):
                raise probe
            plan = probe
        elif all(len(g) == 1 for g in merges):
            plan = _plan_every_subset(traced, mesh, options, fixed=fixed, model_name=model_name,
                                      trace_s=trace_s, recompute=recompute, offload=offload)
        else:
            plan = _plan_merged(traced, mesh, options, AxisMerge(mesh, merges), fixed=fixed,
                                model_name=model_name, trace_s=trace_s, recompute=recompute,
                                offload=offload)
        if plan is not None:
            solved[merges] = plan
        return plan                 # None: pinned layouts that differ on merged axes

    best, done = run_search("axis groupings", grouping_tries(mesh), solve, facts=_facts)
    if best is None:
        raise AutoshardError("pinned layouts that keep some mesh axes alike", got=str(fixed),
                             fix="pin equal placements on two mesh axes")
    alone = next((d for d in done if len(d.attempt.get("merged_axes")) == mesh.ndim
                  and (d.result is not None or d.error is not None)), None)
    note = _fallback_note(alone, best, options) if alone is not None else ""
    return replace(best, warnings=(*best.warnings, *([note] if note else [])))


def grouping_tries(mesh: Mesh) -> list[Try]:
    """The 3-axis search's tries: every grouping of the axes (:func:`partitions`; every axis on
    its own only when each has 2 or more devices), each solved with its groups' collectives
    over their joint process groups, then the same layouts priced one axis at a time."""
    every = min(mesh.shape) > 1
    out = []
    for merges in partitions(mesh.ndim):
        if all(len(g) == 1 for g in merges) and not every:
            continue
        name = "+".join(",".join(mesh.axes[a] for a in g) for g in merges)
        out += [Try(f"axes grouped as {name}", (("merged_axes", merges), ("joint", True)),
                    announce=False),
                Try(f"axes grouped as {name}, one axis at a time",
                    (("merged_axes", merges), ("joint", False)), announce=False)]
    return out


def _facts(p: Plan) -> dict[str, Any]:
    """A grouping's record beside its step: whether its plan's collectives run over joint
    groups, and how its solve went."""
    return {"joint": bool(p.joint_axes), "status": p.solver["status"], "gap": p.solver["gap"]}


def _one_axis_at_a_time(traced: TracedGraph, mesh: Mesh, options: PlanOptions,
                        plan: Plan) -> Plan:
    """``plan``'s layouts with every collective over one axis (docs/cost-model.md §1.2). The
    merged ILP priced a merged axis's collectives as one over its joint group; on equal links
    a joint all-gather costs more latency than one per axis, a joint all-reduce fewer bytes
    (§1.4), so the search prices the same layouts both ways."""
    p = assemble(traced, mesh, plan.strategies(), options, solver=dict(plan.solver),
                 model_name=plan.model, timings=dict(plan.timings),
                 recompute=dict(plan.recompute))
    note = "layouts solved with axes merged, their collectives then priced one axis at a time"
    return replace(p, solver={**p.solver, "objective": p.predicted.step_time_s,
                              "note": "; ".join(filter(None, [p.solver.get("note"), note]))})


def _fallback_note(alone: Tried, best: Plan, options: PlanOptions) -> str:
    """What the plan says when the search over every subset of axes did not finish within the
    time limit (no plan, or one the solver could not prove best) and a merged plan was kept."""
    if alone.result is None:
        why = f"gave no plan ({alone.error.got})"
    elif alone.result.solver.get("note", "").startswith(DESCENT_NOTE):
        return ""          # found by descent (solver/descent.py), as its own record says
    elif alone.result.solver["status"] != "OPTIMAL" and len(best.solver["merged_axes"]) < len(
            alone.attempt.get("merged_axes")):
        why = f"stopped at the time limit {alone.result.solver['gap']:.1%} from its bound"
    else:
        return ""
    return (f"the search over every subset of mesh axes for each tensor dim {why}; solver time "
            f"limit {options.time_limit_s:g} s: the plan is the best with axes merged "
            f"(solver.merged_axes)")


def _plan_every_subset(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                       fixed: dict[str, Strategy] | None, model_name: str, trace_s: float,
                       recompute: dict[str, str], offload: OffloadLevel) -> Plan:
    """The problem on the real 3-axis mesh, built within the solver's time limit and solved
    within it (an incumbent found by then is kept, with its gap)."""
    limit = options.time_limit_s
    t0 = time.perf_counter()
    try:
        with progress.step("every subset of axes for each tensor dim"):
            plan = solve_on(traced, mesh, options, model_name=model_name, fixed=fixed,
                          trace_s=trace_s, merge=None, recompute=recompute, offload=offload,
                          deadline=t0 + limit)
    except BuildTimeout as e:
        raise AutoshardError("a problem over every subset of axes built within the solver's "
                             "time limit, with time left to solve it",
                             got=f"building it took {time.perf_counter() - t0:.3g} s of the "
                                 f"time limit of {limit:g} s",
                             fix="raise time_limit_s (--time-limit)") from e
    return replace(plan, solver={**plan.solver,
                                 "merged_axes": [[a] for a in range(mesh.ndim)]})


def _plan_merged(traced: TracedGraph, mesh: Mesh, options: PlanOptions, merge: AxisMerge, *,
                 fixed: dict[str, Strategy] | None, model_name: str, trace_s: float,
                 recompute: dict[str, str], offload: OffloadLevel) -> Plan | None:
    """The plan with ``merge``'s groups of axes acting as one, on the real mesh; None when a
    pinned layout differs on the axes of a group."""
    pins = {}
    for name, st in (fixed or {}).items():
        outs = tuple(merge.contract_spec(o) for o in st.outputs)
        if any(o is None for o in outs):
            return None
        axes = None if st.state_axes is None else _contract_axes(merge, st.state_axes)
        if axes == ():
            return None
        pins[name] = Strategy((), outs, st.kernel, state_axes=axes)
    with progress.step(f"axes merged as ({','.join(merge.merged().axes)})"):
        sub = plan_once(traced, merge.merged(), options, fixed=pins or None, merge=merge,
                           model_name=model_name, trace_s=trace_s, recompute=recompute,
                           offload=offload)
    strategies = {}
    for n in sub.nodes:
        ins = tuple(merge.expand_spec(x) for x in n.inputs)
        outs = tuple(merge.expand_spec(x) for x in n.outputs)
        axes = None if n.state_axes is None else \
            tuple(sorted(merge.expand_axes(frozenset(n.state_axes))))
        strategies[n.name] = Strategy(ins, outs, n.kernel, work_fraction(ins, outs, mesh.shape),
                                      axes)
    return assemble(traced, mesh, strategies, options,
                    solver={**sub.solver, "merged_axes": [list(g) for g in merge.merges]},
                    model_name=model_name, timings=sub.timings, recompute=recompute,
                    joint=merge.joint())


def _contract_axes(merge: AxisMerge, axes: tuple[int, ...]) -> tuple[int, ...]:
    """Real state axes as merged ones: () where they split a merged group."""
    out = tuple(g for g, real in enumerate(merge.merges) if set(real) <= set(axes))
    return out if {a for g in out for a in merge.merges[g]} == set(axes) else ()
