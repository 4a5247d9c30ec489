"""The model zoo and the loss wrappers: sizes, numerics, export-ability and error messages."""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.loss import as_loss_module, with_loss
from autoshard.zoo import (ZOO, BertConfig, GPTConfig, LlamaConfig, count_parameters, get_model,
                           load_factory)
from autoshard.zoo import hf

TINY = ["mlp-tiny", "gpt2-tiny", "llama-tiny", "bert-tiny"]
HF_TINY = ["hf-gpt2-tiny", "hf-llama-tiny", "hf-bert-tiny"]
needs_transformers = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None, reason="transformers missing")


# ------------------------------------------------------------------------- sizes (closed forms)


def _gpt_params(c: GPTConfig) -> int:
    h, f = c.hidden, c.ffn_mult * c.hidden
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h   # qkv+out, fc1+fc2, two LayerNorms
    return c.vocab_size * h + c.context * h + c.n_layers * block + 2 * h   # head tied


def _llama_params(c: LlamaConfig) -> int:
    h, kv = c.hidden, c.n_kv_heads * (c.hidden // c.n_heads)
    block = 2 * h * h + 2 * h * kv + 3 * h * c.ffn + 2 * h
    return 2 * c.vocab_size * h + c.n_layers * block + h   # untied head


def _bert_params(c: BertConfig) -> int:
    h, f = c.hidden, c.ffn
    emb = (c.vocab_size + c.context + c.type_vocab_size) * h + 2 * h
    block = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h
    head = h * h + h + 2 * h + c.vocab_size   # dense, LayerNorm, decoder bias (weight tied)
    return emb + c.n_layers * block + head


# Published sizes; the tolerance covers rounding in the published figure.
@pytest.mark.parametrize("name, published, rel", [
    ("gpt2", 124.4e6, 0.001), ("gpt3-175b", 174.6e9, 0.01), ("llama2-7b", 6.74e9, 0.001),
    ("llama3-8b", 8.03e9, 0.001), ("llama2-70b", 68.98e9, 0.001), ("bert-large", 335.1e6, 0.001),
])
def test_real_size_parameter_counts(name: str, published: float, rel: float) -> None:
    model, _ = get_model(name)
    cfg = ZOO[name].config
    closed = {GPTConfig: _gpt_params, LlamaConfig: _llama_params, BertConfig: _bert_params}
    assert count_parameters(model) == closed[type(cfg)](cfg)
    assert count_parameters(model) == pytest.approx(published, rel=rel)


def test_real_size_builds_on_meta_without_memory() -> None:
    # 175B parameters in bf16 would be 350 GB: building at all proves nothing was allocated.
    model, inputs = get_model("gpt3-175b")
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers(), *inputs])
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert [tuple(t.shape) for t in inputs] == [(8, 2048), (8, 2048)]


def test_presets_default_sizes_and_dtypes() -> None:
    assert ZOO["llama3-8b"].seq == 8192 and ZOO["llama2-7b"].seq == 4096
    assert ZOO["gpt2"].seq == 1024 and ZOO["bert-large"].seq == 512
    assert ZOO["gpt3-13b"].config.hidden == 5120
    for name in ZOO:
        tiny = name.endswith("-tiny") or "-tiny-" in name
        if ZOO[name].config is not None:
            assert ZOO[name].config.dtype == (torch.float32 if tiny else torch.bfloat16), name
        assert ZOO[name].description


def test_repeated_blocks_live_in_layers() -> None:
    model, _ = get_model("llama2-7b")
    names = {n for n, _ in model.named_modules()}
    assert {"layers.0", "layers.31"} <= names and "layers.32" not in names


# ------------------------------------------------------------------------------ numerics on CPU


@pytest.mark.parametrize("name", TINY + [pytest.param(n, marks=needs_transformers)
                                         for n in HF_TINY])
