"""Per-op compute time: a roofline on one device.

``time = max(flops / (peak * efficiency) + specials / transcendental_rate, bytes / mem_bandwidth,
kernel_floor_s)`` where FLOPs are the op's forward FLOPs and ``specials`` its special-function
evaluations (exp, tanh, erf, ...), both times the strategy's ``compute_scale``, and bytes are the
local sizes of the op's inputs and outputs under the strategy's specs. Large matmuls run at
``matmul_efficiency`` of peak, small ops are bandwidth-, special-function- or launch-bound
(docs/cost-model.md §3).

``op_time`` is called for every (node, strategy) pair of a model (tens of thousands for a 70B
model), so everything that depends on the op alone is computed once and kept on the (immutable)
:class:`OpInfo`; the per-strategy work is a few integer products, with no torch calls.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from autoshard.ir import OpInfo, Strategy, cached_on, local_shape
from autoshard.mesh import Mesh
from autoshard.ops.registry import (ATTENTION, ELEMENTWISE, FACTORY, GATHER, MATMUL, VIEW,
                                    OpRecord, record_of)

aten = torch.ops.aten

# Backward FLOPs as a multiple of forward FLOPs (docs/cost-model.md §3). A matmul needs grad wrt
# input and grad wrt weight, each as many FLOPs as the forward (hence training ≈ 3× forward, the
# 6·Ψ·tokens rule). Flash attention's backward does 5 matmuls to the forward's 2 (Dao 2023,
# FlashAttention-2, arXiv 2307.08691: backward FLOPs are 2.5× forward).
MATMUL_BACKWARD_FACTOR = 2.0
ATTENTION_BACKWARD_FACTOR = 2.5
# An elementwise op's backward reads the saved input(s) and the output gradient and writes the
# input gradient(s): 1.5x the forward's traffic for a unary op, more where autograd materialises
# intermediates; 2x is the round, conservative figure.
ELEMENTWISE_BACKWARD_BYTES = 2.0

# Passes over the logits a cross-entropy's kernels make, in units of the logits' local bytes,
# (forward, backward), by the strategy's kernel (docs/cost-model.md §3.9). PyTorch's composite
# (log_softmax + nll_loss) keeps its statistics in registers: reads for the row max, for the
# sum of exps, and to write the log-probabilities (4); backward writes nll's zero-filled
# gradient, then log_softmax_backward reads it and the saved output, sums it, and writes the
# input's gradient (5). The vocabulary-parallel kernel (ops/loss.py) runs one log_softmax in
# fp32: three reads and an fp32 write, and on 16-bit logits the cast it saves (8; 4 on fp32
# logits); backward the exp of the saved log-probabilities and one row scale in place (4).
CROSS_ENTROPY_PASSES = (4.0, 5.0)
VOCAB_PARALLEL_PASSES = {True: (8.0, 4.0), False: (4.0, 4.0)}   # by 16-bit logits


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
    specials: float = 0.0                           # whole forward special-function evaluations
    specials_backward: float = 0.0                  # ... and its backward's
    bias: int = -1                                  # MATMUL: position of a broadcast bias input
    cross_entropy: bool = False                     # priced by passes over its logits (§3.9)


_PROFILE_KEY = "_autoshard_op_profile"


def op_profile(op: OpInfo) -> OpProfile:
    """The op's :class:`OpProfile`, computed once and kept on the op (OpInfo is immutable)."""
    return cached_on(op, _PROFILE_KEY, _make_profile)


def _make_profile(op: OpInfo) -> OpProfile:
    record = record_of(op.target)
    family = record.family
    ins, outs = op.inputs, op.outputs
    if family == VIEW:
        return OpProfile(VIEW, 0.0, False, False, (), ())
    floats = [t.dtype for t in ins if t.dtype.is_floating_point or t.dtype.is_complex]
    dtype = floats[0] if floats else (outs[0].dtype if outs else torch.float32)
    has_backward = family != FACTORY and bool(floats) and any(
        t.dtype.is_floating_point or t.dtype.is_complex for t in outs)
    fwd_sp, bwd_sp = _specials(op, record)
    bias = record.bias if family == MATMUL else -1
    if not (0 <= bias < len(ins) and outs and ins[bias].numel < outs[0].numel):
        bias = -1
    return OpProfile(
        family=family, flops=float(record.flops(op)),
        low_precision=dtype.is_floating_point and dtype.itemsize <= 2,
        has_backward=has_backward,
        inputs=tuple((t.shape, t.dtype.itemsize) for t in ins),
        outputs=tuple((t.shape, t.dtype.itemsize) for t in outs),
        table=0 if family == GATHER and ins else -1,
        specials=fwd_sp, specials_backward=bwd_sp, bias=bias,
        cross_entropy=record.logits and bool(ins))


