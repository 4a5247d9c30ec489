"""Trace one instance of each kind of repeated layer, and write the rest of the graph by copying.

Exporting a model costs time per op traced: Llama-3-8B's 32 identical layers were most of the
main job's planning time, Llama-2-70B's 80 the better part of a minute. Layers repeat, though,
in patterns (Gemma's five local layers to one global, Jamba's interleave of attention, Mamba and
MoE), and a layer's graph depends on what kind of layer it is, not on its index. So:

1. **Kinds.** In the model's largest ``nn.ModuleList``/``nn.Sequential`` of layers, two layers
   are of one kind when their module trees, parameters, buffers and plain attributes are equal
   (an attribute equal to the index of each layer that has it, as ``layer_idx``, is left out).
2. **A prefix.** The shortest prefix of the layers that holds, past its first layer (which reads
   the embedding rather than a layer), two of every kind (one of a kind seen once), every
   transition between kinds that the whole list makes, and ends in the last layer's kind, is
   exported in place of the list (the model runs the prefix as its layers).
3. **Proof.** The prefix's graph must show what the copy assumes: layers of one kind trace to
   the same graph; each layer reads only the layer before it, the ops before the first layer and
   its own parameters; the ops after the last layer read only it; node names follow export's
   counter per op name. And a second prefix is exported (shorter where one can be copied out
   to the prefix, else longer): the shorter copied out to the longer's length must equal the
   longer's export, so a forward that reads how many layers there are (a scale of
   1 / len(layers), a last layer treated apart) fails there.
   Anything else: the model is exported whole.
4. **Copies.** Layer ``i`` past the prefix is a copy of the prefix layer of its kind that follows
   a layer of the kind ``i - 1`` is; its inputs from that layer are the same positions of the
   copy before it, its parameters new placeholders named and ordered as export names them. The
   result is the graph, names and shapes included, that exporting the whole model gives (tests
   compare them on every family the zoo builds).

A forward that behaves differently only at the full count of layers would pass the proof and
be copied wrongly; ``AUTOSHARD_TRACE_WHOLE=1`` (or ``trace(..., whole=True)``) exports every
layer.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import operator
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind

from autoshard.trace.layers import layer_of

_SCALARS = (int, float, str, bool, type(None), torch.dtype)
_NAMED = re.compile(r"^(.*?)(?:_(\d+))?$")
_PREFIX = {InputKind.PARAMETER: "p_", InputKind.BUFFER: "b_"}

Specs = dict[str, tuple[InputKind, str]]      # placeholder name -> (kind, target)


@dataclass(frozen=True)
class Repeat:
    """What is exported of a model's layers: ``container`` (its module path) holds ``count``
    layers of ``kinds`` (one id per layer); the first ``prefix`` of them are exported, and the
    first ``proof`` too: copying the shorter of the two out to the longer must give it."""

    container: str
    count: int
    prefix: int
    proof: int
    kinds: tuple[int, ...]

    def cut(self, prefix: int, count: int) -> "Repeat":
        """The first ``count`` layers, of which the first ``prefix`` are exported."""
        return Repeat(self.container, count, prefix, self.proof, self.kinds[:count])

    def template(self, i: int) -> int:
        """The prefix layer that layer ``i`` copies: the last of its kind that follows one of
        the kind before ``i``."""
        want = (self.kinds[i - 1], self.kinds[i])
        return max(j for j in range(1, self.prefix) if (self.kinds[j - 1], self.kinds[j]) == want)


def repeated_layers(model: torch.nn.Module) -> Repeat | None:
    """The prefix to export of ``model``'s layers, or None where exporting them all is as short
    (a few layers, one instance of each kind, no container of layers, hooks on a layer)."""
    best = None
    for path, m in model.named_modules():     # (the model itself is no container of its own)
        if path and type(m) in (torch.nn.ModuleList, torch.nn.Sequential) and len(m) > 2:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[0]:
                best = (size, path, m)
    if best is None:
        return None
    _, path, layers = best
    if len({id(x) for x in layers}) < len(layers) or any(
            s._forward_hooks or s._forward_pre_hooks for x in layers for s in x.modules()):
        return None         # one module repeated (shared weights), or hooks to run per layer
    kinds = layer_kinds(layers)
    prefix = _prefix(kinds)
    proof = _proof(kinds, prefix) if prefix is not None else None
    if proof is None or prefix + proof >= len(kinds):
        return None           # exporting every layer is as quick
    return Repeat(path, len(kinds), prefix, proof, kinds)


def layer_kinds(layers: Any) -> tuple[int, ...]:
    """One id per layer, equal for layers of one kind (see the module's doc, 1.)."""
    attrs = [_attributes(x) for x in layers]
    keys = {k for a in attrs for k in a}
    index = {k for k in keys if sum(k in a for a in attrs) > 1 and all(
        type(a[k]) is int and a[k] == i for i, a in enumerate(attrs) if k in a)}
    plain = _Plain()
    return _kind_ids([_kind(x, {k: plain(v) for k, v in a.items() if k not in index})
                       for x, a in zip(layers, attrs)])


def _attributes(layer: torch.nn.Module) -> dict[tuple[str, str], Any]:
    """Every plain attribute of a layer's modules, by (module path, attribute name)."""
    return {(name, k): v for name, m in layer.named_modules() for k, v in vars(m).items()
            if not k.startswith("_")}


def _kind(layer: torch.nn.Module, attrs: dict[tuple[str, str], Any]) -> tuple:
    modules = tuple((name, type(m).__module__, type(m).__qualname__)
                    for name, m in layer.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad)
                   for n, p in layer.named_parameters(remove_duplicate=False))
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return modules, tuple(sorted(attrs.items(), key=lambda kv: kv[0])), params, buffers


