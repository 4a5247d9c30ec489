"""The data axes of the export: FSDP2's fully_shard or replicate over the axes that are not
tensor-parallel, the inputs' batch split, the decisions no API expresses, and the plan's
ledger matched against the collectives the program runs."""
from __future__ import annotations

from collections import Counter

from autoshard.ir import CollectiveKind, Phase, Shard, StateMode
from autoshard.plangraph import Graph
from autoshard.tools.export.graph import (Expected, Export, Module, STEP_PHASES, axes_text,
                                          param_reads)


def map_data_axes(exp: Export, g: Graph, mods: dict[str, Module]) -> None:
    """fully_shard when the plan stores some parameter sharded over a data axis (ZeRO-3), one
    group per repeated layer holding such a parameter and the root for the rest; else replicate.
    Several data axes are flattened into one data mesh."""
    plan = exp.plan
    axes = [plan.mesh_axes.index(a) for a in exp.data_axes]
    if not axes:
        return
    label = exp.data_axes
    zero3 = {f for f, spec in plan.params.items() if any(isinstance(spec[a], Shard) for a in axes)}
    if not zero3:
        exp.data_parallel = "replicate"
        exp.expected.append(Expected(Phase.BACKWARD, CollectiveKind.ALL_REDUCE, label, 1,
                                     "replicate: the gradients all-reduced"))
        return
    exp.data_parallel = "fully_shard"
    exp.fsdp_groups = [layer.name for layer in plan.layers
                       if any(f.startswith(layer.name + ".") for f in zero3)]
    placeholders = {g.param_node.get(f) for f in zero3}
    exp.reshard_after_forward = any(
        c.kind == CollectiveKind.ALL_GATHER and c.phase in (Phase.BACKWARD, Phase.RECOMPUTE)
        and c.value in placeholders for c in plan.collectives)
    in_groups = [f for f in plan.params if any(f.startswith(p + ".") for p in exp.fsdp_groups)]
    n = len(exp.fsdp_groups) + (len(in_groups) < len(plan.params))
    exp.expected += [Expected(Phase.FORWARD, CollectiveKind.ALL_GATHER, label, n,
                              "fully_shard: parameters gathered, one collective per group"),
                     Expected(Phase.BACKWARD, CollectiveKind.REDUCE_SCATTER, label, n,
                              "fully_shard: gradients reduce-scattered, one collective per group")]
    if exp.reshard_after_forward and exp.fsdp_groups:
        exp.expected.append(Expected(Phase.BACKWARD, CollectiveKind.ALL_GATHER, label,
                                     len(exp.fsdp_groups),
                                     "fully_shard: layer parameters gathered again"))
    replicated = sorted(f for f in plan.params if f not in zero3)
    if replicated:
        exp.not_expressible.append(
            f"{len(replicated)} parameters the plan keeps replicated over {axes_text(label)} "
            f"(e.g. {replicated[0]}) are sharded by fully_shard like the others (its groups "
            f"shard every parameter they hold)")
    dims = sorted({p.dim for f in zero3 for a in axes
                   if isinstance(p := plan.params[f][a], Shard) and p.dim != 0})
    if dims:
        exp.not_expressible.append(f"ZeRO-3 shards on dims {dims} in the plan: fully_shard "
                                   f"shards dim 0")


def map_inputs(exp: Export) -> None:
    """The batch (dim 0) of every input split over the data axes over which the plan splits
    some input: each data-parallel rank runs the model on its own samples, inputs and labels
    alike (the plan may keep labels whole and slice them in its loss)."""
    plan = exp.plan
    metas = [plan.input_meta.get(k) for k in plan.inputs]
    split: list[str] = []
    used = 1
    for a in exp.data_axes:
        i = plan.mesh_axes.index(a)
        if not any(isinstance(s[i], Shard) for s in plan.inputs.values()):
            continue
        n = plan.mesh_shape[i]
        if all(m is not None and m[0] and m[0][0] % (used * n) == 0 for m in metas):
            split.append(a)
            used *= n
        else:
            exp.not_expressible.append(f"the plan splits inputs over {a!r}, but not every "
                                       f"input's batch divides; they are replicated there")
    for pos, (k, spec) in enumerate(plan.inputs.items()):
        exp.input_split[pos] = tuple(split)
        other = sorted({p.dim for a, p in zip(plan.mesh_axes, spec)
                        if a in split and isinstance(p, Shard) and p.dim != 0})
        if other:
            exp.not_expressible.append(f"{k} is split on dim {other[0]} in the plan; here "
                                       f"on its batch (dim 0)")
        if exp.tensor_axis is not None:
            p = spec[plan.mesh_axes.index(exp.tensor_axis)]
            if isinstance(p, Shard):
                exp.not_expressible.append(f"{k} is split over {exp.tensor_axis!r} in the plan; "
                                           f"the styles take it replicated there")


