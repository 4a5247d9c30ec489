"""Hugging Face transformers models: tiny ones built from their config classes, and any model
built from a ``config.json`` with transformers' Auto classes (``from_config``; no weights, no
downloads, on the meta device by default).

transformers is an optional dependency: it is imported only when one of these is built, and a
missing install raises ``AutoshardError``. Each model is wrapped in ``HFLossModel`` so that
``forward(input_ids, labels)`` (``(pixel_values, labels)`` for image classification) returns the
scalar training loss; the HF model is the attribute ``model``, so its parameter names read
``model.<hf name>`` (``model.transformer.h.0...``).
"""
from __future__ import annotations

import contextlib
import difflib
import json
import types
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from autoshard.errors import AutoshardError

# Shared tiny sizes, the same as the plain-PyTorch tiny presets, so the two can be compared.
TINY_VOCAB, TINY_SEQ, TINY_HIDDEN, TINY_HEADS, TINY_LAYERS, TINY_FFN = 64, 16, 32, 4, 2, 64


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as exc:
        raise AutoshardError("Hugging Face models (the hf-* zoo models, config.json files) need "
                             "the optional dependency transformers",
                             got=f"ImportError: {exc}",
                             fix="pip install 'transformers>=4.45' (or autoshard[test])") from None
    return transformers


@contextlib.contextmanager
def _quiet(transformers: ModuleType) -> Iterator[None]:
    # Config and model construction log advice that does not apply to tiny random models.
    logging = transformers.utils.logging
    previous = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(previous)


