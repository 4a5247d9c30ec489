"""Gradient buckets at run time: the plan's ``grad_sync`` buckets (cost/overlap.py), issued
asynchronously during backward and awaited at its end, as PyTorch DDP's Reducer does (Li et al.
2020, VLDB, §3.2).

A bucketed gradient is what a parameter gets through a reshard that moves nothing in forward
and all-reduces the gradient in backward (planner.gradient_buckets). That reshard's
:class:`DeferredGradSync` hands the gradient to :class:`GradBuckets` instead of returning it to
autograd (other reads of the parameter accumulate theirs as usual): it is copied into its
bucket's flat buffer, and once every member has arrived the buffer is all-reduced over the
bucket's first axis with ``async_op=True`` while autograd goes on with the earlier layers. At the
end of backward (an autograd engine callback) each bucket is waited for, all-reduced over any
further axes, and added to its parameters' ``.grad`` (so gradient accumulation over several
backward passes stays right).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from autoshard.codegen.collectives import ExecutedCollective, Ledger
from autoshard.codegen.groups import MeshGroups
from autoshard.errors import AutoshardError
from autoshard.plans import CollectiveRecord


@dataclass
class _Bucket:
    name: str                       # "bucket<k>", as the plan's records name it
    axes: tuple[int, ...]
    planned_nbytes: int
    members: tuple[str, ...]
    buffer: torch.Tensor | None = None
    offsets: dict[str, tuple[int, torch.Size]] | None = None
    arrived: int = 0
    work: object | None = None


class GradBuckets:
    """One rank's gradient buckets, from the plan's bucket records."""

    def __init__(self, records: list[CollectiveRecord], groups: MeshGroups, ledger: Ledger) -> None:
        self.groups, self.ledger = groups, ledger
        self.buckets: list[_Bucket] = []
        self.of: dict[str, _Bucket] = {}
        by_name: dict[str, _Bucket] = {}
        for r in records:
            axis = groups.axes.index(r.axes[0]) if len(r.axes) == 1 and r.axes[0] in groups.axes \
                else None
            if axis is None:
                raise AutoshardError("a gradient bucket over one axis of the mesh "
                                     f"{groups.axes}", got=f"{r.node} over {r.axes}",
                                     fix="re-plan: the plan file was edited or is damaged")
            b = by_name.get(r.node)
            if b is None:
                b = by_name[r.node] = _Bucket(r.node, (), r.bytes, r.members)
                self.buckets.append(b)
                for m in r.members:
                    if m in self.of:
                        raise AutoshardError("each parameter in one gradient bucket",
                                             got=f"{m} in {self.of[m].name} and {r.node}",
                                             fix="re-plan: the plan file is damaged")
                    self.of[m] = b
            b.axes += (axis,)
        self.params: dict[str, torch.nn.Parameter] = {}
        self._pending = False

    # -- during backward ------------------------------------------------------------------
    def arrive(self, member: str, grad: torch.Tensor) -> None:
        b = self.of[member]
        if b.buffer is None:
            self._start(b, grad.dtype, grad.device)
        off, shape = b.offsets[member]
        if tuple(grad.shape) != tuple(shape):
            raise RuntimeError(f"gradient of {member} has shape {tuple(grad.shape)}, the bucket "
                               f"expects {tuple(shape)}")
        b.buffer[off:off + grad.numel()].copy_(grad.reshape(-1))
        b.arrived += 1
        if b.arrived == len(b.members):
            b.work = dist.all_reduce(b.buffer, group=self.groups.groups[b.axes[0]], async_op=True)
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _start(self, b: _Bucket, dtype: torch.dtype, device: torch.device) -> None:
        b.offsets, off = {}, 0
        for m in b.members:
            shape = self.params[m].shape
            b.offsets[m] = (off, shape)
            off += math.prod(shape)
        b.buffer = torch.zeros(off, dtype=dtype, device=device)

    # -- at the end of backward -----------------------------------------------------------
    def finish(self) -> None:
        """Wait for every bucket issued in this backward, finish it, add it to ``.grad``."""
        self._pending = False
        for b in self.buckets:
            if b.buffer is None:
                continue              # no member's gradient flowed in this backward
            if b.work is None:        # a member's gradient never came: it is zero
                b.work = dist.all_reduce(b.buffer, group=self.groups.groups[b.axes[0]],
                                         async_op=True)
            b.work.wait()
            for a in b.axes[1:]:
                dist.all_reduce(b.buffer, group=self.groups.groups[a])
            for a in b.axes:
                self.ledger.add(ExecutedCollective(
                    kind="all_reduce", axes=(self.groups.axes[a],),
                    nbytes=b.buffer.numel() * b.buffer.element_size(),
                    planned_nbytes=b.planned_nbytes, phase="grad_sync", node=b.name,
                    group_size=self.groups.shape[a]))
            for m, (off, shape) in b.offsets.items():
                g = b.buffer[off:off + math.prod(shape)].view(shape)
                p = self.params[m]
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            b.buffer, b.offsets, b.arrived, b.work = None, None, 0, None


class DeferredGradSync(torch.autograd.Function):
    """Identity in forward; in backward, the gradient goes to its bucket, not to autograd."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, hand_over: Callable[[torch.Tensor], None]) -> torch.Tensor:
        ctx.hand_over = hand_over
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.hand_over(grad)
        return None, None
