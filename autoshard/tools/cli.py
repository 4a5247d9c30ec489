"""``autoshard`` command line: plan, show, report, verify, diff, explain, export, zoo."""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.files import check_output, model_files
from autoshard.options import (CONTEXT_PARALLEL, CONTEXT_PARALLEL_TOKENS, OFFLOAD,
                               OFFLOAD_OVERLAP, OPTIMIZERS, PRECISIONS, RECOMPUTE, SCHEDULES,
                               ZERO, PlanOptions)


def _number(kind: type, what: str, *, zero: bool = False) -> Any:
    """An argparse ``type`` reading a finite number of ``kind`` above zero (or at zero, with
    ``zero``): a bad value is refused by the flag's name ("argument --time-limit: a positive
    number of seconds; got '0'") before anything is loaded or planned."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"{what}; got {text!r}")
        return value
    parse.__name__ = what          # argparse names the type in its own messages
    return parse


COUNT = _number(int, "a positive integer")
SECONDS = _number(float, "a positive number of seconds")
_MICROBATCHES = _number(int, "a positive integer or auto")


def _microbatches(text: str) -> int | str:
    return text if text == "auto" else _MICROBATCHES(text)


def parse_mesh(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if not shape or any(n < 1 for n in shape):
        raise AutoshardError("--mesh is sizes joined by 'x', e.g. 8x8 or 2x2x2", got=repr(text),
                             fix="write the mesh shape like 8x8")
    return shape


def make_mesh(args):
    """The mesh of ``--mesh``, ``--axes`` and ``--cluster``, each refused by its flag's name."""
    from autoshard.cluster import PRESETS
    from autoshard.mesh import Mesh
    shape = parse_mesh(args.mesh)
    axes = tuple(a.strip() for a in args.axes.split(",")) if args.axes else None
    if axes is not None and (len(axes) != len(shape) or len(set(axes)) != len(axes)
                             or not all(axes)):
        raise AutoshardError(f"--axes: one distinct name per axis of --mesh {args.mesh}",
                             got=repr(args.axes),
                             fix=f"e.g. --axes {','.join(('pp', 'dp', 'tp')[-len(shape):])}")
    if args.cluster not in PRESETS and not args.cluster.endswith(".json"):
        raise AutoshardError(f"--cluster: a preset ({', '.join(sorted(PRESETS))}) or a "
                             "profile .json", got=repr(args.cluster),
                             fix="e.g. --cluster h100, or the file autoshard calibrate wrote")
    return Mesh(shape, axes, cluster=args.cluster)


def plan_options(args) -> PlanOptions:
    """The CLI's flags as PlanOptions."""
    return PlanOptions(training=not args.inference, optimizer=args.optimizer,
                       # `is not None`: 0 must be refused, not read as "unset"
                       memory_budget=None if args.memory_gb is None else args.memory_gb * 2**30,
                       time_limit_s=args.time_limit, recompute=args.recompute,
                       bucket_mb=args.bucket_mb, zero=args.zero, offload=args.offload,
                       offload_overlap=args.offload_overlap,
                       context_parallel=args.context_parallel,
                       precision=args.precision, compile=args.compile,
                       accumulation_steps=args.accumulation_steps,
                       **pipeline_options(args))


def pipeline_options(args) -> dict:
    """--pipeline, --schedule, --microbatches as PlanOptions fields (a --gpus search takes
    the schedule and microbatches for the pipelines it tries)."""
    if args.pipeline is None and getattr(args, "gpus", None) is None:
        given = [f"--{k} {v}" for k, v in (("schedule", args.schedule),
                                           ("microbatches", args.microbatches)) if v != "auto"]
        if given:
            raise AutoshardError("--schedule and --microbatches with --pipeline (or --gpus)",
                                 got=f"{' '.join(given)} without a pipeline",
                                 fix="add --pipeline AXIS (or auto), or drop them")
        return {}
    return {"pipeline": args.pipeline, "schedule": args.schedule,
            "microbatches": args.microbatches}


