"""Pipelined plans of large models, each planned as a user would, from the CLI, beside the
unpipelined plan of the same model where one fits, with a Gantt chart of one plan's schedule.

Per row: the wall time of the whole ``autoshard plan`` command (a fresh process: import,
tracing on the meta device, every solve), the predicted step, the schedule, microbatches and
stages, the largest stage's peak, and the predicted model-FLOPs utilisation: ``6·Ψ·tokens`` over
the step on every device's peak (Narayanan et al. 2021, arXiv 2104.04473, count the same way;
recomputation not counted as useful work), beside Megatron-LM's measured 42-47% for GPT-3 175B
on H100 (its README, 2024).

    python benchmarks/pipeline_plans.py                                  # print the table
    python benchmarks/pipeline_plans.py --out benchmarks/RESULTS.md      # rewrite its section
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

from autoshard.plans import Plan  # noqa: E402
from autoshard.plans.searches import named, searches  # noqa: E402
from autoshard.tools.report import save_gantt  # noqa: E402

SECTION = "pipeline_plans"
ROOT = Path(__file__).resolve().parent
CASES = [
    "gpt3-175b --mesh 16x8x8 --axes pp,dp,tp --pipeline pp --batch 1536 --seq 2048 "
    "--microbatches 64 --schedule 1F1B",
    "gpt3-175b --mesh 16x8x8 --axes pp,dp,tp --pipeline pp --batch 1536 --seq 2048",
    "gpt3-175b --gpus 1024 --cluster h100 --batch 1536 --seq 2048",
    "llama3-70b --mesh 8x8 --axes pp,tp --pipeline auto --batch 16 --seq 2048",
    "gpt2 --mesh 8 --axes pp --pipeline auto --batch 8 --seq 1024",
]
GIB = 2**30


def params_of(model: str) -> int:
    from autoshard.zoo.models import count_parameters
    from autoshard.zoo.registry import load_model
    m, _ = load_model(model, batch=1, seq=8, device="meta")
    return count_parameters(m)


def run(case: str, psi: dict[str, int], gantt: Path | None) -> list[str]:
    args = case.split()
    batch, seq = int(args[args.index("--batch") + 1]), int(args[args.index("--seq") + 1])
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "plan.json"
        t0 = time.perf_counter()
        r = subprocess.run(["autoshard", "plan", *args, "-o", str(path)], capture_output=True,
                           text=True)
        wall = time.perf_counter() - t0
        if r.returncode != 0:
            return [f"`{case}`", f"{wall:.1f}", "no plan: " + r.stderr.strip().splitlines()[-1],
                    "", "", "", "", ""]
        plan = json.loads(path.read_text())
        if plan.get("pipeline") is not None and gantt is not None:
            # The library's chart (autoshard/tools/report.py), as `autoshard report` draws it.
            save_gantt(Plan.load(path).pipeline, gantt)
    return row(f"`{case}`", f"{wall:.1f}", plan, psi[args[0]] * batch * seq)


def mfu(step_s: float, devices: int, flops_per_token_psi: float) -> float:
    """6·Ψ·tokens over the step on every device's h100 bf16 dense peak (docs/cost-model.md §2)."""
    return 6 * flops_per_token_psi / (step_s * devices * 989e12)


def row(label: str, wall: str, plan: dict, psi_tokens: float) -> list[str]:
    p, pl = plan["predicted"], plan.get("pipeline")
    devices = 1
    for n in plan["mesh"]["shape"]:
        devices *= n
    mesh = "x".join(map(str, plan["mesh"]["shape"])) + f" ({','.join(plan['mesh']['axes'])})"
    shape = (f"{pl['schedule']}, {pl['microbatches']} microbatches, {len(pl['stages'])} stages "
             f"of {'/'.join(str(len(s['layers'])) for s in pl['stages'])} layers on "
             f"{len(pl['stages']) // pl['virtual_stages']} ranks" if pl else "no pipeline")
    records = searches(plan["solver"])
    search = "; ".join(f"{t.changes.get('pipeline') or 'none'}: " + (
        f"{t.step_time_s * 1e3:.1f} ms" if t.step_time_s is not None else "no plan")
        for r in named(records, "pipeline axis", top=True)[:1] for t in r.tries)
    ms = plan["solver"].get("mesh_search")
    if ms:
        meshes = [t for r in named(records, "meshes", top=True) for t in r.tries]
        planned = sorted((t for t in meshes if t.step_time_s is not None),
                         key=lambda t: t.step_time_s)
        search = (f"{len({t.label for t in planned})} of {ms['candidates']} meshes planned; "
                  "runners-up " + "; ".join(f"{t.label}: {t.step_time_s * 1e3:.1f} ms"
                                            for t in planned[1:4]))
    return [label, wall, f"{p['step_time_s'] * 1e3:.1f}", mesh, shape,
            f"{p['ilp_memory_bytes'] / GIB:.2f}", f"{mfu(p['step_time_s'], devices, psi_tokens):.1%}",
            search or "-"]


