"""Plain-PyTorch models for planning: MLP, GPT (2/3), Llama (2/3) and BERT.

Every model builds on any device, the meta device included (``with torch.device("meta"):``), and
its ``forward`` returns a scalar training loss, so the traced graph is a training step's forward.
Pass ``labels=None`` (``y=None`` for the MLP) to get logits instead.

Conventions the tracer and planner rely on:
- repeated blocks live in an ``nn.ModuleList`` called ``layers`` (``layers.0``, ``layers.1``, ...);
- attention is ``F.scaled_dot_product_attention`` (``is_causal=True`` for decoders), never an
  explicit mask tensor, and there is no data-dependent Python control flow, so the graph exports
  with ``torch.export.export(..., strict=False)`` on meta tensors;
- every model has ``example_inputs(batch, seq, *, device)`` returning ``(inputs, labels)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError

_INIT_STD = 0.02  # GPT-2 / BERT / Llama all initialise weights with N(0, 0.02)


def _require_positive(cls_name: str, **values: int) -> None:
    for key, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{cls_name}.{key} must be a positive int; got {value!r}. "
                             f"Fix: pass {key}=<int >= 1>.")


def _require_divisible(cls_name: str, num: str, den: str, a: int, b: int) -> None:
    if a % b:
        raise ValueError(f"{cls_name}.{num} ({a}) must be divisible by {den} ({b}). "
                         f"Fix: pick {num} as a multiple of {den}.")


def _init_weights(module: nn.Module) -> None:
    # Draws from the global RNG so the caller's torch.manual_seed fixes the weights; on the meta
    # device these calls cost nothing.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=_INIT_STD)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def _require_batch(batch: int) -> None:
    if batch < 1:
        raise AutoshardError("batch is a positive int", got=f"batch={batch!r}",
                             fix="pass batch >= 1")


def _token_inputs(batch: int, seq: int | None, *, vocab: int, max_seq: int, model: str,
                  field: str, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    if seq is None or seq < 1 or seq > max_seq:
        raise AutoshardError(f"{model} takes a sequence length in 1..{max_seq}, its config's "
                             f"context ({field})", got=f"seq={seq!r}",
                             fix=f"pass seq <= {max_seq}, or raise the context for a "
                                 f"long-context run: --context {seq} (autoshard plan, verify), "
                                 f"context={seq} (get_model, load_model)")
    _require_batch(batch)
    input_ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.randint(0, vocab, (batch, seq), device=device)
    return input_ids, labels


def _lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # Labels are already the targets for each position (no shift): the zoo's example inputs are
    # random ids, and a shift would only add a slice to the graph.
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


def _split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    b, s, _ = x.shape
    return x.view(b, s, n_heads, -1).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, _, s, _ = x.shape
    return x.transpose(1, 2).reshape(b, s, -1)


# ------------------------------------------------------------------------------------------ MLP


@dataclass(frozen=True, slots=True)
class MLPConfig:
    n_layers: int
    width: int
    activation: Literal["relu", "gelu"] = "relu"
    bias: bool = True
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        _require_positive("MLPConfig", n_layers=self.n_layers, width=self.width)
        if self.activation not in ("relu", "gelu"):
            raise ValueError(f"MLPConfig.activation is 'relu' or 'gelu'; got {self.activation!r}. "
                             "Fix: pass activation='relu' or 'gelu'.")


class _MLPBlock(nn.Module):
    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.width, cfg.width, bias=cfg.bias, dtype=cfg.dtype)
        self.act = nn.ReLU() if cfg.activation == "relu" else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class MLP(nn.Module):
    """``n_layers`` identical Linear+activation blocks of ``width``; MSE loss against ``y``."""

    def __init__(self, n_layers: int, width: int, *, activation: Literal["relu", "gelu"] = "relu",
                 bias: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = MLPConfig(n_layers, width, activation, bias, dtype)
        self.layers = nn.ModuleList(_MLPBlock(self.config) for _ in range(n_layers))

    @classmethod
    def from_config(cls, cfg: MLPConfig) -> MLP:
        return cls(cfg.n_layers, cfg.width, activation=cfg.activation, bias=cfg.bias,
                   dtype=cfg.dtype)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x if y is None else F.mse_loss(x, y)

    def example_inputs(self, batch: int, seq: int | None = None, *,
                       device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
        if seq is not None:
            raise AutoshardError("an MLP takes inputs of shape (batch, width), no sequence",
                                 got=f"seq={seq}", fix="leave seq unset for MLP models")
        _require_batch(batch)
        shape, dtype = (batch, self.config.width), self.config.dtype
        return (torch.randn(shape, device=device, dtype=dtype),
                torch.randn(shape, device=device, dtype=dtype))


# --------------------------------------------------------------- shared by GPT, Llama and BERT


@dataclass(frozen=True, slots=True)
class _TransformerConfig:
    """The leading fields every transformer config has; each family's config adds its own.

    Every int field of a config is a count or a size and must be positive, and ``hidden`` must
    split evenly into ``n_heads`` heads.
    """

    n_layers: int
    hidden: int
    n_heads: int
    # Keyword-only, so each family's own fields keep their positions after n_heads.
    dtype: torch.dtype = field(default=torch.float32, kw_only=True)

    def __post_init__(self) -> None:
        name = type(self).__name__
        # Annotations stay strings under `from __future__ import annotations`.
        _require_positive(name, **{f.name: getattr(self, f.name) for f in fields(self)
                                   if f.type == "int"})
        _require_divisible(name, "hidden", "n_heads", self.hidden, self.n_heads)


def _layer_norm(cfg: GPTConfig | BertConfig) -> nn.LayerNorm:
    return nn.LayerNorm(cfg.hidden, eps=cfg.layer_norm_eps, bias=cfg.bias, dtype=cfg.dtype)


class _SelfAttention(nn.Module):
    """GPT's (causal) and BERT's (bidirectional) multi-head attention.

    Separate Q, K and V projections (the same function and parameter count as GPT-2's fused
    ``c_attn``). A fused [Q|K|V] weight split column-parallel puts all of Q on the first ranks,
    so its ``split`` needs all-to-alls; Megatron avoids that by interleaving heads in the fused
    weight, a strided layout autoshard's placements do not express yet."""

    def __init__(self, cfg: GPTConfig | BertConfig, *, causal: bool) -> None:
        super().__init__()
        self.n_heads, self.causal = cfg.n_heads, causal
        self.q_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)
        self.k_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)
        self.v_proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)
        self.out = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (_split_heads(p(x), self.n_heads) for p in projections)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(_merge_heads(y))


