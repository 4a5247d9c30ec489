"""Predicted against measured peak memory of a training step, per rank, on gloo ranks of this host.

    python benchmarks/memory_vs_measure.py --out benchmarks/RESULTS.md
    python benchmarks/memory_vs_measure.py --models gpt2-tiny --meshes 4 --recompute full

For each zoo model (default gpt2-tiny and llama-tiny, their default batch and sequence, fp32),
mesh (default 4 and 2x2) and activation checkpointing setting (default none, full and selective),
the model is traced once and planned several ways, every plan priced by the same cost model on
the ``stress`` cluster (the one ``autoshard verify`` plans with):

- ``autoshard``: the planner's choice (``plan_traced``);
- ``dp``, ``megatron``, ``megatron-dp``: the hand-written baselines (solver/baselines.py; on a
  1-D mesh ``megatron-dp`` is ``megatron``);
- ``zero3``: every parameter stored sharded over the whole mesh (``zero3_layouts``, through
  ``solver.alternatives.plan_stored``, which may all-gather a weight where an op reads it whole);
  with checkpointing, the same layouts assembled with the checkpointable layers recomputed;
- the state modes (docs/cost-model.md §9, cost/state.py), on a baseline's layouts:
  ``dp+zero1`` and ``dp+zero2`` (``baseline_plan(traced, mesh, "dp", zero="zero1")`` or
  ``zero="zero2"``: the optimizer state, and under ZeRO-2 the gradients too, sharded over the
  replicated axes, with an fp32 master of each shard in the optimizer) and ``dp+offload``
  (``offload="optimizer"``: the optimizer state and step on the host), and on a mesh of more
  than one axis the same three on
  ``megatron-dp`` (``megatron-dp+zero1``, ...). ``--states`` picks the modes, and
  ``--state-recompute`` (default ``none``) the checkpointing settings they are planned with:
  each technique in turn, not every combination, unless asked.

``--recompute`` (default ``none,full,selective``) sets ``PlanOptions(recompute=...)``: "full"
checkpoints every checkpointable layer (it keeps its inputs only and runs its forward again in
backward), "selective" keeps the outputs of its matmuls, attention and collectives as well and
recomputes the rest (docs/cost-model.md §8).

Each plan then runs on 4 gloo ranks through ``autoshard verify``'s rank function
(``verify_rank``): the loss and gradient comparison with the single-device model, then
``measure_step_memory``: a warm-up step creates the AdamW state, and the second step (forward,
backward with its gradient syncs, AdamW step, ``zero_grad``) is measured by
``torch.distributed._tools.mem_tracker.MemTracker``. Per plan the table gives the measured peak
(the largest over the ranks), the two predictions of it, each with its error:

- the sum model (docs/cost-model.md §4.4, the plan's ``predicted.ilp_sum_bytes`` before
  liveness): model state plus everything the forward saves, all alive at once;
- liveness (``autoshard.cost.liveness.step_memory``, §4.5): the largest number of bytes alive at
  any moment of the forward, the backward and the optimizer step. Under optimizer offload
  its peak is the device's and the optimizer state it keeps on the host is apart
  (``predicted.memory.host``); on CPU the "host" is the same memory as the "device" and
  the tracker counts both, so an offload row's liveness figure is the device peak plus the host
  bytes (and its sum model figure the sum plus the host bytes). Those host bytes include an
  fp32 copy of the gradient shard made for the step (cost/state.py), which the step does not
  make on CPU (``.to("cpu", torch.float32)`` of an fp32 CPU gradient returns it) and which
  would exist only during the optimizer step anyway: the note gives the device peak plus the
  host's optimizer state without it, and its error;

and the split of each at its peak. A second measurement of the same step runs the tracker
without its module hooks. MemTracker's module tracker registers a gradient hook on the inputs of
every module it sees run (``register_multi_grad_hook``), and the rank program is a module whose
inputs are the parameters: the hook holds each parameter gradient autograd computes until every
one has arrived, so ``AccumulateGrad`` copies it into ``.grad`` instead of keeping it, and the
original stays alive beside the copy until the hook fires at the end of backward. That column is
what the step holds without the tracker's own references.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

SECTION = "memory_vs_measure"
MODELS = ("gpt2-tiny", "llama-tiny")
MESHES = ("4", "2x2")
RECOMPUTE = ("none", "full", "selective")
PLANS = ("autoshard", "dp", "megatron", "megatron-dp", "zero3")
# State modes (cost/state.py) -> the PlanOptions that force them on every parameter.
STATES = {"zero1": {"zero": "zero1"}, "zero2": {"zero": "zero2"},
          "offload": {"offload": "optimizer"}}
STATE_RECOMPUTE = ("none",)
PARTS = ("params", "grads", "optimizer", "activations", "temporaries", "other")
PRED_PARTS = ("parameters", "gradients", "optimizer", "activations", "temporaries")
TARGET = 0.10


def state_plan_names(shape: tuple[int, ...], states) -> list[str]:
    """The state-mode plans of a mesh: each mode on ``dp``, and on ``megatron-dp`` where the
    mesh has more than one axis (on one axis it is ``megatron``, which replicates nothing that
    the mode could shard but the embeddings and head)."""
    bases = ("dp", "megatron-dp") if len(shape) > 1 else ("dp",)
    return [f"{b}+{m}" for b in bases for m in states]


def make_plans(model: str, shape: tuple[int, ...], time_limit: float, recompute: str,
               names=PLANS):
    """(traced graph, name -> Plan or the error text when no plan of that kind is found).
    ``names``: among ``PLANS`` and "<baseline>+<state mode>" (``STATES``)."""
    from autoshard import Mesh
    from autoshard.errors import AutoshardError
    from autoshard.solver.alternatives import plan_stored
    from autoshard.solver.baselines import baseline_plan, zero3_layouts
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    from autoshard.tools.verify import build

    mesh = Mesh(shape, cluster="stress")
    traced = trace(*build(model, None, None, 0))
    kw = {"model_name": model, "time_limit_s": time_limit, "recompute": recompute}

    def zero3():
        plan = plan_stored(traced, mesh, zero3_layouts(traced, mesh), model_name=model,
                           time_limit_s=time_limit)
        return with_recompute(traced, mesh, plan, recompute) if recompute != "none" else plan

    makers = {"autoshard": lambda: plan_traced(traced, mesh, **kw), "zero3": zero3}
    out: dict[str, object] = {}
    for name in names:
        base, _, state = name.partition("+")
        make = makers.get(name) or (lambda b=base, s=state: baseline_plan(
            traced, mesh, b, **kw, **STATES.get(s, {})))
        try:
            out[name] = make()
        except AutoshardError as e:
            out[name] = f"no plan: {e}"
    return traced, out


def with_recompute(traced, mesh, plan, policy: str):
    """``plan``'s strategies assembled again with every checkpointable layer checkpointed
    under ``policy`` (``plan_stored`` pins layouts and plans without checkpointing)."""
    from autoshard.solver.assemble import assemble
    from autoshard.trace.layers import checkpointable
    layers = dict.fromkeys(checkpointable(traced.graph, traced.layers), policy)
    return assemble(traced, mesh, plan.strategies(), plan.options, solver=dict(plan.solver),
                    model_name=plan.model, timings={}, recompute=layers)


def _pricer(traced, plan):
    from autoshard import Mesh
    from autoshard.cost.price import Pricer
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster=plan.cluster)
    return Pricer(traced, mesh, plan.options, recompute=dict(plan.recompute),
                  joint=plan.joint_groups())


def liveness(traced, plan):
    """The liveness prediction of ``plan`` (docs/cost-model.md §4.5)."""
    from autoshard.cost.liveness import step_memory
    return step_memory(traced, plan.strategies(), _pricer(traced, plan))


def sum_model(traced, plan) -> float:
    """The sum model's peak (docs/cost-model.md §4.4): every node's memory price (model state,
    what an op saves beyond its inputs) plus the saved copies, summed."""
    pricer, strategies = _pricer(traced, plan), plan.strategies()
    return sum(pricer.memory(n, s) for n, s in strategies.items()) + pricer.saved_copies(
        strategies)


class _NoModules:
    """What MemTracker asks of its ModTracker, with no module hooks: every op counts as forward
    or optimizer (the split at the peak is coarser), the total is the same."""

    is_bw = False

    def register_user_hooks(self, *hooks) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def __enter__(self) -> "_NoModules":
        return self

    def __exit__(self, *exc) -> None:
        pass


def measure_without_module_hooks(spec) -> dict:
    """``measure_step_memory`` of the plan's per-rank program under a MemTracker whose module
    tracker hooks nothing (runs on every rank of the world)."""
    import torch.distributed._tools.mem_tracker as mt

    from autoshard.codegen.parallelize import parallelize
    from autoshard.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.tools.verify import build, measure_step_memory

    original = mt.MemTracker

    class NoModuleHooks(original):                    # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _NoModules()

    model, inputs = build(spec.model, spec.batch, spec.seq, spec.seed, spec.task)
    pm = parallelize(model, Mesh(spec.mesh_shape, spec.axes), plan=Plan.loads(spec.plan_json),
                     example_inputs=inputs)
    mt.MemTracker = NoModuleHooks
    try:
        return measure_step_memory(pm, pm.shard_inputs(*inputs))
    finally:
        mt.MemTracker = original


def run_case(world, model: str, plan) -> dict:
    from autoshard.tools.verify import VerifySpec, summarize, verify_rank
    t0 = time.perf_counter()
    spec = VerifySpec(model, plan.mesh_shape, plan.mesh_axes, plan.dumps())
    reports = world.run(verify_rank, spec)
    for r in reports:
        if "error" in r:
            return {"failure": " ".join(map(str, r["error"]))}
    ok, text = summarize(reports, 1e-5)
    mems = [r["memory"] for r in reports]
    bad = [m["not_measured"] for m in mems if "not_measured" in m]
    if bad:
        return {"verify": "PASS" if ok else "FAIL", "failure": f"not measured: {bad[0]}"}
    top = max(range(len(mems)), key=lambda k: mems[k]["measured"])
    plain = [m.get("measured") for m in world.run(measure_without_module_hooks, spec)]
    return {"verify": "PASS" if ok else "FAIL", "memory": mems, "top_rank": top,
            "measured": mems[top]["measured"],
            "measured_min": min(m["measured"] for m in mems),
            "measured_no_hooks": max(plain) if all(plain) else None,
            "wall_s": time.perf_counter() - t0, "report": text}


def offloaded(res: dict) -> bool:
    return bool(res.get("liveness", {}).get("host"))


def predicted_peak(res: dict) -> float:
    """The liveness figure a row compares with the measurement: the device peak, plus the host's
    bytes under offload (on CPU the tracker counts both; see the module docstring)."""
    live = res["liveness"]
    return live["peak"] + live.get("host", 0)


def host_grad_copy(traced, plan) -> int:
    """Bytes of the fp32 gradient copy in an offload plan's host bytes: 4 per element of every
    offloaded parameter's state shard (cost/state.py ``state_bytes``)."""
    from autoshard.cost.state import step_elements
    strategies, total = plan.strategies(), 0
    for p in traced.params:
        st = strategies.get(p.name)
        if p.info is not None and st is not None and st.kernel == "offload":
            total += 4 * step_elements(tuple(p.info.shape), st.outputs[0], "offload",
                                       tuple(plan.mesh_shape))
    return total


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def err(pred: float, meas: float) -> float:
    return (pred - meas) / meas


