"""A 3-axis mesh: every grouping of its axes against the problem over every subset of axes.

For each case, plans the model as ``autoshard plan`` does (default options, h100) and lists the
tries of the planner's search "axis groupings" from the plan's record: each grouping of the
axes (merged axes acting as one, their collectives over the joint groups, then the same layouts
priced one axis at a time) and the problem over every subset of axes, which solver/descent.py
solves one and two axes at a time. The planning time is beside each case.

    python benchmarks/three_axis.py --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

SECTION = "three_axis"
# (zoo model, mesh, axes, batch, sequence)
CASES = (("llama3-8b", (4, 4, 4), ("dp", "tp", "cp"), 8, 8192),
         ("llama3-70b", (4, 4, 4), ("dp", "tp", "cp"), 8, 8192))


def run(case: tuple) -> dict:
    import autoshard
    from autoshard.plans.searches import on_chosen_path, searches
    from autoshard.zoo import get_model
    name, shape, axes, batch, seq = case
    model, inputs = get_model(name, batch=batch, seq=seq)
    t0 = time.perf_counter()
    plan = autoshard.plan(model, inputs, autoshard.Mesh(shape, axes, cluster="h100"),
                          model_name=name)
    seconds = time.perf_counter() - t0
    [search] = on_chosen_path(searches(plan.solver), "axis groupings")
    tries = [{"label": t.label, "step_ms": None if t.step_time_s is None else t.step_time_s * 1e3,
              "status": t.facts.get("status", ""), "chosen": t.chosen,
              "every_subset": len(t.changes["merged_axes"]) == len(shape),
              "error": t.error or ""} for t in search.tries
             if t.step_time_s is not None or t.error]    # (a try with nothing to price: none)
    return {"case": case, "seconds": seconds, "tries": tries,
            "step_ms": plan.predicted.step_time_s * 1e3, "note": plan.solver.get("note", "")}


def _row(t: dict) -> str:
    step = "no plan" if t["step_ms"] is None else f"{t['step_ms']:.1f}"
    mark = " (chosen)" if t["chosen"] else ""
    return f"| {md_cell(t['label'])}{mark} | {step} | {t['status']} | {md_cell(t['error'][:90])} |"


def section(results: list[dict], wall_s: float) -> str:
    lines = ["## A 3-axis mesh, every subset of axes", "",
             f"- command: `{command('benchmarks/three_axis.py')}`", f"- machine: {machine()}",
             f"- date: {today()}; {revision()}; total wall time {wall_s / 60:.1f} min",
             "- each case planned as `autoshard plan` does (default options, h100, training "
             "with Adam); the tries of its search `axis groupings`, each with its step as the "
             "search priced it: `dp,tp+cp` merges dp and tp into one axis beside cp (its "
             "collectives over their joint group, then the same layouts priced one axis at a "
             "time); `dp+tp+cp`, every axis its own, is the problem over every subset of axes, "
             "solved one and two axes at a time (solver/descent.py). The plan's predicted step "
             "is its try's after the budget is fitted to the step's liveness peak", ""]
    for r in results:
        name, shape, axes, batch, seq = r["case"]
        lines += [f"### {name} on {'x'.join(map(str, shape))} ({','.join(axes)}), batch "
                  f"{batch} x {seq}", "",
                  "| try | step ms | status | why no plan |", "|---|---:|---|---|"]
        lines += [_row(t) for t in r["tries"]]
        grouped = [t["step_ms"] for t in r["tries"]
                   if t["step_ms"] is not None and not t["every_subset"]]
        alone = [t["step_ms"] for t in r["tries"] if t["step_ms"] is not None and t["every_subset"]]
        gain = f"; every axis its own {min(grouped) / alone[0]:.2f}x faster than the best " \
               f"grouping ({alone[0]:.1f} against {min(grouped):.1f} ms)" \
            if grouped and alone else ""
        lines += ["", f"- planned in {r['seconds']:.1f} s; the plan's predicted step "
                      f"{r['step_ms']:.1f} ms{gain}", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results = []
    for case in CASES:
        results.append(run(case))
        print(results[-1], flush=True)
    body = section(results, time.perf_counter() - t0)
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)


if __name__ == "__main__":
    main()
