"""``autoshard export --format dtensor``: a plan as a torchtitan-style parallelize function.

Structural tests read the generated file for known plans (which style each module gets, what is
listed as not expressible) and import it standalone. The gloo tests (tier 2 of docs/design.md)
apply it with DTensor to HF Llama tiny on a 2 x 2 mesh of 4 ranks and compare, in one rank
program, its loss and gradients with autoshard's runtime of the same plan and with the
single-device model (fp32, 1e-5), and count its collectives with CommDebugMode against the plan's
ledger.

Where the collectives differ from the plan's, the difference is the exporter's own list (the
generated docstring shows it): tensor-parallel boundaries whose collectives are the plan's (an
all-gather into the column-parallel Linears, a reduce-scatter out of the row-parallel ones, and
their backward duals) are counted as planned; the rest (sequence-parallel norm weights
all-reduced one by one where the plan buckets them, FSDP's per-group collectives where the plan
gathers per parameter, small activation reshards the plan makes and the styles do not) is
declared, and the test holds the run to exactly that declaration.
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import importlib.util
import json
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.tools.cli import main
from autoshard.errors import AutoshardError
from autoshard.tools.export import FORMATS, export_plan
from autoshard.tools.export.render import source as render_source
from autoshard.tools.verify import VerifySpec, build, plan_for, rel_err, summarize, verify_rank
from dist import world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
MODEL = "hf-llama-tiny"
TOL = 1e-5

world4 = world_fixture(4, timeout_s=300)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """Two plans of HF Llama tiny on 2 x 2 that the styles express in different ways:
    megatron-dp (tensor parallel over "tp" with the batch dim sharded between its Linears, data
    parallel over "dp") and the FSDP stored layout (the planner reads the weights sharded over
    "dp" with the sequence sharded between Linears, and keeps them ZeRO-3 over "tp")."""
    from autoshard.ir import Partial, Shard, Strategy
    from autoshard.solver.alternatives import plan_stored
    from autoshard.solver.baselines import baseline_plan, zero3_layouts
    from autoshard.trace.export import trace
    mesh = Mesh((2, 2), cluster=CLUSTER)
    model, inputs = build(MODEL, None, None, 0)
    traced = trace(model, inputs)          # as verify traces it (plan_for)
    # The FSDP storage, with the out-projection read row-parallel over "dp" (a Partial output
    # over "dp", the batch over "tp"): on a 2-way axis its reduce-scatter costs exactly what
    # the column-parallel read's all-gather and all-to-all do, and the solver may return either.
    ph = next(p.name for p in traced.placeholders
              if p.fqn == "model.model.layers.0.self_attn.o_proj.weight")
    o_proj = next(n.name for n in traced.graph.nodes
                  if n.op == "call_function" and ph in {a.name for a in n.all_input_nodes})
    stored = zero3_layouts(traced, mesh) | {o_proj: Strategy((), ((Partial(), Shard(0)),))}
    return {"megatron-dp": baseline_plan(traced, mesh, "megatron-dp", model_name=MODEL),
            "fsdp": plan_stored(traced, mesh, stored, model_name=MODEL, label="fsdp",
                                zero="none", offload="none")}


def _load(source: str, tmp_path: Path, name: str):
    """The generated file, imported as a module of its own (as a user would import it)."""
    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"exported_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------- structure

def _imports(source: str) -> set[str]:
    mods = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            mods |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module.split(".")[0])
    return mods


@pytest.mark.slow
def test_megatron_dp_maps_to_column_row_and_sequence_parallel(plans, tmp_path):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel,
                                                   SequenceParallel)
    exp = export_plan(plans["megatron-dp"])
    assert (exp.tensor_axis, exp.data_axes, exp.stream) == ("tp", ("dp",), 0)
    assert exp.data_parallel == "replicate" and exp.input_split == {0: ("dp",), 1: ("dp",)}
    source = render_source(exp)
    assert _imports(source) <= {"__future__", "contextlib", "inspect", "torch"}
    mod = _load(source, tmp_path, "megatron_dp")
    assert (mod.MESH_SHAPE, mod.MESH_AXES, mod.TENSOR_AXIS) == ((2, 2), ("dp", "tp"), "tp")
    tp = mod.tensor_parallel_plan()
    for i in range(2):
        layer = f"model.model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            assert type(tp[f"{layer}.{name}"]) is ColwiseParallel, name
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            style = tp[f"{layer}.{name}"]
            assert type(style) is RowwiseParallel and style.output_layouts == (Shard(0),)
            assert style.use_local_output is False      # the stream stays DTensor
        for name in ("input_layernorm", "post_attention_layernorm"):
            style = tp[f"{layer}.{name}"]
            assert type(style) is SequenceParallel and style.sequence_sharding == (Shard(0),)
        for name in ("self_attn", "mlp"):              # one all-gather for q, k, v (gate, up)
            style = tp[f"{layer}.{name}"]
            assert type(style) is mod.PrepareFirstInput
            assert (style.input_layouts, style.desired_input_layouts) == ((Shard(0),),
                                                                          (Replicate(),))
    assert type(tp["model.model.norm"]) is SequenceParallel
    # Replicated over "tp" in the plan: the embedding's output joins the sharded stream, the
    # head's input is gathered (the plan runs both on the split batch: listed).
    assert type(tp["model.model.embed_tokens"]) is PrepareModuleOutput
    assert type(tp["model.lm_head"]) is PrepareModuleInput
    assert len(tp) == 3 + 2 * 11
    doc = mod.__doc__
    assert "plan of hf-llama-tiny on mesh 2x2 ('dp', 'tp')" in doc
    assert plans["megatron-dp"].fingerprint in doc
    assert "model.lm_head: the plan runs it on activations split over 'tp'" in doc
    assert "gradient buckets" in doc
    # The Linears' boundary collectives are all the plan's: per layer an all-gather in and a
    # reduce-scatter out of attention and MLP, and their duals in backward.
    planned = exp.expected_counts(planned_only=True)
    assert planned == Counter({("forward", "all_gather", ("tp",)): 4,
                               ("forward", "reduce_scatter", ("tp",)): 4,
                               ("backward", "reduce_scatter", ("tp",)): 4,
                               ("backward", "all_gather", ("tp",)): 4})


def test_fsdp_layout_maps_to_sequence_parallel_and_fully_shard(plans, tmp_path):
    """The planner chose "dp" as the tensor axis of this plan and "tp" as its ZeRO-3 axis: the
    export follows the plan's reads, not the axis names."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    exp = export_plan(plans["fsdp"])
    assert (exp.tensor_axis, exp.data_axes, exp.stream) == ("dp", ("tp",), 1)
    assert exp.data_parallel == "fully_shard"
    assert exp.fsdp_groups == ["model.model.layers.0", "model.model.layers.1"]
    assert exp.reshard_after_forward is False     # the plan gathers each weight once
    mod = _load(render_source(exp), tmp_path, "fsdp")
    tp = mod.tensor_parallel_plan()
    embed, head = tp["model.model.embed_tokens"], tp["model.lm_head"]
    assert type(embed) is RowwiseParallel and embed.output_layouts == (Shard(1),)
    assert type(head) is ColwiseParallel and head.input_layouts == (Shard(1),)
    assert head.output_layouts == (Replicate(),)
    assert mod.FSDP_GROUPS == ("model.model.layers.0", "model.model.layers.1")
    assert "fully_shard(model, mesh=data, reshard_after_forward=False)" in render_source(exp)


