"""The one pricing function: what a node costs under a strategy, and what a reshard costs.

The ILP's coefficients (solver/build.py) and a Plan's predicted figures (solver/planner.py) are
both sums of these two prices, the first over every (node, strategy) and (value, source layout,
requirement) the search may pick, the second over the ones a plan picked. A change to a price
(overlap, recomputation, offload) is made here once.

- :meth:`Pricer.node`: seconds of compute on one device (forward, + backward in training;
  docs/cost-model.md §3) and bytes one device holds for the node: a parameter's state (weights,
  gradient, optimizer), a buffer, or what an op saves for backward (§4).
- :meth:`Pricer.reshard`: seconds of the collectives that move a value from its producer's layout
  to a requirement, both directions (§1), and the bytes of a parameter's resharded copy kept for
  backward (a ZeRO-3 weight gathered for a linear).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx

from autoshard.cost.comm import Reshard, reshard, reshard_time
from autoshard.cost.compute import op_time
from autoshard.cost.memory import param_state_bytes, saved_activation_bytes, saved_input_bytes
from autoshard.cost.reshards import grad_values, no_backward
from autoshard.ir import OpInfo, Spec, Strategy, local_shape
from autoshard.mesh import AxisMerge, Mesh
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
    ``merge.merged()`` and reshards are priced as they run on the real mesh."""

    def __init__(self, traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                 merge: AxisMerge | None = None) -> None:
        self.traced, self.mesh, self.options, self.merge = traced, mesh, options, merge
        self.training = traced.training
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
        self._reads: dict[str, frozenset[int]] = {}
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
        if self._nodes[name].op == "placeholder":
            return 0.0
        return op_time(self.info(name), strategy, self.mesh, training=self.training)

    def memory(self, name: str, strategy: Strategy) -> float:
        """Bytes one device holds for the node. An input a parameter feeds directly is not saved
        again (it lives in model state); a resharded copy is charged on its reshard."""
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
        return float(saved_activation_bytes(self.info(name), strategy, self.mesh.shape,
                                            exclude=self._param_reads(node)))

    def reads(self, name: str) -> list[str]:
        """The nodes whose values ``name`` reads, by input position."""
        return [ref[0] for ref in value_inputs(self._nodes[name])]

    def _param_reads(self, node: fx.Node) -> frozenset[int]:
        reads = self._reads.get(node.name)
        if reads is None:
            reads = self._reads[node.name] = frozenset(
                k for k, ref in enumerate(value_inputs(node)) if ref[0] in self.params)
        return reads

    # -- per reshard ------------------------------------------------------------------------
    def reshard(self, value: ValueRef, src: Spec, dst: Spec, divergent: frozenset[int],
                consumers: Sequence[Consumer]) -> Price:
        """Moving ``value`` from ``src`` to what ``consumers`` need: ``dst``, with the gradient
        all-reduced over ``divergent`` axes (only if the value carries a gradient)."""
        return Price(self.reshard_seconds(value, src, dst, divergent),
                     self.copy_bytes(value, src, dst, consumers))

    def reshard_seconds(self, value: ValueRef, src: Spec, dst: Spec,
                        divergent: frozenset[int]) -> float:
        shape, itemsize = self.shapes[value]
        grad = value[0] in self.grads
        key = (src, dst, shape, itemsize, divergent if grad else frozenset(), grad)
        t = self._reshard_memo.get(key)
        if t is None:
            t = self._reshard_memo[key] = reshard_time(self.steps(value, src, dst, divergent),
                                                       self.merge.real if self.merge else self.mesh)
        return t

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

    def copy_bytes(self, value: ValueRef, src: Spec, dst: Spec,
                   consumers: Sequence[Consumer]) -> float:
        """A parameter's resharded copy, kept if a consumer saves it for backward (the
        parameter itself is in model state)."""
        if value[0] not in self.params or not self.training or src == dst:
            return 0.0
        return float(max([saved_input_bytes(self.info(c), k, dst, self.mesh.shape)
                          for c, k in consumers if c in self._nodes
                          and self._nodes[c].op == "call_function"] or [0]))