def _specials(op: OpInfo, record: OpRecord) -> tuple[float, float]:
    """Whole (forward, backward) special-function evaluations of ``op`` (docs/cost-model.md
    §3.7): per element of its largest tensor for elementwise ops (the record's ``specials``),
    and one exp per attention score each way (FlashAttention's softmax, recomputed in
    backward)."""
    ins, outs, family = op.inputs, op.outputs, record.family
    if family == ATTENTION:
        if len(ins) < 2 or len(ins[0].shape) < 2 or len(ins[1].shape) < 2:
            return 0.0, 0.0
        scores = float(math.prod(ins[0].shape[:-1]) * ins[1].shape[-2])
        if op.kwargs.get("is_causal", len(op.args) > 5 and op.args[5]):
            scores /= 2     # a flash kernel skips the masked half, as its FLOPs (§3.4)
        return scores, scores
    if family in (MATMUL, GATHER, FACTORY, VIEW):
        return 0.0, 0.0
    per = record.specials_of(op)
    if per == (0, 0):
        return 0.0, 0.0
    n = float(max((t.numel for t in (*ins, *outs)), default=0))
    return per[0] * n, per[1] * n


@dataclass(frozen=True, slots=True)
class Fused:
    """An op's place in a chain of elementwise ops (pointwise, norms, reductions) that inductor
    fuses into one kernel when the rank program is compiled (docs/cost-model.md §3.10):
    ``inside``, the positions of its tensor inputs made by another op of the chain (read from
    registers, not memory); ``kept``, its output is read only inside the chain (never written);
    the op whose output leaves the chain pays the fused kernel's launch floor."""

    inside: frozenset[int]
    kept: bool


def fusions(graph: "torch.fx.Graph") -> dict[str, Fused]:
    """The :class:`Fused` place of every elementwise op of ``graph`` that has a neighbour in a
    chain. A view between two elementwise ops is an index expression of the fused kernel, not a
    break; any other op (matmul, attention, gather, a factory, the graph's output) is."""
    import torch.fx as fx

    def family(n: fx.Node) -> str | None:
        return record_of(n.target).family if n.op == "call_function" else None

    def producer(n: fx.Node) -> fx.Node:         # through views
        while family(n) == VIEW and n.all_input_nodes:
            n = n.all_input_nodes[0]
        return n

    def readers(n: fx.Node) -> list[fx.Node]:    # through views
        out = []
        for u in n.users:
            out.extend(readers(u) if family(u) == VIEW else [u])
        return out

    def fusable(n: fx.Node) -> bool:
        return family(n) == ELEMENTWISE and n.target != aten.cross_entropy_loss.default

    out: dict[str, Fused] = {}
    for n in graph.nodes:
        if not fusable(n):
            continue
        inside = frozenset(i for i, a in enumerate(_tensor_args(n)) if fusable(producer(a)))
        users = readers(n)
        kept = bool(users) and all(fusable(u) for u in users)
        if inside or kept:
            out[n.name] = Fused(inside, kept)
    return out


def _tensor_args(n: "torch.fx.Node") -> list:
    """The node's tensor arguments in the order OpInfo lists its inputs (ir.op_info)."""
    import torch.fx as fx
    flat: list = []
    fx.node.map_aggregate((n.args, n.kwargs), lambda a: flat.append(a) if isinstance(
        a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor) else None)
    return flat


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


def op_bytes(op: OpInfo, strategy: Strategy, mesh_shape: tuple[int, ...],
             fused: Fused | None = None) -> tuple[int, int]:
    """(input bytes, output bytes) one device reads and writes for ``op`` under ``strategy``;
    in a fused chain (``fused``), what the chain's kernel moves for it."""
    prof = op_profile(op)
    ins = _specs(strategy.inputs, len(prof.inputs))
    b_in = 0
    for i, (shape, isz) in enumerate(prof.inputs):
        if i != prof.table and not (fused and i in fused.inside):
            b_in += local_numel(shape, ins[i] if i < len(ins) else None, mesh_shape) * isz
    if fused is not None and fused.kept:
        return b_in, 0
    b_out = 0
    for j, (shape, isz) in enumerate(prof.outputs):
        spec = strategy.outputs[j] if j < len(strategy.outputs) else None
        b_out += local_numel(shape, spec, mesh_shape) * isz
    if prof.table >= 0:      # a gather reads as many table bytes as it writes
        b_in += b_out
    return b_in, b_out


