"""One record per ATen op: everything the planner knows about it, registered in one place.

An :class:`OpRecord` holds, for one op target:

- ``strategies``: the sharding rule, a plain function ``(op: OpInfo, mesh_shape) ->
  list[Strategy]`` giving every N-D strategy the op supports (most rules describe one mesh axis
  and let :func:`expand` take the product over axes; einsum-shaped ops come from an equation);
- ``family``: how the cost model prices it (docs/cost-model.md §3): a view costs nothing, a
  matmul or attention runs at the matmul efficiency, a gather reads rows of a table, a factory
  has no backward, everything else is elementwise;
- ``saves``: what its backward keeps alive (docs/cost-model.md §4), a :class:`Saves` or a
  function of the op giving one;
- ``follows``: whether the ILP merges it into the op that makes its input (``INPUT``: a view or
  unary op follows its one input; ``LARGEST``: a broadcasting op follows its one full-size
  input; ``NO``: a decision of its own);
- ``flops``: its whole (unsharded) forward FLOPs;
- ``localize``: how one rank calls it on its local tensors (default: the op unchanged, with every
  int-list argument equal to the global output shape replaced by the local one);
- ``collectives`` (optional): the collectives an op runs *inside* itself under a strategy, for an
  op whose local kernel must reduce across ranks before it can finish (the vocabulary-parallel
  cross-entropy's max and sum-exp, ops/loss.py). Its ``localize`` then returns a
  :class:`CollectiveKernel`, which whoever runs the op binds to its ranks; the cost model prices
  the declared collectives and the plan's ledger lists them (docs/cost-model.md §3.8).

and the facts that change an op's price beyond its family (optional, default: none), declared
with :func:`amend` next to the op's registration, so that the cost model and codegen read them
from the record and hold no table of ops of their own:

- ``specials``: special-function evaluations (exp, log, tanh, erf, ...) per element of its
  largest tensor, (forward, backward), or a function of the op giving them (docs/cost-model.md
  §3.7);
- ``bias``: a matmul's additive input broadcast over its rows, by position (its gradient is a
  sum over the rows, one more kernel in backward);
- ``logits``: a cross-entropy priced by passes over its logits (§3.9), whose backward holds one
  more logits-sized tensor while it runs;
- ``grad``: how backward makes its inputs' gradients where the family does not say (the
  liveness walk, cost/liveness.py): :data:`PASSES` hands the output's gradient to each input of
  its size, :data:`WIDENS` (a view) makes a new input-sized one;
- ``one_factor``: a product, whose backward keeps one factor only for the other's gradient;
- ``workspace``: the bytes a rank's kernel holds while it runs beyond its inputs, outputs and
  saved tensors, ``(forward, backward)``, a function of the op, the strategy and the mesh
  (ring attention's visiting K/V blocks and fp32 accumulators; the liveness walk's peak);
- ``kernels``: the ATen ops it dispatches to at run time where they differ from itself (what
  torch's selective checkpointing policy sees, codegen/recompute.py).

Adding an op is one :func:`register_op` call plus one validation sample in tests/test_rules.py;
every part of the rule is a required argument. Ops with no record are replicated, with one warning per op
naming it and the model's source line, and priced as elementwise ops that save every input.
"""
from __future__ import annotations

import itertools
import operator
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, Union

import torch

from autoshard.ir import (OpInfo, Phase, Replicate, Shard, Strategy, local_shape, spec_fits,
                          work_fraction)

aten = torch.ops.aten

RuleFn = Callable[[OpInfo, tuple], list]
LocalizeFn = Callable[..., tuple]   # (op, strategy, mesh_shape, coords, args, kwargs) -> (fn, args, kwargs)
FlopsFn = Callable[[OpInfo], float]
CollectivesFn = Callable[[OpInfo, Strategy, tuple], tuple]   # -> tuple[OpCollective, ...]
# (local tensor, "sum" | "max", backward=False): ``backward`` for a reduction the op's backward
# runs (the ledger's phase, the plan's record of that phase)
Reduce = Callable[..., torch.Tensor]

