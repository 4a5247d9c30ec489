"""Values that share storage, and the reads a plan may not reshard because of an in-place write.

torch.export's training IR keeps in-place ops as written. One device runs them on one storage:
BEiT builds its relative position index as ``index = zeros(...); index[1:, 1:] = coords``
(``slice``, ``slice``, ``copy_``) and then reads ``index.view(-1)``, so the write reaches the
later read only through the view chain's shared storage. On a rank, a reshard makes a new
tensor: a reshard between ``zeros`` and a slice, or into ``copy_``, puts the write in that copy,
and the read of ``zeros`` after it sees zeros. Likewise a reshard one consumer emits before the
write and a later consumer reuses (codegen/rewrite.py shares a reshard per value and layout)
holds the value from before the write.

An *alias group* is the values one storage holds: an op whose schema marks its output as an
alias of an input (``view``, ``slice``, ``select``, ``expand``, ``add_``...) joins the two. In a
group that some op writes into (``ops/modes.py`` ``written_args``), a read is *pinned*, read in
the layout its producer made it in, when:

- it is the written input of an in-place op, and the storage is read after the write other
  than through the op's result and the aliases made from it, or is the graph's input or output
  (the write must land in that storage; ``full_like(x).scatter_(...)``, read through its
  result alone, may take a copy, which codegen writes into);
- its consumer makes an alias of it before a write into its group (the write must reach the
  view); a view made after the last write is a read like any other;
- it reads a value before a write into its group that is read again after the write (a
  reshard made for the first read, which codegen shares with later reads in the same layout,
  would hold the value from before the write). The reads after the write stay free: the
  reshard they need is made after it.

The solver prices a pinned read's reshard as forbidden (solver/build.py), so the plan moves none
of these values through a copy. Reads after every write (BEiT's table lookup through the index)
and the sources of writes (``copy_``'s ``src``) stay free.
"""
from __future__ import annotations

import operator

import torch.fx as fx
from torch.utils._pytree import tree_leaves

from autoshard.ops.modes import written_args
from autoshard.trace.graph import ValueRef, value_ref

Read = tuple[str, int]    # (consumer node, position among its value inputs: graph.value_inputs)


def pinned_reads(graph: fx.Graph) -> frozenset[Read]:
    """The reads of ``graph`` a plan must leave as their producer lays them out (above)."""
    return _analysed(graph)[0]


def written_placeholders(graph: fx.Graph) -> frozenset[str]:
    """The graph's inputs (parameters, buffers) that an op writes into, itself or through a
    view: a batch norm's running statistics in training. Their reads are pinned, so the
    layout they are stored in is the one their writer runs in (solver/build.py offers such a
    buffer the sharded layouts a parameter has)."""
    return _analysed(graph)[1]


_ANALYSED = "_autoshard_aliases"


def _analysed(graph: fx.Graph) -> tuple[frozenset[Read], frozenset[str]]:
    """(pinned reads, written placeholders) of ``graph``, from one walk kept on the graph: every
    problem built on a traced graph (each mesh, each rung of a search) asks again. Kept with the
    node count it was made at, so a graph edited since is walked again."""
    kept = getattr(graph, _ANALYSED, None)
    if kept is not None and kept[0] == len(graph.nodes):
        return kept[1]
    groups, reads, writes = _walk(graph)
    written_at: dict[ValueRef, list[int]] = {}
    for t, ref in writes:
        written_at.setdefault(groups.root(ref), []).append(t)
    times: dict[ValueRef, list[int]] = {}
    in_group: dict[ValueRef, list[tuple]] = {}
    for r in reads:
        times.setdefault(r[1], []).append(r[0])
        in_group.setdefault(groups.root(r[1]), []).append(r)
    # storage that outlives the step (an input's) or leaves it (an output's)
    lasting = {groups.root((n.name, 0)) for n in graph.nodes if n.op == "placeholder"}
    lasting |= {groups.root(value_ref(x)) for n in graph.nodes if n.op == "output"
                for x in tree_leaves(n.args) if isinstance(x, fx.Node)}
    pinned = set()
    for t, ref, read, kind in reads:
        root = groups.root(ref)
        at = written_at.get(root)
        if at is None:
            continue
        if kind == "alias" and any(w > t for w in at):
            pinned.add(read)
        elif kind == "write" and (root in lasting or _read_apart(in_group[root], t, read[0])):
            pinned.add(read)
    for t, ref, read, kind in reads:
        at = written_at.get(groups.root(ref))
        if at is not None and read not in pinned and any(t < w < times[ref][-1] for w in at):
            pinned.add(read)
    placeholders = frozenset(n.name for n in graph.nodes
                             if n.op == "placeholder" and groups.root((n.name, 0)) in written_at)
    result = (frozenset(pinned), placeholders)
    setattr(graph, _ANALYSED, (len(graph.nodes), result))
    return result