def add_pipeline_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pipeline", default=None, metavar="AXIS",
                   help="pipeline the model's layers over this mesh axis (stages cut by the "
                        "cost model), or auto: plan without and over each axis, keep the "
                        "fastest")
    p.add_argument("--schedule", default="auto", choices=SCHEDULES,
                   help="pipeline schedule (default auto: the fastest, 1F1B on ties)")
    p.add_argument("--microbatches", type=_microbatches, default="auto",
                   help="microbatches per step on a pipeline (default auto: p, 2p or 4p)")


def cmd_plan(args) -> int:
    from autoshard import progress
    from autoshard.solver.planner import plan
    from autoshard.zoo.registry import load_model
    if args.gpus is None and args.gpus_per_node is not None:
        raise AutoshardError("--gpus-per-node only with --gpus", got="--mesh",
                             fix="set devices_per_node in a cluster profile, or use --gpus")
    mesh = make_mesh(args) if args.mesh is not None else None
    options = plan_options(args)
    if args.output:                       # before planning, not after minutes of it
        _check_writable(args.output)
        check_output(args.output, [*model_files(args.model), *(
            [("cluster profile", args.cluster)] if args.cluster.endswith(".json") else [])])
    t0 = time.perf_counter()
    # Progress on stderr (stdout keeps the summary or the JSON); --quiet silences it.
    with progress.enabled(not args.quiet):
        with progress.step(f"loading {args.model} on the meta device"):
            model, inputs = load_model(args.model, batch=args.batch, seq=args.seq,
                                       device="meta", task=args.task, context=args.context)
        if mesh is None:
            from autoshard.solver.meshes import search_mesh
            p = search_mesh(model, inputs, args.gpus, gpus_per_node=args.gpus_per_node,
                            cluster=args.cluster, options=options, model_name=args.model,
                            time_budget_s=args.search_budget)
        else:
            p = plan(model, inputs, mesh, options, model_name=args.model)
    took = time.perf_counter() - t0
    if args.json:
        return _plan_json(p, took, args.output)
    print(p.summary())
    t = p.timings
    print(f"  planned in {took:.2f} s (trace {t['trace_s']:.2f} s, build "
          f"{t['build_s']:.2f} s, solve {t['solve_s']:.2f} s)")
    if args.output:
        p.save(args.output)
        print(f"  wrote {args.output}")
    return 0


def _check_writable(output: str) -> None:
    """-o names a file in an existing directory this process may write to."""
    import errno
    import os
    folder = Path(output).parent
    code = errno.ENOENT if not folder.is_dir() else \
        errno.EACCES if not os.access(folder, os.W_OK) else 0
    if code:
        raise AutoshardError("a writable path for the plan (-o)",
                             got=f"{output}: {os.strerror(code)}",
                             fix="write into an existing directory you may write to")


def _plan_json(p, took: float, output: str | None) -> int:
    """``plan --json``: the plan written first (a script reads the path it names), then its
    summary as one JSON object on stdout."""
    import json

    from autoshard.tools.report import summary_json
    if output:
        p.save(output)
    print(json.dumps(summary_json(p, seconds=took, output=output), indent=1))
    return 0


def cmd_report(args) -> int:
    from autoshard.tools.report import write_report
    t0 = time.perf_counter()
    output = args.output or str(Path(args.plan).with_suffix(".html"))
    figures = write_report(args.plan, output)
    print(f"wrote {output} ({', '.join(figures)}) in {time.perf_counter() - t0:.2f} s")
    return 0


def cmd_show(args) -> int:
    from autoshard.plans import Plan
    p = Plan.load(args.plan)
    print(p.summary())
    if args.nodes:
        print(p.explain())
    return 0


def cmd_verify(args) -> int:
    from autoshard.plans import Plan
    from autoshard.tools.verify import verify
    mesh = make_mesh(args)
    plan = Plan.load(args.plan) if args.plan else None
    print(f"verifying {args.model} on {mesh} with {mesh.size} gloo ranks "
          f"({'plan file ' + args.plan if args.plan else args.baseline or 'autoshard plan'})")
    ok, text = verify(args.model, mesh, plan=plan, batch=args.batch, seq=args.seq,
                      baseline=args.baseline, tolerance=args.tolerance, task=args.task,
                      compile=args.compile, **pipeline_options(args))
    print(text)
    return 0 if ok else 1


