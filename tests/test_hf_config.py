"""Hugging Face config.json files as models: `autoshard plan path/config.json`, verify, errors.

Tiny configs of six architectures are written to a temporary directory and built with
transformers' Auto classes (autoshard.zoo.hf.from_config), on the meta device to plan and on CPU
to verify on gloo ranks.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from autoshard.tools.cli import main  # noqa: E402
from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.plans import Plan  # noqa: E402
from autoshard.solver.planner import plan  # noqa: E402
from autoshard.zoo import from_config, load_model  # noqa: E402
from autoshard.zoo.hf import HFLossModel, infer_task  # noqa: E402

# Published configs' shapes at toy sizes, dropout off (so verify compares like with like).
TINY = {
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 64, "max_position_embeddings": 16,
              "bos_token_id": 0, "eos_token_id": 0, "torch_dtype": "float32"},
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 32,
             "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 16, "bos_token_id": 0,
             "eos_token_id": 0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0},
    "bert": {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 32,
             "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64,
             "vocab_size": 64, "max_position_embeddings": 16, "hidden_dropout_prob": 0.0,
             "attention_probs_dropout_prob": 0.0},
    "t5": {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": 32,
           "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2, "vocab_size": 64,
           "n_positions": 16, "dropout_rate": 0.0, "is_encoder_decoder": True,
           "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0},
    # transient-global attention; its encoder needs the attention mask autoshard passes
    "longt5": {"model_type": "longt5", "architectures": ["LongT5ForConditionalGeneration"],
               "d_model": 32, "d_ff": 64, "d_kv": 8, "num_heads": 4, "num_layers": 2,
               "vocab_size": 64, "dropout_rate": 0.0, "is_encoder_decoder": True,
               "encoder_attention_type": "transient-global", "local_radius": 2,
               "global_block_size": 2, "pad_token_id": 0, "eos_token_id": 1,
               "decoder_start_token_id": 0, "torch_dtype": "float32"},
    "vit": {"model_type": "vit", "architectures": ["ViTForImageClassification"],
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "image_size": 16, "patch_size": 4, "num_channels": 3,
            "num_labels": 10, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0},
}
TASK = {"llama": "causal-lm", "gpt2": "causal-lm", "bert": "masked-lm", "t5": "seq2seq",
        "longt5": "seq2seq", "vit": "image-classification"}
# A parameter each model must have, under the wrapper's ``model.``
PARAM = {"llama": "model.model.layers.1.self_attn.q_proj.weight",
         "gpt2": "model.transformer.h.1.attn.c_attn.weight",
         "bert": "model.bert.encoder.layer.1.attention.self.query.weight",
         "t5": "model.decoder.block.1.layer.0.SelfAttention.q.weight",
         "longt5": "model.encoder.block.1.layer.0.TransientGlobalSelfAttention.q.weight",
         "vit": "model.vit.layers.1.attention.q_proj.weight"}


def write(tmp_path: Path, name: str, fields: dict | str) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(fields if isinstance(fields, str) else json.dumps(fields))
    return str(path)


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("configs")
    return {name: write(root, name, fields) for name, fields in TINY.items()}


def one_line_error(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error:") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# ---------------------------------------------------------------------------------- planning


@pytest.mark.parametrize("name", list(TINY))
def test_plan_a_config_from_the_cli(configs, name: str, tmp_path, capsys) -> None:
    out = tmp_path / "plan.json"
    sizes = ["--batch", "2"] + ([] if name == "vit" else ["--seq", "8"])
    assert main(["plan", configs[name], "--mesh", "2", "--cluster", "cpu", *sizes,
                 "-o", str(out)]) == 0
    assert f"autoshard plan {configs[name]} on mesh 2 (x), cluster cpu, training" in \
        capsys.readouterr().out
    p = Plan.load(out)
    assert p.model == configs[name] and p.training and p.solver["status"] == "OPTIMAL"
    assert PARAM[name] in p.params
    assert len(p.layers) >= 2       # the numbered blocks are found as layers
    shape = [2, 3, 16, 16] if name == "vit" else [2, 8]
    assert list(p.input_meta["input0"][0]) == shape


def test_python_equivalents(configs) -> None:
    model = from_config(configs["t5"])
    assert isinstance(model, HFLossModel) and model.task == "seq2seq"
    assert next(model.parameters()).device.type == "meta"
    assert next(model.parameters()).dtype == torch.bfloat16    # no torch_dtype: bf16
    ids, labels = model.example_inputs(2, None)
    assert ids.shape == labels.shape == (2, 16)    # default seq capped at n_positions
    # load_model: the CLI's path, with the config's torch_dtype (float32 for this llama).
    model, inputs = load_model(configs["llama"], batch=3, seq=8, device="meta")
    assert next(model.parameters()).dtype == torch.float32
    assert [tuple(t.shape) for t in inputs] == [(3, 8), (3, 8)]
    p = plan(model, inputs, Mesh((2,), cluster="cpu"))
    assert PARAM["llama"] in p.params


def test_directory_holding_config_json(configs, tmp_path, capsys) -> None:
    folder = tmp_path / "llama-checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(Path(configs["llama"]).read_text())
    assert main(["plan", str(folder), "--mesh", "2", "--cluster", "cpu", "--batch", "2",
                 "--seq", "8"]) == 0
    assert "training" in capsys.readouterr().out


def test_forward_returns_the_loss_on_cpu(configs) -> None:
    torch.manual_seed(0)
    for name in ("bert", "vit"):
        model, inputs = load_model(configs[name], batch=2, seq=None if name == "vit" else 8,
                                   device="cpu")
        loss = model.float()(*(t.float() if t.is_floating_point() else t for t in inputs))
        assert loss.shape == () and torch.isfinite(loss)


@pytest.mark.parametrize("name", ["llama", "longt5"])
def test_verify_a_config_on_gloo(configs, name: str, capsys) -> None:
    assert main(["verify", configs[name], "--mesh", "2", "--batch", "2", "--seq", "8"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("PASS") and "bytes planned" in out


# ---------------------------------------------------------------------------- task inference


@pytest.mark.parametrize("arch, model_type, task", [
    ("LlamaForCausalLM", "llama", "causal-lm"),
    ("GPT2LMHeadModel", "gpt2", "causal-lm"),
    ("BertForMaskedLM", "bert", "masked-lm"),
    ("BertForPreTraining", "bert", "masked-lm"),           # by its suffix
    ("T5ForConditionalGeneration", "t5", "seq2seq"),
    ("T5WithLMHeadModel", "t5", "seq2seq"),                # older T5 configs name this
    ("ViTForImageClassification", "vit", "image-classification"),
])
def test_task_from_architectures(arch: str, model_type: str, task: str) -> None:
    fields = {"model_type": model_type, "architectures": [arch],
              "is_encoder_decoder": model_type == "t5"}
    assert infer_task(fields) == task


def test_task_from_model_type_when_only_one_fits() -> None:
    assert infer_task({"model_type": "llama"}) == "causal-lm"
    assert infer_task({"model_type": "vit"}) == "image-classification"
    with pytest.raises(AutoshardError, match="causal-lm, masked-lm.*pass --task"):
        infer_task({"model_type": "bert"})          # BertLMHeadModel and BertForMaskedLM
    with pytest.raises(AutoshardError, match="MistralForSequenceClassification"):
        infer_task({"model_type": "mistral",
                    "architectures": ["MistralForSequenceClassification"]})


def test_explicit_task_picks_the_auto_class(configs) -> None:
    fields = {k: v for k, v in TINY["bert"].items() if k != "architectures"}
    assert from_config(fields, task="causal-lm").model.__class__.__name__ == "BertLMHeadModel"
    assert from_config(fields, task="masked-lm").model.__class__.__name__ == "BertForMaskedLM"


# ------------------------------------------------------------------------------------ errors


def test_missing_file_and_directory(tmp_path, capsys) -> None:
    err = one_line_error(capsys, ["plan", str(tmp_path / "nope.json"), "--mesh", "2"])
    assert "config.json" in err and "no such file" in err
    err = one_line_error(capsys, ["plan", str(tmp_path), "--mesh", "2"])
    assert "has no config.json" in err


def test_config_that_is_not_json(tmp_path, capsys) -> None:
    err = one_line_error(capsys, ["plan", write(tmp_path, "bad", "{nope"), "--mesh", "2"])
    assert "readable JSON" in err
    err = one_line_error(capsys, ["plan", write(tmp_path, "list", "[1, 2]"), "--mesh", "2"])
    assert "one JSON object" in err and "list" in err


def test_config_without_model_type(tmp_path, capsys) -> None:
    path = write(tmp_path, "c", {"hidden_size": 32})
    err = one_line_error(capsys, ["plan", path, "--mesh", "2"])
    assert "model_type" in err and "hidden_size" in err and "Fix:" in err


def test_unknown_model_type_suggests_close_ones(tmp_path, capsys) -> None:
    err = one_line_error(capsys, ["plan", write(tmp_path, "c", {"model_type": "lama"}),
                                  "--mesh", "2"])
    assert "'lama'" in err and "did you mean llama" in err


def test_unknown_task(configs, capsys) -> None:
    err = one_line_error(capsys, ["plan", configs["llama"], "--mesh", "2", "--task", "causal"])
    assert "'causal'" in err and "did you mean causal-lm" in err


def test_task_the_model_class_does_not_support(configs, capsys) -> None:
    err = one_line_error(capsys, ["plan", configs["gpt2"], "--mesh", "2", "--task",
                                  "image-classification"])
    assert "gpt2" in err and "'image-classification'" in err and "--task causal-lm" in err


def test_ambiguous_task_asks_for_one(configs, tmp_path, capsys) -> None:
    fields = {k: v for k, v in TINY["bert"].items() if k != "architectures"}
    err = one_line_error(capsys, ["plan", write(tmp_path, "bert", fields), "--mesh", "2"])
    assert "--task" in err and "masked-lm" in err


def test_field_transformers_refuses(tmp_path, capsys) -> None:
    fields = dict(TINY["llama"], hidden_size=30)      # not a multiple of 4 heads
    err = one_line_error(capsys, ["plan", write(tmp_path, "c", fields), "--mesh", "2"])
    assert "LlamaForCausalLM" in err and "(30)" in err


def test_task_for_a_zoo_model_is_refused(capsys) -> None:
    err = one_line_error(capsys, ["plan", "gpt2-tiny", "--mesh", "2", "--task", "causal-lm"])
    assert "only for a Hugging Face config" in err


def test_sizes_the_model_cannot_take(configs, capsys) -> None:
    err = one_line_error(capsys, ["plan", configs["llama"], "--mesh", "2", "--seq", "17"])
    assert "seq in 1..16" in err
    err = one_line_error(capsys, ["plan", configs["vit"], "--mesh", "2", "--seq", "8"])
    assert "image" in err and "seq=8" in err


def test_bad_torch_dtype(tmp_path) -> None:
    with pytest.raises(AutoshardError, match="torch_dtype 'int8'"):
        from_config(dict(TINY["llama"], torch_dtype="int8"))


def test_without_transformers(configs, monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)   # makes `import transformers` fail
    err = one_line_error(capsys, ["plan", configs["llama"], "--mesh", "2"])
    assert "transformers" in err and "pip install" in err


def test_a_model_type_with_several_classes_for_its_task() -> None:
    """DeiT has two image classifiers (with and without its distillation teacher): the one the
    config's architectures name is built, else the first; transformers itself failed on a config
    naming none."""
    fields = dict(model_type="deit", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  intermediate_size=64, image_size=32, patch_size=16, num_labels=3)
    assert type(from_config(fields).model).__name__ == "DeiTForImageClassification"
    teacher = dict(fields, architectures=["DeiTForImageClassificationWithTeacher"])
    assert type(from_config(teacher, task="image-classification").model).__name__ == \
        "DeiTForImageClassificationWithTeacher"


def test_layerdrop_while_training_is_refused_naming_the_fields() -> None:
    """M2M-100's LayerDrop (0.05 by default) skips whole layers at random in training, which
    export cannot follow: refused naming the config fields to set; with them at 0 it plans."""
    fields = dict(model_type="m2m_100", d_model=32, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                  decoder_ffn_dim=64, vocab_size=64, max_position_embeddings=64)
    model = from_config(fields, task="seq2seq")
    with pytest.raises(AutoshardError, match=r"without LayerDrop.*encoder_layerdrop"):
        plan(model, model.example_inputs(2, 8), Mesh((2,)))
    model = from_config(dict(fields, encoder_layerdrop=0.0, decoder_layerdrop=0.0),
                        task="seq2seq")
    assert plan(model, model.example_inputs(2, 8), Mesh((2,))).predicted.step_time_s > 0


def test_a_multimodal_config_plans_its_language_model_from_text_config() -> None:
    """Gemma 3's published config.json (model_type gemma3) keeps the vocabulary and positions
    in text_config: a causal-LM plan reads them there (it was refused: vocab_size 0)."""
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=96,
                max_position_embeddings=64, sliding_window=8,
                layer_types=["sliding_attention", "full_attention"])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=32, patch_size=16)
    model = from_config(dict(model_type="gemma3", text_config=text, vision_config=vision,
                             mm_tokens_per_image=4), task="causal-lm")
    assert (model.vocab_size, model.context) == (96, 64)
    ids, _ = model.example_inputs(2, 8)
    assert plan(model, (ids, ids), Mesh((2,))).predicted.step_time_s > 0
