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
``state``, so torch's learning-rate schedulers and step hooks work on it. An optimizer whose
update is not elementwise (``ELEMENTWISE`` lists the torch classes that are) is refused where a
parameter or its state is a shard. Its state dicts, this rank's and the DTensors of
torch.distributed.checkpoint, are codegen/optimstate.py's.
"""
from __future__ import annotations

import inspect
import warnings
import weakref
from typing import Any, Callable

import torch

from autoshard.codegen import earlystep, hostopt
from autoshard.codegen.collectives import apply_steps
# Re-exported where callers have long imported them from here: the DTensor helpers
# (codegen/dtensors.py), the layout's cut (tests) and the state dicts' layout key.
from autoshard.codegen.dtensors import (  # noqa: F401
    contiguous_stride, dtensor_in_place, refuse_strided)
from autoshard.codegen.optimlayout import (  # noqa: F401
    _Entry, _cut, _names, _placements, _slice, entries, grouped, pieces, records)
from autoshard.codegen.optimstate import LAYOUT_KEY, OptimizerStateDicts  # noqa: F401
from autoshard.errors import AutoshardError
from autoshard.ir import Phase, Shard, StateMode


# Parameters whose gradients only a ShardedOptimizer reads right (held apart by a bucket), so a
# plain torch optimizer over them is refused instead of silently skipping them.
# (By id: tensors compare elementwise, so a WeakSet of them cannot test membership.)
_NEEDS_SHARDED: dict[int, "weakref.ref[torch.Tensor]"] = {}
_OWNED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOKED = False
# The latest ShardedOptimizer of each module: the only one whose hooks step parameters in
# backward (hostopt.py, earlystep.py). An earlier one, kept alive by its hooks if by nothing
# else, would otherwise go on stepping them on every backward, under its own settings.
_LATEST: "weakref.WeakKeyDictionary[Any, ShardedOptimizer]" = weakref.WeakKeyDictionary()


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


class ShardedOptimizer(OptimizerStateDicts, torch.optim.Optimizer):
    """``optimizer_cls(**kwargs)`` over this rank's share of the optimizer state.

    A ``torch.optim.Optimizer``: ``param_groups`` and ``state`` are the wrapped optimizer's own
    (the fp32 masters, or the parameters themselves where they are their own masters), so every
    ``torch.optim.lr_scheduler`` sets its learning rates and step hooks run as torch defines
    them."""

    def __init__(self, pm: Any, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 params: Any = None, *, elementwise: bool | None = None,
                 **kwargs: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise AutoshardError("a torch.optim.Optimizer class", got=repr(optimizer_cls),
                                 fix="pm.optimizer(torch.optim.AdamW, lr=3e-4)")
        self.pm = pm
        self.entries = entries(pm)
        if not self.entries:
            raise AutoshardError("a module with parameters to train (requires_grad=True)",
                                 got="none on this rank", fix="unfreeze a parameter")
        _refuse_whole_tensor_math(optimizer_cls, elementwise, self.entries)
        groups = [{**g, "params": [e.master for e in g["params"]]}
                  for g in grouped(pm, self.entries, params)]
        masters = [e.master for e in self.entries]
        if _fused_by_default(optimizer_cls, {k: v for g in groups for k, v in g.items()
                                             if k != "params"} | kwargs, masters):
            kwargs = {**kwargs, "fused": True}
        self.optimizer = optimizer_cls(groups, **kwargs)
        _OWNED.add(self.optimizer)
        _OWNED.add(self)
        # torch.optim.Optimizer's bookkeeping (hook tables, the step wrapper the schedulers
        # count calls through), then the wrapped optimizer's groups and state as ours: one
        # object each, so a scheduler's lr is what the wrapped step reads.
        super().__init__(masters, dict(self.optimizer.defaults))
        self.param_groups = self.optimizer.param_groups
        self.state = self.optimizer.state
        self.defaults = self.optimizer.defaults
        self._built = True
        if elementwise is None:
            elementwise = issubclass(optimizer_cls, ELEMENTWISE)
        # The optimizer-offloaded masters' fused host step, overlapped (codegen/hostopt.py),
        # and under offload_overlap="backward" the device's steps in backward (earlystep.py).
        self.host = hostopt.attach(self)
        self.early = earlystep.attach(self, elementwise)
        previous = _LATEST.get(pm)
        if previous is not None:
            previous.unhook()
        _LATEST[pm] = self
        # The device's update after backward in the step program's pieces (cost/program.py
        # PIECE_BYTES); an optimizer not known to update each parameter on its own steps them
        # all at once.
        self.pieces = pieces(pm, self.entries, frozenset(
            e.placeholder for e in self.early.entries) if self.early is not None else frozenset())
        if len(self.pieces) > 1 and not elementwise:
            warnings.warn(
                f"{optimizer_cls.__name__} is not known to update each parameter from its own "
                f"state alone, so it steps every parameter in one call: the fp32 casts of all "
                f"16-bit gradients are alive at once, above the plan's memory figure (its "
                f"{len(self.pieces)} pieces of the update, docs/cost-model.md §4.5); pass "
                f"elementwise=True if its update is elementwise", stacklevel=2)
            self.pieces = []
        self._piece_of = {id(e): k for k, piece in enumerate(self.pieces) for e in piece}

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch.optim.Optimizer's, while it builds this optimizer; refused after: the groups
        are given to ``pm.optimizer(...)`` (each trainable parameter is in one from the start,
        with its master and state laid out)."""
        if not self.__dict__.get("_built"):
            return super().add_param_group(param_group)
        raise AutoshardError(
            "every parameter group given when the optimizer is built",
            got="opt.add_param_group(...) on pm.optimizer(...)'s optimizer",
            fix="pass the groups as pm.optimizer(torch.optim.AdamW, [{'params': ...}, ...], "
                "lr=...); to train a frozen parameter, set requires_grad before planning")

    def unhook(self) -> None:
        """Step nothing in backward any more (a later optimizer of the module took over)."""
        for part in (self.host, self.early):
            if part is not None:
                part.unhook()

    # -- the torch.optim surface ---------------------------------------------------------------
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
        if self.early is not None:           # (stepped in backward: nothing left to step)
            self.early.done.clear()
        held = self.pm.held_grads()
        if held:
            raise AutoshardError(
                "gradients synced before the optimizer steps",
                got=f"{len(held)} held unsynced by pm.no_sync(): {_names(held)}",
                fix="run the last micro-batch's pm.step(...) outside `with pm.no_sync():`")
        self._recut_masters()
        apart = [e for e in self.entries if e.master is not e.param]
        grads = [(e, g) for e in apart if (g := self.grad_shard(e)) is not None]
        for e in apart:
            e.master.grad = None
        if self.host is not None:       # stepped on the host while the rest steps here
            self.pm.runtime.host.settle()
            self.host.start([(e, g) for e, g in grads if self.host.owns(e)], self._write_back)
            grads = [(e, g) for e, g in grads if not self.host.owns(e)]
        grads = self._grads_to_host(grads)
        # The update piece by piece (the step program's pieces, cost/program.py
        # OptimizerStep.pieces): a piece's gradients are cast for its masters just before its
        # update and freed after it, so one piece's casts are alive at a time. A parameter that
        # is its own master shows its gradient to its own piece's update only.
        n = max(1, len(self.pieces))
        by_piece: list[list[tuple[_Entry, torch.Tensor]]] = [[] for _ in range(n)]
        for e, g in grads:
            by_piece[self._piece_of.get(id(e), 0)].append((e, g))
        own: list[list[tuple[_Entry, torch.Tensor]]] = [[] for _ in range(n)]
        if n > 1:
            for e in self.entries:
                if e.master is e.param and e.param.grad is not None:
                    own[self._piece_of.get(id(e), 0)].append((e, e.param.grad))
                    e.param.grad = None
        for piece, mine in zip(by_piece, own):
            for e, g in mine:
                e.param.grad = g
            self._update(piece)
            for e, _ in mine:
                e.param.grad = None
        for e, g in (x for mine in own for x in mine):
            e.param.grad = g
        if self.host is not None:
            self.host.finish(self._write_back)
        return loss

    def _update(self, grads: list[tuple[_Entry, torch.Tensor]]) -> None:
        """One piece's update: ``grads`` as the fp32 gradients of their masters, the wrapped
        optimizer's step over them (and over the parameters that are their own masters whose
        gradients are set), the updated masters written back, the casts freed."""
        # The casts between 16-bit parameters and their fp32 masters, grouped into one
        # multi-tensor copy each way where the two sit on the same device (one kernel launch per
        # group instead of one per parameter: on a GPU the launches were half the step).
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
                e.master.grad = g.to(e.master.device, e.master.dtype).contiguous()
        self.optimizer.step()
        stepped = [e for e, _ in grads]
        plain = [e for e in stepped if not e.gather and e.mode != StateMode.OFFLOAD
                 and e.master.device == e.param.device]
        if plain:
            torch._foreach_copy_([e.param for e in plain], [e.master.detach() for e in plain])
        done = {id(e) for e in plain}
        for e in stepped:
            if id(e) not in done:
                self._write_back(e, e.master.detach())
            e.seen = e.param._version
            e.master.grad = None

    def _write_back(self, e: _Entry, new: torch.Tensor) -> None:
        """The updated master ``new`` of ``e`` into its parameter."""
        ledger = self.pm.runtime.ledger
        if e.on_host:
            # Cast on the host; up the link only what the device needs: offload's updated
            # shard, or parameter offload's shard to be gathered.
            new = new.to(e.param.dtype)
            if e.mode == StateMode.OFFLOAD or e.gather:
                ledger.add_host("h2d", new, Phase.OPTIMIZER, "optimizer", e.placeholder)
                new = self.pm.runtime.host.up(new, e.placeholder, self.pm.runtime.device)
        else:
            new = new.to(e.param.device, e.param.dtype)
        if e.gather:
            new = apply_steps(new, e.gather, self.pm.groups, ledger=ledger,
                              phase=Phase.OPTIMIZER, node="optimizer")
            if e.mode == StateMode.OFFLOAD_PARAMS:     # the gathered parameter to its host copy
                ledger.add_host("d2h", new, Phase.OPTIMIZER, "optimizer", e.placeholder)
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
            if e.mode == StateMode.OFFLOAD:
                ledger.add_host("d2h", g, Phase.OPTIMIZER, "optimizer", e.placeholder)
                g = host.down(g, e.placeholder + ":grad") if g.is_cuda else g.to(e.master.device)
            out.append((e, g))
        host.settle()
        return out

    def _recut_masters(self, force: bool = False) -> None:
        """An fp32 (or fp64) parameter's master kept apart (ZeRO-1/2, offload) is its slice of the
        parameter: cut it again when the parameter was written other than by ``step`` (a load,
        ``pm.load_full_state_dict``), as the parameter's version counter tells."""
        with torch.no_grad():
            for e in self.entries:
                if e.master is e.param or e.param.dtype.itemsize < 4:
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


def released_grads(pm: Any) -> dict[str, torch.Tensor]:
    """The gradients of ``pm``'s parameters that left the device in this backward (on the host,
    as they landed: codegen/hostopt.py), by name; empty once the optimizer has stepped them."""
    host = getattr(_LATEST.get(pm), "host", None)
    if host is None:
        return {}
    return {key.fqn: g for key in host.released.values()
            if (g := host.landed_grad(key)) is not None}


def stepped(pm: Any) -> list[str]:
    """The parameters of ``pm`` stepped on the device in this backward, their gradients gone
    (codegen/earlystep.py); empty once the optimizer has stepped."""
    early = getattr(_LATEST.get(pm), "early", None)
    return sorted(e.fqn for e in early.done.values()) if early is not None else []


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



