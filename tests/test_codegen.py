"""Tier 2: plans run on real gloo ranks and equal the single-device model.

Each case plans in this process, then every rank of a shared world builds the same model (same
seed), runs one training step of its per-rank program and of the whole model, and compares loss,
every gradient (fp32: 1e-5 relative) and every collective's run-time bytes with the
plan. Plans are made with tests/data/compute_bound.json, a cluster on which compute is slow, so
even these tiny models get sharded plans with many collectives (on a real cluster they would
rightly be replicated).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.tools.verify import VerifySpec, build, plan_for, summarize, verify_rank
from autoshard.errors import AutoshardError
from dist import world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
TOL = 1e-5

world2 = world_fixture(2, timeout_s=300)
world4 = world_fixture(4, timeout_s=300)
world8 = world_fixture(8, timeout_s=300)


def mesh_of(shape: tuple[int, ...]) -> Mesh:
    return Mesh(shape, cluster=CLUSTER)


def check(world, model: str, plan: Plan) -> dict:
    spec = VerifySpec(model, plan.mesh_shape, plan.mesh_axes, plan.dumps(),
                      measure_memory=False)      # (informational; tests/test_memory_measure.py)
    reports = world.run(verify_rank, spec)
    ok, text = summarize(reports, TOL)
    assert ok, text
    assert reports[0]["collectives"] > 0, "the plan moved nothing: the case tests nothing"
    return reports[0]


CASES4 = [("mlp-tiny", (4,)), ("gpt2-tiny", (4,)), ("gpt2-tiny", (2, 2)), ("llama-tiny", (4,)),
          ("llama-tiny", (2, 2)), ("hf-gpt2-tiny", (4,)), ("hf-gpt2-tiny", (2, 2)),
          ("hf-llama-tiny", (4,)), ("hf-llama-tiny", (2, 2)), ("bert-tiny", (2, 2))]


# The Hugging Face models on (4,) repeat their (2, 2) cases and the zoo models' (4,) ones;
# Hugging Face GPT-2 on (2, 2) runs planned (its loss pinned vocab-parallel) in
# tests/test_vocab_parallel.py.
FULL_ONLY = {"test_autoshard_plan_equals_single_device[hf-gpt2-tiny-4]",
             "test_autoshard_plan_equals_single_device[hf-llama-tiny-4]",
             "test_autoshard_plan_equals_single_device[hf-gpt2-tiny-2x2]"}


@pytest.mark.parametrize("model,shape", CASES4, ids=[f"{m}-{'x'.join(map(str, s))}" for m, s in CASES4])
def test_autoshard_plan_equals_single_device(world4, model, shape):
    check(world4, model, plan_for(model, mesh_of(shape)))


def test_mlp_on_two(world2):
    check(world2, "mlp-tiny", plan_for("mlp-tiny", mesh_of((2,))))


@pytest.mark.slow
def test_three_axis_mesh_at_world_size_eight(world8):
    """A plan of a 3-axis mesh runs as planned on 8 ranks. Planned under a 2 s time limit: the
    every-subset ILP's build takes longer and is given up (under the default 20 s it took ~20 s
    idle, and was given up the same way on a loaded machine), so the plan is the best of the
    axis merges, stepped one axis at a time: per-axis collectives on all three axes (idle, its
    predicted step is within 1e-6 of the every-subset plan's)."""
    plan = plan_for("gpt2-tiny", mesh_of((2, 2, 2)), time_limit_s=2.0)
    assert not plan.joint_axes and len({c.axes for c in plan.collectives}) >= 3
    check(world8, "gpt2-tiny", plan)


@pytest.mark.parametrize("baseline", ["dp", "megatron", "megatron-dp"])
def test_hand_written_plans_through_a_plan_file(world4, tmp_path, baseline):
    shape = (4,) if baseline != "megatron-dp" else (2, 2)
    plan = plan_for("gpt2-tiny", mesh_of(shape), baseline=baseline)
    path = tmp_path / f"{baseline}.json"
    plan.save(path)
    loaded = Plan.load(path)
    report = check(world4, "gpt2-tiny", loaded)
    kinds = {c.kind for c in loaded.collectives}
    if baseline == "dp":
        # Block parameters are replicated: their gradients are all-reduced (embeddings are left
        # to the solver in every baseline, see autoshard/solver/baselines.py).
        # They travel in buckets (one all-reduce per bucket and axis, cost/overlap.py).
        replicated = {n.name for n in loaded.nodes if n.op == "placeholder" and n.name.startswith("p_")
                      and all(str(p) == "R" for p in n.outputs[0])}
        grads = [c for c in loaded.collectives if c.phase == "grad_sync" and c.members]
        assert grads and {c.kind for c in grads} == {"all_reduce"}
        assert {m for c in grads for m in c.members} <= replicated
    else:
        assert "all_reduce" in kinds or "reduce_scatter" in kinds, kinds
    assert report["bytes"] == report["planned_bytes"]


# -- gradient buckets -------------------------------------------------------------------------

def _bucketed_plan() -> Plan:
    """Data parallel over both axes, with buckets small enough that there are several, most
    holding several gradients."""
    plan = plan_for("gpt2-tiny", mesh_of((2, 2)), baseline="dp", bucket_mb=0.01)
    buckets = {c.node: c.members for c in plan.collectives if c.members}
    assert len(buckets) >= 4 and sum(len(m) > 1 for m in buckets.values()) >= 2, buckets
    return plan


def test_gradient_buckets_run_as_planned(world4):
    """One all-reduce per bucket and axis at run time, each of the planned bytes; gradients equal
    the single-device model's."""
    plan = _bucketed_plan()
    report = check(world4, "gpt2-tiny", plan)
    assert report["bytes"] == report["planned_bytes"]


def _accumulate(plan_json: str) -> dict[str, float]:
    """Two backward passes before reading the gradients: a bucket must add to ``.grad``."""
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    from autoshard.tools.verify import rel_err
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    ref = as_loss_module(build("gpt2-tiny", None, None, 0)[0])
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    local = pm.shard_inputs(*inputs)
    for _ in range(2):
        pm.step(*local)
        ref(*inputs).backward()
    full = pm.full_grads()
    return {name: rel_err(full[name.removeprefix("model.")], p.grad)
            for name, p in ref.named_parameters()}


def test_gradient_buckets_accumulate_over_two_backward_passes(world4):
    errs = world4.run(_accumulate, _bucketed_plan().dumps())[0]
    assert errs and max(errs.values()) <= TOL, errs


# -- structure of the emitted program ---------------------------------------------------------

def _structure(plan_json: str) -> tuple[int, int, str]:
    from autoshard.codegen.rewrite import ReshardCall
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    calls = [n for n in pm.program.graph.nodes if isinstance(n.target, ReshardCall)]
    fwd = sum(sum(s.is_collective for s in n.target.edge.reshard.forward) for n in calls)
    return len(calls), fwd, pm.program.meta["autoshard_plan"]["fingerprint"]


def test_emitted_graph_has_the_plans_collectives(world4):
    plan = plan_for("gpt2-tiny", mesh_of((4,)), baseline="megatron")
    n_calls, n_fwd, fp = world4.run(_structure, plan.dumps())[0]
    assert fp == plan.fingerprint
    assert n_fwd == sum(1 for c in plan.collectives if c.phase == "forward")
    assert n_calls > 0


# -- state: full state dicts and torch.distributed.checkpoint ---------------------------------

def _state_round_trip(plan_json: str) -> bool:
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    torch.manual_seed(123)
    other = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in original.items()}
    pm.load_full_state_dict(other)
    pm.load_full_state_dict(original)
    full = pm.full_state_dict()
    return all(torch.equal(full[k], original[k]) for k in full) and set(full) <= set(original)


