"""autoshard against the hand-written baselines, every zoo model on several meshes.

For every model the script traces once (the trace does not depend on the mesh), then on each
mesh plans with autoshard (``plan_traced``, default options: ZeRO-2/3 chosen per parameter,
checkpointing and optimizer offload as "auto" decides) and with every baseline of ``CATALOGUE``:
the hand-written layouts of ``autoshard.solver.baselines`` (``dp``, ``megatron``,
``megatron-dp`` through ``baseline_plan``; ``fsdp``, ``fsdp-tp`` through ``stored_plan``) and
data parallelism with ZeRO-1 or ZeRO-2 (``baseline_plan(traced, mesh, "dp", zero=...)``), the
last four each without and with full activation checkpointing (``+ckpt``), all priced by the
same cost model. It prints one row per (model, mesh): predicted step times, the best baseline
over autoshard, autoshard's peak memory, the solver status and gap, and the memory techniques
autoshard's plan uses. A row where autoshard is slower than the best baseline (or finds no plan
where a baseline does) is flagged ``WORSE`` and listed after the table with a first diagnosis.

    python benchmarks/compare_plans.py                        # everything (~1 h on 2 cores)
    python benchmarks/compare_plans.py --quick                # 4 models on 8 and 4x2
    python benchmarks/compare_plans.py --models gpt2,llama-tiny --meshes 8,2x4 --baselines dp,fsdp
    python benchmarks/compare_plans.py --out benchmarks/RESULTS.md
    python benchmarks/compare_plans.py --replot benchmarks/RESULTS.md   # its chart, from its table

With ``--out``, the table's step times are also drawn as a grouped bar chart (one panel per
model, one group per mesh, one bar per plan) written next to the results file
(``compare_plans.png``) and linked from the section; ``--replot`` redraws that chart from the
table a section already holds, without planning anything.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.ir import Shard  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.options import PlanOptions  # noqa: E402
from autoshard.solver import alternatives, assemble, planner  # noqa: E402
from autoshard.solver.baselines import (BASELINES, STORED, baseline_plan,  # noqa: E402
                                        fsdp_tp_layouts, stored_plan, zero3_layouts)
from autoshard.solver.build import build_problem  # noqa: E402
from autoshard.solver.ilp import Infeasible, NoSolution  # noqa: E402
from autoshard.trace.export import trace  # noqa: E402
from autoshard.trace.layers import checkpointable  # noqa: E402
from autoshard.zoo.registry import ZOO, get_model  # noqa: E402

# The columns, each a hand-written plan: name -> (how it is made, the options it plans with).
# "pinned": ``baseline_plan`` (weights read where they lie); "stored": ``stored_plan`` (weights
# stored so, gathered where an op reads them whole). ``dp``/``megatron``/``megatron-dp`` keep
# the planner's default recompute ("auto": checkpointing where memory binds); the rest are the
# plans a user writes by hand with checkpointing off or on everywhere ("+ckpt": recompute="full").
CATALOGUE: dict[str, tuple[str, str, dict]] = {
    "dp": ("pinned", "dp", {}),
    "megatron": ("pinned", "megatron", {}),
    "megatron-dp": ("pinned", "megatron-dp", {}),
    "fsdp": ("stored", "fsdp", {"recompute": "none"}),
    "fsdp+ckpt": ("stored", "fsdp", {"recompute": "full"}),
    "fsdp-tp": ("stored", "fsdp-tp", {"recompute": "none"}),
    "fsdp-tp+ckpt": ("stored", "fsdp-tp", {"recompute": "full"}),
    "zero1": ("pinned", "dp", {"zero": "zero1", "recompute": "none"}),
    "zero1+ckpt": ("pinned", "dp", {"zero": "zero1", "recompute": "full"}),
    "zero2": ("pinned", "dp", {"zero": "zero2", "recompute": "none"}),
    "zero2+ckpt": ("pinned", "dp", {"zero": "zero2", "recompute": "full"}),
}
assert {v[1] for v in CATALOGUE.values()} <= set(BASELINES + STORED)
ALL = tuple(CATALOGUE)
QUICK_MODELS = "mlp-tiny,gpt2,gpt3-1.3b,llama3-8b"
QUICK_MESHES = "8,4x2"

MESHES = "8,2x4,4x2,2x2x2"
LLAMA3_SEQ = 2048     # llama3 presets default to their 8192 context; 2048 keeps tracing sane
SECTION = "compare_plans"
TOL = 1e-6            # relative: autoshard counts as worse only beyond float noise


def seq_for(name: str) -> int | None:
    return LLAMA3_SEQ if name.startswith("llama3") else None


def parse_meshes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(n) for n in m.lower().split("x")) for m in text.split(",") if m.strip()]


def mesh_str(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def short(e: BaseException, n: int = 160) -> str:
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return text if len(text) <= n else text[: n - 3] + "..."


def verdict(e: BaseException) -> Infeasible | NoSolution | None:
    """The solver's verdict behind a planner error: the nearest Infeasible or NoSolution through
    causes and contexts (the planner re-raises its last search's error with the memory
    techniques it tried, without chaining it as the cause)."""
    seen: set[int] = set()
    queue: list[BaseException | None] = [e]
    while queue:
        x = queue.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (Infeasible, NoSolution)):
            return x
        queue += [x.__cause__, x.__context__]
    return None


def failure_cell(e: BaseException) -> str:
    """What a plan's failure means, from the solver verdict the planner's error chains: OOM (no
    plan fits memory), a solver timeout, or an error."""
    cause = verdict(e) if isinstance(e, AutoshardError) else None
    if isinstance(cause, Infeasible) and cause.least_host is not None:
        return (f"infeasible: host OOM (what fits the device keeps at least "
                f"{cause.least_host / 2**30:.1f} GiB on the host)")
    if isinstance(cause, Infeasible):
        bound = "" if cause.exact else "at least "
        return f"infeasible: OOM (needs {bound}{cause.least_memory / 2**30:.1f} GiB)"
    if isinstance(cause, NoSolution):
        return "no solution: solver time limit (not OOM)"
    return "error: " + short(e)


def stored_baseline(traced, mesh: Mesh, name: str, **kw):
    """``stored_plan``, with activation checkpointing as ``kw["recompute"]`` asks.

    ``solver.alternatives.plan_stored`` builds its problem without checkpointing whatever the
    options say; for recompute="full" this builds it with every checkpointable layer recomputed,
    solves it under the stored layouts as ``plan_stored`` does, and assembles the plan with the
    layers recomputed (the figures the ILP solved for). Where ``stored_plan`` checkpoints by
    itself, its plan is used as is."""
    layers = dict.fromkeys(checkpointable(traced.graph, traced.layers), "full")
    if kw.get("recompute") != "full" or not layers:
        return stored_plan(traced, mesh, name, **kw)
    options = PlanOptions(training=traced.training, zero="none", offload="none").replace(**kw)
    layouts = zero3_layouts(traced, mesh) if name == "fsdp" else fsdp_tp_layouts(traced, mesh)
    t0 = time.perf_counter()
    built = build_problem(traced, mesh, options, recompute=layers)
    build_s = time.perf_counter() - t0
    plan = alternatives._solve(traced, mesh, options, built,
                               pins=alternatives._pins(built, layouts), exclude=(),
                               model_name="", label=f"{name}, checkpointed")
    if plan is None:
        raise AutoshardError(f"a plan with the {name} layouts, checkpointed, within the memory "
                             f"budget and time limit", got="none found",
                             fix="raise memory_budget or time_limit_s")
    return assemble.assemble(traced, mesh, plan.strategies(), options, solver=dict(plan.solver),
                            model_name="", timings={**plan.timings, "build_s": build_s},
                            recompute=layers)


def plan_row(name: str, traced, shape: tuple[int, ...], cluster: str, time_limit: float,
             columns: tuple[str, ...] = ALL) -> dict:
    mesh = Mesh(shape, cluster=cluster)
    row: dict = {"model": name, "mesh": mesh_str(shape), "columns": columns}
    t0 = time.perf_counter()
    try:
        p = planner.plan_traced(traced, mesh, time_limit_s=time_limit, model_name=name)
        row.update(auto=p.predicted.step_time_s, peak=p.predicted.ilp_sum_bytes,
                   auto_s=time.perf_counter() - t0, status=p.solver["status"], gap=p.solver["gap"],
                   objective=p.solver.get("objective"), merged=p.solver.get("merged_axes"),
                   techniques=techniques(p), small=small_sharded(traced, p))
    except Exception as e:  # noqa: BLE001 -- a failing model is a row, not a crash
        traceback.print_exc()
        row["auto_err"] = failure_cell(e)
    for b in columns:
        how, base, options = CATALOGUE[b]
        if how == "stored" and len(shape) > 2:
            row[b + "_err"] = "n/a (1-D, 2-D meshes)"
            continue
        try:
            if how == "pinned":
                bp = baseline_plan(traced, mesh, base, time_limit_s=time_limit, **options)
            else:
                bp = stored_baseline(traced, mesh, base, time_limit_s=time_limit, **options)
            row[b] = bp.predicted.step_time_s
            row[b + "_peak"] = bp.predicted.ilp_sum_bytes
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, AutoshardError):
                traceback.print_exc()
            row[b + "_err"] = failure_cell(e)
    row["wall_s"] = time.perf_counter() - t0
    feasible = [(row[b], b) for b in columns if b in row]
    row["best"], row["best_name"] = min(feasible) if feasible else (None, None)
    if "auto" in row:
        row["worse"] = row["best"] is not None and row["auto"] > row["best"] * (1 + TOL)
    else:
        row["worse"] = row["best"] is not None
    return row


def techniques(p) -> str:
    """What the plan does beyond placing tensors: parameters whose gradients and optimizer state
    are sharded apart from them (ZeRO-1/2) or offloaded, parameters stored sharded (ZeRO-3 or
    tensor parallel), recomputed layers, gradient buckets."""
    modes: dict[str, int] = {}
    for st in p.param_state.values():
        modes[st.mode] = modes.get(st.mode, 0) + 1
    out = [f"{label} {modes[m]}" for m, label in (("zero1", "ZeRO-1"), ("zero2", "ZeRO-2"),
                                                  ("offload", "offload"),
                                                  ("offload_params", "param offload"))
           if modes.get(m)]
    sharded = sum(1 for s in p.params.values() if any(isinstance(x, Shard) for x in s))
    if sharded:
        out.append(f"sharded {sharded}/{len(p.params)}")
    if p.recompute:
        policies = "+".join(sorted(set(p.recompute.values())))
        out.append(f"ckpt {policies} {len(p.recompute)}/{len(p.layers)} layers")
    buckets = len({c.node for c in p.collectives if c.members})
    if buckets:
        out.append(f"{buckets} buckets")
    return ", ".join(out) or "-"


SMALL = 2**20     # bytes: a parameter below 1 MiB is not worth sharding unless memory asks


def small_sharded(traced, p) -> int:
    """Parameters under 1 MiB the plan stores sharded and gathers where they are read (ZeRO-3
    style: collectives, each with its latency, for a few bytes). A bias stored sharded with its
    column-parallel weight and read where it lies is not counted: it moves nothing."""
    small = {ph.name for ph in traced.params if ph.info is not None
             and math.prod(ph.info.shape) * ph.info.dtype.itemsize < SMALL}
    return len({c.value for c in p.collectives if c.phase == "forward" and c.value in small})


def fmt_row(r: dict, columns: tuple[str, ...]) -> list[str]:
    if "trace_err" in r:
        return ([r["model"], r["mesh"], "trace failed: " + r["trace_err"]]
                + [""] * (len(head(columns)) - 3))
    ms = lambda v: f"{v * 1e3:.3f}"  # noqa: E731
    cells = [r["model"], r["mesh"], ms(r["auto"]) if "auto" in r else r["auto_err"]]
    cells += [ms(r[b]) if b in r else r.get(b + "_err", "") for b in columns]
    if "auto" in r and r["best"] is not None:
        cells.append(f"{r['best'] / r['auto']:.3f} ({r['best_name']})" if r["auto"] > 0 else "-")
    else:
        cells.append("-")
    if "auto" in r:
        cells += [f"{r['peak'] / 2**30:.3g}", r["status"], f"{r['gap']:.2%}", r["techniques"],
                  str(r["small"])]
    else:
        cells += ["-", "-", "-", "-", "-"]
    cells.append("**WORSE**" if r["worse"] else "")
    cells.append(f"{r['wall_s']:.0f}")
    return cells


def head(columns: tuple[str, ...]) -> list[str]:
    return (["model", "mesh", "autoshard ms"] + [f"{b} ms" for b in columns]
            + ["best baseline / autoshard", "autoshard peak GiB", "status", "gap", "techniques",
               "params < 1 MiB gathered per use", "flag", "wall s"])


def table(rows: list[dict], columns: tuple[str, ...] = ALL) -> str:
    h = head(columns)
    lines = ["| " + " | ".join(h) + " |", "|" + "---|" * len(h)]
    lines += ["| " + " | ".join(md_cell(c) for c in fmt_row(r, columns)) + " |" for r in rows]
    return "\n".join(lines)


def flagged(rows: list[dict], columns: tuple[str, ...] = ALL) -> list[str]:
    out = []
    for r in rows:
        if "trace_err" in r:
            out.append(f"- {r['model']}: trace failed: {r['trace_err']}")
        elif r.get("worse"):
            auto = f"{r['auto'] * 1e3:.3f} ms" if "auto" in r else r["auto_err"]
            base = ", ".join(f"{b} {r[b] * 1e3:.3f} ms" for b in columns if b in r)
            detail = ""
            if "auto" in r and r.get("objective") is not None:
                # The ILP's own objective next to the assembled prediction: they should agree.
                detail = (f" ({r['status']}, gap {r['gap']:.2%}, ILP objective "
                          f"{r['objective'] * 1e3:.3f} ms")
                detail += f", merged axes {r['merged']})" if r.get("merged") else ")"
                detail += f", best/autoshard {r['best'] / r['auto']:.4f}"
            out.append(f"- WORSE {r['model']} on {r['mesh']}: autoshard {auto}{detail}; {base}")
        elif "auto_err" in r:
            out.append(f"- {r['model']} on {r['mesh']}: autoshard {r['auto_err']}")
    return out


def plot(rows: list[dict], columns: tuple[str, ...], path: str | Path, title: str = "") -> Path:
    """The table's predicted step times as a grouped bar chart written to ``path`` (PNG): one
    panel per model (its own ms scale: models differ by 10^4), one group per mesh, one bar for
    autoshard and one per baseline; a plan that failed (out of memory, no solution, n/a) is an
    ``x`` at the panel's foot. ``rows`` are the row dicts ``table`` takes (``plan_row``'s, or
    ``rows_from_markdown``'s)."""
    from autoshard.tools.report import pyplot
    plt = pyplot()
    models = list(dict.fromkeys(r["model"] for r in rows if "trace_err" not in r))
    if not models:
        raise ValueError("no planned row to plot")
    series = ("auto", *columns)
    names = {"auto": "autoshard", **{b: b for b in columns}}
    # One colour per hand-written layout; its checkpointed twin ("+ckpt") the same, hatched.
    bases = list(dict.fromkeys(b.removesuffix("+ckpt") for b in columns))
    tab = plt.get_cmap("tab10")
    color = {"auto": "#222222", **{b: tab(bases.index(b.removesuffix("+ckpt")) % 10)
                                   for b in columns}}
    ncols = min(4, len(models))
    nrows = math.ceil(len(models) / ncols)
    height = 2.8 * nrows + 1.4
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, height), squeeze=False)
    width = 0.85 / len(series)
    for ax, model in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == model and "trace_err" not in r]
        for g, r in enumerate(mine):
            for k, key in enumerate(series):
                x = g - 0.425 + (k + 0.5) * width
                if key in r:
                    ax.bar(x, r[key] * 1e3, width, color=color[key], label=names[key],
                           hatch="////" if key.endswith("+ckpt") else None,
                           edgecolor="white", linewidth=0)
                else:
                    ax.plot(x, 0, marker="x", color=color[key], markersize=4, clip_on=False)
        if not any(key in r for r in mine for key in series):
            ax.set_ylim(0, 1)
            ax.set_yticks([])
            ax.text(0.5, 0.5, "no plan on any mesh", transform=ax.transAxes, ha="center",
                    fontsize=8)
        ax.set_xticks(range(len(mine)), [r["mesh"] for r in mine], fontsize=8)
        ax.set_title(model, fontsize=9)
        ax.set_ylabel("ms", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    for ax in list(axes.flat)[len(models):]:
        ax.axis("off")
    seen: dict = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    order = [names[k] for k in series if names[k] in seen]
    fig.legend([seen[n] for n in order], order, loc="lower center", ncol=min(12, len(order)),
               fontsize=8, frameon=False)
    fig.suptitle(title or "predicted step per model and mesh (ms, each panel its own scale): "
                 "autoshard (black) vs hand-written baselines (hatched: checkpointed); "
                 "x: no plan", fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / height, 1, 1 - 0.2 / height))
    path = Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def rows_from_markdown(text: str) -> tuple[list[dict], tuple[str, ...]]:
    """The rows and baseline columns of a table ``table`` wrote (the first in ``text``), as
    much as ``plot`` needs: model, mesh, and each plan's step in seconds where it has one
    (``<name>_err``, the cell's text, where it has none)."""
    lines = [l for l in text.splitlines() if l.startswith("| ")]
    if not lines:
        raise ValueError("no table in the text")
    head = [c.strip() for c in lines[0].strip("|").split(" | ")]
    if head[:3] != ["model", "mesh", "autoshard ms"]:
        raise ValueError(f"not a compare_plans table: {head[:3]}")
    columns = tuple(c[:-3] for c in head[3:] if c.endswith(" ms"))
    keys = ["auto", *columns]
    rows = []
    for line in lines[1:]:
        cells = [c.strip() for c in re.split(r"(?<!\\) \| ", line.strip().strip("|").strip())]
        row: dict = {"model": cells[0], "mesh": cells[1]}
        if cells[2].startswith("trace failed"):
            row["trace_err"] = cells[2]
        else:
            for key, cell in zip(keys, cells[2:2 + len(keys)]):
                try:
                    row[key] = float(cell) / 1e3
                except ValueError:
                    row[key + "_err"] = cell
        rows.append(row)
    return rows, columns


