"""Collective costs (alpha-beta per mesh axis) and resharding plans.

The single home of every collective formula. ``S`` is the size in bytes of
the collective's full buffer as docs/cost-model.md §1 defines it: the tensor all-reduced, the
all-gather's output, the reduce-scatter's input, each device's all-to-all input.

Ring algorithm times (docs/cost-model.md §1.1, after nccl-tests doc/PERFORMANCE.md):
  all-reduce      2(p-1)·alpha + 2(p-1)/p · S/B
  all-gather      (p-1)·alpha + (p-1)/p · S/B
  reduce-scatter  (p-1)·alpha + (p-1)/p · S/B
  all-to-all      (p-1)·alpha + (p-1)/p · S/B
  send/recv       alpha + S/B
"""
from __future__ import annotations

import math
import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

from autoshard.ir import CollectiveKind, Partial, Phase, Replicate, Shard, Spec, shard_factor
from autoshard.cluster import COLLECTIVE_KINDS
from autoshard.mesh import AxisLink, Mesh


def link_time(link: AxisLink, kind: str, p: int, nbytes: float, *,
              latency_share: float = 1.0) -> float:
    """One ``kind`` collective of ``nbytes`` over ``p`` devices on ``link``, at the figures the
    link has for that kind (``AxisLink.figures``); ``latency_share``: the part of its latency
    charged (a gradient's share of a bucket, cost/overlap.py)."""
    alpha, bandwidth = link.figures(kind)
    return collective_time(kind, p, nbytes, alpha * latency_share, bandwidth)


def collective_time(kind: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    if kind == CollectiveKind.SEND_RECV:
        return alpha + nbytes / bandwidth
    if p <= 1:
        return 0.0
    frac = (p - 1) / p
    if kind == CollectiveKind.ALL_REDUCE:
        return 2 * (p - 1) * alpha + 2 * frac * nbytes / bandwidth
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER,
                CollectiveKind.ALL_TO_ALL):
        return (p - 1) * alpha + frac * nbytes / bandwidth
    raise ValueError(f"unknown collective kind {kind!r}")