def test_mixed_activation_layouts_fall_back_to_replicated_activations(tmp_path):
    """fsdp-tp stores Megatron over "tp" and FSDP over "dp", but the planner reads the weights
    sharded over "dp" with the hidden dim sharded between Linears: no one layout for
    SequenceParallel, and the out-projections' outputs join the residual whole. The export
    says so and gathers them."""
    from autoshard.solver.baselines import stored_plan
    from autoshard.trace.export import trace
    from torch.distributed.tensor import Replicate
    model, inputs = build(MODEL, None, None, 0)
    plan = stored_plan(trace(model, inputs), Mesh((2, 2), cluster=CLUSTER), "fsdp-tp")
    exp = export_plan(plan)
    assert exp.tensor_axis == "dp" and exp.stream is None
    notes = "\n".join(exp.not_expressible)
    assert "sequence parallelism: the plan runs norm-like modules" in notes
    assert "self_attn.o_proj: its output is gathered over 'dp'" in notes
    tp = _load(render_source(exp), tmp_path, "fsdp_tp").tensor_parallel_plan()
    assert tp["model.model.layers.0.self_attn.o_proj"].output_layouts == (Replicate(),)


def test_a_strided_fused_projection_is_not_expressible():
    """A fused QKV Linear read strided (each rank its part of Q, K and V): no parallel style
    cuts a weight group by group, so the export replicates it and says so; the out-projection
    stays row-parallel."""
    factory = f"{Path(__file__).parent / 'data' / 'fused_qkv_model.py'}:make"
    exp = export_plan(plan_for(factory, Mesh((4,), cluster=CLUSTER), baseline="megatron"))
    notes = "\n".join(exp.not_expressible)
    assert "blocks.0.qkv: weight read strided (S(0/3)" in notes
    assert "blocks.0.gate_up: weight read strided (S(0/2)" in notes
    styles = {st.path: st.cls for st in exp.styles}
    assert "blocks.0.qkv" not in styles and styles["blocks.0.out"] == "RowwiseParallel"
    compile(render_source(exp), "parallelize.py", "exec")