class _Plain:
    """An attribute as compared between layers: a scalar (or a sequence of them) by value, a
    function by its name, a ``functools.partial`` by its function and arguments (each layer of
    transformers' Gemma makes its own partial of one activation), an object whose ``repr``
    shows its contents by that, anything else by identity. Memoised per object: every
    attention module of a Hugging Face model holds the one config."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[Any, Any]] = {}

    def __call__(self, v: Any) -> Any:
        if isinstance(v, _SCALARS):
            return v
        if id(v) not in self._seen:
            self._seen[id(v)] = (v, self._plain(v))   # keeps v alive: its id stays its own
        return self._seen[id(v)][1]

    def _plain(self, v: Any) -> Any:
        if isinstance(v, (tuple, list)):
            return type(v).__name__, tuple(self(x) for x in v)
        if isinstance(v, functools.partial):
            return "partial", self(v.func), self(v.args), tuple(sorted(
                ((k, self(x)) for k, x in v.keywords.items()), key=repr))
        if callable(v) and hasattr(v, "__qualname__"):
            return "function", getattr(v, "__module__", None), v.__qualname__
        if isinstance(v, (torch.Tensor, torch.nn.Module)):
            return "object", id(v)
        text = repr(v)
        return ("object", id(v)) if " at 0x" in text else ("repr", type(v).__qualname__, text)


def _kind_ids(kinds: list[tuple]) -> tuple[int, ...]:
    ids: dict[tuple, int] = {}
    return tuple(ids.setdefault(k, len(ids)) for k in kinds)


def _prefix(kinds: tuple[int, ...]) -> int | None:
    """The shortest prefix (see the module's doc, 2.) shorter than the list, or None."""
    n, rest = len(kinds), kinds[1:]
    need = {k: min(2, rest.count(k)) for k in set(rest)}
    steps = {(kinds[i - 1], kinds[i]) for i in range(1, n)}
    for p in range(3, n):
        head = kinds[1:p]
        if kinds[p - 1] == kinds[-1] and all(head.count(k) >= c for k, c in need.items()) \
                and steps <= {(kinds[i - 1], kinds[i]) for i in range(1, p)}:
            return p
    return None


def _proof(kinds: tuple[int, ...], prefix: int) -> int | None:
    """The other prefix exported to check the copy: the shortest that copies out to ``prefix``
    layers, else the shortest longer one that ``prefix`` copies out to; None where that is the
    whole list."""
    def copies_to(short: int, count: int) -> bool:
        steps = {(kinds[i - 1], kinds[i]) for i in range(1, short)}
        return kinds[short - 1] == kinds[count - 1] and all(
            (kinds[i - 1], kinds[i]) in steps for i in range(short, count))
    return next((s for s in range(2, prefix) if copies_to(s, prefix)), None) or next(
        (q for q in range(prefix + 1, len(kinds)) if copies_to(prefix, q)), None)


@contextlib.contextmanager
def shortened(model: torch.nn.Module, container: str, count: int) -> Iterator[None]:
    """While inside, ``model``'s layer ``container`` holds only its first ``count`` layers."""
    parent_path, _, attr = container.rpartition(".")
    parent = model.get_submodule(parent_path)
    full = getattr(parent, attr)
    short = type(full)(*[full[i] for i in range(count)]) \
        if isinstance(full, torch.nn.Sequential) else torch.nn.ModuleList(
            full[i] for i in range(count))
    short.train(full.training)
    parent._modules[attr] = short
    try:
        yield
    finally:
        parent._modules[attr] = full


def signature_of(ep: Any) -> Specs:
    """Each placeholder's input kind and target, from an ExportedProgram's signature."""
    return {s.arg.name: (s.kind, s.target) for s in ep.graph_signature.input_specs}


def same_graph(a: tuple[fx.GraphModule, Specs], b: tuple[fx.GraphModule, Specs]) -> bool:
    """Two graphs and their signatures equal as :func:`expand` writes them: every node's name,
    op, target, arguments, value's shape, dtype and requires_grad, module path and source."""
    def rows(gm: fx.GraphModule) -> list:
        out = []
        for n in gm.graph.nodes:
            stack = n.meta.get("nn_module_stack") or {}
            out.append((n.name, n.op, str(n.target), repr((n.args, n.kwargs)), _shape(n),
                        tuple((k, p) for k, (p, _) in stack.items()), n.meta.get("stack_trace")))
        return out
    return list(a[1].items()) == list(b[1].items()) and rows(a[0]) == rows(b[0])


class _NotShown(Exception):
    """The prefix's graph does not show what copying its layers assumes."""


def expand(gm: fx.GraphModule, specs: Specs, repeat: Repeat,
           strip: str) -> tuple[fx.GraphModule, Specs] | None:
    """The graph of the whole model from the graph of its prefix (see the module's doc), with
    its placeholders' kinds and targets; None where the prefix does not prove the copy."""
    try:
        return _Expansion(gm, specs, repeat, strip).run()
    except _NotShown:
        return None


class _Expansion:
    def __init__(self, gm: fx.GraphModule, specs: Specs, repeat: Repeat, strip: str) -> None:
        self.gm, self.specs, self.rep, self.strip = gm, specs, repeat, strip
        self.path = strip + repeat.container     # the container in module stacks and targets
        self.layer: dict[fx.Node, int] = {}               # node -> its prefix layer
        self.blocks: list[list[fx.Node]] = [[] for _ in range(repeat.prefix)]
        self.params: list[list[fx.Node]] = [[] for _ in range(repeat.prefix)]
        self.pre: list[fx.Node] = []
        self.post: list[fx.Node] = []
        self.placeholders: list[fx.Node] = []

    def run(self) -> tuple[fx.GraphModule, Specs]:
        self._partition()
        self._check_names()
        self._check_reads()
        self._check_kinds()
        return self._build()

    # -- reading the prefix --------------------------------------------------------------------
    def _layer_of(self, node: fx.Node) -> int | None:
        if node.op == "placeholder":
            kind, target = self.specs[node.name]
            where = layer_of(target) if kind in _PREFIX and target else None
        elif node.op == "call_function" and node.target is operator.getitem and \
                isinstance(node.args[0], fx.Node) and node.args[0] in self.layer:
            return self.layer[node.args[0]]
        else:
            stack = node.meta.get("nn_module_stack")
            where = layer_of(list(stack.values())[-1][0]) if stack else None
        if where is None or where[0] != self.path:
            return None
        if where[1] >= self.rep.prefix:
            raise _NotShown       # the model ran a layer past the prefix
        return where[1]

    def _partition(self) -> None:
        seen = -1                 # the last layer whose ops were met
        for node in self.gm.graph.nodes:
            index = self._layer_of(node)
            if node.op == "placeholder":
                self.placeholders.append(node)
                if index is not None:
                    if self.specs[node.name][0] not in _PREFIX:
                        raise _NotShown
                    self.layer[node] = index
                    self.params[index].append(node)
                continue
            if index is None:
                (self.pre if seen < 0 else self.post).append(node)
                if seen >= 0 and node.op != "output":
                    seen = self.rep.prefix      # ops after a layer end the layers
                continue
            if index < seen or index > seen + 1 or seen >= self.rep.prefix:
                raise _NotShown       # layers out of order, or an op between two of them
            if node.op != "call_function":
                raise _NotShown       # a submodule or an attribute read inside a layer
            seen = index
            self.layer[node] = index
            self.blocks[index].append(node)
        if seen < 0 or any(not b for b in self.blocks):
            raise _NotShown

    def _check_names(self) -> None:
        """Export names an op by its op name and a counter (FX's namespace: ``linear``,
        ``linear_1``; ``pow_1`` first, as ``pow`` is a builtin); the copies are named by the same
        namespace, so their names are the whole model's export's only if the prefix's are."""
        names = fx.graph._Namespace()
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                if names.create_name(_base(node.name), None) != node.name:
                    raise _NotShown
            elif names.create_name(node.name, None) != node.name:
                raise _NotShown
            if node.op == "placeholder" and node in self.layer:
                kind, target = self.specs[node.name]
                if node.name != _placeholder_name(kind, target):
                    raise _NotShown

    def _check_reads(self) -> None:
        """Layer j reads layer j - 1, the ops before the layers and its own parameters; the ops
        after the layers read the last one only."""
        last = self.rep.prefix - 1
        for node, j in self.layer.items():
            if node.op == "placeholder":
                if any(self.layer.get(u) != j for u in node.users):
                    raise _NotShown   # a parameter read outside its own layer
                continue
            for a in node.all_input_nodes:
                k = self.layer.get(a)
                if k is not None and k != j and not (k == j - 1 and a.op != "placeholder"):
                    raise _NotShown
                if k is None and a not in self.pre and a.op != "placeholder":
                    raise _NotShown
        for node in self.post:
            for a in node.all_input_nodes:
                if self.layer.get(a, last) != last or (a in self.layer and a.op == "placeholder"):
                    raise _NotShown

    def _check_kinds(self) -> None:
        """Layers of one kind in the prefix trace to one graph (reading the same positions of
        the layer before where that is of one kind too)."""
        first: dict[Any, list] = {}
        kinds = self.rep.kinds
        for j in range(1, self.rep.prefix):     # layer 0 reads the embedding, not a layer
            for key, exact in ((kinds[j], False), ((kinds[j - 1], kinds[j]), True)):
                if first.setdefault(key, self._signature(j, exact)) != self._signature(j, exact):
                    raise _NotShown

    def _signature(self, j: int, exact: bool) -> list:
        pos = {n: i for i, n in enumerate(self.blocks[j])}
        ppos = {n: i for i, n in enumerate(self.params[j])}
        before = {n: i for i, n in enumerate(self.blocks[j - 1])}

        def arg(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            if a in pos:
                return ("in", pos[a])
            if a in ppos:
                return ("param", ppos[a])
            if a in before:
                return ("before", before[a] if exact else None)
            return ("outside", a.name)
        sig: list = [(self.specs[p.name][1].removeprefix(f"{self.path}.{j}."),
                      _shape(p)) for p in self.params[j]]
        for n in self.blocks[j]:
            sig.append((str(n.target), repr(fx.node.map_aggregate((n.args, n.kwargs), arg)),
                        _shape(n)))
        return sig

    # -- writing the whole model ----------------------------------------------------------------
    def _build(self) -> tuple[fx.GraphModule, Specs]:
        rep = self.rep
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        specs: Specs = {}
        templates = {i: rep.template(i) for i in range(rep.prefix, rep.count)}
        new_params: dict[int, dict[fx.Node, fx.Node]] = {i: {} for i in templates}
        last_of_kind = {self.specs[p.name][0]: p for p in self.params[rep.prefix - 1]}
        for i in templates:
            if any(self.specs[p.name][0] not in last_of_kind for p in self.params[templates[i]]):
                raise _NotShown    # no place to put a kind of input layer i has
        for node in self.placeholders:
            env[node] = self._copy_placeholder(graph, node, *self.specs[node.name], specs)
            kind = self.specs[node.name][0]
            if last_of_kind.get(kind) is node:
                for i, t in templates.items():
                    for p in self.params[t]:
                        if self.specs[p.name][0] == kind:
                            target = self._renamed_target(self.specs[p.name][1], t, i)
                            new_params[i][p] = self._copy_placeholder(graph, p, kind, target,
                                                                      specs)
        for node in self.pre:
            env[node] = self._copy(graph, node, env.__getitem__, None)
        copies: dict[int, list[fx.Node]] = {}
        for j in range(rep.prefix):
            for n in self.blocks[j]:
                env[n] = self._copy(graph, n, env.__getitem__, None)
            copies[j] = [env[n] for n in self.blocks[j]]
        for i, t in templates.items():
            local: dict[fx.Node, fx.Node] = {}
            if len(copies[i - 1]) != len(self.blocks[t - 1]):
                raise _NotShown
            before = dict(zip(self.blocks[t - 1], copies[i - 1]))

            def mapped(a: fx.Node, local=local, before=before, i=i) -> fx.Node:
                for table in (local, before, new_params[i]):
                    if a in table:
                        return table[a]
                return env[a]
            copies[i] = []
            for n in self.blocks[t]:
                local[n] = self._copy(graph, n, mapped, (t, i))
                copies[i].append(local[n])
        tail = dict(zip(self.blocks[rep.prefix - 1], copies[rep.count - 1]))
        for node in self.post:
            env[node] = self._copy(graph, node, lambda a: tail[a] if a in tail else env[a],
                                   None)
        graph.lint()
        return fx.GraphModule(self.gm, graph), specs

    def _copy_placeholder(self, graph: fx.Graph, node: fx.Node, kind: InputKind, target: str,
                          specs: Specs) -> fx.Node:
        name = node.name if target == self.specs[node.name][1] else \
            _placeholder_name(kind, target)
        new = graph.placeholder(name)
        if new.name != name:
            raise _NotShown
        new.meta = copy.copy(node.meta)
        specs[name] = (kind, target)
        return new

    def _copy(self, graph: fx.Graph, node: fx.Node, mapped: Any,
              moved: tuple[int, int] | None) -> fx.Node:
        """A copy of ``node`` reading ``mapped`` of its inputs; ``moved``: (t, i), a node of
        prefix layer t copied into layer i."""
        name = _base(node.name) if node.op == "call_function" else node.name
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), mapped)
        new = graph.create_node(node.op, node.target, args, kwargs, name, node.type)
        new.meta = copy.copy(node.meta)
        if moved is not None:
            stack = node.meta.get("nn_module_stack")
            if stack:
                new.meta["nn_module_stack"] = {
                    self._moved(k, *moved): (self._moved(p, *moved), ty)
                    for k, (p, ty) in stack.items()}
        return new

    def _moved(self, path: str, t: int, i: int) -> str:
        """A module path (or stack key) of prefix layer ``t`` as it reads in layer ``i``."""
        for old, new in ((f"{self.path}.{t}", f"{self.path}.{i}"),
                         (f"{self.path}[{t}]", f"{self.path}[{i}]")):
            path = re.sub(re.escape(old) + r"(?=[.\[]|$)", new, path)
        return path

    def _renamed_target(self, target: str, t: int, i: int) -> str:
        old = f"{self.path}.{t}."
        if not target.startswith(old):
            raise _NotShown
        return f"{self.path}.{i}." + target[len(old):]


def _base(name: str) -> str:
    """An op's name without its counter: ``linear_3`` -> ``linear``."""
    return _NAMED.match(name).group(1)


def _placeholder_name(kind: InputKind, target: str) -> str:
    """The name export gives a parameter's or buffer's placeholder (checked on the prefix)."""
    return _PREFIX[kind] + re.sub(r"[^a-zA-Z0-9]", "_", target).lower()


def _shape(n: fx.Node) -> Any:
    v = n.meta.get("val")
    return (tuple(v.shape), v.dtype, v.requires_grad) if isinstance(v, torch.Tensor) else None
