"""The one pricing function: what a node costs under a strategy, and what a reshard costs.

The ILP's coefficients (solver/build.py) and a Plan's predicted figures (solver/assemble.py) are
both sums of these two prices, the first over every (node, strategy) and (value, source layout,
requirement) the search may pick, the second over the ones a plan picked. A change to a price
(overlap, recomputation, offload) is made here once.

- :meth:`Pricer.node`: seconds of compute on one device (forward, + backward in training;
  docs/cost-model.md §3) and bytes one device holds for the node: a parameter's state (weights,
  gradient, optimizer), a buffer, or the outputs (and per-row statistics) an op saves for
  backward (§4).
- :meth:`Pricer.reshard_cost`: seconds of the collectives that move a value from its
  producer's layout to a requirement, both directions (§1): blocking seconds, and the seconds of
  a data-parallel gradient sync that runs in buckets behind backward compute (§7), which the
  step pays only where backward compute (:meth:`Pricer.backward`) cannot hide it.
- :meth:`Pricer.op_charges` / :meth:`Pricer.op_comm_seconds`: the collectives an op runs inside
  itself (a vocabulary-parallel cross-entropy's all-reduces, §3.8, blocking; ring attention's
  hops, §3.11, each behind one step's block compute), priced like a reshard's and listed in the
  plan's ledger.
- :meth:`Pricer.saved_copy_bytes`: the bytes of a value that the ops reading it keep for backward,
  once per layout they read it in (§4.4): the normed input that q, k and v projections all save
  is one tensor, and a ZeRO-3 weight gathered for a linear is one gathered copy.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass

import torch.fx as fx

from autoshard.cost.comm import (Groups, Reshard, Step, reshard, reshard_time, step_seconds,
                                 steps_time)
from autoshard.cost.compute import fusions, local_numel, op_profile, op_times
from autoshard.cost.memory import saved_activation_bytes, saved_rule
from autoshard.cost.overlap import is_grad_sync, sync_share_seconds
from autoshard.cost.reshards import carries_grad, frozen, grad_values, no_backward
from autoshard.cost.state import (ADAM_STEP_BYTES, MASTER_CAST_BYTES, SCATTERS, SGD_STEP_BYTES,
                                  StateBytes, host_copies, modes_for, state_bytes, state_spec,
                                  step_elements, zero_axes, zero_grad_sync)
from autoshard.ir import OpInfo, Partial, Replicate, Shard, Spec, Strategy, local_shape
from autoshard.mesh import AxisMerge, Mesh
from autoshard.ops.registry import STORED_FAMILIES, VIEW, op_collectives, record_of
from autoshard.options import PlanOptions, state_modes
from autoshard.trace.export import TracedGraph, op_info
from autoshard.trace.graph import ValueRef, value_inputs, value_shapes

Consumer = tuple[str, int]   # (consumer node, tensor input position)


@dataclass(frozen=True, slots=True)
class Price:
    seconds: float
    bytes: float


class Pricer:
    """Prices on ``mesh`` (the mesh the strategies are written for). With ``merge``, ``mesh`` is
    ``merge.merged()`` and reshards are priced as they run on the real mesh, each merged axis's
    collectives as one over its real axes' joint group. ``joint``: without ``merge``, the groups
    of ``mesh``'s axes whose collectives run as one (a plan's ``joint_axes``,
    docs/cost-model.md §1.4).

    ``recompute``: layer name -> activation checkpointing policy (docs/cost-model.md §8), or a
    set of layer names (all "full"). "full": every op of the layer runs its forward again in
    backward, its reshards' collectives included; of what its ops save, one layer's worth per
    group of identical layers is alive at once (the layer being recomputed), which
    :meth:`memory_weight` expresses as a weight of 1/(group size); the values the layer reads
    from outside are kept whole (:meth:`checkpoint_inputs`). "selective" (Korthikanti et al.
    2022, §5): the outputs of matmuls, attention and collectives are stored (:meth:`stores`)
    and everything else (norms, activations, RoPE, residual adds, local slices) is recomputed
    from them.

    ``offload``: whether parameters may keep their optimizer state on the host (True), or their
    stored shards and gradients too ("parameters") (cost/state.py, options.state_modes); the
    ZeRO modes ``options`` allows are offered either way."""

    def __init__(self, traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                 merge: AxisMerge | None = None,
                 recompute: Mapping[str, str] | frozenset[str] = frozenset(),
                 offload: bool | str = False, joint: Groups = ()) -> None:
        self.traced, self.mesh, self.options, self.merge = traced, mesh, options, merge
        # A pipeline's stages share one SPMD plan of one microbatch (solver/pipeline.py): they
        # run the graph m times per step and the gradient sync and optimizer step once, so each
        # run bears 1/m of those; and k microbatches' activations are alive at once on the
        # fullest stage, so its activations weigh k against the stages' memory.
        m, k = options.stage_run or (1, 1.0)
        self.step_share, self.activation_copies = 1.0 / m, float(k)
        # Gradient accumulation (docs/cost-model.md §7.2): the prices are an optimizer step's,
        # whose N micro-steps each run forward and backward with their collectives (``runs``
        # times), then one gradient sync, behind the last micro-step's backward only (the
        # window, :meth:`backward`, is one micro-step's), and one optimizer step.
        self.runs = options.accumulation_steps if traced.training else 1
        self.joint: Groups = merge.joint() if merge is not None else joint
        self.training = traced.training
        self.modes = state_modes(options, offload) if self.training else (None,)
        if not isinstance(recompute, Mapping):
            recompute = {layer: "full" for layer in recompute}
        self.recompute: dict[str, str] = dict(recompute) if self.training else {}
        groups: dict[str, int] = {}
        for layer in traced.layers:
            groups[layer.same_as] = groups.get(layer.same_as, 0) + 1
        self._group_size = {layer.name: groups[layer.same_as] for layer in traced.layers
                            if layer.name in self.recompute}
        self.params = {p.name for p in traced.params}
        # A tied weight (one tensor under several names) is lifted as one graph input per name:
        # the first holds the weight's state, every later one maps to it.
        names: dict[str, list[str]] = {}
        for p in traced.params:
            names.setdefault(p.fqn, []).append(p.name)
        tied = {fqn: ns for fqn, ns in names.items() if len(ns) > 1}
        self.tied_to = {n: ns[0] for ns in tied.values() for n in ns[1:]}
        self.tied_fqns = {n: fqn for fqn, ns in tied.items() for n in ns}
        self.shapes = value_shapes(traced.graph)
        self.grads = grad_values(traced.graph, self.params) if self.training else set()
        self._nodes = {n.name: n for n in traced.graph.nodes}
        # Frozen parameters (requires_grad=False): their state is the parameter alone.
        self.frozen = frozenset(n for n in self.params if frozen(self._nodes[n]))
        self._infos: dict[str, OpInfo] = {}
        self._saved_inputs: dict[ValueRef, list[Consumer]] | None = None
        self._kept: dict[ValueRef, bool] = {}
        self._ckpt_inputs: dict[ValueRef, None] | None = None
        self._reshard_memo: dict[tuple, float] = {}
        # Compiled, elementwise chains run as one kernel each (docs/cost-model.md §3.10).
        self.fused = fusions(traced.graph) if options.compile else {}

    # -- per node ---------------------------------------------------------------------------
    def has_grad(self, value: ValueRef) -> bool:
        """Whether ``value`` carries a gradient in training (cost/reshards.py ``carries_grad``)."""
        return carries_grad(self._nodes, self.grads, value)

    def info(self, name: str) -> OpInfo:
        """The op's view of a call_function node (computed once)."""
        info = self._infos.get(name)
        if info is None:
            info = self._infos[name] = op_info(self._nodes[name])
        return info

    def node(self, name: str, strategy: Strategy) -> Price:
        return Price(self.compute(name, strategy), self.memory(name, strategy))

    def compute(self, name: str, strategy: Strategy) -> float:
        """Forward + backward seconds (+ the forward again where it is recomputed)."""
        fwd, bwd = self.times(name, strategy)
        if self._nodes[name].op == "placeholder":
            return fwd                  # its optimizer step, once per step
        return (fwd * (2 if self.reruns(name) else 1) + bwd) * self.runs

    def policy(self, name: str) -> str | None:
        """The checkpointing policy of the layer op ``name`` is in, if any."""
        if not self.recompute or self._nodes[name].op != "call_function":
            return None
        return self.recompute.get(self.traced.layer_of_node.get(name))

    def recomputed(self, name: str) -> bool:
        """Whether ``name`` is an op of a checkpointed layer."""
        return self.policy(name) is not None

    def stores(self, name: str) -> bool:
        """Whether selective checkpointing keeps the op's outputs: a matmul or attention (their
        outputs are what is costly to recompute: Korthikanti et al. 2022, §5)."""
        return record_of(self._nodes[name].target).family in STORED_FAMILIES

    def reruns(self, name: str) -> bool:
        """Whether the op's forward runs again in backward."""
        policy = self.policy(name)
        return policy == "full" or (policy == "selective" and not self.stores(name))

    def reshards_again(self, name: str) -> bool:
        """Whether reshards read by ``name`` run their forward collectives again in backward:
        under full recomputation; selective stores collective outputs."""
        return self.policy(name) == "full"

    def memory_weight(self, name: str) -> float:
        """How much of what ``name`` saves for backward counts toward the peak: 1, or for an op
        of a checkpointed layer whose saved tensors are recomputed, 1/(its group of identical
        layers): one layer's worth per group is alive, while that layer is recomputed."""
        if self.policy(name) == "selective" and self.stores(name):
            return 1.0
        return self._layer_weight(name)

    def copy_weight(self, value: ValueRef, consumers: list[Consumer], src: Spec, dst: Spec
                    ) -> float:
        """The weight of a saved copy of ``value`` in layout ``dst`` (:meth:`memory_weight`):
        the least of its savers'. Under selective checkpointing a copy is recomputed (one
        layer's worth alive) unless a collective delivered it (stored, counted by
        :meth:`stored_reshard_bytes`)."""
        if any(self.policy(c) == "selective" for c, _ in consumers):
            if self._collective(value, src, dst):
                return 0.0      # a stored collective output: :meth:`stored_reshard_bytes`
            # Recomputed in backward from what is stored (a stored op's own output, kept in
            # its producer's layout, is :meth:`memory`'s and costs nothing here).
            return min(self._layer_weight(c) for c, _ in consumers) * self.activation_copies
        return min(self.memory_weight(c) for c, _ in consumers) * self.activation_copies

    def _layer_weight(self, name: str) -> float:
        if not self.recomputed(name):
            return 1.0
        return 1.0 / self._group_size[self.traced.layer_of_node[name]]

    def _collective(self, value: ValueRef, src: Spec, dst: Spec) -> bool:
        return any(st.is_collective for st in self.steps(value, src, dst, frozenset()).forward)

    def stored_reshard_bytes(self, value: ValueRef, src: Spec, dst: Spec, consumer: str
                             ) -> float:
        """Bytes selective checkpointing stores for a reshard run inside a selectively
        checkpointed layer (``consumer`` is where it runs): its output, when it comes from a
        collective."""
        if self.policy(consumer) != "selective" or not self._collective(value, src, dst):
            return 0.0
        shape, itemsize = self.shapes[value]
        return float(local_numel(shape, dst, self.mesh.shape) * itemsize) * self.activation_copies

    def _stored(self, value: ValueRef) -> bool:
        node = self._nodes[value[0]]
        return node.op == "call_function" and self.policy(node.name) == "selective" \
            and self.stores(node.name)

    def checkpoint_inputs(self) -> dict[ValueRef, None]:
        """The activations checkpointed layers read from outside themselves: what
        ``torch.utils.checkpoint`` keeps for each (parameters are model state)."""
        if self._ckpt_inputs is not None:
            return self._ckpt_inputs
        out: dict[ValueRef, None] = {}
        self._ckpt_inputs = out
        if not self.recompute:
            return out
        where = self.traced.layer_of_node
        for node in self.traced.graph.nodes:
            if not self.recomputed(node.name) or node.target is operator.getitem:
                continue
            for ref in value_inputs(node):
                if where.get(ref[0]) != where[node.name] and ref[0] not in self.params:
                    out[ref] = None
        return out

    def op_steps(self, name: str, strategy: Strategy) -> tuple[Step, ...]:
        """The collectives the op runs inside itself under ``strategy`` (ops/registry.py
        ``collectives``), as steps on the mesh the program runs on (an op planned on merged axes
        runs on the real ones)."""
        return tuple(st for _, st, _ in self.op_charges(name, strategy))

    def op_charges(self, name: str, strategy: Strategy) -> tuple[tuple[str, Step, float], ...]:
        """``(phase, step, exposed seconds)`` of each collective the op runs inside itself, in
        its order: a blocking one's seconds whole, an overlapped one's (ring attention's hops)
        beyond the share of the op's compute it runs beside, ``max(0, t - hides·c·overlap)``
        with ``c`` the op's forward or backward seconds (docs/cost-model.md §3.8, §3.11)."""
        node = self._nodes[name]
        if node.op != "call_function" or record_of(node.target).collectives is None:
            return ()
        strategy, mesh_shape = self._on_real_mesh(strategy)
        colls = op_collectives(self.info(name), strategy, mesh_shape)
        if not colls:
            return ()
        real = self.merge.real if self.merge else self.mesh
        fwd, bwd = self.times(name, strategy) if any(c.hides for c in colls) else (0.0, 0.0)
        overlap = self.mesh.cluster.comm_overlap
        out = []
        for c in colls:
            st = Step(c.kind, c.axis, nbytes=c.nbytes, joint=c.joint)
            hidden = c.hides * (fwd if c.phase == "forward" else bwd) * overlap
            out.append((c.phase, st, max(0.0, step_seconds(st, real) - hidden)))
        return tuple(out)

    def _on_real_mesh(self, strategy: Strategy) -> tuple[Strategy, tuple[int, ...]]:
        """The strategy as it runs on the mesh the program runs on (an op planned on merged
        axes runs on the real ones), and that mesh's shape."""
        if self.merge is None:
            return strategy, self.mesh.shape
        return Strategy(tuple(self.merge.expand_spec(s) for s in strategy.inputs),
                        tuple(self.merge.expand_spec(s) for s in strategy.outputs),
                        strategy.kernel, strategy.compute_scale), self.merge.real.shape

    def workspace(self, name: str, strategy: Strategy) -> tuple[int, int]:
        """Bytes the op's kernel holds while it runs beyond its tensors, (forward, backward)
        (ops/registry.py ``workspace``; ring attention's blocks in flight, §3.11)."""
        node = self._nodes[name]
        fn = record_of(node.target).workspace if node.op == "call_function" else None
        if fn is None:
            return 0, 0
        strategy, mesh_shape = self._on_real_mesh(strategy)
        return fn(self.info(name), strategy, mesh_shape)

    def op_comm_seconds(self, name: str, strategy: Strategy) -> float:
        """Exposed seconds of :meth:`op_charges`; the forward ones twice where a fully
        checkpointed layer runs the op's forward again (selective stores collective outputs,
        §8)."""
        charges = self.op_charges(name, strategy)
        if not charges:
            return 0.0
        again = 2 if self.reshards_again(name) else 1
        return sum(t * (again if phase == "forward" else 1) for phase, _, t in charges) * self.runs

    def backward(self, name: str, strategy: Strategy) -> float:
        """The window gradient syncs hide behind: the backward part of :meth:`compute`, times
        the share of it a collective can overlap on this cluster (``Cluster.comm_overlap``).
        A parameter whose offloaded host step runs in that window (:meth:`offload_step_seconds`)
        takes its seconds out of it: the ILP's window is ``w >= sync + host - backward``."""
        if self._nodes[name].op == "placeholder":
            return -self.offload_step_seconds(name, strategy)[1]
        return self.times(name, strategy)[1] * self.mesh.cluster.comm_overlap

    def times(self, name: str, strategy: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of an op once (a parameter: its optimizer step, 0)."""
        if self._nodes[name].op == "placeholder":
            return self.optimizer_seconds(name, strategy), 0.0
        return op_times(self.info(name), strategy, self.mesh, training=self.training,
                        compiled=self.options.compile, fused=self.fused.get(name))

    # -- model state ------------------------------------------------------------------------
    def param_modes(self, name: str, spec) -> list[str | None]:
        """The state modes (cost/state.py) a parameter stored in ``spec`` may take."""
        ph = self.traced.placeholder(name)
        return modes_for(ph.info.shape, spec, self.mesh.shape, self.optimizer_of(name),
                         self.modes)

    def optimizer_of(self, name: str) -> str:
        """The optimizer whose state parameter ``name`` carries: "none" for a frozen one (no
        gradient, no state, no step: docs/cost-model.md §4.1), else the options'."""
        return "none" if name in self.frozen else self.options.state_optimizer

    def state_bytes(self, name: str, strategy: Strategy) -> StateBytes:
        """What one device (and its host) holds for a parameter or buffer placeholder: the
        parameter, its gradient, its optimizer state (docs/cost-model.md §4.1, §9)."""
        ph = self.traced.placeholder(name)
        if ph.info is None or ph.kind == "input" or name in self.tied_to:
            return StateBytes()
        spec = strategy.outputs[0]
        if ph.kind != "param":
            numel = math.prod(local_shape(ph.info.shape, spec, self.mesh.shape))
            return StateBytes(buffers=numel * ph.info.dtype.itemsize)
        return state_bytes(ph.info.shape, ph.info.dtype, spec, strategy.kernel, self.mesh.shape,
                           self.optimizer_of(name))

    def accumulated_bytes(self, name: str, strategy: Strategy) -> float:
        """What gradient accumulation holds for a parameter beyond its state's gradient: its
        gradient whole, in its stored layout, across micro-steps (codegen/buckets.py under
        ``no_sync``), where ZeRO-2 or offload keep only a shard after the step's sync
        (docs/cost-model.md §7.2). 0 without accumulation, for a frozen parameter, and under
        parameter offload (its gradient goes down to the host)."""
        if self.runs == 1 or name in self.frozen or name not in self.params:
            return 0.0
        st = self.state_bytes(name, strategy)
        return max(0.0, st.parameters - st.gradients)

    def optimizer_seconds(self, name: str, strategy: Strategy) -> float:
        """The optimizer step's seconds for one parameter (docs/cost-model.md §9): its shard of
        the update, streamed at the device's (or with offload the host's) memory bandwidth, and
        with offload the gradient shard down and the updated shard up the host link. Under
        parameter offload the gradient is on the host already; a shard of a replicated
        parameter goes up to be all-gathered, and the gathered parameter comes back down to its
        host copy (:meth:`host_steps`). Under optimizer offload, the blocking part of
        :meth:`offload_step_seconds`. The all-gather of the updated shards is a collective
        (:meth:`optimizer_steps`)."""
        ph = self.traced.placeholder(name)
        opt = self.optimizer_of(name)
        if ph.kind != "param" or opt == "none" or name in self.tied_to:
            return 0.0
        spec, mode = strategy.outputs[0], strategy.kernel
        if mode == "offload":
            return self.offload_step_seconds(name, strategy)[0]
        n = step_elements(ph.info.shape, spec, mode, self.mesh.shape)
        per = SGD_STEP_BYTES if opt == "sgd" else ADAM_STEP_BYTES
        c = self.mesh.cluster
        if mode == "offload_params":
            t = n * per / c.host_mem_bandwidth + sum(
                b for _, b in self.host_steps(name, strategy)) / c.host_bandwidth
        else:
            casts = MASTER_CAST_BYTES if ph.info.dtype.itemsize < 4 else 0
            t = n * (per + casts) / c.mem_bandwidth
        return t * self.step_share

    def offload_step_seconds(self, name: str, strategy: Strategy) -> tuple[float, float]:
        """Optimizer offload's host step of one parameter (docs/cost-model.md §9.1), as
        (blocking, overlapped) seconds: its state shard's update streamed at the host's memory
        bandwidth, its gradient shard down and the updated shard up the host link. Under
        ``PlanOptions.offload_overlap`` "backward" or "delayed" (codegen/hostopt.py) all of it
        runs on the host while the device computes: it is work in the overlap window of §7
        (beside the gradient buckets' sync), which the step pays only where backward compute
        cannot hide it; under "none" it blocks, and on a pipeline's stages too (the runtime
        lands their gradients at the step, after every microbatch). (0, 0) for any other
        mode."""
        ph = self.traced.placeholder(name)
        opt = self.optimizer_of(name)
        mode = strategy.kernel
        if ph.kind != "param" or opt == "none" or name in self.tied_to or mode != "offload":
            return 0.0, 0.0
        n = step_elements(ph.info.shape, strategy.outputs[0], mode, self.mesh.shape)
        c = self.mesh.cluster
        t = (n * (SGD_STEP_BYTES if opt == "sgd" else ADAM_STEP_BYTES) / c.host_mem_bandwidth
             + 2 * n * ph.info.dtype.itemsize / c.host_bandwidth) * self.step_share
        if self.options.offload_overlap == "none" or self.options.stage_run is not None:
            return t, 0.0
        return 0.0, t

    def host_steps(self, name: str, strategy: Strategy) -> list[tuple[str, int]]:
        """The host-link copies of one parameter's optimizer step (cost/state.py
        ``host_copies``; none for a buffer, a tied alias or a frozen parameter)."""
        ph = self.traced.placeholder(name)
        if ph.kind != "param" or name in self.tied_to or self.optimizer_of(name) == "none":
            return []
        return host_copies(ph.info.shape, ph.info.dtype, strategy.outputs[0], strategy.kernel,
                           self.mesh.shape)

    def fetch_bytes(self, value: ValueRef, src: Spec, mode: str | None) -> int:
        """Bytes one use of a parameter under parameter offload copies to the device: its
        stored local shard (0 for any other value or mode)."""
        if mode != "offload_params" or value[0] not in self.params:
            return 0
        shape, itemsize = self.shapes[value]
        return local_numel(shape, src, self.mesh.shape) * itemsize

    def host_seconds(self, value: ValueRef, src: Spec, dst: Spec, divergent: frozenset[int],
                     mode: str | None, again: bool = False) -> float:
        """Seconds on the host link of one use of a parameter under parameter offload
        (docs/cost-model.md §9), read in ``dst``: its stored shard copied to the device (again
        where ``again``: the use is recomputed), and the gradient that comes back copied down:
        the stored-layout gradient of this use, or for a bucketed gradient sync its bucket's
        share (its reduce-scattered shard). Blocking: the runtime copies at the use, without
        prefetch."""
        n = self.fetch_bytes(value, src, mode)
        if not n:
            return 0.0
        down = 0
        if self.has_grad(value):
            steps = self.steps(value, src, dst, divergent)
            down = n
            if is_grad_sync(steps):
                shape, itemsize = self.shapes[value]
                sspec = state_spec(shape, src, self.mesh.shape)
                if sspec is not None:
                    down = local_numel(shape, sspec, self.mesh.shape) * itemsize
        return (n * (2 if again else 1) + down) / self.mesh.cluster.host_bandwidth \
            * self.step_share * self.runs

    def optimizer_steps(self, name: str, strategy: Strategy) -> Reshard | None:
        """The all-gather(s) that bring the updated state shards back to the parameter's
        layout after the step (zero1/zero2/offload over its zero axes), or None."""
        ph = self.traced.placeholder(name)
        if strategy.kernel is None or ph.kind != "param" or name in self.tied_to:
            return None
        spec = strategy.outputs[0]
        sspec = state_spec(ph.info.shape, spec, self.mesh.shape)
        if sspec is None:
            return None
        if self.merge is not None:
            sspec, spec = self.merge.expand_spec(sspec), self.merge.expand_spec(spec)
            mesh_shape = self.merge.real.shape
        else:
            mesh_shape = self.mesh.shape
        return reshard(sspec, spec, ph.info.shape, ph.info.dtype.itemsize, mesh_shape)

    def optimizer_comm_seconds(self, name: str, strategy: Strategy) -> float:
        r = self.optimizer_steps(name, strategy)
        mesh = self.merge.real if self.merge else self.mesh
        return steps_time(r.forward, mesh) * self.step_share if r else 0.0

    def memory(self, name: str, strategy: Strategy) -> float:
        """Bytes one device holds for the node: a parameter's state or a buffer; for an op, what
        it saves for backward apart from its inputs (those are :meth:`saved_copy_bytes`)."""
        node = self._nodes[name]
        if node.op == "placeholder":
            return float(self.state_bytes(name, strategy).device
                         + self.accumulated_bytes(name, strategy))
        if not self.training:
            return 0.0
        info = self.info(name)
        saved = saved_activation_bytes(info, strategy, self.mesh.shape,
                                       exclude=frozenset(saved_rule(info).inputs))
        if self.policy(name) == "selective" and self.stores(name):
            # Selective checkpointing stores every output of the op, saved or not.
            saved = max(saved, sum(local_numel(shape, spec, self.mesh.shape) * isz
                                   for (shape, isz), spec in zip(
                                       op_profile(info).outputs, strategy.outputs)))
        return (saved * self.memory_weight(name) + self._kept_for_checkpoint(name, strategy)) \
            * self.activation_copies

    def _kept_for_checkpoint(self, name: str, strategy: Strategy) -> float:
        """The outputs of ``name`` a checkpointed layer keeps as its inputs, in their layout."""
        total = 0.0
        for i, spec in enumerate(strategy.outputs):
            if (name, i) in self.checkpoint_inputs():
                shape, itemsize = self.shapes[(name, i)]
                total += local_numel(shape, spec, self.mesh.shape) * itemsize
        return total

    def reads(self, name: str) -> list[str]:
        """The nodes whose values ``name`` reads, by input position."""
        return [ref[0] for ref in value_inputs(self._nodes[name])]

    # -- saved inputs -----------------------------------------------------------------------
    def saved_inputs(self) -> dict[ValueRef, list[Consumer]]:
        """Each value some op keeps for its backward, with those (consumer, input position)
        pairs (training only; empty for inference)."""
        if self._saved_inputs is None:
            out: dict[ValueRef, list[Consumer]] = {}
            if self.training:
                for node in self.traced.graph.nodes:
                    if node.op != "call_function" or node.target is operator.getitem:
                        continue
                    refs = value_inputs(node)
                    for k in saved_rule(self.info(node.name)).inputs:
                        if k < len(refs) and self._needed(node, refs, k):
                            out.setdefault(refs[k], []).append((node.name, k))
            self._saved_inputs = out
        return self._saved_inputs

    def _needed(self, node: fx.Node, refs: list[ValueRef], k: int) -> bool:
        """A product's backward keeps one factor only for the other's gradient: PyTorch saves
        ``a`` of ``a * b`` only if ``b`` needs a gradient (RoPE's ``q * cos`` keeps ``cos``,
        not ``q``)."""
        if not record_of(node.target).one_factor or len(refs) != 2:
            return True
        other = refs[1 - k][0]
        return other in self.grads or other in self.params

    def saved_copy_bytes(self, value: ValueRef, src: Spec, dst: Spec,
                         mode: str | None = None) -> float:
        """Bytes one device keeps of ``value`` in layout ``dst`` for the ops that save it there
        (one tensor however many ops save it). Nothing when that tensor is the producer's own
        (``dst == src``) and already counted: a parameter or buffer, an output its op saves, or
        a view of one; but a parameter under offload (``mode``, its state mode) is read from
        its copy on the device, which is what the ops keep."""
        same = dst == src or not self.steps(value, src, dst, frozenset()).forward
        if same and self.kept(value) and not self.fetch_bytes(value, src, mode):
            return 0.0      # (specs that differ only on 1-device axes: same)
        shape, itemsize = self.shapes[value]
        return float(local_numel(shape, dst, self.mesh.shape) * itemsize)

    def saved_copies(self, strategies: dict[str, Strategy]) -> float:
        """:meth:`saved_copy_bytes` summed over a full assignment: every value once per layout
        its saving consumers read it in (weighted as the most-kept of its savers, see
        :meth:`memory_weight`)."""
        total = 0.0
        for ref, cons in self.saved_inputs().items():
            src = strategies[ref[0]].outputs[ref[1]]
            mode = strategies[ref[0]].kernel if ref[0] in self.params else None
            for dst in dict.fromkeys(strategies[c].inputs[k] for c, k in cons):
                total += self.saved_copy_bytes(ref, src, dst, mode) * self.copy_weight(
                    ref, cons, src, dst)
        return total

    def kept(self, value: ValueRef) -> bool:
        """Whether ``value`` in its producer's layout is already counted in memory."""
        known = self._kept.get(value)
        if known is None:
            node = self._nodes[value[0]]
            if node.op == "placeholder":
                ph = self.traced.placeholder(node.name)
                known = ph.kind != "input"
            elif record_of(node.target).family == VIEW:
                refs = value_inputs(node)
                known = bool(refs) and self.kept(refs[0])
            else:
                known = value[1] in saved_rule(self.info(node.name)).outputs \
                    or self._stored(value)
            self._kept[value] = known
        return known

    # -- per reshard ------------------------------------------------------------------------
    def reshard_seconds(self, value: ValueRef, src: Spec, dst: Spec,
                        divergent: frozenset[int]) -> float:
        """All the seconds of :meth:`reshard_cost`, blocking or not."""
        return sum(self.reshard_cost(value, src, dst, divergent))

    def reshard_cost(self, value: ValueRef, src: Spec, dst: Spec,
                     divergent: frozenset[int], mode: str | None = None) -> tuple[float, float]:
        """(blocking seconds, bucketed gradient-sync seconds) of the reshard; ``mode``: the
        state mode of the parameter ``value`` is (zero2 and offload reduce-scatter the bucketed
        gradient, cost/state.py)."""
        shape, itemsize = self.shapes[value]
        grad = self.has_grad(value)
        param = value[0] in self.params
        key = (src, dst, shape, itemsize, divergent if grad else frozenset(), grad, param, mode)
        t = self._reshard_memo.get(key)
        if t is None:
            steps = self.steps(value, src, dst, divergent)
            mesh = self.merge.real if self.merge else self.mesh
            if param and is_grad_sync(steps):
                steps = self.bucketed_sync(value, src, steps, mode)
                t = (0.0, self.step_share * sync_share_seconds(steps, mesh,
                                                               self.options.bucket_bytes))
            else:
                t = (reshard_time(steps, mesh) * self.runs, 0.0)
            self._reshard_memo[key] = t
        return t

    def reshard_floor(self, value: ValueRef, src: Spec, dst: Spec) -> float:
        """A lower bound on :meth:`reshard_seconds` without building the reshard: every real
        mesh axis whose placement changes needs a collective on it — forward, or backward for a
        value with a gradient — unless it changes from replicated to partial, or to a shard of a
        value without a gradient (local steps both). A collective over ``p`` devices pays at
        least ``(p - 1)·alpha`` of its axis (docs/cost-model.md §1.1), and one over several axes
        at least the sum of theirs (``p1·p2 - 1 >= (p1 - 1) + (p2 - 1)`` at the slowest
        member's alpha). A parameter's gradient sync is priced in buckets, one latency per
        bucket: 0 for parameters."""
        if value[0] in self.params:
            return 0.0
        mesh = self.mesh
        if self.merge is not None:
            src, dst, mesh = self.merge.expand_spec(src), self.merge.expand_spec(dst), \
                self.merge.real
        grad = self.has_grad(value)
        t = 0.0
        for a, (x, y) in enumerate(zip(src, dst)):
            if x == y or (isinstance(x, Replicate)
                          and (isinstance(y, Partial) or (isinstance(y, Shard) and not grad))):
                continue
            t += (mesh.shape[a] - 1) * mesh.links[a].least_alpha
        return t * self.runs

    def bucketed_sync(self, value: ValueRef, src: Spec, steps: Reshard, mode: str | None
                      ) -> Reshard:
        """A parameter's pure gradient sync as its bucket runs it: all-reduces, or under
        zero2/offload reduce-scatters over its zero axes (on the real mesh)."""
        if mode not in SCATTERS:
            return steps
        shape = self.shapes[value][0]
        if state_spec(shape, src, self.mesh.shape) is None:
            return steps
        mesh_shape = self.mesh.shape
        if self.merge is not None:
            src, mesh_shape = self.merge.expand_spec(src), self.merge.real.shape
        return zero_grad_sync(steps, zero_axes(src, mesh_shape), mesh_shape)

    def forward_seconds(self, value: ValueRef, src: Spec, dst: Spec) -> float:
        """The forward collectives of a reshard alone: what recomputing it runs again."""
        steps = self.steps(value, src, dst, frozenset())
        return steps_time(steps.forward, self.merge.real if self.merge else self.mesh) * self.runs

    def steps(self, value: ValueRef, src: Spec, dst: Spec, divergent: frozenset[int]) -> Reshard:
        """The collectives, forward and backward, on the mesh the program runs on."""
        shape, itemsize = self.shapes[value]
        grad = self.has_grad(value)
        mesh_shape = self.mesh.shape
        if self.merge is not None:
            src, dst = self.merge.expand_spec(src), self.merge.expand_spec(dst)
            divergent = self.merge.expand_axes(divergent)
            mesh_shape = self.merge.real.shape
        r = reshard(src, dst, shape, itemsize, mesh_shape, divergent if grad else frozenset(),
                    self.joint)
        return r if grad else no_backward(r)
