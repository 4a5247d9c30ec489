"""The vocabulary-parallel cross-entropy (ops/loss.py; Shoeybi et al. 2019 §3, torchtitan's loss
parallel; docs/cost-model.md §3.8): logits sharded on the class dim, the softmax's max and
sum-exp all-reduced across the axis (one value per row), never the b·s·V logits gathered.

- closed form: the bytes of the loss's own all-reduces, and their price;
- structural: GPT-2 124M on 8 devices, with its head sharded over the vocabulary, plans the
  vocab-parallel loss and moves no collective of b·s·V/2 elements or more;
- numerical: gloo ranks run such plans with the single-device model's loss and gradients
  (1e-5) and the plan's collectives byte for byte (``autoshard.tools.verify``).

The rule itself (every strategy, forward and backward, with label smoothing and ignored targets,
on meshes up to (2, 2, 2)) is checked by tests/test_rules.py and tests/test_dtypes.py.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import autoshard.ops.loss as loss_rules
from autoshard import Mesh, PlanOptions
from autoshard.cost.comm import collective_time
from autoshard.cost.price import Pricer
from autoshard.ir import Replicate, Shard, Strategy, op_info
from autoshard.ops.registry import OpCollective, op_collectives, strategies_for
from autoshard.plans import Plan
from autoshard.solver.baselines import baseline_pins
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import TracedGraph, trace
from autoshard.trace.export import op_info as node_info
from autoshard.tools.verify import VerifySpec, build, summarize, verify_rank
from autoshard.zoo.models import GPT
from autoshard.zoo.registry import ZOO, get_model
from dist import world_fixture

aten = torch.ops.aten
CE = aten.cross_entropy_loss.default
CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
TOL = 1e-5

world4 = world_fixture(4, timeout_s=300)


def _ce_info(rows: int, classes: int, dtype: torch.dtype = torch.float32):
    x = torch.empty(rows, classes, dtype=dtype, device="meta")
    t = torch.empty(rows, dtype=torch.int64, device="meta")
    return op_info(CE, (x, t), {}, CE(x, t))


def _vocab_strategy(info, mesh_shape: tuple, spec: tuple) -> Strategy:
    (s,) = [s for s in strategies_for(info, mesh_shape)
            if s.kernel == "vocab_parallel" and s.inputs[0] == spec]
    return s


# ------------------------------------------------------------------------------ closed form

@pytest.mark.parametrize("dtype,itemsize", [(torch.float32, 4), (torch.bfloat16, 4),
                                            (torch.float64, 8)])
def test_loss_all_reduces_move_one_value_per_row(dtype, itemsize) -> None:
    """b·s = 8192 rows of V = 50304 classes on 8 devices: a max and a sum-exp all-reduce of
    b·s values each (fp32 at least: the statistics are reduced upcast, as Megatron does)."""
    b_s, v = 8 * 1024, 50304
    info = _ce_info(b_s, v, dtype)
    s = _vocab_strategy(info, (8,), (Shard(1),))
    assert str(s) == "[S(1)] x [R] -> [P] (vocab_parallel)"
    assert s.compute_scale == 1 / 8
    assert op_collectives(info, s, (8,)) == (OpCollective("all_reduce", 0, b_s * itemsize),) * 2


def test_loss_all_reduces_on_two_axes() -> None:
    """Rows over the first axis and classes over the second: the rank's b·s/2 rows, over the
    second axis only. Classes over both axes: each reduction runs over one axis, then the other."""
    b_s, v = 4096, 64
    info = _ce_info(b_s, v)
    rows_vocab = _vocab_strategy(info, (2, 4), (Shard(0), Shard(1)))
    assert op_collectives(info, rows_vocab, (2, 4)) == (
        OpCollective("all_reduce", 1, b_s // 2 * 4),) * 2
    both = _vocab_strategy(info, (2, 4), (Shard(1), Shard(1)))
    assert [(c.axis, c.nbytes) for c in op_collectives(info, both, (2, 4))] == [
        (0, b_s * 4), (1, b_s * 4), (0, b_s * 4), (1, b_s * 4)]
    # Classes over an axis of one device are whole: not offered (the replicated strategy is
    # that one, priced as such).
    assert not [s for s in strategies_for(info, (1, 4))
                if s.kernel == "vocab_parallel" and s.inputs[0][0] == Shard(1)]


def test_other_strategies_run_no_collective_inside() -> None:
    info = _ce_info(64, 16)
    others = [s for s in strategies_for(info, (4,)) if s.kernel != "vocab_parallel"]
    assert others and all(op_collectives(info, s, (4,)) == () for s in others)


@pytest.fixture(scope="module")
def tiny() -> TracedGraph:
    model, inputs = build("gpt2-tiny", None, None, 0)
    return trace(model, inputs)


def _loss_node(traced: TracedGraph):
    return next(n for n in traced.graph.nodes if n.target == CE)


def test_loss_all_reduces_are_priced_as_all_reduces(tiny) -> None:
    """docs/cost-model.md §1.1's ring all-reduce, twice, on the axis's link; blocking, and on
    top of the op's compute."""
    mesh = Mesh((4,), cluster=CLUSTER)
    pricer = Pricer(tiny, mesh, PlanOptions())
    node = _loss_node(tiny)
    s = _vocab_strategy(node_info(node), (4,), (Shard(1),))
    rows = 4 * 16                                    # gpt2-tiny: batch 4, sequence 16
    link = mesh.links[0]
    want = 2 * collective_time("all_reduce", 4, rows * 4, link.alpha, link.bandwidth)
    assert pricer.op_comm_seconds(node.name, s) == pytest.approx(want, rel=1e-12)
    assert [(st.kind, st.nbytes) for st in pricer.op_steps(node.name, s)] == [
        ("all_reduce", rows * 4)] * 2
    rows_only = next(st for st in strategies_for(node_info(node), (4,))
                     if st.kernel == "loss_rows")
    assert pricer.op_comm_seconds(node.name, rows_only) == 0.0