def test_tiny_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = get_model(name, device="cpu")
    loss = model(*inputs)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_seeded_by_the_caller() -> None:
    def loss() -> torch.Tensor:
        torch.manual_seed(1)
        model, inputs = get_model("gpt2-tiny", device="cpu")
        return model(*inputs)
    assert torch.equal(loss(), loss())


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny"])
def test_labels_none_gives_logits(name: str) -> None:
    model, (ids, _) = get_model(name, device="cpu", batch=2, seq=5)
    assert model(ids).shape == (2, 5, 64)


def test_dtype_override() -> None:
    model, _ = get_model("gpt2-tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    mlp, (x, y) = get_model("mlp-tiny", dtype=torch.bfloat16)
    assert x.dtype == y.dtype == torch.bfloat16


def _renamed(name: str, table: list[tuple[str, str]]) -> str:
    for ours, theirs in table:
        name = name.replace(ours, theirs)
    return name


_HF_NAMES = {
    "llama": [("tok_emb", "model.embed_tokens"), ("layers.", "model.layers."),
              ("attn_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm"),
              (".attn.", ".self_attn.")],
    "gpt2": [("tok_emb", "transformer.wte"), ("pos_emb", "transformer.wpe"),
             ("layers.", "transformer.h."), ("ln_f", "transformer.ln_f"), ("ln1", "ln_1"),
             ("ln2", "ln_2"), ("attn.q_proj", "attn.c_attn"), ("attn.k_proj", "attn.c_attn"),
             ("attn.v_proj", "attn.c_attn"), ("attn.out", "attn.c_proj"),
             ("mlp.fc1", "mlp.c_fc"), ("mlp.fc2", "mlp.c_proj")],
    "bert": [("tok_emb", "bert.embeddings.word_embeddings"),
             ("pos_emb", "bert.embeddings.position_embeddings"),
             ("type_emb", "bert.embeddings.token_type_embeddings"),
             ("emb_ln", "bert.embeddings.LayerNorm"), ("layers.", "bert.encoder.layer."),
             ("attn.q_proj", "attention.self.query"), ("attn.k_proj", "attention.self.key"),
             ("attn.v_proj", "attention.self.value"), ("attn.out", "attention.output.dense"),
             ("ln1", "attention.output.LayerNorm"), ("fc1", "intermediate.dense"),
             ("fc2", "output.dense"), ("ln2", "output.LayerNorm"),
             ("head.dense", "cls.predictions.transform.dense"),
             ("head.ln", "cls.predictions.transform.LayerNorm"),
             ("head.bias", "cls.predictions.bias")],
}


def _hf_name(family: str, name: str) -> str:
    if family == "llama" and name == "norm.weight":
        return "model.norm.weight"
    return _renamed(name, _HF_NAMES[family])


@needs_transformers
@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_plain_models_match_hugging_face(family: str) -> None:
    """Same weights, same logits: the plain models are faithful to the HF architectures."""
    torch.manual_seed(0)
    ours, (ids, _) = get_model(f"{family}-tiny", device="cpu")
    theirs, _ = get_model(f"hf-{family}-tiny", device="cpu")
    state = theirs.model.state_dict()
    with torch.no_grad():
        for name, p in ours.named_parameters():
            src = state[_hf_name(family, name)]
            if family == "gpt2" and "attn.c_attn" in _hf_name(family, name):
                # HF fuses [Q|K|V] on the output dim (last, as Conv1D); ours are three Linears.
                src = src.chunk(3, dim=-1)["qkv".index(name.split(".attn.")[1][0])]
            # HF GPT-2 stores its projections as Conv1D, i.e. transposed Linear weights.
            p.copy_(src.t() if family == "gpt2" and p.ndim == 2 and "emb" not in name else src)
    # fp32 on CPU, same op order up to fused kernels: agreement to a few ulps of O(1) logits.
    torch.testing.assert_close(ours(ids), theirs.model(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama-tiny", "bert-tiny",
                                  pytest.param("hf-gpt2-tiny", marks=needs_transformers)])
def test_export_on_meta(name: str) -> None:
    model, inputs = get_model(name)
    ep = torch.export.export(model, inputs, strict=False)
    calls = [n for n in ep.graph.nodes if n.op == "call_function"]
    assert calls and all("val" in n.meta for n in calls)
    out = next(n for n in ep.graph.nodes if n.op == "output").args[0][0]
    assert out.meta["val"].shape == ()
    if not name.startswith("hf-"):
        paths = {p for n in calls for p, _ in n.meta.get("nn_module_stack", {}).values()}
        assert {"layers.0", "layers.1"} <= paths


# -------------------------------------------------------------------------------------- errors


def test_unknown_name_lists_close_matches_and_all_names() -> None:
    with pytest.raises(AutoshardError) as err:
        get_model("lama3-8b")
    msg = str(err.value)
    assert "did you mean llama3-8b" in msg and "'lama3-8b'" in msg
    assert all(name in msg for name in ZOO)


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(AutoshardError, match="sequence length in 1..16"):
        get_model("gpt2-tiny", seq=17)
    with pytest.raises(AutoshardError, match="no sequence"):
        get_model("mlp-tiny", seq=4)
    with pytest.raises(AutoshardError, match="batch"):
        get_model("llama-tiny", batch=0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible"):
        LlamaConfig(2, 32, 4, 3, 64)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(0, 32, 4)


def test_hf_without_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)   # makes `import transformers` fail
    with pytest.raises(AutoshardError, match="pip install"):
        hf.hf_gpt2_tiny()


_FACTORY = """
import torch
from torch import nn

def build():
    return nn.Linear(4, 2), (torch.randn(3, 4),)

def single():
    return nn.Linear(4, 2)

def bad_inputs():
    return nn.Linear(4, 2), ("not a tensor",)

not_callable = 3
"""


@pytest.fixture
def factory_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_model.py"
    path.write_text(_FACTORY)
    return path


def test_load_factory(factory_file: Path) -> None:
    model, inputs = load_factory(f"{factory_file}:build")
    assert isinstance(model, nn.Linear) and inputs[0].shape == (3, 4)


@pytest.mark.parametrize("suffix, match", [
    (":missing", "no such function"), (":not_callable", "got an object of type int"),
    (":single", "got an object of type Linear"),
    (":bad_inputs", "example_inputs a tuple of \\(str\\)"),
    ("", "path/to/file.py:function"),
])
def test_load_factory_errors(factory_file: Path, suffix: str, match: str) -> None:
    with pytest.raises(AutoshardError, match=match):
        load_factory(f"{factory_file}{suffix}")


def test_load_factory_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AutoshardError, match="no such file"):
        load_factory(f"{tmp_path / 'nope.py'}:build")