TASKS = ("causal-lm", "masked-lm", "seq2seq", "image-classification")
# task -> (transformers Auto class, the name of its model_type -> class name table)
_AUTO = {
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    "masked-lm": ("AutoModelForMaskedLM", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
    "seq2seq": ("AutoModelForSeq2SeqLM", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    "image-classification": ("AutoModelForImageClassification",
                             "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
}
# The sequence length a text model is planned at when none is given: the usual pretraining
# length, capped at the model's position limit (BERT and T5: 512).
DEFAULT_SEQ = 2048


def max_positions(config: Any) -> int:
    """The longest sequence a text model's config allows (T5's positions are relative: its
    published n_positions, 512, is the length it was trained at)."""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 1 << 30


class HFLossModel(nn.Module):
    """``forward(*inputs) -> model(**dict(zip(input_names, inputs))).loss``.

    Hugging Face forwards take ``labels`` (and ViT its ``pixel_values``) only by keyword, while
    autoshard traces ``model(*example_inputs)``: the inputs are ``(input_ids, labels)``, or
    ``(pixel_values, labels)`` for ``task="image-classification"``. A seq2seq model also gets
    an attention mask of ones, made inside ``forward`` (see there).
    """

    def __init__(self, model: nn.Module, *, vocab_size: int | None = None,
                 context: int | None = None, task: str = "causal-lm") -> None:
        super().__init__()
        assert task in TASKS, task
        self.model, self.task = model, task
        config = getattr(model, "config", None)
        # (a multimodal config, Gemma 3's, keeps its language model's fields in text_config)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        self.input_names = ("pixel_values" if task == "image-classification" else "input_ids",
                            "labels")
        self.vocab_size = vocab_size if vocab_size is not None else \
            getattr(config, "vocab_size", None) or getattr(text, "vocab_size", 0)
        self.context = context if context is not None else \
            min(max_positions(config), max_positions(text))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if len(inputs) != len(self.input_names):
            raise AutoshardError(f"this model takes ({', '.join(self.input_names)})",
                                 got=f"{len(inputs)} positional inputs",
                                 fix="pass them in that order, as example_inputs() makes them")
        kwargs = dict(zip(self.input_names, inputs))
        if self.task == "seq2seq":
            # The mask a tokenizer gives with unpadded ids (every token attended), as training
            # passes it: without one, some encoders do not trace (LongT5 and Switch
            # Transformers index it unchecked; LongT5's transient-global attention, at real
            # size, builds tensors off the meta device), where their eager path makes one.
            kwargs["attention_mask"] = torch.ones_like(inputs[0])
        return self.model(**kwargs).loss

    def example_inputs(self, batch: int, seq: int | None, *,
                       device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
        """One training step's inputs with labels: token ids (``seq`` None: the default length,
        DEFAULT_SEQ capped at the model's positions), or images of the config's size."""
        if self.task == "image-classification":
            return self._images(batch, seq, device)
        if not isinstance(self.vocab_size, int) or self.vocab_size < 1:
            raise AutoshardError("a text model whose config gives its vocab_size",
                                 got=f"vocab_size {self.vocab_size!r}",
                                 fix="add vocab_size to the config (or build the model yourself "
                                     "and plan it with a factory)")
        if seq is None:
            seq = min(DEFAULT_SEQ, self.context)
        if not 1 <= seq <= self.context or batch < 1:
            raise AutoshardError(f"this model takes batch >= 1 and seq in 1..{self.context}",
                                 got=f"batch={batch!r}, seq={seq!r}",
                                 fix=f"pass batch >= 1 and seq <= {self.context}")
        return (torch.randint(0, self.vocab_size, (batch, seq), device=device),
                torch.randint(0, self.vocab_size, (batch, seq), device=device))

    def _images(self, batch: int, seq: int | None,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        if seq is not None:
            raise AutoshardError("no sequence length for an image-classification model (its "
                                 "inputs are images of the config's image_size)",
                                 got=f"seq={seq}", fix="leave seq (--seq) unset")
        if batch < 1:
            raise AutoshardError("batch >= 1", got=f"batch={batch!r}", fix="pass batch >= 1")
        config = self.model.config
        size = getattr(config, "image_size", 224)     # a ResNet config names none: ImageNet's
        size = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()),
                     torch.float32)
        pixels = torch.randn(batch, getattr(config, "num_channels", 3), *size, dtype=dtype,
                             device=device)
        return pixels, torch.randint(0, config.num_labels, (batch,), device=device)


def _wrap(build: Callable[[ModuleType], nn.Module], dtype: torch.dtype | None,
          task: str = "causal-lm") -> HFLossModel:
    transformers = _transformers()
    with _quiet(transformers):
        model = build(transformers)
    if dtype is not None:
        model = model.to(dtype)
    return HFLossModel(model, vocab_size=TINY_VOCAB, context=TINY_SEQ, task=task)


def _gpt2(tf: ModuleType) -> nn.Module:
    # bos/eos default to 50256, outside the tiny vocab; dropout off keeps the graph deterministic.
    config = tf.GPT2Config(vocab_size=TINY_VOCAB, n_positions=TINY_SEQ, n_embd=TINY_HIDDEN,
                           n_layer=TINY_LAYERS, n_head=TINY_HEADS, resid_pdrop=0.0,
                           embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                           use_cache=False, attn_implementation="sdpa")
    model = tf.GPT2LMHeadModel(config)
    # The class name does not match a loss family, so HF would warn on every call before
    # falling back to this very loss.
    model.loss_type = "ForCausalLM"
    return model


def _llama(tf: ModuleType) -> nn.Module:
    config = tf.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN,
                            intermediate_size=TINY_FFN, num_hidden_layers=TINY_LAYERS,
                            num_attention_heads=TINY_HEADS, num_key_value_heads=TINY_HEADS // 2,
                            max_position_embeddings=TINY_SEQ, rms_norm_eps=1e-5,
                            bos_token_id=0, eos_token_id=0,
                            use_cache=False, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(config)


def _bert(tf: ModuleType) -> nn.Module:
    config = tf.BertConfig(vocab_size=TINY_VOCAB, hidden_size=TINY_HIDDEN,
                           num_hidden_layers=TINY_LAYERS, num_attention_heads=TINY_HEADS,
                           intermediate_size=TINY_FFN, max_position_embeddings=TINY_SEQ,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                           use_cache=False, attn_implementation="sdpa")
    return tf.BertForMaskedLM(config)


def _resnet(tf: ModuleType) -> nn.Module:
    config = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                             depths=[1, 1], layer_type="basic", num_labels=4, image_size=16)
    return tf.ResNetForImageClassification(config)


def hf_gpt2_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """GPT2LMHeadModel: 2 layers, hidden 32, 4 heads, vocab 64, context 16 (tied head)."""
    return _wrap(_gpt2, dtype)


def hf_llama_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """LlamaForCausalLM: 2 layers, hidden 32, 4 heads, 2 kv heads, ffn 64, vocab 64, context 16."""
    return _wrap(_llama, dtype)


def hf_bert_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """BertForMaskedLM: 2 layers, hidden 32, 4 heads, ffn 64, vocab 64, context 16."""
    return _wrap(_bert, dtype, "masked-lm")


def hf_resnet_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """ResNetForImageClassification: 2 stages of one basic block (8 and 16 channels), batch
    norm after every convolution, 4 labels, 16x16 images."""
    return _wrap(_resnet, dtype, "image-classification")


# ------------------------------------------------------------------ any model from a config.json

_CONFIG_FIX = "pass the config.json published with the model, or the directory holding it"
# Keys that say how to store weights, not what the model is: the dtype is chosen here.
_DTYPE_KEYS = ("torch_dtype", "dtype")


def is_config_path(name: object) -> bool:
    """Whether a model argument names a Hugging Face config: ``*.json``, or a directory."""
    return isinstance(name, (str, Path)) and (str(name).endswith(".json") or Path(name).is_dir())


def read_config(path: str | Path) -> dict[str, Any]:
    """The fields of ``path`` (a config.json, or a directory holding one) as a dict."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        got = (f"directory {path} has no config.json" if path.is_dir()
               else f"{path}: no such file")
        raise AutoshardError("a Hugging Face config.json, or a directory holding one", got=got,
                             fix=_CONFIG_FIX)
    try:
        fields = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise AutoshardError("a Hugging Face config.json that is readable JSON",
                             got=f"{file}: {getattr(e, 'strerror', None) or e}",
                             fix=_CONFIG_FIX) from e
    if not isinstance(fields, dict):
        raise AutoshardError("a Hugging Face config.json holding one JSON object",
                             got=f"{file}: a JSON {type(fields).__name__}", fix=_CONFIG_FIX)
    return fields


def _model_type(fields: Mapping[str, Any], where: str, tf: ModuleType) -> str:
    model_type = fields.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise AutoshardError('a Hugging Face config with a model_type (e.g. "llama")',
                             got=f"{where}: model_type {model_type!r}" if "model_type" in fields
                             else f"{where}: no model_type among its keys "
                                  f"{sorted(fields)[:8]}",
                             fix="add the model_type of its architecture, as the config.json "
                                 "published with the model has it")
    known = tf.models.auto.configuration_auto.CONFIG_MAPPING
    if model_type not in known:
        close = difflib.get_close_matches(model_type, list(known.keys()), n=3, cutoff=0.6)
        raise AutoshardError(f"a model_type that transformers {tf.__version__} knows",
                             got=f"{where}: model_type {model_type!r}",
                             fix=(f"did you mean {', '.join(close)}? " if close else "")
                             + "a newer transformers may know it (pip install -U transformers)")
    return model_type


def supported_tasks(model_type: str) -> list[str]:
    """The tasks (of TASKS) transformers has a model class for, for this ``model_type``."""
    tf = _transformers()
    names = tf.models.auto.modeling_auto
    return [task for task, (_, table) in _AUTO.items() if model_type in getattr(names, table)]


def infer_task(fields: Mapping[str, Any], *, where: str = "the config") -> str:
    """The task a config was published for: its ``architectures`` (``LlamaForCausalLM`` ->
    causal-lm), else the one task its model_type has a model class for."""
    tf = _transformers()
    model_type = _model_type(fields, where, tf)
    tasks = supported_tasks(model_type)
    archs = fields.get("architectures") or []
    archs = [a for a in (archs if isinstance(archs, list) else [archs]) if isinstance(a, str)]
    names = tf.models.auto.modeling_auto
    for arch in archs:
        for task in tasks:             # the class the Auto class would build for this task
            if arch in _as_tuple(getattr(names, _AUTO[task][1]).get(model_type)):
                return task
        guess = _task_of_class_name(arch, bool(fields.get("is_encoder_decoder")))
        if guess in tasks:
            return guess
    if not archs and len(tasks) == 1:
        return tasks[0]
    said = f"architectures {archs}" if archs else "no architectures"
    raise AutoshardError(f"a task for the {model_type} config: {_tasks_text(tasks)}",
                         got=f"{where}: {said}, which does not pick one",
                         fix=f"pass --task (task=...), one of {', '.join(tasks) or TASKS}")


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _task_of_class_name(arch: str, encoder_decoder: bool) -> str | None:
    if arch.endswith(("ForCausalLM", "LMHeadModel")):
        return "seq2seq" if encoder_decoder else "causal-lm"
    if arch.endswith(("ForMaskedLM", "ForPreTraining")):
        return "masked-lm"
    if arch.endswith(("ForConditionalGeneration", "ForSeq2SeqLM")):
        return "seq2seq"
    if arch.endswith("ForImageClassification"):
        return "image-classification"
    return None


def _tasks_text(tasks: list[str]) -> str:
    if not tasks:
        return f"none of {', '.join(TASKS)} has a class"
    return tasks[0] if len(tasks) == 1 else f"one of {', '.join(tasks)}"


def _dtype(fields: Mapping[str, Any], dtype: torch.dtype | None, where: str) -> torch.dtype:
    """``dtype``, else the config's torch_dtype, else bfloat16 (mixed-precision training, as
    the zoo's real-size presets)."""
    if dtype is not None:
        return dtype
    for key in _DTYPE_KEYS:
        name = fields.get(key)
        if name is None or name == "auto":
            continue
        value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise AutoshardError(f"a floating-point {key} in the config (e.g. \"bfloat16\")",
                                 got=f"{where}: {key} {name!r}",
                                 fix=f"write a torch dtype name, or drop {key} (bfloat16 then)")
        return value
    return torch.bfloat16


def from_config(config: str | Path | Mapping[str, Any], *, task: str | None = None,
                dtype: torch.dtype | None = None,
                device: str | torch.device = "meta") -> HFLossModel:
    """Build the model of a Hugging Face config with transformers' Auto classes, wrapped so that
    ``forward(*model.example_inputs(batch, seq))`` returns the training loss.

    ``config``: a config.json, a directory holding one, or its fields as a dict. ``task``:
    causal-lm | masked-lm | seq2seq | image-classification (default: from the config's
    ``architectures``, see ``infer_task``). ``dtype``: default the config's ``torch_dtype``, else
    bfloat16. Built on ``device`` (meta: no memory); random weights from the global RNG. The
    config is built as published, dropout included, with ``use_cache=False`` (a KV cache is
    inference state) and sdpa attention where the model has it.
    """
    tf = _transformers()
    where = str(config) if isinstance(config, (str, Path)) else "the config"
    fields = read_config(config) if isinstance(config, (str, Path)) else dict(config)
    model_type = _model_type(fields, where, tf)
    if task is None:
        task = infer_task(fields, where=where)
    elif task not in TASKS:
        close = difflib.get_close_matches(str(task), TASKS, n=1, cutoff=0.5)
        raise AutoshardError(f"a task among {', '.join(TASKS)}", got=repr(task),
                             fix=f"did you mean {close[0]}?" if close
                             else f"pass one of {', '.join(TASKS)}")
    tasks = supported_tasks(model_type)
    if task not in tasks:
        raise AutoshardError(f"a task transformers has a {model_type} model class for: "
                             f"{_tasks_text(tasks)}", got=f"task {task!r} for {where}",
                             fix=f"pass --task {tasks[0]}" if tasks
                             else "plan it from Python with a model you build (a factory)")
    dtype = _dtype(fields, dtype, where)
    auto = getattr(tf, _AUTO[task][0])
    config_cls = tf.models.auto.configuration_auto.CONFIG_MAPPING[model_type]
    model_cls = auto._model_mapping[config_cls]
    kwargs = {k: v for k, v in fields.items() if k not in ("model_type", *_DTYPE_KEYS)}
    if isinstance(model_cls, tuple):
        # Several classes for the task (DeiT's, with and without its distillation teacher):
        # the one the config's architectures name, else the first, which transformers then
        # needs named in architectures
        named = set(_as_tuple(fields.get("architectures")))
        model_cls = next((c for c in model_cls if c.__name__ in named), model_cls[0])
        kwargs["architectures"] = [model_cls.__name__]
    kwargs["use_cache"] = False
    kwargs.setdefault("attn_implementation",
                      "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager")
    with _quiet(tf):
        try:
            hf_config = tf.AutoConfig.for_model(model_type, **kwargs)
            with torch.device(device):
                model = auto.from_config(hf_config, dtype=dtype)
        except Exception as e:       # transformers' own checks: a field out of range, say
            text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
            text = text[:300].rstrip(".")
            raise AutoshardError(f"a {model_type} config transformers can build a "
                                 f"{model_cls.__name__} from", got=f"{where}: "
                                 f"{type(e).__name__}: {text}",
                                 fix="correct the field it names (the config.json published "
                                     "with a model builds unchanged)") from e
    route_experts_as_one_op(model)
    scan_as_one_op(model)
    if task == "causal-lm" and getattr(model, "loss_type", None) is None:
        # A class name without a loss family (GPT2LMHeadModel): HF would warn on every call
        # before falling back to this very loss.
        model.loss_type = "ForCausalLM"
    return HFLossModel(model, task=task)


# ------------------------------------------------------------ routed experts as one op

EXPERTS_IMPLEMENTATION = "autoshard"


def route_experts_as_one_op(model: nn.Module) -> bool:
    """Run ``model``'s mixture-of-experts layers (Hugging Face's ``@use_experts_implementation``
    classes: Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, Jamba...) through autoshard's one op per
    experts call (ops/moe.py ``routed_experts``) instead of transformers' default grouped
    path, whose sort over every token of the step keeps the tokens whole on every device
    (docs/cost-model.md §12), and DBRX's and Switch Transformers' experts too
    (:func:`_dbrx_experts_as_one_op`, zoo/hf_switch.py, which stacks each Switch layer's
    experts into two weights), and JetMoE's experts and attention experts (zoo/hf_jetmoe.py,
    the latter through ``routed_linear``). The model computes the same; experts this op does
    not cover (transposed or biased weights, or a custom gate, other than GPT-OSS's) keep
    transformers' path. Returns whether the model has such layers."""
    from autoshard.zoo.hf_jetmoe import jetmoe_experts_as_ops
    from autoshard.zoo.hf_switch import switch_experts_as_one_op
    if _dbrx_experts_as_one_op(model) or switch_experts_as_one_op(model) or \
            jetmoe_experts_as_ops(model):
        return True
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, _experts_forward)
    model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    return True