# ------------------------------------------------------------------------------ pins

def _table(traced: TracedGraph) -> str:
    """The vocabulary table: the parameter an embedding looks rows up in (tied to the head)."""
    for n in traced.graph.nodes:
        if n.target is aten.embedding.default and n.args[0].name in {p.name for p in traced.params}:
            info = traced.placeholder(n.args[0].name).info
            if info.shape[0] == _loss_node(traced).args[0].meta["val"].shape[1]:
                return n.args[0].name
    raise AssertionError("no vocabulary table")


def vocab_pins(traced: TracedGraph, mesh: Mesh, loss: str | None) -> dict[str, Strategy]:
    """Megatron-LM's layout (tensor parallel over the last axis, data parallel over the
    others) with its vocabulary table sharded by rows, as Megatron shards it: over the last
    axis, or, given ``loss`` (the loss's strategy, pinned: on a tiny model the solver rightly
    prefers one exchange of the small logits to three latency-bound all-reduces), over the axes
    that strategy shards the classes on, the head pinned to read it so (column parallel over
    the vocabulary, its tokens split as the loss splits rows)."""
    pins = baseline_pins(traced, mesh, "megatron-dp")
    table = _table(traced)
    last = (Replicate(),) * (mesh.ndim - 1) + (Shard(0),)
    if loss is None:
        pins[table] = Strategy((), (last,))
        return pins
    node = _loss_node(traced)
    (pins[node.name],) = [s for s in strategies_for(node_info(node), mesh.shape) if str(s) == loss]
    logits = pins[node.name].inputs[0]
    rows = tuple(Shard(0) if p == Shard(1) else Replicate() for p in logits)
    tokens = tuple(Shard(0) if p == Shard(0) else Replicate() for p in logits)
    pins[table] = Strategy((), (rows,))
    aliases = {p.name for p in traced.params if p.fqn == traced.placeholder(table).fqn}
    head = next(n for n in traced.graph.nodes if n.target is aten.linear.default
                and n.args[1].name in aliases)
    (pins[head.name],) = [s for s in strategies_for(node_info(head), mesh.shape)
                          if s.inputs[:2] == (tokens, rows)]
    return pins


def _loss_records(plan: Plan, traced: TracedGraph):
    """The collectives the loss runs inside itself (reshards into it have another value)."""
    name = _loss_node(traced).name
    return [c for c in plan.collectives if c.node == name and c.value == name]


# ------------------------------------------------------------------------------ structural

@pytest.fixture(scope="module")
def gpt2_v50304() -> TracedGraph:
    """GPT-2 124M with its vocabulary padded to 50304 (a multiple of 8 and of 128, as
    Megatron's make-vocab-size-divisible-by and nanoGPT pad it), batch 8 x 1024 tokens."""
    cfg = dataclasses.replace(ZOO["gpt2"].config, vocab_size=50304)
    with torch.device("meta"):
        model = GPT(cfg)
    return trace(model, model.example_inputs(8, 1024))


def _elements(c, plan_dtypes: dict[str, int]) -> int:
    """Elements a collective moves: its bytes over its value's itemsize (a gradient bucket
    holds the bf16 model's gradients)."""
    return c.bytes // plan_dtypes.get(c.value, 2)


def _itemsizes(traced: TracedGraph) -> dict[str, int]:
    out = {}
    for n in traced.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out[n.name] = v.dtype.itemsize
    return out


def _largest_elements(plan: Plan, traced: TracedGraph) -> int:
    sizes = _itemsizes(traced)
    return max(_elements(c, sizes) for c in plan.collectives)


def _logits_moves(plan: Plan, traced: TracedGraph) -> list:
    logits = _loss_node(traced).args[0].name
    return [c for c in plan.collectives if c.value == logits]


