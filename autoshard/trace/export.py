"""Capture a model as an ATen-level FX graph with torch.export (non-strict), shapes on every node.

The model may live on the meta device: export runs on fake tensors, so planning a 70B model
allocates no weights. We keep export's training IR (``aten.linear``, ``aten.layer_norm``,
``aten.scaled_dot_product_attention`` stay whole): fewer, larger ops give the planner fewer
decisions, and every one of them is differentiable, so the per-rank program trains under autograd.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import itertools
import operator
import os
import re
import sys
import traceback
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autoshard.errors import AutoshardError
from autoshard.ir import Layer, OpInfo, TensorInfo
from autoshard.ir import op_info as make_op_info
from autoshard.ops.moe import LOOPING_EXPERTS, register_library_ops
from autoshard.trace.fused import GROUPS, mark_fused_dims, marked_info
from autoshard.trace.graph import output_infos, tensor_info, value_ref, value_shapes
from autoshard.trace.layers import find_layers
from autoshard.trace.repeat import (Repeat, Specs, expand, repeated_layers, same_graph, shortened,
                                    signature_of)
from autoshard.trace.sequence import mark_sequence_dims


@dataclass(frozen=True, slots=True)
class Placeholder:
    name: str          # graph placeholder name
    kind: str          # "param" | "buffer" | "constant" | "input"
    fqn: str           # parameter/buffer FQN, or "input<i>"
    info: TensorInfo | None


@dataclass
class TracedGraph:
    """A traced model: the flat graph module plus what planning and codegen need about it.

    Its graph is not changed after tracing (a pass that needs another graph builds one): what is
    read off it once is kept, on the instance (:attr:`value_shapes`, cost/reshards.py
    ``traced_grads``)."""

    gm: fx.GraphModule
    placeholders: list[Placeholder]
    training: bool
    fingerprint: str
    node_sigs: dict[str, str] = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)  # placeholder -> value
    layers: tuple[Layer, ...] = ()
    # What a wrapper (autoshard's loss wrapper) adds to module paths: "model." or "".
    module_prefix: str = ""
    # The prefix of the layers exported, the others written as copies (trace/repeat.py).
    repeat: Repeat | None = None

    @property
    def graph(self) -> fx.Graph:
        return self.gm.graph

    @functools.cached_property
    def value_shapes(self) -> dict[tuple[str, int], tuple[tuple[int, ...], int]]:
        """(global shape, itemsize) of every value of the graph (trace/graph.py
        ``value_shapes``), read once: the graph does not change after tracing, and every
        pricing of a plan reads them (a walk of every node, each time)."""
        return value_shapes(self.graph)

    @property
    def copied_layers(self) -> int:
        """Layers written as copies of exported ones rather than exported."""
        return 0 if self.repeat is None else self.repeat.count - self.repeat.prefix

    def placeholder(self, name: str) -> Placeholder:
        return self._by_name[name]

    def __post_init__(self) -> None:
        self._by_name = {p.name: p for p in self.placeholders}
        self.layer_of_node = {n: layer.name for layer in self.layers for n in layer.nodes}

    def module_of(self, node: fx.Node) -> str:
        """The model's own module path of a node ("" at the model's top level)."""
        path = module_path(node)
        return "" if path == self.module_prefix.rstrip(".") else path.removeprefix(
            self.module_prefix)

    @property
    def params(self) -> list[Placeholder]:
        return [p for p in self.placeholders if p.kind == "param"]

    @property
    def inputs(self) -> list[Placeholder]:
        return [p for p in self.placeholders if p.kind == "input"]


# node.meta key of op_info's memo: (what it was computed from, the OpInfo).
_INFO_KEY = "_autoshard_op_info"


def op_info(node: fx.Node) -> OpInfo:
    """The rule's view of a call_function node: tensors replaced by their shapes and dtypes.

    Computed once per node and kept in its meta: every Pricer (one per ILP built, per plan
    assembled, per memory estimate) asks for every node's, and converting the arguments cost
    more than the pricing in a profile of Mamba-2 2.7B's planning on 8x8. The memo holds the
    objects it was computed from (the node's arguments, its value and its inputs' values and
    dim marks) and is used only while each is still the same object, so a rewritten node is
    computed again."""
    basis = _info_basis(node)
    memo = node.meta.get(_INFO_KEY)
    if memo is not None and len(memo[0]) == len(basis) and \
            all(a is b for a, b in zip(memo[0], basis)):
        return memo[1]
    info = _op_info(node)
    node.meta[_INFO_KEY] = (basis, info)
    return info


def _info_basis(node: fx.Node) -> tuple:
    """The objects :func:`_op_info` reads, in a fixed order."""
    out: list[Any] = [node.target, node.args, node.kwargs, node.meta.get("val"),
                      node.meta.get(GROUPS), node.meta.get("stack_trace")]
    for a in node.all_input_nodes:
        src = a if value_ref(a)[0] == a.name else a.args[0]
        out += [a, a.meta.get("val"), src, src.meta.get(GROUPS)]
    return tuple(out)


def _op_info(node: fx.Node) -> OpInfo:
    def val(a: fx.Node) -> Any:
        v = a.meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise AutoshardError(
                "a model whose ops take tensors, not numbers read off tensors",
                got=f"{node.name} ({node.target}) reads {a.name}, a {type(v).__name__} "
                    f"({source_line(node) or 'no source line'})",
                fix="compute that number from shapes, or keep it a tensor (torch.where, "
                    "masking) instead of .item() or int(t)")
        name, out = value_ref(a)
        src = a if name == a.name else a.args[0]        # a getitem reads its producer's output
        return marked_info(src, out) if GROUPS in src.meta else v

    args, kwargs = fx.node.map_arg((node.args, node.kwargs), val)
    info = make_op_info(node.target, args, kwargs, node.meta.get("val"), source_line(node))
    if GROUPS in node.meta:
        outs = tuple(marked_info(node, i) for i in range(len(info.outputs)))
        info = dataclasses.replace(info, outputs=outs)
    return info


def source_line(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace") or ""
    lines = [l.strip() for l in trace.strip().splitlines()]
    files = [i for i, l in enumerate(lines) if l.startswith("File ")]
    if not files:
        return ""
    i = files[-1]
    code = lines[i + 1] if i + 1 < len(lines) else ""
    return f"{lines[i]}: {code}".strip()


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def trace(model: torch.nn.Module, example_inputs: Sequence[Any], *, training: bool = True,
          whole: bool = False) -> TracedGraph:
    """Export ``model(*example_inputs)`` to a flat ATen graph.

    For training the model must return a scalar loss (wrap it with :func:`autoshard.with_loss`,
    or pass a Hugging Face model whose output has ``.loss``). Repeated layers are exported one
    instance per kind and copied (trace/repeat.py); ``whole``: export every layer.
    """
    if not isinstance(model, torch.nn.Module):
        raise AutoshardError("model is a torch.nn.Module", got=type(model).__name__,
                             fix="pass the nn.Module itself")
    example_inputs = _meta_like_model(model, _checked_inputs(example_inputs))
    whole = whole or os.environ.get("AUTOSHARD_TRACE_WHOLE", "0") == "1"
    key = reusable(model, example_inputs, training) \
        if os.environ.get("AUTOSHARD_TRACE_REUSE", "1") != "0" else None
    key = key and (key, whole)
    if key is not None and key in _TRACED:
        _TRACED.move_to_end(key)
        return _TRACED[key]
    traced = _trace(model, example_inputs, training, whole)
    # A constant is a tensor read from this instance (not a parameter or buffer the program
    # binds at run time): a graph that holds one is this instance's alone.
    if key is not None and not traced.constants:
        _TRACED[key] = traced
        while len(_TRACED) > _TRACED_KEPT:
            _TRACED.popitem(last=False)
    return traced


# Graphs of zoo-built models, by :func:`reusable`'s key: the tests and ``verify`` build the same
# tiny models again and again in long-lived processes, and exporting one costs seconds there.
# ``AUTOSHARD_TRACE_REUSE=0`` traces every time (the benchmarks set it: their planning times
# include tracing).
_TRACED: collections.OrderedDict = collections.OrderedDict()
_TRACED_KEPT = 8


def reusable(model: torch.nn.Module, inputs: tuple, training: bool) -> tuple | None:
    """The key under which ``model``'s graph may be reused, or None. Only for a model the zoo
    built (``zoo/registry.py`` ``mark_built``: same recipe, same code), and only where everything
    the graph can depend on is equal: the module tree as printed, every parameter's and
    buffer's name, shape, dtype, device and ``requires_grad``, every module's mode, every
    config, the methods replaced, the inputs' shapes and dtypes, and training or not."""
    recipe = getattr(model, "_autoshard_recipe", None)
    if recipe is None:
        return None
    params = tuple((n, tuple(p.shape), p.dtype, p.device.type, p.requires_grad)
                   for n, p in model.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), b.dtype, b.device.type)
                    for n, b in model.named_buffers(remove_duplicate=False))
    # Every config in the tree (a wrapper's model's too), its private fields included
    # (transformers keeps the experts and attention implementations there), and the methods an
    # instance replaces (zoo/hf.py's one-op experts and scans: forward, JetMoE's map and
    # reduce, RecurrentGemma's _rnn_scan)
    configs = {id(c): c for m in model.modules()
               if (c := getattr(m, "config", None)) is not None}
    config = tuple(sorted(repr(sorted((k, repr(v)) for k, v in vars(c).items()))
                          if hasattr(c, "__dict__") else repr(c) for c in configs.values()))
    methods = tuple((n, k) for n, m in model.named_modules() for k, v in vars(m).items()
                    if isinstance(v, types.MethodType))
    ins = tuple((tuple(t.shape), t.dtype, t.device.type) if isinstance(t, torch.Tensor)
                else repr(t) for t in torch.utils._pytree.tree_leaves(inputs))
    return (recipe, repr(model), params, buffers, tuple(m.training for m in model.modules()),
            config, methods, ins, training)


