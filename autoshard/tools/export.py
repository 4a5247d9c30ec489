"""Export a plan as a torchtitan-style ``parallelize(model, mesh)`` (``autoshard export``).

The generated file applies the plan with PyTorch's own parallel APIs instead of autoshard's
runtime: ``parallelize_module`` with the tensor-parallel styles (ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput/Output, loss parallel) over one mesh axis, and FSDP2
(``fully_shard``) or FSDP2's replicate over the others. It imports torch only.

Those APIs express a subset of what the planner decides, so the export maps what they can say and
lists the rest, in the generated docstring, as not expressible (docs/export.md):

- The **tensor axis** is the mesh axis over which the plan reads Linear or Embedding weights
  sharded (a name like "tp" means nothing here: the planner may pick either axis). A Linear whose
  weight is read ``S(0)`` there is column-parallel, ``S(1)`` row-parallel; an Embedding read
  ``S(0)`` (its vocabulary) is row-parallel, ``S(1)`` column-parallel.
- The **stream layout** is how the activations between those modules lie over the tensor axis:
  replicated, or sharded on one dim (sequence parallel) when every norm-like module (parameters
  all 1-D) runs on activations sharded there. The plan lays out every activation on its own; the
  styles need one layout for all of them, so a plan that mixes several is exported replicated.
- Every other axis is a **data axis**: ``fully_shard`` when the plan stores some parameter sharded
  over it (ZeRO-3), else replicate (DDP over FSDP2's machinery). The batch is split over the axes
  on which the plan splits the inputs.

The styles compose only where the activations they hand each other agree, which the plan's
per-node layouts do not guarantee once some decision is not expressible. :func:`export_plan`
therefore walks the plan's graph and gives every value the class the generated program would
produce (replicated input, the stream, a column-parallel output, a gathered whole tensor); where
two classes meet that the program cannot combine, it gathers the column-parallel outputs involved,
drops sequence parallelism, or, as a last resort, tensor parallelism, and says so. The program
always computes the plan's model; what it may not do is run the plan's collectives, and the
docstring's table compares the two per phase, kind and axis.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from autoshard.errors import AutoshardError
from autoshard.files import check_output, write_output
from autoshard.ir import Partial, Replicate, Shard, Spec, spec_str
from autoshard.plangraph import Graph, Value, graph_of
from autoshard.plans import NodePlan, Plan

FORMATS = ("dtensor",)

LINEAR = "aten.linear.default"
EMBEDDING = "aten.embedding.default"
CLASS_LOSSES = ("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default",
                "aten.nll_loss.default")
VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
_VIEW_SIZES = re.compile(r"^\S+ \S+ \(\('%\w+', \[(-?[0-9][-0-9, ]*)\]\)")
# The plan's collective phases as a training step runs them: forward, or backward (gradient
# syncs included). Optimizer all-gathers (ZeRO-1/2), recomputation and pipeline sends have no
# counterpart in the exported program.
STEP_PHASES = {"forward": "forward", "backward": "backward", "grad_sync": "backward"}


class _Inexpressible(Exception):
    """A combination the exported program cannot run; the caller relaxes the mapping."""

    def __init__(self, reason: str, gather: frozenset[str] = frozenset()) -> None:
        super().__init__(reason)
        self.reason, self.gather = reason, gather


# ----------------------------------------------------------------------------- modules

@dataclass
class Module:
    """A module of the model, as the plan's parameters name it: ``kind`` is ``linear`` (its
    weight read by aten.linear), ``embedding``, ``norm`` (every parameter 1-D, read by
    elementwise or normalisation ops) or ``other``; ``node`` is the op that stands for it (the
    linear or embedding, a norm's last parameter reader); ``weight_read`` the spec in which that
    op reads its weight."""

    path: str
    params: dict[str, str]                    # leaf name -> fqn
    kind: str = "other"
    node: str = ""
    weight_read: Spec | None = None
    tied: bool = False


def modules_of(plan: Plan, g: Graph) -> dict[str, Module]:
    """The plan's parameters grouped by module, each classified by how the graph reads it."""
    mods: dict[str, Module] = {}
    for fqn in plan.params:
        path, _, leaf = fqn.rpartition(".")
        mods.setdefault(path, Module(path, {})).params[leaf] = fqn
    for m in mods.values():
        m.tied = any(f in plan.tied for f in m.params.values())
        _classify(m, g)
    return mods


def _param_reads(g: Graph, fqn: str) -> list[tuple[str, int]]:
    node = g.param_node.get(fqn)
    return list(g.users.get((node, 0), ())) if node else []


def _classify(m: Module, g: Graph) -> None:
    weight = m.params.get("weight")
    reads = _param_reads(g, weight) if weight else []
    ops = {(g.nodes[n].op, i) for n, i in reads}
    if reads and ops == {(LINEAR, 1)} and len(reads) == 1:
        m.kind, m.node = "linear", reads[0][0]
    elif reads and ops == {(EMBEDDING, 0)} and len(reads) == 1:
        m.kind, m.node = "embedding", reads[0][0]
    elif all(len(g.shapes.get((g.param_node.get(f, ""), 0), (0, 0))) == 1
             for f in m.params.values()):
        readers = [n for f in m.params.values() for n, _ in _param_reads(g, f)]
        if readers and not any(g.nodes[n].op in (LINEAR, EMBEDDING) for n in readers):
            order = list(g.nodes)
            m.kind, m.node = "norm", max(readers, key=order.index)
    if m.kind in ("linear", "embedding"):
        m.weight_read = g.spec_in(*reads[0])


# ----------------------------------------------------------------------------- what is decided

@dataclass(frozen=True)
class Style:
    """One entry of the tensor-parallel plan: ``cls(**kwargs)`` on module ``path``; ``kwargs``
    are code, in order; ``why`` is the plan's decision it expresses (the comment beside it)."""

    path: str
    cls: str
    kwargs: tuple[tuple[str, str], ...] = ()
    why: str = ""

    def code(self) -> str:
        return f"{self.cls}({', '.join(f'{k}={v}' for k, v in self.kwargs)})"


@dataclass(frozen=True)
class Expected:
    """Collectives the exported program runs per rank and step: ``count`` of ``kind`` over
    ``axes`` in ``phase`` (forward or backward), made by ``source``. ``planned``: the plan runs
    exactly these at the same value (``value``), so they are the expressible part of its ledger."""

    phase: str
    kind: str
    axes: tuple[str, ...]
    count: int
    source: str
    planned: bool = False
    value: str = ""


@dataclass
class Export:
    """What :func:`export_plan` decided; :meth:`source` is the generated file."""

    plan: Plan
    tensor_axis: str | None
    stream: int | None                  # the sequence-parallel dim over the tensor axis, or None
    data_axes: tuple[str, ...]
    styles: list[Style]
    parents: dict[str, str]             # module -> the layout its first input arrives in
    data_parallel: str | None           # "fully_shard", "replicate" or None
    fsdp_groups: list[str]
    reshard_after_forward: bool
    input_split: dict[int, tuple[str, ...]]     # input position -> data axes its batch splits over
    loss_parallel: bool
    not_expressible: list[str]
    expected: list[Expected]
    unexpressed: list[tuple[str, str, tuple[str, ...], int, str]]   # plan records not run
    layers: dict[str, list[str]] = field(default_factory=dict)     # loop prefix -> layers
    order: dict[str, int] = field(default_factory=dict)   # module -> position in the graph

    def expected_counts(self, *, planned_only: bool = False) -> Counter:
        """Collectives per (phase, kind, axes) the program runs in one step (only those the
        plan runs at the same values, with ``planned_only``)."""
        c: Counter = Counter()
        for e in self.expected:
            if e.planned or not planned_only:
                c[(e.phase, e.kind, e.axes)] += e.count
        return c

    def source(self) -> str:
        return _Renderer(self).render()

    def describe(self) -> str:
        """One sentence: which axis is tensor-parallel (and how the activations between the
        styles' modules lie), which are data-parallel and with what."""
        out = []
        if self.tensor_axis:
            sp = (f", sequence parallel (activations between modules sharded on dim "
                  f"{self.stream})" if self.stream is not None else
                  ", activations between modules replicated")
            out.append(f"tensor parallel over {self.tensor_axis!r} (parallelize_module){sp}")
        else:
            out.append("no tensor parallelism")
        if self.data_parallel:
            how = ("fully_shard" + (" per repeated layer and the root" if self.fsdp_groups
                                    else "")
                   if self.data_parallel == "fully_shard" else "replicate (DDP on FSDP2)")
            out.append(f"data parallel over {_axes_text(self.data_axes)} with {how}")
        return "; ".join(out) + "."


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise AutoshardError(f"an export format among {', '.join(FORMATS)}", got=repr(fmt),
                             fix="use --format dtensor")


def export_plan(plan: Plan, fmt: str = "dtensor") -> Export:
    """Map ``plan`` onto DTensor's parallel styles and FSDP2 (see the module docstring)."""
    check_format(fmt)
    g = graph_of(plan)
    mods = modules_of(plan, g)
    notes: list[str] = []
    t = _tensor_axis(plan, mods, notes)
    mapping = _map_tensor_axis(plan, g, mods, t, notes) if t is not None else None
    if mapping is None and t is not None:
        t = None
    data_axes = tuple(a for i, a in enumerate(plan.mesh_axes) if i != t)
    exp = Export(plan=plan, tensor_axis=plan.mesh_axes[t] if t is not None else None,
                 stream=mapping.stream if mapping else None, data_axes=data_axes,
                 styles=mapping.styles if mapping else [],
                 parents=mapping.parents if mapping else {}, data_parallel=None,
                 fsdp_groups=[], reshard_after_forward=False, input_split={},
                 loss_parallel=mapping.loss_parallel if mapping else False,
                 not_expressible=notes, expected=list(mapping.expected) if mapping else [],
                 unexpressed=[])
    _map_data_axes(exp, g, mods)
    _map_inputs(exp)
    _other_decisions(exp)
    _match_ledger(exp, g, mapping.boundaries if mapping else {})
    exp.layers = _layer_loops(exp)
    exp.order = _module_order(g, mods)
    return exp


def export_file(plan_path: str | Path, output: str | Path, fmt: str = "dtensor") -> Export:
    """``autoshard export``: read a plan file, write the generated module to ``output``."""
    check_format(fmt)             # before reading anything: the cheapest mistake first
    check_output(output, [("plan file", plan_path)], suffix=".py")
    exp = export_plan(Plan.load(plan_path), fmt)
    write_output(output, exp.source(), what="generated file")
    return exp


# ----------------------------------------------------------------------------- the tensor axis

def _tensor_axis(plan: Plan, mods: dict[str, Module], notes: list[str]) -> int | None:
    """The axis over which most Linear/Embedding weights are read sharded (ties: the inner one,
    as torchtitan puts TP innermost). parallelize_module takes a 1-D mesh: weights read sharded
    over another axis too are replicated there."""
    counts = Counter(a for m in mods.values() if m.weight_read is not None and not m.tied
                     for a, p in enumerate(m.weight_read) if isinstance(p, Shard))
    if not counts:
        return None
    t = max(counts, key=lambda a: (counts[a], a))
    for a, n in sorted(counts.items()):
        if a != t:
            notes.append(f"tensor parallelism over {plan.mesh_axes[a]!r} ({n} weights read "
                         f"sharded): parallelize_module takes a 1-D mesh, so only "
                         f"{plan.mesh_axes[t]!r} is tensor-parallel here; over "
                         f"{plan.mesh_axes[a]!r} those weights are replicated and the axis is "
                         f"data-parallel")
    return t


@dataclass
class _Mapping:
    stream: int | None
    styles: list[Style]
    parents: dict[str, str]
    expected: list[Expected]
    boundaries: dict[str, list[Expected]]     # plan value -> what the styles run for it
    loss_parallel: bool


def _map_tensor_axis(plan: Plan, g: Graph, mods: dict[str, Module], t: int,
                     notes: list[str]) -> _Mapping | None:
    """Try sequence parallel on the norms' dim, then a replicated stream, then give up tensor
    parallelism: the first mapping whose program is consistent wins; why the others failed
    goes to the notes."""
    sp = _sequence_dim(plan, g, mods, t, notes)
    tries = ([sp] if sp is not None else []) + [None]
    for stream in tries:
        gather: frozenset[str] = frozenset()
        while True:
            try:
                mapping = _TensorMapper(plan, g, mods, t, stream, gather).run()
            except _Inexpressible as e:
                if e.gather and not e.gather <= gather:
                    gather |= e.gather
                    continue
                what = (f"sequence parallelism on dim {stream}" if stream is not None
                        else "tensor parallelism")
                notes.append(f"{what} over {plan.mesh_axes[t]!r} dropped: {e.reason}")
                break
            notes.extend(mapping.notes)
            return mapping.result
    return None


def _sequence_dim(plan: Plan, g: Graph, mods: dict[str, Module], t: int,
                  notes: list[str]) -> int | None:
    """The dim the norm-like modules' activations are sharded on over the tensor axis, when it
    is one dim for all of them and not the normalised (last) one."""
    dims = {}
    for m in mods.values():
        if m.kind != "norm":
            continue
        spec = g.spec_out((m.node, 0))
        p = spec[t] if spec else None
        rank = g.rank((m.node, 0))
        dims[m.path] = p.dim if isinstance(p, Shard) and p.dim < rank - 1 else (
            None if isinstance(p, Replicate) else "other")
    kinds = set(dims.values())
    if len(kinds) == 1 and isinstance(next(iter(kinds)), int):
        return next(iter(kinds))
    sharded = sorted(p for p, d in dims.items() if d is not None)
    if sharded:
        notes.append(f"sequence parallelism: the plan runs norm-like modules on activations laid "
                     f"out differently over {plan.mesh_axes[t]!r} ("
                     + ", ".join(f"{p}: {_dim_text(dims[p])}" for p in sharded[:4])
                     + (", ..." if len(sharded) > 4 else "")
                     + "); SequenceParallel needs one layout for all, so they run replicated")
    return None


def _dim_text(d: int | str | None) -> str:
    return "replicated" if d is None else f"sharded on dim {d}" if isinstance(d, int) else \
        "sharded on the normalised dim or partial"


# Classes of values in the exported program (over the tensor axis): whole tensors derived from
# the inputs, buffers and constants alone; the activations between the styles' modules; a
# column-parallel Linear's output (a chunk of its last dim); a gathered whole tensor; a
# parameter read outside the styles' modules.
REP, STREAM, COL, FULL, PARAM = "rep", "stream", "col", "full", "param"


@dataclass(frozen=True)
class _Cls:
    kind: str | None                       # None: no tensor
    origins: frozenset[str] = frozenset()  # for COL: the column-parallel Linears it comes from
    scalar: bool = False


class _TensorMapper:
    """One attempt at the tensor-axis mapping with a given stream layout (``stream``: the
    sequence-parallel dim, or None for replicated) and the column-parallel Linears whose output
    must be gathered (``gather``)."""

    def __init__(self, plan: Plan, g: Graph, mods: dict[str, Module], t: int,
                 stream: int | None, gather: frozenset[str]) -> None:
        self.plan, self.g, self.mods, self.t = plan, g, mods, t
        self.axis = plan.mesh_axes[t]
        self.stream, self.gather = stream, gather
        self.by_node = {m.node: m for m in mods.values() if m.node}
        self.cls: dict[Value, _Cls] = {}
        self.styles: dict[str, Style] = {}
        self.parents: dict[str, str] = {}
        self.expected: list[Expected] = []
        self.boundaries: dict[str, list[Expected]] = {}
        self.notes: list[str] = []
        self.loss_parallel = False
        self.role: dict[str, str] = {}           # module -> "colwise" or "rowwise"
        self.colwise_inputs: dict[Value, list[tuple[str, str, _Cls]]] = {}
        self.sp_norms: list[Module] = []
        self.params = set(g.param_node.values())

    # -- the walk -------------------------------------------------------------------------
    def run(self) -> "_TensorMapper":
        self._decide_linears()
        for name, node in self.g.nodes.items():
            self._visit(name, node)
        self._group_colwise()
        self._sequence_parallel_grads()
        return self

    @property
    def result(self) -> _Mapping:
        return _Mapping(self.stream, list(self.styles.values()), self.parents, self.expected,
                        self.boundaries, self.loss_parallel)

    def _decide_linears(self) -> None:
        """Column- or row-parallel from the weight's read spec; tied weights, Linears called
        several times and modules whose weight the styles cannot shard stay replicated."""
        for m in self.mods.values():
            p = m.weight_read[self.t] if m.weight_read is not None else None
            if m.kind == "other" and any(
                    isinstance(s[self.t], Shard) for f in m.params.values()
                    for n, i in _param_reads(self.g, f)
                    if (s := self.g.spec_in(n, i)) is not None):
                self.notes.append(f"{m.path}: parameters read sharded over {self.axis!r} by ops "
                                  f"no parallel style covers ({self._ops(m)}); replicated here")
            if m.kind not in ("linear", "embedding") or not isinstance(p, Shard):
                continue
            if p.groups:
                self.notes.append(f"{m.path}: weight read strided ({p}, a fused projection, "
                                  f"each rank its part of every group) over {self.axis!r}; no "
                                  f"parallel style cuts a weight by groups, so it is replicated")
                continue
            if m.tied:
                self.notes.append(f"{m.path}: a tied weight read sharded over {self.axis!r}; "
                                  f"the styles would shard one tensor twice, so it is replicated")
                continue
            role = {("linear", 0): "colwise", ("linear", 1): "rowwise",
                    ("embedding", 0): "rowwise", ("embedding", 1): "colwise"}.get((m.kind, p.dim))
            if role is None:
                continue
            self.role[m.path] = role
            self._check_bias(m, role)

    def _ops(self, m: Module) -> str:
        ops = sorted({self.g.nodes[n].op for f in m.params.values()
                      for n, _ in _param_reads(self.g, f)})
        return ", ".join(ops)

    def _check_bias(self, m: Module, role: str) -> None:
        bias = m.params.get("bias")
        if bias is None or role == "rowwise":     # added once after the reduction: the same sum
            return
        read = [self.g.spec_in(n, i) for n, i in _param_reads(self.g, bias)]
        want = Shard(0) if role == "colwise" else Replicate()
        if read and read[0] is not None and read[0][self.t] != want:
            self.notes.append(f"{m.path}.bias: read {read[0][self.t]} over {self.axis!r} in the "
                              f"plan; {'Colwise' if role == 'colwise' else 'Rowwise'}Parallel "
                              f"keeps it {want}")

    def _visit(self, name: str, node: NodePlan) -> None:
        m = self.by_node.get(name)
        if node.op == "placeholder":
            # Buffers and constants are whole tensors like the inputs; a parameter read outside
            # the styles' modules is not sharded with what it meets, nor its gradient reduced.
            self._set(name, _Cls(PARAM if name in self.params else REP))
        elif m is not None and m.kind == "linear":
            self._linear(m, name)
        elif m is not None and m.kind == "embedding":
            self._embedding(m, name)
        elif m is not None and m.kind == "norm":
            self._norm(m, name)
        else:
            self._check_view(name, node)
            self._set(name, self._combine(name, enumerate(self.g.reads.get(name, ()))))

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
        m = _VIEW_SIZES.search(self.plan.node_sigs.get(name, ""))
        if c.kind != COL or spec is None or not isinstance(spec[self.t], Shard) or m is None:
            return
        sizes = [int(x) for x in m.group(1).split(",") if x.strip()]
        d = spec[self.t].dim
        if d < len(sizes) and sizes[d] != -1 and -1 in sizes:
            raise _Inexpressible(f"{name} views a column-parallel output with a fixed size "
                                 f"({sizes[d]}) on its sharded dim", gather=c.origins)

    def _set(self, name: str, c: _Cls) -> None:
        for i in range(max(1, len(self.g.nodes[name].outputs))):
            shape = self.g.shapes.get((name, i))
            self.cls[(name, i)] = c if shape is None or shape else _Cls(c.kind, c.origins, True)

    def _get(self, v: Value) -> _Cls:
        return self.cls.get(v, _Cls(None))

    def _combine(self, name: str, values: Iterable[tuple[int, Value]]) -> _Cls:
        """The class of an op's output from its inputs' (``values``: input index, value), or
        why the program cannot run it. A column-parallel output is a chunk here: where the plan
        reads it whole, the program must have gathered it at its Linear."""
        values = list(values)
        for i, v in values:
            c, spec = self._get(v), self.g.spec_in(name, i)
            if c.kind == COL and spec is not None and not isinstance(spec[self.t], Shard):
                raise _Inexpressible(f"{name} reads a column-parallel output whole",
                                     gather=c.origins)
        cs = [self._get(v) for _, v in values]
        cs = [c for c in cs if c.kind is not None and not (c.scalar and c.kind == REP)]
        kinds = {c.kind for c in cs}
        cols = frozenset().union(*(c.origins for c in cs if c.kind == COL))
        if self.stream is None:
            kinds = {STREAM if k == FULL else k for k in kinds}
        if COL in kinds and kinds & {STREAM, FULL, PARAM}:
            raise _Inexpressible(f"{name} combines a column-parallel output with whole "
                                 f"activations or a parameter", gather=cols)
        if COL in kinds:
            return _Cls(COL, cols)
        if STREAM in kinds and self.stream is not None and kinds & {REP, FULL, PARAM}:
            raise _Inexpressible(f"{name} combines the sequence-sharded activations (DTensors) "
                                 f"with a whole tensor or a parameter outside the styles' modules")
        for k in (STREAM, FULL, REP, PARAM):
            if k in kinds:
                return _Cls(k)
        return _Cls(REP if not values else None)       # a factory (arange, zeros): whole

    # -- layouts as code --------------------------------------------------------------------
    def _stream_code(self) -> str:
        return "Replicate()" if self.stream is None else f"Shard({self.stream})"

    def _arriving(self, c: _Cls) -> str:
        """The layout a module's activation input arrives in, as a Placement expression."""
        if c.kind == COL:
            return "Shard(-1)"
        if c.kind == STREAM:
            return self._stream_code()
        return "Replicate()"

    # -- modules ----------------------------------------------------------------------------
    def _activation(self, name: str) -> Value:
        return self.g.reads[name][0]

    def _linear(self, m: Module, name: str) -> None:
        c = self._get(self._activation(name))
        role = self.role.get(m.path)
        spec = m.weight_read
        weight = f"weight {spec_str(spec)}" if spec else "weight"
        if role == "colwise":
            self._colwise_linear(m, name, c, weight)
        elif role == "rowwise":
            self._rowwise_linear(m, name, c, weight)
        else:
            self._plain(m, name, c)

    def _colwise_linear(self, m: Module, name: str, c: _Cls, weight: str) -> None:
        if c.kind in (None, PARAM):
            raise _Inexpressible(f"{m.path} reads no activation")
        kwargs: list[tuple[str, str]] = []
        arriving = self._arriving(c)
        if arriving != "Replicate()":
            kwargs.append(("input_layouts", arriving))
        gathered = name in self.gather or self._plan_gathers(name)
        loss = not gathered and self._feeds_class_loss(name)
        if gathered:
            kwargs.append(("output_layouts", "Replicate()"))
            self._boundary(name, [("forward", "all_gather")], f"{m.path} output gathered")
            if not self._plan_gathers(name):
                self.notes.append(f"{m.path}: its output is gathered over {self.axis!r} (the "
                                  f"plan keeps it sharded, {self._consumer_specs(name)}), "
                                  f"since what follows runs on whole activations here")
            out = _Cls(FULL)
        elif loss:
            kwargs += [("output_layouts", "Shard(-1)"), ("use_local_output", "False")]
            self.loss_parallel = True
            out = _Cls(FULL)
        else:
            out = _Cls(COL, frozenset({name}))
        self.colwise_inputs.setdefault(self._activation(name), []).append((m.path, name, c))
        self.styles[m.path] = Style(m.path, "ColwiseParallel", tuple(kwargs),
                                    f"{weight}: column-parallel over {self.axis!r}")
        self._set(name, out)

    def _rowwise_linear(self, m: Module, name: str, c: _Cls, weight: str) -> None:
        kwargs: list[tuple[str, str]] = []
        if c.kind in (REP, FULL) or (c.kind == STREAM and self.stream is None):
            # A whole input sliced locally; its gradient is all-gathered in backward.
            kwargs.append(("input_layouts", "Replicate()"))
            self._boundary(self._activation(name)[0], [("backward", "all_gather")],
                           f"{m.path} input sliced")
        elif c.kind == STREAM:
            raise _Inexpressible(f"{m.path} is row-parallel on the sequence-sharded activations")
        elif c.kind in (None, PARAM):
            raise _Inexpressible(f"{m.path} reads no activation")
        self._stream_output(kwargs, name, m.path, "reduced")
        self.styles[m.path] = Style(m.path, "RowwiseParallel", tuple(kwargs),
                                    f"{weight}: row-parallel over {self.axis!r}")
        self._set(name, _Cls(STREAM))

    def _stream_output(self, kwargs: list[tuple[str, str]], name: str, path: str,
                       verb: str) -> None:
        """A partial output reduced into the stream: all-reduce, or reduce-scatter onto the
        sequence-parallel dim (whose backward all-gathers); a stream of DTensors under sequence
        parallelism, so that model code reading its shape sees the whole one."""
        if self.stream is None:
            self._boundary(name, [("forward", "all_reduce")], f"{path} output {verb}")
        else:
            kwargs += [("output_layouts", self._stream_code()), ("use_local_output", "False")]
            self._boundary(name, [("forward", "reduce_scatter"), ("backward", "all_gather")],
                           f"{path} output {verb}")
        self._check_stream_consumers(name, path)

    def _embedding(self, m: Module, name: str) -> None:
        role = self.role.get(m.path)
        spec = m.weight_read
        kwargs: list[tuple[str, str]] = []
        if role == "rowwise":
            kwargs.append(("input_layouts", "Replicate()"))
            self._stream_output(kwargs, name, m.path, "reduced")
            self.styles[m.path] = Style(m.path, "RowwiseParallel", tuple(kwargs),
                                        f"weight {spec_str(spec)}: vocabulary-parallel over "
                                        f"{self.axis!r}")
        elif role == "colwise":
            if self.stream is None:
                kwargs.append(("output_layouts", "Replicate()"))
                self._boundary(name, [("forward", "all_gather")], f"{m.path} output gathered")
            else:
                kwargs += [("output_layouts", self._stream_code()), ("use_local_output", "False")]
                self._boundary(name, [("forward", "all_to_all"), ("backward", "all_to_all")],
                               f"{m.path} output resharded")
            self.styles[m.path] = Style(m.path, "ColwiseParallel", tuple(kwargs),
                                        f"weight {spec_str(spec)}: column-parallel over "
                                        f"{self.axis!r}")
        elif self.stream is not None:
            self.styles[m.path] = Style(
                m.path, "PrepareModuleOutput",
                (("output_layouts", "Replicate()"),
                 ("desired_output_layouts", self._stream_code()), ("use_local_output", "False")),
                f"weight {spec_str(spec)}: replicated over {self.axis!r}; its output joins the "
                f"sequence-sharded activations")
            self._extra("backward", "all_gather", f"{m.path} output's gradient gathered")
            self.notes.append(f"{m.path}: the plan runs it on the inputs split over "
                              f"{self.axis!r} and all-reduces its weight gradient there; here "
                              f"it runs whole and its output's gradient is all-gathered")
        self._set(name, _Cls(STREAM))

    def _norm(self, m: Module, name: str) -> None:
        ins = [(i, v) for i, v in enumerate(self.g.reads.get(name, ()))
               if v[0] not in self.g.param_node.values()]
        c = self._combine(name, ins)
        if c.kind == COL:
            raise _Inexpressible(f"{m.path} normalises a column-parallel output", gather=c.origins)
        if c.kind == STREAM and self.stream is not None:
            self.styles[m.path] = Style(m.path, "SequenceParallel",
                                        (("sequence_dim", str(self.stream)),),
                                        f"activations {spec_str(self.g.spec_out((name, 0)))}: "
                                        f"sequence-parallel over {self.axis!r}")
            self.sp_norms.append(m)
        self._set(name, c)

    def _plain(self, m: Module, name: str, c: _Cls) -> None:
        """A Linear the plan keeps replicated over the tensor axis."""
        if c.kind == COL:
            raise _Inexpressible(f"{m.path} (replicated) reads a column-parallel output",
                                 gather=c.origins)
        if c.kind == STREAM and self.stream is not None:
            self.styles[m.path] = Style(
                m.path, "PrepareModuleInput",
                (("input_layouts", self._stream_code()), ("desired_input_layouts", "Replicate()"),
                 ("use_local_output", "True")),
                f"weight {spec_str(m.weight_read)}: replicated over {self.axis!r}; its input "
                f"is gathered")
            self._extra("forward", "all_gather", f"{m.path} input gathered")
            read = self.g.spec_in(name, 0)
            if read is not None and isinstance(read[self.t], Shard):
                self.notes.append(f"{m.path}: the plan runs it on activations split over "
                                  f"{self.axis!r} ({spec_str(read)}) and all-reduces its weight "
                                  f"gradient; here its input is all-gathered and it runs whole")
            c = _Cls(FULL)
        self._set(name, c)

    # -- after the walk ---------------------------------------------------------------------
    def _group_colwise(self) -> None:
        """Column-parallel Linears reading one value (q, k and v of an attention) share one
        redistribution of it at their parent module's input, as the plan moves it once:
        PrepareFirstInput on the innermost module holding them and the Linears their region
        feeds, unless that is a whole repeated layer or the model (whose first input is not
        this value)."""
        layers = {layer.name for layer in self.plan.layers}
        for value, group in self.colwise_inputs.items():
            paths = [p for p, _, _ in group]
            parent = _common_parent(paths + self._region_rowwise([n for _, n, _ in group]))
            c = group[0][2]
            arriving = self._arriving(c)
            # Only for sequence-sharded (DTensor) activations: a hook handing the parent a
            # DTensor where the rest of its code adds plain tensors (a residual) would break it.
            hooked = bool(parent) and parent not in layers and parent not in self.mods \
                and len(group) > 1 and c.kind == STREAM and self.stream is not None
            if hooked:
                self.parents[parent] = arriving
                for path, _, _ in group:
                    st = self.styles[path]
                    self.styles[path] = Style(path, st.cls, tuple(
                        kv for kv in st.kwargs if kv[0] != "input_layouts"), st.why)
            per = 1 if hooked else len(group)
            # Sharded -> Replicate: all-gather, whose backward reduce-scatters the partial
            # gradient; Replicate (from_local): the partial gradient all-reduced in backward.
            kinds = ([("forward", "all_gather"), ("backward", "reduce_scatter")]
                     if arriving.startswith("Shard(") else [("backward", "all_reduce")])
            where = f"{parent} input" if hooked else f"input of {', '.join(paths)}"
            self._boundary(value[0], kinds * per, f"{where} redistributed to Replicate()")
            if not hooked and len(group) > 1:
                self.notes.append(f"{', '.join(paths)} read one value; each redistributes it "
                                  f"on its own here (the plan once)")

    def _region_rowwise(self, names: list[str]) -> list[str]:
        """The row-parallel Linears the outputs of these Linears reach through other ops."""
        seen, todo, found = set(names), list(names), []
        while todo:
            n = todo.pop()
            for user, _ in self.g.users.get((n, 0), ()):
                m = self.by_node.get(user)
                if m is not None and self.role.get(m.path) == "rowwise" and m.kind == "linear":
                    found.append(m.path)
                elif user not in seen and m is None:
                    seen.add(user)
                    todo.append(user)
        return found

    def _sequence_parallel_grads(self) -> None:
        """SequenceParallel keeps a norm's parameters replicated DTensors: each one's gradient,
        a partial sum over the sequence shards, is all-reduced (the plan fuses these into its
        gradient buckets) by the data-parallel wrapper's backward; without one (a 1-D mesh)
        it stays partial until used, and the optimizer step reduces it."""
        if len(self.plan.mesh_shape) == 1:
            if self.sp_norms:
                self.notes.append("the SequenceParallel norms' weight gradients stay partial "
                                  "DTensors after backward; the optimizer step all-reduces them")
            return
        for m in self.sp_norms:
            for leaf in m.params:
                self._extra("backward", "all_reduce", f"{m.path}.{leaf} gradient")

    # -- the plan's side --------------------------------------------------------------------
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

    def _extra(self, phase: str, kind: str, source: str) -> None:
        self.expected.append(Expected(phase, kind, (self.axis,), 1, source))


def _common_parent(paths: list[str]) -> str:
    """The innermost module path holding every one of ``paths`` (excluded themselves)."""
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


# ----------------------------------------------------------------------------- the data axes

def _map_data_axes(exp: Export, g: Graph, mods: dict[str, Module]) -> None:
    """fully_shard when the plan stores some parameter sharded over a data axis (ZeRO-3), one
    group per repeated layer holding such a parameter and the root for the rest; else replicate.
    Several data axes are flattened into one data mesh."""
    plan = exp.plan
    axes = [plan.mesh_axes.index(a) for a in exp.data_axes]
    if not axes:
        return
    label = exp.data_axes
    zero3 = {f for f, spec in plan.params.items() if any(isinstance(spec[a], Shard) for a in axes)}
    if not zero3:
        exp.data_parallel = "replicate"
        exp.expected.append(Expected("backward", "all_reduce", label, 1,
                                     "replicate: the gradients all-reduced"))
        return
    exp.data_parallel = "fully_shard"
    exp.fsdp_groups = [layer.name for layer in plan.layers
                       if any(f.startswith(layer.name + ".") for f in zero3)]
    placeholders = {g.param_node.get(f) for f in zero3}
    exp.reshard_after_forward = any(
        c.kind == "all_gather" and c.phase in ("backward", "recompute") and c.value in placeholders
        for c in plan.collectives)
    in_groups = [f for f in plan.params if any(f.startswith(p + ".") for p in exp.fsdp_groups)]
    n = len(exp.fsdp_groups) + (len(in_groups) < len(plan.params))
    exp.expected += [Expected("forward", "all_gather", label, n, "fully_shard: parameters "
                              "gathered, one collective per group"),
                     Expected("backward", "reduce_scatter", label, n, "fully_shard: gradients "
                              "reduce-scattered, one collective per group")]
    if exp.reshard_after_forward and exp.fsdp_groups:
        exp.expected.append(Expected("backward", "all_gather", label, len(exp.fsdp_groups),
                                     "fully_shard: layer parameters gathered again"))
    replicated = sorted(f for f in plan.params if f not in zero3)
    if replicated:
        exp.not_expressible.append(
            f"{len(replicated)} parameters the plan keeps replicated over {_axes_text(label)} "
            f"(e.g. {replicated[0]}) are sharded by fully_shard like the others (its groups "
            f"shard every parameter they hold)")
    dims = sorted({p.dim for f in zero3 for a in axes
                   if isinstance(p := plan.params[f][a], Shard) and p.dim != 0})
    if dims:
        exp.not_expressible.append(f"ZeRO-3 shards on dims {dims} in the plan: fully_shard "
                                   f"shards dim 0")


def _axes_text(axes: tuple[str, ...]) -> str:
    return " x ".join(repr(a) for a in axes)


def _map_inputs(exp: Export) -> None:
    """The batch (dim 0) of every input split over the data axes over which the plan splits
    some input: each data-parallel rank runs the model on its own samples, inputs and labels
    alike (the plan may keep labels whole and slice them in its loss)."""
    plan = exp.plan
    metas = [plan.input_meta.get(k) for k in plan.inputs]
    split: list[str] = []
    used = 1
    for a in exp.data_axes:
        i = plan.mesh_axes.index(a)
        if not any(isinstance(s[i], Shard) for s in plan.inputs.values()):
            continue
        n = plan.mesh_shape[i]
        if all(m is not None and m[0] and m[0][0] % (used * n) == 0 for m in metas):
            split.append(a)
            used *= n
        else:
            exp.not_expressible.append(f"the plan splits inputs over {a!r}, but not every "
                                       f"input's batch divides; they are replicated there")
    for pos, (k, spec) in enumerate(plan.inputs.items()):
        exp.input_split[pos] = tuple(split)
        other = sorted({p.dim for a, p in zip(plan.mesh_axes, spec)
                        if a in split and isinstance(p, Shard) and p.dim != 0})
        if other:
            exp.not_expressible.append(f"{k} is split on dim {other[0]} in the plan; here "
                                       f"on its batch (dim 0)")
        if exp.tensor_axis is not None:
            p = spec[plan.mesh_axes.index(exp.tensor_axis)]
            if isinstance(p, Shard):
                exp.not_expressible.append(f"{k} is split over {exp.tensor_axis!r} in the plan; "
                                           f"the styles take it replicated there")


def _other_decisions(exp: Export) -> None:
    """Plan decisions with no counterpart in parallelize_module/fully_shard."""
    plan, notes = exp.plan, exp.not_expressible
    modes = Counter(st.mode for st in plan.param_state.values())
    names = {"zero1": "ZeRO-1 (optimizer state sharded)",
             "zero2": "ZeRO-2 (gradients and optimizer state sharded)",
             "offload": "optimizer state and step on the host (offload)",
             "offload_params": "parameters, gradients and optimizer state on the host "
                               "(parameter offload; fully_shard's offload_policy="
                               "CPUOffloadPolicy() is its counterpart)"}
    for mode, n in sorted(modes.items()):
        notes.append(f"{names[mode]} for {n} parameters: here gradients and optimizer state "
                     f"follow the parameter")
    if any(c.members for c in plan.collectives):
        notes.append(f"gradient buckets (bucket_mb {plan.options.bucket_mb:g}): "
                     + ("fully_shard" if exp.data_parallel == "fully_shard" else "replicate"
                        if exp.data_parallel else "the styles")
                     + " group gradients by module, not by the plan's buckets")
    by_policy = Counter(plan.recompute.values())
    for policy, n in sorted(by_policy.items()):
        notes.append(f"activation checkpointing ({policy}) of {n} layers (e.g. "
                     f"{next(k for k, v in plan.recompute.items() if v == policy)}): not "
                     f"applied; wrap those layers with torch.utils.checkpoint to match")
    if plan.pipeline is not None:
        pl = plan.pipeline
        notes.append(f"pipeline over {pl.axis!r} ({pl.schedule}, {len(pl.stages)} stages, "
                     f"{pl.microbatches} microbatches): needs torch.distributed.pipelining; "
                     f"here the whole model runs on every rank of {pl.axis!r}, as data "
                     f"parallelism")
    if plan.options.precision != "model":
        notes.append(f"precision {plan.options.precision}: not applied (for fully_shard, "
                     f"mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                     f"reduce_dtype=torch.float32) expresses it)")
    if not plan.training:
        notes.append("a forward-only plan: the data-parallel wrapper is applied all the same")


