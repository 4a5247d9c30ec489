"""Runtime collectives: execute a :class:`~autoshard.cost.comm.Reshard` on torch.distributed.

``Reshard.forward`` / ``Reshard.backward`` (autoshard.cost.comm) are the one definition of what
moves; this module only carries them out, on local tensors (gloo for CPU tensors, NCCL on GPUs).
Run eagerly, each collective is torch.distributed's own, synchronous, into a fresh output: the
functional collectives' Python wrapper (``AsyncCollectiveTensor``, its autograd registration)
costs the host several times as much per call, which a tensor-parallel rank program pays
several times per layer and step (benchmarks/RESULTS.md "Runtime overhead", host time per
collective). Traced into a compiled region (codegen/compile.py), they are
``torch.distributed._functional_collectives`` calls, waited on at once, which the traced graph
holds as ``_c10d_functional`` nodes. Both move the same bytes.

Every collective executed is written to a :class:`Ledger` with its size ``S`` (docs/cost-model.md §1)
*measured on the tensor actually moved*, next to the ``Step.nbytes`` the cost model priced, so a
caller can report any disagreement between plan and execution.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from autoshard.codegen.groups import MeshGroups
from autoshard.cost.comm import Reshard, Step
from autoshard.ir import CollectiveKind, Phase, to_group_major, to_rank_major
from autoshard.plans.records import PHASES

# torch 2.13 renamed all_gather_tensor / reduce_scatter_tensor to *_single, and
# all_gather_into_tensor / reduce_scatter_tensor likewise (the old names warn, at every call).
_all_gather_single = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
_reduce_scatter_single = getattr(fc, "reduce_scatter_single", None) or fc.reduce_scatter_tensor
_dist_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_dist_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _wait(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, fc.AsyncCollectiveTensor):
        return t.wait()
    return t


_are_we_tracing = getattr(fc, "_are_we_tracing", lambda: True)   # (absent: always functional)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


def _functional(x: torch.Tensor) -> bool:
    """Whether a collective on ``x`` must be a functional one: traced into a compiled region
    (AOTAutograd's fake tensors and proxies, Dynamo: the functional collectives' own test), seen
    by a dispatch mode (selective checkpointing stores the functional collectives' outputs for
    its recompute: codegen/recompute.py), or differentiated through (their autograd formulas;
    the program's reshards run theirs inside :class:`Redistribute`, without a graph)."""
    return (torch._C._len_torch_dispatch_stack() > 0 or _are_we_tracing()
            or (x.requires_grad and torch.is_grad_enabled()))


def _group_size(group: dist.ProcessGroup) -> int:
    # (dist.get_world_size checks the group first, at each call; None: the default group)
    return group.size() if group is not None else dist.get_world_size()


# ---------------------------------------------------------------------------------------------
# Plain per-step functions on local tensors. ``dim`` is a tensor dim, ``group`` one mesh axis's
# process group; shards are ordered by group rank (= mesh coordinate, see MeshGroups).
# ---------------------------------------------------------------------------------------------

def all_gather(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in group rank order."""
    dim %= x.dim()
    if _functional(x):
        return _wait(_all_gather_single(x.contiguous(), dim, group)).contiguous()
    n = _group_size(group)
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))      # every rank's x, joined on dim 0
    _dist_all_gather(out, x.contiguous(), group=group)
    return out if dim == 0 else torch.cat(out.chunk(n), dim=dim)


def all_reduce(x: torch.Tensor, group: dist.ProcessGroup, op: str = "sum") -> torch.Tensor:
    """Reduce ``x`` over the group with ``op`` ("sum", or "max" for an op's own reductions),
    out of place."""
    if _functional(x):
        return _wait(fc.all_reduce(x.contiguous(), op, group))
    y = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(y, op=_REDUCE_OPS[op], group=group)
    return y


def reduce_scatter(x: torch.Tensor, dim: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's chunk of ``dim``."""
    n = _group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"reduce_scatter needs dim {dim} of {tuple(x.shape)} divisible by {n}")
    dim %= x.dim()
    if _functional(x):
        return _wait(_reduce_scatter_single(x.contiguous(), "sum", dim, group)).contiguous()
    # Rank j's chunk of ``dim`` leads: a plain reduce-scatter of dim 0 for any ``dim``.
    send = x.contiguous() if dim == 0 else torch.cat(x.chunk(n, dim=dim))
    out = x.new_empty((send.shape[0] // n, *send.shape[1:]))
    _dist_reduce_scatter(out, send, group=group)
    return out


def all_to_all(x: torch.Tensor, gather_dim: int, scatter_dim: int,
               group: dist.ProcessGroup) -> torch.Tensor:
    """Split ``scatter_dim`` into group-size chunks, send chunk j to rank j, and concatenate
    what arrives along ``gather_dim`` in group rank order."""
    n = _group_size(group)
    if x.shape[scatter_dim] % n:
        raise ValueError(f"all_to_all needs dim {scatter_dim} of {tuple(x.shape)} divisible by {n}")
    # A leading chunk axis makes the exchange a plain dim-0 all_to_all_single for any dims.
    send = torch.stack(x.chunk(n, dim=scatter_dim)).contiguous()
    if _functional(x):
        recv = _wait(fc.all_to_all_single(send, None, None, group))
    else:
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


def local_slice(x: torch.Tensor, dim: int, *, coord: int, size: int) -> torch.Tensor:
    """This rank's chunk ``coord`` of ``size`` along ``dim`` (no communication)."""
    if x.shape[dim] % size:
        raise ValueError(f"slice needs dim {dim} of {tuple(x.shape)} divisible by {size}")
    return x.chunk(size, dim=dim)[coord].contiguous()


def to_partial(x: torch.Tensor, *, coord: int) -> torch.Tensor:
    """Replicate -> Partial: the value on coordinate 0 of the axis, zeros elsewhere."""
    return x if coord == 0 else torch.zeros_like(x)


# ---------------------------------------------------------------------------------------------
# The ledger.
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class ExecutedCollective:
    """One collective as executed. ``nbytes`` is S measured at run time; ``planned_nbytes`` the
    ``Step.nbytes`` the cost model charged for it."""

    kind: str
    axes: tuple[str, ...]
    nbytes: int
    planned_nbytes: int
    phase: Phase
    node: str
    group_size: int

    @property
    def matches(self) -> bool:
        return self.nbytes == self.planned_nbytes

    @property
    def bytes(self) -> int:
        """The measured S under the field name autoshard.plans.records.CollectiveRecord uses."""
        return self.nbytes

    def __str__(self) -> str:
        flag = "" if self.matches else f" (planned {self.planned_nbytes} B)"
        at = f" @{self.node}" if self.node else ""
        return f"{self.phase} {self.kind}[{','.join(self.axes)}] {self.nbytes} B{flag}{at}"


@dataclass(frozen=True, slots=True)
class ExecutedTransfer:
    """One copy over the host link as executed (optimizer and parameter offload): ``direction``
    "d2h" or "h2d", the bytes copied, and where, as autoshard.plans.records.HostTransfer lists it. On a
    CPU run the host is the device and the copy moves nothing, but is counted all the same."""

    direction: str
    nbytes: int
    phase: Phase
    node: str
    value: str

    def __str__(self) -> str:
        return f"{self.phase} {self.direction} {self.nbytes} B @{self.node} ({self.value})"


@dataclass(slots=True)
class Ledger:
    """Every collective a rank executed, in order; and every host-link copy (``host``)."""

    records: list[ExecutedCollective] = field(default_factory=list)
    host: list[ExecutedTransfer] = field(default_factory=list)

    def add(self, record: ExecutedCollective) -> None:
        self.records.append(record)

    def add_host(self, direction: str, t: torch.Tensor, phase: Phase, node: str,
                 value: str) -> None:
        """Count a copy of ``t`` over the host link (its bytes as they travel)."""
        self.host.append(ExecutedTransfer(direction, t.numel() * t.element_size(), phase, node,
                                          value))

    def mismatches(self) -> list[ExecutedCollective]:
        """Records whose measured bytes differ from the planned ``Step.nbytes``."""
        return [r for r in self.records if not r.matches]

    def total_bytes(self, phase: Phase | None = None) -> int:
        return sum(r.nbytes for r in self.records if phase is None or r.phase == phase)

    def clear(self) -> None:
        self.records.clear()
        self.host.clear()

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[ExecutedCollective]:
        return iter(self.records)

    def __str__(self) -> str:
        return "\n".join(str(r) for r in self.records)


# ---------------------------------------------------------------------------------------------
# Steps and the autograd.Function.
# ---------------------------------------------------------------------------------------------

def apply_step(x: torch.Tensor, step: Step, groups: MeshGroups, *, ledger: Ledger | None = None,
               phase: Phase = Phase.FORWARD, node: str = "") -> torch.Tensor:
    """Run one ``Step`` on the local tensor ``x`` (no autograd bookkeeping). A step over several
    axes at once runs on their joint group, whose ranks are in row-major order of their
    coordinates over the axes (codegen/groups.py): one collective, as the plan lists it."""
    axes = step.axes
    n = groups.joint_size(axes)
    # A strided dim (ir.py) is held group by group; the collective cuts and joins in rank order.
    if step.kind == "slice":
        return local_slice(to_rank_major(x, step.dim, n, step.groups), step.dim,
                           coord=groups.joint_coord(axes), size=n)
    if step.kind == "to_partial":
        return to_partial(x, coord=groups.joint_coord(axes))
    group = groups.group_of(axes)
    if step.kind == CollectiveKind.ALL_GATHER:
        y = to_group_major(all_gather(x, step.dim, group), step.dim, n, step.groups)
        moved = y                                   # S is the all-gather's output
    elif step.kind == CollectiveKind.ALL_REDUCE:
        y = moved = all_reduce(x, group)
    elif step.kind == CollectiveKind.REDUCE_SCATTER:
        moved = to_rank_major(x, step.dim, n, step.groups)
        y = reduce_scatter(moved, step.dim, group)  # S is the input
    elif step.kind == CollectiveKind.ALL_TO_ALL:
        moved = to_rank_major(x, step.dim2, n, step.groups2)
        y = to_group_major(all_to_all(moved, step.dim, step.dim2, group), step.dim, n,
                           step.groups)             # S: each device's input
    else:
        raise ValueError(f"cannot execute step kind {step.kind!r}; known: all_gather, all_reduce, "
                         "reduce_scatter, all_to_all, slice, to_partial")
    if ledger is not None:
        ledger.add(ExecutedCollective(kind=step.kind, axes=tuple(groups.axes[a] for a in axes),
                                    nbytes=moved.numel() * moved.element_size(),
                                    planned_nbytes=step.nbytes, phase=phase, node=node,
                                    group_size=_group_size(group)))
    return y


def reduce_over_axis(x: torch.Tensor, op: str, axis: int, groups: MeshGroups, *,
                     ledger: Ledger | None, planned_nbytes: int, phase: Phase = Phase.FORWARD,
                     node: str = "") -> torch.Tensor:
    """One all-reduce an op runs inside itself (ops/registry.py ``CollectiveKernel``), over mesh
    axis ``axis``, written to the ledger as the plan lists it. In "replay" (a selectively
    checkpointed layer run again) the collective returns its stored output and is not counted,
    as a reshard's is not."""
    y = all_reduce(x, groups.groups[axis], op)
    if ledger is not None and phase != Phase.REPLAY:
        ledger.add(ExecutedCollective(kind=CollectiveKind.ALL_REDUCE, axes=(groups.axes[axis],),
                                      nbytes=y.numel() * y.element_size(),
                                      planned_nbytes=planned_nbytes, phase=phase, node=node,
                                      group_size=groups.shape[axis]))
    return y


def apply_steps(x: torch.Tensor, steps: Sequence[Step], groups: MeshGroups, *,
                ledger: Ledger | None = None, phase: Phase = Phase.FORWARD,
                node: str = "") -> torch.Tensor:
    assert phase in PHASES, phase
    for step in steps:
        x = apply_step(x, step, groups, ledger=ledger, phase=phase, node=node)
    return x


class Redistribute(torch.autograd.Function):
    """``Reshard.forward`` in forward, ``Reshard.backward`` on the gradient in backward.

    The backward steps already hold the gradient sync of divergent axes (DTensor's gradient
    convention), so this one Function serves every backend and every placement pair.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, reshard: Reshard, groups: MeshGroups,
                ledger: Ledger | None, node: str, grad_phase: Phase,
                phase: Phase = Phase.FORWARD) -> torch.Tensor:
        ctx.reshard, ctx.groups, ctx.ledger, ctx.node = reshard, groups, ledger, node
        ctx.grad_phase, ctx.in_shape = grad_phase, x.shape
        if phase == Phase.REPLAY:     # selective recompute: the collectives return stored outputs
            return apply_steps(x, reshard.forward, groups, phase=Phase.RECOMPUTE, node=node)
        return apply_steps(x, reshard.forward, groups, ledger=ledger, phase=phase, node=node)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        g = apply_steps(grad, ctx.reshard.backward, ctx.groups, ledger=ctx.ledger,
                        phase=ctx.grad_phase, node=ctx.node)
        # A gradient of another shape means the plan lacks a backward step; autograd would sum
        # it down to the input's shape without a word and train on wrong gradients.
        assert g.shape == ctx.in_shape, (
            f"reshard at {ctx.node}: gradient {tuple(g.shape)} for an input of "
            f"{tuple(ctx.in_shape)}; backward steps {ctx.reshard.backward}")
        return g, None, None, None, None, None, None


def redistribute(x: torch.Tensor, reshard: Reshard, groups: MeshGroups, *,
                 ledger: Ledger | None = None, node: str = "",
                 grad_phase: Phase = Phase.BACKWARD, phase: Phase = Phase.FORWARD
                 ) -> torch.Tensor:
    """Move the local shard ``x`` as ``reshard`` says, differentiably. ``grad_phase`` labels the
    backward collectives in the ledger ("grad_sync" for a parameter's); ``phase`` the forward
    ones ("recompute" when a checkpointed layer runs its forward again; "replay" when a
    selectively checkpointed one does, and the collectives, whose outputs were stored, are not
    counted)."""
    if not reshard.forward and not reshard.backward:
        return x
    return Redistribute.apply(x, reshard, groups, ledger, node, grad_phase, phase)
