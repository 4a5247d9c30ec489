"""A plan as one self-contained HTML page of plots: ``autoshard report plan.json -o report.html``.

The page carries its figures as base64 PNG (matplotlib), so the file travels alone (a mail, a CI
artifact) and opens in any browser without a server:

- the predicted step broken into compute, the communication it waits for per mesh axis and, on
  a pipeline, the bubble; beside it the gradient sync hidden behind backward, per axis;
- the memory of one device broken into parameters, gradients, optimizer state, activations and
  temporaries at the step's peak (and the bytes offloaded to the host) against the budget; on a
  pipeline, each rank's stages' peaks;
- a map of the placements layer by layer: one row per repeated layer, one column per parameter
  of the layer and per matmul-like op, each cell coloured by its placement;
- on a pipeline, the schedule as a Gantt chart (:func:`gantt_slots`).

Each part is computed by a function of the plan alone (``step_parts``, ``memory_parts``,
``layer_map``, ``gantt_slots``), then drawn; matplotlib is imported only to draw, so the CLI and
the library do not pay for it elsewhere. :func:`summary_json` is what ``autoshard plan --json``
prints.
"""
from __future__ import annotations

import base64
import html
import io
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autoshard.cluster import Cluster
from autoshard.cost.memory import default_budget
from autoshard.files import check_output, write_output
from autoshard.schedules import SPLIT_BACKWARD, simulate_schedule
from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, Replicate, Shard, StateMode, spec_str
from autoshard.plans import Plan
from autoshard.plans.records import Pipeline

# ---------------------------------------------------------------------------- the plan's figures


def step_parts(plan: Plan) -> list[tuple[str, float]]:
    """The predicted step as consecutive parts (label, seconds) that add up to it: compute, the
    communication the step waits for on each mesh axis, and on a pipeline the bubble (the idle
    share of the schedule's compute, which ``compute_s`` includes). A plan made before
    communication was priced per axis has one "exposed comm" part."""
    p = plan.predicted
    compute = float(p.compute_s)
    parts = []
    bubble = pipeline_bubble(plan.pipeline) if plan.pipeline else 0.0
    parts.append(("compute", compute - bubble))
    exposed = p.exposed_comm_s
    if exposed:
        parts += [(f"comm over {a}", float(exposed[a])) for a in plan.mesh_axes if a in exposed]
    if bubble:
        parts.append(("pipeline bubble", bubble))
    if p.host_s:            # parameter offload's copies in and out (not overlapped)
        parts.append(("host link", float(p.host_s)))
    rest = float(p.step_time_s) - sum(s for _, s in parts)
    if not exposed:
        parts.append(("exposed comm", rest))
    elif abs(rest) > 1e-9 * max(1.0, float(p.step_time_s)):
        parts.append(("other", rest))
    return [(label, s) for label, s in parts if s > 0]


def hidden_parts(plan: Plan) -> list[tuple[str, float]]:
    """Gradient sync hidden behind backward compute, per mesh axis (not part of the step)."""
    hidden = plan.predicted.overlapped_comm_s
    if hidden is None:
        return []
    return [(f"hidden over {a}", float(hidden[a])) for a in plan.mesh_axes if hidden.get(a)]


def pipeline_bubble(pl: Pipeline) -> float:
    """Seconds of the schedule's compute that the busiest rank waits (docs/cost-model.md §10):
    the schedule's compute over every microbatch, its order of actions run with the stages'
    compute (:func:`gantt_slots`' split of it into F, B and W), less that rank's own work,
    ``m`` times the sum of its stages' seconds per microbatch."""
    compute = [st.predicted.compute_s for st in pl.stages]
    ranks = pl.ranks
    busy = pl.microbatches * max(sum(compute[k] for k in pl.stages_of(r)) for r in range(ranks))
    step = simulate_schedule(pl.schedule, ranks, pl.microbatches, *_shares(pl, compute))
    return max(0.0, step - busy)


