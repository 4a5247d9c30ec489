"""The optimizer a plan's state placements need: ``pm.optimizer(torch.optim.AdamW, lr=3e-4)``.

docs/cost-model.md §9 and cost/state.py. It wraps any torch.optim optimizer class and runs it on
what the plan says each rank keeps:

- a parameter whose state follows it (plain data parallelism, tensor parallelism, ZeRO-3): the
  optimizer steps the local shard itself when it is fp32, or an fp32 master copy of it when it
  is 16-bit (mixed precision: Micikevicius et al., "Mixed Precision Training", arXiv 1710.03740),
  written back rounded after each step;
- zero1 / zero2 / offload: an fp32 master of this rank's slice of the local shard (the optimizer
  state's placement, cut along the state dim over the zero axes), on the host for offload. Its
  gradient is the slice of ``.grad`` (zero1) or the shard a reduce-scatter bucket left
  (codegen/buckets.py); after the step the updated slices are all-gathered back into the
  parameter (phase "optimizer" of the plan's collectives, counted in the ledger).

``step``, ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``param_groups`` behave as the
wrapped optimizer's (its state dict holds this rank's shards).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from autoshard.codegen.collectives import apply_steps
from autoshard.cost.comm import reshard
from autoshard.errors import AutoshardError
from autoshard.ir import Shard, Spec


@dataclass
class _Entry:
    fqn: str
    placeholder: str
    param: torch.nn.Parameter
    master: torch.Tensor            # what the wrapped optimizer steps (may be ``param`` itself)
    dim: int | None                 # the state dim, when the state is a slice of the local shard
    cut: tuple[tuple[int, int], ...]   # (number of pieces, this rank's piece) per zero axis
    gather: tuple                   # the steps bringing the updated slice back (all-gathers)
    sharded_grad: bool              # zero2/offload: the gradient arrives as a shard


# Parameters whose gradients only a ShardedOptimizer reads right (held apart by a bucket), so a
# plain torch optimizer over them is refused instead of silently skipping them.
# (By id: tensors compare elementwise, so a WeakSet of them cannot test membership.)
_NEEDS_SHARDED: dict[int, "weakref.ref[torch.Tensor]"] = {}
_OWNED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
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


class ShardedOptimizer:
    """``optimizer_cls(**kwargs)`` over this rank's share of the optimizer state."""

    def __init__(self, pm: Any, optimizer_cls: Callable[..., torch.optim.Optimizer],
                 **kwargs: Any) -> None:
        if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
            raise AutoshardError("a torch.optim.Optimizer class", got=repr(optimizer_cls),
                                 fix="pm.optimizer(torch.optim.AdamW, lr=3e-4)")
        self.pm = pm
        plan, groups = pm.plan, pm.groups
        self.entries: list[_Entry] = []
        for fqn, p in pm.local_parameters().items():
            if not p.requires_grad:
                continue
            ph = pm._param_ph[fqn]
            st = plan.param_state.get(fqn)
            spec = plan.params[fqn]
            if st is None or st.optimizer == spec:
                dim, cut, gather = None, (), ()
                host = st is not None and st.offload
            else:
                dim, cut = _cut(spec, st.optimizer, groups.shape, groups.coords)
                shape = pm.traced.placeholder(ph).info.shape
                gather = reshard(tuple(st.optimizer), tuple(spec), tuple(shape),
                                 p.element_size(), tuple(groups.shape)).forward
                host = st.offload
            src = pm.master_source.pop(fqn, None)      # bf16-mixed: the fp32 weight
            local = _slice(p.detach() if src is None else src, dim, cut)
            if dim is None and not host and p.dtype == torch.float32:
                master = p                       # an fp32 parameter is its own master
            else:
                master = torch.nn.Parameter(local.to(torch.device("cpu") if host else p.device,
                                                     torch.float32, copy=True))
            sharded = st is not None and st.mode in ("zero2", "offload") and dim is not None
            self.entries.append(_Entry(fqn, ph, p, master, dim, cut, gather, sharded))
        self.optimizer = optimizer_cls([e.master for e in self.entries], **kwargs)
        _OWNED.add(self.optimizer)

    # -- the torch.optim surface ---------------------------------------------------------------
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.optimizer.load_state_dict(sd)

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
        for e in self.entries:
            if e.master is e.param:
                continue
            g = self.grad_shard(e)
            e.master.grad = None if g is None else g.to(e.master.device, torch.float32)
        self.optimizer.step()
        ledger = self.pm.runtime.ledger
        for e in self.entries:
            if e.master is e.param or e.master.grad is None:
                continue
            new = e.master.detach().to(e.param.device, e.param.dtype)
            if e.gather:
                new = apply_steps(new, e.gather, self.pm.groups, ledger=ledger,
                                  phase="optimizer", node="optimizer")
            e.param.copy_(new)
        return loss

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


def _cut(spec: Spec, state: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]
         ) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The state dim and, per zero axis in order (row-major, the first outermost), the number of
    pieces and this rank's piece."""
    axes = [a for a, (p, q) in enumerate(zip(spec, state)) if p != q]
    dims = {state[a].dim for a in axes if isinstance(state[a], Shard)}
    if len(dims) != 1 or len(axes) != sum(isinstance(state[a], Shard) for a in axes):
        raise AutoshardError("optimizer placements that shard one dim over the parameter's "
                             "replicated axes", got=f"{spec} -> {state}",
                             fix="re-plan: the plan file was edited or is damaged")
    return dims.pop(), tuple((mesh_shape[a], coords[a]) for a in axes)


def _slice(t: torch.Tensor, dim: int | None, cut: tuple[tuple[int, int], ...]) -> torch.Tensor:
    for n, r in cut:
        t = t.chunk(n, dim)[r]
    return t
