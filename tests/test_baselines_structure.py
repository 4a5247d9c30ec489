"""The Megatron baselines place linears by the graph's structure, not by parameter names.

Hugging Face Phi-3, GPT-NeoX and Falcon fuse Q, K and V into one linear (``qkv_proj``,
``query_key_value``) and Phi-3 fuses gate and up (``gate_up_proj``): each fused projection is
one column-parallel linear and each output projection a row-parallel one (Shoeybi et al. 2019,
arXiv 1909.08053, §3), as for Llama and GPT-2. Renaming every linear, even to names that say the
opposite role, changes no pin; a linear the structure does not place stays replicated and the
plan names it.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

pytest.importorskip("transformers")

from autoshard.tools.cli import main  # noqa: E402
from autoshard.ir import Replicate, Shard  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.solver.baselines import (baseline_pins, baseline_plan, megatron_roles,  # noqa: E402
                                        stored_plan, unclassified_params)
from autoshard.trace.blocks import COLUMN, ROW  # noqa: E402
from autoshard.trace.export import TracedGraph, trace  # noqa: E402
from autoshard.zoo import from_config, get_model  # noqa: E402

R, S0, S1 = (Replicate(),), (Shard(0),), (Shard(1),)
# Strided (ir.py Shard): each rank its part of every group a fused output is split into.
QKV1, QKV0 = (Shard(1, (1, 1, 1)),), (Shard(0, (1, 1, 1)),)
_SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64,
          "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"}
# Published architectures at toy sizes (hidden 32, 2 layers), dropout off.
CONFIGS = {
    "phi3": {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], **_SMALL,
             "intermediate_size": 64, "num_key_value_heads": 2, "max_position_embeddings": 16,
             "pad_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0},
    "gpt_neox": {"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], **_SMALL,
                 "intermediate_size": 64, "rotary_pct": 0.5, "max_position_embeddings": 16},
    "falcon": {"model_type": "falcon", "architectures": ["FalconForCausalLM"], **_SMALL},
}
# Megatron's spec of every linear parameter of layer 1, on a 1-D mesh, by FQN suffix: a column
# weight split on its output dim and its bias with it, a row weight on its input dim and its
# bias whole. nn.Linear stores (out, in); GPT-2's Conv1D (in, out); Falcon reads x @ w.T.
EXPECTED = {
    # Phi-3 with 4 query and 2 key-value heads: Q twice as wide as K and V
    "phi3": {"self_attn.qkv_proj.weight": (Shard(0, (2, 1, 1)),), "self_attn.o_proj.weight": S1,
             "mlp.gate_up_proj.weight": (Shard(0, (1, 1)),), "mlp.down_proj.weight": S1},
    "gpt_neox": {"attention.query_key_value.weight": S0, "attention.query_key_value.bias": S0,
                 "attention.dense.weight": S1, "attention.dense.bias": R,
                 "mlp.dense_h_to_4h.weight": S0, "mlp.dense_h_to_4h.bias": S0,
                 "mlp.dense_4h_to_h.weight": S1, "mlp.dense_4h_to_h.bias": R},
    "falcon": {"self_attention.query_key_value.weight": S0, "self_attention.dense.weight": S1,
               "mlp.dense_h_to_4h.weight": S0, "mlp.dense_4h_to_h.weight": S1},
    "hf-llama-tiny": {"self_attn.q_proj.weight": S0, "self_attn.k_proj.weight": S0,
                      "self_attn.v_proj.weight": S0, "self_attn.o_proj.weight": S1,
                      "mlp.gate_proj.weight": S0, "mlp.up_proj.weight": S0,
                      "mlp.down_proj.weight": S1},
    "hf-gpt2-tiny": {"attn.c_attn.weight": QKV1, "attn.c_attn.bias": QKV0, "attn.c_proj.weight": S0,
                     "attn.c_proj.bias": R, "mlp.c_fc.weight": S1, "mlp.c_fc.bias": S0,
                     "mlp.c_proj.weight": S0, "mlp.c_proj.bias": R},
}
LAYER_1 = {"phi3": "model.model.layers.1.", "gpt_neox": "model.gpt_neox.layers.1.",
           "falcon": "model.transformer.h.1.", "hf-llama-tiny": "model.model.layers.1.",
           "hf-gpt2-tiny": "model.transformer.h.1."}


def build(name: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    if name in CONFIGS:
        model = from_config(CONFIGS[name])
        return model, model.example_inputs(4, 16)
    return get_model(name)


@pytest.fixture(scope="module")
def traces() -> dict[str, TracedGraph]:
    return {name: trace(*build(name)) for name in EXPECTED}


def pins_by_fqn(traced: TracedGraph, mesh: Mesh, baseline: str = "megatron") -> dict:
    return {traced.placeholder(ph).fqn: s.outputs[0]
            for ph, s in baseline_pins(traced, mesh, baseline).items()}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_every_projection_is_column_or_row_parallel(traces, name: str) -> None:
    """Every linear parameter of a block gets its Megatron spec, fused projections included,
    and no linear parameter is left unplaced."""
    traced = traces[name]
    pins = pins_by_fqn(traced, Mesh((4,), cluster="cpu"))
    got = {fqn.removeprefix(LAYER_1[name]): spec for fqn, spec in pins.items()
           if fqn.startswith(LAYER_1[name]) and fqn.removeprefix(LAYER_1[name]) in EXPECTED[name]}
    assert got == EXPECTED[name]
    assert unclassified_params(traced) == ()


@pytest.mark.parametrize("name", ["phi3", "falcon"])
def test_renaming_the_model_changes_no_pin(traces, name: str) -> None:
    """The same model one module deeper (every FQN and module path changes) gets the same
    pins, parameter by parameter."""
    model, inputs = build(name)
    wrapped = trace(Renamed(model), inputs)
    mesh = Mesh((4,), cluster="cpu")
    again = {fqn.removeprefix("renamed."): s for fqn, s in pins_by_fqn(wrapped, mesh).items()}
    assert again == pins_by_fqn(traces[name], mesh)


class Renamed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.renamed = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.renamed(*args)


# ------------------------------------------------------------------ a model with made-up names

HIDDEN, HEADS, FFN = 32, 4, 64
# The four linears of a block by what they do: fused QKV, attention out, fused gate-up, down.
ROLES = {"qkv": COLUMN, "out": ROW, "gate_up": COLUMN, "down": ROW}
NAMINGS = {
    "megatron": {"qkv": "qkv", "out": "out_proj", "gate_up": "fc1", "down": "fc2"},
    "letters": {"qkv": "a", "out": "b", "gate_up": "c", "down": "d"},
    # Names that say the opposite role: a name-based rule would swap every pair.
    "lying": {"qkv": "out_proj", "out": "qkv", "gate_up": "fc2", "down": "fc1"},
}


class Block(nn.Module):
    """A pre-norm transformer block with a fused QKV and a fused gate-up (SwiGLU) projection,
    its linears under the names ``names`` gives."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__()
        self.names = names
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        shapes = {"qkv": (HIDDEN, 3 * HIDDEN), "out": (HIDDEN, HIDDEN),
                  "gate_up": (HIDDEN, 2 * FFN), "down": (FFN, HIDDEN)}
        for role, (n_in, n_out) in shapes.items():
            self.add_module(names[role], nn.Linear(n_in, n_out))

    def linear(self, role: str) -> nn.Module:
        return getattr(self, self.names[role])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.linear("qkv")(self.norm1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.linear("out")(att.transpose(1, 2).reshape(b, s, HIDDEN))
        gate, up = self.linear("gate_up")(self.norm2(x)).chunk(2, dim=-1)
        return x + self.linear("down")(F.silu(gate) * up)


class Stack(nn.Module):
    """Two blocks between an input projection (a linear outside every block) and a norm."""

    def __init__(self, names: dict[str, str]) -> None:
        super().__init__()
        self.proj_in = nn.Linear(HIDDEN, HIDDEN)
        self.stack = nn.ModuleList([Block(names), Block(names)])
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.stack:
            x = block(x)
        return F.mse_loss(self.norm(x), target)


def stack_trace(naming: str) -> TracedGraph:
    with torch.device("meta"):
        model = Stack(NAMINGS[naming])
        inputs = (torch.randn(4, 16, HIDDEN), torch.randn(4, 16, HIDDEN))
    return trace(model, inputs)


@pytest.fixture(scope="module")
def stacks() -> dict[str, TracedGraph]:
    return {naming: stack_trace(naming) for naming in NAMINGS}


def by_role(traced: TracedGraph, naming: str, specs: dict) -> dict[str, object]:
    """``specs`` (FQN -> spec) of the blocks' linears, keyed by block, role and weight/bias."""
    role_of = {name: role for role, name in NAMINGS[naming].items()}
    out = {}
    for fqn, spec in specs.items():
        parts = fqn.split(".")     # stack.<i>.<linear>.<weight|bias>
        if parts[0] == "stack" and parts[2] in role_of:
            out[(parts[1], role_of[parts[2]], parts[3])] = spec
    return out


@pytest.mark.parametrize("naming", list(NAMINGS))
def test_made_up_names_get_megatron_roles(stacks, naming: str) -> None:
    """Whatever the linears are called, the fused QKV and gate-up are column-parallel and the
    out and down projections row-parallel."""
    traced = stacks[naming]
    specs = by_role(traced, naming, pins_by_fqn(traced, Mesh((4,), cluster="cpu")))
    want = {"weight": {COLUMN: S0, ROW: S1}, "bias": {COLUMN: S0, ROW: R}}
    assert len(specs) == 2 * 4 * 2
    for (_, role, kind), spec in specs.items():
        # the fused outputs are split (QKV viewed as [b, s, 3, heads, hd] and unbound; gate-up
        # chunked in two): strided, each rank its part of every group
        fused = {"qkv": (Shard(0, (1, 1, 1)),), "gate_up": (Shard(0, (1, 1)),)}
        expect = fused.get(role, want[kind][ROLES[role]])
        assert spec == expect, (naming, role, kind)
    roles = {traced.placeholder(ph).fqn: r for ph, r in megatron_roles(traced).items()}
    assert roles["proj_in.weight"] is None and roles["proj_in.bias"] is None


def test_names_change_no_pin(stacks) -> None:
    mesh = Mesh((2, 2), cluster="cpu")
    first, *rest = [by_role(stacks[n], n, pins_by_fqn(stacks[n], mesh, "megatron-dp"))
                    for n in NAMINGS]
    assert all(other == first for other in rest)


def test_a_linear_outside_the_blocks_is_named_in_the_plan(stacks) -> None:
    """The input projection is outside every layer: replicated, listed, and the plan says so;
    the dp baseline places no linear and says nothing."""
    traced = stacks["letters"]
    assert unclassified_params(traced) == ("proj_in.weight", "proj_in.bias")
    mesh = Mesh((4,), cluster="cpu")
    assert pins_by_fqn(traced, mesh)["proj_in.weight"] == R
    plan = baseline_plan(traced, mesh, "megatron")
    assert plan.solver["status"] == "OPTIMAL"
    assert any("baseline megatron" in w and "proj_in.weight, proj_in.bias" in w
               for w in plan.warnings), plan.warnings
    assert not any("baseline" in w for w in baseline_plan(traced, mesh, "dp").warnings)


def test_a_stack_without_residual_adds_is_left_replicated() -> None:
    """The zoo's MLP (Linear + ReLU layers, no residual stream): no linear has a Megatron role,
    every one stays replicated (as before), and the fsdp-tp plan names them."""
    model, inputs = get_model("mlp-tiny")
    traced = trace(model, inputs)
    linears = [p.fqn for p in traced.params if p.fqn.startswith("layers.")]
    assert linears and unclassified_params(traced) == tuple(linears)
    mesh = Mesh((2, 2), cluster="cpu")
    assert all(spec == (Replicate(),) * 2 for spec in pins_by_fqn(traced, mesh).values())
    plan = stored_plan(traced, mesh, "fsdp-tp")
    assert any("baseline fsdp-tp" in w and f"{len(linears)} linear" in w for w in plan.warnings)


@pytest.mark.parametrize("name", ["phi3", "gpt_neox", "falcon"])
@pytest.mark.parametrize("shape, baseline", [((4,), "megatron"), ((2, 2), "megatron-dp")])
def test_fused_projection_plans_solve(traces, name: str, shape, baseline: str) -> None:
    """The pinned layouts solve, and the plan stores every fused projection as pinned."""
    traced = traces[name]
    mesh = Mesh(shape, cluster="cpu")
    plan = baseline_plan(traced, mesh, baseline)
    assert plan.solver["status"] == "OPTIMAL"
    assert plan.predicted.step_time_s > 0 and plan.predicted.comm_s > 0
    tp = [a for a in range(len(shape)) if baseline == "megatron" or a == len(shape) - 1]
    for suffix, spec in EXPECTED[name].items():
        want = tuple(spec[0] if a in tp else Replicate() for a in range(len(shape)))
        assert tuple(plan.params[LAYER_1[name] + suffix]) == want, suffix
    assert not plan.warnings


# Phi-3 slices Q, K and V out of its fused projection with three slices, each a follower of
# the projection's decision in the ILP (solver/build.py): the all-gather of the column-sharded
# output they share is charged once, as the program (and the plan's price) runs it once.
@pytest.mark.parametrize("name", ["phi3", "gpt_neox",
                                  "falcon"])
def test_objective_is_the_plans_price(traces, name: str) -> None:
    plan = baseline_plan(traces[name], Mesh((4,), cluster="cpu"), "megatron")
    assert plan.solver["objective"] == pytest.approx(plan.predicted.step_time_s, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_projection_plans_run_on_gloo(tmp_path, capsys, name: str) -> None:
    """Megatron's layout of the fused projections runs on 2 gloo ranks: loss and gradients
    equal the single-device model's and the bytes run equal the plan's (``autoshard verify``)."""
    config = tmp_path / f"{name}.json"
    config.write_text(json.dumps(CONFIGS[name]))
    argv = ["verify", str(config), "--mesh", "2", "--batch", "2", "--seq", "8",
            "--baseline", "megatron"]
    assert main(argv) == 0
    assert capsys.readouterr().out.rstrip().endswith("PASS")