MEMORY_PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def memory_parts(plan: Plan) -> list[tuple[str, float]]:
    """What one device holds at the step's peak (the liveness of values, docs/cost-model.md
    §4.5), part by part; empty when the plan does not record it (a pipelined plan: see
    :func:`stage_peaks`)."""
    mem = plan.predicted.memory
    if mem is None:
        return []
    return [(k, float(getattr(mem, k))) for k in MEMORY_PARTS]


def stage_peaks(plan: Plan) -> list[list[tuple[int, float]]]:
    """On a pipeline, per rank of the pipeline axis, its stages and their peaks (a rank holds
    ``virtual_stages`` of them: plans.py ``Pipeline.stages_of``)."""
    pl = plan.pipeline
    if pl is None:
        return []
    return [[(k, float(pl.stages[k].predicted.ilp_sum_bytes)) for k in pl.stages_of(r)]
            for r in range(pl.ranks)]


def budget_bytes(plan: Plan) -> float | None:
    """The memory budget the plan was made for: its option, else the default budget of the
    cluster it records (cost/memory.py ``default_budget``); None for an old file naming a
    profile without its figures."""
    if plan.options.memory_budget is not None:
        return float(plan.options.memory_budget)
    return float(default_budget(plan.cluster)) if isinstance(plan.cluster, Cluster) else None


# Ops whose placement decides a layer's layout (and its collectives): the matmul-like ones.
_MATMUL = re.compile(r"mm|bmm|addmm|baddbmm|matmul|linear|einsum|conv\w*|\w*attention\w*")


@dataclass(frozen=True)
class LayerMap:
    """Placements layer by layer: ``rows`` the layers (with their stage and checkpointing),
    ``columns`` the parameters (by name within the layer) then the matmul-like ops (by kind
    and rank within the layer: ``linear 3``), ``cells[i][j]`` the placement spec of column
    ``j`` in layer ``i`` ("" where the layer has none) and ``modes[i][j]`` a parameter's
    ZeRO/offload mode ("" if none); ``outside``: the parameters outside every layer."""

    rows: tuple[str, ...]
    columns: tuple[str, ...]
    cells: tuple[tuple[str, ...], ...]
    modes: tuple[tuple[str, ...], ...]
    outside: tuple[str, ...]


def layer_map(plan: Plan) -> LayerMap:
    layers = sorted(plan.layers, key=lambda l: -len(l.name))   # a nested layer claims first
    of: dict[str, dict[str, str]] = {l.name: {} for l in plan.layers}
    outside = []
    for fqn in plan.params:
        layer = next((l.name for l in layers if fqn.startswith(l.name + ".")), None)
        if layer is None:
            outside.append(fqn)
        else:
            of[layer][fqn[len(layer) + 1:]] = fqn
    ops = {n.name: n for n in plan.nodes}
    param_cols: dict[str, None] = {}
    op_cols: dict[str, None] = {}
    rows = []
    for layer in plan.layers:
        row: dict[str, tuple[str, str]] = {}
        for short, fqn in of[layer.name].items():
            st = plan.param_state.get(fqn)
            row[short] = (spec_str(plan.params[fqn]), st.mode if st else "")
            param_cols.setdefault(short, None)
        seen: dict[str, int] = {}
        for name in layer.nodes:
            n = ops.get(name)
            if n is None or n.op == "placeholder" or not n.outputs:
                continue
            kind = _op_kind(n.op)
            if not _MATMUL.fullmatch(kind):
                continue
            seen[kind] = seen.get(kind, 0) + 1
            column = f"{kind} {seen[kind]}"
            row[column] = (spec_str(n.outputs[0]), "")
            op_cols.setdefault(column, None)
        rows.append((layer.name, row))
    order = [*param_cols, *op_cols]
    stage = {name: st.index for st in (plan.pipeline.stages if plan.pipeline else ())
             for name in st.layers}
    labels, cells, modes = [], [], []
    for name, row in rows:
        cells.append(tuple(row.get(c, ("", ""))[0] for c in order))
        modes.append(tuple(row.get(c, ("", ""))[1] for c in order))
        extra = [f"stage {stage[name]}"] if name in stage else []
        if name in plan.recompute:
            extra.append(f"{plan.recompute[name]} ckpt")
        labels.append(name + (f" ({', '.join(extra)})" if extra else ""))
    return LayerMap(tuple(labels), tuple(order), tuple(cells), tuple(modes), tuple(outside))


