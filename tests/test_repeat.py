"""One layer per kind exported, the rest copied (trace/repeat.py).

- Pure data: the kinds of a model's layers and the prefixes exported for uniform, patterned
  (Gemma's 5 local : 1 global, Jamba's interleave) and dense-then-MoE lists.
- The copied graph is the whole export's, node for node (names, ops, arguments, shapes, module
  paths, sources), on the zoo's models and on Hugging Face's families of 2024-2026; a model
  whose forward reads how many layers it has, or reads one layer's values in another, is
  exported whole.
- gloo (tests/test_unseen.py, on its world): a plan made on the copied graph trains as the
  single-device model (loss and gradients within 1e-5, bytes as planned).
"""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from autoshard.trace.export import trace
from autoshard.trace.repeat import _prefix, _proof, layer_kinds, repeated_layers
from autoshard.tools.verify import build
from autoshard.zoo.models import GPT, GPTConfig, Llama, LlamaConfig


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


class _Skips(_Scaled):
    """A stack whose layer i also reads layer i-2's output (a skip across layers)."""

    def forward(self, x, y):
        outs = [x, x]
        for layer in self.layers:
            outs.append(outs[-1] + layer(outs[-1]) + outs[-2])
        return ((outs[-1] - y) ** 2).mean()


@pytest.mark.parametrize("stack", [_Scaled, _Skips], ids=["counts its layers", "skips layers"])
def test_a_forward_the_prefix_cannot_stand_for_is_exported_whole(stack) -> None:
    """A forward that reads how many layers it has, or one layer's values in a later one: the
    prefix does not show what copying assumes, and every layer is exported."""
    model = stack(10)
    inputs = (torch.randn(4, 16), torch.randn(4, 16))
    assert repeated_layers(model) is not None
    fast = trace(model, inputs)
    assert fast.copied_layers == 0
    _same(fast, trace(model, inputs, whole=True))


def test_a_fault_of_the_copier_is_said_and_the_whole_model_exported(monkeypatch) -> None:
    """A bug in the copier itself (not a model it cannot copy) is not hidden: a warning names
    it, and every layer is exported instead."""
    import autoshard.trace.export as export

    def broken(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr(export, "expand", broken)
    model = _llama(6)
    with pytest.warns(UserWarning, match="copying the exported layers of Llama failed"):
        fast = trace(model, _inputs())
    assert fast.copied_layers == 0
    _same(fast, trace(model, _inputs(), whole=True))


def test_a_model_that_is_its_own_list_of_layers_has_no_container() -> None:
    assert repeated_layers(nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))) is None


# Hugging Face families (tests/test_unseen.py's tiny configs), with enough layers that their
# patterns repeat past the prefix and its proof.
LONGER = {
    "qwen3_moe": dict(num_hidden_layers=8),      # (the gloo check in tests/test_unseen.py)
    "deepseek_v3": dict(num_hidden_layers=8, first_k_dense_replace=1),
    "mamba2": dict(num_hidden_layers=8),
    "jamba": dict(num_hidden_layers=20, attn_layer_period=4, attn_layer_offset=2),
    "gemma3_text": dict(num_hidden_layers=18, layer_types=(
        ["sliding_attention"] * 2 + ["full_attention"]) * 6),
}


def longer_configs(tmp_path_factory) -> dict[str, str]:
    from test_unseen import CONFIGS
    out = {}
    for name, fields in LONGER.items():
        path = tmp_path_factory.mktemp(name) / "config.json"
        path.write_text(json.dumps({**CONFIGS[name], **fields}))
        out[name] = str(path)
    return out


@pytest.fixture(scope="module")
def longer(tmp_path_factory) -> dict[str, str]:
    pytest.importorskip("transformers")
    return longer_configs(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LONGER if n != "qwen3_moe"])
def test_hugging_face_families_copy_as_exported(longer, name) -> None:
    """Uniform (Mamba-2's scan), dense then MoE (DeepSeek-V3), an interleave of Mamba,
    attention and MoE (Jamba), local and global attention (Gemma-3). (Qwen3-MoE, uniform, is
    the gloo check's model.)"""
    model, inputs = build(longer[name], 2, 16, 0)
    fast = trace(model, inputs)
    assert fast.copied_layers > 0
    _same(fast, trace(model, inputs, whole=True))
