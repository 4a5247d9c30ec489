"""Per-op compute time: a roofline on one device.

``time = max(flops / (peak * efficiency), bytes / mem_bandwidth, kernel_floor_s)`` where FLOPs
are the op's forward FLOPs times the strategy's ``compute_scale`` and bytes are the local sizes of
the op's inputs and outputs under the strategy's specs. Large matmuls run at ``matmul_efficiency``
of peak, small ops are bandwidth- or launch-bound (REFERENCE.md §2: "achievable matmul throughput
is ~70-80% of peak on large shapes; small ops are bandwidth- or launch-bound (a floor of a few µs
per kernel)").

``op_time`` is called for every (node, strategy) pair of a model (tens of thousands for a 70B
model), so everything that depends on the op alone is computed once and kept on the (immutable)
:class:`OpInfo`; the per-strategy work is a few integer products, with no torch calls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from autoshard.ir import Strategy, local_shape
from autoshard.mesh import Mesh
from autoshard.solver.rules.registry import RULES, OpInfo, cached_on, op_flops

# Op families, by the op's base name (``aten.mm.default`` -> "mm"; in-place "relu_" -> "relu").
VIEW, MATMUL, ATTENTION, GATHER = "view", "matmul", "attention", "gather"
ELEMENTWISE = "elementwise"     # everything else: elementwise, reductions, norms, copies

# No kernel runs: views, symbolic sizes, asserts, uninitialised allocations.
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "_reshape_alias", "permute", "transpose", "t", "expand",
    "expand_as", "unsqueeze", "squeeze", "slice", "select", "split", "split_with_sizes",
    "unsafe_split", "chunk", "unbind", "narrow", "getitem", "alias", "detach", "view_as",
    "flatten", "unflatten", "movedim", "as_strided", "diagonal", "unfold", "lift_fresh",
    "view_as_real", "view_as_complex", "sym_size", "sym_numel", "sym_stride",
    "sym_storage_offset", "sym_constrain_range", "sym_constrain_range_for_size",
    "empty", "empty_like", "empty_strided", "empty_permuted", "size", "stride", "dim",
})
# Functionalised graphs spell views "<view>_copy"; a compiler turns them back into views.
VIEW_OPS = VIEW_OPS | frozenset(f"{n}_copy" for n in VIEW_OPS)

MATMUL_OPS = frozenset({
    "mm", "bmm", "addmm", "addbmm", "baddbmm", "mv", "addmv", "dot", "vdot", "matmul", "linear",
    "einsum", "tensordot", "bilinear", "_scaled_mm", "_grouped_mm", "convolution", "_convolution",
    "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
})
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
    "_efficient_attention_forward",
})
# Ops that read a few rows of a big table: bytes moved are the rows, not the table.
GATHER_OPS = frozenset({"embedding", "index_select", "gather", "index", "take"})
# Ops whose output does not depend differentiably on their tensor inputs.
NO_GRAD_OPS = frozenset({
    "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like",
    "new_zeros", "new_ones", "new_full", "new_empty", "bernoulli", "scalar_tensor",
    "zeros", "ones", "full", "arange", "rand", "randn", "randint", "eye", "fill",
})

# Backward FLOPs as a multiple of forward FLOPs. A matmul needs grad wrt input and grad wrt
# weight, each as many FLOPs as the forward (hence training ≈ 3× forward, REFERENCE.md §3's
# 6·Ψ·tokens). Flash attention's backward does 5 matmuls to the forward's 2 (Dao 2023,
# FlashAttention-2, arXiv 2307.08691: backward FLOPs are 2.5× forward).
MATMUL_BACKWARD_FACTOR = 2.0
ATTENTION_BACKWARD_FACTOR = 2.5
# An elementwise op's backward reads the saved input(s) and the output gradient and writes the
# input gradient(s): 1.5x the forward's traffic for a unary op, more where autograd materialises
# intermediates; 2x is the round, conservative figure.
ELEMENTWISE_BACKWARD_BYTES = 2.0


def op_name(target: Any) -> str:
    """The base name of an op target: ``aten.mm.default`` -> "mm", ``operator.getitem`` ->
    "getitem"; in-place variants map to the functional name ("relu_" -> "relu")."""
    name = getattr(target, "_opname", None) or getattr(target, "__name__", None) or str(target)
    if name.endswith("_") and not name.endswith("__"):
        name = name[:-1]
    return name


def op_family(target: Any) -> str:
    name = op_name(target)
    if name in VIEW_OPS or name.startswith("_assert") or name.startswith("_functional_assert"):
        return VIEW
    if name in ATTENTION_OPS:
        return ATTENTION
    if name in MATMUL_OPS:
        return MATMUL
    if name in GATHER_OPS:
        return GATHER
    return ELEMENTWISE


def op_arg(op: OpInfo, name: str, default: Any = None) -> Any:
    """A (non-tensor) argument by schema name, positional or keyword."""
    if name in op.kwargs:
        return op.kwargs[name]
    schema = getattr(op.target, "_schema", None)
    if schema is not None:
        for i, a in enumerate(schema.arguments):
            if a.name == name:
                return op.args[i] if i < len(op.args) else default
    return default


def _matmul_flops(op: OpInfo, name: str) -> float | None:
    """Closed-form FLOPs of matmul-like ops (2 per multiply-add), for rules that register none."""
    ins, out = op.inputs, op.outputs
    if not ins or not out:
        return None
    n_out = out[0].numel
    if name in ("mm", "bmm", "matmul", "linear", "_scaled_mm"):
        return 2.0 * n_out * ins[0].shape[-1]
    if name in ("addmm", "baddbmm") and len(ins) >= 3:
        return 2.0 * n_out * ins[1].shape[-1] + n_out
    if name == "addbmm" and len(ins) >= 3:
        return 2.0 * ins[1].numel * ins[2].shape[-1] + n_out
    if name in ("mv", "dot", "vdot"):
        return 2.0 * ins[0].numel
    if name == "addmv" and len(ins) >= 2:
        return 2.0 * ins[1].numel
    if name.startswith("conv") or name in ("convolution", "_convolution"):
        w = ins[1]
        per_out = w.numel / w.shape[0]   # (C_in/groups) * prod(kernel) MACs per output element
        transposed = bool(op_arg(op, "transposed", False)) or "transpose" in name
        return 2.0 * (ins[0].numel if transposed else n_out) * per_out
    if name in ATTENTION_OPS and len(ins) >= 3:
        q, k, v = ins[0], ins[1], ins[2]
        batch = math.prod(q.shape[:-2])
        lq, lk = q.shape[-2], k.shape[-2]
        f = 2.0 * batch * lq * lk * (q.shape[-1] + v.shape[-1])     # QK^T and PV
        # A causal kernel skips the masked half of the score matrix (FlashAttention-2 counts it so).
        return f * 0.5 if op_arg(op, "is_causal", False) else f
    return None


def forward_flops(op: OpInfo) -> float:
    """The op's whole forward FLOPs: the rule's ``flops`` when registered, else the closed form
    for matmul-like ops, else the registry default (one per output element)."""
    rule = RULES.get(op.target)
    if rule is None or rule.flops is None:
        f = _matmul_flops(op, op_name(op.target))
        if f is not None:
            return f
    return op_flops(op)


@dataclass(frozen=True, slots=True)
class OpProfile:
    """Everything about an op's cost that no strategy changes."""

    family: str
    flops: float                                    # whole forward FLOPs
    low_precision: bool                             # runs at the 16-bit peak
    has_backward: bool
    inputs: tuple[tuple[tuple[int, ...], int], ...]  # (global shape, itemsize) per tensor input
    outputs: tuple[tuple[tuple[int, ...], int], ...]
    table: int = -1                                 # GATHER: position of the table in inputs