# ----------------------------------------------------------------------------- the ledger

def _match_ledger(exp: Export, g: Graph, boundaries: dict[str, list[Expected]]) -> None:
    """Which of the plan's collectives the program runs as planned: at each tensor-parallel
    boundary, the plan's collectives on that value over the tensor axis and the style's must be
    the same kinds in the same phases. Everything else of the plan is listed by why the
    program does not run it."""
    plan = exp.plan
    matched: set[int] = set()
    for value, es in boundaries.items():
        ids = [i for i, c in enumerate(plan.collectives)
               if c.value == value and c.axes == es[0].axes and c.phase in STEP_PHASES]
        want = Counter((STEP_PHASES[plan.collectives[i].phase], plan.collectives[i].kind)
                       for i in ids for _ in range(plan.collectives[i].count))
        have = Counter((e.phase, e.kind) for e in es for _ in range(e.count))
        if want == have:
            matched.update(ids)
            keep = {id(e) for e in es}
            exp.expected = [Expected(e.phase, e.kind, e.axes, e.count, e.source, True, e.value)
                            if id(e) in keep else e for e in exp.expected]
        else:
            exp.not_expressible.append(
                f"collectives at {value}: the plan runs {_counter_text(want) or 'none'}, the "
                f"styles {_counter_text(have)}")
    rows: Counter = Counter()
    params = set(g.param_node.values())
    for i, c in enumerate(plan.collectives):
        if i not in matched:
            rows[(c.phase, c.kind, c.axes, _why_not_run(c, params))] += c.count
    exp.unexpressed = [(ph, k, ax, n, why) for (ph, k, ax, why), n in sorted(rows.items())]


