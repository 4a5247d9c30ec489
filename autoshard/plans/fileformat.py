"""The plan file: reading and checking every value of a plan's JSON (docs/plan-format.md).
Loading a plan parses JSON and nothing else: it never executes code."""
from __future__ import annotations

import json
import re
from typing import Any, TYPE_CHECKING

from autoshard.cluster import PRESETS, Cluster
from autoshard.schedules import SCHEDULES
from autoshard.errors import AutoshardError
from autoshard.ir import (CollectiveKind, Layer, OffloadLevel, Spec, StateMode, spec_fits,
                          spec_str)
from autoshard.options import PlanOptions
from autoshard.plangraph import graph_of
from autoshard.plans.fields import Field, Malformed
from autoshard.plans.prediction import Prediction, StagePrediction
from autoshard.plans.records import (CollectiveRecord, DIRECTIONS, FORMAT, HostTransfer, NodePlan,
                                     MODE_OFFLOAD, PHASES, ParamState, Pipeline, Stage,
                                     VERSION)

if TYPE_CHECKING:
    from autoshard.plans import Plan


def read_fields(text: str, source: str) -> dict[str, Any]:
    """The fields of a Plan from a plan file's text, each checked as it is read; a bad file is
    refused here with an AutoshardError naming ``source``, the value and the fix."""
    try:
        d = json.loads(text)
    # ValueError: bad JSON, or an integer of over 4300 digits; RecursionError: deep nesting.
    except (ValueError, RecursionError) as e:
        raise AutoshardError("a plan file is JSON written by Plan.save", got=f"{source}: {e}",
                             fix="re-create it with `autoshard plan ... -o plan.json`") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        got = d.get("format") if isinstance(d, dict) else type(d).__name__
        raise AutoshardError(f"a plan file with \"format\": \"{FORMAT}\"", got=f"{source}: {got!r}",
                             fix="pass a file written by Plan.save / `autoshard plan -o`")
    if d.get("version") != VERSION:
        raise AutoshardError(f"plan format version {VERSION}", got=f"{source}: {d.get('version')!r}",
                             fix="re-plan with this version of autoshard")
    try:
        return _fields(d)
    except Malformed as e:
        raise AutoshardError("a complete plan (mesh, nodes, params, collectives, predicted, "
                             f"solver), with {e.where} {e.expected}",
                             got=f"{source}: malformed, {e.got}",
                             fix=f"correct {e.where} as docs/plan-format.md describes it, "
                                 f"or re-create the plan with `autoshard plan -o`") from e


def _fields(d: dict) -> dict[str, Any]:
    """Every value is checked as it is read (docs/plan-format.md), so that a hand-edited or
    damaged file is refused here, naming the value, and not later inside summary(),
    planning or the runtime."""
    root = Field(d, "")
    shape, axes, cluster = _read_mesh(root.key("mesh"))
    nodes = _read_nodes(root.key("nodes"), len(shape))
    inputs = _read_inputs(root.key("inputs"), shape)
    params = {k: f.key("placements").spec(len(shape)) for k, f in root.key("params").items()}
    param_state = _read_param_state(root.key("params"), params, nodes, len(shape))
    layers = _read_layers(root.key("layers"), {n.name for n in nodes})
    return dict(mesh_shape=shape, mesh_axes=axes, cluster=cluster,
                fingerprint=root.key("fingerprint").text(),
                options=_read_options(root.key("options")),
                layers=layers,
                recompute=_read_recompute(root.key("recompute", {}), layers),
                nodes=nodes, params=params, param_state=param_state,
                # Optional: plans written before tied weights and warnings were recorded.
                tied=_read_tied(root.key("tied", {}), params, len(shape)),
                warnings=tuple(w.text() for w in root.key("warnings", []).entries()),
                inputs={k: spec for k, (spec, _) in inputs.items()},
                input_meta={k: meta for k, (_, meta) in inputs.items() if meta is not None},
                collectives=tuple(_read_collective(f) for f in root.key("collectives").entries()),
                # Optional: plans written before host transfers were listed have none.
                host_transfers=tuple(_read_host_transfer(f) for f in
                                     root.key("host_transfers", []).entries()),
                predicted=Prediction.read(root.key("predicted")),
                solver=_read_solver(root.key("solver")),
                model=root.key("model", "").text(),
                node_sigs={k: f.text() for k, f in root.key("node_signatures", {}).items()},
                pipeline=_read_pipeline(root.key("pipeline", None), axes, layers),
                joint_axes=_read_joint_axes(root.key("joint_axes", []), axes))