def _op_kind(op: str) -> str:
    """``aten.linear.default`` -> ``linear``."""
    parts = op.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] == "aten" else parts[0]


@dataclass(frozen=True)
class Slot:
    """One forward ("F"), backward ("B") or weight pass ("W", split backward) of one microbatch
    on one stage, on its rank."""

    rank: int
    stage: int
    microbatch: int
    kind: str
    start: float
    seconds: float


def gantt_slots(pl: Pipeline) -> list[Slot]:
    """The schedule's slots over one step, from the stages' predicted seconds per microbatch
    (compute and communication; backward taken as twice forward, the matmul rule of
    docs/cost-model.md §3.5). Each rank runs its slots in the schedule's order
    (autoshard/schedules.py ``schedule_order``, torch's for the split-backward schedules); a
    slot starts once its rank is free and its input has arrived: a forward the previous
    stage's forward of that microbatch, a backward the next stage's backward (or its own
    forward on the last stage), a weight pass its backward (``simulate_schedule``, which
    prices the plan's stages the same way)."""
    slots: list[tuple] = []
    simulate_schedule(pl.schedule, pl.ranks, pl.microbatches,
                      *_shares(pl, [st.predicted.compute_s + st.predicted.comm_s
                                    for st in pl.stages]), slots=slots)
    return [Slot(r, s, k, kind, start, seconds) for r, kind, s, k, start, seconds in slots]


def _shares(pl: Pipeline, seconds: list[float]) -> tuple[list[float], ...]:
    """A stage's seconds per microbatch as F, B and W: forward a third, backward the rest; a
    split backward (zero bubble, DualPipeV) is B (its input's gradient) and W (its weights'),
    a third each (autoshard/schedules.py)."""
    split = pl.schedule in SPLIT_BACKWARD
    return ([t / 3 for t in seconds], [t * (1 if split else 2) / 3 for t in seconds],
            [t / 3 if split else 0.0 for t in seconds])


# ------------------------------------------------------------------------------------- drawing

_COLORS = {"compute": "#4c72b0", "pipeline bubble": "#c8c8c8", "other": "#937860",
           "exposed comm": "#dd8452"}
_AXIS_COLORS = ("#dd8452", "#55a868", "#c44e52", "#8172b3", "#da8bc3", "#ccb974")
_MEMORY_COLORS = {"parameters": "#4c72b0", "gradients": "#55a868", "optimizer": "#c44e52",
                  "activations": "#dd8452", "temporaries": "#8172b3", "host": "#937860"}


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display), imported only when a figure is
    drawn; a clear error where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise AutoshardError("matplotlib installed to draw a plan's figures",
                             got="no module named matplotlib",
                             fix='python -m pip install "matplotlib>=3.7"') from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _axis_color(label: str, axes: tuple[str, ...]) -> str:
    name = label.rsplit(" ", 1)[-1]
    return _AXIS_COLORS[axes.index(name) % len(_AXIS_COLORS)] if name in axes else "#dd8452"


