"""Per-device memory: model state (parameters, gradients, optimizer) and saved activations.

Closed forms from docs/cost-model.md §4: ZeRO model-state bytes (Rajbhandari et al. 2019, arXiv
1910.02054) and activation bytes per transformer layer (Korthikanti et al. 2022, arXiv 2205.05198,
Table 2). ``saved_activation_bytes`` is the per-op model the planner sums over a graph.
"""
from __future__ import annotations


import torch

from autoshard.cost.compute import local_numel, op_profile
from autoshard.cost.state import optimizer_bytes_per_element
from autoshard.errors import AutoshardError
from autoshard.ir import OpInfo, Strategy, cached_on, shard_factor
from autoshard.ops.registry import NOTHING, VIEW, Saves, record_of
from autoshard.options import OPTIMIZERS

# ----------------------------------------------------------------------------- budgets

# What a device's memory holds besides the step the liveness walk counts (docs/cost-model.md
# §4.6): the CUDA context and the kernels' libraries (cuBLAS, cuDNN, NCCL), which
# ``torch.cuda.max_memory_allocated`` does not see, left out of the default budget; and the
# allocator's own excess over the walk (blocks rounded up, tensors the walk does not know of:
# on one H100 the allocator's peak was 0.1-2.5% above the walk's; on gloo ranks MemTracker's
# was up to 7% above, benchmarks/RESULTS.md memory_vs_measure), left out of every budget.
DEVICE_RESERVE_BYTES = 2**30
ALLOCATOR_SLACK = 0.07
# What one training process holds on the host besides the state the plan offloads: the Python
# interpreter, torch and the CUDA libraries' host side (docs/cost-model.md §4.6).
HOST_RESERVE_BYTES = 4 * 2**30


def device_budget(cluster, memory_budget: float | None) -> float:
    """The bytes a plan's step may peak at on one device, as the liveness walk counts them:
    ``memory_budget`` (the allocator's peak a user allows; default the device's memory less
    :data:`DEVICE_RESERVE_BYTES`) less :data:`ALLOCATOR_SLACK` of it."""
    allowed = default_budget(cluster) if memory_budget is None else memory_budget
    return allowed * (1 - ALLOCATOR_SLACK)


def default_budget(cluster) -> float:
    """The ``memory_budget`` a plan gets when none is given: the device's memory less
    :data:`DEVICE_RESERVE_BYTES`."""
    return cluster.memory_bytes - DEVICE_RESERVE_BYTES


def budget_for(peak: float) -> float:
    """The ``memory_budget`` a step that peaks at ``peak`` bytes (the walk's) needs: the inverse
    of :func:`device_budget`."""
    return peak / (1 - ALLOCATOR_SLACK)


def host_budget(cluster) -> float:
    """The host bytes a device's process may fill with offloaded state and its pinned buffers:
    the cluster's ``host_memory_bytes`` per device less :data:`HOST_RESERVE_BYTES`."""
    return cluster.host_memory_bytes - HOST_RESERVE_BYTES


# ----------------------------------------------------------------------------- model state

# Mixed-precision Adam keeps an fp32 master copy, momentum and variance: K = 12 bytes per
# parameter on top of 16-bit parameter and gradient (ZeRO paper §3.1; docs/cost-model.md §4.1).
MIXED_PRECISION_ADAM_K = 12


def param_state_bytes(numel_local: int, dtype: torch.dtype, *, optimizer: str = "adam") -> int:
    """Bytes one device holds for ``numel_local`` parameter elements: parameter, gradient and
    optimizer state. ``optimizer="none"`` (inference) counts the parameters only.

    - 16-bit (or smaller) params with Adam: 2 + 2 + K=12 = 16 bytes each (mixed precision).
    - fp32 or fp64 params with Adam: param, gradient, momentum and variance in their dtype,
      16 bytes each for fp32 (cost/state.py ``optimizer_bytes_per_element``).
    - ``"sgd"``: parameter + gradient (plain SGD keeps no state).
    """
    if optimizer not in OPTIMIZERS:
        raise AutoshardError(f"optimizer is one of {OPTIMIZERS}", got=repr(optimizer),
                             fix="pass optimizer='adam' (mixed-precision Adam/AdamW), 'sgd' or "
                                 "'none' for inference")
    isz = dtype.itemsize
    if optimizer == "none":
        return numel_local * isz
    return numel_local * (2 * isz + optimizer_bytes_per_element(isz, optimizer, None))


def zero_model_state_bytes(psi: float, d: int, stage: int, K: float = MIXED_PRECISION_ADAM_K
                           ) -> float:
    """Per-device model-state bytes of ZeRO stage ``stage`` (0 = plain data parallel) over ``d``
    data-parallel ranks, for ``psi`` parameters with 2-byte params and grads and ``K`` bytes of
    optimizer state per parameter (docs/cost-model.md §4.2, ZeRO paper Figure 1)."""
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
    (Korthikanti et al. 2022, Table 2; docs/cost-model.md §4.3). ``mode``:

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


def _saves(op: OpInfo) -> Saves:
    prof = op_profile(op)
    if prof.family == VIEW or not prof.has_backward:
        return NOTHING
    return record_of(op.target).saved(op)


_SAVED_KEY = "_autoshard_saves"


def saved_rule(op: OpInfo) -> Saves:
    """What the op's backward keeps (its record's :class:`Saves`; nothing for an op without a
    backward), computed once and kept on the (immutable) op."""
    return cached_on(op, _SAVED_KEY, _saves)


def saved_activation_bytes(op: OpInfo, strategy: Strategy, mesh_shape: tuple[int, ...], *,
                           exclude: frozenset[int] = frozenset()) -> int:
    """Bytes one device keeps alive from ``op``'s forward until its backward (training).

    Local sizes under ``strategy``. ``exclude`` lists positions in ``op.inputs`` whose storage is
    counted elsewhere: the planner passes every saved input, and counts each saved value once per
    layout across its consumers (``Pricer.saved_copy_bytes``). Approximate by design: it follows PyTorch's
    derivative formulas for the common ops (each op's record says what it saves).
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

