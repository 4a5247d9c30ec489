"""Mixture-of-experts ops of Hugging Face transformers' default experts path (``grouped_mm``;
Mixtral, Qwen-MoE): ``topk`` picks each token's experts, ``sort`` groups the token-expert pairs
by expert, ``histc`` counts the pairs per expert, ``_grouped_mm`` runs every expert on its rows,
and ``index_put`` builds the inverse permutation.

- ``topk``/``sort``: the dim they rank along stays whole; every other dim shards through, both
  outputs (values and their indices along that dim) alike.
- ``histc`` with a fixed range (``min < max``): the histogram of a whole is the sum of its
  parts' histograms, so any input dim may be sharded, giving a Partial output. With
  ``min == max`` the range is the data's own extrema, which a rank cannot know: replicated.
- ``_grouped_mm`` with ``offs`` (a 2-D input [tokens, K] sorted by expert, a 3-D weight
  [experts, K, N]): ``offs`` are global row offsets, so the token rows and the expert dim stay
  whole. The weight's N shards with the output's last dim (column-parallel experts), and K shards
  on both operands into a Partial output (row-parallel experts). The expert dim shards too
  (kernel ``local_experts``): a rank holding experts ``[lo, hi)`` runs them on their rows,
  ``offs[lo-1]:offs[hi-1]`` (from row 0 for the first expert), and leaves zeros in the other
  rows, so the output is a Partial sum over the axis (docs/cost-model.md §12: expert
  parallelism with the tokens replicated, which is what a router that sorts tokens by expert,
  with data-dependent counts, allows). Without ``offs`` (3-D x 3-D) it is a batched matmul.
  Other operand ranks, and a bias (no CPU kernel to validate it), are replicated.
- ``one_hot``: every input dim shards through to the same output dim, and the class dim the op
  appends is built whole on every rank (GShard's gating one-hots expert indices and buffer slots
  per token, so a token-sharded router stays token-sharded). ``num_classes=-1`` takes the class
  count from the data's maximum, which a rank cannot know: replicated.
- ``index_put``: replicate-only. Its indices address the whole tensor, and the routing tensors
  it writes are small (one entry per token-expert pair), so replicating them costs little.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from autoshard.ir import Shard, Strategy
from autoshard.ops._common import (P, R, Option, arg, norm_dim, plain_localize, replicate_only,
                                   shard_index)
from autoshard.ops.matmul import einsum_options
from autoshard.ops.registry import (ELEMENTWISE, MATMUL, NO, NOTHING, RECORDS, OpInfo, Saves,
                                    expand, per_output_element, register_op)

aten = torch.ops.aten

SORTS = (aten.sort.default, aten.sort.stable)
GROUPED_MM = aten._grouped_mm.default


def _ranked_dim(op: OpInfo) -> int:
    """The dim ``sort``/``topk`` rank along (``sort.stable`` takes it by keyword only)."""
    pos = 2 if op.target == aten.topk.default else 1
    return norm_dim(arg(op, pos, "dim", -1), op.inputs[0].ndim)


def rank_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, dim = op.inputs[0], _ranked_dim(op)
    n_out = len(op.outputs)
    opts: list[Option] = [((Shard(d),), (Shard(d),) * n_out)
                          for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    return expand(op, mesh_shape, opts)


def one_hot_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    if arg(op, 1, "num_classes", -1) < 0:
        return replicate_only(op, mesh_shape)
    return expand(op, mesh_shape, [((Shard(d),), (Shard(d),)) for d in range(x.ndim)
                                   if x.shape[d] > 1])


def histc_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    if not arg(op, 2, "min", 0) < arg(op, 3, "max", 0):
        return replicate_only(op, mesh_shape)
    return expand(op, mesh_shape, [((Shard(d),), (P,)) for d in range(x.ndim) if x.shape[d] > 1])


def _offs_given(op: OpInfo) -> bool:
    return len(op.inputs) == 3 and arg(op, 3, "bias") is None


def grouped_mm_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, w = op.inputs[:2]
    if len(op.inputs) == 2 and x.ndim == w.ndim == 3:
        return expand(op, mesh_shape, einsum_options(op, ["gmk", "gkn"], "gmn"))
    if _offs_given(op) and (x.ndim, w.ndim) == (2, 3):
        return expand(op, mesh_shape, [((R, Shard(2), R), (Shard(1),)),
                                       ((Shard(1), Shard(1), R), (P,)), _LOCAL_EXPERTS],
                      kernel=_experts_kernel)
    return replicate_only(op, mesh_shape)


LOCAL_EXPERTS = "local_experts"
# The weight split on its expert dim, the token rows and the offsets whole: a Partial output.
_LOCAL_EXPERTS: Option = ((R, Shard(0), R), (P,))


def _experts_kernel(combo: tuple) -> str | None:
    return LOCAL_EXPERTS if _LOCAL_EXPERTS in combo else None


def grouped_mm_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                        args: tuple, kwargs: dict) -> tuple:
    """The op itself, or under ``local_experts`` the op on this rank's experts' rows."""
    if strategy.kernel != LOCAL_EXPERTS:
        return op.target, args, kwargs
    index, factor = shard_index(strategy.inputs[1], 0, mesh_shape, coords)
    n, target = op.inputs[1].shape[0], op.target
    lo, hi = index * n // factor, (index + 1) * n // factor

    def local_experts(*a: Any, **k: Any) -> torch.Tensor:   # a named function: an FX target
        return local_experts_mm(target, *a, lo=lo, hi=hi, **k)

    return local_experts, args, kwargs


def local_experts_mm(target: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor,
                     *args: Any, lo: int, hi: int, **kwargs: Any) -> torch.Tensor:
    """``target(x, w, offs)`` for experts ``[lo, hi)`` only, ``w`` holding just those: their
    rows (``offs`` are global cumulative row counts) through the op, zeros in every other row.
    The row bounds are read off ``offs`` at run time: how many tokens an expert gets is data."""
    offs = args[0] if args else kwargs.pop("offs")
    starts = torch.cat([offs.new_zeros(1), offs])
    first, last = int(starts[lo]), int(starts[hi])
    y = target(x[first:last], w, offs[lo:hi] - first, *args[1:], **kwargs)
    below, above = y.new_zeros(first, y.shape[-1]), y.new_zeros(x.shape[0] - last, y.shape[-1])
    return torch.cat([below, y, above])


def grouped_mm_flops(op: OpInfo) -> float:
    """2·M·K·N summed over the groups: 2 · output elements · K, except for 2-D x 2-D, whose K
    is what the groups split (2 · input elements · N)."""
    x, w = op.inputs[:2]
    if x.ndim == w.ndim == 2:
        return 2.0 * x.numel * w.shape[-1]
    return 2.0 * op.outputs[0].numel * x.shape[-1]


def _input_elements(op: OpInfo) -> float:
    """One read per input element (a histogram's work is its input, not its bins)."""
    return float(op.inputs[0].numel)


def indices_saved(op: OpInfo) -> Saves:
    """``index_put(self, indices, values)``: backward keeps the indices, not the data."""
    return Saves(inputs=tuple(range(1, len(op.inputs) - 1)))


_ROUTING = dict(family=ELEMENTWISE, follows=NO, localize=plain_localize)
# Backward scatters the gradient back through the indices output.
register_op(*SORTS, aten.topk.default, strategies=rank_strategy, saves=Saves(outputs=(1,)),
            flops=per_output_element, **_ROUTING)
# Integer in, integer out: no gradient, nothing saved.
register_op(aten.one_hot.default, strategies=one_hot_strategy, saves=NOTHING,
            flops=per_output_element, **_ROUTING)
register_op(aten.histc.default, strategies=histc_strategy, saves=NOTHING, flops=_input_elements,
            **_ROUTING)
register_op(aten.index_put.default, strategies=replicate_only, saves=indices_saved,
            flops=per_output_element, **_ROUTING)
# Backward keeps both operands (each gradient needs the other), not the offsets.
_GROUPED = dict(strategies=grouped_mm_strategy, family=MATMUL, saves=Saves(inputs=(0, 1)),
                follows=NO, flops=grouped_mm_flops, localize=grouped_mm_localize)
register_op(GROUPED_MM, **_GROUPED)


def grouped_mm_ops() -> tuple:
    """The grouped matmuls of transformers' experts path: ``_grouped_mm`` and, where
    transformers is imported, its ``grouped_mm_fallback``."""
    try:
        return (GROUPED_MM, torch.ops.transformers.grouped_mm_fallback.default)
    except (AttributeError, RuntimeError):     # transformers' MoE code not imported
        return (GROUPED_MM,)


def register_library_ops() -> None:
    """Records for ops a library defines when it is imported, which may be after autoshard:
    transformers' ``grouped_mm_fallback(input, weight, offs)``, the grouped matmul its MoE
    models (Mixtral, Qwen-MoE) call in float32 under export, computes what ``_grouped_mm``
    computes with offsets, so it gets the same record. The tracer calls this on every graph."""
    try:
        op = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):     # transformers' MoE code not imported
        return
    if op not in RECORDS:
        register_op(op, **_GROUPED)


