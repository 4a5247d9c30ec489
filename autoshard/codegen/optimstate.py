"""The state dicts of the optimizer ``pm.optimizer(...)`` gives (codegen/optim.py): this rank's,
and the DTensors of torch.distributed.checkpoint. Saving and loading the state is one concern
apart from stepping it; :class:`OptimizerStateDicts` is mixed into ``ShardedOptimizer``, whose
attributes it reads (``pm``, ``optimizer``, ``entries``, ``settle``, ``_recut_masters``).

``state_dict`` is the wrapped optimizer's (this rank's shards) with the layout they were cut
by; ``load_state_dict`` refuses a state of another layout. ``sharded_state_dict`` and
``load_sharded_state_dict`` give the state as DTensors of the parameters' global shapes, for
torch.distributed.checkpoint (DCP): saved under one plan, it loads under any other (README.md,
"Use"). Keys:

- ``state.<fqn>.<key>``: the wrapped optimizer's state of parameter ``fqn`` (AdamW: ``exp_avg``,
  ``exp_avg_sq``, ``step``). A tensor shaped like the parameter is a DTensor with its global
  shape whose placements say exactly what this rank holds: the parameter's spec, plus the zero
  axes' cut along the state dim (``_placements``). Scalar state (``step``) is a plain tensor,
  the same on every rank (DCP saves it once).
- ``master.<fqn>``: the fp32 master of a 16-bit parameter, laid out as its state. An fp32
  parameter's master, where one is kept apart (ZeRO-1/2, offload), always equals its slice of
  the parameter, so it is not saved: it is cut again from the parameter, and a checkpoint of a
  data parallel plan loads under ZeRO and back.
- ``param_groups.<i>.<name>``: the hyperparameters of group ``i`` (lr, betas, weight decay, ...)
  as plain values; not the flags saying how this process steps (foreach, fused, capturable,
  differentiable).
"""
from __future__ import annotations

import inspect
from typing import Any

import torch

from autoshard.codegen.dtensors import dtensor_in_place, refuse_strided
from autoshard.codegen.optimlayout import _Entry, _names, _slice
from autoshard.errors import AutoshardError
from autoshard.ops.simulate import shard_tensor

# param_groups entries that are not hyperparameters: the parameters, and how this process steps.
_NOT_SAVED = frozenset({"params", "param_names", "foreach", "fused", "capturable",
                        "differentiable"})
LAYOUT_KEY = "autoshard_layout"


