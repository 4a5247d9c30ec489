"""Peak memory per device over a whole training step, from the liveness of values.

docs/cost-model.md §4.5. Where §4.4 adds up everything the forward saves as if it were all alive
at once, this walks the step the rank program runs and keeps a running count of the bytes that
are alive:

- **forward**, in program order (the traced graph's order; a reshard runs just before its first
  consumer, as codegen emits it): each op's outputs are allocated (a view, or an op whose output
  aliases its input in the traced graph, allocates nothing), and every tensor is freed after its
  last forward use unless an op keeps it for backward (``saved_rule``, ``Pricer.saved_inputs``:
  what is kept is the tensor the op actually read, so a resharded copy, such as a ZeRO-3 weight
  all-gathered for a matmul, lives until that matmul's backward; one tensor kept by several ops
  counts once). Ops of a checkpointed layer keep nothing: the layer keeps the tensors it reads
  from outside itself until its backward has run; under selective checkpointing it also keeps
  the outputs of its matmuls, attention and collectives (codegen/recompute.py).
- **backward**, in reverse program order (the autograd engine's order): each op's input
  gradients are allocated while its output gradients and saved tensors are alive, then those
  are freed. A view or a same-shape add passes its gradient through without a copy; a value
  read by several ops accumulates one gradient; a reshard's backward collectives make a
  gradient in the producer's layout; a parameter's gradient stays (``.grad``) from the moment
  it lands to the end of the step, unless the step program lists it as ``released``
  (``offload_overlap="backward"``: stepped as autograd completes it, after the backward of the
  first forward event that reads it, on the device with its update's moments, or sent to the
  host). A data-parallel gradient
  sync copies the gradient into its bucket's flat buffer (codegen/buckets.py), allocated
  whole when the bucket's first gradient arrives. A checkpointed layer runs its forward again when its backward first needs a saved
  tensor (``torch.utils.checkpoint`` recomputes on the first unpack): what its ops save is
  alive again, one layer at a time; selective checkpointing hands the kept outputs back
  instead of making them again.
- **parameter offload** (state mode ``offload_params``, cost/state.py): the parameter, its
  gradient and optimizer state live on the host. Each use copies the stored shard to the
  device (codegen/rewrite.py): a reshard of it holds that copy while it runs (then its output,
  as any reshard's); the ops that read it where it lies share one copy, made at the first of
  them and freed after the last, unless one keeps it for backward. Its gradient leaves the
  device as soon as it lands (or, bucketed, once its bucket is done).
- **optimizer step**: parameters, gradients and optimizer state, plus the moments the step
  program's optimizer records list (cost/program.py ``OptimizerStep.moments``: the fp32
  copies of 16-bit gradients for their masters, the update's temporaries by implementation,
  each ZeRO or offload gather back into the parameter's layout); nothing about the optimizer
  step is derived here.
- **gradient accumulation** (``PlanOptions.accumulation_steps`` > 1): the walk is the last
  micro-step, which starts with every gradient the earlier ones accumulated (the step
  program's ``held``); a bucketed gradient is added to its held copy and handed to its
  bucket, any other lands on the ``.grad`` it holds (docs/cost-model.md §7.2).

The walk's parts: the running count and the report (cost/live_memory.py), sizes and reads
(cost/walk_values.py), forward and recomputation (cost/walk_forward.py), backward, the gradient
buckets and the optimizer step (cost/walk_backward.py); the model state and the report here.

Interface (one function)::

    step_memory(traced, strategies, pricer, *, update=None, program=None,
                log=None) -> MemoryBreakdown

``traced``: the :class:`~autoshard.trace.export.TracedGraph` of a training step; ``strategies``:
node name -> :class:`~autoshard.ir.Strategy` for every placeholder and op (``Plan.strategies()``,
or the planner's assignment, as ``solver/assemble.py`` has it); ``pricer``: the
:class:`~autoshard.cost.price.Pricer` the plan is priced with (its mesh, options, checkpointed
layers, ``state_bytes``). ``update``: the optimizer's implementation, "fused" (what
``pm.optimizer`` runs unless told otherwise), "foreach" or "loop" (None: the program's, else
"fused").
``program``: the assignment's step program (cost/program.py: its events in the order the rank
runs them, its reshards, buckets and host-kept parameters), which the walk reads instead of
deriving any of them; built from ``pricer`` when not given.
``log``: a list that gets every moment the walk checks, ``(phase, node, bytes)``. For a
forward-only graph the walk is the forward alone. Linear in the graph's size (an 8B-parameter
Llama, 2,200 nodes: under a second).

:class:`MemoryBreakdown` gives ``peak`` (bytes one device holds at its fullest moment, the
largest over the phases), ``phase`` ("forward", "backward" or "optimizer") and ``at`` (the node
where it is reached), the split of the peak into ``parameters`` (parameters, buffers and
constants), ``gradients`` (parameter gradients, bucket buffers included), ``optimizer``
(optimizer state on the device), ``activations`` (tensors made in forward, or made again by
recomputation: activations, resharded copies, the step's inputs), ``temporaries`` (made in
backward or by the optimizer step: activation gradients, gradients on their way through a
reshard) and ``host`` (optimizer state kept on the host under offload; not part of the peak),
``phases``, the peak of each phase, and ``state``, the model state's totals (parameters,
gradients, optimizer, host), from which a plan's ``predicted.memory`` is made
(solver/assemble.py, plans/prediction.py ``PredictedMemory``).

Model state comes from ``Pricer.state_bytes`` (parameters, gradients, optimizer, host per
parameter; for a Pricer without it, from :func:`~autoshard.cost.memory.param_state_bytes`).
Sizes are local: each value's shape under its producer's output spec, a resharded copy under
the consumer's input spec (``autoshard.ir.local_shape``). Not modelled: buffers a kernel
allocates inside itself and frees before it returns, allocator rounding and fragmentation, and
the collectives' own staging buffers.
"""
from __future__ import annotations

