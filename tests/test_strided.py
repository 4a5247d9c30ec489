"""Strided shards of fused projections (ir.py ``Shard(dim, groups)``, trace/fused.py).

A fused projection's output is split into groups (GPT-2's ``c_attn`` into Q, K and V; Phi-3's
``qkv_proj`` into Q, K, V of 2:1:1 widths under grouped-query attention, its ``gate_up_proj``
into gate and up). Megatron shards such a weight so that each rank holds its part of every group
(Shoeybi et al. 2019, arXiv 1909.08053, §3): then the split moves nothing.

- closed form: the layout, its spelling, what fits; the steps of a reshard;
- rules: every strategy with a strided shard equals the single-device op (values and
  gradients, on a simulated mesh);
- structural: the dims the pass marks; HF GPT-2 124M on 4 devices sends Megatron's bytes per
  block, 8·b·s·h·(t-1)/t elements (Korthikanti et al. 2022, arXiv 2205.05198, §4.2.2),
  with no all-to-all between the fused projection and the attention;
- numerical: on gloo ranks the fused layouts train as the single-device model (loss,
  gradients), and the runtime cuts and reassembles strided parameters, from real and from meta
  tensors.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

import autoshard.ops  # noqa: F401  (registers every rule)
from autoshard import Mesh, Plan
from autoshard.tools.cli import main
from autoshard.cost.comm import reshard
from autoshard.errors import AutoshardError
from autoshard.ir import (Replicate, Shard, TensorInfo, op_info, parse_placement, spec_fits,
                          to_group_major, to_rank_major)
from autoshard.ops.registry import strategies_for
from autoshard.ops.simulate import check_strategy, shard_tensor, unshard
from autoshard.trace.export import trace
from dist import world_fixture

aten = torch.ops.aten
QKV = (1, 1, 1)
GQA = (2, 1, 1)


# -- closed form -------------------------------------------------------------------------------

def test_a_strided_shard_is_spelled_parsed_and_fitted() -> None:
    for p in (Shard(1, QKV), Shard(0, GQA), Shard(2)):
        assert parse_placement(str(p)) == p
    assert str(Shard(1, QKV)) == "S(1/3)" and str(Shard(0, GQA)) == "S(0/2+1+1)"
    with pytest.raises(ValueError, match="lowest terms"):
        Shard(0, (2, 2))
    assert spec_fits((4, 12), (Shard(1, QKV),), (4,))           # groups of 4, 1 each
    assert not spec_fits((4, 12), (Shard(1, QKV),), (3,))       # 4 does not split 3 ways
    assert not spec_fits((4, 12), (Shard(1, QKV), Shard(1)), (2, 2))   # mixed on one dim
    assert spec_fits((4, 16), (Shard(1, GQA), Shard(1, GQA)), (2, 2))


def test_each_rank_holds_its_part_of_every_group() -> None:
    """Q|K|V of 8|4|4 elements on 2 x 2 ranks (both axes on the dim, row-major inside each
    group): rank (1, 0) holds piece 2 of 4 of each group."""
    full = torch.arange(16.)
    spec, mesh = (Shard(0, GQA), Shard(0, GQA)), (2, 2)
    assert shard_tensor(full, spec, mesh, (1, 0)).tolist() == [4., 5., 10., 14.]
    pieces = {c: shard_tensor(full, spec, mesh, c) for c in itertools.product(range(2), range(2))}
    assert torch.equal(unshard(pieces, spec, mesh), full)
    x = torch.arange(24.).view(2, 12)
    assert torch.equal(to_group_major(to_rank_major(x, 1, 2, QKV), 1, 2, QKV), x)


def test_a_strided_gather_moves_the_bytes_of_a_contiguous_one() -> None:
    """S(1/3) -> R: one all-gather of the whole tensor, its groups noted for the reorder; the
    gradient goes back by the adjoint slice, strided alike."""
    r = reshard((Shard(1, QKV),), (Replicate(),), (8, 12), 4, (4,))
    plain = reshard((Shard(1),), (Replicate(),), (8, 12), 4, (4,))
    (fwd,), (bwd,) = r.forward, r.backward
    assert (fwd.kind, fwd.groups, fwd.nbytes) == ("all_gather", QKV, plain.forward[0].nbytes)
    assert (bwd.kind, bwd.groups) == ("slice", QKV)
    a2a = reshard((Shard(1, QKV),), (Shard(0),), (8, 12), 4, (4,)).forward
    assert [(s.kind, s.groups, s.groups2) for s in a2a] == [("all_to_all", QKV, ())]


# -- rules -------------------------------------------------------------------------------------

g = torch.Generator().manual_seed(0)
X, W, B = (torch.randn(4, 6, generator=g), torch.randn(6, 12, generator=g),
           torch.randn(12, generator=g))
Y = torch.randn(2, 3, 16, generator=g)
# op, args, the marks of each tensor input, the marks of every output
CASES = {
    "addmm": (aten.addmm.default, (B, X, W), [((0, QKV),), (), ((1, QKV),)], ((1, QKV),)),
    "view": (aten.view.default, (X @ W, [2, 2, 12]), [((1, QKV),)], ((2, QKV),)),
    "t": (aten.t.default, (W,), [((1, QKV),)], ((0, QKV),)),
    # a fused QKV viewed as (3, heads, head_dim): its shards are the heads of each group
    "view-heads": (aten.view.default, (X @ W, [4, 3, 2, 2]), [((1, QKV),)], ()),
    "split": (aten.split.Tensor, (Y, 8, 2), [((2, (1, 1)),)], ()),
    "slice-q": (aten.slice.Tensor, (Y, 2, 0, 8), [((2, GQA),)], ()),
    "slice-v": (aten.slice.Tensor, (Y, -1, 12, 9223372036854775807), [((2, GQA),)], ()),
    "narrow-k": (aten.narrow.default, (Y, 2, 8, 4), [((2, GQA),)], ()),
    "chunk": (aten.chunk.default, (Y, 2, -1), [((2, (1, 1)),)], ()),
}


def _info(case: str):
    """The op's OpInfo with the marks trace/fused.py would give its tensors."""
    target, args, in_marks, out_marks = CASES[case]
    marks = iter(in_marks)
    args_i = tuple(TensorInfo(tuple(a.shape), a.dtype, next(marks))
                   if isinstance(a, torch.Tensor) else a for a in args)
    info = op_info(target, args, {}, target(*args))
    outs = tuple(TensorInfo(o.shape, o.dtype, out_marks) for o in info.outputs)
    return target, args, type(info)(target, args_i, {}, outs)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_strided_strategies_equal_the_single_device_op(case: str, mesh: tuple) -> None:
    target, args, info = _info(case)
    strided = [s for s in strategies_for(info, mesh)
               if any(isinstance(p, Shard) and p.groups
                      for spec in (*s.inputs, *s.outputs) if spec is not None for p in spec)]
    assert strided, f"{case}: no strided strategy offered"
    for s in strided:
        assert check_strategy(target, args, {}, s, mesh, atol=1e-6) == [], str(s)


