"""What each linear of a repeated block does, read off the graph rather than off parameter names.

Megatron-LM's tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053, §3) splits every
transformer block into pairs: the linears that read the block's (normalised) input are
*column*-parallel, their outputs sharded through attention or the activation; the linear whose
output is added back into the residual stream is *row*-parallel, its partial sums reduced once.
The pair is a property of the dataflow, so it is found here from the graph of each layer
(``trace/layers.py``), whatever the modules are called: a fused ``qkv_proj`` or
``query_key_value`` is one column-parallel linear, ``dense_4h_to_h`` a row-parallel one.

Inside one layer, a *linear* is a matmul-like op whose weight is a 2-D parameter
(``aten.linear``, ``addmm``/``mm`` of Hugging Face's Conv1D, ``matmul`` with a transposed
weight as Falcon writes it). Then:

- the *residual stream* is the layer's input that reaches one of its outputs through no linear
  (same shape as that output), and every value computed from it through no linear;
- a *residual add* adds a value on the stream to one that is not, computed from linears; the
  linears that reach that other operand through no other linear are **row**-parallel (attention
  out-proj, MLP down: several branches may meet before the add, as GPT-NeoX's and Falcon's
  parallel attention and MLP do);
- a linear whose output reaches a row-parallel linear through no other linear, and whose own
  input comes from the stream (through norms and views) or from outside the layer (the encoder
  output a cross-attention reads) rather than from another linear, is **column**-parallel (Q, K,
  V or a fused QKV, fc1, gate and up or a fused gate_up).

Everything else has no role: a linear outside every layer, in a layer without a residual add
(a plain MLP stack), or one the rules place both ways.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.fx as fx

from autoshard.ir import Layer

aten = torch.ops.aten
COLUMN, ROW = "column", "row"

# Ops a weight may pass through on its way into a matmul: a layout change or a cast.
_WEIGHT_VIEWS = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default,
                 aten.view.default, aten.reshape.default, aten.alias.default,
                 aten._to_copy.default, aten.to.dtype, aten.contiguous.default}
_ADDS = {aten.add.Tensor, aten.add_.Tensor}


@dataclass(frozen=True, slots=True)
class Linear:
    """One matmul-like op with a parameter weight, and its Megatron role (None: the graph does
    not say)."""

    node: str               # the op's node
    weight: str             # the weight's placeholder
    bias: str | None        # the bias's placeholder, if the op (or an add right after it) has one
    layer: str | None       # the layer holding the op; None outside every layer
    role: str | None        # COLUMN, ROW or None


def block_linears(graph: fx.Graph, layers: Iterable[Layer], params: set[str]) -> tuple[Linear, ...]:
    """Every linear of ``graph`` in graph order with its role; ``params`` names the parameter
    placeholders (a weight must be one)."""
    nodes = {n.name: n for n in graph.nodes}
    layer_of = {name: layer.name for layer in layers for name in layer.nodes}
    index = {n: i for i, n in enumerate(graph.nodes)}
    roles: dict[str, str | None] = {}
    for layer in layers:
        roles.update(_layer_roles({nodes[name] for name in layer.nodes}, params, index))
    out = []
    for n in graph.nodes:
        parts = _linear_parts(n, params)
        if parts is not None:
            weight, bias, _ = parts
            out.append(Linear(n.name, weight, bias, layer_of.get(n.name), roles.get(n.name)))
    return tuple(out)


def _linear_parts(n: fx.Node, params: set[str]) -> tuple[str, str | None, fx.Node] | None:
    """(weight placeholder, bias placeholder or None, activation input) of a linear; None for
    any other node, a matmul of two activations (attention scores) included."""
    if n.op != "call_function":
        return None
    if n.target is aten.linear.default:
        act, w, b = n.args[0], n.args[1], n.args[2] if len(n.args) > 2 else n.kwargs.get("bias")
    elif n.target is aten.addmm.default:
        b, act, w = n.args[:3]
    elif n.target in (aten.mm.default, aten.matmul.default):
        act, w = n.args[:2]
        b = _bias_added_after(n, params)
    else:
        return None
    weight = _param_through_views(w, params)
    if weight is None or not isinstance(act, fx.Node):
        return None
    bias = b.name if isinstance(b, fx.Node) and b.name in params else None
    return weight, bias, act


def _param_through_views(node: object, params: set[str]) -> str | None:
    """The 2-D parameter ``node`` is, after layout changes and casts (Falcon: ``x @ w.T``)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in _WEIGHT_VIEWS:
        node = node.args[0]
    if not isinstance(node, fx.Node) or node.name not in params:
        return None
    val = node.meta.get("val")
    return node.name if isinstance(val, torch.Tensor) and val.ndim == 2 else None