def _trace(model: torch.nn.Module, example_inputs: tuple, training: bool,
           whole: bool = False) -> TracedGraph:
    from autoshard.loss import as_loss_module

    wrapped = as_loss_module(model) if training else model
    # Our own loss wrapper holds the model as ``model``: report the model's own names. A tied
    # parameter may be lifted under any of its names; use the one named_parameters() gives.
    strip = "model." if wrapped is not model else ""
    repeat = None if whole else repeated_layers(model)
    if repeat is not None:
        traced = _trace_repeated(model, wrapped, example_inputs, training, strip, repeat)
        if traced is not None:
            return traced
    try:
        with _sets_in_fixed_order(model):
            ep = torch.export.export(wrapped, example_inputs, strict=False)
    except Exception as e:  # export's own errors are long: name the likely cause and its fix
        raise _export_failure(e, model, example_inputs, training) from e
    try:
        return from_exported(ep, training=training, strip=strip,
                             aliases=parameter_aliases(model))
    except GuardOnDataDependentSymNode as e:    # a shape that depends on values, as of x[mask]
        raise _export_failure(e, model, example_inputs, training) from e


def _trace_repeated(model: torch.nn.Module, wrapped: torch.nn.Module, example_inputs: tuple,
                    training: bool, strip: str, repeat: Repeat) -> TracedGraph | None:
    """The graph exported with only a prefix of the layers and the rest copied, or None where
    the prefix does not stand for them (trace/repeat.py): then the caller exports them all, and
    a mistake in the model is reported by that export."""
    def exported(count: int) -> ExportedProgram:
        with shortened(model, repeat.container, count), _sets_in_fixed_order(model):
            return torch.export.export(wrapped, example_inputs, strict=False)
    try:
        ep, proof = exported(repeat.prefix), exported(repeat.proof)
    except Exception:   # noqa: BLE001 - the whole model's export reports the model's mistake
        return None
    try:
        short, long = sorted((ep, proof), key=lambda e: len(e.graph.nodes))
        copied = expand(short.graph_module, signature_of(short),
                        repeat.cut(min(repeat.prefix, repeat.proof),
                                   max(repeat.prefix, repeat.proof)), strip)
        if copied is None or not same_graph(copied, (long.graph_module, signature_of(long))):
            return None
        expanded = expand(ep.graph_module, signature_of(ep), repeat, strip)
        if expanded is None:
            return None
        traced = from_exported(ep, training=training, strip=strip,
                               aliases=parameter_aliases(model), gm=expanded[0],
                               specs=expanded[1])
    except AutoshardError:   # the model's own mistake: the whole model's export reports it
        return None
    except Exception as e:   # noqa: BLE001 - a fault of the copier's own: said, not hidden
        warnings.warn(f"autoshard: copying the exported layers of {type(model).__name__} failed "
                      f"({type(e).__name__}: {e}); every layer is exported instead, which is "
                      f"slower but gives the same graph. Please report this.", stacklevel=2)
        return None
    traced.repeat = repeat
    return traced