def test_plain_data_parallel_plan_has_no_tensor_axis():
    """Every weight replicated: data parallel over both axes flattened, the batch split over
    the axes the plan splits it on."""
    plan = plan_for("mlp-tiny", Mesh((2, 2), cluster=CLUSTER), baseline="dp")
    exp = export_plan(plan)
    assert exp.tensor_axis is None and exp.styles == []
    assert exp.data_axes == ("dp", "tp") and exp.data_parallel == "replicate"
    assert '_flatten("_".join(DATA_AXES))' in render_source(exp)
    compile(render_source(exp), "parallelize.py", "exec")


# ----------------------------------------------------------------------------- errors and CLI

def test_cli_writes_an_importable_file(plans, tmp_path, capsys):
    path = tmp_path / "plan.json"
    plans["megatron-dp"].save(path)
    out = tmp_path / "parallelize.py"
    assert main(["export", str(path), "--format", "dtensor", "-o", str(out)]) == 0
    assert "parallelize_module" in out.read_text()
    said = capsys.readouterr().out
    assert "tensor parallel over 'tp'" in said and str(out) in said
    mod = _load(out.read_text(), tmp_path, "from_cli")
    assert callable(mod.parallelize) and callable(mod.shard_inputs)


@pytest.mark.parametrize("case", ["format", "missing", "not-json", "no-signatures", "output"])
def test_errors_are_one_line(plans, tmp_path, capsys, case):
    path = tmp_path / "plan.json"
    plans["megatron-dp"].save(path)
    args = ["export", str(path), "-o", str(tmp_path / "p.py")]
    if case == "format":
        args += ["--format", "jax"]
    elif case == "missing":
        args[1] = str(tmp_path / "nope.json")
    elif case == "not-json":
        path.write_text("{ not json")
    elif case == "no-signatures":
        d = plans["megatron-dp"].to_json()
        d["node_signatures"] = {}
        path.write_text(json.dumps(d))
    elif case == "output":
        args[3] = str(tmp_path / "no" / "such" / "dir" / "p.py")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: ") and err.count("\n") == 1, err
    assert {"format": "dtensor", "missing": "readable plan file", "not-json": "JSON",
            "no-signatures": "node signatures", "output": "writable"}[case] in err


def test_unknown_format_from_python(plans):
    with pytest.raises(AutoshardError, match="export format among dtensor"):
        export_plan(plans["megatron-dp"], "onnx")
    assert FORMATS == ("dtensor",)


# ----------------------------------------------------------------------------- on gloo ranks

