"""The tensor axis of the export: which mesh axis is tensor-parallel, the stream's layout
(sequence parallel or replicated), and the parallel style each Linear, Embedding and norm
takes, relaxed (gathers, no sequence parallelism, no tensor parallelism) until the program
is consistent."""
from __future__ import annotations

from collections import Counter

from autoshard.ir import CollectiveKind, Phase, Replicate, Shard, spec_str
from autoshard.plangraph import Graph
from autoshard.plans import Plan
from autoshard.plans.records import NodePlan
from autoshard.tools.export.graph import Module, Style, param_reads
from autoshard.tools.export.values import (COL, FULL, PARAM, REP, STREAM, Cls, Inexpressible,
                                           Mapping, ValueClasses)


def tensor_axis(plan: Plan, mods: dict[str, Module], notes: list[str]) -> int | None:
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



def map_tensor_axis(plan: Plan, g: Graph, mods: dict[str, Module], t: int,
                     notes: list[str]) -> Mapping | None:
    """Try sequence parallel on the norms' dim, then a replicated stream, then give up tensor
    parallelism: the first mapping whose program is consistent wins; why the others failed
    goes to the notes."""
    sp = _sequence_dim(plan, g, mods, t, notes)
    tries = ([sp] if sp is not None else []) + [None]
    for stream in tries:
        gather: frozenset[str] = frozenset()
        while True:
            try:
                mapping = TensorMapper(plan, g, mods, t, stream, gather).run()
            except Inexpressible as e:
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