class _FixedOrderSet(set):
    """A set that iterates in one order in every process (by ``repr``). Python orders a set of
    strings by their hashes, which differ between processes (``PYTHONHASHSEED``); a model that
    iterates one in forward (transformers' Gemma-3 and Llama-4 compute one rotary table per
    ``set(config.layer_types)``) would trace a different graph in each process, and a plan made
    in one would fail its fingerprint in another, or in another rank."""

    def __iter__(self):
        return iter(sorted(super().__iter__(), key=repr))


@contextlib.contextmanager
def _sets_in_fixed_order(model: torch.nn.Module):
    """While tracing, ``set(...)`` in the model's own source modules (not torch's) builds a
    :class:`_FixedOrderSet`; set literals and comprehensions are untouched."""
    names = {type(m).__module__ for m in model.modules()}
    modules = [sys.modules[n] for n in names
               if n in sys.modules and not n.startswith("torch.") and n != "builtins"
               and "set" not in vars(sys.modules[n])]
    for module in modules:
        module.set = _FixedOrderSet
    try:
        yield
    finally:
        for module in modules:
            vars(module).pop("set", None)


def _meta_like_model(model: torch.nn.Module, inputs: tuple) -> tuple:
    """A model on the meta device traced with a real batch: only the batch's shapes and dtypes
    matter to the graph, so trace with meta tensors of them (a real tensor beside meta weights
    would fail in the first op that reads both)."""
    tensors = itertools.chain(model.parameters(), model.buffers())
    if not any(t.device.type == "meta" for t in tensors):
        return inputs
    return tuple(torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t
                 for t in inputs)