def bytes_sent_per_device(kind: str, p: int, nbytes: float) -> float:
    """Bytes one device sends (docs/cost-model.md §1.1)."""
    if kind == CollectiveKind.SEND_RECV:
        return nbytes
    if p <= 1:
        return 0.0
    frac = (p - 1) / p
    return 2 * frac * nbytes if kind == CollectiveKind.ALL_REDUCE else frac * nbytes


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a resharding: a collective over ``axis``, or a local op (slice, zero).

    ``dim`` is the tensor dim gathered/scattered/sliced; ``dim2`` the new dim of an all-to-all.
    ``nbytes`` is S for a collective (0 for local steps). ``joint``: the mesh axes (ascending,
    ``axis`` first) of a step that runs as one collective over their joint process group, the
    dim split over them row-major (docs/cost-model.md §1.4); empty for a step over ``axis``.
    ``groups``/``groups2``: the relative group sizes of ``dim``/``dim2`` where they are sharded
    strided (ir.py ``Shard``): the collective cuts or joins every group alike, the same bytes
    as a contiguous one plus a local reorder (codegen/collectives.py).
    """

    kind: CollectiveKind | str     # a collective, or a local step: "slice" | "to_partial"
    axis: int
    dim: int = -1
    dim2: int = -1
    nbytes: int = 0
    joint: tuple[int, ...] = ()
    groups: tuple[int, ...] = ()
    groups2: tuple[int, ...] = ()

    @property
    def is_collective(self) -> bool:
        return self.kind in COLLECTIVE_KINDS

    @property
    def axes(self) -> tuple[int, ...]:
        """The mesh axes whose joint group runs the step (one axis for most steps)."""
        return self.joint or (self.axis,)

    def group_size(self, mesh_shape: tuple[int, ...]) -> int:
        """The devices of the step's group: the product of its axes' sizes."""
        return math.prod(mesh_shape[a] for a in self.axes)


@dataclass(frozen=True, slots=True)
class Reshard:
    """How a tensor moves from the producer's spec to what a consumer needs, both directions.

    ``forward`` are the steps in order. ``backward`` are the collectives the gradient needs, in
    order: the grad all-reduce over ``divergent`` axes (fused with an all-gather's adjoint slice
    into a reduce-scatter where both fall on one axis), then the adjoint of each forward step.
    """

    forward: tuple[Step, ...]
    backward: tuple[Step, ...]

    @property
    def collectives(self) -> tuple[tuple[str, Step], ...]:
        return tuple((Phase.FORWARD, s) for s in self.forward if s.is_collective) + tuple(
            (Phase.BACKWARD, s) for s in self.backward if s.is_collective)


def _must_change(src: Spec, dst: Spec) -> list[bool]:
    change = [s != d for s, d in zip(src, dst)]
    # A dim split over several axes is nested row-major: an inner axis that keeps S(d) must still
    # be undone and redone when an outer axis on the same dim changes.
    grew = True
    while grew:
        grew = False
        for a, (s, d) in enumerate(zip(src, dst)):
            if change[a] or not isinstance(s, Shard):
                continue
            if any(change[b] and s in (src[b], dst[b]) for b in range(a)):
                change[a] = grew = True
    return change


def _can_finish(state: list, dst: Spec, done: list[bool], axis: int, dims: set[int],
                new_dim: int) -> bool:
    """Whether ``axis`` may go straight to ``dst[axis]`` = ``S(new_dim)`` now (slice,
    reduce-scatter, all-to-all).

    Under row-major nesting, an axis can only split or gather a dim as the innermost axis
    sharding it: no axis after ``axis`` may hold ``S(d)`` for a dim ``d`` in ``dims`` (the dims
    the step touches). And it must not block later steps: an outer axis still to change, which
    will gather or slice ``new_dim``, would find ``axis`` inside it. Unchanged outer axes are
    fine (``axis`` becomes their inner split, as the spec says).
    """
    for b in range(axis + 1, len(state)):
        if isinstance(state[b], Shard) and state[b].dim in dims:
            return False
    for b in range(axis):
        if not done[b] and any(isinstance(p, Shard) and p.dim == new_dim
                               for p in (state[b], dst[b])):
            return False
    return True


Groups = tuple[tuple[int, ...], ...]   # disjoint sets of mesh axes whose collectives run as one


@lru_cache(maxsize=200_000)
def reshard(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
            mesh_shape: tuple[int, ...], divergent: frozenset[int] = frozenset(),
            joint: Groups = ()) -> Reshard:
    """Plan the steps from ``src`` to ``dst`` for a tensor of global ``shape``.

    Greedy, one step at a time: first any step that finishes an axis without growing the local
    tensor (slice, reduce-scatter, to-partial, all-to-all), so later collectives move fewer
    bytes; else all-reduce a partial axis; else all-gather, an axis that ends replicated if
    one can, else the innermost sharded one. Every step is valid under row-major nesting.

    ``joint``: groups of axes whose collectives run as one over the group's joint process
    group (docs/cost-model.md §1.4). Where every group's axes hold one placement in ``src``
    and one in ``dst`` (the layouts of a plan made with those axes merged), the steps are
    planned on the mesh with each group as one axis of their product, and each step over a
    group becomes one step over all of its axes; elsewhere every axis moves on its own.
    """
    assert len(src) == len(dst) == len(mesh_shape)
    if joint:
        merged = _joint_reshard(src, dst, shape, itemsize, mesh_shape, divergent, joint)
        if merged is not None:
            return merged
    # On an axis of one device every placement holds the same data: plan without it.
    src, dst = _drop_unit_axes(src, mesh_shape), _drop_unit_axes(dst, mesh_shape)
    divergent = frozenset(a for a in divergent if mesh_shape[a] > 1)
    done = [not c for c in _must_change(src, dst)]
    state = list(src)
    local = [s // shard_factor(state, d, mesh_shape) for d, s in enumerate(shape)]
    fwd: list[Step] = []
    while not all(done):
        kind, a, dim, dim2 = _next_step(state, dst, done)
        n, size = mesh_shape[a], math.prod(local) * itemsize
        if kind == CollectiveKind.ALL_GATHER:
            local[dim] *= n
            size *= n                                    # S is the gathered output
        elif kind in ("slice", CollectiveKind.REDUCE_SCATTER):
            local[dim] //= n
        elif kind == CollectiveKind.ALL_TO_ALL:
            local[dim] *= n
            local[dim2] //= n
        # the strided groups of the dim the step cuts or joins: the source's for a gather, the
        # destination's for a slice or reduce-scatter; an all-to-all joins one, cuts the other
        src_g = state[a].groups if isinstance(state[a], Shard) else ()
        dst_g = dst[a].groups if isinstance(dst[a], Shard) else ()
        groups = src_g if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_TO_ALL) \
            else dst_g
        fwd.append(Step(kind, a, dim, dim2, nbytes=size if kind in COLLECTIVE_KINDS else 0,
                        groups=groups if dim >= 0 else (),
                        groups2=dst_g if kind == CollectiveKind.ALL_TO_ALL else ()))
        state[a] = Replicate() \
            if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.ALL_REDUCE) else dst[a]
        done[a] = state[a] == dst[a]
    return Reshard(tuple(fwd), _backward(tuple(fwd), dst, shape, itemsize, mesh_shape, divergent))


def _joint_reshard(src: Spec, dst: Spec, shape: tuple[int, ...], itemsize: int,
                   mesh_shape: tuple[int, ...], divergent: frozenset[int],
                   joint: Groups) -> Reshard | None:
    """:func:`reshard` with ``joint``'s groups as single axes, or None where a group's axes
    differ in a layout, or where the nesting of a dim split over several axes is not the
    real mesh's (a dim split over a non-adjacent group and the axis between them)."""
    src, dst = _drop_unit_axes(src, mesh_shape), _drop_unit_axes(dst, mesh_shape)
    groups = _partition(joint, mesh_shape)
    if all(len(g) == 1 for g in groups):
        return None
    for spec in (src, dst):
        if any(len({spec[a] for a in g}) != 1 for g in groups) or not _nests_alike(spec, groups):
            return None
    div = frozenset(a for a in divergent if mesh_shape[a] > 1)
    if any(0 < len(div & set(g)) < len(g) for g in groups):
        return None
    r = reshard(tuple(src[g[0]] for g in groups), tuple(dst[g[0]] for g in groups), shape,
                itemsize, tuple(math.prod(mesh_shape[a] for a in g) for g in groups),
                frozenset(i for i, g in enumerate(groups) if g[0] in div))

    def real(s: Step) -> Step:
        g = groups[s.axis]
        return dataclasses.replace(s, axis=g[0], joint=g if len(g) > 1 else ())

    return Reshard(tuple(map(real, r.forward)), tuple(map(real, r.backward)))