def _read_apart(group_reads: list[tuple], t: int, writer: str) -> bool:
    """Whether the storage an in-place op at time ``t`` writes into is read after it other than
    through the op's own output: a reshard into the op gives it a copy, which its output and
    the aliases made from that output hold; a later read of the value written, or of an alias
    made before the write, would miss the write. (``full_like(x).scatter_(...)``, read through
    its result alone, may take a copy.)"""
    lineage = {writer}
    for t2, ref, (consumer, _), kind in group_reads:
        if t2 <= t:
            continue
        if ref[0] not in lineage:
            return True
        if kind != "read":                   # an alias of the copy, or a write into it
            lineage.add(consumer)
    return False


def _walk(graph: fx.Graph) -> tuple["_Groups", list, list]:
    """The alias groups; every read (time, value, (consumer, position), kind: "write",
    "alias" or "read"); every write (time, value written)."""
    groups = _Groups()
    reads: list[tuple[int, ValueRef, Read, str]] = []   # (time, value, read, kind)
    writes: list[tuple[int, ValueRef]] = []
    for t, n in enumerate(graph.nodes):
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        written = {id(x) for x in tree_leaves(written_args(n.target, n.args, n.kwargs))
                   if isinstance(x, fx.Node)}
        aliased = _aliased_arguments(n)
        for k, (x, arg) in enumerate(_value_reads(n)):
            ref = value_ref(x)
            if id(x) in written:
                kind = "write"
                writes.append((t, ref))
            elif arg in aliased:
                kind = "alias"
            else:
                kind = "read"
            if arg in aliased:
                for out in _outputs(n):
                    groups.join(out, ref)
            reads.append((t, ref, (n.name, k), kind))
    return groups, reads, writes


class _Groups:
    """Union-find over values."""

    def __init__(self) -> None:
        self.parent: dict[ValueRef, ValueRef] = {}

    def root(self, ref: ValueRef) -> ValueRef:
        while self.parent.get(ref, ref) != ref:
            ref = self.parent[ref]
        return ref

    def join(self, a: ValueRef, b: ValueRef) -> None:
        ra, rb = self.root(a), self.root(b)
        if ra != rb:
            self.parent[ra] = rb


def _value_reads(n: fx.Node) -> list[tuple[fx.Node, str | None]]:
    """Each value input of ``n``, in ``graph.value_inputs``' order, with the name of the schema
    argument it is passed as."""
    schema = getattr(n.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    out = []
    for i, a in enumerate(n.args):
        name = names[i] if i < len(names) else None
        out += [(x, name) for x in tree_leaves(a) if isinstance(x, fx.Node)]
    for name, a in n.kwargs.items():
        out += [(x, name) for x in tree_leaves(a) if isinstance(x, fx.Node)]
    return out


def _aliased_arguments(n: fx.Node) -> set[str]:
    """The schema arguments ``n``'s output is a view of (``view``'s ``self``; an in-place op's
    ``self``, which it returns)."""
    schema = getattr(n.target, "_schema", None)
    if schema is None:
        return set()
    sets = set()
    for r in schema.returns:
        if r.alias_info is not None:
            sets |= set(r.alias_info.before_set)
    return {a.name for a in schema.arguments
            if a.alias_info is not None and sets & set(a.alias_info.before_set)}


def _outputs(n: fx.Node) -> list[ValueRef]:
    """The values ``n`` makes: itself, and each output a getitem reads (``split``'s pieces)."""
    return [(n.name, 0)] + [value_ref(u) for u in n.users
                            if u.op == "call_function" and u.target is operator.getitem]