_DICT_INPUTS_FIX = ("pass a tuple of tensors in the order of forward's parameters, e.g. "
                    "(input_ids, labels); for a forward that takes keywords, wrap the model in "
                    "a module whose forward takes them positionally")


def _checked_inputs(example_inputs: Any) -> tuple:
    """The example inputs as a tuple, refusing what tuple() would silently get wrong (a dict
    gives its keys, a tensor its rows) and inputs with nothing in them."""
    if isinstance(example_inputs, Mapping):
        raise AutoshardError("example_inputs is a tuple of forward's positional inputs",
                             got=f"a {type(example_inputs).__name__} with keys "
                                 f"{list(example_inputs)[:5]}", fix=_DICT_INPUTS_FIX)
    if not isinstance(example_inputs, (tuple, list)):
        raise AutoshardError("example_inputs is a tuple of forward's positional inputs",
                             got=f"a {type(example_inputs).__name__}",
                             fix="wrap a single input in a tuple: (x,)")
    leaves = torch.utils._pytree.tree_leaves(tuple(example_inputs))
    for i, t in enumerate(x for x in leaves if isinstance(x, torch.Tensor)):
        if 0 in t.shape:    # export and planning would go through, planning nothing
            raise AutoshardError("example inputs without a dimension of size 0",
                                 got=f"input{i} of shape {list(t.shape)}",
                                 fix="use a batch of at least 1 (--batch) and non-empty dims")
    return tuple(example_inputs)


def _export_failure(e: Exception, model: torch.nn.Module, inputs: tuple,
                    training: bool) -> AutoshardError:
    """The AutoshardError for a failed export, with the fix for its likely cause."""
    text = str(e)
    cause = _likely_cause(e, text, model, inputs, training)
    if isinstance(e, AutoshardError):   # raised by our loss wrappers while export ran forward
        expected, fix = cause or (e.expected, e.fix)
        return AutoshardError(expected, got=e.got, fix=fix)
    expected, fix = cause or ("a model that torch.export can capture (non-strict)",
                              "make forward traceable by torch.export.export(model, inputs, "
                              "strict=False)")
    where = _model_line(e)
    return AutoshardError(expected, got=f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"
                          + (f" (at {where})" if where else ""),
                          fix=f"{fix}; the full export error is chained below")