def replot(results: str | Path, section: str = SECTION) -> Path:
    """Redraw a section's chart from the table it holds (no planning), next to ``results``,
    and link it from the section if it is not yet."""
    results = Path(results)
    text = results.read_text()
    m = re.search(rf"<!-- {section}:begin -->\n(.*?)\n<!-- {section}:end -->", text, re.S)
    if m is None:
        raise ValueError(f"no section {section} in {results}")
    body = m.group(1)
    rows, columns = rows_from_markdown(body)
    png = plot(rows, columns, results.parent / f"{section}.png")
    link = chart_link(section)
    if link not in body:
        last = max(i for i, l in enumerate(body.splitlines()) if l.startswith("| "))
        lines = body.splitlines()
        repo = Path(__file__).resolve().parent.parent
        shown = results.resolve().relative_to(repo) if results.resolve().is_relative_to(repo) \
            else results.name              # as typed from the repository root, never a full path
        note = (f"The table's step times as a chart, drawn from the table by `python "
                f"benchmarks/compare_plans.py --replot {shown}`:")
        body = "\n".join(lines[:last + 1] + ["", note, "", link] + lines[last + 1:])
        write_section(results, section, body)
    return png


def chart_link(section: str) -> str:
    return f"![predicted step per model and mesh, autoshard vs baselines]({section}.png)"


