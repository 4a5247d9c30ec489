"""Named models with example inputs: ``get_model("llama3-8b")`` and user factories.

Real-size presets build in bfloat16 with batch 8 and the model's usual training sequence length;
the ``*-tiny`` presets build in float32 for CPU tests. Everything builds on the meta device by
default, where a 175B model costs no memory.
"""
from __future__ import annotations

import difflib
import hashlib
import importlib.util
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Union

import torch
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.zoo import hf
from autoshard.zoo.models import (GPT, MLP, Bert, BertConfig, GPTConfig, Llama, LlamaConfig,
                                  MLPConfig)
from autoshard.zoo.moe import GShardMoE, MoEConfig

ModelConfig = Union[MLPConfig, GPTConfig, LlamaConfig, BertConfig, MoEConfig]
Builder = Callable[[Union[torch.dtype, None]], nn.Module]
BF16 = torch.bfloat16


@dataclass(frozen=True, slots=True)
class ZooEntry:
    """A named model: ``build(dtype)`` makes it on the ambient device (dtype None: the preset's).

    ``seq`` is None for models without a sequence dimension (the MLP). ``config`` is the family
    config for the plain-PyTorch models and None for the Hugging Face ones.
    """

    description: str
    build: Builder
    batch: int
    seq: int | None
    config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.batch < 1 or (self.seq is not None and self.seq < 1):
            raise ValueError(f"ZooEntry batch and seq must be positive; got batch={self.batch}, "
                             f"seq={self.seq}. Fix: use positive defaults.")


def _from_config(cls: Callable[[Any], nn.Module], cfg: ModelConfig,
                 dtype: torch.dtype | None) -> nn.Module:
    return cls(cfg if dtype is None else replace(cfg, dtype=dtype))


def _entry(description: str, cfg: ModelConfig, *, batch: int = 8,
           seq: int | None = None) -> ZooEntry:
    cls = {MLPConfig: MLP.from_config, GPTConfig: GPT, LlamaConfig: Llama, BertConfig: Bert,
           MoEConfig: GShardMoE}
    if seq is None and not isinstance(cfg, MLPConfig):
        seq = cfg.context  # the usual training length is the context for every preset here
    return ZooEntry(description, partial(_from_config, cls[type(cfg)], cfg), batch, seq, cfg)


def _presets(family: Callable[..., ModelConfig],
             rows: list[tuple[Any, ...]]) -> dict[str, ZooEntry]:
    """A zoo entry per ``(name, description, *dims)`` row with config ``family(*dims)``.

    ``dims`` are the config's leading positional fields; ``family`` fixes the rest.
    """
    return {name: _entry(description, family(*dims)) for name, description, *dims in rows}


# The settings a family's sizes share: tokenizer, training context, rotary base, dtype.
_GPT2 = partial(GPTConfig, vocab_size=50257, context=1024, dtype=BF16)
_GPT3 = partial(GPTConfig, vocab_size=50257, context=2048, dtype=BF16)
_LLAMA2 = partial(LlamaConfig, vocab_size=32000, context=4096, rope_theta=10000.0, dtype=BF16)
_LLAMA3 = partial(LlamaConfig, vocab_size=128256, context=8192, rope_theta=500000.0, dtype=BF16)

