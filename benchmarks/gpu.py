"""On one GPU: calibrate, price each op class against its measured time, and time the rank
program against the eager model.

Three parts, one command (docs/cost-model.md §2.9 for the profile's fields):

1. ``autoshard calibrate --device cuda`` (here: one NCCL rank) writes a profile: bf16 and fp32
   matmul rates, memory bandwidth, the kernel-launch floor, SDPA's speed. With one GPU no
   collective is measured and the profile keeps the preset's link figures.
2. Op classes at Llama-3-8B shapes (one decoder layer with the embedding, the final norm, the
   128256-way head and the loss; batch 1 × 2048, bf16): every op of the traced graph is run alone
   on the GPU with real tensors of its shapes, forward and forward + backward
   (``torch.autograd.grad``), timed with CUDA events; beside it the cost model's
   ``op_times`` on the h100 preset and on the profile of part 1. Two layouts: the whole layer on
   one GPU, and one rank of Megatron tensor parallelism over 8 (each op at that rank's local
   shapes, as ``localize`` gives them).
3. The rank program on world 1 against the eager model: a GPT of GPT-2 small's shape (fp32,
   bf16, and fp32 under autocast against autoshard's bf16-mixed) and Llama-3-8B cut to 2 layers
   (bf16, and fp32 under autocast against bf16-mixed), stepped with AdamW, eagerly and through
   ``autoshard.parallelize`` (``pm.step`` + ``pm.optimizer``), steps interleaved, median per
   step; forward + backward and the optimizer step timed apart; the rank program's peak memory
   against the plan's. Target: the rank program within 1.05× of eager. Then
   ``examples/train.py --device cuda`` under torchrun on world 1, as a user runs it.

    python benchmarks/gpu.py --out benchmarks/RESULTS.md --profile benchmarks/h100-calibrated.json

Needs a CUDA device; on a machine without one it says so and writes nothing.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import (command, cuda_device, local_call, machine,  # noqa: E402
                      node_strategies, revision, today, write_section)

SECTION = "gpu"
STEP_TARGET = 1.05
CLASSES = ("matmul", "attention", "norm", "pointwise", "loss", "embedding")


# ------------------------------------------------------------------------------- op classes

def llama_layer(batch: int, seq: int):
    """Llama-3-8B cut to one decoder layer, on the meta device, with its example batch."""
    from autoshard.zoo.models import Llama
    from autoshard.zoo.registry import _lookup
    cfg = replace(_lookup("llama3-8b").config, n_layers=1)
    with torch.device("meta"):
        model = Llama(cfg)
    return model, model.example_inputs(batch, seq, device="meta")


def op_class(node) -> str | None:
    """The class an op is reported under: by family, and for elementwise ops by the module
    they sit in (a norm's pow, mean, rsqrt and muls are the norm's)."""
    from autoshard.ops.registry import ATTENTION, GATHER, MATMUL, VIEW, record_of
    family = record_of(node.target).family
    if family == VIEW:
        return None
    if family == MATMUL:
        return "matmul"
    if family == ATTENTION:
        return "attention"
    if family == GATHER:
        return "embedding"
    name = getattr(node.target, "_opname", "")
    if "cross_entropy" in name or "log_softmax" in name or "nll_loss" in name:
        return "loss"
    stack = node.meta.get("nn_module_stack") or {}
    if any("norm" in str(t).lower() for _, t in stack.values()):
        return "norm"
    return "pointwise"


def _real(v, shape, device, grad: bool):
    if v.dtype.is_floating_point:
        return torch.randn(shape, dtype=v.dtype, device=device, requires_grad=grad)
    if v.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return torch.randint(0, 2, shape, dtype=v.dtype, device=device)


def needs_grad(traced) -> set[str]:
    """The nodes whose value autograd differentiates in a training step: the parameters and
    every floating value computed from one (inputs, buffers and constants need none)."""
    params = {ph.name for ph in traced.placeholders if ph.kind == "param"}
    out: set[str] = set()
    for node in traced.graph.nodes:
        v = node.meta.get("val")
        floating = isinstance(v, torch.Tensor) and v.dtype.is_floating_point
        if node.name in params or (floating and any(a.name in out for a in node.all_input_nodes)):
            out.add(node.name)
    return out


def cuda_timed(fn, *, window_s: float = 0.01, repeats: int = 5) -> tuple[float, float]:
    """(wall, device) seconds per call of ``fn`` run back to back: wall is the median over
    ``repeats`` windows of about ``window_s`` between CUDA events (the host's dispatch included
    where it is the slower side); device is the sum of the CUDA kernels' durations per call,
    from the profiler (what the roofline prices)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    n = max(1, min(1000, int(window_s / max(time.perf_counter() - t0, 1e-6))))
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / n)
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    k = min(n, 20)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(k):
            fn()
        torch.cuda.synchronize()
    kernels = sum(e.device_time for e in prof.events() if e.device_type == DeviceType.CUDA)
    return statistics.median(out), kernels / 1e6 / k