def cell(pred: float, meas: float) -> str:
    return f"{kib(pred)} ({100 * err(pred, meas):+.1f}%)"


def row(model: str, mesh: str, rc: str, name: str, res: dict) -> list[str]:
    head = [model, mesh, rc, name, res.get("verify", "")]
    if "memory" not in res:
        return head + [""] * (len(HEAD) - len(head) - 1) + [md_cell(res.get("failure", ""))]
    m = res["memory"][res["top_rank"]]
    meas, b, live = res["measured"], m["breakdown"], res["liveness"]
    shown = kib(meas) if res["measured_min"] == meas else f"{kib(res['measured_min'])}-{kib(meas)}"
    plain = res.get("measured_no_hooks")
    pred = predicted_peak(res)
    note = ""
    if offloaded(res):
        state = pred - res["host_grad_copy"]
        note = (f"offload: liveness = device peak {kib(live['peak'])} + host "
                f"{kib(live['host'])}; without the host's fp32 gradient copy "
                f"({kib(res['host_grad_copy'])}, not made on CPU) {cell(state, meas)}")
    return head + [
        shown, cell(res["sum_model"], meas), cell(pred, meas),
        f"{live['phase']} @{live['at']}",
        " / ".join(kib(live[k]) for k in PRED_PARTS),
        " / ".join(kib(b[k] + (b["buffers"] if k == "other" else 0)) for k in PARTS),
        f"{kib(plain)} ({100 * err(pred, plain):+.1f}%)" if plain else "", note]


