"""How long `autoshard explain` (and `autoshard diff`) take on the main job's plan: Llama-3-8B
on 8x8.

The plan is made once (`autoshard plan llama3-8b --mesh 8x8 --axes dp,tp --batch 8 --seq 2048`,
or ``--plan FILE`` to reuse one), then each case runs `autoshard explain` in a fresh Python
process, timed from the command's start to its exit (interpreter start and imports included): the
model traced again on the meta device, the plan's ILP built again, and for ``--node`` and
``--param`` the baseline and three alternatives re-solved (3 s limit each, explain's default).
``--json`` output gives the split and each alternative's deltas. Target: 30 s per command.

    python benchmarks/explain_time.py                        # print the table
    python benchmarks/explain_time.py --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

SECTION = "explain_time"
REPO = Path(__file__).resolve().parent.parent
PLAN = ["llama3-8b", "--mesh", "8x8", "--axes", "dp,tp", "--batch", "8", "--seq", "2048"]
# layers.0.attn.o_proj, layers.0.mlp.gate_proj; a layer's weight; the embedding (outside layers)
CASES = [["--top", "10"], ["--node", "linear_3"], ["--node", "linear_4"],
         ["--param", "layers.0.attn.q_proj.weight"], ["--param", "tok_emb.weight"]]
TARGET_S = 30.0
TIME_LIMIT_S = 3.0     # per re-solve (explain's default)


def autoshard(args: list[str]) -> tuple[float, float, str]:
    """Run ``python -m autoshard ARGS`` from the repository root; (wall seconds, CPU seconds,
    stdout). The CPU seconds (user + system of the process) are what the command costs on an
    idle core: on a shared machine the wall time also counts the other load."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "autoshard", *args], capture_output=True,
                       text=True, cwd=REPO, env=env)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if r.returncode != 0:
        raise SystemExit(f"autoshard {' '.join(args)} failed:\n{r.stderr}")
    return wall, cpu, r.stdout


def row(plan: str, case: list[str]) -> dict:
    wall, cpu, out = autoshard(["explain", plan, *case, "--json", "--time-limit",
                                f"{TIME_LIMIT_S:g}"])
    d = json.loads(out)
    r = {"case": " ".join(case), "wall_s": wall, "cpu_s": cpu}
    if "collectives" in d:
        r["trace_s"] = d["seconds"]["rebuild_s"]
        top = d["collectives"][0]
        r["what"] = (f"first: {top['phase']} {top['kind']} over {','.join(top['axes'])} "
                     f"x{top['instances']}, {top['seconds'] * 1e3:.2f} ms, for {top['node']}")
        return r
    s = d["seconds"]
    r.update(trace_s=s["rebuild_s"], build_s=s["build_s"],
             solves_s=s["baseline_s"] + s["alternatives_s"], solves=1 + len(d["alternatives"]))
    parts = [f"chosen {d['chosen']} (baseline {d['baseline']['step_time_s'] * 1e3:.2f} ms, "
             f"file {d['plan_file']['step_time_s'] * 1e3:.2f} ms)"]
    for a in d["alternatives"]:
        if a["step_delta_s"] is None:
            parts.append(f"{a['strategy']}: {a['status']}")
            continue
        parts.append(f"{a['strategy']}: {a['step_delta_s'] * 1e3:+.2f} ms, "
                     f"{a['memory_delta_bytes'] / 2**30:+.2f} GiB ({a['status'].split(';')[0]})")
    r["what"] = "; ".join(parts)
    return r


def loadavg() -> str:
    try:
        return "/".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def report(rows: list[dict], plan_s: float | None, started: str, load: str,
           diff: tuple[float, float, str] | None = None) -> str:
    head = ["`autoshard explain plan.json ...`", "wall s", "CPU s", "trace s", "ILP build s",
            "re-solves (s)", f"CPU <= {TARGET_S:g} s", "result"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        solves = f"{r['solves']} ({r['solves_s']:.1f})" if "solves" in r else "-"
        cells = [f"`{r['case']}`", f"{r['wall_s']:.1f}", f"{r['cpu_s']:.1f}",
                 f"{r['trace_s']:.1f}" if "trace_s" in r else "-",
                 f"{r['build_s']:.1f}" if "build_s" in r else "-", solves,
                 "yes" if r["cpu_s"] <= TARGET_S else "**no**", r["what"]]
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    made = (f"planned by `autoshard plan {' '.join(PLAN)}` in {plan_s:.1f} s (wall)"
            if plan_s is not None else "an existing plan file (--plan)")
    return "\n".join([
        "## `autoshard explain` on the main job's plan (Llama-3-8B, 8x8, h100)", "",
        f"- command: `{command('benchmarks/explain_time.py')}`",
        f"- machine: {machine()}",
        f"- date: {started}; {revision()}; load average (1/5/15 min) at the start {load} (the "
        "machine is shared: other load inflates the times)",
        f"- the plan: {made}. Each row is one `autoshard explain` process, timed from start to "
        "exit (interpreter start and imports included; `CPU s`: its user + system seconds, the "
        "wall time on an idle core, since the solver runs on one thread; `trace`, `ILP build` "
        "and `re-solves` are wall seconds inside it): the model traced again on the meta "
        "device (`trace`), its ILP built again, then for `--node`/`--param` the baseline (the "
        f"chosen strategy pinned) and 3 next-best strategies re-solved, {TIME_LIMIT_S:g} s limit "
        "each. `result`: "
        "each alternative's step and memory delta against the baseline (re-solved plan minus "
        "baseline).",
        "", *lines, *([] if diff is None else [
            "", f"`autoshard diff plan.json full.json` (the same plan against one made with "
                f"`--recompute full`): {diff[0]:.1f} s wall, {diff[1]:.1f} s CPU; its first "
                f"line: {md_cell(diff[2])}"])])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan", default=None, help="an existing plan file of the main job")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    args = ap.parse_args()
    started, load = today(), loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        plan, plan_s = args.plan, None
        if plan is None:
            plan = str(Path(tmp) / "plan.json")
            plan_s, _, _ = autoshard(["plan", *PLAN, "-o", plan])
        rows = []
        for case in CASES:
            rows.append(row(plan, case))
            print(f"{rows[-1]['case']}: {rows[-1]['wall_s']:.1f} s", file=sys.stderr)
        # `autoshard diff` of the main job's plan against the same model fully recomputed
        other = str(Path(tmp) / "full.json")
        autoshard(["plan", *PLAN, "--recompute", "full", "-o", other])
        wall, cpu, out = autoshard(["diff", plan, other])
        first = out.strip().splitlines()[0].replace(tmp + "/", "") if out.strip() else ""
        diff = (wall, cpu, first)
    text = report(rows, plan_s, started, load, diff)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
