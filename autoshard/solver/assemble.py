"""A full assignment (a strategy per node) as a Plan: its ledger of collectives and host copies,
and its predicted figures, the sums of the prices the ILP's coefficients come from
(cost/price.py) over the program the rank will run (cost/program.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoshard.cost.liveness import step_memory
from autoshard.cost.price import Pricer
from autoshard.cost.comm import Groups, Step, joint_groups, step_seconds
from autoshard.cost.overlap import bucket_collectives, exposed_seconds, sync_share_by_axis
from autoshard.cost.program import program_for, step_program
from autoshard.cost.compute import local_numel
from autoshard.cost.state import SCATTERS, StateBytes, state_spec
from autoshard.cost.reshards import direct_reads
from autoshard.ir import CollectiveKind, OffloadLevel, Phase, StateMode, Strategy
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.plans.prediction import Prediction, PredictedMemory
from autoshard.plans.records import (CollectiveRecord, HostTransfer, MODE_OFFLOAD, NodePlan,
                                     ParamState)
from autoshard.trace.export import TracedGraph


def forward_memory(traced: TracedGraph, mesh: Mesh, strategies: dict[str, Strategy],
                   options: PlanOptions, recompute: dict[str, str], joint: Groups = ()) -> float:
    """The memory the ILP bounds for a full assignment (``assemble``'s ``ilp_memory_bytes``)
    without the rest of the plan: what each node holds and saves, the saved copies of resharded
    values, and under selective checkpointing the collective outputs it stores."""
    pricer = Pricer(traced, mesh, options, recompute=recompute, joint=joint)
    memory = sum(pricer.memory(n, st) for n, st in strategies.items())
    memory += pricer.saved_copies(strategies)
    if "selective" in recompute.values():
        program = step_program(traced, strategies, mesh.shape, bucket_bytes=options.bucket_bytes,
                               recompute=recompute, joint=joint, shapes=pricer.shapes)
        for e in program.edges:
            memory += pricer.stored_reshard_bytes(e.value, e.src, e.dst, e.consumers[0][0])
    return memory


class _Sums:
    """The per-node sums of a step, in graph order (the order the ILP's objective adds them)."""

    def __init__(self) -> None:
        self.compute_s = self.memory = self.backward_s = self.optimizer_s = 0.0
        self.host_step_s = 0.0
        self.state = StateBytes()


def _node_sums(pricer: Pricer, nodes: list, strategies: dict[str, Strategy]) -> _Sums:
    s = _Sums()
    for n in nodes:
        price = pricer.node(n.name, strategies[n.name])
        s.compute_s += price.seconds
        s.memory += price.bytes
        s.backward_s += pricer.backward(n.name, strategies[n.name])
        if n.op == "placeholder":
            s.state += pricer.state_bytes(n.name, strategies[n.name])
            s.optimizer_s += pricer.optimizer_seconds(n.name, strategies[n.name])
            s.host_step_s += pricer.offload_step_seconds(n.name, strategies[n.name])[1]
    return s


class _Ledger:
    """The plan's collectives in the order the step runs them, and the seconds they take per
    mesh axis: ``blocking`` (the step waits) and ``sync`` (bucketed gradient syncs, which
    backward compute can hide, docs/cost-model.md §7)."""

    def __init__(self, mesh: Mesh, runs: int = 1) -> None:
        self.mesh, self.runs = mesh, runs
        self.records: list[CollectiveRecord] = []
        self.blocking = dict.fromkeys(mesh.axes, 0.0)
        self.sync = dict.fromkeys(mesh.axes, 0.0)

    def blocking_step(self, step: Step, phase: Phase, node: str, value: str) -> None:
        # The optimizer's gathers run once per optimizer step, the rest once per micro-step
        # (docs/cost-model.md §7.2): the record's count says so.
        runs = 1 if phase == Phase.OPTIMIZER else self.runs
        _charge(self.blocking, step, self.mesh, runs)
        self.records.append(CollectiveRecord(step.kind, tuple(self.mesh.axes[a] for a in step.axes),
                                             step.nbytes, phase, node, value, count=runs))

    def reshards(self, pricer: Pricer, edges: list, first: dict,
                 strategies: dict[str, Strategy], bucket_bytes: int, memory: float) -> float:
        """The reshards' collectives; ``memory`` plus what they store for backward."""
        for e in edges:
            if first.get(e.value[0]) is e:           # run by its bucket
                st = strategies[e.value[0]]
                steps = pricer.bucketed_sync(e.value, e.src, e.reshard, st.kernel, st.state_axes)
                for a, t in sync_share_by_axis(steps, self.mesh, bucket_bytes).items():
                    self.sync[self.mesh.axes[a]] += t
                continue
            # A reshard runs where its first consumer runs: inside a fully checkpointed layer,
            # its forward collectives run again when the layer is recomputed
            # (codegen/recompute.py).
            again = [(Phase.RECOMPUTE, st) for st in e.reshard.forward if st.is_collective] \
                if pricer.reshards_again(e.consumers[0][0]) else []
            memory += pricer.stored_reshard_bytes(e.value, e.src, e.dst, e.consumers[0][0])
            for phase, step in [*e.reshard.collectives, *again]:
                if phase == Phase.BACKWARD and e.from_param:
                    phase = Phase.GRAD_SYNC
                self.blocking_step(step, phase, e.consumers[0][0], e.value[0])
        return memory

    def in_ops(self, pricer: Pricer, nodes: list, strategies: dict[str, Strategy]) -> None:
        """Collectives an op runs inside itself (a vocabulary-parallel loss's all-reduces, ring
        attention's hops, docs/cost-model.md §3.8, §3.11): their exposed seconds, the forward
        ones again where the op's layer is recomputed."""
        for n in nodes:
            charges = pricer.op_charges(n.name, strategies[n.name])
            again = [(Phase.RECOMPUTE, st, t) for ph, st, t in charges if ph == Phase.FORWARD] \
                if charges and pricer.reshards_again(n.name) else []
            for phase, step, t in [*charges, *again]:
                for a in step.axes:
                    self.blocking[self.mesh.axes[a]] += t * self.runs / len(step.axes)
                self.records.append(CollectiveRecord(
                    step.kind, tuple(self.mesh.axes[a] for a in step.axes), step.nbytes, phase,
                    n.name, n.name, count=self.runs))

    def buckets(self, buckets: list) -> None:
        for k, b in enumerate(buckets):
            for axes, nbytes in bucket_collectives(b, self.mesh.shape):
                self.records.append(CollectiveRecord(b.kind_on(axes[0]),
                                                     tuple(self.mesh.axes[a] for a in axes),
                                                     nbytes, Phase.GRAD_SYNC, f"bucket{k}", "",
                                                     b.members))

    def optimizer(self, pricer: Pricer, params: dict[str, str], strategies: dict[str, Strategy]
                  ) -> dict[str, ParamState]:
        """After the optimizer step, the updated state shards are all-gathered back into each
        parameter's layout (zero1/zero2/offload, cost/state.py): blocking, phase "optimizer".
        (The state record of each parameter whose state is laid out apart.)"""
        param_state = {}
        for name, fqn in params.items():
            r = pricer.optimizer_steps(name, strategies[name])
            if strategies[name].kernel is not None:
                param_state[fqn] = _state_record(pricer, name, strategies[name])
            for step in (r.forward if r else ()):
                if step.is_collective:
                    self.blocking_step(step, Phase.OPTIMIZER, "optimizer", name)
        return param_state


@dataclass(frozen=True)
class _Overlap:
    comm_s: float
    exposed: dict[str, float]
    overlapped: dict[str, float]
    host_exposed: float


def _overlap(ledger: _Ledger, sums: _Sums) -> _Overlap:
    """One overlap window (cost/overlap.py): the buckets run behind backward compute; what does
    not fit is exposed, shared over the axes by their sync seconds. Offloaded host steps run in
    the same window (cost/price.py offload_step_seconds; each took its seconds out of
    ``backward_s``, as in the ILP): what they add to the exposed part is the optimizer step's,
    on the critical path as its blocking part is (in compute)."""
    sync, blocking = ledger.sync, ledger.blocking
    total_sync = sum(sync.values())
    window = sums.backward_s + sums.host_step_s
    comm_exposed = exposed_seconds(total_sync, window)
    host_exposed = exposed_seconds(total_sync + sums.host_step_s, window) - comm_exposed
    hidden_frac = 1.0 - comm_exposed / total_sync if total_sync else 1.0
    overlapped = {a: t * hidden_frac for a, t in sync.items()}
    exposed = {a: blocking[a] + sync[a] - overlapped[a] for a in ledger.mesh.axes}
    return _Overlap(sum(blocking.values()) + total_sync, exposed, overlapped, host_exposed)


def _tied_reads(pricer: Pricer, nodes: list, strategies: dict[str, Strategy]
                ) -> dict[str, tuple]:
    """A tied weight's fqn -> every layout an op reads it in, in graph order."""
    tied: dict[str, list] = {}
    for n in nodes:
        for k, ref in enumerate(pricer.reads(n.name)):
            if ref in pricer.tied_fqns:
                reads = tied.setdefault(pricer.tied_fqns[ref], [])
                if strategies[n.name].inputs[k] not in reads:
                    reads.append(strategies[n.name].inputs[k])
    return {fqn: tuple(reads) for fqn, reads in tied.items()}


def _predicted(sums: _Sums, ov: _Overlap, host_s: float, live: Any) -> Prediction:
    """The plan's predicted figures (plans/prediction.py, docs/plan-format.md)."""
    state = sums.state
    return Prediction(
        step_time_s=sums.compute_s + sum(ov.exposed.values()) + host_s,
        compute_s=sums.compute_s, comm_s=ov.comm_s, ilp_sum_bytes=sums.memory,
        optimizer_s=sums.optimizer_s, host_s=host_s, host_step_s=sums.host_step_s,
        peak_phase=live.phase,
        memory=PredictedMemory(
            peak=live.peak, parameters=live.parameters, gradients=live.gradients,
            optimizer=live.optimizer, activations=live.activations,
            temporaries=live.temporaries, host=state.host,
            model_state=state.parameters + state.gradients + state.optimizer),
        exposed_comm_s=ov.exposed, overlapped_comm_s=ov.overlapped)


def assemble(traced: TracedGraph, mesh: Mesh, strategies: dict[str, Strategy],
             options: PlanOptions, *, solver: dict[str, Any], model_name: str,
             timings: dict[str, float],
             recompute: dict[str, str] | frozenset[str] | None = None,
             joint: Groups = ()) -> Plan:
    """The Plan of a full assignment on ``mesh``: its ledger, and its predicted figures as the
    sum of the prices the ILP's coefficients come from (cost/price.py), over the nodes and the
    reshards the program will run (cost/reshards.py, the walk codegen makes). ``joint``: groups
    of axes whose collectives run as one (the plan's ``joint_axes``, docs/cost-model.md §1.4);
    a collective over several axes is one record listing them, and its seconds are shared
    evenly among them in the per-axis figures."""
    if not isinstance(recompute, dict):       # a set of layers: all fully checkpointed
        recompute = dict.fromkeys(recompute or (), "full")
    joint = joint_groups(joint, mesh.shape)
    pricer = Pricer(traced, mesh, options, recompute=recompute, joint=joint)
    nodes = [n for n in traced.graph.nodes if n.name in strategies]
    params = {p.name: p.fqn for p in traced.params}
    sums = _node_sums(pricer, nodes, strategies)
    sums.memory += pricer.saved_copies(strategies)
    # What the rank runs in the step (cost/program.py): the ledger below lists its reshards,
    # buckets and host copies, and the liveness walk reads the same program.
    program = program_for(traced, strategies, pricer)
    edges, buckets, first = list(program.edges), list(program.buckets), program.first_syncs()
    ledger = _Ledger(mesh, pricer.runs)
    sums.memory = ledger.reshards(pricer, edges, first, strategies, options.bucket_bytes,
                                  sums.memory)
    ledger.in_ops(pricer, nodes, strategies)
    ledger.buckets(buckets)
    param_state = ledger.optimizer(pricer, params, strategies)
    # The host link (docs/cost-model.md §9): each use of a parameter kept on the host copies it
    # in and its gradient back, blocking; the optimizer step's copies are in optimizer_s.
    transfers = host_transfers(traced, pricer, strategies, edges, first, buckets)
    host_s = sum(t.bytes for t in transfers if t.phase != Phase.OPTIMIZER) \
        / mesh.cluster.host_bandwidth * pricer.step_share * pricer.runs
    ov = _overlap(ledger, sums)
    sums.optimizer_s += ov.host_exposed
    sums.compute_s += ov.host_exposed
    # The peak over the step, from the liveness of values (cost/liveness.py, §4.5), beside
    # ``memory``, the sum of everything forward saves (§4.4) that the ILP bounds.
    live = step_memory(traced, strategies, pricer, program=program)
    return Plan(
        mesh_shape=mesh.shape, mesh_axes=mesh.axes, cluster=mesh.cluster,
        fingerprint=traced.fingerprint, options=options,
        nodes=tuple(NodePlan(n.name, _op_name(n), strategies[n.name].inputs,
                             strategies[n.name].outputs, strategies[n.name].kernel,
                             strategies[n.name].state_axes)
                    for n in nodes),
        params={params[n]: strategies[n].outputs[0] for n in params},
        inputs={p.fqn: strategies[p.name].outputs[0] for p in traced.inputs},
        collectives=tuple(ledger.records), predicted=_predicted(sums, ov, host_s, live),
        solver=solver, model=model_name, node_sigs=traced.node_sigs, layers=traced.layers,
        tied=_tied_reads(pricer, nodes, strategies),
        recompute={layer.name: recompute[layer.name] for layer in traced.layers
                   if layer.name in recompute},
        param_state=param_state, host_transfers=tuple(transfers),
        joint_axes=tuple(tuple(mesh.axes[a] for a in g) for g in joint),
        input_meta={p.fqn: (p.info.shape, str(p.info.dtype).removeprefix("torch."))
                    for p in traced.inputs if p.info is not None},
        # Wall-clock figures stay off the saved plan: they would make two runs' files differ.
        timings=timings)


def _charge(seconds: dict[str, float], step: Step, mesh: Mesh, runs: int = 1) -> None:
    """Add a step's seconds to its axes' figures, shared evenly among the axes of a joint one;
    ``runs``: how often the step runs it (each micro-step of gradient accumulation,
    docs/cost-model.md §7.2)."""
    t = step_seconds(step, mesh) * runs
    for a in step.axes:
        seconds[mesh.axes[a]] += t / len(step.axes)


def _state_record(pricer: Pricer, name: str, strategy: Strategy) -> ParamState:
    ph = pricer.traced.placeholder(name)
    spec, mode = strategy.outputs[0], strategy.kernel
    sspec = state_spec(ph.info.shape, spec, pricer.mesh.shape, strategy.state_axes) or spec
    return ParamState(mode, sspec if mode in SCATTERS else spec, sspec,
                      MODE_OFFLOAD.get(mode, OffloadLevel.NONE))


def host_transfers(traced: TracedGraph, pricer: Pricer, strategies: dict[str, Strategy],
                   edges: list, first: dict, buckets: list) -> list[HostTransfer]:
    """Every copy over the host link a step makes (docs/cost-model.md §9), as the runtime makes
    them (codegen/rewrite.py, codegen/buckets.py, codegen/optim.py). A parameter kept on the
    host (offload_params) is copied to the device once per use: per reshard edge that reads it,
    and once for all the ops that read it where it lies (``direct_reads``), at the first of
    them; again where that use is recomputed. The gradient of a use comes back down in the
    stored layout, unless a bucket syncs it: then its share of the bucket (the reduce-scattered
    shard) comes down once the bucket is done. Then the optimizer step's
    (``Pricer.host_steps``)."""
    out: list[HostTransfer] = []
    params = [p.name for p in traced.params]
    fetched = {n for n in params if strategies[n].kernel == StateMode.OFFLOAD_PARAMS}
    if fetched:
        uses = [(e.value[0], e.src, e.consumers[0][0], first.get(e.value[0]) is e)
                for e in edges if e.value[0] in fetched]
        for name, cons in direct_reads(traced.graph, strategies, fetched,
                                       training=traced.training).items():
            uses.append((name, strategies[name].outputs[0], cons[0][0], False))
        for name, src, node, bucketed in uses:
            n = pricer.fetch_bytes((name, 0), src, StateMode.OFFLOAD_PARAMS)
            # every micro-step's (docs/cost-model.md §7.2)
            out.append(HostTransfer("h2d", n, Phase.FORWARD, node, name, pricer.runs))
            if pricer.recomputed(node):
                out.append(HostTransfer("h2d", n, Phase.RECOMPUTE, node, name, pricer.runs))
            if not bucketed and name in pricer.grads:
                out.append(HostTransfer("d2h", n, Phase.BACKWARD, node, name, pricer.runs))
        for k, b in enumerate(buckets):
            for m in b.members:
                if m in fetched:
                    shape, isz = pricer.shapes[(m, 0)]
                    spec = strategies[m].outputs[0]
                    if b.kind == CollectiveKind.REDUCE_SCATTER:
                        spec = state_spec(shape, spec, pricer.mesh.shape,
                                          strategies[m].state_axes) or spec
                    out.append(HostTransfer("d2h", local_numel(shape, spec, pricer.mesh.shape)
                                            * isz, Phase.GRAD_SYNC, f"bucket{k}", m))
    for name in params:
        for direction, nbytes in pricer.host_steps(name, strategies[name]):
            out.append(HostTransfer(direction, nbytes, Phase.OPTIMIZER, "optimizer", name))
    return out


def _op_name(n) -> str:
    return "placeholder" if n.op == "placeholder" else str(n.target)