def _why_not_run(c, params: set[str]) -> str:
    if c.phase == "optimizer":
        return "ZeRO-1/2 or offload: parameters gathered after the optimizer step"
    if c.phase == "recompute":
        return "activation checkpointing: forward collectives run again"
    if c.phase == "pipeline":
        return "pipeline sends between stages"
    if c.members:
        return "gradient buckets"
    if c.value in params:
        return ("parameter gradients" if c.phase == "grad_sync" else
                "parameters gathered for the ops that read them")
    if c.node == "output":
        return "the loss reduced over the ranks (here each rank keeps its own)"
    return "activation reshards the styles do not make (each rank computes these values whole)"


def _counter_text(c: Counter) -> str:
    return ", ".join(f"{ph} {k} x{n}" for (ph, k), n in sorted(c.items()))


def _module_order(g: Graph, mods: dict[str, Module]) -> dict[str, int]:
    """Each module's position: where the graph first reads one of its parameters."""
    pos = {name: i for i, name in enumerate(g.nodes)}
    out = {}
    for m in mods.values():
        reads = [pos[n] for f in m.params.values() for n, _ in _param_reads(g, f)]
        out[m.path] = min(reads, default=len(pos))
    return out


def _layer_loops(exp: Export) -> dict[str, list[str]]:
    """Repeated layers whose styles are the same up to their path: written as one loop, as
    torchtitan writes its per-block plan. Keyed by the first layer of each loop."""
    loops: dict[str, list[str]] = {}
    runs: dict[str, list[str]] = {}
    for layer in exp.plan.layers:
        runs.setdefault(layer.same_as, []).append(layer.name)
    for first, names in runs.items():
        shapes = {_relative(exp, n) for n in names}
        if len(names) > 1 and len(shapes) == 1 and next(iter(shapes)):
            loops[names[0]] = names
    return loops


