"""Runtime collectives on real gloo worlds (Tier 2): forward values, gradients and measured bytes.

For every src -> dst spec pair on meshes (2,), (4,) and (2, 2) (nested sharding, Partial sources
and targets, divergent axes), each rank builds its local input from one global tensor, runs
``redistribute`` and checks:

- forward: the output is the dst spec's local view of the global tensor (summed over dst's
  Partial axes first, since any summands that add up are a valid Partial);
- backward: given the global grad in the dst convention (a different summand per rank on
  divergent axes), the input's grad is the src convention's view of the true grad;
- the ledger: exactly ``Reshard.collectives``, in order, each with measured bytes == Step.nbytes.

All values are small integers held in floating point, so every sum is exact and comparisons are
``torch.equal`` (no tolerance needed).
"""
from __future__ import annotations

import itertools
import math
import time
import traceback

import pytest
import torch
import torch.distributed as tdist

from autoshard.codegen.collectives import Ledger, redistribute
from autoshard.codegen.groups import MeshGroups
from autoshard.cost.comm import Reshard, Step, reshard
from autoshard.errors import AutoshardError
from autoshard.ir import Partial, R, S, Shard, Spec, parse_spec, spec_str
from autoshard.mesh import Mesh

try:
    from dist import RankCrash, RankError, world_fixture
except ImportError:  # tests/ turned into a package
    from tests.dist import RankCrash, RankError, world_fixture

SHAPE = (12, 4, 20)         # odd-ish sizes, each divisible by 4 (nested 2x2 sharding)
PLACEMENTS = (R, Partial(), S(0), S(1), S(2))

world2 = world_fixture(2, grace_s=1.0)
world4 = world_fixture(4)


# ---------------------------------------------------------------------------------------------
# Building local tensors from global ones (runs on every rank; pure functions of coords).
# ---------------------------------------------------------------------------------------------

def _value_spec(spec: Spec) -> Spec:
    """The spec of the summed value / of a gradient: Partial reads as Replicate."""
    return tuple(R if isinstance(p, Partial) else p for p in spec)


def local_view(x: torch.Tensor, spec: Spec, mesh_shape: tuple[int, ...],
               coords: tuple[int, ...]) -> torch.Tensor:
    """This rank's shard: a dim sharded on several axes is split row-major, axis 0 outermost."""
    for d in range(x.dim()):
        idx, n = 0, 1
        for a, p in enumerate(spec):
            if p == Shard(d):
                idx, n = idx * mesh_shape[a] + coords[a], n * mesh_shape[a]
        x = x.chunk(n, dim=d)[idx]
    return x


def summand(x: torch.Tensor, axes: list[int], mesh_shape: tuple[int, ...],
            coords: tuple[int, ...], seed: int) -> torch.Tensor:
    """This rank's part of ``x`` when ``x`` is the sum over ``axes`` (all ranks agree)."""
    combos = list(itertools.product(*(range(mesh_shape[a]) for a in axes)))
    gen = torch.Generator().manual_seed(seed)
    parts = [torch.randint(-4, 5, x.shape, generator=gen).to(x.dtype) for _ in combos[1:]]
    parts.insert(0, x - sum(parts, torch.zeros_like(x)))
    return parts[combos.index(tuple(coords[a] for a in axes))]