def _experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """An ``ExpertsInterface`` implementation: the ``routed_experts`` op where the experts are
    the plain gated kind it computes, transformers' grouped path otherwise."""
    from transformers.integrations import moe

    from autoshard.ops.moe import ACTIVATIONS, GPT_OSS_GATE, routed_experts
    if _gpt_oss(experts):
        # [E, H, 2I] and [E, I, H] stored transposed: the op reads views of them
        return routed_experts(hidden_states, top_k_index, top_k_weights,
                              experts.gate_up_proj.transpose(1, 2),
                              experts.down_proj.transpose(1, 2), 0,
                              f"{GPT_OSS_GATE}:{float(experts.alpha)!r}:{float(experts.limit)!r}",
                              None, experts.gate_up_proj_bias, experts.down_proj_bias)
    act = getattr(experts.config, "hidden_act", None)
    plain = (experts.has_gate and experts.is_concatenated and not experts.is_transposed
             and not experts.has_bias and not experts.has_post_expert_norm
             and not experts._is_expert_parallel and act in ACTIVATIONS
             and type(experts)._apply_gate is moe._default_apply_gate)
    if not plain:
        return moe.grouped_mm_experts_forward(experts, hidden_states, top_k_index,
                                              top_k_weights)
    return routed_experts(hidden_states, top_k_index, top_k_weights, experts.gate_up_proj,
                          experts.down_proj, 0, act)