def mismatched(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        obj = r.get("objective")
        if "auto" in r and obj is not None and abs(obj - r["auto"]) > 0.01 * max(r["auto"], 1e-12):
            merged = f", merged axes {r['merged']}" if r.get("merged") else ""
            out.append(f"- {r['model']} on {r['mesh']}: predicted {r['auto'] * 1e3:.3f} ms, "
                       f"ILP objective {obj * 1e3:.3f} ms{merged}")
    return out


def diagnosis(r: dict) -> str:
    """Why autoshard lost a row, as far as the row tells: the solver stopped at its time limit
    with the baseline inside its gap, or the baseline's plan lies outside autoshard's search."""
    if "auto" not in r or not r.get("worse"):
        return ""
    best, name = r["best"], r["best_name"]
    out = []
    if r["status"] != "OPTIMAL":
        bound = r["objective"] * (1 - r["gap"]) if r.get("objective") is not None else None
        inside = bound is not None and best >= bound * (1 - TOL)
        out.append(f"the ILP stopped at its time limit ({r['status']}, gap {r['gap']:.2%}, "
                   f"lower bound {bound * 1e3:.3f} ms)" if bound is not None else
                   f"the ILP stopped at its time limit ({r['status']})")
        out.append("the baseline lies within that gap: a better plan exists in the search, the "
                   "solver did not reach it" if inside else
                   "the baseline is below that bound: it is outside the search autoshard ran")
    else:
        out.append("the ILP proved its plan optimal: the baseline is outside the search "
                   "autoshard ran")
    if name.endswith("+ckpt") and "ckpt" not in r["techniques"]:
        out.append("autoshard's plan checkpoints no layer (recompute='auto' tries checkpointing "
                   "only when memory binds)")
    return "; ".join(out)


def summary(rows: list[dict]) -> list[str]:
    planned = [r for r in rows if "trace_err" not in r]
    compared = [r for r in planned if r["best"] is not None]
    at_least = [r for r in compared if "auto" in r and not r["worse"]]
    worse = [r for r in compared if "auto" in r and r["worse"]]
    lost = [r for r in compared if "auto" not in r]
    none = [r for r in planned if r["best"] is None]
    alone = sum("auto" in r for r in none)
    out = [f"- autoshard at least as fast as the best feasible baseline on {len(at_least)} of "
           f"{len(compared)} rows with a feasible baseline; slower on {len(worse)}; no plan where "
           f"a baseline has one on {len(lost)}; {len(none)} rows with no feasible baseline, "
           f"where autoshard finds a plan on {alone}."]
    for r in worse:
        out.append(f"- {r['model']} on {r['mesh']}: best baseline {r['best_name']} "
                   f"{r['best'] * 1e3:.3f} ms against autoshard {r['auto'] * 1e3:.3f} ms "
                   f"(ratio {r['best'] / r['auto']:.4f}): {diagnosis(r)}.")
    for r in lost:
        out.append(f"- {r['model']} on {r['mesh']}: autoshard {r['auto_err']}, best baseline "
                   f"{r['best_name']} {r['best'] * 1e3:.3f} ms.")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    ap.add_argument("--meshes", default=None, help=f"comma-separated shapes (default {MESHES})")
    ap.add_argument("--baselines", default=None,
                    help=f"comma-separated baseline columns (default all: {','.join(ALL)})")
    ap.add_argument("--quick", action="store_true",
                    help=f"models {QUICK_MODELS} on meshes {QUICK_MESHES} (unless given), "
                         f"written to section {SECTION}_quick")
    ap.add_argument("--cluster", default="h100")
    ap.add_argument("--time-limit", type=float, default=20.0,
                    help="ILP time limit per plan, s (default 20, the planner's)")
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    ap.add_argument("--replot", default=None, metavar="RESULTS_MD",
                    help="only redraw the chart of this file's section from its table")
    args = ap.parse_args(argv)
    if args.replot:
        section = SECTION + ("_quick" if args.quick else "")
        print(f"wrote {replot(args.replot, section)}")
        return 0
    if args.models is None and args.quick:
        args.models = QUICK_MODELS
    models = [m.strip() for m in args.models.split(",")] if args.models else list(ZOO)
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(ZOO)}")
    meshes = parse_meshes(args.meshes or (QUICK_MESHES if args.quick else MESHES))
    columns = tuple(b.strip() for b in args.baselines.split(",")) if args.baselines else ALL
    if set(columns) - set(ALL):
        ap.error(f"unknown baselines {sorted(set(columns) - set(ALL))}; known: {', '.join(ALL)}")
    section = SECTION + ("_quick" if args.quick else "")
    started, t_all = today(), time.perf_counter()
    rows: list[dict] = []
    traces: list[str] = []
    for name in models:
        entry, seq = ZOO[name], seq_for(name)
        shown_seq = seq if seq is not None else entry.seq
        t0 = time.perf_counter()
        try:
            model, inputs = get_model(name, seq=seq)
            traced = trace(model, inputs, training=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"model": name, "mesh": "all", "trace_err": short(e, 300)})
            print(table(rows[-1:], columns).splitlines()[-1], flush=True)
            continue
        took = time.perf_counter() - t0
        traces.append(f"{name} (batch {entry.batch}, seq {shown_seq}): {took:.1f} s")
        print(f"# {name}: batch {entry.batch}, seq {shown_seq}, traced in {took:.1f} s",
              flush=True)
        for shape in meshes:
            rows.append(plan_row(name, traced, shape, args.cluster, args.time_limit, columns))
            print(table(rows[-1:], columns).splitlines()[-1], flush=True)
        del traced, model, inputs
    total = time.perf_counter() - t_all
    notes = flagged(rows, columns)
    body = ["## Plan quality: autoshard vs hand-written baselines"
            + (" (quick subset)" if args.quick else ""), "",
            f"- command: `{command('benchmarks/compare_plans.py')}`",
            f"- machine: {machine()}",
            f"- date: {started}; {revision()}; total wall time {total / 60:.1f} min",
            f"- cluster {args.cluster}; default mesh axes (1-D `x`, 2-D `dp,tp`, 3-D `x,y,z`); "
            f"training step (Adam); each preset's default batch and sequence, except the llama3 "
            f"presets, traced at seq {LLAMA3_SEQ} instead of their 8192 context to keep tracing "
            f"time sane; ILP time limit {args.time_limit:g} s per plan.",
            "- step times are the cost model's predictions (ms), overlap of bucketed gradient "
            "sync with backward priced (docs/cost-model.md §7), for autoshard (default options: "
            "ZeRO-2 and ZeRO-3 chosen per parameter, activation checkpointing (selective or "
            "full) where memory binds, "
            "optimizer offload only where nothing fits without it) and for each hand-written "
            "baseline, each solved by the same ILP machinery with its parameter layout fixed: "
            "`dp`, `megatron` over every axis, `megatron-dp` (Megatron over the last axis, DP "
            "over the others), weights read where they lie, checkpointing where memory binds "
            "(recompute=\"auto\", §8); `fsdp` (every parameter stored sharded over every axis) "
            "and `fsdp-tp` (torchtitan's 2-D storage, FSDP x Megatron over the last axis), read "
            "as the ILP finds cheapest, 1-D and 2-D meshes; `zero1`/`zero2`: data parallel with "
            "the optimizer state (ZeRO-1) or the gradients and optimizer state (ZeRO-2) sharded "
            "over the data axes (`baseline_plan(traced, mesh, \"dp\", zero=...)`, §9). The "
            "`fsdp`, `fsdp-tp`, `zero1`, `zero2` columns are without checkpointing, their "
            "`+ckpt` twins with every repeated layer checkpointed (recompute=\"full\"). No "
            "baseline offloads. `infeasible: OOM` = no plan with that baseline's layout fits "
            "device memory; `no solution: solver time limit` = the ILP found no solution within "
            "the time limit though a plan fitting memory exists. Ratio = best feasible baseline "
            "/ autoshard (>= 1 means autoshard is at least as fast), with the best baseline's "
            "name. `techniques` (autoshard's plan): parameters under ZeRO-1, ZeRO-2, offload; "
            "parameters stored sharded (ZeRO-3 or tensor parallel); checkpointed layers and "
            "their policy; "
            "gradient buckets. `params < 1 MiB gathered per use`: small parameters the plan "
            "stores sharded and gathers where read. `wall s` = planning time of the row "
            "(autoshard and every baseline).",
            "", table(rows, columns), ""]
    if args.out:
        body += [chart_link(section), ""]
    body += ["Summary:", ""] + summary(rows) + [""]
    body += ["Rows flagged or failed:", ""] + (notes or ["- none"]) + [""]
    body += ["Rows where autoshard's ILP objective and its assembled predicted step differ by "
             "more than 1% (the two should agree):", ""] + (mismatched(rows) or ["- none"]) + [""]
    body += ["Trace time per model: " + "; ".join(traces) + "."]
    text = "\n".join(body)
    print()
    print(text)
    if args.out:
        write_section(args.out, section, text)
        png = plot(rows, columns, Path(args.out).parent / f"{section}.png")
        print(f"\nwrote section {section} of {args.out} and {png}")
    return 1 if any(r.get("worse") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
