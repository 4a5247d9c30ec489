"""Per-device memory: model state (parameters, gradients, optimizer) and saved activations.

Closed forms from REFERENCE.md §3: ZeRO model-state bytes (Rajbhandari et al. 2019, arXiv
1910.02054) and activation bytes per transformer layer (Korthikanti et al. 2022, arXiv 2205.05198,
Table 2). ``saved_activation_bytes`` is the per-op model the planner sums over a graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from autoshard.cost.compute import (ATTENTION, GATHER, MATMUL, VIEW, local_numel, op_family,
                                    op_name, op_profile)
from autoshard.errors import AutoshardError
from autoshard.ir import Strategy, shard_factor
from autoshard.solver.rules.registry import OpInfo, cached_on

# ----------------------------------------------------------------------------- model state

# Mixed-precision Adam keeps an fp32 master copy, momentum and variance: K = 12 bytes per
# parameter on top of 16-bit parameter and gradient (ZeRO paper §3.1; REFERENCE.md §3).
MIXED_PRECISION_ADAM_K = 12
OPTIMIZERS = ("adam", "adamw", "sgd", "none")


def param_state_bytes(numel_local: int, dtype: torch.dtype, *, optimizer: str = "adam") -> int:
    """Bytes one device holds for ``numel_local`` parameter elements: parameter, gradient and
    optimizer state. ``optimizer="none"`` (inference) counts the parameters only.

    - 16-bit (or smaller) params with Adam: 2 + 2 + K=12 = 16 bytes each (mixed precision).
    - fp32 params with Adam: 4 + 4 + 8 (momentum and variance in fp32) = 16 bytes each.
    - ``"sgd"``: parameter + gradient (plain SGD keeps no state).
    """
    if optimizer not in OPTIMIZERS:
        raise AutoshardError(f"optimizer is one of {OPTIMIZERS}", got=repr(optimizer),
                             fix="pass optimizer='adam' (mixed-precision Adam/AdamW), 'sgd' or "
                                 "'none' for inference")
    isz = dtype.itemsize
    if optimizer == "none":
        return numel_local * isz
    if optimizer == "sgd":
        return numel_local * 2 * isz
    state = MIXED_PRECISION_ADAM_K if isz < 4 else 2 * isz
    return numel_local * (2 * isz + state)


def zero_model_state_bytes(psi: float, d: int, stage: int, K: float = MIXED_PRECISION_ADAM_K
                           ) -> float:
    """Per-device model-state bytes of ZeRO stage ``stage`` (0 = plain data parallel) over ``d``
    data-parallel ranks, for ``psi`` parameters with 2-byte params and grads and ``K`` bytes of
    optimizer state per parameter (REFERENCE.md §3, ZeRO paper Figure 1)."""
    if stage not in (0, 1, 2, 3) or d < 1:
        raise AutoshardError("ZeRO stage is 0 (DP), 1, 2 or 3 over d >= 1 ranks",
                             got=f"stage={stage!r}, d={d!r}", fix="pass stage in 0..3, d >= 1")
    if stage == 0:
        return (2 + 2 + K) * psi
    if stage == 1:
        return 4 * psi + K * psi / d
    if stage == 2:
        return 2 * psi + (2 + K) * psi / d
    return (2 + 2 + K) * psi / d


# ----------------------------------------------------------------------------- activations

ACTIVATION_MODES = ("none", "tensor", "tensor_sequence", "selective", "full")


def activation_bytes_per_layer(s: int, b: int, h: int, a: int, t: int = 1,
                               mode: str = "none") -> float:
    """Activation bytes one device keeps per transformer layer with 16-bit activations
    (Korthikanti et al. 2022, Table 2; REFERENCE.md §3). ``mode``:

    - ``"none"``: no parallelism, ``sbh(34 + 5as/h)``
    - ``"tensor"``: tensor parallel over ``t``, ``sbh(10 + 24/t + 5as/(ht))``
    - ``"tensor_sequence"``: tensor + sequence parallel, ``sbh/t (34 + 5as/h)``
    - ``"selective"``: tensor + sequence parallel + selective recompute, ``34 sbh/t``
    - ``"full"``: full recompute, ``2sbh`` (the layer input only)
    """
    sbh = s * b * h
    if mode == "none":
        return sbh * (34 + 5 * a * s / h)
    if mode == "tensor":
        return sbh * (10 + 24 / t + 5 * a * s / (h * t))
    if mode == "tensor_sequence":
        return sbh / t * (34 + 5 * a * s / h)
    if mode == "selective":
        return 34 * sbh / t
    if mode == "full":
        return 2 * sbh
    raise AutoshardError(f"activation mode is one of {ACTIVATION_MODES}", got=repr(mode),
                         fix="pick the parallelism setting to price")


@dataclass(frozen=True, slots=True)
class SavedRule:
    """What an op keeps alive for backward, independent of the strategy.

    ``inputs``/``outputs`` are positions in ``op.inputs``/``op.outputs``. ``extra`` lists buffers
    that are not graph tensors, each ``(side, index, per, nbytes)``: ``nbytes`` for every element
    (``per="elem"``) or every row (``per="row"``, rows = all dims but the last) of that tensor;
    ``nbytes=0`` means the tensor's own itemsize.
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    extra: tuple[tuple[str, int, str, int], ...] = ()