# ---------------------------------------------------------------------------------------- loss


def test_with_loss_names_and_calls() -> None:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    wrapped = with_loss(inner, F.mse_loss)
    assert [n for n, _ in wrapped.named_parameters()][0] == "model.0.weight"
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    expected = F.mse_loss(inner(x), y)
    assert torch.equal(wrapped(x, y), expected) and torch.equal(wrapped(x, target=y), expected)
    ep = torch.export.export(wrapped, (x, y), strict=False)
    assert "model.0.weight" in ep.graph_signature.parameters
    with pytest.raises(AutoshardError, match="target"):
        wrapped(x)


def test_as_loss_module() -> None:
    class Scalar(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.sum()

    class WithOutput(nn.Module):
        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> object:
            return type("Out", (), {"loss": None if labels is None else (x - labels).sum()})()

    x = torch.ones(2, 3)
    assert as_loss_module(Scalar())(x).item() == 6.0
    assert as_loss_module(WithOutput())(x, labels=torch.zeros(2, 3)).item() == 6.0
    with pytest.raises(AutoshardError, match="pass labels"):
        as_loss_module(WithOutput())(x)


@needs_transformers
def test_as_loss_module_on_hugging_face_model() -> None:
    torch.manual_seed(0)
    wrapped, (ids, labels) = get_model("hf-bert-tiny", device="cpu")
    loss = as_loss_module(wrapped.model)(input_ids=ids, labels=labels)
    assert torch.equal(loss, wrapped(ids, labels)) and math.isfinite(loss.item())


def test_a_zoo_models_graph_is_reused_only_where_nothing_it_depends_on_changed(monkeypatch
                                                                               ) -> None:
    """Tracing a zoo model built again by the same recipe returns the graph already made (the
    test suite and verify rebuild the same tiny models many times); a change of anything the
    graph depends on (a mode, a frozen parameter, a dtype, the batch, the config) traces
    anew, and a factory's model (user code) is never reused."""
    import torch

    from autoshard.trace.export import trace
    from autoshard.zoo.registry import get_model

    def fresh(**kw):
        torch.manual_seed(1)
        return get_model("gpt2-tiny", device="cpu", **kw)

    model, inputs = fresh()
    first = trace(model, inputs)
    model, inputs = fresh()
    assert trace(model, inputs) is first
    model.eval()
    assert trace(model, inputs) is not first
    model, inputs = fresh()
    next(model.parameters()).requires_grad_(False)
    assert trace(model, inputs) is not first
    model, inputs = fresh(batch=3)
    assert trace(model, inputs) is not first
    model, inputs = fresh()
    assert trace(model.double(), inputs) is not first
    model, inputs = fresh()
    del model._autoshard_recipe          # as a factory's model: never reused
    assert trace(model, inputs) is not first
    monkeypatch.setenv("AUTOSHARD_TRACE_REUSE", "0")     # the benchmarks time tracing too
    model, inputs = fresh()
    assert trace(model, inputs) is not first


@needs_transformers
def test_a_config_models_graph_is_traced_anew_when_its_config_changes(tmp_path) -> None:
    """A Hugging Face model built from a config.json is reused like a zoo model, but not
    across a change of its config that the module tree does not show (a field, transformers'
    experts implementation, kept in a private field of the wrapped model's config)."""
    import json

    from autoshard.ops.moe import ROUTED_EXPERTS
    from autoshard.tools.verify import build
    from autoshard.trace.export import trace
    from test_unseen import CONFIGS
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["qwen3_moe"]))
    model, inputs = build(str(path), 2, 8, 0)
    first = trace(model, inputs)
    again, inputs = build(str(path), 2, 8, 0)
    assert trace(again, inputs) is first
    again.model.set_experts_implementation("grouped_mm")
    grouped = trace(again, inputs)
    assert grouped is not first
    assert not any(n.target is ROUTED_EXPERTS for n in grouped.graph.nodes)
    model.model.config.rope_theta = 5.0
    assert trace(model, inputs) is not first


@needs_transformers
def test_a_config_models_graph_is_traced_anew_when_a_method_is_put_back(tmp_path) -> None:
    """The methods zoo/hf.py replaces on an instance are part of the key, not only ``forward``:
    RecurrentGemma with transformers' own ``_rnn_scan`` again (its loop over the sequence) is
    traced anew, not given the graph of the one-op scan (it was: the key named forwards only)."""
    import json

    from autoshard.ops.ssm import LINEAR_SCAN
    from autoshard.tools.verify import build
    from autoshard.trace.export import trace
    from test_unseen import CONFIGS
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS["recurrent_gemma"]))
    model, inputs = build(str(path), 2, 8, 0)
    first = trace(model, inputs)
    assert sum(n.target is LINEAR_SCAN for n in first.graph.nodes) == 2
    again, inputs = build(str(path), 2, 8, 0)
    for m in again.modules():
        vars(m).pop("_rnn_scan", None)
    with pytest.warns(UserWarning, match="assigned during export"):   # (transformers' loop
        loop = trace(again, inputs)                                  # keeps its last state)
    assert loop is not first and not any(n.target is LINEAR_SCAN for n in loop.graph.nodes)
