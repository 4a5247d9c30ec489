"""The step program: what one rank runs in a training step, for one full assignment.

docs/design.md "The step program". Built once from the traced graph and the strategies, and read
by every consumer, so the order and the rules are written here only:

- ``solver/assemble.assemble`` lists the ledger's collectives and host copies from its reshards,
  buckets and fetched parameters;
- ``cost/liveness.step_memory`` walks its events forward, backward and through the optimizer
  step for the step's peak;
- ``codegen/rewrite.emit`` lowers its events, in its order, into the rank program, and runs the
  gradient syncs its buckets hold through the runtime's buckets;
- ``codegen/optim.py`` lays out each parameter's fp32 master and optimizer state as its
  optimizer record (:class:`ParamUpdate`, ``updates``) says.

Events, in the order the rank program runs them: every op of the traced graph (placeholders and
``getitem`` excepted) in graph order, each reshard just before the first op that reads it
(``cost/reshards.reshard_edges``: one per (value, required spec), shared by its consumers). An
event inside a checkpointed layer names that layer (``region``): its ops run again in backward.

Gradient buckets (``cost/overlap.gradient_buckets``): each parameter's first pure gradient sync
(``first_grad_syncs``) is run by its bucket, not where the gradient appears; ``bucketed`` maps a
parameter to that reshard's index. ``fetched``: parameters kept on the host (state mode
``offload_params``), copied to the device at each use.

The optimizer step (``optimizer``, an :class:`OptimizerStep`): one :class:`ParamUpdate` per
parameter the step updates on this rank (frozen and tied-alias ones have none), with the bytes
of its temporaries and host copies, and the moments of the optimizer phase that the liveness
walk checks (``moments``); ``released``, the parameters whose updates start as autograd
completes their gradients (on the device, or on the host after the gradient's copy down),
their gradients freed then. Gradient accumulation
(``accumulation`` micro-steps per optimizer step): ``held``, the gradient each parameter holds
on the device across micro-steps.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.cost.comm import Groups
from autoshard.cost.overlap import Bucket, first_grad_syncs, gradient_buckets
from autoshard.cost.reshards import (ReshardEdge, frozen, pinned_reshards, reshard_edges,
                                     traced_grads)
from autoshard.cost.state import HOST_MODES, host_copies, state_spec, step_elements
from autoshard.errors import AutoshardError
from autoshard.ir import Spec, StateMode, Strategy, local_shape, spec_str
from autoshard.trace.graph import ValueRef, value_inputs, value_ref


@dataclass(frozen=True, slots=True)
class Event:
    """One thing the rank runs in forward: an op (``name``, its node) or a reshard (``edge``,
    its index in :attr:`StepProgram.edges`; ``name``, its first consumer). ``region``: the
    checkpointed layer it runs in, if any."""

    kind: str                    # "op" | "reshard"
    name: str
    edge: int = -1
    region: str | None = None


UPDATES = ("fused", "foreach", "loop")      # how the optimizer's update runs (OptimizerStep)
# Optimizers whose step keeps moment-sized fp32 state (docs/cost-model.md §4.1).
MOMENT_OPTIMIZERS = ("adam", "adamw")
# The device's update runs in pieces of at most this many bytes of fp32 state per moment (a
# larger parameter alone), each piece's 16-bit gradients cast up for their masters just before
# its update and freed after it (codegen/optim.py): the casts alive at once are one piece's, not
# every parameter's (Llama-3-8B stepped whole on one GPU: 1.96 GiB, its embedding's, not 29.9).
PIECE_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class ParamUpdate:
    """One parameter's part of the optimizer step on this rank (docs/cost-model.md §4.6), the
    one fact that the cost model and the runtime's optimizer (codegen/optim.py) both read.

    Where its state lies:

    - ``name``, ``fqn``: its placeholder and its name in the model; ``mode``: its state mode
      (cost/state.py); ``spec``: the layout it is stored in;
    - ``state``: the layout of its optimizer state where that is cut apart from the parameter
      (ZeRO-1/2, offload: ``state_spec``, over the zero axes), else None (the state follows
      the parameter);
    - ``on_host``: its state and its step live on the host (offload, parameter offload);
    - ``master``: a master is kept apart from the parameter (a 16-bit parameter, or one
      whose state is cut apart or on the host); else the parameter is its own master;
    - ``elements``: the elements of its state shard, what one rank's step updates;
    - ``width``: the bytes of one element of its master and moments: fp32, or the parameter's
      own dtype where wider (an fp64 model's).

    What the step makes of it, in bytes:

    - ``moment``: one tensor of ``width`` bytes an element the size of its state shard (its
      momentum, its variance, its master where kept apart), for an optimizer with moments; 0
      where its state lives on the host;
    - ``cast``: the fp32 copy of a 16-bit gradient for its master, alive through its piece's
      update (:meth:`OptimizerStep.pieces`);
    - ``gather``: bytes made on the device while its updated shard is brought back into its
      layout, one parameter at a time (ZeRO-1/2 and offload: the gathered parameter; parameter
      offload: the shard come up and the gathered parameter going down);
    - ``host``: its host-link copies, as (direction, bytes) (cost/state.py ``host_copies``)."""

    name: str
    mode: StateMode | None
    moment: int
    cast: int
    gather: int
    host: tuple[tuple[str, int], ...]
    fqn: str
    spec: Spec
    state: Spec | None
    on_host: bool
    master: bool
    elements: int
    width: int = 4

    def state_bytes(self, optimizer: str) -> dict[str, int]:
        """The optimizer state ``optimizer`` keeps for it, by where it lies ("device",
        "host"): its master where kept apart, and Adam's two moments (docs/cost-model.md
        §4.1), each ``width·elements``."""
        tensors = int(self.master) + (2 if optimizer in MOMENT_OPTIMIZERS else 0)
        where = "host" if self.on_host else "device"
        return {"device": 0, "host": 0, where: tensors * self.width * self.elements}


@dataclass(frozen=True)
class OptimizerStep:
    """The optimizer step of one rank: its optimizer, its update's implementation ("fused":
    pm.optimizer's default, no temporaries; "foreach": one moment-sized copy of every
    parameter's at once; "loop": torch's single-tensor loop, two of a parameter's at a time
    with one of the previous still alive) and one record per updated parameter."""

    optimizer: str
    update: str
    params: tuple[ParamUpdate, ...] = ()
    # stepped as autograd completes their gradients: on the device, or on the host after the
    # gradient's copy down (:func:`steps_in_backward`); the step program's ``released``
    released: frozenset[str] = frozenset()

    def pieces(self) -> list[tuple[ParamUpdate, ...]]:
        """The parameters the device's update steps after backward (those with a ``moment``,
        not ``released`` on the device), in order, cut into runs of at most :data:`PIECE_BYTES` of
        moment (one larger parameter alone): the runtime casts a piece's gradients and runs its
        update before the next piece's (codegen/optim.py ``ShardedOptimizer.step``). An
        optimizer without moments is one piece."""
        out: list[list[ParamUpdate]] = []
        size = 0
        for u in self.params:
            if not u.moment or (u.name in self.released and not u.on_host):
                continue
            if not out or size + u.moment > PIECE_BYTES:
                out.append([])
                size = 0
            out[-1].append(u)
            size += u.moment
        return [tuple(p) for p in out]

    def moments(self) -> list[tuple[str, int]]:
        """The moments of the optimizer phase the liveness walk checks, as (where, bytes alive
        beyond the model state): each piece's update with its casts and temporaries, then each
        parameter's gather. Read by cost/liveness.py (the phase's peak)."""
        out: list[tuple[str, int]] = [("optimizer step", 0)]
        for piece in self.pieces():
            out += self.piece_moments(piece)
        out += [(f"optimizer step ({u.name})", u.gather) for u in self.params if u.gather]
        return out

    def piece_moments(self, piece: tuple[ParamUpdate, ...]) -> list[tuple[str, int]]:
        """One call of the update over ``piece`` (a piece, or one parameter stepped in
        backward): its moments as (where, bytes alive beyond what is already held), its casts
        and its implementation's temporaries (none for an optimizer without moments)."""
        if self.optimizer not in MOMENT_OPTIMIZERS:
            return []
        casts = sum(u.cast for u in piece)
        if self.update == "foreach":
            return [("optimizer step", casts + sum(u.moment for u in piece))]
        if self.update == "loop":
            out, prev = [], 0       # (a call's last denominator is released when it returns)
            for u in piece:
                # denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps): two at once,
                # with the previous parameter's denom not yet released.
                out.append((f"optimizer step ({u.name})", casts + prev + 2 * u.moment))
                prev = u.moment
            return out
        return [("optimizer step", casts)]


