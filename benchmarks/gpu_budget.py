"""On one GPU: the budget sweep run, every plan's allocator peak against its budget.

The planner holds the step's peak from liveness to ``memory_budget`` less the allocator's slack
(docs/cost-model.md §4.6). This script checks that promise where it matters: Llama-3-8B cut to
8 layers (bf16-mixed, batch 2 x 2048, one device on the h100 preset, as
``benchmarks/budget_table.py`` plans it) at each budget of the sweep, planned with the default
options, run through ``parallelize`` + ``pm.optimizer`` for two steps on a world of 1 (NCCL),
and per plan:

- ``torch.cuda.max_memory_allocated`` over the second step against the budget (must be at most
  it) and against the plan's predicted step peak (the issue asks within 3%);
- on plans that offload, the process's resident host memory (``VmHWM`` of /proc/self/status,
  the peak) against the predicted host bytes plus the process reserve (within 10%).

A budget the planner refuses is a row too (its least memory, which must be above the budget).
Each plan runs in a fresh child process so that one plan's allocator and host high-water marks
do not carry into the next.

    python benchmarks/gpu_budget.py --out benchmarks/RESULTS.md
    python benchmarks/gpu_budget.py --budgets 60,44,20        # a few budgets

Needs a CUDA device; on a machine without one it says so and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import (command, cuda_device, machine, revision, today,  # noqa: E402
                      write_section)

SECTION = "gpu_budget"
GIB = 2**30
BUDGETS = (60, 50, 44, 36, 28, 20, 12, 8)
LAYERS, BATCH, SEQ = 8, 2, 2048


def _vm_hwm() -> int:
    """The process's peak resident memory in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def one(budget_gib: float) -> dict:
    """Plan, run two steps, measure: in this process (the child)."""
    import torch
    import torch.distributed as dist

    import autoshard
    from autoshard.cost.memory import HOST_RESERVE_BYTES
    from autoshard.solver.solve import BudgetError
    from autoshard.zoo.models import Llama
    from autoshard.zoo.registry import ZOO

    device = cuda_device("benchmarks/gpu_budget.py")
    assert device is not None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29537")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    budget = int(budget_gib * GIB)
    try:
        torch.manual_seed(0)
        with device:
            model = Llama(replace(ZOO["llama3-8b"].config, n_layers=LAYERS))
            x, y = model.example_inputs(BATCH, SEQ, device=device)
        mesh = autoshard.Mesh((1,), ("x",), cluster="h100")
        t0 = time.perf_counter()
        try:
            plan = autoshard.plan(model, (x, y), mesh, model_name="llama3-8b-8L",
                                  precision="bf16-mixed", memory_budget=budget)
        except BudgetError as e:
            return {"budget_gib": budget_gib, "refused": True, "least_bytes": e.least_bytes,
                    "phase": e.phase, "plan_s": time.perf_counter() - t0}
        plan_s = time.perf_counter() - t0
        pm = autoshard.parallelize(model, mesh, plan=plan, example_inputs=(x, y))
        del model
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
        xs, ys = pm.shard_inputs(x, y)
        pm.step(xs, ys)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        loss = pm.step(xs, ys)
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize(device)
        pred = plan.predicted
        return {"budget_gib": budget_gib, "refused": False, "plan_s": plan_s,
                "loss": float(loss), "peak_bytes": torch.cuda.max_memory_allocated(device),
                "predicted_peak_bytes": pred.memory.peak, "phase": pred.peak_phase,
                "host_hwm_bytes": _vm_hwm(),
                "predicted_host_bytes": pred.memory.host + HOST_RESERVE_BYTES,
                "offloads": any(st.offload != "none" for st in plan.param_state.values()),
                "warnings": list(plan.warnings), "step_ms": pred.step_time_s * 1e3}
    finally:
        dist.destroy_process_group()


def render(rows: list[dict]) -> str:
    head = ["budget GiB", "outcome", "predicted peak GiB", "max_memory_allocated GiB",
            "within budget", "vs predicted", "host peak GiB (VmHWM)", "predicted host GiB",
            "host vs predicted"]
    lines = ["## On one GPU: budget sweep, allocator peak against budget", "",
             f"- command: `{command('benchmarks/gpu_budget.py')}`", f"- machine: {machine()}",
             f"- date: {today()}; {revision()}",
             f"- Llama-3-8B cut to {LAYERS} layers, bf16-mixed, batch {BATCH} x {SEQ}, one "
             "device (h100 preset), default options and `memory_budget`; the second of two "
             "steps through `parallelize` + `pm.optimizer` measured, each plan in a fresh "
             "process. Host: predicted host bytes plus the process reserve "
             "(docs/cost-model.md §4.6).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b = r["budget_gib"]
        if "error" in r:
            lines.append(f"| {b:g} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        if r["refused"]:
            ok = "yes" if r["least_bytes"] > b * GIB else "NO"
            lines.append(f"| {b:g} | refused: least {r['least_bytes'] / GIB:.2f} GiB "
                         f"({r['phase']}), above the budget: {ok} |" + " |" * (len(head) - 2))
            continue
        peak, pred = r["peak_bytes"], r["predicted_peak_bytes"]
        host = (f"{r['host_hwm_bytes'] / GIB:.1f} | {r['predicted_host_bytes'] / GIB:.1f} | "
                f"{r['host_hwm_bytes'] / r['predicted_host_bytes'] - 1:+.1%}") \
            if r["offloads"] else "- | - | -"
        lines.append(f"| {b:g} | plan ({r['phase']}) | {pred / GIB:.2f} | {peak / GIB:.2f} | "
                     f"{'yes' if peak <= b * GIB else 'NO'} | {peak / pred - 1:+.1%} | {host} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="GiB, comma-separated (default: the issue's sweep)")
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    ap.add_argument("--one", type=float, default=None, help=argparse.SUPPRESS)  # the child
    args = ap.parse_args()
    if args.one is not None:
        print("RESULT " + json.dumps(one(args.one)), flush=True)
        return 0
    if cuda_device("benchmarks/gpu_budget.py") is None:
        return 2
    rows = []
    for b in (float(x) for x in args.budgets.split(",")):
        r = subprocess.run([sys.executable, __file__, "--one", str(b)], capture_output=True,
                           text=True)
        found = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        row = json.loads(found[-1][7:]) if found else {
            "budget_gib": b, "error": (r.stderr.strip().splitlines() or ["no output"])[-1]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    text = render(rows)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