# -- structural --------------------------------------------------------------------------------

def _groups_by_fqn(traced) -> dict:
    return {p.fqn: dict(p.info.groups) for p in traced.params if p.info and p.info.groups}


def test_the_pass_marks_fused_projections_back_to_their_weights() -> None:
    from test_baselines_structure import build
    got = _groups_by_fqn(trace(*build("phi3")))
    layer = "model.model.layers.1."
    assert got[layer + "self_attn.qkv_proj.weight"] == {0: GQA}      # 4 Q heads, 2 KV heads
    assert got[layer + "mlp.gate_up_proj.weight"] == {0: (1, 1)}
    gpt2 = _groups_by_fqn(trace(*build("hf-gpt2-tiny")))
    assert gpt2["model.transformer.h.0.attn.c_attn.weight"] == {1: QKV}
    assert gpt2["model.transformer.h.0.attn.c_attn.bias"] == {0: QKV}
    assert set(gpt2) == {f"model.transformer.h.{i}.attn.c_attn.{k}" for i in (0, 1)
                         for k in ("weight", "bias")}
    # GPT-NeoX interleaves heads ([h, 3, hd] per head): a contiguous shard is Megatron's
    assert _groups_by_fqn(trace(*build("gpt_neox"))) == {}


@pytest.fixture(scope="module")
def gpt2_124m_plan(tmp_path_factory) -> Plan:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config().to_dict()
    config.update(architectures=["GPT2LMHeadModel"], resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, torch_dtype="bfloat16")
    path = tmp_path_factory.mktemp("gpt2") / "config.json"
    path.write_text(json.dumps(config))
    out = path.parent / "plan.json"
    assert main(["plan", str(path), "--mesh", "4", "--cluster", "cpu", "--batch", "1",
                 "--seq", "1024", "--quiet", "-o", str(out)]) == 0
    return Plan.loads(out.read_text())


