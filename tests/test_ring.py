"""Ring attention: query, key and value sharded in the zigzag layout over a ring of ranks, K/V
blocks passed around it (ops/ring.py; ops/attention.py ``cp_ring``; codegen/ring.py;
docs/cost-model.md §3.11).

- closed form: the hops and their bytes, the balanced causal work per step, the price of a
  hop hidden behind a step's block compute, against docs/cost-model.md §3.11;
- rule: every ring strategy against single-device attention, forward and backward (threads);
- structural: a llama-tiny plan pinned to the ring lists its send/recv hops and gathers no K/V;
  the ILP picks ring or gather by their prices;
- numerical: gloo ranks run llama-tiny (causal, grouped-query) with the sequence sharded 2 and
  4 ways under the ring, loss and every gradient within 1e-5 of one device, run-time bytes
  equal to the plan, record by record; compiled, one attention block with the ring between
  its compiled regions, as the eager program.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autoshard import Mesh
from autoshard.cost.comm import collective_time
from autoshard.cost.compute import op_times
from autoshard.cost.price import Pricer
from autoshard.ir import ZIGZAG, Replicate, Shard, op_info
from autoshard.cost.liveness import step_memory
from autoshard.ops.attention import SDPA, ring_collectives, sdpa_workspace
from autoshard.ops.registry import strategies_for
from autoshard.ops.ring import RingLayout, ring_hops
from autoshard.ops.simulate import check_strategy
from autoshard.options import PlanOptions
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import TracedGraph, trace
from autoshard.trace.export import op_info as node_info
from autoshard.tools.verify import VerifySpec, build, summarize, verify_rank
from dist import world_fixture

ZZ = Shard(2, ZIGZAG)
TOL = 1e-5
BATCH, SEQ = 1, 16

world4 = world_fixture(4, timeout_s=600)


def _sdpa(shape_q=(1, 4, 16, 8), shape_kv=(1, 4, 16, 8), dtype=torch.float64, **kwargs):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=dtype) for s in (shape_q, shape_kv, shape_kv))
    return (q, k, v), kwargs, op_info(SDPA, (q, k, v), kwargs, SDPA(q, k, v, **kwargs))


def _ring(info, mesh, axes=None):
    return [s for s in strategies_for(info, mesh) if s.kernel == "cp_ring"
            and (axes is None or tuple(a for a, p in enumerate(s.inputs[0]) if p == ZZ) == axes)]


# ---- closed form ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_ring_makes_n_minus_1_hops_forward_and_2n_minus_1_backward(n) -> None:
    hops = ring_hops(n)
    assert [h.moves for h in hops if h.phase == "forward"] == [("kv",)] * (n - 1)
    assert [h.moves for h in hops if h.phase == "backward"] == \
        [("kv",), ("dkv",)] * (n - 1) + [("dkv",)]
    assert ring_hops(1) == ()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_steps_skip_masked_blocks_and_do_equal_work(n) -> None:
    """Each step of each rank is two chunk-pairs of unmasked work (the diagonal step: one whole
    pair and two causal halves), 2n pairs in all: 1/n of the causal 2n² (§3.11)."""
    rows = 4                                     # two chunks of 2 rows
    total = 0
    for r in range(n):
        lay = RingLayout(r, n, True, None, 1)
        for step in range(n):
            qr, kr, causal = lay.blocks(step, rows)
            pairs = (qr.stop - qr.start) // 2 * ((kr.stop - kr.start) // 2)   # chunk pairs
            work = pairs / 2 if causal else pairs      # the diagonal: one pair + two halves
            assert work == 2, (r, step, qr, kr, causal)
            total += work
    assert total == n * 2 * n == (2 * n) ** 2 // 2


def test_hops_carry_the_local_kv_and_fp32_gradients() -> None:
    """bf16 K/V of [1, 2, 16, 8] on 4 ranks: a K/V hop moves the local K and V (2·2·4·8 bf16
    elements), a gradient hop their fp32 accumulators, twice the bytes."""
    _, _, info = _sdpa((1, 4, 16, 8), (1, 2, 16, 8), torch.bfloat16, is_causal=True,
                       enable_gqa=True)
    (st,) = _ring(info, (4,))
    assert str(st) == "[S(2/zz)] x [S(2/zz)] x [S(2/zz)] -> [S(2/zz)] (cp_ring)"
    assert st.compute_scale == 1 / 4
    local = 2 * 2 * 4 * 8
    got = [(c.phase, c.nbytes, c.hides) for c in ring_collectives(info, st, (4,))]
    assert got == [("forward", local * 2, 0.25)] * 3 + \
        [("backward", local * 2, 0.25), ("backward", local * 4, 0.25)] * 3 + \
        [("backward", local * 4, 0.25)]


@pytest.mark.parametrize("cluster", ["stress", "h100"])
def test_a_hop_is_charged_beyond_the_step_it_hides_behind(tiny, cluster) -> None:
    """Pricer.op_charges: each hop costs ``max(0, alpha + S/B - t_step)`` with ``t_step`` the
    op's forward (or backward) seconds over n (docs/cost-model.md §3.11): on the stress
    cluster's slow compute every hop hides, on H100 figures llama-tiny's blocks are shorter
    than a hop's latency and every hop shows."""
    mesh = Mesh((4,), cluster=cluster)
    pricer = Pricer(tiny, mesh, PlanOptions(context_parallel="on"))
    node = next(n for n in tiny.graph.nodes if n.target is SDPA)
    (st,) = _ring(node_info(node), (4,))
    fwd, bwd = op_times(node_info(node), st, mesh, training=True)
    alpha, bandwidth = mesh.links[0].figures("send_recv")
    charges = pricer.op_charges(node.name, st)
    assert len(charges) == 3 + 7
    for phase, step, t in charges:
        raw = collective_time("send_recv", 4, step.nbytes, alpha, bandwidth)
        assert raw == alpha + step.nbytes / bandwidth
        hide = (fwd if phase == "forward" else bwd) / 4 * mesh.cluster.comm_overlap
        assert t == pytest.approx(max(0.0, raw - hide))
        assert (t == 0) if cluster == "stress" else (0 < t < raw)
    assert pricer.op_comm_seconds(node.name, st) == pytest.approx(sum(t for *_, t in charges))


