"""Real-size models planned under a sweep of memory budgets: every returned plan peaks within its
budget over the whole step, every refusal names a least memory above it.

The budget is the step's peak (docs/cost-model.md §4.6): for each (model, mesh, budget) the
planner runs with its defaults (``zero``, ``offload``, ``recompute`` all "auto"), bf16-mixed,
on the h100 preset, the model on the meta device. A row is either a plan (its predicted step,
its step peak from liveness and the phase it is reached in, the host bytes it offloads, its
techniques, its warnings) or the planner's refusal (the least memory it found a plan needs, and
that plan's binding phase). The check column says whether the row keeps the promise.

    python benchmarks/budget_table.py                                  # print the table
    python benchmarks/budget_table.py --out benchmarks/RESULTS.md      # rewrite its section
    python benchmarks/budget_table.py --case llama3-8b-8L              # one case
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import command, machine, revision, today, write_section  # noqa: E402

SECTION = "budget_table"
GIB = 2**30
# name -> (zoo preset, layers or None for the preset's, mesh, axes, batch, seq, budgets in GiB)
CASES = {
    "llama3-8b-8L": ("llama3-8b", 8, (1,), ("x",), 2, 2048, (60, 50, 44, 36, 28, 20, 12, 8)),
    "llama2-13b": ("llama2-13b", None, (8,), ("dp",), 8, 4096, (74.5, 60, 40, 24)),
    "llama3-8b-2x2": ("llama3-8b", None, (2, 2), ("dp", "tp"), 8, 2048, (74.5, 40, 24)),
}


def techniques(plan) -> str:
    modes: dict[str, int] = {}
    for st in plan.param_state.values():
        modes[st.mode] = modes.get(st.mode, 0) + 1
    out = [f"{k} {v}" for k, v in sorted(modes.items())]
    if plan.recompute:
        kinds = "/".join(sorted(set(plan.recompute.values())))
        out.append(f"checkpointing {kinds} {len(plan.recompute)}/{len(plan.layers)}")
    return ", ".join(out) or "-"


def traces_of(case: str):
    import torch

    from autoshard.trace.batches import Traces
    from autoshard.zoo.models import GPT, GPTConfig, Llama, LlamaConfig
    from autoshard.zoo.registry import ZOO
    preset, layers, _, _, batch, seq, _ = CASES[case]
    cfg = ZOO[preset].config
    if layers is not None:
        cfg = replace(cfg, n_layers=layers)
    cls = {GPTConfig: GPT, LlamaConfig: Llama}[type(cfg)]
    with torch.device("meta"):
        model = cls(cfg)
        inputs = model.example_inputs(batch, seq, device=torch.device("meta"))
    return Traces(model, inputs, training=True, precision="bf16-mixed")


def row(case: str, traces, budget_gib: float) -> list[str]:
    from autoshard.mesh import Mesh
    from autoshard.options import resolve_options
    from autoshard.solver.planner import plan_with
    from autoshard.solver.solve import BudgetError
    _, _, shape, axes, _, _, _ = CASES[case]
    budget = int(budget_gib * GIB)
    options = resolve_options(None, {"precision": "bf16-mixed", "memory_budget": budget})
    t0 = time.perf_counter()
    try:
        p = plan_with(traces, Mesh(shape, axes, cluster="h100"), options, model_name=case)
    except BudgetError as e:
        wall = time.perf_counter() - t0
        ok = "yes" if e.least_bytes > budget else "NO"
        what = f"refused: least {e.least_bytes / GIB:.2f} GiB" + (f" ({e.phase})" if e.phase
                                                                  else " (ILP sum)")
        return [case, f"{budget_gib:g}", what, "", "", "", "", "", f"{wall:.0f}", ok]
    wall = time.perf_counter() - t0
    pred = p.predicted
    peak = pred.memory.peak
    warn = "; ".join(w for w in p.warnings if "budget" in w) or "-"
    ok = "yes" if peak <= budget and warn == "-" else "NO"
    return [case, f"{budget_gib:g}", "plan", f"{pred.step_time_s * 1e3:.0f}",
            f"{peak / GIB:.2f}", pred.peak_phase, f"{pred.memory.host / GIB:.1f}",
            techniques(p) + ("" if warn == "-" else f"; warning: {warn}"), f"{wall:.0f}", ok]


HEAD = ["case", "budget GiB", "outcome", "step ms", "step peak GiB", "peak phase", "host GiB",
        "techniques", "wall s", "fits"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    ap.add_argument("--case", action="append", choices=sorted(CASES),
                    help="only these cases (default: all)")
    args = ap.parse_args()
    rows = []
    for case in args.case or list(CASES):
        traces = traces_of(case)
        for b in CASES[case][6]:
            rows.append(row(case, traces, b))
            print(" | ".join(rows[-1]), flush=True)
    lines = ["## Budget sweeps: every plan peaks within its budget (h100, bf16-mixed)", "",
             f"- command: `{command('benchmarks/budget_table.py')}`", f"- machine: {machine()}",
             f"- date: {today()}; {revision()}",
             "- Each row plans the model (meta device) with the default options and "
             "`memory_budget` set; `step peak`: the peak over forward, backward and the "
             "optimizer step from the step program's liveness (docs/cost-model.md §4.5), the "
             "figure the planner holds to 93% of the budget (the allocator's slack, §4.6); a refusal gives the least memory a "
             "plan found needs (its step peak and phase, or where the ILP found none, the least "
             "sum it bounds). `fits`: the plan's peak is within the budget with no warning, or "
             "the refusal's least memory is above it. `wall s` is under a shared, loaded "
             "machine: compare rows, not machines.", "",
             "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
