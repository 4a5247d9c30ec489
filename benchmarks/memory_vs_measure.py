"""Predicted against measured peak memory of a training step, per rank, on gloo ranks of this host.

    python benchmarks/memory_vs_measure.py --out benchmarks/RESULTS.md
    python benchmarks/memory_vs_measure.py --models gpt2-tiny --meshes 4

For each zoo model (default gpt2-tiny and llama-tiny, their default batch and sequence, fp32) and
mesh (default 4 and 2x2), the model is traced once and planned several ways, every plan priced by
the same cost model on the ``stress`` cluster (the one ``autoshard verify`` plans with):

- ``autoshard``: the planner's choice (``plan_traced``);
- ``dp``, ``megatron``, ``megatron-dp``: the hand-written baselines (solver/baselines.py; on a
  1-D mesh ``megatron-dp`` is ``megatron``);
- ``zero3``: every parameter stored sharded over the whole mesh (``zero3_layouts``, through
  ``solver.alternatives.plan_stored``, which may all-gather a weight where an op reads it whole).

Each plan then runs on 4 gloo ranks through ``autoshard verify``'s rank function
(``verify_rank``): the loss and gradient comparison with the single-device model, then
``measure_step_memory``: a warm-up step creates the AdamW state, and the second step (forward,
backward with its gradient syncs, AdamW step, ``zero_grad``) is measured by
``torch.distributed._tools.mem_tracker.MemTracker``. Per plan the table gives the plan's predicted
peak per device (``predicted["peak_memory_bytes"]``) and its two parts (model state: parameter,
gradient and two Adam moments, 16 bytes per fp32 element of the rank's shards; saved: what the
forward keeps for backward), the measured peak (the largest over the ranks) with the tracker's
breakdown at that moment, the error, and the activations the rank held when its forward returned,
the measured counterpart of the predicted "saved" part.
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
PLANS = ("autoshard", "dp", "megatron", "megatron-dp", "zero3")
PARTS = ("params", "grads", "optimizer", "activations", "temporaries", "other")


def make_plans(model: str, shape: tuple[int, ...], time_limit: float) -> dict[str, object]:
    """name -> Plan, or the error text when no plan of that kind is found."""
    from autoshard import Mesh
    from autoshard.errors import AutoshardError
    from autoshard.solver.alternatives import plan_stored
    from autoshard.solver.baselines import baseline_plan, zero3_layouts
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    from autoshard.verify import build

    mesh = Mesh(shape, cluster="stress")
    traced = trace(*build(model, None, None, 0))
    makers = {
        "autoshard": lambda: plan_traced(traced, mesh, model_name=model, time_limit_s=time_limit),
        "zero3": lambda: plan_stored(traced, mesh, zero3_layouts(traced, mesh), model_name=model,
                                     time_limit_s=time_limit),
    }
    out: dict[str, object] = {}
    for name in PLANS:
        make = makers.get(name) or (lambda n=name: baseline_plan(traced, mesh, n,
                                                                 model_name=model,
                                                                 time_limit_s=time_limit))
        try:
            out[name] = make()
        except AutoshardError as e:
            out[name] = f"no plan: {e}"
    return out


def run_case(world, model: str, plan) -> dict:
    from autoshard.verify import VerifySpec, summarize, verify_rank
    t0 = time.perf_counter()
    reports = world.run(verify_rank, VerifySpec(model, plan.mesh_shape, plan.mesh_axes,
                                                plan.dumps()))
    wall = time.perf_counter() - t0
    for r in reports:
        if "error" in r:
            return {"failure": " ".join(map(str, r["error"]))}
    ok, text = summarize(reports, 1e-5)
    mems = [r["memory"] for r in reports]
    bad = [m["not_measured"] for m in mems if "not_measured" in m]
    if bad:
        return {"verify": "PASS" if ok else "FAIL", "failure": f"not measured: {bad[0]}"}
    top = max(range(len(mems)), key=lambda k: mems[k]["measured"])
    return {"verify": "PASS" if ok else "FAIL", "memory": mems, "top_rank": top,
            "measured_min": min(m["measured"] for m in mems), "wall_s": wall,
            "report": text}


def kib(n: float) -> str:
    return f"{n / 1024:.1f}"


def row(model: str, mesh: str, name: str, res: dict) -> list[str]:
    if "memory" not in res:
        return [model, mesh, name, res.get("verify", ""), "", "", "", "", "", "",
                *([""] * len(PARTS)), md_cell(res.get("failure", ""))]
    m = res["memory"][res["top_rank"]]
    p, b = m["predicted"], m["breakdown"]
    measured = kib(m["measured"])
    if res["measured_min"] != m["measured"]:
        measured = f"{kib(res['measured_min'])}-{measured}"
    fwd = (m.get("after_forward") or {}).get("activations")
    fwd_cell = f"{kib(fwd)} ({100 * (p['saved'] - fwd) / fwd:+.1f}%)" if fwd else ""
    return [model, mesh, name, res["verify"], kib(p["peak"]), measured,
            f"{100 * m['error']:+.1f}", kib(p["model_state"]), kib(p["saved"]), fwd_cell,
            *(kib(b[k]) for k in PARTS), where_it_differs(p, b)]


def where_it_differs(p: dict, b: dict) -> str:
    """measured - predicted, split into parts that add up to it, largest first (those of at
    least 1 KiB). The prediction's model state is params + two moments (3/4 of it in fp32 AdamW)
    and gradients (1/4); at the measured peak gradients are in ``.grad`` (grads) or still in a
    sync bucket (temporaries, with the activation gradients), so those two go together."""
    grads_pred = p["model_state"] // 4
    terms = {
        "params+moments": b["params"] + b["optimizer"] - (p["model_state"] - grads_pred),
        "grads+temporaries": b["grads"] + b["temporaries"] - grads_pred,
        "activations": b["activations"] - p["saved"],
        "other": b["other"] + b["buffers"] - p["buffers"],
    }
    big = sorted(((v, k) for k, v in terms.items() if abs(v) >= 1024), key=lambda t: -abs(t[0]))
    return "; ".join(f"{k} {'+' if v > 0 else '-'}{kib(abs(v))}" for v, k in big)


HEAD = ["model", "mesh", "plan", "verify", "predicted peak KiB", "measured peak KiB",
        "error %", "predicted model state KiB", "predicted saved KiB",
        "measured activations after forward KiB (predicted saved vs it)",
        *(f"at peak: {k} KiB" for k in PARTS), "measured - predicted, by part (KiB)"]


def render(rows: list[list[str]], results: list[tuple[str, str, str, dict]], wall_s: float,
           step: str) -> str:
    lines = [
        "## Predicted vs measured peak memory per rank (gloo, MemTracker)",
        "",
        f"- command: `{command('benchmarks/memory_vs_measure.py')}`",
        f"- machine: {machine()}",
        f"- date: {today()}; {revision()}; total wall time {wall_s / 60:.1f} min",
        "- each plan made on the `stress` cluster (autoshard verify's default), fp32, the zoo's "
        "default batch and sequence; run on 4 gloo ranks by `autoshard verify`'s rank function "
        f"(`verify` = its loss and gradient check). Measured: the {step}, by "
        "`torch.distributed._tools.mem_tracker.MemTracker` on CPU; the peak is the largest over "
        "the ranks (a range where the ranks differ), the breakdown that rank's at its peak. "
        "`error` = (predicted - measured) / measured.",
        "- predicted peak = model state (param + grad + two Adam moments: 16 bytes per fp32 "
        "element of the rank's shards, docs/cost-model.md §4.1) + saved (what the forward keeps "
        "for backward, §4.4): everything held at once. It counts no activation gradients and no "
        "temporaries, and gradients in full.",
        "- `measured activations after forward`: the activations the rank held when its forward "
        "returned (MemTracker's post-forward snapshot of the module): the measured counterpart "
        "of the predicted `saved` part. At the peak: `grads` are gradients already in `.grad`; "
        "gradients the runtime still holds in a gradient-sync bucket, and activation gradients, "
        "are `temporaries`; `other` = inputs and buffers.",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "|".join("---" if k < 4 else "---:" for k in range(len(HEAD) - 1)) + "|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", *summary_lines(results)]
    return "\n".join(lines)


def summary_lines(results: list[tuple[str, str, str, dict]]) -> list[str]:
    measured = [(m, s, n, r) for m, s, n, r in results if "memory" in r]
    if not measured:
        return ["No plan was measured."]
    errs = [r["memory"][r["top_rank"]]["error"] for *_, r in measured]
    fwd = [(r["memory"][r["top_rank"]]["predicted"]["saved"],
            (r["memory"][r["top_rank"]].get("after_forward") or {}).get("activations"))
           for *_, r in measured]
    fwd_errs = [(p - a) / a for p, a in fwd if a]
    out = [f"Peak error over {len(errs)} plans: mean {100 * sum(errs) / len(errs):+.1f}%, "
           f"range {100 * min(errs):+.1f}% to {100 * max(errs):+.1f}% (negative: the plan "
           f"predicts less than was measured)."]
    if fwd_errs:
        out.append(f"Predicted saved-for-backward against the activations measured when the "
                   f"forward returned: mean {100 * sum(fwd_errs) / len(fwd_errs):+.1f}%, range "
                   f"{100 * min(fwd_errs):+.1f}% to {100 * max(fwd_errs):+.1f}%.")
        for model in dict.fromkeys(m for m, *_ in measured):
            e = [(p - a) / a for (mm, *_), (p, a) in zip(measured, fwd) if mm == model and a]
            if e:
                out.append(f"- {model}: saved part {100 * min(e):+.1f}% to {100 * max(e):+.1f}% "
                           f"over {len(e)} plans")
    under = [(m, s, n) for m, s, n, r in measured if r["memory"][r["top_rank"]]["error"] < 0]
    if under:
        out.append("Peaks measured above the prediction (the prediction holds no temporaries: "
                   "activation gradients, gradients in sync buckets): "
                   + ", ".join(f"{m} {s} {n}" for m, s, n in under) + ".")
    failed = [(m, s, n, r) for m, s, n, r in results if "memory" not in r]
    for m, s, n, r in failed:
        out.append(f"- {m} on {s}, {n}: {r.get('failure', 'not run')}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--meshes", default=",".join(MESHES))
    ap.add_argument("--time-limit", type=float, default=20.0, help="ILP time limit per plan (s)")
    ap.add_argument("--out", default=None, help="write the section into this RESULTS.md")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    args = ap.parse_args(argv)

    from autoshard.cli import parse_mesh
    from autoshard.codegen.world import World

    t0 = time.perf_counter()
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    meshes = [s.strip() for s in args.meshes.split(",") if s.strip()]
    shapes = {s: parse_mesh(s) for s in meshes}
    results: list[tuple[str, str, str, dict]] = []
    rows: list[list[str]] = []
    step = "second (steady-state) training step"
    worlds: dict[int, World] = {}
    try:
        for model in models:
            for mesh in meshes:
                shape = shapes[mesh]
                size = 1
                for n in shape:
                    size *= n
                plans = make_plans(model, shape, args.time_limit)
                if size not in worlds:
                    worlds[size] = World(size, timeout_s=600).start()
                for name, plan in plans.items():
                    res = ({"failure": plan} if isinstance(plan, str)
                           else run_case(worlds[size], model, plan))
                    if "memory" in res:
                        step = res["memory"][0]["step"]
                    results.append((model, mesh, name, res))
                    rows.append(row(model, mesh, name, res))
                    print(" | ".join(rows[-1]), flush=True)
    finally:
        for w in worlds.values():
            w.close()
    body = render(rows, results, time.perf_counter() - t0, step)
    print()
    print(body)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{"model": m, "mesh": s, "plan": n, **{k: v for k, v in r.items() if k != "report"}}
             for m, s, n, r in results], indent=1, default=str))
    if args.out:
        write_section(args.out, SECTION, body)
        print(f"wrote section {SECTION!r} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
