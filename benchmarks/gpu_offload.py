"""On one GPU: CPU offload as the runtime runs it, against the plan's prediction.

Optimizer offload (ZeRO-Offload, arXiv 2101.06840) and parameter offload (ZeRO-Infinity, arXiv
2104.07857; FSDP2's ``CPUOffloadPolicy``) price the host link and the host's optimizer step
(docs/cost-model.md §9). On a CPU run the "host" is the device itself; only a GPU exercises
the real path: pinned host memory, copies over PCIe each way, AdamW on the host's cores. This
script measures, on one GPU as rank 0 of a world of 1 (NCCL):

1. The host link: pinned and pageable copies each way at the sizes the runtime moves, against
   the preset's ``host_bandwidth``; and AdamW over fp32 state on the host's cores (the kernel
   ``pm.optimizer`` picks there) against ``host_mem_bandwidth``.
2. One model planned three ways on the h100 preset, ``offload`` forced to ``none``,
   ``optimizer`` and ``parameters``: the median step (forward + backward, then the optimizer
   step) against the plan's predicted step and its parts; the host bytes the runtime counted in
   a step against the plan's ``host_transfers``; the CUDA allocator's peak against the plan's
   liveness peak and its host bytes; and the losses of a few AdamW steps from one init against
   the eager model's (every plan must train as the model does).

3. Llama-3-8B at the shapes of the offload issue's table (bf16-mixed through ``parallelize`` and
   ``pm.optimizer(AdamW)``; 8 layers at batch 2 x 2048, 32 layers at 1 x 2048), each row under
   a memory budget and an ``offload`` mode, and for optimizer offload under each
   ``offload_overlap`` (codegen/hostopt.py): predicted step against the measured step (a whole
   iteration, forward + backward + ``opt.step()``), the forward + backward and optimizer parts,
   and the losses of the first steps: every overlap's equal to the unoverlapped run's
   ("backward"), or to its documented recurrence ("delayed": the parameters one update behind,
   so from one batch repeated its loss at step 2 is step 1's, at step 3 the plain run's step 2).
   ``--llama none`` skips them.

    python benchmarks/gpu_offload.py --out benchmarks/RESULTS.md

Needs a CUDA device; on a machine without one it says so and writes nothing.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import (command, cuda_device, machine, revision, today,  # noqa: E402
                      write_section)

SECTION = "gpu-offload"
LLAMA_SECTION = "gpu-offload-llama"
MODES = ("none", "optimizer", "parameters")
GiB = 2**30
# The offload issue's table: (label, layers, batch, seq, memory budget, offload, overlaps).
LLAMA_ROWS = (
    ("Llama-3-8B / 8 layers, 80 GB", 8, 2, 2048, None, "none", ("backward",)),
    ("Llama-3-8B / 8 layers, 20 GiB", 8, 2, 2048, 20 * GiB, "optimizer",
     ("none", "backward", "delayed")),
    ("Llama-3-8B / 8 layers, 8 GiB", 8, 2, 2048, 8 * GiB, "parameters", ("backward",)),
    # The planner's choice on one 80 GB GPU: optimizer offload of as few parameters as fit
    # (PlanOptions.offload "auto", per parameter), the ZeRO-Offload layout of the table
    # (every parameter's state on the host) beside it.
    ("Llama-3-8B / 32 layers, one 80 GB GPU", 32, 1, 2048, 80e9, "auto",
     ("none", "backward", "delayed")),
    ("Llama-3-8B / 32 layers, one 80 GB GPU, all state offloaded", 32, 1, 2048, None,
     "optimizer", ("none", "backward")),
)


def _timed(fn, device) -> float:
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def host_link(device, sizes_mib=(4, 64, 256), reps: int = 10) -> list[dict]:
    """Copies each way between the GPU and host memory, pinned and pageable: GB/s, median."""
    rows = []
    for mib in sizes_mib:
        n = mib * 2**20 // 4
        dev = torch.empty(n, device=device)
        for pinned in (True, False):
            host = torch.empty(n, pin_memory=pinned)
            for direction, fn in (("h2d", lambda: dev.copy_(host)),
                                  ("d2h", lambda: host.copy_(dev))):
                fn()
                t = statistics.median(_timed(fn, device) for _ in range(reps))
                rows.append({"MiB": mib, "pinned": pinned, "direction": direction,
                             "GB_s": n * 4 / t / 1e9})
    return rows


def host_adamw(state_bytes: int = 2**30, reps: int = 5) -> dict:
    """AdamW on the host over ``state_bytes`` of fp32 state (master and moments), beyond the
    last-level cache, as optimizer offload steps it (codegen/hostopt.py: flat buckets, torch's
    fused kernel, bf16 gradients converted on the fly): seconds and the bytes a step streams
    in the model's terms (docs/cost-model.md §9: ADAM_STEP_BYTES an element) per second."""
    from autoshard.codegen.hostopt import HostOptimizer
    from autoshard.cost.state import ADAM_STEP_BYTES
    numel = state_bytes // 12
    p = torch.nn.Parameter(torch.randn(numel))
    g = torch.randn(numel).to(torch.bfloat16)
    host = HostOptimizer(torch.optim.AdamW([p], lr=1e-4), "adam", [0], [p], [torch.float32],
                         overlap="none", bucket_bytes=25 * 2**20, device=torch.device("cpu"))

    def step() -> float:
        host.land(0, g)
        t0 = time.perf_counter()
        host.start([], _dropped)
        host.finish(_dropped)
        return time.perf_counter() - t0

    step()
    t = statistics.median(step() for _ in range(reps))
    host.close()
    return {"numel": numel, "fused": True, "threads": host.threads, "s": t,
            "GB_s": numel * ADAM_STEP_BYTES / t / 1e9}


