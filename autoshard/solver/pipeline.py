"""Pipeline planning: cut the model's layers into stages along one mesh axis (docs/cost-model.md
§10).

The graph is traced for one microbatch. Every stage runs its part of that graph as one SPMD plan
over the other axes of the mesh, and stages built from identical layers take identical
decisions, so that plan is solved once, for the whole graph, on the sub-mesh (the ILP's
identical-layer templates make one layer's decision every layer's). Its prices then give each
layer's seconds per microbatch and its memory, and a dynamic program over the cut points (Alpa's
stage construction, Zheng et al. 2022, arXiv 2201.12023 §5, here on one axis) picks the stages
that minimise the slowest one within the device memory, with each schedule's microbatches in
flight (autoshard/schedules.py). The step: the schedule's forward and backward over every
microbatch, its order of actions run with the stages' own seconds (``simulate_schedule``), then
the slowest stage's gradient sync (its buckets run once, after the last microbatch) and
optimizer step. The SPMD plan is chosen for one microbatch's run, which bears
1/m of the gradient sync and optimizer step (cost/price.py ``step_share``), as the pipelined
step does.

The steps, each in its own module: the per-layer figures and a cut's (solver/stage_figures.py),
the cut into stages (solver/stage_cuts.py), the schedule search here, through the search driver
(solver/search.py ``run_search``), and the winner's assembly (solver/pipeline_assembly.py).
"""
from __future__ import annotations

from typing import Any, Sequence

from autoshard import progress
from autoshard.cost.memory import budget_for, device_budget
from autoshard.cost.price import Pricer
from autoshard.cost.program import program_for
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.schedules import (SCHEDULES, SPLIT_BACKWARD, V_PLACED, VIRTUAL_STAGES,
                                 check_microbatches, fullest_stage)
from autoshard.solver.pipeline_assembly import assemble_pipelined, sub_mesh
from autoshard.solver.search import Try, run_search
from autoshard.solver.stage_cuts import StageWalk, cut_stages, cut_v_stages
from autoshard.solver.stage_figures import (LayerFigures, layer_figures, per_rank,
                                            cut_step_seconds, stage_figures)
from autoshard.trace.export import TracedGraph


def plan_pipelined(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *, model_name: str,
                   trace_s: float, plan_spmd: Any) -> Plan:
    """The pipelined plan of ``traced`` (one microbatch) on ``mesh``; ``plan_spmd`` plans a
    graph on a mesh without a pipeline (planner.plan_traced). In steps: the stages' one SPMD
    plan on the sub-mesh, its figures per layer, the schedule search (each schedule's fastest
    cut into stages that fits) and the winner's assembly."""
    a, m = _pipeline_axis(traced, mesh, options)
    p = mesh.shape[a]
    sub = sub_mesh(mesh, a)
    budget = device_budget(mesh.cluster, options.memory_budget)
    spmd, sub_options = _stage_layouts(traced, sub, options, p, m, budget, plan_spmd,
                                       model_name=model_name, trace_s=trace_s)
    strategies = spmd.strategies()
    # Priced per step (the optimizer step whole), as the stages' figures are.
    pricer = Pricer(traced, sub, sub_options.replace(stage_run=None),
                    recompute=dict(spmd.recompute))
    figs = layer_figures(traced, spmd, strategies, pricer, sub, mesh.links[a])
    schedules = _schedules(options, len(traced.layers), p, m, spmd.recompute)
    # Each stage's peak is the liveness walk of its part of the step program (§10.4).
    walker = StageWalk(traced, strategies, pricer, program_for(traced, strategies, pricer),
                       figs.where, sub, p, m)
    schedule, cuts, figures, step = _search_schedules(schedules, figs, walker, budget, p, m)
    layers = [layer.name for layer in traced.layers]
    stage_layers = tuple(tuple(layers[i] for i in range(lo, hi)) for lo, hi in cuts)
    return assemble_pipelined(traced, mesh, a, spmd, sub, pricer, stage_layers, cuts, figures,
                              figs.boundary, schedule, m, step, options)