def _model_line(e: Exception) -> str | None:
    """Where in the model's own code (neither torch's nor autoshard's) the export failed:
    "file:line: source" of the innermost such frame."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
            os.path.dirname(os.__file__))
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(skip)]
    if not frames:
        return None
    f = frames[-1]
    return f"{os.path.basename(f.filename)}:{f.lineno}: {(f.line or '').strip()}"



def _likely_cause(e: Exception, text: str, model: torch.nn.Module, inputs: tuple,
                  training: bool) -> tuple[str, str] | None:
    """(what export needed, how to give it), told from the exception's type and message; None
    when no common cause fits. Order matters: a dict output also reads "loss=NoneType"."""
    if isinstance(e, TypeError) and re.search(r"\bforward\(\) (takes|missing|got)", text):
        return ("example inputs that match the parameters of forward",
                f"pass one example input per parameter of {type(model).__name__}.forward"
                f"{_signature(model)}, in order (for training, the target last)")
    if any(isinstance(x, Mapping) for x in inputs):
        return "example inputs that are tensors, not dicts", _DICT_INPUTS_FIX
    # Our loss wrapper's refusal (autoshard/loss.py) names the type of the output it got.
    if training and re.search(r"\bgot (dict|tuple|list) with loss=", text):
        return ("for training, a forward that returns one scalar loss",
                "wrap the model: autoshard.with_loss(model, loss_fn), with a loss_fn that picks "
                "the logits out of the output, or plan forward only with training=False "
                "(--inference)")
    if training and (any(x is None for x in inputs) or re.search(r"\btarget\b", text)):
        return ("for training, example inputs that end with the target (labels)",
                "pass the target tensor as the last example input (a Hugging Face model "
                "computes .loss only when given labels), or plan forward only with "
                "training=False (--inference)")
    data_dependent = isinstance(e, GuardOnDataDependentSymNode) or "data-dependent" in text
    experts = _looping_experts(model)
    # (Switch's router fails first: it assigns its classifier module again in forward.)
    if experts is not None and (data_dependent or "Couldn't swap" in text):
        return ("a model whose experts a trace can follow",
                f"{experts} groups the tokens by expert with counts read off the device "
                "(nonzero, tolist), which export cannot follow: "
                "call autoshard.zoo.hf.route_experts_as_one_op(model) on the transformers "
                "model first (from_config and config.json paths do), which runs them as one op")
    if data_dependent and training and "layerdrop" in (_model_line(e) or "").lower():
        return ("a model without LayerDrop while training: it skips whole layers at random, "
                "which one traced program cannot",
                "set the config's layerdrop fields (encoder_layerdrop, decoder_layerdrop or "
                "layerdrop) to 0, or plan forward only with training=False (--inference)")
    if data_dependent:
        return ("a forward whose control flow and shapes do not depend on tensor values",
                "replace branches on values (if x.sum() > 0) with torch.where, and value-sized "
                "results (int(t), x[mask], nonzero) with fixed shapes")
    if "cache" in text.lower():
        return ("a model that torch.export can capture (non-strict)",
                "turn off caches (use_cache=False)")
    return None


def _looping_experts(model: torch.nn.Module) -> str | None:
    """The class of transformers' experts in ``model`` that group the tokens by counts read off
    the device (DBRX's and Switch Transformers' loops over ``nonzero``, JetMoE's router's
    ``tolist``), where zoo/hf.py ``route_experts_as_one_op`` has not made them one op (it sets
    their ``forward``)."""
    for m in model.modules():
        name = type(m).__name__
        if name in LOOPING_EXPERTS and "forward" not in vars(m):
            return name
    return None


def _signature(model: torch.nn.Module) -> str:
    try:
        return str(inspect.signature(model.forward))
    except (TypeError, ValueError):    # a forward without a Python signature
        return "(...)"


# Export's runtime checks of values read off tensors (``assert lengths.max().item() <= slen`` in
# XLM becomes ``item``, ``le``, ``_assert_scalar``).
VALUE_ASSERTIONS = (torch.ops.aten._assert_scalar.default,)


def drop_value_assertions(gm: fx.GraphModule) -> None:
    """Drop the checks a model makes of values read off its tensors (above), and what computes
    only them: they change no value, and a rank holding part of a tensor could not evaluate
    them (the maximum of its share is not the maximum). The model's own run checks its data."""
    dropped = False
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in VALUE_ASSERTIONS:
            gm.graph.erase_node(node)
            dropped = True
    if dropped:
        gm.graph.eliminate_dead_code()
        gm.recompile()


def inline_subgraphs(gm: fx.GraphModule) -> None:
    """Inline higher-order ``wrap_with_set_grad_enabled`` regions (Hugging Face computes rotary
    tables under ``torch.no_grad``). Inlined, their ops get shapes and rules like any other;
    the grad mode does not change values, and nothing in them needs a gradient."""
    from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wrap_with_set_grad_enabled:
            continue
        sub = getattr(gm, node.args[1].target)
        env: dict[fx.Node, Any] = {}
        ph = iter(node.args[2:])
        with gm.graph.inserting_before(node):
            for sn in sub.graph.nodes:
                if sn.op == "placeholder":
                    env[sn] = next(ph)
                elif sn.op == "output":
                    result = fx.node.map_arg(sn.args[0], lambda a: env[a])
                else:
                    env[sn] = gm.graph.node_copy(sn, lambda a: env[a])
        for user in list(node.users):
            if user.target is operator.getitem and isinstance(result, (tuple, list)):
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
        if isinstance(result, fx.Node):
            node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    gm.recompile()


