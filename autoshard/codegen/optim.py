"""The optimizer a plan's state placements need: ``pm.optimizer(torch.optim.AdamW, lr=3e-4)``.

docs/cost-model.md §9 and cost/state.py. It wraps any torch.optim optimizer class and runs it on
what the plan says each rank keeps, as the step program's optimizer records say it
(cost/program.py ``ParamUpdate``, the records the plan's memory figures read; ``records``
below): which parameters are stepped, which keep an fp32 master apart, the layout their state
is cut in and whether it lives on the host. Nothing of that is decided here again:

- a parameter whose state follows it (plain data parallelism, tensor parallelism, ZeRO-3): the
  optimizer steps the local shard itself when it is fp32, or an fp32 master copy of it when it
  is 16-bit (mixed precision: Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740),
  written back rounded after each step;
- zero1 / zero2 / offload: an fp32 master of this rank's slice of the local shard (the optimizer
  state's placement, cut along the state dim over the zero axes), on the host for offload. Its
  gradient is the slice of ``.grad`` (zero1) or the shard a reduce-scatter bucket left
  (codegen/buckets.py); after the step the updated slices are all-gathered back into the
  parameter (phase "optimizer" of the plan's collectives, counted in the ledger). Under
  offload the gradient shard goes down to the host and the updated shard (cast to the
  parameter's dtype there) comes back up, each copy counted in the ledger's host records.
- offload_params (parameter offload): as offload, but the parameter and its gradient are on
  the host already (codegen/runtime.py, codegen/rewrite.py): the step reads the gradient and
  writes the host parameter where they lie; only a shard cut apart from its parameter (a
  replicated one) goes up to be all-gathered, and the gathered parameter comes back down.

It is a ``torch.optim.Optimizer`` sharing the wrapped optimizer's ``param_groups`` and
``state``, so torch's learning-rate schedulers and step hooks work on it. ``state_dict`` is the
wrapped optimizer's (this rank's shards) with the layout they were cut by; ``load_state_dict``
refuses a state of another layout. An optimizer whose update is not elementwise (``ELEMENTWISE``
lists the torch classes that are) is refused where a parameter or its state is a shard. ``sharded_state_dict`` and
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
import weakref
from typing import Any, Callable

import torch

from autoshard.codegen import hostopt
from autoshard.codegen.collectives import apply_steps
from autoshard.codegen.optimlayout import (  # noqa: F401 (_cut, _placements: runtime.py)
    _Entry, _cut, _placements, _slice, entries, records)
from autoshard.errors import AutoshardError
from autoshard.ir import Shard, Spec, spec_str
from autoshard.ops.simulate import shard_tensor


# Parameters whose gradients only a ShardedOptimizer reads right (held apart by a bucket), so a
# plain torch optimizer over them is refused instead of silently skipping them.
# (By id: tensors compare elementwise, so a WeakSet of them cannot test membership.)
_NEEDS_SHARDED: dict[int, "weakref.ref[torch.Tensor]"] = {}
_OWNED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
# param_groups entries that are not hyperparameters: the parameters, and how this process steps.
_NOT_SAVED = frozenset({"params", "param_names", "foreach", "fused", "capturable",
                        "differentiable"})
_HOOKED = False


def _guard(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _OWNED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            ref = _NEEDS_SHARDED.get(id(p))
            if ref is not None and ref() is p:
                raise AutoshardError(
                    "the optimizer of a plan that shards gradients or optimizer state apart from "
                    "the parameters (ZeRO-1/2, offload) to come from pm.optimizer(...)",
                    got=f"{type(optimizer).__name__} over the module's parameters",
                    fix="opt = pm.optimizer(torch.optim.AdamW, lr=...) (it wraps the class)")


def watch(params: list[torch.Tensor]) -> None:
    global _HOOKED
    if not _HOOKED:
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        register_optimizer_step_pre_hook(_guard)
        _HOOKED = True
    for p in params:
        _NEEDS_SHARDED[id(p)] = weakref.ref(p)


# Optimizers whose update of an element reads only that element's gradient and state: stepping a
# shard equals the shard of the whole step. Others (Adafactor's factored moments, LAMB/LARS trust
# ratios, Shampoo, Muon, LBFGS's line search) read statistics of a whole parameter.
ELEMENTWISE: tuple[type, ...] = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop)
LAYOUT_KEY = "autoshard_layout"


class ShardedOptimizer(torch.optim.Optimizer):
    """``optimizer_cls(**kwargs)`` over this rank's share of the optimizer state.

    A ``torch.optim.Optimizer``: ``param_groups`` and ``state`` are the wrapped optimizer's own
    (the fp32 masters, or the parameters themselves where they are their own masters), so every
    ``torch.optim.lr_scheduler`` sets its learning rates and step hooks run as torch defines
    them."""

    def __init__(self, pm: Any, optimizer_cls: Callable[..., torch.optim.Optimizer], *,
                 elementwise: bool | None = None, **kwargs: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise AutoshardError("a torch.optim.Optimizer class", got=repr(optimizer_cls),
                                 fix="pm.optimizer(torch.optim.AdamW, lr=3e-4)")
        self.pm = pm
        self.entries = entries(pm)
        if not self.entries:
            raise AutoshardError("a module with parameters to train (requires_grad=True)",
                                 got="none on this rank", fix="unfreeze a parameter")
        _refuse_whole_tensor_math(optimizer_cls, elementwise, self.entries)
        masters = [e.master for e in self.entries]
        if _fused_by_default(optimizer_cls, kwargs, masters):
            kwargs = {**kwargs, "fused": True}
        self.optimizer = optimizer_cls(masters, **kwargs)
        _OWNED.add(self.optimizer)
        _OWNED.add(self)
        # torch.optim.Optimizer's bookkeeping (hook tables, the step wrapper the schedulers
        # count calls through), then the wrapped optimizer's groups and state as ours: one
        # object each, so a scheduler's lr is what the wrapped step reads.
        super().__init__(masters, dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults
        # The optimizer-offloaded masters' fused host step, overlapped (codegen/hostopt.py).
        self.host = hostopt.attach(self)

    # -- the torch.optim surface ---------------------------------------------------------------
    def layout(self) -> list[list]:
        """What this rank's state is, per parameter: its name, global shape, the state's DTensor
        placements, where it lives and this rank's mesh coordinates. ``state_dict()`` carries
        it; ``load_state_dict`` refuses a state saved under another layout."""
        coords = list(self.pm.groups.coords)
        return [[e.fqn, list(e.shape), [str(p) for p in e.placements],
                 e.master.device.type, list(e.master.shape), coords] for e in self.entries]

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
        if saved != mine:
            names = ("name", "global shape", "placements", "device", "local shape",
                     "mesh coordinates")
            for a, b in zip(saved, mine):
                i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                if i is not None:
                    raise AutoshardError(
                        f"optimizer state laid out as this optimizer keeps {b[0]}: "
                        f"{names[i]} {b[i]}", got=f"state of {a[0]} saved with {names[i]} {a[i]}",
                        fix=fix)
            raise AutoshardError(f"state for the {len(mine)} parameters this optimizer steps",
                                 got=f"state for {len(saved)}", fix=fix)
        self.optimizer.load_state_dict({k: v for k, v in state_dict.items() if k != LAYOUT_KEY})
        # (torch's load_state_dict builds new groups and state: share them again)
        self.param_groups, self.state = self.optimizer.param_groups, self.optimizer.state

    @torch.no_grad()
    def settle(self) -> None:
        """Finish a host step still running (``offload_overlap="delayed"``, codegen/hostopt.py)
        and write its parameters back, so that the state and the parameters agree."""
        if self.host is not None:
            self.host.flush(self._write_back)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.pm.zero_grad(set_to_none=set_to_none)
        if self.pm.runtime.buckets is not None:
            self.pm.runtime.buckets.shards.clear()
        for e in self.entries:
            if e.master is not e.param:
                e.master.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.settle()         # the delayed host step, before anything reads the masters
        held = self.pm.held_grads()
        if held:
            raise AutoshardError(
                "gradients synced before the optimizer steps",
                got=f"{len(held)} held unsynced by pm.no_sync(): {_names(held)}",
                fix="run the last micro-batch's pm.step(...) outside `with pm.no_sync():`")
        self._recut_masters()
        # The casts between 16-bit parameters and their fp32 masters, grouped into one
        # multi-tensor copy each way where the two sit on the same device (one kernel launch per
        # group instead of one per parameter: on a GPU the launches were half the step).
        apart = [e for e in self.entries if e.master is not e.param]
        grads = [(e, g) for e in apart if (g := self.grad_shard(e)) is not None]
        for e in apart:
            e.master.grad = None
        if self.host is not None:       # stepped on the host while the rest steps here
            self.pm.runtime.host.settle()
            self.host.start([(e, g) for e, g in grads if self.host.owns(e)], self._write_back)
            grads = [(e, g) for e, g in grads if not self.host.owns(e)]
        grads = self._grads_to_host(grads)
        local = [(e, g) for e, g in grads
                 if g.device == e.master.device and g.dtype != e.master.dtype]
        if local:
            bufs = [torch.empty_like(e.master) for e, _ in local]
            torch._foreach_copy_(bufs, [g for _, g in local])
            for (e, _), b in zip(local, bufs):
                e.master.grad = b
        for e, g in grads:
            if e.master.grad is None:        # already fp32 here: no copy; else to the host
                # A fused kernel reads its tensors as dense: a slice of .grad across a dim
                # other than the first is copied out.
                e.master.grad = g.to(e.master.device, torch.float32).contiguous()
        self.optimizer.step()
        stepped = [e for e in apart if e.master.grad is not None]
        plain = [e for e in stepped if not e.gather and e.mode != "offload"
                 and e.master.device == e.param.device]
        if plain:
            torch._foreach_copy_([e.param for e in plain], [e.master.detach() for e in plain])
        done = {id(e) for e in plain}
        for e in stepped:
            if id(e) not in done:
                self._write_back(e, e.master.detach())
            e.seen = e.param._version
        if self.host is not None:
            self.host.finish(self._write_back)
        return loss

    def _write_back(self, e: _Entry, new: torch.Tensor) -> None:
        """The updated master ``new`` of ``e`` into its parameter."""
        ledger = self.pm.runtime.ledger
        if e.on_host:
            # Cast on the host; up the link only what the device needs: offload's updated
            # shard, or parameter offload's shard to be gathered.
            new = new.to(e.param.dtype)
            if e.mode == "offload" or e.gather:
                ledger.add_host("h2d", new, "optimizer", "optimizer", e.placeholder)
                new = self.pm.runtime.host.up(new, e.placeholder, self.pm.runtime.device)
        else:
            new = new.to(e.param.device, e.param.dtype)
        if e.gather:
            new = apply_steps(new, e.gather, self.pm.groups, ledger=ledger,
                              phase="optimizer", node="optimizer")
            if e.mode == "offload_params":     # the gathered parameter to its host copy
                ledger.add_host("d2h", new, "optimizer", "optimizer", e.placeholder)
                new = new.to(e.param.device)
        e.param.copy_(new)
        e.seen = e.param._version

    # -- the host side of offload (one boundary: what crosses the host link) ------------------
    def _grads_to_host(self, grads: list[tuple[_Entry, torch.Tensor]]
                       ) -> list[tuple[_Entry, torch.Tensor]]:
        """Offload: each gradient shard goes down to the host in its own dtype (cast there);
        the others as they are. Copies still in flight are settled before and after."""
        ledger, host = self.pm.runtime.ledger, self.pm.runtime.host
        host.settle()        # copies over the host link still in flight (codegen/hostlink.py)
        out = []
        for e, g in grads:
            if e.mode == "offload":
                ledger.add_host("d2h", g, "optimizer", "optimizer", e.placeholder)
                g = host.down(g, e.placeholder + ":grad") if g.is_cuda else g.to(e.master.device)
            out.append((e, g))
        host.settle()
        return out

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
        unexpected = [k for k in sd if isinstance(k, str) and k.startswith("state.")
                      and k not in want]
        if unexpected:
            raise AutoshardError(
                "only the state entries this optimizer keeps",
                got=f"{len(unexpected)} others: {_names(unexpected)}",
                fix="load with the optimizer class and options it was saved with (e.g. amsgrad)")
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
            if e.param.dtype != torch.float32:          # 16-bit: the master is kept apart
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

    def _recut_masters(self, force: bool = False) -> None:
        """An fp32 parameter's master kept apart (ZeRO-1/2, offload) is its slice of the
        parameter: cut it again when the parameter was written other than by ``step`` (a load,
        ``pm.load_full_state_dict``), as the parameter's version counter tells."""
        with torch.no_grad():
            for e in self.entries:
                if e.master is e.param or e.param.dtype != torch.float32:
                    continue
                if force or e.param._version != e.seen:
                    e.master.copy_(_slice(e.param.detach(), e.dim, e.cut))
                    e.seen = e.param._version

    def grad_shard(self, e: _Entry) -> torch.Tensor | None:
        """This rank's gradient for ``e``'s master: the bucket's shard and/or the slice of
        ``.grad`` (reads of the parameter outside its bucket add theirs there, as autograd
        does)."""
        buckets = self.pm.runtime.buckets
        g = buckets.shards.get(e.placeholder) if buckets is not None else None
        if e.param.grad is not None:
            part = _slice(e.param.grad, e.dim, e.cut)
            g = part if g is None else g + part
        return g