def _pipeline_axis(traced: TracedGraph, mesh: Mesh, options: PlanOptions) -> tuple[int, int]:
    """The pipeline axis's index and the number of microbatches, once they are checked: a
    training plan, an axis of the mesh with 2 or more devices and no more than the layers, a
    given number of microbatches that the schedule takes."""
    axis_name = options.pipeline
    if axis_name not in mesh.axes:
        raise AutoshardError(f"PlanOptions.pipeline naming an axis of the mesh {mesh.axes}",
                             got=repr(axis_name), fix="pass one of the mesh's axis names")
    a = mesh.axes.index(axis_name)
    p = mesh.shape[a]
    layers = [layer.name for layer in traced.layers]
    if not traced.training:
        raise AutoshardError("a training plan when pipelining", got="training=False",
                             fix="plan inference without a pipeline (pipeline=None)")
    if p < 2:
        raise AutoshardError("a pipeline axis of 2 or more devices",
                             got=f"axis {axis_name} of {p} device",
                             fix="pipeline over an axis of 2 or more devices (a larger mesh "
                                 "axis), or plan without a pipeline")
    if len(layers) < p:
        raise AutoshardError("at least one layer per pipeline stage",
                             got=f"axis {axis_name} of {p} devices, {len(layers)} layers",
                             fix="pipeline over a smaller axis, or plan without a pipeline")
    m = options.microbatches
    if not isinstance(m, int):
        raise AutoshardError("a number of microbatches here", got=repr(m),
                             fix="autoshard.plan and the CLI choose it; pass an int to "
                                 "plan_traced")
    if options.schedule != "auto":
        check_microbatches(options.schedule, p, m)
    return a, m


def _stage_layouts(traced: TracedGraph, sub: Mesh, options: PlanOptions, p: int, m: int,
                   budget: float, plan_spmd: Any, *, model_name: str, trace_s: float
                   ) -> tuple[Plan, PlanOptions]:
    """The stages' one SPMD plan of one microbatch on the sub-mesh, and the options it was
    planned with."""
    # The sub-plan holds every layer's state where a stage holds 1/p of it: its bound is the
    # stage's budget times p (the stages' exact peaks are checked by the cut search).
    # Its activations weigh the microbatches the fullest stage keeps alive, and each run of it
    # bears 1/m of the step's gradient sync and optimizer step (PlanOptions.stage_run).
    sub_options = options.replace(pipeline=None, memory_budget=budget_for(budget) * p,
                                  microbatches="auto",
                                  stage_run=(m, fullest_stage(options.schedule, p, m)))
    if options.schedule in SPLIT_BACKWARD and options.recompute == "auto":
        sub_options = sub_options.replace(recompute="none")     # see ``_schedules``
    with progress.step(f"layouts of the stages over {','.join(sub.axes)}, {m} microbatches"):
        spmd = plan_spmd(traced, sub, sub_options, model_name=model_name, trace_s=trace_s)
    # The sub-mesh has at most two axes (meshes have three): no axes merged, no joint groups.
    assert not spmd.joint_axes, spmd.joint_axes
    return spmd, sub_options


def _schedules(options: PlanOptions, L: int, p: int, m: int, recompute: dict[str, str]
               ) -> tuple[str, ...]:
    """The schedules to search: the one the options name, checked against the ``L`` layers,
    the ``m`` microbatches and checkpointing (``recompute``: the sub-plan's), or with "auto"
    each one these allow."""
    # A split backward (zero bubble) computes the weights' gradients in autograd runs apart
    # from the inputs': a checkpointed layer's forward would run again in each of them
    # (torch.utils.checkpoint recomputes per backward run), so it is offered without one.
    recomputed = sorted(k for k, v in recompute.items() if v != "none")
    if options.schedule == "auto":
        return tuple(x for x in SCHEDULES if L >= p * VIRTUAL_STAGES[x]
                     and not (_needs_rounds(x) and m % p)
                     and not (x == "DualPipeV" and m < 2 * p)
                     and not (x in SPLIT_BACKWARD and recomputed))
    if L < p * VIRTUAL_STAGES[options.schedule]:
        raise AutoshardError(f"at least {p * VIRTUAL_STAGES[options.schedule]} layers for "
                             f"{options.schedule} on {p} ranks (one per stage)",
                             got=f"{L} layers", fix="schedule='1F1B', or fewer ranks")
    if _needs_rounds(options.schedule) and m % p:
        raise AutoshardError(f"a number of microbatches divisible by the {p} pipeline ranks "
                             f"for {options.schedule} (as Megatron-LM requires; the "
                             f"activations it keeps are priced for whole rounds of {p})",
                             got=f"{m} microbatches",
                             fix=f"microbatches={m - m % p or p}, or schedule='1F1B'")
    if options.schedule in SPLIT_BACKWARD and recomputed:
        raise AutoshardError(f"{options.schedule} without activation checkpointing (its "
                             f"split backward would recompute a layer once per weight "
                             f"group)", got=f"{len(recomputed)} layers recomputed "
                             f"({recomputed[0]}, ...)",
                             fix="recompute='none', or schedule='Interleaved1F1B'")
    return (options.schedule,)