def _bias_added_after(n: fx.Node, params: set[str]) -> fx.Node | None:
    """The 1-D parameter added to a matmul's output by the op that alone reads it (Falcon's
    ``x @ w.T + b``)."""
    if len(n.users) != 1:
        return None
    user = next(iter(n.users))
    if user.target not in _ADDS:
        return None
    other = next((a for a in user.args[:2] if isinstance(a, fx.Node) and a is not n), None)
    if other is None or other.name not in params:
        return None
    val = other.meta.get("val")
    return other if isinstance(val, torch.Tensor) and val.ndim == 1 else None


def _layer_roles(members: set[fx.Node], params: set[str],
                 index: dict[fx.Node, int]) -> dict[str, str | None]:
    """The role of every linear of one layer (``members``: its nodes; ``index``: every node's
    position in the graph), as the module docstring defines it."""
    members = members | {u for n in members for u in n.users if u.target is operator.getitem}
    acts = {n: parts[2] for n in members if (parts := _linear_parts(n, params)) is not None}
    linears = set(acts)
    stream = _stream_inputs(members, linears, params)
    on_stream = _on_stream(sorted(members, key=index.__getitem__), linears, stream)

    def streamed(n: fx.Node) -> bool:
        return n in stream or n in on_stream

    rows: set[fx.Node] = set()
    for n in members:
        if n.target in _ADDS:
            operands = [a for a in n.args[:2] if isinstance(a, fx.Node)]
            if len(operands) == 2 and streamed(operands[0]) != streamed(operands[1]):
                branch = operands[1] if streamed(operands[0]) else operands[0]
                rows |= _sources(branch, members, linears, streamed) & linears
    feeders = {m for r in rows for m in _sources(acts[r], members, linears, streamed) & linears}
    roles: dict[str, str | None] = {}
    for m in linears:
        reads_stream = not (_sources(acts[m], members, linears, streamed) & linears)
        if m in rows:
            roles[m.name] = None if m in feeders else ROW
        else:
            roles[m.name] = COLUMN if m in feeders and reads_stream else None
    return roles


def _sources(start: fx.Node, members: set[fx.Node], linears: set[fx.Node],
             stop: Callable[[fx.Node], bool]) -> set[fx.Node]:
    """What ``start`` is computed from through no linear: the linears, the nodes outside the
    layer and the nodes ``stop`` accepts that a walk back from ``start`` meets first."""
    seen: set[fx.Node] = set()
    found: set[fx.Node] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in linears or n not in members or stop(n):
            found.add(n)
        else:
            todo.extend(n.all_input_nodes)
    return found


def _stream_inputs(members: set[fx.Node], linears: set[fx.Node],
                   params: set[str]) -> set[fx.Node]:
    """The layer's inputs that reach an output of the layer through no linear and have its
    shape: the residual stream coming in (not masks, rotary tables or position biases)."""
    outputs = [n for n in members if n.op == "call_function"
               and any(u not in members for u in n.users)]
    found: set[fx.Node] = set()
    for out in outputs:
        shape = _shape(out)
        for n in _sources(out, members, linears, lambda _: False):
            if (n not in members and n.name not in params and shape is not None
                    and _shape(n) == shape):
                found.add(n)
    return found


def _on_stream(ordered: list[fx.Node], linears: set[fx.Node],
               stream: set[fx.Node]) -> set[fx.Node]:
    """The layer's nodes (``ordered``: in graph order) computed from the incoming stream through
    no linear (norms, residual adds, views), in one pass."""
    found: set[fx.Node] = set()
    for n in ordered:
        if n not in linears and any(a in stream or a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _shape(n: fx.Node) -> tuple[int, ...] | None:
    val = n.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None