# ----------------------------------------------------------- routed experts as one op

ROUTED_EXPERTS_OP = "autoshard::routed_experts"
# transformers' experts that group the tokens by counts read off the device (DBRX's and
# Switch's loops over ``nonzero``, JetMoE's router's ``tolist``), which export cannot follow, by
# class name: zoo/hf.py runs them through the routed ops instead, and tracing one it has not
# names that (trace/export.py)
DBRX_EXPERTS, SWITCH_SPARSE_MLP = "DbrxExperts", "SwitchTransformersSparseMLP"
JETMOE_ROUTER = "JetMoeTopKGating"
LOOPING_EXPERTS = (DBRX_EXPERTS, SWITCH_SPARSE_MLP, JETMOE_ROUTER)
# The activations a gated expert applies to its gate half (Hugging Face's ``hidden_act``).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": torch.nn.functional.silu, "swish": torch.nn.functional.silu,
    "gelu": torch.nn.functional.gelu, "relu": torch.nn.functional.relu,
    "gelu_pytorch_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh")}


@contextlib.contextmanager
def _autograd_in_kernel() -> Iterator[None]:
    """Autograd inside a custom op's kernel, which the dispatcher runs with autograd's keys
    excluded: the routed ops' gradients are their references differentiated there, in an op of
    their own, so that a compiler tracing the backward sees one opaque call (the reference
    groups tokens with ``nonzero``, whose data-dependent shapes AOTAutograd cannot trace)."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(
        torch._C.DispatchKey.AutogradFunctionality)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude), \
            torch.enable_grad():
        yield


def _differentiated(fn: Callable[..., torch.Tensor], grad: torch.Tensor,
                    tensors: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor]:
    """The gradients of ``fn(*leaves)`` against ``grad`` for each tensor given in ``tensors``
    (None: not an input), zeros where the output does not depend on it (no token chose a held
    expert)."""
    with _autograd_in_kernel():
        leaves = [None if t is None else t.detach().requires_grad_() for t in tensors]
        given = [t for t in leaves if t is not None]
        out = fn(*leaves)
        grads = torch.autograd.grad(out, given, grad, allow_unused=True) if out.requires_grad \
            else [None] * len(given)
    return [_or_zeros(g, t) for g, t in zip(grads, given)]


def routed_experts_reference(x: torch.Tensor, top_k_index: torch.Tensor,
                             top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                             down: torch.Tensor, first_expert: int, activation: str,
                             mask: torch.Tensor | None = None,
                             gate_up_bias: torch.Tensor | None = None,
                             down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the op computes, in differentiable ops: for every token ``t`` and each of its
    choices ``j`` whose expert ``e = top_k_index[t, j]`` is one of the ``gate_up.shape[0]``
    experts held from ``first_expert`` on, ``top_k_weights[t, j] · (down_e h + down_bias_e)``,
    summed over the choices (float32 sums, the output in ``x``'s dtype), where ``u = gate_up_e
    x_t + gate_up_bias_e`` and ``h`` is :func:`expert_hidden` of it, times ``mask[t, j]`` where
    a mask is given (an expert's dropout, drawn outside the op: [T, k, I]). Tokens are
    independent of each other; experts not held add nothing."""
    gated = gated_experts(gate_up, down)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(top_k_index == first_expert + e)
        if tok.numel() == 0:
            continue
        u = torch.nn.functional.linear(x[tok], gate_up[e],
                                       None if gate_up_bias is None else gate_up_bias[e])
        h = expert_hidden(u, activation, gated)
        if mask is not None:
            h = h * mask[tok, slot]
        y = torch.nn.functional.linear(h, down[e], None if down_bias is None else down_bias[e])
        out = out.index_add(0, tok, (y * top_k_weights[tok, slot, None]).float())
    return out.to(x.dtype)