def _search_schedules(schedules: Sequence[str], figs: LayerFigures, walker: StageWalk,
                      budget: float, p: int, m: int) -> tuple[str, Any, list[dict], float]:
    """(schedule, cuts, the stages' figures, step) of the fastest schedule whose cut into
    stages fits ``budget``: one try per schedule through the search driver."""
    best, _ = run_search("schedules", schedule_tries(schedules),
                         lambda t: _fastest_cut(t.get("schedule"), figs, walker, budget, p, m),
                         price=lambda c: c[0], step=lambda c: c[4],
                         facts=lambda c: {"stages": len(c[2])}) if schedules else (None, [])
    if best is None:
        raise AutoshardError(f"pipeline stages within the memory budget of {budget / 2**30:.2f} "
                             f"GiB per device",
                             got=f"no cut of {len(figs.secs)} layers into stages on {p} ranks "
                                 f"fits with {m} microbatches under {' or '.join(schedules)}",
                             fix="use more pipeline stages, a larger mesh, the 1F1B schedule, "
                                 "or activation checkpointing (recompute='full')")
    _, schedule, cuts, figures, step = best
    return schedule, cuts, figures, step


def _fastest_cut(schedule: str, figs: LayerFigures, walker: StageWalk, budget: float, p: int,
                 m: int):
    """The schedule's candidate: (its tie-break key, the schedule, its fastest cut that fits,
    the stages' figures, the step), or None where no cut fits."""
    v = VIRTUAL_STAGES[schedule]
    # A rank holds v stages: each within 1/v of its memory.
    tries = [walker.fitting(lambda b: cut_stages(
        *figs.balanced, p, m, schedule, b / v, stages=p * v), budget, schedule)]
    if schedule in V_PLACED:
        tries.append(walker.fitting(lambda b: cut_v_stages(
            *figs.balanced, p, m, schedule, b), budget, schedule))
    # Each cut priced by running the schedule's order with its stages' own seconds
    # (``cut_step_seconds``): the closed forms the cut search balances hold for balanced
    # stages only.
    priced = []
    for c, peaks in (t for t in tries if t is not None):
        f = stage_figures(c, figs, p, m, schedule)
        for fig, peak in zip(f, peaks):
            fig["peak_bytes"] = peak.peak
        priced.append((cut_step_seconds(f, m, p, schedule, comm=True)
                       + per_rank(f, p, schedule, "optimizer_s", "sync_s"), c, f))
    if not priced:
        progress.note(f"{schedule}: no cut into {p * v} stages fits")
        return None
    step, cuts, figures = min(priced, key=lambda x: x[0])
    # Equal times: fewer microbatches in flight, then fewer sends, then one backward pass;
    # of the split ones, the V (a send fewer, its activations even across the ranks).
    key = (step, schedule != "1F1B", VIRTUAL_STAGES[schedule] > 1,
           schedule in SPLIT_BACKWARD, schedule not in V_PLACED)
    progress.note(f"{schedule}: {p * v} stages, step {step * 1e3:.3f} ms")
    return key, schedule, cuts, figures, step


def schedule_tries(schedules: Sequence[str]) -> list[Try]:
    """The schedule search's tries: each schedule's fastest cut into stages that fits,
    compared on its step (ties: the simpler schedule), and only the winner assembled."""
    return [Try(s, (("schedule", s),), announce=False) for s in schedules]


def _needs_rounds(schedule: str) -> bool:
    """Whether ``schedule`` takes microbatches in rounds of ``p`` (the looped interleaved
    schedules, as Megatron-LM's; torch's ZB-V takes any number, DualPipeV any from ``2p``:
    autoshard/schedules.py ``check_microbatches``)."""
    return VIRTUAL_STAGES[schedule] > 1 and schedule not in V_PLACED