def _refuse_whole_tensor_math(optimizer_cls: type, elementwise: bool | None,
                              entries: list[_Entry]) -> None:
    """An optimizer whose math reads whole parameters, on shards, would compute its statistics
    per shard (Adafactor's row and column means, a trust ratio's norms): refuse it where any
    parameter or its state is a shard, naming them. ``elementwise`` overrides the class test
    (True for a custom optimizer known to be elementwise)."""
    if elementwise is None:
        elementwise = issubclass(optimizer_cls, ELEMENTWISE)
    if elementwise:
        return
    cut = [e.fqn for e in entries if e.dim is not None or any(isinstance(p, Shard) for p in e.spec)]
    if cut:
        raise AutoshardError(
            f"an optimizer whose update is elementwise ({', '.join(c.__name__ for c in ELEMENTWISE[:5])}"
            f", ...) where the plan shards parameters or their optimizer state",
            got=f"{optimizer_cls.__name__}, whose update reads statistics of a whole parameter "
                f"(not one of the elementwise optimizers), over the shards of {len(cut)} "
                f"parameters: {_names(cut)}: it would compute them per shard",
            fix="plan with these parameters and their state replicated (zero='none', no tensor "
                "parallelism), or, if the class's update is elementwise, pass elementwise=True")


def _fused_by_default(optimizer_cls: type, kwargs: dict, masters: list[torch.Tensor]) -> bool:
    """Whether to step with the optimizer's fused kernel, as the plan prices it
    (docs/cost-model.md §9: one pass reading the gradient, the master and the moments, writing
    the last three): where the class has one, the caller chose no implementation (``fused`` or
    ``foreach``), and every master is a float on a device torch fuses for (torchtitan's default
    too). PyTorch's own default, foreach, streams about three times the bytes."""
    if "fused" not in inspect.signature(optimizer_cls.__init__).parameters:
        return False
    if kwargs.keys() & {"fused", "foreach"} or not masters:
        return False
    try:
        from torch.optim.optimizer import _get_fused_kernels_supported_devices
        devices = set(_get_fused_kernels_supported_devices())
    except ImportError:                 # a torch without the helper: the two we test on
        devices = {"cuda", "cpu"}
    return all(m.dtype.is_floating_point and m.device.type in devices for m in masters)


def refuse_strided(fqn: str, spec: Spec) -> None:
    """torch.distributed.checkpoint describes a rank's part of a tensor as one box; a strided
    shard (ir.py) is one box per group, which DCP refuses as overlapping chunks. Say so."""
    if any(isinstance(p, Shard) and p.groups for p in spec):
        raise AutoshardError(
            f"{fqn}: parameters DCP can describe (one box of the global tensor per rank)",
            got=f"a strided shard {spec_str(spec)} (a fused projection, each rank its part of "
                f"every group)",
            fix="save with pm.full_state_dict() / load_full_state_dict(), or plan with "
                "pins={...: contiguous spec} for this parameter")


def dtensor_in_place(local: torch.Tensor, device_mesh: Any, placements: tuple,
                     shape: tuple[int, ...]) -> Any:
    """``local`` as the DTensor of global ``shape`` and ``placements``, the tensor itself
    wherever it lies: ``DTensor.from_local`` would copy a host tensor to the mesh's device. As
    FSDP2's CPU offload builds its sharded parameters (torch.distributed.fsdp,
    ``_from_local_no_grad``); DCP reads and writes it in place."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta),
                   requires_grad=False)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


def _names(keys: list[str]) -> str:
    return ", ".join(keys[:5]) + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")
