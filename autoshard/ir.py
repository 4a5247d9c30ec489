"""Core IR: placements, sharding specs and strategies.

A *spec* is a tuple with one placement per mesh axis (``axis`` always means a mesh axis, ``dim`` a
tensor dimension). ``(Shard(0), Replicate())`` on a ("dp", "tp") mesh means dim 0 is split over
"dp" and the tensor is whole along "tp". A dim sharded over several axes is split row-major in
axis order (the first axis is the outer split), as DTensor does.

A *strided* shard ``Shard(dim, groups)`` cuts the dim first into groups of the given relative
sizes (``(1, 1, 1)``: three equal thirds, Q, K and V of a fused projection; ``(2, 1, 1)``: Q
twice as wide as K and V under grouped-query attention), then shards every group alike: a rank
holds its piece of each group, the pieces one after the other in group order. It is the layout a
fused projection needs when its output is later split into the groups (Megatron's layout of
GPT-2's ``c_attn``): each rank keeps its heads of Q, of K and of V. DTensor calls the equal-group
case ``_StridedShard(dim, split_factor=len(groups))``. Every axis that shards a dim shards it with
the same groups; within each group the axes nest row-major as above.
"""
from __future__ import annotations

import functools

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Sequence, Union

import torch


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int
    groups: tuple[int, ...] = ()    # relative group sizes of a strided shard; () is contiguous

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim) takes a non-negative tensor dimension; got {self.dim!r}. "
                             "Fix: normalise negative dims with dim % ndim first.")
        g = self.groups
        if g and g != ZIGZAG and (len(g) < 2 or any(not isinstance(x, int) or x < 1 for x in g)
                                  or math.gcd(*g) != 1):
            raise ValueError(f"Shard(dim, groups) takes two or more positive relative group "
                             f"sizes in lowest terms, or ZIGZAG {ZIGZAG}; got {g!r}. Fix: e.g. "
                             f"(1, 1, 1) for three equal groups, (2, 1, 1) for one twice as wide "
                             f"as the others.")

    def __str__(self) -> str:
        if not self.groups:
            return f"S({self.dim})"
        if self.groups == ZIGZAG:
            return f"S({self.dim}/zz)"
        g = self.groups
        return f"S({self.dim}/{len(g)})" if len(set(g)) == 1 else \
            f"S({self.dim}/{'+'.join(map(str, g))})"

    def group_sizes(self, size: int) -> list[int]:
        """The absolute sizes of the groups of a dim of ``size`` elements (one group if
        contiguous)."""
        if not self.groups:
            return [size]
        unit, rest = divmod(size, sum(map(abs, self.groups)))
        assert not rest, f"{self}: {size} elements do not cut into groups {self.groups}"
        return [abs(w) * unit for w in self.groups]


# The causal load-balanced layout of a sequence dim (see the module docstring).
ZIGZAG = (1, -1)


@dataclass(frozen=True, slots=True)
class Replicate:
    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True, slots=True)
class Partial:
    """Each rank holds a summand; the logical tensor is the sum over the axis."""

    def __str__(self) -> str:
        return "P"


Placement = Union[Shard, Replicate, Partial]
Spec = tuple  # tuple[Placement, ...], one per mesh axis

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def spec_str(spec: Spec | None) -> str:
    if spec is None:
        return "-"
    return "[" + ", ".join(str(p) for p in spec) + "]"


