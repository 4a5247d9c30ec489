"""The one pricing function: what a node costs under a strategy, and what a reshard costs.

The ILP's coefficients (solver/build.py) and a Plan's predicted figures (solver/planner.py) are
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
- :meth:`Pricer.saved_copy_bytes`: the bytes of a value that the ops reading it keep for backward,
  once per layout they read it in (§4.4): the normed input that q, k and v projections all save
  is one tensor, and a ZeRO-3 weight gathered for a linear is one gathered copy.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from autoshard.cost.comm import Reshard, reshard, reshard_time, steps_time
from autoshard.cost.compute import local_numel, op_times
from autoshard.cost.memory import param_state_bytes, saved_activation_bytes, saved_rule
from autoshard.cost.overlap import is_grad_sync, sync_share_seconds
from autoshard.cost.reshards import grad_values, no_backward
from autoshard.ir import OpInfo, Spec, Strategy, local_shape
from autoshard.mesh import AxisMerge, Mesh
from autoshard.ops.registry import VIEW, record_of
from autoshard.options import PlanOptions
from autoshard.trace.export import TracedGraph, op_info
from autoshard.trace.graph import ValueRef, value_inputs, value_shapes

Consumer = tuple[str, int]   # (consumer node, tensor input position)


@dataclass(frozen=True, slots=True)
class Price:
    seconds: float
    bytes: float


class Pricer:
    """Prices on ``mesh`` (the mesh the strategies are written for). With ``merge``, ``mesh`` is
    ``merge.merged()`` and reshards are priced as they run on the real mesh.

    ``recompute``: layers (by name) whose activations are checkpointed: full recomputation,
    docs/cost-model.md §8. Their ops run their forward twice; of what they save, one layer's
    worth per group of identical layers is alive at once (the layer being recomputed), which
    :meth:`memory_weight` expresses as a weight of 1/(group size) on each such node; the
    values they read from outside the layer are kept whole (:meth:`checkpoint_inputs`)."""

    def __init__(self, traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                 merge: AxisMerge | None = None, recompute: frozenset[str] = frozenset()) -> None:
        self.traced, self.mesh, self.options, self.merge = traced, mesh, options, merge
        self.training = traced.training
        self.recompute = recompute if self.training else frozenset()
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
        self._infos: dict[str, OpInfo] = {}
        self._saved_inputs: dict[ValueRef, list[Consumer]] | None = None
        self._kept: dict[ValueRef, bool] = {}
        self._ckpt_inputs: dict[ValueRef, None] | None = None
        self._reshard_memo: dict[tuple, float] = {}

    # -- per node ---------------------------------------------------------------------------
    def info(self, name: str) -> OpInfo:
        """The op's view of a call_function node (computed once)."""
        info = self._infos.get(name)
        if info is None:
            info = self._infos[name] = op_info(self._nodes[name])
        return info

    def node(self, name: str, strategy: Strategy) -> Price:
        return Price(self.compute(name, strategy), self.memory(name, strategy))

    def compute(self, name: str, strategy: Strategy) -> float:
        """Forward + backward seconds (+ the forward again in a recomputed layer)."""
        fwd, bwd = self._times(name, strategy)
        return fwd * (2 if self.recomputed(name) else 1) + bwd

    def recomputed(self, name: str) -> bool:
        """Whether ``name`` is an op of a checkpointed layer."""
        return bool(self.recompute) and self.traced.layer_of_node.get(name) in self.recompute \
            and self._nodes[name].op == "call_function"

    def memory_weight(self, name: str) -> float:
        """How much of what ``name`` saves for backward counts toward the peak: 1, or for an op
        of a checkpointed layer 1/(its group of identical layers): one layer's worth per group
        is alive, while that layer is recomputed."""
        if not self.recomputed(name):
            return 1.0
        return 1.0 / self._group_size[self.traced.layer_of_node[name]]

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

    def backward(self, name: str, strategy: Strategy) -> float:
        """The backward part of :meth:`compute`: the window gradient syncs hide behind."""
        return self._times(name, strategy)[1]

    def _times(self, name: str, strategy: Strategy) -> tuple[float, float]:
        if self._nodes[name].op == "placeholder":
            return 0.0, 0.0
        return op_times(self.info(name), strategy, self.mesh, training=self.training)

    def memory(self, name: str, strategy: Strategy) -> float:
        """Bytes one device holds for the node: a parameter's state or a buffer; for an op, what
        it saves for backward apart from its inputs (those are :meth:`saved_copy_bytes`)."""
        node = self._nodes[name]
        if node.op == "placeholder":
            ph = self.traced.placeholder(name)
            if ph.info is None or ph.kind == "input" or name in self.tied_to:
                return 0.0
            numel = math.prod(local_shape(ph.info.shape, strategy.outputs[0], self.mesh.shape))
            if ph.kind == "param":
                return float(param_state_bytes(numel, ph.info.dtype,
                                               optimizer=self.options.state_optimizer))
            return float(numel * ph.info.dtype.itemsize)
        if not self.training:
            return 0.0
        info = self.info(name)
        saved = saved_activation_bytes(info, strategy, self.mesh.shape,
                                       exclude=frozenset(saved_rule(info).inputs))
        return saved * self.memory_weight(name) + self._kept_for_checkpoint(name, strategy)

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
        if node.target is not torch.ops.aten.mul.Tensor or len(refs) != 2:
            return True
        other = refs[1 - k][0]
        return other in self.grads or other in self.params

    def saved_copy_bytes(self, value: ValueRef, src: Spec, dst: Spec) -> float:
        """Bytes one device keeps of ``value`` in layout ``dst`` for the ops that save it there
        (one tensor however many ops save it). Nothing when that tensor is the producer's own
        (``dst == src``) and already counted: a parameter or buffer, an output its op saves, or
        a view of one."""
        same = dst == src or not self.steps(value, src, dst, frozenset()).forward
        if same and self.kept(value):      # (specs that differ only on 1-device axes: same)
            return 0.0
        shape, itemsize = self.shapes[value]
        return float(local_numel(shape, dst, self.mesh.shape) * itemsize)

    def saved_copies(self, strategies: dict[str, Strategy]) -> float:
        """:meth:`saved_copy_bytes` summed over a full assignment: every value once per layout
        its saving consumers read it in (weighted as the most-kept of its savers, see
        :meth:`memory_weight`)."""
        total = 0.0
        for ref, cons in self.saved_inputs().items():
            src = strategies[ref[0]].outputs[ref[1]]
            weight = min(self.memory_weight(c) for c, _ in cons)
            for dst in dict.fromkeys(strategies[c].inputs[k] for c, k in cons):
                total += self.saved_copy_bytes(ref, src, dst) * weight
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
                known = value[1] in saved_rule(self.info(node.name)).outputs
            self._kept[value] = known
        return known

    # -- per reshard ------------------------------------------------------------------------
    def reshard_seconds(self, value: ValueRef, src: Spec, dst: Spec,
                        divergent: frozenset[int]) -> float:
        """All the seconds of :meth:`reshard_cost`, blocking or not."""
        return sum(self.reshard_cost(value, src, dst, divergent))

    def reshard_cost(self, value: ValueRef, src: Spec, dst: Spec,
                     divergent: frozenset[int]) -> tuple[float, float]:
        """(blocking seconds, bucketed gradient-sync seconds) of the reshard."""
        shape, itemsize = self.shapes[value]
        grad = value[0] in self.grads
        param = value[0] in self.params
        key = (src, dst, shape, itemsize, divergent if grad else frozenset(), grad, param)
        t = self._reshard_memo.get(key)
        if t is None:
            steps = self.steps(value, src, dst, divergent)
            mesh = self.merge.real if self.merge else self.mesh
            if param and is_grad_sync(steps):
                t = (0.0, sync_share_seconds(steps, mesh, self.options.bucket_bytes))
            else:
                t = (reshard_time(steps, mesh), 0.0)
            self._reshard_memo[key] = t
        return t

    def forward_seconds(self, value: ValueRef, src: Spec, dst: Spec) -> float:
        """The forward collectives of a reshard alone: what recomputing it runs again."""
        steps = self.steps(value, src, dst, frozenset())
        return steps_time(steps.forward, self.merge.real if self.merge else self.mesh)

    def steps(self, value: ValueRef, src: Spec, dst: Spec, divergent: frozenset[int]) -> Reshard:
        """The collectives, forward and backward, on the mesh the program runs on."""
        shape, itemsize = self.shapes[value]
        grad = value[0] in self.grads
        mesh_shape = self.mesh.shape
        if self.merge is not None:
            src, dst = self.merge.expand_spec(src), self.merge.expand_spec(dst)
            divergent = self.merge.expand_axes(divergent)
            mesh_shape = self.merge.real.shape
        r = reshard(src, dst, shape, itemsize, mesh_shape, divergent if grad else frozenset())
        return r if grad else no_backward(r)
