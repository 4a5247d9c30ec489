"""The device's share of ``offload_overlap="backward"`` (docs/cost-model.md §9.1): a parameter
whose whole gradient is its ``.grad`` and whose optimizer state is on the device is stepped the
moment autograd completes that gradient, from a post-accumulate-grad hook, and the gradient is
freed there (cost/program.py ``steps_in_backward``, the step program's ``released``, where the
liveness walk frees it too). Its offloaded twin is codegen/hostopt.py, which copies such a
gradient down and steps it on the host. Together they leave no gradient of these parameters on
the device at the end of backward, the peak of an offloaded plan on one GPU.

This is PyTorch's optimizer-in-backward pattern (the post-accumulate-grad hook's own example:
step, then free the gradient). The update is the wrapped torch optimizer's own step over that
one parameter (its param groups narrowed to it for the call), with the gradient cast for its
fp32 master first and the master written back into the 16-bit parameter after, as
codegen/optim.py does after backward: the same kernels on the same values, so the numbers are
those of stepping after backward. Autograd has finished with the parameter when its gradient is
complete: every op that reads it has run its backward (a checkpointed layer recomputes before
its own backward, which completes its weights' gradients), so updating it in place is safe.
Each call costs host time on autograd's thread, beside the kernels backward queues (one call
per parameter: not yet measured on a GPU).
"""
from __future__ import annotations

import warnings
from functools import partial
from typing import Any

import torch

from autoshard.codegen.hostopt import second_backward
from autoshard.codegen.optimlayout import _Entry
from autoshard.cost.program import steps_in_backward

class EarlySteps:
    """The in-backward steps of ``entries`` (codegen/optimlayout.py entries whose state is on
    the device) for the ShardedOptimizer ``opt``. ``done``: the entries stepped since the last
    ``opt.step()``, whose gradients are gone."""

    def __init__(self, opt: Any, entries: list[_Entry]) -> None:
        self.opt, self.entries = opt, entries
        groups = opt.optimizer.param_groups
        self.group_of = {id(e): next(k for k, g in enumerate(groups)
                                     if any(q is e.master for q in g["params"]))
                         for e in entries}
        self.done: dict[int, _Entry] = {}
        self.handles = [e.param.register_post_accumulate_grad_hook(partial(self._hook, e))
                        for e in entries]

    def _hook(self, e: _Entry, p: torch.Tensor) -> None:
        if self.opt.pm.accumulating:        # inside pm.no_sync(): stepped at the step
            return
        if id(e) in self.done:
            raise second_backward()
        opt = self.opt.optimizer
        groups = opt.param_groups
        kept = [g["params"] for g in groups]
        with torch.no_grad():
            if e.master is not e.param:
                e.master.grad = p.grad.to(e.master.dtype)
                p.grad = None                  # (the cast holds the gradient now)
            mine = self.group_of[id(e)]
            for k, g in enumerate(groups):
                g["params"] = [e.master] if k == mine else []
            try:
                opt.step()
            finally:
                for g, ps in zip(groups, kept):
                    g["params"] = ps
            if e.master is not e.param:
                e.param.copy_(e.master)
                e.master.grad = None
        p.grad = None
        e.seen = e.param._version
        self.done[id(e)] = e

    def unhook(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def attach(opt: Any, elementwise: bool) -> EarlySteps | None:
    """The in-backward steps of a ShardedOptimizer's (codegen/optim.py) parameters whose state
    is on the device and whose gradients ``steps_in_backward``, or None where it has none (only
    the latest optimizer of a module keeps its hooks: codegen/optim.py). An optimizer not known
    to update each parameter on its own steps them after backward instead, with a warning: their
    gradients then stay on the device through backward, above the plan's memory figure."""
    pm = opt.pm
    if pm.plan.pipeline is not None:
        return None
    buckets = pm.runtime.buckets
    bucketed = set(buckets.of) if buckets is not None else set()
    mine = [e for e in opt.entries if not e.on_host and steps_in_backward(
        e.mode, e.dim is not None, e.placeholder in bucketed, pm.plan.options.offload_overlap)]
    if not mine:
        return None
    if not elementwise:
        warnings.warn(f"{type(opt.optimizer).__name__} is not known to update each parameter "
                      f"from its own state alone, so the {len(mine)} parameters the plan steps "
                      f"in backward (offload_overlap='backward') step after it: their "
                      f"gradients stay on the device, above the plan's memory figure "
                      f"(docs/cost-model.md §9.1); pass elementwise=True if its update is "
                      f"elementwise", stacklevel=3)
        return None
    return EarlySteps(opt, mine)