def parse_placement(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return R
    if text == "P":
        return P
    m = re.fullmatch(r"S\((\d+)(?:/(zz|\d+(?:\+\d+)*))?\)", text)
    if m:
        dim, groups = int(m.group(1)), m.group(2)
        if groups is None:
            return Shard(dim)
        if groups == "zz":
            return Shard(dim, ZIGZAG)
        g = tuple(int(x) for x in groups.split("+"))
        return Shard(dim, (1,) * g[0] if len(g) == 1 else g)
    raise ValueError(f"a placement is written R, P, S(dim) or, strided, S(dim/groups) or "
                     f"S(dim/w1+w2+...); got {text!r}. "
                     "Fix: use the form printed by spec_str, e.g. '[S(0), R]' or '[S(1/3)]'.")


def parse_spec(text: str) -> Spec:
    text = text.strip()
    if not (text.startswith("[") and text.endswith("]")):
        raise ValueError(f"a spec is written '[p, p, ...]'; got {text!r}. Fix: e.g. '[S(0), R]'.")
    body = text[1:-1].strip()
    return tuple(parse_placement(t) for t in body.split(",")) if body else ()


def replicated(ndim_mesh: int) -> Spec:
    return (R,) * ndim_mesh


def shard_factor(spec: Spec, dim: int, mesh_shape: Sequence[int]) -> int:
    """How many pieces ``dim`` is cut into under ``spec``."""
    f = 1
    for p, n in zip(spec, mesh_shape):
        if isinstance(p, Shard) and p.dim == dim:
            f *= n
    return f


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    return tuple(s // shard_factor(spec, d, mesh_shape) for d, s in enumerate(shape))


def spec_fits(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """Every sharded dim exists and divides evenly (uneven shards are not planned); a strided
    dim is cut by every axis with the same groups, each group dividing evenly."""
    strided: dict[int, tuple[int, ...]] = {}
    for p in spec:
        if isinstance(p, Shard):
            if p.dim >= len(shape) or strided.setdefault(p.dim, p.groups) != p.groups:
                return False
    for d, g in strided.items():
        if g and shape[d] % sum(map(abs, g)):
            return False
        f = shard_factor(spec, d, mesh_shape)
        if any(x % f for x in Shard(d, g).group_sizes(shape[d])):
            return False
    return all(s % shard_factor(spec, d, mesh_shape) == 0 for d, s in enumerate(shape))


def dim_groups(spec: Spec, dim: int) -> tuple[int, ...]:
    """The groups of a strided ``dim`` under ``spec`` (() if contiguous or not sharded)."""
    return next((p.groups for p in spec if isinstance(p, Shard) and p.dim == dim), ())


def to_rank_major(x: torch.Tensor, dim: int, n: int, groups: tuple[int, ...]) -> torch.Tensor:
    """Reorder ``dim`` of ``x``, laid out group by group (each group cut in ``n`` pieces, piece
    by piece), into rank order: piece 0 of every group, then piece 1, ... (what a collective over
    ``n`` ranks cuts or concatenates); a group of negative size gives rank ``r`` its piece
    ``n-1-r``. The inverse of :func:`to_group_major`."""
    if not groups or n == 1:
        return x
    parts = [g.chunk(n, dim) if w > 0 else g.chunk(n, dim)[::-1]
             for w, g in zip(groups, x.split(Shard(dim, groups).group_sizes(x.shape[dim]), dim))]
    return torch.cat([p[r] for r in range(n) for p in parts], dim)


def to_group_major(x: torch.Tensor, dim: int, n: int, groups: tuple[int, ...]) -> torch.Tensor:
    """The inverse of :func:`to_rank_major`: ``n`` rank pieces, each holding its part of every
    group, reordered group by group."""
    if not groups or n == 1:
        return x
    sizes = Shard(dim, groups).group_sizes(x.shape[dim] // n)
    pieces = [r.split(sizes, dim) for r in x.chunk(n, dim)]
    return torch.cat([p[i] for i, w in enumerate(groups)
                      for p in (pieces if w > 0 else pieces[::-1])], dim)


def divergent_axes(in_spec: Spec, out_spec: Spec) -> frozenset[int]:
    """Axes on which a replicated input meets per-rank-different work.

    An input that is Replicate on axis ``a`` feeding an op whose output is not Replicate on ``a``
    gets a *partial* local gradient there, which must be all-reduced over ``a`` (Megatron's "f";
    data parallel's gradient sync when the input is a parameter).
    """
    return frozenset(a for a, (i, o) in enumerate(zip(in_spec, out_spec))
                     if isinstance(i, Replicate) and not isinstance(o, Replicate))


def work_fraction(ins: tuple, outs: tuple, mesh_shape: tuple) -> float:
    """The fraction of an op's work one rank does under these specs (``Strategy.compute_scale``):
    1/n for every axis of size n on which the work is split."""
    scale = 1.0
    for a, n in enumerate(mesh_shape):
        option = (tuple(s[a] for s in ins if s is not None), tuple(s[a] for s in outs))
        if _splits_work(option):
            scale /= n
    return scale


def _splits_work(option: tuple) -> bool:
    """Whether a 1-D option divides the op's work over the axis: some output is sharded, or a
    sharded input meets a partial output (a contraction). Partial in -> partial out (a linear op
    on summands) does the whole work on every rank."""
    ins, outs = option
    if any(isinstance(p, Shard) for p in outs):
        return True
    return any(isinstance(p, Shard) for p in ins) and (
        not outs or any(isinstance(p, Partial) for p in outs))


class PlanName(str, Enum):
    """A name a plan file writes: each member is its string on disk, in f-strings, in
    comparisons and in messages, so files and text name it as they always have (Python 3.11's
    ``StrEnum``, written out: the package supports 3.10)."""

    __str__ = str.__str__
    __format__ = str.__format__

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def of(cls, name: str | None) -> Any:
        """``name`` as a member, None where it names none."""
        return cls._value2member_map_.get(name)


class StateMode(PlanName):
    """Where a parameter's gradient and optimizer state live when not laid out as the
    parameter is (cost/state.py, docs/cost-model.md §9): the kernel of its placeholder's
    strategy, and a plan file's ``kernel`` and ``ParamState.mode``; no mode (None): with the
    parameter."""

    ZERO1 = "zero1"                    # optimizer state sharded over the zero axes
    ZERO2 = "zero2"                    # gradients too
    OFFLOAD = "offload"                # optimizer state and step on the host
    OFFLOAD_PARAMS = "offload_params"  # the stored parameter too, copied in at each use


class CollectiveKind(PlanName):
    """The collectives a plan runs (cost/comm.py prices them, codegen/collectives.py runs them,
    docs/cost-model.md §1): a plan file's ``collectives[].kind`` and a cluster profile's link
    figures per kind; ``of`` is None for a reshard step that moves nothing (a local slice)."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"          # point to point: pipeline sends, ring attention's hops


class Phase(PlanName):
    """The part of a training step a collective or a host copy runs in: a plan file's
    ``collectives[].phase`` and ``host_transfers[].phase``, the runtime ledger's records
    (codegen/collectives.py), in step order (docs/plan-format.md)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    GRAD_SYNC = "grad_sync"            # a parameter's gradient sync (buckets, tied weights)
    OPTIMIZER = "optimizer"            # the step's own: ZeRO's gathers, offload's copies
    RECOMPUTE = "recompute"            # a checkpointed layer's forward collectives, run again
    PIPELINE = "pipeline"              # sends between stages, the loss's all-reduce
    # The runtime's only, never recorded: a selectively checkpointed layer's forward run again,
    # its collectives returning the outputs stored in forward (codegen/recompute.py).
    REPLAY = "replay"


class OffloadLevel(PlanName):
    """How far state goes to the host (docs/cost-model.md §9): ``PlanOptions.offload`` (any of
    them), a plan file's ``params[].offload`` (NONE written ``false``) and the planner's memory
    ladder (solver/budget.py: none, then the optimizer's, then the parameters' too)."""

    AUTO = "auto"                      # an option only: the planner decides per plan
    NONE = "none"
    OPTIMIZER = "optimizer"            # optimizer state and step (state mode "offload")
    PARAMETERS = "parameters"          # the stored parameters too ("offload_params")


class OffloadOverlap(PlanName):
    """How the host's optimizer step overlaps the device under offload
    (``PlanOptions.offload_overlap``, codegen/hostopt.py, docs/cost-model.md §9.1)."""

    BACKWARD = "backward"              # each bucket steps as soon as its gradients are complete
    DELAYED = "delayed"                # during the next step's forward and backward
    NONE = "none"                      # after backward


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op: the spec each tensor input must arrive in, and the output specs.

    ``inputs`` has one entry per tensor argument in the order the rule enumerates them (``None``
    for a non-tensor argument). ``outputs`` has one spec per tensor output. ``kernel`` names a
    local variant of the op when the per-rank computation is not the op itself (e.g. a mean over
    a sharded dim, which must be scaled to a partial sum). ``compute_scale`` is the fraction of
    the op's whole work done on one rank. A parameter's placeholder's kernel is its
    ``StateMode``, and ``state_axes`` the mesh axes a ZeRO mode shards its state over where
    that is some of its replicated axes only (cost/state.py); None: all of them.
    """

    inputs: tuple
    outputs: tuple
    kernel: str | None = None
    compute_scale: float = 1.0
    state_axes: tuple[int, ...] | None = None

    def __str__(self) -> str:
        ins = " x ".join(spec_str(s) for s in self.inputs)
        outs = ", ".join(spec_str(s) for s in self.outputs)
        k = f" ({self.kernel})" if self.kernel else ""
        if self.state_axes is not None:
            k = f" ({self.kernel} over axes {list(self.state_axes)})"
        return f"{ins} -> {outs}{k}"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A tensor's shape and dtype. ``groups``: ``(dim, relative group sizes)`` pairs for the dims
    the model later splits into groups (trace/fused.py): the dims a rule may shard strided."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    groups: tuple[tuple[int, tuple[int, ...]], ...] = ()

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class OpInfo:
    """What a rule sees of one node: its target, its arguments with every tensor replaced by a
    :class:`TensorInfo`, and its tensor outputs (flattened, in order)."""

    target: Any
    args: tuple
    kwargs: dict
    outputs: tuple[TensorInfo, ...]
    source: str = ""

    @functools.cached_property
    def inputs(self) -> tuple[TensorInfo, ...]:
        """The tensor arguments in order (flattened once: every rule and pricer reads them)."""
        flat, _ = torch.utils._pytree.tree_flatten((self.args, self.kwargs))
        return tuple(a for a in flat if isinstance(a, TensorInfo))

    @property
    def out(self) -> TensorInfo:
        return self.outputs[0]


def op_info(target: Any, args: tuple, kwargs: dict, outputs: Any, source: str = "") -> OpInfo:
    """The one way to build an :class:`OpInfo`: a call's arguments and outputs with every tensor
    (real, fake or meta) replaced by its shape and dtype."""
    def conv(a: Any) -> Any:
        return TensorInfo(tuple(int(s) for s in a.shape), a.dtype) if isinstance(
            a, torch.Tensor) else a

    flat, spec = torch.utils._pytree.tree_flatten((tuple(args), dict(kwargs)))
    args, kwargs = torch.utils._pytree.tree_unflatten([conv(a) for a in flat], spec)
    outs = tuple(conv(t) for t in torch.utils._pytree.tree_flatten(outputs)[0]
                 if isinstance(t, torch.Tensor))
    return OpInfo(target, tuple(args), dict(kwargs), outs, source)


def cached_on(op: OpInfo, key: str, make: Callable[[OpInfo], Any]) -> Any:
    """``make(op)``, computed once per op and kept on it (an OpInfo is immutable; the cost model
    prices thousands of strategies of the same op)."""
    value = op.__dict__.get(key)
    if value is None:
        value = make(op)
        object.__setattr__(op, key, value)
    return value


@dataclass(frozen=True, slots=True)
class Layer:
    """One instance of a repeated block of the model, as its module path names it
    (``model.layers.3``): its graph nodes in order (its parameters and buffers first, as they are
    graph inputs), and ``same_as``, the first layer of its container with the same ops, shapes and
    wiring (itself if none). Identical layers share their sharding decisions; per-layer choices
    (checkpointing) and pipeline stage cuts refer to layers by name."""

    name: str
    nodes: tuple[str, ...]
    same_as: str

    def __post_init__(self) -> None:
        if not self.name or not self.nodes:
            raise ValueError(f"a Layer has a name and at least one node; got {self.name!r} with "
                             f"{len(self.nodes)} nodes. Fix: build layers with trace.layers.")