_PROFILE_KEY = "_autoshard_op_profile"


def op_profile(op: OpInfo) -> OpProfile:
    """The op's :class:`OpProfile`, computed once and kept on the op (OpInfo is immutable)."""
    return cached_on(op, _PROFILE_KEY, _make_profile)


def _make_profile(op: OpInfo) -> OpProfile:
    family = op_family(op.target)
    ins, outs = op.inputs, op.outputs
    if family == VIEW:
        return OpProfile(VIEW, 0.0, False, False, (), ())
    floats = [t.dtype for t in ins if t.dtype.is_floating_point]
    dtype = floats[0] if floats else (outs[0].dtype if outs else torch.float32)
    has_backward = bool(floats) and any(t.dtype.is_floating_point for t in outs) and (
        op_name(op.target) not in NO_GRAD_OPS)
    return OpProfile(
        family=family, flops=forward_flops(op),
        low_precision=dtype.is_floating_point and dtype.itemsize <= 2,
        has_backward=has_backward,
        inputs=tuple((t.shape, t.dtype.itemsize) for t in ins),
        outputs=tuple((t.shape, t.dtype.itemsize) for t in outs),
        table=0 if family == GATHER and ins else -1)


@lru_cache(maxsize=1 << 16)
def local_numel(shape: tuple[int, ...], spec: tuple | None, mesh_shape: tuple[int, ...]) -> int:
    """Elements of one device's shard (``autoshard.ir.local_shape``); cached, as the same few
    (shape, spec) pairs recur across a model's layers."""
    if spec is None:
        return math.prod(shape)
    return math.prod(local_shape(shape, spec, mesh_shape))