@pytest.mark.parametrize("cluster", ["cpu", "h100"])
def test_gpt2_vocab_sharded_head_plans_the_vocab_parallel_loss(gpt2_v50304, cluster) -> None:
    """The head sharded over the vocabulary on 8 devices: the solver picks the vocab-parallel
    loss (nothing pinned but the parameters), whose two all-reduces move b·s fp32 values; the
    logits never move and no collective moves b·s·V/2 elements or more. The ILP's objective is
    the plan's price, the loss's collectives included."""
    traced, mesh = gpt2_v50304, Mesh((8,), cluster=cluster)
    plan = plan_traced(traced, mesh, fixed=vocab_pins(traced, mesh, None), model_name="gpt2")
    b_s, v = 8 * 1024, 50304
    loss = plan.strategies()[_loss_node(traced).name]
    assert plan.params["tok_emb.weight"] == (Shard(0),)
    assert loss.kernel == "vocab_parallel" and loss.inputs[0] == (Shard(1),), str(loss)
    assert [(c.kind, c.bytes, c.phase) for c in _loss_records(plan, traced)] == [
        ("all_reduce", b_s * 4, "forward")] * 2
    assert _logits_moves(plan, traced) == []
    assert _largest_elements(plan, traced) < b_s * v // 2
    assert plan.solver["objective"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


def test_without_the_vocab_parallel_loss_the_logits_move(gpt2_v50304, monkeypatch) -> None:
    """The same layout when the loss cannot read sharded classes: the logits are exchanged
    for rows, b·s·V/8 elements per device in forward and again in backward."""
    monkeypatch.setattr(loss_rules, "_vocab_parallel_ok", lambda op: False)
    traced, mesh = gpt2_v50304, Mesh((8,), cluster="h100")
    plan = plan_traced(traced, mesh, fixed=vocab_pins(traced, mesh, None), model_name="gpt2")
    assert plan.strategies()[_loss_node(traced).name].kernel != "vocab_parallel"
    moves = _logits_moves(plan, traced)
    assert moves and all(c.bytes // 2 >= 8 * 1024 * 50304 // 8 for c in moves)


@pytest.mark.slow
def test_gpt2_free_plan_shards_head_and_loss_together() -> None:
    """Unpinned, one sequence of 1024 tokens on 8 H100s: the solver shards the table by rows
    and then reads the logits vocab-parallel."""
    model_cfg = dataclasses.replace(ZOO["gpt2"].config, vocab_size=50304)
    with torch.device("meta"):
        model = GPT(model_cfg)
    traced = trace(model, model.example_inputs(1, 1024))
    plan = plan_traced(traced, Mesh((8,), cluster="h100"), model_name="gpt2")
    loss = plan.strategies()[_loss_node(traced).name]
    assert plan.params["tok_emb.weight"] == (Shard(0),)
    assert loss.kernel == "vocab_parallel", str(loss)
    assert not any(c.node == _loss_node(traced).name and c.kind == "all_gather"
                   for c in plan.collectives)


@pytest.fixture(scope="module")
def gpt2_v50257() -> TracedGraph:
    """GPT-2 as published, batch 8 x 1024, on the meta device: traced once for both clusters."""
    model, inputs = get_model("gpt2", batch=8, seq=1024)
    return trace(model, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("cluster", ["cpu", "h100"])
def test_gpt2_vocab_50257_on_eight_moves_no_logits(gpt2_v50257, cluster) -> None:
    """GPT-2 as published (vocabulary 50257, which 8 does not divide, so no plan shards it):
    still no collective of b·s·V/2 elements or more."""
    traced = gpt2_v50257
    plan = plan_traced(traced, Mesh((8,), cluster=cluster), model_name="gpt2")
    assert _largest_elements(plan, traced) < 8 * 1024 * 50257 // 2


# ------------------------------------------------------------------------------ numerical

GLOO = [("gpt2-tiny", (4,), "[S(1)] x [R] -> [P] (vocab_parallel)"),
        ("hf-gpt2-tiny", (2, 2), "[S(0), S(1)] x [R, R] -> [P, P] (vocab_parallel)"),
        ("gpt2-tiny", (2, 2), "[S(1), S(1)] x [R, R] -> [P, P] (vocab_parallel)")]


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,loss", GLOO, ids=[
    f"{m}-{'x'.join(map(str, s))}-{i}" for i, (m, s, _) in enumerate(GLOO)])
def test_vocab_parallel_plan_equals_single_device(world4, model, shape, loss) -> None:
    """The loss reads the logits sharded on the vocabulary (the head's table sharded by rows):
    loss and every gradient within 1e-5 of one device, every collective run as planned (the
    loss's all-reduces included), and the logits never moved."""
    m, inputs = build(model, None, None, 0)
    traced = trace(m, inputs)
    mesh = Mesh(shape, cluster=CLUSTER)
    plan = plan_traced(traced, mesh, fixed=vocab_pins(traced, mesh, loss), model_name=model)
    node = _loss_node(traced)
    assert str(plan.strategies()[node.name]) == loss
    vocab_axes = sum(p == Shard(1) for p in plan.strategies()[node.name].inputs[0])
    assert [c.kind for c in _loss_records(plan, traced)] == ["all_reduce"] * 2 * vocab_axes
    assert _logits_moves(plan, traced) == []
    reports = world4.run(verify_rank, VerifySpec(model, plan.mesh_shape, plan.mesh_axes,
                                                 plan.dumps(), measure_memory=False))
    ok, text = summarize(reports, TOL)
    assert ok, text
    assert all(not r["ledger_diff"] for r in reports)
