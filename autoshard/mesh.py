"""The logical device mesh: shape, axis names and per-axis link figures (alpha, bandwidth)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError


@dataclass(frozen=True, slots=True)
class AxisLink:
    alpha: float       # s per collective step
    bandwidth: float   # bus bandwidth, bytes/s
    # Per collective kind, (kind, alpha, bandwidth) in place of the two above: a backend whose
    # collectives do not share one alpha-beta (gloo's reduce-scatter costs about its
    # all-reduce), as `autoshard calibrate` measures them (Cluster.collective_kinds,
    # docs/cost-model.md §2.9). Empty: every kind on the link's figures (NCCL's ring).
    kinds: tuple[tuple[str, float, float], ...] = ()

    @property
    def least_alpha(self) -> float:
        """The smallest latency any kind runs at on this link."""
        return min([self.alpha] + [a for _, a, _ in self.kinds])

    def figures(self, kind: str) -> tuple[float, float]:
        """(alpha, bandwidth) that ``kind`` runs at on this link."""
        for k, a, b in self.kinds:
            if k == kind:
                return a, b
        return self.alpha, self.bandwidth


@dataclass(frozen=True, slots=True, init=False)
class Mesh:
    """An N-D mesh of devices. Ranks are laid out row-major over ``shape``.

    Axes are placed on the hardware innermost-first: the last axis varies fastest between ranks,
    so it lands inside a node (NVLink) while the product of inner axes fits ``devices_per_node``;
    an axis that spans nodes gets the inter-node figures. ``links`` overrides this per axis.
    """

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    cluster: Cluster
    links: tuple[AxisLink, ...]

    def __init__(self, shape: Sequence[int] | int, axes: Sequence[str] | None = None, *,
                 cluster: Cluster | str | Path = "h100",
                 links: Sequence[AxisLink] | None = None) -> None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not shape or not all(isinstance(n, int) and n >= 1 for n in shape):
            raise AutoshardError("a mesh shape is a non-empty tuple of positive ints",
                                 got=repr(shape), fix="e.g. Mesh((8, 8), ('dp', 'tp'))")
        if len(shape) > 3:
            raise AutoshardError("meshes of 1 to 3 axes are supported", got=f"{len(shape)} axes",
                                 fix="merge axes, e.g. (2, 2, 2, 2) -> (4, 2, 2)")
        if axes is None:
            axes = ("dp", "tp")[-len(shape):] if len(shape) <= 2 else ("x", "y", "z")
            axes = tuple(axes) if len(shape) > 1 else ("x",)
        axes = tuple(axes)
        if len(axes) != len(shape) or len(set(axes)) != len(axes) or not all(
                isinstance(a, str) and a for a in axes):
            raise AutoshardError("one distinct, non-empty name per mesh axis",
                                 got=f"shape {shape} with axes {axes}",
                                 fix="name each axis once, e.g. axes=('dp', 'tp')")
        cluster = Cluster.resolve(cluster)
        if links is None:
            links = _default_links(shape, cluster)
        links = tuple(links)
        if len(links) != len(shape):
            raise AutoshardError("one AxisLink per mesh axis", got=f"{len(links)} for {len(shape)}",
                                 fix="give links for every axis or none")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "axes", axes)
        object.__setattr__(self, "cluster", cluster)
        object.__setattr__(self, "links", links)

    @property
    def ndim(self) -> int:
        """The number of mesh axes."""
        return len(self.shape)

    def axis_index(self, name: str) -> int:
        if name not in self.axes:
            raise AutoshardError(f"a mesh axis name among {self.axes}", got=repr(name),
                                 fix="use one of the mesh's axis names")
        return self.axes.index(name)

    @property
    def size(self) -> int:
        """The number of devices."""
        return math.prod(self.shape)

    def coords(self, rank: int) -> tuple[int, ...]:
        out = []
        for n in reversed(self.shape):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def group_link(self, axes: Sequence[int]) -> AxisLink:
        """A collective over several axes runs at the slowest member's figures
        (docs/cost-model.md §1.4)."""
        ls = [self.links[a] for a in axes]
        if len(ls) == 1:
            return ls[0]
        kinds = sorted({k for l in ls for k, _, _ in l.kinds})
        return AxisLink(alpha=max(l.alpha for l in ls), bandwidth=min(l.bandwidth for l in ls),
                        kinds=tuple((k, max(l.figures(k)[0] for l in ls),
                                     min(l.figures(k)[1] for l in ls)) for k in kinds))

    def __str__(self) -> str:
        dims = "x".join(str(n) for n in self.shape)
        return f"Mesh({dims}, axes={','.join(self.axes)}, cluster={self.cluster.name})"

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "axes": list(self.axes), "cluster": self.cluster.name,
                "links": [{"alpha": l.alpha, "bandwidth": l.bandwidth} for l in self.links]}


def split_axes(sizes: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The (axis, size) pairs of a mesh of named sizes that split it (more than one device),
    in order; one ``dp`` axis of 1 where none does. The mesh search builds its meshes so
    (solver/meshes.py ``Candidate``), and a plan's summary finds its mesh among the tries so."""
    return [(a, n) for a, n in sizes if n > 1] or [("dp", 1)]


