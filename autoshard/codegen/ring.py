"""Ring attention's transport on torch.distributed: the point-to-point shifts of ops/ring.py
between this rank and its neighbours on the ring of the op's mesh axes, each written to the
ledger next to the bytes the plan lists for it (ops/attention.py ``ring_collectives``).

The ring of several axes is their ranks in row-major order of their coordinates (the zigzag
layout over several axes nests as one axis of their product, ir.py); its sends go over the
default group to the neighbours' global ranks, so it needs no process group of its own. Each
shift posts its sends and receives at once, one ``batch_isend_irecv`` (gloo and NCCL alike),
and returns without waiting, so the block compute of the step runs while the blocks travel; the
kernel waits on them before the next step.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from autoshard.codegen.collectives import ExecutedCollective, Ledger
from autoshard.codegen.groups import MeshGroups
from autoshard.ir import CollectiveKind, Phase
from autoshard.ops.registry import OpCollective
from autoshard.ops.ring import RingKernel


def neighbours(groups: MeshGroups, axes: tuple[int, ...]) -> tuple[int, int]:
    """Global ranks of the (next, previous) rank on the ring of ``axes``."""
    n, me = groups.joint_size(axes), groups.joint_coord(axes)

    def rank_at(pos: int) -> int:
        coords = list(groups.coords)
        for a in reversed(axes):               # row-major: the last axis varies fastest
            pos, coords[a] = divmod(pos, groups.shape[a])
        return int(groups.device_mesh.mesh[tuple(coords)])
    return rank_at((me + 1) % n), rank_at((me - 1) % n)


class _Pending:
    def __init__(self, works: list[Any], bufs: list[torch.Tensor]) -> None:
        self.works, self.bufs = works, bufs

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.bufs


class GroupRing:
    """ops/ring.py ``Ring`` over this rank's neighbours on the ring of ``axes``. Every shift is
    one ``send_recv`` in the ledger (S: the bytes sent, docs/cost-model.md §1.1), matched in
    order with the plan's records of its phase; in "replay" (a selectively checkpointed layer
    run again, whose collectives the plan does not list twice) nothing is counted."""

    def __init__(self, groups: MeshGroups, axes: tuple[int, ...], ledger: Ledger | None,
                 node: str, planned: Sequence[OpCollective], phase: Phase) -> None:
        self.next, self.prev = neighbours(groups, axes)
        self.names = tuple(groups.axes[a] for a in axes)
        self.size = groups.joint_size(axes)
        self.ledger, self.node, self.phase = ledger, node, phase
        self.planned = {p: iter([c for c in planned if c.phase == p])
                        for p in (Phase.FORWARD, Phase.BACKWARD)}

    def shift(self, tensors: Sequence[torch.Tensor], backward: bool,
              channel: int = 0) -> _Pending:
        tensors = [t.contiguous() for t in tensors]
        bufs = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (t, b) in enumerate(zip(tensors, bufs)):
            # A tag per channel and tensor: the gradients' shift may be in flight beside the
            # blocks' (ops/ring.py), and tags keep their messages apart.
            tag = channel * len(tensors) + i
            ops += [dist.P2POp(dist.isend, t, self.next, tag=tag),
                    dist.P2POp(dist.irecv, b, self.prev, tag=tag)]
        # One batch: NCCL runs a batch's sends and receives as one group, so two ranks sending
        # to each other first (a ring of two) cannot wait on each other's receive.
        works = dist.batch_isend_irecv(ops)
        self._count(tensors, backward)
        return _Pending(works, bufs)

    def _count(self, tensors: Sequence[torch.Tensor], backward: bool) -> None:
        phase = Phase.BACKWARD if backward else self.phase
        if self.ledger is None or phase == Phase.REPLAY:
            return
        want = next(self.planned[Phase.BACKWARD if backward else Phase.FORWARD], None)
        self.ledger.add(ExecutedCollective(
            kind=CollectiveKind.SEND_RECV, axes=self.names, nbytes=sum(t.numel() * t.element_size()
                                                          for t in tensors),
            planned_nbytes=want.nbytes if want else -1, phase=phase, node=self.node,
            group_size=self.size))


class RingCall:
    """A graph target: ring attention (ops/ring.py ``RingKernel``) bound to this rank's
    neighbours and ledger at each call (the runtime's phase says forward or recompute)."""

    def __init__(self, kernel: RingKernel, runtime: Any, node: str,
                 planned: tuple[OpCollective, ...]) -> None:
        self.kernel, self.rt, self.node, self.planned = kernel, runtime, node, planned
        self.__name__ = kernel.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        rt = self.rt
        ring = GroupRing(rt.groups, self.kernel.axes, rt.ledger, self.node, self.planned,
                         rt.phase)
        return self.kernel.bind(ring)(*args, **kwargs)

    def __repr__(self) -> str:
        return self.__name__
