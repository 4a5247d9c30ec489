"""The host optimizer step of optimizer offload against torch's AdamW on this host, beyond the
last-level cache, as bytes per second.

    python benchmarks/host_optimizer.py --gib 1 4 --out benchmarks/RESULTS.md
    python benchmarks/host_optimizer.py --gib 0.25                     # print only

``--gib``: the fp32 optimizer state per case (master + exp_avg + exp_avg_sq, 12 bytes per
element), so 1 GiB is 89.5 M parameters. The parameters are laid out as a model has them,
tensors of 2^22 elements (a 2048 x 2048 weight) and a remainder. One AdamW step each
(lr 1e-3, weight decay 0.1), by:

- **torch fused**: ``torch.optim.AdamW(fused=True)`` with fp32 gradients (its CPU kernel needs the
  parameter's dtype); what codegen/optim.py ran before codegen/hostopt.py;
- **torch foreach**: ``torch.optim.AdamW(foreach=True)``, PyTorch's default on a GPU, with fp32
  gradients;
- **hostopt bf16**: codegen/hostopt.py's step (flat buckets of 25 MiB, the default
  ``PlanOptions.bucket_mb``, torch's fused kernel over pieces of ``CHUNK`` elements) with bf16
  gradients, as a bf16-mixed step lands them, converted on the fly;
- **hostopt fp32**: the same with fp32 gradients;
- **copy**: ``dst.copy_(src)`` of one tensor as large as the state, the host's streaming
  bandwidth (read + write) for scale.

Bytes per second count what an Adam step must move: the gradient read, master and moments read
and written (``4 * 6 + gradient bytes`` per element: 28 with fp32 gradients, 26 with bf16),
over the median of ``--iters`` timed steps after one warm-up. The cases run one after another,
each freeing its memory before the next (the 4 GiB case holds about 5.5 GiB at its peak).

The host's load is part of the result: the section states the load average and the share of
CPU time other processes used while each case ran (autoshard/tools/calibrate/timing.py ``other_load``);
on a shared machine the figures are a lower bound of what the host does alone.
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _results import command, machine, revision, today, write_section  # noqa: E402

from autoshard.tools.calibrate import other_load  # noqa: E402

from autoshard.tools.calibrate.timing import host_cpu_seconds
from autoshard.codegen.hostopt import CHUNK, HostOptimizer  # noqa: E402

SECTION = "host-optimizer"
PIECE = 1 << 22
HP = dict(lr=1e-3, weight_decay=0.1)


def _shapes(numel: int) -> list[int]:
    return [PIECE] * (numel // PIECE) + ([numel % PIECE] if numel % PIECE else [])


def _state(numel: int, grad_dtype: torch.dtype):
    params = [torch.nn.Parameter(torch.randn(n)) for n in _shapes(numel)]
    grads = [torch.randn(p.shape).to(grad_dtype) for p in params]
    return params, grads


def _time(step, iters: int) -> list[float]:
    step()                                       # warm-up: the state is allocated here
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def _torch_case(numel: int, iters: int, impl: str) -> list[float]:
    params, grads = _state(numel, torch.float32)
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, **HP, **{impl: True})
    return _time(opt.step, iters)


def _host_case(numel: int, iters: int, grad_dtype: torch.dtype) -> list[float]:
    params, grads = _state(numel, grad_dtype)
    opt = torch.optim.AdamW(params, **HP)
    keys = list(range(len(params)))
    host = HostOptimizer(opt, "adam", keys, params, [torch.float32] * len(params),
                         overlap="none", bucket_bytes=25 * 2**20, device=torch.device("cpu"))

    def step():
        for k, g in zip(keys, grads):            # landing is the copy down: not timed here
            host.land(k, g)
        t0 = time.perf_counter()
        host.start([], _skip)
        host.finish(_skip)
        return time.perf_counter() - t0

    step()
    try:
        return [step() for _ in range(iters)]
    finally:
        host.close()


def _skip(key, new) -> None:
    pass


def _copy_case(numel: int, iters: int) -> list[float]:
    src = torch.randn(numel * 3)
    dst = torch.empty_like(src)
    return _time(lambda: dst.copy_(src), iters)


CASES = {
    "torch fused": (lambda n, it: _torch_case(n, it, "fused"), 28),
    "torch foreach": (lambda n, it: _torch_case(n, it, "foreach"), 28),
    "hostopt bf16": (lambda n, it: _host_case(n, it, torch.bfloat16), 26),
    "hostopt fp32": (lambda n, it: _host_case(n, it, torch.float32), 28),
    "copy": (_copy_case, 24),                   # 12 bytes/element read, 12 written
}


def run_case(name: str, gib: float, iters: int) -> dict:
    numel = int(gib * 2**30 // 12)
    fn, per = CASES[name]
    before, c0 = host_cpu_seconds(), time.process_time()
    times = fn(numel, iters)
    own = time.process_time() - c0
    load = other_load(before, host_cpu_seconds(), own)
    gc.collect()
    t = statistics.median(times)
    return {"case": name, "gib": gib, "numel": numel, "s": t, "min_s": min(times),
            "gbps": numel * per / t / 1e9, "other_load": load}


def render(rows: list[dict], iters: int) -> str:
    load = os.getloadavg()
    lines = [
        "## Host optimizer step against torch's AdamW (this host, beyond the last-level cache)",
        "",
        f"`{command('benchmarks/host_optimizer.py')}`, {today()}, {revision()}.",
        f"Machine: {machine()}; {torch.get_num_threads()} intra-op threads; last-level cache "
        f"{_llc()}. Load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
        f"{os.cpu_count()} CPUs: the host was shared with other work, so every figure is a "
        "lower bound of what it does alone. One AdamW step per row (median of "
        f"{iters} after a warm-up); GB/s counts the bytes an Adam step must move (module "
        f"docstring); hostopt pieces of {CHUNK} elements.",
        "",
        "| fp32 state | implementation | gradients | step (median) | fastest | GB/s | "
        "other processes' CPU share |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        grad = {"hostopt bf16": "bf16", "copy": "-"}.get(r["case"], "fp32")
        lines.append(f"| {r['gib']:g} GiB ({r['numel'] / 1e6:.1f} M) | {r['case']} | {grad} | "
                     f"{r['s'] * 1e3:.0f} ms | {r['min_s'] * 1e3:.0f} ms | {r['gbps']:.2f} | "
                     + (f"{r['other_load']:.0%}" if r["other_load"] is not None else "n/a")
                     + " |")
    return "\n".join(lines) + "\n"


def _llc() -> str:
    try:
        return Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, nargs="+", default=[1.0])
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    args = ap.parse_args(argv)
    rows = []
    for gib in args.gib:
        for name in args.cases:
            rows.append(run_case(name, gib, args.iters))
            r = rows[-1]
            print(f"{gib:g} GiB {name}: {r['s'] * 1e3:.0f} ms, {r['gbps']:.2f} GB/s", flush=True)
    text = render(rows, args.iters)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