def _rand(seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(-8, 9, SHAPE, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _specs(ndim: int) -> list[Spec]:
    return list(itertools.product(PLACEMENTS, repeat=ndim))


def _divergent_choices(dst: Spec) -> list[frozenset[int]]:
    """No divergence, and every non-empty set of dst's Replicate axes (only they can diverge)."""
    rep = [a for a, p in enumerate(dst) if p == R]
    return [frozenset(c) for k in range(len(rep) + 1) for c in itertools.combinations(rep, k)]


# ---------------------------------------------------------------------------------------------
# Worker functions (module level: they pickle by reference into the World's ranks).
# ---------------------------------------------------------------------------------------------

_GROUPS: dict[tuple, MeshGroups] = {}


def _groups(mesh_shape: tuple[int, ...], axes: tuple[str, ...]) -> MeshGroups:
    key = (mesh_shape, axes)
    if key not in _GROUPS:                 # creating subgroups is collective and not free
        _GROUPS[key] = MeshGroups.from_mesh(Mesh(mesh_shape, axes))
    return _GROUPS[key]


def _check_case(groups: MeshGroups, src: Spec, dst: Spec, divergent: frozenset[int],
                dtype: torch.dtype, seed: int) -> tuple[list[str], Ledger]:
    plan = reshard(src, dst, SHAPE, torch.empty((), dtype=dtype).element_size(), groups.shape,
                   divergent)
    return check_redistribution(groups, plan, src, dst, divergent, _rand(seed, dtype),
                                _rand(seed + 1, dtype), seed)


def check_redistribution(groups: MeshGroups, plan: Reshard, src: Spec, dst: Spec,
                         divergent: frozenset[int], X: torch.Tensor, GY: torch.Tensor,
                         seed: int) -> tuple[list[str], Ledger]:
    """Run ``plan`` (``src`` -> ``dst``) on this rank's piece of ``X`` and backward from its piece
    of ``GY``: the problems found (value, gradient, the ledger against the plan's collectives,
    each over its axes' group with its size) and the ledger."""
    ms, coords = groups.shape, groups.coords
    src_p = [a for a, p in enumerate(src) if isinstance(p, Partial)]
    x = local_view(summand(X, src_p, ms, coords, seed + 2), _value_spec(src), ms, coords)
    x = x.clone().requires_grad_()
    ledger = Ledger()
    y = redistribute(x, plan, groups, ledger=ledger, node="n")
    bad: list[str] = []

    total = y.detach().clone()
    for a, p in enumerate(dst):
        if isinstance(p, Partial):
            tdist.all_reduce(total, group=groups.groups[a])
    if not torch.equal(total, local_view(X, _value_spec(dst), ms, coords)):
        bad.append("forward value")

    g = local_view(summand(GY, sorted(divergent), ms, coords, seed + 3), _value_spec(dst), ms,
                   coords)
    y.backward(g)
    if x.grad is None or not torch.equal(x.grad, local_view(GY, _value_spec(src), ms, coords)):
        bad.append("gradient")

    want = [(ph, s.kind, tuple(groups.axes[a] for a in s.axes), s.nbytes,
             math.prod(ms[a] for a in s.axes)) for ph, s in plan.collectives]
    got = [(r.phase, r.kind, r.axes, r.nbytes, r.group_size) for r in ledger]
    if got != want:
        bad.append(f"ledger {got} != planned {want}")
    if ledger.mismatches():
        bad.append(f"bytes mismatch {[str(r) for r in ledger.mismatches()]}")
    return bad, ledger


def _check_src(mesh_shape: tuple[int, ...], axes: tuple[str, ...], src_text: str,
               dtype_name: str) -> tuple[int, int, list[str]]:
    """(cases run, collectives executed, problems) for src_text -> every dst and divergence."""
    groups = _groups(mesh_shape, axes)
    src, dtype = parse_spec(src_text), getattr(torch, dtype_name)
    problems: list[str] = []
    seed = n_collectives = 0
    for dst in _specs(len(mesh_shape)):
        for div in _divergent_choices(dst):
            seed += 10
            case = f"rank {groups.rank}: {src_text} -> {spec_str(dst)} divergent {sorted(div)}"
            try:
                bad, ledger = _check_case(groups, src, dst, div, dtype, seed)
                n_collectives += len(ledger)
            except Exception:            # keep going: the other ranks run the same steps
                bad = [traceback.format_exc(limit=4)]
            problems += [f"{case}: {b}" for b in bad]
    return seed // 10, n_collectives, problems


def _ledger_of(mesh_shape: tuple[int, ...], axes: tuple[str, ...], src_text: str,
               dst_text: str, divergent: tuple[int, ...]) -> list[str]:
    groups = _groups(mesh_shape, axes)
    bad, ledger = _check_case(groups, parse_spec(src_text), parse_spec(dst_text),
                              frozenset(divergent), torch.float32, 7)
    assert not bad, bad
    return [f"{r.phase} {r.kind}[{','.join(r.axes)}]" for r in ledger]


def _wrong_plan_bytes() -> list[str]:
    groups = _groups((2,), ("x",))
    x = torch.ones(3, 4, requires_grad=True)
    plan = Reshard(forward=(Step("all_gather", 0, 1, nbytes=48),),       # truly 3*8*4 = 96
                   backward=(Step("slice", 0, 1),))
    ledger = Ledger()
    redistribute(x, plan, groups, ledger=ledger, node="fc1").sum().backward()
    return [str(r) for r in ledger.mismatches()]


def _world_size_error(mesh_shape: tuple[int, ...]) -> str:
    try:
        MeshGroups.from_mesh(Mesh(mesh_shape))
    except AutoshardError as e:
        return str(e)
    return "no error"


def _from_device_mesh(transposed: bool) -> tuple:
    from torch.distributed.device_mesh import DeviceMesh
    ranks = torch.arange(4).reshape(2, 2)
    dm = DeviceMesh("cpu", ranks.T if transposed else ranks, mesh_dim_names=("dp", "tp"))
    g = MeshGroups.from_device_mesh(dm)
    peers = tuple(tuple(tdist.get_process_group_ranks(grp)) for grp in g.groups)
    return g.axes, g.coords, peers


def _crash_rank1(marker: str | None) -> int:
    """Rank 1 dies from SIGSEGV: every time, or only while ``marker`` does not exist yet."""
    import ctypes
    import os
    if tdist.get_rank() == 1 and (marker is None or not os.path.exists(marker)):
        if marker is not None:
            open(marker, "w").close()
        ctypes.string_at(0)                           # a real segmentation fault
    return tdist.get_rank()


def _fail_on_rank1_then_barrier() -> None:
    if tdist.get_rank() == 1:
        raise ValueError("rank 1 fails on purpose")
    tdist.barrier()        # rank 0 waits here for a rank that never comes


# ---------------------------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------------------------

MESHES = [((2,), ("x",), "world2"), ((4,), ("x",), "world4"), ((2, 2), ("dp", "tp"), "world4")]
CASES = [(shape, axes, world, spec_str(src), "float64" if i % 2 else "float32")
         for shape, axes, world in MESHES for i, src in enumerate(_specs(len(shape)))]


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape, axes, world, src, dtype", CASES,
                         ids=[f"{'x'.join(map(str, c[0]))}-{c[3]}" for c in CASES])
def test_redistribute_every_dst(request, mesh_shape, axes, world, src, dtype):
    per_rank = request.getfixturevalue(world).run(_check_src, mesh_shape, axes, src, dtype)
    problems = [p for _, _, rank_problems in per_rank for p in rank_problems]
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:20])
    n_cases, n_collectives, _ = per_rank[0]
    n_dst = len(PLACEMENTS) ** len(mesh_shape)
    assert n_cases > n_dst and n_collectives > 0      # not vacuous


