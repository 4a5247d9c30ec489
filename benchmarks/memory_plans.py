"""Models that only fit with memory techniques: each planned as a user would, from the CLI.

For each case the planner runs with its defaults (``zero``, ``offload`` and ``recompute`` all
"auto") on the h100 preset; the table gives the wall time of the whole ``autoshard plan``
command (a fresh process: import, tracing on the meta device, every solve the planner runs),
the predicted step, the peak the ILP bounds (what forward saves) and the peak over the whole step
from liveness (docs/cost-model.md §4.5), the host bytes offloaded, and the techniques the plan
uses, as ``autoshard show`` lists them.

    python benchmarks/memory_plans.py                                   # print the table
    python benchmarks/memory_plans.py --out benchmarks/RESULTS.md       # rewrite its section
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import command, machine, revision, today, write_section  # noqa: E402

SECTION = "memory_plans"
CASES = [
    "llama2-13b --mesh 8 --axes dp --batch 8 --seq 4096",
    "llama3-70b --mesh 8x8 --axes dp,tp --batch 16 --seq 2048",
    "llama2-70b --mesh 8 --axes dp --batch 8 --seq 4096",
    "gpt3-175b --mesh 8x8 --axes dp,tp --batch 8 --seq 2048",
    "llama3-8b --mesh 8 --axes dp --batch 8 --seq 2048 --memory-gb 20",
    "gpt2 --mesh 8 --axes dp --batch 8",
]
GIB = 2**30


def techniques(plan: dict) -> str:
    params = plan["params"]
    modes: dict[str, int] = {}
    for fqn, p in params.items():
        if p["offload"]:
            modes["offload"] = modes.get("offload", 0) + 1
        elif p["grad_placements"] != p["placements"]:
            modes["ZeRO-2"] = modes.get("ZeRO-2", 0) + 1
        elif p["optimizer_placements"] != p["placements"]:
            modes["ZeRO-1"] = modes.get("ZeRO-1", 0) + 1
    sharded = sum(1 for p in params.values() if p["placements"].strip("[]").replace("R", "")
                  .replace(",", "").strip())
    out = [f"{k} {v}" for k, v in sorted(modes.items())]
    out.append(f"sharded storage {sharded}/{len(params)}")
    rec = plan.get("recompute", {})
    if rec:
        kinds = sorted(set(rec.values()))
        out.append(f"checkpointing {'/'.join(kinds)} {len(rec)}/{len(plan['layers'])}")
    return ", ".join(out)


def run(case: str) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        t0 = time.perf_counter()
        r = subprocess.run(["autoshard", "plan", *case.split(), "-o", str(path)],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            return [f"`{case}`", f"{wall:.1f}", "no plan: " + r.stderr.strip().splitlines()[-1],
                    "", "", "", "", ""]
        plan = json.loads(path.read_text())
    p = plan["predicted"]
    mem = p.get("memory", {})
    warn = "; ".join(plan.get("warnings", []))
    return [f"`{case}`", f"{wall:.1f}", f"{p['step_time_s'] * 1e3:.1f}",
            f"{p['ilp_memory_bytes'] / GIB:.2f}", f"{mem.get('peak', 0) / GIB:.2f}",
            f"{mem.get('host', 0) / GIB:.2f}", techniques(plan), warn or "-"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    args = ap.parse_args()
    rows = []
    for case in CASES:
        rows.append(run(case))
        print(" | ".join(rows[-1]), flush=True)
    head = ["command (`autoshard plan ...`)", "wall s", "predicted step ms",
            "ILP peak GiB", "step peak GiB (liveness)", "host GiB", "techniques", "warnings"]
    lines = [f"## Plans that fit only with memory techniques (h100, 80 GB)", "",
             f"- command: `{command('benchmarks/memory_plans.py')}`", f"- machine: {machine()}",
             f"- date: {today()}; {revision()}",
             "- Each row is one `autoshard plan` process with the default options (`zero`, "
             "`offload`, `recompute` all \"auto\"); `wall s` includes Python start, tracing on "
             "the meta device and every solve the planner runs. `ILP peak`: what forward saves "
             "plus model state, the sum the ILP holds to the budget (74.51 GiB); `step peak`: "
             "the peak over forward, backward and the optimizer step from liveness "
             "(docs/cost-model.md §4.5). `techniques`: parameters whose gradient and optimizer "
             "state are sharded apart (ZeRO-2) or on the host (offload), parameters stored "
             "sharded (ZeRO-3 / tensor parallel), checkpointed layers.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
