"""The per-op sharding rule registry (DESIGN.md example 4).

A rule is a plain function ``(op: OpInfo, mesh_shape) -> list[Strategy]`` giving every N-D
strategy the op supports on a mesh of that shape. Most rules describe one mesh axis at a time and
let :func:`expand` take the product over axes; einsum-shaped ops are generated from an equation.

A rule may also register:
- ``localize``: how to call the op on one rank's local tensors under a strategy (rewrite size
  arguments to local sizes, pick a local kernel). Default: the op unchanged, with every int-list
  argument that equals the global output shape replaced by the local output shape.
- ``flops``: the op's whole (unsharded) forward FLOPs. Default: one per output element.

Ops with no rule are replicated, with one warning per op naming it and the model's source line.
"""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from autoshard.ir import Partial, Replicate, Shard, Strategy, local_shape, spec_fits

aten = torch.ops.aten


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


def cached_on(op: OpInfo, key: str, make: Callable[[OpInfo], Any]) -> Any:
    """``make(op)``, computed once per op and kept on it (an OpInfo is immutable; the cost model
    prices thousands of strategies of the same op)."""
    value = op.__dict__.get(key)
    if value is None:
        value = make(op)
        object.__setattr__(op, key, value)
    return value


RuleFn = Callable[[OpInfo, tuple], list]
LocalizeFn = Callable[..., tuple]   # (op, strategy, mesh_shape, coords, args, kwargs) -> (fn, args, kwargs)
FlopsFn = Callable[[OpInfo], float]


@dataclass
class OpRule:
    strategies: RuleFn
    localize: LocalizeFn | None = None
    flops: FlopsFn | None = None


RULES: dict[Any, OpRule] = {}


def register_strategy(*targets: Any) -> Callable[[RuleFn], RuleFn]:
    def deco(fn: RuleFn) -> RuleFn:
        for t in targets:
            RULES.setdefault(t, OpRule(fn)).strategies = fn
        return fn
    return deco


def register_localize(*targets: Any) -> Callable[[LocalizeFn], LocalizeFn]:
    def deco(fn: LocalizeFn) -> LocalizeFn:
        for t in targets:
            assert t in RULES, f"register the strategy of {t} before its localize"
            RULES[t].localize = fn
        return fn
    return deco


def register_flops(*targets: Any) -> Callable[[FlopsFn], FlopsFn]:
    def deco(fn: FlopsFn) -> FlopsFn:
        for t in targets:
            assert t in RULES, f"register the strategy of {t} before its flops"
            RULES[t].flops = fn
        return fn
    return deco


def replicate_strategy(op: OpInfo, mesh_shape: tuple) -> Strategy:
    r = (Replicate(),) * len(mesh_shape)
    return Strategy(tuple(r for _ in op.inputs), tuple(r for _ in op.outputs))


def expand(op: OpInfo, mesh_shape: tuple, per_axis: Sequence[tuple], *,
           kernel: Callable[[tuple], str | None] | None = None) -> list[Strategy]:
    """The product over mesh axes of 1-D options.

    ``per_axis`` lists 1-D options ``(input placements, output placements)``, each a tuple with
    one placement per tensor input / output. The all-replicate option is always included. A
    combination is kept when every spec fits its tensor (dims exist and divide evenly).
    """
    n_in, n_out = len(op.inputs), len(op.outputs)
    rep = (tuple(Replicate() for _ in range(n_in)), tuple(Replicate() for _ in range(n_out)))
    # dict.fromkeys: a rule may generate the same 1-D option twice (e.g. two dims that map alike);
    # a duplicate option would give the ILP duplicate strategies.
    options = list(dict.fromkeys([rep] + [tuple(map(tuple, o)) for o in per_axis]))
    in_infos, out_infos = op.inputs, op.outputs
    out: list[Strategy] = []
    for combo in itertools.product(options, repeat=len(mesh_shape)):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(n_in))
        outs = tuple(tuple(c[1][j] for c in combo) for j in range(n_out))
        if not all(spec_fits(t.shape, s, mesh_shape) for t, s in zip(in_infos, ins)):
            continue
        if not all(spec_fits(t.shape, s, mesh_shape) for t, s in zip(out_infos, outs)):
            continue
        out.append(Strategy(ins, outs, kernel(combo) if kernel else None,
                            work_fraction(ins, outs, mesh_shape)))
    return out


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


_warned: set = set()


def strategies_for(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    """All strategies of ``op``; an op with no rule is replicated with one warning."""
    rule = RULES.get(op.target)
    if rule is None:
        if op.target not in _warned:
            _warned.add(op.target)
            warnings.warn(f"autoshard: no sharding rule for {op.target}; it is replicated on "
                          f"every device. First seen at: {op.source or 'unknown source'}",
                          stacklevel=2)
        return [replicate_strategy(op, mesh_shape)]
    return rule.strategies(op, mesh_shape) or [replicate_strategy(op, mesh_shape)]


def op_flops(op: OpInfo) -> float:
    rule = RULES.get(op.target)
    if rule is not None and rule.flops is not None:
        return float(rule.flops(op))
    return float(sum(t.numel for t in op.outputs))


def _local_out_shapes(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> list[tuple[int, ...]]:
    return [local_shape(t.shape, spec, mesh_shape) for t, spec in zip(op.outputs, strategy.outputs)]


def default_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                     args: tuple, kwargs: dict) -> tuple:
    """The op unchanged, except that a top-level int-list argument equal to the global shape of
    an output (a size argument: ``full``, ``new_ones``, ``expand``...) becomes that output's
    local shape. ``args``/``kwargs`` hold the rank's local tensors."""
    pairs = [(tuple(t.shape), loc) for t, loc in
             zip(op.outputs, _local_out_shapes(op, strategy, mesh_shape)) if tuple(t.shape) != loc]

    def fix(a: Any) -> Any:
        if isinstance(a, (list, tuple)) and a and all(
                isinstance(x, int) and not isinstance(x, bool) for x in a):
            for glob, loc in pairs:
                if tuple(a) == glob:
                    return list(loc)
        return a

    return op.target, tuple(fix(a) for a in args), {k: fix(v) for k, v in kwargs.items()}


def localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
             args: tuple, kwargs: dict) -> tuple:
    """``(fn, args, kwargs)`` to run ``op`` on one rank under ``strategy`` (the rule's localize,
    else :func:`default_localize`)."""
    rule = RULES.get(op.target)
    fn = rule.localize if rule is not None and rule.localize is not None else default_localize
    return fn(op, strategy, tuple(mesh_shape), tuple(coords), tuple(args), dict(kwargs))
