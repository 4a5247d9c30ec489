"""Parameters kept on the host and copied to the device at each use (state mode
``offload_params``: ZeRO-Infinity's parameter offload, FSDP2's CPUOffloadPolicy).

Closed forms (cost/state.py and cost/price.py against docs/cost-model.md §9, by hand for one
weight), structure (the plan's host copies and bytes; the model state beside ZeRO-3's layout),
numerics on gloo (loss and gradients as the single-device model's, 20 AdamW steps as
single-device AdamW's, every host copy and collective counted at run time as planned), the
planner's choice (only where memory requires it) and the host memory bound.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from autoshard.cost.memory import HOST_RESERVE_BYTES
from autoshard import Mesh, Plan, PlanOptions
from autoshard.cluster import Cluster
from autoshard.cost.price import Pricer
from autoshard.cost.state import ADAM_STEP_BYTES, state_bytes, state_spec
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Shard, Strategy
from autoshard.tools.report import techniques
from autoshard.solver.baselines import stored_plan
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.tools.verify import VerifySpec, build, plan_for, summarize, verify_rank
from dist import adamw_steps, world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
R, S0 = Replicate(), Shard(0)

world4 = world_fixture(4, timeout_s=300)


# -- closed forms -----------------------------------------------------------------------------

def test_offload_params_state_bytes_by_hand():
    """Nothing on the device; on the host the parameter, its gradient shard (codegen/
    hostlink.py), the fp32 master and moments, and the bucketed host step's landing buffer and
    the buffer the updated shard is cast into (codegen/hostopt.py; docs/cost-model.md §9)."""
    shape, d = (4096, 1024), 8
    psi = shape[0] * shape[1]
    # Replicated bf16 over 8 ranks: the state is cut over them, the parameter is whole.
    rep = state_bytes(shape, torch.bfloat16, (R,), "offload_params", (d,), "adam")
    assert rep.device == 0
    assert rep.host == 2 * psi + (2 + 2 + 2 + 12) * psi / d
    # ZeRO-3's layout (stored S(0)) in fp32: n = psi / d local elements, all of it on the host.
    n = psi / d
    zero3 = state_bytes(shape, torch.float32, (S0,), None, (d,), "adam")
    stream = state_bytes(shape, torch.float32, (S0,), "offload_params", (d,), "adam")
    assert zero3.device == (4 + 4 + 8) * n and zero3.host == 0
    assert stream.device == 0 and stream.host == (4 + 4 + 4 + 4 + 12) * n


def _mlp_pricer(offload: str = "parameters", recompute=frozenset()):
    model, inputs = build("mlp-tiny", None, None, 0)
    traced = trace(model, inputs)
    mesh = Mesh((4,), cluster="cpu")
    return traced, Pricer(traced, mesh, PlanOptions(), offload=offload, recompute=recompute)


def test_host_seconds_by_hand():
    """One use of a weight kept on the host: its stored shard up (twice where recomputed) and
    its gradient down, in the stored layout or, bucketed, the reduce-scattered share; the
    optimizer step at the host's memory bandwidth, with a replicated parameter's shard up and
    its gathered parameter down."""
    traced, pricer = _mlp_pricer()
    c = pricer.mesh.cluster
    p = traced.params[0]
    value, shape, isz = (p.name, 0), p.info.shape, p.info.dtype.itemsize
    numel = math.prod(shape)
    assert ("offload_params", None) in pricer.param_states(p.name, (S0,))
    # ZeRO-3's layout: gathered for the use, its gradient reduce-scattered back to the shard.
    n = numel // 4 * isz
    up_down = pricer.host_seconds(value, (S0,), (R,), frozenset(), "offload_params")
    assert up_down == pytest.approx((n + n) / c.host_bandwidth, rel=1e-12)
    again = pricer.host_seconds(value, (S0,), (R,), frozenset(), "offload_params", again=True)
    assert again == pytest.approx((2 * n + n) / c.host_bandwidth, rel=1e-12)
    # Replicated, a data-parallel read: its whole copy up; its bucket's reduce-scattered share
    # (a quarter) down.
    whole = numel * isz
    dp = pricer.host_seconds(value, (R,), (R,), frozenset({0}), "offload_params")
    assert dp == pytest.approx((whole + whole / 4) / c.host_bandwidth, rel=1e-12)
    # Any other mode, or no parameter: no host link.
    assert pricer.host_seconds(value, (S0,), (R,), frozenset(), "offload") == 0.0
    assert pricer.host_seconds(value, (S0,), (R,), frozenset(), None) == 0.0
    # The optimizer step: ZeRO-3's layout, stepped where it lies.
    sharded = Strategy((), ((S0,),), "offload_params")
    # (and the two host copies, each read and written: the gradient shard into its landing
    # buffer, the updated shard into the host parameter)
    step = (numel // 4) * (ADAM_STEP_BYTES + 2 * 2 * isz) / c.host_mem_bandwidth
    assert pricer.optimizer_seconds(p.name, sharded) == pytest.approx(step, rel=1e-12)
    assert pricer.host_steps(p.name, sharded) == []
    # Replicated: the state cut over the 4 ranks; its shard up, the gathered parameter down.
    rep = Strategy((), ((R,),), "offload_params")
    assert state_spec(shape, (R,), (4,)) is not None
    assert pricer.host_steps(p.name, rep) == [("h2d", whole // 4), ("d2h", whole)]
    # (the landing copy of the shard; the gathered parameter, whole, copied into place)
    assert pricer.optimizer_seconds(p.name, rep) == pytest.approx(
        ((numel // 4) * ADAM_STEP_BYTES + 2 * (whole // 4) + 2 * whole) / c.host_mem_bandwidth
        + (whole // 4 + whole) / c.host_bandwidth, rel=1e-12)


def test_host_buffers_keep_one_buffer_per_key_and_accumulate():
    """The host link's buffers (codegen/hostlink.py): a copy down lands in the buffer kept for
    its key, the same memory every step; a second gradient for a tensor that already has one
    is added to it (a tied weight, accumulation without zero_grad), through its own buffer."""
    from autoshard.codegen.hostlink import HostBuffers
    bufs = HostBuffers(torch.device("cpu"))
    g1, g2 = torch.randn(3, 4), torch.randn(3, 4)
    first = bufs.down(g1, "w")
    assert torch.equal(first, g1) and first is not g1
    total = bufs.down(g2, "w", into=first)
    assert total is first and torch.allclose(total, g1 + g2)
    assert bufs.down(g2, "w") is first and torch.equal(first, g2)     # a new step: reused
    assert bufs.down(g1, "v") is not first                            # another key: its own
    assert bufs.down(g1.to(torch.float64), "w").dtype == torch.float64    # a changed layout


def test_optimizer_offload_alone_offers_no_parameter_offload():
    _, pricer = _mlp_pricer(offload="optimizer")
    assert "offload" in pricer.modes and "offload_params" not in pricer.modes
    _, pricer = _mlp_pricer(offload="parameters")
    assert {"offload", "offload_params"} <= set(pricer.modes)


# -- structure --------------------------------------------------------------------------------

def _fsdp(model: str, shape: tuple[int, ...], **kw) -> Plan:
    m, inputs = build(model, None, None, 0)
    return stored_plan(trace(m, inputs), Mesh(shape, cluster=CLUSTER), "fsdp", **kw)


@pytest.fixture(scope="module")
def zero3_and_streamed():
    return (_fsdp("gpt2-tiny", (4,), bucket_mb=0.05),
            _fsdp("gpt2-tiny", (4,), offload="parameters", bucket_mb=0.05))


def test_streaming_zero3_moves_its_state_to_the_host(zero3_and_streamed):
    """ZeRO-3's layout, streamed: the device's model state is gone, by exactly what ZeRO-3
    keeps there; the host holds what the formula says; the step's peak is lower."""
    zero3, stream = zero3_and_streamed
    assert stream.params == zero3.params
    assert {st.mode for st in stream.param_state.values()} == {"offload_params"}
    assert all(st.offload == "parameters" for st in stream.param_state.values())
    m3, ms = zero3.predicted.memory, stream.predicted.memory
    model, inputs = build("gpt2-tiny", None, None, 0)
    traced = trace(model, inputs)
    host = device = 0.0
    for p in traced.params:
        if p.fqn not in zero3.params or p.name in {n for n in _tied_later(traced)}:
            continue
        spec = zero3.params[p.fqn]
        device += state_bytes(p.info.shape, p.info.dtype, spec, None, (4,), "adam").device
        n = math.prod(p.info.shape) // math.prod(
            4 for x in spec if isinstance(x, Shard))
        sspec = state_spec(p.info.shape, spec, (4,))
        ns = n // 4 if sspec is not None else n
        # fp32: parameter, gradient, master+moments, the host step's landing and update buffers
        host += 4 * n + 4 * ns + 12 * ns + 4 * ns + 4 * ns
    assert m3.model_state == device and m3.host == 0
    assert ms.model_state == 0 and ms.host == host
    assert ms.peak < m3.peak
    assert stream.predicted.ilp_sum_bytes < zero3.predicted.ilp_sum_bytes