class TensorMapper(ValueClasses):
    """One attempt at the tensor-axis mapping with a given stream layout (``stream``: the
    sequence-parallel dim, or None for replicated) and the column-parallel Linears whose output
    must be gathered (``gather``)."""


    def run(self) -> "TensorMapper":
        self._decide_linears()
        for name, node in self.g.nodes.items():
            self._visit(name, node)
        self._group_colwise()
        self._sequence_parallel_grads()
        return self

    def _decide_linears(self) -> None:
        """Column- or row-parallel from the weight's read spec; tied weights, Linears called
        several times and modules whose weight the styles cannot shard stay replicated."""
        for m in self.mods.values():
            p = m.weight_read[self.t] if m.weight_read is not None else None
            if m.kind == "other" and any(
                    isinstance(s[self.t], Shard) for f in m.params.values()
                    for n, i in param_reads(self.g, f)
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

    def _check_bias(self, m: Module, role: str) -> None:
        bias = m.params.get("bias")
        if bias is None or role == "rowwise":     # added once after the reduction: the same sum
            return
        read = [self.g.spec_in(n, i) for n, i in param_reads(self.g, bias)]
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
            self._set(name, Cls(PARAM if name in self.params else REP))
        elif m is not None and m.kind == "linear":
            self._linear(m, name)
        elif m is not None and m.kind == "embedding":
            self._embedding(m, name)
        elif m is not None and m.kind == "norm":
            self._norm(m, name)
        else:
            self._check_view(name, node)
            self._set(name, self._combine(name, enumerate(self.g.reads.get(name, ()))))

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

    def _colwise_linear(self, m: Module, name: str, c: Cls, weight: str) -> None:
        if c.kind in (None, PARAM):
            raise Inexpressible(f"{m.path} reads no activation")
        kwargs: list[tuple[str, str]] = []
        arriving = self._arriving(c)
        if arriving != "Replicate()":
            kwargs.append(("input_layouts", arriving))
        gathered = name in self.gather or self._plan_gathers(name)
        loss = not gathered and self._feeds_class_loss(name)
        if gathered:
            kwargs.append(("output_layouts", "Replicate()"))
            self._boundary(name, [(Phase.FORWARD, CollectiveKind.ALL_GATHER)],
                           f"{m.path} output gathered")
            if not self._plan_gathers(name):
                self.notes.append(f"{m.path}: its output is gathered over {self.axis!r} (the "
                                  f"plan keeps it sharded, {self._consumer_specs(name)}), "
                                  f"since what follows runs on whole activations here")
            out = Cls(FULL)
        elif loss:
            kwargs += [("output_layouts", "Shard(-1)"), ("use_local_output", "False")]
            self.loss_parallel = True
            out = Cls(FULL)
        else:
            out = Cls(COL, frozenset({name}))
        self.colwise_inputs.setdefault(self._activation(name), []).append((m.path, name, c))
        self.styles[m.path] = Style(m.path, "ColwiseParallel", tuple(kwargs),
                                    f"{weight}: column-parallel over {self.axis!r}")
        self._set(name, out)

    def _rowwise_linear(self, m: Module, name: str, c: Cls, weight: str) -> None:
        kwargs: list[tuple[str, str]] = []
        if c.kind in (REP, FULL) or (c.kind == STREAM and self.stream is None):
            # A whole input sliced locally; its gradient is all-gathered in backward.
            kwargs.append(("input_layouts", "Replicate()"))
            self._boundary(self._activation(name)[0],
                           [(Phase.BACKWARD, CollectiveKind.ALL_GATHER)],
                           f"{m.path} input sliced")
        elif c.kind == STREAM:
            raise Inexpressible(f"{m.path} is row-parallel on the sequence-sharded activations")
        elif c.kind in (None, PARAM):
            raise Inexpressible(f"{m.path} reads no activation")
        self._stream_output(kwargs, name, m.path, "reduced")
        self.styles[m.path] = Style(m.path, "RowwiseParallel", tuple(kwargs),
                                    f"{weight}: row-parallel over {self.axis!r}")
        self._set(name, Cls(STREAM))

    def _stream_output(self, kwargs: list[tuple[str, str]], name: str, path: str,
                       verb: str) -> None:
        """A partial output reduced into the stream: all-reduce, or reduce-scatter onto the
        sequence-parallel dim (whose backward all-gathers); a stream of DTensors under sequence
        parallelism, so that model code reading its shape sees the whole one."""
        if self.stream is None:
            self._boundary(name, [(Phase.FORWARD, CollectiveKind.ALL_REDUCE)],
                           f"{path} output {verb}")
        else:
            kwargs += [("output_layouts", self._stream_code()), ("use_local_output", "False")]
            self._boundary(name, [(Phase.FORWARD, CollectiveKind.REDUCE_SCATTER),
                                  (Phase.BACKWARD, CollectiveKind.ALL_GATHER)],
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
                self._boundary(name, [(Phase.FORWARD, CollectiveKind.ALL_GATHER)],
                               f"{m.path} output gathered")
            else:
                kwargs += [("output_layouts", self._stream_code()), ("use_local_output", "False")]
                self._boundary(name, [(Phase.FORWARD, CollectiveKind.ALL_TO_ALL),
                                      (Phase.BACKWARD, CollectiveKind.ALL_TO_ALL)],
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
            self._extra(Phase.BACKWARD, CollectiveKind.ALL_GATHER,
                        f"{m.path} output's gradient gathered")
            self.notes.append(f"{m.path}: the plan runs it on the inputs split over "
                              f"{self.axis!r} and all-reduces its weight gradient there; here "
                              f"it runs whole and its output's gradient is all-gathered")
        self._set(name, Cls(STREAM))

    def _norm(self, m: Module, name: str) -> None:
        ins = [(i, v) for i, v in enumerate(self.g.reads.get(name, ()))
               if v[0] not in self.g.param_node.values()]
        c = self._combine(name, ins)
        if c.kind == COL:
            raise Inexpressible(f"{m.path} normalises a column-parallel output", gather=c.origins)
        if c.kind == STREAM and self.stream is not None:
            self.styles[m.path] = Style(m.path, "SequenceParallel",
                                        (("sequence_dim", str(self.stream)),),
                                        f"activations {spec_str(self.g.spec_out((name, 0)))}: "
                                        f"sequence-parallel over {self.axis!r}")
            self.sp_norms.append(m)
        self._set(name, c)

    def _plain(self, m: Module, name: str, c: Cls) -> None:
        """A Linear the plan keeps replicated over the tensor axis."""
        if c.kind == COL:
            raise Inexpressible(f"{m.path} (replicated) reads a column-parallel output",
                                 gather=c.origins)
        if c.kind == STREAM and self.stream is not None:
            self.styles[m.path] = Style(
                m.path, "PrepareModuleInput",
                (("input_layouts", self._stream_code()), ("desired_input_layouts", "Replicate()"),
                 ("use_local_output", "True")),
                f"weight {spec_str(m.weight_read)}: replicated over {self.axis!r}; its input "
                f"is gathered")
            self._extra(Phase.FORWARD, CollectiveKind.ALL_GATHER, f"{m.path} input gathered")
            read = self.g.spec_in(name, 0)
            if read is not None and isinstance(read[self.t], Shard):
                self.notes.append(f"{m.path}: the plan runs it on activations split over "
                                  f"{self.axis!r} ({spec_str(read)}) and all-reduces its weight "
                                  f"gradient; here its input is all-gathered and it runs whole")
            c = Cls(FULL)
        self._set(name, c)

    def _group_colwise(self) -> None:
        """Column-parallel Linears reading one value (q, k and v of an attention) share one
        redistribution of it at their parent module's input, as the plan moves it once:
        PrepareFirstInput on the innermost module holding them and the Linears their region
        feeds, unless that is a whole repeated layer or the model (whose first input is not
        this value)."""
        layers = {layer.name for layer in self.plan.layers}
        for value, group in self.colwise_inputs.items():
            paths = [p for p, _, _ in group]
            parent = common_parent(paths + self._region_rowwise([n for _, n, _ in group]))
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
            kinds = ([(Phase.FORWARD, CollectiveKind.ALL_GATHER),
                      (Phase.BACKWARD, CollectiveKind.REDUCE_SCATTER)]
                     if arriving.startswith("Shard(")
                     else [(Phase.BACKWARD, CollectiveKind.ALL_REDUCE)])
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
                self._extra(Phase.BACKWARD, CollectiveKind.ALL_REDUCE,
                            f"{m.path}.{leaf} gradient")


def common_parent(paths: list[str]) -> str:
    """The innermost module path holding every one of ``paths`` (excluded themselves)."""
    parts = [p.split(".")[:-1] for p in paths]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)