def joint_groups(joint: Groups, mesh_shape: tuple[int, ...]) -> Groups:
    """``joint``'s groups without their 1-device axes, those of two or more axes left."""
    return tuple(g for g in _partition(joint, mesh_shape) if len(g) > 1)


def _partition(joint: Groups, mesh_shape: tuple[int, ...]) -> Groups:
    """Every axis in one group, ordered by first axis: ``joint``'s groups without their
    1-device axes (they move nothing), the other axes alone."""
    groups = [tuple(sorted(a for a in g if mesh_shape[a] > 1)) for g in joint]
    groups = [g for g in groups if g]
    seen = {a for g in groups for a in g}
    groups += [(a,) for a in range(len(mesh_shape)) if a not in seen]
    return tuple(sorted(groups))


def _nests_alike(spec: Spec, groups: Groups) -> bool:
    """Whether each tensor dim's axes, taken group by group in the merged mesh's order, are
    the real mesh's row-major order (the first axis outermost, docs/plan-format.md "Specs")."""
    for d in {p.dim for p in spec if isinstance(p, Shard)}:
        cuts = {a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == d}
        real = sorted(cuts)
        merged = [a for g in groups if g[0] in cuts for a in g]
        if real != merged:
            return False
    return True


def _next_step(state: list, dst: Spec, done: list[bool]) -> tuple[str, int, int, int]:
    todo = [a for a in range(len(state)) if not done[a]]
    for a in todo:                               # free slices, outermost first
        s, d = state[a], dst[a]
        if isinstance(s, Replicate) and isinstance(d, Shard) and _can_finish(
                state, dst, done, a, {d.dim}, d.dim):
            return "slice", a, d.dim, -1
    for a in reversed(todo):                     # steps that keep or shrink the local tensor
        s, d = state[a], dst[a]
        if isinstance(s, Replicate) and isinstance(d, Partial):
            return "to_partial", a, -1, -1
        if isinstance(s, Partial) and isinstance(d, Shard) and _can_finish(
                state, dst, done, a, {d.dim}, d.dim):
            return CollectiveKind.REDUCE_SCATTER, a, d.dim, -1
        if isinstance(s, Shard) and isinstance(d, Shard) and s.dim != d.dim and _can_finish(
                state, dst, done, a, {s.dim, d.dim}, d.dim):
            return CollectiveKind.ALL_TO_ALL, a, s.dim, d.dim
    # Nothing shrinks: what is left grows the tensor. A partial axis is all-reduced first, at
    # the current size: a reduce-scatter that waits for a gather of n >= 2 would move as much.
    for a in reversed(todo):
        if isinstance(state[a], Partial):
            return CollectiveKind.ALL_REDUCE, a, -1, -1
    for a in reversed(todo):                     # gathers that finish an axis, if valid
        s = state[a]
        if isinstance(s, Shard) and isinstance(dst[a], Replicate) and not any(
                state[b] == s for b in range(a + 1, len(state))):
            return CollectiveKind.ALL_GATHER, a, s.dim, -1
    for a in reversed(todo):                     # innermost first: nothing inside it holds its dim
        if isinstance(state[a], Shard):
            return CollectiveKind.ALL_GATHER, a, state[a].dim, -1
    raise AssertionError(f"no resharding step from {state} to {dst}")


