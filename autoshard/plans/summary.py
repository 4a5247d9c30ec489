"""A plan in words: the step and its parts, state modes, the mesh search, the pipeline and the
layers (``Plan.summary``), and one line per node (``Plan.explain``)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from autoshard.ir import Layer, StateMode, spec_str
from autoshard.mesh import split_axes
from autoshard.plans.records import DIRECTIONS, MODE_NAMES
from autoshard.plans.searches import TryRecord, named, searches
from autoshard.schedules import balanced_bubble

if TYPE_CHECKING:
    from autoshard.plans import Plan


def comm_by_axis(plan: Plan) -> list[str]:
    exposed = plan.predicted.exposed_comm_s or {}
    hidden = plan.predicted.overlapped_comm_s or {}
    return [f"    comm over {a}: {exposed.get(a, 0.0) * 1e3:.3f} ms exposed, "
            f"{hidden.get(a, 0.0) * 1e3:.3f} ms hidden behind backward"
            for a in plan.mesh_axes if exposed.get(a) or hidden.get(a)]


def _accumulation_summary(plan: Plan) -> list[str]:
    n = plan.options.accumulation_steps
    if n == 1:
        return []
    return [f"  gradient accumulation: {n} micro-steps per optimizer step (the figures are the "
            f"optimizer step's; forward and backward collectives run {n} times, the gradient "
            f"buckets and the optimizer's gathers once)"]


def summary(plan: Plan) -> str:
    p, s = plan.predicted, plan.solver
    dims = "x".join(map(str, plan.mesh_shape))
    lines = [f"autoshard plan {plan.model or ''} on mesh {dims} ({','.join(plan.mesh_axes)}), "
             f"cluster {plan.cluster_text}, {'training' if plan.training else 'inference'}",
             f"  predicted step {p.step_time_s * 1e3:.3f} ms = compute "
             f"{p.compute_s * 1e3:.3f} ms + exposed comm "
             f"{p.exposed_comm_total_s * 1e3:.3f} ms "
             f"(of {p.comm_s * 1e3:.3f} ms comm)"
             + (f" + host link {p.host_s * 1e3:.3f} ms" if p.host_s else "")
             # The step's liveness peak is the figure the budget holds (docs/cost-model.md
             # §4.6); a pipeline's stages have none yet, only their ILP sums.
             + (f"; peak {size_text(p.memory.peak)} per device" if p.memory is not None else
                f"; ILP memory sum {size_text(p.ilp_sum_bytes)} per device"),
             *comm_by_axis(plan), *_accumulation_summary(plan),
             f"  solver {s['status']}, {s['variables']} variables, {s.get('decisions', '?')} "
             f"decisions, gap {s['gap']:.2%}"
             + (f"; ILP memory sum {size_text(p.ilp_sum_bytes)} per device (the ILP's own "
                f"figure, not the step's peak)" if p.memory is not None else ""),
             *_mesh_search_summary(plan)]
    by: dict[tuple[str, str, tuple[str, ...]], list[int]] = {}
    for c in plan.collectives:        # on a pipeline, every stage's, as often as they run
        by.setdefault((c.phase, c.kind, c.axes), []).extend([c.bytes] * c.count)
    lines.append("  collectives:")
    for (phase, kind, axes), bs in sorted(by.items()):
        lines.append(f"    {phase:9s} {kind:14s} over {','.join(axes):8s} x{len(bs):<5d} "
                     f"{size_text(sum(bs)):>12s}")
    shown: dict[str, str] = {}
    for fqn, spec in plan.params.items():
        shown.setdefault(spec_str(spec), fqn)
    lines.append("  parameter layouts (first parameter of each):")
    for spec, fqn in shown.items():
        n = sum(1 for s in plan.params.values() if spec_str(s) == spec)
        lines.append(f"    {spec:20s} x{n:<4d} e.g. {fqn}")
    for fqn, reads in plan.tied.items():
        lines.append(f"  tied weight {fqn}: stored {spec_str(plan.params[fqn])}, read as "
                     + ", ".join(spec_str(r) for r in reads))
    lines += _state_summary(plan)
    lines += _pipeline_summary(plan)
    for policy in ("selective", "full"):
        n = sum(1 for p in plan.recompute.values() if p == policy)
        if n:
            what = ("their forward in backward" if policy == "full" else
                    "all but matmul, attention and collective outputs in backward")
            lines.append(f"  activation checkpointing ({policy}): {n} of {len(plan.layers)} "
                         f"layers recompute {what}")
    lines += layers_summary(plan)
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _state_summary(plan: Plan) -> list[str]:
    """Where gradients and optimizer state live (ZeRO-1/2, offload) and the memory split."""
    lines = []
    by: dict[tuple[str, str], int] = {}
    for fqn, st in plan.param_state.items():
        # ZeRO's: the mesh axes its state is cut over (all the replicated ones, or one)
        axes = ",".join(a for a, p, q in zip(plan.mesh_axes, plan.params[fqn], st.optimizer)
                        if p != q) if st.mode in (StateMode.ZERO1, StateMode.ZERO2) else ""
        key = (st.mode, axes)
        by[key] = by.get(key, 0) + 1
    for (mode, axes), n in sorted(by.items()):
        over = f" over {axes}" if axes else ""
        lines.append(f"  {MODE_NAMES.get(mode, mode)}{over}: {n} of {len(plan.params)} "
                     "parameters")
    if plan.host_transfers:
        by_dir = {d: sum(t.bytes * t.count for t in plan.host_transfers if t.direction == d)
                  for d in DIRECTIONS}
        host_s = plan.predicted.host_s
        lines.append(f"  host link per step: {size_text(by_dir['h2d'])} host to device, "
                     f"{size_text(by_dir['d2h'])} device to host"
                     + (f"; {host_s * 1e3:.3f} ms of it outside the optimizer step, "
                        f"not overlapped" if host_s else ""))
    mem = plan.predicted.memory
    if mem is not None:
        parts = ", ".join(f"{k} {size_text(getattr(mem, k))}" for k in
                          ("parameters", "gradients", "optimizer", "activations",
                           "temporaries") if getattr(mem, k))
        host = f"; host {size_text(mem.host)}" if mem.host else ""
        at = plan.predicted.peak_phase
        lines.append(f"  peak over the step (liveness) {size_text(mem.peak)}"
                     f"{f', in {at}' if at else ''}: {parts}{host}")
    if plan.predicted.optimizer_s:
        lines.append(f"  optimizer step: {plan.predicted.optimizer_s * 1e3:.3f} ms "
                     f"(in compute)")
    return lines


def _mesh_search_summary(plan: Plan) -> list[str]:
    """The meshes a ``--gpus`` search tried (solver/meshes.py), fastest first: the tries of its
    rounds (the search "meshes"), with the search's own figures from ``solver.mesh_search``."""
    ms = plan.solver.get("mesh_search")
    tries = [t for r in named(searches(plan.solver), "meshes", top=True) for t in r.tries]
    if not ms or not tries:
        return []       # (a plan file from before the searches were recorded: no lines)
    planned = sorted((t for t in tries if t.step_time_s is not None),
                     key=lambda t: t.step_time_s)
    skipped = [t for t in tries if t.step_time_s is None and t.error is None]
    chosen = next((t for t in planned if _is_plan_of(t, plan)), None)
    lines = [f"  mesh search over {ms['gpus']} devices ({ms['gpus_per_node']} per node): "
             f"{len({_mesh_text(t) for t in tries if t not in skipped})} of "
             f"{ms['candidates']} meshes planned "
             f"in {ms['search_s']:.1f} s"]
    for t in [*planned, *(t for t in tries if t.error is not None)]:
        what = (f"{t.step_time_s * 1e3:.3f} ms" + (
            f", {t.facts['schedule']}, {t.facts['microbatches']} microbatches"
            if t.facts.get("microbatches") else "") if t.step_time_s is not None
            else f"no plan: {t.error[:90]}")
        lines.append(f"    {_mesh_text(t):22s} {what}{'  <- chosen' if t is chosen else ''}")
    if skipped:
        lines.append(f"    not planned (time budget of {ms.get('time_budget_s', 0):.0f} s, "
                     f"--search-budget): " + ", ".join(_mesh_text(t) for t in skipped))
    return lines