def _read_mesh(f: Field) -> tuple[tuple[int, ...], tuple[str, ...], Cluster | str]:
    shape = tuple(n.integer(least=1) for n in f.key("shape").entries(nonempty=True))
    axes_field = f.key("axes")
    axes = tuple(a.text(nonempty=True) for a in axes_field.entries())
    if len(axes) != len(shape) or len(set(axes)) != len(axes):
        axes_field.fail(f"one distinct name per dimension of the mesh shape {list(shape)}")
    return shape, axes, _read_cluster(f.key("cluster", ""))


def _read_cluster(f: Field) -> Cluster | str:
    """The cluster's figures (docs/plan-format.md). Files written before plans recorded them
    name it: a preset by its name is taken as that preset (what every tool priced such a plan
    on); another name is kept, and a tool that prices the plan asks for its profile."""
    if isinstance(f.value, str):
        return PRESETS.get(f.value, f.value)
    obj = f.obj()       # outside the try: its own Malformed is not a cluster's error
    try:
        return Cluster.from_json(obj)
    except AutoshardError as e:
        raise Malformed(f.where, f"the figures of a cluster: {e.expected}", e.got) from e


def _read_nodes(f: Field, ndim: int) -> tuple[NodePlan, ...]:
    nodes: dict[str, NodePlan] = {}
    for n in f.entries():
        name, kernel = n.key("name"), n.key("kernel", None)
        if name.text(nonempty=True) in nodes:
            name.fail("a node name used once")
        nodes[name.value] = NodePlan(
            name.value, n.key("op").text(),
            tuple(s.spec(ndim) for s in n.key("inputs").entries()),
            tuple(s.spec(ndim) for s in n.key("placements").entries()),
            # A placeholder's kernel is its state mode; an op's names its local variant.
            None if kernel.value is None else StateMode.of(kernel.text()) or kernel.value,
            _read_state_axes(n.key("state_axes", None), ndim))
    return tuple(nodes.values())


def _read_state_axes(f: Field, ndim: int) -> tuple[int, ...] | None:
    """A ZeRO parameter's state axes (absent: every replicated axis): distinct mesh axis
    positions, ascending."""
    if f.value is None:
        return None
    axes = tuple(a.integer() for a in f.entries(nonempty=True))
    if list(axes) != sorted(set(axes)) or axes[-1] >= ndim:
        f.fail(f"distinct mesh axis positions below {ndim}, ascending")
    return axes


def _read_inputs(f: Field, mesh_shape: tuple[int, ...]) -> dict[str, tuple[Spec, Any]]:
    """Each model input's (spec, (shape, dtype) or None), in positional order: the file's keys
    are sorted as text, input10 before input2, and example_inputs() needs them by position."""
    position = {k: _input_position(k, x) for k, x in f.items()}
    if sorted(position.values()) != list(range(len(position))):
        f.fail(f"inputs keyed input0 .. input{len(position) - 1}, one per model input")
    out: dict[str, tuple[Spec, Any]] = {}
    for k, x in sorted(f.items(), key=lambda kv: position[kv[0]]):
        placements = x.key("placements")
        spec = placements.spec(len(mesh_shape))
        if "shape" not in x.obj():
            out[k] = (spec, None)
            continue
        shape = tuple(d.integer(least=1) for d in x.key("shape").entries())
        if not spec_fits(shape, spec, mesh_shape):
            placements.fail(f"a spec that splits the input's shape {list(shape)} evenly")
        out[k] = (spec, (shape, x.key("dtype").text(nonempty=True)))
    return out


def _input_position(name: str, f: Field) -> int:
    # At most 9 digits: int() of thousands of digits is refused (and no model has that many).
    match = re.fullmatch(r"input([0-9]{1,9})", name)
    if match is None:
        f.fail(f"keyed input<i> (the input's position), not {name!r}")
    return int(match.group(1))


def _read_options(f: Field) -> PlanOptions:
    obj = f.obj()       # outside the try: its own Malformed is not the options' error
    try:
        return PlanOptions.from_json(obj)
    except AutoshardError as e:      # its fix speaks to code that builds options
        raise Malformed(f.where, f"valid: {e.expected}", e.got) from e
    except OverflowError as e:       # PlanOptions' finiteness check on an int beyond any float
        raise Malformed(f.where, "valid: numbers within float range", str(e)) from e


def _read_layers(f: Field, node_names: set[str]) -> tuple[Layer, ...]:
    layers = []
    for x in f.entries():
        members, name = x.key("nodes"), x.key("name")
        nodes = tuple(n.text() for n in members.entries(nonempty=True))
        if not set(nodes) <= node_names:
            members.fail("names of the plan's nodes")
        # As trace/layers.py names them; summary() splits the block's number off.
        if not re.fullmatch(r".+\.[0-9]+", name.text()):
            name.fail("a module path ending in the block's number, like 'layers.3'")
        layers.append(Layer(name.value, nodes, x.key("same_as").text()))
    names = {layer.name for layer in layers}
    for x, layer in zip(f.entries(), layers):
        if layer.same_as not in names:      # summary() groups identical layers by it
            x.key("same_as").fail("the name of one of the plan's layers")
    return tuple(layers)


