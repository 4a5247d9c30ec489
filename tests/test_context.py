"""Context parallelism: attention's query sequence sharded over a mesh axis in the causal
load-balanced layout (ir.py ``ZIGZAG``; ops/attention.py ``cp_gather``; trace/sequence.py;
docs/cost-model.md §3.11).

- closed form: the layout's chunks, the balanced causal work per rank, the priced FLOPs;
- rule: every context-parallel strategy against single-device attention, forward and backward;
- structural: a llama-tiny plan with its attention context parallel gathers K and V (and
  reduce-scatters their gradients) and moves no other activation along the sequence;
- numerical: gloo ranks run llama-tiny (causal, grouped-query) with the sequence sharded 2 and
  4 ways, loss and every gradient within 1e-5 of one device, run-time bytes equal to the plan.
"""
from __future__ import annotations

import pytest
import torch

from autoshard import Mesh
from autoshard.errors import AutoshardError
from autoshard.ir import (ZIGZAG, Replicate, Shard, op_info, parse_spec, spec_str,
                          to_group_major, to_rank_major)
from autoshard.ops.attention import SDPA, sdpa_flops
from autoshard.ops.registry import strategies_for
from autoshard.ops.simulate import check_strategy, shard_tensor
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import TracedGraph, trace
from autoshard.trace.export import op_info as node_info
from autoshard.tools.verify import VerifySpec, build, summarize, verify_rank
from autoshard.zoo.registry import get_model
from dist import world_fixture

ZZ = Shard(2, ZIGZAG)
TOL = 1e-5          # fp32 on gloo
BATCH, SEQ = 1, 16  # one sequence: the loss's rows are the sequence, sharded with it

world4 = world_fixture(4, timeout_s=600)


# ---- closed form ---------------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 4])
def test_zigzag_gives_rank_r_chunks_r_and_2n_minus_1_minus_r(n) -> None:
    x = torch.arange(4 * n)
    for r in range(n):
        got = shard_tensor(x, (Shard(0, ZIGZAG),), (n,), (r,)).tolist()
        assert got == [*range(2 * r, 2 * r + 2), *range(2 * (2 * n - 1 - r), 2 * (2 * n - r))]
    assert torch.equal(to_group_major(to_rank_major(x, 0, n, ZIGZAG), 0, n, ZIGZAG), x)


def test_zigzag_over_two_axes_nests_as_one_axis_of_their_product() -> None:
    x = torch.arange(16)
    two = [shard_tensor(x, (Shard(0, ZIGZAG),) * 2, (2, 2), c).tolist()
           for c in [(0, 0), (0, 1), (1, 0), (1, 1)]]
    one = [shard_tensor(x, (Shard(0, ZIGZAG),), (4,), (r,)).tolist() for r in range(4)]
    assert two == one
    assert spec_str((ZZ, Replicate())) == "[S(2/zz), R]"
    assert parse_spec("[S(2/zz), R]") == (ZZ, Replicate())


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n) -> None:
    """Under a causal mask a query at position i reads i + 1 keys: every rank's two chunks read
    the same number, 1/n of the whole; contiguous chunks would give the last rank 2n-1 times
    the first's."""
    c, s = 4, 8 * n
    pos = torch.arange(s)
    work = [int((shard_tensor(pos, (Shard(0, ZIGZAG),), (n,), (r,)) + 1).sum()) for r in range(n)]
    assert len(set(work)) == 1 and work[0] * n == s * (s + 1) // 2
    contiguous = [int((pos.chunk(n)[r] + 1).sum()) for r in range(n)]
    assert contiguous[-1] > contiguous[0] * (2 * n - 1) - 2 * c * n


def _sdpa(shape_q=(1, 4, 16, 8), shape_kv=(1, 4, 16, 8), **kwargs):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64)
               for s in (shape_q, shape_kv, shape_kv))
    return (q, k, v), kwargs, op_info(SDPA, (q, k, v), kwargs, SDPA(q, k, v, **kwargs))


def test_context_parallel_work_is_one_nth_of_the_causal_count() -> None:
    """FLOPs of causal attention are half the full score matrix's (FlashAttention-2's count);
    the zigzag strategy does 1/n of them on each rank."""
    _, _, causal = _sdpa(is_causal=True)
    _, _, full = _sdpa()
    b, h, s, d = 1, 4, 16, 8
    assert sdpa_flops(full) == 4 * b * h * s * s * d
    assert sdpa_flops(causal) == sdpa_flops(full) / 2
    (st,) = [s for s in strategies_for(causal, (4,)) if s.kernel == "cp_gather"]
    assert str(st) == "[S(2/zz)] x [R] x [R] -> [S(2/zz)] (cp_gather)"
    assert st.compute_scale == 1 / 4


