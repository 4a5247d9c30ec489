"""Where a parameter's gradient and optimizer state live, apart from the parameter itself.

docs/cost-model.md §9. A parameter is stored in its placement (``params[...].placements``); in
the plain mode its gradient and optimizer state are laid out the same way (replicated: plain
data parallelism; sharded: ZeRO-3/FSDP). Three modes place them apart, over the *zero axes*: the
mesh axes of more than one device on which the parameter is replicated (Rajbhandari et al.,
"ZeRO", arXiv 1910.02054, §5; Ren et al., "ZeRO-Offload", arXiv 2101.06840):

- ``zero1``: the optimizer state (and, for a 16-bit parameter, its fp32 master copy) is sharded
  over the zero axes; gradients are all-reduced whole as in data parallelism; each rank updates
  its shard and the updated shards are all-gathered (torch's ZeroRedundancyOptimizer).
- ``zero2``: the gradient is reduce-scattered over the zero axes instead of all-reduced (half the
  bytes), so each rank keeps only its shard of it too; then as ``zero1``.
- ``offload``: as ``zero2``, with the optimizer state on the host and the optimizer step run
  there: the gradient shard goes down the host link, the updated parameter shard comes back.
- ``offload_params``: parameter offload (ZeRO-Infinity, Rajbhandari et al., arXiv 2104.07857;
  FSDP2's ``CPUOffloadPolicy``): as ``offload``, and the stored parameter itself lives in host
  memory too. Each read of it in forward (and again where its layer is recomputed) copies its
  stored shard to the device, where it is gathered as the plan says; the gradient that comes
  back in its stored layout (or its bucket's shard) goes down to the host at once. Any stored
  layout may take it, sharded or replicated. The device keeps no parameter state of its own,
  only the transient copies of each use (cost/liveness.py).

The shard is cut along one tensor dim that no other mesh axis splits (``state_spec``), so a
rank's optimizer state is a plain slice of its stored parameter and the state dicts stay
DTensor-shaped. A parameter with no zero axis, or no such dim, keeps its state with it (offload
still applies: nothing to shard, everything on the host).

zero1 and zero2 may also shard over one zero axis alone (``Strategy.state_axes``; the planner
offers each where a parameter has two), as hybrid sharding does (FSDP's
``HYBRID_SHARD``; ZeRO++'s hierarchical partitioning, hpZ: Wang et al., arXiv 2306.10209):
the state sharded within a node and replicated across nodes, so the gathers after the step
stay on the fast axis. The gradient of such a zero2 parameter is reduce-scattered over its
state axes first, then all-reduced over the others on the shard (``zero_grad_sync``), the
hierarchical order (docs/cost-model.md §9).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from autoshard.cost.comm import Reshard, Step
from autoshard.ir import CollectiveKind, Replicate, Shard, Spec, StateMode, local_shape

# The modes whose bucketed gradient is reduce-scattered over the zero axes (each rank keeps its
# shard), and those that keep the optimizer state and step on the host.
SCATTERS = (StateMode.ZERO2, StateMode.OFFLOAD, StateMode.OFFLOAD_PARAMS)
HOST_MODES = (StateMode.OFFLOAD, StateMode.OFFLOAD_PARAMS)
# Bytes one optimizer step reads and writes per updated element: a fused Adam kernel reads the
# gradient, the fp32 parameter (master), momentum and variance and writes the last three,
# 7 x 4 bytes (PyTorch's fused/foreach AdamW; ZeRO-Offload §4.1 counts the same streams for
# CPU-Adam). SGD reads the gradient and the parameter and writes the parameter.
ADAM_STEP_BYTES = 28
SGD_STEP_BYTES = 12
# A 16-bit parameter with an fp32 master (codegen/optim.py): its gradient cast up (read 2, write
# 4) and the updated master cast back into it (read 4, write 2), per element.
MASTER_CAST_BYTES = 12
# Parameter offload's host step (codegen/hostopt.py) adds two host copies to the update, each a
# read and a write: the gradient shard (on the host already) into its bucket's landing buffer,
# and the updated parameter into the host parameter (the whole local parameter where the shard
# was all-gathered). Optimizer offload moves the same two over the link by DMA, priced there.
PARAM_OFFLOAD_COPIES = 2


def zero_axes(spec: Spec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The mesh axes of more than one device on which ``spec`` is replicated."""
    return tuple(a for a, (p, n) in enumerate(zip(spec, mesh_shape))
                 if isinstance(p, Replicate) and n > 1)