def _read_tied(f: Field, params: dict[str, Spec], ndim: int) -> dict[str, tuple[Spec, ...]]:
    tied = {}
    for fqn, reads in f.items():
        if fqn not in params:      # summary() shows the layout it is stored in
            reads.fail("a tied weight among the plan's params")
        tied[fqn] = tuple(r.spec(ndim) for r in reads.entries())
    return tied


def _read_recompute(f: Field, layers: tuple[Layer, ...]) -> dict[str, str]:
    names = {layer.name for layer in layers}
    out = {}
    for name, policy in f.items():
        if name not in names:       # the runtime checkpoints the layer by this name
            policy.fail(f"a policy for one of the plan's layers, not {name!r}")
        if policy.text() not in ("selective", "full"):
            policy.fail('"selective" or "full"')
        out[name] = policy.text()
    return out


def _read_collective(f: Field) -> CollectiveRecord:
    # Kinds and axes are not held to today's lists: they describe a step and steer nothing
    # (verify compares them with the collectives that ran). A phase is one of PHASES: the
    # pipeline's figures and the tools' tables (diff, export) go by it.
    kind = f.key("kind").text()
    return CollectiveRecord(CollectiveKind.of(kind) or kind,
                            tuple(a.text() for a in f.key("axes").entries()),
                            f.key("bytes").integer(), f.key("phase").one_of(PHASES),
                            f.key("node").text(),
                            f.key("value", "").text(),
                            tuple(m.text(nonempty=True) for m in f.key("members", []).entries()),
                            f.key("stage", -1).integer(least=-1),
                            f.key("count", 1).integer(least=1))


def _read_pipeline(f: Field, axes: tuple[str, ...], layers: tuple[Layer, ...]
                   ) -> Pipeline | None:
    if f.value is None:
        return None
    axis = f.key("axis")
    if axis.text() not in axes:
        axis.fail(f"one of the mesh's axes {list(axes)}")
    schedule = f.key("schedule")
    if schedule.text() not in SCHEDULES:
        schedule.fail(f"one of {', '.join(map(json.dumps, SCHEDULES))}")
    names = {layer.name for layer in layers}
    stages = []
    for i, x in enumerate(f.key("stages").entries(nonempty=True)):
        if x.key("index").integer() != i:
            x.key("index").fail(f"the stage's position, {i}")
        members = x.key("layers")
        stage_layers = tuple(n.text() for n in members.entries())
        if not set(stage_layers) <= names:
            members.fail("names of the plan's layers")
        stages.append(Stage(i, stage_layers, StagePrediction.read(x.key("predicted"))))
    microbatches = f.key("microbatches")
    m = microbatches.integer(least=1)
    if schedule.value == "DualPipeV" and m < len(stages):
        microbatches.fail(f"at least {len(stages)} under DualPipeV (one per stage, as torch's "
                          f"ScheduleDualPipeV requires)")
    return Pipeline(axis.value, schedule.value, m, tuple(stages),
                    f.key("virtual_stages", 1).integer(least=1))


def _read_param_state(f: Field, params: dict[str, Spec], nodes: tuple[NodePlan, ...],
                      ndim: int) -> dict[str, ParamState]:
    """Each parameter's gradient and optimizer placements (absent in plans made before they
    were recorded: both follow the parameter). The mode is the parameter's placeholder's kernel
    (docs/plan-format.md); the placements must agree with it."""
    out = {}
    for fqn, pf in f.items():
        spec = params[fqn]
        grad = pf.key("grad_placements", spec_str(spec)).spec(ndim)
        opt = pf.key("optimizer_placements", spec_str(spec)).spec(ndim)
        off = pf.key("offload", False)
        # false, "optimizer" or "parameters"; true in plans written before parameter offload
        # (the optimizer's).
        what = {False: OffloadLevel.NONE, True: OffloadLevel.OPTIMIZER,
                OffloadLevel.OPTIMIZER: OffloadLevel.OPTIMIZER,
                OffloadLevel.PARAMETERS: OffloadLevel.PARAMETERS}.get(off.value) \
            if isinstance(off.value, (bool, str)) else None
        if what is None:
            off.fail('false, "optimizer" or "parameters"')
        if grad == spec and opt == spec and what == OffloadLevel.NONE:
            continue
        mode = next((m for m, w in MODE_OFFLOAD.items() if w == what), None) \
            or (StateMode.ZERO2 if grad != spec else StateMode.ZERO1)
        if what == OffloadLevel.NONE and grad not in (spec, opt):
            pf.key("grad_placements").fail(f"the parameter's placements or its "
                                           f"optimizer_placements {spec_str(opt)}")
        out[fqn] = ParamState(mode, grad, opt, what)
    return out