@dataclass(frozen=True)
class StepProgram:
    """One rank's training step for one assignment (see the module docstring)."""

    events: tuple[Event, ...]
    edges: tuple[ReshardEdge, ...]
    buckets: tuple[Bucket, ...]
    bucketed: Mapping[str, int]          # parameter -> the reshard its bucket runs
    fetched: frozenset[str]              # parameters kept on the host
    edge_of: Mapping[tuple[ValueRef, tuple[str, int]], int] = field(repr=False)
    bucket_of: Mapping[str, int] = field(repr=False)
    optimizer: OptimizerStep = OptimizerStep("none", "fused")
    accumulation: int = 1
    held: Mapping[str, int] = field(default_factory=dict)     # parameter -> bytes
    stage: frozenset[str] | None = None      # a pipeline stage's ops (stage_program); None: all

    @property
    def released(self) -> frozenset[str]:
        """The parameters stepped as autograd completes their gradients, which then leave the
        device (the optimizer step's record of them)."""
        return self.optimizer.released

    def first_syncs(self) -> dict[str, ReshardEdge]:
        """Each bucketed parameter's gradient sync reshard (``first_grad_syncs``' result)."""
        return {p: self.edges[i] for p, i in self.bucketed.items()}

    def edge(self, ref: ValueRef, consumer: tuple[str, int]) -> ReshardEdge | None:
        """The reshard a consumer's input goes through, if any."""
        i = self.edge_of.get((ref, consumer))
        return None if i is None else self.edges[i]


