"""Which MIP backend for the planner's ILP: CBC, HiGHS and CP-SAT (OR-Tools) on real problems.

Each case builds the planner's problem (``solver.build.build_problem``, default options, no
checkpointing) for a model on a mesh, then solves it with each backend alone for the same time
limit, one thread each, and reports the status, the step time of the plan found (exact, by
``problem.evaluate``), the backend's lower bound and the wall time. The planner's solve path
(``ilp.solve``: the first backend, then the starts and the second backend) is timed last on the
same problem. The problems are kept as JSON (``--problems``) so that a rerun solves the same
data without tracing.

    python benchmarks/solver_choice.py                       # the default cases, 20 s each
    python benchmarks/solver_choice.py --limit 20 --out benchmarks/RESULTS.md

Two variants, each its own section: ``--relaxed`` solves the problem without its memory-only
items (saved activations that price no time), which a solve takes first (``ilp._search``), and
``--cutoff-ms X`` asks each backend only for a plan faster than X ms (a later checkpointing rung
under the bar of a plan in hand, solver/budget.py); both without the planner's entry.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

from ortools.linear_solver import pywraplp  # noqa: E402

from autoshard.solver import ilp  # noqa: E402
from autoshard.solver.problem import Problem, evaluate  # noqa: E402

SECTION = "solver choice"
HERE = Path(__file__).resolve().parent
# (label, model: a zoo name or a config.json, mesh, axes, batch, seq)
CASES = (
    ("gemma3-12b 8x8", str(HERE / "solver" / "gemma3-12b.json"), "8x8", "dp,tp", 8, 2048),
    ("gemma3-12b 8", str(HERE / "solver" / "gemma3-12b.json"), "8", "tp", 8, 2048),
    ("llama3-8b 8x8", "llama3-8b", "8x8", "dp,tp", 8, 2048),
    ("llama3-70b 4x8", "llama3-70b", "4x8", "dp,tp", 16, 2048),
    ("gpt3-175b 8x8 b64", "gpt3-175b", "8x8", "dp,tp", 64, 2048),
)
DEFAULT_CASES = ("gemma3-12b 8x8", "gemma3-12b 8", "llama3-8b 8x8")
BACKENDS = ("CBC", "HIGHS", "CP-SAT")
STATUS = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
          pywraplp.Solver.INFEASIBLE: "INFEASIBLE", pywraplp.Solver.NOT_SOLVED: "NOT_SOLVED"}


def build(model: str, mesh_s: str, axes: str, batch: int, seq: int) -> Problem:
    from autoshard.mesh import Mesh
    from autoshard.options import resolve_options
    from autoshard.solver.build import build_problem
    from autoshard.solver.planner import trace_for
    from autoshard.zoo.hf import from_config
    from autoshard.zoo.registry import get_model
    if model.endswith(".json"):
        m = from_config(model)
        inputs = m.example_inputs(batch, seq)
    else:
        m, inputs = get_model(model, batch=batch, seq=seq)
    options = resolve_options(None, {"training": True})
    mesh = Mesh(tuple(int(x) for x in mesh_s.split("x")), tuple(axes.split(",")),
                cluster="h100")
    return build_problem(trace_for(m, inputs, options), mesh, options).problem


def one(problem: Problem, backend: str, limit: float, cutoff_s: float | None = None) -> dict:
    """One backend alone, in a child process killed at ``ilp.WALL_SLACK`` times the limit plus
    a second (a backend can run far past its own limit: then "killed")."""
    t0 = time.perf_counter()

    def run() -> dict:
        r = ilp._attempt(problem, (backend,), limit, cutoff_s)
        row = {"status": STATUS.get(r.status, str(r.status)), "bound_ms": r.bound * 1e3}
        if r.choice is not None:
            row["step_ms"] = evaluate(problem, r.choice)[0] * 1e3
        return row
    try:
        row = ilp._bounded(run, limit_s=limit)
    except ilp.NoSolution:
        row = {"status": "killed"}
    return {"backend": backend, "seconds": time.perf_counter() - t0, **row}


def path(problem: Problem, limit: float) -> dict:
    """The planner's entry without its starts (those need the traced graph): what the first
    backend and the fallback give."""
    t0 = time.perf_counter()
    try:     # killed, like a backend alone, at WALL_SLACK times twice the limit
        sol = ilp._bounded(lambda: ilp.solve(problem, time_limit_s=limit), limit_s=2 * limit)
    except (ilp.Infeasible, ilp.NoSolution) as e:
        return {"backend": "ilp.solve", "status": type(e).__name__,
                "seconds": time.perf_counter() - t0}
    return {"backend": f"ilp.solve ({sol.backend or 'start'})", "status": sol.status,
            "seconds": time.perf_counter() - t0, "step_ms": sol.objective * 1e3,
            "bound_ms": sol.bound * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=20.0, help="seconds per backend")
    ap.add_argument("--cases", default="", help="labels to run, comma-separated (default: "
                    + ", ".join(DEFAULT_CASES) + ")")
    ap.add_argument("--problems", default=str(HERE / ".problems"),
                    help="where built problems are kept as JSON")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated")
    ap.add_argument("--relaxed", action="store_true",
                    help="the problem without its memory-only items (module docstring)")
    ap.add_argument("--cutoff-ms", type=float, default=None,
                    help="only plans faster than this many ms (module docstring)")
    args = ap.parse_args()
    variant = args.relaxed or args.cutoff_ms is not None
    keep = Path(args.problems)
    keep.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, model, mesh_s, axes, batch, seq in CASES:
        if label not in (args.cases.split(",") if args.cases else DEFAULT_CASES):
            continue
        f = keep / (label.replace(" ", "_") + ".json")
        if not f.exists():
            f.write_text(build(model, mesh_s, axes, batch, seq).to_json())
        problem = Problem.from_json(f.read_text())
        if args.relaxed:
            problem = ilp.without_memory_only(problem)
        cutoff = None if args.cutoff_ms is None else args.cutoff_ms / 1e3
        runs = [one(problem, b, args.limit, cutoff) for b in args.backends.split(",")]
        for r in runs if variant else [*runs, path(problem, args.limit)]:
            r.update(case=label, decisions=len(problem.decisions))
            rows.append(r)
            print(r, flush=True)
    if args.out:
        name, head = _heading(args)
        write_section(Path(args.out), name, _table(head, rows))


def _heading(args) -> tuple[str, str]:
    """The section's name and its table's heading, text before the rows."""
    limit = f"{args.limit:g} s limit, one thread"
    if args.cutoff_ms is not None:
        items = " without its memory-only items" if args.relaxed else ""
        return f"{SECTION}: cutoff", ("## Which MIP backend under a cutoff\n\nEach backend alone "
                                      f"on the planner's problem{items}, asked only for a plan "
                                      f"faster than {args.cutoff_ms:g} ms ({limit})")
    if args.relaxed:
        return f"{SECTION}: relaxed", ("## Which MIP backend first: the problem without its "
                                       "memory-only items\n\nEach backend alone on the "
                                       f"planner's problem without them ({limit})")
    return SECTION, ("## Which MIP backend: CBC, HiGHS and CP-SAT on the planner's problems\n\n"
                     "Each backend alone on the planner's problem (default options, no "
                     f"checkpointing; {limit}), then the planner's entry `ilp.solve` (first "
                     "backend, fallback; without the starts, which need the traced graph)")


def _table(head: str, rows: list[dict]) -> str:
    head = (f"{head}. Step and bound in ms.\n\n"
            f"Command: `{command('benchmarks/solver_choice.py')}`; machine: {machine()}; {revision()}; {today()}.\n\n"
            "| case | decisions | backend | status | step (ms) | bound (ms) | seconds |\n"
            "|---|---|---|---|---|---|---|\n")
    def ms(v):
        return "-" if v is None else f"{v:.4g}"
    return head + "".join(
        f"| {md_cell(r['case'])} | {r['decisions']} | {r['backend']} | {r['status']} | "
        f"{ms(r.get('step_ms'))} | {ms(r.get('bound_ms'))} | {r['seconds']:.1f} |\n"
        for r in rows)


if __name__ == "__main__":
    main()