@pytest.mark.parametrize("src, dst, divergent, want", [
    # Megatron "f": replicated activation into column-parallel work; grad all-reduce only.
    ("[S(0), R]", "[S(0), R]", (1,), ["backward all_reduce[tp]"]),
    # Megatron "g": partial output reduced in forward, identity backward.
    ("[S(0), P]", "[S(0), R]", (), ["forward all_reduce[tp]"]),
    # ZeRO-3 parameter: gathered for use, gradient reduce-scattered over dp.
    ("[S(0), R]", "[R, R]", (0,), ["forward all_gather[dp]", "backward reduce_scatter[dp]"]),
    # Sequence parallel: reduce-scatter out, all-gather back (and the reverse on the way in).
    ("[R, P]", "[R, S(1)]", (), ["forward reduce_scatter[tp]", "backward all_gather[tp]"]),
    ("[R, S(1)]", "[R, R]", (1,), ["forward all_gather[tp]", "backward reduce_scatter[tp]"]),
    ("[S(0), S(1)]", "[S(0), S(2)]", (), ["forward all_to_all[tp]", "backward all_to_all[tp]"]),
])
def test_known_patterns(world4, src, dst, divergent, want):
    got = world4.run(_ledger_of, (2, 2), ("dp", "tp"), src, dst, divergent)
    assert got == [want] * 4


