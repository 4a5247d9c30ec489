"""A GShard mixture-of-experts language model (Lepikhin et al. 2020, arXiv 2006.16668).

A GPT-style decoder (learned positions, pre-LN blocks, head tied to the token embedding) whose
every other feed-forward layer is a mixture of experts, as in GShard §2.2 and in the MoE models
of Alpa's benchmark suite (Zheng et al., OSDI'22, §8.1). The MoE layer is GShard's Algorithm 1,
written with dense einsums so that the traced graph has static shapes:

- the tokens of a step are cut into ``G`` groups of ``S`` tokens (``group_size``);
- gate logits ``einsum("GSM,ME->GSE")``, softmax, top-2 gating with expert capacity
  ``C = 2·S/E · capacity_factor``: a token's place in its expert's buffer is an exclusive
  ``cumsum`` of the one-hot masks along the group, and tokens past ``C`` are dropped, so nothing
  depends on the data's values but the values themselves;
- the combine weights ``[G, S, E, C]`` and the dispatch mask (where they are non-zero);
- ``dispatched = einsum("GSEC,GSM->EGCM")``, each expert's feed-forward on its ``C`` slots of
  every group with the experts' weights stored as one tensor each, ``[E, M, H]`` and
  ``[E, H, M]``: ``einsum("EGCM,EMH->EGCH")``, GELU, ``einsum("EGCH,EHM->EGCM")``;
- ``combine = einsum("GSEC,EGCM->GSM")``.

The leading expert dim ``E`` of the weights is what expert parallelism splits: with the tokens
split by group and the experts split by ``E`` on one mesh axis, ``dispatched`` goes from
``S(G)`` to ``S(E)`` by one all-to-all and the experts' output back by another
(docs/cost-model.md §12). The auxiliary load-balancing loss is GShard's (§2.2, "auxiliary
loss"), in the form of its reference implementation: ``E² · mean(density · mean gate)``, i.e.
``E · Σ_e (c_e / S) · m_e`` per group, weighted by ``aux_loss_coef`` (1e-2, the weight Switch
Transformer uses, Fedus et al. 2021 §2.2).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.errors import AutoshardError
from autoshard.zoo.models import (_INIT_STD, _GPTMLP, _layer_norm, _lm_loss,
                                  _SelfAttention, _TokenLM, _TransformerConfig, _init_weights)


@dataclass(frozen=True, slots=True)
class MoEConfig(_TransformerConfig):
    """GShard MoE transformer. ``moe_every``: every ``moe_every``-th layer (the 2nd, 4th, ...)
    has a mixture of experts in place of its feed-forward (GShard and Alpa: every other one).
    ``ffn_mult``: the feed-forward width over ``hidden`` (8 in Alpa's MoE suite); ``group_size``:
    tokens per gating group (GShard's ``S``; 2048 in Alpa's suite)."""

    n_experts: int
    vocab_size: int = 32000
    context: int = 1024
    ffn_mult: int = 8
    group_size: int = 2048
    capacity_factor: float = 1.0
    moe_every: int = 2
    aux_loss_coef: float = 1e-2
    bias: bool = True
    layer_norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        _TransformerConfig.__post_init__(self)  # zero-argument super() fails in slots classes
        if self.n_experts < 2:
            raise ValueError(f"MoEConfig.n_experts must be at least 2 for top-2 gating; got "
                             f"{self.n_experts}. Fix: pass n_experts >= 2.")
        if not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig.capacity_factor must be positive; got "
                             f"{self.capacity_factor!r}. Fix: pass e.g. capacity_factor=1.0.")

    @property
    def capacity(self) -> int:
        """Slots per expert per group: ``2·S/E · capacity_factor`` (GShard Algorithm 1),
        rounded down (48 experts do not divide Alpa's 2 x 2048 slots)."""
        return max(1, int(2 * self.group_size * self.capacity_factor) // self.n_experts)

    def is_moe(self, layer: int) -> bool:
        return layer % self.moe_every == self.moe_every - 1


def top2_gating(logits: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor,
                                                             torch.Tensor]:
    """GShard's top-2 gating (Algorithm 1) on gate logits ``[G, S, E]``: ``(combine weights
    [G, S, E, C], dispatch mask [G, S, E, C], auxiliary loss)``, in float32.

    Every shape is static: positions in an expert's buffer are exclusive cumsums of one-hot
    masks along the group, and a token whose position reaches ``capacity`` is dropped (its
    mask, hence its combine weight, is zero). The second expert is always kept when it has
    room (GShard's random second-expert policy is left out so that the graph is deterministic).
    """
    n_experts = logits.shape[-1]
    gates = torch.softmax(logits.float(), dim=-1)
    index_1 = torch.argmax(gates, dim=-1)
    mask_1 = F.one_hot(index_1, n_experts).float()
    gate_1 = (gates * mask_1).sum(-1)
    index_2 = torch.argmax(gates * (1.0 - mask_1), dim=-1)
    mask_2 = F.one_hot(index_2, n_experts).float()
    gate_2 = (gates * mask_2).sum(-1)
    aux = (mask_1.mean(1) * gates.mean(1)).mean() * (n_experts * n_experts)
    denom = gate_1 + gate_2 + 1e-9
    gate_1, gate_2 = gate_1 / denom, gate_2 / denom
    # A token's slot in its expert: how many tokens before it in the group chose that expert
    # (the second choices queue after every first choice).
    pos_1 = torch.cumsum(mask_1, dim=1) - mask_1
    mask_1 = mask_1 * (pos_1 < capacity).float()
    pos_2 = torch.cumsum(mask_2, dim=1) - mask_2 + mask_1.sum(1, keepdim=True)
    mask_2 = mask_2 * (pos_2 < capacity).float()
    combine = (_slots(gate_1, mask_1, pos_1, capacity)
               + _slots(gate_2, mask_2, pos_2, capacity))
    return combine, (combine > 0).float(), aux


def _slots(gate: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
           capacity: int) -> torch.Tensor:
    """``[G, S, E, C]``: ``gate`` at (the token's expert, its slot), zero for a dropped token."""
    kept = mask.sum(-1)                                  # 1 if the token kept this choice
    slot = (pos * mask).sum(-1).long()                   # 0 for a dropped token: no overflow
    where = mask.unsqueeze(-1) * F.one_hot(slot, capacity).float().unsqueeze(2)
    return (gate * kept).unsqueeze(-1).unsqueeze(-1) * where


class MoELayer(nn.Module):
    """GShard's MoE feed-forward (Algorithm 1) on ``[B, L, M]`` activations; returns the output
    and the auxiliary loss. ``wi [E, M, H]`` and ``wo [E, H, M]`` hold every expert's weights."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        e, m, h = cfg.n_experts, cfg.hidden, cfg.ffn_mult * cfg.hidden
        self.group_size, self.capacity = cfg.group_size, cfg.capacity
        self.gate = nn.Parameter(torch.empty(m, e, dtype=cfg.dtype))
        self.wi = nn.Parameter(torch.empty(e, m, h, dtype=cfg.dtype))
        self.wo = nn.Parameter(torch.empty(e, h, m, dtype=cfg.dtype))
        for w in (self.gate, self.wi, self.wo):
            nn.init.normal_(w, mean=0.0, std=_INIT_STD)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, l, m = x.shape
        # Two views, a merge then a split, each of which a sharded batch passes through.
        tokens = x.reshape(b * l, m).view(-1, self.group_size, m)
        logits = torch.einsum("GSM,ME->GSE", tokens, self.gate)
        combine, dispatch, aux = top2_gating(logits, self.capacity)
        dispatched = torch.einsum("GSEC,GSM->EGCM", dispatch.to(x.dtype), tokens)
        h = F.gelu(torch.einsum("EGCM,EMH->EGCH", dispatched, self.wi))
        out = torch.einsum("EGCH,EHM->EGCM", h, self.wo)
        y = torch.einsum("GSEC,EGCM->GSM", combine.to(x.dtype), out)
        return y.reshape(b * l, m).view(b, l, m), aux


class _MoEBlock(nn.Module):
    """A pre-LN block: attention, then the feed-forward (dense or MoE). Returns the block's
    output and its auxiliary loss (zero for a dense block)."""

    def __init__(self, cfg: MoEConfig, moe: bool) -> None:
        super().__init__()
        self.ln1 = _layer_norm(cfg)
        self.attn = _SelfAttention(cfg, causal=True)
        self.ln2 = _layer_norm(cfg)
        self.mlp = MoELayer(cfg) if moe else _GPTMLP(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.attn(self.ln1(x))
        if isinstance(self.mlp, MoELayer):
            y, aux = self.mlp(self.ln2(x))
            return x + y, aux
        return x + self.mlp(self.ln2(x)), None


class GShardMoE(_TokenLM):
    """The GShard MoE language model; the loss is the LM loss plus ``aux_loss_coef`` times the
    MoE layers' auxiliary losses (GShard §2.2)."""

    family = "GShard MoE"

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__(cfg)
        self.pos_emb = nn.Embedding(cfg.context, cfg.hidden, dtype=cfg.dtype)
        self.layers = nn.ModuleList(_MoEBlock(cfg, cfg.is_moe(i)) for i in range(cfg.n_layers))
        self.ln_f = _layer_norm(cfg)
        self.apply(_init_weights)

    def _hidden(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.tok_emb(input_ids) + self.pos_emb(pos)
        aux = []
        for layer in self.layers:
            x, a = layer(x)
            if a is not None:
                aux.append(a)
        return self.ln_f(x), aux

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self._hidden(input_ids)[0], self.tok_emb.weight)

    def forward(self, input_ids: torch.Tensor,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        h, aux = self._hidden(input_ids)
        logits = F.linear(h, self.tok_emb.weight)
        if labels is None:
            return logits
        loss = _lm_loss(logits, labels)
        return loss + self.config.aux_loss_coef * sum(aux) if aux else loss

    def example_inputs(self, batch: int, seq: int | None, *,
                       device: torch.device | str = "meta") -> tuple[torch.Tensor, torch.Tensor]:
        group = self.config.group_size
        if seq is not None and (batch * seq) % group:
            raise AutoshardError(f"a GShard MoE model's tokens per step (batch x seq) cut into "
                                 f"groups of {group} tokens",
                                 got=f"batch {batch} x seq {seq} = {batch * seq} tokens",
                                 fix=f"pick batch and seq whose product is a multiple of {group}")
        return super().example_inputs(batch, seq, device=device)


def count_moe_parameters(cfg: MoEConfig) -> int:
    """Closed form of the model's parameters (head tied): for the zoo's description and tests."""
    h, f, e = cfg.hidden, cfg.ffn_mult * cfg.hidden, cfg.n_experts
    attn = 4 * h * h + 4 * h + 4 * h                     # q, k, v, out with biases; two norms
    dense = 2 * h * f + f + h
    moe = h * e + 2 * e * h * f
    n_moe = sum(cfg.is_moe(i) for i in range(cfg.n_layers))
    blocks = cfg.n_layers * attn + (cfg.n_layers - n_moe) * dense + n_moe * moe
    return cfg.vocab_size * h + cfg.context * h + blocks + 2 * h


__all__ = ["GShardMoE", "MoEConfig", "MoELayer", "top2_gating", "count_moe_parameters"]
