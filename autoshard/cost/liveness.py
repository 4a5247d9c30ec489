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
  it lands to the end of the step. A data-parallel gradient sync copies the gradient into its
  bucket's flat buffer (codegen/buckets.py), allocated whole when the bucket's first gradient
  arrives. A checkpointed layer runs its forward again when its backward first needs a saved
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

Interface (one function)::

    step_memory(traced, strategies, pricer, *, update=None, program=None,
                log=None) -> MemoryBreakdown

``traced``: the :class:`~autoshard.trace.export.TracedGraph` of a training step; ``strategies``:
node name -> :class:`~autoshard.ir.Strategy` for every placeholder and op (``Plan.strategies()``,
or the planner's assignment, as ``solver.planner.assemble`` has it); ``pricer``: the
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
gradients, optimizer, host). ``to_json()`` is the dict for a plan's ``predicted["memory"]``.

Model state comes from ``Pricer.state_bytes`` (parameters, gradients, optimizer, host per
parameter; for a Pricer without it, from :func:`~autoshard.cost.memory.param_state_bytes`).
Sizes are local: each value's shape under its producer's output spec, a resharded copy under
the consumer's input spec (``autoshard.ir.local_shape``). Not modelled: buffers a kernel
allocates inside itself and frees before it returns, allocator rounding and fragmentation, and
the collectives' own staging buffers.
"""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import torch
import torch.fx as fx

from autoshard.cost.comm import Reshard
from autoshard.cost.compute import local_numel, op_profile
from autoshard.cost.memory import param_state_bytes, saved_rule
from autoshard.cost.program import UPDATES, Event, StepProgram, node_reads, program_for
from autoshard.errors import AutoshardError
from autoshard.ir import Strategy, shard_factor
from autoshard.ops.registry import PASSES, VIEW, WIDENS, record_of
from autoshard.trace.graph import ValueRef, value_inputs, value_ref

aten = torch.ops.aten

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


@dataclass(frozen=True)
class MemoryBreakdown:
    """One device's peak over a training step and what it holds then (bytes; see the module
    docstring). ``parameters + gradients + optimizer + activations + temporaries == peak``;
    ``phases``: the peak of each phase; ``state``: the model state's totals over the step
    (parameters, gradients, optimizer, host: ``Pricer.state_bytes`` summed), whatever part of
    it is alive at the peak."""

    peak: int
    phase: str
    at: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int
    host: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    state: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)




class _Storage:
    """One tensor storage: its bytes, category, and the references holding it. ``permuted``: a
    gradient that is a transposed view (reshaping it copies)."""

    __slots__ = ("nbytes", "cat", "refs", "permuted")

    def __init__(self, nbytes: int, cat: str) -> None:
        self.nbytes, self.cat, self.refs, self.permuted = int(nbytes), cat, 0, False


class _Memory:
    """Live bytes by category, with the peak of each phase and the split at it."""

    def __init__(self) -> None:
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.phase = "forward"
        # Per phase, in the order they run: its peak, where, and the split then.
        self.best: dict[str, tuple[int, str, dict[str, int]]] = {}
        self.log: list[tuple[str, str, int]] | None = None     # (phase, at, bytes) per moment

    def alloc(self, nbytes: int, cat: str, refs: int = 1) -> _Storage:
        s = _Storage(nbytes, cat)
        self.live[cat] += s.nbytes
        self.total += s.nbytes
        s.refs = refs
        if refs == 0:
            self._free(s)
        return s

    def ref(self, s: _Storage, n: int = 1) -> _Storage:
        s.refs += n
        return s

    def unref(self, s: _Storage | None, n: int = 1) -> None:
        if s is None:
            return
        s.refs -= n
        assert s.refs >= 0, "a storage released more often than held"
        if s.refs == 0:
            self._free(s)

    def _free(self, s: _Storage) -> None:
        self.live[s.cat] -= s.nbytes
        self.total -= s.nbytes

    def recategorize(self, s: _Storage, cat: str) -> None:
        if s.refs > 0:
            self.live[s.cat] -= s.nbytes
            self.live[cat] += s.nbytes
        s.cat = cat

    def mark(self, at: str, extra: int = 0, extra_cat: str = "temporaries") -> None:
        """A moment to check: what is alive now, plus ``extra`` bytes that exist only during
        this moment (a kernel's transient output)."""
        total = self.total + extra
        if self.log is not None:
            self.log.append((self.phase, at, total))
        if total > self.best.get(self.phase, (-1,))[0]:
            live = dict(self.live)
            live[extra_cat] += extra
            self.best[self.phase] = (total, at, live)


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


# ------------------------------------------------------------------------------------------------


def _fake(node: fx.Node, idx: int) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[idx] if idx < len(val) else None
    return val if isinstance(val, torch.Tensor) else None


def _storage_key(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:     # noqa: BLE001 (a tensor without a storage: no aliasing known)
        return None


class _Walk:
    def __init__(self, traced: Any, strategies: dict[str, Strategy], pricer: Any,
                 program: StepProgram) -> None:
        self.traced, self.strategies, self.pricer = traced, strategies, pricer
        self.graph: fx.Graph = traced.graph
        self.mesh_shape = tuple(pricer.mesh.shape)
        self.training = bool(traced.training)
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.params = {p.name for p in traced.params}
        self.tied_to: dict[str, str] = getattr(pricer, "tied_to", {})
        self.grads: set[str] = pricer.grads if self.training else set()
        self.mem = _Memory()
        self.program = program
        self.edges = program.edges
        self.edge_of = program.edge_of
        self.saved_at: set[tuple[str, int]] = {c for cons in pricer.saved_inputs().values()
                                               for c in cons} if self.training else set()
        recompute = getattr(pricer, "recompute", None) or {}
        # Layer -> checkpointing policy ("full", "selective"); a set of names is all "full".
        self.policies: dict[str, str] = dict(recompute) if isinstance(recompute, dict) else {
            layer: "full" for layer in recompute}
        self.recompute: frozenset[str] = frozenset(self.policies)
        self.stored: dict[str, list[tuple[Any, _Storage]]] = {}
        self.events = program.events
        self.edge_region = {ev.edge: ev.region for ev in self.events if ev.kind == "reshard"}
        self.op_region = {ev.name: ev.region for ev in self.events if ev.kind == "op"}
        self.region_ops: dict[str, set[str]] = {}
        self.region_events: dict[str, list[Event]] = {}
        for ev in self.events:
            if ev.region is not None:
                self.region_events.setdefault(ev.region, []).append(ev)
                if ev.kind == "op":
                    self.region_ops.setdefault(ev.region, set()).add(ev.name)
        self.buckets = program.buckets
        self.bucket_of = program.bucket_of
        # A pipeline stage (cost/program.py stage_program): its ops, and the values it makes
        # that later stages read (sent after its forward, their gradients received back).
        self.stage = program.stage
        self.sent: list[ValueRef] = []
        if self.stage is not None:
            seen: set[ValueRef] = set()
            for n in self.graph.nodes:
                if n.op == "call_function" and n.name not in self.stage \
                        and n.target is not operator.getitem:
                    for ref in value_inputs(n):
                        if ref[0] in self.stage and ref not in seen:
                            seen.add(ref)
                            self.sent.append(ref)
        self.in_flight = 1     # a stage's microbatches whose activations are alive at once
        # Parameters kept on the host (offload_params), by every placeholder name they have.
        self.fetched = program.fetched
        # Where the copy the direct readers of such a parameter share is made: the checkpointed
        # layer of the first of them (None: outside any).
        self.fetch_region: dict[str, str | None] = {}
        for ev in self.events:
            if ev.kind == "op" and self.fetched:
                for key in self._event_reads(ev):
                    if key[0] == "fetch" and key[1] not in self.fetch_region:
                        self.fetch_region[key[1]] = ev.region

    # -- sizes ----------------------------------------------------------------------------
    def _local_bytes(self, ref: ValueRef, spec: Any) -> int:
        shape, itemsize = self.pricer.shapes[ref]
        return local_numel(tuple(shape), spec, self.mesh_shape) * itemsize

    def _out_spec(self, ref: ValueRef) -> Any:
        strat = self.strategies.get(ref[0])
        if strat is None or ref[1] >= len(strat.outputs):
            return None
        return strat.outputs[ref[1]]

    def _value_bytes(self, ref: ValueRef) -> int:
        return self._local_bytes(ref, self._out_spec(ref))

    def _edge_bytes(self, i: int) -> int:
        e = self.edges[i]
        return self._local_bytes(e.value, e.dst)

    def _fake_of(self, ref: ValueRef) -> Any:
        return _fake(self.nodes[ref[0]], ref[1])

    def _floating(self, ref: ValueRef) -> bool:
        t = self._fake_of(ref)
        return t is not None and (t.dtype.is_floating_point or t.dtype.is_complex)

    def _needs_grad(self, ref: ValueRef) -> bool:
        """Whether autograd computes a gradient for the value: a floating value computed from a
        parameter; an output that aliases an input (a view among several outputs) only if
        that input needs one."""
        if not (self.training and ref[0] in self.grads and self._floating(ref)):
            return False
        node = self.nodes[ref[0]]
        if node.op != "call_function":
            return True
        val = node.meta.get("val")
        if not isinstance(val, (tuple, list)):
            return True
        ins = [k for k, j in self._aliases(node).items() if j == ref[1]]
        refs = value_inputs(node)
        return not ins or any(self._needs_grad(refs[k]) for k in ins)

    def _steps_transient(self, steps: Iterable, nbytes: int) -> tuple[int, int]:
        """(the largest bytes alive at once besides the input while ``steps`` run on a tensor
        of ``nbytes``, the final bytes): each collective's output is made while its input is
        alive; an all-gather or a reduce-scatter along a dim other than 0 and an all-to-all
        stage one more copy (autoshard/codegen/collectives.py)."""
        cur, most, first = nbytes, 0, True
        for s in steps:
            n = s.group_size(self.mesh_shape) if s.axis < len(self.mesh_shape) else 1
            if s.kind == "all_gather":
                out, stage = cur * n, (cur * n if s.dim != 0 else 0)
            elif s.kind in ("reduce_scatter", "slice"):
                out, stage = cur // n, (cur if s.kind == "reduce_scatter" and s.dim != 0 else 0)
            elif s.kind == "all_to_all":
                out, stage = cur, 2 * cur
            else:
                out, stage = cur, 0
            held = 0 if first else cur      # an intermediate is held while the next step runs
            most = max(most, held + stage + out)
            cur, first = out, False
        return most, cur

    def _reshard_aliases(self, r: Reshard) -> bool:
        """Whether the reshard's forward leaves the tensor where it is (no steps, or a slice of
        a contiguous block: ``chunk(...)[i].contiguous()`` along dim 0 copies nothing)."""
        return all(s.kind == "slice" and s.dim == 0 for s in r.forward)

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> MemoryBreakdown:
        mem = self.mem
        self.state: dict[str, Any] = {}
        host = 0
        self.tensors: dict[Any, _Storage] = {}
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
        self.p_grad: dict[str, _Storage] = {}
        # Gradient accumulation: what the earlier micro-steps left, alive from the start.
        self.held_grad: dict[str, _Storage] = {}
        for name, nbytes in self.program.held.items():
            held = self.mem.alloc(nbytes, "gradients")
            if name in self.program.bucketed:
                self.held_grad[name] = held         # the bucket's held copy (no_sync)
            else:
                self.p_grad[name] = held            # .grad

        mem.phase = "forward"
        self.held: dict[str, list[_Storage]] = {}        # backward node -> saved storages
        self.region_held: dict[str, list[_Storage]] = {}
        start = mem.total
        loss = self._forward(self.events, recompute=False)
        kept = mem.total - start
        if self.training:
            mem.phase = "backward"
            for s in loss:
                mem.unref(s)
            self._backward()
            mem.phase = "optimizer"
            self._optimizer()
        # A pipeline stage's other microbatches in flight (stage_memory): what each one's
        # forward leaves for its backward is alive through this one's forward and backward.
        others = (self.in_flight - 1) * kept
        phases: dict[str, int] = {}
        best: tuple[int, str, str, dict[str, int]] = (-1, "forward", "", {})
        for ph, (total, at, live) in mem.best.items():
            if ph != "optimizer" and others:
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

    # -- forward ----------------------------------------------------------------------------
    def _forward(self, events: list[Event], *, recompute: bool) -> list[_Storage]:
        """Run ``events`` forward. Outside recomputation: the whole program, returning the loss's
        storages (held until backward starts). Recomputing a checkpointed layer: its events,
        whose saved tensors are held for their backward."""
        mem = self.mem
        tensors = self.tensors
        uses: dict[Any, int] = {}
        self.born_here: set[Any] = set()
        for ev in events:
            for key in self._event_reads(ev):
                uses[key] = uses.get(key, 0) + 1
        if not recompute:
            self._ends(uses)
        started: set[str] = set()
        for ev in events:
            region = ev.region
            if region is not None and not recompute and region not in started:
                started.add(region)
                self._hold_region_inputs(region)
            if ev.kind == "reshard":
                e = self.edges[ev.edge]
                src = tensors.get(e.value)
                key = ("edge", ev.edge)
                if src is None:
                    continue
                store = self._stores_reshard(ev)
                raw = self._collective_outputs(e.reshard, self._local_bytes(e.value, e.src)) \
                    if store else []
                if recompute and store and raw[-1][1]:
                    tensors[key] = self._take(region, key)        # stored: replayed
                    mem.mark(ev.name)
                    self._drop_staging(region, ev.edge)
                elif self._reshard_aliases(e.reshard):
                    if e.value[0] in self.fetched:     # the copy in from the host
                        tensors[key] = mem.alloc(self._local_bytes(e.value, e.src),
                                                 "activations")
                    else:
                        tensors[key] = mem.ref(src)
                    mem.mark(ev.name)
                else:
                    nin = self._local_bytes(e.value, e.src)
                    most, _ = self._steps_transient(e.reshard.forward, nin)
                    out = self._edge_bytes(ev.edge)
                    tensors[key] = mem.alloc(out, "activations")
                    # A parameter kept on the host: its copy in is alive while it is gathered.
                    held = nin if e.value[0] in self.fetched else 0
                    mem.mark(ev.name, extra=max(0, most - out) + held, extra_cat="activations")
                    if recompute and store:     # made again from the stored staging output
                        self._drop_staging(region, ev.edge)
                if store and not recompute:
                    # Selective checkpointing keeps every collective's own output: the final
                    # tensor, or a staging one the final is cut or concatenated from.
                    for nbytes, final in raw:
                        if final:
                            self._store(region, key)
                        else:
                            self.stored.setdefault(region, []).append(
                                (("staging", ev.edge), mem.alloc(nbytes, "activations")))
                self._born(key, uses)
                self._use(e.value, uses)
                continue
            node = self.nodes[ev.name]
            reads = self._event_reads(ev)
            for key in reads:
                if key[0] == "fetch" and key not in self.born_here and (
                        not recompute or self.fetch_region.get(key[1]) == region):
                    # The copy in of a parameter kept on the host, made for its first direct
                    # reader (again where that reader is recomputed).
                    tensors[key] = mem.alloc(self._local_bytes((key[1], 0),
                                                               self._out_spec((key[1], 0))),
                                             "activations")
                    self._born(key, uses)
            store = self._stores_op(node.name)
            if recompute and store:
                outs = self._replayed_outputs(region, node)
            else:
                outs = self._outputs(node, reads)
            mem.mark(node.name, extra=self._workspace(node.name)[0])
            if store and not recompute:
                for key in outs:
                    self._store(region, key)
            if self.training and (recompute or region is None):
                self._hold_saved(node, reads, outs)
            for key in outs:
                self._born(key, uses)
            for key in reads:
                self._use(key, uses)
        if recompute:
            return []
        for key in self.sent:
            self._use(key, uses)
        loss = []
        for key in self._loss_keys():
            if key in tensors:
                loss.append(mem.ref(tensors[key]))
                self._use(key, uses)
        return loss

    def _ends(self, uses: dict[Any, int]) -> None:
        """The program's ends in forward: the loss and, on a pipeline stage, the values sent
        on to the next stages are read once more at its end; the values received from earlier
        stages are there before its first op."""
        for key in [*self._loss_keys(), *self.sent]:
            uses[key] = uses.get(key, 0) + 1
        for key in [k for k in uses if self._received(k)]:
            self.tensors[key] = self.mem.alloc(self._value_bytes(key), "activations")
            self._born(key, uses)

    def _loss_keys(self) -> list[Any]:
        """What the graph's output reads (the loss), where this program makes it."""
        out_node = next(n for n in self.graph.nodes if n.op == "output")
        return [self._delivered(ref, (out_node.name, k))
                for k, ref in enumerate(node_reads(out_node)) if self._made_here(ref)]

    def _made_here(self, ref: ValueRef) -> bool:
        """Whether this program makes ``ref``: always, unless it is a pipeline stage's
        (``StepProgram.stage``) and another stage's op makes it."""
        return self.stage is None or ref[0] in self.stage or \
            self.nodes[ref[0]].op != "call_function"

    def _received(self, key: Any) -> bool:
        return key[0] not in ("edge", "fetch") and not self._made_here(key)

    def _event_reads(self, ev: Event) -> list[Any]:
        if ev.kind == "reshard":
            return [self.edges[ev.edge].value]
        node = self.nodes[ev.name]
        return [self._delivered(ref, (node.name, k)) for k, ref in enumerate(value_inputs(node))]

    def _delivered(self, ref: ValueRef, consumer: tuple[str, int]) -> Any:
        """The tensor a consumer reads: the value, or its resharded copy, or (a parameter kept
        on the host, read where it lies) the copy its direct readers share."""
        i = self.edge_of.get((ref, consumer))
        if i is not None:
            return ("edge", i)
        if ref[0] in self.fetched:
            return ("fetch", ref[0])
        return ref

    def _born(self, key: Any, uses: dict[Any, int]) -> None:
        """A tensor just made: it holds its storage while forward reads remain."""
        self.born_here.add(key)
        if uses.get(key, 0) == 0 and key not in self.pinned:
            self.mem.unref(self.tensors.get(key))

    def _use(self, key: Any, uses: dict[Any, int]) -> None:
        """One forward read of ``key`` done; its last releases the tensor (a tensor made before
        a recomputation, a checkpointed layer's input, is held by the layer instead)."""
        if key in self.pinned or key not in self.born_here:
            return
        uses[key] -= 1
        if uses[key] == 0:
            self.mem.unref(self.tensors.get(key))

    def _outputs(self, node: fx.Node, reads: list[Any]) -> list[Any]:
        """Make the op's outputs: a new storage each, or the input's storage where the traced
        graph's output aliases an input."""
        ins = [a for a in torch.utils._pytree.tree_flatten((node.args, node.kwargs))[0]
               if isinstance(a, fx.Node)]
        in_keys = {}
        for k, a in enumerate(ins):
            ref = value_ref(a)
            t = self._fake_of(ref) if ref[0] in self.nodes else None
            sk = _storage_key(t) if t is not None else None
            if sk is not None:
                in_keys.setdefault(sk, k)
        val = node.meta.get("val")
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        outs = []
        for j in range(n_out):
            ref = (node.name, j)
            t = _fake(node, j)
            if t is None:
                continue
            sk = _storage_key(t)
            k = in_keys.get(sk) if sk is not None else None
            if k is not None and k < len(reads) and reads[k] in self.tensors:
                self.tensors[ref] = self.mem.ref(self.tensors[reads[k]])
            else:
                self.tensors[ref] = self.mem.alloc(self._value_bytes(ref), "activations")
            outs.append(ref)
        return outs

    def _hold_saved(self, node: fx.Node, reads: list[Any], outs: list[Any]) -> None:
        """What the op keeps for its backward, held until it runs."""
        if node.name not in self.grads:
            return                           # no gradient flows through it: autograd keeps nothing
        info = self.pricer.info(node.name)
        rule = saved_rule(info)
        held: list[_Storage] = []
        for k in rule.inputs:
            if k < len(reads) and (node.name, k) in self.saved_at and reads[k] in self.tensors:
                held.append(self.mem.ref(self.tensors[reads[k]]))
        for j in rule.outputs:
            ref = (node.name, j)
            if ref in self.tensors and ref in outs:
                held.append(self.mem.ref(self.tensors[ref]))
        extra = self._extra_bytes(node.name, info, rule)
        if extra:
            held.append(self.mem.alloc(extra, "activations"))
        if held:
            self.held.setdefault(node.name, []).extend(held)

    def _saves(self, node: fx.Node) -> bool:
        """Whether the op keeps anything for its backward."""
        if not self.training or node.name not in self.grads:
            return False
        rule = saved_rule(self.pricer.info(node.name))
        return bool(rule.outputs or rule.extra) or any((node.name, k) in self.saved_at
                                                       for k in rule.inputs)

    def _extra_bytes(self, name: str, info: Any, rule: Any) -> int:
        """Buffers the op keeps that are not graph values: per-row statistics, masks
        (``Saves.extra``, as memory.saved_activation_bytes counts them)."""
        prof = op_profile(info)
        strat = self.strategies[name]
        ins = strat.inputs if len(strat.inputs) == len(prof.inputs) else tuple(
            s for s in strat.inputs if s is not None)
        total = 0
        for side, idx, per, nbytes in rule.extra:
            infos = prof.inputs if side == "in" else prof.outputs
            specs = ins if side == "in" else strat.outputs
            if idx >= len(infos):
                continue
            shape, isz = infos[idx]
            spec = specs[idx] if idx < len(specs) else None
            n = local_numel(tuple(shape), spec, self.mesh_shape)
            if per == "row" and shape:
                last = shape[-1] // (shard_factor(spec, len(shape) - 1, self.mesh_shape)
                                     if spec else 1)
                n //= max(last, 1)
            total += n * (nbytes or isz)
        return total

    def _hold_region_inputs(self, region: str) -> None:
        """A checkpointed layer keeps the tensors it reads from outside itself (its inputs;
        parameters are alive anyway) until its backward has run."""
        inside = self.region_ops.get(region, set())
        held: dict[int, _Storage] = {}
        for ev in self.region_events.get(region, []):
            keys = [self.edges[ev.edge].value] if ev.kind == "reshard" else self._event_reads(ev)
            for key in keys:
                produced_inside = (key[0] not in ("edge", "fetch") and key[0] in inside) or (
                    key[0] == "edge" and self.edge_region.get(key[1]) == region) or (
                    key[0] == "fetch" and self.fetch_region.get(key[1]) == region)
                if produced_inside or key in self.pinned or key not in self.tensors:
                    continue
                s = self.tensors[key]
                if id(s) not in held:
                    held[id(s)] = self.mem.ref(s)
        self.region_held[region] = list(held.values())

    # -- backward ---------------------------------------------------------------------------
    def _backward(self) -> None:
        mem = self.mem
        self.grad: dict[Any, _Storage] = {}
        self.bucket_buf: dict[int, _Storage] = {}
        self.bucket_out: dict[int, _Storage] = {}
        self.bucket_held: dict[int, list[_Storage]] = {}
        # The loss's gradient: a scalar (ones_like), for the loss's producer.
        for key in self._loss_keys():
            self.grad[key] = mem.alloc(4, "temporaries")
        # A stage's sent values: their gradients come back from the next stage.
        for key in self.sent:
            if self._needs_grad(key):
                self.grad[key] = mem.alloc(self._value_bytes(key), "temporaries")
        regions_done: set[str] = set()
        region_first: dict[str, int] = {}
        for i, ev in enumerate(self.events):
            if ev.region is not None:
                region_first.setdefault(ev.region, i)
        for i in range(len(self.events) - 1, -1, -1):
            ev = self.events[i]
            # torch.utils.checkpoint recomputes a layer when its backward first unpacks a saved
            # tensor: at the layer's last op that saves one (the backward of the reshards and
            # adds after it runs before that).
            if ev.region is not None and ev.region not in regions_done and ev.kind == "op" \
                    and self._saves(self.nodes[ev.name]):
                regions_done.add(ev.region)
                self._recompute(ev.region)
            if ev.kind == "reshard":
                self._reshard_backward(ev)
            else:
                self._op_backward(self.nodes[ev.name])
            if ev.region is not None and region_first[ev.region] == i:
                for s in self.region_held.pop(ev.region, []):
                    mem.unref(s)
        for s in list(self.grad.values()):
            mem.unref(s)
        self.grad.clear()
        self._finish_buckets()

    def _recompute(self, region: str) -> None:
        """The layer's forward again, its reshards included, holding what its ops save; under
        selective checkpointing the stored outputs are handed back instead of made again, and
        the store lets go of them."""
        phase = self.mem.phase
        self._forward(self.region_events.get(region, []), recompute=True)
        self.mem.phase = phase
        for _, s in self.stored.pop(region, []):
            self.mem.unref(s)

    # -- selective checkpointing ------------------------------------------------------------
    def _selective(self, region: str | None) -> bool:
        return region is not None and self.policies.get(region) == "selective"

    def _stores_op(self, name: str) -> bool:
        """Whether selective checkpointing keeps the op's outputs from forward to its layer's
        recomputation (codegen/recompute.py: matmuls and attention, ``Pricer.stores``)."""
        if not self._selective(self.op_region.get(name)):
            return False
        stores = getattr(self.pricer, "stores", None)
        if callable(stores):
            return bool(stores(name))
        return record_of(self.nodes[name].target).family in ("matmul", "attention")

    def _stores_reshard(self, ev: Event) -> bool:
        """Selective checkpointing keeps every collective's output (a replay moves nothing)."""
        return self._selective(ev.region) and any(
            st.is_collective for st in self.edges[ev.edge].reshard.forward)

    def _collective_outputs(self, r: Reshard, nbytes: int) -> list[tuple[int, bool]]:
        """(bytes, whether it is the reshard's result) of the output of each collective of
        ``r``'s forward, run on a tensor of ``nbytes`` (codegen/collectives.py: an all-gather
        along a dim other than 0 and an all-to-all concatenate their collective's output)."""
        out, cur = [], nbytes
        steps = list(r.forward)
        for i, st in enumerate(steps):
            n = st.group_size(self.mesh_shape) if st.axis < len(self.mesh_shape) else 1
            last = i == len(steps) - 1
            if st.kind == "all_gather":
                cur *= n
                out.append((cur, last and st.dim == 0))
            elif st.kind == "reduce_scatter":
                cur //= n
                out.append((cur, last))
            elif st.kind in ("all_reduce", "all_to_all"):
                out.append((cur, last and st.kind == "all_reduce"))
            elif st.kind == "slice":
                cur //= n
        return out or [(0, False)]

    def _store(self, region: str, key: Any) -> None:
        s = self.tensors.get(key)
        if s is not None:
            self.stored.setdefault(region, []).append((key, self.mem.ref(s)))

    def _take(self, region: str, key: Any) -> _Storage:
        """A stored output handed back by the replay (the store's reference goes with it)."""
        entries = self.stored.get(region, [])
        for i, (k, s) in enumerate(entries):
            if k == key:
                return entries.pop(i)[1]
        return self.mem.alloc(self._value_bytes(key) if key[0] != "edge"
                              else self._edge_bytes(key[1]), "activations")

    def _drop_staging(self, region: str, edge: int) -> None:
        """The stored staging outputs of a reshard, once its result is made from them."""
        entries = self.stored.get(region, [])
        for s in [s for k, s in entries if k == ("staging", edge)]:
            self.mem.unref(s)
        self.stored[region] = [(k, s) for k, s in entries if k != ("staging", edge)]

    def _replayed_outputs(self, region: str, node: fx.Node) -> list[Any]:
        val = node.meta.get("val")
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        outs = []
        for j in range(n_out):
            if _fake(node, j) is not None:
                self.tensors[(node.name, j)] = self._take(region, (node.name, j))
                outs.append((node.name, j))
        return outs

    def _contribute(self, key: Any, s: _Storage, at: str) -> None:
        """A gradient for ``key`` arrives (one reference on ``s`` handed over)."""
        mem = self.mem
        if key[0] == "fetch":
            self._land(self.tied_to.get(key[1], key[1]), s, at)
            return
        if key[0] != "edge" and (key[0] in self.params or key[0] in self.tied_to):
            self._land(self.tied_to.get(key[0], key[0]), s, at)
            return
        old = self.grad.get(key)
        if old is None:
            self.grad[key] = s
            return
        # Accumulate: in place into whichever of the two is not shared, else into a new one.
        if old.refs == 1 or s.refs == 1:
            mem.mark(at)
            keep, drop = (old, s) if old.refs == 1 else (s, old)
            self.grad[key] = keep
            mem.unref(drop)
            return
        new = mem.alloc(max(old.nbytes, s.nbytes), "temporaries")
        mem.mark(at)
        self.grad[key] = new
        mem.unref(old)
        mem.unref(s)

    def _land(self, param: str, s: _Storage, at: str) -> None:
        """A parameter's gradient reaches ``.grad`` (AccumulateGrad): stolen if no one else
        holds it, else copied; a second one is added in place."""
        mem = self.mem
        if param in self.fetched:
            # Kept on the host: the gradient goes down to it as it lands (codegen/rewrite.py).
            mem.mark(at)
            mem.unref(s)
            return
        old = self.p_grad.get(param)
        if old is None:
            if s.refs == 1:
                mem.recategorize(s, "gradients")
                self.p_grad[param] = s
            else:
                self.p_grad[param] = mem.alloc(s.nbytes, "gradients")
                mem.mark(at)
                mem.unref(s)
            return
        mem.mark(at)
        mem.unref(s)

    def _op_backward(self, node: fx.Node) -> None:
        mem = self.mem
        name = node.name
        val = node.meta.get("val")
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        out_grads = {j: self.grad.pop((name, j)) for j in range(n_out) if (name, j) in self.grad}
        held = self.held.pop(name, [])
        if not out_grads or name not in self.grads:
            for s in [*out_grads.values(), *held]:
                mem.unref(s)
            return
        refs = value_inputs(node)
        record = record_of(node.target)     # how its backward makes gradients (ops/registry.py)
        view = record.family == VIEW
        alias = self._aliases(node)
        new_grads: list[tuple[Any, _Storage]] = []
        for k, ref in enumerate(refs):
            if not self._needs_grad(ref):
                continue
            key = self._delivered(ref, (name, k))
            nbytes = self._local_bytes(ref, self.edges[key[1]].dst) if key[0] == "edge" \
                else self._value_bytes(ref)      # (a parameter's copy in: its stored bytes)
            g0 = out_grads.get(alias.get(k, -1))
            if g0 is not None and record.grad != WIDENS:
                # A view's (or an aliasing op's) gradient is its output's, reshaped: a copy only
                # where a transposed gradient has to become contiguous.
                if view and self._reshapes(node) and g0.permuted:
                    new_grads.append((key, mem.alloc(nbytes, "temporaries")))
                else:
                    if view and self._permutes(node):
                        g0.permuted = not g0.permuted
                    new_grads.append((key, mem.ref(g0)))
            elif record.grad == PASSES and len(out_grads) == 1 \
                    and next(iter(out_grads.values())).nbytes == nbytes:
                new_grads.append((key, mem.ref(next(iter(out_grads.values())))))
            else:
                new_grads.append((key, mem.alloc(nbytes, "temporaries")))
        extra = 0
        if record.logits and refs:     # the log-softmax's gradient, then the logits'
            extra = self._local_bytes(refs[0], self._in_spec(node, 0))
        mem.mark(name, extra=extra + self._workspace(name)[1])
        for s in [*out_grads.values(), *held]:
            mem.unref(s)
        for key, s in new_grads:
            self._contribute(key, s, name)

    def _workspace(self, name: str) -> tuple[int, int]:
        """What the op's kernel holds while it runs (ops/registry.py ``workspace``)."""
        fn = getattr(self.pricer, "workspace", None)
        return fn(name, self.strategies[name]) if callable(fn) else (0, 0)

    def _in_spec(self, node: fx.Node, k: int) -> Any:
        strat = self.strategies[node.name]
        return strat.inputs[k] if k < len(strat.inputs) else None

    def _aliases(self, node: fx.Node) -> dict[int, int]:
        """Input position -> the output that shares its storage in the traced graph."""
        cache = self.__dict__.setdefault("_alias_cache", {})
        if node.name in cache:
            return cache[node.name]
        val = node.meta.get("val")
        outs = {}
        for j, t in enumerate(val if isinstance(val, (tuple, list)) else [val]):
            if isinstance(t, torch.Tensor):
                sk = _storage_key(t)
                if sk is not None:
                    outs.setdefault(sk, j)
        found = {}
        for k, ref in enumerate(value_inputs(node)):
            t = self._fake_of(ref)
            sk = _storage_key(t) if t is not None else None
            if sk is not None and sk in outs:
                found[k] = outs[sk]
        cache[node.name] = found
        return found

    @staticmethod
    def _permutes(node: fx.Node) -> bool:
        return node.target in (aten.transpose.int, aten.permute.default, aten.t.default)

    @staticmethod
    def _reshapes(node: fx.Node) -> bool:
        return node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)

    def _reshard_backward(self, ev: Event) -> None:
        mem = self.mem
        e = self.edges[ev.edge]
        key = ("edge", ev.edge)
        g = self.grad.pop(key, None)
        if g is None:
            return
        if not self._needs_grad(e.value):
            mem.unref(g)
            return
        param = self.tied_to.get(e.value[0], e.value[0])
        if self.program.bucketed.get(param) == ev.edge and param in self.bucket_of:
            if param in self.held_grad:       # added in place to the held sum, which goes on
                mem.mark(ev.name)
                mem.unref(g)
                g = self.held_grad.pop(param)
            self._arrive(self.bucket_of[param], g, ev.name)
            return
        if not e.reshard.backward:
            self._contribute(e.value, g, ev.name)
            return
        most, final = self._steps_transient(e.reshard.backward, self._edge_bytes(ev.edge))
        out = mem.alloc(self._local_bytes(e.value, e.src), "temporaries")
        mem.mark(ev.name, extra=max(0, most - out.nbytes))
        mem.unref(g)
        self._contribute(e.value, out, ev.name)

    def _arrive(self, b: int, g: _Storage, at: str) -> None:
        """A gradient reaches its bucket (codegen/buckets.py). An all-reduce bucket copies it
        into its flat buffer, allocated whole at the first arrival. A reduce-scatter bucket
        keeps the gradients until all have come, then lays them out in one buffer and
        reduce-scatters it; the buffer lives until the next reduce-scatter bucket is issued
        (the runtime finishes one before it issues the next), or the end of backward."""
        mem, bucket = self.mem, self.buckets[b]
        if getattr(bucket, "kind", "all_reduce") != "reduce_scatter":
            if b not in self.bucket_buf:
                self.bucket_buf[b] = mem.alloc(bucket.nbytes, "gradients")
            mem.mark(at)
            mem.unref(g)
            return
        mem.recategorize(g, "gradients")
        held = self.bucket_held.setdefault(b, [])
        held.append(g)
        mem.mark(at)
        if len(held) == len(bucket.members):
            self._scatter(b, at)

    def _scatter(self, b: int, at: str) -> None:
        for prev in list(self.bucket_out):      # one reduce-scatter bucket in flight
            self._complete(prev)
        mem, bucket = self.mem, self.buckets[b]
        n = self.mesh_shape[bucket.axes[0]] if bucket.axes else 1
        self.bucket_buf[b] = mem.alloc(bucket.nbytes, "gradients")
        self.bucket_out[b] = mem.alloc(bucket.nbytes // max(n, 1), "gradients")
        mem.mark(at)
        for g in self.bucket_held.pop(b, []):
            mem.unref(g)

    def _finish_buckets(self) -> None:
        """End of backward: an all-reduced buffer becomes its parameters' ``.grad`` (views of
        it); a reduce-scattered bucket leaves each member its gradient shard (the state's
        gradient bytes, cost/state.py) and frees its buffers."""
        mem = self.mem
        for b in list(self.bucket_held):
            self._scatter(b, "gradient buckets")        # a member's gradient never came
        for b in list(self.bucket_out):
            self._complete(b)
        mem.mark("end of backward")

    def _complete(self, b: int) -> None:
        """A reduce-scatter bucket done: its members' shards stay, its buffers go."""
        mem = self.mem
        out = self.bucket_out.pop(b)
        for m in self.buckets[b].members:
            if m in self.state and m not in self.fetched:    # (a host one's goes down)
                self.p_grad.setdefault(m, mem.alloc(int(self.state[m]["gradients"]),
                                                    "gradients"))
        mem.mark("gradient buckets")
        mem.unref(out)
        mem.unref(self.bucket_buf.pop(b))

    # -- optimizer step ---------------------------------------------------------------------
    def _optimizer(self) -> None:
        """Parameters, gradients and optimizer state, plus each moment of the step program's
        optimizer step (cost/program.py ``OptimizerStep.moments``)."""
        for at, extra in self.program.optimizer.moments():
            self.mem.mark(at, extra=extra)
