"""Llama-3-8B at long context on 8x8 H100: autoshard's plan with context parallelism beside a hand
layout and beside Llama 3's published 128K setup.

Rows, each priced by the same cost model (docs/cost-model.md; §3.11 for context parallelism):

- ``autoshard``: the planner's plan of Llama-3-8B (context raised to the sequence), batch 1;
- ``K/V all-gather only``: the planner with ring attention withdrawn
  (``context_parallel="gather"``);
- ``hand: TP 8 + CP 8``: Megatron tensor parallelism inside a node (the ``megatron-dp``
  baseline's weight layouts) and every attention context parallel across the nodes (pinned
  ``[S(2/zz), S(1)] x [R, S(1)] x [R, S(1)]``, or under ring attention
  ``[S(2/zz), S(1)]`` for K and V too), the rest of the activations placed by the ILP;
- ``without context parallelism``: the planner's plan with the choice withdrawn (no attention
  strategy shards the query sequence, no op is offered the balanced layout), what it planned
  before the choice existed;
- the same two at ``--short`` tokens (default 8192, batch 8, the zoo's): the choice is taken
  only where it pays, and then the plan is no worse.

For each: the predicted step and its parts, the peak memory per device, the model FLOPs
utilisation the step implies (6·Ψ·tokens + 6·L·b·H·s²·d for causal attention, over 64 x 989
TFLOP/s), and the seconds the plan took (wall and this process's CPU time: the machine may be
shared). Llama 3's 128K setup (Dubey et al., arXiv 2407.21783, Table 4: 405B on 16,384 H100, TP 8
x CP 16 x PP 16 x DP 8, 380 TFLOP/s per GPU, 38% MFU) is printed beside them as published.

    python benchmarks/long_context.py --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import contextlib
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, revision, today, write_section  # noqa: E402

import torch  # noqa: E402

from autoshard import Mesh  # noqa: E402
from autoshard.ir import ZIGZAG, Replicate, Shard  # noqa: E402
from autoshard.ops import attention  # noqa: E402
from autoshard.ops.attention import SDPA  # noqa: E402
from autoshard.ops.registry import strategies_for  # noqa: E402
from autoshard.solver.baselines import baseline_pins  # noqa: E402
from autoshard.solver.planner import plan_traced  # noqa: E402
from autoshard.trace import sequence  # noqa: E402
from autoshard.trace.export import op_info, trace  # noqa: E402
from autoshard.zoo.registry import get_model  # noqa: E402

SECTION = "long-context"
H100_BF16 = 989e12      # NVIDIA H100 SXM datasheet, dense
LLAMA3_128K = ("Llama 3 405B at 131072 tokens (published, arXiv 2407.21783 Table 4): 16,384 "
               "H100, TP 8 x CP 16 x PP 16 x DP 8, 380 TFLOP/s per GPU, 38% MFU")


def model_flops(model, batch: int, seq: int) -> float:
    """Training FLOPs of one step: 6·Ψ per token, plus causal attention's 3 x 2·b·H·s²·d per
    layer (half the score matrix; forward + backward as 3x the forward, the usual MFU count)."""
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    head_dim = cfg.hidden // cfg.n_heads
    return 6.0 * params * batch * seq + 6.0 * cfg.n_layers * batch * cfg.n_heads * seq**2 * head_dim


def hand_pins(traced, mesh: Mesh, kernel: str = "cp_gather") -> dict:
    """Megatron's weight layouts over the last axis, every attention context parallel over the
    first with its heads over the last: K/V gathered over the first (``cp_gather``) or passed
    around its ring (``cp_ring``)."""
    pins = baseline_pins(traced, mesh, "megatron-dp")
    zz, heads = Shard(2, ZIGZAG), Shard(1)
    kv = (zz, heads) if kernel == "cp_ring" else (Replicate(), heads)
    want = ((zz, heads), kv, kv)
    for n in traced.graph.nodes:
        if n.target is SDPA:
            (pins[n.name],) = [s for s in strategies_for(op_info(n), mesh.shape)
                               if s.kernel == kernel and tuple(s.inputs) == want]
    return pins


def hand_ring_pins(traced, mesh: Mesh) -> dict:
    return hand_pins(traced, mesh, "cp_ring")


def row(label: str, plan, flops: float, wall: float, cpu: float) -> dict:
    p = plan.predicted
    step = p.step_time_s
    sdpa = next((str(s) for k, s in plan.strategies().items() if "scaled_dot" in k), "-")
    return {"label": label, "step_ms": step * 1e3, "compute_ms": p.compute_s * 1e3,
            "exposed_ms": sum(p.exposed_comm_s.values()) * 1e3,
            "memory_gib": p.memory.peak / 2**30,
            "mfu": flops / (step * plan_devices(plan) * H100_BF16), "wall_s": wall, "cpu_s": cpu,
            "attention": sdpa}


def plan_devices(plan) -> int:
    n = 1
    for s in plan.mesh_shape:
        n *= s
    return n


def cpu_seconds() -> float:
    """This process's CPU time and its finished children's (a solve may run in a child)."""
    return sum(resource.getrusage(who).ru_utime + resource.getrusage(who).ru_stime
               for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))


@contextlib.contextmanager
def without_context_parallelism():
    """The planner as it was before the choice: attention never shards its query sequence,
    and no dim is marked for the balanced layout."""
    saved = attention.context_parallel_ok, sequence.context_parallel_ok
    attention.context_parallel_ok = sequence.context_parallel_ok = lambda op: False
    try:
        yield
    finally:
        attention.context_parallel_ok, sequence.context_parallel_ok = saved


def plan_one(model, inputs, mesh: Mesh, *, fixed=None, cp: bool = True, variant: str = "auto"):
    """``variant``: PlanOptions.context_parallel ("gather": the K/V all-gather alone)."""
    wall, cpu = time.perf_counter(), cpu_seconds()
    with contextlib.nullcontext() if cp else without_context_parallelism():
        traced = trace(model, inputs)
        plan = plan_traced(traced, mesh, model_name="llama3-8b", context_parallel=variant,
                           fixed=fixed(traced, mesh) if fixed else None)
    return plan, time.perf_counter() - wall, cpu_seconds() - cpu


def run(seq: int, short: int, short_batch: int) -> list[dict]:
    mesh = Mesh((8, 8), ("dp", "tp"), cluster="h100")
    rows = []
    for batch, length, hand in ((1, seq, True), (short_batch, short, False)):
        if length <= 0:
            continue
        model, inputs = get_model("llama3-8b", batch=batch, seq=length, context=max(length, 8192))
        flops = model_flops(model, batch, length)
        tries = [(f"autoshard, {length} tokens x {batch}", {}),
                 (f"autoshard without context parallelism, {length} x {batch}", {"cp": False})]
        if hand:
            tries[1:1] = [
                (f"autoshard, K/V all-gather only (no ring), {length} x {batch}",
                 {"variant": "gather"}),
                (f"hand: TP 8 in a node + CP 8 across nodes, {length} x {batch}",
                 {"fixed": hand_pins}),
                (f"hand: TP 8 in a node + ring CP 8 across nodes, {length} x {batch}",
                 {"fixed": hand_ring_pins})]
        for label, kw in tries:
            plan, wall, cpu = plan_one(model, inputs, mesh, **kw)
            rows.append(row(label, plan, flops, wall, cpu))
            print(rows[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    head = ("| plan | predicted step (ms) | compute | exposed comm | peak memory (GiB) | MFU | "
            "planned in: wall / CPU (s) | attention |\n|---|---|---|---|---|---|---|---|\n")
    return head + "".join(
        f"| {r['label']} | {r['step_ms']:.1f} | {r['compute_ms']:.1f} | {r['exposed_ms']:.1f} | "
        f"{r['memory_gib']:.1f} | {100 * r['mfu']:.1f}% | {r['wall_s']:.0f} / {r['cpu_s']:.0f} | "
        f"`{r['attention']}` |\n" for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=131072)
    ap.add_argument("--short", type=int, default=8192, help="0: no short rows")
    ap.add_argument("--short-batch", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = run(args.seq, args.short, args.short_batch)
    body = (f"## Long context: Llama-3-8B with context parallelism on 8x8 H100\n\n"
            f"`{command('benchmarks/long_context.py')}` on {machine()}, {revision()}, "
            f"{today()}. Predicted figures (h100 preset); the seconds each plan took, tracing "
            f"included, on a CPU shared with other work (wall) and as CPU time (this process "
            f"and its solver children). \"Without context parallelism\": the same planner with "
            f"the choice withdrawn (what it planned before the choice existed, priced by this "
            f"revision's model); \"hand\": Megatron's weight layouts over tp, every attention "
            f"context parallel over dp, the other activations placed by the ILP. MFU: "
            f"6·Ψ·tokens + causal attention's 6·L·b·H·s²·d over the step at 64 x 989 TFLOP/s."
            f"\n\n{table(rows)}\nFor scale: {LLAMA3_128K}.\n")
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)


if __name__ == "__main__":
    main()