# ---- the rule against single-device attention ---------------------------------------------

CASES = [dict(is_causal=True), dict(), dict(is_causal=True, scale=0.3)]


@pytest.mark.parametrize("mesh", [(2,), (4,), (2, 2)])
@pytest.mark.parametrize("kwargs", CASES, ids=["causal", "full", "causal-scale"])
def test_context_parallel_strategies_match_single_device(mesh, kwargs) -> None:
    args, kwargs, info = _sdpa(**kwargs)
    cps = [s for s in strategies_for(info, mesh) if s.kernel == "cp_gather"]
    assert cps
    for st in cps:
        assert not check_strategy(SDPA, args, kwargs, st, mesh), str(st)


def test_grouped_query_attention_shards_its_sequence_too() -> None:
    args, kwargs, info = _sdpa((1, 4, 16, 8), (1, 2, 16, 8), is_causal=True, enable_gqa=True)
    cps = [s for s in strategies_for(info, (2, 2)) if s.kernel == "cp_gather"]
    assert any(s.inputs[1] == (Replicate(), Shard(1)) for s in cps)     # CP x heads
    for st in cps:
        assert not check_strategy(SDPA, args, kwargs, st, (2, 2)), str(st)


def test_no_context_parallel_with_a_mask_tensor_or_dropout() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, 4, generator=g)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    masked = op_info(SDPA, (q, q, q, mask), {}, SDPA(q, q, q, mask))
    assert not any(s.kernel for s in strategies_for(masked, (2,)))
    drop = op_info(SDPA, (q, q, q), {"dropout_p": 0.1}, SDPA(q, q, q))
    assert not any(s.kernel for s in strategies_for(drop, (2,)))


# ---- planning llama-tiny with its attention context parallel -------------------------------

def cp_pins(traced: TracedGraph, mesh: Mesh, axes: tuple[int, ...]) -> dict:
    """Every attention op pinned to ``cp_gather`` over exactly ``axes`` (the other axes: its
    cheapest choice); everything else is the planner's. On a tiny model the planner rightly
    prefers other layouts, whose latency is lower: the pins prove the runtime."""
    pins = {}
    for n in traced.graph.nodes:
        if n.target is SDPA:
            pins[n.name] = next(
                s for s in strategies_for(node_info(n), mesh.shape) if s.kernel == "cp_gather"
                and all((s.inputs[0][a] == ZZ) == (a in axes) for a in range(mesh.ndim))
                and all(s.inputs[0][a] == Replicate() or a in axes for a in range(mesh.ndim)))
    return pins


@pytest.fixture(scope="module")
def tiny() -> TracedGraph:
    model, inputs = build("llama-tiny", BATCH, SEQ, 0)
    return trace(model, inputs)


def test_sequence_marks_reach_the_inputs_and_the_loss(tiny) -> None:
    ids, labels = tiny.inputs
    assert ids.info.groups == ((1, ZIGZAG),)        # token ids: sharded in the balanced layout
    assert labels.info.groups == ()                 # the loss takes its targets whole (mean)
    loss = next(n for n in tiny.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default)
    assert node_info(loss).inputs[0].groups == ((0, ZIGZAG),)


def test_context_parallel_plan_gathers_only_k_and_v(tiny) -> None:
    """Four ways over one axis: per layer, K and V gathered (b·s·h_kv·d each: grouped-query
    attention reads its 2 K/V heads) and their gradients reduce-scattered; the residual stream
    and the MLP stay on their sequence shards (no other collective of an activation along the
    sequence; the loss may take the small logits whole, as the planner prices it)."""
    mesh = Mesh((4,), cluster="stress")
    plan = plan_traced(tiny, mesh, fixed=cp_pins(tiny, mesh, (0,)), model_name="llama-tiny",
                       context_parallel="on")
    kv = BATCH * 2 * SEQ * 8 * 4            # [b, kv heads, s, head_dim] fp32
    at_attention = [c for c in plan.collectives if c.node.startswith("scaled_dot_product")]
    assert sorted((c.phase, c.kind, c.bytes) for c in at_attention) == sorted(
        [("forward", "all_gather", kv)] * 4 + [("backward", "reduce_scatter", kv)] * 4)
    big = [c for c in plan.collectives if c.phase in ("forward", "backward")
           and c.bytes >= BATCH * SEQ * 32 * 4
           and not c.node.startswith(("scaled_dot_product", "cross_entropy"))]
    assert big == [], [str(c) for c in big]


