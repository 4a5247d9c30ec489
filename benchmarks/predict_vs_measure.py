"""Predicted against measured step time: does the cost model, on a calibrated profile, hold on
this machine?

    python benchmarks/predict_vs_measure.py --out benchmarks/RESULTS.md       # calibrates first
    python benchmarks/predict_vs_measure.py --cluster cluster.json            # a saved profile

On 2 gloo ranks of this host (one thread each), a GPT (default 4 layers, hidden 1024, 16 heads,
vocab 4096, seq 128, batch 4, fp32: about 55M parameters, big enough that compute and gloo
communication both matter; `--hidden 512 --heads 8` runs the smaller model of earlier
revisions, whose step the runtime's work around each op, which no op's price counts, weighs on
more) is planned on a 2-device mesh with the calibrated CPU profile
(``autoshard calibrate``, run here first unless ``--cluster`` names a saved one), six ways:

- ``autoshard``: the planner's choice (``plan_traced``);
- ``dp``, ``megatron``: the hand-written baselines (solver/baselines.py);
- ``zero3``: every parameter stored sharded, the batch split (``zero3_layouts``), the ILP free to
  all-gather weights where ops need them whole (solver/alternatives.py, ``plan_stored``);
- ``runner-up 1``, ``runner-up 2``: the ILP solved again with no-good cuts excluding the
  parameter layouts of the plans before (solver/alternatives.py, ``runners_up``).

Every rank builds the same model (same seed) and a ParallelModule per plan, then runs
``--warmup`` steps of each, then ``--iters`` rounds in which each plan runs one step, in
alternating order, each after a barrier (a slow drift of the shared host's speed hits every plan
alike). A step is what the plans are priced for (docs/cost-model.md §9): ``pm.step`` (forward +
backward, the gradient synchronisation included), then the optimizer step of
``pm.optimizer(torch.optim.AdamW, fused=True)`` (with the gathers of state placed apart) and its
``zero_grad``; its time is its slowest rank's. Reported per plan: the predicted step (the
plan's ``predicted.step_time_s``), the median measured step, their error; the mean absolute
percentage error (MAPE); whether the planner's pick is measured fastest or within 5% of the
fastest; and a scatter plot.

Then (unless ``--no-families``) every op of the ``autoshard`` and ``megatron`` plans is timed
alone on both ranks at once, at the rank's local shapes under the plan's strategy, forward and
backward through autograd, and summed per op family (matmul, attention, elementwise, gather)
against ``autoshard.cost.compute.op_times``: where the compute prediction goes wrong, family by
family, and how much of a step's time outside its collective calls is not in its ops at all.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import (command, local_call, machine, md_cell, node_strategies,  # noqa: E402
                      revision, today, write_section)

SECTION = "predict_vs_measure"
TARGET_MAPE = 15.0      # percent
PICK_SLACK = 0.05       # "within 5% of the fastest"


@dataclass(frozen=True)
class Model:
    layers: int = 4
    hidden: int = 1024
    heads: int = 16
    vocab: int = 4096
    seq: int = 128
    batch: int = 4
    seed: int = 0

    def __str__(self) -> str:
        return (f"GPT, {self.layers} layers, hidden {self.hidden}, {self.heads} heads, vocab "
                f"{self.vocab}, seq {self.seq}, batch {self.batch}, fp32")


def build(m: Model, device: str = "cpu"):
    from autoshard.zoo.models import GPT, GPTConfig
    torch.manual_seed(m.seed)
    with torch.device(device):
        model = GPT(GPTConfig(m.layers, m.hidden, m.heads, vocab_size=m.vocab, context=m.seq))
    return model.train(), model.example_inputs(m.batch, m.seq, device=device)


# ----------------------------------------------------------------------------------- planning

COMPILED = ("autoshard", "dp", "megatron")   # planned again as compiled (--compile)


def make_plans(m: Model, cluster: str, time_limit: float,
               compiled: bool = False) -> dict[str, str]:
    """name -> plan JSON, every plan priced on the calibrated profile. With ``compiled``,
    ``"<name> compiled"`` too for each of :data:`COMPILED`: planned and priced as the compiled
    rank program (PlanOptions.compile, docs/cost-model.md §3.10), which parallelize then
    compiles."""
    from autoshard.mesh import Mesh
    from autoshard.solver.alternatives import plan_stored, runners_up
    from autoshard.solver.baselines import baseline_plan, zero3_layouts
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    traced = trace(*build(m, "meta"))
    mesh = Mesh((2,), ("x",), cluster=cluster)
    best = plan_traced(traced, mesh, model_name="gpt", time_limit_s=time_limit)
    plans = {"autoshard": best,
             "dp": baseline_plan(traced, mesh, "dp", time_limit_s=time_limit),
             "megatron": baseline_plan(traced, mesh, "megatron", time_limit_s=time_limit),
             "zero3": plan_stored(traced, mesh, zero3_layouts(traced, mesh), label="zero3",
                                  time_limit_s=time_limit)}
    for p in runners_up(traced, mesh, best, 2, time_limit_s=time_limit):
        plans[p.solver["alternative"]] = p
    if compiled:
        plans["autoshard compiled"] = plan_traced(traced, mesh, model_name="gpt",
                                                  time_limit_s=time_limit, compile=True)
        for name in COMPILED[1:]:
            plans[f"{name} compiled"] = baseline_plan(traced, mesh, name, compile=True,
                                                      time_limit_s=time_limit)
    return {k: p.dumps() for k, p in plans.items()}, traced


def plan_strategies(plan_json: str):
    """The plan and its strategy per node, as the planner priced them."""
    from autoshard.plans import Plan
    plan = Plan.loads(plan_json)
    return plan, node_strategies(plan)


# ------------------------------------------------------------------------- op families alone

FAMILY_PLANS = ("autoshard", "megatron")   # a batch-split and a hidden-split layout
FAMILY_REPS = 9                            # single calls timed per op and pass (median)


def family_rank(m: Model, plans: dict[str, str], names: tuple[str, ...], reps: int) -> dict:
    """On every rank at once, one thread each (as the plans run): every op of each named plan
    alone, at this rank's local shapes under the plan's strategy, forward and forward + backward
    (``torch.autograd.grad`` of the op's outputs), median of ``reps`` single calls after a
    warm-up call, a barrier before each op. Returns per plan ``[(node, forward_s, backward_s)]``,
    backward as the difference."""
    import torch.distributed as dist
    from autoshard.ops.registry import VIEW, record_of
    from autoshard.trace.export import trace
    torch.set_num_threads(1)
    traced = trace(*build(m, "meta"))
    coords = (dist.get_rank(),)

    def timed(fn) -> float:
        fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def needing_grad(o) -> list[torch.Tensor]:
        return [x for x in torch.utils._pytree.tree_flatten(o)[0]
                if isinstance(x, torch.Tensor) and x.requires_grad]

    out: dict[str, list] = {}
    for name in names:
        plan, strategies = plan_strategies(plans[name])
        rows = []
        for node in traced.graph.nodes:
            if node.op != "call_function" or node.name not in strategies:
                continue
            if record_of(node.target).family == VIEW:
                continue
            fn, args, kwargs, tensors = local_call(
                node, strategies[node.name], plan.mesh_shape, coords,
                lambda a, v, shape: torch.randn(shape, dtype=v.dtype, requires_grad=True)
                if v.dtype.is_floating_point else torch.randint(0, 2, shape, dtype=v.dtype))
            wrt = [t for t in tensors if t.requires_grad]
            dist.barrier()
            fwd = timed(lambda: fn(*args, **kwargs))
            bwd = 0.0
            outs = needing_grad(fn(*args, **kwargs))
            if wrt and outs:
                dys = [torch.randn_like(o) for o in outs]
                both = timed(lambda: torch.autograd.grad(needing_grad(fn(*args, **kwargs)), wrt,
                                                         dys, allow_unused=True))
                bwd = max(0.0, both - fwd)
            rows.append((node.name, fwd, bwd))
        out[name] = rows
    return out


def family_table(m: Model, plans: dict[str, str], cluster, names: tuple[str, ...],
                 reps: int) -> dict:
    """Per plan and op family: ``[ops, predicted forward ms, measured forward ms, predicted
    backward ms, measured backward ms]``: the cost model's seconds (``op_times`` on the
    calibrated profile, under the plan's strategies) against the ops timed alone on 2 ranks
    (``family_rank``; per op the slower rank's time)."""
    from autoshard.codegen.world import World
    from autoshard.cost.compute import op_times
    from autoshard.mesh import Mesh
    from autoshard.ops.registry import record_of
    from autoshard.trace.export import op_info, trace
    with World(2, timeout_s=1800) as w:
        w.start()
        reports = w.run(family_rank, m, plans, names, reps)
    traced = trace(*build(m, "meta"))
    nodes = {n.name: n for n in traced.graph.nodes}
    out: dict[str, dict] = {}
    for name in names:
        plan, strategies = plan_strategies(plans[name])
        mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster=cluster)
        fams: dict[str, list] = {}
        for i, (node, _, _) in enumerate(reports[0][name]):
            pf, pb = op_times(op_info(nodes[node]), strategies[node], mesh, training=True)
            mf = max(r[name][i][1] for r in reports)
            mb = max(r[name][i][2] for r in reports)
            row = fams.setdefault(record_of(nodes[node].target).family, [0, 0.0, 0.0, 0.0, 0.0])
            row[0] += 1
            for k, v in enumerate((pf, mf, pb, mb), start=1):
                row[k] += v * 1e3
        out[name] = fams
    return out


# ------------------------------------------------------------------------------- measurement

COLLECTIVE_FUNCTIONS = ("all_gather", "all_reduce", "reduce_scatter", "all_to_all")
PROBE = (512, 2048, 512, 3)      # m, k, n of a forward linear (a calibration shape), calls


def time_collectives() -> list[tuple[float, float, str, int]]:
    """Wrap the runtime's collective functions (autoshard/codegen/collectives.py, which
    ``apply_step`` looks up at each call) so that each call appends (enter, exit, kind, S) to
    the returned list, S as docs/cost-model.md §1.1 defines it. ``time.perf_counter`` is the
    host's monotonic clock, shared by the ranks, so the parent can tell a rank's wait for the
    other from the collective itself."""
    import torch.distributed as dist
    from autoshard.codegen import collectives as C
    stamps: list[tuple[float, float, str, int]] = []

    def wrap(kind, fn):
        def timed(x, *args, **kwargs):
            nbytes = x.numel() * x.element_size()
            if kind == "all_gather":                      # S is the gathered output
                nbytes *= dist.get_world_size(args[-1] if args else kwargs["group"])
            t0 = time.perf_counter()
            try:
                return fn(x, *args, **kwargs)
            finally:
                stamps.append((t0, time.perf_counter(), kind, nbytes))
        return timed

    for name in COLLECTIVE_FUNCTIONS:
        setattr(C, name, wrap(name, getattr(C, name)))
    return stamps


def bench_rank(m: Model, plans: dict[str, str], warmup: int, iters: int) -> dict:
    import torch.distributed as dist
    from autoshard.codegen.parallelize import parallelize
    from autoshard.mesh import Mesh
    from autoshard.plans import Plan
    c_start = time.process_time()
    torch.set_num_threads(1)
    stamps = time_collectives()
    model, inputs = build(m)
    mesh = Mesh((2,), ("x",), cluster="cpu")      # binds ranks to the mesh; plans bring prices
    progs = {}
    for name, text in plans.items():
        pm = parallelize(model, mesh, plan=Plan.loads(text), example_inputs=inputs)
        # The optimizer the plans are priced for (PlanOptions.optimizer "adam"): AdamW, fused,
        # one pass over each parameter's state as docs/cost-model.md §9 prices it.
        progs[name] = (pm, pm.shard_inputs(*inputs),
                       pm.optimizer(torch.optim.AdamW, lr=1e-4, fused=True))
    kinds: dict[str, dict[str, int]] = {}
    first: dict[str, float] = {}      # the first step: a compiled program compiles in it
    for name, (pm, args, opt) in progs.items():
        for i in range(warmup):
            t0 = time.perf_counter()
            pm.step(*args)
            if i == 0:
                first[name] = time.perf_counter() - t0
            opt.step()
            if i == 0:
                kinds[name] = {}
                for r in pm.ledger:
                    kinds[name][r.kind] = kinds[name].get(r.kind, 0) + 1
            opt.zero_grad()
    x = torch.randn(*PROBE[:2])
    w = torch.randn(PROBE[2], PROBE[1])
    probe: list[float] = []
    times: dict[str, list[float]] = {n: [] for n in progs}
    opt_times: dict[str, list[float]] = {n: [] for n in progs}
    cpu: dict[str, list[float]] = {n: [] for n in progs}
    comm: dict[str, list[list[tuple[float, float]]]] = {n: [] for n in progs}
    order = list(progs)
    for i in range(iters):
        for name in (order if i % 2 == 0 else order[::-1]):
            pm, args, opt = progs[name]
            dist.barrier()
            stamps.clear()
            t0, c0 = time.perf_counter(), time.process_time()
            pm.step(*args)
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            times[name].append(time.perf_counter() - t0)
            opt_times[name].append(time.perf_counter() - t1)
            cpu[name].append(time.process_time() - c0)
            comm[name].append(list(stamps))
            pm.ledger.clear()
        # the machine's speed now: a calibration shape's forward matmul, on both ranks at once
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(PROBE[3]):
            torch.nn.functional.linear(x, w)
        probe.append(2.0 * PROBE[0] * PROBE[1] * PROBE[2] * PROBE[3] / (time.perf_counter() - t0))
    return {"times": times, "optimizer": opt_times, "cpu": cpu, "comm": comm,
            "collectives": kinds, "probe": probe, "cpu_s": time.process_time() - c_start,
            "first_s": first}


def measure(m: Model, plans: dict[str, str], warmup: int, iters: int) -> dict:
    from autoshard.tools.calibrate.timing import host_cpu_seconds, other_load
    from autoshard.codegen.world import World
    with World(2, timeout_s=1800) as w:
        w.start()
        before, c0 = host_cpu_seconds(), time.process_time()
        reports = w.run(bench_rank, m, plans, warmup, iters)
        own = time.process_time() - c0 + sum(r["cpu_s"] for r in reports)
        other = other_load(before, host_cpu_seconds(), own)
    out: dict = {"_host": {"other_load": other,
                           "probe_flops_per_s": statistics.median(
                               min(r["probe"][i] for r in reports) for i in range(iters))}}
    for name in plans:
        steps = [max(r["times"][name][i] for r in reports) for i in range(iters)]
        cpu = [max(r["cpu"][name][i] for r in reports) for i in range(iters)]
        # Per step, on the rank whose step was slowest: its time inside collective calls; and
        # of it, the time after both ranks had entered each call (the collective itself, the
        # rest being a wait for the other rank).
        comm, moving = [], []
        for i in range(iters):
            slow = max(reports, key=lambda r: r["times"][name][i])
            calls = [r["comm"][name][i] for r in reports]
            comm.append(sum(c[1] - c[0] for c in slow["comm"][name][i]))
            if len({len(c) for c in calls}) == 1:
                moving.append(sum(max(0.0, call[1] - max(c[k][0] for c in calls))
                                  for k, call in enumerate(slow["comm"][name][i])))
        opt = [max(r["optimizer"][name][i] for r in reports) for i in range(iters)]
        out[name] = {"median_s": statistics.median(steps), "steps_s": steps,
                     "optimizer_median_s": statistics.median(opt),
                     "calls": [(c[2], c[3]) for c in reports[0]["comm"][name][0]],
                     "cpu_median_s": statistics.median(cpu),
                     "comm_median_s": statistics.median(comm),
                     "moving_median_s": statistics.median(moving) if moving else None,
                     "rest_median_s": statistics.median(s - c for s, c in zip(steps, comm)),
                     "first_step_s": max(r["first_s"][name] for r in reports),
                     "collectives": reports[0]["collectives"][name]}
    return out


# ---------------------------------------------------------------------------------- analysis

def _kinds(prof: dict) -> dict:
    """The profile's per-kind collective figures: kind -> (alpha, bandwidth)."""
    return {k: (v["alpha"], v["bandwidth"]) for k, v in prof.get("collective_kinds", {}).items()}


def table_time(samples: list[dict], nbytes: float) -> float:
    """A collective's time at ``nbytes`` read off the calibration's own timings (log-log
    interpolation between the measured sizes; proportional to size beyond the largest, the
    smallest's time below it)."""
    pts = sorted((r["bytes"], r["seconds"]) for r in samples)
    if nbytes <= pts[0][0]:
        return pts[0][1]
    if nbytes >= pts[-1][0]:
        return pts[-1][1] * nbytes / pts[-1][0]
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if b0 <= nbytes <= b1:
            w = math.log(nbytes / b0) / math.log(b1 / b0)
            return math.exp(math.log(t0) + w * math.log(t1 / t0))
    raise AssertionError("unreachable")


def blocking_comm(calls: list[tuple[str, int]], prof: dict) -> tuple[float, float] | None:
    """The step's blocking collective calls (as run) priced two ways from the calibration: its
    timings of the same kind and size (``table_time``), and the fitted figures of each kind the
    cost model prices them at (docs/cost-model.md §1.1, §2.9). None without the calibration's samples."""
    from autoshard.cluster import Cluster
    from autoshard.cost.comm import link_time
    from autoshard.mesh import Mesh
    samples = prof.get("measured", {}).get("collectives", {}).get("samples")
    if not samples:
        return None
    link = Mesh((2,), cluster=Cluster._from_profile(dict(prof))).links[0]
    table = sum(table_time(samples[k], b) for k, b in calls)
    fit = sum(link_time(link, k, 2, b) for k, b in calls)
    return table, fit


def calibrated_probe_rate(prof: dict) -> float | None:
    """The calibration's rate for the probe's shape and pass (rank 0's), if it measured it."""
    for r in prof.get("measured", {}).get("matmul_shapes", {}).get("float32", []):
        if tuple(r["shape"]) == PROBE[:3]:
            return r["flops"] / r["forward_s"]
    return None


def analyse(plans: dict[str, str], measured: dict, prof: dict, families: dict) -> dict:
    from autoshard.plans import Plan
    rows = []
    for name, text in plans.items():
        plan = Plan.loads(text)
        pred = plan.predicted.step_time_s
        meas = measured[name]["median_s"]
        priced = blocking_comm(measured[name]["calls"], prof)
        rows.append({
            "plan": name, "predicted_ms": pred * 1e3, "measured_ms": meas * 1e3,
            "error_pct": (pred - meas) / meas * 100,
            "compute_ms": plan.predicted.compute_s * 1e3,
            # the optimizer step, counted in compute (docs/cost-model.md §9), and as run
            "optimizer_ms": plan.predicted.optimizer_s * 1e3,
            "measured_optimizer_ms": measured[name]["optimizer_median_s"] * 1e3,
            "comm_ms": plan.predicted.comm_s * 1e3,
            # what the model leaves on the step after hiding any comm behind compute
            "exposed_ms": (pred - plan.predicted.compute_s) * 1e3,
            # the step if the bucketed gradient sync the model hides behind backward were paid
            "no_overlap_ms": (pred + sum((plan.predicted.overlapped_comm_s or {}).values()))
            * 1e3,
            "collectives": measured[name]["collectives"],
            "iqr_ms": (_q(measured[name]["steps_s"], 0.25) * 1e3,
                       _q(measured[name]["steps_s"], 0.75) * 1e3),
            "cpu_ms": measured[name]["cpu_median_s"] * 1e3,
            "measured_comm_ms": measured[name]["comm_median_s"] * 1e3,
            "calls": len(measured[name]["calls"]),
            "calls_table_ms": None if priced is None else priced[0] * 1e3,
            "calls_fit_ms": None if priced is None else priced[1] * 1e3,
            "measured_moving_ms": (None if measured[name]["moving_median_s"] is None
                                   else measured[name]["moving_median_s"] * 1e3),
            "measured_rest_ms": measured[name]["rest_median_s"] * 1e3,
            "params": _layout_summary(plan),
            "first_step_ms": measured[name]["first_step_s"] * 1e3,
        })
    mape = statistics.mean(abs(r["error_pct"]) for r in rows)
    fastest = min(rows, key=lambda r: r["measured_ms"])
    pick = next(r for r in rows if r["plan"] == "autoshard")
    no_overlap_mape = statistics.mean(abs(r["no_overlap_ms"] - r["measured_ms"])
                                      / r["measured_ms"] * 100 for r in rows)
    host = measured["_host"]
    cal_probe = calibrated_probe_rate(prof)
    by_pred = sorted(rows, key=lambda r: r["predicted_ms"])
    by_meas = sorted(rows, key=lambda r: r["measured_ms"])
    return {"rows": rows, "mape": mape, "fastest": fastest["plan"],
            "pick_ratio": pick["measured_ms"] / fastest["measured_ms"],
            "pick_ok": pick["measured_ms"] <= fastest["measured_ms"] * (1 + PICK_SLACK),
 "families": families,
            "no_overlap_mape": no_overlap_mape,
            "other_load": host["other_load"], "probe": host["probe_flops_per_s"],
            "calibrated_probe": cal_probe,
            "rank_pred": [r["plan"] for r in by_pred], "rank_meas": [r["plan"] for r in by_meas]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _layout_summary(plan) -> str:
    """How many parameters the plan stores sharded."""
    from autoshard.ir import Replicate
    sharded = sum(1 for spec in plan.params.values()
                  if any(not isinstance(x, Replicate) for x in spec))
    return f"{sharded}/{len(plan.params)} sharded"


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 5.2), dpi=110)
    xs = [r["measured_ms"] for r in rows]
    ys = [r["predicted_ms"] for r in rows]
    lo, hi = min(xs + ys) * 0.85, max(xs + ys) * 1.15
    ax.plot([lo, hi], [lo, hi], color="0.4", lw=1, label="predicted = measured")
    ax.fill_between([lo, hi], [lo * 0.85, hi * 0.85], [lo * 1.15, hi * 1.15], color="0.9",
                    label="within ±15%")
    markers = {"autoshard": "*", "dp": "s", "megatron": "D", "zero3": "^"}
    for r in rows:
        mark = markers.get(r["plan"], "o")
        ax.scatter(r["measured_ms"], r["predicted_ms"], marker=mark, s=140 if mark == "*" else 45,
                   zorder=3, alpha=0.85,
                   label=f"{r['plan']}: {r['predicted_ms']:.0f} vs {r['measured_ms']:.0f} ms "
                         f"({r['error_pct']:+.1f}%)")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured median step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title(f"GPT step on 2 gloo ranks, calibrated CPU profile: MAPE {result['mape']:.1f}%",
                 fontsize=10)
    ax.legend(loc="upper left", fontsize=7.5)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------------------------ report

