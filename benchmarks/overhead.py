"""Runtime overhead of autoshard's generated program against DTensor tensor parallelism.

    python benchmarks/overhead.py --out benchmarks/RESULTS.md   # 4 gloo ranks on this host
    python benchmarks/overhead.py --sizes small --iters 40         # print only

Both frameworks run the same Megatron-LM layout of the same weights on the same ranks: q/k/v and
fc1 column-parallel, out_proj and fc2 row-parallel, layer norms replicated, activations
replicated between blocks (one all-reduce after each row-parallel linear in forward, one at each
block input in backward). So the two programs do the same arithmetic and move the same bytes,
and the difference in step time is what each framework adds around them.

- **autoshard**: the parameter pins of ``baseline_plan(traced, mesh, "megatron")``, plus pins
  on the activation layouts of the linears, the norms and the loss input (``megatron_pins``),
  so that the ILP cannot trade the Megatron program for another one. Left alone (the "as
  planned" row, for information) it may: at the medium size it batch-shards the norms and the
  residual stream, all-gathers before the column-parallel linears, runs out_proj on an
  all-to-all with an all-gathered weight, and computes the loss on a quarter of the batch.
- **DTensor**: ``parallelize_module`` with ``ColwiseParallel`` / ``RowwiseParallel`` and a
  ``PrepareModuleInput`` on the attention module, so q, k and v share one input (one backward
  all-reduce instead of three, as in Megatron).

The model is a GPT-style block stack (pre-LN, causal SDPA, GELU MLP, final LN, MSE loss against a
target) with separate q/k/v projections: with the zoo GPT's fused ``qkv`` a contiguous column
shard holds whole q rows on one rank and k rows on another, so neither framework can run it head-
parallel without permuting the weight (autoshard's megatron baseline then gathers the qkv weight
instead). The attention reshapes with ``view(b, s, -1, head_dim)``, which gives the local heads
under DTensor's local tensors and is the same op in autoshard's global trace.

A step is forward + backward (no optimizer), on the inputs sharded once beforehand. Each
program gets ``--warmup`` steps, then the three run in alternation ``--iters`` times, each timed
step after a barrier; a step's time is the slowest rank's. Reported: the median wall time, the
median ratio to DTensor over back-to-back pairs (robust to slow drifts in the host's load), and
the median process CPU time per step (robust to other processes sharing the cores). The first
step's losses are checked equal (relative 1e-5) across programs and against the single-process
model; the exit status is 1 if they are not.

A second table times the host's part of one collective as the eager rank program runs it
(codegen/collectives.py: torch.distributed's own collective into a fresh output) against the
functional collective it ran before (what a compiled region traces, and what DTensor's eager
redistribution calls), on torch's fake process group of 8 ranks in this process: nothing moves,
so what is timed is the Python and dispatch around the collective, which a tensor-parallel rank
program pays several times per layer and step. Median over ``--collective_iters`` calls of each
(rounded up to whole blocks), in alternating blocks of 100 (each after 10 calls of warm-up).
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

SECTION = "overhead"


# ------------------------------------------------------------------------------------- model

class Attention(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // n_heads
        self.q_proj = nn.Linear(hidden, hidden)
        self.k_proj = nn.Linear(hidden, hidden)
        self.v_proj = nn.Linear(hidden, hidden)
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = Attention(hidden, n_heads)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class BlockStack(nn.Module):
    def __init__(self, n_layers: int, hidden: int, n_heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(hidden, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return F.mse_loss(self.ln_f(x), target)


@dataclass(frozen=True)
class Size:
    name: str
    layers: int
    hidden: int
    heads: int
    seq: int
    batch: int

    def __str__(self) -> str:
        return (f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, "
                f"batch {self.batch}")


# "small" is dominated by per-op and per-collective costs (where framework overhead shows);
# "medium" is the size of a step that does real work.
SIZES = {"small": Size("small", 4, 128, 4, 64, 4), "medium": Size("medium", 4, 256, 8, 128, 8)}


@dataclass(frozen=True)
class Config:
    world: int = 4
    warmup: int = 5
    iters: int = 20
    seed: int = 0
    collective_iters: int = 500


def build(size: Size, seed: int) -> tuple[BlockStack, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    model = BlockStack(size.layers, size.hidden, size.heads)
    x = torch.randn(size.batch, size.seq, size.hidden)
    target = torch.randn(size.batch, size.seq, size.hidden)
    return model, (x, target)


# ------------------------------------------------------------------------- autoshard's plans

def megatron_pins(traced, mesh) -> dict:
    """``baseline_pins(..., "megatron")`` plus the Megatron activation layouts on a 1-D mesh:
    column-parallel linears read a replicated input and write the output sharded on its last
    dim; row-parallel linears read that and write a partial sum; norms and the loss are
    replicated (as DTensor computes them on its replicated local tensors)."""
    from autoshard.ir import Partial, Replicate, Shard
    from autoshard.solver.baselines import baseline_pins
    from autoshard.ops.registry import strategies_for
    from autoshard.trace.blocks import COLUMN, ROW, block_linears
    from autoshard.trace.export import op_info, output_infos
    aten = torch.ops.aten
    R, P = (Replicate(),), (Partial(),)

    def pick(node, inputs, outputs):
        for s in strategies_for(op_info(node), mesh.shape):
            if tuple(s.inputs) == inputs and tuple(s.outputs) == outputs:
                return s
        raise AssertionError(f"no strategy {inputs} -> {outputs} for {node.format_node()}")

    pins = dict(baseline_pins(traced, mesh, "megatron"))
    roles = {lin.node: lin.role for lin in block_linears(
        traced.graph, traced.layers, {p.name for p in traced.params})}
    for node in traced.graph.nodes:
        if node.target in (aten.layer_norm.default, aten.broadcast_tensors.default):
            n_in = sum(1 for t in op_info(node).args
                       for a in (t if isinstance(t, (list, tuple)) else [t])
                       if type(a).__name__ == "TensorInfo")
            pins[node.name] = pick(node, (R,) * n_in, (R,) * len(output_infos(node)))
        elif node.target is aten.linear.default:
            last = (Shard(len(node.meta["val"].shape) - 1),)
            if roles.get(node.name) == COLUMN:
                pins[node.name] = pick(node, (R, (Shard(0),), (Shard(0),)), (last,))
            elif roles.get(node.name) == ROW:
                pins[node.name] = pick(node, (last, (Shard(1),), P), (P,))
    return pins


def make_plans(size: Size, cfg: Config) -> dict[str, str]:
    from autoshard.mesh import Mesh
    from autoshard.solver.baselines import baseline_plan
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    model, inputs = build(size, cfg.seed)
    traced = trace(model, inputs)
    mesh = Mesh((cfg.world,), ("tp",), cluster="cpu")
    ilp = baseline_plan(traced, mesh, "megatron")
    exact = plan_traced(traced, mesh, fixed=megatron_pins(traced, mesh))
    return {"exact": exact.dumps(), "ilp": ilp.dumps()}


def check_megatron_layout(plan_json: str) -> list[str]:
    """Parameters whose layout is not Megatron's column/row split (empty when all are)."""
    from autoshard.ir import Replicate, Shard
    from autoshard.plans import Plan
    plan = Plan.loads(plan_json)
    want = {"q_proj.weight": Shard(0), "q_proj.bias": Shard(0), "k_proj.weight": Shard(0),
            "k_proj.bias": Shard(0), "v_proj.weight": Shard(0), "v_proj.bias": Shard(0),
            "fc1.weight": Shard(0), "fc1.bias": Shard(0), "out_proj.weight": Shard(1),
            "fc2.weight": Shard(1)}
    bad = []
    for fqn, spec in plan.params.items():
        key = ".".join(fqn.split(".")[-2:])
        expect = want.get(key, Replicate())
        if tuple(spec) != (expect,):
            bad.append(f"{fqn}: {spec} (Megatron: {expect})")
    return bad