from typing import Any

from autoshard.cost.compute import local_numel
from autoshard.cost.live_memory import MemoryBreakdown, Storage
from autoshard.cost.memory import param_state_bytes
from autoshard.cost.program import UPDATES, StepProgram, program_for
from autoshard.cost.walk_backward import BackwardWalk
from autoshard.errors import AutoshardError
from autoshard.ir import Phase, Strategy

__all__ = ["MemoryBreakdown", "stage_memory", "step_memory"]


def step_memory(traced: Any, strategies: dict[str, Strategy], pricer: Any, *,
                update: str | None = None, program: StepProgram | None = None,
                log: list[tuple[str, str, int]] | None = None) -> MemoryBreakdown:
    """Peak bytes one device holds over a training step (forward, backward, optimizer step) of
    ``traced`` under ``strategies``, priced with ``pricer``; see the module docstring.

    ``update``: the optimizer's implementation, "fused" (no temporaries; ``pm.optimizer``'s
    default), "foreach" or "loop" (torch's others); None: the program's.
    ``program``: the step program of this assignment (cost/program.py), if at hand; else built.
    ``log``: a list to append every moment the walk checks, as (phase, node, bytes)."""
    if update is not None and update not in UPDATES:
        raise AutoshardError(f"an optimizer update among {UPDATES}", got=repr(update),
                             fix='pass update="fused" (pm.optimizer\'s default)')
    if program is None or (update is not None and program.optimizer.update != update):
        program = program_for(traced, strategies, pricer, update or "fused")
    assert not traced.training or program.optimizer.optimizer == \
        pricer.options.state_optimizer, "a step program built without its optimizer step"
    walk = _Walk(traced, strategies, pricer, program)
    walk.mem.log = log
    return walk.run()


def stage_memory(traced: Any, strategies: dict[str, Strategy], pricer: Any,
                 program: StepProgram, *, in_flight: int = 1) -> MemoryBreakdown:
    """One pipeline stage's peak over its step (docs/cost-model.md §10.4): the walk of its
    program (``program.stage`` set: cost/program.py ``stage_program``) for one microbatch, what
    other stages make received before its forward and what it makes for them sent after, their
    gradients back; with the activations the other ``in_flight - 1`` microbatches the schedule
    keeps in flight (autoshard/schedules.py ``in_flight``) alive through its forward and
    backward, each what one microbatch's forward leaves for its backward (the walk's)."""
    assert program.stage is not None, "a stage's program (stage_program)"
    walk = _Walk(traced, strategies, pricer, program)
    walk.in_flight = max(1, int(in_flight))
    return walk.run()