def test_the_ring_holds_two_block_pairs_and_fp32_accumulators_while_it_runs(tiny) -> None:
    """ops/attention.py ``sdpa_workspace``: forward, two K/V block pairs (the one computed on,
    the one arriving) and the fp32 output; backward, the same blocks, two fp32 gradient pairs
    and the fp32 dQ. The step's liveness walk adds it at the op (its log shows the moment)."""
    _, _, info = _sdpa((1, 4, 16, 8), (1, 2, 16, 8), torch.bfloat16, is_causal=True,
                       enable_gqa=True)
    (st,) = _ring(info, (4,))
    q, kv = 4 * 4 * 8, 2 * 2 * 4 * 8            # local elements: q, and K plus V
    assert sdpa_workspace(info, st, (4,)) == (2 * kv * 2 + q * 4, 2 * kv * 2 + 2 * kv * 4 + q * 4)
    gather = next(s for s in strategies_for(info, (4,)) if s.kernel == "cp_gather")
    assert sdpa_workspace(info, gather, (4,)) == (0, 0)

    mesh = Mesh((4,), cluster="stress")
    plan = plan_traced(tiny, mesh, fixed=ring_pins(tiny, mesh, (0,)), model_name="llama-tiny",
                       context_parallel="on")
    strategies = plan.strategies()
    pricer = Pricer(tiny, mesh, PlanOptions(context_parallel="on"))

    class NoWorkspace(Pricer):
        def workspace(self, name, strategy):
            return 0, 0
    logs: dict[str, list] = {"with": [], "without": []}
    step_memory(tiny, strategies, pricer, log=logs["with"])
    step_memory(tiny, strategies, NoWorkspace(tiny, mesh, PlanOptions(context_parallel="on")),
                log=logs["without"])
    node = next(n.name for n in tiny.graph.nodes if n.target is SDPA)
    at = {k: [b for ph, n, b in v if n == node] for k, v in logs.items()}
    fwd, bwd = pricer.workspace(node, strategies[node])
    assert fwd > 0 and bwd > 0
    assert [w - wo for w, wo in zip(at["with"], at["without"])] == [fwd, bwd]