def op_time(op: OpInfo, strategy: Strategy, mesh: Mesh, *, training: bool) -> float:
    """Seconds one device spends on ``op`` under ``strategy``: forward, + backward if training."""
    fwd, bwd = op_times(op, strategy, mesh, training=training)
    return fwd + bwd


def op_times(op: OpInfo, strategy: Strategy, mesh: Mesh, *, training: bool,
             compiled: bool = False, fused: Fused | None = None) -> tuple[float, float]:
    """(forward, backward) seconds one device spends on ``op`` under ``strategy``; backward is
    0 for inference and for ops without a gradient.

    Eager (``compiled`` False), each kernel takes at least the host's dispatch of one op
    (``Cluster.host_dispatch_s``: the host runs ahead of the device only where the device is
    the slower). Compiled (docs/cost-model.md §3.10), no op pays the host, and an op in a fused
    chain (``fused``, from :func:`fusions`) moves only the bytes the chain's kernel moves for
    it, the chain paying one kernel floor."""
    prof = op_profile(op)
    if prof.family == VIEW:
        return 0.0, 0.0
    c = mesh.cluster
    if not compiled:
        fused = None
    floor = max(c.kernel_floor_s, c.host_dispatch_s) if not compiled else \
        0.0 if fused is not None and fused.kept else c.kernel_floor_s
    b_in, b_out = op_bytes(op, strategy, mesh.shape, fused)
    nbytes = b_in + b_out
    scale = strategy.compute_scale
    flops = prof.flops * scale
    # 16-bit ops run at the tensor-core peak, fp32 at the fp32 peak (docs/cost-model.md §3.3).
    peak = c.flops if prof.low_precision else c.fp32_flops
    heavy = prof.family in (MATMUL, ATTENTION)
    rate = peak * (c.matmul_efficiency if heavy else 1.0)
    # Special functions run on the same units as the op's arithmetic, one after the other
    # (docs/cost-model.md §3.7): the two compute terms add.
    special = prof.specials * scale / c.transcendental_rate
    passes = None
    if prof.cross_entropy:
        shape, isz = prof.inputs[0]
        spec = _specs(strategy.inputs, len(prof.inputs))
        logits = local_numel(shape, spec[0] if spec else None, mesh.shape) * isz
        passes = (VOCAB_PARALLEL_PASSES[isz <= 2] if strategy.kernel == "vocab_parallel"
                  else CROSS_ENTROPY_PASSES)
        nbytes = max(nbytes, passes[0] * logits)
    fwd = max(flops / rate + special, nbytes / c.mem_bandwidth, floor)
    if not training or not prof.has_backward:
        return fwd, 0.0
    if prof.family == MATMUL:
        bwd = fwd * MATMUL_BACKWARD_FACTOR          # two kernels priced like the forward
        if prof.bias >= 0:                          # + the bias gradient: a sum over the rows
            bwd += max(b_out / c.mem_bandwidth, floor)
        return fwd, bwd
    special_bwd = prof.specials_backward * scale / c.transcendental_rate
    if prof.family == ATTENTION:
        return fwd, max(flops * ATTENTION_BACKWARD_FACTOR / rate + special_bwd,
                        ELEMENTWISE_BACKWARD_BYTES * nbytes / c.mem_bandwidth, floor)
    if prof.family == GATHER:
        # embedding_dense_backward: zero the table's gradient, then scatter-add the rows.
        shape, isz = prof.inputs[prof.table]
        spec = _specs(strategy.inputs, len(prof.inputs))
        table = local_numel(shape, spec[prof.table] if spec else None, mesh.shape) * isz
        return fwd, max(flops / rate, (table + nbytes) / c.mem_bandwidth, floor)
    moved = passes[1] * logits if passes else ELEMENTWISE_BACKWARD_BYTES * nbytes
    return fwd, max(flops / rate + special_bwd, moved / c.mem_bandwidth, floor)