def time_ops(traced, plan, device) -> list[dict]:
    """Every op of ``traced`` alone at the local shapes of ``plan``'s strategies on rank 0, with
    gradients where the training step has them: forward and backward (``autograd.grad`` of the
    op's outputs, the graph retained) timed apart, wall and device time each."""
    strategies = node_strategies(plan)
    coords = tuple(0 for _ in plan.mesh_shape)
    grads = needs_grad(traced)
    rows = []
    for node in traced.graph.nodes:
        if node.op != "call_function" or node.name not in strategies:
            continue
        cls = op_class(node)
        if cls is None:
            continue
        fn, args, kwargs, tensors = local_call(
            node, strategies[node.name], plan.mesh_shape, coords,
            lambda a, v, shape: _real(v, shape, device, a.name in grads), device)
        wrt = [t for t in tensors if t.requires_grad]
        fwd = cuda_timed(lambda: fn(*args, **kwargs))
        bwd = (0.0, 0.0)
        outs = [x for x in torch.utils._pytree.tree_flatten(fn(*args, **kwargs))[0]
                if isinstance(x, torch.Tensor) and x.requires_grad]
        if wrt and outs:
            dys = [torch.randn_like(o) for o in outs]
            bwd = cuda_timed(lambda: torch.autograd.grad(outs, wrt, dys, allow_unused=True,
                                                         retain_graph=True))
        rows.append({"node": node.name, "class": cls, "op": str(node.target),
                     "forward_s": fwd[1], "backward_s": bwd[1],
                     "forward_wall_s": fwd[0], "backward_wall_s": bwd[0]})
        del args, kwargs, tensors, outs
    torch.cuda.empty_cache()
    return rows


def predict_ops(traced, plan, rows, clusters: dict) -> None:
    """Adds ``predicted[cluster] = (forward_s, backward_s)`` to each row: ``op_times`` under the
    plan's strategy on each cluster."""
    from autoshard.cost.compute import op_times
    from autoshard.mesh import Mesh
    from autoshard.trace.export import op_info
    strategies = node_strategies(plan)
    nodes = {n.name: n for n in traced.graph.nodes}
    for name, cluster in clusters.items():
        mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster=cluster)
        for r in rows:
            pf, pb = op_times(op_info(nodes[r["node"]]), strategies[r["node"]], mesh,
                              training=True)
            r.setdefault("predicted", {})[name] = (pf, pb)


def op_classes(clusters: dict, device) -> dict:
    from autoshard.mesh import Mesh
    from autoshard.solver.baselines import baseline_plan
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    model, example = llama_layer(1, 2048)
    traced = trace(model, example)
    layouts = {
        "1 GPU": plan_traced(traced, Mesh((1,), ("x",), cluster="h100"), time_limit_s=30),
        "Megatron TP 8, rank 0": baseline_plan(traced, Mesh((8,), ("tp",), cluster="h100"),
                                               "megatron", time_limit_s=30),
    }
    out = {}
    for name, plan in layouts.items():
        rows = time_ops(traced, plan, device)
        predict_ops(traced, plan, rows, clusters)
        out[name] = rows
    return out


def class_table(rows: list[dict], clusters: list[str]) -> list[list]:
    """Per class: ops, device forward/backward ms, wall ms (forward + backward), and per
    cluster the predicted forward/backward ms."""
    table = []
    for cls in (*CLASSES, "all"):
        sel = [r for r in rows if cls == "all" or r["class"] == cls]
        if not sel:
            continue
        mf = sum(r["forward_s"] for r in sel) * 1e3
        mb = sum(r["backward_s"] for r in sel) * 1e3
        wall = sum(r["forward_wall_s"] + r["backward_wall_s"] for r in sel) * 1e3
        pred = [(sum(r["predicted"][c][0] for r in sel) * 1e3,
                 sum(r["predicted"][c][1] for r in sel) * 1e3) for c in clusters]
        table.append([cls, len(sel), mf, mb, wall, pred])
    return table


