"""A ParallelModule's parameters as torch's own utilities take them, and their gradients.

``pm.named_parameters()`` gives each parameter as a DTensor of its global shape over the mesh
whose data is this rank's shard itself, and whose ``.grad`` is this rank's gradient as it is held:
with the parameter, or, where a bucket reduce-scatters it apart (ZeRO-2, offload), as the
optimizer state's shard. Keeping those views and the held gradients in step (publishing after a
backward, reconciling a gradient cleared through its view, ``zero_grad``, ``no_sync``) is one
concern apart from running the program; it lives here, and :class:`GradViews` is mixed into
codegen/runtime.py's ``ParallelModule``, whose attributes it reads.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from autoshard.codegen.collectives import apply_steps
from autoshard.codegen.dtensors import dtensor_in_place, dtensor_placements
from autoshard.codegen.groups import MeshGroups
from autoshard.codegen.optimlayout import _cut, _names, _placements, _slice
from autoshard.cost.comm import reshard
from autoshard.errors import AutoshardError
from autoshard.ir import Spec, local_shape


class GradViews:
    """The DTensor views of a ``ParallelModule``'s parameters and the gradients they publish.

    Mixed into ``ParallelModule`` (codegen/runtime.py), which sets what is read here: ``plan``,
    ``groups``, ``traced``, ``runtime``, ``pipeline``, ``params``, ``fqns``, ``_specs``,
    ``_param_ph``, ``_every_spec``, ``_trains``, ``_holders``, ``accumulating``, ``_views``
    (fqn -> its view), ``_published`` (fqn -> the gradient its view wraps) and
    ``local_parameters()``; ``full_grads`` gathers through the state dicts' ``_full`` and
    ``_across_stages`` (codegen/statedicts.py)."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.nn.Module.zero_grad``, of the local shards, the gradient shards the
        buckets hold (ZeRO-2, offload) and the DTensor views."""
        for p in self.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:      # (as torch.optim.Optimizer.zero_grad: a bucket's view cannot detach_)
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()
        if self.runtime.buckets is not None:
            self.runtime.buckets.shards.clear()
        self._publish_grads()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's ``no_sync``: the backward passes run inside hold each bucketed gradient on this
        rank instead of syncing it; the first backward after it syncs the sum, once per bucket.
        (A plan with ``accumulation_steps=N`` prices N such micro-steps per optimizer step,
        docs/cost-model.md §7.2; by default one.) Gradients the plan syncs inside the
        program (tensor parallel reductions) are synced as the step runs. Step the optimizer
        after a backward outside it: ``pm.optimizer`` refuses to step while gradients are held.
        On a pipeline the schedule's microbatches already accumulate without a sync: use more
        microbatches instead."""
        if self.pipeline is not None:
            raise AutoshardError("no_sync() on a plan without a pipeline",
                                 got=f"a plan pipelined over {self.plan.pipeline.axis}",
                                 fix="plan more microbatches: the schedule accumulates them and "
                                     "syncs once per step")
        buckets = self.runtime.buckets
        was, self.accumulating = self.accumulating, True   # read by the host step (hostopt)
        before = buckets.defer if buckets is not None else False
        if buckets is not None:          # (none: nothing is synced apart from the program)
            buckets.defer = True
        try:
            yield
        finally:
            self.accumulating = was
            if buckets is not None:
                buckets.defer = before

    def held_grads(self) -> list[str]:
        """Parameters (placeholder names) whose gradients ``no_sync`` holds unsynced."""
        return sorted(self.runtime.buckets._held) if self.runtime.buckets is not None else []

    # -- parameters as torch's own utilities take them -----------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The model's parameters (this rank's stage's, on a pipeline) under their own names, as
        DTensors of their global shapes with the plan's placements on the mesh, as FSDP2 and
        torch's tensor parallel modules give them. Each one's data is this rank's shard itself
        (``local_parameters()``), and its ``.grad`` this rank's gradient as a DTensor laid out
        as it is held: with the parameter, or, where a bucket reduce-scatters it apart (ZeRO-2,
        offload), as the optimizer state's shard. So torch's own ``clip_grad_norm_``,
        ``clip_grad_value_`` and ``get_total_norm`` reduce over the mesh and return what one
        device returns, and clip in place what the optimizer then reads. The gradients are
        brought up to date by ``pm.step``, ``zero_grad`` and each call of this method. On a
        pipeline every rank lists every parameter, another stage's with no rows, laid out
        along the pipeline axis so that the norm reduces over the stages too
        (codegen/stageviews.py)."""
        from autoshard.codegen.optim import released_grads, stepped
        gone = sorted(released_grads(self)) + stepped(self)
        if gone:
            raise AutoshardError(
                "every gradient on the device between backward and the optimizer's step, for "
                "torch's utilities over pm.parameters() (clip_grad_norm_ would leave some out)",
                got=f"{len(gone)} parameters stepped in backward under "
                    f"offload_overlap='backward', their gradients gone from the device: "
                    f"{_names(gone)}",
                fix="plan with offload_overlap='none' to clip or read gradients between "
                    "backward and the step, or call pm.parameters() before backward or after "
                    "opt.step()")
        fqns = self.fqns if self.pipeline is None else list(self._every_spec)
        views = [(prefix + fqn, self._view(fqn)) for fqn in fqns]
        self._publish_grads()
        yield from views

    def _view(self, fqn: str) -> torch.nn.Parameter:
        view = self._views.get(fqn)
        if view is None:
            p = self.local_parameters().get(fqn)
            spec = self._every_spec[fqn]
            shape = tuple(self.traced.placeholder(self._ph_of(fqn)).info.shape)
            if self.pipeline is None:
                data = dtensor_in_place(p.detach(), self.groups.device_mesh,
                                        dtensor_placements(spec), shape)
            else:       # another stage's parameter: no rows here (codegen/stageviews.py)
                from autoshard.codegen.stageviews import absent, as_view
                local = p.detach() if p is not None else absent(
                    local_shape(shape, spec, self.plan.mesh_shape), self._dtype_of(fqn),
                    self.runtime.device)
                data = as_view(local, self.groups.device_mesh, self._placements(fqn, spec),
                               shape)
            requires_grad = p.requires_grad if p is not None else self._trains[fqn]
            view = self._views[fqn] = torch.nn.Parameter(data, requires_grad=requires_grad)
            if fqn in self.plan.param_state and p is not None:
                from autoshard.codegen.optim import watch
                watch([view])
        return view

    def _ph_of(self, fqn: str) -> str:
        return next(ph.name for ph in self.traced.params if ph.fqn == fqn)

    def _dtype_of(self, fqn: str) -> torch.dtype:
        return self.traced.placeholder(self._ph_of(fqn)).info.dtype

    def _placements(self, fqn: str, spec: Spec, grad: Spec | None = None) -> list:
        """A view's DTensor placements: the plan's, and on a pipeline the pipeline axis's as
        codegen/stageviews.py lays it out."""
        out = list(_grad_placements(spec, grad, self.groups) if grad is not None
                   else dtensor_placements(spec))
        if self.pipeline is None:
            return out
        from autoshard.codegen.stageviews import pipeline_placements
        axis = self.plan.mesh_axes.index(self.plan.pipeline.axis)
        return pipeline_placements(out, axis, self._holders.get(self._ph_of(fqn), set()),
                                   self.plan.mesh_shape[axis], fqn,
                                   tuple(self.traced.placeholder(self._ph_of(fqn)).info.shape))

    def _publish_grads(self) -> None:
        """Each DTensor view's ``.grad``: this rank's gradient, the tensor itself (so clipping it
        in place clips what the optimizer reads). A gradient split between ``.grad`` (reads of
        the parameter outside its bucket) and a bucket's shard is summed into the shard first,
        as the optimizer would sum it. On a pipeline, where every rank lists every parameter,
        a view has a gradient on every rank or on none (so the collectives of torch's norm
        match): while this rank holds gradients, another stage's parameter shows one of no
        rows, and one of its own stages without a gradient (unused) shows zeros."""
        mine = {fqn: self._held_grad(fqn) for fqn in self._views if fqn in self._param_ph}
        holding = self.pipeline is not None and any(g is not None for g, _ in mine.values())
        for fqn, view in self._views.items():
            spec = self._every_spec[fqn]
            st = self.plan.param_state.get(fqn)
            g, spec_grad = mine.get(fqn, (None, st.grad if st is not None else spec))
            if g is None and holding:
                from autoshard.codegen.stageviews import absent
                local = local_shape(tuple(view.shape), spec_grad, self.plan.mesh_shape)
                g = view._local_tensor.new_zeros(local) if fqn in mine else \
                    absent(local, view.dtype, view._local_tensor.device)
            if g is None:
                view.grad = None
            elif view.grad is None or view.grad._local_tensor is not g:
                placements = self._placements(fqn, spec, spec_grad)
                view.grad = (dtensor_in_place if self.pipeline is None else _as_view)(
                    g, self.groups.device_mesh, placements, tuple(view.shape))
            self._published[fqn] = g

    def _held_grad(self, fqn: str) -> tuple[torch.Tensor | None, Spec]:
        """This rank's gradient of ``fqn`` and its layout: ``.grad``, or a bucket's shard (with
        ``.grad`` summed into it)."""
        shards = self.runtime.buckets.shards if self.runtime.buckets is not None else {}
        p, ph = self.local_parameters()[fqn], self._param_ph[fqn]
        g, spec = p.grad, self._specs[ph]
        if ph not in shards:
            return g, spec
        st = self.plan.param_state[fqn]
        dim, cut = _grad_cut(spec, st.grad, self.groups)
        if g is not None:
            shards[ph].add_(_slice(g.to(shards[ph].device), dim, cut))
            p.grad = None
        return shards[ph], st.grad

    def _reconcile_grads(self) -> None:
        """A gradient cleared through its view (``zero_grad`` of a torch optimizer over
        ``pm.parameters()``) is cleared where it is held too, before backward accumulates into
        it."""
        shards = self.runtime.buckets.shards if self.runtime.buckets is not None else {}
        for fqn, view in self._views.items():
            held = self._published.get(fqn)
            if view.grad is not None or held is None:
                continue
            if fqn in self._param_ph:         # (not another stage's)
                p, ph = self.local_parameters()[fqn], self._param_ph[fqn]
                if p.grad is held:
                    p.grad = None
                elif shards.get(ph) is held:
                    del shards[ph]
            self._published[fqn] = None

    def local_grads(self) -> dict[str, torch.Tensor]:
        """Each parameter's gradient in its stored layout on this rank: ``.grad``, plus, where a
        reduce-scatter bucket holds it as a shard (ZeRO-2, offload), that shard gathered back.
        Collective when any shard is held: every rank calls it."""
        shards = self.runtime.buckets.shards if self.runtime.buckets is not None else {}
        out = {}
        from autoshard.codegen.optim import released_grads, stepped
        used = stepped(self)
        if used:
            raise AutoshardError(
                "the gradients of every parameter between backward and the optimizer's step",
                got=f"{len(used)} parameters stepped on the device in backward under "
                    f"offload_overlap='backward', their gradients used and freed: "
                    f"{_names(used)}",
                fix="plan with offload_overlap='none' to read gradients between backward and "
                    "the step")
        gone = released_grads(self)
        for fqn, p in self.local_parameters().items():
            g = p.grad
            if g is None and fqn in gone:          # sent to the host in backward
                g = gone[fqn].to(p.device)
            shard = shards.get(self._param_ph[fqn])
            if shard is not None:
                st = self.plan.param_state[fqn]
                ph = self.traced.placeholder(self._param_ph[fqn])
                r = reshard(tuple(st.grad), tuple(self.plan.params[fqn]), tuple(ph.info.shape),
                            shard.element_size(), self.plan.mesh_shape)
                with torch.no_grad():
                    whole = apply_steps(shard.to(self.runtime.device), r.forward, self.groups)
                g = whole if g is None else g.to(whole.device) + whole
            if g is not None:
                out[fqn] = g
        return out

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self._across_stages({fqn: self._full(fqn, g)
                                    for fqn, g in self.local_grads().items()})


def _as_view(*args: Any) -> Any:
    from autoshard.codegen.stageviews import as_view
    return as_view(*args)


def _grad_cut(spec: Spec, grad: Spec, groups: MeshGroups):
    return _cut(spec, grad, groups.shape, groups.coords)


def _grad_placements(spec: Spec, grad: Spec, groups: MeshGroups) -> tuple:
    if grad == spec:
        return tuple(dtensor_placements(spec))
    return _placements(spec, grad, groups.shape)
