"""Holdout suite: real-size Hugging Face architectures, built from their published configs.

The zoo's models are the ones autoshard was developed against; these are not. Each model in
``benchmarks/holdout/<name>.json`` is its config.json as released (the file's ``source`` says
which), built with transformers' Auto classes on the meta device (no weights, no downloads) by
``autoshard.zoo.hf.from_config``, the code path of ``autoshard plan path/to/config.json``, and
planned for a training step (mixed-precision Adam) on an 8-device and an 8x8-device h100 mesh.

Every (model, mesh) case runs in a fresh Python process with a wall-clock timeout, so one model
that plans slowly, crashes or exhausts memory does not stop the suite. Per case the table gives
the planning time (``autoshard.plan``: tracing, ILP build, solve, assembling the plan), the
predicted step time, the peak memory per device and the verdict; for every case it also gives the
hand calculation a reader can check an "infeasible" verdict against: the model state per device if
every parameter were sharded over the whole mesh, 16 bytes per parameter (bf16 parameter and
gradient, fp32 master copy, Adam momentum and variance; docs/cost-model.md §4.1) / devices; and
the share of parameters the plan keeps whole on every device. Ops that autoshard has no sharding
rule for (it warns once per op, and replicates them) are listed per model under the table, with
each case's failure text, the plan's own warnings and its largest replicated parameters.

    python benchmarks/holdout.py                                   # every model, meshes 8 and 8x8
    python benchmarks/holdout.py --models llama3-8b,t5-large --meshes 8x8 --timeout 600
    python benchmarks/holdout.py --out benchmarks/RESULTS.md       # rewrite its section there
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, revision, today, write_section  # noqa: E402

from autoshard.tools.cli import parse_mesh  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
# --set -> (its configs' folder, the RESULTS.md section it writes, the section's title). "unseen":
# the architectures of 2024-2026 (local:global attention, MLA and routed experts, complex RoPE,
# state-space layers) planned after their ops got rules (docs/cost-model.md §12, §13).
SETS = {"holdout": (HERE / "holdout", "holdout", "Holdout: published Hugging Face architectures"),
        "unseen": (HERE / "unseen", "unseen", "Unseen architectures")}
CONFIGS, SECTION, TITLE = SETS["holdout"]

# Keys of a holdout JSON that describe the file rather than the model; the rest is config.json.
META_KEYS = ("kind", "source")
# kind -> the task of autoshard.zoo.hf.from_config (which picks the Auto class and the inputs)
KINDS = {
    "decoder": "causal-lm",
    "moe": "causal-lm",
    "encoder": "masked-lm",
    "encoder-decoder": "seq2seq",
    "vision": "image-classification",
}
ADAM_BYTES_PER_PARAM = 16          # docs/cost-model.md §4.1, mixed-precision Adam
UNRULED = re.compile(r"autoshard: no sharding rule for (\S+); .*?First seen at: (.*)", re.S)
# The planner's warning when devices repeat work (solver/planner.py, _mesh_use_note).
REPEATED = re.compile(r"compute per device is ([\d.]+)x the ideal share.*?idle axes: (.*?)(?:\.|$)")


# ---------------------------------------------------------------- building a model (child side)

def load_config(name: str) -> dict:
    path = CONFIGS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"no config {path}; known: {', '.join(known_models())}")
    return json.loads(path.read_text())


def known_models() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def build(name: str, dtype_name: str):
    """The model of ``holdout/<name>.json`` on the meta device in ``dtype`` (training runs in
    bf16: the memory model's 16 bytes per parameter), wrapped so that it takes positional inputs
    and returns its loss, and the holdout spec."""
    from autoshard.zoo.hf import from_config

    spec = load_config(name)
    fields = {k: v for k, v in spec.items() if k not in META_KEYS}
    model = from_config(fields, task=KINDS[spec["kind"]], dtype=getattr(torch, dtype_name))
    return model, spec


def example_inputs(model, batch: int, seq: int | None):
    """(tensors, shape text) for one training step with labels, on meta: token ids of ``seq``
    (default 2048) capped at the model's max positions, or images of the config's size."""
    if model.task == "image-classification":
        pixels, labels = model.example_inputs(batch, None)
        return (pixels, labels), "x".join(map(str, [batch, *pixels.shape[2:]]))
    tokens, labels = model.example_inputs(batch, min(seq, model.context) if seq else None)
    return (tokens, labels), "x".join(map(str, tokens.shape))


def verdict_of(error: Exception) -> str:
    """One line saying why planning failed: infeasible (with autoshard's least memory), no
    solution within the time limit, or the error itself."""
    from autoshard.solver.diagnostics import gib
    from autoshard.solver.ilp import Infeasible, NoSolution

    text, cause = str(error), error.__cause__
    if isinstance(cause, Infeasible):
        least = ("" if cause.exact else "at least ") + gib(cause.least_memory)
        return f"infeasible: least {least} (budget {gib(cause.budget)})"
    if isinstance(cause, NoSolution):
        return "no solution within time limit: " + text.split("got ", 1)[-1].split(". Fix")[0]
    detail = f" [cause: {type(cause).__name__}: {str(cause).strip().splitlines()[0]}]" \
        if cause is not None and str(cause).strip() else ""
    return f"error: {type(error).__name__}: {text.strip().splitlines()[0] if text else ''}{detail}"


def one(name: str, mesh_text: str, batch: int, seq: int | None, time_limit: float,
        dtype_name: str) -> dict:
    """Build and plan one case in this process; a JSON-able dict of what the table needs."""
    import autoshard

    model, spec = build(name, dtype_name)
    inputs, shape = example_inputs(model, batch, seq)
    params = sum(p.numel() for p in model.parameters())     # tied weights counted once
    mesh_shape = parse_mesh(mesh_text)
    out = {"model": name, "kind": spec["kind"], "params": params, "mesh": mesh_text,
           "inputs": shape, "devices": math.prod(mesh_shape)}
    mesh = autoshard.Mesh(mesh_shape, cluster="h100")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        try:
            plan = autoshard.plan(model, inputs, mesh, time_limit_s=time_limit, model_name=name)
        except Exception as e:          # a crash in the planner is a finding, not a stop
            plan = None
            out.update(verdict=verdict_of(e), detail=failure_text(e))
        out["plan_s"] = time.perf_counter() - t0
    if plan is not None:
        out.update(plan_figures(plan), **replicated_params(plan, model))
    out["unruled"] = unruled_ops(caught)
    return out


def failure_text(error: Exception) -> str:
    """The whole message, and the first line of its cause (torch.export's error, say)."""
    cause = error.__cause__
    tail = f" [cause: {type(cause).__name__}: {str(cause).strip()[:500]}]" if cause else ""
    return f"{type(error).__name__}: {error}{tail}"


def plan_figures(plan) -> dict:
    s, t = plan.solver, getattr(plan, "timings", None) or {}
    status = s["status"] + (f" (gap {s['gap']:.1%})" if s.get("gap") else "")
    return {"verdict": status, "step_ms": plan.predicted.step_time_s * 1e3,
            "peak_gib": plan.predicted.ilp_sum_bytes / 2**30,
            "trace_s": t.get("trace_s"), "solve_s": t.get("solve_s"),
            # getattr: older planners (a revision measured from a worktree) lack these.
            "layers": len(getattr(plan, "layers", ())),
            "kinds": len({layer.same_as for layer in getattr(plan, "layers", ())}),
            "warnings": list(getattr(plan, "warnings", ())),
            **repeated_work(getattr(plan, "warnings", ()))}


def repeated_work(plan_warnings) -> dict:
    """Compute per device over the ideal share and the idle axes, as the plan's warning says
    (no warning: under 2x, no idle axis)."""
    for w in plan_warnings:
        m = REPEATED.search(w)
        if m:
            axes = ", ".join(a.split(" (")[0] for a in m.group(2).split("), "))
            return {"repeat_x": float(m.group(1)), "idle_axes": axes}
    return {"repeat_x": None, "idle_axes": "none"}


def replicated_params(plan, model) -> dict:
    """Share of the parameters the plan stores whole on every device, and the largest of them
    grouped over layers (``h.*.mlp...``): a weight replicated on a mesh it could be sharded
    over is the usual sign of an op whose rule does not see through to it (e.g. ``weight.T``)."""
    from autoshard import Replicate

    sizes = {n: p.numel() for n, p in model.named_parameters()}
    groups: dict[str, list[int]] = {}
    for fqn, spec in plan.params.items():
        if all(isinstance(x, Replicate) for x in spec):
            groups.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), []).append(sizes.get(fqn, 0))
    pct = 100 * sum(map(sum, groups.values())) / (sum(sizes.values()) or 1)
    # Under 1% is norms and biases, replicated by design: naming them would only be noise.
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:4] if pct >= 1 else []
    return {"replicated_pct": pct,
            "replicated_top": [f"{g} (x{len(ns)}, {sum(ns) / 1e6:,.0f} M)" for g, ns in top]}