def _drop_unit_axes(spec: Spec, mesh_shape: tuple[int, ...]) -> Spec:
    if all(n > 1 for n in mesh_shape):
        return spec
    return tuple(Replicate() if n == 1 else p for p, n in zip(spec, mesh_shape))


def _backward(fwd: tuple[Step, ...], dst: Spec, shape: tuple[int, ...], itemsize: int,
              mesh_shape: tuple[int, ...], divergent: frozenset[int]) -> tuple[Step, ...]:
    """The gradient's steps: the dual of each forward step, in reverse order.

    Gradients follow the tensor's placement (DTensor's convention), and the gradient of a Partial
    tensor is Replicate. So: all_reduce -> nothing; all_gather -> slice; slice -> all_gather;
    reduce_scatter -> all_gather; all_to_all -> all_to_all back; to_partial -> nothing. A grad
    all-reduce on a divergent axis followed by an all-gather's adjoint slice on the same axis is
    a reduce-scatter (ZeRO-3's and sequence parallel's backward).
    """
    grad_local = [s // shard_factor(dst, d, mesh_shape) for d, s in enumerate(shape)]
    gathered_axes = {s.axis for s in fwd if s.kind == CollectiveKind.ALL_GATHER}
    out: list[Step] = []
    for a in sorted(divergent - gathered_axes):
        out.append(Step(CollectiveKind.ALL_REDUCE, a, nbytes=math.prod(grad_local) * itemsize))
    for s in reversed(fwd):
        n = mesh_shape[s.axis]
        size = math.prod(grad_local) * itemsize
        if s.kind == CollectiveKind.ALL_GATHER:
            kind = CollectiveKind.REDUCE_SCATTER if s.axis in divergent else "slice"
            out.append(Step(kind, s.axis, s.dim,
                            nbytes=size if kind == CollectiveKind.REDUCE_SCATTER else 0,
                            groups=s.groups))
            grad_local[s.dim] //= n
        elif s.kind in ("slice", CollectiveKind.REDUCE_SCATTER):
            grad_local[s.dim] *= n
            out.append(Step(CollectiveKind.ALL_GATHER, s.axis, s.dim,
                            nbytes=math.prod(grad_local) * itemsize, groups=s.groups))
        elif s.kind == CollectiveKind.ALL_TO_ALL:
            out.append(Step(CollectiveKind.ALL_TO_ALL, s.axis, s.dim2, s.dim, nbytes=size,
                            groups=s.groups2, groups2=s.groups))
            grad_local[s.dim2] *= n
            grad_local[s.dim] //= n
        # all_reduce and to_partial: the gradient passes through unchanged.
    return tuple(out)


def step_seconds(s: Step, mesh: Mesh) -> float:
    """One step's collective time on its axis's link, or over several axes at once on their
    slowest member's (docs/cost-model.md §1.4); 0 for a local step."""
    if not s.is_collective:
        return 0.0
    link = mesh.group_link(s.axes) if s.joint else mesh.links[s.axis]
    return link_time(link, s.kind, s.group_size(mesh.shape), s.nbytes)


def steps_time(steps: Sequence[Step], mesh: Mesh) -> float:
    return sum(step_seconds(s, mesh) for s in steps)


def reshard_time(r: Reshard, mesh: Mesh) -> float:
    return steps_time(r.forward, mesh) + steps_time(r.backward, mesh)
