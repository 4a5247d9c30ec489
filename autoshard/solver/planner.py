"""trace -> build problem (priced by cost/price.py) -> ILP -> Plan."""
from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Sequence

import torch

from autoshard import progress
from autoshard.cost.liveness import step_memory
from autoshard.cost.price import Pricer
from autoshard.cost.comm import Groups, Step, joint_groups, step_seconds
from autoshard.cost.overlap import bucket_collectives, exposed_seconds, sync_share_by_axis
from autoshard.cost.program import step_program
from autoshard.cost.compute import local_numel
from autoshard.cost.state import SCATTERS, StateBytes, state_spec
from autoshard.cost.reshards import direct_reads
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Strategy, work_fraction
from autoshard.mesh import AxisMerge, Merges, Mesh
from autoshard.options import PlanOptions, resolve_options
from autoshard.plans import Plan
from autoshard.plans.records import CollectiveRecord, HostTransfer, NodePlan, ParamState
from autoshard.cost.memory import budget_for, device_budget, host_budget
from autoshard.solver.build import BuildTimeout, Built, build_problem
from autoshard.solver.ilp import Infeasible, NoBetter, NoSolution, break_ties, solve
from autoshard.solver.problem import Problem, Solution
from autoshard.solver.diagnostics import gib, mesh_use, smaller_mesh, unruled_note
from autoshard.solver.starts import obvious_starts
from autoshard.trace.batches import Traces, batch_of, sliced
from autoshard.trace.export import TracedGraph
from autoshard.trace.layers import checkpointable, regroup


class BudgetError(AutoshardError):
    """No plan fits the memory budget. ``least_bytes``: the least ``memory_budget`` a plan found
    needs (cost/memory.py ``budget_for`` of its step's peak, cost/liveness.py), or where the ILP
    found none within the budget, of the least sum the ILP bounds (a lower bound on any plan's
    peak); ``phase``: where that peak is reached ("forward", "backward", "optimizer"; None for
    the ILP's sum)."""

    def __init__(self, expected: str, *, got: str, fix: str, least_bytes: float,
                 phase: str | None) -> None:
        super().__init__(expected, got=got, fix=fix)
        self.least_bytes, self.phase = float(least_bytes), phase


def check_mesh_fits(traced: TracedGraph, mesh: Mesh) -> None:
    """A mesh larger than every dimension of the problem can only replicate: say so."""
    dims = [d for p in traced.placeholders if p.info is not None for d in p.info.shape]
    if mesh.size > 1 and not any(d % n == 0 and d >= n for d in dims for n in mesh.shape if n > 1):
        raise AutoshardError(
            f"a mesh whose axes divide some tensor dimension of the model (mesh {mesh.shape})",
            got=f"no parameter or input dimension divisible by any axis; dims seen: "
                f"{sorted(set(dims))[:12]}",
            fix="use a smaller mesh, or a larger batch/model")


def plan(model: torch.nn.Module, example_inputs: Sequence[Any], mesh: Mesh,
         options: PlanOptions | None = None, *, model_name: str = "", **overrides: Any) -> Plan:
    """Choose a sharding for every op of ``model(*example_inputs)`` on ``mesh``.

    ``options`` (default :class:`PlanOptions()`) with any of its fields given as keywords, e.g.
    ``plan(model, inputs, mesh, training=False, memory_budget=40 * 2**30)``."""
    if not isinstance(mesh, Mesh):
        raise AutoshardError("mesh is an autoshard.Mesh", got=type(mesh).__name__,
                             fix="autoshard.Mesh((8, 8), ('dp', 'tp'), cluster='h100')")
    options = resolve_options(options, overrides)
    traces = Traces(model, example_inputs, training=options.training,
                    precision=options.precision)
    return plan_with(traces, mesh, options, model_name=model_name)


def plan_with(traces: Traces, mesh: Mesh, options: PlanOptions, *, model_name: str = "") -> Plan:
    """:func:`plan` with the model's graphs taken from ``traces``: the searches below (pipeline
    axis, microbatch count; solver/meshes.py's meshes) trace it at several batch sizes, and
    share one :class:`Traces` so that each batch is traced once, most by rebatching."""
    if options.pipeline == "auto":
        return _plan_pipeline_auto(traces, mesh, options, model_name)
    if options.pipeline is not None and options.microbatches == "auto":
        # Microbatch counts to try (docs/cost-model.md §10): p, 2p and 4p for p stages, those
        # that divide the batch; each traced and planned, the fastest kept.
        p = mesh.shape[mesh.axes.index(options.pipeline)] if options.pipeline in mesh.axes \
            else 1
        tries = [k * p for k in (1, 2, 4) if traces.full % (k * p) == 0]
        if not tries:
            raise AutoshardError(f"a batch that {p} pipeline stages can cut into {p}, {2 * p} "
                                 f"or {4 * p} microbatches", got=f"batch {traces.full}",
                                 fix="pass microbatches=<a divisor of the batch>")
        plans, errors = [], []
        for k in tries:          # fewer microbatches may not fit: more are in flight per stage
            try:
                with progress.step(f"{k} microbatches"):
                    plans.append(plan_with(traces, mesh, options.replace(microbatches=k),
                                           model_name=model_name))
            except AutoshardError as e:
                errors.append(e)
        if not plans:
            raise errors[-1]
        best = min(plans, key=lambda x: x.predicted["step_time_s"])
        return replace(best, options=options.replace(microbatches=best.pipeline.microbatches))
    batch = traces.full
    if options.pipeline is not None:    # the graph of one microbatch (trace_for)
        if not isinstance(options.microbatches, int):
            raise AutoshardError("a number of microbatches to trace one of", got="'auto'",
                                 fix="pass microbatches=<int> (autoshard.plan chooses 'auto')")
        if batch % options.microbatches:
            raise AutoshardError(f"a batch divisible by the {options.microbatches} microbatches",
                                 got=f"batch {batch}", fix="pass microbatches=<a divisor of it>")
        batch //= options.microbatches
    with progress.step(f"tracing {model_name or type(traces.model).__name__} (batch {batch})"):
        trace_s = traces.seconds_for(batch)
    return plan_traced(traces.at(batch), mesh, options, model_name=model_name, trace_s=trace_s)