def _relative(exp: Export, layer: str) -> tuple:
    pre = layer + "."
    styles = tuple((s.path[len(pre):], s.code()) for s in exp.styles if s.path.startswith(pre))
    parents = tuple((p[len(pre):], lay) for p, lay in exp.parents.items() if p.startswith(pre))
    return styles + parents


# ----------------------------------------------------------------------------- the file

_PREPARE_FIRST_INPUT = '''
class PrepareFirstInput(ParallelStyle):
    """PrepareModuleInput for a module's first input, whether the caller passes it by position
    or by keyword (Hugging Face attention takes ``hidden_states=``), which PrepareModuleInput
    must be told ahead. The column-parallel Linears inside then read the redistributed tensor:
    it moves once for all of them, as in the plan."""

    def __init__(self, *, input_layouts: Placement, desired_input_layouts: Placement) -> None:
        super().__init__()
        self.input_layouts = (input_layouts,)
        self.desired_input_layouts = (desired_input_layouts,)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        first = next(iter(inspect.signature(module.forward).parameters))

        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (self._prepare(args[0], device_mesh), *args[1:]), kwargs
            if first not in kwargs:
                raise ValueError(f"{type(mod).__name__} called without its first input {first!r}")
            return args, {**kwargs, first: self._prepare(kwargs[first], device_mesh)}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module

    def _prepare(self, x: torch.Tensor, mesh: DeviceMesh) -> DTensor:
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, self.input_layouts, run_check=False)
        return x.redistribute(placements=self.desired_input_layouts)
'''


