"""The plan's graph as the export sees it: the model's modules read off the parameters
(Linear, Embedding, norm-like), and what the export decides (Style, Expected, Export)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from autoshard.ir import Phase, Spec
from autoshard.plangraph import Graph
from autoshard.plans import Plan

FORMATS = ("dtensor",)

LINEAR = "aten.linear.default"
EMBEDDING = "aten.embedding.default"
CLASS_LOSSES = ("aten.cross_entropy_loss.default", "aten.nll_loss_nd.default",
                "aten.nll_loss.default")
VIEWS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default")
# The plan's collective phases as a training step runs them: forward, or backward (gradient
# syncs included). Optimizer all-gathers (ZeRO-1/2), recomputation and pipeline sends have no
# counterpart in the exported program.
STEP_PHASES = {Phase.FORWARD: Phase.FORWARD, Phase.BACKWARD: Phase.BACKWARD,
               Phase.GRAD_SYNC: Phase.BACKWARD}


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


def param_reads(g: Graph, fqn: str) -> list[tuple[str, int]]:
    node = g.param_node.get(fqn)
    return list(g.users.get((node, 0), ())) if node else []


def _classify(m: Module, g: Graph) -> None:
    weight = m.params.get("weight")
    reads = param_reads(g, weight) if weight else []
    ops = {(g.nodes[n].op, i) for n, i in reads}
    if reads and ops == {(LINEAR, 1)} and len(reads) == 1:
        m.kind, m.node = "linear", reads[0][0]
    elif reads and ops == {(EMBEDDING, 0)} and len(reads) == 1:
        m.kind, m.node = "embedding", reads[0][0]
    elif all(len(g.shapes.get((g.param_node.get(f, ""), 0), (0, 0))) == 1
             for f in m.params.values()):
        readers = [n for f in m.params.values() for n, _ in param_reads(g, f)]
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

    phase: Phase
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
            out.append(f"data parallel over {axes_text(self.data_axes)} with {how}")
        return "; ".join(out) + "."


def axes_text(axes: tuple[str, ...]) -> str:
    return " x ".join(repr(a) for a in axes)