def _plan_pipeline_auto(traces: Traces, mesh: Mesh, options: PlanOptions,
                        model_name: str) -> Plan:
    """Whether and on which axis to pipeline (docs/cost-model.md §10): the plan without a
    pipeline and one pipelined over each axis of 2 or more devices; the fastest kept, every
    try recorded in ``solver["pipeline_search"]`` (its step, or why it has no plan)."""
    tries: list[tuple[str | None, Plan | None, AutoshardError | None]] = []
    for axis in (None, *(a for a, n in zip(mesh.axes, mesh.shape) if n >= 2)):
        try:
            with progress.step(f"pipeline over {axis}" if axis else "without a pipeline"):
                opts = options.replace(pipeline=axis, **({} if axis else {"microbatches": "auto"}))
                tries.append((axis, plan_with(traces, mesh, opts, model_name=model_name), None))
        except AutoshardError as e:
            tries.append((axis, None, e))
    found = [(axis, p) for axis, p, _ in tries if p is not None]
    if not found:
        raise next(e for _, _, e in tries if e is not None)
    _, best = min(found, key=lambda ap: ap[1].predicted["step_time_s"])
    search = [{"pipeline": axis, "step_time_s": p.predicted["step_time_s"] if p else None,
               **({"microbatches": p.pipeline.microbatches} if p and p.pipeline else {}),
               **({"error": e.got} if e else {})} for axis, p, e in tries]
    return replace(best, solver={**best.solver, "pipeline_search": search})