def _default_links(shape: tuple[int, ...], cluster: Cluster) -> tuple[AxisLink, ...]:
    # An axis's groups lie in blocks of ``inner`` consecutive ranks (the axis times all inner
    # axes). They stay inside a node when the whole mesh fits one node, or when the blocks tile
    # nodes exactly; a block of 3 on 8-GPU nodes straddles a node boundary (ranks 6, 7, 8).
    links: list[AxisLink] = []
    dpn, inner = cluster.devices_per_node, 1
    one_node = math.prod(shape) <= dpn
    for n in reversed(shape):
        inner *= n
        if one_node or (inner <= dpn and dpn % inner == 0):
            links.append(AxisLink(cluster.intra_alpha, cluster.intra_bandwidth,
                                  cluster.collective_kinds))
        else:
            links.append(AxisLink(cluster.inter_alpha, cluster.inter_bandwidth,
                                  cluster.collective_kinds))
    return tuple(reversed(links))


Merges = tuple[tuple[int, ...], ...]   # groups of real axes that act as one


@dataclass(frozen=True, slots=True)
class AxisMerge:
    """A mesh whose axes are merged into groups: ``merges=((0, 1), (2,))`` on a 2x2x2 mesh
    plans on a 4x2 mesh where the first axis stands for real axes 0 and 1 together. A plan made
    on the merged mesh runs on the real one with every spec expanded (the merged axis's placement
    on each of its real axes), and its reshards are priced as they run there: a merged axis's
    collective as one over its real axes' joint process group (docs/cost-model.md §1.4).
    ``merges`` lists every real axis once, groups in order of their first axis; a group's axes
    need not be adjacent (``((0, 2), (1,))``)."""

    real: Mesh
    merges: Merges

    def __post_init__(self) -> None:
        flat = sorted(a for g in self.merges for a in g)
        if flat != list(range(self.real.ndim)) or any(list(g) != sorted(g) for g in self.merges) \
                or [g[0] for g in self.merges] != sorted(g[0] for g in self.merges):
            raise AutoshardError(f"groups of the axes 0..{self.real.ndim - 1}, each axis once, "
                                 "ascending, groups by their first axis", got=repr(self.merges),
                                 fix="e.g. ((0, 2), (1,)) on a 3-axis mesh")

    def merged(self) -> Mesh:
        return Mesh(tuple(math.prod(self.real.shape[a] for a in g) for g in self.merges),
                    tuple("*".join(self.real.axes[a] for a in g) for g in self.merges),
                    cluster=self.real.cluster,
                    links=tuple(self.real.group_link(g) for g in self.merges))

    def joint(self) -> Merges:
        """The groups of more than one real axis: their collectives run as one."""
        return tuple(g for g in self.merges if len(g) > 1)

    def expand_spec(self, spec: tuple | None) -> tuple | None:
        """A spec on the merged mesh, on the real mesh."""
        if spec is None:
            return None
        out: list = [None] * self.real.ndim
        for p, g in zip(spec, self.merges):
            for a in g:
                out[a] = p
        return tuple(out)

    def contract_spec(self, spec: tuple) -> tuple | None:
        """A spec on the real mesh on the merged one; None if a merge's axes differ in it."""
        out = []
        for g in self.merges:
            placements = {spec[a] for a in g}
            if len(placements) != 1:
                return None
            out.append(placements.pop())
        return tuple(out)

    def expand_axes(self, axes: frozenset[int]) -> frozenset[int]:
        return frozenset(a for g in axes for a in self.merges[g])