# GPT dims: n_layers, hidden, n_heads.
_GPT2_PRESETS = _presets(_GPT2, [
    ("gpt2", "GPT-2 small 124M (12 layers, 768, 12 heads)", 12, 768, 12),
    ("gpt2-medium", "GPT-2 medium 355M (24, 1024, 16)", 24, 1024, 16),
    ("gpt2-large", "GPT-2 large 774M (36, 1280, 20)", 36, 1280, 20),
    ("gpt2-xl", "GPT-2 XL 1.5B (48, 1600, 25)", 48, 1600, 25),
])
_GPT3_PRESETS = _presets(_GPT3, [
    ("gpt3-125m", "GPT-3 125M (12, 768, 12)", 12, 768, 12),
    ("gpt3-350m", "GPT-3 350M (24, 1024, 16)", 24, 1024, 16),
    ("gpt3-760m", "GPT-3 760M (24, 1536, 16)", 24, 1536, 16),
    # The paper prints 24 heads of 128, which does not divide 2048; 32 heads as Alpa does.
    ("gpt3-1.3b", "GPT-3 1.3B (24, 2048, 32)", 24, 2048, 32),
    ("gpt3-2.7b", "GPT-3 2.7B (32, 2560, 32)", 32, 2560, 32),
    ("gpt3-6.7b", "GPT-3 6.7B (32, 4096, 32)", 32, 4096, 32),
    # The paper prints d_model 5140, which 40 heads do not divide; 5120 (head dim 128) is the
    # value every reimplementation trains with.
    ("gpt3-13b", "GPT-3 13B (40, 5120, 40)", 40, 5120, 40),
    ("gpt3-175b", "GPT-3 175B (96, 12288, 96)", 96, 12288, 96),
])
# Llama dims: n_layers, hidden, n_heads, n_kv_heads, ffn.
_LLAMA2_PRESETS = _presets(_LLAMA2, [
    ("llama2-7b", "Llama-2 7B (32, 4096, 32 heads, MHA)", 32, 4096, 32, 32, 11008),
    ("llama2-13b", "Llama-2 13B (40, 5120, 40 heads, MHA)", 40, 5120, 40, 40, 13824),
    ("llama2-70b", "Llama-2 70B (80, 8192, 64 heads, 8 kv heads)", 80, 8192, 64, 8, 28672),
])
_LLAMA3_PRESETS = _presets(_LLAMA3, [
    ("llama3-8b", "Llama-3 8B (32, 4096, 32 heads, 8 kv heads, vocab 128256)",
     32, 4096, 32, 8, 14336),
    ("llama3-70b", "Llama-3 70B (80, 8192, 64 heads, 8 kv heads, vocab 128256)",
     80, 8192, 64, 8, 28672),
])

# GShard MoE: Alpa's benchmark suite sizes (Zheng et al., OSDI'22, §8.1; its "moe" suite):
# seq 1024, 16 heads, vocab 32000, FFN 8 x hidden, every other layer MoE with top-2 gating over
# groups of 2048 tokens, head tied. Batch 16: 16 x 1024 tokens make 8 groups, which an 8-device
# mesh splits. Dims: n_layers, hidden, n_heads, n_experts.
_GSHARD = partial(MoEConfig, vocab_size=32000, context=1024, group_size=2048, dtype=BF16)
_GSHARD_PRESETS = {name: _entry(f"GShard MoE {size} ({layers} layers, {hidden}, {experts} "
                                f"experts, top-2; Alpa benchmark suite sizes)",
                                _GSHARD(layers, hidden, 16, experts), batch=16)
                   for name, size, layers, hidden, experts in [
                       ("gshard-moe-380m", "380M", 8, 768, 8),
                       ("gshard-moe-1.3b", "1.3B", 16, 768, 16),
                       ("gshard-moe", "2.4B", 16, 1024, 16),
                       ("gshard-moe-10b", "10B", 16, 1536, 32),
                       ("gshard-moe-27b", "27B", 16, 2048, 48),
                       ("gshard-moe-70b", "70B", 32, 2048, 64)]}
# 4 experts, groups of 8 tokens (capacity 4): a batch of 4 x 16 makes 8 groups.
_TINY_MOE = MoEConfig(2, 32, 4, 4, vocab_size=64, context=16, ffn_mult=4, group_size=8)

_TINY_GPT = GPTConfig(2, 32, 4, vocab_size=64, context=16)
_TINY_LLAMA = LlamaConfig(2, 32, 4, 2, 64, vocab_size=64, context=16)
_TINY_BERT = BertConfig(2, 32, 4, 64, vocab_size=64, context=16)