# Families (docs/cost-model.md §3).
VIEW, MATMUL, ATTENTION, GATHER = "view", "matmul", "attention", "gather"
FACTORY = "factory"          # builds a tensor from sizes or another's shape: no gradient flows
ELEMENTWISE = "elementwise"  # elementwise ops, reductions, norms, copies, losses
FAMILIES = (VIEW, MATMUL, ATTENTION, GATHER, FACTORY, ELEMENTWISE)

# How an op joins the ILP (solver/build.py).
NO, INPUT, LARGEST = "no", "input", "largest"
FOLLOWS = (NO, INPUT, LARGEST)
# How backward makes an op's input gradients, where the family does not say (``grad``).
PASSES, WIDENS = "passes", "widens"
# Families whose outputs selective checkpointing stores (their outputs are what is costly to
# recompute: Korthikanti et al. 2022, §5); the pricing and the rank program read this alike.
STORED_FAMILIES = (MATMUL, ATTENTION)


@dataclass(frozen=True, slots=True)
class Saves:
    """What an op keeps alive for backward, independent of the strategy.

    ``inputs``/``outputs`` are positions in ``op.inputs``/``op.outputs``. ``extra`` lists buffers
    that are not graph tensors, each ``(side, index, per, nbytes)``: ``nbytes`` for every element
    (``per="elem"``) or every row (``per="row"``, rows = all dims but the last) of that tensor;
    ``nbytes=0`` means the tensor's own itemsize.
    """

    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    extra: tuple[tuple[str, int, str, int], ...] = ()


NOTHING = Saves()
SavesFn = Callable[[OpInfo], Saves]


@dataclass(frozen=True, slots=True)
class OpCollective:
    """One collective an op runs inside itself: ``kind`` over mesh axis ``axis`` moving
    ``nbytes`` (S of docs/cost-model.md §1.1, per rank), in the order the kernel runs them;
    ``phase``: the pass that runs it ("forward" or "backward"); ``joint``: the axes of a
    collective over their joint group (ascending, ``axis`` first; empty for one axis);
    ``hides``: the share of the op's compute in that pass that runs beside it (ring attention's
    hops, each behind one step's block compute: docs/cost-model.md §3.11); 0: blocking."""

    kind: str
    axis: int
    nbytes: int
    phase: Phase = Phase.FORWARD
    joint: tuple[int, ...] = ()
    hides: float = 0.0


class CollectiveKernel:
    """A local kernel that reduces across ranks before it can finish: ``fn(reduce, *args,
    **kwargs)``, where ``reduce(x, op)`` all-reduces ``x`` with ``op`` ("sum" or "max") over the
    mesh ``axes``, one axis after the other (``reduce(x, op, backward=True)`` from the backward
    of an autograd function the kernel applies: SyncBatchNorm's, ops/batch_norm.py). The op's
    rule cannot reach process groups (ops/ sits below codegen/), so whoever runs the op binds
    ``reduce``: codegen to the rank's groups and its ledger, the mesh simulator
    (ops/simulate.py) to the other simulated ranks.
    ``eval_op``: the ATen op that computes the same from the same local arguments once their
    training flag is off (batch norm's running statistics need no reduction), which
    ``pm.eval()``'s program runs instead (codegen/modes.py); None where eval mode changes
    nothing."""

    def __init__(self, fn: Callable[..., Any], axes: tuple[int, ...], name: str,
                 eval_op: Any = None) -> None:
        self.fn, self.axes, self.__name__, self.eval_op = fn, tuple(axes), name, eval_op

    def bind(self, reduce: Reduce) -> Callable[..., Any]:
        """The kernel with its reductions bound: a plain function of the local tensors."""
        def run(*args: Any, **kwargs: Any) -> Any:
            return self.fn(reduce, *args, **kwargs)
        run.__name__ = self.__name__
        return run

    def __repr__(self) -> str:
        return self.__name__


def all_inputs(op: OpInfo) -> Saves:
    """Every tensor input: the safe side for an op whose derivative needs its operands."""
    return Saves(inputs=tuple(range(len(op.inputs))))