def _gpt_oss(experts: nn.Module) -> bool:
    """GPT-OSS's experts: gate and up interleaved in ``gate_up_proj [E, H, 2I]``, ``down_proj
    [E, I, H]``, both biased, its own clamped gate (ops/moe.py ``expert_hidden``)."""
    return (type(experts).__name__ == "GptOssExperts" and experts.has_gate
            and not experts.is_concatenated and experts.is_transposed and experts.has_bias
            and not experts.has_post_expert_norm and not experts._is_expert_parallel)


def _dbrx_experts_as_one_op(model: nn.Module) -> bool:
    """DBRX's experts (``DbrxExperts``, not an ``@use_experts_implementation`` class) through
    the ``routed_experts`` op: they loop over the experts a step's tokens hit, found with
    ``nonzero``, which a trace cannot follow. Returns whether the model has them."""
    from autoshard.ops.moe import ACTIVATIONS, DBRX_EXPERTS
    ffn = getattr(getattr(model, "config", None), "ffn_config", None)
    act = (getattr(ffn, "ffn_act_fn", None) or {}).get("name", "silu")
    if act not in ACTIVATIONS:          # transformers' loop stays; the trace names it
        return False
    found = False
    for m in model.modules():
        if type(m).__name__ == DBRX_EXPERTS:
            m.forward = types.MethodType(_dbrx_experts_forward, m)
            m.activation_name = act
            found = True
    return found


