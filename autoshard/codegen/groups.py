"""Binding a logical :class:`~autoshard.mesh.Mesh` to the torch.distributed world.

A :class:`MeshGroups` is one rank's view of the mesh: for every mesh axis, the process group of
the ranks it talks to along that axis, its coordinate on the axis and the axis size. Collectives
concatenate shards in *group rank* order while specs index shards by *mesh coordinate*, so the
two must agree; :meth:`MeshGroups.from_device_mesh` checks that they do.

A collective over several axes at once (docs/cost-model.md §1.4) runs on the *joint* group of
those axes: the ranks that share this rank's coordinates on every other axis. A dim split over
several axes is split row-major, the first axis outermost (docs/plan-format.md, "Specs"), so a
rank's shard index over the group is its row-major index over the group's coordinates
(:meth:`MeshGroups.joint_coord`), and the joint group's ranks must come in that order.
"""
from __future__ import annotations

import os
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh


@dataclass(frozen=True, slots=True, eq=False)
class MeshGroups:
    """Per mesh axis: this rank's process group, its coordinate and the axis size."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    coords: tuple[int, ...]
    groups: tuple[dist.ProcessGroup, ...]
    rank: int
    device_type: str
    device_mesh: DeviceMesh
    # Joint groups made so far (:meth:`add_joint`), by their axes (ascending, two or more).
    joint: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.shape)
        if not (len(self.axes) == len(self.coords) == len(self.groups) == n):
            raise ValueError(f"MeshGroups needs one name, coordinate and group per mesh axis; got "
                             f"axes={self.axes}, shape={self.shape}, coords={self.coords}, "
                             f"{len(self.groups)} groups. Fix: build it with MeshGroups.from_mesh.")
        if not all(0 <= c < s for c, s in zip(self.coords, self.shape)):
            raise ValueError(f"coordinates {self.coords} lie outside the mesh {self.shape}. "
                             "Fix: build it with MeshGroups.from_mesh.")

    @classmethod
    def from_mesh(cls, mesh: Mesh, *, device_type: str | None = None) -> MeshGroups:
        """Create the axis subgroups of ``mesh`` over the whole world (a collective call).

        Ranks are laid out row-major over ``mesh.shape``, as :meth:`Mesh.coords` does.
        ``device_type`` defaults to "cuda" for NCCL and "cpu" otherwise (gloo).
        """
        world = _world_size()
        if world != mesh.size:
            raise AutoshardError(
                f"world size {mesh.size} for mesh shape {mesh.shape} with axes {mesh.axes}",
                got=f"world size {world}" if world is not None else
                "no world (torch.distributed is not initialised and WORLD_SIZE is unset)",
                fix=f"launch with torchrun --nproc-per-node {mesh.size} (nnodes x nproc-per-node "
                    f"= {mesh.size}), or change the mesh"
                    + (f" to {world} devices" if world is not None else ""))
        if device_type is None:
            device_type = _default_device_type()
        dm = init_device_mesh(device_type, mesh.shape, mesh_dim_names=mesh.axes)
        groups = cls.from_device_mesh(dm)
        assert groups.coords == mesh.coords(groups.rank), (groups.coords, groups.rank)
        return groups

    @classmethod
    def from_device_mesh(cls, device_mesh: DeviceMesh) -> MeshGroups:
        """Adopt a user's DeviceMesh (possibly a sub-mesh of the world, e.g. a pipeline stage)."""
        coords = device_mesh.get_coordinate()
        rank = dist.get_rank()
        if coords is None:
            raise AutoshardError("this rank to be a member of the DeviceMesh",
                                 got=f"rank {rank} outside {device_mesh}",
                                 fix="build MeshGroups only on the ranks of the mesh")
        shape = tuple(device_mesh.shape)
        names = device_mesh.mesh_dim_names
        axes = tuple(names) if names is not None else Mesh(shape).axes
        groups = tuple(device_mesh.get_group(a) for a in range(len(shape)))
        for a, g in enumerate(groups):
            if dist.get_rank(g) != coords[a]:
                raise AutoshardError(
                    "ranks in the same order along each axis's process group as in the mesh",
                    got=f"rank {rank} at coordinate {coords[a]} on axis {axes[a]!r} but group "
                        f"rank {dist.get_rank(g)} (group {dist.get_process_group_ranks(g)})",
                    fix="build the DeviceMesh with init_device_mesh, or with a mesh tensor whose "
                        "ranks increase along every axis")
        return cls(axes=axes, shape=shape, coords=tuple(coords), groups=groups, rank=rank,
                   device_type=device_mesh.device_type, device_mesh=device_mesh)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def axis(self, axis: int | str) -> int:
        """The index of a mesh axis given by index or name."""
        if isinstance(axis, str):
            if axis not in self.axes:
                raise AutoshardError(f"a mesh axis name among {self.axes}", got=repr(axis),
                                     fix="use one of the mesh's axis names")
            return self.axes.index(axis)
        if not 0 <= axis < len(self.shape):
            raise AutoshardError(f"a mesh axis index in [0, {len(self.shape)})", got=repr(axis),
                                 fix="index the mesh's axes from 0")
        return axis

    def group(self, axis: int | str) -> dist.ProcessGroup:
        return self.groups[self.axis(axis)]

    def coord(self, axis: int | str) -> int:
        return self.coords[self.axis(axis)]

    def size(self, axis: int | str) -> int:
        return self.shape[self.axis(axis)]

    # -- several axes at once ---------------------------------------------------------------
    def add_joint(self, axes: tuple[int, ...]) -> dist.ProcessGroup:
        """Make (once) this rank's joint group of ``axes``. Every rank of the mesh calls it for
        the same groups in the same order (torch.distributed's rule for overlapping groups);
        only the members of each group meet to make it."""
        axes = tuple(sorted(axes))
        if len(axes) < 2 or len(set(axes)) != len(axes) or not all(
                0 <= a < self.ndim for a in axes):
            raise AutoshardError(f"two or more distinct axes of the mesh {self.axes}",
                                 got=repr(axes), fix="name a group of the mesh's axes")
        if axes in self.joint:
            return self.joint[axes]
        mesh = self.device_mesh.mesh
        index = tuple(slice(None) if a in axes else c for a, c in enumerate(self.coords))
        ranks = [int(r) for r in mesh[index].reshape(-1).tolist()]    # row-major over axes
        group = dist.new_group(ranks, use_local_synchronization=True)
        if dist.get_rank(group) != self.joint_coord(axes):
            raise AutoshardError(
                "ranks in row-major order of their coordinates in a group of several axes",
                got=f"rank {self.rank} at index {self.joint_coord(axes)} over "
                    f"{[self.axes[a] for a in axes]} but group rank {dist.get_rank(group)} "
                    f"(group {ranks})",
                fix="build the DeviceMesh with init_device_mesh, or with a mesh tensor whose "
                    "ranks increase row-major")
        self.joint[axes] = group
        return group

    def group_of(self, axes: tuple[int, ...]) -> dist.ProcessGroup:
        """The process group of one axis, or the joint group of several (made beforehand with
        :meth:`add_joint`: making it here, inside a collective, could deadlock)."""
        if len(axes) == 1:
            return self.groups[axes[0]]
        group = self.joint.get(tuple(axes))
        if group is None:
            raise AutoshardError(f"a joint process group of the axes "
                                 f"{[self.axes[a] for a in axes]} made before the program runs",
                                 got=f"none among {sorted(self.joint)}",
                                 fix="call MeshGroups.add_joint on every rank first (parallelize "
                                     "does, for the plan's joint_axes)")
        return group

    def joint_coord(self, axes: tuple[int, ...]) -> int:
        """This rank's row-major index over the coordinates of ``axes`` (its shard of a dim
        split over them)."""
        out = 0
        for a in axes:
            out = out * self.shape[a] + self.coords[a]
        return out

    def joint_size(self, axes: tuple[int, ...]) -> int:
        return math.prod(self.shape[a] for a in axes)

    def __str__(self) -> str:
        where = ", ".join(f"{a}={c}/{n}" for a, c, n in zip(self.axes, self.coords, self.shape))
        return f"MeshGroups(rank {self.rank}: {where}, {self.device_type})"


def _world_size() -> int | None:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    env = os.environ.get("WORLD_SIZE")
    return int(env) if env else None


def _default_device_type() -> str:
    if dist.is_initialized():
        return "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"