def all_but_first(op: OpInfo) -> Saves:
    """Every input but the first: a mask, an index or a target, not the data."""
    return Saves(inputs=tuple(range(1, len(op.inputs))))


def per_output_element(op: OpInfo) -> float:
    """One FLOP per output element: the count for elementwise ops and copies."""
    return float(sum(t.numel for t in op.outputs))


@dataclass(frozen=True, slots=True)
class OpRecord:
    """Everything the planner knows about one op (see the module docstring)."""

    strategies: RuleFn
    family: str
    saves: Union[Saves, SavesFn]
    follows: str
    flops: FlopsFn
    localize: LocalizeFn
    collectives: CollectivesFn | None = None
    # Facts that change the price (see the module docstring; :func:`amend`).
    specials: tuple[int, int] | Callable[[OpInfo], tuple[int, int]] = (0, 0)
    bias: int = -1
    logits: bool = False
    grad: str = ""
    one_factor: bool = False
    kernels: tuple = ()
    workspace: Callable[[OpInfo, Strategy, tuple], tuple[int, int]] | None = None

    def __post_init__(self) -> None:
        assert self.family in FAMILIES, f"family is one of {FAMILIES}; got {self.family!r}"
        assert self.follows in FOLLOWS, f"follows is one of {FOLLOWS}; got {self.follows!r}"
        assert self.grad in ("", PASSES, WIDENS), f"grad is {PASSES!r} or {WIDENS!r}"

    def saved(self, op: OpInfo) -> Saves:
        return self.saves(op) if callable(self.saves) else self.saves

    def specials_of(self, op: OpInfo) -> tuple[int, int]:
        """Special-function evaluations per element of the op's largest tensor (fwd, bwd)."""
        return self.specials(op) if callable(self.specials) else self.specials


RECORDS: dict[Any, OpRecord] = {}


def register_op(*targets: Any, strategies: RuleFn, family: str, saves: Union[Saves, SavesFn],
                follows: str, flops: FlopsFn, localize: LocalizeFn | None = None,
                collectives: CollectivesFn | None = None) -> None:
    """Register everything about ``targets`` at once (one record each)."""
    record = OpRecord(strategies, family, saves, follows, flops, localize or default_localize,
                      collectives)
    global _stored
    for t in targets:
        assert t not in RECORDS, f"{t} is registered twice"
        RECORDS[t] = record
    _stored = None


def amend(*targets: Any, **facts: Any) -> None:
    """Add price facts (fields of :class:`OpRecord` after ``collectives``) to the records of the
    registered ``targets``."""
    global _stored
    for t in targets:
        assert t in RECORDS, f"{t} is not registered"
        RECORDS[t] = replace(RECORDS[t], **facts)
    _stored = None


def stored_kernels() -> frozenset:
    """The ATen ops whose outputs selective checkpointing stores: every op of a
    :data:`STORED_FAMILIES` record and the kernels it dispatches to."""
    global _stored
    if _stored is None:
        _stored = frozenset(op for t, r in RECORDS.items() if r.family in STORED_FAMILIES
                            for op in (t, *r.kernels))
    return _stored


_stored: frozenset | None = None        # stored_kernels(), until a record changes