# ------------------------------------------------------------------------ rank program vs eager

def gpt2_small(dtype: torch.dtype):
    """GPT-2 small's shape (12 layers, hidden 768, vocab 50257), batch 8 × 1024."""
    from autoshard.zoo.models import GPT, GPTConfig
    model = GPT(GPTConfig(12, 768, 12, vocab_size=50257, context=1024, dtype=dtype))
    return model, model.example_inputs(8, 1024, device=torch.get_default_device())


def llama3_8b_2_layers(dtype: torch.dtype = torch.bfloat16):
    """Llama-3-8B cut to 2 decoder layers (1.5B parameters with embedding and head), batch
    1 × 2048."""
    from autoshard.zoo.models import Llama
    from autoshard.zoo.registry import _lookup
    model = Llama(replace(_lookup("llama3-8b").config, n_layers=2, dtype=dtype))
    return model, model.example_inputs(1, 2048, device=torch.get_default_device())


def step_vs_eager(device, clusters: dict, label: str, build, *, steps: int,
                  mixed: bool = False) -> dict:
    """Median step time of the eager model and of its world-1 rank program, steps interleaved;
    forward + backward and the optimizer step timed apart; then, with the eager model freed,
    the rank program's peak memory over two steps against the plan's. ``mixed``: an fp32
    model, run eagerly under ``torch.autocast`` (bf16) and planned with
    ``precision="bf16-mixed"`` (bf16 parameters, fp32 masters in ``pm.optimizer``)."""
    import gc

    import autoshard
    torch.manual_seed(0)
    with device:
        model, (x, y) = build()
    eager = copy.deepcopy(model)
    mesh = autoshard.Mesh((1,), ("x",), cluster="h100")
    precision = "bf16-mixed" if mixed else "model"
    plan = autoshard.plan(model, (x, y), mesh, model_name=label, precision=precision)
    predicted = {name: autoshard.plan(model, (x, y), autoshard.Mesh((1,), ("x",), cluster=c),
                                      model_name=label, precision=precision
                                      ).predicted.step_time_s
                 for name, c in clusters.items()}
    pm = autoshard.parallelize(model, mesh, plan=plan, example_inputs=(x, y))
    del model
    opt_pm = pm.optimizer(torch.optim.AdamW, lr=1e-4)
    # pm.optimizer steps with the fused kernel (codegen/optim.py); the eager model does too.
    opt_eager = torch.optim.AdamW(eager.parameters(), lr=1e-4, fused=True)
    xs, ys = pm.shard_inputs(x, y)

    def eager_fb():
        with torch.autocast("cuda", torch.bfloat16, enabled=mixed):
            loss = eager(x, y)
        loss.backward()

    def pm_fb():
        pm.step(xs, ys)
        pm.ledger.clear()

    def eager_opt():
        opt_eager.step()
        opt_eager.zero_grad()

    def pm_opt():
        opt_pm.step()
        opt_pm.zero_grad()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    times = {k: [] for k in ("eager_fb", "eager_opt", "pm_fb", "pm_opt")}
    for i in range(steps + 3):
        for name, fn in (("eager_fb", eager_fb), ("eager_opt", eager_opt), ("pm_fb", pm_fb),
                         ("pm_opt", pm_opt)):
            t = timed(fn)
            if i >= 3:                       # three warm-up steps
                times[name].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    with torch.autocast("cuda", torch.bfloat16, enabled=mixed):
        loss_e = eager(x, y).item()
    loss_p = pm(xs, ys).item()
    pm.ledger.clear()
    del eager, opt_eager
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        pm_fb()
        pm_opt()
    peak = torch.cuda.max_memory_allocated(device)
    del pm, opt_pm
    gc.collect()
    torch.cuda.empty_cache()
    return {"label": label, "precision": "fp32 model; eager autocast bf16, autoshard bf16-mixed"
            if mixed else "the model's dtype", "steps": steps, "median_s": med,
            "ilp_memory_bytes": peak, "predicted_peak_bytes": plan.predicted.memory.peak,
            "ilp_peak_bytes": plan.predicted.ilp_sum_bytes,
            "predicted_step_s": predicted, "loss_after": {"eager": loss_e, "autoshard": loss_p}}


