"""One layer per kind exported, the rest copied (trace/repeat.py).

- Pure data: the kinds of a model's layers and the prefixes exported for uniform, patterned
  (Gemma's 5 local : 1 global, Jamba's interleave) and dense-then-MoE lists.
- The copied graph is the whole export's, node for node (names, ops, arguments, shapes, module
  paths, sources), on the zoo's models and on Hugging Face's families of 2024-2026; a model
  whose forward reads how many layers it has, or reads one layer's values in another, is
  exported whole.
- gloo: a plan made on the copied graph trains as the single-device model (loss and gradients
  within 1e-5, bytes as planned).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autoshard import Mesh
from autoshard.trace.export import trace
from autoshard.trace.repeat import _prefix, _proof, layer_kinds, repeated_layers
from autoshard.tools.verify import VerifySpec, build, plan_for, summarize, verify_rank
from autoshard.zoo.models import GPT, GPTConfig, Llama, LlamaConfig
from dist import world_fixture

world4 = world_fixture(4, timeout_s=600)


def _same(a, b) -> None:
    """Two traces are one graph: signatures (names, ops, arguments, shapes), placeholders,
    layers, and the module path and source of every node."""
    assert a.node_sigs == b.node_sigs
    assert a.placeholders == b.placeholders and a.layers == b.layers
    for x, y in zip(a.gm.graph.nodes, b.gm.graph.nodes):
        sx, sy = x.meta.get("nn_module_stack") or {}, y.meta.get("nn_module_stack") or {}
        assert [(k, p) for k, (p, _) in sx.items()] == [(k, p) for k, (p, _) in sy.items()], x
        assert x.meta.get("stack_trace") == y.meta.get("stack_trace"), x
    assert a.fingerprint == b.fingerprint


# ---------------------------------------------------------------------------------- pure data

def test_prefixes_of_uniform_patterned_and_mixed_lists() -> None:
    """The prefix exported holds, past layer 0, two of every kind, every transition the list
    makes, and ends in the last layer's kind; the proof is the shortest prefix that copies out
    to it, else the shortest longer one it copies out to."""
    uniform = (0,) * 32
    assert (_prefix(uniform), _proof(uniform, 3)) == (3, 2)
    gemma = ((0,) * 5 + (1,)) * 8                     # 5 local : 1 global, 48 layers
    assert (_prefix(gemma), _proof(gemma, 12)) == (12, 18)
    dense_then_moe = (0,) * 3 + (1,) * 58             # DeepSeek-V3: 3 dense, then MoE
    assert (_prefix(dense_then_moe), _proof(dense_then_moe, 5)) == (5, 6)
    jamba = (0, 1, 2, 1) * 8
    assert (_prefix(jamba), _proof(jamba, 10)) == (10, 6)
    assert _prefix((0, 1, 0, 1)) is None               # no prefix shorter than the list


def _llama(layers: int) -> nn.Module:
    return Llama(LlamaConfig(layers, 32, 4, 2, 64, vocab_size=64, context=16))


def _inputs(batch: int = 2, seq: int = 16) -> tuple:
    tokens = torch.randint(0, 64, (batch, seq))
    return tokens, torch.randint(0, 64, (batch, seq))


def test_kinds_leave_out_the_layer_index_and_see_attributes() -> None:
    """``layer_idx``-like attributes do not split kinds; a differing plain attribute does."""
    with torch.device("meta"):
        model = _llama(8)
    for i, layer in enumerate(model.layers):
        layer.layer_idx = i
    assert layer_kinds(model.layers) == (0,) * 8
    model.layers[5].attn.window = 4
    assert layer_kinds(model.layers) == (0,) * 5 + (1, 0, 0)


# --------------------------------------------------------------------- one process: the graph

@pytest.mark.parametrize("family", ["llama", "gpt"])
def test_copied_graph_is_the_whole_export(family) -> None:
    with torch.device("meta"):
        model = _llama(8) if family == "llama" else GPT(GPTConfig(8, 32, 4, vocab_size=64,
                                                                   context=16))
    inputs = _inputs()
    fast = trace(model, inputs)
    assert fast.copied_layers == 8 - 3
    _same(fast, trace(model, inputs, whole=True))


class _Scaled(nn.Module):
    """A stack whose forward reads how many layers it has."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = x + layer(x)
        return ((x / len(self.layers) - y) ** 2).mean()


def test_a_forward_that_counts_its_layers_is_exported_whole() -> None:
    model = _Scaled(10)
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    assert repeated_layers(model) is not None
    fast = trace(model, inputs)
    assert fast.copied_layers == 0
    _same(fast, trace(model, inputs, whole=True))


# Hugging Face families (tests/test_unseen.py's tiny configs), with enough layers that their
# patterns repeat past the prefix and its proof.
_LONGER = {
    "qwen3_moe": dict(num_hidden_layers=12),
    "deepseek_v3": dict(num_hidden_layers=12, first_k_dense_replace=2),
    "mamba2": dict(num_hidden_layers=12),
    "jamba": dict(num_hidden_layers=20, attn_layer_period=4, attn_layer_offset=2),
    "gemma3_text": dict(num_hidden_layers=36, layer_types=(
        ["sliding_attention"] * 5 + ["full_attention"]) * 6),
    # Llama 4 reads a value computed in one layer's attention from a later one: exported whole.
    "llama4_text": dict(num_hidden_layers=24, no_rope_layers=[1, 1, 1, 0] * 6),
}


@pytest.fixture(scope="module")
def longer(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    from test_unseen import CONFIGS
    out = {}
    for name, fields in _LONGER.items():
        path = tmp_path_factory.mktemp(name) / "config.json"
        path.write_text(json.dumps({**CONFIGS[name], **fields}))
        out[name] = str(path)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(_LONGER))
def test_hugging_face_families_copy_as_exported(longer, name) -> None:
    model, inputs = build(longer[name], 2, 16, 0)
    fast = trace(model, inputs)
    assert (fast.copied_layers > 0) == (name != "llama4_text")
    _same(fast, trace(model, inputs, whole=True))


# ------------------------------------------------------------------------------------- gloo

@pytest.mark.slow
def test_plan_on_the_copied_graph_trains_as_one_device(world4, longer) -> None:
    """Qwen3-MoE with 12 layers, 9 of them copies, over (2, 2): loss and gradients as one
    device's, bytes as planned."""
    model, inputs = build(longer["qwen3_moe"], 4, 8, 0)
    assert trace(model, inputs).copied_layers == 9
    plan = plan_for(longer["qwen3_moe"], Mesh((2, 2), cluster="stress"), batch=4, seq=8)
    reports = world4.run(verify_rank, VerifySpec(longer["qwen3_moe"], plan.mesh_shape,
                                                 plan.mesh_axes, plan.dumps(), batch=4, seq=8))
    assert "error" not in reports[0], reports[0]["error"]
    ok, text = summarize(reports, 1e-5)
    assert ok, text
    assert reports[0]["bytes"] == reports[0]["planned_bytes"]