def unruled_ops(caught) -> dict[str, str]:
    """op name -> source line where it was first seen, from autoshard's warnings."""
    ops = {}
    for w in caught:
        m = UNRULED.match(str(w.message))
        if m:   # the installed transformers' path is noise: keep the package-relative one
            where = re.sub(r'File "[^"]*/site-packages/', 'File "', m.group(2).strip())
            ops.setdefault(m.group(1), where)
    return ops


# ---------------------------------------------------------------- running cases (parent side)

def run_case(name: str, mesh: str, args) -> dict:
    """One case in a fresh process, killed after ``args.timeout`` seconds."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--meshes", mesh,
           "--set", args.set,
           "--batch", str(args.batch), "--time-limit", str(args.time_limit),
           "--dtype", args.dtype] + (["--seq", str(args.seq)] if args.seq else [])
    # The autoshard of this checkout, not whichever one is installed: a copy of the script in
    # another worktree then measures that worktree's planner.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                           env=env)
    except subprocess.TimeoutExpired:
        return {"model": name, "mesh": mesh, "plan_s": time.perf_counter() - t0,
                "verdict": f"timeout: killed after {args.timeout:g} s", "unruled": {}}
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        tail = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        return {"model": name, "mesh": mesh, "plan_s": time.perf_counter() - t0,
                "verdict": f"crash (exit {r.returncode}): {tail}", "unruled": {}}
    return json.loads(lines[-1])


def summarise(runs: list[dict]) -> dict:
    """The last run's figures with the median planning time over all runs."""
    row = dict(runs[-1])
    row["plan_s"] = statistics.median(r["plan_s"] for r in runs)
    verdicts = {r["verdict"] for r in runs}
    if len(verdicts) > 1:
        row["verdict"] += f" (runs disagree: {' / '.join(sorted(verdicts))})"
    return row