def _from_plan_file_alone(path: str) -> float:
    """The issue's usage: parallelize(model, mesh, plan="plan.json"), no example inputs."""
    import autoshard
    plan = Plan.load(path)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = autoshard.parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=path)
    return float(pm.step(*pm.shard_inputs(*inputs)))


def test_parallelize_from_a_plan_file_needs_no_example_inputs(world2, tmp_path):
    plan = plan_for("gpt2-tiny", mesh_of((2,)))
    plan.save(tmp_path / "p.json")
    losses = world2.run(_from_plan_file_alone, str(tmp_path / "p.json"))
    model, inputs = build("gpt2-tiny", None, None, 0)
    from autoshard.loss import as_loss_module
    want = float(as_loss_module(model)(*inputs).detach())
    assert all(abs(l - want) <= 1e-5 * abs(want) for l in losses), (losses, want)


def test_full_state_dict_round_trip_is_bit_exact(world4):
    plan = plan_for("gpt2-tiny", mesh_of((2, 2)), baseline="megatron-dp")
    assert all(world4.run(_state_round_trip, plan.dumps()))


def _dcp_save(plan_json: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    dcp.save(pm.sharded_state_dict(), checkpoint_id=path)


def _dcp_load(plan_json: str, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 7)        # other weights, overwritten by load
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    sd = pm.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    pm.load_sharded_state_dict(sd)
    return pm.full_state_dict()


def test_checkpoint_saved_on_four_ranks_loads_on_two_with_another_plan(world4, world2, tmp_path):
    save_plan = plan_for("gpt2-tiny", mesh_of((4,)), baseline="megatron")
    load_plan = plan_for("gpt2-tiny", mesh_of((2,)), baseline="dp")
    assert save_plan.params != load_plan.params
    world4.run(_dcp_save, save_plan.dumps(), str(tmp_path / "ckpt"))
    full = world2.run(_dcp_load, load_plan.dumps(), str(tmp_path / "ckpt"))[0]
    model, _ = build("gpt2-tiny", None, None, 0)
    for name, p in model.named_parameters():
        assert torch.equal(full[name], p.detach()), name


def test_checkpoint_of_a_pipeline_loads_without_one_and_back(world4, world2, tmp_path):
    """DCP across stages: each rank saves its own stage's shards (stage 0 holds the embedding,
    stage 1 the head), the checkpoint loads into a plan without a pipeline, and the other way
    round; the parameters come back bit-exact."""
    piped = plan_for("gpt2-tiny", Mesh((2, 2), ("pp", "tp"), cluster="stress"), pipeline="pp",
                     schedule="1F1B", microbatches=2)
    flat = plan_for("gpt2-tiny", mesh_of((2,)), baseline="dp")
    assert piped.pipeline is not None and len(piped.pipeline.stages) == 2
    model, _ = build("gpt2-tiny", None, None, 0)
    world4.run(_dcp_save, piped.dumps(), str(tmp_path / "from_pipeline"))
    full = world2.run(_dcp_load, flat.dumps(), str(tmp_path / "from_pipeline"))[0]
    for name, p in model.named_parameters():
        assert torch.equal(full[name], p.detach()), name
    world2.run(_dcp_save, flat.dumps(), str(tmp_path / "into_pipeline"))
    for full in world4.run(_dcp_load, piped.dumps(), str(tmp_path / "into_pipeline")):
        for name, p in model.named_parameters():
            assert torch.equal(full[name], p.detach()), name


# -- training: 100 steps equal to one process --------------------------------------------------

def _train(plan_json: str, steps: int) -> list[float]:
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        losses.append(float(pm.step(*pm.shard_inputs(*inputs))))
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.slow
def test_a_hundred_training_steps_track_one_process(world4):
    """Every rank's loss tracks one process's, step by step, over 100 AdamW steps. (100 rather
    than 200: at lr 1e-2 gpt2-tiny's loss falls from 4.1 to 0.18 by step 25 and to 0.0037 by
    step 100, so the run already covers the fast fall and a long tail where rounding would
    drift; the second hundred steps showed nothing the first does not.)"""
    from autoshard.loss import as_loss_module
    steps = 100
    plan = plan_for("gpt2-tiny", mesh_of((2, 2)))
    parallel = world4.run(_train, plan.dumps(), steps)
    model, inputs = build("gpt2-tiny", None, None, 0)
    ref = as_loss_module(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        loss = ref(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        for rank in range(4):
            assert abs(parallel[rank][step] - loss.item()) <= 1e-4 * max(1.0, abs(loss.item())), \
                (step, rank, parallel[rank][step], loss.item())
    assert parallel[0][-1] < 0.5 * parallel[0][0], "the model did not train"


# -- bad input ----------------------------------------------------------------------------------

def _catch(fn, *args):
    try:
        fn(*args)
    except AutoshardError as e:
        return str(e)
    return None


def _parallelize_with(plan_json: str, model_name: str, mesh_shape: tuple[int, ...],
                      batch: int | None = None) -> None:
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build(model_name, batch, None, 0)
    parallelize(model, Mesh(mesh_shape), plan=plan, example_inputs=inputs)


def test_wrong_world_size_is_refused(world2):
    plan = plan_for("gpt2-tiny", mesh_of((4,)))
    msgs = world2.run(_catch, _parallelize_with, plan.dumps(), "gpt2-tiny", (4,))
    assert msgs[0] and "world size 4" in msgs[0] and "got world size 2" in msgs[0], msgs[0]
    assert "torchrun --nproc-per-node 4" in msgs[0]


def test_plan_for_another_mesh_or_model_is_refused(world2):
    plan = plan_for("gpt2-tiny", mesh_of((2,)))
    other_mesh = world2.run(_catch, _parallelize_with, plan_for("gpt2-tiny", Mesh((2,), ("dp",), cluster=CLUSTER)).dumps(),
                            "gpt2-tiny", (2,))[0]
    assert other_mesh and "mesh the plan was made for" in other_mesh, other_mesh
    other_model = world2.run(_catch, _parallelize_with, plan.dumps(), "llama-tiny", (2,))[0]
    assert other_model and "first differences" in other_model and "Fix" in other_model, other_model


def _bad_inputs(plan_json: str) -> str | None:
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs)
    wrong = tuple(t[:, :8] for t in inputs)
    local = pm.shard_inputs(*inputs)
    return [_catch(pm.shard_inputs, *wrong), _catch(pm.step, local[0]),
            _catch(pm.shard_inputs, inputs[0].float(), *inputs[1:]),
            _catch(pm.step, local[0].float(), *local[1:])]


def test_inputs_of_other_shapes_are_refused(world2):
    """Inputs of another shape, another count, or floats where token ids were traced: said
    before the program runs, not by the model's ops inside it."""
    shape, count, ids, local_ids = world2.run(
        _bad_inputs, plan_for("gpt2-tiny", mesh_of((2,))).dumps())[0]
    assert shape and "planned shape" in shape and "got shape (4, 8)" in shape, shape
    assert count and "2 local inputs" in count and "got 1" in count, count
    for msg in (ids, local_ids):
        assert msg and "input 0 of dtype torch.int64" in msg and "torch.float32" in msg, msg


def test_complex_values_carry_their_gradients(world4):
    """An rfft between two linear layers: its complex output carries a gradient like a float one.
    Planned as float-only once, the reshards after the rfft lost their backward steps and the
    run failed (or, with rfft sharded, trained on wrong gradients)."""
    factory = f"{Path(__file__).parent / 'data' / 'fft_model.py'}:make"
    plan = plan_for(factory, mesh_of((4,)))
    assert any(n.op == "aten.fft_rfft.default" for n in plan.nodes)
    check(world4, factory, plan)


# -- activation checkpointing -------------------------------------------------------------------

RECOMPUTE_CASES = [("gpt2-tiny", (4,), "megatron", "full"), ("llama-tiny", (4,), "megatron", "full"),
                   ("llama-tiny", (2, 2), None, "full"),
                   ("gpt2-tiny", (4,), "megatron", "selective"),
                   ("llama-tiny", (2, 2), "megatron-dp", "selective")]


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,baseline,policy", RECOMPUTE_CASES,
                         ids=[f"{m}-{'x'.join(map(str, s))}-{b or 'autoshard'}-{p}"
                              for m, s, b, p in RECOMPUTE_CASES])
def test_recomputed_layers_equal_single_device(world4, model, shape, baseline, policy):
    """Every layer checkpointed: loss and gradients equal the single-device model's, and the
    collectives a recomputed layer runs again are the plan's "recompute" entries, byte for
    byte (verify compares the whole ledger). Selective checkpointing stores collective outputs:
    nothing runs again."""
    plan = plan_for(model, mesh_of(shape), baseline=baseline, recompute=policy)
    assert set(plan.recompute.values()) == {policy} and len(plan.recompute) == 2
    report = check(world4, model, plan)
    again = [c for c in plan.collectives if c.phase == "recompute"]
    if baseline == "megatron":
        assert bool(again) == (policy == "full")
    assert report["bytes"] == report["planned_bytes"]


def test_layers_under_different_policies_equal_single_device(world4):
    """Checkpointing per layer (the planner's k-of-n choice): one layer fully recomputed, the
    other selectively, under Megatron's layout; the layers are decided as two groups."""
    from autoshard.solver.baselines import baseline_pins
    from autoshard.options import PlanOptions
    from autoshard.solver.merging import plan_once
    from autoshard.trace.export import trace
    model, inputs = build("llama-tiny", None, None, 0)
    traced = trace(model, inputs)
    mesh = mesh_of((4,))
    rc = {"layers.0": "full", "layers.1": "selective"}
    plan = plan_once(traced, mesh, PlanOptions(zero="none", offload="none"),
                        model_name="llama-tiny", fixed=baseline_pins(traced, mesh, "megatron"),
                        trace_s=0.0, merge=None, recompute=rc, offload="none")
    assert plan.recompute == rc
    assert {c.phase for c in plan.collectives} >= {"recompute"}
    report = check(world4, "llama-tiny", plan)
    assert report["bytes"] == report["planned_bytes"]
