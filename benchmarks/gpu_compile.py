"""On one GPU: the rank program compiled (inductor) against eager, and against its kernels.

Two parts, one command (docs/cost-model.md §2.11 and §3.10 for what the cost model prices):

1. **Megatron TP 8, rank 0, of a Llama-3-8B layer** (the layer with embedding, final norm,
   128256-way head and loss; batch 1 × 2048, bf16): rank 0's program run alone on this GPU,
   the other seven ranks stood in for by torch's fake process group (nothing crosses a link:
   its all-reduce returns at once, its all-gather copies the rank's shard into each of the 8
   slots of its output and its reduce-scatter copies one slice, on this GPU; what is timed is
   the rank's own work, those copies, and its host's dispatch).
   Forward + backward, eager and ``compile=True``: wall time per step (median) against the sum
   of its CUDA kernels' time (torch.profiler, self device time). Target: compiled wall time
   within 1.15x of its kernels' (eager measured 3.6x in benchmarks/RESULTS.md "On one GPU"),
   and no slower than a plain PyTorch Llama layer of rank 0's local shapes (heads, KV heads,
   FFN and vocabulary divided by 8) under ``torch.compile``. Beside them, two experiments
   with CUDA graphs, not yet options of autoshard's: inductor's CUDA graph trees around each
   compiled region, and the whole step (eager or compiled) captured as one graph and replayed,
   which runs last: a capture that fails may leave the device unusable.
2. **Llama-3-8B cut to 2 layers on one GPU**, bf16-mixed, AdamW through ``pm.optimizer``:
   steps interleaved eager / compiled (``parallelize(..., compile=True)``), median; target
   compiled at least 1.15x faster; losses of the same steps equal (bf16 rounding: 2e-2
   relative); each beside its plan's predicted step (the compiled plan planned with
   ``compile=True``, on the h100 preset).

    python benchmarks/gpu_compile.py --out benchmarks/RESULTS.md [--diagnose FILE]

``--diagnose FILE`` writes where each program's host time goes (Python functions by own time,
ATen ops by own CPU time, every CUDA runtime and driver call per step, the caching allocator's
cudaMalloc and cudaFree calls), the plain compiled layer's too, for the comparison the targets
make.

Needs a CUDA device; on a machine without one it says so and writes nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import (command, cuda_device, machine, md_cell, revision, today,  # noqa: E402
                      write_section)

SECTION = "gpu_compile"
WALL_TARGET = 1.15       # compiled wall time / its kernels' time, TP 8 rank 0
SPEEDUP_TARGET = 1.15    # eager / compiled step, 2 layers on one GPU
LOSS_RTOL = 2e-2         # bf16: losses of the same steps agree to rounding
LOSS_STEPS = 3           # ... compared over the first steps


def _timed(fn, steps: int, warmup: int = 3) -> float:
    out = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _kernel_seconds(fn, steps: int = 3) -> float:
    """The CUDA kernels' own time per call of ``fn`` (profiler, self device time)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.self_device_time_total for e in prof.key_averages())
    return total_us * 1e-6 / steps


DIAGNOSIS: list[str] | None = None      # --diagnose: where a step's host time goes