def _tied_later(traced) -> list[str]:
    seen, later = set(), []
    for p in traced.params:
        if p.fqn in seen:
            later.append(p.name)
        seen.add(p.fqn)
    return later


def test_the_plan_lists_every_host_copy(zero3_and_streamed):
    """One copy in per use of each streamed parameter, again in recomputation for those read
    in a checkpointed layer, its gradient down; they are the step's host-link seconds, outside
    the optimizer step, and the step is the ILP's objective."""
    stream = plan_for("gpt2-tiny", Mesh((4,), cluster=CLUSTER), offload="parameters",
                      recompute="full", bucket_mb=0.05)
    assert set(stream.recompute.values()) == {"full"}
    t = stream.host_transfers
    fwd = [x for x in t if x.phase == "forward"]
    assert fwd and all(x.direction == "h2d" for x in fwd)
    assert {x.value for x in fwd} == {n.name for n in stream.nodes
                                      if n.kernel == "offload_params"}
    recomputed = {n for layer in stream.layers if layer.name in stream.recompute
                  for n in layer.nodes}
    again = [x for x in t if x.phase == "recompute"]
    assert sorted((x.node, x.value, x.bytes) for x in again) == sorted(
        (x.node, x.value, x.bytes) for x in fwd if x.node in recomputed)
    assert again
    down = [x for x in t if x.direction == "d2h" and x.phase in ("backward", "grad_sync")]
    assert {x.value for x in down} == {x.value for x in fwd}
    bw = Cluster.load(CLUSTER).host_bandwidth
    host_s = sum(x.bytes for x in t if x.phase != "optimizer") / bw
    p = stream.predicted
    assert p.host_s == pytest.approx(host_s, rel=1e-12)
    assert p.step_time_s == pytest.approx(
        p.compute_s + sum(p.exposed_comm_s.values()) + p.host_s, rel=1e-12)
    assert stream.solver["objective"] == pytest.approx(p.step_time_s, rel=1e-9)
    # ZeRO-3's own plan: no host link at all.
    assert not zero3_and_streamed[0].host_transfers