def state_spec(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...],
               axes: tuple[int, ...] | None = None) -> Spec | None:
    """The layout of the optimizer state under zero1/zero2/offload: ``spec`` with each of
    ``axes`` (None: every zero axis) splitting the first dim that no other axis splits and that
    divides evenly (row-major over those axes, the first outermost). None if there is no such
    axis or dim."""
    if axes is None:
        axes = zero_axes(spec, mesh_shape)
    if not axes:
        return None
    split = {p.dim for p in spec if isinstance(p, Shard)}
    n = math.prod(mesh_shape[a] for a in axes)
    for d, size in enumerate(shape):
        if d not in split and size % n == 0 and size >= n:
            return tuple(Shard(d) if a in axes else p for a, p in enumerate(spec))
    return None


def state_choices(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...],
                  optimizer: str, allowed: tuple[str | None, ...], itemsize: int = 4
                  ) -> list[tuple[str | None, tuple[int, ...] | None]]:
    """The (mode, state axes) a parameter stored in ``spec`` may take, among the modes
    ``allowed``: the ZeRO modes only where there is optimizer state and a dim to shard it on,
    over every zero axis (axes None) and, where there are two and no offload is allowed, over
    each one alone;
    offload (of the optimizer, or of the parameters too) wherever there is state, over every
    zero axis, but for an fp64 parameter (``itemsize`` 8: the host's step keeps fp32 masters
    and moments, codegen/hostopt.py)."""
    if optimizer in ("none", "sgd"):
        return [(None, None)]
    zero = zero_axes(spec, mesh_shape)
    # Each axis alone where there are two: on three or more (a 3-axis mesh's problem over
    # every subset of axes) the subsets made the ILP too hard to solve in time (llama-tiny
    # on 2x2x2: no incumbent in 15 s, docs/cost-model.md §9); the tries with axes merged into
    # two offer them there (solver/merging.py). Not where offload is offered: the memory
    # binds (the planner's ladder got there), an axis alone holds more state than both, and
    # the larger problems made Mixtral-8x7B's plan on 2x4 take 80 s instead of 61 (the same
    # plan; benchmarks/holdout.py --models mixtral-8x7b --meshes 2x4 at 6ca6bed and 089a604).
    alone = len(zero) == 2 and not any(m in HOST_MODES for m in allowed)
    subsets = [None, *((a,) for a in zero)] if alone else [None]
    out: list[tuple[str | None, tuple[int, ...] | None]] = []
    for m in allowed:
        if m is None or (m in HOST_MODES and itemsize <= 4):
            out.append((m, None))
        elif m not in HOST_MODES:
            out += [(m, axes) for axes in subsets
                    if state_spec(shape, spec, mesh_shape, axes) is not None]
    return out or [(None, None)]  # a forced ZeRO mode leaves an unshardable parameter plain