def step_figure(plan: Plan) -> Any:
    """Horizontal stacked bars in ms: the step's parts, and the sync hidden behind backward."""
    plt = pyplot()
    parts, hidden = step_parts(plan), hidden_parts(plan)
    fig, ax = plt.subplots(figsize=(9, 2.4 if hidden else 1.9))
    rows = [("step", parts)] + ([("hidden behind\nbackward", hidden)] if hidden else [])
    for y, (_, row) in enumerate(rows):
        left = 0.0
        for label, s in row:
            color = _COLORS.get(label) or _axis_color(label, plan.mesh_axes)
            ax.barh(y, s * 1e3, left=left, color=color, edgecolor="white",
                    hatch="//" if y else None, alpha=0.55 if y else 1.0,
                    label=f"{label}: {s * 1e3:.3f} ms")
            left += s * 1e3
    ax.set_yticks(range(len(rows)), [name for name, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (predicted)")
    ax.set_title(f"predicted step {plan.predicted.step_time_s * 1e3:.3f} ms")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def memory_figure(plan: Plan) -> Any:
    """One device's memory at the step's peak, part by part, against the budget (per rank and
    stage on a pipeline), and the host bytes offloaded beside it. The axis is in the unit of
    the largest bar; a budget more than 20 times that is named in the title, not drawn (it
    would shrink the bars to nothing)."""
    plt = pyplot()
    budget = budget_bytes(plan)
    parts, ranks = memory_parts(plan), stage_peaks(plan)
    host = float(plan.predicted.memory.host) if parts else 0.0
    rows: list[list[tuple[str, float, Any]]] = []
    if parts:
        rows.append([(label, b, _MEMORY_COLORS[label]) for label, b in parts])
        labels = ["device (peak)"]
        if host:
            rows.append([("host (offloaded)", host, _MEMORY_COLORS["host"])])
            labels.append("host")
        phase = plan.predicted.peak_phase
        title = f"peak {_bytes(sum(b for _, b in parts))} per device" + (
            f", in {phase}" if phase else "")
    else:
        cmap = plt.get_cmap("tab20")
        rows = [[(f"stage {k}", b, cmap(k % 20)) for k, b in stages] for stages in ranks]
        labels = [f"rank {r} of {plan.pipeline.axis}" for r in range(len(ranks))]
        title = (f"peak per rank of {plan.pipeline.axis}: its stages' peaks, microbatches in "
                 f"flight; largest {_bytes(plan.predicted.ilp_sum_bytes)}")
    top = max([sum(b for _, b, _ in row) for row in rows] + [1.0])
    unit, scale = _unit(top)
    fig, ax = plt.subplots(figsize=(9, max(2.2, 0.35 * len(labels) + 1.6)))
    for y, row in enumerate(rows):
        left = 0.0
        for label, b, color in row:
            ax.barh(y, b / scale, left=left, color=color, edgecolor="white",
                    hatch=".." if label.startswith("host") else None,
                    label=f"{label}: {_bytes(b)}")
            left += b / scale
    if budget is not None and budget <= 20 * top:
        ax.axvline(budget / scale, color="black", linestyle="--", linewidth=1.2,
                   label=f"budget: {_bytes(budget)}")
    elif budget is not None:
        title += f" (budget {_bytes(budget)}, off the scale)"
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    if len(ax.get_legend_handles_labels()[1]) <= 24:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _unit(nbytes: float) -> tuple[str, float]:
    """The largest binary unit that keeps ``nbytes`` at 1 or more."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, float(scale)
    return "bytes", 1.0


def _bytes(nbytes: float) -> str:
    unit, scale = _unit(nbytes)
    return f"{nbytes / scale:.2f} {unit}" if scale > 1 else f"{nbytes:.0f} bytes"


def _short(spec: str) -> str:
    """``[R, S(0)]`` -> ``R S0``: a cell's text."""
    return re.sub(r"S\((\d+)\)", r"S\1", spec.strip("[]")).replace(",", "")


def layer_figure(plan: Plan) -> Any | None:
    """The layer map (:func:`layer_map`) as a grid of coloured cells, one colour per placement;
    a hatched cell is a parameter whose gradients or optimizer state are sharded apart from it
    (ZeRO-1/2) or offloaded. None when the plan has no repeated layers."""
    lm = layer_map(plan)
    if not lm.rows or not lm.columns:
        return None
    plt = pyplot()
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch
    specs = sorted({c for row in lm.cells for c in row if c},
                   key=lambda s: (s.count("S"), s.count("P"), s))
    palette = plt.get_cmap("tab20").colors + plt.get_cmap("tab20b").colors
    index = {s: i for i, s in enumerate(specs)}
    grid = [[index[c] if c else -1 for c in row] for row in lm.cells]
    import numpy as np
    data = np.ma.masked_less(np.array(grid, dtype=float), 0)
    colors = ListedColormap([palette[i % len(palette)] for i in range(max(1, len(specs)))])
    nr, nc = len(lm.rows), len(lm.columns)
    fig, ax = plt.subplots(figsize=(min(24, 3.5 + 0.55 * nc), min(40, 2.8 + 0.2 * nr)))
    ax.imshow(data, cmap=colors, vmin=-0.5, vmax=max(1, len(specs)) - 0.5, aspect="auto",
              interpolation="nearest")
    for i, row in enumerate(lm.modes):
        for j, mode in enumerate(row):
            if mode:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch="///",
                                           edgecolor="black", linewidth=0))
    if nr * nc <= 1200:
        for i, row in enumerate(lm.cells):
            for j, c in enumerate(row):
                if c:
                    ax.text(j, i, _short(c), ha="center", va="center", fontsize=6)
    ax.set_xticks(range(nc), lm.columns, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(nr), lm.rows, fontsize=7 if nr <= 48 else 5)
    hatched = any(m for row in lm.modes for m in row)
    ax.set_title(f"placements per layer ({nr} layers): parameters as stored, then the "
                 f"matmul-like ops' outputs" + ("; hatched: ZeRO-1/2 or offloaded state"
                                                if hatched else ""), fontsize=9)
    handles = [Patch(color=palette[i % len(palette)], label=s) for s, i in index.items()]
    if hatched:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="///",
                             label="gradients/optimizer state sharded apart or offloaded"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7,
              frameon=False, title=f"placement over ({', '.join(plan.mesh_axes)})",
              title_fontsize=7)
    fig.tight_layout()
    return fig