# GPT-OSS's gate, named with its two constants: "gpt_oss:<alpha>:<limit>".
GPT_OSS_GATE = "gpt_oss"


def expert_hidden(u: torch.Tensor, activation: str, gated: bool) -> torch.Tensor:
    """An expert's hidden activation from its first projection ``u``:

    - gated (``u`` of ``2I``: the gate half, then the up half): ``act(gate) · up``;
    - ungated (``u`` of ``I``: Switch Transformers' ``wo(act(wi x))``): ``act(u)``;
    - ``"gpt_oss:<alpha>:<limit>"`` (GPT-OSS: gate and up interleaved, even and odd columns):
      ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)`` with ``g = min(gate, limit)``.
    """
    if activation.startswith(GPT_OSS_GATE + ":"):
        alpha, limit = (float(v) for v in activation.split(":")[1:])
        gate, up = u[..., ::2].clamp(max=limit), u[..., 1::2].clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    act = ACTIVATIONS[activation]
    if gated:
        gate, up = u.chunk(2, dim=-1)
        return act(gate) * up
    return act(u)


def gated_experts(gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether ``gate_up`` holds a gate and an up projection (twice ``down``'s inner width) or
    one projection (as wide), which a Switch Transformers expert has."""
    inner = down.shape[-1]
    if gate_up.shape[1] not in (inner, 2 * inner):
        raise ValueError(f"routed_experts: gate_up [E, 2I, H] or [E, I, H] for down [E, H, I] "
                         f"with I = {inner}; got gate_up {list(gate_up.shape)}")
    return gate_up.shape[1] == 2 * inner


@torch.library.custom_op(ROUTED_EXPERTS_OP, mutates_args=())
def routed_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                   gate_up: torch.Tensor, down: torch.Tensor, first_expert: int,
                   activation: str, mask: torch.Tensor | None = None,
                   gate_up_bias: torch.Tensor | None = None,
                   down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Hugging Face's experts (gated: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``;
    ungated, ``gate_up [E, I, H]``; GPT-OSS's gate; with biases ``[E, 2I]``/``[E, H]`` or
    not) on tokens ``x [T, H]`` routed by ``top_k_index``/``top_k_weights [T, k]``, with an
    optional dropout ``mask [T, k, I]`` on the hidden activation, as one op: a tracer sees one
    node whose rule splits tokens, experts or both (see ``experts_strategy``) instead of a sort
    over every token of the step."""
    return routed_experts_reference(x, top_k_index, top_k_weights, gate_up, down,
                                    first_expert, activation, mask, gate_up_bias, down_bias)


@routed_experts.register_fake
def _routed_experts_fake(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty_like(x)


def _routed_experts_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, index, weights, gate_up, down, first, activation, mask, gate_up_bias, down_bias = inputs
    ctx.save_for_backward(x, index, weights, gate_up, down, mask, gate_up_bias, down_bias)
    ctx.first, ctx.activation = first, activation


@torch.library.custom_op(ROUTED_EXPERTS_OP + "_grads", mutates_args=())
def routed_experts_grads(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                         down: torch.Tensor, first_expert: int, activation: str,
                         mask: torch.Tensor | None = None,
                         gate_up_bias: torch.Tensor | None = None,
                         down_bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The backward of ``routed_experts``: the reference run again and differentiated, giving
    the gradients of the tokens, the routing weights, the experts' weights and the biases
    given (the expert indices and the dropout mask have none)."""
    def fn(lx, lw, lgu, ld, lgub, ldb):
        return routed_experts_reference(lx, top_k_index, lw, lgu, ld, first_expert, activation,
                                        mask, lgub, ldb)
    return _differentiated(fn, grad, (x, top_k_weights, gate_up, down, gate_up_bias, down_bias))


@routed_experts_grads.register_fake
def _routed_experts_grads_fake(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                               down: torch.Tensor, first_expert: int, activation: str,
                               mask: torch.Tensor | None = None,
                               gate_up_bias: torch.Tensor | None = None,
                               down_bias: torch.Tensor | None = None) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in (x, top_k_weights, gate_up, down, gate_up_bias,
                                          down_bias) if t is not None]


def _routed_experts_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, index, weights, gate_up, down, mask, gate_up_bias, down_bias = ctx.saved_tensors
    grads = iter(routed_experts_grads(grad, x, index, weights, gate_up, down, ctx.first,
                                      ctx.activation, mask, gate_up_bias, down_bias))
    gx, gw, ggu, gd = next(grads), next(grads), next(grads), next(grads)
    gub, gdb = (None if t is None else next(grads) for t in (gate_up_bias, down_bias))
    return gx, None, gw, ggu, gd, None, None, None, gub, gdb


def _or_zeros(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like) if g is None else g


routed_experts.register_autograd(_routed_experts_backward, setup_context=_routed_experts_context)
ROUTED_EXPERTS = torch.ops.autoshard.routed_experts.default

# Tokens split: each rank routes its own tokens through every expert (exact: tokens are
# independent). Experts split: each rank runs its experts on every token, a Partial output. The
# optional inputs (the op's arguments 7-9): a dropout mask, one row per token, goes with the
# tokens; the biases, one row per expert, with the experts.
_TOKENS: Option = ((Shard(0), Shard(0), Shard(0), R, R), (Shard(0),))
_EXPERTS: Option = ((R, R, R, Shard(0), Shard(0)), (P,))
_OPTIONAL = (("mask", Shard(0), R), ("gate_up_bias", R, Shard(0)), ("down_bias", R, Shard(0)))


def experts_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """Tokens over an axis (data parallel), experts over an axis (expert parallel, the tokens
    whole on it and the output a sum over its ranks), or both on different axes. The experts'
    inner dim is not split: ``gate_up`` holds the gate and up halves one after the other, which
    one even split would not cut alike."""
    given = [(tokens, experts) for i, (name, tokens, experts) in enumerate(_OPTIONAL, start=7)
             if arg(op, i, name) is not None]
    tokens = ((*_TOKENS[0], *(t for t, _ in given)), _TOKENS[1])
    experts = ((*_EXPERTS[0], *(e for _, e in given)), _EXPERTS[1])
    return expand(op, mesh_shape, [tokens, experts],
                  kernel=lambda combo: LOCAL_EXPERTS if experts in combo else None)


def _localize_experts(weight: int, first: int) -> Callable:
    """A routed op's local call: the op on the rank's tensors; under ``local_experts`` told
    which expert it holds first (its argument ``first``; its experts' weight is tensor input
    ``weight``, split on dim 0)."""
    def localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                 args: tuple, kwargs: dict) -> tuple:
        if strategy.kernel != LOCAL_EXPERTS:
            return op.target, args, kwargs
        index, factor = shard_index(strategy.inputs[weight], 0, mesh_shape, coords)
        held = arg(op, first, "first_expert", 0) + index * op.inputs[weight].shape[0] // factor
        return op.target, args[:first] + (held,) + args[first + 1:], kwargs
    return localize


def experts_flops(op: OpInfo) -> float:
    """2 FLOPs per multiply-add of the routed pairs: ``T·k`` rows through ``H -> W`` and
    ``I -> H``, where ``W`` is ``gate_up``'s width (``2I`` gated, ``I`` ungated): ``6·T·k·H·I``
    gated, ``4·T·k·H·I`` ungated."""
    x, index, _, gate_up, down = op.inputs[:5]
    return 2.0 * index.numel * x.shape[-1] * (gate_up.shape[1] + down.shape[-1])


def experts_saved(op: OpInfo) -> Saves:
    """The tokens, their routing and dropout mask, and per token what a grouped kernel keeps
    for backward: each of its ``k`` pairs' gate-up output and activation (``W + I``
    elements: ``3I`` gated, ``2I`` ungated)."""
    x, index, _, gate_up, down = op.inputs[:5]
    per_row = index.shape[-1] * (gate_up.shape[1] + down.shape[-1]) * x.dtype.itemsize
    return Saves(inputs=(0, 1, 2) + (() if arg(op, 7, "mask") is None else (5,)),
                 extra=(("in", 0, "row", per_row),))


register_op(ROUTED_EXPERTS, strategies=experts_strategy, family=MATMUL, saves=experts_saved,
            follows=NO, flops=experts_flops, localize=_localize_experts(3, 5))


# ------------------------------------------------------ one routed linear: attention experts

ROUTED_LINEAR_OP = "autoshard::routed_linear"


def routed_linear_reference(x: torch.Tensor, top_k_index: torch.Tensor, weight: torch.Tensor,
                            first_expert: int, top_k_weights: torch.Tensor | None = None
                            ) -> torch.Tensor:
    """What the op computes, in differentiable ops, with ``weight [E, O, H]`` holding the
    experts from ``first_expert`` on and ``e = top_k_index[t, j]`` a held expert:

    - dispatch (no ``top_k_weights``): ``x [T, H]`` to ``[T, k, O]``, slot ``(t, j)`` being
      ``weight_e x_t`` (zero where ``e`` is not held);
    - combine: ``x [T, k, H]`` to ``[T, O]``, the sum over ``j`` of
      ``top_k_weights[t, j] · weight_e x[t, j]`` (float32 sums, the output in ``x``'s dtype).

    Tokens are independent of each other; experts not held add nothing."""
    k, out_dim = top_k_index.shape[-1], weight.shape[1]
    combine = top_k_weights is not None
    shape = (x.shape[0], out_dim) if combine else (x.shape[0], k, out_dim)
    out = torch.zeros(shape, dtype=torch.float32 if combine else x.dtype, device=x.device)
    for e in range(weight.shape[0]):
        tok, slot = torch.where(top_k_index == first_expert + e)
        if tok.numel() == 0:
            continue
        if combine:
            y = torch.nn.functional.linear(x[tok, slot], weight[e])
            out = out.index_add(0, tok, (y * top_k_weights[tok, slot, None]).float())
        else:
            y = torch.nn.functional.linear(x[tok], weight[e])
            out = out.index_put((tok, slot), y)
    return out.to(x.dtype)


@torch.library.custom_op(ROUTED_LINEAR_OP, mutates_args=())
def routed_linear(x: torch.Tensor, top_k_index: torch.Tensor, weight: torch.Tensor,
                  first_expert: int, top_k_weights: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One projection per expert, ``weight [E, O, H]``, applied to each token's routed slots:
    JetMoE's mixture of attention heads projects each token's queries with the ``k`` experts it
    chose (dispatch) and their attention outputs back, weighted and summed (combine); see
    :func:`routed_linear_reference`. One op a tracer follows, where transformers splits the
    tokens by counts it reads off the device."""
    return routed_linear_reference(x, top_k_index, weight, first_expert, top_k_weights)


@routed_linear.register_fake
def _routed_linear_fake(x: torch.Tensor, top_k_index: torch.Tensor, weight: torch.Tensor,
                        first_expert: int, top_k_weights: torch.Tensor | None = None
                        ) -> torch.Tensor:
    if top_k_weights is not None:
        return x.new_empty((x.shape[0], weight.shape[1]))
    return x.new_empty((x.shape[0], top_k_index.shape[-1], weight.shape[1]))


def _routed_linear_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    x, index, weight, first, weights = inputs
    ctx.save_for_backward(x, index, weight, weights)
    ctx.first = first


@torch.library.custom_op(ROUTED_LINEAR_OP + "_grads", mutates_args=())
def routed_linear_grads(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                        weight: torch.Tensor, first_expert: int,
                        top_k_weights: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The backward of ``routed_linear``: the reference differentiated, giving the gradients
    of the tokens, the weight and, when combining, the routing weights."""
    def fn(lx, lweight, lw):
        return routed_linear_reference(lx, top_k_index, lweight, first_expert, lw)
    return _differentiated(fn, grad, (x, weight, top_k_weights))


@routed_linear_grads.register_fake
def _routed_linear_grads_fake(grad: torch.Tensor, x: torch.Tensor, top_k_index: torch.Tensor,
                              weight: torch.Tensor, first_expert: int,
                              top_k_weights: torch.Tensor | None = None) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in (x, weight, top_k_weights) if t is not None]


def _routed_linear_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, index, weight, weights = ctx.saved_tensors
    gx, gweight, *gw = routed_linear_grads(grad, x, index, weight, ctx.first, weights)
    return gx, None, gweight, None, (gw[0] if gw else None)


routed_linear.register_autograd(_routed_linear_backward, setup_context=_routed_linear_context)
ROUTED_LINEAR = torch.ops.autoshard.routed_linear.default


def routed_linear_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """As the routed experts': tokens over an axis (their routing and weights with them), or
    experts over an axis (the tokens whole on it, the output a sum over its ranks: a slot's
    value comes from the one rank holding its expert), and as a linear's: the weight's output
    dim split with the output's last (column-parallel: JetMoE's query heads), or its input dim
    with the input's last, into a Partial output (row-parallel), on any mix of axes."""
    combine = arg(op, 4, "top_k_weights") is not None
    w = (R,) if combine else ()
    tokens: Option = ((Shard(0), Shard(0), R) + ((Shard(0),) if combine else ()), (Shard(0),))
    experts: Option = ((R, R, Shard(0)) + w, (P,))
    x_last, out_last = op.inputs[0].ndim - 1, op.outputs[0].ndim - 1
    column: Option = ((R, R, Shard(1)) + w, (Shard(out_last),))
    row: Option = ((Shard(x_last), R, Shard(2)) + w, (P,))
    return expand(op, mesh_shape, [tokens, experts, column, row],
                  kernel=lambda combo: LOCAL_EXPERTS if experts in combo else None)


def routed_linear_flops(op: OpInfo) -> float:
    """2 FLOPs per multiply-add: ``T·k`` routed rows through ``H -> O`` (``2·T·k·H·O``)."""
    index, weight = op.inputs[1], op.inputs[2]
    return 2.0 * index.numel * weight.shape[1] * weight.shape[2]


def routed_linear_saved(op: OpInfo) -> Saves:
    """What a linear keeps: its input, and the routing (the weights too, when combining)."""
    return Saves(inputs=(0, 1) + ((3,) if arg(op, 4, "top_k_weights") is not None else ()))


register_op(ROUTED_LINEAR, strategies=routed_linear_strategy, family=MATMUL,
            saves=routed_linear_saved, follows=NO, flops=routed_linear_flops,
            localize=_localize_experts(2, 3))
