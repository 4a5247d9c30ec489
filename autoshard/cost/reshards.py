"""What moves between nodes under a given assignment of strategies: the reshard edges.

Both the planner (to write the plan's collective ledger and price it) and codegen (to insert the
collectives) walk the graph through this one function, so the plan's ledger and the program's
collectives cannot disagree.

A *value* is one tensor output of a node, ``(node name, output index)``. Each consumer needs the
value in a spec, and, if it does per-rank-different work on an axis where the value is replicated,
an all-reduce of its gradient on that axis. Consumers with the same (spec, divergent axes) share
one reshard: one set of collectives, one gradient all-reduce.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
import torch.fx as fx

from autoshard.cost.comm import Groups, Reshard, reshard
from autoshard.ir import Replicate, Spec, Strategy, divergent_axes
from autoshard.ops.registry import FACTORY, record_of
from autoshard.trace.aliases import pinned_reads
from autoshard.trace.graph import ValueRef, flat_values, value_inputs



@dataclass(frozen=True, slots=True)
class ReshardEdge:
    value: ValueRef
    consumers: tuple[tuple[str, int], ...]   # (consumer node, tensor input position)
    src: Spec
    dst: Spec
    divergent: frozenset[int]
    reshard: Reshard
    from_param: bool


def frozen(node: fx.Node) -> bool:
    """Whether a parameter placeholder is frozen (``requires_grad=False``): torch.export keeps
    the parameter's flag on its traced value, so this is the model's own fact, read here only.
    A frozen parameter has no gradient, hence no gradient sync, no gradient buffer, no
    optimizer state and no optimizer step (docs/cost-model.md §4.1)."""
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and not val.requires_grad


def grad_values(graph: fx.Graph, param_names: set[str]) -> set[str]:
    """Nodes whose outputs carry a gradient in training: floating-point values computed from a
    trainable parameter. Only these get backward collectives (an input batch, a mask or a
    frozen parameter has no gradient)."""
    needs: set[str] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in param_names and not frozen(node):
                needs.add(node.name)
        elif node.op == "call_function" and node.target is not operator.getitem:
            # A detach, or a factory (``new_empty``, ``zeros_like``: the input gives only its
            # dtype and shape), cuts the gradient.
            if (node.target is torch.ops.aten.detach.default
                    or record_of(node.target).family == FACTORY):
                continue
            vals = flat_values(node)
            # Complex values carry gradients too (an rfft's output).
            floating = any(isinstance(v, torch.Tensor) and (v.dtype.is_floating_point
                                                            or v.dtype.is_complex) for v in vals)
            if floating and any(r[0] in needs for r in value_inputs(node)):
                needs.add(node.name)
    return needs


def traced_grads(traced: Any) -> frozenset[str]:
    """:func:`grad_values` of a traced model (trace/export.py TracedGraph) and its parameters,
    computed once and kept on it: its graph does not change after tracing, and every pricing
    asks (a walk of every node, each time); none where it is not traced for training."""
    kept = traced.__dict__.get(_GRADS)
    if kept is None:
        kept = frozenset(grad_values(traced.graph, {p.name for p in traced.params})
                         if traced.training else ())
        traced.__dict__[_GRADS] = kept
    return kept


_GRADS = "_autoshard_grad_values"        # where traced_grads keeps its answer


def carries_grad(graph_nodes: dict[str, fx.Node], grads: set[str], ref: ValueRef) -> bool:
    """Whether value ``ref`` has a gradient: its node is in ``grads`` and this output is
    floating-point (``topk``'s indices, beside its values, have none)."""
    if ref[0] not in grads:
        return False
    vals = flat_values(graph_nodes[ref[0]])
    v = vals[ref[1]] if ref[1] < len(vals) else None
    return not isinstance(v, torch.Tensor) or v.dtype.is_floating_point or v.dtype.is_complex


def passes_grad(graph_nodes: dict[str, fx.Node], grads: set[str], ref: ValueRef,
                consumer: str) -> bool:
    """Whether a gradient reaches ``ref`` through ``consumer``: the value has one and the
    consumer's output has one too (a factory reading only the input's dtype and shape, or a
    cast to integers, passes none back), or the consumer is the graph's output."""
    return carries_grad(graph_nodes, grads, ref) and (
        consumer in grads or graph_nodes[consumer].op == "output")


def no_backward(r: Reshard) -> Reshard:
    return Reshard(r.forward, ())


def input_divergence(strategy: Strategy, k: int) -> frozenset[int]:
    spec = strategy.inputs[k]
    outs = strategy.outputs
    axes = set()
    for out in outs:
        axes |= divergent_axes(spec, out)
    return frozenset(axes)


def output_requirement(ndim_mesh: int) -> Spec:
    return (Replicate(),) * ndim_mesh


def _requirements(graph: fx.Graph, strategies: dict[str, Strategy], grads: set[str],
                  mesh_ndim: int, training: bool
                  ) -> Iterator[tuple[ValueRef, Spec, frozenset[int], list[tuple[str, int]]]]:
    """Every (value, required spec, divergent axes, consumers) of the graph, values in the
    order they are first read, requirements in the order their first consumer reads them."""
    wants: dict[ValueRef, dict[tuple[Spec, frozenset[int]], list[tuple[str, int]]]] = {}
    order: list[ValueRef] = []
    nodes = {n.name: n for n in graph.nodes}
    for node in graph.nodes:
        if node.op == "output":
            if not training:
                continue
            for k, ref in enumerate(value_inputs(node)):
                key = (output_requirement(mesh_ndim), frozenset())
                wants.setdefault(ref, {}).setdefault(key, []).append((node.name, k))
            continue
        strat = strategies.get(node.name)
        if strat is None:
            continue
        for k, ref in enumerate(value_inputs(node)):
            if ref not in wants:
                order.append(ref)
            key = (strat.inputs[k], input_divergence(strat, k)
                   if passes_grad(nodes, grads, ref, node.name) else frozenset())
            wants.setdefault(ref, {}).setdefault(key, []).append((node.name, k))
    seen = set(order)
    order += [r for r in wants if r not in seen]
    for ref in order:
        for (dst, div), consumers in wants[ref].items():
            yield ref, dst, div, consumers


def direct_reads(graph: fx.Graph, strategies: dict[str, Strategy], param_names: set[str],
                 *, training: bool) -> dict[str, list[tuple[str, int]]]:
    """Each parameter's consumers that read it where it lies (its stored layout, no gradient to
    sum): the reads no reshard edge carries. Under parameter offload they share one copy to
    the device (codegen/rewrite.py), made at the first of them."""
    out: dict[str, list[tuple[str, int]]] = {}
    specs = {n: strategies[n].outputs[0] for n in param_names if n in strategies}
    if not specs:
        return out
    grads = grad_values(graph, param_names) if training else set()
    ndim = len(next(iter(specs.values())))
    for ref, dst, div, consumers in _requirements(graph, strategies, grads, ndim, training):
        if ref[0] in specs and ref[1] == 0 and not div and dst == specs[ref[0]]:
            out.setdefault(ref[0], []).extend(consumers)
    return out


def pinned_reshards(graph: fx.Graph, edges: Iterable[ReshardEdge]) -> list[ReshardEdge]:
    """The edges that reshard a read an in-place write pins (trace/aliases.py): on a rank the
    reshard's copy would take the write, or hold the value from before it, where one device
    has one storage. The solver prices them as forbidden; no plan that runs may hold one."""
    pinned = pinned_reads(graph)
    return [e for e in edges if any(c in pinned for c in e.consumers)] if pinned else []


def reshard_edges(graph: fx.Graph, strategies: dict[str, Strategy], mesh_shape: tuple[int, ...],
                  shapes: dict[ValueRef, tuple[tuple[int, ...], int]], param_names: set[str],
                  *, training: bool, joint: Groups = (),
                  grads: frozenset[str] | None = None) -> Iterator[ReshardEdge]:
    """Every (value, requirement) pair that needs steps, in graph order.

    ``shapes`` maps a value to (global shape, itemsize). The graph's output (the loss, in training)
    is required replicated. ``joint``: the plan's groups of axes whose collectives run as one
    (``Plan.joint_axes``, docs/cost-model.md §1.4). ``grads``: :func:`grad_values` of the
    graph, where the caller has them (:func:`traced_grads`).
    """
    if grads is None:
        grads = grad_values(graph, param_names) if training else set()
    nodes = {n.name: n for n in graph.nodes}
    for ref, dst, div, consumers in _requirements(graph, strategies, grads, len(mesh_shape),
                                                  training):
        src = strategies[ref[0]].outputs[ref[1]]
        if dst == src and not div:
            continue
        shape, itemsize = shapes[ref]
        r = reshard(src, dst, shape, itemsize, mesh_shape, div, joint)
        if not any(passes_grad(nodes, grads, ref, c) for c, _ in consumers):
            r = no_backward(r)
        yield ReshardEdge(ref, tuple(consumers), src, dst, div, r, ref[0] in param_names)
