"""The layers of a traced model: repeated blocks found by module path, and which are identical.

A node belongs to the layer its module path names (``model.layers.3.attn.q_proj`` is in layer
``model.layers.3``); a parameter or buffer placeholder by its FQN. Two layers of one container
are identical when their nodes, in order, have the same ops, argument structure, shapes and
wiring (an input from outside the layer is compared by its shape). Identical layers let the
planner take one decision for all of them, which is why a 96-layer model plans in little more
time than one layer.
"""
from __future__ import annotations

import operator
import re
from typing import Any

import torch.fx as fx

from autoshard.ir import Layer
from autoshard.trace.graph import output_infos, value_ref, value_shapes

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def layer_of(path: str) -> tuple[str, int] | None:
    """``model.layers.3.attn.q_proj`` -> ("model.layers", 3): the repeated-layer container."""
    m = _LAYER.match(path)
    return (m.group(1), int(m.group(2))) if m else None


def node_layer(node: fx.Node, fqns: dict[str, str], strip: str = "") -> tuple[str, int] | None:
    """The layer a node belongs to; ``fqns`` maps parameter and buffer placeholders to FQNs.
    ``strip``: the prefix a wrapper adds to module paths (parameter FQNs are the model's own)."""
    if node.op == "placeholder":
        return layer_of(fqns[node.name]) if node.name in fqns else None
    stack = node.meta.get("nn_module_stack")
    return layer_of(list(stack.values())[-1][0].removeprefix(strip)) if stack else None


def find_layers(graph: fx.Graph, fqns: dict[str, str], strip: str = "") -> tuple[Layer, ...]:
    """Every layer of the model in graph order, each with the first identical layer of its
    container. ``fqns`` maps parameter and buffer placeholders to their FQNs; ``strip`` is the
    prefix a wrapper adds to module paths. getitem nodes belong to their producer and are left
    out."""
    shapes = value_shapes(graph)
    found: dict[tuple[str, int], list[fx.Node]] = {}
    for n in graph.nodes:
        if n.op == "placeholder" or (n.op == "call_function" and not _is_getitem(n)):
            key = node_layer(n, fqns, strip)
            if key is not None:
                found.setdefault(key, []).append(n)
    firsts: dict[str, list[tuple[list, str]]] = {}
    layers = []
    for (container, index), nodes in found.items():
        name = f"{container}.{index}"
        sig = _signature(nodes, fqns, shapes)
        same = next((n for s, n in firsts.get(container, []) if s == sig), None)
        if same is None:
            firsts.setdefault(container, []).append((sig, name))
        layers.append(Layer(name, tuple(n.name for n in nodes), same or name))
    return tuple(layers)


def _is_getitem(n: fx.Node) -> bool:
    return n.target is operator.getitem


def _signature(nodes: list[fx.Node], fqns: dict[str, str], shapes: dict) -> list[Any]:
    pos = {n.name: i for i, n in enumerate(nodes)}
    sig: list[Any] = []
    for n in nodes:
        outs = [(t.shape, t.dtype) for t in output_infos(n)]
        if n.op == "placeholder":
            fqn = fqns[n.name]
            lk = layer_of(fqn)
            sig.append(("ph", fqn[len(f"{lk[0]}.{lk[1]}"):], outs))
            continue

        def arg(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            src, i = value_ref(a)
            return ("in", pos[src], i) if src in pos else ("out", shapes.get((src, i)))

        sig.append((str(n.target), repr(fx.node.map_aggregate((n.args, n.kwargs), arg)), outs))
    return sig


def checkpointable(graph: fx.Graph, layers: tuple[Layer, ...]) -> tuple[str, ...]:
    """The layers that can be checkpointed as one region of the program: those that repeat
    (a group of identical layers, where recomputing one at a time saves memory) and whose ops
    come one after another in the graph, no other op between them."""
    group: dict[str, int] = {}
    for layer in layers:
        group[layer.same_as] = group.get(layer.same_as, 0) + 1
    ops = [n.name for n in graph.nodes if n.op == "call_function" and not _is_getitem(n)]
    where = {name: i for i, name in enumerate(ops)}
    out = []
    for layer in layers:
        idx = sorted(where[n] for n in layer.nodes if n in where)
        if group[layer.same_as] > 1 and idx and idx[-1] - idx[0] + 1 == len(idx):
            out.append(layer.name)
    return tuple(out)


def regroup(layers: tuple[Layer, ...], policies: dict[str, str]) -> tuple[Layer, ...]:
    """``layers`` with identical layers grouped apart by their checkpointing policy (``policies``:
    layer name -> policy; absent means none): the first k of 32 identical layers recomputed and
    the rest not are two groups, each with its own template in the ILP, since one shared decision
    cannot carry two prices. The same layers when every group has one policy."""
    firsts: dict[tuple[str, str | None], str] = {}
    out = []
    for layer in layers:
        key = (layer.same_as, policies.get(layer.name))
        first = firsts.setdefault(key, layer.name)
        out.append(layer if first == layer.same_as else Layer(layer.name, layer.nodes, first))
    return tuple(out)


def stages_of(graph: fx.Graph, layers: tuple[Layer, ...],
              stage_layers: tuple[tuple[str, ...], ...]) -> dict[str, int]:
    """The pipeline stage of every node of ``graph`` (docs/cost-model.md §10): a layer's ops go
    with their layer's stage; an op outside every layer with the stage of the last layer before
    it (the first stage before the first layer: embeddings; the last after the last layer: the
    head and the loss); a placeholder (parameter, buffer, input) with the first op reading it."""
    stage_of_layer = {name: i for i, names in enumerate(stage_layers) for name in names}
    layer_of_node = {n: layer.name for layer in layers for n in layer.nodes}
    out: dict[str, int] = {}
    current = 0
    for n in graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        layer = layer_of_node.get(n.name)
        if layer in stage_of_layer:
            current = stage_of_layer[layer]
        out[n.name] = current
    for n in graph.nodes:
        if n.op == "placeholder":
            out[n.name] = min((out[u.name] for u in n.users if u.name in out), default=0)
    return out
