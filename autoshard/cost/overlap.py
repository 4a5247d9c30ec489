"""Gradient buckets, and what of their communication hides behind backward compute.

docs/cost-model.md §7. A data-parallel parameter's gradient sync (a reshard with no forward
steps whose backward is all-reduces only) is not run where its gradient appears: gradients are
fused into buckets of up to ``PlanOptions.bucket_mb``, as PyTorch DDP's Reducer does (Li et al.
2020, "PyTorch Distributed", VLDB, §3.2), each bucket is all-reduced asynchronously once all its
gradients are ready, and the step waits for every bucket at the end of backward. So

- one latency per bucket, not per gradient: each gradient is charged its bandwidth term and its
  share ``S / bucket_bytes`` (at most one) of a bucket's latency, so full buckets pay one latency
  each; the last, partly filled bucket of an axis is charged its share only (at most one latency
  per axis below :func:`bucket_seconds` of the buckets the runtime issues). The ILP and the plan's
  predicted step use this one price, so the plan's step is the ILP's objective;
- one overlap window: the buckets' communication runs while backward compute goes on, and the
  step waits only for the part that does not fit behind it, ``max(0, sync - backward)``
  (:func:`exposed_seconds`). Every other collective (tensor and sequence parallel, a sharded
  parameter's gather) is on the critical path: blocking.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from autoshard.cost.comm import Reshard, link_time
from autoshard.cost.reshards import ReshardEdge
from autoshard.cost.state import scatter_axes, zero_grad_sync
from autoshard.ir import CollectiveKind, Strategy
from autoshard.mesh import Mesh
from autoshard.trace.graph import first_reads


def is_grad_sync(r: Reshard) -> bool:
    """A pure gradient sync: nothing moves in forward, the gradient is all-reduced in backward
    (a zero2/offload parameter's bucket reduce-scatters it instead: cost/state.py)."""
    return not r.forward and bool(r.backward) and \
        all(s.kind == CollectiveKind.ALL_REDUCE for s in r.backward)


def first_grad_syncs(edges: Iterable[ReshardEdge]) -> dict[str, ReshardEdge]:
    """Each parameter's first pure gradient sync, in the walk's order: the one its bucket runs
    (a parameter read in two layouts syncs its other reads' gradients itself). The planner's
    ledger and the runtime pick the same one through this."""
    out: dict[str, ReshardEdge] = {}
    for e in edges:
        if e.from_param and e.value[0] not in out and is_grad_sync(e.reshard):
            out[e.value[0]] = e
    return out


def latency_share(nbytes: float, bucket_bytes: float) -> float:
    """The part of a collective's latency ``nbytes`` of gradient pay inside buckets of
    ``bucket_bytes``: a full bucket's one latency, shared by its gradients."""
    return min(1.0, nbytes / bucket_bytes)


def sync_share_seconds(r: Reshard, mesh: Mesh, bucket_bytes: float) -> float:
    """The price of one gradient's sync inside buckets: its bandwidth term and its share
    ``min(1, S / bucket_bytes)`` of one collective latency per axis."""
    return sum(sync_share_by_axis(r, mesh, bucket_bytes).values())


def sync_share_by_axis(r: Reshard, mesh: Mesh, bucket_bytes: float) -> dict[int, float]:
    """:func:`sync_share_seconds` per mesh axis; a collective over several axes at once
    (docs/cost-model.md §1.4) is shared evenly among them."""
    out: dict[int, float] = {}
    for s in r.backward:
        link = mesh.group_link(s.axes)
        t = link_time(link, s.kind, s.group_size(mesh.shape), s.nbytes,
                      latency_share=latency_share(s.nbytes, bucket_bytes))
        for a in s.axes:
            out[a] = out.get(a, 0.0) + t / len(s.axes)
    return out


@dataclass(frozen=True, slots=True)
class Bucket:
    """Gradients synced together: over ``axes`` (in order), of one dtype, all-reduced or (zero2,
    offload) reduce-scattered; ``nbytes`` is the flat buffer the first axis's collective takes.
    ``joint``: groups of ``axes`` that one collective runs over at once (docs/cost-model.md
    §1.4); every other axis has its own (:func:`bucket_collectives`). ``all_reduced``: the
    last of ``axes`` that a reduce-scatter bucket all-reduces, of its shard, after the
    reduce-scatters (zero2 over some of the replicated axes, cost/state.py)."""

    axes: tuple[int, ...]
    dtype: str
    members: tuple[str, ...]     # parameter placeholders, in the order their gradients appear
    nbytes: int
    kind: str = CollectiveKind.ALL_REDUCE
    joint: tuple[tuple[int, ...], ...] = ()
    all_reduced: tuple[int, ...] = ()

    def kind_on(self, axis: int) -> str:
        """The collective the bucket runs on ``axis``."""
        return CollectiveKind.ALL_REDUCE if axis in self.all_reduced else self.kind


@dataclass(frozen=True, slots=True)
class Sync:
    """One parameter's gradient sync, for :func:`form_buckets`."""

    param: str
    axes: tuple[int, ...]
    dtype: str
    nbytes: int
    kind: str = CollectiveKind.ALL_REDUCE
    joint: tuple[tuple[int, ...], ...] = ()
    all_reduced: tuple[int, ...] = ()


def form_buckets(syncs: Iterable[Sync], bucket_bytes: float) -> list[Bucket]:
    """Fill buckets in the order the gradients become ready (``syncs``' order): one open bucket
    per (axes, dtype, kind, joint groups, all-reduced axes); a gradient that would overflow its
    open bucket closes it and starts the next; a gradient larger than a bucket travels alone.
    Buckets are listed in closing order (the order they are issued)."""
    open_: dict[tuple, list[Sync]] = {}
    out: list[Bucket] = []

    def close(key: tuple) -> None:
        members = open_.pop(key)
        out.append(Bucket(key[0], key[1], tuple(m.param for m in members),
                          sum(m.nbytes for m in members), key[2], key[3], key[4]))

    for s in syncs:
        key = (s.axes, s.dtype, s.kind, s.joint, s.all_reduced)
        if key in open_ and sum(m.nbytes for m in open_[key]) + s.nbytes > bucket_bytes:
            close(key)
        open_.setdefault(key, []).append(s)
    for key in list(open_):
        close(key)
    return out


def bucket_bytes_by_axis(b: Bucket, mesh_shape: tuple[int, ...]) -> list[int]:
    """The bytes of the bucket's collective on each of its axes: the whole buffer for
    all-reduces; what the earlier reduce-scatters left for reduce-scatters and for the
    all-reduces after them."""
    out, n = [], b.nbytes
    for a in b.axes:
        out.append(n)
        if b.kind_on(a) == CollectiveKind.REDUCE_SCATTER:
            n //= mesh_shape[a]
    return out


def bucket_collectives(b: Bucket, mesh_shape: tuple[int, ...]
                       ) -> list[tuple[tuple[int, ...], int]]:
    """The bucket's collectives in order, each (its axes, its bytes): one per axis, or one
    over each of ``b.joint``'s groups at once, of the bucket's buffer."""
    if not b.joint:
        return [((a,), n) for a, n in zip(b.axes, bucket_bytes_by_axis(b, mesh_shape))]
    # reduce-scatter buckets run one axis at a time
    assert b.kind == CollectiveKind.ALL_REDUCE, b
    out: list[tuple[tuple[int, ...], int]] = []
    for a in b.axes:
        g = next((g for g in b.joint if a in g), (a,))
        if g[0] == a:
            out.append((g, b.nbytes))
    return out


def bucket_seconds(b: Bucket, mesh: Mesh) -> float:
    """One collective of the bucket per axis (or joint group), one latency each."""
    return sum(link_time(mesh.group_link(g), b.kind_on(g[0]),
                         math.prod(mesh.shape[a] for a in g), n)
               for g, n in bucket_collectives(b, mesh.shape))


def grad_sync(param: str, r: Reshard, dtype: str) -> Sync:
    """A parameter's all-reduced gradient sync: the axes of its reshard's backward steps in
    order, those of a step over several axes at once in one joint group."""
    return Sync(param, tuple(a for s in r.backward for a in s.axes), dtype, r.backward[0].nbytes,
                joint=tuple(s.joint for s in r.backward if s.joint))


def exposed_seconds(sync_s: float, backward_s: float) -> float:
    """What the step waits for of ``sync_s`` seconds of bucketed gradient sync issued during
    ``backward_s`` seconds of backward compute."""
    return max(0.0, sync_s - backward_s)


def gradient_buckets(edges: list[ReshardEdge], nodes: list, bucket_bytes: float,
                     strategies: Mapping[str, Strategy] | None = None,
                     mesh_shape: tuple[int, ...] = ()) -> list[Bucket]:
    """The buckets of a plan's gradient syncs, the ones the runtime issues: the
    gradient a parameter gets through a reshard that is a pure gradient sync, summed over that
    reshard's consumers (other reads of the parameter add their own, unsynced, as autograd
    does). Gradients become ready in the reverse order of their parameter's first use in
    forward. A parameter read through two such reshards (in two layouts) buckets the first.
    ``strategies``: each parameter's, whose state mode and state axes say how it syncs:
    zero2/offload/offload_params ones are reduce-scattered over their state axes, and
    all-reduced over any others (cost/state.py ``zero_grad_sync``), in buckets of their own."""
    first_use = first_reads(nodes)
    dtypes = {n.name: str(n.meta["val"].dtype).removeprefix("torch.") for n in nodes
              if n.op == "placeholder"}
    syncs: dict[str, Sync] = {}
    shapes = {n.name: tuple(n.meta["val"].shape) for n in nodes if n.op == "placeholder"}
    for name, e in first_grad_syncs(edges).items():
        st = (strategies or {}).get(name)
        axes = None if st is None else scatter_axes(shapes[name], e.src, st.kernel,
                                                    st.state_axes, mesh_shape)
        if axes is not None:
            steps = zero_grad_sync(e.reshard, axes, mesh_shape).backward
            syncs[name] = Sync(name, tuple(s.axis for s in steps), dtypes[name],
                               e.reshard.backward[0].nbytes, CollectiveKind.REDUCE_SCATTER,
                               all_reduced=tuple(s.axis for s in steps
                                                 if s.kind == CollectiveKind.ALL_REDUCE))
        else:
            syncs[name] = grad_sync(name, e.reshard, dtypes[name])
    order = sorted(syncs, key=lambda name: -first_use.get(name, 0))
    return form_buckets([syncs[name] for name in order], bucket_bytes)
