"""Binding a logical :class:`~autoshard.mesh.Mesh` to the torch.distributed world.

A :class:`MeshGroups` is one rank's view of the mesh: for every mesh axis, the process group of
the ranks it talks to along that axis, its coordinate on the axis and the axis size. Collectives
concatenate shards in *group rank* order while specs index shards by *mesh coordinate*, so the
two must agree; :meth:`MeshGroups.from_device_mesh` checks that they do.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

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