def _diagnose(label: str, step, pm=None) -> None:
    """The host's side of ``step``: Python functions by own time (cProfile) and ATen ops by
    own CPU time (torch.profiler), and how the program was split into compiled regions."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile
    out = DIAGNOSIS
    out.append(f"==== {label}")
    if pm is not None:
        from autoshard.codegen.compile import CompiledRegion
        mods = list(pm.program.modules()) if hasattr(pm, "program") else []
        regions = [m for m in mods if isinstance(m, CompiledRegion)]
        out.append(f"compiled regions {len(regions)} (compiled {sum(r.compiled for r in regions)})"
                   f"; program nodes {len(pm.program.graph.nodes)}")
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    # The caching allocator's own calls into the driver over the same steps: a cudaMalloc or
    # cudaFree a step (cudaFree waits for the device) would serialise host and device.
    before = torch.cuda.memory_stats()
    pr.enable()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    pr.disable()
    after = torch.cuda.memory_stats()
    out.append("allocator over 10 steps: " + "; ".join(
        f"{k} {after.get(k, 0) - before.get(k, 0)}" for k in
        ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")))
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    out.append(buf.getvalue())
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    out.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    # Per step: the CUDA runtime's kernel launches, graph launches, syncs and copies, with the
    # host time each kind of call took.
    # Every CUDA runtime and driver call the profiler saw (launches, syncs, copies, event
    # waits, allocations), not a list chosen in advance.
    runtime = {}
    for e in prof.key_averages():
        if re.match(r"cu(da)?[A-Z]", e.key):
            runtime[e.key] = (e.count / 3, e.self_cpu_time_total / 3)
    out.append("per step: " + "; ".join(f"{k} {n:.0f} calls, {us / 1e3:.2f} ms host"
                                        for k, (n, us) in sorted(runtime.items())))


def _diagnose_warnings(label: str, caught: list) -> None:
    """The warnings ``label``'s program raised while built and compiled, each distinct message
    once with its count (torch's own deprecations left out)."""
    seen: dict[str, int] = {}
    for w in caught:
        if not issubclass(w.category, DeprecationWarning):
            text = f"{w.category.__name__}: {str(w.message)[:300]}"
            seen[text] = seen.get(text, 0) + 1
    DIAGNOSIS.append(f"==== {label}: warnings while building and compiling "
                     f"({sum(seen.values())})")
    DIAGNOSIS.extend(f"{text} (x{n})" if n > 1 else text for text, n in seen.items())


def _diagnose_collectives(device) -> None:
    """What one collective of the fake process group costs the host on this device."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    t = torch.empty(2048 * 4096, dtype=torch.bfloat16, device=device)
    group = dist.group.WORLD
    for name, fn in (("dist.all_reduce", lambda: dist.all_reduce(t, group=group)),
                     ("funcol.all_reduce + wait_tensor",
                      lambda: funcol.wait_tensor(funcol.all_reduce(t, "sum", group)))):
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(100):
            fn()
        torch.cuda.synchronize()
        DIAGNOSIS.append(f"{name}: {(time.perf_counter() - t0) * 1e4:.1f} us a call (fake pg)")


def _llama_layer_bf16():
    """Llama-3-8B cut to one decoder layer in bf16, built under ``deferred_init`` (no memory;
    ``parallelize`` replays its init on rank 0's shards), with meta example inputs."""
    from autoshard.codegen.materialize import deferred_init
    from autoshard.zoo.models import Llama
    from autoshard.zoo.registry import _lookup
    cfg = replace(_lookup("llama3-8b").config, n_layers=1, dtype=torch.bfloat16)
    with deferred_init():
        model = Llama(cfg)
    return model, model.example_inputs(1, 2048, device="meta")


def tp8_rank0(device, steps: int) -> dict:
    """Part 1: rank 0 of Megatron TP 8 on a fake world of 8, eager and compiled."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autoshard
    from autoshard.solver.baselines import baseline_plan
    from autoshard.trace.export import trace
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    try:
        mesh = init_device_mesh("cuda", (8,), mesh_dim_names=("tp",))
        model, inputs = _llama_layer_bf16()
        plan = baseline_plan(trace(model, inputs), autoshard.Mesh((8,), ("tp",), cluster="h100"),
                             "megatron")
        out, kept = {}, {}
        for compiled in (False, True, "cudagraphs"):
            name = _variant(compiled)
            if compiled == "cudagraphs":
                # (an experiment, not an option of autoshard's yet: inductor's CUDA graph trees
                # around each compiled region, its inputs copied into static buffers)
                torch._inductor.config.triton.cudagraphs = True
            try:
                out[name], *program = _tp8_variant(model, mesh, plan, inputs, device, steps,
                                                   compiled)
                if compiled != "cudagraphs":
                    kept[name] = program
            except Exception as e:        # the experiment may fail; say how, go on
                out[name] = {"error": _error(e)}
            finally:
                torch._inductor.config.triton.cudagraphs = False
        if DIAGNOSIS is not None:
            _diagnose_collectives(device)
        out["plain_compiled"] = plain_layer(device, steps)
        # Last, as a failed capture may leave the device unusable: the same programs, each
        # step one CUDA graph (the compiled one first, the experiment that matters).
        for name in [n for n in ("compiled", "eager") if n in kept]:
            pm, x, step = kept[name]
            try:
                out[f"{name} graphed"] = _whole_step_graph(pm, x, step, steps, out[name])
            except Exception as e:
                out[f"{name} graphed"] = {"error": _error(e)}
        return out
    finally:
        dist.destroy_process_group()


def _variant(compiled) -> str:
    return {False: "eager", True: "compiled", "cudagraphs": "cudagraphs"}[compiled]


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:500]


def _tp8_variant(model, mesh, plan, inputs, device, steps: int, compiled) -> tuple:
    """One variant of part 1: (wall time per step, its kernels' time, the first step's), and
    the program, its inputs and its step function, for the CUDA graph experiment."""
    import autoshard
    def step():
        pm.step(*x)
        pm.zero_grad()
        pm.ledger.clear()

    # Every warning of building and compiling (a region that fell back to eager says so),
    # kept for the diagnosis.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = autoshard.parallelize(model, mesh, plan=plan, compile=bool(compiled))
        x = pm.shard_inputs(*(t.to(device) if t.device.type != "meta" else
                              torch.zeros(t.shape, dtype=t.dtype, device=device)
                              for t in inputs))
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
    if DIAGNOSIS is not None:
        _diagnose_warnings(f"TP 8 rank 0, {_variant(compiled)}", caught)
    res = {"wall_s": _timed(step, steps), "kernels_s": _kernel_seconds(step),
           "first_step_s": first}
    if DIAGNOSIS is not None:
        _diagnose(f"TP 8 rank 0, {_variant(compiled)}", step, pm)
    return res, pm, x, step


def _whole_step_graph(pm, x, step, steps: int, ungraphed: dict) -> dict:
    """An experiment, not an option of autoshard's yet: rank 0's whole step (forward and
    backward, every compiled region and collective) captured once as one CUDA graph and
    replayed, as torch.cuda.graphs' whole-network recipe does: warmed on a side stream, the
    gradients unset before the capture so that its backward allocates them in the graph's pool
    and each replay rewrites them in place. The inputs stay where they are (a training loop
    would copy each batch into them: 2 × 2048 int64 here, 32 KiB). First step: warm-up and
    capture. Where the profiler sees no kernel inside a replay, its kernels are taken as the
    same program's without the graph (``kernels_from``)."""
    t0 = time.perf_counter()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    pm.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pm.step(*x)
    graph.replay()
    torch.cuda.synchronize()
    res = {"wall_s": _timed(graph.replay, steps), "kernels_s": _kernel_seconds(graph.replay),
           "first_step_s": time.perf_counter() - t0}
    if res["kernels_s"] <= 0.0:
        res.update(kernels_s=ungraphed["kernels_s"], kernels_from="the program without the graph")
    if DIAGNOSIS is not None:
        _diagnose("TP 8 rank 0, whole step one CUDA graph", graph.replay)
    pm.ledger.clear()
    return res


class LocalLayer(torch.nn.Module):
    """A plain PyTorch Llama-3-8B decoder layer with embedding, final norm, head and loss, at
    the local shapes of one rank of Megatron TP 8: 4 query heads and 1 KV head of 128, FFN
    1792, 16032 vocabulary rows (no collectives: the rank's own work only)."""

    def __init__(self, hidden=4096, heads=4, kv=1, head_dim=128, ffn=1792, vocab=16032,
                 seq=2048, theta=500000.0) -> None:
        super().__init__()
        nn = torch.nn
        self.heads, self.kv, self.hd = heads, kv, head_dim
        self.emb = nn.Embedding(vocab, hidden)
        self.n1, self.n2, self.nf = (nn.RMSNorm(hidden, eps=1e-5) for _ in range(3))
        self.q = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k = nn.Linear(hidden, kv * head_dim, bias=False)
        self.v = nn.Linear(hidden, kv * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate = nn.Linear(hidden, ffn, bias=False)
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab, bias=False)
        freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _rope(self, x):
        a, b = x[..., 0::2], x[..., 1::2]
        cos, sin = self.cos[: x.shape[-2]].to(x.dtype), self.sin[: x.shape[-2]].to(x.dtype)
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def forward(self, ids, targets):
        b, s = ids.shape
        h = self.emb(ids)
        x = self.n1(h)
        q = self._rope(self.q(x).view(b, s, self.heads, self.hd).transpose(1, 2))
        k = self._rope(self.k(x).view(b, s, self.kv, self.hd).transpose(1, 2))
        v = self.v(x).view(b, s, self.kv, self.hd).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                             enable_gqa=True)
        h = h + self.o(a.transpose(1, 2).reshape(b, s, -1))
        x = self.n2(h)
        h = h + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        logits = self.head(self.nf(h))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def plain_layer(device, steps: int) -> dict:
    """:class:`LocalLayer` under torch.compile, timed as the rank program is."""
    with torch.device(device):
        model = LocalLayer().to(torch.bfloat16)
        ids = torch.randint(0, 16032, (1, 2048))
        targets = torch.randint(0, 16032, (1, 2048))
    fn = torch.compile(model)

    def step():
        fn(ids, targets).backward()
        model.zero_grad()

    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    res = {"wall_s": _timed(step, steps), "kernels_s": _kernel_seconds(step),
           "first_step_s": first}
    if DIAGNOSIS is not None:
        _diagnose("plain layer, local shapes, torch.compile", step)
    return res


def two_layers(device, steps: int, cluster="h100") -> dict:
    """Part 2: Llama-3-8B cut to 2 layers, bf16-mixed, eager against compiled."""
    import torch.distributed as dist

    import autoshard
    from gpu import llama3_8b_2_layers
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    try:
        torch.manual_seed(0)
        with device:
            model, (x, y) = llama3_8b_2_layers(torch.float32)
        mesh = autoshard.Mesh((1,), ("x",), cluster=cluster)
        runs = {}
        for compiled in (False, True):
            plan = autoshard.plan(model, (x, y), mesh, model_name="llama3-8b-2l",
                                  precision="bf16-mixed", compile=compiled)
            pm = autoshard.parallelize(model, mesh, plan=plan, example_inputs=(x, y))
            runs[compiled] = (plan, pm, pm.optimizer(torch.optim.AdamW, lr=1e-4),
                              pm.shard_inputs(x, y))
        losses = {False: [], True: []}
        times = {False: [], True: []}
        first = {}
        for i in range(steps + 3):
            for compiled, (plan, pm, opt, args) in runs.items():
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                loss = pm.step(*args)
                opt.step()
                opt.zero_grad()
                pm.ledger.clear()
                torch.cuda.synchronize()
                t = time.perf_counter() - t0
                if i == 0:
                    first[compiled] = t
                if i >= 3:
                    times[compiled].append(t)
                losses[compiled].append(float(loss))
        return {name: {"step_s": statistics.median(times[c]), "first_step_s": first[c],
                       "predicted_step_s": runs[c][0].predicted.step_time_s,
                       "losses": losses[c]}
                for name, c in (("eager", False), ("compiled", True))}
    finally:
        dist.destroy_process_group()


def render(tp: dict, two: dict, wall_s: float, cluster: str = "h100") -> str:
    c, p = tp["compiled"], tp["plain_compiled"]
    speed = two["eager"]["step_s"] / two["compiled"]["step_s"]
    # The first steps: one batch repeated is memorised within a few, after which the losses
    # are ~1e-4 and their relative rounding says nothing.
    worst = max(abs(a - b) / abs(a) for a, b in zip(two["eager"]["losses"][:LOSS_STEPS],
                                                     two["compiled"]["losses"][:LOSS_STEPS]))
    lines = [
        "## On one GPU: the rank program compiled against eager",
        "",
        f"- command: `{command('benchmarks/gpu_compile.py')}`",
        f"- machine: {machine()}",
        f"- date: {today()}; {revision()}; total wall time {wall_s / 60:.1f} min",
        "",
        "**Megatron TP 8, rank 0, Llama-3-8B layer** (batch 1 × 2048, bf16; the other ranks a "
        "fake process group: nothing crosses a link, its all-gather and reduce-scatter copy "
        "on this GPU), forward + backward, ms:",
        "",
        "| program | wall | kernels | wall / kernels | first step s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, key in (("eager rank program", "eager"),
                      ("eager rank program, whole step one CUDA graph (experiment)",
                       "eager graphed"),
                      ("compiled rank program", "compiled"),
                      ("compiled rank program + inductor's CUDA graphs (experiment)",
                       "cudagraphs"),
                      ("compiled rank program, whole step one CUDA graph (experiment)",
                       "compiled graphed"),
                      ("plain layer, local shapes, torch.compile", "plain_compiled")):
        r = tp.get(key)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | failed: {md_cell(r['error'][:200])} | | | |")
            continue
        mark = "*" if "kernels_from" in r else ""
        lines.append(f"| {name} | {r['wall_s'] * 1e3:.2f} | {r['kernels_s'] * 1e3:.2f}{mark} | "
                     f"{r['wall_s'] / r['kernels_s']:.2f} | {r['first_step_s']:.1f} |")
    lines.append("")
    if any("kernels_from" in r for r in tp.values()):
        lines.append("- \\*: the profiler saw no kernel inside the graph's replays; its "
                     "kernels' time is the same program's without the graph.")
    if "error" in c:
        lines.append("- the compiled rank program failed: both targets not met.")
    else:
        ratio = c["wall_s"] / c["kernels_s"]
        lines.append(
            f"- compiled wall / kernels {ratio:.2f} (target <= {WALL_TARGET}: "
            f"{'met' if ratio <= WALL_TARGET else 'not met'}); compiled rank program "
            f"{c['wall_s'] / p['wall_s']:.2f}x the plain compiled layer (target <= 1: "
            f"{'met' if c['wall_s'] <= p['wall_s'] else 'not met'}).")
    g = tp.get("compiled graphed")
    if g is not None and "error" not in g:
        lines.append(f"- the same program, its whole step one CUDA graph (an experiment, not "
                     f"yet an option of autoshard's): wall / kernels "
                     f"{g['wall_s'] / g['kernels_s']:.2f}, "
                     f"{g['wall_s'] / p['wall_s']:.2f}x the plain compiled layer.")
    lines += [
        "",
        "**Llama-3-8B, 2 layers, one GPU, bf16-mixed, AdamW** (steps interleaved, median), ms:",
        "",
        f"| program | step | predicted ({Path(cluster).name}) | first step s |",
        "|---|---:|---:|---:|",
    ]
    for name in ("eager", "compiled"):
        r = two[name]
        lines.append(f"| {name} | {r['step_s'] * 1e3:.1f} | {r['predicted_step_s'] * 1e3:.1f} | "
                     f"{r['first_step_s']:.1f} |")
    lines += ["", f"- speed-up {speed:.2f}x (target >= {SPEEDUP_TARGET}: "
              f"{'met' if speed >= SPEEDUP_TARGET else 'not met'}); losses of the same steps "
              f"within {worst:.1e} relative over the first {LOSS_STEPS} (bf16: <= {LOSS_RTOL})."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--cluster", default="h100",
                    help="plan on this preset or profile (autoshard calibrate --device cuda)")
    ap.add_argument("--diagnose", default=None,
                    help="write where the host's time goes (cProfile, torch.profiler) here")
    args = ap.parse_args(argv)
    global DIAGNOSIS
    DIAGNOSIS = [] if args.diagnose else None
    device = cuda_device("benchmarks/gpu_compile.py")
    if device is None:
        return 2
    t0 = time.perf_counter()
    try:
        # Part 2 first: part 1 ends with the CUDA graph experiments, which may leave the
        # device unusable where a capture fails.
        two = two_layers(device, args.steps, args.cluster)
        print(json.dumps(two), flush=True)
        tp = tp8_rank0(device, args.steps)
        print(json.dumps(tp), flush=True)
    finally:
        if args.diagnose:
            Path(args.diagnose).write_text("\n".join(DIAGNOSIS))
    body = render(tp, two, time.perf_counter() - t0, args.cluster)
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps({"tp8_rank0": tp, "two_layers": two}, indent=1))
    if args.out:
        write_section(Path(args.out), SECTION, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