def _kind(name: str) -> str:
    for key, kind in (("all_gather", "all_gather"), ("allgather", "all_gather"),
                      ("reduce_scatter", "reduce_scatter"), ("all_reduce", "all_reduce"),
                      ("allreduce", "all_reduce"), ("all_to_all", "all_to_all"),
                      ("alltoall", "all_to_all")):
        if key in name:
            return kind
    return name


def _recorder(axes_of: dict[frozenset, tuple[str, ...]]):
    """CommDebugMode that also records each collective's mesh axes and phase: it counts as
    CommDebugMode does (the same ops), keyed by (phase, kind, axes). A collective's axes are
    found by the ranks of its process group (``axes_of``: ranks -> axes), not by the group's
    name: a mesh sliced again may hand out a cached group of another name."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.debug._comm_mode import c10d_collective_ops

    def ranks(a) -> frozenset | None:
        if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
            return frozenset(dist.get_process_group_ranks(dist.ProcessGroup.unbox(a)))
        if isinstance(a, str):
            try:
                return frozenset(dist.get_process_group_ranks(_resolve_process_group(a)))
            except (ValueError, RuntimeError, KeyError):
                return None                 # a string that names no group ("sum")
        return None

    class AxisCommMode(CommDebugMode):
        def __init__(self) -> None:
            super().__init__()
            self.records: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = func._overloadpacket
            if packet in self.comm_registry or packet in c10d_collective_ops:
                found = [r for a in (*args, *(kwargs or {}).values())
                         if (r := ranks(a)) is not None]
                axes = axes_of.get(found[0]) if found else None
                phase = "backward" if self.advanced_module_tracker.is_bw else "forward"
                self.records[(phase, _kind(str(packet)), axes)] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    return AxisCommMode()


def _run_exported(spec: VerifySpec, source: str, workdir: str) -> dict:
    """On every rank: the single-device model, autoshard's runtime of the plan (as verify runs
    it), and the exported file applied with DTensor to a third copy of the same model; one
    training step each. Returns the losses, every gradient's error against both, and the
    exported program's collectives."""
    import torch.distributed as dist
    from autoshard.codegen.parallelize import parallelize as autoshard_parallelize
    from autoshard.loss import as_loss_module
    from torch.distributed.tensor import DTensor

    model, inputs = build(spec.model, spec.batch, spec.seq, spec.seed)
    exported_model, runtime_model = copy.deepcopy(model), copy.deepcopy(model)
    ref = as_loss_module(model)
    ref_loss = ref(*inputs)
    ref_loss.backward()
    ref_grads = {n.removeprefix("model."): p.grad for n, p in ref.named_parameters()}

    plan = Plan.loads(spec.plan_json)
    pm = autoshard_parallelize(runtime_model, Mesh(spec.mesh_shape, spec.axes), plan=plan,
                               example_inputs=inputs)
    runtime_loss = float(pm.step(*pm.shard_inputs(*inputs)))
    runtime_grads = pm.full_grads()

    mod = _load(source, Path(workdir), f"exported_rank{dist.get_rank()}")
    mesh = mod.make_mesh("cpu")
    mod.parallelize(exported_model, mesh)
    data = mod._data_mesh(mesh) if mod.DATA_AXES else None
    axes_of = {frozenset(dist.get_process_group_ranks(mesh.get_group(a))): (a,)
               for a in mesh.mesh_dim_names}
    if data is not None:
        axes_of[frozenset(dist.get_process_group_ranks(data.get_group()))] = tuple(mod.DATA_AXES)
    comm = _recorder(axes_of)
    local = mod.shard_inputs(mesh, *inputs)
    with warnings.catch_warnings():
        # CommDebugMode's module tracker warns about Hugging Face's output dataclasses.
        warnings.simplefilter("ignore")
        with comm, mod.loss_context():
            loss = exported_model(*local)
            loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss.detach()
    if data is not None:             # each data-parallel rank's loss is its own samples' mean
        dist.all_reduce(loss, group=data.get_group())
        loss = loss / data.size()
    grads = {}
    for name, p in exported_model.named_parameters():
        g = p.grad
        grads[name] = g.full_tensor() if isinstance(g, DTensor) else g
    return {
        "loss": float(loss), "runtime_loss": runtime_loss, "ref_loss": float(ref_loss.detach()),
        "vs_runtime": {n: rel_err(grads[n], runtime_grads[n]) for n in runtime_grads},
        "vs_ref": {n: rel_err(grads[n], g) for n, g in ref_grads.items()},
        "missing": sorted(set(ref_grads) - set(grads)),
        "collectives": dict(comm.records), "total": comm.get_total_counts(),
    }