class _Walk(BackwardWalk):
    """The whole walk: the model state alive throughout, forward, backward and the optimizer
    step (cost/walk_forward.py, cost/walk_backward.py), and the report."""

    def run(self) -> MemoryBreakdown:
        mem = self.mem
        self.state: dict[str, Any] = {}
        host = 0
        self.tensors: dict[Any, Storage] = {}
        # Model state, the step's inputs: alive throughout (a stage's: those its ops read).
        mine = self._stage_placeholders()
        for node in self.graph.nodes:
            if node.op != "placeholder":
                continue
            ref = (node.name, 0)
            if node.name in self.tied_to or (mine is not None and node.name not in mine):
                continue
            ph = self.traced.placeholder(node.name)
            strat = self.strategies.get(node.name)
            if ph.info is None or strat is None:
                continue
            if ph.kind == "input":
                self.tensors[ref] = mem.alloc(self._value_bytes(ref), "activations")
                continue
            st = self._state(node.name, strat)
            self.state[node.name] = st
            self.tensors[ref] = mem.alloc(int(st["parameters"]), "parameters")
            if st["optimizer"]:
                mem.alloc(int(st["optimizer"]), "optimizer")
            host += int(st["host"])
        for name, first in self.tied_to.items():
            if (first, 0) in self.tensors:
                self.tensors[(name, 0)] = self.tensors[(first, 0)]
        self.pinned = set(self.tensors)
        self.p_grad: dict[str, Storage] = {}
        # Gradient accumulation: what the earlier micro-steps left, alive from the start.
        self.held_grad: dict[str, Storage] = {}
        for name, nbytes in self.program.held.items():
            held = self.mem.alloc(nbytes, "gradients")
            if name in self.program.bucketed:
                self.held_grad[name] = held         # the bucket's held copy (no_sync)
            else:
                self.p_grad[name] = held            # .grad

        mem.phase = Phase.FORWARD
        self.held: dict[str, list[Storage]] = {}        # backward node -> saved storages
        self.region_held: dict[str, list[Storage]] = {}
        start = mem.total
        loss = self._forward(self.events, recompute=False)
        kept = mem.total - start
        if self.training:
            mem.phase = Phase.BACKWARD
            for s in loss:
                mem.unref(s)
            self._backward()
            mem.phase = Phase.OPTIMIZER
            self._optimizer()
        # A pipeline stage's other microbatches in flight (stage_memory): what each one's
        # forward leaves for its backward is alive through this one's forward and backward.
        others = (self.in_flight - 1) * kept
        phases: dict[str, int] = {}
        best: tuple[int, str, str, dict[str, int]] = (-1, Phase.FORWARD, "", {})
        for ph, (total, at, live) in mem.best.items():
            if ph != Phase.OPTIMIZER and others:
                total, live = total + others, {**live, "activations": live["activations"] + others}
            phases[ph] = int(total)
            if total > best[0]:        # the first of equal peaks, as the walk met them
                best = (total, ph, at, live)
        total, phase, at, live = best
        return MemoryBreakdown(peak=int(total), phase=phase, at=at,
                               parameters=live["parameters"], gradients=live["gradients"],
                               optimizer=live["optimizer"], activations=live["activations"],
                               temporaries=live["temporaries"], host=host,
                               phases=phases,
                               state={k: int(sum(st[k] for st in self.state.values()))
                                      for k in ("parameters", "gradients", "optimizer", "host")})

    def _stage_placeholders(self) -> set[str] | None:
        """A stage's placeholders: those its events read (a tied name's first name too); None
        for the whole step."""
        if self.stage is None:
            return None
        out: set[str] = set()
        for ev in self.events:
            for key in self._event_reads(ev):
                name = self.edges[key[1]].value[0] if key[0] == "edge" else key[1] \
                    if key[0] == "fetch" else key[0]
                if self.nodes[name].op == "placeholder":
                    out |= {name, self.tied_to.get(name, name)}
        return out

    def _state(self, name: str, strategy: Strategy) -> dict[str, float]:
        """One placeholder's parameters, gradients, optimizer and host bytes."""
        sb = getattr(self.pricer, "state_bytes", None)
        if callable(sb):
            s = sb(name, strategy)
            return {"parameters": s.parameters, "gradients": s.gradients,
                    "optimizer": s.optimizer, "host": getattr(s, "host", 0.0)}
        ph = self.traced.placeholder(name)
        numel = local_numel(tuple(ph.info.shape), strategy.outputs[0], self.mesh_shape)
        isz = ph.info.dtype.itemsize
        if ph.kind != "param":
            return {"parameters": numel * isz, "gradients": 0, "optimizer": 0, "host": 0}
        opt = self.pricer.options.state_optimizer
        total = param_state_bytes(numel, ph.info.dtype, optimizer=opt)
        grads = 0 if opt == "none" else numel * isz
        return {"parameters": numel * isz, "gradients": grads,
                "optimizer": total - numel * isz - grads, "host": 0}