def cmd_diff(args) -> int:
    import json

    from autoshard.tools.diff import diff_files, render
    if args.limit < 0:
        raise AutoshardError("--limit is a number of lines >= 0 (0: all)", got=str(args.limit),
                             fix="e.g. --limit 40, or --limit 0 for every line")
    d = diff_files(args.a, args.b, force=args.force)
    print(json.dumps(d.to_json(), indent=1) if args.json else render(d, limit=args.limit))
    return 0


def cmd_export(args) -> int:
    from autoshard.tools.export import export_file
    exp = export_file(args.plan, args.output, args.format)
    print(f"wrote {args.output}: {exp.describe()}")
    n = len(exp.not_expressible)
    print(f"  {len(exp.styles)} styles; {n} decision{'' if n == 1 else 's'} not expressible "
          f"(listed in its docstring)")
    return 0


def cmd_explain(args) -> int:
    from autoshard.tools.explain import explain_file
    print(explain_file(args.plan, node=args.node, param=args.param, top=args.top,
                       alternatives=args.alternatives, time_limit_s=args.time_limit,
                       model=args.model, cluster=args.cluster, task=args.task,
                       as_json=args.json))
    return 0


def cmd_calibrate(args) -> int:
    from autoshard.tools.calibrate import calibrate, summary, write_profile, writes_profile
    prof = calibrate(args.device, args.world, quick=args.quick)
    if not writes_profile():
        return 0                       # under torchrun every rank measured; rank 0 writes
    write_profile(prof, args.output)
    print(summary(prof))
    print(f"  wrote {args.output} (use it with --cluster {args.output})")
    return 0


def cmd_zoo(args) -> int:
    from autoshard.zoo.registry import ZOO
    for name, e in ZOO.items():
        print(f"{name:16s} {e.description}")
    return 0


CONTEXT_HELP = ("a zoo model's longest sequence (its config's context), raised for "
                "long-context runs: e.g. llama3-8b --context 131072 --seq 131072")
