"""How the exported program's values lie over the tensor axis: the class of each value
(whole, the stream between the styles' modules, a column-parallel chunk, gathered, a
parameter), how an op combines its inputs' classes, and the collectives the styles run
for them. The styles each module takes are in tensor.py."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from autoshard.ir import Partial, Phase, Replicate, Shard, spec_str
from autoshard.plangraph import Graph, Value
from autoshard.plans import Plan
from autoshard.plans.records import NodePlan
from autoshard.tools.export.graph import (CLASS_LOSSES, Expected, Module, Style, VIEWS,
                                          param_reads)

# A view's sizes in its signature (the plan's node_sigs); -1 is the one the view infers.
VIEW_SIZES = re.compile(r"^\S+ \S+ \(\('%\w+', \[(-?[0-9][-0-9, ]*)\]\)")


class Inexpressible(Exception):
    """A combination the exported program cannot run; the caller relaxes the mapping."""

    def __init__(self, reason: str, gather: frozenset[str] = frozenset()) -> None:
        super().__init__(reason)
        self.reason, self.gather = reason, gather


@dataclass
class Mapping:
    stream: int | None
    styles: list[Style]
    parents: dict[str, str]
    expected: list[Expected]
    boundaries: dict[str, list[Expected]]     # plan value -> what the styles run for it
    loss_parallel: bool



# Classes of values in the exported program (over the tensor axis): whole tensors derived from
# the inputs, buffers and constants alone; the activations between the styles' modules; a
# column-parallel Linear's output (a chunk of its last dim); a gathered whole tensor; a
# parameter read outside the styles' modules.
REP, STREAM, COL, FULL, PARAM = "rep", "stream", "col", "full", "param"


@dataclass(frozen=True)
class Cls:
    kind: str | None                       # None: no tensor
    origins: frozenset[str] = frozenset()  # for COL: the column-parallel Linears it comes from
    scalar: bool = False



class ValueClasses:
    """The classes of the values one attempt at the tensor-axis mapping gives, and what it
    records: styles, collectives, notes. The walk and the module rules are TensorMapper's."""

    def __init__(self, plan: Plan, g: Graph, mods: dict[str, Module], t: int,
                 stream: int | None, gather: frozenset[str]) -> None:
        self.plan, self.g, self.mods, self.t = plan, g, mods, t
        self.axis = plan.mesh_axes[t]
        self.stream, self.gather = stream, gather
        self.by_node = {m.node: m for m in mods.values() if m.node}
        self.cls: dict[Value, Cls] = {}
        self.styles: dict[str, Style] = {}
        self.parents: dict[str, str] = {}
        self.expected: list[Expected] = []
        self.boundaries: dict[str, list[Expected]] = {}
        self.notes: list[str] = []
        self.loss_parallel = False
        self.role: dict[str, str] = {}           # module -> "colwise" or "rowwise"
        self.colwise_inputs: dict[Value, list[tuple[str, str, Cls]]] = {}
        self.sp_norms: list[Module] = []
        self.params = set(g.param_node.values())

    @property
    def result(self) -> Mapping:
        return Mapping(self.stream, list(self.styles.values()), self.parents, self.expected,
                        self.boundaries, self.loss_parallel)

    def _ops(self, m: Module) -> str:
        ops = sorted({self.g.nodes[n].op for f in m.params.values()
                      for n, _ in param_reads(self.g, f)})
        return ", ".join(ops)

    def _check_view(self, name: str, node: NodePlan) -> None:
        """A view of a column-parallel output runs on its local chunk: right where the model's
        code leaves the sharded dim to be inferred (``view(b, s, -1, head_dim)``, as Hugging
        Face and torchtitan models write it). Where it infers another dim and gives the sharded
        one (its global head count: ``view(b, s, n_heads, -1)``), the chunk would be split
        wrongly and silently: such outputs are gathered. (Sizes all given are constants in the
        graph, whether the code read them from the tensor or not; if not, the view fails
        loudly on the chunk.)"""
        if node.op not in VIEWS or not self.g.reads.get(name):
            return
        c = self._get(self.g.reads[name][0])
        spec = node.outputs[0] if node.outputs else None
        m = VIEW_SIZES.search(self.plan.node_sigs.get(name, ""))
        if c.kind != COL or spec is None or not isinstance(spec[self.t], Shard) or m is None:
            return
        sizes = [int(x) for x in m.group(1).split(",") if x.strip()]
        d = spec[self.t].dim
        if d < len(sizes) and sizes[d] != -1 and -1 in sizes:
            raise Inexpressible(f"{name} views a column-parallel output with a fixed size "
                                 f"({sizes[d]}) on its sharded dim", gather=c.origins)

    def _set(self, name: str, c: Cls) -> None:
        for i in range(max(1, len(self.g.nodes[name].outputs))):
            shape = self.g.shapes.get((name, i))
            self.cls[(name, i)] = c if shape is None or shape else Cls(c.kind, c.origins, True)

    def _get(self, v: Value) -> Cls:
        return self.cls.get(v, Cls(None))

    def _combine(self, name: str, values: Iterable[tuple[int, Value]]) -> Cls:
        """The class of an op's output from its inputs' (``values``: input index, value), or
        why the program cannot run it. A column-parallel output is a chunk here: where the plan
        reads it whole, the program must have gathered it at its Linear."""
        values = list(values)
        for i, v in values:
            c, spec = self._get(v), self.g.spec_in(name, i)
            if c.kind == COL and spec is not None and not isinstance(spec[self.t], Shard):
                raise Inexpressible(f"{name} reads a column-parallel output whole",
                                     gather=c.origins)
        cs = [self._get(v) for _, v in values]
        cs = [c for c in cs if c.kind is not None and not (c.scalar and c.kind == REP)]
        kinds = {c.kind for c in cs}
        cols = frozenset().union(*(c.origins for c in cs if c.kind == COL))
        if self.stream is None:
            kinds = {STREAM if k == FULL else k for k in kinds}
        if COL in kinds and kinds & {STREAM, FULL, PARAM}:
            raise Inexpressible(f"{name} combines a column-parallel output with whole "
                                 f"activations or a parameter", gather=cols)
        if COL in kinds:
            return Cls(COL, cols)
        if STREAM in kinds and self.stream is not None and kinds & {REP, FULL, PARAM}:
            raise Inexpressible(f"{name} combines the sequence-sharded activations (DTensors) "
                                 f"with a whole tensor or a parameter outside the styles' modules")
        for k in (STREAM, FULL, REP, PARAM):
            if k in kinds:
                return Cls(k)
        return Cls(REP if not values else None)       # a factory (arange, zeros): whole

    def _stream_code(self) -> str:
        return "Replicate()" if self.stream is None else f"Shard({self.stream})"

    def _arriving(self, c: Cls) -> str:
        """The layout a module's activation input arrives in, as a Placement expression."""
        if c.kind == COL:
            return "Shard(-1)"
        if c.kind == STREAM:
            return self._stream_code()
        return "Replicate()"

    def _activation(self, name: str) -> Value:
        return self.g.reads[name][0]

    def _consumer_specs(self, name: str) -> str:
        specs = {spec_str(s) for u, i in self.g.users.get((name, 0), ())
                 if (s := self.g.spec_in(u, i)) is not None}
        return "read as " + ", ".join(sorted(specs)) if specs else "not read"

    def _plan_gathers(self, name: str) -> bool:
        """Whether every op reading this output reads it whole over the tensor axis."""
        specs = [s for u, i in self.g.users.get((name, 0), ())
                 if (s := self.g.spec_in(u, i)) is not None]
        return bool(specs) and all(isinstance(s[self.t], Replicate) for s in specs)

    def _feeds_class_loss(self, name: str) -> bool:
        """Whether a cross-entropy reads this output (through views) sharded on its class dim
        over the tensor axis: the vocabulary-parallel loss of loss_parallel()."""
        todo, seen = [name], {name}
        while todo:
            n = todo.pop()
            for user, i in self.g.users.get((n, 0), ()):
                node = self.g.nodes.get(user)
                if node is None or user in seen:
                    continue
                if node.op in CLASS_LOSSES:
                    spec = self.g.spec_in(user, i)
                    p = spec[self.t] if spec else None
                    return isinstance(p, Shard) and p.dim == 1 and i == 0
                if user not in self.by_node:
                    seen.add(user)
                    todo.append(user)
        return False

    def _check_stream_consumers(self, name: str, path: str) -> None:
        want = Replicate() if self.stream is None else Shard(self.stream)
        specs = {s[self.t] for u, i in self.g.users.get((name, 0), ())
                 if (s := self.g.spec_in(u, i)) is not None}
        other = sorted(str(p) for p in specs if p != want and not isinstance(p, Partial))
        if other:
            self.notes.append(f"{path}: the plan reads its output as {', '.join(other)} over "
                              f"{self.axis!r}; the styles hand it on as {want}")

    def _boundary(self, value: str, kinds: list[tuple[str, str]], source: str) -> None:
        es = [Expected(ph, k, (self.axis,), 1, source, value=value) for ph, k in kinds]
        self.boundaries.setdefault(value, []).extend(es)
        self.expected.extend(es)

    def _extra(self, phase: Phase, kind: str, source: str) -> None:
        self.expected.append(Expected(phase, kind, (self.axis,), 1, source))