class OptimizerStateDicts:
    """A ``ShardedOptimizer``'s state dicts: this rank's (``state_dict``, with the layout of its
    shards) and DCP's (``sharded_state_dict``), and their loads."""

    # -- this rank's state dict ----------------------------------------------------------------
    def layout(self) -> list[list]:
        """What this rank's state is, per parameter: its name, global shape, the state's DTensor
        placements, where it lives and this rank's mesh coordinates. ``state_dict()`` carries
        it; ``load_state_dict`` refuses a state saved under another layout."""
        coords = list(self.pm.groups.coords)
        group = {id(m): i for i, g in enumerate(self.optimizer.param_groups) for m in g["params"]}
        return [[e.fqn, list(e.shape), [str(p) for p in e.placements],
                 e.master.device.type, list(e.master.shape), coords, group[id(e.master)]]
                for e in self.entries]

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict (this rank's shards) and :meth:`layout`."""
        self.settle()
        return {**self.optimizer.state_dict(), LAYOUT_KEY: self.layout()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` gave under this same plan and rank. A state saved under
        another layout (another plan, mesh or rank) is refused: its shards are other parts of
        the tensors. Reshard through ``sharded_state_dict`` and torch.distributed.checkpoint."""
        fix = ("save opt.sharded_state_dict() with torch.distributed.checkpoint and load it with "
               "opt.load_sharded_state_dict(...): DCP reshards between layouts")
        self.settle()
        saved = state_dict.get(LAYOUT_KEY) if isinstance(state_dict, dict) else None
        if saved is None:
            raise AutoshardError("a state dict from pm.optimizer(...).state_dict(), which "
                                 "records the layout of its shards",
                                 got="one without it (a plain torch optimizer's?)", fix=fix)
        mine = self.layout()
        # (a layout saved before parameter groups were recorded: one group)
        saved = [a + [0] if isinstance(a, list) and len(a) == len(mine[0]) - 1 else a
                 for a in saved] if mine else saved
        if saved != mine:
            names = ("name", "global shape", "placements", "device", "local shape",
                     "mesh coordinates", "parameter group")
            for a, b in zip(saved, mine):
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if i is not None:
                    raise AutoshardError(
                        f"optimizer state laid out as this optimizer keeps {b[0]}: "
                        f"{names[i]} {b[i]}", got=f"state of {a[0]} saved with {names[i]} {a[i]}",
                        fix=fix if names[i] != "parameter group" else
                        "build pm.optimizer(...) with the parameter groups it was saved with, "
                        "or load through opt.load_sharded_state_dict (DCP), which keys the "
                        "state by parameter name")
            raise AutoshardError(f"state for the {len(mine)} parameters this optimizer steps",
                                 got=f"state for {len(saved)}", fix=fix)
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != LAYOUT_KEY})
        # (torch's load_state_dict builds new groups and state: share them again)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state


    # -- torch.distributed.checkpoint (module docstring) -------------------------------------
    def sharded_state_dict(self) -> dict[str, Any]:
        """The optimizer's state for torch.distributed.checkpoint, keyed by parameter FQN:
        DTensors of the parameters' global shapes, scalars as plain tensors, hyperparameters as
        values (module docstring). Its tensors are the state itself, not copies: ``dcp.load``
        into this dict writes the state in place. Before the first step there is no state yet:
        the dict then holds zero-filled state as the first step would create it, which
        ``load_sharded_state_dict`` installs (Adam's and AdamW's first step from it equals the
        first step from none)."""
        self.settle()
        return {key: target for key, _, _, target in self._layout()}

    def load_sharded_state_dict(self, sd: Any) -> None:
        """Copy ``sd`` into this optimizer: ``opt.sharded_state_dict()`` filled by ``dcp.load``
        (saved by any plan), or the same keys with full tensors. Creates the state if the
        optimizer has not stepped. Load the parameters too (``pm.load_sharded_state_dict``,
        before or after): an fp32 parameter's master kept apart is cut from the parameter again,
        here and at the next step if the parameter changed since. Every entry is checked before
        any is written, so a refused ``sd`` leaves the optimizer as it was."""
        self.settle()
        from torch.distributed.tensor import DTensor
        layout = self._layout()
        want = {key for key, *_ in layout}
        missing = [key for key, *_ in layout if key not in sd]
        if missing:
            raise AutoshardError(
                "an optimizer state dict with every entry of opt.sharded_state_dict()",
                got=f"{len(missing)} missing: {_names(missing)}",
                fix="fill opt.sharded_state_dict() with torch.distributed.checkpoint.load from a "
                    "checkpoint saved by pm.optimizer of the same class and options, and pass it")
        unexpected = [k for k in sd if isinstance(k, str)
                      and k.startswith(("state.", "param_groups.")) and k not in want]
        if unexpected:
            raise AutoshardError(
                "only the state entries this optimizer keeps",
                got=f"{len(unexpected)} others: {_names(unexpected)}",
                fix="load with the optimizer class, options and parameter groups it was saved "
                    "with (e.g. amsgrad)")
        with torch.no_grad():
            writes = [(e, name, target, self._incoming(key, e, target, sd[key]))
                      for key, e, name, target in layout]
            created: dict[int, dict[str, Any]] = {}
            for e, name, target, value in writes:
                dst = target.to_local() if isinstance(target, DTensor) else target
                if isinstance(dst, torch.Tensor):
                    if value is not dst:
                        dst.copy_(value)
                    value = dst
                if e is None:                          # a hyperparameter: (group, name)
                    group = self.optimizer.param_groups[name[0]]
                    if not isinstance(dst, torch.Tensor):
                        group[name[1]] = value
                elif name is not None:                 # state: into the live state, or new
                    state = self.optimizer.state.get(e.master)
                    if state:
                        state[name] = value
                    else:
                        created.setdefault(id(e.master), {})[name] = value
            for e in self.entries:
                if id(e.master) in created:
                    self.optimizer.state[e.master] = created[id(e.master)]
        self._recut_masters(force=True)

    def _layout(self) -> list[tuple[str, "_Entry | None", Any, Any]]:
        """(key, entry, name, target) per entry of the sharded state dict: ``name`` is the state
        key (None: the master; for a hyperparameter, entry None and name (group, key))."""
        out: list[tuple[str, _Entry | None, Any, Any]] = []
        for i, group in enumerate(self.optimizer.param_groups):
            for k, v in group.items():
                if k not in _NOT_SAVED:
                    out.append((f"param_groups.{i}.{k}", None, (i, k), v))
        blank = None
        for e in self.entries:
            if e.param.dtype.itemsize < 4:              # 16-bit: the master is kept apart
                out.append((f"master.{e.fqn}", e, None, self._dtensor(e, e.master.detach())))
            state = self.optimizer.state.get(e.master)
            if not state:
                blank = self._blank_state() if blank is None else blank
                state = blank[e.fqn]
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    if v.shape != e.master.shape:
                        raise AutoshardError(
                            "optimizer state shaped like the parameter's shard, or scalar",
                            got=f"{type(self.optimizer).__name__} state {k!r} of {e.fqn} of "
                                f"shape {tuple(v.shape)} beside a shard of "
                                f"{tuple(e.master.shape)}",
                            fix="use an optimizer with elementwise state (Adam, AdamW, SGD...) "
                                "or save opt.state_dict() per rank")
                    v = self._dtensor(e, v)
                out.append((f"state.{e.fqn}.{k}", e, k, v))
        return out

    def _dtensor(self, e: _Entry, local: torch.Tensor) -> Any:
        """``local`` as the DTensor of ``e``'s global shape and state placements. Built directly
        rather than with ``DTensor.from_local``, which would copy offloaded (host) state to the
        mesh's device: the DTensor keeps the host tensor, on the device mesh, as FSDP2's CPU
        offload builds its sharded parameters (torch.distributed.fsdp, ``_from_local_no_grad``),
        and DCP reads and writes it in place."""
        refuse_strided(e.fqn, e.spec)
        return dtensor_in_place(local, self.pm.groups.device_mesh, e.placements, e.shape)

    def _incoming(self, key: str, e: _Entry | None, target: Any, value: Any) -> Any:
        """This rank's part of ``value`` loaded for ``target``, checked."""
        from torch.distributed.tensor import DTensor
        fix = ("fill opt.sharded_state_dict() with torch.distributed.checkpoint.load (it lays "
               "the state out for this plan) from a checkpoint of the same model")
        if isinstance(target, DTensor):
            assert e is not None
            if not isinstance(value, torch.Tensor):
                raise AutoshardError(f"{key}: a tensor of global shape {e.shape}",
                                     got=type(value).__name__, fix=fix)
            if tuple(value.shape) != e.shape:
                raise AutoshardError(f"{key} of global shape {e.shape}, the parameter's",
                                     got=f"global shape {tuple(value.shape)}", fix=fix)
            if isinstance(value, DTensor):
                if tuple(value.placements) != tuple(target.placements):
                    raise AutoshardError(
                        f"{key} laid out as this plan keeps it ({list(target.placements)})",
                        got=f"placements {list(value.placements)}", fix=fix)
                return value.to_local()
            groups = self.pm.groups            # a full tensor: this rank's part of it
            return _slice(shard_tensor(value, e.spec, groups.shape, groups.coords), e.dim, e.cut)
        if isinstance(target, torch.Tensor):
            t = torch.as_tensor(value)
            if t.shape != target.shape:
                raise AutoshardError(f"{key}: a tensor of shape {tuple(target.shape)}",
                                     got=f"shape {tuple(t.shape)}", fix=fix)
            return t
        return value

    def _blank_state(self) -> dict[str, dict[str, Any]]:
        """Per parameter, the state the wrapped optimizer's first step creates, zero-filled. Its
        keys, dtypes and shapes come from one step of a scratch copy of the optimizer over meta
        tensors (no memory, no arithmetic); scalars sit where the optimizer keeps them (the
        host, or the parameter's device when capturable or fused, as torch.optim.Adam does)."""
        opt = self.optimizer
        accepted = inspect.signature(type(opt).__init__).parameters
        kwargs = {k: v for k, v in opt.defaults.items() if k in accepted}   # the groups hold
        kwargs.update({k: v for k, v in (("foreach", False), ("fused", None),   # the rest
                                         ("capturable", False)) if k in accepted})
        metas: dict[int, torch.Tensor] = {}
        groups = []
        for group in opt.param_groups:
            params = []
            for m in group["params"]:
                t = torch.nn.Parameter(torch.empty_like(m, device="meta"))
                t.grad = torch.empty_like(t)
                metas[id(m)] = t
                params.append(t)
            groups.append({**{k: v for k, v in group.items() if k not in _NOT_SAVED},
                           "params": params})
        try:
            scratch = type(opt)(groups, **kwargs)
            with torch.no_grad():
                scratch.step()
        except Exception as exc:  # noqa: BLE001 (any optimizer's failure is reported)
            raise AutoshardError(
                "an optimizer whose first step can be laid out on meta tensors before it runs",
                got=f"{type(opt).__name__}: {type(exc).__name__}: {exc}",
                fix="take one optimizer step before opt.sharded_state_dict() for dcp.load") from exc
        out: dict[str, dict[str, Any]] = {}
        for e in self.entries:
            group = next(g for g in opt.param_groups if any(p is e.master for p in g["params"]))
            on_device = bool(group.get("capturable") or group.get("fused"))
            state = {}
            for k, v in scratch.state[metas[id(e.master)]].items():
                if isinstance(v, torch.Tensor):
                    device = e.master.device if on_device or v.device.type == "meta" else v.device
                    v = torch.zeros(v.shape, dtype=v.dtype, device=device)
                state[k] = v
            out[e.fqn] = state
        return out

