"""autoshard against the hand-written baselines, every zoo model on several meshes.

For every model the script traces once (the trace does not depend on the mesh), then on each
mesh plans with autoshard (``plan_traced``) and with every baseline of
``autoshard.solver.baselines.BASELINES`` (``baseline_plan``), all priced by the same cost model,
and prints one row per (model, mesh): predicted step times, the best baseline over autoshard,
autoshard's peak memory, the solver status and gap. A row where autoshard is slower than the best
baseline (or finds no plan where a baseline does) is flagged ``WORSE`` and listed after the table.

Each model is traced once; every plan is the one ``plan_traced`` or ``baseline_plan`` returns.

    python benchmarks/compare_plans.py                        # everything (~20 min on 2 cores)
    python benchmarks/compare_plans.py --models gpt2,llama-tiny --meshes 8,2x4
    python benchmarks/compare_plans.py --out benchmarks/RESULTS.md
"""
from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _results import command, machine, md_cell, today, write_section  # noqa: E402

from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.solver import planner  # noqa: E402
from autoshard.solver.baselines import BASELINES, STORED, baseline_plan, stored_plan  # noqa: E402

ALL = BASELINES + STORED
from autoshard.solver.ilp import Infeasible, NoSolution  # noqa: E402
from autoshard.trace.export import trace  # noqa: E402
from autoshard.zoo.registry import ZOO, get_model  # noqa: E402

MESHES = "8,2x4,4x2,2x2x2"
LLAMA3_SEQ = 2048     # llama3 presets default to their 8192 context; 2048 keeps tracing sane
SECTION = "compare_plans"
TOL = 1e-6            # relative: autoshard counts as worse only beyond float noise


def seq_for(name: str) -> int | None:
    return LLAMA3_SEQ if name.startswith("llama3") else None


def parse_meshes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(n) for n in m.lower().split("x")) for m in text.split(",") if m.strip()]


