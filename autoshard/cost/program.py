"""The step program: what one rank runs in a training step, for one full assignment.

docs/design.md "The step program". Built once from the traced graph and the strategies, and read
by every consumer, so the order and the rules are written here only:

- ``solver/assemble.assemble`` lists the ledger's collectives and host copies from its reshards,
  buckets and fetched parameters;
- ``cost/liveness.step_memory`` walks its events forward, backward and through the optimizer
  step for the step's peak;
- ``codegen/rewrite.emit`` lowers its events, in its order, into the rank program, and runs the
  gradient syncs its buckets hold through the runtime's buckets.

Events, in the order the rank program runs them: every op of the traced graph (placeholders and
``getitem`` excepted) in graph order, each reshard just before the first op that reads it
(``cost/reshards.reshard_edges``: one per (value, required spec), shared by its consumers). An
event inside a checkpointed layer names that layer (``region``): its ops run again in backward.

Gradient buckets (``cost/overlap.gradient_buckets``): each parameter's first pure gradient sync
(``first_grad_syncs``) is run by its bucket, not where the gradient appears; ``bucketed`` maps a
parameter to that reshard's index. ``fetched``: parameters kept on the host (state mode
``offload_params``), copied to the device at each use.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch.fx as fx
import torch.utils._pytree as pytree

from autoshard.cost.comm import Groups
from autoshard.cost.overlap import Bucket, first_grad_syncs, gradient_buckets
from autoshard.cost.reshards import ReshardEdge, reshard_edges
from autoshard.ir import Strategy
from autoshard.trace.graph import ValueRef, value_inputs, value_ref, value_shapes


@dataclass(frozen=True, slots=True)
class Event:
    """One thing the rank runs in forward: an op (``name``, its node) or a reshard (``edge``,
    its index in :attr:`StepProgram.edges`; ``name``, its first consumer). ``region``: the
    checkpointed layer it runs in, if any."""

    kind: str                    # "op" | "reshard"
    name: str
    edge: int = -1
    region: str | None = None


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

    def first_syncs(self) -> dict[str, ReshardEdge]:
        """Each bucketed parameter's gradient sync reshard (``first_grad_syncs``' result)."""
        return {p: self.edges[i] for p, i in self.bucketed.items()}

    def edge(self, ref: ValueRef, consumer: tuple[str, int]) -> ReshardEdge | None:
        """The reshard a consumer's input goes through, if any."""
        i = self.edge_of.get((ref, consumer))
        return None if i is None else self.edges[i]


def step_program(traced: Any, strategies: dict[str, Strategy], mesh_shape: tuple[int, ...], *,
                 bucket_bytes: float, recompute: Mapping[str, str] | None = None,
                 joint: Groups = (), shapes: Mapping | None = None) -> StepProgram:
    """The step program of ``traced`` (a :class:`~autoshard.trace.export.TracedGraph`) under
    ``strategies`` (node name -> strategy, every placeholder and op) on a mesh of
    ``mesh_shape``; ``recompute``: checkpointed layer -> policy; ``joint``: the plan's groups of
    axes whose collectives run as one; ``shapes``: ``value_shapes`` of the graph, if at hand."""
    graph: fx.Graph = traced.graph
    params = {p.name for p in traced.params}
    shapes = value_shapes(graph) if shapes is None else shapes
    edges = tuple(reshard_edges(graph, strategies, tuple(mesh_shape), shapes, params,
                                training=traced.training, joint=joint))
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
        modes = {n: strategies[n].kernel for n in params if n in strategies}
        buckets = tuple(gradient_buckets(list(edges), nodes, bucket_bytes, modes,
                                         tuple(mesh_shape)))
    return StepProgram(
        events=tuple(events), edges=edges, buckets=buckets, bucketed=bucketed,
        fetched=frozenset(n for n in params
                          if getattr(strategies.get(n), "kernel", None) == "offload_params"),
        edge_of=edge_of,
        bucket_of={m: k for k, b in enumerate(buckets) for m in b.members})


def node_reads(node: fx.Node) -> list[ValueRef]:
    """The values a node reads, in input order (the graph's output: every tensor it returns)."""
    if node.op == "output":
        return [value_ref(a) for a in pytree.tree_flatten(node.args)[0]
                if isinstance(a, fx.Node)]
    return value_inputs(node)