def test_plan_file_says_what_is_offloaded(zero3_and_streamed):
    _, stream = zero3_and_streamed
    d = json.loads(stream.dumps())
    assert {v["offload"] for v in d["params"].values()} == {"parameters"}
    assert d["host_transfers"] and Plan.loads(stream.dumps()) == stream
    assert "parameter offload" in stream.summary() and "host link" in stream.summary()
    assert techniques(stream)["offload_params"] == len(stream.param_state)
    # A plan written before parameter offload: "offload": true is the optimizer's.
    opt = plan_for("mlp-tiny", Mesh((4,), cluster=CLUSTER), baseline="dp", offload="optimizer")
    old = json.loads(opt.dumps())
    assert {v["offload"] for v in old["params"].values()} == {"optimizer"}
    for v in old["params"].values():
        v["offload"] = True
    del old["host_transfers"]
    loaded = Plan.loads(json.dumps(old))
    assert {(st.mode, st.offload) for st in loaded.param_state.values()} == {("offload",
                                                                              "optimizer")}
    assert loaded.host_transfers == ()
    bad = json.loads(opt.dumps())
    next(iter(bad["params"].values()))["offload"] = "disk"
    with pytest.raises(AutoshardError, match='false, "optimizer" or "parameters"'):
        Plan.loads(json.dumps(bad))