NOTHING = SavedRule()
# Ops whose backward needs no tensor (sums, copies, layout changes, constructors).
_SAVE_NOTHING = frozenset({
    "add", "sub", "rsub", "neg", "sum", "mean", "cat", "stack", "clone", "_to_copy", "to",
    "copy", "contiguous", "repeat", "pad", "constant_pad_nd", "flip", "roll", "cumsum",
    "slice_scatter", "select_scatter", "zeros_like", "ones_like", "full_like", "fill",
    "lift_fresh_copy", "_unsafe_index_put", "new_zeros", "new_ones", "new_full", "scalar_tensor",
    "sym_sum",
})
_SAVE_INPUT0 = frozenset({
    "gelu", "silu", "mish", "log", "log1p", "log2", "log10", "sin", "cos", "erf", "abs", "square",
    "leaky_relu", "hardswish", "hardsigmoid", "softplus", "log_sigmoid", "clamp", "clamp_min",
    "clamp_max", "hardtanh", "var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm",
    "frobenius_norm", "sign",
})
_SAVE_OUTPUT0 = frozenset({
    "tanh", "sigmoid", "relu", "exp", "exp2", "rsqrt", "sqrt", "reciprocal", "_softmax",
    "softmax", "_log_softmax", "log_softmax", "elu", "threshold",
})
_LAYER_NORMS = frozenset({"native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm",
                          "native_group_norm", "group_norm", "native_batch_norm",
                          "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                          "batch_norm"})


def _saved_rule(op: OpInfo) -> SavedRule:
    family, name = op_family(op.target), op_name(op.target)
    prof = op_profile(op)
    n_in, n_out = len(prof.inputs), len(prof.outputs)
    if family == VIEW or not prof.has_backward:
        return NOTHING
    if family == MATMUL:
        if name in ("addmm", "baddbmm", "addbmm", "addmv"):
            return SavedRule(inputs=(1, 2))                   # not the bias
        if name in ("einsum", "tensordot", "bilinear"):
            return SavedRule(inputs=tuple(range(n_in)))
        return SavedRule(inputs=(0, 1))                       # not linear's/conv's bias
    if family == ATTENTION:
        # q, k, v (and a mask), the output, and the fp32 logsumexp per query row (FlashAttention).
        return SavedRule(inputs=tuple(range(n_in)), outputs=(0,), extra=(("in", 0, "row", 4),))
    if family == GATHER:
        return SavedRule(inputs=tuple(range(1, n_in)))        # the indices, not the table
    if name in _SAVE_NOTHING:
        return NOTHING
    if name in _LAYER_NORMS:
        # The input and per-row fp32 stats (mean and rstd; RMSNorm has rstd only; for batch and
        # group norm the stats are per channel or group, which per row over-counts slightly).
        stats = 4 if "rms" in name else 8
        return SavedRule(inputs=(0,), extra=(("in", 0, "row", stats),))
    if name in ("native_dropout", "dropout", "feature_dropout"):
        return SavedRule(extra=(("out", 0, "elem", 1),))      # the bool mask
    if name in _SAVE_OUTPUT0:
        return SavedRule(outputs=(0,))
    if name in _SAVE_INPUT0:
        return SavedRule(inputs=(0,))
    if name in ("mul", "div"):
        return SavedRule(inputs=(0, 1)) if n_in >= 2 else NOTHING   # x * scalar needs nothing
    if name == "pow":
        return SavedRule(inputs=tuple(range(n_in)))
    if name in ("masked_fill", "index_put", "scatter", "scatter_add", "index_add"):
        return SavedRule(inputs=tuple(range(1, n_in)))        # the mask / indices
    if name == "where":
        return SavedRule(inputs=(0,))                         # the condition
    if name == "nll_loss_forward" or name == "nll_loss2d_forward":
        # ``self`` is log_softmax's output, already kept by log_softmax; the target is small.
        return SavedRule(inputs=tuple(range(1, n_in)), outputs=tuple(range(1, n_out)))
    if name == "cross_entropy_loss":
        # The composite keeps a logits-sized log-softmax and the target.
        return SavedRule(inputs=tuple(range(1, n_in)), extra=(("in", 0, "elem", 0),))
    # Unknown op with a gradient: assume its backward needs every input (over-estimating memory
    # is the safe side for a planner under a memory budget).
    return SavedRule(inputs=tuple(range(n_in)))


def saved_input_bytes(op: OpInfo, k: int, spec, mesh_shape: tuple[int, ...]) -> int:
    """Bytes one device keeps of input ``k`` for ``op``'s backward when the op reads it in layout
    ``spec``; 0 if the backward does not need it. A parameter read where it lies is already in
    model state; read through a reshard, the resharded copy is what the backward keeps."""
    prof = op_profile(op)
    if k not in saved_rule(op).inputs or k >= len(prof.inputs):
        return 0
    shape, isz = prof.inputs[k]
    return local_numel(shape, spec, tuple(mesh_shape)) * isz


_SAVED_KEY = "_autoshard_saved_rule"


def saved_rule(op: OpInfo) -> SavedRule:
    """The op's :class:`SavedRule`, computed once and kept on the (immutable) op."""
    return cached_on(op, _SAVED_KEY, _saved_rule)


def saved_activation_bytes(op: OpInfo, strategy: Strategy, mesh_shape: tuple[int, ...], *,
                           exclude: frozenset[int] = frozenset()) -> int:
    """Bytes one device keeps alive from ``op``'s forward until its backward (training).

    Local sizes under ``strategy``. ``exclude`` lists positions in ``op.inputs`` whose storage is
    counted elsewhere (parameters and views of them, which live in model state). A tensor saved
    by several consumers is counted once per consumer here; a caller that sums over a graph can
    dedupe by producer with :func:`saved_rule`. Approximate by design: it follows PyTorch's
    derivative formulas for the common ops (see ``_saved_rule``).
    """
    rule = saved_rule(op)
    if rule is NOTHING:
        return 0
    mesh_shape = tuple(mesh_shape)
    prof = op_profile(op)
    ins = strategy.inputs if len(strategy.inputs) == len(prof.inputs) else tuple(
        s for s in strategy.inputs if s is not None)

    def in_spec(i: int):
        return ins[i] if i < len(ins) else None

    def out_spec(j: int):
        return strategy.outputs[j] if j < len(strategy.outputs) else None

    total = 0
    for i in rule.inputs:
        if i < len(prof.inputs) and i not in exclude:
            shape, isz = prof.inputs[i]
            total += local_numel(shape, in_spec(i), mesh_shape) * isz
    for j in rule.outputs:
        if j < len(prof.outputs):
            shape, isz = prof.outputs[j]
            total += local_numel(shape, out_spec(j), mesh_shape) * isz
    for side, idx, per, nbytes in rule.extra:
        infos, spec = (prof.inputs, in_spec(idx)) if side == "in" else (prof.outputs, out_spec(idx))
        if idx >= len(infos):
            continue
        shape, isz = infos[idx]
        n = local_numel(shape, spec, mesh_shape)
        if per == "row" and shape:
            last = shape[-1] // (shard_factor(spec, len(shape) - 1, mesh_shape) if spec else 1)
            n //= max(last, 1)
        total += n * (nbytes or isz)
    return total

