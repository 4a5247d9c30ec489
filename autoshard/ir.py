"""Core IR: placements, sharding specs and strategies.

A *spec* is a tuple with one placement per mesh axis (``axis`` always means a mesh axis, ``dim`` a
tensor dimension). ``(Shard(0), Replicate())`` on a ("dp", "tp") mesh means dim 0 is split over
"dp" and the tensor is whole along "tp". A dim sharded over several axes is split row-major in
axis order (the first axis is the outer split), as DTensor does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

import torch


@dataclass(frozen=True, slots=True)
class Shard:
    dim: int

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or self.dim < 0:
            raise ValueError(f"Shard(dim) takes a non-negative tensor dimension; got {self.dim!r}. "
                             "Fix: normalise negative dims with dim % ndim first.")

    def __str__(self) -> str:
        return f"S({self.dim})"


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
    if text.startswith("S(") and text.endswith(")"):
        return Shard(int(text[2:-1]))
    raise ValueError(f"a placement is written R, P or S(dim); got {text!r}. "
                     "Fix: use the form printed by spec_str, e.g. '[S(0), R]'.")


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
    """Every sharded dim exists and divides evenly (uneven shards are not planned)."""
    for p in spec:
        if isinstance(p, Shard) and p.dim >= len(shape):
            return False
    return all(s % shard_factor(spec, d, mesh_shape) == 0 for d, s in enumerate(shape))


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


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run an op: the spec each tensor input must arrive in, and the output specs.

    ``inputs`` has one entry per tensor argument in the order the rule enumerates them (``None``
    for a non-tensor argument). ``outputs`` has one spec per tensor output. ``kernel`` names a
    local variant of the op when the per-rank computation is not the op itself (e.g. a mean over
    a sharded dim, which must be scaled to a partial sum). ``compute_scale`` is the fraction of
    the op's whole work done on one rank.
    """

    inputs: tuple
    outputs: tuple
    kernel: str | None = None
    compute_scale: float = 1.0

    def __str__(self) -> str:
        ins = " x ".join(spec_str(s) for s in self.inputs)
        outs = ", ".join(spec_str(s) for s in self.outputs)
        k = f" ({self.kernel})" if self.kernel else ""
        return f"{ins} -> {outs}{k}"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype

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

    @property
    def inputs(self) -> list[TensorInfo]:
        flat, _ = torch.utils._pytree.tree_flatten((self.args, self.kwargs))
        return [a for a in flat if isinstance(a, TensorInfo)]

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