@pytest.mark.slow
def test_gpt2_124m_sends_megatrons_bytes_per_block(gpt2_124m_plan: Plan) -> None:
    """GPT-2 124M (b 1, s 1024, h 768, bf16) on 4 devices, cpu preset: ``c_attn`` strided as
    Megatron's, no all-to-all in any block, and every block's activation collectives send
    Megatron's 8·b·s·h·(t-1)/t elements per device within 2%: Megatron with sequence
    parallelism, a reduce-scatter and an all-gather where Megatron all-reduces, each way.

    The first block also gathers the causal mask (s·s booleans) that every block's attention
    reads: once for all twelve, a value the blocks share. (On a cluster whose gradient sync
    hides behind backward the planner instead ran the out-projection on sequence shards behind
    a small all-to-all, its weight's gradient synced in buckets; on CPU hosts nothing hides,
    docs/cost-model.md §7.)"""
    plan, t, (b, s, h), itemsize = gpt2_124m_plan, 4, (1, 1024, 768), 2
    blk = "model.transformer.h.0."
    assert plan.params[blk + "attn.c_attn.weight"] == (Shard(1, QKV),)
    assert plan.params[blk + "attn.c_attn.bias"] == (Shard(0, QKV),)
    megatron = 8 * b * s * h * (t - 1) / t
    extra = []
    for k, layer in enumerate(plan.layers):
        nodes = set(layer.nodes)
        block = [c for c in plan.collectives
                 if not c.members and c.phase in ("forward", "backward")
                 and (c.node in nodes or c.value in nodes)]
        assert not [c for c in block if c.kind == "all_to_all"], layer.name
        mask = [c for c in block if c.kind == "all_gather" and c.bytes == s * s
                and c.node.startswith("scaled_dot_product_attention")]
        extra += mask
        rest = [c for c in block if c not in mask]
        sent = sum(c.bytes * (2 if c.kind == "all_reduce" else 1) * (t - 1) / t for c in rest)
        assert abs(sent / itemsize - megatron) <= 0.02 * megatron, (layer.name, sent / itemsize)
    assert len(extra) == 1 and extra[0].phase == "forward"


# Published architectures at a size where 4 devices split a block (hidden 1024, one sequence
# of 1024 tokens): Phi-3 with grouped-query attention (16 query, 4 key-value heads: Q four
# times as wide as K and V) and GPT-NeoX (heads interleaved in its fused weight).
_BLOCK = {"hidden_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 16,
          "vocab_size": 4096, "max_position_embeddings": 1024, "bos_token_id": 0,
          "eos_token_id": 0, "torch_dtype": "bfloat16"}
FUSED_CONFIGS = {
    "phi3": ({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **_BLOCK,
              "num_key_value_heads": 4, "intermediate_size": 2816, "pad_token_id": 0,
              "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
             "model.model.layers.0.", {"self_attn.qkv_proj.weight": (Shard(0, (4, 1, 1)),),
                                       "mlp.gate_up_proj.weight": (Shard(0, (1, 1)),),
                                       "mlp.down_proj.weight": (Shard(1),)}),
    "gpt_neox": ({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], **_BLOCK,
                  "intermediate_size": 4096, "rotary_pct": 0.25},
                 "model.gpt_neox.layers.0.", {"attention.query_key_value.weight": (Shard(0),),
                                              "mlp.dense_h_to_4h.weight": (Shard(0),),
                                              "mlp.dense_4h_to_h.weight": (Shard(1),)}),
}


