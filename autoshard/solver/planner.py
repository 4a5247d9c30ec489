"""trace -> build problem (priced by cost/price.py) -> ILP -> Plan: the entry points, and the
searches over the pipeline axis and the microbatch count. Fitting the budget is
solver/budget.py, one plan on a mesh solver/merging.py and solver/solve.py, the Plan of an
assignment solver/assemble.py."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from autoshard import progress
from autoshard.cost.price import Pricer
from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, OffloadOverlap, Strategy
from autoshard.mesh import AxisMerge, Mesh
from autoshard.options import PlanOptions, resolve_options
from autoshard.plans import Plan
from autoshard.solver.diagnostics import (grouped_experts_note, mesh_use,
                                          microbatch_statistics_note, smaller_mesh, unruled_note)
from autoshard.trace.batches import Traces, batch_of, sliced
from autoshard.trace.export import TracedGraph
from autoshard.solver.budget import fit_budget, plan_memory
from autoshard.solver.offload_split import offload_per_parameter
from autoshard.solver.solve import offload_level, repriced
from autoshard.solver.search import Try, apart, records_searches, run_search

# The least share of the step that offload_overlap="backward" must save on a plan offloaded under
# "none" for the plan to say so (_overlap_note).
OVERLAP_NOTE_GAIN = 0.05


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


@records_searches
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
        best, _ = run_search("microbatches", microbatch_tries(tries),
                             lambda t: plan_with(traces, mesh, t.options(options),
                                                 model_name=model_name),
                             error_of_none="last")
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
    traced = traces.at(batch)
    if traced.repeat is not None:
        progress.note(f"{traced.repeat.prefix} of {traced.repeat.count} layers exported, the "
                      f"others copied from them")
    return plan_traced(traced, mesh, options, model_name=model_name, trace_s=trace_s)


def microbatch_tries(counts: Sequence[int]) -> list[Try]:
    """The microbatch search's tries, fewest first (fewer may not fit: more are in flight per
    stage, so the last try's error says most when none fits)."""
    return [Try(f"{k} microbatches", (("microbatches", k),)) for k in counts]


def pipeline_tries(mesh: Mesh) -> list[Try]:
    """The pipeline search's tries: no pipeline (its microbatch count left to search), then a
    pipeline over each axis of 2 or more devices."""
    return [Try("without a pipeline", (("pipeline", None), ("microbatches", "auto")))] + [
        Try(f"pipeline over {a}", (("pipeline", a),))
        for a, n in zip(mesh.axes, mesh.shape) if n >= 2]


def _plan_pipeline_auto(traces: Traces, mesh: Mesh, options: PlanOptions,
                        model_name: str) -> Plan:
    """Whether and on which axis to pipeline (docs/cost-model.md §10): the plan without a
    pipeline and one pipelined over each axis of 2 or more devices; the fastest kept, every
    try in the plan's record of its searches (the search "pipeline axis")."""
    best, _ = run_search("pipeline axis", pipeline_tries(mesh),
                         lambda t: plan_with(traces, mesh, t.options(options),
                                             model_name=model_name))
    return best


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