def train_example(steps: int = 30) -> list[str]:
    """``examples/train.py --device cuda`` on world 1: its first and last log lines."""
    import subprocess
    cmd = ["torchrun", "--nproc-per-node", "1", "examples/train.py", "--mesh", "1", "--device",
           "cuda", "--steps", str(steps)]
    run = subprocess.run(cmd, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                         text=True, timeout=600)
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith("step")]
    if run.returncode or not lines:
        return [f"`{' '.join(cmd)}` failed (exit {run.returncode}): {run.stderr[-500:]}"]
    return [f"`{' '.join(cmd)}`: {lines[0].strip()} … {lines[-1].strip()}"]


# --------------------------------------------------------------------------------- rendering

def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def render(args, prof: dict | None, cal_s: float, ops: dict, steps: list[dict], train: list[str],
           wall_s: float) -> str:
    dev = torch.cuda.get_device_name()
    clusters = ["h100"] + (["calibrated"] if prof else [])
    lines = ["## On one GPU: calibration, op classes at Llama-3-8B shapes, rank program vs eager",
             "", f"- command: `{command('benchmarks/gpu.py')}`",
             f"- machine: {dev}; {machine()}", f"- {revision()}",
             f"- date: {today()}; total wall time {wall_s / 60:.1f} min", ""]
    if prof:
        m = prof["measured"]
        lines += [
            f"**Calibration** (`autoshard calibrate --device cuda --world 1`, {cal_s:.0f} s; the "
            f"profile is `{args.profile}`): bf16 matmul peak {prof['flops'] / 1e12:.0f} TFLOP/s, "
            f"overall {m['matmul_bfloat16']['overall_flops_per_s'] / 1e12:.0f} (efficiency "
            f"{prof['matmul_efficiency']:.2f}); fp32 {m['matmul_float32']['overall_flops_per_s'] / 1e12:.0f} "
            f"TFLOP/s overall; memory bandwidth {prof['mem_bandwidth'] / 1e12:.2f} TB/s; kernel floor "
            f"{prof['kernel_floor_s'] * 1e6:.1f} µs; SDPA (causal, "
            f"{'×'.join(str(s) for s in m['attention'].get('shape', ()))}) trains at "
            f"{m['attention']['training_rate_over_matmul_rate']:.2f}× the matmul rate. With one "
            "GPU no collective ran: the profile keeps the h100 preset's NVLink and InfiniBand "
            "figures (NCCL between GPUs needs two or more).", ""]
    lines += ["**Op classes at Llama-3-8B shapes** (one decoder layer with embedding, final norm, "
              "128256-way head and loss; batch 1 × 2048, bf16), ms per step. Each op alone with "
              "gradients where the step has them; device: its CUDA kernels' time (profiler), "
              "what the roofline prices; wall: calls back to back between CUDA events, the "
              "host's dispatch included where it is the slower side; predicted: `op_times` on "
              "the h100 preset" + (" and on the calibrated profile" if prof else "") + ".", ""]
    head = "| layout | class | ops | device fwd | device bwd | wall fwd+bwd |"
    sep = "| --- | --- | ---: | ---: | ---: | ---: |"
    for c in clusters:
        head += f" {c} fwd | {c} bwd | {c} / device |"
        sep += " ---: | ---: | ---: |"
    lines += [head, sep]
    for layout, rows in ops.items():
        for cls, n, mf, mb, wall, pred in class_table(rows, clusters):
            cells = [layout, f"**{cls}**" if cls == "all" else cls, str(n), _ms(mf), _ms(mb),
                     _ms(wall)]
            for pf, pb in pred:
                cells += [_ms(pf), _ms(pb), f"{(pf + pb) / max(mf + mb, 1e-12):.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Largest ops, measured against the preset's price (forward + backward, ms):", ""]
    for layout, rows in ops.items():
        top = sorted(rows, key=lambda r: -(r["forward_s"] + r["backward_s"]))[:6]
        lines.append(f"- {layout}: " + "; ".join(
            f"{r['node']} ({r['class']}) {_ms((r['forward_s'] + r['backward_s']) * 1e3)} vs "
            f"{_ms(sum(r['predicted']['h100']) * 1e3)}" for r in top))
    lines += ["", f"**Rank program against the eager model** (world 1, NCCL; AdamW; steps "
              f"interleaved, median of {steps[0]['steps'] if steps else 0}; target ≤ "
              f"{STEP_TARGET}× eager):", "",
              "| model | eager fwd+bwd | autoshard fwd+bwd | eager optimizer | autoshard optimizer "
              "| eager step | autoshard step | ratio | "
              + " | ".join(f"predicted ({c})" for c in clusters)
              + " | peak memory: measured / liveness / ILP (GiB) |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
              + " ---: |" * len(clusters) + " ---: |"]
    for s in steps:
        m = s["median_s"]
        e, p = m["eager_fb"] + m["eager_opt"], m["pm_fb"] + m["pm_opt"]
        name = s["label"] + ("; " + s["precision"] if s["precision"] != "the model's dtype"
                             else "")
        lines.append(f"| {name} | {m['eager_fb'] * 1e3:.1f} | "
                     f"{m['pm_fb'] * 1e3:.1f} | {m['eager_opt'] * 1e3:.1f} | "
                     f"{m['pm_opt'] * 1e3:.1f} | {e * 1e3:.1f} | {p * 1e3:.1f} | "
                     f"{p / e:.3f} | "
                     + " | ".join(f"{s['predicted_step_s'][c] * 1e3:.1f}" for c in clusters)
                     + f" | {s['ilp_memory_bytes'] / 2**30:.2f} / "
                       f"{s['predicted_peak_bytes'] / 2**30:.2f} / "
                       f"{s['ilp_peak_bytes'] / 2**30:.2f} |")
    lines += ["", "Peak memory: measured is the CUDA allocator's `max_memory_allocated` over two "
              "steps of the rank program alone (the eager copy freed); liveness is the plan's "
              "`predicted.memory.peak`, the walk over the whole step (docs/cost-model.md §4.5); "
              "ILP is the per-op estimate the solver holds under the memory budget "
              "(`predicted.ilp_memory_bytes`)."]
    lines += ["", "**The example, as a user runs it**: " + " ".join(train)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--profile", default="h100-calibrated.json",
                    help="where the calibrated profile is written")
    ap.add_argument("--json", default=None, help="also write every measurement here")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-calibrate", action="store_true")
    args = ap.parse_args(argv)
    device = cuda_device("benchmarks/gpu.py")
    if device is None:
        return 2
    t_start = time.perf_counter()
    prof, cal_s = None, 0.0
    if not args.skip_calibrate:
        from autoshard.tools.calibrate import calibrate, summary, write_profile
        t0 = time.perf_counter()
        prof = calibrate("cuda", 1)
        cal_s = time.perf_counter() - t0
        write_profile(prof, args.profile)
        print(summary(prof), flush=True)
    clusters = {"h100": "h100"}
    if prof:
        from autoshard.cluster import Cluster
        clusters["calibrated"] = Cluster.load(args.profile)
    t0 = time.perf_counter()
    ops = op_classes(clusters, device)
    print(f"op classes timed in {time.perf_counter() - t0:.0f} s", flush=True)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    import torch.distributed as dist
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    steps = []
    try:
        cases = (("GPT-2 small shape, batch 8 × 1024, fp32", partial(gpt2_small, torch.float32),
                  False),
                 ("GPT-2 small shape, batch 8 × 1024, bf16", partial(gpt2_small, torch.bfloat16),
                  False),
                 ("GPT-2 small shape, batch 8 × 1024", partial(gpt2_small, torch.float32), True),
                 ("Llama-3-8B, 2 layers, batch 1 × 2048, bf16", llama3_8b_2_layers, False),
                 ("Llama-3-8B, 2 layers, batch 1 × 2048",
                  partial(llama3_8b_2_layers, torch.float32), True))
        for label, build, mixed in cases:
            steps.append(step_vs_eager(device, clusters, label, build, steps=args.steps,
                                       mixed=mixed))
            print(json.dumps(steps[-1]["median_s"]), flush=True)
    finally:
        dist.destroy_process_group()
    train = train_example()
    text = render(args, prof, cal_s, ops, steps, train, time.perf_counter() - t_start)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"ops": ops, "steps": steps, "profile": prof},
                                              indent=1, default=str))
    if args.out:
        write_section(args.out, SECTION, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