def _dropped(key, new) -> None:
    pass


def gpt2_small(device, batch: int, seq: int):
    from autoshard.zoo.models import GPT, GPTConfig
    torch.manual_seed(0)
    with device:
        model = GPT(GPTConfig(12, 768, 12, vocab_size=50257, context=1024, dtype=torch.float32))
        inputs = model.example_inputs(batch, seq, device=device)
    return model, inputs


def eager_losses(device, batch: int, seq: int, steps: int) -> list[float]:
    model, (x, y) = gpt2_small(device, batch, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    out = []
    for _ in range(steps):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def run_plan(device, mode: str, batch: int, seq: int, steps: int, loss_steps: int,
             cluster="h100") -> dict:
    """One plan with ``offload=mode`` on a world of 1: losses from the seeded init, then the
    median step and its two parts, the host bytes of one step and the allocator's peak."""
    import autoshard
    model, (x, y) = gpt2_small(device, batch, seq)
    mesh = autoshard.Mesh((1,), ("x",), cluster=cluster)
    t0 = time.perf_counter()
    plan = autoshard.plan(model, (x, y), mesh, model_name="gpt2-small-shape", offload=mode)
    plan_s = time.perf_counter() - t0
    pm = autoshard.parallelize(model, mesh, plan=plan, example_inputs=(x, y))
    del model
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-4)
    xs, ys = pm.shard_inputs(x, y)
    losses = []
    for _ in range(loss_steps):
        losses.append(pm.step(xs, ys).item())
        opt.step()
        opt.zero_grad()
    host_params = sum(p.numel() for p in pm.params.values() if p.device.type == "cpu")
    pm.runtime.ledger.clear()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)

    def fb():
        pm.step(xs, ys)

    def step_opt():
        opt.step()
        opt.zero_grad()

    fb()
    step_opt()
    peak = torch.cuda.max_memory_allocated(device)
    ledger = pm.runtime.ledger
    measured_host = {d: sum(t.nbytes for t in ledger.host if t.direction == d)
                     for d in ("h2d", "d2h")}
    planned_host = {d: sum(t.bytes for t in plan.host_transfers if t.direction == d)
                    for d in ("h2d", "d2h")}
    times = {"fb": [], "opt": []}
    for i in range(steps + 2):
        ledger.clear()
        a, b = _timed(fb, device), _timed(step_opt, device)
        if i >= 2:
            times["fb"].append(a)
            times["opt"].append(b)
    med = {k: statistics.median(v) for k, v in times.items()}
    p = plan.predicted
    out = {"mode": mode, "plan_s": plan_s, "losses": losses, "median_s": med,
           "step_s": med["fb"] + med["opt"],
           "predicted": {k: getattr(p, k) for k in ("step_time_s", "compute_s", "host_s",
                                                    "optimizer_s")},
           "host_bytes": {"measured": measured_host, "planned": planned_host},
           "params_on_host": host_params,
           "peak_bytes": peak, "predicted_peak_bytes": p.memory.peak,
           "predicted_host_bytes": p.memory.host}
    del pm, opt
    gc.collect()
    torch.cuda.empty_cache()
    return out