def parameter_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Every name of a (tied) parameter -> the one ``named_parameters()`` gives it."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return {n: canonical[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}


def from_exported(ep: ExportedProgram, *, training: bool, strip: str = "",
                  aliases: dict[str, str] | None = None,
                  gm: fx.GraphModule | None = None,
                  specs: Specs | None = None) -> TracedGraph:
    """``ep``'s graph (or ``gm``, a graph of the same signature: trace/batches.py; or of the
    signature ``specs``, placeholder -> (kind, target): trace/repeat.py) as a
    :class:`TracedGraph`."""
    gm = ep.graph_module if gm is None else gm
    drop_value_assertions(gm)
    inline_subgraphs(gm)
    register_library_ops()      # ops a library defined after autoshard was imported
    kinds = {InputKind.PARAMETER: "param", InputKind.BUFFER: "buffer",
             InputKind.CONSTANT_TENSOR: "constant", InputKind.USER_INPUT: "input"}
    specs = signature_of(ep) if specs is None else specs
    placeholders: list[Placeholder] = []
    constants: dict[str, torch.Tensor] = {}
    n_in = 0
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        spec_kind, target = specs[node.name]
        kind = kinds.get(spec_kind, "constant")
        if kind == "input":
            fqn, n_in = f"input{n_in}", n_in + 1
        else:
            fqn = target.removeprefix(strip)
            fqn = (aliases or {}).get(fqn, fqn)
        if kind == "constant":
            constants[node.name] = ep.constants[target]
        placeholders.append(Placeholder(node.name, kind, fqn, tensor_info(node.meta.get("val"))))
    mark_fused_dims(gm, {p.name for p in placeholders if p.kind == "param"})
    mark_sequence_dims(gm)
    nodes = {n.name: n for n in gm.graph.nodes}
    placeholders = [dataclasses.replace(p, info=marked_info(nodes[p.name]))
                    if p.info is not None and GROUPS in nodes[p.name].meta else p
                    for p in placeholders]
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [tensor_info(a.meta.get("val")) for a in torch.utils._pytree.tree_flatten(out_node.args)[0]
            if isinstance(a, fx.Node)]
    outs = [o for o in outs if o is not None]
    if training and not (len(outs) == 1 and outs[0].ndim == 0 and outs[0].dtype.is_floating_point):
        raise AutoshardError("for training, the model returns one scalar floating-point loss",
                             got=f"outputs {[(list(o.shape), str(o.dtype)) for o in outs]}",
                             fix="pass the target (labels) as the last example input if forward "
                                 "computes the loss from it, else wrap it: autoshard.with_loss("
                                 "model, loss_fn); or plan forward only with training=False "
                                 "(--inference)")
    sigs = node_signatures(gm.graph)
    digest = hashlib.sha256("\n".join(f"{k} {v}" for k, v in sigs.items()).encode()).hexdigest()
    fqns = {p.name: p.fqn for p in placeholders if p.kind in ("param", "buffer")}
    return TracedGraph(gm, placeholders, training, digest[:32], sigs, constants,
                       find_layers(gm.graph, fqns, strip), strip)


def node_signatures(graph: fx.Graph) -> dict[str, str]:
    """One line per node: op, target, argument structure and output shapes (the fingerprint's
    input; also what a stale plan is diffed against)."""
    sigs: dict[str, str] = {}
    for node in graph.nodes:
        # Devices are where a graph was traced (meta for planning), not part of the model.
        args = fx.node.map_aggregate(
            (node.args, node.kwargs),
            lambda a: f"%{a.name}" if isinstance(a, fx.Node) else "<device>"
            if isinstance(a, torch.device) else a)
        shapes = [(list(t.shape), str(t.dtype).removeprefix("torch.")) for t in output_infos(node)]
        sigs[node.name] = f"{node.op} {_target_name(node)} {args} {shapes}"
    return sigs


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, str):
        return t
    return str(t) if isinstance(t, torch._ops.OpOverload) else getattr(t, "__name__", str(t))