def render(args, m: Model, prof: dict, result: dict, wall_s: float, plot_rel: str,
           load: tuple[str, str], busy: str) -> str:
    meas = prof.get("measured", {})
    coll = meas.get("collectives", {})
    source = (f"`{args.cluster}`" if args.cluster else
              "measured by `autoshard calibrate --device cpu --world 2` at the start of this run")
    pick = ("fastest" if result["fastest"] == "autoshard" else
            f"at {result['pick_ratio']:.3f}x the fastest ({result['fastest']})")
    link = coll.get("link_fit", {})
    lines = [
        "## Predicted vs measured step time (calibrated CPU profile, 2 gloo ranks)",
        "",
        f"- command: `{command('benchmarks/predict_vs_measure.py')}`",
        f"- machine: {machine()}",
        f"- date: {today()}; {revision()}; total wall time {wall_s / 60:.1f} min; load average "
        f"(1/5/15 min) {load[0]} at the start, {load[1]} at the end; host CPUs {busy} busy "
        f"just before the start (other processes share these 2 cores and would slow the ranks)",
        f"- model: {m}; mesh 2 (`x`), 2 gloo ranks of this host, one thread each; training step "
        f"as the plans are priced (docs/cost-model.md §9): `pm.step` (forward + backward, "
        f"gradient synchronisation included), then `pm.optimizer(torch.optim.AdamW, "
        f"fused=True)`'s step and `zero_grad`; {args.warmup} warm-up steps per plan, then "
        f"{args.iters} rounds "
        f"of one step of every plan in alternating order, a barrier before each; a step's time is "
        f"its slowest rank's; *measured* is the median (interquartile range). *In collectives*: "
        f"that rank's time inside the runtime's blocking collective calls, and in parentheses the "
        f"part after both ranks had entered each call (the rest is a wait for the other rank); "
        f"*outside*: the rest of its step, compute and anything not in those calls (a bucketed "
        f"gradient all-reduce's wait included); medians of each; *CPU*: the slowest rank's "
        f"process CPU time per step (median; gloo's threads included).",
        f"- profile: {source}"
        f" ({meas.get('wall_s', 0):.0f} s): fp32 matmul peak {prof['fp32_flops'] / 1e9:.1f} "
        f"GFLOP/s "
        f"x efficiency {prof['matmul_efficiency']:.3f} = "
        f"{prof['fp32_flops'] * prof['matmul_efficiency'] / 1e9:.1f} GFLOP/s per rank; memory "
        f"bandwidth {prof['mem_bandwidth'] / 1e9:.1f} GB/s; special functions "
        f"{prof.get('transcendental_rate', 0) / 1e9:.2f} G/s; kernel floor "
        f"{prof['kernel_floor_s'] * 1e6:.1f} µs; link alpha {prof['intra_alpha'] * 1e6:.0f} µs, "
        f"bandwidth {prof['intra_bandwidth'] / 1e9:.3f} GB/s"
        + (f" (fit to {', '.join(coll.get('link_fit_kinds', []))}, largest relative error "
           f"{link['max_rel_err']:.0%})" if link else "")
        + ("; each kind priced on its own fit: " + ", ".join(
            f"{k} {a * 1e6:.0f} µs and {b / 1e9:.3f} GB/s"
            for k, (a, b) in sorted(_kinds(prof).items())) if _kinds(prof) else "")
        + (f"; overlap {prof['comm_overlap']:.2f} of backward compute can hide a gradient "
           f"bucket (an all-reduce issued from a gradient hook during backward)"
           if "comm_overlap" in prof else "") + ".",
        "",
        "| plan | predicted ms | measured median ms (IQR) | error % | predicted compute ms | "
        "measured outside collectives ms | predicted comm ms (exposed) | measured in collectives ms "
        "(both ranks in) | "
        "CPU ms | collectives per step (run) | parameters |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in result["rows"]:
        coll_txt = ", ".join(f"{k} x{v}" for k, v in sorted(r["collectives"].items())) or "none"
        lines.append(
            f"| {md_cell(r['plan'])} | {r['predicted_ms']:.1f} | {r['measured_ms']:.1f} "
            f"({r['iqr_ms'][0]:.1f}-{r['iqr_ms'][1]:.1f}) | {r['error_pct']:+.1f} | "
            f"{r['compute_ms']:.1f} | {r['measured_rest_ms']:.1f} | {r['comm_ms']:.1f} "
            f"({r['exposed_ms']:.1f}) | "
            f"{r['measured_comm_ms']:.1f} ({_ms(r['measured_moving_ms'])}) | {r['cpu_ms']:.1f} | "
            f"{md_cell(coll_txt)} | "
            f"{r['params']} |")
    ok = result["mape"] <= TARGET_MAPE
    lines += [
        "",
        f"- **MAPE {result['mape']:.1f}%** (target <= {TARGET_MAPE:.0f}%: "
        f"{'met' if ok else 'not met'}).",
        f"- autoshard's pick is measured {pick}: "
        f"{'within' if result['pick_ok'] else 'not within'} 5% of the fastest.",
        f"- order by predicted step: {', '.join(result['rank_pred'])}; by measured step: "
        f"{', '.join(result['rank_meas'])}.",
    ]
    lines += compiled_lines(result)
    lines += diagnosis_lines(result)
    lines += family_lines(result)
    lines += error_lines(result, prof)
    lines += ["", f"![predicted vs measured]({plot_rel})", "", gpu_paragraph()]
    return "\n".join(lines)


def compiled_lines(result: dict) -> list[str]:
    """Each plan run compiled (``--compile``) beside the same plan eager: predicted and measured
    steps, and the first step's time, in which every rank compiles its program."""
    rows = {r["plan"]: r for r in result["rows"]}
    pairs = [(n, rows[n], rows[f"{n} compiled"]) for n in COMPILED
             if n in rows and f"{n} compiled" in rows]
    if not pairs:
        return []
    out = ["", "Compiled (inductor; `--compile`) beside eager, same plan names (the compiled "
           "plan is planned and priced as compiled, docs/cost-model.md §3.10):", "",
           "| plan | eager predicted ms | eager measured ms | compiled predicted ms | "
           "compiled measured ms | compiled error % | measured speed-up | first step s "
           "(compiling) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, e, c in pairs:
        out.append(f"| {name} | {e['predicted_ms']:.1f} | {e['measured_ms']:.1f} | "
                   f"{c['predicted_ms']:.1f} | {c['measured_ms']:.1f} | {c['error_pct']:+.1f} | "
                   f"{e['measured_ms'] / c['measured_ms']:.2f}x | "
                   f"{c['first_step_ms'] / 1e3:.1f} |")
    return out


def family_lines(result: dict) -> list[str]:
    """The op families of each plan in ``result["families"]``: predicted against timed alone."""
    fams = result.get("families") or {}
    if not fams:
        return []
    rows = {r["plan"]: r for r in result["rows"]}
    out = ["", "Op families, predicted (`autoshard.cost.compute.op_times` on the profile, under "
               "the plan's strategies) against every op timed alone at the plan's local shapes on "
               "both ranks at once (forward, and forward + backward through autograd less the "
               "forward; median of "
               f"{FAMILY_REPS} calls, the slower rank's), ms per step:", "",
           "| plan | family | ops | forward predicted | forward alone | backward predicted | "
           "backward alone | error % |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, table in fams.items():
        tot = [0.0] * 5
        for fam, r in sorted(table.items(), key=lambda kv: -(kv[1][2] + kv[1][4])):
            tot = [a + b for a, b in zip(tot, r)]
            alone = r[2] + r[4]
            err = f"{(r[1] + r[3] - alone) / alone * 100:+.1f}" if alone > 0 else "-"
            out.append(f"| {md_cell(name)} | {fam} | {r[0]} | {r[1]:.2f} | {r[2]:.2f} | "
                       f"{r[3]:.2f} | {r[4]:.2f} | {err} |")
        alone = tot[2] + tot[4]
        err = (tot[1] + tot[3] - alone) / alone * 100
        out.append(f"| {md_cell(name)} | **all** | {tot[0]:.0f} | {tot[1]:.1f} | {tot[2]:.1f} | "
                   f"{tot[3]:.1f} | {tot[4]:.1f} | {err:+.1f} |")
    for name in fams:
        r = rows.get(name)
        if r is None:
            continue
        alone = sum(v[2] + v[4] for v in fams[name].values())
        ops = r["compute_ms"] - r["optimizer_ms"]
        rest = r["measured_rest_ms"] - r["measured_optimizer_ms"]
        out.append("")
        out.append(f"- {name}: its ops alone take {alone:.1f} ms against {ops:.1f} ms of "
                   f"predicted compute for them; its step outside the collective calls and the "
                   f"optimizer step took {rest:.1f} ms ({rest - alone:+.1f} ms against its ops "
                   f"alone: the runtime around the kernels, and with bucketed gradient sync "
                   f"gloo's work on the same cores).")
    return out


def _near(samples: list[dict], nbytes: float) -> dict:
    return min(samples, key=lambda r: abs(math.log(r["bytes"] / nbytes)))


def error_lines(result: dict, prof: dict) -> list[str]:
    """Where each plan's error lies (outside the collective calls against the predicted compute,
    inside them against the predicted exposed comm), and, when the target is missed, the likely
    reasons with this run's own figures."""
    rows = result["rows"]
    out = ["", "Where the error lies, per plan (measured − predicted; the two parts are medians, "
               "so they add up only roughly):", ""]
    for r in rows:
        rest = r["measured_rest_ms"] - r["compute_ms"]
        coll = r["measured_comm_ms"] - r["exposed_ms"]
        out.append(f"- {r['plan']}: measured {r['measured_ms'] - r['predicted_ms']:+.1f} ms "
                   f"against the prediction (error {r['error_pct']:+.1f}%); outside "
                   f"the collective calls {rest:+.1f} ms ({r['measured_rest_ms']:.1f} measured "
                   f"against {r['compute_ms']:.1f} ms of predicted compute, "
                   f"{rest / r['compute_ms']:+.0%}); in blocking collectives {coll:+.1f} ms "
                   f"({r['measured_comm_ms']:.1f} measured against {r['exposed_ms']:.1f} ms of "
                   f"predicted exposed comm).")
    if result["mape"] <= TARGET_MAPE:
        return out
    meas = prof.get("measured", {})
    out += ["", "Likely reasons (from this run's figures; the cost model was not changed to "
                "fit them):", ""]
    over = [(r["measured_rest_ms"] - r["compute_ms"]) / r["compute_ms"] for r in rows]
    parts = []
    for name, fams in result.get("families", {}).items():
        off = [(f, r[2] + r[4] - r[1] - r[3], r[1] + r[3], r[2] + r[4])
               for f, r in fams.items() if abs(r[2] + r[4] - r[1] - r[3]) >= 1.0]
        if off:
            parts.append(f"{name}'s ops timed alone: " + ", ".join(
                f"{f} {p:.1f} ms predicted, {a:.1f} alone ({d:+.1f})"
                for f, d, p, a in sorted(off, key=lambda x: -abs(x[1]))))
    parts.append("the runtime around the kernels that no op's price counts (the autograd "
                 "engine, gradient accumulation where a tensor feeds several ops, the plan's "
                 "local reshard copies): the step outside its collective calls against its ops "
                 "alone, in the table above")
    probe_ok = (result["calibrated_probe"]
                and abs(result["probe"] / result["calibrated_probe"] - 1) <= DISTURBED_PROBE)
    if min(over) > 0:
        out.append(f"- **Compute is under-predicted on every plan** ({min(over):+.0%} to "
                   f"{max(over):+.0%} outside the collective calls): " + "; ".join(parts) + "."
                   + (" The matmuls themselves ran at the calibrated rate (the probe above)."
                      if probe_ok else ""))
    under = [r for r in rows if r["measured_rest_ms"] > r["compute_ms"]]
    if under and min(over) <= 0:
        out.append(f"- **Compute is under-predicted on {', '.join(r['plan'] for r in under)}** "
                   f"(outside the collective calls): " + "; ".join(parts) + ".")
    hidden = [r for r in rows if r["comm_ms"] - r["exposed_ms"] > 0.5 * r["comm_ms"] > 0]
    if hidden:
        names = ", ".join(r["plan"] for r in hidden)
        out.append(f"- **Hidden gradient sync that is not hidden here** ({names}): the model "
                   f"overlaps the bucketed gradient all-reduce with backward compute and leaves "
                   f"{hidden[0]['exposed_ms']:.1f} of its {hidden[0]['comm_ms']:.1f} ms on the "
                   f"step, but each rank has one core, and gloo's reduction and copies run on it: "
                   f"these plans' time outside the blocking calls exceeds their predicted compute "
                   f"by {min(r['measured_rest_ms'] - r['compute_ms'] for r in hidden):.0f}-"
                   f"{max(r['measured_rest_ms'] - r['compute_ms'] for r in hidden):.0f} ms, more "
                   f"than the plans without bucketed sync.")
    blocking = [r for r in rows if r not in hidden and r["calls_table_ms"] is not None
                and r["measured_comm_ms"] > 1.5 * r["exposed_ms"]]
    fits = meas.get("collectives", {}).get("per_kind_fit")
    if blocking and fits:
        worst = max(f["max_rel_err"] for f in fits.values())
        each = "; ".join(
            f"{r['plan']}: {r['calls']} calls, {_ms(r['measured_moving_ms'])} ms with both ranks "
            f"in (of {r['measured_comm_ms']:.1f} ms in the calls), against "
            f"{r['calls_table_ms']:.1f} ms for the same kinds and sizes in the calibration's "
            f"timings and {r['calls_fit_ms']:.1f} ms on its fits" for r in blocking)
        out.append(f"- **Blocking collectives take longer in a step than in the calibration** "
                   f"({each}). The fits (one alpha and one bandwidth per kind over every size, "
                   f"largest relative error {worst:.0%}) are a compromise over gloo's costs, "
                   f"which are not linear in the message size (docs/cost-model.md §6: no "
                   f"bandwidth ramp); and the same calls take longer between a step's ops than "
                   f"after the calibration's compute, with both ranks in: how long the ranks "
                   f"computed before a call matters (\"Collectives against the compute before "
                   f"them\" below).")
    return out


def gpu_paragraph() -> str:
    return ("**GPUs.** This comparison runs on gloo ranks of a CPU host. On one H100, the "
            "calibration, every op of a Llama-3-8B layer against its price, the rank program "
            "against eager (\"On one GPU: calibration, op classes at Llama-3-8B shapes, rank "
            "program vs eager\", `benchmarks/gpu.py`) and CPU offload against its price (\"On "
            "one GPU: CPU offload against its prediction\", `benchmarks/gpu_offload.py`) are "
            "below. NCCL between GPUs needs a host with several: `autoshard calibrate --device "
            "cuda --world 8 -o gpu.json`, then `autoshard plan llama3-8b --mesh 8 --cluster "
            "gpu.json`.")


def diagnosis_lines(result: dict) -> list[str]:
    """What the run says about the host and about the figures (not the cost model's output)."""
    out = []
    runs = result.get("disturbed_runs") or []
    earlier = runs[:-1] if result.get("final_disturbed") else runs
    if earlier:
        out.append(f"- {len(earlier)} earlier run(s) were disturbed and discarded ("
                   + " / ".join(earlier) + ").")
    if result.get("final_disturbed"):
        out.append(f"- **this run was disturbed too** ({result['final_disturbed']}): its "
                   "measured times are not this machine's alone.")
    probe, cal = result["probe"], result["calibrated_probe"]
    if cal:
        out.append(f"- the host's speed: a probe matmul between rounds ran at "
                   f"{probe / 1e9:.1f} GFLOP/s per rank (median), {probe / cal:.2f}x the rate the "
                   f"calibration measured for the same shape ({cal / 1e9:.1f} GFLOP/s).")
    if result["other_load"] is not None:
        out.append(f"- other processes used {result['other_load']:.0%} of the host's CPU time "
                   "while the plans ran.")
    out.append("- the optimizer step (fused AdamW, in the step and in its predicted compute, "
               "docs/cost-model.md §9), predicted / measured (median, the slower rank's): "
               + ", ".join(f"{r['plan']} {r['optimizer_ms']:.1f} / "
                           f"{r['measured_optimizer_ms']:.1f} ms" for r in result["rows"]) + ".")
    if any(r["no_overlap_ms"] > r["predicted_ms"] for r in result["rows"]):
        out.append(
            f"- diagnosis: with the bucketed gradient sync paid on the step instead of hidden "
            f"behind backward (gloo's copies and reductions need the cores every rank computes "
            f"on), MAPE would be {result['no_overlap_mape']:.1f}% ("
            + ", ".join(f"{r['plan']} {r['no_overlap_ms']:.1f} ms" for r in result["rows"]) + ").")
    return out


def busy_fraction(seconds: float = 2.0) -> float | None:
    """The share of this host's CPU time spent busy over ``seconds`` (Linux /proc/stat), or
    None where that cannot be read."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return idle, sum(vals)
    try:
        i0, t0 = sample()
        time.sleep(seconds)
        i1, t1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(max_busy: float, wait_s: float) -> str:
    """Wait (at most ``wait_s``) until other processes leave the host's CPUs mostly idle: the
    measurement shares 2 cores with whatever else runs. Returns what was seen, for the report."""
    deadline = time.monotonic() + wait_s
    busy = busy_fraction()
    while busy is not None and busy > max_busy and time.monotonic() < deadline:
        print(f"host busy ({busy:.0%} of CPU time), waiting for it to be quiet ...", flush=True)
        time.sleep(10)
        busy = busy_fraction()
    return "n/a" if busy is None else f"{busy:.0%}"


def _loadavg() -> str:
    try:
        return "/".join(f"{v:.1f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cluster", default=None,
                    help="a calibrated profile (default: run autoshard calibrate here first)")
    ap.add_argument("--save-cluster", default=None, help="write the profile measured here")
    ap.add_argument("--layers", type=int, default=Model.layers)
    ap.add_argument("--hidden", type=int, default=Model.hidden)
    ap.add_argument("--heads", type=int, default=Model.heads)
    ap.add_argument("--vocab", type=int, default=Model.vocab)
    ap.add_argument("--seq", type=int, default=Model.seq)
    ap.add_argument("--batch", type=int, default=Model.batch)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--time-limit", type=float, default=20.0, help="ILP time limit per plan (s)")
    ap.add_argument("--no-families", dest="families", action="store_false",
                    help="skip timing every op of the autoshard and megatron plans alone")
    ap.add_argument("--compile", action="store_true",
                    help="also plan, price and run autoshard's, dp and megatron compiled "
                         "(inductor), with the compile time (the first step's) beside them")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--plot", default=str(ROOT / "benchmarks" / "predict_vs_measure.png"))
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--max-busy", type=float, default=0.15,
                    help="wait until the host's CPUs are at most this busy before starting")
    ap.add_argument("--wait-quiet", type=float, default=300.0,
                    help="how long to wait for that (s; 0: do not wait)")
    ap.add_argument("--retries", type=int, default=1,
                    help="run again (calibration included) when other processes disturbed a run")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    load0 = _loadavg()
    m = Model(args.layers, args.hidden, args.heads, args.vocab, args.seq, args.batch)
    attempts: list[str] = []
    for attempt in range(args.retries + 1):
        busy0 = (wait_quiet(args.max_busy, args.wait_quiet) if args.wait_quiet > 0
                 else "not checked")
        prof, plans, result = one_run(args, m)
        why = disturbed(result, prof)
        if not why:
            break
        attempts.append(why)
        print(f"this run was disturbed ({why})"
              + ("; running again" if attempt < args.retries else ""), flush=True)
    result["disturbed_runs"], result["final_disturbed"] = attempts, why

    print(f"\n{'plan':12s} {'predicted ms':>13s} {'measured ms':>12s} {'error %':>8s}   "
          f"{'compute: predicted':>18s} {'measured':>9s}   {'comm: predicted':>15s} "
          f"{'measured':>9s}")
    for r in result["rows"]:
        print(f"{r['plan']:12s} {r['predicted_ms']:13.1f} {r['measured_ms']:12.1f} "
              f"{r['error_pct']:+8.1f}   {r['compute_ms']:18.1f} {r['measured_rest_ms']:9.1f}   "
              f"{r['comm_ms']:15.1f} {r['measured_comm_ms']:9.1f} "
              f"({_ms(r['measured_moving_ms'])} with both ranks in)")
    print(f"MAPE {result['mape']:.1f}% (target <= {TARGET_MAPE:.0f}%); fastest measured: "
          f"{result['fastest']}; autoshard's pick at {result['pick_ratio']:.3f}x the fastest")
    for line in diagnosis_lines(result) + family_lines(result) + error_lines(result, prof):
        print(line)
    plot_path = Path(args.plot)
    plot(result, plot_path)
    print(f"wrote {plot_path}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": prof, "result": result}, indent=1,
                                              default=str))
    if args.out:
        out = Path(args.out)
        try:
            rel = os.path.relpath(plot_path.resolve(), out.resolve().parent)
        except ValueError:
            rel = plot_path.name
        body = render(args, m, prof, result, time.perf_counter() - t0, rel, (load0, _loadavg()),
                      busy0)
        write_section(out, SECTION, body)
        print(f"wrote section {SECTION} of {out}")
    return 0


def one_run(args, m: Model) -> tuple[dict, dict[str, str], dict]:
    """Calibrate (unless ``--cluster``), plan, measure, analyse."""
    from autoshard.tools.calibrate import calibrate, summary, write_profile
    if args.cluster:
        prof = json.loads(Path(args.cluster).read_text())
        cluster_path = args.cluster
    else:
        print("calibrating (autoshard calibrate --device cpu --world 2) ...", flush=True)
        prof = calibrate("cpu", 2)
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        tmp.close()
        cluster_path = tmp.name
        write_profile(prof, cluster_path)
        if args.save_cluster:
            write_profile(prof, args.save_cluster)
    if "measured" in prof:
        print(summary(prof), flush=True)
    try:
        print(f"planning {m} on mesh 2 ...", flush=True)
        plans, traced = make_plans(m, cluster_path, args.time_limit, args.compile)
    finally:
        if not args.cluster:
            os.unlink(cluster_path)
    print(f"measuring {len(plans)} plans on 2 gloo ranks ({args.warmup} warm-up, {args.iters} "
          "rounds) ...", flush=True)
    measured = measure(m, plans, args.warmup, args.iters)
    families = {}
    if args.families:
        from autoshard.cluster import Cluster
        names = tuple(n for n in FAMILY_PLANS if n in plans)
        print(f"timing every op of {', '.join(names)} alone on 2 gloo ranks ...", flush=True)
        families = family_table(m, plans, Cluster._from_profile(dict(prof)), names, FAMILY_REPS)
    return prof, plans, analyse(plans, measured, prof, families)


DISTURBED_LOAD = 0.10      # other processes' share of the host's CPU time
DISTURBED_PROBE = 0.15     # the probe matmul's rate off the calibration's by more than this


def disturbed(result: dict, prof: dict) -> str:
    """Why a run's figures are not this machine's own (other processes took CPU time from the
    calibration or from the plans' steps, or the host ran at another speed), or ""."""
    why = []
    cal_other = prof.get("measured", {}).get("other_load")
    if cal_other is not None and cal_other > DISTURBED_LOAD:
        why.append(f"other processes used {cal_other:.0%} of the CPU time while calibrating")
    if result["other_load"] is not None and result["other_load"] > DISTURBED_LOAD:
        why.append(f"other processes used {result['other_load']:.0%} of the CPU time while the "
                   "plans ran")
    if result["calibrated_probe"]:
        ratio = result["probe"] / result["calibrated_probe"]
        if abs(ratio - 1) > DISTURBED_PROBE:
            why.append(f"the probe matmul ran at {ratio:.2f}x the calibration's rate")
    return "; ".join(why)


if __name__ == "__main__":
    sys.exit(main())