def gantt_figure(pl: Pipeline) -> Any:
    """The schedule (:func:`gantt_slots`) as a Gantt chart: one row per rank of the pipeline
    axis, forwards blue, backwards orange (a rank's second stage lighter when interleaved),
    white space the bubble."""
    plt = pyplot()
    slots = gantt_slots(pl)
    ranks = len(pl.stages) // pl.virtual_stages
    fig, ax = plt.subplots(figsize=(10, 0.35 * ranks + 1.5))
    base = {"F": (0.30, 0.45, 0.69), "B": (0.87, 0.52, 0.32), "W": (0.33, 0.66, 0.41)}
    label_them = pl.microbatches * pl.virtual_stages <= 16
    for s in slots:
        chunk = s.stage // ranks
        color = tuple(c + (1 - c) * 0.45 * chunk for c in base[s.kind])
        ax.barh(s.rank, s.seconds * 1e3, left=s.start * 1e3, color=color, edgecolor="white",
                linewidth=0.3)
        if label_them:
            ax.text((s.start + s.seconds / 2) * 1e3, s.rank, str(s.microbatch), ha="center",
                    va="center", fontsize=6, color="white")
    ax.set_yticks(range(ranks), [f"rank {r}: stage{'s' if pl.virtual_stages > 1 else ''} "
                                 + ", ".join(map(str, pl.stages_of(r))) for r in range(ranks)],
                  fontsize=8)
    ax.invert_yaxis()
    end = max(s.start + s.seconds for s in slots)
    busy = max(sum(s.seconds for s in slots if s.rank == r) for r in range(ranks))
    ax.set_xlabel("ms (forward blue, backward orange" + (
        ", its weights' gradient green" if pl.schedule in SPLIT_BACKWARD else "")
        + "; a microbatch's number on it; white space: the bubble)")
    ax.set_title(f"{pl.schedule} over {pl.axis}: {len(pl.stages)} stages on {ranks} ranks, "
                 f"{pl.microbatches} microbatches; busiest rank idle "
                 f"{1 - busy / end:.0%} of {end * 1e3:.3f} ms (predicted)", fontsize=9)
    fig.tight_layout()
    return fig


def save_gantt(pl: Pipeline, path: str | Path, dpi: int = 110) -> Path:
    """The Gantt chart of a pipeline's schedule written as a PNG."""
    fig = gantt_figure(pl)
    return _save(fig, path, dpi)


def _save(fig: Any, path: str | Path, dpi: int) -> Path:
    import matplotlib.pyplot as plt
    path = Path(path)
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as e:
        raise AutoshardError("a writable path for the figure", got=f"{path}: {e.strerror}",
                             fix="write into an existing directory you may write to") from e
    finally:
        plt.close(fig)
    return path


def png_base64(fig: Any, dpi: int = 100) -> str:
    """A figure as base64 PNG text (closed afterwards), for an ``<img src="data:...">``."""
    import matplotlib.pyplot as plt
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=dpi)
    finally:
        plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