@pytest.mark.parametrize("name", list(FUSED_CONFIGS))
def test_the_planner_finds_megatrons_fused_layouts(tmp_path, name: str) -> None:
    """Planned freely on 4 devices (cpu preset, batch 1 x 1024): Phi-3's fused QKV strided in
    its 4:1:1 groups and its gate-up in two, GPT-NeoX's head-interleaved QKV contiguous, the
    MLPs column- then row-parallel, and nothing moved between the fused projection and the
    attention."""
    config, layer, want = FUSED_CONFIGS[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    out = tmp_path / "plan.json"
    assert main(["plan", str(path), "--mesh", "4", "--cluster", "cpu", "--batch", "1",
                 "--seq", "1024", "--quiet", "-o", str(out)]) == 0
    plan = Plan.loads(out.read_text())
    assert {k: plan.params[layer + k] for k in want} == want
    nodes = list(plan.layers[0].nodes)
    qkv = nodes[nodes.index("linear"):nodes.index("scaled_dot_product_attention") + 1]
    assert not [c for c in plan.collectives if c.kind == "all_to_all" and c.node in qkv
                and c.value in qkv]


# -- numerical (gloo) --------------------------------------------------------------------------

world4 = world_fixture(4, timeout_s=300)


def _verify_on(world, model: str, plan: Plan) -> None:
    """What ``autoshard verify`` runs, on this module's warm world rather than a world spawned
    per call (the command itself is run by tests/test_hf_config.py and
    tests/test_baselines_structure.py): loss and every gradient within the default tolerance of
    the single-device model's, the bytes run equal the plan's, and the report says PASS."""
    from autoshard.tools.verify import VerifySpec, summarize, verify_rank
    reports = world.run(verify_rank, VerifySpec(model, plan.mesh_shape, plan.mesh_axes,
                                                plan.dumps(), measure_memory=False))
    ok, text = summarize(reports, None)
    assert ok and text.rstrip().endswith("PASS"), text
    assert all(r["bytes"] == r["planned_bytes"] for r in reports)


@pytest.mark.slow
@pytest.mark.parametrize("mesh, baseline", [("4", "megatron"), ("2x2", "megatron-dp")])
def test_gpt2_fused_qkv_trains_as_one_device_on_gloo(world4, mesh: str, baseline: str) -> None:
    """Megatron's layout of HF GPT-2's fused ``c_attn`` (strided) on 4 gloo ranks: loss and
    every gradient equal the single-device model's, the bytes run equal the plan's."""
    from autoshard.tools.verify import plan_for
    shape = tuple(int(n) for n in mesh.split("x"))
    plan = plan_for("hf-gpt2-tiny", Mesh(shape), baseline=baseline)
    assert plan.params["model.transformer.h.0.attn.c_attn.weight"][-1] == Shard(1, QKV)
    _verify_on(world4, "hf-gpt2-tiny", plan)


@pytest.mark.slow
def test_a_fused_qkv_viewed_into_heads_trains_as_one_device_on_gloo(world4) -> None:
    """A fused QKV viewed as [b, s, 3, heads, head_dim] and unbound, a gate-up chunked: both
    strided in Megatron's layout on 4 gloo ranks, equal to the single-device model."""
    from autoshard.tools.verify import plan_for
    factory = f"{Path(__file__).parent / 'data' / 'fused_qkv_model.py'}:make"
    plan = plan_for(factory, Mesh((4,)), baseline="megatron")
    assert plan.params["blocks.0.qkv.weight"] == (Shard(0, QKV),)
    assert plan.params["blocks.0.gate_up.weight"] == (Shard(0, (1, 1)),)
    assert not [c for c in plan.collectives if c.kind == "all_to_all"]
    _verify_on(world4, factory, plan)


def _state_rank(plan_json: str) -> dict:
    from autoshard.codegen.parallelize import parallelize
    from autoshard.tools.verify import build
    plan = Plan.loads(plan_json)
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes)
    real, inputs = build("hf-gpt2-tiny", None, None, 0)
    want = {k: v.clone() for k, v in real.state_dict().items()}
    pm = parallelize(real, mesh, plan=plan, example_inputs=inputs)
    got = {k: v.clone() for k, v in pm.full_state_dict().items()}
    pm.load_full_state_dict({k: v + 1 for k, v in want.items()})
    again = pm.full_state_dict()
    try:
        pm.sharded_state_dict()
        refused = ""
    except AutoshardError as e:
        refused = str(e)
    return {"equal": [k for k in got if not torch.equal(got[k], want[k])],
            "loaded": all(torch.equal(again[k], want[k] + 1) for k in again),
            "refused": refused}


@pytest.mark.slow
def test_full_state_dict_returns_the_fused_layout(world4) -> None:
    """Strided parameters cut from the model reassemble to its state dict, and a full state
    dict loads back into them; DCP, which cannot describe them, is refused with a reason."""
    from autoshard.tools.verify import plan_for
    plan = plan_for("hf-gpt2-tiny", Mesh((2, 2)), baseline="megatron-dp")
    assert plan.params["model.transformer.h.0.attn.c_attn.weight"] == (Replicate(), Shard(1, QKV))
    for r in world4.run(_state_rank, plan.dumps()):
        assert r["equal"] == [] and r["loaded"], r
        assert "strided shard" in r["refused"], r["refused"]


def test_a_meta_build_materialises_each_ranks_part_of_every_group() -> None:
    """A parameter built on the meta device is materialised shard by shard, a strided one as
    the rank's box in each group: the same values as cutting the whole tensor."""
    from autoshard.codegen import materialize as M
    with M.deferred_init(), torch.device("meta"):
        lin = torch.nn.Linear(8, 16)
    sources = M.prepare(lin, seed=3)
    whole = sources.local("weight", None, (1,), (0,))
    spec, mesh = (Shard(0, GQA), Shard(1)), (2, 2)
    for c in itertools.product(range(2), range(2)):
        assert torch.equal(sources.local("weight", spec, mesh, c),
                           shard_tensor(whole, spec, mesh, c)), c