def test_parameter_offload_is_refused_on_a_pipeline():
    with pytest.raises(AutoshardError, match="parameter offload without a pipeline"):
        plan_for("gpt2-tiny", Mesh((2, 2), ("pp", "dp"), cluster=CLUSTER), pipeline="pp",
                 microbatches=2, offload="parameters")


# -- numerics on gloo -------------------------------------------------------------------------

CASES = [("llama-tiny", (4,), "dp", {}),
         ("llama-tiny", (2, 2), None, dict(recompute="full")),
         ("llama-tiny", (4,), "fsdp", {}),
         ("llama-tiny", (2, 2), "megatron-dp", dict(recompute="selective"))]


def _plan(model: str, shape: tuple[int, ...], base: str | None, kw: dict) -> Plan:
    kw = dict(offload="parameters", bucket_mb=0.05, **kw)
    if base == "fsdp":
        return _fsdp(model, shape, **kw)
    return plan_for(model, Mesh(shape, cluster=CLUSTER), baseline=base, **kw)


def _verify(world, model: str, plan: Plan) -> None:
    """Loss and every gradient within 1e-5 of the single-device model's; every collective and
    every host copy of the step counted at run time as the plan lists it, byte for byte."""
    assert plan.param_state and all(st.mode == "offload_params"
                                    for st in plan.param_state.values())
    spec = VerifySpec(model, plan.mesh_shape, plan.mesh_axes, plan.dumps(),
                      measure_memory=False)
    reports = world.run(verify_rank, spec)
    ok, text = summarize(reports, 1e-5)
    assert ok, text
    for rep in reports:
        assert rep["host_ledger_diff"] == [] and rep["ledger_diff"] == []
        assert rep["host_bytes"] == rep["planned_host_bytes"] > 0
        assert rep["bytes"] == rep["planned_bytes"]


# Data parallel streaming is ZeRO-3's layout (fsdp) less the sharding, and ZeRO-3's layout
# streamed is test_gpt2_streamed_steps_as_its_device_twin's (on GPT-2, verified the same way and
# stepped against its device twin): both with AUTOSHARD_SLOW=1.
FULL_ONLY = {"test_offloaded_parameters_train_as_single_device[llama-tiny-4-dp]",
             "test_offloaded_parameters_train_as_single_device[llama-tiny-4-fsdp]"}


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,base,kw", CASES,
                         ids=[f"{m}-{'x'.join(map(str, s))}-{b}" + "".join(
                             f"-{v}" for v in k.values()) for m, s, b, k in CASES])
def test_offloaded_parameters_train_as_single_device(world4, model, shape, base, kw):
    plan = _plan(model, shape, base, kw)
    if "recompute" in kw:
        assert any(t.phase == "recompute" for t in plan.host_transfers)
    _verify(world4, model, plan)
    errs = [e for e, _ in world4.run(adamw_steps, model, plan.dumps(), 20)]
    assert max(errs) <= 1e-4, errs


