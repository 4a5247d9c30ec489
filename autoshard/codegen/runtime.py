"""ParallelModule: one rank's share of a planned model, trainable with torch.optim.

    pm = autoshard.parallelize(model, mesh, plan="plan.json")
    loss = pm.step(*pm.shard_inputs(*batch))     # forward + backward on this rank's shard

Here: binding the model's tensors to the rank program and running it. Its other concerns are
mixed in from their own modules: the parameters as DTensors and their gradients
(codegen/gradviews.py), the state dicts (codegen/statedicts.py) and tensors cut to a rank
and gathered back (codegen/shards.py).
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch

from autoshard.codegen.collectives import Ledger
from autoshard.codegen.gradviews import GradViews
from autoshard.codegen.groups import MeshGroups
from autoshard.codegen.masks import seed_shards
from autoshard.codegen.rewrite import RankRuntime, emit
from autoshard.codegen.shards import Shards
from autoshard.codegen.statedicts import StateDicts
from autoshard.errors import AutoshardError
from autoshard.ir import Spec, StateMode

if TYPE_CHECKING:
    from autoshard.codegen.optim import ShardedOptimizer
from autoshard.plans import Plan
from autoshard.trace.export import TracedGraph


class ParallelModule(GradViews, StateDicts, Shards, torch.nn.Module):
    """The per-rank program with this rank's parameter shards as its parameters.

    ``local_parameters()`` gives the shards under the original model's names (kept in
    ``fqns``), ``named_parameters()`` the same as DTensors (codegen/gradviews.py).
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
        self._views: dict[str, torch.nn.Parameter] = {}      # fqn -> DTensor view (named_parameters)
        self._published: dict[str, torch.Tensor | None] = {}  # fqn -> the gradient its view wraps
        stage_programs, bound = self._emit(device)
        full = dict(model.named_parameters())      # canonical names, as the trace reports them
        full.update(dict(model.named_buffers()))
        strategies = plan.strategies()
        self._bind_values(model, full, strategies, bound, device)
        self._record_parameters(model, full, strategies, bound)
        # fqn -> this rank's fp32 shard of a weight the step runs in bf16 (bf16-mixed): the
        # optimizer's master starts from it (codegen/optim.py takes it).
        self.master_source: dict[str, torch.Tensor] = {}
        if self.runtime.buckets is not None:
            self._bind_buckets()
        if plan.param_state:        # their state lives apart: only pm.optimizer steps them
            from autoshard.codegen.optim import watch
            watch([self.params[_key(fqn)] for fqn in plan.param_state if fqn in self._param_ph])
        self._input_specs = [strategies[ph.name].outputs[0] for ph in traced.inputs]
        self._input_infos = [ph.info for ph in traced.inputs]      # shape and dtype, or None
        if stage_programs is not None:
            from autoshard.codegen.pipeline import Pipelined
            self.pipeline = Pipelined(self, stage_programs, device)
        self._compile = compile
        self._emitted = self.program         # as emitted: pm.eval() derives its program from it
        self._eval_program: Any = None
        if compile:       # each stage program, or the whole one, by inductor (codegen/compile.py)
            self._compile_programs()

    # -- construction, step by step ------------------------------------------------------------
    def _emit(self, device: torch.device) -> tuple[list | None, set[str] | None]:
        """The rank program, and on a pipeline its stage programs and the placeholders this
        rank's stages read (None, None without a pipeline)."""
        traced, plan = self.traced, self.plan
        self._holders: dict[str, set[int]] = {}    # placeholder -> pipeline coordinates holding it
        if plan.pipeline is None:
            self.program = emit(traced, plan, self.runtime)
            self.seeded_masks = seed_shards(self.program, plan, self.groups.coords, device)
            return None, None
        from autoshard.codegen.pipeline import cut
        from autoshard.trace.layers import stages_of
        stages = stages_of(traced.graph, traced.layers,
                           tuple(st.layers for st in plan.pipeline.stages))
        self.program = emit(traced, plan, self.runtime, stages)
        # the ops drawing a mask per shard (codegen/masks.py), by node name
        self.seeded_masks = seed_shards(self.program, plan, self.groups.coords, device)
        stage_programs = cut(self.program, len(plan.pipeline.stages),
                             [ph.name for ph in traced.inputs])
        bound = {name for k in self.runtime.stages if k >= 0 for name in stage_programs[k][1]}
        # Every parameter's pipeline coordinates (its DTensor view's layout, stageviews.py).
        for k, (_, names, _) in enumerate(stage_programs):
            for name in names:
                self._holders.setdefault(name, set()).add(plan.pipeline.rank_of(k))
        return stage_programs, bound

    def _bind_values(self, model: torch.nn.Module, full: dict[str, torch.Tensor],
                     strategies: dict, bound: set[str] | None, device: torch.device) -> None:
        """This rank's shard of every parameter, buffer and constant its program reads (its
        stages', on a pipeline)."""
        from autoshard.codegen.materialize import local_shard
        self._specs: dict[str, Spec] = {}
        self._names: list[str] = []          # placeholder order, params/buffers/constants
        self.params = torch.nn.ParameterDict()
        self._buffers_local: dict[str, torch.Tensor] = {}
        self.fqns: list[str] = []
        # Parameters kept on the host (parameter offload): their shards live in host memory
        # (pinned beside a GPU, as FSDP2's CPUOffloadPolicy keeps them), copied in at each use.
        self.on_host = {ph.fqn for ph in self.traced.params
                        if strategies[ph.name].kernel == StateMode.OFFLOAD_PARAMS}
        # Values cut from the model's tensors; on the meta device, this rank's shard only is
        # materialised from the model's init or left for a state dict (materialize.py).
        here = (self.plan.mesh_shape, self.groups.coords, device)
        for ph in self.traced.placeholders:
            if ph.kind == "input" or (bound is not None and ph.name not in bound):
                continue          # an input, or (on a pipeline) another stage's
            spec = strategies[ph.name].outputs[0] if ph.info is not None else None
            self._specs[ph.name] = spec
            if ph.kind == "param":
                self.fqns.append(ph.fqn)
                local = local_shard(model, ph.fqn, full[ph.fqn], spec, *here)
                if ph.fqn in self.on_host:
                    local = _to_host(local, device)
                self.params[_key(ph.fqn)] = torch.nn.Parameter(
                    local, requires_grad=full[ph.fqn].requires_grad)
            elif ph.kind == "buffer":
                self._buffers_local[ph.name] = local_shard(model, ph.fqn, full[ph.fqn], spec, *here)
            else:
                const = self.traced.constants[ph.name]
                self._buffers_local[ph.name] = local_shard(model, ph.name, const, spec, *here)

    def _record_parameters(self, model: torch.nn.Module, full: dict[str, torch.Tensor],
                           strategies: dict, bound: set[str] | None) -> None:
        """What the views and state dicts need to know of every parameter: its placeholder,
        layout, whether it trains, its tied names, and which buffers a state dict holds."""
        traced = self.traced
        self._param_ph = {ph.fqn: ph.name for ph in traced.params
                          if bound is None or ph.name in bound}
        # Every parameter's layout, other stages' too: on a pipeline pm.parameters() lists them all.
        self._every_spec = {ph.fqn: strategies[ph.name].outputs[0] for ph in traced.params}
        self._trains = {ph.fqn: full[ph.fqn].requires_grad for ph in traced.params}
        # The model's own parameters by id (held weakly: the model may go), so that optimizer
        # groups built from them before parallelize name the same parameters (optimlayout.py).
        self._origin = {id(full[ph.fqn]): (weakref.ref(full[ph.fqn]), ph.fqn)
                        for ph in traced.params}
        # A tied parameter's other names (full_state_dict carries them, as state_dict() does).
        from autoshard.trace.export import parameter_aliases
        self._aliases = {a: c for a, c in parameter_aliases(model).items() if a != c}
        # Buffers a state dict holds (not the non-persistent ones, e.g. rotary frequencies).
        saved = set(model.state_dict(keep_vars=True))
        self._saved_buffers = {ph.name for ph in traced.placeholders
                               if ph.kind == "buffer" and ph.fqn in saved}

    def _bind_buckets(self) -> None:
        """The gradient buckets' members bound to this rank's parameters, with where each one's
        synced gradient goes (the host, a reduce-scatter's state dim)."""
        traced, buckets = self.traced, self.runtime.buckets
        known = {ph.name: self.params[_key(ph.fqn)] for ph in traced.params
                 if ph.fqn in self._param_ph}
        unknown = sorted(set(buckets.of) - set(known))
        if unknown:
            raise AutoshardError("gradient buckets whose members are the model's parameters",
                                 got=f"unknown members {unknown[:5]}",
                                 fix="re-plan: the plan file was edited or is damaged")
        buckets.params = known
        # Members kept on the host: their synced gradient goes down to it.
        buckets.host = {ph.name for ph in traced.params
                        if ph.fqn in self.on_host and ph.name in known}
        # reduce_scatter buckets cut each member along its state dim (codegen/optim.py).
        for fqn, st in self.plan.param_state.items():
            if fqn not in self._param_ph:
                continue                      # another pipeline stage's
            dim = next((q.dim for q, r in zip(st.grad, self.plan.params[fqn]) if q != r), None)
            if dim is not None:
                buckets.shard_dim[self._param_ph[fqn]] = dim

    def _compile_programs(self) -> None:
        """Each stage program, or the whole one, compiled by inductor (codegen/compile.py)."""
        from autoshard.codegen.compile import compile_program
        if self.pipeline is not None:
            for k, module in zip(self.pipeline.mine, self.pipeline.modules):
                module.program = compile_program(module.program, self.runtime,
                                                 name=f"stage {k}",
                                                 layer_of=self.traced.layer_of_node)
        else:
            self.program = compile_program(self.program, self.runtime,
                                           layer_of=self.traced.layer_of_node)

    def bound_values(self) -> dict[str, torch.Tensor]:
        """This rank's parameters, buffers and constants by placeholder name."""
        out = {ph.name: self.params[_key(ph.fqn)] for ph in self.traced.params
               if ph.fqn in self._param_ph}
        out.update(self._buffers_local)
        return out

    @property
    def microbatches(self) -> int:
        return self.plan.pipeline.microbatches if self.plan.pipeline is not None else 1

    # -- running -------------------------------------------------------------------------------
    def _apply(self, fn: Any, recurse: bool = True) -> "ParallelModule":
        """``pm.to(...)``, ``.cuda()``, ``.half()`` and the like, where they change nothing; one
        that would move or cast a tensor is refused. Its shards already are where the plan runs
        them, in the dtypes it priced (the device, or the host where offloaded), and the
        optimizer, the gradient buckets and the host buffers hold views of them that a copy
        would leave behind."""
        for name, t in [*torch.nn.Module.named_parameters(self), *self.named_buffers()]:
            new = fn(t)
            if new is not t:
                raise AutoshardError(
                    "pm.to(...), .cuda(), .half() and the like only where they change nothing "
                    f"(the shards are on {self.runtime.device}, or the host where offloaded, "
                    "in the plan's dtypes)",
                    got=f"a call that makes {name} ({t.dtype} on {t.device}) {new.dtype} on "
                        f"{new.device}",
                    fix="drop the call (parallelize placed every shard); for another dtype, "
                        "cast the model (model.to(dtype)) or plan with precision=... before "
                        "autoshard.parallelize")
        return self

    def train(self, mode: bool = True) -> "ParallelModule":
        """``pm.train()`` / ``pm.eval()``, as ``model.train()`` / ``model.eval()``: in eval mode
        dropout is the identity, stochastic depth keeps every sample and batch norm uses its
        running statistics without updating them. The program was traced in training mode;
        eval mode runs a copy of it with those ops' flags flipped and masks filled with their
        means (codegen/modes.py), same layouts and collectives; on a pipeline,
        each stage's program so (codegen/pipeline.py ``Pipelined``)."""
        if not mode and self._eval_program is None and self.pipeline is None:
            from autoshard.codegen.modes import eval_version
            self._eval_program = eval_version(self._emitted, self) or self.program
        return super().train(mode)

    def forward(self, *local_args: Any) -> Any:
        """One forward; the ledger then holds this step's collectives (forward, and backward
        once it has run), not every step's. The loss of a training plan is replicated on every
        rank; an inference plan's output comes back whole on every rank (gathered as
        ``gather_output`` does). On a pipeline it evaluates: the schedule's forwards alone
        (codegen/pipeline.py ``Pipelined.evaluate``), under ``torch.no_grad()`` or
        ``pm.eval()``, return the loss ``pm.step`` would, with no graph to run backward on."""
        self._check_local(local_args)
        if self.pipeline is not None:
            return self.pipeline.evaluate(*local_args)
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

    # -- state ---------------------------------------------------------------------------------
    def local_parameters(self) -> Mapping[str, torch.nn.Parameter]:
        """This rank's parameter shards by name (read-only: made once, at construction, and
        read per parameter on every step)."""
        local = self.__dict__.get("_local_parameters")
        if local is None:
            local = self._local_parameters = MappingProxyType(
                {fqn: self.params[_key(fqn)] for fqn in self.fqns})
        return local

    def optimizer(self, optimizer_cls: type, params: Any = None,
                  **kwargs: Any) -> "ShardedOptimizer":
        """A ``torch.optim.Optimizer`` (``optimizer_cls(params, **kwargs)`` inside, whose groups
        and state it shares, so torch's schedulers drive it) that keeps fp32 masters for 16-bit
        parameters, shards its state as the plan says (ZeRO-1/2, on the host for offload) and
        gathers the updated parameters (codegen/optim.py). ``params``: every trainable
        parameter in one group by default, or parameter groups as torch.optim takes them, of
        the parameters ``pm.named_parameters()`` yields or of the model ``pm`` was built from
        (e.g. no weight decay on biases and norms), each trainable parameter in exactly one.
        Required when the plan places gradients or optimizer state apart from the parameters.
        Steps with the class's fused kernel unless ``fused`` or ``foreach`` is given. A class
        whose update is not elementwise is refused on sharded layouts unless
        ``elementwise=True`` says it is."""
        from autoshard.codegen.optim import ShardedOptimizer
        return ShardedOptimizer(self, optimizer_cls, params, **kwargs)

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