class _TokenLM(nn.Module):
    """A language model on token ids: GPT, Llama and BERT.

    ``tok_emb`` is each family's first module; a subclass registers the rest, then applies
    ``_init_weights``, and computes ``_logits(input_ids)``. ``forward`` adds the loss, and
    ``example_inputs`` draws random ids from the vocabulary, at most ``context`` of them a row.
    """

    family: ClassVar[str]  # the model's name in error messages

    def __init__(self, cfg: GPTConfig | LlamaConfig | BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden, dtype=cfg.dtype)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self._logits(input_ids)
        return logits if labels is None else _lm_loss(logits, labels)

    def example_inputs(self, batch: int, seq: int | None, *,
                       device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
        return _token_inputs(batch, seq, vocab=self.config.vocab_size, max_seq=self.config.context,
                             field=f"{type(self.config).__name__}.context",
                             model=self.family, device=device)


# ------------------------------------------------------------------------------------------ GPT


@dataclass(frozen=True, slots=True)
class GPTConfig(_TransformerConfig):
    vocab_size: int = 50257
    context: int = 1024
    ffn_mult: int = 4
    bias: bool = True
    layer_norm_eps: float = 1e-5


class _GPTMLP(nn.Module):
    """fc1 to ``ffn_mult`` x hidden, GELU, fc2 back: GPT-2's MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        ffn = cfg.ffn_mult * cfg.hidden
        self.fc1 = nn.Linear(cfg.hidden, ffn, bias=cfg.bias, dtype=cfg.dtype)
        self.fc2 = nn.Linear(ffn, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's "gelu_new" is the tanh approximation.
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class _GPTBlock(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = _layer_norm(cfg)
        self.attn = _SelfAttention(cfg, causal=True)
        self.ln2 = _layer_norm(cfg)
        self.mlp = _GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(_TokenLM):
    """GPT-2 / GPT-3: learned positions, pre-LN blocks, LM head tied to the token embedding.

    The head is ``F.linear(h, tok_emb.weight)`` rather than a second module sharing the weight,
    so the tied weight has exactly one name (``tok_emb.weight``) in the traced graph.
    """

    family = "GPT"

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.pos_emb = nn.Embedding(cfg.context, cfg.hidden, dtype=cfg.dtype)
        self.layers = nn.ModuleList(_GPTBlock(cfg) for _ in range(cfg.n_layers))
        self.ln_f = _layer_norm(cfg)
        self.apply(_init_weights)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.ln_f(x), self.tok_emb.weight)


# ---------------------------------------------------------------------------------------- Llama


@dataclass(frozen=True, slots=True)
class LlamaConfig(_TransformerConfig):
    n_kv_heads: int
    ffn: int
    vocab_size: int = 32000
    context: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _TransformerConfig.__post_init__(self)  # zero-argument super() fails in slots classes
        _require_divisible("LlamaConfig", "n_heads", "n_kv_heads", self.n_heads, self.n_kv_heads)
        _require_divisible("LlamaConfig", "head_dim", "2", self.hidden // self.n_heads, 2)


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: normalise in float32 with plain ops, scale in the model dtype."""

    def __init__(self, dim: int, *, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rope_cos_sin(seq: int, head_dim: int, *, theta: float, dtype: torch.dtype,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    # Computed in forward from arange, not kept in buffers: a model built on meta and later
    # materialised (to_empty) would otherwise carry garbage tables. The cost is a few tiny ops.
    # Llama-3's long-context frequency scaling is left out: it changes values, not shapes or cost.
    exponent = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponent)
    freqs = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


class _LlamaAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        head_dim = cfg.hidden // cfg.n_heads
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.n_heads * head_dim, bias=False, dtype=cfg.dtype)
        self.k_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * head_dim, bias=False, dtype=cfg.dtype)
        self.v_proj = nn.Linear(cfg.hidden, cfg.n_kv_heads * head_dim, bias=False, dtype=cfg.dtype)
        self.o_proj = nn.Linear(cfg.n_heads * head_dim, cfg.hidden, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = _apply_rope(_split_heads(self.q_proj(x), self.n_heads), cos, sin)
        k = _apply_rope(_split_heads(self.k_proj(x), self.n_kv_heads), cos, sin)
        v = _split_heads(self.v_proj(x), self.n_kv_heads)
        # Grouped-query attention inside the kernel (torch >= 2.5; Hugging Face's SDPA path
        # does the same where it can) rather than K and V copied per query head: a planner
        # then moves and keeps the small K/V (context parallelism's all-gather, tensor
        # parallelism's heads).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.n_kv_heads != self.n_heads)
        return self.o_proj(_merge_heads(y))


class _LlamaMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False, dtype=cfg.dtype)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn, bias=False, dtype=cfg.dtype)
        self.down_proj = nn.Linear(cfg.ffn, cfg.hidden, bias=False, dtype=cfg.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _LlamaBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.attn = _LlamaAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.mlp = _LlamaMLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(_TokenLM):
    """Llama 2 / 3: RMSNorm, rotary positions, grouped-query attention, SwiGLU, untied head."""

    family = "Llama"

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        self.layers = nn.ModuleList(_LlamaBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.hidden, eps=cfg.rms_norm_eps, dtype=cfg.dtype)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab_size, bias=False, dtype=cfg.dtype)
        self.apply(_init_weights)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        x = self.tok_emb(input_ids)
        # The tables follow the activations' dtype, so a model cast with .to() stays consistent.
        cos, sin = _rope_cos_sin(input_ids.shape[1], cfg.hidden // cfg.n_heads,
                                 theta=cfg.rope_theta, dtype=x.dtype, device=input_ids.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


# ----------------------------------------------------------------------------------------- BERT


@dataclass(frozen=True, slots=True)
class BertConfig(_TransformerConfig):
    """BERT's defaults are the published BERT-base/large ones (Devlin et al. 2018): a 30,522-token
    WordPiece vocabulary, 512 positions, two segment types, layer-norm epsilon 1e-12."""

    ffn: int
    vocab_size: int = 30522
    context: int = 512
    type_vocab_size: int = 2
    bias: bool = True
    layer_norm_eps: float = 1e-12


class Bert(_TokenLM):
    """BERT encoder with the masked-LM head; the decoder weight is the word embedding (tied)."""

    family = "BERT"

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__(cfg)
        self.pos_emb = nn.Embedding(cfg.context, cfg.hidden, dtype=cfg.dtype)
        self.type_emb = nn.Embedding(cfg.type_vocab_size, cfg.hidden, dtype=cfg.dtype)
        self.emb_ln = _layer_norm(cfg)
        self.layers = nn.ModuleList(_BertBlock(cfg) for _ in range(cfg.n_layers))
        self.head = _BertMLMHead(cfg)
        self.apply(_init_weights)

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment input: every token has type 0, as HF does when token_type_ids is None.
        types = torch.zeros_like(input_ids)
        x = self.emb_ln(self.tok_emb(input_ids) + self.pos_emb(pos) + self.type_emb(types))
        for layer in self.layers:
            x = layer(x)
        return self.head(x, self.tok_emb.weight)


class _BertBlock(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = _SelfAttention(cfg, causal=False)
        self.ln1 = _layer_norm(cfg)
        self.fc1 = nn.Linear(cfg.hidden, cfg.ffn, bias=cfg.bias, dtype=cfg.dtype)
        self.fc2 = nn.Linear(cfg.ffn, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)
        self.ln2 = _layer_norm(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Post-LN, as in the original BERT: normalise after each residual add.
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class _BertMLMHead(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias, dtype=cfg.dtype)
        self.ln = _layer_norm(cfg)
        self.bias = nn.Parameter(torch.zeros(cfg.vocab_size, dtype=cfg.dtype))

    def forward(self, x: torch.Tensor, decoder_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(F.gelu(self.dense(x))), decoder_weight, self.bias)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once); works on meta tensors."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["MLP", "MLPConfig", "GPT", "GPTConfig", "Llama", "LlamaConfig", "RMSNorm", "Bert",
           "BertConfig", "count_parameters"]
