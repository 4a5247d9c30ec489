"""The obvious plans a solve starts from, on a problem no backend settles in its time limit.

For one model on one mesh (default: the Gemma-3 12B shape, 48 layers, from its published text
config, on 8x8 h100, batch 8 x 2048), builds the planner's problem (default options, no
checkpointing) and solves each start of ``solver/starts.py`` (a restriction of that problem:
the baselines' stored layouts, the mesh without each axis, the merged mesh) as ``ilp.solve``
does; then assembles the plan of the best one as the planner assembles any plan
(``solve.solved_plan``) and prints its predicted step. That plan is what a time-limited
``autoshard plan`` returns at the least: the planner's own solve only replaces it with a faster
one. ``--compare-mesh 8`` also plans the same model on that mesh (``autoshard.plan``'s path)
for the step the start must not exceed.

    python benchmarks/solver_starts.py --limit 20 --compare-mesh 8 --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

from autoshard.mesh import Mesh  # noqa: E402
from autoshard.options import resolve_options  # noqa: E402
from autoshard.solver import ilp  # noqa: E402
from autoshard.solver.build import build_problem  # noqa: E402
from autoshard.solver.deadline import Deadline, best_start  # noqa: E402
from autoshard.solver.planner import plan_traced, trace_for  # noqa: E402
from autoshard.solver.solve import solved_plan
from autoshard.solver.problem import Solution, evaluate, fits  # noqa: E402
from autoshard.solver.starts import obvious_starts  # noqa: E402
from autoshard.zoo.hf import from_config  # noqa: E402

SECTION = "solver starts"
HERE = Path(__file__).resolve().parent


def mesh_of(text: str, axes: str) -> Mesh:
    return Mesh(tuple(int(x) for x in text.split("x")), tuple(axes.split(",")), cluster="h100")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(HERE / "solver" / "gemma3-12b.json"))
    ap.add_argument("--mesh", default="8x8")
    ap.add_argument("--axes", default="dp,tp")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--limit", type=float, default=20.0, help="the solver's time limit (s)")
    ap.add_argument("--compare-mesh", default=None, help="also plan on this mesh, e.g. 8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = from_config(args.config)
    options = resolve_options(None, {"training": True, "time_limit_s": args.limit})
    t0 = time.perf_counter()
    traced = trace_for(model, model.example_inputs(args.batch, args.seq), options)
    trace_s = time.perf_counter() - t0
    mesh = mesh_of(args.mesh, args.axes)
    built = build_problem(traced, mesh, options)
    problem = built.problem
    rows, best = [], None
    for st in obvious_starts(traced, mesh, built):
        t1 = time.perf_counter()
        found = best_start(problem, (st,), Deadline.after(args.limit / 2), ilp.solve_held)
        row = {"start": st.label, "seconds": time.perf_counter() - t1}
        if found is not None:
            row["step_ms"] = found[2] * 1e3
            if best is None or found[2] < best[2]:
                best = found
        rows.append(row)
        print(row, flush=True)
    plan = None
    if best is not None:
        assert fits(problem, best[1])
        sol = Solution(best[1], "FEASIBLE", best[2], 0.0, 0, 0.0, start=best[0])
        plan = solved_plan(traced, mesh, options, built, problem, sol, model_name=args.config,
                           timings={})[0]
        print("best start", best[0], "objective", evaluate(problem, best[1])[0] * 1e3,
              "predicted", plan.predicted.step_time_s * 1e3, flush=True)
    other = None
    if args.compare_mesh:
        small = mesh_of(args.compare_mesh, ",".join(args.axes.split(",")[-len(
            args.compare_mesh.split("x")):]))
        other = plan_traced(traced, small, options)
        print("on", args.compare_mesh, other.predicted.step_time_s * 1e3,
              other.solver["status"], flush=True)
    if args.out:
        write_section(Path(args.out), SECTION, _table(args, rows, plan, other, trace_s))


def _table(args, rows, plan, other, trace_s: float) -> str:
    out = [f"## Never worse than the obvious plan: the starts on {Path(args.config).stem} "
           f"{args.mesh}\n",
           f"Each start of `solver/starts.py`, a restriction of the planner's problem (default "
           f"options, no checkpointing), solved as `ilp.solve` solves it ({args.limit / 2:g} s "
           f"each); the best one's plan assembled as the planner assembles any plan. "
           f"Tracing took {trace_s:.0f} s.\n",
           f"Command: `{command('benchmarks/solver_starts.py')}`; machine: {machine()}; "
           f"{revision()}; {today()}.\n",
           "| start | step (ms, the ILP's price) | seconds |", "|---|---|---|"]
    for r in rows:
        step = f"{r['step_ms']:.1f}" if "step_ms" in r else "none found"
        out.append(f"| {md_cell(r['start'])} | {step} | {r['seconds']:.1f} |")
    if plan is not None:
        out.append(f"\nThe best start's plan ({plan.solver['start']}): predicted step "
                   f"{plan.predicted.step_time_s * 1e3:.1f} ms.")
    if other is not None:
        out.append(f"The plan on mesh {args.compare_mesh}: predicted step "
                   f"{other.predicted.step_time_s * 1e3:.1f} ms, solver "
                   f"{other.solver['status']}.")
    return "\n".join(out)


if __name__ == "__main__":
    main()
