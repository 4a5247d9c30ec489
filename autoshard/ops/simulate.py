"""A single-process simulator of a device mesh: shard tensors, run one op per rank, reassemble.

Used to validate every rule against single-device execution (as DTensor's strategy validation does), and reusable
by codegen to build local shards. Ranks are addressed by their coordinates on the mesh.

Conventions (DTensor's): ``Shard(d)`` holds a slice of dim ``d`` (several axes on one dim split it
row-major, the first axis outermost); ``Replicate`` a full copy; ``Partial`` a summand. Gradients
follow their tensor's placement, a Partial tensor's gradient being replicated.
"""
from __future__ import annotations

import functools
import itertools
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.ir import (OpInfo, Partial, Replicate, Shard, Spec, Strategy, divergent_axes,
                          local_shape, op_info, to_group_major, to_rank_major)
from autoshard.ops.registry import CollectiveKernel, localize
from autoshard.ops.ring import RingKernel

Coords = tuple[int, ...]


def all_coords(mesh_shape: Sequence[int]) -> list[Coords]:
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _summand(t: torch.Tensor, n: int, c: int, seed: int | None, axis: int) -> torch.Tensor:
    if seed is None or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return t.clone() if c == 0 else torch.zeros_like(t)
    g = torch.Generator().manual_seed(seed * 1009 + axis)
    noise = torch.randn((n, *t.shape), generator=g, dtype=t.dtype)
    noise = noise - noise.mean(0, keepdim=True)  # summands differ, yet sum to t
    return t / n + noise[c].to(t.device)


def shard_tensor(full: torch.Tensor, spec: Spec, mesh_shape: Sequence[int], coords: Sequence[int],
                 *, seed: int | None = None) -> torch.Tensor:
    """The local tensor of rank ``coords``.

    A Partial axis gives the whole value to coordinate 0 and zeros elsewhere, or, with ``seed``,
    a random split (floating tensors): summands that differ per rank, so that a rule treating a
    non-linear op as linear fails validation.
    """
    assert len(spec) == len(mesh_shape) == len(coords), (spec, mesh_shape, coords)
    t = full
    for a, (p, n, c) in enumerate(zip(spec, mesh_shape, coords)):
        if isinstance(p, Shard):
            assert t.shape[p.dim] % n == 0, f"dim {p.dim} of {tuple(t.shape)} does not split {n} ways"
            # strided: this rank's piece of every group (ir.py), in group order
            t = to_rank_major(t, p.dim, n, p.groups).chunk(n, p.dim)[c]
        elif isinstance(p, Partial):
            t = _summand(t, n, c, seed, a)
    return t.contiguous()


def unshard(locals_by_coords: dict[Coords, torch.Tensor], spec: Spec, mesh_shape: Sequence[int],
            *, rtol: float = 1e-6, atol: float = 1e-8, check: bool = True) -> torch.Tensor:
    """The full tensor from every rank's local tensor; Replicate copies must agree (``check``;
    off for uninitialised values such as ``empty``'s)."""
    cur = {tuple(k): v for k, v in locals_by_coords.items()}
    for a in reversed(range(len(mesh_shape))):
        p, n = spec[a], mesh_shape[a]
        nxt: dict[Coords, torch.Tensor] = {}
        for key in cur:
            if key[a] != 0:
                continue
            pieces = [cur[key[:a] + (c,) + key[a + 1:]] for c in range(n)]
            if isinstance(p, Shard):
                nxt[key] = to_group_major(torch.cat(pieces, p.dim), p.dim, n, p.groups)
            elif isinstance(p, Partial):
                nxt[key] = sum(pieces[1:], pieces[0])
            else:
                for c, x in enumerate(pieces[1:], 1):
                    if x.shape != pieces[0].shape or check and not _close(x, pieces[0], rtol, atol):
                        raise AssertionError(f"replicas disagree on mesh axis {a}: coordinate {c} "
                                             f"differs from coordinate 0 (spec {spec})")
                nxt[key] = pieces[0]
        cur = nxt
    (out,) = cur.values()
    return out


def _close(x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float) -> bool:
    if x.dtype.is_floating_point or x.dtype.is_complex:
        return torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
    return torch.equal(x, y)


