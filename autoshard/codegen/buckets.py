"""Gradient buckets at run time: the plan's ``grad_sync`` buckets (cost/overlap.py), issued
asynchronously during backward and awaited at its end, as PyTorch DDP's Reducer does (Li et al.
2020, VLDB, §3.2).

A bucketed gradient is what a parameter gets through a reshard that moves nothing in forward
and all-reduces the gradient in backward (cost/overlap.py gradient_buckets). That reshard's
:class:`DeferredGradSync` hands the gradient to :class:`GradBuckets` instead of returning it to
autograd (other reads of the parameter accumulate theirs as usual): it is copied into its
bucket's flat buffer, and once every member has arrived the buffer is all-reduced over the
bucket's first axis with ``async_op=True`` while autograd goes on with the earlier layers. At the
end of backward (an autograd engine callback) each bucket is waited for, all-reduced over any
further axes, and added to its parameters' ``.grad`` (so gradient accumulation over several
backward passes stays right). A record over several axes is one collective over their joint
group (codegen/groups.py, docs/cost-model.md §1.4).

A ``reduce_scatter`` bucket (parameters whose gradients are sharded apart from them: ZeRO-2 and
offload, cost/state.py) lays its members out so that the reduce-scatter over each axis leaves
every rank its own shard of every member along the member's shard dim (chunk ``r`` of every
member, then chunk ``r + 1``, ...: FSDP's copy-in layout), and adds those shards to
:attr:`GradBuckets.shards` instead of ``.grad``; the sharded optimizer (codegen/optim.py) reads
them there. Where the state is sharded over some of the replicated axes only, the shards are
then all-reduced over the others (the records' kinds say which, in order).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from autoshard.codegen.collectives import (ExecutedCollective, Ledger, _reduce_scatter_single,
                                           _wait, reduce_scatter)
from autoshard.codegen.groups import MeshGroups
from autoshard.codegen.hostlink import HostBuffers
from autoshard.errors import AutoshardError
from autoshard.ir import CollectiveKind, Phase
from autoshard.plans.records import CollectiveRecord


@dataclass
class _Bucket:
    name: str                       # "bucket<k>", as the plan's records name it
    axes: tuple[tuple[int, ...], ...]   # per collective, its axes (one, or a joint group)
    planned_nbytes: tuple[int, ...]   # per collective
    members: tuple[str, ...]
    kind: str = CollectiveKind.ALL_REDUCE
    # per collective: a reduce_scatter bucket's last ones may all-reduce its shard (zero2 over
    # some of the replicated axes, cost/state.py)
    kinds: tuple[str, ...] = ()
    buffer: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] | None = None     # reduce_scatter: the arrived gradients
    offsets: dict[str, tuple[int, torch.Size]] | None = None
    arrived: int = 0
    work: object | None = None


class GradBuckets:
    """One rank's gradient buckets, from the plan's bucket records."""

    def __init__(self, records: list[CollectiveRecord], groups: MeshGroups, ledger: Ledger,
                 hostbufs: HostBuffers) -> None:
        self.groups, self.ledger, self.hostbufs = groups, ledger, hostbufs
        self.buckets: list[_Bucket] = []
        self.of: dict[str, _Bucket] = {}
        by_name: dict[str, _Bucket] = {}
        for r in records:
            axis = tuple(groups.axes.index(a) for a in r.axes) if r.axes and len(
                set(r.axes)) == len(r.axes) and set(r.axes) <= set(groups.axes) else None
            if axis is None:
                raise AutoshardError("a gradient bucket over distinct axes of the mesh "
                                     f"{groups.axes}", got=f"{r.node} over {r.axes}",
                                     fix="re-plan: the plan file was edited or is damaged")
            b = by_name.get(r.node)
            if b is None:
                if r.kind not in (CollectiveKind.ALL_REDUCE, CollectiveKind.REDUCE_SCATTER):
                    raise AutoshardError("gradient buckets that all-reduce or reduce-scatter",
                                         got=f"{r.node}: {r.kind}",
                                         fix="re-plan: the plan file was edited or is damaged")
                b = by_name[r.node] = _Bucket(r.node, (), (), r.members, r.kind)
                self.buckets.append(b)
                for m in r.members:
                    if m in self.of:
                        raise AutoshardError("each parameter in one gradient bucket",
                                             got=f"{m} in {self.of[m].name} and {r.node}",
                                             fix="re-plan: the plan file is damaged")
                    self.of[m] = b
            summed = [k == CollectiveKind.ALL_REDUCE for k in (*b.kinds, r.kind)]
            if summed != sorted(summed):       # a reduce-scatter after an all-reduce
                raise AutoshardError("a gradient bucket that all-reduces, or reduce-scatters "
                                     "and then all-reduces its shard",
                                     got=f"{r.node}: {', '.join((*b.kinds, r.kind))}",
                                     fix="re-plan: the plan file was edited or is damaged")
            b.axes += (axis,)
            b.kinds += (r.kind,)
            b.planned_nbytes += (r.bytes,)
        self.params: dict[str, torch.nn.Parameter] = {}
        # reduce_scatter buckets: each member's shard dim (set by the module), and the shards.
        self.shard_dim: dict[str, int] = {}
        self.shards: dict[str, torch.Tensor] = {}
        # Members kept on the host (parameter offload, set by the module): their synced
        # gradient, or shard, is copied down to the host once its bucket is done.
        self.host: set[str] = set()
        self._inflight: list[_Bucket] = []
        self._pending = False
        # Accumulation without sync (DDP's no_sync): while ``defer`` is set (a pipeline's
        # microbatches before the last), each gradient is held here and added to the one that
        # arrives once it is cleared, so every bucket syncs once per step, with the sum.
        self.defer = False
        self._held: dict[str, torch.Tensor] = {}

    def held(self) -> list[torch.Tensor]:
        """The gradients held unsynced across micro-steps (``defer``), one per member."""
        return list(self._held.values())

    # -- during backward ------------------------------------------------------------------
    def arrive(self, member: str, grad: torch.Tensor) -> None:
        held = self._held.get(member)
        if self.defer:
            self._held[member] = grad.detach().clone() if held is None else held.add_(grad)
            return
        if held is not None:
            grad = self._held.pop(member).add_(grad)
        self._hand(member, grad)
        self._queue_finish()

    def release(self, members: list[str]) -> None:
        """Sync the held gradients of ``members`` now and finish, outside backward: a pipeline's
        split backward (codegen/pipeline.py) computes a stage's weight gradients in one autograd
        run per parameter group, so it holds them over its last microbatch's runs too, then
        releases them here, each bucket synced once."""
        for m in members:
            if m in self._held:
                self._hand(m, self._held.pop(m))
        self.finish()

    def _hand(self, member: str, grad: torch.Tensor) -> None:
        b = self.of[member]
        if b.kind == CollectiveKind.REDUCE_SCATTER:
            self._arrive_scatter(b, member, grad)
            return
        if b.buffer is None:
            self._start(b, grad.dtype, grad.device)
        off, shape = b.offsets[member]
        if tuple(grad.shape) != tuple(shape):
            raise RuntimeError(f"gradient of {member} has shape {tuple(grad.shape)}, the bucket "
                               f"expects {tuple(shape)}")
        b.buffer[off:off + grad.numel()].copy_(grad.reshape(-1))
        b.arrived += 1
        if b.arrived == len(b.members):
            b.work = dist.all_reduce(b.buffer, group=self.groups.group_of(b.axes[0]),
                                     async_op=True)

    def _arrive_scatter(self, b: _Bucket, member: str, grad: torch.Tensor) -> None:
        if tuple(grad.shape) != tuple(self.params[member].shape):
            raise RuntimeError(f"gradient of {member} has shape {tuple(grad.shape)}, the bucket "
                               f"expects {tuple(self.params[member].shape)}")
        if b.grads is None:
            b.grads = {}
        b.grads[member] = grad
        if len(b.grads) == len(b.members):
            self._scatter_first(b)

    def _scatter_first(self, b: _Bucket) -> None:
        # One reduce-scatter bucket in flight: the one before is finished (its shards kept,
        # its full-size buffer freed) as this one is issued, so ZeRO-2's saving holds during
        # backward too, not only after it.
        for prev in self._inflight:
            self._finish_scatter(prev)
        self._inflight = [b]
        pieces = [self._grad_or_zero(b, m) for m in b.members]
        b.buffer = _interleave(pieces, [self.shard_dim[m] for m in b.members],
                               self.groups.joint_size(b.axes[0]))
        b.grads = None
        b.work = _reduce_scatter_single(b.buffer, "sum", 0, self.groups.group_of(b.axes[0]))

    def _grad_or_zero(self, b: _Bucket, m: str) -> torch.Tensor:
        g = b.grads.get(m) if b.grads else None
        if g is not None:
            return g
        # (where the arrived gradients are: a member kept on the host is not)
        near = next(iter(b.grads.values()), None) if b.grads else None
        return torch.zeros_like(self.params[m], device=near.device if near is not None
                                else self.params[m].device)

    def _queue_finish(self) -> None:
        if not self._pending:
            self._pending = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def _finish_scatter(self, b: _Bucket) -> None:
        """Wait for the first axis's reduce-scatter, run the further axes' (reduce-scatters of
        the shards, then all-reduces of what they leave), keep the shards."""
        if b.work is None:            # a member's gradient never came: it is zero
            self._scatter_first(b)
        out = _wait(b.work)
        shapes = [list(self.params[m].shape) for m in b.members]
        dims = [self.shard_dim[m] for m in b.members]
        for k, a in enumerate(b.axes):
            self._record(b, a, b.buffer, k)
            if b.kinds[k] == CollectiveKind.REDUCE_SCATTER:
                for sh, d in zip(shapes, dims):
                    sh[d] //= self.groups.joint_size(a)
            if k + 1 < len(b.axes):
                nxt = b.axes[k + 1]
                if b.kinds[k + 1] == CollectiveKind.REDUCE_SCATTER:
                    b.buffer = _interleave(_split(out, shapes), dims,
                                           self.groups.joint_size(nxt))
                    out = reduce_scatter(b.buffer, 0, self.groups.group_of(nxt))
                else:                 # the shards, summed over the axes not scattered
                    b.buffer = out
                    dist.all_reduce(out, group=self.groups.group_of(nxt))
        pieces = _split(out, shapes)
        for m, g in zip(b.members, pieces):
            if m in self.host:
                self.ledger.add_host("d2h", g, Phase.GRAD_SYNC, b.name, m)
                if g.is_cuda:         # into pinned memory, at the link's speed (hostlink.py)
                    self.shards[m] = self.hostbufs.down(g, m + ":shard", self.shards.get(m))
                    continue
                g = g.to("cpu")
            if m in self.shards:
                self.shards[m].add_(g)
            else:
                self.shards[m] = g
        b.buffer, b.work = None, None

    def _record(self, b: _Bucket, axes: tuple[int, ...], buffer: torch.Tensor | None,
                k: int) -> None:
        buf = b.buffer if buffer is None else buffer
        self.ledger.add(ExecutedCollective(
            kind=b.kinds[k], axes=tuple(self.groups.axes[a] for a in axes),
            nbytes=buf.numel() * buf.element_size(), planned_nbytes=b.planned_nbytes[k],
            phase=Phase.GRAD_SYNC, node=b.name,
            group_size=dist.get_world_size(self.groups.group_of(axes))))

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
        self._inflight = []
        for b in self.buckets:
            if b.kind == CollectiveKind.REDUCE_SCATTER:
                if b.grads is not None or b.buffer is not None:
                    self._finish_scatter(b)
                continue
            if b.buffer is None:
                continue              # no member's gradient flowed in this backward
            if b.work is None:        # a member's gradient never came: it is zero
                b.work = dist.all_reduce(b.buffer, group=self.groups.group_of(b.axes[0]),
                                         async_op=True)
            b.work.wait()
            for a in b.axes[1:]:
                dist.all_reduce(b.buffer, group=self.groups.group_of(a))
            for k, a in enumerate(b.axes):
                self._record(b, a, b.buffer, k)
            for m, (off, shape) in b.offsets.items():
                g = b.buffer[off:off + math.prod(shape)].view(shape)
                p = self.params[m]
                if m in self.host:
                    self.ledger.add_host("d2h", g, Phase.GRAD_SYNC, b.name, m)
                    if g.is_cuda:     # into pinned memory, at the link's speed (hostlink.py)
                        p.grad = self.hostbufs.down(g, m, p.grad)
                        continue
                    g = g.to(p.device, copy=True)
                if p.grad is None:
                    p.grad = g
                else:
                    p.grad.add_(g)
            b.buffer, b.offsets, b.arrived, b.work = None, None, 0, None
        self.hostbufs.settle()        # the host members' gradients copied down have landed


def _interleave(pieces: list[torch.Tensor], dims: list[int], n: int) -> torch.Tensor:
    """One flat buffer: chunk 0 of every piece (along its dim), then chunk 1, ...: a
    reduce-scatter over ``n`` ranks leaves rank ``r`` the sum of every piece's chunk ``r``."""
    return torch.cat([t.chunk(n, d)[r].reshape(-1) for r in range(n)
                      for t, d in zip(pieces, dims)])


def _split(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    out, off = [], 0
    for sh in shapes:
        k = math.prod(sh)
        out.append(flat[off:off + k].view(sh))
        off += k
    return out


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
