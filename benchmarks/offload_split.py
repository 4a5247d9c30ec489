"""Offload per parameter (docs/cost-model.md §9.2): the offload issue's Llama-3-8B rows on one
H100 planned with the state modes the ILP chooses per decision (every identical layer alike),
then split per parameter, as ``autoshard.plan`` returns them. Predicted figures only, planned on
the calibrated H100 profile (benchmarks/h100-calibrated.json); benchmarks/gpu_offload.py runs
them on the GPU.

    python benchmarks/offload_split.py --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, revision, today, write_section  # noqa: E402

import torch  # noqa: E402

from autoshard import Mesh  # noqa: E402
from autoshard.cluster import Cluster  # noqa: E402
from autoshard.ir import StateMode  # noqa: E402
from autoshard.options import resolve_options  # noqa: E402
from autoshard.solver.budget import fit_budget, plan_memory  # noqa: E402
from autoshard.solver.offload_split import offload_per_parameter  # noqa: E402
from autoshard.solver.planner import plan_with  # noqa: E402
from autoshard.trace.batches import Traces  # noqa: E402
from autoshard.zoo.models import Llama, LlamaConfig  # noqa: E402

SECTION = "offload_split"
PROFILE = Path(__file__).resolve().parent / "h100-calibrated.json"
GIB = 2**30
# (layers, batch, memory budget in bytes, its label, checkpointing): the offload issue's rows
# that offload under "auto", and the 32-layer one with every layer fully checkpointed (beside
# the planner's own mix of full and selective checkpointing)
ROWS = ((8, 2, 20 * GIB, "20 GiB", "auto"), (32, 1, 80e9, "80 GB", "auto"),
        (32, 1, 80e9, "80 GB, full checkpointing", "full"))


def _offloaded(plan) -> int:
    return sum(s.kernel in (StateMode.OFFLOAD, StateMode.OFFLOAD_PARAMS)
               for s in plan.strategies().values())


def _checkpointing(plan) -> str:
    """Layers checkpointed, full / selective."""
    policies = list(plan.recompute.values())
    return f"{policies.count('full')} / {policies.count('selective')}"


def row(layers: int, batch: int, budget: float, label: str, recompute: str,
        mesh: Mesh) -> list[str]:
    cfg = LlamaConfig(layers, 4096, 32, 8, 14336, vocab_size=128256, context=8192,
                      rope_theta=500000.0)
    with torch.device("meta"):
        model = Llama(cfg)
    inputs = model.example_inputs(batch, 2048, device="meta")
    options = resolve_options(None, {"precision": "bf16-mixed", "memory_budget": budget,
                                     "offload_overlap": "backward", "recompute": recompute})
    traces = Traces(model, inputs, training=True, precision="bf16-mixed")
    traced = traces.at(batch)
    # The planner's own steps (solver/planner.py plan_traced), the split apart.
    whole = plan_memory(traced, mesh, options, model_name="", fixed=None, trace_s=0.0, merge=None)
    whole = fit_budget(traced, mesh, options, whole, model_name="", trace_s=0.0)
    t = time.perf_counter()
    split = offload_per_parameter(traced, mesh, options, whole) or whole   # (none fits back)
    split_s = time.perf_counter() - t
    planned = plan_with(traces, mesh, options)
    assert planned.predicted == split.predicted, "autoshard.plan returns the split plan"
    out = []
    for modes, p in (("per decision", whole), ("per parameter", split)):
        q = p.predicted
        out.append(f"| {layers} layers, batch {batch}, {label} | {modes} | "
                   f"{_checkpointing(p)} | {_offloaded(p)} | {q.step_time_s * 1e3:,.1f} | "
                   f"{q.host_step_s * 1e3:,.1f} | "
                   f"{q.memory.peak / GIB:.2f} | {q.ilp_sum_bytes / GIB:.2f} | "
                   f"{q.memory.host / GIB:.2f} | "
                   f"{f'{split_s:.1f} s' if modes == 'per parameter' else ''} |")
        print(out[-1], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    mesh = Mesh((1,), ("x",), cluster=Cluster.load(str(PROFILE)))
    rows = ["| model, budget | state modes | layers checkpointed (full / selective) | "
            "parameters offloaded | predicted step (ms) | host "
            "step in the window (ms) | liveness peak (GiB) | ILP sum (GiB) | host state (GiB) | "
            "the split's planning time |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for layers, batch, budget, label, recompute in ROWS:
        rows += row(layers, batch, budget, label, recompute, mesh)
    budget_line = ("The device budget the liveness peak is held to is the memory budget less "
                   "the allocator's slack (docs/cost-model.md §4.6): 18.6 GiB of 20 GiB, "
                   "69.29 GiB of 80 GB.")
    text = "\n".join([
        "## Offload per parameter: the offload issue's Llama-3-8B rows, predicted", "",
        f"- command: `{command('benchmarks/offload_split.py')}`", f"- machine: {machine()}",
        f"- date: {today()}; {revision()}; total wall time "
        f"{(time.perf_counter() - t0) / 60:.1f} min",
        "- Llama-3-8B cut to 8 or 32 layers, bf16-mixed, sequence 2048, AdamW, "
        "`offload_overlap=\"backward\"`, `Mesh((1,))` on benchmarks/h100-calibrated.json; "
        "\"per decision\": the plan as the ILP and the budget search leave it (one state mode "
        "for a parameter of every identical layer); \"per parameter\": after "
        "solver/offload_split.py, as `autoshard.plan` returns it (docs/cost-model.md §9.2); "
        "under checkpointing \"auto\" the pass also tries every layer fully checkpointed, and "
        "keeps the faster.",
        "", *rows, "", budget_line])
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