# -------------------------------------------------------------------------- per-rank bench

PROGRAMS = ("autoshard-exact", "dtensor", "autoshard-ilp")
LABELS = {"autoshard-exact": "autoshard, Megatron program",
          "dtensor": "DTensor parallelize_module",
          "autoshard-ilp": "autoshard, megatron baseline as planned (ILP activations)"}


def _dtensor_model(model: BlockStack, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    for block in model.layers:
        parallelize_module(block, mesh, {
            # one replicated DTensor input for q, k and v: their input gradients are summed
            # locally and all-reduced once, as in Megatron
            "attn": PrepareModuleInput(input_layouts=(Replicate(),),
                                       desired_input_layouts=(Replicate(),)),
            "attn.q_proj": ColwiseParallel(), "attn.k_proj": ColwiseParallel(),
            "attn.v_proj": ColwiseParallel(), "attn.out_proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(),
        })
    return model


def _zero(params) -> None:
    for p in params:
        p.grad = None


def _programs(size: Size, cfg: Config, plans: dict[str, str], model: BlockStack,
              x: torch.Tensor, target: torch.Tensor) -> dict:
    """name -> (step function, its parameters, its ledger or None)."""
    from autoshard.codegen.parallelize import parallelize
    from autoshard.mesh import Mesh
    from autoshard.plans import Plan
    mesh = Mesh((cfg.world,), ("tp",), cluster="cpu")
    out = {}
    for key in ("exact", "ilp"):
        pm = parallelize(model, mesh, plan=Plan.loads(plans[key]), example_inputs=(x, target))
        args = pm.shard_inputs(x, target)      # sharded once, outside the timed steps
        out[f"autoshard-{key}"] = (lambda pm=pm, args=args: pm.step(*args),
                                   list(pm.local_parameters().values()), pm.ledger)
    dt = _dtensor_model(copy.deepcopy(model), cfg.world)

    def dt_step() -> torch.Tensor:
        loss = dt(x, target)
        loss.backward()
        return loss.detach()
    out["dtensor"] = (dt_step, list(dt.parameters()), None)
    return out


def _first_step(go, ledger) -> tuple[float, dict[str, int]]:
    """The first step's loss and its collectives by kind."""
    counts: dict[str, int] = {}
    if ledger is not None:
        ledger.clear()
        loss = float(go())
        for r in ledger:
            counts[r.kind] = counts.get(r.kind, 0) + 1
        return loss, counts
    from torch.distributed.tensor.debug import CommDebugMode
    mode = CommDebugMode()
    with mode:
        loss = float(go())
    for k, v in mode.get_comm_counts().items():
        kind = str(getattr(k, "__name__", k)).split(".")[-1].removesuffix("_")
        counts[kind] = counts.get(kind, 0) + v
    return loss, counts


def bench_rank(cfg: Config, sizes: list[Size], plans: dict[str, dict[str, str]]) -> dict:
    import warnings
    import torch.distributed as dist
    # PrepareModuleInput's hook on a module whose input needs no grad (x is data) warns per step
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    torch.set_num_threads(1)
    results = {}
    for size in sizes:
        model, (x, target) = build(size, cfg.seed)
        ref_loss = float(copy.deepcopy(model)(x, target).detach())
        progs = _programs(size, cfg, plans[size.name], model, x, target)
        losses, collectives = {}, {}
        for n in PROGRAMS:
            go, params, ledger = progs[n]
            losses[n], collectives[n] = _first_step(go, ledger)
            _zero(params)
            for _ in range(cfg.warmup):
                go()
                _zero(params)
                if ledger is not None:
                    ledger.clear()
        wall = {n: [] for n in PROGRAMS}
        cpu = {n: [] for n in PROGRAMS}
        for i in range(cfg.iters):
            for n in (PROGRAMS if i % 2 == 0 else PROGRAMS[::-1]):
                go, params, ledger = progs[n]
                dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                go()
                wall[n].append(time.perf_counter() - t0)
                cpu[n].append(time.process_time() - c0)
                _zero(params)
                if ledger is not None:
                    ledger.clear()   # the runtime's ledger keeps every collective of every step
        results[size.name] = {"ref_loss": ref_loss, "losses": losses, "wall": wall, "cpu": cpu,
                              "collectives": collectives}
    return results


# ---------------------------------------------------------------------------------- driver

def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(reports: list[dict], size: Size, cfg: Config) -> dict:
    per = [r[size.name] for r in reports]
    wall = {n: [max(r["wall"][n][i] for r in per) for i in range(cfg.iters)] for n in PROGRAMS}
    cpu = {n: [max(r["cpu"][n][i] for r in per) for i in range(cfg.iters)] for n in PROGRAMS}
    r0 = per[0]
    ref = r0["ref_loss"]
    out = {"ref_loss": ref, "programs": {}}
    for n in PROGRAMS:
        out["programs"][n] = {
            "wall_ms": statistics.median(wall[n]) * 1e3,
            "wall_iqr_ms": (_q(wall[n], 0.25) * 1e3, _q(wall[n], 0.75) * 1e3),
            "cpu_ms": statistics.median(cpu[n]) * 1e3,
            # step i of each program ran back to back: the ratio per pair cancels slow drifts
            "wall_ratio": statistics.median(a / b for a, b in zip(wall[n], wall["dtensor"])),
            "cpu_ratio": statistics.median(cpu[n]) / statistics.median(cpu["dtensor"]),
            "loss": r0["losses"][n],
            "loss_err": abs(r0["losses"][n] - ref) / abs(ref),
            "collectives": r0["collectives"][n],
        }
    p = out["programs"]
    out["pair_err"] = abs(p["autoshard-exact"]["loss"] - p["dtensor"]["loss"]) / abs(ref)
    return out


COLLECTIVE_INPUT = (16, 64)       # fp32, 4 KiB: small, so that the host's part shows


def collective_host_cost(iters: int) -> dict[str, tuple[float, float]]:
    """Collective -> (eager, functional) host µs per call, median (the module's docstring)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from autoshard.codegen import collectives as C
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    tracing = C._are_we_tracing
    try:
        g = dist.group.WORLD
        x = torch.randn(COLLECTIVE_INPUT)
        calls = {"all_reduce": lambda: C.all_reduce(x, g),
                 "all_gather (dim 0)": lambda: C.all_gather(x, 0, g),
                 "reduce_scatter (dim 0)": lambda: C.reduce_scatter(x, 0, g),
                 "all_to_all": lambda: C.all_to_all(x, 1, 0, g)}
        out = {}
        for name, fn in calls.items():
            times: dict[bool, list[float]] = {False: [], True: []}
            for block in range(2 * -(-iters // 100)):     # blocks of 100 calls, alternating
                functional = bool(block % 2)
                C._are_we_tracing = (lambda: True) if functional else tracing
                for i in range(110):
                    t0 = time.perf_counter()
                    fn()
                    t = time.perf_counter() - t0
                    if i >= 10:
                        times[functional].append(t)
            out[name] = (statistics.median(times[False]) * 1e6,
                         statistics.median(times[True]) * 1e6)
        return out
    finally:
        C._are_we_tracing = tracing
        dist.destroy_process_group()


def _loadavg() -> str:
    try:
        return "/".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def render(cfg: Config, sizes: list[Size], summaries: dict[str, dict],
           layout_issues: list[str], load: str,
           host: dict[str, tuple[float, float]]) -> str:
    lines = [
        "## Runtime overhead: autoshard vs DTensor tensor parallelism",
        "",
        f"Command: `{command('benchmarks/overhead.py')}`  ",
        f"Machine: {machine()}  ",
        f"Date: {today()}; {revision()}  ",
        f"Load average (1/5/15 min): {load}",
        "",
        f"A GPT-style block stack (pre-LN, causal SDPA, GELU MLP, separate q/k/v, MSE loss), fp32, "
        f"on {cfg.world} gloo ranks of this host (one thread each), 1-D mesh. Both frameworks run "
        f"the same Megatron program (q/k/v/fc1 column-, out_proj/fc2 row-parallel, one all-reduce "
        f"per row-parallel linear forward and per block input backward). A step is forward + "
        f"backward; {cfg.warmup} warm-up steps, then {cfg.iters} steps of each program in "
        f"alternation, a barrier before each; a step's time is its slowest rank's. *wall* is the "
        f"median (interquartile range), *vs DTensor* the median ratio over back-to-back pairs; "
        f"*CPU* is the slowest rank's process CPU time per step (median), which is less "
        f"sensitive than wall time to other load on the host.",
        "",
        "| size | program | wall ms (IQR) | vs DTensor | CPU ms | CPU vs DTensor | "
        "collectives per step | loss rel. err |",
        "|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for size in sizes:
        s = summaries[size.name]
        for n in PROGRAMS:
            p = s["programs"][n]
            coll = ", ".join(f"{k} x{v}" for k, v in sorted(p["collectives"].items()))
            lines.append(
                f"| {size.name}: {md_cell(size)} | {md_cell(LABELS[n])} | {p['wall_ms']:.1f} "
                f"({p['wall_iqr_ms'][0]:.1f}-{p['wall_iqr_ms'][1]:.1f}) | {p['wall_ratio']:.3f} "
                f"| {p['cpu_ms']:.1f} | {p['cpu_ratio']:.3f} | {md_cell(coll)} | "
                f"{p['loss_err']:.1e} |")
    lines += ["", "*loss rel. err*: the first step's loss against the single-process model; "
              "autoshard's and DTensor's first-step losses agree to "
              + ", ".join(f"{summaries[z.name]['pair_err']:.1e}" for z in sizes)
              + " (relative). Megatron column/row parameter layouts in autoshard's plan: "
              + ("all as expected." if not layout_issues else "; ".join(layout_issues[:5]))]
    lines += ["", f"**Host time per collective** (fp32 {COLLECTIVE_INPUT}, torch's fake process "
              f"group of 8 in one process: nothing moves; median of "
              f"{100 * -(-cfg.collective_iters // 100)} calls "
              "of each, in alternating blocks of 100), µs:", "",
              "| collective | eager rank program (torch.distributed) | functional collective | "
              "functional / eager |", "|---|---:|---:|---:|"]
    lines += [f"| {name} | {e:.1f} | {f:.1f} | {f / e:.1f} |" for name, (e, f) in host.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = Config()
    for f, v in asdict(defaults).items():
        ap.add_argument(f"--{f}", type=int, default=v)
    ap.add_argument("--sizes", default="small,medium",
                    help="comma-separated among "
                         + ", ".join(f"{k} ({v})" for k, v in SIZES.items()))
    ap.add_argument("--out", default=None,
                    help="rewrite this script's section of this file (benchmarks/RESULTS.md)")
    args = ap.parse_args(argv)
    cfg = Config(**{f: getattr(args, f) for f in asdict(defaults)})
    sizes = [SIZES[s.strip()] for s in args.sizes.split(",")]

    from autoshard.codegen.world import World
    load0 = _loadavg()
    t0 = time.perf_counter()
    plans = {z.name: make_plans(z, cfg) for z in sizes}
    layout_issues = sorted({b for z in sizes
                            for b in check_megatron_layout(plans[z.name]["exact"])})
    print(f"planned in {time.perf_counter() - t0:.1f} s; parameter layouts not Megatron's: "
          f"{layout_issues or 'none'}", flush=True)
    host = collective_host_cost(cfg.collective_iters)
    for name, (e, f) in host.items():
        print(f"{name}: eager {e:.1f} us, functional {f:.1f} us a call (fake process group)")
    with World(cfg.world, timeout_s=3600) as world:
        reports = world.run(bench_rank, cfg, sizes, plans)
    summaries = {z.name: summarize(reports, z, cfg) for z in sizes}
    ok = True
    for z in sizes:
        s = summaries[z.name]
        print(f"{z.name} ({z}):")
        for n in PROGRAMS:
            p = s["programs"][n]
            print(f"  {n:16s} wall {p['wall_ms']:8.2f} ms (IQR {p['wall_iqr_ms'][0]:.1f}-"
                  f"{p['wall_iqr_ms'][1]:.1f})  x{p['wall_ratio']:.3f}   cpu {p['cpu_ms']:8.2f} ms "
                  f"x{p['cpu_ratio']:.3f}   loss {p['loss']:.7f} (err {p['loss_err']:.1e})  "
                  f"{p['collectives']}")
        if s["pair_err"] > 1e-5 or max(p["loss_err"] for p in s["programs"].values()) > 1e-5:
            ok = False
            print(f"  LOSS MISMATCH: autoshard vs DTensor {s['pair_err']:.2e}", file=sys.stderr)
    if args.out:
        load = f"{load0} at the start, {_loadavg()} at the end"
        write_section(args.out, SECTION, render(cfg, sizes, summaries, layout_issues, load,
                                                 host))
        print(f"wrote the {SECTION} section of {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