HEAD = ["model", "mesh", "recompute", "plan", "verify", "measured peak KiB",
        "sum model KiB (error)", "liveness KiB (error)", "liveness peak in",
        "liveness at its peak: params / grads / optimizer / activations / temporaries KiB",
        "measured at its peak: params / grads / optimizer / activations / temporaries / other KiB",
        "measured, tracker without module hooks KiB (liveness error)", "note"]


def render(rows: list[list[str]], results: list[tuple], wall_s: float, step: str) -> str:
    lines = [
        "## Predicted vs measured peak memory per rank (gloo, MemTracker)",
        "",
        f"- command: `{command('benchmarks/memory_vs_measure.py')}`",
        f"- machine: {machine()}",
        f"- date: {today()}; {revision()}; total wall time {wall_s / 60:.1f} min",
        "- each plan made on the `stress` cluster (autoshard verify's default), fp32, the zoo's "
        "default batch and sequence; `recompute`: `PlanOptions(recompute=...)` (full: every "
        "checkpointable layer recomputed from its inputs; selective: from its matmuls', "
        "attention's and collectives' outputs, docs/cost-model.md §8; zero3's layouts assembled "
        "with the same layers checkpointed). Run on 4 gloo ranks by `autoshard verify`'s rank "
        "function "
        f"(`verify` = its loss and gradient check). Measured: the {step}, by "
        "`torch.distributed._tools.mem_tracker.MemTracker` on CPU; the peak is the largest over "
        "the ranks (a range where the ranks differ), the breakdown that rank's at its peak "
        "(`other`: the inputs and buffers). `error` = (predicted - measured) / measured.",
        "- state modes (docs/cost-model.md §9): `dp+zero1`, `dp+zero2`, `dp+offload` are the "
        "`dp` baseline planned with `zero=\"zero1\"`, `zero=\"zero2\"` (optimizer state, and "
        "for ZeRO-2 gradients, sharded over the replicated axes, each shard's fp32 master in "
        "the optimizer; the measurement counts the masters, tracked as `other`) and "
        "`offload=\"optimizer\"` (optimizer state and step on the host); `megatron-dp+...` the "
        "same on `megatron-dp` (2x2 only). **Offload rows**: on CPU the host is the same memory "
        "as the device and the tracker counts both, so both predictions of an offload row are "
        "the device's plus the host bytes (`predicted[\"memory\"][\"host\"]`); the host "
        "bytes include an fp32 copy of each gradient shard for the step (cost/state.py), which "
        "exists only during the optimizer step and which the step does not make on CPU (the "
        "gradient is fp32 there already): the note gives the liveness figure without it.",
        "- `sum model`: docs/cost-model.md §4.4, the sum of the plan's memory prices (each node's "
        "`Pricer.memory` + `Pricer.saved_copies`): model state + everything the forward saves "
        "for backward, all alive at once. "
        "`liveness`: `autoshard.cost.liveness.step_memory` (§4.5), the most bytes alive at any "
        "moment of the step; `liveness peak in`: the phase and node where it is reached.",
        "- `measured, tracker without module hooks`: the same step measured again by a "
        "MemTracker whose module tracker hooks nothing. MemTracker's module tracker puts a "
        "gradient hook on the inputs of every module it sees run, and the rank program is a "
        "module whose inputs are the parameters: the hook holds every parameter gradient "
        "autograd computes until all have arrived, so `AccumulateGrad` copies each into `.grad` "
        "and the original stays alive beside the copy until backward ends (twice the "
        "gradients of the parameters that do not go through a data-parallel bucket). Without "
        "those hooks the step holds what it holds untracked; the split at its peak is coarser "
        "(no backward phase), so only the total is shown. On a 1-D mesh `megatron-dp` is "
        "`megatron`: where the two rows differ, the difference is the run-to-run variation of the "
        "measurement (a tensor freed at another moment of the step).",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "|".join("---" if k < 5 or k in (8, 12) else "---:" for k in range(len(HEAD)))
        + "|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", *summary_lines(results)]
    return "\n".join(lines)


