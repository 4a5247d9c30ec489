"""Switch Transformers' sparse layers through the ``routed_experts`` op (ops/moe.py).

Transformers' ``SwitchTransformersSparseMLP`` routes each token to one expert (top-1, with a
capacity per expert and sequence: tokens past it are dropped, their layer output zero) and then
loops over the experts the step hit, found with ``nonzero``, which a trace cannot follow. Each
expert is its own ``wo(dropout(act(wi x)))`` module, so an expert-parallel plan could not hold
a share of them: a stack of E separate parameters splits only as each of them does.

:func:`switch_experts_as_one_op` rewrites each such layer in place:

- the experts become one :class:`SwitchExperts` module holding ``wi [E, I, H]`` and ``wo [E, H,
  I]``, each expert's weights at its index (``experts.expert_{e}.wi.weight`` is now
  ``experts.wi[e]``, so state dicts name the two stacked weights, as transformers' own
  Mixtral stacks its experts' weights), computed by the op's ungated form;
- the expert's dropout is drawn outside the op as a mask over each routed token's hidden
  activation ([T, 1, I], ``F.dropout`` of ones: the same distribution), which the op applies;
- the layer's output is the op's with each token's routing weight zeroed where the capacity
  dropped it: top-1 index ``argmax`` of its one-hot row, weight ``probability · kept``;
- the router computes its classifier in its own dtype (float32) without assigning the module
  again in forward (``self.classifier = self.classifier.to(dtype)``, which export refuses): the
  classifier is converted once here, which transformers' first forward does for good anyway.
"""
from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn


class SwitchExperts(nn.Module):
    """The experts of one Switch layer as two stacked weights, ``wi [E, I, H]`` (each expert's
    ``wi.weight [I, H]``) and ``wo [E, H, I]`` (its ``wo.weight``), run by ``routed_experts``
    with ``activation`` and the experts' dropout ``dropout.p``."""

    def __init__(self, experts: nn.ModuleDict, activation: str) -> None:
        super().__init__()
        mods = [experts[f"expert_{e}"] for e in range(len(experts))]
        self.wi = nn.Parameter(torch.stack([m.wi.weight.detach() for m in mods]),
                               requires_grad=mods[0].wi.weight.requires_grad)
        self.wo = nn.Parameter(torch.stack([m.wo.weight.detach() for m in mods]),
                               requires_grad=mods[0].wo.weight.requires_grad)
        self.dropout = nn.Dropout(mods[0].dropout.p)
        self.activation = activation

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
                ) -> torch.Tensor:
        from autoshard.ops.moe import routed_experts
        mask = None
        if self.training and self.dropout.p > 0:
            mask = self.dropout(x.new_ones(x.shape[0], index.shape[-1], self.wi.shape[1]))
        return routed_experts(x, index, weights, self.wi, self.wo, 0, self.activation, mask)


def switch_experts_as_one_op(model: nn.Module) -> bool:
    """Rewrite ``model``'s Switch Transformers sparse layers as the module's docstring says.
    Layers whose experts the op does not cover (an activation it lacks, weights of mixed
    dtypes, a bias) keep transformers' loop. Returns whether any layer was rewritten."""
    from autoshard.ops.moe import ACTIVATIONS, SWITCH_SPARSE_MLP
    act = next((m.config.dense_act_fn for m in model.modules()
                if hasattr(getattr(m, "config", None), "dense_act_fn")), None)
    found = False
    for layer in model.modules():
        if type(layer).__name__ != SWITCH_SPARSE_MLP:
            continue
        experts = layer.experts
        if isinstance(experts, nn.ModuleDict):
            mods = list(experts.values())
            weights = [w for m in mods for w in (m.wi.weight, m.wo.weight)]
            if (act not in ACTIVATIONS or len({w.dtype for w in weights}) != 1
                    or any(m.wi.bias is not None or m.wo.bias is not None for m in mods)):
                continue
            layer.experts = SwitchExperts(experts, act)
        router = layer.router
        router.classifier = router.classifier.to(router.dtype)
        router.forward = types.MethodType(_router_forward, router)
        layer.forward = types.MethodType(_sparse_forward, layer)
        found = True
    return found


def _router_forward(router: nn.Module, hidden_states: torch.Tensor) -> tuple:
    """``SwitchTransformersTop1Router.forward`` without assigning its classifier again: the
    one-hot expert of each token (zero past the expert's capacity in its sequence), its
    probability, and the router's logits."""
    router.input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(router.dtype)
    if router.training and router.jitter_noise > 0:
        # In place, as transformers does (which, in float32, jitters the experts' input too).
        hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - router.jitter_noise,
                                                                  1.0 + router.jitter_noise)
    weight, bias = router.classifier.weight, router.classifier.bias
    logits = F.linear(hidden_states, weight.to(router.dtype),
                      None if bias is None else bias.to(router.dtype))
    probs = F.softmax(logits, dim=-1, dtype=router.dtype).to(router.input_dtype)
    expert_index = F.one_hot(torch.argmax(probs, dim=-1), num_classes=router.num_experts)
    priority = torch.cumsum(expert_index, dim=-2)
    expert_index = expert_index * (priority <= router.expert_capacity)
    return expert_index, torch.max(probs, dim=-1).values.unsqueeze(-1), logits


def _sparse_forward(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """``SwitchTransformersSparseMLP.forward`` through the op: a token past its expert's
    capacity gets weight zero, so adds nothing, as in transformers' loop."""
    b, s, h = hidden_states.shape
    selected, probs, _ = layer.router(hidden_states)
    index = torch.argmax(selected, dim=-1).view(-1, 1)
    weights = probs.view(-1, 1) * selected.sum(dim=-1).view(-1, 1).to(probs.dtype)
    out = layer.experts(hidden_states.view(-1, h), index, weights)
    return out.view(b, s, h)