def step_program(traced: Any, strategies: dict[str, Strategy], mesh_shape: tuple[int, ...], *,
                 bucket_bytes: float, recompute: Mapping[str, str] | None = None,
                 joint: Groups = (), shapes: Mapping | None = None, optimizer: str = "none",
                 update: str = "fused", accumulation: int = 1,
                 overlap: str = "none") -> StepProgram:
    """The step program of ``traced`` (a :class:`~autoshard.trace.export.TracedGraph`) under
    ``strategies`` (node name -> strategy, every placeholder and op) on a mesh of
    ``mesh_shape``; ``recompute``: checkpointed layer -> policy; ``joint``: the plan's groups of
    axes whose collectives run as one; ``shapes``: ``value_shapes`` of the graph, if at hand;
    ``optimizer``: the optimizer whose step ends it ("none": no optimizer records), ``update``
    its implementation (``UPDATES``); ``accumulation``: micro-steps per optimizer step;
    ``overlap``: ``PlanOptions.offload_overlap`` (which gradients leave in backward,
    :func:`steps_in_backward`)."""
    graph: fx.Graph = traced.graph
    params = {p.name for p in traced.params}
    shapes = traced.value_shapes if shapes is None else shapes
    edges = tuple(reshard_edges(graph, strategies, tuple(mesh_shape), shapes, params,
                                training=traced.training, joint=joint,
                                grads=traced_grads(traced)))
    _refuse_pinned(graph, edges)
    edge_of = {(e.value, c): i for i, e in enumerate(edges) for c in e.consumers}
    recompute = dict(recompute or {})
    events: list[Event] = []
    emitted: set[int] = set()
    for node in graph.nodes:
        if node.op == "placeholder" or node.target is operator.getitem:
            continue
        region = None
        if node.op == "call_function" and recompute:
            layer = traced.layer_of_node.get(node.name)
            region = layer if layer in recompute else None
        for k, ref in enumerate(node_reads(node)):
            i = edge_of.get((ref, (node.name, k)))
            if i is not None and i not in emitted:
                emitted.add(i)
                events.append(Event("reshard", node.name, i, region))
        if node.op == "call_function":
            events.append(Event("op", node.name, region=region))
    index = {id(e): i for i, e in enumerate(edges)}
    bucketed: dict[str, int] = {}
    buckets: tuple[Bucket, ...] = ()
    if traced.training:
        bucketed = {p: index[id(e)] for p, e in first_grad_syncs(edges).items()}
        nodes = [n for n in graph.nodes if n.name in strategies]
        buckets = tuple(gradient_buckets(list(edges), nodes, bucket_bytes, strategies,
                                         tuple(mesh_shape)))
    fetched = frozenset(n for n in params
                        if getattr(strategies.get(n), "kernel", None) == StateMode.OFFLOAD_PARAMS)
    opt = optimizer_step(traced, strategies, tuple(mesh_shape), optimizer, update) \
        if traced.training else OptimizerStep("none", update)
    bucket_of = {m: k for k, b in enumerate(buckets) for m in b.members}
    opt = replace(opt, released=frozenset(u.name for u in opt.params if steps_in_backward(
        u.mode, u.state is not None, u.name in bucket_of, overlap)))
    return StepProgram(
        events=tuple(events), edges=edges, buckets=buckets, bucketed=bucketed,
        fetched=fetched, edge_of=edge_of, bucket_of=bucket_of,
        optimizer=opt, accumulation=accumulation,
        held=held_gradients(traced, strategies, tuple(mesh_shape), fetched, bucketed)
        if traced.training and accumulation > 1 else {})