def summary_lines(results: list[tuple]) -> list[str]:
    measured = [(m, s, rc, n, r) for m, s, rc, n, r in results if "memory" in r]
    if not measured:
        return ["No plan was measured."]

    def stats(key: str, rows=measured) -> tuple[float, float, float]:
        e = [err(r[key], r["measured"]) for *_, r in rows]
        return min(e), max(e), max(abs(x) for x in e)

    live = [(m, s, rc, n, {**r, "live": predicted_peak(r)}) for m, s, rc, n, r in measured]
    out = []
    for label, key, rows in (("sum model", "sum_model", measured), ("liveness", "live", live)):
        lo, hi, worst = stats(key, rows)
        out.append(f"- {label}: error {100 * lo:+.1f}% to {100 * hi:+.1f}% over {len(rows)} "
                   f"plans, largest |error| {100 * worst:.1f}%; within {100 * TARGET:.0f}% on "
                   f"{sum(abs(err(r[key], r['measured'])) <= TARGET for *_, r in rows)} of "
                   f"{len(rows)} rows.")
        for model in dict.fromkeys(m for m, *_ in rows):
            for rc in dict.fromkeys(x[2] for x in rows):
                sub = [x for x in rows if x[0] == model and x[2] == rc]
                if sub:
                    lo, hi, _ = stats(key, sub)
                    out.append(f"  - {model}, recompute {rc}: {100 * lo:+.1f}% to "
                               f"{100 * hi:+.1f}% over {len(sub)} plans")
    plain = [(predicted_peak(r), r["measured_no_hooks"]) for *_, r in measured
             if r.get("measured_no_hooks")]
    if plain:
        e = [err(p, q) for p, q in plain]
        out.append(f"- liveness against the measurement without the tracker's module hooks: "
                   f"{100 * min(e):+.1f}% to {100 * max(e):+.1f}% over {len(e)} plans.")
    out.append("- liveness by technique (each row counted under every technique it uses): "
               + "; ".join(f"{t}: {100 * lo:+.1f}% to {100 * hi:+.1f}% over {k} rows"
                           for t, (lo, hi, k) in by_technique(live).items()) + ".")
    worst = sorted(live, key=lambda x: -abs(err(x[4]["live"], x[4]["measured"])))[:3]
    out.append("- largest liveness errors: " + "; ".join(
        f"{m} {s} recompute {rc} {n} {100 * err(r['live'], r['measured']):+.1f}%"
        + (f" ({100 * err(r['live'], r['measured_no_hooks']):+.1f}% without module hooks)"
           if r.get("measured_no_hooks") else "")
        for m, s, rc, n, r in worst) + ".")
    for m, s, rc, n, r in results:
        if "memory" not in r:
            out.append(f"- {m} on {s}, recompute {rc}, {n}: {r.get('failure', 'not run')}")
    return out


