"""Tiny Hugging Face transformers models, built from their config classes (no downloads).

transformers is an optional dependency: it is imported only when one of these is built, and a
missing install raises ``AutoshardError``. Each model is wrapped in ``HFLossModel`` so that
``forward(input_ids, labels)`` returns the scalar training loss; the HF model is the attribute
``model``, so its parameter names read ``model.<hf name>`` (``model.transformer.h.0...``).
"""
from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Callable, Iterator

import torch
from torch import nn

from autoshard.errors import AutoshardError

# Shared tiny sizes, the same as the plain-PyTorch tiny presets, so the two can be compared.
TINY_VOCAB, TINY_SEQ, TINY_HIDDEN, TINY_HEADS, TINY_LAYERS, TINY_FFN = 64, 16, 32, 4, 2, 64


def _transformers() -> ModuleType:
    try:
        import transformers
    except ImportError as exc:
        raise AutoshardError("the hf-* zoo models need the optional dependency transformers",
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


class HFLossModel(nn.Module):
    """``forward(input_ids, labels) -> model(input_ids=..., labels=...).loss``."""

    def __init__(self, model: nn.Module, *, vocab_size: int, context: int) -> None:
        super().__init__()
        self.model = model
        self.vocab_size, self.context = vocab_size, context

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss

    def example_inputs(self, batch: int, seq: int | None, *,
                       device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
        if seq is None or not 1 <= seq <= self.context or batch < 1:
            raise AutoshardError(f"this model takes batch >= 1 and seq in 1..{self.context}",
                                 got=f"batch={batch!r}, seq={seq!r}",
                                 fix=f"pass batch >= 1 and seq <= {self.context}")
        return (torch.randint(0, self.vocab_size, (batch, seq), device=device),
                torch.randint(0, self.vocab_size, (batch, seq), device=device))


def _wrap(build: Callable[[ModuleType], nn.Module], dtype: torch.dtype | None) -> HFLossModel:
    transformers = _transformers()
    with _quiet(transformers):
        model = build(transformers)
    if dtype is not None:
        model = model.to(dtype)
    return HFLossModel(model, vocab_size=TINY_VOCAB, context=TINY_SEQ)


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


def hf_gpt2_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """GPT2LMHeadModel: 2 layers, hidden 32, 4 heads, vocab 64, context 16 (tied head)."""
    return _wrap(_gpt2, dtype)


def hf_llama_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """LlamaForCausalLM: 2 layers, hidden 32, 4 heads, 2 kv heads, ffn 64, vocab 64, context 16."""
    return _wrap(_llama, dtype)


def hf_bert_tiny(dtype: torch.dtype | None = None) -> HFLossModel:
    """BertForMaskedLM: 2 layers, hidden 32, 4 heads, ffn 64, vocab 64, context 16."""
    return _wrap(_bert, dtype)


__all__ = ["HFLossModel", "hf_gpt2_tiny", "hf_llama_tiny", "hf_bert_tiny"]