@records_searches
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
    if options.pipeline is not None and options.offload == OffloadLevel.PARAMETERS:
        raise AutoshardError("parameter offload without a pipeline (not built for pipeline "
                             "stages yet)", got=f"offload='parameters' and pipeline="
                             f"{options.pipeline!r}",
                             fix="drop the pipeline, or offload the optimizer only "
                                 "(offload='optimizer')")
    if options.pipeline is not None:
        # The graph is one microbatch's (trace_for); the stages' SPMD plan is this function's.
        from autoshard.solver.pipeline import plan_pipelined
        plan = plan_pipelined(traced, mesh, options, model_name=model_name, trace_s=trace_s,
                              plan_spmd=plan_traced)
        note = microbatch_statistics_note(traced, options.microbatches)
        return replace(plan, warnings=(*plan.warnings, note)) if note else plan
    plan = plan_memory(traced, mesh, options, model_name=model_name, fixed=fixed,
                        trace_s=trace_s, merge=merge)
    if fixed or merge is not None:
        return plan
    unruled, grouped = unruled_note(traced), grouped_experts_note(traced)
    notes = [*plan.warnings, *([unruled.removeprefix("; ")] if unruled else []),
             *([grouped] if grouped else [])]
    if options.stage_run is None:     # (a pipeline's stages are held to it by their caller)
        plan = _fitted(traced, mesh, options, plan, model_name, trace_s)
        notes += _overlap_note(traced, mesh, options, plan, model_name)
    notes += _mesh_use_note(traced, mesh, options, plan, model_name)
    return replace(plan, warnings=tuple(notes)) if notes else plan


def _fitted(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan,
            model_name: str, trace_s: float) -> Plan:
    """``plan`` held to the budget by its step's liveness peak, then split per parameter
    where it offloads."""
    plan = fit_budget(traced, mesh, options, plan, model_name=model_name, trace_s=trace_s)
    return offload_per_parameter(traced, mesh, options, plan) or plan


def _overlap_note(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan,
                  model_name: str) -> list[str]:
    """A plan that steps offloaded optimizer state on the host after backward (the default
    ``offload_overlap="none"``): its layouts under ``"backward"``, which gives the same numbers
    and hides the host's step behind backward, with each parameter's state split between
    device and host chosen again (more may stay on the host, docs/cost-model.md §9.1), said
    where that is at least OVERLAP_NOTE_GAIN faster. The choice stays the user's: it rules out
    changing gradients between backward and the step.

    No ILP is solved for the note: the split is where "backward" gains (docs/cost-model.md
    §9.1: Mixtral-8x7B on 2x4 h100, 913 ms so against 922 ms from the solve it replaced)."""
    if options.offload_overlap != OffloadOverlap.NONE or offload_level(plan) == OffloadLevel.NONE:
        return []
    overlapped = replace(options, offload_overlap=OffloadOverlap.BACKWARD)
    same = repriced(traced, mesh, overlapped, plan, plan.strategies(), plan.recompute)
    try:
        # A plan to compare with, not this one's: a search its fitting runs stays out of this
        # plan's record.
        with progress.step("offload: pricing the same with offload_overlap='backward'"), \
                apart():
            other = _fitted(traced, mesh, overlapped, same, model_name, 0.0)
    except AutoshardError:
        return []
    now, then = plan.predicted.step_time_s, other.predicted.step_time_s
    if then > now * (1 - OVERLAP_NOTE_GAIN):
        return []
    return [f"the host's optimizer step runs after backward (offload_overlap='none'); with "
            f"offload_overlap='backward' this plan's layouts step in {then * 1e3:.3f} ms "
            f"against {now * 1e3:.3f} ms here, with the same numbers (each parameter steps as "
            f"backward completes its gradient; a loop that changes gradients between backward "
            f"and the step, as clip_grad_norm_ does, needs 'none')"]


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
        # A plan to compare with, not this one's: its searches stay out of this plan's record.
        with progress.step(f"devices repeat work: planning the same on {_devices(small)}"), \
                apart():
            other = plan_memory(traced, small, options, model_name=model_name, fixed=None,
                                 trace_s=0.0, merge=None)
    except AutoshardError:
        return [f"{head}. The same work does not fit on {_devices(small)} alone."]
    return [f"{head}. The same work on {_devices(small)}: predicted step "
            f"{other.predicted.step_time_s * 1e3:.3f} ms against "
            f"{plan.predicted.step_time_s * 1e3:.3f} ms here"]


def _devices(mesh: Mesh) -> str:
    if mesh.size == 1:
        return "one device"
    return f"mesh {'x'.join(map(str, mesh.shape))} (axes {','.join(mesh.axes)})"