class _Renderer:
    """The generated module: a docstring that says what the plan decided and what the program
    does instead where it cannot, then constants, the tensor-parallel plan, ``parallelize``,
    ``shard_inputs`` and ``loss_context``."""

    def __init__(self, exp: Export) -> None:
        self.exp, self.plan = exp, exp.plan

    def render(self) -> str:
        parts = [self._docstring(), self._imports(), self._constants()]
        if self.exp.parents:
            parts.append(_PREPARE_FIRST_INPUT.strip("\n"))
        parts += [self._tp_plan(), self._functions()]
        return "\n\n\n".join(p.rstrip("\n") for p in parts) + "\n"

    # -- the docstring --------------------------------------------------------------------
    def _docstring(self) -> str:
        e, p = self.exp, self.plan
        shape = "x".join(map(str, p.mesh_shape))
        lines = [f"Apply the autoshard plan of {p.model or '(model not recorded)'} on mesh "
                 f"{shape} {p.mesh_axes} with DTensor's parallel styles and FSDP2.", "",
                 f"Generated by `autoshard export --format dtensor` from a plan of fingerprint "
                 f"{p.fingerprint} (cluster {p.cluster_text}, "
                 f"{'training' if p.training else 'forward only'}, predicted step "
                 f"{p.predicted['step_time_s'] * 1e3:.3f} ms).", "",
                 "Model: the module the plan was made for, built the same way on every rank "
                 "(its parameter paths are the plan's, e.g. "
                 f"{next(iter(p.params), '-')}).", "Mesh: " + e.describe(), "", "Usage::", "",
                 '    mesh = make_mesh("cuda")            # or "cpu" with gloo',
                 "    model = parallelize(model, mesh)",
                 "    with loss_context():",
                 "        loss = model(*shard_inputs(mesh, *inputs))   # the global batch in",
                 "        loss.backward()",
                 "",
                 "Each rank's loss is the mean over its own samples; with equal samples per rank "
                 "their mean over the data axes is the plan's loss."]
        lines += ["", "Not expressible with these APIs (the program differs from the plan "
                      "here):"]
        lines += [f"  - {n}" for n in e.not_expressible] or ["  (nothing)"]
        lines += ["", "Collectives per rank and training step (phase, kind, axes: the plan's; "
                      "this program's; of them, as the plan runs them at the same tensor):"]
        lines += self._collective_table()
        if e.unexpressed:
            lines += ["", "The plan's collectives this program does not run:"]
            lines += [f"  - {ph} {k} over {','.join(ax)} x{n}: {why}"
                      for ph, k, ax, n, why in e.unexpressed]
        extra = [x for x in e.expected if not x.planned]
        if extra:
            lines += ["", "This program's collectives the plan does not run:"]
            rows = Counter((x.phase, x.kind, x.axes, x.source) for x in extra
                           for _ in range(x.count))
            lines += [f"  - {ph} {k} over {','.join(ax)} x{n}: {src}"
                      for (ph, k, ax, src), n in sorted(rows.items())]
        if e.loss_parallel:
            lines += ["", "The loss runs vocabulary-parallel: its collectives (loss_parallel's "
                          "all-reduces) are not itemized above."]
        body = "\n".join(_wrap(line) for line in lines)
        return '"""' + body.replace('"""', "'''") + '\n"""'

    def _collective_table(self) -> list[str]:
        plan_rows: Counter = Counter()
        for c in self.plan.collectives:
            if c.phase in STEP_PHASES:
                plan_rows[(STEP_PHASES[c.phase], c.kind, c.axes)] += c.count
        here = self.exp.expected_counts()
        planned = self.exp.expected_counts(planned_only=True)
        keys = sorted(set(plan_rows) | set(here))
        rows = [f"  {'phase':9s} {'kind':14s} {'axes':10s} {'plan':>5s} {'here':>5s} "
                f"{'as planned':>10s}"]
        rows += [f"  {ph:9s} {k:14s} {','.join(ax):10s} {plan_rows[(ph, k, ax)]:5d} "
                 f"{here[(ph, k, ax)]:5d} {planned[(ph, k, ax)]:10d}" for ph, k, ax in keys]
        return rows

    # -- code -------------------------------------------------------------------------------
    def _imports(self) -> str:
        e = self.exp
        styles = sorted({s.cls for s in e.styles}
                        | ({"loss_parallel"} if e.loss_parallel else set())
                        | ({"parallelize_module"} if e.tensor_axis else set()))
        lines = ["from __future__ import annotations", "", "import contextlib"]
        if e.parents:
            lines.append("import inspect")
        lines += ["", "import torch", "from torch import nn",
                  "from torch.distributed.device_mesh import DeviceMesh, init_device_mesh"]
        if e.tensor_axis:
            code = " ".join(st.code() for st in e.styles) + " ".join(e.parents.values())
            used = [n for n in ("DTensor", "Replicate", "Shard")
                    if (n == "DTensor" and e.parents) or f"{n}(" in code
                    or (n == "Replicate" and e.parents)]
            if used:
                lines.append(f"from torch.distributed.tensor import {', '.join(used)}")
            lines.append("from torch.distributed.tensor.parallel import (")
            lines += [f"    {s}," for s in styles]
            lines.append(")")
            lines.append("from torch.distributed.tensor.parallel.style import ParallelStyle")
            if e.parents:
                lines.append("from torch.distributed.tensor.placement_types import Placement")
        if e.data_parallel == "fully_shard":
            lines.append("from torch.distributed.fsdp import fully_shard")
        elif e.data_parallel == "replicate":
            lines += ["# DDP built on FSDP2 (a private module in torch 2.13): it composes with "
                      "the styles'",
                      "# DTensor parameters, as DistributedDataParallel does not",
                      "from torch.distributed._composable.replicate_with_fsdp import replicate"]
        return "\n".join(lines)

    def _constants(self) -> str:
        e, p = self.exp, self.plan
        return "\n".join([
            f"MESH_SHAPE = {tuple(p.mesh_shape)!r}",
            f"MESH_AXES = {tuple(p.mesh_axes)!r}",
            "# parallelize_module runs over this axis (None: no tensor parallelism)",
            f"TENSOR_AXIS = {e.tensor_axis!r}",
            "# replicate or fully_shard run over these axes, flattened",
            f"DATA_AXES = {tuple(e.data_axes)!r}",
            "# input position -> the data axes over which shard_inputs splits its batch (dim 0)",
            f"INPUT_SPLIT = {dict(e.input_split)!r}",
            "# fully_shard groups, innermost first; the root is the last group",
            f"FSDP_GROUPS = {tuple(e.fsdp_groups)!r}",
            f"LOSS_PARALLEL = {e.loss_parallel!r}",
        ])

    def _tp_plan(self) -> str:
        e = self.exp
        head = ['def tensor_parallel_plan() -> dict[str, ParallelStyle]:' if e.tensor_axis else
                'def tensor_parallel_plan() -> dict:',
                '    """The styles per module path, for parallelize_module over TENSOR_AXIS; '
                'the comment',
                '    above each is the plan\'s decision it expresses."""']
        if not e.tensor_axis:
            return "\n".join(head + ["    return {}"])
        entries = self._entries()
        looped = {n for names in e.layers.values() for n in names}
        body = ["    plan: dict[str, ParallelStyle] = {"]
        body += [line for path, lines in entries if not _in_any(path, looped)
                 for line in _indent(lines, 8)]
        body.append("    }")
        for first, names in e.layers.items():
            pre = first + "."
            body.append(f"    for layer in {_tuple_code(names)}:")
            body.append("        plan.update({")
            for path, lines in entries:
                if path.startswith(pre):
                    lines = [lines[0], lines[1].replace(f'"{pre}', 'f"{layer}.', 1), *lines[2:]]
                    body += _indent(lines, 12)
            body.append("        })")
        body.append("    return plan")
        return "\n".join(head + body)

    def _entries(self) -> list[tuple[str, list[str]]]:
        """(module path, [its comment, its entry]), in the model's order."""
        rows = [(s.path, [f"# {s.why}", *_entry_code(s.path, s.cls, s.kwargs)])
                for s in self.exp.styles]
        rows += [(p, ["# one redistribution of its input for the column-parallel Linears "
                      "inside",
                      *_entry_code(p, "PrepareFirstInput", (("input_layouts", lay),
                                                            ("desired_input_layouts",
                                                             "Replicate()")))])
                 for p, lay in self.exp.parents.items()]
        order = self.exp.order

        def key(row: tuple[str, list[str]]) -> tuple[int, str]:
            path = row[0]
            under = [i for m, i in order.items() if m == path or m.startswith(path + ".")]
            return (min(under, default=len(order)), path)

        return sorted(rows, key=key)

    def _functions(self) -> str:
        e = self.exp
        out = ['def make_mesh(device_type: str = "cuda") -> DeviceMesh:',
               '    """The plan\'s mesh over every rank of the default process group."""',
               '    return init_device_mesh(device_type, MESH_SHAPE, mesh_dim_names=MESH_AXES)',
               "", "",
               "def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:",
               '    """Apply the plan to ``model`` in place (every rank builds it alike: '
               'parallelize_module',
               "    scatters sharded weights from each axis' first rank) and return it. "
               "``mesh``: the plan's",
               '    mesh, with its axis names (make_mesh)."""',
               "    if tuple(mesh.shape) != MESH_SHAPE or tuple(mesh.mesh_dim_names or ()) != "
               "MESH_AXES:",
               '        raise ValueError(f"this plan runs on a mesh of shape {MESH_SHAPE} with '
               'axes {MESH_AXES}; "',
               '                         f"got {tuple(mesh.shape)} {mesh.mesh_dim_names}: build '
               'it with make_mesh()")']
        if e.tensor_axis:
            out.append("    parallelize_module(model, mesh[TENSOR_AXIS], tensor_parallel_plan())")
        if e.data_parallel == "fully_shard":
            r = e.reshard_after_forward
            out += ["    data = _data_mesh(mesh)",
                    "    for path in FSDP_GROUPS:",
                    f"        fully_shard(model.get_submodule(path), mesh=data, "
                    f"reshard_after_forward={r})",
                    "    fully_shard(model, mesh=data, reshard_after_forward=False)"]
        elif e.data_parallel == "replicate":
            out.append("    replicate(model, mesh=_data_mesh(mesh))")
        out.append("    return model")
        out += ["", "",
                "def shard_inputs(mesh: DeviceMesh, *inputs: torch.Tensor) -> "
                "tuple[torch.Tensor, ...]:",
                '    """This rank\'s part of each global input: its batch split over the data '
                'axes in',
                '    INPUT_SPLIT (row-major, the first axis outermost), whole over the others."""',
                "    out = []",
                "    for i, x in enumerate(inputs):",
                "        for axis in INPUT_SPLIT.get(i, ()):",
                "            x = x.chunk(mesh[axis].size())[mesh[axis].get_local_rank()]",
                "        out.append(x)",
                "    return tuple(out)",
                "", "",
                "def loss_context() -> contextlib.AbstractContextManager:",
                '    """Where forward and backward run: loss_parallel() when the loss reads '
                'logits sharded',
                '    on the vocabulary (LOSS_PARALLEL)."""',
                "    return loss_parallel()" if e.loss_parallel else
                "    return contextlib.nullcontext()"]
        if e.data_parallel:
            out += ["", "",
                    "def _data_mesh(mesh: DeviceMesh) -> DeviceMesh:",
                    '    """The data axes as one mesh dimension."""',
                    "    if len(DATA_AXES) == 1:",
                    "        return mesh[DATA_AXES[0]]",
                    '    return mesh[DATA_AXES]._flatten("_".join(DATA_AXES))']
        return "\n".join(out)