def _check_on_gloo(world4, plan: Plan, tmp_path: Path) -> tuple[dict, object]:
    spec = VerifySpec(MODEL, plan.mesh_shape, plan.mesh_axes, plan.dumps(), measure_memory=False)
    ok, text = summarize(world4.run(verify_rank, spec), TOL)
    assert ok, text                                     # autoshard verify passes this plan
    exp = export_plan(plan)
    reports = world4.run(_run_exported, spec, render_source(exp), str(tmp_path))
    for rank, r in enumerate(reports):
        assert not r["missing"], r["missing"]
        assert abs(r["loss"] - r["runtime_loss"]) <= TOL * abs(r["runtime_loss"]), (rank, r)
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), (rank, r)
        worst = max(r["vs_runtime"].items(), key=lambda kv: kv[1])
        assert worst[1] <= TOL, f"rank {rank}: {worst} against autoshard's runtime"
        assert max(r["vs_ref"].values()) <= TOL
        ran = Counter(r["collectives"])
        assert sum(ran.values()) == r["total"]          # the same collectives CommDebugMode counts
        assert None not in {k[2] for k in ran}, ran     # every one on a known mesh axis
        assert ran == exp.expected_counts(), (rank, ran, exp.expected_counts())
    return reports[0], exp


def _plan_linear_boundaries(plan: Plan, axis: str) -> Counter:
    """The plan's collectives over ``axis`` that move the input of a Linear whose weight it
    reads sharded there, or such a Linear's output (read independently of the exporter, from
    the plan's nodes and signatures)."""
    from autoshard.plangraph import graph_of
    g = graph_of(plan)
    t = plan.mesh_axes.index(axis)
    values = set()
    for name, node in g.nodes.items():
        if node.op == "aten.linear.default" and type(node.inputs[1][t]).__name__ == "Shard":
            values |= {name, g.reads[name][0][0]}
    phase = {"forward": "forward", "backward": "backward"}
    return Counter((phase[c.phase], c.kind, c.axes) for c in plan.collectives
                   if c.axes == (axis,) and c.value in values and c.phase in phase)


@pytest.mark.slow
def test_exported_megatron_dp_matches_verify_on_gloo(world4, plans, tmp_path):
    """Same loss and gradients as autoshard's runtime; the Linears' collectives are exactly the
    plan's. The other differences, as declared: SequenceParallel all-reduces each norm weight's
    gradient (5) where the plan buckets them with the embedding's and the head's (1); the
    embedding runs whole, its output's gradient all-gathered (1); the head's input is gathered
    (1); replicate all-reduces the gradients in one collective where the plan uses 2 buckets;
    the plan's small reshards of positions and masks and its loss reduction are not run."""
    plan = plans["megatron-dp"]
    report, exp = _check_on_gloo(world4, plan, tmp_path)
    ran = Counter(report["collectives"])
    planned = exp.expected_counts(planned_only=True)
    assert planned == _plan_linear_boundaries(plan, "tp")
    extra = ran - planned
    assert extra == Counter({("backward", "all_reduce", ("tp",)): 5,
                             ("backward", "all_gather", ("tp",)): 1,
                             ("forward", "all_gather", ("tp",)): 1,
                             ("backward", "all_reduce", ("dp",)): 1})


