"""A ParallelModule's state dicts: whole (``full_state_dict``, as ``model.state_dict()``) and
sharded (``sharded_state_dict``, DTensors for torch.distributed.checkpoint), and their loads.

Saving gathers each parameter and buffer whole or describes this rank's shard of it; loading
checks every name and global shape before anything is written, then keeps this rank's shard.
On a pipeline each stage holds its own tensors, so a whole state dict is gathered across the
stages too. This is one concern apart from running the program: :class:`StateDicts` is mixed
into codegen/runtime.py's ``ParallelModule``, whose attributes it reads.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from autoshard.codegen.dtensors import (contiguous_stride, dtensor_in_place, dtensor_placements,
                                       refuse_strided)
from autoshard.errors import AutoshardError


class StateDicts:
    """Whole and sharded state dicts of a ``ParallelModule``, and their loads.

    Mixed into ``ParallelModule`` (codegen/runtime.py), which sets what is read here: ``traced``,
    ``groups``, ``runtime``, ``pipeline``, ``on_host``, ``_specs``, ``_param_ph``,
    ``_buffers_local``, ``_saved_buffers``, ``_aliases``, and its ``local_parameters()``,
    ``_shard``, ``_gather`` and ``_local_tensor``."""

    def _full(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        ph = self.traced.placeholder(self._param_ph[fqn])
        return self._gather(t, self._specs[ph.name], ph.info.shape)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's ``state_dict()``: every parameter and buffer whole, a tied parameter
        under each of its names (as ``model.state_dict()`` has it). Collective."""
        out = {fqn: self._full(fqn, p) for fqn, p in self.local_parameters().items()}
        for ph in self._state_placeholders():
            if ph.kind == "buffer":
                out[ph.fqn] = self._gather(self._buffers_local[ph.name], self._specs[ph.name],
                                           ph.info.shape)
        out = self._across_stages(out)
        out.update({alias: out[fqn] for alias, fqn in self._aliases.items() if fqn in out})
        return out

    def _across_stages(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """On a pipeline, every stage's tensors on every rank (each stage holds its own)."""
        if self.pipeline is None:
            return mine
        parts: list[Any] = [None] * self.pipeline.ranks
        dist.all_gather_object(parts, {k: v.cpu() for k, v in mine.items()},
                               group=self.pipeline.group)
        out: dict[str, torch.Tensor] = {}
        for part in parts:
            out.update({k: v.to(self.pipeline.device) for k, v in part.items() if k not in out})
        return out

    def _state_placeholders(self) -> list[Any]:
        """The placeholders of this rank's parameters and buffers (its stage's, on a pipeline)."""
        return [ph for ph in self.traced.placeholders
                if (ph.kind == "param" and ph.fqn in self._param_ph)
                or (ph.kind == "buffer" and ph.name in self._buffers_local
                    and ph.name in self._saved_buffers)]

    def _check_names(self, sd: Any, what: str, fix: str) -> None:
        """Every parameter and buffer of this rank is in ``sd`` (before anything is written)."""
        missing = [ph.fqn for ph in self._state_placeholders() if ph.fqn not in sd]
        if missing:
            raise AutoshardError(f"{what} with every parameter and buffer of the model",
                                 got=f"{len(missing)} missing: {', '.join(missing[:5])}", fix=fix)

    def _incoming(self, sd: Any, name: str, what: str, fix: str) -> torch.Tensor:
        """``sd[ph.fqn]`` of placeholder ``name``, checked to have its global shape. (Read once,
        as it is loaded: a lazy mapping reads one tensor at a time.)"""
        ph = self.traced.placeholder(name)
        v = sd[ph.fqn]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(ph.info.shape):
            got = f"shape {tuple(v.shape)}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise AutoshardError(f"{ph.fqn} of shape {tuple(ph.info.shape)} in {what}",
                                 got=got, fix=fix)
        return v

    def load_full_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load ``model.state_dict()`` (or ``full_state_dict()``): each rank keeps its shard of
        every parameter and buffer. Names and shapes are checked first (``strict``: every one
        of this rank's tensors present, whole)."""
        what, fix = "a full state dict", "pass model.state_dict() of the same model"
        self._check_names(sd, what, fix)
        self.runtime.host.settle()      # no copy of a host parameter still in flight
        with torch.no_grad():
            for ph in self._state_placeholders():
                local = self._local_tensor(ph)
                local.copy_(self._shard(self._incoming(sd, ph.name, what, fix),
                                        self._specs[ph.name]))

    def sharded_state_dict(self) -> dict[str, Any]:
        """Parameters as DTensors on the torch DeviceMesh, for torch.distributed.checkpoint
        (``dcp.load`` writes into them: no copy of a host parameter is left in flight)."""
        self.runtime.host.settle()
        from torch.distributed.tensor import DTensor
        out = {}
        for fqn, p in self.local_parameters().items():
            ph = self.traced.placeholder(self._param_ph[fqn])
            refuse_strided(fqn, self._specs[ph.name])
            placements = dtensor_placements(self._specs[ph.name])
            if fqn in self.on_host:
                # The host tensor itself, not a device copy (from_local would move it).
                out[fqn] = dtensor_in_place(p.detach(), self.groups.device_mesh, placements,
                                            ph.info.shape)
                continue
            out[fqn] = DTensor.from_local(p.detach(), self.groups.device_mesh, placements,
                                          run_check=False, shape=torch.Size(ph.info.shape),
                                          stride=contiguous_stride(ph.info.shape))
        for ph in self._state_placeholders():        # buffers (BatchNorm's running statistics)
            if ph.kind == "buffer":
                refuse_strided(ph.fqn, self._specs[ph.name])
                out[ph.fqn] = dtensor_in_place(self._buffers_local[ph.name],
                                               self.groups.device_mesh,
                                               dtensor_placements(self._specs[ph.name]),
                                               tuple(ph.info.shape))
        return out

    def state_dict(self, *, destination: Any = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, Any]:
        """torch's ``Module.state_dict()`` of a sharded module, as FSDP2 gives it: the model's
        own names, each value a DTensor of this rank's shard (``sharded_state_dict()``), so
        ``torch.distributed.checkpoint`` saves it as it is. Not collective; not for one file
        saved by one rank: ``full_state_dict()`` gathers the whole tensors."""
        out = destination if destination is not None else {}
        for k, v in self.sharded_state_dict().items():
            out[prefix + k] = v
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """torch's ``Module.load_state_dict``: a sharded state dict (DTensors, as
        ``state_dict()`` gives) loads as ``load_sharded_state_dict``, a whole one (the single
        device model's ``state_dict()``) as ``load_full_state_dict``. Strict, in place."""
        if not strict or assign:
            raise AutoshardError(
                "pm.load_state_dict(sd) with strict=True and assign=False (every parameter and "
                "buffer is loaded, into this rank's shards)",
                got=f"strict={strict}, assign={assign}",
                fix="pass the whole state dict with the defaults, or load a model's part into "
                    "the model before autoshard.parallelize")
        from torch.distributed.tensor import DTensor
        from torch.nn.modules.module import _IncompatibleKeys
        sharded = {isinstance(v, DTensor) for v in state_dict.values()}
        if sharded == {True, False}:
            raise AutoshardError(
                "a state dict whose tensors are all DTensors (pm.state_dict()) or all whole "
                "tensors (model.state_dict(), pm.full_state_dict())",
                got="both kinds in one state dict",
                fix="load each kind with its own call: pm.load_sharded_state_dict(sd) or "
                    "pm.load_full_state_dict(sd)")
        if True in sharded:
            self.load_sharded_state_dict(state_dict)
        else:
            self.load_full_state_dict(state_dict)
        return _IncompatibleKeys([], [])

    def load_sharded_state_dict(self, sd: dict[str, Any]) -> None:
        """Copy ``sd`` (``pm.sharded_state_dict()`` filled by ``dcp.load``, saved under any
        plan) into this rank's parameters and buffers; names and global shapes are checked
        first."""
        what = "a sharded state dict"
        fix = ("fill pm.sharded_state_dict() with torch.distributed.checkpoint.load from a "
               "checkpoint of the same model, and pass it")
        self._check_names(sd, what, fix)
        phs = self._state_placeholders()
        values = [self._incoming(sd, ph.name, what, fix) for ph in phs]
        self.runtime.host.settle()
        with torch.no_grad():
            for ph, v in zip(phs, values):
                dst, src = self._local_tensor(ph), v.to_local()
                if src.untyped_storage().data_ptr() == dst.untyped_storage().data_ptr():
                    # DCP loaded into this very tensor (pm.state_dict()'s shards are views of
                    # it): a view with other strides (a column shard of a one-row weight)
                    # overlaps it partially, which copy_ refuses.
                    src = src.clone()
                dst.copy_(src)