def microbatch(example_inputs: Sequence[Any], microbatches: int) -> tuple:
    """The first of ``microbatches`` equal slices of the batch (the rows of every tensor input
    that has the batch dimension), as the planner traces and the runtime feeds one."""
    batch = batch_of(example_inputs)
    if batch % microbatches:
        raise AutoshardError(f"a batch divisible by the {microbatches} microbatches",
                             got=f"batch {batch}", fix="pass microbatches=<a divisor of it>")
    return sliced(example_inputs, batch // microbatches)


def trace_for(model: torch.nn.Module, example_inputs: Sequence[Any],
              options: PlanOptions) -> TracedGraph:
    """The graph the planner plans for ``options``: in their precision, and with a pipeline,
    of one microbatch (every stage runs its part of that graph once per microbatch)."""
    if options.pipeline is not None:
        if not isinstance(options.microbatches, int):
            raise AutoshardError("a number of microbatches to trace one of", got="'auto'",
                                 fix="pass microbatches=<int> (autoshard.plan chooses 'auto')")
        example_inputs = microbatch(example_inputs, options.microbatches)
    return Traces(model, example_inputs, training=options.training,
                  precision=options.precision).at(batch_of(example_inputs))


def plan_traced(traced: TracedGraph, mesh: Mesh, options: PlanOptions | None = None, *,
                model_name: str = "", fixed: dict[str, Strategy] | None = None,
                trace_s: float = 0.0, merge: AxisMerge | None = None, **overrides: Any) -> Plan:
    """Plan a traced graph. ``fixed`` pins the strategies of some nodes (a hand-written plan's
    parameter layouts); ``merge``: ``mesh`` merges axes of a real mesh (see below). A plan of the
    search (not pinned, not a merged sub-problem) says when it leaves devices repeating work."""
    if options is None:
        overrides = {"training": traced.training, **overrides}
    options = resolve_options(options, overrides)
    if options.training != traced.training:
        raise AutoshardError(f"options.training equal to the traced graph's ({traced.training})",
                             got=f"training={options.training}",
                             fix="trace with the same training flag the options ask for")
    if options.pipeline is None and options.microbatches != "auto":
        raise AutoshardError("microbatches only with a pipeline (the batch runs whole "
                             "otherwise)", got=f"microbatches={options.microbatches!r} and no "
                             "pipeline", fix="add pipeline='pp' (an axis of the mesh) or "
                             "'auto', or drop microbatches")
    if options.pipeline == "auto":
        raise AutoshardError("a pipeline axis or None to plan a traced graph",
                             got="pipeline='auto'",
                             fix="call autoshard.plan (or the CLI), which searches the axes")
    if options.pipeline is not None and options.offload == "parameters":
        raise AutoshardError("parameter offload without a pipeline (not built for pipeline "
                             "stages yet)", got=f"offload='parameters' and pipeline="
                             f"{options.pipeline!r}",
                             fix="drop the pipeline, or offload the optimizer only "
                                 "(offload='optimizer')")
    if options.pipeline is not None:
        # The graph is one microbatch's (trace_for); the stages' SPMD plan is this function's.
        from autoshard.solver.pipeline import plan_pipelined
        return plan_pipelined(traced, mesh, options, model_name=model_name, trace_s=trace_s,
                              plan_spmd=plan_traced)
    plan = _plan_memory(traced, mesh, options, model_name=model_name, fixed=fixed,
                        trace_s=trace_s, merge=merge)
    if fixed or merge is not None:
        return plan
    unruled = unruled_note(traced)
    notes = [*plan.warnings, *([unruled.removeprefix("; ")] if unruled else [])]
    if options.stage_run is None:     # (a pipeline's stages are held to it by their caller)
        plan = _fit_budget(traced, mesh, options, plan, model_name=model_name, trace_s=trace_s)
    notes += _mesh_use_note(traced, mesh, options, plan, model_name)
    return replace(plan, warnings=tuple(notes)) if notes else plan


def _plan_memory(traced: TracedGraph, mesh: Mesh, options: PlanOptions, **kw: Any) -> Plan:
    """Plan with the memory techniques ``options`` allows, cheapest first: parameter, gradient
    and optimizer-state sharding (ZeRO-1/2/3) are always in the search; activation
    checkpointing as :func:`_plan_recompute` decides; under offload "auto", optimizer offload
    only when no plan fits without it, and parameter offload (beside it) only when no plan fits
    with optimizer offload alone, since each costs host-link time. When nothing fits, the error
    names the least memory found and the techniques that were tried."""
    forced = forced_offload(options)
    ladder: list[bool | str] = [forced]
    if not forced and options.offload == "auto" and traced.training \
            and options.state_optimizer not in ("none", "sgd"):
        ladder += [True] + (["parameters"] if options.stage_run is None else [])
    for k, offload in enumerate(ladder):
        try:
            if k:
                what = "optimizer offload" if offload is True else "parameter offload"
                with progress.step(f"no plan fits: with {what}"):
                    plan = _plan_recompute(traced, mesh, options, offload=offload, **kw)
            else:
                plan = _plan_recompute(traced, mesh, options, offload=offload, **kw)
            break
        except AutoshardError as e:
            if not isinstance(e.__cause__, Infeasible) or k == len(ladder) - 1:
                raise _with_techniques(e, traced, options, offload)
    _check_host(plan, mesh)
    return plan


def forced_offload(options: PlanOptions) -> bool | str:
    """The offload level ``options.offload`` forces (see :func:`offload_level`), else False."""
    return {"optimizer": True, "parameters": "parameters"}.get(options.offload, False)


def offload_level(plan: Plan) -> bool | str:
    """How far offload went in ``plan`` (the ``offload`` argument that plans it again with
    the same state modes offered): "parameters" where a parameter is kept on the host, True
    where only optimizer state is, else False."""
    modes = {st.mode for st in plan.param_state.values()}
    if "offload_params" in modes or plan.options.offload == "parameters":
        return "parameters"
    return "offload" in modes or plan.options.offload == "optimizer"


def _with_techniques(e: AutoshardError, traced: TracedGraph, options: PlanOptions,
                     offload: bool | str) -> AutoshardError:
    if not isinstance(e.__cause__, Infeasible):
        return e
    tried = ["parameter sharding (ZeRO-3)"]
    if traced.training and options.state_optimizer not in ("none", "sgd"):
        tried.append({"auto": "ZeRO-2", "none": "", "zero1": "ZeRO-1",
                      "zero2": "ZeRO-2"}[options.zero])
    layers = checkpointable(traced.graph, traced.layers) if traced.training else []
    if layers and options.recompute != "none":
        tried.append(f"full activation checkpointing of its {len(layers)} repeated layers")
    if offload:
        tried.append("optimizer offload to the host")
    if offload == "parameters":
        tried.append("parameter offload to the host")
    fix = e.fix
    if not offload and traced.training and options.offload == "none":
        fix += ", or allow optimizer offload (offload='auto')"
    if layers and options.recompute == "none":
        fix += ", or allow activation checkpointing (recompute='auto')"
    got = f"{e.got}; techniques tried: {', '.join(t for t in tried if t)}"
    if isinstance(e, BudgetError):
        return BudgetError(e.expected, got=got, fix=fix, least_bytes=e.least_bytes,
                           phase=e.phase)
    return AutoshardError(e.expected, got=got, fix=fix)


def _check_host(plan: Plan, mesh: Mesh) -> None:
    host = plan.predicted.get("memory", {}).get("host", 0.0)
    if host > host_budget(mesh.cluster):
        raise AutoshardError(
            f"state offloaded within the host memory of one device "
            f"({gib(host_budget(mesh.cluster))}: the cluster field host_memory_bytes less a "
            f"process's own, cost/memory.py)",
            got=f"the plan offloads {gib(host)} per device",
            fix="use a larger mesh, or a cluster profile with more host memory per device")


BINDS = 0.9     # a plan above this fraction of the budget may be held back by it


def _plan_recompute(traced: TracedGraph, mesh: Mesh, options: PlanOptions, **kw: Any) -> Plan:
    """Plan with activation checkpointing as ``options.recompute`` says: "none", "selective" or
    "full" on every checkpointable layer. "auto": without it first; recomputing only adds time
    to the same layouts, so it is tried only when memory binds (no plan fits, or the plan fills
    the budget): selective and full, each kept if it is the fastest plan that fits (memory it
    frees can buy faster layouts)."""
    layers = checkpointable(traced.graph, traced.layers) if traced.training else []
    if not layers or options.recompute == "none":
        return _plan_traced(traced, mesh, options, recompute={}, **kw)
    if options.recompute in ("selective", "full"):
        return _plan_traced(traced, mesh, options,
                            recompute=dict.fromkeys(layers, options.recompute), **kw)
    budget = device_budget(mesh.cluster, options.memory_budget)
    plans: list[Plan] = []
    try:
        with progress.step("without activation checkpointing"):
            plans.append(_plan_traced(traced, mesh, options, recompute={}, **kw))
    except AutoshardError as e:
        # No plan fits, or none was found in time (memory that binds makes the ILP hard):
        # checkpointing frees memory either way.
        if not isinstance(e.__cause__, (Infeasible, NoSolution)):
            raise
        error = e
    # Memory binds when the plan comes near the budget: a layout the budget ruled out may be
    # faster with the memory checkpointing frees (a plan 1% under the budget can be one).
    if plans and plans[0].predicted["ilp_memory_bytes"] < budget * BINDS:
        return plans[0]
    # A plan that fits by liveness too is final unless checkpointing beats it: search only
    # faster ones (re-planning for the peak below never makes a plan faster).
    cutoff = plans[0].predicted["step_time_s"] if plans and \
        plans[0].predicted["memory"]["peak"] <= budget and mesh.ndim < 3 else None
    for policy in ("selective", "full"):
        try:
            with progress.step(f"activation checkpointing ({policy})"):
                plans.append(_plan_traced(traced, mesh, options, cutoff_s=cutoff,
                                          recompute=dict.fromkeys(layers, policy), **kw))
        except NoBetter:
            progress.note(f"no plan faster than {cutoff * 1e3:.3f} ms")
            continue
        except AutoshardError as e:
            if not isinstance(e.__cause__, (Infeasible, NoSolution)):
                raise
            error = e
            continue
        if policy == "selective" and plans[-1].predicted["ilp_memory_bytes"] < budget * 0.98 \
                and plans[-1].predicted["memory"]["peak"] <= budget:
            break    # memory no longer binds: full recomputation would only add time
    if not plans:
        raise error
    # Compared by the step's liveness peak too (a selective plan's can be twice the sum the ILP
    # bounds): each re-planned for it as plan_traced would, and the fastest that fits kept.
    # Fastest first: re-planning a plan for its peak never makes it faster, so once one fits,
    # a plan already slower than it needs no re-planning.
    fitting = None
    for p in sorted(plans, key=lambda p: p.predicted["step_time_s"]):
        if fitting is not None and p.predicted["step_time_s"] >= fitting.predicted["step_time_s"]:
            break
        fit = _fit_live(traced, mesh, options, p, budget, kw)
        if fit is not None and (fitting is None or fit.predicted["step_time_s"]
                                < fitting.predicted["step_time_s"]):
            fitting = fit
    if fitting is None:
        return min(plans, key=lambda p: p.predicted["step_time_s"])
    partial = _plan_partial(traced, mesh, options, fitting, layers, budget, **kw)
    return fitting if partial is None else partial


def _fit_live(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan, budget: float,
              kw: dict[str, Any]) -> Plan | None:
    """``plan`` if its liveness peak fits ``budget``, else :func:`_tighten`'s plan with the
    same techniques, if one fits; else None. Pinned or merged sub-problems are left to their
    caller."""
    if plan.predicted["memory"]["peak"] <= budget or kw.get("fixed") or kw.get("merge") is not None:
        return plan
    fit, _ = _tighten(traced, mesh, options, plan, budget, kw, kw.get("offload"))
    return fit


TIGHTEN = 6      # rounds of the outer loop per set of techniques (docs/cost-model.md §4.6)


def _tighten(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan, budget: float,
             kw: dict[str, Any], offload: bool | str | None = None
             ) -> tuple[Plan | None, list[Plan]]:
    """The outer loop that holds the step's peak to ``budget`` (docs/cost-model.md §4.6): the ILP
    bounds the sum of what forward saves and the model state, which lies below the liveness
    peak by what backward's gradients and the optimizer's temporaries add; so solve again with
    the ILP's bound lowered by the peak's excess, with ``plan``'s techniques, until the peak
    fits, the ILP finds no plan, or :data:`TIGHTEN` rounds are spent; ``offload``: the offload
    level offered (default: as far as ``plan`` went). The peak need not fall
    as fast as the sum (a 16-bit parameter the ILP moves off the device takes its fp32
    gradient copy out of the optimizer step too; a layout that saves less may gather more), so
    each round that leaves the peak above the budget doubles the next one's cut. (The plan that
    fits, or None; every plan solved on the way.)"""
    solved: list[Plan] = []
    p = plan
    offload = offload_level(plan) if offload is None else offload
    for k in range(TIGHTEN):
        live = p.predicted["memory"]["peak"]
        if live <= budget:
            return p, solved
        lower = p.predicted["ilp_memory_bytes"] - (live - budget) * 2**k
        if lower <= 0:
            break
        try:
            with progress.step(f"re-planning for the step's peak (ILP bound {gib(lower)})"):
                p = _plan_traced(traced, mesh, options.replace(memory_budget=lower),
                                 **{**kw, "offload": offload}, recompute=dict(p.recompute))
        except AutoshardError:
            break
        p = replace(p, options=options)
        solved.append(p)
    return (p if p.predicted["memory"]["peak"] <= budget else None), solved


def _fit_budget(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan, *,
                model_name: str, trace_s: float) -> Plan:
    """``plan``, or a plan whose step peaks within the memory budget, or a refusal: the budget
    is the step's peak over forward, backward and the optimizer step (cost/liveness.py). The
    plan's own techniques are tightened first (:func:`_tighten`); then the ones that lower the
    phase that binds: optimizer offload, then parameter offload, for an optimizer-step peak;
    full checkpointing for a forward or backward one (then offload too), as far as ``options``
    allows. None fits: an error naming the least peak found, and its phase."""
    budget = device_budget(mesh.cluster, options.memory_budget)
    if plan.predicted["memory"]["peak"] <= budget:
        return plan
    kw = {"model_name": model_name, "fixed": None, "trace_s": trace_s, "merge": None}
    fit, tried = _tighten(traced, mesh, options, plan, budget, kw)
    tried.append(plan)
    techniques = [_technique(plan.recompute, offload_level(plan))]
    for recompute, offload in _remedies(traced, options, plan):
        if fit is not None:
            break
        what = _technique(recompute, offload)
        techniques.append(what)
        try:
            with progress.step(f"the step peaks above the budget: with {what}"):
                p = _plan_traced(traced, mesh, options, **kw, recompute=recompute,
                                 offload=offload)
        except AutoshardError as e:
            if not (isinstance(e, BudgetError) or isinstance(e.__cause__, NoSolution)):
                raise
            continue
        fit, more = _tighten(traced, mesh, options, p, budget, kw, offload)
        tried += [p, *more]
    if fit is not None:
        return fit
    least = min(tried, key=lambda p: p.predicted["memory"]["peak"])
    need = budget_for(least.predicted["memory"]["peak"])
    raise BudgetError(
        f"a plan whose step peaks within the memory budget of {gib(budget_for(budget))} per "
        f"device (forward, backward and the optimizer step, cost/liveness.py, with the "
        f"allocator's slack, docs/cost-model.md §4.6)",
        got=f"none; the least memory any plan found needs is {gib(need)} per device, at "
            f"its {least.predicted['peak_phase']} peak; techniques tried: "
            f"{'; '.join(dict.fromkeys(techniques))}",
        fix="raise memory_budget, use a larger mesh, or a smaller batch"
            + ("" if options.offload == "auto" else ", or allow offload (offload='auto')")
            + ("" if options.recompute == "auto"
               else ", or allow activation checkpointing (recompute='auto')"),
        least_bytes=need, phase=least.predicted["peak_phase"])


def _remedies(traced: TracedGraph, options: PlanOptions, plan: Plan
              ) -> list[tuple[dict[str, str], bool | str]]:
    """The techniques to try, in order, when ``plan``'s step peaks above the budget: those that
    lower its binding phase first (an optimizer-step peak falls with offload, which takes the
    optimizer state off the device; a forward or backward one with checkpointing), as far as
    ``options`` allows them, each with ``plan``'s others."""
    recompute, offload = dict(plan.recompute), offload_level(plan)
    layers = checkpointable(traced.graph, traced.layers) if traced.training else []
    ckpt = [dict.fromkeys(layers, "full")] if layers and options.recompute == "auto" \
        and plan.recompute != dict.fromkeys(layers, "full") else []
    offloads: list[bool | str] = []
    if options.offload == "auto" and traced.training \
            and options.state_optimizer not in ("none", "sgd"):
        offloads = [o for o in (True, "parameters") if o != offload
                    and (o is True or options.stage_run is None)
                    and not (o is True and offload == "parameters")]
    if plan.predicted["peak_phase"] == "optimizer":
        out = [(recompute, o) for o in offloads] + [(c, offloads[-1] if offloads else offload)
                                                    for c in ckpt]
    else:
        out = [(c, offload) for c in ckpt] + [(ckpt[0] if ckpt else recompute, o)
                                              for o in offloads]
    return out


def _technique(recompute: dict[str, str], offload: bool | str) -> str:
    policies = sorted(set(recompute.values()))
    ckpt = f"{'/'.join(policies)} checkpointing of {len(recompute)} layers" if recompute \
        else "no checkpointing"
    return ckpt + {False: "", True: ", optimizer offload",
                   "parameters": ", parameter offload"}[offload]


def _grouped(traced: TracedGraph, recompute: dict[str, str]) -> TracedGraph:
    """``traced`` with its identical layers grouped apart by policy where ``recompute`` mixes
    policies in a group (trace/layers.py ``regroup``)."""
    layers = regroup(traced.layers, recompute)
    return traced if layers == traced.layers else replace(traced, layers=layers)


def _plan_partial(traced: TracedGraph, mesh: Mesh, options: PlanOptions, best: Plan,
                  layers: Sequence[str], budget: float, **kw: Any) -> Plan | None:
    """Checkpointing per layer: when the fastest plan applies one policy to every layer, the
    first k layers with it and the rest with a cheaper one (full over selective or none,
    selective over none) may fit too, with less recomputation: Megatron-LM's
    ``--recompute-num-layers`` (block method), the per-layer search of Galvatron and Mist. For
    each cheaper policy the least such k is found by pricing ``best``'s own layouts (memory never
    falls as fewer layers recompute; the sum the ILP bounds, as the ladder compares), raised a
    little until the step's liveness peak fits too. The faster of these, with ``best``'s
    layouts, if it beats ``best``, else None. (Solving the ILP again at that k might find faster
    layouts, at the price of one more solve.)"""
    policies = set(best.recompute.values())
    if len(policies) != 1 or len(best.recompute) != len(layers) or len(layers) < 2:
        return None
    hi = policies.pop()
    strategies = best.strategies()

    def fits(p: Plan) -> bool:      # the ILP's bound and the step's liveness peak alike
        return max(p.predicted["ilp_memory_bytes"], p.predicted["memory"]["peak"]) <= budget

    candidates = []
    for lo in {"full": ("selective", None), "selective": (None,)}[hi]:
        def mixed(k: int, lo: str | None = lo) -> dict[str, str]:
            out = {layer: hi for layer in layers[:k]}
            if lo is not None:
                out.update({layer: lo for layer in layers[k:]})
            return out

        # Bisect on k over best's layouts (the memory sum alone, as the ILP bounds it).
        lo_k, hi_k = 0, len(layers)
        while lo_k < hi_k:
            k = (lo_k + hi_k) // 2
            if forward_memory(_grouped(traced, mixed(k)), mesh, strategies, options,
                              mixed(k), best.joint_groups()) <= budget:
                hi_k = k
            else:
                lo_k = k + 1
        # The step's liveness peak lies above that sum (backward's gradients, the optimizer's
        # temporaries): a few more layers recomputed until it fits too.
        for k in sorted({hi_k, hi_k + max(1, len(layers) // 8), hi_k + len(layers) // 4}):
            if k >= len(layers):
                break
            rc = mixed(k)
            p = assemble(_grouped(traced, rc), mesh, strategies, options,
                         solver=dict(best.solver), model_name=kw.get("model_name", ""),
                         timings=dict(best.timings), recompute=rc, joint=best.joint_groups())
            # Not solved again: the layouts are best's, priced with these policies.
            p = replace(p, solver={**p.solver, "objective": p.predicted["step_time_s"],
                                   "note": f"layouts solved with every layer {hi}; "
                                           f"checkpointing then priced per layer"})
            if fits(p):
                candidates.append(p)
                break
    if not candidates:
        return None
    pick = min(candidates, key=lambda p: p.predicted["step_time_s"])
    # ``best`` may still be re-planned for its own liveness peak: never faster than it is now.
    return pick if pick.predicted["step_time_s"] < best.predicted["step_time_s"] else None


def _mesh_use_note(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan,
                   model_name: str) -> list[str]:
    use = mesh_use(Pricer(traced, mesh, options), plan.strategies())
    if not use.wasteful:
        return []
    small = smaller_mesh(mesh, use.idle_axes)
    idle = ", ".join(f"{mesh.axes[a]} ({use.split[a]:.0%} of compute split over it)"
                     for a in use.idle_axes)
    head = (f"devices repeat work: compute per device is {use.redundancy:.1f}x the ideal share "
            f"of {mesh.size} devices; idle axes: {idle}")
    try:
        with progress.step(f"devices repeat work: planning the same on {_devices(small)}"):
            other = _plan_memory(traced, small, options, model_name=model_name, fixed=None,
                                 trace_s=0.0, merge=None)
    except AutoshardError:
        return [f"{head}. The same work does not fit on {_devices(small)} alone."]
    return [f"{head}. The same work on {_devices(small)}: predicted step "
            f"{other.predicted['step_time_s'] * 1e3:.3f} ms against "
            f"{plan.predicted['step_time_s'] * 1e3:.3f} ms here"]


def _devices(mesh: Mesh) -> str:
    if mesh.size == 1:
        return "one device"
    return f"mesh {'x'.join(map(str, mesh.shape))} (axes {','.join(mesh.axes)})"


def _plan_traced(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *, model_name: str,
                 fixed: dict[str, Strategy] | None, trace_s: float,
                 merge: AxisMerge | None, recompute: dict[str, str], offload: bool,
                 cutoff_s: float | None = None) -> Plan:
    """One plan of ``traced`` with these techniques; ``cutoff_s``: only a plan faster than that
    is wanted (the ILP prunes by it, in a quarter of the time limit; :class:`NoBetter` when it
    finds none; 2-D meshes)."""
    check_mesh_fits(traced, mesh)
    traced = _grouped(traced, recompute)
    if mesh.ndim >= 3:
        return _plan_by_merging(traced, mesh, options, model_name=model_name, fixed=fixed,
                                trace_s=trace_s, recompute=recompute, offload=offload)
    return _solve(traced, mesh, options, model_name=model_name, fixed=fixed, trace_s=trace_s,
                  merge=merge, recompute=recompute, offload=offload, cutoff_s=cutoff_s)


MIN_SOLVE_S = 0.5    # the least time a solve under a deadline gets once its ILP is built


def _solve(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *, model_name: str,
           fixed: dict[str, Strategy] | None, trace_s: float, merge: AxisMerge | None,
           recompute: dict[str, str], offload: bool, deadline: float | None = None,
           cutoff_s: float | None = None) -> Plan:
    """One ILP on ``mesh`` (every axis its own, whatever its number), solved and assembled.
    ``deadline`` (``time.perf_counter()`` seconds): building and solving share the time up to it
    (BuildTimeout if building runs past it), and a solve without an incumbent by then raises
    at once (the caller has other plans)."""
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
    if deadline is not None and deadline - time.perf_counter() < build_s:
        # Solving took longer than building on every 3-axis problem measured (gpt2-tiny,
        # llama-tiny: 1.2x to 2.3x): less time than that left cannot give a plan.
        raise BuildTimeout()
    try:
        with progress.step(f"solving ({len(problem.decisions)} decisions)"):
            # A try that must beat a plan in hand is a gamble: a quarter of the time limit.
            limit = options.time_limit_s if cutoff_s is None else options.time_limit_s / 4
            if deadline is not None:
                limit = max(MIN_SOLVE_S, deadline - time.perf_counter())
            # Never worse than the obvious plans (solver/starts.py); a pinned problem is a
            # baseline's own, and a deadline leaves no time for them.
            starts = () if fixed or deadline is not None else \
                (lambda: obvious_starts(traced, mesh, built))
            sol = solve(problem, time_limit_s=limit, cutoff_s=cutoff_s, starts=starts,
                        verdict=deadline is None, highs_first=options.stage_run is not None)
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
    progress.note(f"{sol.status}: {sol.objective * 1e3:.3f} ms per step")
    return solved_plan(traced, mesh, options, built, problem, sol, model_name=model_name,
                       timings={"trace_s": trace_s, "build_s": build_s, "solve_s": sol.seconds},
                       recompute=recompute)[0]


def solved_plan(traced: TracedGraph, mesh: Mesh, options: PlanOptions, built: Built,
                problem: Problem, sol: Solution, *, model_name: str,
                timings: dict[str, float], recompute: dict[str, str] | None = None,
                **record: Any) -> tuple[Plan, tuple[int, ...]]:
    """The Plan of a solution of ``problem`` (``built``'s, with the caller's pins and cuts),
    and its choice: ties broken toward the layouts a user expects (:func:`storage_preferences`)
    within those pins and cuts, assembled and priced as every plan is. ``record``: more fields
    of the plan's solver record (an alternative's label)."""
    choice = break_ties(problem, sol.choice, storage_preferences(traced, built))
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


# A 3-axis mesh is searched two ways, and the fastest plan kept (docs/design.md, "The ILP"):
# - merged: for each way to group the axes (adjacent or not: (x,y)+z, x+(y,z), (x,z)+y, (x,y,z)),
#   a 1-D or 2-D problem whose merged axes hold one placement, solved exactly; a merged axis's
#   collective runs as one collective over its real axes' joint group (docs/cost-model.md §1.4);
# - every subset: the problem on the real mesh, where each tensor dim may be split over any
#   subset of the axes (about 5^3 placements per tensor: a larger ILP), every collective over
#   one axis. It is built and solved within the solver's time limit; where it is not, the plan
#   is the best merged one and says so (``warnings``, ``solver["axis_search"]``).
# A mesh with a 1-device axis skips the second: merging that axis into another is the same.


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
                     recompute: dict[str, str], offload: bool) -> Plan:
    tries: list[dict[str, Any]] = []
    plans: list[Plan] = []
    errors: list[AutoshardError] = []
    every = min(mesh.shape) > 1
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
    for merges in partitions(mesh.ndim):
        alone = all(len(g) == 1 for g in merges)
        if alone and not every:
            continue
        try:
            if merges == whole:
                if isinstance(probe, AutoshardError):
                    raise probe
                plan = probe
            elif alone:
                plan = _plan_every_subset(traced, mesh, options, fixed=fixed,
                                          model_name=model_name, trace_s=trace_s,
                                          recompute=recompute, offload=offload)
            else:
                plan = _plan_merged(traced, mesh, options, AxisMerge(mesh, merges), fixed=fixed,
                                    model_name=model_name, trace_s=trace_s,
                                    recompute=recompute, offload=offload)
        except AutoshardError as e:
            errors.append(e)
            tries.append({"merged_axes": [list(g) for g in merges], "error": e.got})
            continue
        if plan is None:
            continue                      # pinned layouts that differ on merged axes
        for p in [plan, *([_one_axis_at_a_time(traced, mesh, options, plan)]
                          if plan.joint_axes else [])]:
            plans.append(p)
            tries.append({"merged_axes": [list(g) for g in merges], "joint": bool(p.joint_axes),
                          "step_time_s": p.predicted["step_time_s"],
                          "status": p.solver["status"], "gap": p.solver["gap"]})
    if not plans:
        if errors:
            raise errors[0]
        raise AutoshardError("pinned layouts that keep some mesh axes alike", got=str(fixed),
                             fix="pin equal placements on two mesh axes")
    best = min(plans, key=lambda p: p.predicted["step_time_s"])
    alone = next((t for t in tries if len(t["merged_axes"]) == mesh.ndim), None)
    note = _fallback_note(alone, best, options) if alone is not None else ""
    return replace(best, solver={**best.solver, "axis_search": tries},
                   warnings=(*best.warnings, *([note] if note else [])))


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
    return replace(p, solver={**p.solver, "objective": p.predicted["step_time_s"],
                              "note": "; ".join(filter(None, [p.solver.get("note"), note]))})


def _fallback_note(alone: dict[str, Any], best: Plan, options: PlanOptions) -> str:
    """What the plan says when the search over every subset of axes did not finish within the
    time limit (no plan, or one the solver could not prove best) and a merged plan was kept."""
    if "error" in alone:
        why = f"gave no plan ({alone['error']})"
    elif alone["status"] != "OPTIMAL" and len(best.solver["merged_axes"]) < len(alone[
            "merged_axes"]):
        why = f"stopped at the time limit {alone['gap']:.1%} from its bound"
    else:
        return ""
    return (f"the search over every subset of mesh axes for each tensor dim {why}; solver time "
            f"limit {options.time_limit_s:g} s: the plan is the best with axes merged "
            f"(solver.merged_axes)")


def _plan_every_subset(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                       fixed: dict[str, Strategy] | None, model_name: str, trace_s: float,
                       recompute: dict[str, str], offload: bool) -> Plan:
    """The problem on the real 3-axis mesh, built within the solver's time limit and solved
    within it (an incumbent found by then is kept, with its gap)."""
    limit = options.time_limit_s
    t0 = time.perf_counter()
    try:
        with progress.step("every subset of axes for each tensor dim"):
            plan = _solve(traced, mesh, options, model_name=model_name, fixed=fixed,
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
                 recompute: dict[str, str], offload: bool) -> Plan | None:
    """The plan with ``merge``'s groups of axes acting as one, on the real mesh; None when a
    pinned layout differs on the axes of a group."""
    pins = {}
    for name, st in (fixed or {}).items():
        outs = tuple(merge.contract_spec(o) for o in st.outputs)
        if any(o is None for o in outs):
            return None
        pins[name] = Strategy((), outs, st.kernel)
    with progress.step(f"axes merged as ({','.join(merge.merged().axes)})"):
        sub = _plan_traced(traced, merge.merged(), options, fixed=pins or None, merge=merge,
                           model_name=model_name, trace_s=trace_s, recompute=recompute,
                           offload=offload)
    strategies = {}
    for n in sub.nodes:
        ins = tuple(merge.expand_spec(x) for x in n.inputs)
        outs = tuple(merge.expand_spec(x) for x in n.outputs)
        strategies[n.name] = Strategy(ins, outs, n.kernel, work_fraction(ins, outs, mesh.shape))
    return assemble(traced, mesh, strategies, options,
                    solver={**sub.solver, "merged_axes": [list(g) for g in merge.merges]},
                    model_name=model_name, timings=sub.timings, recompute=recompute,
                    joint=merge.joint())


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


def forward_memory(traced: TracedGraph, mesh: Mesh, strategies: dict[str, Strategy],
                   options: PlanOptions, recompute: dict[str, str], joint: Groups = ()) -> float:
    """The memory the ILP bounds for a full assignment (``assemble``'s ``ilp_memory_bytes``)
    without the rest of the plan: what each node holds and saves, the saved copies of resharded
    values, and under selective checkpointing the collective outputs it stores."""
    pricer = Pricer(traced, mesh, options, recompute=recompute, joint=joint)
    memory = sum(pricer.memory(n, st) for n, st in strategies.items())
    memory += pricer.saved_copies(strategies)
    if "selective" in recompute.values():
        program = step_program(traced, strategies, mesh.shape, bucket_bytes=options.bucket_bytes,
                               recompute=recompute, joint=joint, shapes=pricer.shapes)
        for e in program.edges:
            memory += pricer.stored_reshard_bytes(e.value, e.src, e.dst, e.consumers[0][0])
    return memory


def assemble(traced: TracedGraph, mesh: Mesh, strategies: dict[str, Strategy],
             options: PlanOptions, *, solver: dict[str, Any], model_name: str,
             timings: dict[str, float],
             recompute: dict[str, str] | frozenset[str] | None = None,
             joint: Groups = ()) -> Plan:
    """The Plan of a full assignment on ``mesh``: its ledger, and its predicted figures as the
    sum of the prices the ILP's coefficients come from (cost/price.py), over the nodes and the
    reshards the program will run (cost/reshards.py, the walk codegen makes). ``joint``: groups
    of axes whose collectives run as one (the plan's ``joint_axes``, docs/cost-model.md §1.4);
    a collective over several axes is one record listing them, and its seconds are shared
    evenly among them in the per-axis figures."""
    graph = traced.graph
    if not isinstance(recompute, dict):       # a set of layers: all fully checkpointed
        recompute = dict.fromkeys(recompute or (), "full")
    joint = joint_groups(joint, mesh.shape)
    pricer = Pricer(traced, mesh, options, recompute=recompute, joint=joint)
    nodes = [n for n in graph.nodes if n.name in strategies]
    params = {p.name: p.fqn for p in traced.params}
    compute_s = memory = backward_s = optimizer_s = host_step_s = 0.0
    state = StateBytes()
    for n in nodes:
        price = pricer.node(n.name, strategies[n.name])
        compute_s += price.seconds
        memory += price.bytes
        backward_s += pricer.backward(n.name, strategies[n.name])
        if n.op == "placeholder":
            state += pricer.state_bytes(n.name, strategies[n.name])
            optimizer_s += pricer.optimizer_seconds(n.name, strategies[n.name])
            host_step_s += pricer.offload_step_seconds(n.name, strategies[n.name])[1]
    memory += pricer.saved_copies(strategies)
    # What the rank runs in the step (cost/program.py): the ledger below lists its reshards,
    # buckets and host copies, and the liveness walk reads the same program.
    program = step_program(traced, strategies, mesh.shape, bucket_bytes=options.bucket_bytes,
                           recompute=recompute, joint=joint, shapes=pricer.shapes)
    edges, buckets, first = list(program.edges), list(program.buckets), program.first_syncs()
    modes = {n: strategies[n].kernel for n in params}
    collectives: list[CollectiveRecord] = []
    blocking = dict.fromkeys(mesh.axes, 0.0)
    sync = dict.fromkeys(mesh.axes, 0.0)
    for e in edges:
        if first.get(e.value[0]) is e:           # run by its bucket
            steps = pricer.bucketed_sync(e.value, e.src, e.reshard, modes[e.value[0]])
            for a, t in sync_share_by_axis(steps, mesh, options.bucket_bytes).items():
                sync[mesh.axes[a]] += t
            continue
        # A reshard runs where its first consumer runs: inside a fully checkpointed layer, its
        # forward collectives run again when the layer is recomputed (codegen/recompute.py).
        again = [("recompute", st) for st in e.reshard.forward if st.is_collective] \
            if pricer.reshards_again(e.consumers[0][0]) else []
        memory += pricer.stored_reshard_bytes(e.value, e.src, e.dst, e.consumers[0][0])
        for phase, step in [*e.reshard.collectives, *again]:
            if phase == "backward" and e.from_param:
                phase = "grad_sync"
            _charge(blocking, step, mesh)
            collectives.append(CollectiveRecord(step.kind, tuple(mesh.axes[a] for a in step.axes),
                                                step.nbytes, phase, e.consumers[0][0],
                                                e.value[0]))
    # Collectives an op runs inside itself (a vocabulary-parallel loss's all-reduces,
    # docs/cost-model.md §3.8): blocking, in forward, again where its layer is recomputed.
    for n in nodes:
        steps = pricer.op_steps(n.name, strategies[n.name])
        again = ("recompute",) if steps and pricer.reshards_again(n.name) else ()
        for phase in ("forward", *again):
            for step in steps:
                _charge(blocking, step, mesh)
                collectives.append(CollectiveRecord(step.kind, tuple(mesh.axes[a] for a in step.axes),
                                                    step.nbytes, phase, n.name, n.name))
    for k, b in enumerate(buckets):
        for axes, nbytes in bucket_collectives(b, mesh.shape):
            collectives.append(CollectiveRecord(b.kind, tuple(mesh.axes[a] for a in axes), nbytes,
                                                "grad_sync", f"bucket{k}", "", b.members))
    # After the optimizer step, the updated state shards are all-gathered back into each
    # parameter's layout (zero1/zero2/offload, cost/state.py): blocking, phase "optimizer".
    param_state = {}
    for name, fqn in params.items():
        r = pricer.optimizer_steps(name, strategies[name])
        if modes[name] is not None:
            param_state[fqn] = _state_record(pricer, name, strategies[name])
        for step in (r.forward if r else ()):
            if step.is_collective:
                _charge(blocking, step, mesh)
                collectives.append(CollectiveRecord(step.kind,
                                                    tuple(mesh.axes[a] for a in step.axes),
                                                    step.nbytes, "optimizer", "optimizer", name))
    # The host link (docs/cost-model.md §9): each use of a parameter kept on the host copies it
    # in and its gradient back, blocking; the optimizer step's copies are in optimizer_s.
    transfers = host_transfers(traced, pricer, strategies, edges, first, buckets)
    host_s = sum(t.bytes for t in transfers if t.phase != "optimizer") \
        / mesh.cluster.host_bandwidth * pricer.step_share
    # One overlap window (cost/overlap.py): the buckets run behind backward compute; what does
    # not fit is exposed, shared over the axes by their sync seconds.
    # Offloaded host steps run in the same window (cost/price.py offload_step_seconds; each
    # took its seconds out of ``backward_s``, as in the ILP): what they add to the exposed part
    # is the optimizer step's, on the critical path as its blocking part is (in compute).
    total_sync = sum(sync.values())
    window = backward_s + host_step_s
    comm_exposed = exposed_seconds(total_sync, window)
    host_exposed = exposed_seconds(total_sync + host_step_s, window) - comm_exposed
    optimizer_s += host_exposed
    compute_s += host_exposed
    hidden_frac = 1.0 - comm_exposed / total_sync if total_sync else 1.0
    overlapped = {a: t * hidden_frac for a, t in sync.items()}
    exposed = {a: blocking[a] + sync[a] - overlapped[a] for a in mesh.axes}
    comm_s = sum(blocking.values()) + total_sync
    # The peak over the step, from the liveness of values (cost/liveness.py, §4.5), beside
    # ``memory``, the sum of everything forward saves (§4.4) that the ILP bounds.
    live = step_memory(traced, strategies, pricer, program=program)
    tied: dict[str, list] = {}
    for n in nodes:
        for k, ref in enumerate(pricer.reads(n.name)):
            if ref in pricer.tied_fqns:
                reads = tied.setdefault(pricer.tied_fqns[ref], [])
                if strategies[n.name].inputs[k] not in reads:
                    reads.append(strategies[n.name].inputs[k])
    node_plans = tuple(NodePlan(n.name, _op_name(n), strategies[n.name].inputs,
                                strategies[n.name].outputs, strategies[n.name].kernel)
                       for n in nodes)
    return Plan(
        mesh_shape=mesh.shape, mesh_axes=mesh.axes, cluster=mesh.cluster,
        fingerprint=traced.fingerprint, options=options, nodes=node_plans,
        params={params[n]: strategies[n].outputs[0] for n in params},
        inputs={p.fqn: strategies[p.name].outputs[0] for p in traced.inputs},
        collectives=tuple(collectives),
        predicted={"step_time_s": compute_s + sum(exposed.values()) + host_s,
                   "compute_s": compute_s, **({"host_s": host_s} if host_s else {}),
                   "comm_s": comm_s, "ilp_memory_bytes": memory,
                   "optimizer_s": optimizer_s, "peak_phase": live.phase,
                   **({"host_step_s": host_step_s} if host_step_s else {}),
                   "memory": {"peak": live.peak, "parameters": live.parameters,
                              "gradients": live.gradients, "optimizer": live.optimizer,
                              "activations": live.activations, "temporaries": live.temporaries,
                              "host": state.host,
                              "model_state": state.parameters + state.gradients + state.optimizer},
                   "exposed_comm_s": exposed, "overlapped_comm_s": overlapped},
        solver=solver, model=model_name, node_sigs=traced.node_sigs, layers=traced.layers,
        tied={fqn: tuple(reads) for fqn, reads in tied.items()},
        recompute={layer.name: recompute[layer.name] for layer in traced.layers
                   if layer.name in recompute},
        param_state=param_state, host_transfers=tuple(transfers),
        joint_axes=tuple(tuple(mesh.axes[a] for a in g) for g in joint),
        input_meta={p.fqn: (p.info.shape, str(p.info.dtype).removeprefix("torch."))
                    for p in traced.inputs if p.info is not None},
        # Wall-clock figures stay off the saved plan: they would make two runs' files differ.
        timings=timings)


def _charge(seconds: dict[str, float], step: Step, mesh: Mesh) -> None:
    """Add a step's seconds to its axes' figures, shared evenly among the axes of a joint one."""
    t = step_seconds(step, mesh)
    for a in step.axes:
        seconds[mesh.axes[a]] += t / len(step.axes)


def _state_record(pricer: Pricer, name: str, strategy: Strategy) -> ParamState:
    ph = pricer.traced.placeholder(name)
    spec, mode = strategy.outputs[0], strategy.kernel
    sspec = state_spec(ph.info.shape, spec, pricer.mesh.shape) or spec
    return ParamState(mode, sspec if mode in SCATTERS else spec, sspec,
                      {"offload": "optimizer", "offload_params": "parameters"}.get(mode, ""))


def host_transfers(traced: TracedGraph, pricer: Pricer, strategies: dict[str, Strategy],
                   edges: list, first: dict, buckets: list) -> list[HostTransfer]:
    """Every copy over the host link a step makes (docs/cost-model.md §9), as the runtime makes
    them (codegen/rewrite.py, codegen/buckets.py, codegen/optim.py). A parameter kept on the
    host (offload_params) is copied to the device once per use: per reshard edge that reads it,
    and once for all the ops that read it where it lies (``direct_reads``), at the first of
    them; again where that use is recomputed. The gradient of a use comes back down in the
    stored layout, unless a bucket syncs it: then its share of the bucket (the reduce-scattered
    shard) comes down once the bucket is done. Then the optimizer step's
    (``Pricer.host_steps``)."""
    out: list[HostTransfer] = []
    params = [p.name for p in traced.params]
    fetched = {n for n in params if strategies[n].kernel == "offload_params"}
    if fetched:
        uses = [(e.value[0], e.src, e.consumers[0][0], first.get(e.value[0]) is e)
                for e in edges if e.value[0] in fetched]
        for name, cons in direct_reads(traced.graph, strategies, fetched,
                                       training=traced.training).items():
            uses.append((name, strategies[name].outputs[0], cons[0][0], False))
        for name, src, node, bucketed in uses:
            n = pricer.fetch_bytes((name, 0), src, "offload_params")
            out.append(HostTransfer("h2d", n, "forward", node, name))
            if pricer.recomputed(node):
                out.append(HostTransfer("h2d", n, "recompute", node, name))
            if not bucketed and name in pricer.grads:
                out.append(HostTransfer("d2h", n, "backward", node, name))
        for k, b in enumerate(buckets):
            for m in b.members:
                if m in fetched:
                    shape, isz = pricer.shapes[(m, 0)]
                    spec = strategies[m].outputs[0]
                    if b.kind == "reduce_scatter":
                        spec = state_spec(shape, spec, pricer.mesh.shape) or spec
                    out.append(HostTransfer("d2h", local_numel(shape, spec, pricer.mesh.shape)
                                            * isz, "grad_sync", f"bucket{k}", m))
    for name in params:
        for direction, nbytes in pricer.host_steps(name, strategies[name]):
            out.append(HostTransfer(direction, nbytes, "optimizer", "optimizer", name))
    return out


def _op_name(n) -> str:
    return "placeholder" if n.op == "placeholder" else str(n.target)
