"""Predicted step time against the memory budget: the planner trading time for memory.

Llama-3-8B (the zoo preset, bf16, batch 8 x 2048, training with mixed-precision Adam) on 8 h100
(one mesh axis ``dp``) is traced once and planned with ``plan_traced`` under a falling memory
budget per device (what ``autoshard plan --memory-gb`` sets): first with the device's own memory
(the unconstrained plan, whose peak P starts the sweep), then at budgets from just below P down
to just above the least memory any plan needs, and once below that, where no plan fits and the
planner's error (quoted verbatim) names the least memory found and the techniques it tried.

Each budget is planned with the default options (``zero``, ``offload`` and ``recompute`` all
"auto": the planner picks gradient/optimizer-state and parameter sharding per parameter in the
ILP, activation checkpointing where memory binds, optimizer offload only where nothing fits
without it), and, to show what the automatic choice leaves out, with ``recompute`` forced to
"none", "selective" and "full". The table gives, per budget, the predicted step, the peak, the
techniques the plan uses (parameters under ZeRO-1, ZeRO-2, offload; parameters stored sharded;
checkpointed layers) and the planning time; the plot (``--plot``, default
benchmarks/memory_curve.png) draws the curves and the techniques.

    python benchmarks/memory_curve.py --out benchmarks/RESULTS.md
    python benchmarks/memory_curve.py --points 6            # a coarser sweep
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.ir import Shard  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.solver.ilp import Infeasible  # noqa: E402
from autoshard.solver import planner  # noqa: E402
from autoshard.solver.planner import plan_traced  # noqa: E402
from autoshard.trace.export import trace  # noqa: E402
from autoshard.zoo.registry import get_model  # noqa: E402

SECTION = "memory_curve"
GIB = 2**30
TOL = 1e-6          # relative: a rise of the step below this is float noise
# The share of the budget above which the planner tries checkpointing (solver/budget.py BINDS).
BINDS = getattr(planner, "BINDS", 1.0)
FORCED = ("none", "selective", "full")


def infeasible_cause(e: BaseException) -> Infeasible | None:
    """The solver's Infeasible verdict behind a planner error, the nearest through causes and
    contexts (the planner re-raises its last search's error with the techniques it tried, so the
    verdict is the context's cause; an earlier search's verdict lies further down)."""
    seen: set[int] = set()
    queue = [e]
    while queue:
        x = queue.pop(0)
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Infeasible):
            return x
        queue += [x.__cause__, x.__context__]
    return None


def uses(plan) -> dict[str, int]:
    """What a plan does to save memory: parameters per state mode, parameters stored sharded,
    checkpointed layers."""
    modes = Counter(st.mode for st in plan.param_state.values())
    policies = Counter(plan.recompute.values())
    return {"zero1": modes["zero1"], "zero2": modes["zero2"], "offload": modes["offload"],
            "sharded": sum(1 for s in plan.params.values() if any(isinstance(p, Shard) for p in s)),
            "params": len(plan.params), "recompute": len(plan.recompute),
            "policy": "+".join(sorted(policies)), "layers": len(plan.layers)}


def uses_str(u: dict[str, int]) -> str:
    parts = [f"{label} {u[k]}" for k, label in (("zero1", "ZeRO-1"), ("zero2", "ZeRO-2"),
                                                 ("offload", "offload")) if u[k]]
    if u["sharded"]:
        parts.append(f"sharded {u['sharded']}")
    if u["recompute"]:
        parts.append(f"ckpt {u['policy']} {u['recompute']}/{u['layers']}")
    return ", ".join(parts) or "-"


def attempt(traced, mesh, budget: float | None, time_limit: float, **options) -> dict:
    """One planning run: its step, peak, techniques and seconds, or its error."""
    t0 = time.perf_counter()
    try:
        p = plan_traced(traced, mesh, memory_budget=budget, time_limit_s=time_limit,
                        model_name="llama3-8b", **options)
    except AutoshardError as e:
        inf = infeasible_cause(e)
        return {"error": str(e), "least": inf.least_memory if inf else None,
                "exact": inf.exact if inf else None, "seconds": time.perf_counter() - t0}
    mem = p.predicted.memory
    return {"step": p.predicted.step_time_s, "peak": p.predicted.ilp_sum_bytes,
            "host": mem.host, "uses": uses(p), "status": p.solver["status"],
            "gap": p.solver["gap"], "seconds": time.perf_counter() - t0}


def budgets(peak: float, least: float, n: int) -> list[float]:
    """``n`` budgets from just below ``peak`` to just above ``least``, evenly spaced, in GiB
    rounded to 0.01 (so that the table shows the budget planned with)."""
    hi, lo = peak * 0.995, least * 1.01
    if n == 1:
        return [round(hi / GIB, 2) * GIB]
    return [round((hi - (hi - lo) * k / (n - 1)) / GIB, 2) * GIB for k in range(n)]


def step_cell(r: dict) -> str:
    if "step" in r:
        return f"{r['step'] * 1e3:.1f}"
    return "no plan" if r.get("least") is not None else "error"


def table(rows: list[dict]) -> str:
    head = ["budget GiB", "predicted step ms", "peak GiB", "host GiB", "ZeRO-1", "ZeRO-2",
            "offload", "stored sharded", "checkpointed layers", "status", "planning s",
            "recompute=none ms", "recompute=selective ms", "recompute=full ms"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        a = r["auto"]
        label = f"{r['budget'] / GIB:.2f}" + (" (device)" if r.get("device") else "")
        if "step" in a:
            u = a["uses"]
            cells = [label, step_cell(a), f"{a['peak'] / GIB:.2f}", f"{a['host'] / GIB:.2f}",
                     str(u["zero1"]), str(u["zero2"]), str(u["offload"]),
                     f"{u['sharded']}/{u['params']}", f"{u['recompute']}/{u['layers']}"
                     + (f" {u['policy']}" if u["recompute"] else ""),
                     a["status"], f"{a['seconds']:.1f}"]
        else:
            cells = [label, step_cell(a)] + ["-"] * 8 + [f"{a['seconds']:.1f}"]
        cells += [step_cell(r[f]) if f in r else "" for f in FORCED]
        out.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    return "\n".join(out)


def rises(rows: list[dict], key) -> list[tuple[dict, dict]]:
    """(row, the row of a lower budget) pairs where the lower budget's plan is faster: the
    step should not fall as the budget does."""
    out = []
    feasible = [r for r in rows if "step" in key(r)]
    for i, r in enumerate(feasible):
        for lower in feasible[i + 1:]:
            if key(lower)["step"] < key(r)["step"] * (1 - TOL):
                out.append((r, lower))
                break
    return out


def explain(r: dict, lower: dict) -> str:
    a, b = r["auto"], lower["auto"]
    text = (f"at {r['budget'] / GIB:.2f} GiB the plan takes {a['step'] * 1e3:.1f} ms, "
            f"more than the {b['step'] * 1e3:.1f} ms of the plan at {lower['budget'] / GIB:.2f} "
            f"GiB ({uses_str(b['uses'])})")
    forced = [(r[f]["step"], f) for f in FORCED if "step" in r.get(f, {})]
    faster = min(forced, default=None)
    if faster is not None and faster[0] < a["step"] * (1 - TOL):
        text += (f". A faster plan exists at this budget ({faster[0] * 1e3:.1f} ms with "
                 f"recompute='{faster[1]}'); recompute='auto' tries checkpointing only when no "
                 f"plan fits or the plan without it comes within {1 - BINDS:.0%} of the budget "
                 f"(solver/budget.py, `_plan_recompute`), and this one used "
                 f"{a['peak'] / r['budget']:.1%} of it" if a["uses"]["recompute"] == 0 else
                 f". A faster plan exists at this budget ({faster[0] * 1e3:.1f} ms with "
                 f"recompute='{faster[1]}'), which the planner's own ladder did not reach")
    elif b["uses"]["offload"] and not a["uses"]["offload"]:
        text += (". Offload is tried only when no plan fits without it "
                 "(solver/budget.py, `plan_memory`), so a slower plan without it is kept")
    else:
        text += ". No run at this budget finds a faster plan: the search is time-limited or " \
                "the lower budget's plan is outside it"
    return text


def plot(rows: list[dict], least: float | None, path: Path, title: str) -> str:
    """Two panels over the falling budget: the predicted step of the three runs, and the share
    of parameters (layers) each technique of the planner's plan covers."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:           # the figure is optional, the table is not
        return f"no plot: matplotlib is not installed ({e})"
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7.5), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    styles = {"auto": ("C0", "-", "o", "autoshard (zero, offload, recompute 'auto')"),
              "none": ("C1", "--", "s", "recompute='none'"),
              "selective": ("C8", "-.", "v", "recompute='selective'"),
              "full": ("C2", ":", "^", "recompute='full'")}
    for key, (color, ls, marker, label) in styles.items():
        pts = [(r["budget"] / GIB, r[key]["step"] * 1e3) for r in rows
               if key in r and "step" in r[key]]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, ls=ls, marker=marker, ms=5 if key == "auto" else 4,
                    lw=2 if key == "auto" else 1.2, label=label, zorder=3 if key == "auto" else 2)
    feasible = [r for r in rows if "step" in r["auto"]]
    xs = [r["budget"] / GIB for r in feasible]
    for key, label, color in (("zero1", "ZeRO-1", "C4"), ("zero2", "ZeRO-2", "C5"),
                              ("sharded", "stored sharded (ZeRO-3)", "C6"),
                              ("offload", "optimizer offload", "C3")):
        bx.plot(xs, [100 * r["auto"]["uses"][key] / r["auto"]["uses"]["params"]
                     for r in feasible], marker=".", color=color, label=f"{label}, % of params")
    for policy, ls in (("selective", "-."), ("full", "--")):
        bx.plot(xs, [100 * r["auto"]["uses"]["recompute"] / max(r["auto"]["uses"]["layers"], 1)
                     if r["auto"]["uses"]["policy"] == policy else 0 for r in feasible],
                marker=".", color="k", ls=ls, label=f"checkpointed ({policy}), % of layers")
    for a in (ax, bx):
        if least is not None:
            a.axvspan(0, least / GIB, color="0.85", zorder=0)
            a.axvline(least / GIB, color="0.4", lw=1)
        a.grid(alpha=0.3)
    if least is not None:
        ax.text(least / GIB / 2, sum(ax.get_ylim()) / 2, f"no plan fits\nbelow\n"
                f"{least / GIB:.2f} GiB", ha="center", va="center", fontsize=7, color="0.3")
    ax.set_xlim(max(r["budget"] for r in rows) / GIB * 1.03, 0)
    ax.set_ylabel("predicted step time, ms")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    bx.set_ylabel("autoshard's plan uses, %")
    bx.set_ylim(-5, 105)
    bx.set_xlabel("memory budget per device, GiB (falling to the right)")
    bx.legend(fontsize=7, loc="center left")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return f"plot: {path.name}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", type=int, default=12,
                    help="budgets between the unconstrained peak and the least memory (12)")
    ap.add_argument("--cluster", default="h100")
    ap.add_argument("--time-limit", type=float, default=20.0,
                    help="ILP time limit per solve, s (default 20, the planner's)")
    ap.add_argument("--no-forced", action="store_true",
                    help="skip the recompute='none'/'full' curves (a third of the time)")
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parent / "memory_curve.png"),
                    help="where to save the figure ('' for none)")
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    args = ap.parse_args(argv)
    if args.points < 1:
        ap.error("--points is at least 1")
    started, t_all = today(), time.perf_counter()
    batch, seq = 8, 2048
    t0 = time.perf_counter()
    model, inputs = get_model("llama3-8b", batch=batch, seq=seq)
    traced = trace(model, inputs, training=True)
    trace_s = time.perf_counter() - t0
    del model
    mesh = Mesh((8,), ("dp",), cluster=args.cluster)
    print(f"# traced llama3-8b (batch {batch}, seq {seq}) in {trace_s:.1f} s", flush=True)

    def point(budget: float, device: bool = False) -> dict:
        r = {"budget": budget, "device": device,
             "auto": attempt(traced, mesh, None if device else budget, args.time_limit)}
        if not args.no_forced:
            for f in FORCED:
                r[f] = attempt(traced, mesh, None if device else budget, args.time_limit,
                               recompute=f)
        print(table([r]).splitlines()[-1], flush=True)
        return r

    rows = [point(mesh.cluster.memory_bytes, device=True)]
    if "step" not in rows[0]["auto"]:
        print(rows[0]["auto"]["error"])
        return 1
    peak = rows[0]["auto"]["peak"]
    # A budget far below any plan: the error names the least memory, which ends the sweep.
    probe = attempt(traced, mesh, 0.25 * GIB, args.time_limit)
    least = probe.get("least")
    if least is None:
        print(f"no least memory from the planner's error: {probe.get('error')}")
        return 1
    rows += [point(b) for b in budgets(peak, least, args.points)]
    below = math.floor(least / GIB * 0.9 * 4) / 4 * GIB          # 10% under, to 0.25 GiB
    infeasible = point(below)
    rows.append(infeasible)
    total = time.perf_counter() - t_all

    auto_rises = rises(rows, lambda r: r["auto"])
    best = lambda r: min((x for x in (r["auto"], *(r.get(f, {}) for f in FORCED))  # noqa: E731
                          if "step" in x), key=lambda x: x["step"], default={})
    best_rises = rises(rows, best)
    fits_below = "step" in infeasible["auto"]
    err = infeasible["auto"].get("error", "")
    title = (f"Llama-3-8B, batch {batch} x {seq}, training (mixed-precision Adam), "
             f"8 x {args.cluster} (mesh 8, axis dp)")
    plot_note = plot(rows, least, Path(args.plot), title) if args.plot else "no plot asked"
    print(plot_note)

    mono = ["The step rises monotonically as the budget falls."] if not auto_rises else [
        f"The step does **not** rise monotonically as the budget falls: "
        f"{len(auto_rises)} budget(s) get a slower plan than a smaller budget does:", ""] + [
        f"- {explain(r, lower)}." for r, lower in auto_rises]
    if auto_rises and not args.no_forced:
        mono += ["", "The best of the runs per budget (auto and recompute forced to "
                 + ", ".join(f"'{f}'" for f in FORCED) + ") "
                 + ("rises monotonically." if not best_rises else
                    f"still falls at {len(best_rises)} budget(s).")]
    seconds = [r["auto"]["seconds"] for r in rows]
    body = [
        "## Step time against the memory budget (Llama-3-8B on 8 h100)", "",
        f"- command: `{command('benchmarks/memory_curve.py')}`",
        f"- machine: {machine()}; load average {os.getloadavg()[0]:.1f} at the end (other "
        f"work on the host inflates the planning seconds, not the predictions)",
        f"- date: {started}; {revision()}; total wall time {total / 60:.1f} min (trace "
        f"{trace_s:.1f} s, once)",
        f"- {title}; ILP time limit {args.time_limit:g} s per solve. Each budget is what "
        f"`autoshard plan --memory-gb` sets (`PlanOptions.memory_budget`); the first row plans "
        f"with the device's memory ({mesh.cluster.memory_bytes / GIB:.2f} GiB), the next "
        f"{args.points} go from just below its peak ({peak / GIB:.2f} GiB) to just above the "
        f"least memory any plan needs ({least / GIB:.2f} GiB), and the last is below it.",
        "- `predicted step ms`: the planner's plan with the default options (`zero`, "
        "`offload`, `recompute` all \"auto\"); `ZeRO-1`/`ZeRO-2`/`offload`: parameters whose "
        "optimizer state (and gradient) is sharded apart from the parameter or kept on the host "
        "(`plan.param_state`); `stored sharded`: parameters stored sharded (on this one-axis "
        "mesh, ZeRO-3/FSDP storage, gathered where read); `checkpointed layers`: layers whose "
        "forward is recomputed in backward (`plan.recompute`); `host GiB`: optimizer state "
        "offloaded per device; `planning s`: wall time of `plan_traced` (all the solves the "
        "planner runs at that budget). The last two columns plan the same budget with "
        "`recompute` forced to \"none\", \"selective\" and \"full\".", "",
        table(rows), "",
        f"![step time against memory budget]({Path(args.plot).name})" if args.plot
        else plot_note, "",
        *mono, "",
        f"Planning time per budget: {min(seconds):.1f} s to {max(seconds):.1f} s "
        f"(where memory binds the planner solves several times: without checkpointing, "
        f"selective, full, and again with offload where nothing fits without it).", "",
        f"Below every plan ({below / GIB:.2f} GiB) the planner "
        + ("unexpectedly found a plan." if fits_below else "raises (verbatim):"), "",
        *([] if fits_below else ["```", err, "```"]),
    ]
    text = "\n".join(body)
    print()
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
        print(f"\nwrote section {SECTION} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