def _refuse_pinned(graph: fx.Graph, edges: tuple[ReshardEdge, ...]) -> None:
    """No step program of a plan whose layouts reshard a read an in-place write pins (the
    program would differ from the model's, silently: trace/aliases.py)."""
    bad = pinned_reshards(graph, edges)
    if bad:
        e = bad[0]
        raise AutoshardError(
            "a plan that leaves every value an in-place write reaches in its producer's layout "
            "(trace/aliases.py: on a rank a reshard copies, and the write would miss the "
            "storage later reads see)",
            got=f"{len(bad)} such reshard(s), the first of {e.value[0]} (output {e.value[1]}) "
                f"for {', '.join(f'{c} input {k}' for c, k in e.consumers)}, "
                f"from {spec_str(e.src)} to {spec_str(e.dst)}",
            fix="give those ops layouts that read the value as it lies (a plan edited or pinned "
                "by hand); a plan autoshard solved never takes one unless nothing else was "
                "found: raise time_limit_s or memory_budget, and report the model")


def steps_in_backward(mode: StateMode | None, cut: bool, bucketed: bool, overlap: str) -> bool:
    """Whether a parameter's update starts the moment autograd completes its gradient, which
    then leaves the device: under ``offload_overlap="backward"``, where the gradient is the
    parameter's whole ``.grad`` (its state not ``cut`` apart over zero axes, no gradient
    bucket syncs it), with its state on the device (stepped there, codegen/optim.py) or
    offloaded (copied to the host and stepped in its bucket, codegen/hostopt.py). Not on a
    pipeline, whose microbatches' backwards add to ``.grad`` (it is stepped at the step): its
    stages' programs are built with ``overlap="none"``."""
    return overlap == "backward" and mode in (None, StateMode.OFFLOAD) and not cut \
        and not bucketed


def _updated(traced: Any) -> list[Any]:
    """The parameter placeholders the optimizer steps: trainable, each tensor once (a tied
    weight's later names alias the first)."""
    seen: set[str] = set()
    out = []
    for ph in traced.params:
        if ph.info is None or ph.fqn in seen:
            continue
        seen.add(ph.fqn)
        if not frozen(traced.graph.find_nodes(op="placeholder", target=ph.name)[0]):
            out.append(ph)
    return out


def optimizer_step(traced: Any, strategies: Mapping[str, Strategy], mesh_shape: tuple[int, ...],
                   optimizer: str, update: str = "fused") -> OptimizerStep:
    """The optimizer step's records (:class:`OptimizerStep`), from each parameter's stored
    layout and state mode (cost/state.py): where its state lies whatever the optimizer
    (codegen/optim.py lays the state out from these), and the bytes ``optimizer``'s step
    makes ("none": no records)."""
    assert update in UPDATES, update
    if optimizer == "none":
        return OptimizerStep(optimizer, update)
    return OptimizerStep(optimizer, update, updates(traced, strategies, mesh_shape, optimizer))


def updates(traced: Any, strategies: Mapping[str, Strategy], mesh_shape: tuple[int, ...],
            optimizer: str) -> tuple[ParamUpdate, ...]:
    """One :class:`ParamUpdate` per parameter the step updates (trainable, each tied tensor
    once), in placeholder order. Its bytes are ``optimizer``'s (none for "none" and "sgd"
    but the host copies); where its state lies does not depend on it."""
    out = []
    moments = optimizer in MOMENT_OPTIMIZERS
    for ph in _updated(traced):
        strat = strategies.get(ph.name)
        if strat is None:
            continue
        shape, spec, mode = tuple(ph.info.shape), strat.outputs[0], strat.kernel
        isz = ph.info.dtype.itemsize
        sspec = state_spec(shape, spec, mesh_shape, strat.state_axes) if mode is not None \
            else None
        on_host = mode in HOST_MODES
        elements = step_elements(shape, spec, mode, mesh_shape, strat.state_axes)
        width = max(isz, 4)
        moment = elements * width if moments and not on_host else 0
        gather = 0
        if sspec is not None and moments:
            local = math.prod(local_shape(shape, spec, mesh_shape)) * isz
            gather = local + (math.prod(local_shape(shape, sspec, mesh_shape)) * isz
                              if mode == StateMode.OFFLOAD_PARAMS else 0)
        out.append(ParamUpdate(
            ph.name, mode, moment, moment if isz < 4 else 0, gather,
            tuple(host_copies(shape, ph.info.dtype, spec, mode, mesh_shape)), fqn=ph.fqn,
            spec=tuple(spec), state=sspec, on_host=on_host,
            master=sspec is not None or on_host or isz < 4, elements=elements, width=width))
    return tuple(out)


