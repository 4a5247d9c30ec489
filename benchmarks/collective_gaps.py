"""How long a collective takes against how long the ranks computed before it, on gloo ranks of
this host.

    python benchmarks/collective_gaps.py --out benchmarks/RESULTS.md

`autoshard calibrate` times each collective after compute, as a training step calls it between
ops (docs/cost-model.md §2.9); how long that compute runs matters on a CPU host, and this
measures how: on 2 gloo ranks (one thread each, as the
benchmarks run plans), all-gather, reduce-scatter and all-reduce of 256 KiB, 1 MiB and 4 MiB
(S as docs/cost-model.md §1.1 defines it), each call after ``gap`` ms of small matmuls on both
ranks, timed from the last rank's entry to the last rank's exit (the calibration's measure);
median of ``--calls`` calls after 5 warm-up calls.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import command, machine, revision, today, write_section  # noqa: E402

SECTION = "collective_gaps"
KINDS = ("all_gather", "reduce_scatter", "all_reduce")
SIZES = (2**18, 2**20, 2**22)
GAPS_MS = (0, 1, 3, 10, 30)


def _call(kind: str, nbytes: int, p: int):
    import torch.distributed as dist
    n = nbytes // 4
    if kind == "all_gather":               # S is the gathered output
        x, out = torch.randn(n // p), torch.empty(n)
        return lambda: dist.all_gather_into_tensor(out, x)
    if kind == "reduce_scatter":           # S is the input
        x, out = torch.randn(n), torch.empty(n // p)
        return lambda: dist.reduce_scatter_tensor(out, x)
    x = torch.randn(n)
    return lambda: dist.all_reduce(x)


def gaps_rank(calls: int) -> dict:
    """On every rank at once: per (kind, size, gap) the seconds of each call from the last
    rank's entry to the last rank's exit (host wall clock, shared by the ranks)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    p = dist.get_world_size()
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    t0 = time.perf_counter()
    for _ in range(50):
        a @ b
    per_mm = (time.perf_counter() - t0) / 50
    out = {}
    for kind in KINDS:
        for nbytes in SIZES:
            fn = _call(kind, nbytes, p)
            for gap in GAPS_MS:
                k = round(gap / 1e3 / per_mm)
                secs = []
                for i in range(calls + 5):
                    dist.barrier()
                    for _ in range(k):
                        a @ b
                    t_in = time.time()
                    fn()
                    stamp = torch.tensor([t_in, time.time()], dtype=torch.float64)
                    every = [torch.empty(2, dtype=torch.float64) for _ in range(p)]
                    dist.all_gather(every, stamp)
                    if i >= 5:
                        secs.append(max(float(s[1]) for s in every)
                                    - max(float(s[0]) for s in every))
                out[f"{kind}/{nbytes}/{gap}"] = statistics.median(secs)
    return out


def render(res: dict, calls: int, wall_s: float) -> str:
    lines = ["## Collectives against the compute before them (2 gloo ranks)", "",
             f"- command: `{command('benchmarks/collective_gaps.py')}`",
             f"- machine: {machine()}", f"- {revision()}",
             f"- date: {today()}; total wall time {wall_s:.0f} s", "",
             "Each call after `gap` ms of small matmuls on both ranks, timed from the last "
             "rank's entry to the last rank's exit; median of "
             f"{calls} calls, ms. `autoshard calibrate --device cpu` times its calls after 30 ms "
             "of compute (a step's collectives come tens of ms apart).", "",
             "| collective | S | " + " | ".join(f"gap {g} ms" for g in GAPS_MS)
             + f" | gap {GAPS_MS[-1]} / gap {GAPS_MS[2]} |",
             "| --- | ---: |" + " ---: |" * (len(GAPS_MS) + 1)]
    for kind in KINDS:
        for nbytes in SIZES:
            row = [res[f"{kind}/{nbytes}/{g}"] for g in GAPS_MS]
            lines.append(f"| {kind} | {nbytes >> 10} KiB | "
                         + " | ".join(f"{t * 1e3:.2f}" for t in row)
                         + f" | {row[-1] / row[2]:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=25)
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    args = ap.parse_args(argv)
    from autoshard.codegen.world import World
    t0 = time.perf_counter()
    with World(2, timeout_s=1200) as w:
        w.start()
        reports = w.run(gaps_rank, args.calls)
    text = render(reports[0], args.calls, time.perf_counter() - t0)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