CP_X_HEADS = "[S(2/zz), S(1)] x [R, S(1)] x [R, S(1)] -> [S(2/zz), S(1)] (cp_gather)"


def test_the_planner_takes_context_and_tensor_parallelism_per_axis(tiny) -> None:
    """One sequence, 2 K/V heads: on 2x2 devices of slow compute the planner splits the heads
    over one axis (all they allow) and the sequence over the other, unpinned (with the K/V
    all-gather the only variant: ring attention, whose hops hide behind this cluster's slow
    compute, would win, tests/test_ring.py)."""
    plan = plan_traced(tiny, Mesh((2, 2), cluster="stress"), model_name="llama-tiny",
                       context_parallel="gather")
    attention = {str(s) for k, s in plan.strategies().items() if k.startswith("scaled_dot")}
    assert attention == {CP_X_HEADS}


# ---- numerical: gloo ranks against one device ----------------------------------------------

GLOO = [((4,), (0,)), ((2, 2), None), ((2, 2), (0, 1))]


@pytest.mark.slow
@pytest.mark.parametrize("shape,axes", GLOO, ids=["cp4", "cp2-tp2-planned", "cp2x2"])
def test_context_parallel_equals_single_device(world4, tiny, shape, axes) -> None:
    """llama-tiny (causal, 4 heads over 2 K/V heads) with its sequence sharded 4 ways on one
    axis, 2 ways beside 2-way heads (the planner's own plan), and 2x2 ways: loss and every
    gradient within 1e-5 of one device, every collective run as planned, byte for byte."""
    mesh = Mesh(shape, cluster="stress")
    pins = cp_pins(tiny, mesh, axes) if axes else None
    plan = plan_traced(tiny, mesh, fixed=pins, model_name="llama-tiny",
                       context_parallel="gather")
    if axes is None:
        assert CP_X_HEADS in {str(s) for s in plan.strategies().values()}
    reports = world4.run(verify_rank, VerifySpec("llama-tiny", plan.mesh_shape, plan.mesh_axes,
                                                 plan.dumps(), BATCH, SEQ, measure_memory=False))
    ok, text = summarize(reports, TOL)
    assert ok, text
    assert all(r["bytes"] == r["planned_bytes"] for r in reports)


# ---- the context of a zoo model --------------------------------------------------------------

def test_seq_above_the_context_names_the_config_field() -> None:
    with pytest.raises(AutoshardError, match=r"LlamaConfig\.context.*--context 32"):
        get_model("llama-tiny", batch=1, seq=32)
    model, (ids, _) = get_model("llama-tiny", batch=1, seq=32, context=32)
    assert model.config.context == 32 and ids.shape == (1, 32)
    with pytest.raises(AutoshardError, match="context"):
        get_model("mlp-tiny", context=32)


def test_plan_cli_names_the_context_and_its_flag(capsys) -> None:
    from autoshard.tools.cli import main
    assert main(["plan", "llama-tiny", "--mesh", "2", "--batch", "1", "--seq", "32"]) == 2
    err = capsys.readouterr().err
    assert "LlamaConfig.context" in err and "--context 32" in err and "Traceback" not in err
    assert main(["plan", "llama-tiny", "--mesh", "2", "--context", "8", "--seq", "16"]) == 2
    assert "1..8" in capsys.readouterr().err


def test_context_parallelism_is_offered_from_a_long_sequence_or_when_asked(tiny) -> None:
    """PlanOptions.context_parallel: "auto" offers the zigzag layouts only from
    CONTEXT_PARALLEL_TOKENS keys (llama-tiny's 16 are far below), "on" always."""
    from autoshard.ir import ZIGZAG

    def zigzags(plan) -> int:
        return sum(isinstance(p, Shard) and p.groups == ZIGZAG
                   for n in plan.nodes for spec in (*n.inputs, *n.outputs) for p in spec)
    mesh = Mesh((2, 2), cluster="stress")
    assert zigzags(plan_traced(tiny, mesh, model_name="llama-tiny")) == 0
    assert zigzags(plan_traced(tiny, mesh, model_name="llama-tiny", context_parallel="on")) > 0