def _specs(specs: tuple, n: int) -> tuple:
    # A rule may list ``None`` for a non-tensor (or absent optional) argument; align to tensors.
    if len(specs) == n:
        return specs
    return tuple(s for s in specs if s is not None)


def op_bytes(op: OpInfo, strategy: Strategy, mesh_shape: tuple[int, ...]) -> tuple[int, int]:
    """(input bytes, output bytes) one device reads and writes for ``op`` under ``strategy``."""
    prof = op_profile(op)
    ins = _specs(strategy.inputs, len(prof.inputs))
    b_in = 0
    for i, (shape, isz) in enumerate(prof.inputs):
        if i != prof.table:
            b_in += local_numel(shape, ins[i] if i < len(ins) else None, mesh_shape) * isz
    b_out = 0
    for j, (shape, isz) in enumerate(prof.outputs):
        spec = strategy.outputs[j] if j < len(strategy.outputs) else None
        b_out += local_numel(shape, spec, mesh_shape) * isz
    if prof.table >= 0:      # a gather reads as many table bytes as it writes
        b_in += b_out
    return b_in, b_out


def op_time(op: OpInfo, strategy: Strategy, mesh: Mesh, *, training: bool) -> float:
    """Seconds one device spends on ``op`` under ``strategy``: forward, + backward if training."""
    prof = op_profile(op)
    if prof.family == VIEW:
        return 0.0
    c = mesh.cluster
    b_in, b_out = op_bytes(op, strategy, mesh.shape)
    nbytes = b_in + b_out
    flops = prof.flops * strategy.compute_scale
    # 16-bit ops run at the tensor-core peak, fp32 at the fp32 peak (REFERENCE.md §2 datasheets).
    peak = c.flops if prof.low_precision else c.fp32_flops
    heavy = prof.family in (MATMUL, ATTENTION)
    rate = peak * (c.matmul_efficiency if heavy else 1.0)
    fwd = max(flops / rate, nbytes / c.mem_bandwidth, c.kernel_floor_s)
    if not training or not prof.has_backward:
        return fwd
    if prof.family == MATMUL:
        return fwd * (1.0 + MATMUL_BACKWARD_FACTOR)   # two kernels priced like the forward
    if prof.family == ATTENTION:
        bwd = max(flops * ATTENTION_BACKWARD_FACTOR / rate,
                  ELEMENTWISE_BACKWARD_BYTES * nbytes / c.mem_bandwidth, c.kernel_floor_s)
        return fwd + bwd
    if prof.family == GATHER:
        # embedding_dense_backward: zero the table's gradient, then scatter-add the rows.
        shape, isz = prof.inputs[prof.table]
        spec = _specs(strategy.inputs, len(prof.inputs))
        table = local_numel(shape, spec[prof.table] if spec else None, mesh.shape) * isz
        bwd = max(flops / rate, (table + nbytes) / c.mem_bandwidth, c.kernel_floor_s)
        return fwd + bwd
    bwd = max(flops / rate, ELEMENTWISE_BACKWARD_BYTES * nbytes / c.mem_bandwidth,
              c.kernel_floor_s)
    return fwd + bwd