def megatron_175b(psi: int) -> list[str]:
    """Megatron-LM's published layout for GPT-3 175B, priced by the same cost model: tensor 8
    in a node (Megatron's column/row-parallel weights pinned, the activations' layouts the ILP's
    cheapest), pipeline 16 with interleaved 1F1B, data 8, its distributed optimizer (ZeRO-1);
    the stages cut by the same program; the fastest of 64 and 192 microbatches (micro-batch 3
    and 1 per data-parallel rank; 16 and 32 leave no cut within memory)."""
    from autoshard.mesh import Mesh
    from autoshard.options import PlanOptions
    from autoshard.solver.baselines import pipelined_baseline_plan
    from autoshard.trace.batches import Traces
    from autoshard.zoo.registry import load_model
    batch, seq = 1536, 2048
    model, inputs = load_model("gpt3-175b", batch=batch, seq=seq, device="meta")
    traces = Traces(model, inputs, training=True)
    mesh = Mesh((16, 8, 8), ("pp", "dp", "tp"), cluster="h100")
    t0 = time.perf_counter()
    plans = []
    for m in (64, 192):
        options = PlanOptions(pipeline="pp", schedule="Interleaved1F1B", microbatches=m)
        plans.append(pipelined_baseline_plan(traces.at(batch // m), mesh, "megatron-dp",
                                             options, model_name="gpt3-175b", zero="zero1"))
    best = min(plans, key=lambda p: p.predicted.step_time_s)
    return row("Megatron-LM's layout for gpt3-175b (priced, not planned): pp16 x dp8 x tp8, "
               "Interleaved1F1B, Megatron weights, ZeRO-1", f"{time.perf_counter() - t0:.1f}",
               best.to_json(), psi * batch * seq)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    args = ap.parse_args()
    psi = {m: params_of(m) for m in dict.fromkeys(c.split()[0] for c in CASES)}
    gantt = ROOT / "pipeline_gantt.png"
    rows = []
    for n, case in enumerate(CASES):
        rows.append(run(case, psi, gantt if n == 0 else None))
        print(" | ".join(rows[-1]), flush=True)
    rows.append(megatron_175b(psi["gpt3-175b"]))
    print(" | ".join(rows[-1]), flush=True)
    head = ["command (`autoshard plan ...`)", "wall s", "predicted step ms", "mesh", "pipeline",
            "largest stage peak GiB", "predicted MFU", "searched"]
    lines = ["## Pipelined plans (h100)", "",
             f"- command: `{command('benchmarks/pipeline_plans.py')}`", f"- machine: {machine()}",
             f"- date: {today()}; {revision()}",
             "- Each row is one `autoshard plan` process (`wall s`: Python start, tracing on the "
             "meta device, every solve; `--microbatches` auto traces and plans p, 2p and 4p; "
             "`--pipeline auto` plans without a pipeline and over each axis, and keeps the "
             "fastest: the last column gives every try). "
             "MFU: 6·Ψ·tokens over the predicted step times devices times 989 TFLOP/s; "
             "Megatron-LM measured 42-47% for GPT-3 175B on H100 (its README, 2024: 96 to 4,608 "
             "GPUs, batch 1,152). The pipelined plans sync gradients once per step and price no "
             "overlap of those syncs or of the sends with compute. `--gpus` searches the meshes "
             "(docs/cost-model.md §11); its last column gives the runners-up. The last row is "
             "Megatron-LM's published layout for 175B priced by the same cost model "
             "(`megatron_175b` in this script: Megatron's weights pinned in every stage, "
             "`autoshard.solver.baselines.pipelined_baseline_plan`).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "![schedule of the first row](pipeline_gantt.png)"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