@pytest.mark.slow
def test_gpt2_streamed_steps_as_its_device_twin(world4, zero3_and_streamed):
    """gpt2-tiny in ZeRO-3's layout (tied embedding and head, biases, layer norms): gradients
    as the single-device model's; and 5 AdamW steps give the parameters, bit for bit, of the
    same layouts with everything on the device. (Bit for bit, the count of steps only has to
    send every parameter to the device and back more than once: a stale or lost host copy
    shows from the second step on. Against single-device AdamW both differ by 6.1e-4 on
    layers.1.mlp.fc1.weight after 20 steps: rounding noise in a gradient that Adam's first
    steps scale up, as tests/test_state.py notes of gpt2-tiny on 2x2.) The two plans are the
    structure tests' (the same stored_plan calls), planned once for the module."""
    twin, stream = zero3_and_streamed
    assert [(n.inputs, n.outputs) for n in stream.nodes] == \
        [(n.inputs, n.outputs) for n in twin.nodes]
    _verify(world4, "gpt2-tiny", stream)
    _, a = world4.run(adamw_steps, "gpt2-tiny", stream.dumps(), 5)[0]
    _, b = world4.run(adamw_steps, "gpt2-tiny", twin.dumps(), 5)[0]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the planner's choice ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama70b():
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("llama2-70b", batch=8, seq=4096, device="meta")
    return trace(model, inputs)


@pytest.mark.slow
def test_llama2_70b_streams_parameters_only_when_memory_requires_it(llama70b):
    """Llama-2-70B on 8 H100s, data parallel, batch 8 x 4096 (docs/cost-model.md §9): in 80 GB
    optimizer offload is enough and no parameter is streamed; in 30 GiB nothing fits with
    optimizer offload alone, and the planner streams parameters, at a slower step."""
    mesh = Mesh((8,), ("dp",), cluster="h100")
    full = plan_traced(llama70b, mesh, recompute="full")
    assert not any(st.mode == "offload_params" for st in full.param_state.values())
    assert any(st.mode == "offload" for st in full.param_state.values())
    assert not any(t.phase != "optimizer" for t in full.host_transfers)
    assert full.predicted.memory.peak <= 80e9
    budget = 30 * 2**30
    with pytest.raises(AutoshardError, match="optimizer offload to the host"):
        plan_traced(llama70b, mesh, recompute="full", memory_budget=budget, offload="optimizer")
    tight = plan_traced(llama70b, mesh, recompute="full", memory_budget=budget)
    streamed = [f for f, st in tight.param_state.items() if st.mode == "offload_params"]
    assert streamed and tight.predicted.host_s > 0
    assert tight.predicted.memory.peak <= budget
    assert tight.predicted.step_time_s > full.predicted.step_time_s
    assert tight.predicted.memory.host <= mesh.cluster.host_memory_bytes


@pytest.mark.slow
def test_no_plan_when_even_streaming_overfills_the_host():
    """A device budget only parameter offload meets, on a host too small for what it keeps:
    the error names the host memory and the least any plan that fits the device needs.
    Checkpointing is pinned to "full", what the planner picks here anyway (same plan, same
    error): the offload ladder under test runs as before, without the recompute ladder's
    three solves at each of its rungs."""
    model, inputs = build("gpt2-tiny", None, None, 0)
    traced = trace(model, inputs)
    budget = 300_000      # (the walk's peak held to 93% of it: docs/cost-model.md §4.6)
    fits = plan_traced(traced, Mesh((1,), cluster="cpu"), memory_budget=budget, recompute="full")
    assert set(fits.recompute.values()) == {"full"}
    assert any(st.mode == "offload_params" for st in fits.param_state.values())
    host = fits.predicted.memory.host
    # Room for half of it beside the process's own (cost/memory.py host_budget).
    small = dataclasses.replace(Cluster.preset("cpu"),
                                host_memory_bytes=host / 2 + HOST_RESERVE_BYTES)
    with pytest.raises(AutoshardError) as info:
        plan_traced(traced, Mesh((1,), cluster=small), memory_budget=budget, recompute="full")
    text = str(info.value)
    assert "host memory" in text and "host_memory_bytes" in text
    assert "parameter offload to the host" in text
    least = float(text.split("at least ")[1].split(" GiB")[0]) * 2**30
    assert host / 2 < least <= host * (1 + 1e-3)