def _dbrx_experts_forward(experts: nn.Module, hidden_states: torch.Tensor,
                          top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                          ) -> torch.Tensor:
    """DBRX's experts computed by the ``routed_experts`` op. DBRX keeps each expert's gate,
    up and down weights as ``[I, H]`` blocks of ``w1``, ``v1`` and ``w2`` (``[E·I, H]``), and
    computes ``act(x w1_eᵀ) · (x v1_eᵀ)`` times ``w2_e``: the op's ``gate_up`` is ``[w1_e;
    v1_e]`` and its ``down`` is ``w2_eᵀ``."""
    from autoshard.ops.moe import routed_experts
    mlp = experts.mlp
    e, i, h = experts.num_experts, experts.ffn_hidden_size, experts.hidden_size
    gate_up = torch.cat([mlp.w1.view(e, i, h), mlp.v1.view(e, i, h)], dim=1)
    down = mlp.w2.view(e, i, h).transpose(1, 2)
    out = routed_experts(hidden_states.reshape(-1, h), top_k_index, top_k_weights, gate_up,
                         down, 0, experts.activation_name)
    return out.view(hidden_states.shape)


# ------------------------------------------------------- Mamba-1's selective scan as one op

def scan_as_one_op(model: nn.Module) -> bool:
    """Run the selective scan of ``model``'s Mamba-1 mixers (Mamba, Falcon-Mamba, Jamba)
    through autoshard's one op (ops/ssm.py ``selective_scan``), and RecurrentGemma's linear
    recurrence through ``linear_scan``, instead of transformers' PyTorch loops over the
    sequence, which a trace unrolls token by token. The op's kernel is that
    loop; calls the op does not cover (a returned last state, no gate) keep transformers'
    function. Transformers looks the function up in the mixer's module, so it is replaced
    there, by a wrapper that computes the same. Returns whether the model has such mixers."""
    import sys

    modules = {sys.modules[type(m).__module__] for m in model.modules()
               if type(m).__name__.endswith("MambaMixer")}
    modules = {m for m in modules if callable(getattr(m, "mamba_selective_scan", None))}
    for module in modules:
        if not getattr(module.mamba_selective_scan, "_autoshard_scan", False):
            module.mamba_selective_scan = _one_op_scan(module.mamba_selective_scan)
    lrus = [m for m in model.modules() if type(m).__name__ == RG_LRU]
    for lru in lrus:
        lru._rnn_scan = types.MethodType(_rnn_scan_as_one_op, lru)
    return bool(modules) or bool(lrus)