def llama(layers: int):
    """Llama-3-8B's dims with ``layers`` layers, built without memory (parallelize materializes
    each rank's shards on its device)."""
    from autoshard.codegen.materialize import deferred_init
    from autoshard.zoo.models import Llama, LlamaConfig
    cfg = LlamaConfig(layers, 4096, 32, 8, 14336, vocab_size=128256, context=8192,
                      rope_theta=500000.0)
    with deferred_init():
        return Llama(cfg)


def run_llama(device, row: tuple, overlap: str, steps: int, loss_steps: int,
              cluster="h100") -> dict:
    """One row of LLAMA_ROWS under ``overlap``: the plan's prediction, the median iteration and
    its parts, the first losses (one batch, repeated)."""
    import autoshard
    label, layers, batch, seq, budget, offload, _ = row
    model = llama(layers)
    torch.manual_seed(0)               # one batch for every run of a row: losses comparable
    inputs = model.example_inputs(batch, seq, device=device)
    mesh = autoshard.Mesh((1,), ("x",), cluster=cluster)
    t0 = time.perf_counter()     # (planned on meta inputs, as the model's tensors are)
    plan = autoshard.plan(model, model.example_inputs(batch, seq, device="meta"), mesh, model_name=f"llama3-8b-{layers}l",
                          precision="bf16-mixed", memory_budget=budget, offload=offload,
                          offload_overlap=overlap)
    plan_s = time.perf_counter() - t0
    pm = autoshard.parallelize(model, mesh, plan=plan, example_inputs=inputs, seed=0)
    del model
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-5)
    local = pm.shard_inputs(*inputs)
    losses = []
    for _ in range(loss_steps):
        losses.append(pm.step(*local).item())
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(device)
    times = {"fb": [], "opt": [], "iter": []}
    for i in range(steps + 2):
        t0 = time.perf_counter()
        a = _timed(lambda: pm.step(*local), device)
        b = _timed(lambda: (opt.step(), opt.zero_grad()), device)
        if i >= 2:
            times["fb"].append(a)
            times["opt"].append(b)
            times["iter"].append(time.perf_counter() - t0)
    opt.settle()
    p = plan.predicted
    out = {"label": label, "offload": offload, "overlap": overlap, "plan_s": plan_s,
           "losses": losses, "median_s": {k: statistics.median(v) for k, v in times.items()},
           "predicted": {k: getattr(p, k) for k in ("step_time_s", "compute_s", "host_s",
                                                    "optimizer_s", "host_step_s")},
           "modes": {m: sum(1 for st in plan.param_state.values() if st.mode == m)
                     for m in {st.mode for st in plan.param_state.values()}},
           "peak_bytes": torch.cuda.max_memory_allocated(device),
           "predicted_peak_bytes": p.memory.peak}
    del pm, opt
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return out


def llama_child(run: str, args) -> dict:
    """One run of the table in a fresh process: the host's pinned buffers of a run at real
    size (up to ~110 GB for 8B parameters' state) stay in torch's pinned-memory cache after it
    is freed, and the next run would not fit beside them."""
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, __file__, "--one", run, "--cluster", str(args.cluster),
               "--steps", str(args.llama_steps or args.steps),
               "--loss-steps", str(args.loss_steps), "--json", str(out)]
        proc = subprocess.run(cmd)
        if proc.returncode or not out.exists():
            row = LLAMA_ROWS[int(run.split(":")[0])]
            return {"label": row[0], "offload": row[5], "overlap": run.split(":")[1],
                    "failed": f"exit status {proc.returncode}"}
        return json.loads(out.read_text())


def one_llama(device, args) -> int:
    """The child of :func:`llama_child`: one run, on a world of 1, written to ``--json``."""
    import torch.distributed as dist
    i, overlap = args.one.split(":")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = "29535"
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        out = run_llama(device, LLAMA_ROWS[int(i)], overlap, args.steps, args.loss_steps,
                        args.cluster)
    finally:
        dist.destroy_process_group()
    Path(args.json).write_text(json.dumps(out, default=str))
    return 0


def loss_check(rows: list[dict]) -> dict[int, str]:
    """Per row, the losses against the unoverlapped run of its label: equal ("backward"), or
    the delayed update's recurrence (module docstring)."""
    plain = {r["label"]: r["losses"] for r in rows if r["overlap"] == "none" and "losses" in r}
    out = {}
    for i, r in enumerate(rows):
        ref = plain.get(r["label"])
        if "failed" in r:
            out[i] = "-"
            continue
        if ref is None or r["overlap"] == "none":
            out[i] = "-"
            continue
        want = ref if r["overlap"] == "backward" else [ref[0], ref[0], *ref[1:]]
        n = min(len(want), len(r["losses"]), 3)
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], want[:n]))
        out[i] = f"{diff:.1e} over {n} steps"
    return out