@dataclass(frozen=True, slots=True)
class StateBytes:
    """Bytes one device's process holds for one parameter, by kind."""

    parameters: float = 0.0
    gradients: float = 0.0
    optimizer: float = 0.0
    host: float = 0.0
    buffers: float = 0.0

    @property
    def device(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.buffers

    def __add__(self, o: "StateBytes") -> "StateBytes":
        return StateBytes(self.parameters + o.parameters, self.gradients + o.gradients,
                          self.optimizer + o.optimizer, self.host + o.host,
                          self.buffers + o.buffers)


def master_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a parameter's master and moments: fp32 for a 16-bit parameter, else its
    own (an fp64 model steps in fp64)."""
    return dtype if dtype.itemsize >= 4 else torch.float32


def optimizer_bytes_per_element(itemsize: int, optimizer: str, mode: StateMode | None) -> int:
    """Optimizer state per element (docs/cost-model.md §4.1): Adam keeps momentum and variance in
    its master's dtype: an fp32 master copy of a 16-bit parameter (K = 12); an fp32 or fp64
    parameter is its own master (2i) unless its state is sharded or offloaded apart from it
    (then a copy of the shard in its dtype is the master: 3i)."""
    if optimizer in ("none", "sgd"):
        return 0
    m = max(itemsize, 4)
    return 3 * m if itemsize < 4 or mode is not None else 2 * m


def scatter_axes(shape: tuple[int, ...], spec: Spec, mode: StateMode | None,
                 axes: tuple[int, ...] | None, mesh_shape: tuple[int, ...]
                 ) -> tuple[int, ...] | None:
    """The mesh axes a parameter's bucketed gradient is reduce-scattered over: under
    zero2/offload where its state shards, its state ``axes`` (None: every zero axis); None
    where the gradient is all-reduced whole (``zero_grad_sync`` takes the axes)."""
    if mode not in SCATTERS or state_spec(shape, spec, mesh_shape, axes) is None:
        return None
    return axes if axes is not None else zero_axes(spec, mesh_shape)


def state_bytes(shape: tuple[int, ...], dtype: torch.dtype, spec: Spec, mode: StateMode | None,
                mesh_shape: tuple[int, ...], optimizer: str,
                axes: tuple[int, ...] | None = None) -> StateBytes:
    """What one device holds for a parameter of global ``shape`` stored in ``spec`` under
    ``mode`` over state ``axes``, with ``optimizer`` ("none": the parameter only)."""
    isz = dtype.itemsize
    n = math.prod(local_shape(shape, spec, mesh_shape))
    if optimizer == "none":
        return StateBytes(parameters=n * isz)
    sspec = state_spec(shape, spec, mesh_shape, axes) if mode is not None else None
    ns = math.prod(local_shape(shape, sspec, mesh_shape)) if sspec is not None else n
    k = optimizer_bytes_per_element(isz, optimizer, mode)
    if mode is None:
        return StateBytes(n * isz, n * isz, n * k)
    if mode == StateMode.ZERO1:
        return StateBytes(n * isz, n * isz, ns * k)
    if mode == StateMode.ZERO2:
        return StateBytes(n * isz, ns * isz, ns * k)
    if mode == StateMode.OFFLOAD:
        # The gradient shard waits on the device for the step, which copies it to an fp32 host
        # buffer beside the host's optimizer state, through a pinned buffer of its own dtype;
        # the updated shard goes back up through another (codegen/hostlink.py, kept from step
        # to step).
        return StateBytes(n * isz, ns * isz, 0.0, host=ns * (k + 4) + 2 * ns * isz)
    # offload_params: nothing on the device; the host holds the stored parameter, its gradient
    # shard (landed there from the device, in a pinned buffer), the master and moments, and the
    # two buffers of the bucketed host step (codegen/hostopt.py): the landing buffer the
    # gradient is copied into and the one the updated shard is cast into.
    return StateBytes(host=n * isz + 3 * ns * isz + ns * k)


def host_copies(shape: tuple[int, ...], dtype: torch.dtype, spec: Spec, mode: StateMode | None,
                mesh_shape: tuple[int, ...]) -> list[tuple[str, int]]:
    """The host-link copies of one parameter's optimizer step, as (direction, bytes): "d2h"
    (device to host) or "h2d" (docs/cost-model.md §9). Offload: its gradient shard down, the
    updated shard up. Parameter offload of a parameter whose state is cut apart from it (a
    replicated one): the updated shard up, its all-gathered parameter down to the host copy;
    of any other, none (the step writes the host copy where it lies). None for other modes."""
    if mode not in HOST_MODES:
        return []
    isz = dtype.itemsize
    ns = step_elements(shape, spec, mode, mesh_shape) * isz
    if mode == StateMode.OFFLOAD:
        return [("d2h", ns), ("h2d", ns)]
    if state_spec(shape, spec, mesh_shape) is None:
        return []
    return [("h2d", ns), ("d2h", math.prod(local_shape(shape, spec, mesh_shape)) * isz)]


def step_elements(shape: tuple[int, ...], spec: Spec, mode: StateMode | None,
                  mesh_shape: tuple[int, ...], axes: tuple[int, ...] | None = None) -> int:
    """Elements one rank's optimizer step updates: its shard of the optimizer state."""
    sspec = state_spec(shape, spec, mesh_shape, axes) if mode is not None else None
    return math.prod(local_shape(shape, sspec if sspec is not None else spec, mesh_shape))


def zero_grad_sync(r: Reshard, axes: tuple[int, ...], mesh_shape: tuple[int, ...]) -> Reshard:
    """A pure gradient sync under zero2/offload over state ``axes``: the all-reduces on those
    axes become reduce-scatters, run first, in axis order (each of the bytes the previous ones
    left); the other axes' all-reduces follow, of the shard (the hierarchical order: the slow
    axis moves the least). These buckets run one collective per axis: an all-reduce over
    several axes at once (docs/cost-model.md §1.4) is first taken apart into one per axis, of
    the same bytes."""
    steps = sorted(per_axis(r.backward), key=lambda s: s.axis)
    scatter = [s.kind == CollectiveKind.ALL_REDUCE and s.axis in axes for s in steps]
    out: list[Step] = []
    div = 1
    for s in (s for s, sc in zip(steps, scatter) if sc):
        out.append(Step(CollectiveKind.REDUCE_SCATTER, s.axis, nbytes=s.nbytes // div))
        div *= mesh_shape[s.axis]
    out += [dataclasses.replace(s, nbytes=s.nbytes // div)
            for s, sc in zip(steps, scatter) if not sc]
    return Reshard(r.forward, tuple(out))


def per_axis(steps: tuple[Step, ...]) -> tuple[Step, ...]:
    """Gradient all-reduces with every joint one (over several axes at once) replaced by one
    all-reduce per axis of the same bytes: the sum is the same."""
    out: list[Step] = []
    for s in steps:
        if s.joint and s.kind == CollectiveKind.ALL_REDUCE:
            out += [Step(CollectiveKind.ALL_REDUCE, a, nbytes=s.nbytes) for a in s.joint]
        else:
            out.append(s)
    return tuple(out)