def _replicated(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    return [replicate_strategy(op, mesh_shape)]


def record_of(target: Any) -> OpRecord:
    """The op's record; an op without one is replicated, elementwise and saves every input."""
    if target is operator.getitem:      # picks one output of a multi-output op: no kernel
        return TUPLE_ITEM
    return RECORDS.get(target, UNREGISTERED)


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


_warned: set = set()


def strategies_for(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    """All strategies of ``op``; an op with no record is replicated with one warning."""
    record = RECORDS.get(op.target)
    if record is None:
        if op.target not in _warned:
            _warned.add(op.target)
            warnings.warn(f"autoshard: no sharding rule for {op.target}; it is replicated on "
                          f"every device. First seen at: {op.source or 'unknown source'}",
                          stacklevel=2)
        return [replicate_strategy(op, mesh_shape)]
    out = record.strategies(op, mesh_shape) or [replicate_strategy(op, mesh_shape)]
    if any(t.groups for t in (*op.inputs, *op.outputs)) and record.family in STRIDED_FAMILIES:
        out = list(dict.fromkeys(out + strided_variants(op, out, mesh_shape)))
    return out


# Families whose kernels compute element by element along a kept dim (or contract it whole),
# whatever order its elements come in: a strided shard passes through them as a contiguous one.
STRIDED_FAMILIES = (VIEW, MATMUL, ELEMENTWISE)

# Local kernels that read which elements of a dim a rank holds from the strategy's specs, strided
# ones included (the losses' row kernels pick the rank's rows of a whole target, ops/loss.py):
# their strided variants run them unchanged.
ORDER_FREE_KERNELS = ("loss_rows", "vocab_parallel")


def strided_variants(op: OpInfo, strategies: Sequence[Strategy],
                     mesh_shape: tuple) -> list[Strategy]:
    """The strategies again with strided shards (ir.py ``Shard``) on the dims the model splits
    into groups (``TensorInfo.groups``, trace/fused.py), for ops whose dims pass through
    element by element.

    On a mesh axis where every tensor the strategy shards is marked with the same groups on the
    sharded dim, each of those shards becomes strided with them: the local kernel is the same
    (``kernel``-less strategies only, whose local call does not depend on which elements a rank
    holds, or one of ``ORDER_FREE_KERNELS``), and element ``i`` of one tensor's dim still meets
    element ``i`` of the others'."""
    marks = [dict(t.groups) for t in (*op.inputs, *op.outputs)]
    out: list[Strategy] = []
    for st in strategies:
        if st.kernel is not None and st.kernel not in ORDER_FREE_KERNELS:
            continue
        specs = [list(sp) if sp is not None else None for sp in (*st.inputs, *st.outputs)]
        changed = False
        for a in range(len(mesh_shape)):
            if mesh_shape[a] == 1:        # one device holds every group whole: nothing to vary
                continue
            shards = [(i, sp[a]) for i, sp in enumerate(specs)
                      if sp is not None and isinstance(sp[a], Shard) and not sp[a].groups]
            groups = {marks[i].get(p.dim) for i, p in shards}
            if shards and len(groups) == 1 and None not in groups:
                g = groups.pop()
                for i, p in shards:
                    specs[i][a] = Shard(p.dim, g)
                changed = True
        if not changed:
            continue
        ins = tuple(tuple(sp) if sp is not None else None for sp in specs[:len(st.inputs)])
        outs = tuple(tuple(sp) for sp in specs[len(st.inputs):])
        infos = (*op.inputs, *op.outputs)
        if all(sp is None or spec_fits(t.shape, sp, mesh_shape)
               for t, sp in zip(infos, (*ins, *outs))):
            out.append(Strategy(ins, outs, st.kernel, st.compute_scale))
    return out


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


def op_collectives(op: OpInfo, strategy: Strategy, mesh_shape: tuple) -> tuple[OpCollective, ...]:
    """The collectives ``op`` runs inside itself under ``strategy`` (most ops: none)."""
    fn = record_of(op.target).collectives
    return tuple(fn(op, strategy, tuple(mesh_shape))) if fn is not None else ()


def localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
             args: tuple, kwargs: dict) -> tuple:
    """``(fn, args, kwargs)`` to run ``op`` on one rank under ``strategy``."""
    fn = record_of(op.target).localize
    return fn(op, strategy, tuple(mesh_shape), tuple(coords), tuple(args), dict(kwargs))


# An op without a record: replicated, priced as an elementwise op that saves every input (the
# safe side for memory). getitem picks an output of a multi-output op: no kernel runs.
UNREGISTERED = OpRecord(_replicated, ELEMENTWISE, all_inputs, NO, per_output_element,
                        default_localize)
TUPLE_ITEM = OpRecord(_replicated, VIEW, NOTHING, NO, per_output_element, default_localize)