def _shape_text(sizes: list[tuple[str, int]]) -> str:
    """A mesh as its shape and axes, e.g. ``2x4 (pp,tp)``, the axes of one device left out
    (mesh.py ``split_axes``)."""
    kept = split_axes(sizes)
    return f"{'x'.join(str(n) for _, n in kept)} ({','.join(a for a, _ in kept)})"


def _mesh_text(t: TryRecord) -> str:
    m = t.changes.get("mesh") or {}
    return _shape_text([(a, m.get(a, 1)) for a in ("pp", "dp", "tp")])


def _is_plan_of(t: TryRecord, plan: Plan) -> bool:
    """Whether try ``t`` gave ``plan``: its mesh, and its microbatches where it has a
    pipeline (the chosen mesh is tried again at other counts)."""
    m = plan.pipeline.microbatches if plan.pipeline else None
    return _mesh_text(t) == _shape_text(list(zip(plan.mesh_axes, plan.mesh_shape))) and \
        t.step_time_s is not None and t.facts.get("microbatches") == m


def _pipeline_summary(plan: Plan) -> list[str]:
    pl = plan.pipeline
    lines = []
    search = named(searches(plan.solver), "pipeline axis", top=True)
    if search:
        parts = [f"{t.changes.get('pipeline') or 'none'} " + (
            f"{t.step_time_s * 1e3:.3f} ms" + (f" ({t.facts['microbatches']} microbatches)"
                                               if t.facts.get("microbatches") else "")
            if t.step_time_s is not None else f"no plan: {(t.error or '')[:80]}")
            + (" <- chosen" if t.chosen else "") for t in search[0].tries]
        lines.append("  pipeline search (pipeline='auto'): " + "; ".join(parts))
    if pl is None:
        return lines
    v, m = pl.virtual_stages, pl.microbatches
    p = len(pl.stages) // v
    lines.append(f"  pipeline over {pl.axis}: {pl.schedule}, {m} microbatches, "
                 f"{len(pl.stages)} stages on {p} ranks "
                 f"(bubble {balanced_bubble(pl.schedule, p, m):.0%} when balanced)")
    for st in pl.stages:
        what = (f"{st.layers[0]} .. {st.layers[-1].rsplit('.', 1)[-1]}" if len(st.layers) > 1
                else (st.layers[0] if st.layers else "no layer"))
        lines.append(f"    stage {st.index}: {what} ({len(st.layers)} layers); per microbatch "
                     f"compute {st.predicted.compute_s * 1e3:.3f} ms + comm "
                     f"{st.predicted.comm_s * 1e3:.3f} ms; ILP memory sum "
                     f"{size_text(st.predicted.ilp_sum_bytes)}")
    return lines