def _both_paths() -> dict:
    """Each collective run eagerly (torch.distributed's own) and as a functional collective
    (what a traced region holds), on the same inputs; and which path each took."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoshard.codegen import collectives as C
    rank, n = tdist.get_rank(), tdist.get_world_size()
    group = tdist.group.WORLD
    x = torch.arange(4 * 8 * 12, dtype=torch.float32).reshape(4, 8, 12) * (rank + 1)
    calls = [("all_gather", d, lambda d=d: C.all_gather(x, d, group)) for d in (0, 1, -1)]
    calls += [("all_reduce", op, lambda op=op: C.all_reduce(x, group, op))
              for op in ("sum", "max")]
    calls += [("reduce_scatter", d, lambda d=d: C.reduce_scatter(x, d, group)) for d in (0, 1, 2)]
    calls += [("all_to_all", (g, s), lambda g=g, s=s: C.all_to_all(x, g, s, group))
              for g, s in ((0, 1), (1, 0), (2, 1))]

    class Seen(TorchDispatchMode):        # as selective checkpointing's modes see ops
        def __init__(self) -> None:
            super().__init__()
            self.namespaces: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.namespaces.add(getattr(func, "namespace", ""))
            return func(*args, **(kwargs or {}))

    waited = []                           # every functional collective is waited on at once
    wait, tracing = C._wait, C._are_we_tracing
    C._wait = lambda t: waited.append(1) or wait(t)
    try:
        eager = [fn() for _, _, fn in calls]
        eager_functional = len(waited)
        C._are_we_tracing = lambda: True
        traced = [fn() for _, _, fn in calls]
        C._are_we_tracing = tracing
        seen = Seen()
        with seen:
            C.all_reduce(x, group)
        y = x.clone().requires_grad_()
        C.all_reduce(y, group).sum().backward()     # differentiated through: its formula
    finally:
        C._wait, C._are_we_tracing = wait, tracing
    return {"differ": [f"{kind} {arg}" for (kind, arg, _), a, b in zip(calls, eager, traced)
                       if a.shape != b.shape or not torch.equal(a, b)
                       or not a.is_contiguous()],
            "eager_functional": eager_functional, "traced_functional": len(waited) - 2,
            "under_a_mode": "_c10d_functional" in seen.namespaces,
            "grad": y.grad.unique().tolist() == [float(n)], "n": len(calls)}


def test_eager_collectives_equal_the_functional_ones(world4):
    """Run eagerly, each collective is torch.distributed's own (no functional collective's
    wrapper): the same values as the functional collective a compiled region traces, for every
    dim; under a dispatch mode (selective checkpointing stores functional collectives' outputs)
    and under autograd it is the functional one."""
    for r in world4.run(_both_paths):
        assert r["n"] == 11 and r["differ"] == []
        assert r["eager_functional"] == 0 and r["traced_functional"] == 11
        assert r["under_a_mode"] and r["grad"]


def test_ledger_reports_planned_bytes_that_differ(world2):
    mismatches = world2.run(_wrong_plan_bytes)
    assert mismatches == [["forward all_gather[x] 96 B (planned 48 B) @fc1"]] * 2


def test_from_device_mesh_follows_coordinates(world4):
    for transposed in (False, True):
        got = world4.run(_from_device_mesh, transposed)
        for rank, (axes, coords, peers) in enumerate(got):
            assert axes == ("dp", "tp")
            want = (rank % 2, rank // 2) if transposed else Mesh((2, 2)).coords(rank)
            assert coords == want
            for axis, group_ranks in enumerate(peers):       # peers differ only along axis
                assert rank in group_ranks and len(group_ranks) == 2


def test_world_size_mismatch_in_a_world(world2):
    messages = world2.run(_world_size_error, (4,))
    for m in messages:
        assert "world size 4" in m and "got world size 2" in m
        assert "torchrun --nproc-per-node 4" in m


def test_world_size_mismatch_without_a_world(monkeypatch):
    if tdist.is_initialized():
        pytest.skip("another test left a process group live in this process")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(AutoshardError, match=r"torchrun --nproc-per-node 2.*"):
        MeshGroups.from_mesh(Mesh((2,)))


# Harness behaviour; these leave world2 dead, so they run last in the module.

def test_harness_rank_error_fails_fast(world2):
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 fails on purpose") as info:
        world2.run(_fail_on_rank1_then_barrier)
    assert set(info.value.failures) == {1}
    assert time.monotonic() - t0 < world2.timeout_s / 2      # the grace period, not the timeout
    assert not world2.alive                                  # rank 0 hung: world killed


def test_harness_retries_a_crashed_rank_once(world2, tmp_path):
    with pytest.warns(RuntimeWarning, match="rank 1 died") as caught:
        assert world2.run(_crash_rank1, str(tmp_path / "crashed")) == [0, 1]
    report = str(caught[0].message)
    assert "Segmentation fault" in report and "_crash_rank1" in report   # faulthandler's trace
    assert len(world2.crashes) == 1 and world2.alive


def test_harness_crash_that_repeats_fails(world2):
    with pytest.warns(RuntimeWarning), pytest.raises(RankCrash, match="Segmentation fault"):
        world2.run(_crash_rank1, None)
    assert not world2.alive


def test_harness_timeout(world2):
    with pytest.raises(TimeoutError):
        world2.run(time.sleep, 5, timeout_s=0.5)
    assert not world2.alive