def hand_state_gib(row: dict) -> str:
    if not row.get("params") or not row.get("devices"):
        return ""
    return f"{ADAM_BYTES_PER_PARAM * row['params'] / row['devices'] / 2**30:.2f}"


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    head = ["model", "kind", "parameters", "mesh", "inputs", "plan s", "trace s", "solve s",
            "step ms", "peak GiB/device", "verdict",
            "fully sharded model state GiB/device (16 B/param / devices)",
            "params replicated %", "layers found (kinds)", "idle axes (work per device / ideal)",
            "ops without rules"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r.get("kind", ""), f"{r['params']:,}" if r.get("params") else "",
                 r["mesh"], r.get("inputs", ""), fmt(r.get("plan_s"), ".1f"),
                 fmt(r.get("trace_s"), ".1f"), fmt(r.get("solve_s"), ".1f"),
                 fmt(r.get("step_ms"), ".1f"), fmt(r.get("peak_gib"), ".2f"), r["verdict"],
                 hand_state_gib(r), fmt(r.get("replicated_pct"), ".0f"),
                 f"{r['layers']} ({r['kinds']})" if r.get("kinds") else r.get("layers", ""),
                 r.get("idle_axes", "") + (f" ({r['repeat_x']:.1f}x)" if r.get("repeat_x") else ""),
                 len(r.get("unruled", {}))]
        lines.append("| " + " | ".join(md_cell(c) for c in cells) + " |")
    return "\n".join(lines)


def unruled_list(rows: list[dict]) -> list[str]:
    """Per model, every op autoshard warned it has no rule for, with where it was first seen."""
    per_model: dict[str, dict[str, str]] = {}
    for r in rows:
        per_model.setdefault(r["model"], {}).update(r.get("unruled", {}))
    out = []
    for model, ops in per_model.items():
        if ops:
            listed = "; ".join(f"`{op}` ({md_cell(src)})" for op, src in sorted(ops.items()))
            out.append(f"- {model}: {listed}")
    return out or ["- none"]


def case_notes(rows: list[dict]) -> list[str]:
    """Per case: the full failure text, or the plan's own warnings and its largest replicated
    parameters, so a reader can tell where a verdict or a slow plan comes from."""
    out = []
    for r in rows:
        notes = []
        if r.get("detail"):
            notes.append("failure: " + md_cell(r["detail"]))
        notes += ["plan warning: " + md_cell(w) for w in r.get("warnings", [])]
        if r.get("replicated_top"):
            notes.append("largest replicated parameters: " + ", ".join(
                f"`{md_cell(g)}`" for g in r["replicated_top"]))
        if notes:
            out.append(f"- {r['model']} on {r['mesh']}: " + "; ".join(notes))
    return out or ["- none"]


