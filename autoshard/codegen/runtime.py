"""ParallelModule: one rank's share of a planned model, trainable with torch.optim.

    pm = autoshard.parallelize(model, mesh, plan="plan.json")
    loss = pm.step(*pm.shard_inputs(*batch))     # forward + backward on this rank's shard
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch
import torch.distributed as dist

from autoshard.codegen.collectives import Ledger, apply_steps
from autoshard.codegen.groups import MeshGroups
from autoshard.codegen.masks import seed_shards
from autoshard.codegen.optim import _slice, contiguous_stride, dtensor_in_place, refuse_strided
from autoshard.codegen.rewrite import RankRuntime, emit
from autoshard.cost.comm import reshard
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Spec, local_shape
from autoshard.ops.simulate import shard_tensor

if TYPE_CHECKING:
    from autoshard.codegen.optim import ShardedOptimizer
from autoshard.plans import Plan
from autoshard.precision import cast_inputs
from autoshard.trace.export import TracedGraph


class ParallelModule(torch.nn.Module):
    """The per-rank program with this rank's parameter shards as its parameters.

    ``named_parameters()`` gives the local shards under the original model's names (dots become
    ``__``-free module paths are not needed: the names are kept in ``fqns``).
    """

    def __init__(self, traced: TracedGraph, plan: Plan, groups: MeshGroups,
                 model: torch.nn.Module, *, compile: bool = False) -> None:
        super().__init__()
        self.plan, self.groups, self.traced = plan, groups, traced
        for axes in plan.joint_groups():     # before any collective runs on them
            groups.add_joint(axes)
        device = torch.device("cuda", torch.cuda.current_device()) if groups.device_type == "cuda" \
            else torch.device("cpu")
        self.runtime = RankRuntime(groups, device, plan)
        self.pipeline = None
        self.accumulating = False      # inside no_sync(): a micro-step of accumulation
        stage_programs = None
        self._holders: dict[str, set[int]] = {}    # placeholder -> pipeline coordinates holding it
        bound: set[str] | None = None          # the placeholders this rank's stage reads
        if plan.pipeline is not None:
            from autoshard.codegen.pipeline import cut
            from autoshard.trace.layers import stages_of
            stages = stages_of(traced.graph, traced.layers,
                               tuple(st.layers for st in plan.pipeline.stages))
            self.program = emit(traced, plan, self.runtime, stages)
            # the ops drawing a mask per shard (codegen/masks.py), by node name
            self.seeded_masks = seed_shards(self.program, plan, groups.coords, device)
            stage_programs = cut(self.program, len(plan.pipeline.stages),
                                 [ph.name for ph in traced.inputs])
            bound = {name for k in self.runtime.stages if k >= 0 for name in stage_programs[k][1]}
            # Every parameter's pipeline coordinates (its DTensor view's layout, stageviews.py).
            for k, (_, names, _) in enumerate(stage_programs):
                for name in names:
                    self._holders.setdefault(name, set()).add(plan.pipeline.rank_of(k))
        else:
            self.program = emit(traced, plan, self.runtime)
            self.seeded_masks = seed_shards(self.program, plan, groups.coords, device)
        full = dict(model.named_parameters())      # canonical names, as the trace reports them
        full.update(dict(model.named_buffers()))
        self._specs: dict[str, Spec] = {}
        self._names: list[str] = []          # placeholder order, params/buffers/constants
        self.params = torch.nn.ParameterDict()
        self._views: dict[str, torch.nn.Parameter] = {}      # fqn -> DTensor view (named_parameters)
        self._published: dict[str, torch.Tensor | None] = {}  # fqn -> the gradient its view wraps
        self._buffers_local: dict[str, torch.Tensor] = {}
        self.fqns: list[str] = []
        strategies = plan.strategies()
        # Parameters kept on the host (parameter offload): their shards live in host memory
        # (pinned beside a GPU, as FSDP2's CPUOffloadPolicy keeps them), copied in at each use.
        self.on_host = {ph.fqn for ph in traced.params
                        if strategies[ph.name].kernel == "offload_params"}
        for ph in traced.placeholders:
            if ph.kind == "input" or (bound is not None and ph.name not in bound):
                continue          # an input, or (on a pipeline) another stage's
            spec = strategies[ph.name].outputs[0] if ph.info is not None else None
            self._specs[ph.name] = spec
            # Values cut from the model's tensors; on the meta device, this rank's shard only
            # is materialised from the model's init or left for a state dict (materialize.py).
            from autoshard.codegen.materialize import local_shard
            here = (self.plan.mesh_shape, self.groups.coords, device)
            if ph.kind == "param":
                self.fqns.append(ph.fqn)
                local = local_shard(model, ph.fqn, full[ph.fqn], spec, *here)
                if ph.fqn in self.on_host:
                    local = _to_host(local, device)
                self.params[_key(ph.fqn)] = torch.nn.Parameter(local, requires_grad=full[ph.fqn].requires_grad)
            elif ph.kind == "buffer":
                self._buffers_local[ph.name] = local_shard(model, ph.fqn, full[ph.fqn], spec, *here)
            else:
                const = traced.constants[ph.name]
                self._buffers_local[ph.name] = local_shard(model, ph.name, const, spec, *here)
        self._param_ph = {ph.fqn: ph.name for ph in traced.params
                          if bound is None or ph.name in bound}
        # Every parameter's layout, other stages' too: on a pipeline pm.parameters() lists them all.
        self._every_spec = {ph.fqn: strategies[ph.name].outputs[0] for ph in traced.params}
        self._trains = {ph.fqn: full[ph.fqn].requires_grad for ph in traced.params}
        # A tied parameter's other names (full_state_dict carries them, as state_dict() does).
        from autoshard.trace.export import parameter_aliases
        self._aliases = {a: c for a, c in parameter_aliases(model).items() if a != c}
        # Buffers a state dict holds (not the non-persistent ones, e.g. rotary frequencies).
        saved = set(model.state_dict(keep_vars=True))
        self._saved_buffers = {ph.name for ph in traced.placeholders
                               if ph.kind == "buffer" and ph.fqn in saved}
        # fqn -> this rank's fp32 shard of a weight the step runs in bf16 (bf16-mixed): the
        # optimizer's master starts from it (codegen/optim.py takes it).
        self.master_source: dict[str, torch.Tensor] = {}
        if self.runtime.buckets is not None:
            known = {ph.name: self.params[_key(ph.fqn)] for ph in traced.params
                     if ph.fqn in self._param_ph}
            unknown = sorted(set(self.runtime.buckets.of) - set(known))
            if unknown:
                raise AutoshardError("gradient buckets whose members are the model's parameters",
                                     got=f"unknown members {unknown[:5]}",
                                     fix="re-plan: the plan file was edited or is damaged")
            self.runtime.buckets.params = known
            # Members kept on the host: their synced gradient goes down to it.
            self.runtime.buckets.host = {ph.name for ph in traced.params
                                         if ph.fqn in self.on_host and ph.name in known}
            # reduce_scatter buckets cut each member along its state dim (codegen/optim.py).
            for fqn, st in plan.param_state.items():
                if fqn not in self._param_ph:
                    continue                      # another pipeline stage's
                dim = next((q.dim for q, r in zip(st.grad, plan.params[fqn]) if q != r), None)
                if dim is not None:
                    self.runtime.buckets.shard_dim[self._param_ph[fqn]] = dim
        if plan.param_state:        # their state lives apart: only pm.optimizer steps them
            from autoshard.codegen.optim import watch
            watch([self.params[_key(fqn)] for fqn in plan.param_state if fqn in self._param_ph])
        self._input_specs = [strategies[ph.name].outputs[0] for ph in traced.inputs]
        self._input_shapes = [ph.info.shape if ph.info else None for ph in traced.inputs]
        if stage_programs is not None:
            from autoshard.codegen.pipeline import Pipelined
            self.pipeline = Pipelined(self, stage_programs, device)
        self._compile = compile
        self._emitted = self.program         # as emitted: pm.eval() derives its program from it
        self._eval_program: Any = None
        if compile:       # each stage program, or the whole one, by inductor (codegen/compile.py)
            from autoshard.codegen.compile import compile_program
            if self.pipeline is not None:
                for k, module in zip(self.pipeline.mine, self.pipeline.modules):
                    module.program = compile_program(module.program, self.runtime,
                                                     name=f"stage {k}")
            else:
                self.program = compile_program(self.program, self.runtime)

    def bound_values(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, buffers and constants by placeholder name."""
        out = {ph.name: self.params[_key(ph.fqn)] for ph in self.traced.params
               if ph.fqn in self._param_ph}
        out.update(self._buffers_local)
        return out

    @property
    def microbatches(self) -> int:
        return self.plan.pipeline.microbatches if self.plan.pipeline is not None else 1

    # -- sharding helpers ----------------------------------------------------------------------
    def _shard(self, full: torch.Tensor, spec: Spec | None) -> torch.Tensor:
        if spec is None:
            return full
        return shard_tensor(full, spec, self.plan.mesh_shape, self.groups.coords).contiguous().clone()

    def _gather(self, local: torch.Tensor, spec: Spec, shape: Sequence[int]) -> torch.Tensor:
        r = reshard(tuple(spec), (Replicate(),) * len(spec), tuple(shape), local.element_size(),
                    self.plan.mesh_shape)
        with torch.no_grad():     # (a tensor kept on the host is gathered on the device)
            return apply_steps(local.detach().to(self.runtime.device), r.forward, self.groups)

    # -- running -------------------------------------------------------------------------------
    def shard_inputs(self, *global_args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if len(global_args) != len(self._input_specs):
            raise AutoshardError(f"{len(self._input_specs)} inputs, as planned",
                                 got=f"{len(global_args)} inputs",
                                 fix="pass the same arguments as the example inputs")
        out = []
        global_args = cast_inputs(global_args, self.plan.options.precision)
        m = self.microbatches
        for i, (a, spec, shape) in enumerate(zip(global_args, self._input_specs, self._input_shapes)):
            # On a pipeline the plan is of one microbatch: the batch is m of them.
            want = None if shape is None else (shape[0] * m, *shape[1:]) if m > 1 else shape
            if isinstance(a, torch.Tensor) and want is not None and tuple(a.shape) != tuple(want):
                raise AutoshardError(f"input {i} of shape {tuple(want)}, the planned shape"
                                     + (f" ({m} microbatches of {tuple(shape)})" if m > 1 else ""),
                                     got=f"shape {tuple(a.shape)}",
                                     fix="re-plan for these shapes, or batch the data as planned")
            if not isinstance(a, torch.Tensor):
                out.append(a)
            elif m > 1:       # each microbatch sharded as planned, stacked back in order
                out.append(torch.cat([self._shard(c, spec) for c in a.chunk(m)]))
            else:
                out.append(self._shard(a, spec))
        return tuple(out)

    def _check_local(self, local_args: Sequence[Any]) -> None:
        m = self.microbatches
        for i, (a, spec, shape) in enumerate(zip(local_args, self._input_specs, self._input_shapes)):
            if isinstance(a, torch.Tensor) and shape is not None:
                want = local_shape(shape, spec, self.plan.mesh_shape)
                want = (want[0] * m, *want[1:]) if m > 1 else want
                if tuple(a.shape) != want:
                    raise AutoshardError(f"local input {i} of shape {want} (the plan shards the "
                                         f"global {tuple(shape)} as {spec})",
                                         got=f"shape {tuple(a.shape)}",
                                         fix="pass pm.shard_inputs(*global_batch) to the module")

    def train(self, mode: bool = True) -> "ParallelModule":
        """``pm.train()`` / ``pm.eval()``, as ``model.train()`` / ``model.eval()``: in eval mode
        dropout is the identity and batch norm uses its running statistics without updating
        them. The program was traced in training mode; eval mode runs a copy of it with those
        ops' flags flipped (codegen/modes.py), same layouts and collectives. A pipeline's
        schedule always runs forward and backward: eval mode there is refused where it would
        change what the program computes."""
        if not mode and self._eval_program is None:
            from autoshard.codegen.modes import eval_program, mode_dependent
            ops = mode_dependent(self._emitted)
            if ops and self.pipeline is not None:
                raise AutoshardError(
                    "pm.eval() on a pipelined plan without ops that run otherwise in eval mode",
                    got=f"{len(ops)} traced in training mode: {', '.join(ops[:4])}",
                    fix="evaluate with a plan without a pipeline (plan(model.eval(), batch, mesh, "
                        "training=False), loading pm.full_state_dict() or a DCP checkpoint)")
            if ops:
                counters = {ph.name for ph in self.traced.placeholders if ph.kind == "buffer"
                            and ph.fqn.endswith("num_batches_tracked")}
                prog = eval_program(self._emitted, counters)
                if self._compile:
                    from autoshard.codegen.compile import compile_program
                    prog = compile_program(prog, self.runtime, name="eval")
                self._eval_program = prog
            else:
                self._eval_program = self.program       # nothing differs
        return super().train(mode)

    def forward(self, *local_args: Any) -> Any:
        """One forward; the ledger then holds this step's collectives (forward, and backward
        once it has run), not every step's. The loss of a training plan is replicated on every
        rank; an inference plan's output comes back whole on every rank (gathered as
        ``gather_output`` does)."""
        if self.pipeline is not None:
            raise AutoshardError("a plan without a pipeline to run forward alone",
                                 got=f"a plan pipelined over {self.plan.pipeline.axis}",
                                 fix="call pm.step(*pm.shard_inputs(*batch)), which runs the "
                                     "schedule, forward and backward")
        self._check_local(local_args)
        self._reconcile_grads()
        self.runtime.ledger.clear()
        flat = []
        for ph in self.traced.placeholders:
            if ph.kind == "param":
                flat.append(self.params[_key(ph.fqn)])
            elif ph.kind == "input":
                continue
            else:
                flat.append(self._buffers_local[ph.name])
        out = (self.program if self.training or self._eval_program is None
               else self._eval_program)(*flat, *local_args)
        if not self.plan.options.training and isinstance(out, torch.Tensor):
            return self.gather_output(out)
        return out

    def step(self, *local_args: Any) -> torch.Tensor:
        """Forward and backward on this rank; returns the full (replicated) loss. On a pipeline:
        one schedule over the microbatches (codegen/pipeline.py), the step's loss on every rank."""
        if not self.plan.options.training:
            raise AutoshardError("pm.step on a training plan (one with a backward)",
                                 got="an inference plan (training=False)",
                                 fix="call pm(*pm.shard_inputs(*batch)) for its output, or "
                                     "plan with training=True to train")
        if self.pipeline is not None:
            self._check_local(local_args)
            self._reconcile_grads()
            self.runtime.ledger.clear()
            loss = self.pipeline.step(*local_args)
        else:
            loss = self(*local_args)
            loss.backward()
            loss = loss.detach()
        self._publish_grads()
        return loss

    def gather_output(self, local: torch.Tensor) -> torch.Tensor:
        out = next(n for n in self.plan.nodes if n.name == self._output_node())
        return self._gather(local, out.outputs[0], self._output_shape())

    def _output_node(self) -> str:
        out = next(n for n in self.traced.graph.nodes if n.op == "output")
        return torch.utils._pytree.tree_flatten(out.args)[0][0].name

    def _output_shape(self):
        out = next(n for n in self.traced.graph.nodes if n.name == self._output_node())
        return tuple(out.meta["val"].shape)

    # -- state ---------------------------------------------------------------------------------
    def local_parameters(self) -> Mapping[str, torch.nn.Parameter]:
        """This rank's parameter shards by name (read-only: made once, at construction, and
        read per parameter on every step)."""
        local = self.__dict__.get("_local_parameters")
        if local is None:
            local = self._local_parameters = MappingProxyType(
                {fqn: self.params[_key(fqn)] for fqn in self.fqns})
        return local

    def _full(self, fqn: str, t: torch.Tensor) -> torch.Tensor:
        ph = self.traced.placeholder(self._param_ph[fqn])
        return self._gather(t, self._specs[ph.name], ph.info.shape)

    def optimizer(self, optimizer_cls: type, **kwargs: Any) -> "ShardedOptimizer":
        """A ``torch.optim.Optimizer`` (``optimizer_cls(**kwargs)`` inside, whose groups and
        state it shares, so torch's schedulers drive it) that keeps fp32 masters for 16-bit
        parameters, shards its state as the plan says (ZeRO-1/2, on the host for offload) and
        gathers the updated parameters (codegen/optim.py). Required when the plan places
        gradients or optimizer state apart from the parameters. Steps with the class's fused
        kernel unless ``fused`` or ``foreach`` is given. A class whose update is not
        elementwise is refused on sharded layouts unless ``elementwise=True`` says it is."""
        from autoshard.codegen.optim import ShardedOptimizer
        return ShardedOptimizer(self, optimizer_cls, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.nn.Module.zero_grad``, of the local shards, the gradient shards the
        buckets hold (ZeRO-2, offload) and the DTensor views."""
        for p in self.params.values():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()
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
                                        _dtensor_placements(spec), shape)
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
                   else _dtensor_placements(spec))
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
        for fqn, p in self.local_parameters().items():
            g = p.grad
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
            placements = _dtensor_placements(self._specs[ph.name])
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
                                               _dtensor_placements(self._specs[ph.name]),
                                               tuple(ph.info.shape))
        return out

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
                self._local_tensor(ph).copy_(v.to_local())

    def _local_tensor(self, ph: Any) -> torch.Tensor:
        """This rank's tensor of a parameter or buffer placeholder."""
        return self.params[_key(ph.fqn)] if ph.kind == "param" else self._buffers_local[ph.name]

    @property
    def ledger(self) -> Ledger:
        return self.runtime.ledger


def _to_host(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in host memory: pinned where the device is a GPU (copies to it and back run at
    the link's speed), as is on a CPU run (the host is the device)."""
    t = t.to("cpu")
    return t.pin_memory() if device.type == "cuda" else t


def _key(fqn: str) -> str:
    return fqn.replace(".", "__")


def _dtensor_placements(spec: Spec):
    """DTensor placements of a parameter kept as ``spec``. A strided shard (a fused projection)
    is ``Shard`` of its dim here: the same elements per rank, so norms and elementwise ops are
    exact; its offsets are not, which is why DCP refuses it (optim.refuse_strided)."""
    from torch.distributed.tensor import Replicate as DR, Shard as DS
    from autoshard.ir import Shard
    return [DS(p.dim) if isinstance(p, Shard) else DR() for p in spec]


def _as_view(*args: Any) -> Any:
    from autoshard.codegen.stageviews import as_view
    return as_view(*args)


def _grad_cut(spec: Spec, grad: Spec, groups: MeshGroups):
    from autoshard.codegen.optim import _cut
    return _cut(spec, grad, groups.shape, groups.coords)


def _grad_placements(spec: Spec, grad: Spec, groups: MeshGroups) -> tuple:
    if grad == spec:
        return tuple(_dtensor_placements(spec))
    from autoshard.codegen.optim import _placements
    return _placements(spec, grad, groups.shape)