def _entry_code(path: str, cls: str, kwargs: tuple[tuple[str, str], ...]) -> list[str]:
    """``"path": Cls(k=v, ...),`` on one line, or one keyword per line when that is long."""
    one = f'"{path}": {cls}({", ".join(f"{k}={v}" for k, v in kwargs)}),'
    if len(one) <= 84 or not kwargs:
        return [one]
    return [f'"{path}": {cls}(', *(f"    {k}={v}," for k, v in kwargs), "),"]


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + line for line in lines]


def _tuple_code(names: list[str]) -> str:
    return "(" + ", ".join(f'"{n}"' for n in names) + ("," if len(names) == 1 else "") + ")"


def _in_any(path: str, layers: set[str]) -> bool:
    return any(path.startswith(n + ".") for n in layers)


def _wrap(line: str, width: int = 96) -> str:
    """A docstring line wrapped at ``width``, continuation lines indented under its text."""
    if len(line) <= width:
        return line
    text = line.lstrip(" -")
    lead = line[:len(line) - len(text)]
    out, cur = [], lead + text.split(" ")[0]
    for w in text.split(" ")[1:]:
        if len(cur) + 1 + len(w) > width:
            out.append(cur)
            cur = " " * len(lead) + w
        else:
            cur = f"{cur} {w}"
    out.append(cur)
    return "\n".join(out)
