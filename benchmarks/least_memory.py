"""Mixtral-8x7B's least memory per device, as autoshard computes it, beside a hand calculation.

The least memory any plan needs is what the planner reports when no plan fits (the ILP
minimising memory over the problem it solves, ``solver.ilp.least_memory_plan``); this script
computes it for Mixtral-8x7B (benchmarks/holdout/mixtral-8x7b.json, batch 8 x 2048, training with
mixed-precision Adam) on 8 and 8x8 h100, without and with full activation checkpointing
(docs/cost-model.md §8), and writes it beside the hand calculation below (HAND: per-token
activation bytes read off transformers' Mixtral forward; model state from docs/cost-model.md §4.1).

    python benchmarks/least_memory.py --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import holdout  # noqa: E402
from _results import command, machine, revision, today, write_section  # noqa: E402

from autoshard import Mesh, PlanOptions  # noqa: E402
from autoshard.solver.build import build_problem  # noqa: E402
from autoshard.solver.ilp import least_memory_plan  # noqa: E402
from autoshard.trace.export import trace  # noqa: E402
from autoshard.trace.layers import checkpointable  # noqa: E402

SECTION = "mixtral_memory"
GIB = 2**30
PARAMS = 46_702_792_704
H, F, LAYERS, TOKENS, VOCAB = 4096, 14336, 32, 8 * 2048, 32000
PER_TOKEN_LAYER = 90 * H            # bytes, the table in HAND
HAND_TABLE = """Hand calculation (h = 4096, 32 heads of 128, 8 KV heads, FFN f = 14336 = 3.5h, 8 experts, top-2, vocabulary 32000, 32 layers, 16,384 tokens per step; bytes per token per layer, bf16 activations, RMSNorm computed in fp32 as transformers does):

| part | saved for backward | bytes / token / layer |
|---|---|---|
| 2 RMSNorms | the fp32 input (4h) + the normalised bf16 value the weight multiplies (2h), each | 12h |
| attention | the projections' input (2h); RoPE keeps only cos and sin (a product keeps a factor for the other's gradient, and cos/sin need none); SDPA: q, and k, v after `repeat_kv` (2h each) + its output (2h); o_proj's input (2h) | 12h |
| router | its input (2h); the 8 softmax outputs are negligible | 2h |
| experts, per routed copy (2 per token) | the gathered token (2h), gate (2f), up (2f), silu(gate) (2f), the product down_proj reads (2f): 2h + 8f = 30h | 60h |
| routing weights | each expert's output (2h) x 2 | 4h |
| total | | 90h = 368,640 B |

Model state: 46,702,792,704 parameters x 16 bytes (docs/cost-model.md §4.1) / devices. Loss: the log-softmax of the logits in fp32 (4 x 32000 B per token); the last norm and the head's input: 8h per token.
"""
LIMITS = """The one row off by more than 10% (8x8 without checkpointing) is a limit of the strategy space, not of the memory model: the experts' `_grouped_mm` keeps its token rows whole (its offsets are global), and the fused gate/up projection's output cannot reach `silu` and `mul` sharded on the FFN dim without strided sharding of the fused dimension; so on the data axis the down projection reads its input gathered (112 MiB per layer per device instead of 14). Expert parallelism and strided sharding of fused projections are the breadth issue's items 1 and 3.
"""


def hand(devices: int, recompute: bool) -> tuple[float, str]:
    """Model state + activations per device, GiB, and how they add up."""
    tokens = TOKENS / devices
    state = PARAMS * 16 / devices / GIB
    loss = tokens * 4 * VOCAB / GIB
    head = tokens * 8 * H / GIB
    layer = tokens * PER_TOKEN_LAYER / GIB
    if recompute:
        inputs = LAYERS * tokens * 2 * H / GIB
        total = state + inputs + layer + loss + head
        how = (f"layer inputs {LAYERS} x {tokens:.0f} tok x 2h = {inputs:.2f}; one layer "
               f"{layer:.2f}; loss {loss:.2f}; head {head:.2f}")
    else:
        total = state + LAYERS * layer + loss + head
        how = (f"{LAYERS} x {tokens:.0f} tok x 90h = {LAYERS * layer:.2f}; loss {loss:.2f}; "
               f"head {head:.2f}")
    return total, f"{state:.2f} | {how}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = holdout.build("mixtral-8x7b", "bfloat16")[0]
    traced = trace(model, holdout.example_inputs(model, 8, 2048)[0], training=True)
    layers = frozenset(checkpointable(traced.graph, traced.layers))
    rows = ["| mesh | checkpointing | model state GiB | activations GiB (hand) | hand total GiB "
            "| autoshard least GiB | autoshard / hand |", "|---|---|---|---|---|---|---|"]
    for shape in ((8,), (8, 8)):
        for recompute in (frozenset(), layers):
            problem = build_problem(traced, Mesh(shape, cluster="h100"), PlanOptions(),
                                    recompute=recompute).problem
            least = least_memory_plan(problem, time_limit_s=120)
            total, parts = hand(Mesh(shape).size, bool(recompute))
            got = least.bytes / GIB
            rows.append(f"| {'x'.join(map(str, shape))} | {'full' if recompute else 'none'} | "
                        f"{parts} | {total:.2f} | {got:.2f}{'' if least.exact else ' (bound)'} "
                        f"| {got / total - 1:+.1%} |")
            print(rows[-1], flush=True)
    text = "\n".join([
        "## Mixtral-8x7B: least memory against a hand calculation", "",
        f"- command: `{command('benchmarks/least_memory.py')}`", f"- machine: {machine()}",
        f"- date: {today()}; {revision()}; total wall time {(time.perf_counter() - t0) / 60:.1f} min",
        "- autoshard's figure: the least memory per device any plan needs (the ILP minimising "
        "memory over the planner's own problem, exact unless marked), for Mixtral-8x7B "
        "(transformers' default experts path, bf16, batch 8 x 2048, training with "
        "mixed-precision Adam), without and with full activation checkpointing of the 32 layers "
        "(docs/cost-model.md §8). When no plan fits, the planner reports the figure of the search "
        "it ran last (with checkpointing, for the default recompute=\"auto\").", "",
        HAND_TABLE.strip(), "", *rows, "", LIMITS.strip()])
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)


if __name__ == "__main__":
    main()