def test_the_plans_price_is_the_ilps_with_exposed_hops(tiny) -> None:
    """On H100 figures llama-tiny's blocks take microseconds, less than a hop's latency: the
    hops show, and the plan's step (its ledger priced hop by hop, exposed part only) is the
    ILP's objective."""
    mesh = Mesh((4,), cluster="h100")
    plan = plan_traced(tiny, mesh, fixed=ring_pins(tiny, mesh, (0,)), model_name="llama-tiny",
                       context_parallel="on")
    pricer = Pricer(tiny, mesh, PlanOptions(context_parallel="on"))
    node = next(n.name for n in tiny.graph.nodes if n.target is SDPA)
    charges = pricer.op_charges(node, plan.strategies()[node])
    assert all(t > 0 for *_, t in charges)
    assert plan.solver["objective"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


# ---- the rule against single-device attention ---------------------------------------------

CASES = [dict(is_causal=True), dict(), dict(is_causal=True, scale=0.3)]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("kwargs", CASES, ids=["causal", "full", "causal-scale"])
def test_ring_strategies_match_single_device(mesh, kwargs) -> None:
    args, kwargs, info = _sdpa(**kwargs)
    rings = _ring(info, mesh)
    assert rings
    for st in rings:
        assert not check_strategy(SDPA, args, kwargs, st, mesh), str(st)


def test_grouped_query_ring_and_no_mixing_with_the_gather() -> None:
    args, kwargs, info = _sdpa((1, 4, 16, 8), (1, 2, 16, 8), is_causal=True, enable_gqa=True)
    rings = _ring(info, (2, 2))
    assert any(s.inputs[1] == (ZZ, Shard(1)) for s in rings)       # ring x heads
    for st in rings:
        assert not check_strategy(SDPA, args, kwargs, st, (2, 2)), str(st)
    for st in strategies_for(info, (2, 2)):       # K/V zigzag exactly where the queries are
        q_axes = [p == ZZ for p in st.inputs[0]]
        k_axes = [p == ZZ for p in st.inputs[1]]
        assert not any(k_axes) or k_axes == q_axes, str(st)


# ---- planning llama-tiny under the ring -----------------------------------------------------

def ring_pins(traced: TracedGraph, mesh: Mesh, axes: tuple[int, ...]) -> dict:
    """Every attention op pinned to the ring over exactly ``axes`` (the others replicated)."""
    pins = {}
    for n in traced.graph.nodes:
        if n.target is SDPA:
            pins[n.name] = next(
                s for s in _ring(node_info(n), mesh.shape, axes)
                if all(s.inputs[0][a] == Replicate() for a in range(mesh.ndim) if a not in axes))
    return pins


@pytest.fixture(scope="module")
def tiny() -> TracedGraph:
    model, inputs = build("llama-tiny", BATCH, SEQ, 0)
    return trace(model, inputs)


def test_ring_plan_passes_kv_blocks_and_gathers_nothing(tiny) -> None:
    """Four ways over one axis: per layer, 3 forward hops of the local K and V (b·h_kv·s/4·d
    fp32 each) and 7 backward ones (3 of blocks, 4 of their gradients); no all-gather at the
    attention."""
    mesh = Mesh((4,), cluster="stress")
    plan = plan_traced(tiny, mesh, fixed=ring_pins(tiny, mesh, (0,)), model_name="llama-tiny",
                       context_parallel="on")
    kv = 2 * BATCH * 2 * (SEQ // 4) * 8 * 4
    layers = sum(1 for n in tiny.graph.nodes if n.target is SDPA)
    at = [c for c in plan.collectives if c.node.startswith("scaled_dot_product")]
    assert sorted((c.phase, c.kind, c.bytes) for c in at) == sorted(
        ([("forward", "send_recv", kv)] * 3 + [("backward", "send_recv", kv)] * 7) * layers)
    assert plan.predicted.step_time_s > 0


def test_the_ilp_weighs_ring_against_gather(tiny) -> None:
    """On 2x2 devices of slow compute every hop hides behind its step's block compute
    (op_comm_seconds 0), so with both variants offered the planner takes the ring over both
    axes, where the gather alone takes heads x sequence; the plan with both is never slower than
    with either alone (the ILP weighs them by the same prices)."""
    mesh = Mesh((2, 2), cluster="stress")
    plans = {cp: plan_traced(tiny, mesh, model_name="llama-tiny", context_parallel=cp)
             for cp in ("on", "gather", "ring")}
    kernels = {cp: {s.kernel for k, s in p.strategies().items() if k.startswith("scaled_dot")}
               for cp, p in plans.items()}
    assert kernels == {"on": {"cp_ring"}, "gather": {"cp_gather"}, "ring": {"cp_ring"}}
    step = {cp: p.predicted.step_time_s for cp, p in plans.items()}
    assert step["on"] <= min(step["gather"], step["ring"]) * (1 + 1e-9)
    pricer = Pricer(tiny, mesh, PlanOptions(context_parallel="on"))
    node = next(n for n in tiny.graph.nodes if n.target is SDPA)
    ring = plans["on"].strategies()[node.name]
    assert pricer.op_comm_seconds(node.name, ring) == 0.0
    assert len(pricer.op_charges(node.name, ring)) == 3 * 4 - 2


# ---- numerical: gloo ranks against one device ----------------------------------------------

GLOO = [((2, 2), (0,)), ((4,), (0,)), ((2, 2), (0, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("shape,axes", GLOO, ids=["ring2-x-2", "ring4", "ring2x2"])
def test_ring_attention_equals_single_device(world4, tiny, shape, axes) -> None:
    """llama-tiny (causal, 4 heads over 2 K/V heads) with its sequence sharded 2 ways (beside
    the planner's choice on the other axis), 4 ways on one axis, and 2x2 ways (one ring over
    both axes): loss and every gradient within 1e-5 of one device, every hop run as planned,
    byte for byte."""
    mesh = Mesh(shape, cluster="stress")
    plan = plan_traced(tiny, mesh, fixed=ring_pins(tiny, mesh, axes), model_name="llama-tiny",
                       context_parallel="on")
    assert any(n.kernel == "cp_ring" for n in plan.nodes)
    reports = world4.run(verify_rank, VerifySpec("llama-tiny", plan.mesh_shape, plan.mesh_axes,
                                                 plan.dumps(), BATCH, SEQ, measure_memory=False))
    ok, text = summarize(reports, TOL)
    assert ok, text
    assert all(r["bytes"] == r["planned_bytes"] and not r["ledger_diff"] for r in reports)
    n = math.prod(shape[a] for a in axes)
    hops = [c for c in plan.collectives if c.kind == "send_recv"]
    assert len(hops) == (3 * n - 2) * sum(1 for x in tiny.graph.nodes if x.target is SDPA)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_ring_attention_in_checkpointed_layers(world4, tiny, recompute) -> None:
    """Four ways, every layer checkpointed: under "full" the ring's forward hops run again in
    backward (phase ``recompute``, as the plan lists them); under "selective" the replayed
    ring moves its blocks again uncounted, as the plan does not list them (docs/cost-model.md
    §8, §3.11). Loss and gradients within 1e-5 of one device either way."""
    mesh = Mesh((4,), cluster="stress")
    plan = plan_traced(tiny, mesh, fixed=ring_pins(tiny, mesh, (0,)), model_name="llama-tiny",
                       context_parallel="on", recompute=recompute)
    assert set(plan.recompute.values()) == {recompute}
    again = [c for c in plan.collectives if c.kind == "send_recv" and c.phase == "recompute"]
    layers = sum(1 for x in tiny.graph.nodes if x.target is SDPA)
    assert len(again) == (3 * layers if recompute == "full" else 0)
    reports = world4.run(verify_rank, VerifySpec("llama-tiny", plan.mesh_shape, plan.mesh_axes,
                                                 plan.dumps(), BATCH, SEQ, measure_memory=False))
    ok, text = summarize(reports, TOL)
    assert ok, text
    assert all(r["bytes"] == r["planned_bytes"] and not r["ledger_diff"] for r in reports)


def test_a_compiled_program_runs_the_ring_eagerly_between_its_regions() -> None:
    """codegen/compile.py: the ring's kernel sends point to point, which a traced graph cannot
    hold; it is a partition of its own, run eagerly, and the ops around it compile."""
    import torch.fx as fx

    from autoshard.codegen.compile import _partition
    from autoshard.codegen.ring import RingCall
    from autoshard.ops.ring import RingKernel
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.ops.aten.relu.default, (x,))
    r = g.call_function(RingCall(RingKernel(lambda ring, t: t, (0,), "cp_ring"), None, "n", ()),
                        (a, a, a))
    b = g.call_function(torch.ops.aten.relu.default, (r,))
    g.output(b)
    parts = _partition(g)
    assert parts[a.name][1] and parts[b.name][1] and not parts[r.name][1]
    assert len({parts[a.name][0], parts[r.name][0], parts[b.name][0]}) == 3


world2 = world_fixture(2, timeout_s=600)


# One causal grouped-query attention block and its projections (tests/data): the ring between two
# compiled regions, as in every layer of llama-tiny, whose other ops would only make inductor
# compile longer (each region's forward and backward on each rank).
ATTENTION = f"{Path(__file__).parent / 'data' / 'ring_attention_model.py'}:make"


@pytest.mark.slow
def test_compiled_program_with_the_ring_equals_the_eager_one(world2) -> None:
    """``compile=True``: the regions around the ring compile, the ring runs eagerly between
    them; loss, gradients and the collectives (the hops among them) as the eager program's."""
    traced = trace(*build(ATTENTION, None, None, 0))
    mesh = Mesh((2,), cluster="stress")
    plan = plan_traced(traced, mesh, fixed=ring_pins(traced, mesh, (0,)), model_name=ATTENTION,
                       context_parallel="on")
    assert sum(c.kind == "send_recv" for c in plan.collectives) == 3 * 2 - 2
    reports = world2.run(verify_rank, VerifySpec(ATTENTION, plan.mesh_shape, plan.mesh_axes,
                                                 plan.dumps(), None, None, measure_memory=False,
                                                 compile=True))
    ok, text = summarize(reports, TOL)
    assert ok, text
    # The projections before the ring, the output projection and the loss after it.
    assert all(r["compiled"]["regions"] == 2 and not r["compiled"]["fallbacks"] for r in reports)
    assert all(r["bytes"] == r["planned_bytes"] and not r["ledger_diff"] for r in reports)


@pytest.mark.parametrize("causal", [True, False])
def test_the_fp32_block_fallback_matches_the_flash_kernel(causal) -> None:
    """Where no flash kernel applies (fp32 on CUDA, other devices) the blocks run in plain fp32
    torch (ops/ring.py ``_math_forward``/``_math_backward``): on the CPU they agree with the
    flash kernel's output, log-sum-exp and gradients, given a merged output and log-sum-exp
    (what the ring's backward passes)."""
    from autoshard.ops import ring
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64) for _ in range(4))
    out, lse, _ = ring._flash_forward(q, k, v, causal, 0.4)
    mout, mlse = ring._math_forward(q, k, v, causal, 0.4)
    assert torch.allclose(out, mout) and torch.allclose(lse, mlse)
    lse2 = lse + 0.3                 # as if another block shared the softmax
    want = ring._flash_backward(dout, q, k, v, out, lse2, causal, 0.4, ())
    got = ring._math_backward(dout, q, k, v, out, lse2, causal, 0.4)
    assert all(torch.allclose(a, b) for a, b in zip(want, got))


def test_the_ring_on_the_fallback_blocks_matches_single_device(monkeypatch) -> None:
    """The whole ring (forward and backward, 4 simulated ranks, GQA, causal) on the fp32
    fallback blocks instead of the CPU flash kernel."""
    from autoshard.ops import ring
    monkeypatch.setattr(ring, "_flash_forward", lambda q, k, v, c, s: (
        *ring._math_forward(q, k, v, c, s), ()))
    monkeypatch.setattr(ring, "_flash_backward", lambda g, q, k, v, o, l, c, s, e:
                        ring._math_backward(g, q, k, v, o, l, c, s))
    args, kwargs, info = _sdpa((1, 4, 16, 8), (1, 2, 16, 8), is_causal=True, enable_gqa=True)
    for st in _ring(info, (4,)):
        assert not check_strategy(SDPA, args, kwargs, st, (4,)), str(st)