def _read_host_transfer(f: Field) -> HostTransfer:
    return HostTransfer(f.key("direction").one_of(DIRECTIONS), f.key("bytes").integer(),
                        f.key("phase").one_of(PHASES), f.key("node").text(), f.key("value").text(),
                        f.key("count", 1).integer(least=1))


def _read_joint_axes(f: Field, axes: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    """Groups of two or more of the mesh's axes, in mesh order, no axis in two groups (absent
    in plans whose collectives all run over one axis)."""
    out: list[tuple[str, ...]] = []
    for g in f.entries():
        names = tuple(a.text() for a in g.entries())
        if len(names) < 2 or any(a not in axes for a in names) or \
                list(names) != sorted(set(names), key=axes.index) or \
                any(a in h for h in out for a in names):
            g.fail(f"a group of two or more of the mesh axes {list(axes)}, in mesh order, "
                   f"in no other group")
        out.append(names)
    return tuple(out)


def _read_solver(f: Field) -> dict[str, Any]:
    """The solver's record: the fields summary() prints are checked, the rest kept as they are."""
    f.key("status").text()
    f.key("variables").integer()
    f.key("gap").number()
    f.key("decisions", 0).integer()
    return dict(f.obj())

def check_layouts(plan: Plan, source: str) -> None:
    """Every placement against its tensor (docs/plan-format.md "Which placements run"): each
    spec of a node's outputs and inputs, of a parameter and its gradient and optimizer state, of
    a tied weight's reads, fits the tensor's shape (its node signature) on the mesh: every S(d)
    a dim the tensor has, split evenly. The nodes are what runs: ``params`` repeats each
    parameter's placeholder spec, and its state mode is the placeholder's kernel; a file where
    the two differ (one edited, not the other) is refused, naming both."""
    if not plan.node_sigs:        # older files: nothing to check the specs against
        return
    g = graph_of(plan)
    index = {n.name: i for i, n in enumerate(plan.nodes)}

    def fits(where: str, spec: Spec, shape: tuple[int, ...] | None) -> None:
        if shape is not None and not spec_fits(shape, spec, plan.mesh_shape):
            raise AutoshardError(
                "every placement fits its tensor: each S(d) a dim the tensor has, split evenly "
                "by the mesh axes that shard it",
                got=f"{source}: {where} = {spec_str(spec)!r} for a tensor of shape {list(shape)} "
                    f"on mesh {list(plan.mesh_shape)}",
                fix="shard only dims the tensor has, into equal parts (or re-create the plan "
                    "with `autoshard plan`)")

    for n in plan.nodes:
        at = f"nodes[{index[n.name]}] ({n.name})"
        for k, spec in enumerate(n.outputs):
            fits(f"{at}.placements[{k}]", spec, g.shapes.get((n.name, k)))
        for k, (spec, value) in enumerate(zip(n.inputs, g.reads.get(n.name, ()))):
            fits(f"{at}.inputs[{k}]", spec, g.shapes.get(value))
    for fqn, name in g.param_node.items():
        node, shape = g.nodes[name], g.shapes.get((name, 0))
        st = plan.param_state.get(fqn)
        fits(f"params[{fqn!r}].placements", plan.params[fqn], shape)
        own = node.outputs[0] if node.outputs else ()
        if own != plan.params[fqn] or node.kernel != (st.mode if st else None):
            raise AutoshardError(
                "a parameter's layout in one place: its placeholder node's spec and kernel, "
                "which run, repeated in params",
                got=f"{source}: params[{fqn!r}] has {spec_str(plan.params[fqn])!r}"
                    f"{' (' + st.mode + ')' if st else ''}, its node {name} "
                    f"{spec_str(own) if own else 'with no placement'!r}"
                    f"{' (' + node.kernel + ')' if node.kernel else ''}",
                fix="edit both alike (the node's spec is the one that runs; its readers' "
                    "inputs reshard from it), or re-create the plan with `autoshard plan`")
        for what, spec in (("grad_placements", st.grad if st else None),
                           ("optimizer_placements", st.optimizer if st else None)):
            if spec is not None:
                fits(f"params[{fqn!r}].{what}", spec, shape)
        for k, spec in enumerate(plan.tied.get(fqn, ())):
            fits(f"tied[{fqn!r}][{k}]", spec, shape)