def report(rows: list[dict], args, started: str, wall: float) -> str:
    runs = f"median of {args.runs} runs" if args.runs > 1 else "one run"
    return "\n".join([
        f"## {TITLE}", "",
        f"- command: `{command('benchmarks/holdout.py')}`",
        f"- machine: {machine()}",
        f"- date: {started}; {revision()}; total wall time {wall / 60:.1f} min",
        f"- each model built from its published config (benchmarks/{CONFIGS.name}/*.json, "
        f"`source` "
        f"field) with transformers' Auto classes on the meta device in {args.dtype}, "
        f"use_cache=False, sdpa attention; inputs batch x seq (decoders seq 2048 capped at the "
        f"model's max positions, BERT and T5 512 with 512-token labels, ViT 224x224 images) "
        f"with labels; `autoshard.plan(..., time_limit_s={args.time_limit:g})` for training "
        f"(mixed-precision Adam) on `Mesh(shape, cluster=\"h100\")`; every case a fresh Python "
        f"process killed after {args.timeout:g} s; `plan s` = wall time of autoshard.plan "
        f"(tracing included; {runs}), `trace s` and `solve s` its parts from `plan.timings`.",
        "- `fully sharded model state` is the hand calculation to check an infeasible verdict "
        "against: if every parameter were sharded over the whole mesh, each device would hold "
        "16 bytes per parameter / devices of model state (docs/cost-model.md §4.1), before "
        "any activation; `params replicated %` is the share of parameter elements the plan "
        "stores whole on every device.", "",
        table(rows), "",
        "Ops without a sharding rule (autoshard replicates them), per model, with the source "
        "line where each was first seen:", "",
        *unruled_list(rows), "",
        "Per case: the failure in full, the plan's warnings, and the largest parameters the plan "
        "stores whole on every device (grouped over layers; M = million elements):", "",
        *case_notes(rows)])


def saved_rows(path: str) -> list[dict]:
    """The rows of a --rows file, the last one of each (model, mesh), in first-seen order."""
    rows: dict[tuple[str, str], dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows[(row["model"], row["mesh"])] = row
    return list(rows.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", default="holdout", choices=sorted(SETS),
                    help="which configs: holdout (default) or unseen (benchmarks/<set>/)")
    ap.add_argument("--models", default=None,
                    help="comma-separated subset of the set's models (default: all)")
    ap.add_argument("--meshes", default="8,8x8", help="comma-separated mesh shapes (default 8,8x8)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="wall-clock seconds per case before it is killed (default 300)")
    ap.add_argument("--time-limit", type=float, default=20.0,
                    help="autoshard's ILP time limit, s (default 20, the planner's)")
    ap.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    ap.add_argument("--seq", type=int, default=None,
                    help="sequence length for text models (default 2048 decoders, 512 BERT/T5)")
    ap.add_argument("--dtype", default="bfloat16", help="parameter dtype (default bfloat16)")
    ap.add_argument("--runs", type=int, default=1, help="runs per case; median plan time")
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    ap.add_argument("--section", default=None,
                    help="the section's name in --out (default: the set's, e.g. unseen)")
    ap.add_argument("--rows", default=None,
                    help="append each case's figures to this JSON-lines file as it finishes, "
                         "and report every row in it (a run stopped early keeps its cases; a "
                         "rerun of a case replaces its row)")
    ap.add_argument("--report", action="store_true",
                    help="with --rows: write the report of the rows saved there, run nothing")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # internal: one child case
    args = ap.parse_args(argv)
    global CONFIGS, SECTION, TITLE
    CONFIGS, SECTION, TITLE = SETS[args.set]
    SECTION = args.section or SECTION
    if args.one:
        print(json.dumps(one(args.one, args.meshes, args.batch, args.seq, args.time_limit,
                             args.dtype)))
        return 0
    models = [m.strip() for m in (args.models or ",".join(known_models())).split(",")
              if m.strip()]
    bad = [m for m in models if m not in known_models()]
    if bad:
        ap.error(f"unknown models {bad}; known: {', '.join(known_models())}")
    meshes = [m.strip() for m in args.meshes.split(",") if m.strip()]
    started, t0, rows = today(), time.perf_counter(), []
    if args.report and not args.rows:
        ap.error("--report reports the rows of a --rows file")
    for name in models if not args.report else ():
        for mesh in meshes:
            row = summarise([run_case(name, mesh, args) for _ in range(args.runs)])
            rows.append(row)
            if args.rows:
                with open(args.rows, "a") as f:
                    f.write(json.dumps(row) + "\n")
            print(f"{name} on {mesh}: {row['plan_s']:.1f} s, {row['verdict']}"
                  f"{', unruled: ' + ', '.join(row['unruled']) if row['unruled'] else ''}",
                  flush=True)
    if args.rows:
        rows = saved_rows(args.rows)
    text = report(rows, args, started, time.perf_counter() - t0)
    print()
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
        print(f"\nwrote section {SECTION} of {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
