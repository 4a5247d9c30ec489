"""JetMoE's two kinds of experts through autoshard's routed ops (ops/moe.py).

Transformers' JetMoE (``JetMoeMoE``: a mixture of gated MLP experts; ``JetMoeMoA``: a mixture
of attention experts, each token's queries projected by the ``k`` experts it chose and their
attention outputs projected back) groups the tokens by expert with ``split`` on counts it
reads off the device (``expert_size.tolist()``), which a trace cannot follow. The experts'
weights are already stacked (``JetMoeParallelExperts.weight [E, O, H]``), so state dicts are
unchanged: :func:`jetmoe_experts_as_ops` replaces the forwards only.

- ``JetMoeMoE``: ``routed_experts`` with ``input_linear.weight [E, 2I, H]`` as the gate and up
  halves (``chunk(2)``: ``act(gate) · up``) and ``output_linear.weight [E, H, I]`` as down,
  then the layer's bias;
- ``JetMoeMoA.map``: ``routed_linear`` dispatching each token to its ``k`` query projections,
  ``[T, k, D]`` in the slot order transformers' ``index_add`` restores;
  ``JetMoeMoA.reduce``: ``routed_linear`` combining the ``k`` attention outputs, each weighted
  by its gate, then the bias.

The router computes as transformers' does (float32 logits, ``topk``, a softmax over the ``k``
chosen, cast to the hidden states' dtype) without grouping the tokens.
"""
from __future__ import annotations

import functools
import types

import torch
from torch import nn

MOE, MOA = "JetMoeMoE", "JetMoeMoA"


def jetmoe_experts_as_ops(model: nn.Module) -> bool:
    """Rewrite ``model``'s JetMoE expert layers as the module's docstring says; MLP experts
    whose activation (the config's ``activation_function``) the routed-experts op lacks keep
    transformers' loop. Returns whether any layer was rewritten."""
    from autoshard.ops.moe import ACTIVATIONS
    act = next((m.config.activation_function for m in model.modules()
                if hasattr(getattr(m, "config", None), "activation_function")), None)
    found = False
    for layer in model.modules():
        name = type(layer).__name__
        if name == MOE and act in ACTIVATIONS:
            layer.forward = types.MethodType(functools.partial(_moe_forward, activation=act),
                                             layer)
        elif name == MOA:
            layer.map = types.MethodType(_moa_map, layer)
            layer.reduce = types.MethodType(_moa_reduce, layer)
        else:
            continue
        layer.router.forward = types.MethodType(_router_forward, layer.router)
        found = True
    return found


def _router_forward(router: nn.Module, x: torch.Tensor) -> tuple:
    """``JetMoeTopKGating.forward`` without grouping the tokens: each token's ``k`` experts
    ``[T, k]``, their gates (a softmax over the chosen logits, in ``x``'s dtype) and the
    logits, at the positions of transformers' tuple (its output recorder reads the logits at
    4, for the auxiliary loss); the two grouping entries are None."""
    logits = router.layer(x).float()
    top_logits, index = logits.topk(router.top_k, dim=1)
    return index, None, torch.softmax(top_logits, dim=1).type_as(x), None, logits


def _moe_forward(layer: nn.Module, layer_input: torch.Tensor, activation: str) -> torch.Tensor:
    from autoshard.ops.moe import routed_experts
    b, s, h = layer_input.shape
    x = layer_input.reshape(-1, h)
    index, _, gates, _, _ = layer.router(x)
    out = routed_experts(x, index, gates, layer.input_linear.weight,
                         layer.output_linear.weight, 0, activation)
    return out.view(b, s, h) + layer.bias


def _moa_map(layer: nn.Module, layer_input: torch.Tensor) -> tuple:
    from autoshard.ops.moe import routed_linear
    b, s, h = layer_input.shape
    x = layer_input.reshape(-1, h)
    index, _, gates, _, logits = layer.router(x)
    queries = routed_linear(x, index, layer.input_linear.weight, 0)
    return queries.view(b, s, layer.top_k, -1), logits, (index, gates)


def _moa_reduce(layer: nn.Module, layer_input: torch.Tensor, topo_info: tuple) -> torch.Tensor:
    from autoshard.ops.moe import routed_linear
    b, s, k, d = layer_input.shape
    index, gates = topo_info
    out = routed_linear(layer_input.reshape(-1, k, d), index, layer.output_linear.weight, 0,
                        gates)
    return out.view(b, s, -1) + layer.bias