def mesh_str(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


def short(e: BaseException, n: int = 160) -> str:
    text = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return text if len(text) <= n else text[: n - 3] + "..."


def failure_cell(e: BaseException) -> str:
    """What a plan's failure means, from the solver verdict the planner's error chains: OOM (no
    plan fits memory), a solver timeout, or an error."""
    cause = e.__cause__ if isinstance(e, AutoshardError) else None
    if isinstance(cause, Infeasible):
        bound = "" if cause.exact else "at least "
        return f"infeasible: OOM (needs {bound}{cause.least_memory / 2**30:.1f} GiB)"
    if isinstance(cause, NoSolution):
        return "no solution: solver time limit (not OOM)"
    return "error: " + short(e)


def plan_row(name: str, traced, shape: tuple[int, ...], cluster: str, time_limit: float) -> dict:
    mesh = Mesh(shape, cluster=cluster)
    row: dict = {"model": name, "mesh": mesh_str(shape)}
    t0 = time.perf_counter()
    try:
        p = planner.plan_traced(traced, mesh, time_limit_s=time_limit, model_name=name)
        row.update(auto=p.predicted["step_time_s"], peak=p.predicted["peak_memory_bytes"],
                   status=p.solver["status"], gap=p.solver["gap"],
                   objective=p.solver.get("objective"), merged=p.solver.get("merged_axes"),
                   techniques=techniques(p), small=small_sharded(traced, p))
    except Exception as e:  # noqa: BLE001 -- a failing model is a row, not a crash
        traceback.print_exc()
        row["auto_err"] = failure_cell(e)
    for b in ALL:
        if b in STORED and len(shape) > 2:
            row[b + "_err"] = "n/a (1-D, 2-D meshes)"
            continue
        try:
            make = baseline_plan if b in BASELINES else stored_plan
            bp = make(traced, mesh, b, time_limit_s=time_limit)
            row[b] = bp.predicted["step_time_s"]
        except Exception as e:  # noqa: BLE001
            if not isinstance(e, AutoshardError):
                traceback.print_exc()
            row[b + "_err"] = failure_cell(e)
    row["wall_s"] = time.perf_counter() - t0
    feasible = [row[b] for b in ALL if b in row]
    row["best"] = min(feasible) if feasible else None
    if "auto" in row:
        row["worse"] = row["best"] is not None and row["auto"] > row["best"] * (1 + TOL)
    else:
        row["worse"] = row["best"] is not None
    return row


def techniques(p) -> str:
    """What the plan does beyond placing tensors: gradient buckets, recomputed layers."""
    buckets = len({c.node for c in p.collectives if c.members})
    out = [f"{buckets} buckets"] if buckets else []
    if p.recompute:
        out.append(f"recompute {len(p.recompute)}/{len(p.layers)} layers")
    return ", ".join(out) or "-"


SMALL = 2**20     # bytes: a parameter below 1 MiB is not worth sharding unless memory asks


def small_sharded(traced, p) -> int:
    """Parameters under 1 MiB the plan stores sharded and gathers where they are read (ZeRO-3
    style: collectives, each with its latency, for a few bytes). A bias stored sharded with its
    column-parallel weight and read where it lies is not counted: it moves nothing."""
    small = {ph.name for ph in traced.params if ph.info is not None
             and math.prod(ph.info.shape) * ph.info.dtype.itemsize < SMALL}
    return len({c.value for c in p.collectives if c.phase == "forward" and c.value in small})


def fmt_row(r: dict) -> list[str]:
    if "trace_err" in r:
        return ([r["model"], r["mesh"], "trace failed: " + r["trace_err"]]
                + [""] * (len(HEAD) - 3))
    ms = lambda v: f"{v * 1e3:.3f}"  # noqa: E731
    cells = [r["model"], r["mesh"], ms(r["auto"]) if "auto" in r else r["auto_err"]]
    cells += [ms(r[b]) if b in r else r[b + "_err"] for b in ALL]
    if "auto" in r and r["best"] is not None:
        cells.append(f"{r['best'] / r['auto']:.3f}" if r["auto"] > 0 else "-")
    else:
        cells.append("-")
    if "auto" in r:
        cells += [f"{r['peak'] / 2**30:.3g}", r["status"], f"{r['gap']:.2%}", r["techniques"],
                  str(r["small"])]
    else:
        cells += ["-", "-", "-", "-", "-"]
    cells.append("**WORSE**" if r["worse"] else "")
    cells.append(f"{r['wall_s']:.0f}")
    return cells


HEAD = (["model", "mesh", "autoshard ms"] + [f"{b} ms" for b in ALL]
        + ["best baseline / autoshard", "autoshard peak GiB", "status", "gap", "techniques",
           "params < 1 MiB gathered per use", "flag", "wall s"])


def table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(md_cell(c) for c in fmt_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def flagged(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        if "trace_err" in r:
            out.append(f"- {r['model']}: trace failed: {r['trace_err']}")
        elif r.get("worse"):
            auto = f"{r['auto'] * 1e3:.3f} ms" if "auto" in r else r["auto_err"]
            base = ", ".join(f"{b} {r[b] * 1e3:.3f} ms" for b in ALL if b in r)
            detail = ""
            if "auto" in r and r.get("objective") is not None:
                # The ILP's own objective next to the assembled prediction: they should agree.
                detail = f" (ILP objective {r['objective'] * 1e3:.3f} ms"
                detail += f", merged axes {r['merged']})" if r.get("merged") else ")"
            out.append(f"- WORSE {r['model']} on {r['mesh']}: autoshard {auto}{detail}; {base}")
        elif "auto_err" in r:
            out.append(f"- {r['model']} on {r['mesh']}: autoshard {r['auto_err']}")
    return out


def mismatched(rows: list[dict]) -> list[str]:
    out = []
    for r in rows:
        obj = r.get("objective")
        if "auto" in r and obj is not None and abs(obj - r["auto"]) > 0.01 * max(r["auto"], 1e-12):
            merged = f", merged axes {r['merged']}" if r.get("merged") else ""
            out.append(f"- {r['model']} on {r['mesh']}: predicted {r['auto'] * 1e3:.3f} ms, "
                       f"ILP objective {obj * 1e3:.3f} ms{merged}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma-separated zoo names (default: all)")
    ap.add_argument("--meshes", default=MESHES, help=f"comma-separated shapes (default {MESHES})")
    ap.add_argument("--cluster", default="h100")
    ap.add_argument("--time-limit", type=float, default=20.0,
                    help="ILP time limit per plan, s (default 20, the planner's)")
    ap.add_argument("--out", default=None, help="rewrite this section of a RESULTS.md")
    args = ap.parse_args(argv)
    models = [m.strip() for m in args.models.split(",")] if args.models else list(ZOO)
    unknown = [m for m in models if m not in ZOO]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(ZOO)}")
    meshes = parse_meshes(args.meshes)
    started, t_all = today(), time.perf_counter()
    rows: list[dict] = []
    traces: list[str] = []
    for name in models:
        entry, seq = ZOO[name], seq_for(name)
        shown_seq = seq if seq is not None else entry.seq
        t0 = time.perf_counter()
        try:
            model, inputs = get_model(name, seq=seq)
            traced = trace(model, inputs, training=True)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"model": name, "mesh": "all", "trace_err": short(e, 300)})
            print(table(rows[-1:]).splitlines()[-1], flush=True)
            continue
        took = time.perf_counter() - t0
        traces.append(f"{name} (batch {entry.batch}, seq {shown_seq}): {took:.1f} s")
        print(f"# {name}: batch {entry.batch}, seq {shown_seq}, traced in {took:.1f} s",
              flush=True)
        for shape in meshes:
            rows.append(plan_row(name, traced, shape, args.cluster, args.time_limit))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
        del traced, model, inputs
    total = time.perf_counter() - t_all
    notes = flagged(rows)
    body = ["## Plan quality: autoshard vs hand-written baselines", "",
            f"- command: `{command('benchmarks/compare_plans.py')}`",
            f"- machine: {machine()}",
            f"- date: {started}; total wall time {total / 60:.1f} min",
            f"- cluster {args.cluster}; default mesh axes (1-D `x`, 2-D `dp,tp`, 3-D `x,y,z`); "
            f"training step (Adam); each preset's default batch and sequence, except the llama3 "
            f"presets, traced at seq {LLAMA3_SEQ} instead of their 8192 context to keep tracing "
            f"time sane; ILP time limit {args.time_limit:g} s per plan.",
            "- step times are the cost model's predictions (ms), overlap of bucketed gradient "
            "sync with backward priced (docs/cost-model.md §7), for autoshard and for each "
            "baseline (`dp`, `megatron` over every axis, `megatron-dp`: Megatron over the last "
            "axis, DP over the others, weights read where they lie; `fsdp`: every parameter "
            "stored sharded over every axis, `fsdp-tp`: torchtitan's 2-D storage, FSDP x "
            "Megatron over the last axis, both read as the ILP finds cheapest, 1-D and 2-D "
            "meshes), each solved by the same ILP machinery, activation checkpointing allowed "
            "where memory binds (§8); `infeasible: OOM` = no plan with that baseline's "
            "parameter layout fits device memory; `no solution: solver time limit` = the ILP "
            "found no solution within the time limit though a plan fitting memory exists. "
            "Ratio = best feasible baseline / autoshard (>= 1 means autoshard is at least as "
            "fast). `techniques`: gradient buckets, recomputed layers; `params < 1 MiB gathered "
            "per use`: small parameters the plan stores sharded and gathers where read. `wall s` "
            "= planning time of the row (autoshard and every baseline).",
            "", table(rows), ""]
    body += ["Rows flagged or failed:", ""] + (notes or ["- none"]) + [""]
    body += ["Rows where autoshard's ILP objective and its assembled predicted step differ by "
             "more than 1% (the two should agree):", ""] + (mismatched(rows) or ["- none"]) + [""]
    body += ["Trace time per model: " + "; ".join(traces) + "."]
    text = "\n".join(body)
    print()
    print(text)
    if args.out:
        write_section(args.out, SECTION, text)
        print(f"\nwrote section {SECTION} of {args.out}")
    return 1 if any(r.get("worse") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