ZOO: dict[str, ZooEntry] = {
    "mlp": _entry("MLP, 8 Linear+ReLU layers of width 4096 (134M params), MSE loss",
                  MLPConfig(8, 4096, dtype=BF16), batch=1024),
    "mlp-tiny": _entry("MLP, 3 layers of width 16, fp32", MLPConfig(3, 16), batch=8),
    **_GPT2_PRESETS,
    **_GPT3_PRESETS,
    **_LLAMA2_PRESETS,
    **_LLAMA3_PRESETS,
    **_GSHARD_PRESETS,
    "bert-large": _entry("BERT-large 335M MLM (24, 1024, 16 heads)",
                         BertConfig(24, 1024, 16, 4096, vocab_size=30522, context=512, dtype=BF16)),
    "gpt2-tiny": _entry("GPT-2 style, 2 layers, hidden 32, fp32", _TINY_GPT, batch=4),
    "llama-tiny": _entry("Llama style, 2 layers, hidden 32, 2 kv heads, fp32", _TINY_LLAMA,
                         batch=4),
    "bert-tiny": _entry("BERT style, 2 layers, hidden 32, fp32", _TINY_BERT, batch=4),
    "gshard-moe-tiny": _entry("GShard MoE, 2 layers (the second MoE), hidden 32, 4 experts, "
                              "top-2, groups of 8 tokens, fp32", _TINY_MOE, batch=4),
    # Deep enough for two pipeline stages per rank on 2 ranks (interleaved 1F1B).
    "gpt2-tiny-4l": _entry("GPT-2 style, 4 layers, hidden 32, fp32",
                           GPTConfig(4, 32, 4, vocab_size=64, context=16), batch=4),
    "llama-tiny-4l": _entry("Llama style, 4 layers, hidden 32, 2 kv heads, fp32",
                            LlamaConfig(4, 32, 4, 2, 64, vocab_size=64, context=16), batch=4),
    "hf-gpt2-tiny": ZooEntry("HF GPT2LMHeadModel, 2 layers, hidden 32, fp32",
                             hf.hf_gpt2_tiny, 4, hf.TINY_SEQ),
    "hf-llama-tiny": ZooEntry("HF LlamaForCausalLM, 2 layers, hidden 32, fp32",
                              hf.hf_llama_tiny, 4, hf.TINY_SEQ),
    "hf-bert-tiny": ZooEntry("HF BertForMaskedLM, 2 layers, hidden 32, fp32",
                             hf.hf_bert_tiny, 4, hf.TINY_SEQ),
    "hf-resnet-tiny": ZooEntry("HF ResNetForImageClassification, 2 basic blocks, batch norm, "
                               "16x16 images, fp32", hf.hf_resnet_tiny, 8, None),
}