def other_decisions(exp: Export) -> None:
    """Plan decisions with no counterpart in parallelize_module/fully_shard."""
    plan, notes = exp.plan, exp.not_expressible
    modes = Counter(st.mode for st in plan.param_state.values())
    names = {StateMode.ZERO1: "ZeRO-1 (optimizer state sharded)",
             StateMode.ZERO2: "ZeRO-2 (gradients and optimizer state sharded)",
             StateMode.OFFLOAD: "optimizer state and step on the host (offload)",
             StateMode.OFFLOAD_PARAMS: "parameters, gradients and optimizer state on the host "
                               "(parameter offload; fully_shard's offload_policy="
                               "CPUOffloadPolicy() is its counterpart)"}
    for mode, n in sorted(modes.items()):
        notes.append(f"{names[mode]} for {n} parameters: here gradients and optimizer state "
                     f"follow the parameter")
    if any(c.members for c in plan.collectives):
        notes.append(f"gradient buckets (bucket_mb {plan.options.bucket_mb:g}): "
                     + ("fully_shard" if exp.data_parallel == "fully_shard" else "replicate"
                        if exp.data_parallel else "the styles")
                     + " group gradients by module, not by the plan's buckets")
    by_policy = Counter(plan.recompute.values())
    for policy, n in sorted(by_policy.items()):
        notes.append(f"activation checkpointing ({policy}) of {n} layers (e.g. "
                     f"{next(k for k, v in plan.recompute.items() if v == policy)}): not "
                     f"applied; wrap those layers with torch.utils.checkpoint to match")
    if plan.pipeline is not None:
        pl = plan.pipeline
        notes.append(f"pipeline over {pl.axis!r} ({pl.schedule}, {len(pl.stages)} stages, "
                     f"{pl.microbatches} microbatches): needs torch.distributed.pipelining; "
                     f"here the whole model runs on every rank of {pl.axis!r}, as data "
                     f"parallelism")
    if plan.options.precision != "model":
        notes.append(f"precision {plan.options.precision}: not applied (for fully_shard, "
                     f"mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                     f"reduce_dtype=torch.float32) expresses it)")
    if not plan.training:
        notes.append("a forward-only plan: the data-parallel wrapper is applied all the same")


# ----------------------------------------------------------------------------- the ledger

def match_ledger(exp: Export, g: Graph, boundaries: dict[str, list[Expected]]) -> None:
    """Which of the plan's collectives the program runs as planned: at each tensor-parallel
    boundary, the plan's collectives on that value over the tensor axis and the style's must be
    the same kinds in the same phases. Everything else of the plan is listed by why the
    program does not run it."""
    plan = exp.plan
    matched: set[int] = set()
    for value, es in boundaries.items():
        ids = [i for i, c in enumerate(plan.collectives)
               if c.value == value and c.axes == es[0].axes and c.phase in STEP_PHASES]
        want = Counter((STEP_PHASES[plan.collectives[i].phase], plan.collectives[i].kind)
                       for i in ids for _ in range(plan.collectives[i].count))
        have = Counter((e.phase, e.kind) for e in es for _ in range(e.count))
        if want == have:
            matched.update(ids)
            keep = {id(e) for e in es}
            exp.expected = [Expected(e.phase, e.kind, e.axes, e.count, e.source, True, e.value)
                            if id(e) in keep else e for e in exp.expected]
        else:
            exp.not_expressible.append(
                f"collectives at {value}: the plan runs {_counter_text(want) or 'none'}, the "
                f"styles {_counter_text(have)}")
    rows: Counter = Counter()
    params = set(g.param_node.values())
    for i, c in enumerate(plan.collectives):
        if i not in matched:
            rows[(c.phase, c.kind, c.axes, _why_not_run(c, params))] += c.count
    exp.unexpressed = [(ph, k, ax, n, why) for (ph, k, ax, why), n in sorted(rows.items())]


def _why_not_run(c, params: set[str]) -> str:
    if c.phase == Phase.OPTIMIZER:
        return "ZeRO-1/2 or offload: parameters gathered after the optimizer step"
    if c.phase == Phase.RECOMPUTE:
        return "activation checkpointing: forward collectives run again"
    if c.phase == Phase.PIPELINE:
        return "pipeline sends between stages"
    if c.members:
        return "gradient buckets"
    if c.value in params:
        return ("parameter gradients" if c.phase == Phase.GRAD_SYNC else
                "parameters gathered for the ops that read them")
    if c.node == "output":
        return "the loss reduced over the ranks (here each rank keeps its own)"
    return "activation reshards the styles do not make (each rank computes these values whole)"


def _counter_text(c: Counter) -> str:
    return ", ".join(f"{ph} {k} x{n}" for (ph, k), n in sorted(c.items()))


def module_order(g: Graph, mods: dict[str, Module]) -> dict[str, int]:
    """Each module's position: where the graph first reads one of its parameters."""
    pos = {name: i for i, name in enumerate(g.nodes)}
    out = {}
    for m in mods.values():
        reads = [pos[n] for f in m.params.values() for n, _ in param_reads(g, f)]
        out[m.path] = min(reads, default=len(pos))
    return out


def layer_loops(exp: Export) -> dict[str, list[str]]:
    """Repeated layers whose styles are the same up to their path: written as one loop, as
    torchtitan writes its per-block plan. Keyed by the first layer of each loop."""
    loops: dict[str, list[str]] = {}
    runs: dict[str, list[str]] = {}
    for layer in exp.plan.layers:
        runs.setdefault(layer.same_as, []).append(layer.name)
    for first, names in runs.items():
        shapes = {_relative(exp, n) for n in names}
        if len(names) > 1 and len(shapes) == 1 and next(iter(shapes)):
            loops[names[0]] = names
    return loops


def _relative(exp: Export, layer: str) -> tuple:
    pre = layer + "."
    styles = tuple((s.path[len(pre):], s.code()) for s in exp.styles if s.path.startswith(pre))
    parents = tuple((p[len(pre):], lay) for p, lay in exp.parents.items() if p.startswith(pre))
    return styles + parents