# ----------------------------------------------------------------------------------- the page

@dataclass(frozen=True)
class Section:
    """One figure of the page: its anchor id, heading, PNG (base64) and caption."""

    id: str
    title: str
    png: str
    caption: str


def sections(plan: Plan) -> list[Section]:
    """The page's figures, in order; the layer map only when the plan has layers, the Gantt
    chart only on a pipeline."""
    out = []
    parts = ", ".join(f"{label} {s * 1e3:.3f} ms" for label, s in step_parts(plan))
    hidden = hidden_parts(plan)
    out.append(Section("step", "Step time", png_base64(step_figure(plan)),
                       f"Predicted step: {parts}." + (
                           " Hidden behind backward compute (not in the step): "
                           + ", ".join(f"{a.removeprefix('hidden ')} {s * 1e3:.3f} ms"
                                       for a, s in hidden) + "." if hidden else "")))
    budget = budget_bytes(plan)
    mem = ", ".join(f"{k} {_bytes(b)}" for k, b in memory_parts(plan)) or \
        "per stage, with its microbatches in flight"
    out.append(Section("memory", "Memory per device", png_base64(memory_figure(plan)),
                       f"At the step's peak: {mem}; budget "
                       + (f"{_bytes(budget)}." if budget is not None else
                          f"unknown (cluster {plan.cluster_text}).")))
    fig = layer_figure(plan)
    if fig is not None:
        out.append(Section("layers", "Placements per layer", png_base64(fig),
                           f"{len(plan.layers)} layers; each cell the spec over mesh axes "
                           f"({', '.join(plan.mesh_axes)}): S(d) splits dim d, R replicates, "
                           f"P holds a summand."))
    if plan.pipeline is not None:
        pl = plan.pipeline
        out.append(Section("pipeline", "Pipeline schedule", png_base64(gantt_figure(pl)),
                           f"{pl.schedule}, {pl.microbatches} microbatches, {len(pl.stages)} "
                           f"stages over {pl.axis}; slots from each stage's predicted seconds "
                           f"per microbatch, backward taken as twice forward."))
    return out


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
img { max-width: 100%; height: auto; border: 1px solid #ddd; }
figcaption, .meta { color: #555; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.85em; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: left; }
pre { background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.8em; }
"""


def render_html(plan: Plan, figures: list[Section] | None = None) -> str:
    """The report page of ``plan``: headline figures, the figures (``figures``, default
    :func:`sections`), the parameters outside the repeated layers, and the plan's text
    summary."""
    esc = html.escape
    dims = "x".join(map(str, plan.mesh_shape))
    title = f"autoshard plan {plan.model or '(model not named)'} on mesh {dims}"
    p = plan.predicted
    head = (f"mesh {dims} ({', '.join(plan.mesh_axes)}), cluster {plan.cluster_text}, "
            f"{'training' if plan.training else 'inference'}; predicted step "
            f"{p.step_time_s * 1e3:.3f} ms, peak memory "
            f"{_bytes(plan.predicted.peak_bytes)} per device; solver {plan.solver['status']}")
    body = [f"<h1>{esc(title)}</h1>", f'<p class="meta">{esc(head)}</p>']
    body += [f'<p class="meta">warning: {esc(w)}</p>' for w in plan.warnings]
    for s in sections(plan) if figures is None else figures:
        body.append(f'<section id="{s.id}"><h2>{esc(s.title)}</h2><figure>'
                    f'<img id="img-{s.id}" alt="{esc(s.title)}" '
                    f'src="data:image/png;base64,{s.png}">'
                    f"<figcaption>{esc(s.caption)}</figcaption></figure></section>")
    outside = layer_map(plan).outside if plan.layers else tuple(plan.params)
    if outside:
        rows = "".join(f"<tr><td>{esc(f)}</td><td>{esc(spec_str(plan.params[f]))}</td>"
                       f"<td>{esc(_state(plan, f))}</td></tr>" for f in outside)
        body.append('<section id="params"><h2>Parameters outside the repeated layers</h2>'
                    "<table><tr><th>parameter</th><th>stored as</th>"
                    f"<th>gradients / optimizer state</th></tr>{rows}</table></section>")
    body.append(f'<section id="summary"><h2>Summary</h2><pre>{esc(plan.summary())}</pre>'
                "</section>")
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{esc(title)}</title><style>{_CSS}</style></head>\n<body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def _state(plan: Plan, fqn: str) -> str:
    st = plan.param_state.get(fqn)
    if st is None:
        return "with the parameter"
    return (f"{st.mode}: gradients {spec_str(st.grad)}, optimizer {spec_str(st.optimizer)}"
            + (", on the host" if st.offload != OffloadLevel.NONE else ""))


def write_report(plan: Plan | str | Path, output: str | Path) -> list[str]:
    """Write the report page of ``plan`` (a Plan or a plan file) to ``output``; the titles of
    the figures it holds."""
    if not isinstance(plan, Plan):
        check_output(output, [("plan file", plan)], suffix=".html")
        plan = Plan.load(plan)
    figures = sections(plan)
    write_output(output, render_html(plan, figures), what="report")
    return [f.title.lower() for f in figures]


# ------------------------------------------------------------------------ the summary as JSON

def techniques(plan: Plan) -> dict[str, Any]:
    """What the plan does beyond placing tensors, counted: parameters stored sharded, under
    ZeRO-1/2 or offloaded, layers checkpointed per policy, gradient buckets, the pipeline."""
    modes = dict.fromkeys(StateMode, 0)
    for st in plan.param_state.values():
        modes[st.mode] = modes.get(st.mode, 0) + 1
    policies = {"selective": 0, "full": 0}
    for policy in plan.recompute.values():
        policies[policy] = policies.get(policy, 0) + 1
    pl = plan.pipeline
    return {"params": len(plan.params),
            "sharded_params": sum(1 for s in plan.params.values()
                                  if any(isinstance(x, Shard) for x in s)),
            "replicated_params": sum(1 for s in plan.params.values()
                                     if all(isinstance(x, Replicate) for x in s)),
            **modes, "recompute": policies, "layers": len(plan.layers),
            "gradient_buckets": len({c.node for c in plan.collectives if c.members}),
            "pipeline": None if pl is None else {
                "axis": pl.axis, "schedule": pl.schedule, "microbatches": pl.microbatches,
                "stages": len(pl.stages), "virtual_stages": pl.virtual_stages,
                "bubble_s": pipeline_bubble(pl)}}


def summary_json(plan: Plan, *, seconds: float | None = None,
                 output: str | None = None) -> dict[str, Any]:
    """The plan's summary for scripts (``autoshard plan --json``): the model and mesh, the
    predicted step and its parts, the memory peak and its parts, the techniques used, the
    solver's verdict, the wall-clock timings (``seconds``: the whole command) and where the
    plan was written (``output``, or None)."""
    p = plan.predicted
    mem = p.memory.to_json() if p.memory is not None else {}
    return {
        "model": plan.model,
        "mesh": {"shape": list(plan.mesh_shape), "axes": list(plan.mesh_axes),
                 "cluster": plan.cluster_name},
        "training": plan.training,
        "predicted": {
            "step_time_s": p.step_time_s, "compute_s": p.compute_s, "comm_s": p.comm_s,
            "exposed_comm_s": dict(p.exposed_comm_s or {}),
            "overlapped_comm_s": dict(p.overlapped_comm_s or {}),
            "optimizer_s": p.optimizer_s,
            "parts": dict(step_parts(plan))},
        "memory": {"peak_bytes": float(p.peak_bytes), "peak_phase": p.peak_phase,
                   "bound_bytes": p.ilp_sum_bytes, "budget_bytes": budget_bytes(plan),
                   **{k: mem[k] for k in (*MEMORY_PARTS, "host") if k in mem}},
        "techniques": techniques(plan),
        "solver": {k: plan.solver[k] for k in ("status", "gap", "variables", "decisions")
                   if k in plan.solver},
        "timings": {**plan.timings, **({"total_s": seconds} if seconds is not None else {})},
        "warnings": list(plan.warnings),
        "output": output,
    }