def render_llama(rows: list[dict]) -> str:
    lines = ["## On one GPU: Llama-3-8B under offload (the offload issue's table)", "",
             f"- command: `{command('benchmarks/gpu_offload.py')}`",
             f"- machine: {torch.cuda.get_device_name()}; {machine()}", f"- {revision()}",
             f"- date: {today()}", "",
             "| model, budget | offload (parameters by mode) | overlap | predicted step "
             "(host step in the window) | measured iteration | fwd+bwd | opt.step() | "
             "measured / predicted | peak GPU memory, measured / liveness (GiB) | losses "
             "against the unoverlapped run |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    checks = loss_check(rows)
    for i, r in enumerate(rows):
        if "failed" in r:
            lines.append(f"| {r['label']} | {r['offload']} | {r['overlap']} | failed: "
                         f"{r['failed']} | | | | | | |")
            continue
        p, m = r["predicted"], r["median_s"]
        modes = ", ".join(f"{k or 'plain'} {v}" for k, v in sorted(r["modes"].items(),
                                                                     key=lambda kv: str(kv[0])))
        lines.append(f"| {r['label']} | {r['offload']} ({modes}) | {r['overlap']} | "
                     f"{p['step_time_s'] * 1e3:.0f} ({p['host_step_s'] * 1e3:.0f}) | "
                     f"{m['iter'] * 1e3:.0f} | {m['fb'] * 1e3:.0f} | {m['opt'] * 1e3:.0f} | "
                     f"{m['iter'] / p['step_time_s']:.2f} | {r['peak_bytes'] / GiB:.1f} / "
                     f"{r['predicted_peak_bytes'] / GiB:.1f} | {checks[i]} |")
    return "\n".join(lines) + "\n"


def render(args, link: list[dict], adamw: dict, rows: list[dict], eager: list[float],
           wall_s: float) -> str:
    from autoshard.cluster import Cluster
    c = Cluster.preset("h100")
    lines = ["## On one GPU: CPU offload against its prediction", "",
             f"- command: `{command('benchmarks/gpu_offload.py')}`",
             f"- machine: {torch.cuda.get_device_name()}; {machine()}", f"- {revision()}",
             f"- date: {today()}; total wall time {wall_s / 60:.1f} min", "",
             f"**Host link** (GB/s, median of 10 copies; the h100 preset prices "
             f"{c.host_bandwidth / 1e9:.0f} GB/s each way, docs/cost-model.md §2.10):", "",
             "| MiB | pinned h2d | pinned d2h | pageable h2d | pageable d2h |",
             "| ---: | ---: | ---: | ---: | ---: |"]
    for mib in sorted({r["MiB"] for r in link}):
        get = {(r["pinned"], r["direction"]): r["GB_s"] for r in link if r["MiB"] == mib}
        lines.append(f"| {mib} | {get[True, 'h2d']:.1f} | {get[True, 'd2h']:.1f} | "
                     f"{get[False, 'h2d']:.1f} | {get[False, 'd2h']:.1f} |")
    lines += ["", f"**AdamW on the host** ({adamw['numel'] / 1e6:.0f}M fp32 parameters, "
              f"codegen/hostopt.py's fused step, bf16 gradients, {adamw['threads']} threads): "
              f"{adamw['s'] * 1e3:.1f} ms a step, {adamw['GB_s']:.1f} GB/s of the bytes a step "
              f"streams, against the preset's {c.host_mem_bandwidth / 1e9:.1f} GB/s of host "
              "memory bandwidth per GPU.", "",
              f"**GPT-2 small's shape** (12 layers, hidden 768, vocab 50257; fp32, batch "
              f"{args.batch} × {args.seq}) planned on `Mesh((1,), cluster=\"h100\")` with "
              "`offload` forced; AdamW through `pm.optimizer`; median of "
              f"{args.steps} steps (ms):", "",
              "| offload | parameters on host | predicted step (compute + host link + host "
              "optimizer) | measured step | fwd+bwd | optimizer | measured / predicted | "
              "host bytes a step, measured / planned (MB) | peak GPU memory, measured / "
              "liveness (GiB) | host state, planned (GiB) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        p = r["predicted"]
        hb = r["host_bytes"]
        meas = sum(hb["measured"].values()) / 1e6
        plan = sum(hb["planned"].values()) / 1e6
        lines.append(
            f"| {r['mode']} | {r['params_on_host'] / 1e6:.1f}M | {p['step_time_s'] * 1e3:.1f} "
            f"({p['compute_s'] * 1e3:.1f} + {p['host_s'] * 1e3:.1f} + "
            f"{p['optimizer_s'] * 1e3:.1f}) | {r['step_s'] * 1e3:.1f} | "
            f"{r['median_s']['fb'] * 1e3:.1f} | {r['median_s']['opt'] * 1e3:.1f} | "
            f"{r['step_s'] / p['step_time_s']:.2f} | {meas:.1f} / {plan:.1f} | "
            f"{r['peak_bytes'] / 2**30:.2f} / {r['predicted_peak_bytes'] / 2**30:.2f} | "
            f"{r['predicted_host_bytes'] / 2**30:.2f} |")
    lines += ["", "The predicted step's parts: `compute_s` holds the optimizer step "
              "(`optimizer_s`, the host's AdamW and its copies for offload) and the rest of "
              "the step; `host_s` is parameter offload's copies in forward and backward. "
              "Peak GPU memory is `max_memory_allocated` over one step after the warm-up.", "",
              f"**Training as the model does** (AdamW, lr 1e-4, {len(eager)} steps from one "
              "seeded init; loss per step):", "",
              "| run | " + " | ".join(f"step {i + 1}" for i in range(len(eager)))
              + " | largest relative difference from eager |",
              "| --- |" + " ---: |" * (len(eager) + 1)]
    lines.append("| eager (fused AdamW on the GPU) | " + " | ".join(f"{v:.6f}" for v in eager)
                 + " | – |")
    for r in rows:
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], eager))
        lines.append(f"| offload {r['mode']} | " + " | ".join(f"{v:.6f}" for v in r["losses"])
                     + f" | {diff:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--loss-steps", type=int, default=4)
    ap.add_argument("--llama", choices=("all", "none"), default="all",
                    help="the Llama-3-8B rows of the offload issue's table")
    ap.add_argument("--runs", default=None,
                    help="only these runs of the table, as ROW:OVERLAP (ROW 0-based), "
                         "comma-separated; default every row under each of its overlaps")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # one run, in a child
    ap.add_argument("--llama-steps", type=int, default=None,
                    help="timed steps of each Llama row (default --steps)")
    ap.add_argument("--cluster", default="h100",
                    help="plan on this preset or profile (autoshard calibrate --device cuda)")
    ap.add_argument("--small", choices=("yes", "no"), default="yes",
                    help="the host link, host AdamW and GPT-2 small parts")
    args = ap.parse_args(argv)
    device = cuda_device("benchmarks/gpu_offload.py")
    if device is None:
        return 2
    if args.one:
        return one_llama(device, args)
    t_start = time.perf_counter()
    small = args.small == "yes"
    link = host_link(device) if small else []
    print(json.dumps(link), flush=True)
    adamw = host_adamw() if small else {}
    print(json.dumps(adamw), flush=True)
    eager = eager_losses(device, args.batch, args.seq, args.loss_steps) if small else []
    gc.collect()
    torch.cuda.empty_cache()
    rows, llama_rows = [], []

    def save() -> None:            # after every row: a run cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"link": link, "adamw": adamw, "rows": rows, "eager": eager,
                 "llama": llama_rows}, indent=1, default=str))

    runs = args.runs.split(",") if args.runs else \
        [f"{i}:{o}" for i, row in enumerate(LLAMA_ROWS) for o in row[-1]]
    if small:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29534")
        import torch.distributed as dist
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        try:
            for mode in MODES:
                rows.append(run_plan(device, mode, args.batch, args.seq, args.steps,
                                     args.loss_steps, args.cluster))
                print(json.dumps(rows[-1], default=str), flush=True)
                save()
        finally:
            dist.destroy_process_group()
    for run in (runs if args.llama == "all" else ()):
        llama_rows.append(llama_child(run, args))
        print(json.dumps(llama_rows[-1], default=str), flush=True)
        save()
    if small:
        text = render(args, link, adamw, rows, eager, time.perf_counter() - t_start)
        print(text)
        if args.out:
            write_section(args.out, SECTION, text)
    if llama_rows:
        text = render_llama(llama_rows)
        print(text)
        if args.out:
            write_section(args.out, LLAMA_SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