def grad_spec(spec: Spec) -> Spec:
    """The placement of a tensor's gradient: a Partial tensor's gradient is replicated."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)


def _swap_tensors(args: tuple, kwargs: dict, new: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    it = iter(new)
    flat = [next(it) if isinstance(a, torch.Tensor) else a for a in flat]
    a, k = tree_unflatten(flat, spec)
    return tuple(a), dict(k)


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _differentiable(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def call_on_copies(fn: Any, args: tuple, kwargs: dict) -> Any:
    """``fn`` on copies of its tensor arguments. An in-place op (``add_``, ``copy_``) must write
    neither into the caller's tensors nor into another rank's (a replicated local tensor shares
    the whole one's storage), and autograd refuses in-place ops on leaves; a copy is a
    differentiable non-leaf, so gradients still reach the originals. A random draw runs from one
    generator state at every call, the single device's and each rank's: ranks seeded alike draw
    alike (ops/factory.py)."""
    copies = [t.clone() for t in _tensors((args, kwargs))]
    a, k = _swap_tensors(args, kwargs, copies)
    if torch.Tag.nondeterministic_seeded not in getattr(fn, "tags", ()):
        return fn(*a, **k)
    with torch.random.fork_rng(devices=()):
        torch.manual_seed(0)
        return fn(*a, **k)


@dataclass
class SimResult:
    outputs: list[torch.Tensor]               # reassembled, one per tensor output
    grads: list[torch.Tensor | None] | None   # reassembled, one per tensor input (None: no grad)


def run_strategy(op_target: Any, args: tuple, kwargs: dict, strategy: Strategy,
                 mesh_shape: Sequence[int], *, grad_outputs: Sequence[torch.Tensor | None] | None = None,
                 grad_inputs: Sequence[bool] | None = None, op: OpInfo | None = None,
                 seed: int | None = 0, rtol: float = 1e-6, atol: float = 1e-8,
                 check_replicas: bool = True) -> SimResult:
    """Run ``op_target`` on every rank's local inputs under ``strategy`` and reassemble.

    With ``grad_outputs`` (the whole output gradients), also run autograd per rank: seed each
    local output gradient in its convention, sum each input's local gradient over its divergent
    axes (the all-reduce the planner inserts), and reassemble the input gradients of the tensor
    inputs flagged in ``grad_inputs`` (default: every floating one).
    """
    mesh_shape = tuple(mesh_shape)
    if op is None:
        op = op_info(op_target, args, kwargs, call_on_copies(op_target, args, kwargs))
    full_ins = _tensors((args, kwargs))
    assert len(full_ins) == len(strategy.inputs), "one spec per tensor input"
    if grad_inputs is None:
        grad_inputs = [_differentiable(t) for t in full_ins]
    coords_list = all_coords(mesh_shape)
    backward = grad_outputs is not None
    local_outs: dict[Coords, list[torch.Tensor]] = {}
    local_grads: dict[Coords, list[torch.Tensor | None]] = {}
    local_ins: dict[Coords, list[torch.Tensor]] = {}
    calls: dict[Coords, tuple] = {}
    for coords in coords_list:
        ins = [shard_tensor(t.detach(), s, mesh_shape, coords,
                            seed=None if seed is None else seed + 31 * i)
               for i, (t, s) in enumerate(zip(full_ins, strategy.inputs))]
        if backward:
            ins = [t.requires_grad_() if want else t for t, want in zip(ins, grad_inputs)]
        largs, lkwargs = _swap_tensors(args, kwargs, ins)
        local_ins[coords] = ins
        calls[coords] = localize(op, strategy, mesh_shape, coords, largs, lkwargs)
    all_outs = _run_ranks(calls)
    for coords in coords_list:
        outs = _tensors(all_outs[coords])
        assert len(outs) == len(strategy.outputs), f"{len(outs)} outputs, {len(strategy.outputs)} specs"
        local_outs[coords] = [o.detach() for o in outs]
    if backward:
        def grads_of(c: Coords) -> list:
            return _local_backward(local_ins[c], _tensors(all_outs[c]), grad_outputs, strategy,
                                   mesh_shape, c)
        # A ring kernel's backward passes blocks between ranks too, and a collective kernel's
        # may reduce across them (SyncBatchNorm's): every rank's at once.
        if any(isinstance(fn, (RingKernel, CollectiveKernel)) for fn, _, _ in calls.values()):
            local_grads.update(_threads({c: functools.partial(grads_of, c)
                                         for c in coords_list}, None))
        else:
            local_grads.update({c: grads_of(c) for c in coords_list})
    outputs = [unshard({c: local_outs[c][j] for c in coords_list}, s, mesh_shape, rtol=rtol,
                       atol=atol, check=check_replicas) for j, s in enumerate(strategy.outputs)]
    grads = None
    if backward:
        grads = [_reassemble_grad(i, s, strategy, local_grads, mesh_shape, full_ins[i], rtol, atol)
                 for i, s in enumerate(strategy.inputs)]
    return SimResult(outputs, grads)


def _run_ranks(calls: dict[Coords, tuple]) -> dict[Coords, Any]:
    """Every rank's localized call. A :class:`CollectiveKernel` reduces across ranks inside the
    op (its reductions met in lockstep, :class:`LockstepReduce`), a :class:`RingKernel` passes
    blocks around a ring (:class:`SimRing`), so those ranks run at once, one thread each; other
    ops run one rank after the other."""
    kinds = (CollectiveKernel, RingKernel)
    if not any(isinstance(fn, kinds) for fn, _, _ in calls.values()):
        return {c: call_on_copies(fn, a, k) for c, (fn, a, k) in calls.items()}
    sync, ring = LockstepReduce(list(calls)), SimRing()
    grad = torch.is_grad_enabled()              # grad mode is per thread

    def job(coords: Coords, fn: Any, a: tuple, k: dict) -> Any:
        with torch.set_grad_enabled(grad):
            if isinstance(fn, CollectiveKernel):
                fn = fn.bind(sync.reduce_for(coords, fn.axes))
            elif isinstance(fn, RingKernel):
                fn = fn.bind(ring.of(coords, fn.axes, list(calls)))
            return call_on_copies(fn, a, k)

    return _threads({c: functools.partial(job, c, *call) for c, call in calls.items()},
                    sync.barrier)


def _threads(jobs: dict[Coords, Any], barrier: threading.Barrier | None) -> dict[Coords, Any]:
    """Run every rank's job in a thread of its own; the first error is raised once all end (a
    failing rank breaks ``barrier`` to let the others out of their wait)."""
    outs: dict[Coords, Any] = {}
    errors: list[BaseException] = []

    def run(coords: Coords, fn: Any) -> None:
        try:
            outs[coords] = fn()
        except BaseException as e:
            errors.append(e)
            if barrier is not None:
                barrier.abort()

    threads = [threading.Thread(target=run, args=(c, fn)) for c, fn in jobs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)),
                     errors[0])
        raise first
    return outs


class SimRing:
    """Point-to-point shifts among simulated ranks in threads (ops/ring.py ``Ring``): a rank's
    k-th shift posts its tensors, and its wait takes the previous rank's k-th (every rank of a
    ring makes the same shifts in the same order). The ring of ``axes`` is the ranks that
    differ only there, in row-major order of their coordinates over those axes."""

    TIMEOUT_S = 60.0

    def __init__(self) -> None:
        self.box: dict[tuple, list[torch.Tensor]] = {}
        self.cond = threading.Condition()

    def of(self, coords: Coords, axes: tuple[int, ...], everyone: list[Coords]):
        ring = sorted((c for c in everyone
                       if all(c[a] == coords[a] for a in range(len(coords)) if a not in axes)),
                      key=lambda c: tuple(c[a] for a in axes))
        me = ring.index(coords)
        prev = ring[(me - 1) % len(ring)]
        shifts = itertools.count()
        sim = self

        class Pending:
            def __init__(self, k: int) -> None:
                self.k = k

            def wait(self) -> list[torch.Tensor]:
                with sim.cond:
                    if not sim.cond.wait_for(lambda: (prev, self.k) in sim.box, sim.TIMEOUT_S):
                        raise TimeoutError(f"rank {coords}: shift {self.k} never came from {prev}")
                    return [t.clone() for t in sim.box.pop((prev, self.k))]

        class Transport:
            @staticmethod
            def shift(tensors, backward: bool, channel: int = 0) -> Pending:
                k = next(shifts)
                with sim.cond:
                    sim.box[(coords, k)] = [t.detach().clone() for t in tensors]
                    sim.cond.notify_all()
                return Pending(k)

        return Transport()


class LockstepReduce:
    """All-reduces among simulated ranks running in threads. Every rank makes the same
    reductions in the same order; the k-th waits until every rank has posted its k-th, then
    combines those of its group (the ranks that differ from it only on the reduced axes), in
    coordinate order, so every member computes the same value."""

    TIMEOUT_S = 60.0        # a rank that fails outside a reduction leaves the others waiting

    def __init__(self, coords: list[Coords]) -> None:
        self.barrier = threading.Barrier(len(coords), timeout=self.TIMEOUT_S)
        self.posted: dict[int, dict[Coords, torch.Tensor]] = {}
        self.lock = threading.Lock()

    def reduce_for(self, coords: Coords, axes: tuple[int, ...]):
        calls = itertools.count()

        def reduce(x: torch.Tensor, how: str, backward: bool = False) -> torch.Tensor:
            k = next(calls)
            with self.lock:
                self.posted.setdefault(k, {})[coords] = x.detach()
            self.barrier.wait()
            group = [v for c, v in sorted(self.posted[k].items())
                     if all(c[a] == coords[a] for a in range(len(coords)) if a not in axes)]
            if how == "max":
                return torch.stack(group).amax(0)
            assert how == "sum", how
            return sum(group[1:], group[0].clone())

        return reduce


def _local_backward(ins, outs, grad_outputs, strategy, mesh_shape, coords) -> list:
    pairs = [(o, shard_tensor(g, grad_spec(s), mesh_shape, coords))
             for o, g, s in zip(outs, grad_outputs, strategy.outputs)
             if g is not None and o.requires_grad]
    wants = [t for t in ins if t.requires_grad]
    if not pairs or not wants:
        return [None] * len(ins)
    got = iter(torch.autograd.grad([o for o, _ in pairs], wants, [g for _, g in pairs],
                                   allow_unused=True))
    return [next(got) if t.requires_grad else None for t in ins]


def _reassemble_grad(i, spec, strategy, local_grads, mesh_shape, full, rtol, atol):
    coords_list = list(local_grads)
    if all(local_grads[c][i] is None for c in coords_list):
        return None
    local = {c: local_grads[c][i] if local_grads[c][i] is not None else
             torch.zeros(local_shape(tuple(full.shape), spec, mesh_shape), dtype=full.dtype)
             for c in coords_list}
    axes = set()
    for out_spec in strategy.outputs:
        axes |= divergent_axes(spec, out_spec)
    if axes:  # the all-reduce of a partial local gradient over each divergent axis
        summed = {}
        for c in coords_list:
            group = [c2 for c2 in coords_list
                     if all(c2[a] == c[a] for a in range(len(c)) if a not in axes)]
            summed[c] = sum((local[c2] for c2 in group[1:]), local[group[0]])
        local = summed
    return unshard(local, grad_spec(spec), mesh_shape, rtol=rtol, atol=atol)


@dataclass
class Mismatch:
    what: str          # "output 0", "grad of input 1"
    detail: str


def check_strategy(op_target: Any, args: tuple, kwargs: dict, strategy: Strategy,
                   mesh_shape: Sequence[int], *, rtol: float = 1e-5, atol: float = 1e-8,
                   backward: bool = True, compare_values: bool = True, seed: int = 0,
                   no_grad: Sequence[int] = ()) -> list[Mismatch]:
    """Compare ``strategy`` with the single-device op: outputs and, with ``backward``, the
    gradient of every differentiable input (but the tensor inputs listed in ``no_grad``).
    Returns the mismatches (empty: the rule holds)."""
    full_ins = _tensors((args, kwargs))
    leaves = [t.detach().requires_grad_() if backward and _differentiable(t) and i not in no_grad
              else t.detach() for i, t in enumerate(full_ins)]
    gargs, gkwargs = _swap_tensors(args, kwargs, leaves)
    ref = _tensors(call_on_copies(op_target, gargs, gkwargs))
    op = op_info(op_target, args, kwargs, ref)
    grad_outputs = None
    ref_grads: list[torch.Tensor | None] = [None] * len(leaves)
    if backward:
        g = torch.Generator().manual_seed(seed + 7)
        grad_outputs = [torch.randn(o.shape, generator=g, dtype=o.dtype) if o.requires_grad else None
                        for o in ref]
        diff = [(o, go) for o, go in zip(ref, grad_outputs) if go is not None]
        wants = [t for t in leaves if t.requires_grad]
        if diff and wants:
            got = iter(torch.autograd.grad([o for o, _ in diff], wants, [go for _, go in diff],
                                           allow_unused=True))
            ref_grads = [next(got) if t.requires_grad else None for t in leaves]
        else:
            grad_outputs = None
    res = run_strategy(op_target, args, kwargs, strategy, mesh_shape, grad_outputs=grad_outputs,
                       grad_inputs=[t.requires_grad for t in leaves], op=op, seed=seed,
                       rtol=rtol, atol=atol, check_replicas=compare_values)
    bad: list[Mismatch] = []
    for j, (got, want) in enumerate(zip(res.outputs, ref)):
        bad += _compare(f"output {j}", got, want.detach(), rtol, atol, compare_values)
    for i, want in enumerate(ref_grads):
        if want is None:
            continue
        got = res.grads[i] if res.grads is not None else None
        if got is None:
            got = torch.zeros_like(want)
        bad += _compare(f"grad of input {i}", got, want, rtol, atol, True)
    return bad


def _compare(what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float,
             values: bool) -> list[Mismatch]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return [Mismatch(what, f"shape/dtype {tuple(got.shape)} {got.dtype}, "
                               f"want {tuple(want.shape)} {want.dtype}")]
    if values and not _close(got, want, rtol, atol):
        err = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        return [Mismatch(what, f"max abs error {err:.3g}")]
    return []