def layers_summary(plan: Plan) -> list[str]:
    """The layers found, one line per run of identical layers of a container."""
    if not plan.layers:
        return ["  layers: none found (no module path with a numbered block)"]
    lines = [f"  layers: {len(plan.layers)}"]
    runs: list[list[Layer]] = []
    for layer in plan.layers:
        last = runs[-1][-1] if runs else None
        if last is not None and layer.same_as == last.same_as and \
                layer.name.rsplit(".", 1)[0] == last.name.rsplit(".", 1)[0]:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    strategies = plan.strategies()
    for run in runs:
        first, last = run[0], run[-1]
        names = first.name if len(run) == 1 else f"{first.name} .. {last.name.rsplit('.', 1)[1]}"
        same = ""
        if len(run) > 1:
            # One decision per group in the ILP; the passes after it (per-parameter offload,
            # per-layer checkpointing) may give some of its layers other strategies.
            kinds = len({tuple(strategies.get(n) for n in layer.nodes) for layer in run})
            same = ", identical (decided once)" if kinds == 1 else \
                f", identical ops in {kinds} different layouts"
        lines.append(f"    {names:32s} x{len(run):<4d} {len(first.nodes)} nodes each{same}")
    return lines


def explain(plan: Plan) -> str:
    """One line per node: the strategy it runs."""
    strategies = plan.strategies()
    return "\n".join(f"{n.name:40s} {n.op:45s} {strategies[n.name]}" for n in plan.nodes)


def ranges(numbers) -> str:
    """0,1,2,3,7 -> '0-3, 7'."""
    out: list[list[int]] = []
    for x in sorted(set(numbers)):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def size_text(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the figure >= 1, sign kept: a tiny model's
    plan must not read "0.00 GiB" (and its snapshot must show a change in memory or traffic).
    The one byte formatting of the plan's text and of the tools (diff, explain)."""
    sign, n = ("-" if nbytes < 0 else ""), abs(nbytes)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n:.0f} B"