def test_exported_fsdp_layout_matches_verify_on_gloo(world4, plans, tmp_path):
    """Tensor parallel with the sequence sharded over "dp" and fully_shard over "tp": the same
    loss and gradients. The Linears' collectives are the plan's, and so are the vocabulary-
    parallel embedding's (a reduce-scatter onto the sequence shards, all-gathered back in
    backward). As declared: the head's logits are gathered at the Linear (the plan gathers them
    at the loss, after a cast and a view: none of its collectives moves the Linear's output);
    the norm weights' gradients are all-reduced one by one (5); fully_shard gathers and
    reduce-scatters once per group (3: two layers and the root) where the plan does per
    parameter."""
    plan = plans["fsdp"]
    report, exp = _check_on_gloo(world4, plan, tmp_path)
    ran = Counter(report["collectives"])
    planned = exp.expected_counts(planned_only=True)
    embedding = Counter({("forward", "reduce_scatter", ("dp",)): 1,
                         ("backward", "all_gather", ("dp",)): 1})
    assert planned == _plan_linear_boundaries(plan, "dp") + embedding
    assert ran - planned == Counter({("forward", "all_gather", ("dp",)): 1,
                                     ("backward", "all_reduce", ("dp",)): 5,
                                     ("forward", "all_gather", ("tp",)): 3,
                                     ("backward", "reduce_scatter", ("tp",)): 3})


def _vocabulary_parallel_loss(plan: Plan) -> Plan:
    """``plan`` with its cross-entropy reading the logits sharded on the vocabulary over "dp"
    (the planner's loss rules keep the class dim whole, so no plan of it does this)."""
    from autoshard.ir import Shard
    nodes = []
    for n in plan.nodes:
        if n.op == "aten.cross_entropy_loss.default":
            logits = (Shard(1),) + tuple(n.inputs[0][1:])
            n = dataclasses.replace(n, inputs=(logits, *n.inputs[1:]))
        nodes.append(n)
    return dataclasses.replace(plan, nodes=tuple(nodes))


def _run_loss_parallel(model_name: str, source: str, workdir: str) -> dict:
    """The exported program alone (autoshard's runtime has no such plan to run) against the
    single-device model."""
    import torch.distributed as dist
    from autoshard.loss import as_loss_module
    from torch.distributed.tensor import DTensor
    model, inputs = build(model_name, None, None, 0)
    ref = as_loss_module(copy.deepcopy(model))
    ref_loss = ref(*inputs)
    ref_loss.backward()
    mod = _load(source, Path(workdir), f"loss_parallel_rank{dist.get_rank()}")
    mesh = mod.make_mesh("cpu")
    mod.parallelize(model, mesh)
    with mod.loss_context():
        loss = model(*mod.shard_inputs(mesh, *inputs))
        loss.backward()
    loss = loss.full_tensor().detach()
    data = mod._data_mesh(mesh)
    dist.all_reduce(loss, group=data.get_group())
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for n, p in model.named_parameters()}
    return {"loss": float(loss / data.size()), "ref_loss": float(ref_loss.detach()),
            "errs": {n.removeprefix("model."): rel_err(grads[n.removeprefix("model.")], p.grad)
                     for n, p in ref.named_parameters()}}


def test_vocabulary_parallel_loss_maps_to_loss_parallel(world4, plans, tmp_path):
    """A column-parallel head whose logits the loss reads sharded on the vocabulary: the head
    keeps them sharded DTensors and the loss runs under loss_parallel(), with the
    single-device model's loss and gradients."""
    from torch.distributed.tensor import Shard
    exp = export_plan(_vocabulary_parallel_loss(plans["fsdp"]))
    assert exp.loss_parallel
    source = render_source(exp)
    assert "return loss_parallel()" in source
    head = _load(source, tmp_path, "loss_parallel").tensor_parallel_plan()["model.lm_head"]
    assert head.output_layouts == (Shard(-1),) and head.use_local_output is False
    for r in world4.run(_run_loss_parallel, MODEL, source, str(tmp_path)):
        assert abs(r["loss"] - r["ref_loss"]) <= TOL * abs(r["ref_loss"]), r
        assert max(r["errs"].values()) <= TOL, r["errs"]


if __name__ == "__main__":        # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