TASK_HELP = ("for a Hugging Face config: causal-lm | masked-lm | seq2seq | image-classification "
             "(default: from the config's architectures)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autoshard", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    # In the order `autoshard --help` lists them.
    for add in (_add_plan, _add_report_show_verify, _add_plan_tools, _add_machine):
        add(sub)
    return ap


def _add_plan(sub: Any) -> None:
    """``autoshard plan``: a model, a mesh (or --gpus) and every planning option."""
    p = sub.add_parser("plan", help="plan a model on a mesh and write the plan JSON")
    p.add_argument("model", help="zoo name (see `autoshard zoo`), path/to/file.py:factory, or a "
                                 "Hugging Face config.json (or a directory holding one)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--mesh", default=None, help="mesh shape, e.g. 8x8 (or --gpus)")
    p.add_argument("--axes", default=None, help="axis names, e.g. dp,tp")
    where.add_argument("--gpus", type=COUNT, default=None,
                   help="search the meshes of this many devices (pipeline x data x tensor, "
                        "tensor inside a node) instead of planning on --mesh")
    p.add_argument("--gpus-per-node", type=COUNT, default=None,
                   help="devices per node for --gpus (default: the cluster's)")
    p.add_argument("--search-budget", type=SECONDS, default=100.0,
                   help="seconds the --gpus search may spend before it stops trying meshes")
    p.add_argument("--cluster", default="h100", help="h100 | h200 | a100 | cpu | profile.json")
    p.add_argument("--batch", type=COUNT, default=None)
    p.add_argument("--seq", type=COUNT, default=None)
    p.add_argument("--context", type=COUNT, default=None, help=CONTEXT_HELP)
    p.add_argument("--inference", action="store_true", help="plan forward only")
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS,
                   help="optimizer state each parameter carries (default adam)")
    p.add_argument("--memory-gb", type=_number(float, "a positive number of GiB"), default=None,
                   help="memory budget per device (GiB)")
    p.add_argument("--time-limit", type=SECONDS, default=20.0, help="solver time limit (s)")
    p.add_argument("--recompute", default="auto", choices=RECOMPUTE,
                   help="activation checkpointing of repeated layers (default auto: where "
                        "memory requires it or it makes the step faster)")
    p.add_argument("--compile", action="store_true",
                   help="plan the rank program compiled by inductor (fused kernels, no host "
                        "dispatch per op); parallelize then compiles it")
    p.add_argument("--bucket-mb", type=_number(float, "a positive number of MiB"), default=25.0,
                   help="gradient all-reduce bucket size in MiB (default 25, as DDP)")
    p.add_argument("--accumulation-steps", type=COUNT, default=1, metavar="N",
                   help="micro-steps per optimizer step (gradient accumulation: N forward and "
                        "backward passes, one gradient sync and one update, docs/cost-model.md "
                        "§7.2; default 1)")
    p.add_argument("--zero", default="auto", choices=ZERO,
                   help="gradients and optimizer state sharded apart from the parameters "
                        "(default auto: the planner chooses ZeRO-2 or not per parameter)")
    p.add_argument("--context-parallel", default="auto", choices=CONTEXT_PARALLEL,
                   help="split attention's query sequence over a mesh axis (default auto: "
                        f"offered from {CONTEXT_PARALLEL_TOKENS} tokens; gather or ring: "
                        "only that variant)")
    p.add_argument("--offload", default="auto", choices=OFFLOAD,
                   help="optimizer: optimizer state and step on the host; parameters: the "
                        "parameters and gradients too, copied to the device at each use "
                        "(default auto: optimizer offload only when no plan fits without it, "
                        "parameter offload only when none fits with that alone)")
    p.add_argument("--offload-overlap", default="none", choices=OFFLOAD_OVERLAP,
                   help="how the host's optimizer step overlaps the device under offload "
                        "(docs/cost-model.md §9.1): none (default: after backward); backward "
                        "(each parameter steps as backward completes its gradient, the same "
                        "numbers, the gradient freed then: a loop that clips gradients plans "
                        "with none); delayed (ZeRO-Offload's one-step-delayed update: other "
                        "numbers)")
    p.add_argument("--precision", default="model", choices=PRECISIONS,
                   help="model: the model's own dtypes (a bf16 model trains mixed precision); "
                        "bf16-mixed: bf16 step, fp32 masters and optimizer state")
    add_pipeline_flags(p)
    p.add_argument("-o", "--output", default=None, help="write the plan here")
    p.add_argument("--task", default=None, help=TASK_HELP)
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (tracing, building, each solve)")
    p.add_argument("--json", action="store_true",
                   help="print the plan's summary as JSON (predicted step and its parts, "
                        "memory, techniques, timings, output path) instead of text")
    p.set_defaults(fn=cmd_plan)


def _add_report_show_verify(sub: Any) -> None:
    """The commands that show a plan or run it: report, show, verify."""
    r = sub.add_parser("report", help="write a plan as one HTML page of plots (step time, "
                                      "memory, placements per layer, pipeline schedule)")
    r.add_argument("plan", help="plan file")
    r.add_argument("-o", "--output", default=None,
                   help="write the page here (default: the plan's path with .html)")
    r.set_defaults(fn=cmd_report)
    s = sub.add_parser("show", help="print a plan file")
    s.add_argument("plan")
    s.add_argument("--nodes", action="store_true", help="also print every node's strategy")
    s.set_defaults(fn=cmd_show)
    v = sub.add_parser("verify", help="run a plan on gloo ranks here and compare with one device")
    v.add_argument("model", help="as for plan: zoo name, path/to/file.py:factory or config.json")
    v.add_argument("--task", default=None, help=TASK_HELP)
    v.add_argument("--mesh", required=True)
    v.add_argument("--axes", default=None)
    v.add_argument("--cluster", default="stress",
                   help="cost model to plan with (default stress: slow compute, so even tiny "
                        "models get sharded plans to prove)")
    v.add_argument("--batch", type=COUNT, default=None)
    v.add_argument("--seq", type=COUNT, default=None)
    v.add_argument("--plan", default=None, help="a plan file (default: plan on the spot)")
    v.add_argument("--baseline", default=None, help="force a hand-written plan: dp | megatron | megatron-dp")
    v.add_argument("--tolerance", type=_number(float, "a positive relative error"), default=None,
                   help="largest relative error of the loss and of each gradient (default: "
                        "1e-5 for an fp32 model; for a 16-bit one, measured from the single "
                        "device's own error in its dtype)")
    v.add_argument("--compile", action="store_true",
                   help="also run the rank program compiled by inductor and compare it with "
                        "the eager one (loss, gradients, run-time bytes)")
    add_pipeline_flags(v)
    v.set_defaults(fn=cmd_verify)