# RecurrentGemma's recurrent unit, whose ``_rnn_scan`` loops over the sequence.
RG_LRU = "RecurrentGemmaRglru"


def _rnn_scan_as_one_op(lru: nn.Module, hidden_states: torch.Tensor,
                        recurrent_gate: torch.Tensor, reset: torch.Tensor,
                        recurrent_states: torch.Tensor | None,
                        acc_dtype: torch.dtype = torch.float32) -> tuple:
    """``RecurrentGemmaRglru._rnn_scan`` through ``linear_scan`` (ops/ssm.py) for a whole
    sequence from no state, its gate zeroed at document starts as transformers' is. That is
    the call without a cache (training), where transformers sets the state to None again before
    each call: no last state is returned (None, which the module keeps, instead of a tensor
    that export warns of). With a cache the state starts as zeros, not None, and decoding, like
    any scan from a given state, runs transformers' own."""
    from autoshard.ops.ssm import linear_scan
    if hidden_states.shape[1] == 1 or recurrent_states is not None or \
            acc_dtype != torch.float32:
        return type(lru)._rnn_scan(lru, hidden_states, recurrent_gate, reset,
                                   recurrent_states, acc_dtype)
    return linear_scan(hidden_states, recurrent_gate * ~reset), None


def _one_op_scan(original: Callable[..., Any]) -> Callable[..., Any]:
    from autoshard.ops.ssm import selective_scan

    def scan(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor | None = None, z: torch.Tensor | None = None,
             delta_bias: torch.Tensor | None = None, delta_softplus: bool = False,
             return_last_state: bool = False, **kwargs: Any) -> Any:
        if return_last_state or D is None or z is None or delta_bias is None:
            return original(hidden_states, dt, A, B, C, D=D, z=z, delta_bias=delta_bias,
                            delta_softplus=delta_softplus,
                            return_last_state=return_last_state, **kwargs)
        return selective_scan(hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus)

    scan._autoshard_scan = True     # type: ignore[attr-defined]
    scan.__wrapped_original__ = original    # type: ignore[attr-defined]
    return scan


__all__ = ["HFLossModel", "TASKS", "from_config", "infer_task", "read_config",
           "supported_tasks", "route_experts_as_one_op", "scan_as_one_op",
           "hf_gpt2_tiny", "hf_llama_tiny", "hf_bert_tiny", "hf_resnet_tiny"]