def _lookup(name: str) -> ZooEntry:
    if not isinstance(name, str):      # a list would fail as unhashable below
        raise AutoshardError("a model name from the zoo (a string)", got=repr(name),
                             fix=f"known names: {', '.join(sorted(ZOO))}")
    if name in ZOO:
        return ZOO[name]
    close = difflib.get_close_matches(name, list(ZOO), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise AutoshardError("a model name from the zoo", got=repr(name),
                         fix=f"{hint}known names: {', '.join(sorted(ZOO))}")


def mark_built(model: nn.Module, recipe: tuple) -> None:
    """Record how the zoo built ``model``: two models built by one recipe run the same code, so
    tracing may reuse one's graph for the other where their structure, tensors, modes and
    config are equal too (trace/export.py ``reusable``). Factories are user code: unmarked."""
    model._autoshard_recipe = recipe


def get_model(name: str, *, batch: int | None = None, seq: int | None = None,
              device: str | torch.device = "meta", dtype: torch.dtype | None = None,
              context: int | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Build zoo model ``name`` on ``device`` and example ``(inputs, labels)`` for it there.

    ``forward(*example_inputs)`` returns the scalar loss. Random weights and ids come from the
    global RNG: seed torch first for reproducible CPU models. ``context`` replaces the config's
    longest sequence (``context``) for long-context runs: a Llama's rotary positions have no
    parameters, so only the sequences it accepts change (a GPT's or BERT's learned position
    table grows with it).
    """
    entry = _lookup(name)
    _check_size("batch", batch)
    _check_size("seq", seq)
    _check_size("context", context)
    if context is not None:
        entry = _with_context(name, entry, context)
    if entry.seq is None and seq is not None:
        raise AutoshardError(f"{name} has no sequence dimension", got=f"seq={seq}",
                             fix="leave seq unset for this model")
    device = torch.device(device)
    with device:
        model = entry.build(dtype)
    batch = entry.batch if batch is None else batch
    seq = entry.seq if seq is None else seq
    mark_built(model, ("zoo", name, repr(entry.config)))
    return model, model.example_inputs(batch, seq, device=device)


def _with_context(name: str, entry: ZooEntry, context: int) -> ZooEntry:
    cfg = entry.config
    if cfg is None or not hasattr(cfg, "context"):
        raise AutoshardError("a context (--context) for a zoo model whose config has one "
                             "(GPT, Llama, BERT, GShard MoE)", got=f"context={context} for {name}",
                             fix="drop --context; a Hugging Face config sets "
                                 "max_position_embeddings in its config.json")
    return _entry(entry.description, replace(cfg, context=context), batch=entry.batch,
                  seq=min(entry.seq, context) if entry.seq else None)


def _check_size(what: str, value: object) -> None:
    # The models check the range as well, but a float or a bool would first reach torch.randint
    # and fail there with a TypeError.
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise AutoshardError(f"{what} is a positive int (or None for the model's default)",
                             got=f"{what}={value!r}", fix=f"pass e.g. {what}=8")


# ------------------------------------------------------------------------------ user factories


def _import_file(path: Path) -> ModuleType:
    # A unique module name per file, registered before exec so that dataclasses and pickling
    # inside the user's file can find their own module.
    digest = hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:10]
    name = f"autoshard_user_{path.stem}_{digest}".replace("-", "_").replace(".", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _check_factory_result(spec: str, result: object) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    contract = f"factory {spec} returns (model: nn.Module, example_inputs: tuple of tensors)"
    fix = "end the factory with `return model, (input_ids, labels)`"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise AutoshardError(contract, got=_describe(result), fix=fix)
    model, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(model, nn.Module):
        raise AutoshardError(contract, got=f"a model of type {type(model).__name__}", fix=fix)
    if not isinstance(inputs, (tuple, list)) or not inputs or not all(
            isinstance(t, torch.Tensor) for t in inputs):
        if isinstance(inputs, (tuple, list)) and inputs:   # a tuple holding a non-tensor
            fix = ("make every example input a tensor: a number as torch.tensor(0.5), or kept "
                   "in the model (an attribute, or a default of forward's argument)")
        raise AutoshardError(contract, got=f"example_inputs {_describe(inputs)}", fix=fix)
    return model, tuple(inputs)


def _describe(value: object) -> str:
    if isinstance(value, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in value)
        return f"a {type(value).__name__} of ({inner})"
    return f"an object of type {type(value).__name__}"


def load_factory(spec: str) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """Import ``path/to/file.py`` and call its ``factory()`` from ``"path/to/file.py:factory"``.

    The factory takes no arguments and returns ``(model, example_inputs)``; the model and inputs
    live wherever the factory puts them (build on ``torch.device("meta")`` to plan big models).
    """
    path_text, sep, func_name = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
    # Only a .py file: importlib has no loader for other suffixes.
    if not sep or not path_text.endswith(".py") or not func_name.isidentifier():
        raise AutoshardError("a model factory is given as 'path/to/file.py:function'",
                             got=repr(spec), fix="e.g. 'models/my_model.py:build'")
    path = Path(path_text)
    if not path.is_file():
        raise AutoshardError(f"a Python file at {path_text}", got="no such file",
                             fix="check the path (relative paths start at the working directory)")
    module = _run_user_code(partial(_import_file, path),
                            expected=f"a Python file {path_text} that imports without error",
                            fix=f"make `python {path_text}` run cleanly")
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise AutoshardError(f"a function {func_name}() in {path_text}",
                             got="no such function" if factory is None
                             else f"an object of type {type(factory).__name__}",
                             fix=f"define `def {func_name}(): ... return model, example_inputs`")
    result = _run_user_code(factory, expected=f"factory {spec}, called with no arguments, "
                                              "returns (model, example_inputs)",
                            fix=f"repair {func_name}() (a factory takes no arguments)")
    return _check_factory_result(spec, result)


def _run_user_code(fn: Callable[[], Any], *, expected: str, fix: str) -> Any:
    """``fn()``, which runs the user's file: its mistakes (a syntax error, a failing import, a
    factory that raises) become an AutoshardError, the original chained for its traceback."""
    try:
        return fn()
    except AutoshardError:
        raise               # already says what to fix (a zoo name the factory looked up)
    # SystemExit: a script that parses sys.argv or exits at import. SyntaxError's text carries
    # the file and the line.
    except (Exception, SystemExit) as e:
        first = str(e).splitlines()[0] if str(e) else ""
        raise AutoshardError(expected, got=f"{type(e).__name__}: {first}",
                             fix=f"{fix}; the full error is chained below") from e


__all__ = ["ZOO", "ZooEntry", "get_model", "load_config", "load_factory", "load_model"]


def load_model(name: str, *, batch: int | None, seq: int | None, device: str,
               task: str | None = None, context: int | None = None):
    """(model, example_inputs) for a zoo name, ``path/to/file.py:factory`` returning them, or a
    Hugging Face config (``path/config.json`` or a directory holding one; ``task`` as
    ``hf.from_config`` takes it, default from the config). A zoo name wins over a directory of
    the same name: write ``./gpt2`` for the directory."""
    if task is not None and (not hf.is_config_path(name) or name in ZOO):
        raise AutoshardError("a task (--task) only for a Hugging Face config.json",
                             got=f"task={task!r} for {name!r}",
                             fix="drop --task: zoo models and factories build their own loss")
    if isinstance(name, str) and ":" in name and name.split(":", 1)[0].endswith(".py"):
        if batch is not None or seq is not None:    # the factory's inputs would ignore them
            raise AutoshardError("batch and seq for zoo models only: a factory builds its own "
                                 "example inputs", got=f"batch={batch}, seq={seq} for {name}",
                                 fix="drop --batch/--seq, or set the sizes inside the factory")
        return load_factory(name)
    if context is not None and name not in ZOO:
        raise AutoshardError("a context (--context) for a zoo model", got=f"context={context} "
                             f"for {name}", fix="set the context inside the factory or the "
                                                "config.json (max_position_embeddings)")
    if hf.is_config_path(name) and name not in ZOO:
        return load_config(name, batch=batch, seq=seq, device=device, task=task)
    return get_model(name, batch=batch, seq=seq, device=device, context=context)


def load_config(path: str | Path, *, batch: int | None = None, seq: int | None = None,
                device: str | torch.device = "meta", task: str | None = None,
                dtype: torch.dtype | None = None) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model of a Hugging Face config.json (``hf.from_config``) and one training step's
    example inputs: batch (default 8) x seq (default 2048, capped at the model's positions), or
    images of the config's size."""
    _check_size("batch", batch)
    _check_size("seq", seq)
    device = torch.device(device)
    model = hf.from_config(path, task=task, dtype=dtype, device=device)
    mark_built(model, ("config", str(Path(path).resolve()), task))
    return model, model.example_inputs(8 if batch is None else batch, seq, device=device)