def _add_plan_tools(sub: Any) -> None:
    """The commands that read plan files: diff, export, explain."""
    d = sub.add_parser("diff", help="what two plans of one model place differently, and the "
                                    "predicted change of each part of the step (b - a)")
    d.add_argument("a", help="plan file")
    d.add_argument("b", help="plan file of the same model (same fingerprint)")
    d.add_argument("--force", action="store_true",
                   help="compare plans of different graphs anyway, by parameter and op name")
    d.add_argument("--json", action="store_true", help="print the diff as JSON")
    d.add_argument("--limit", type=_number(int, "a count of lines, 0 for all", zero=True),
                   default=40,
                   help="lines shown per section (default 40; 0: all)")
    d.set_defaults(fn=cmd_diff)
    x = sub.add_parser("export", help="write a plan as a torchtitan-style parallelize function "
                                      "(DTensor parallel styles and FSDP2)")
    x.add_argument("plan", help="plan file")
    x.add_argument("--format", default="dtensor",
                   help="dtensor: parallelize_module styles, fully_shard or replicate")
    x.add_argument("-o", "--output", required=True, help="write the Python file here")
    x.set_defaults(fn=cmd_export)
    x = sub.add_parser("explain", help="why a node or parameter is placed as it is (its next-best "
                                       "strategies re-solved, with the step and memory deltas) "
                                       "or the most expensive collectives, with source lines")
    x.add_argument("plan", help="plan file")
    what = x.add_mutually_exclusive_group(required=True)
    what.add_argument("--node", metavar="NAME", help="a graph node (`autoshard show --nodes`)")
    what.add_argument("--param", metavar="FQN",
                      help="a parameter, e.g. layers.0.attn.q_proj.weight")
    what.add_argument("--top", type=int, metavar="N", help="the N most expensive collectives")
    x.add_argument("--alternatives", type=int, default=3,
                   help="next-best strategies to re-solve with (default 3)")
    x.add_argument("--time-limit", type=float, default=3.0,
                   help="solver time limit per re-solve in seconds (default 3)")
    x.add_argument("--model", default=None,
                   help="the model to trace again (default: the plan's, at its input shapes)")
    x.add_argument("--task", default=None, help=TASK_HELP)
    x.add_argument("--cluster", default=None,
                   help="the cluster profile JSON, for a plan file written before plans "
                        "recorded their cluster's figures (a plan prices on its own)")
    x.add_argument("--json", action="store_true", help="print the explanation as JSON")
    x.set_defaults(fn=cmd_explain)


def _add_machine(sub: Any) -> None:
    """The commands about this machine and the built-in models: calibrate, zoo."""
    c = sub.add_parser("calibrate", help="measure this machine (matmul, memory, kernels, "
                                         "collectives) and write a cluster profile JSON")
    c.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    c.add_argument("--world", type=int, default=None,
                   help="ranks to measure collectives over (default 2; under torchrun its "
                        "WORLD_SIZE)")
    c.add_argument("--quick", action="store_true", help="small sizes, a few seconds (tests)")
    c.add_argument("-o", "--output", required=True, help="write the profile here")
    c.set_defaults(fn=cmd_calibrate)
    z = sub.add_parser("zoo", help="list the built-in models")
    z.set_defaults(fn=cmd_zoo)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.fn(args)
        sys.stdout.flush()             # inside: a reader gone by now is a broken pipe too
        return code
    except AutoshardError as e:
        # One line, as promised: a value quoted from a file may hold a line break.
        print("autoshard: error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`autoshard show plan.json | head`): nothing left to say to it.
        # Point stdout at /dev/null so that Python's own flush at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