TECHNIQUES = ("ZeRO-1", "ZeRO-2", "ZeRO-3", "selective recomputation", "full recomputation",
              "optimizer offload")


def techniques(name: str, rc: str) -> list[str]:
    """The memory techniques a row's plan uses (the must-show list's names)."""
    state = name.partition("+")[2]
    out = [{"zero1": "ZeRO-1", "zero2": "ZeRO-2", "offload": "optimizer offload"}[state]] \
        if state else []
    if name == "zero3":
        out.append("ZeRO-3")
    if rc in ("full", "selective"):
        out.append(f"{rc} recomputation")
    return out


def by_technique(live: list[tuple]) -> dict[str, tuple[float, float, int]]:
    """Technique -> (smallest, largest liveness error, rows) over the rows that use it."""
    out = {}
    for t in TECHNIQUES:
        e = [err(r["live"], r["measured"]) for _, _, rc, n, r in live if t in techniques(n, rc)]
        if e:
            out[t] = (min(e), max(e), len(e))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default=",".join(MESHES))
    ap.add_argument("--recompute", default=",".join(RECOMPUTE),
                    help="activation checkpointing settings to plan with (none, full, "
                         "selective)")
    ap.add_argument("--states", default=",".join(STATES),
                    help="state modes to plan on the dp (and, on a 2-D mesh, megatron-dp) "
                         "baselines: zero1, zero2, offload; empty for none")
    ap.add_argument("--state-recompute", default=",".join(STATE_RECOMPUTE),
                    help="checkpointing settings the state-mode plans are made with")
    ap.add_argument("--time-limit", type=float, default=20.0, help="ILP time limit per plan (s)")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)

    from autoshard.tools.cli import parse_mesh
    from autoshard.codegen.world import World

    t0 = time.perf_counter()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    meshes = [s.strip() for s in args.meshes.split(",") if s.strip()]
    settings = [s.strip() for s in args.recompute.split(",") if s.strip()]
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    unknown = [s for s in states if s not in STATES]
    if unknown:
        ap.error(f"--states: unknown {unknown}; pick among {list(STATES)}")
    state_rc = [s.strip() for s in args.state_recompute.split(",") if s.strip()] if states \
        else []
    results: list[tuple] = []
    rows: list[list[str]] = []
    step = "second (steady-state) training step"
    worlds: dict[int, World] = {}
    try:
        for model in models:
            for mesh in meshes:
                shape = parse_mesh(mesh)
                size = 1
                for n in shape:
                    size *= n
                if size not in worlds:
                    worlds[size] = World(size, timeout_s=600).start()
                for rc in dict.fromkeys(settings + state_rc):
                    names = (list(PLANS) if rc in settings else []) + (
                        state_plan_names(shape, states) if rc in state_rc else [])
                    traced, plans = make_plans(model, shape, args.time_limit, rc, names)
                    for name, plan in plans.items():
                        if isinstance(plan, str):
                            res = {"failure": plan}
                        else:
                            res = run_case(worlds[size], model, plan)
                            res["liveness"] = liveness(traced, plan).to_json()
                            # Under offload both figures are the device's plus the host's
                            # (the same memory on CPU, see the module docstring).
                            res["sum_model"] = sum_model(traced, plan) + res["liveness"]["host"]
                            res["host_grad_copy"] = host_grad_copy(traced, plan)
                        if "memory" in res:
                            step = res["memory"][0]["step"]
                        results.append((model, mesh, rc, name, res))
                        rows.append(row(model, mesh, rc, name, res))
                        print(" | ".join(rows[-1]), flush=True)
    finally:
        for w in worlds.values():
            w.close()
    body = render(rows, results, time.perf_counter() - t0, step)
    print()
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"model": m, "mesh": s, "recompute": rc, "plan": n,
              **{k: v for k, v in r.items() if k != "report"}}
             for m, s, rc, n, r in results], indent=1, default=str))
    if args.out:
        write_section(args.out, SECTION, body)
        print(f"wrote section {SECTION!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