def held_gradients(traced: Any, strategies: Mapping[str, Strategy], mesh_shape: tuple[int, ...],
                   fetched: frozenset[str], bucketed: Mapping[str, int]) -> dict[str, int]:
    """Gradient accumulation: the gradient each trainable parameter keeps on the device across
    micro-steps, whole in its stored layout (``.grad``, or under ``no_sync`` its bucket's held
    copy, codegen/buckets.py). A parameter kept on the host whose gradient no bucket syncs
    sends it down as it lands: none."""
    out = {}
    for ph in _updated(traced):
        strat = strategies.get(ph.name)
        if strat is None or (ph.name in fetched and ph.name not in bucketed):
            continue
        out[ph.name] = math.prod(local_shape(tuple(ph.info.shape), strat.outputs[0],
                                             mesh_shape)) * ph.info.dtype.itemsize
    return out


def program_for(traced: Any, strategies: dict[str, Strategy], pricer: Any,
                update: str = "fused") -> StepProgram:
    """The step program of an assignment priced with ``pricer`` (its mesh, options,
    checkpointed layers and joint axes): the one the plan's figures, the liveness walk and the
    pipeline stages read."""
    recompute = getattr(pricer, "recompute", None) or {}
    if not isinstance(recompute, dict):
        recompute = dict.fromkeys(recompute, "full")
    options = pricer.options
    return step_program(traced, strategies, tuple(pricer.mesh.shape),
                        bucket_bytes=options.bucket_bytes, recompute=recompute,
                        joint=getattr(pricer, "joint", ()), shapes=pricer.shapes,
                        optimizer=options.state_optimizer, update=update,
                        accumulation=getattr(options, "accumulation_steps", 1),
                        overlap=options.offload_overlap
                        if getattr(options, "stage_run", None) is None else "none")


def node_reads(node: fx.Node) -> list[ValueRef]:
    """The values a node reads, in input order (the graph's output: every tensor it returns)."""
    if node.op == "output":
        return [value_ref(a) for a in pytree.tree_flatten(node.args)[0]
                if isinstance(a, fx.Node)]
    return value_inputs(node)


def stage_program(program: StepProgram, traced: Any, strategies: Mapping[str, Strategy],
                  stage: frozenset[str], mesh_shape: tuple[int, ...], *,
                  bucket_bytes: float) -> StepProgram:
    """The part of ``program`` one pipeline stage runs (docs/cost-model.md §10.4): the events
    of its ops ``stage`` (node names; a reshard where any of its consumers is one of them), the
    gradient buckets of the parameters its ops read (the stage's own, as the pipelined plan
    forms them), their optimizer records and held gradients. ``stage`` is recorded on the
    result: the liveness walk receives what other stages make and sends back its gradient."""
    graph = traced.graph
    out = next(n.name for n in graph.nodes if n.op == "output")

    def runs_here(e: ReshardEdge) -> bool:      # the loss's reshard runs where the loss is made
        return any(c in stage or (c == out and e.value[0] in stage) for c, _ in e.consumers)
    events = tuple(ev for ev in program.events
                   if (ev.name in stage if ev.kind == "op" else runs_here(program.edges[ev.edge])))
    params = {p.name for p in traced.params}
    reads = {ref[0] for n in graph.nodes if n.name in stage for ref in value_inputs(n)} & params
    edges = [e for e in program.edges if e.value[0] in reads and runs_here(e)]
    index = {id(e): i for i, e in enumerate(program.edges)}
    bucketed = {p: index[id(e)] for p, e in first_grad_syncs(edges).items()} \
        if traced.training else {}
    nodes = [n for n in graph.nodes if n.name in strategies]
    buckets = tuple(gradient_buckets(edges, nodes, bucket_bytes, strategies,
                                     tuple(mesh_shape))) \
        if traced.training else ()
    fqn = {p.name: p.fqn for p in traced.params}
    held_fqns = {fqn[p] for p in reads}
    opt = program.optimizer
    return StepProgram(
        events=events, edges=program.edges, buckets=buckets, bucketed=bucketed,
        fetched=program.fetched & reads, edge_of=program.edge_of,
        bucket_of={m: k for k, b in enumerate(buckets) for m in b.members},
        optimizer=OptimizerStep(opt.optimizer, opt.update,
                                tuple(u for u in opt.params if fqn[u.name] in held_fqns)),
        accumulation=program.accumulation,
        held={p: b for p, b in program.held.items() if fqn[p] in held_fqns},
        stage=frozenset(stage))
