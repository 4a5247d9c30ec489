"""Tier 0: the cost model, checked by closed forms and relations (docs/design.md, "Testing").

Figures come from docs/cost-model.md: §1 collective formulas, §2 hardware, §4 ZeRO and activation
memory. Floats are compared with ``math.isclose(rel_tol=1e-9)``: every check is a closed form of
the same arithmetic, so only rounding separates the two sides.
"""
from __future__ import annotations

import itertools
import json
import math
import operator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from autoshard.cluster import HOST_DISPATCH_S, PRESETS, Cluster
from autoshard.cost.comm import (bytes_sent_per_device, collective_time, link_time, reshard,
                                 reshard_time, steps_time)
from autoshard.cost.compute import op_time, op_times
from autoshard.cost.memory import (activation_bytes_per_layer, param_state_bytes,
                                   saved_activation_bytes, zero_model_state_bytes)
from autoshard.errors import AutoshardError
from autoshard.ir import P, R, S, Partial, Replicate, Shard, Strategy, local_shape
from autoshard.mesh import AxisLink, Mesh
from autoshard.ir import OpInfo, TensorInfo
from autoshard.ops.registry import record_of

aten = torch.ops.aten
BF16, F32 = torch.bfloat16, torch.float32
GB = 1e9


def close(a: float, b: float, rel: float = 1e-9) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-18)


# --------------------------------------------------------------------- §1 collectives

ALPHA, BW, NBYTES = 7e-6, 123e9, 3.5e8


@pytest.mark.parametrize("p", [2, 4, 8])
def test_collective_times_match_reference_formulas(p):
    f = (p - 1) / p
    want = {
        "all_reduce": 2 * (p - 1) * ALPHA + 2 * f * NBYTES / BW,
        "all_gather": (p - 1) * ALPHA + f * NBYTES / BW,
        "reduce_scatter": (p - 1) * ALPHA + f * NBYTES / BW,
        "all_to_all": (p - 1) * ALPHA + f * NBYTES / BW,
        "send_recv": ALPHA + NBYTES / BW,
    }
    for kind, t in want.items():
        assert close(collective_time(kind, p, NBYTES, ALPHA, BW), t), kind
    sent = {"all_reduce": 2 * f * NBYTES, "all_gather": f * NBYTES, "reduce_scatter": f * NBYTES,
            "all_to_all": f * NBYTES, "send_recv": NBYTES}
    for kind, b in sent.items():
        assert close(bytes_sent_per_device(kind, p, NBYTES), b), kind


def test_a_kinds_own_figures_price_it_on_every_axis():
    """Cluster.collective_kinds (a calibrated gloo host): a kind named there runs at its own
    alpha and bandwidth on every axis and over merged axes; the others at the link's; a
    reshard's steps are priced so; bad figures and figures on two links are refused."""
    cpu = PRESETS["cpu"]
    rs = ("reduce_scatter", 4 * cpu.intra_alpha, cpu.intra_bandwidth / 2)   # gloo's: slower
    c = Cluster._from_profile({"base": "cpu", "collective_kinds": {
        "reduce_scatter": {"alpha": rs[1], "bandwidth": rs[2]}}})
    assert c.collective_kinds == (rs,)
    mesh = Mesh((2, 4), cluster=c)
    for link in mesh.links + (mesh.group_link((0, 1)),):
        assert close(link_time(link, "reduce_scatter", 4, NBYTES),
                     collective_time("reduce_scatter", 4, NBYTES, rs[1], rs[2]))
        assert close(link_time(link, "all_gather", 4, NBYTES),
                     collective_time("all_gather", 4, NBYTES, c.intra_alpha, c.intra_bandwidth))
    assert mesh.links[0].least_alpha == c.intra_alpha          # the reduce-scatter's is larger
    assert AxisLink(1e-5, 1e9, (("all_to_all", 2e-6, 1e9),)).least_alpha == 2e-6
    # A partial sum reduce-scattered over axis 1 costs the kind's price, not the link's.
    r = reshard((R, P), (R, S(0)), (1024, 1024), 4, mesh.shape)
    (step,), (back,) = r.forward, r.backward
    assert (step.kind, back.kind) == ("reduce_scatter", "all_gather")
    assert close(reshard_time(r, mesh),
                 collective_time("reduce_scatter", 4, step.nbytes, rs[1], rs[2])
                 + collective_time("all_gather", 4, back.nbytes, c.intra_alpha,
                                   c.intra_bandwidth))
    # The profile round-trips through its JSON form.
    assert Cluster._from_profile({k: v for k, v in c.to_json().items() if k != "name"}
                                 | {"base": "cpu"}).collective_kinds == c.collective_kinds
    for bad in ({"reduce_scatter": {"alpha": -1.0, "bandwidth": 1e9}},
                {"broadcast": {"alpha": 1e-5, "bandwidth": 1e9}},
                {"reduce_scatter": {"alpha": 1e-5}}):
        with pytest.raises(AutoshardError, match="collective_kinds"):
            Cluster._from_profile({"base": "cpu", "collective_kinds": bad})
    with pytest.raises(AutoshardError, match="inside"):
        Cluster._from_profile({"base": "h100", "collective_kinds": {
            "reduce_scatter": {"alpha": 1e-5, "bandwidth": 1e9}}})


@pytest.mark.parametrize("p", [2, 4, 8, 64])
def test_all_reduce_is_reduce_scatter_plus_all_gather(p):
    # Bytes: docs/cost-model.md §1. Time: a ring all-reduce *is* a reduce-scatter followed by an
    # all-gather, so the two agree exactly in the alpha-beta model; the single collective only
    # wins by the launch latency a second collective would add.
    ar = bytes_sent_per_device("all_reduce", p, NBYTES)
    assert close(ar, bytes_sent_per_device("reduce_scatter", p, NBYTES)
                 + bytes_sent_per_device("all_gather", p, NBYTES))
    t_ar = collective_time("all_reduce", p, NBYTES, ALPHA, BW)
    t_two = (collective_time("reduce_scatter", p, NBYTES, ALPHA, BW)
             + collective_time("all_gather", p, NBYTES, ALPHA, BW))
    assert close(t_ar, t_two)
    assert t_ar < t_two + ALPHA


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"])
def test_one_device_collectives_are_free(kind):
    assert collective_time(kind, 1, NBYTES, ALPHA, BW) == 0.0
    assert bytes_sent_per_device(kind, 1, NBYTES) == 0.0


def test_collective_time_grows_with_group_and_bytes():
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
        ts = [collective_time(kind, p, NBYTES, ALPHA, BW) for p in (2, 4, 8, 16)]
        assert ts == sorted(ts) and len(set(ts)) == 4
        assert collective_time(kind, 4, 2 * NBYTES, ALPHA, BW) > collective_time(
            kind, 4, NBYTES, ALPHA, BW)


def test_megatron_and_data_parallel_bytes():
    # Megatron TP (docs/cost-model.md §5): 2 all-reduces of b·s·h forward + 2 backward per layer is
    # 8·b·s·h·(t-1)/t elements per device; sequence parallel turns each into RS + AG, same bytes.
    b, s, h, t = 4, 2048, 4096, 8
    elems = b * s * h
    tp = 4 * bytes_sent_per_device("all_reduce", t, elems)
    assert close(tp, 8 * elems * (t - 1) / t)
    sp = 4 * (bytes_sent_per_device("reduce_scatter", t, elems)
              + bytes_sent_per_device("all_gather", t, elems))
    assert close(sp, tp)
    # DP: one all-reduce of the bf16 gradients; ZeRO-3 all-gathers parameters in forward and
    # backward and reduce-scatters gradients: 1.5x DP (ZeRO paper §7).
    psi, d = 7.5e9, 64
    dp = bytes_sent_per_device("all_reduce", d, 2 * psi)
    assert close(dp, 2 * (d - 1) / d * psi * 2)
    z3 = (2 * bytes_sent_per_device("all_gather", d, 2 * psi)
          + bytes_sent_per_device("reduce_scatter", d, 2 * psi))
    assert close(z3, 1.5 * dp)


# --------------------------------------------------------------------- reshard, 1-D

SHAPE, ITEM = (16, 32), 2
FULL = 16 * 32 * ITEM


def kinds(steps):
    return [(s.kind, s.axis, s.dim, s.nbytes) for s in steps]


def test_shard_to_replicate_is_all_gather_of_the_output():
    r = reshard((S(0),), (R,), SHAPE, ITEM, (4,))
    assert kinds(r.forward) == [("all_gather", 0, 0, FULL)]
    assert kinds(r.backward) == [("slice", 0, 0, 0)]          # grad of all-gather: slice
    rd = reshard((S(0),), (R,), SHAPE, ITEM, (4,), frozenset({0}))
    assert kinds(rd.backward) == [("reduce_scatter", 0, 0, FULL)]   # ... or RS if divergent


def test_partial_to_replicate_is_all_reduce():
    r = reshard((P,), (R,), SHAPE, ITEM, (4,))
    assert kinds(r.forward) == [("all_reduce", 0, -1, FULL)]
    assert r.backward == ()                                   # Megatron's "g": identity backward


def test_partial_to_shard_is_reduce_scatter_of_the_input():
    r = reshard((P,), (S(1),), SHAPE, ITEM, (4,))
    assert kinds(r.forward) == [("reduce_scatter", 0, 1, FULL)]
    assert kinds(r.backward) == [("all_gather", 0, 1, FULL)]


def test_replicate_to_shard_is_a_free_slice():
    r = reshard((R,), (S(0),), SHAPE, ITEM, (4,))
    assert kinds(r.forward) == [("slice", 0, 0, 0)]
    assert kinds(r.backward) == [("all_gather", 0, 0, FULL)]  # grad of a slice: all-gather
    mesh = Mesh((4,))
    assert steps_time(r.forward, mesh) == 0.0


def test_shard_to_other_dim_is_all_to_all_of_the_local_input():
    r = reshard((S(0),), (S(1),), SHAPE, ITEM, (4,))
    assert kinds(r.forward) == [("all_to_all", 0, 0, FULL // 4)]
    (back,) = r.backward
    assert (back.kind, back.dim, back.dim2, back.nbytes) == ("all_to_all", 1, 0, FULL // 4)


def test_divergent_replicate_gets_one_gradient_all_reduce():
    # Megatron's "f": a replicated activation feeding a column-parallel matmul.
    r = reshard((R,), (R,), SHAPE, ITEM, (4,), frozenset({0}))
    assert r.forward == ()
    assert kinds(r.backward) == [("all_reduce", 0, -1, FULL)]
    assert reshard((R,), (R,), SHAPE, ITEM, (4,)) == reshard((S(1),), (S(1),), SHAPE, ITEM, (4,))


def test_size_one_axes_cost_nothing():
    mesh = Mesh((1, 4))
    r = reshard((S(0), R), (R, R), SHAPE, ITEM, (1, 4), frozenset({0}))
    assert reshard_time(r, mesh) == 0.0


# --------------------------------------------------------------------- reshard, nested N-D

def test_nested_shard_to_inner_shard():
    # (S(0), S(0)) on (2, 4): dim 0 is cut in 8, axis 0 outer. (R, S(0)) cuts it in 4 by axis 1
    # alone, so axis 1's shard is undone (nested under the changing axis 0) and redone.
    shape, ms = (16, 8), (2, 4)
    r = reshard((S(0), S(0)), (R, S(0)), shape, ITEM, ms)
    full = 16 * 8 * ITEM
    assert kinds(r.forward) == [("all_gather", 1, 0, full // 2), ("all_gather", 0, 0, full),
                                ("slice", 1, 0, 0)]
    assert local_shape(shape, (R, S(0)), ms) == (4, 8)


def test_outer_shard_kept_inner_changes():
    # (S(0), S(0)) -> (S(0), R): gathering the inner axis leaves the outer split as it is.
    r = reshard((S(0), S(0)), (S(0), R), (16, 8), ITEM, (2, 4))
    assert kinds(r.forward) == [("all_gather", 1, 0, 16 * 8 * ITEM // 2)]


def test_independent_dims_use_all_to_all_and_reduce_scatter():
    ms = (2, 4)
    r = reshard((S(0), S(0)), (S(0), S(1)), (16, 8), ITEM, ms)
    assert [s.kind for s in r.forward] == ["all_to_all"]
    r = reshard((S(0), P), (S(0), S(0)), (16, 8), ITEM, ms)
    assert kinds(r.forward) == [("reduce_scatter", 1, 0, 16 * 8 * ITEM // 2)]


@pytest.mark.parametrize("a,b,ms", [
    ((S(1), R), (S(2), S(2)), (4, 4)),
    ((S(0), S(2)), (S(1), S(1)), (2, 4)),
    ((R, S(2)), (S(0), S(1)), (4, 2)),
    ((S(1), R, S(1)), (S(0), S(2), S(2)), (2, 2, 2)),
])
def test_multi_axis_round_trips_cost_the_same_both_ways(a, b, ms):
    shape = tuple(8 * math.prod(ms) for _ in range(3))
    mesh = Mesh(ms)
    there, back = reshard(a, b, shape, ITEM, ms), reshard(b, a, shape, ITEM, ms)
    assert close(steps_time(there.backward, mesh), steps_time(back.forward, mesh))
    assert close(steps_time(back.backward, mesh), steps_time(there.forward, mesh))


# A data-level simulator of resharding steps: every rank's local array, steps applied per group.
# It fixes the semantics the codegen must implement and checks the planner's steps end in the
# destination layout (forward) and the gradient ends in the source layout (backward).

def _ranks(ms):
    return list(itertools.product(*[range(n) for n in ms]))


def _slices(spec, coords, ms, shape):
    out = []
    for d, size in enumerate(shape):
        idx, f = 0, 1
        for a, (p, n) in enumerate(zip(spec, ms)):
            if isinstance(p, Shard) and p.dim == d:      # row-major: first axis is the outer cut
                idx, f = idx * n + coords[a], f * n
        out.append(slice(idx * size // f, (idx + 1) * size // f))
    return tuple(out)


def _distribute(x, spec, ms, rng):
    weights = {a: rng.random(n) + 0.1 for a, (p, n) in enumerate(zip(spec, ms))
               if isinstance(p, Partial)}
    locs = {}
    for c in _ranks(ms):
        v = x[_slices(spec, c, ms, x.shape)].copy()
        for a, w in weights.items():
            v = v * (w[c[a]] / w.sum())                   # summands that add up to the value
        locs[c] = v
    return locs


def _apply(step, locs, ms):
    a, n = step.axis, ms[step.axis]
    new = {}
    for c, v in locs.items():
        group, k = [locs[c[:a] + (j,) + c[a + 1:]] for j in range(n)], c[a]
        if step.kind == "all_gather":
            new[c] = np.concatenate(group, axis=step.dim)
        elif step.kind == "all_reduce":
            new[c] = sum(group)
        elif step.kind == "reduce_scatter":
            new[c] = np.split(sum(group), n, axis=step.dim)[k]
        elif step.kind == "all_to_all":
            new[c] = np.concatenate([np.split(g, n, axis=step.dim2)[k] for g in group],
                                    axis=step.dim)
        elif step.kind == "slice":
            new[c] = np.split(v, n, axis=step.dim)[k]
        elif step.kind == "to_partial":
            new[c] = v if k == 0 else np.zeros_like(v)
        else:
            raise AssertionError(step)
    return new


def _expected_nbytes(step, before, after):
    # docs/cost-model.md §1's S: all-gather output, reduce-scatter input, all-reduce tensor, a2a input.
    n = {"all_gather": after, "all_reduce": before, "reduce_scatter": before,
         "all_to_all": before}.get(step.kind, 0)
    return n * ITEM


def _run(steps, locs, ms):
    for step in steps:
        before = next(iter(locs.values())).size
        locs = _apply(step, locs, ms)
        assert step.nbytes == _expected_nbytes(step, before, next(iter(locs.values())).size), step
    return locs


def _assemble(locs, spec, ms, shape):
    """The logical tensor: sum over Partial axes, place shards, check replicas agree."""
    part = [a for a, p in enumerate(spec) if isinstance(p, Partial)]
    out = np.full(shape, np.nan)
    for c in _ranks(ms):
        if any(c[a] for a in part):
            continue
        v = sum(locs[tuple(alt[part.index(a)] if a in part else x for a, x in enumerate(c))]
                for alt in itertools.product(*[range(ms[a]) for a in part]))
        assert v.shape == local_shape(shape, spec, ms)
        sl = _slices(spec, c, ms, shape)
        if not np.isnan(out[sl]).all():
            np.testing.assert_allclose(out[sl], v)
        out[sl] = v
    return out


@st.composite
def reshard_cases(draw, max_axes=3):
    ms = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=max_axes)
                    .filter(lambda m: math.prod(m) <= 16)))
    ndim = draw(st.integers(1, 3))
    # Every dim divisible by the whole mesh, so every spec fits at every step.
    shape = tuple(draw(st.integers(1, 2)) * math.prod(ms) for _ in range(ndim))
    place = st.sampled_from([R, P] + [S(d) for d in range(ndim)])
    src = tuple(draw(place) for _ in ms)
    dst = tuple(draw(place) for _ in ms)
    divergent = frozenset(a for a in range(len(ms))
                          if isinstance(dst[a], Replicate) and draw(st.booleans()))
    return ms, shape, src, dst, divergent


@settings(max_examples=150, deadline=None, database=None, derandomize=True)
@given(reshard_cases(), st.integers(0, 2**32 - 1))
def test_reshard_steps_move_the_data(case, seed):
    ms, shape, src, dst, divergent = case
    rng = np.random.default_rng(seed)
    r = reshard(src, dst, shape, ITEM, ms, divergent)
    x = rng.random(shape)
    np.testing.assert_allclose(_assemble(_run(r.forward, _distribute(x, src, ms, rng), ms),
                                          dst, ms, shape), x)
    # The gradient follows the tensor's placement (Partial's gradient is Replicate) and is
    # Partial on divergent axes; after the backward steps it is the source's layout.
    g = rng.random(shape)
    g_dst = tuple(P if a in divergent else (R if isinstance(p, Partial) else p)
                  for a, p in enumerate(dst))
    g_src = tuple(R if isinstance(p, Partial) else p for p in src)
    np.testing.assert_allclose(_assemble(_run(r.backward, _distribute(g, g_dst, ms, rng), ms),
                                          g_src, ms, shape), g)
    for step in r.forward + r.backward:
        assert 0 <= step.nbytes <= math.prod(shape) * ITEM


def _sent(steps, ms):
    return sum(bytes_sent_per_device(s.kind, ms[s.axis], s.nbytes) for s in steps
               if s.is_collective)


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(reshard_cases())
def test_reshard_never_sends_more_than_replicate_then_slice(case):
    # The plain plan: all-reduce every partial axis, all-gather every sharded axis (innermost
    # first), slice what the destination shards. The planner's steps never send more.
    ms, shape, src, dst, _ = case
    naive, local = [], math.prod(local_shape(shape, src, ms)) * ITEM
    naive += [("all_reduce", a, local) for a, p in enumerate(src) if isinstance(p, Partial)]
    state = list(src)
    for a in reversed(range(len(ms))):
        if isinstance(state[a], Shard):
            state[a] = R
            naive.append(("all_gather", a, math.prod(local_shape(shape, state, ms)) * ITEM))
    bound = sum(bytes_sent_per_device(k, ms[a], n) for k, a, n in naive)
    assert _sent(reshard(src, dst, shape, ITEM, ms).forward, ms) <= bound * (1 + 1e-12)


@settings(max_examples=100, deadline=None, database=None, derandomize=True)
@given(reshard_cases(max_axes=1), st.integers(0, 2**32 - 1))
def test_round_trip_costs_each_direction(case, seed):
    ms, shape, src, dst, _ = case
    src = tuple(R if isinstance(p, Partial) else p for p in src)
    dst = tuple(R if isinstance(p, Partial) else p for p in dst)
    mesh = Mesh(ms)
    there, back = reshard(src, dst, shape, ITEM, ms), reshard(dst, src, shape, ITEM, ms)
    # The gradient of src -> dst takes the path dst -> src: same steps, same cost.
    assert close(steps_time(there.backward, mesh), steps_time(back.forward, mesh))
    assert close(reshard_time(there, mesh), steps_time(there.forward + back.forward, mesh))
    rng = np.random.default_rng(seed)
    x = rng.random(shape)
    locs = _run(back.forward, _run(there.forward, _distribute(x, src, ms, rng), ms), ms)
    np.testing.assert_allclose(_assemble(locs, src, ms, shape), x)


# --------------------------------------------------------------------- §2 hardware

def test_cluster_presets_carry_reference_figures():
    h100, h200, a100 = PRESETS["h100"], PRESETS["h200"], PRESETS["a100"]
    assert h100.flops == 989e12 and h100.memory_bytes == 80 * GB
    assert h100.mem_bandwidth == 3.35e12 and h100.devices_per_node == 8
    assert 370 * GB <= h100.intra_bandwidth <= 450 * GB        # NCCL ring busbw .. line rate
    assert 46 * GB <= h100.inter_bandwidth <= 50 * GB          # IB NDR achieved .. line rate
    # A small all-reduce across 2 nodes takes ~45 µs (nccl #1244).
    assert close(collective_time("all_reduce", 2, 0, h100.inter_alpha, h100.inter_bandwidth),
                 45e-6)
    assert h200.flops == h100.flops and h200.memory_bytes == 141 * GB
    assert h200.mem_bandwidth == 4.8e12
    assert a100.flops == 312e12 and a100.memory_bytes == 80 * GB
    assert a100.mem_bandwidth == 2.039e12 and a100.intra_bandwidth == 200 * GB
    for c in (h100, h200, a100):
        assert 0.7 <= c.matmul_efficiency <= 0.8                # docs/cost-model.md §2.6: ~70-80%
        assert c.kernel_floor_s < 1e-5                          # "a few µs"


def test_json_profile_overrides_figures(tmp_path):
    path = tmp_path / "slow_ib.json"
    path.write_text(json.dumps({"base": "h100", "inter_bandwidth": 25e9,
                                "matmul_efficiency": 0.6}))
    c = Cluster.load(path)
    assert c.inter_bandwidth == 25e9 and c.matmul_efficiency == 0.6
    assert c.flops == PRESETS["h100"].flops
    assert Cluster.resolve(str(path)) == c
    mesh = Mesh((4, 8), cluster=path)
    assert mesh.links[0].bandwidth == 25e9


@pytest.mark.parametrize("body", [
    {"base": "h100", "nvlink_bw": 1e12},          # unknown key
    {"flops": -1},                                 # not positive
    {"flops": "fast"},                             # not a number
    {"flops": True},                               # JSON true is not a figure
    {"devices_per_node": 8.5},                     # not an int
    {"matmul_efficiency": 1.5},                    # above peak
    {"base": "tpu-v9"},                            # unknown preset
    {"base": ["h100"]},                            # base not a name
    [1, 2],                                        # not an object
])
def test_bad_profiles_say_what_and_how_to_fix(tmp_path, body):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(body))
    with pytest.raises(AutoshardError, match="got .*Fix: "):
        Cluster.load(path)


def test_unreadable_profile(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(AutoshardError, match="got .*Fix: "):
        Cluster.load(path)
    with pytest.raises(AutoshardError, match="got .*Fix: "):
        Cluster.preset("h900")


def test_mesh_default_links_inner_axes_on_nvlink():
    h100 = PRESETS["h100"]
    nvlink = AxisLink(h100.intra_alpha, h100.intra_bandwidth)
    ib = AxisLink(h100.inter_alpha, h100.inter_bandwidth)
    assert Mesh((8, 8)).links == (ib, nvlink)
    assert Mesh((2, 4, 8)).links == (ib, ib, nvlink)
    assert Mesh((4, 2, 8)).links == (ib, ib, nvlink)
    assert Mesh((8, 2, 4)).links == (ib, nvlink, nvlink)
    assert Mesh((4, 2)).links == (nvlink, nvlink)              # one node
    assert Mesh((16,)).links == (ib,)
    # Groups of 3 on 8-GPU nodes straddle a node boundary (ranks 6, 7, 8).
    assert Mesh((3, 3)).links == (ib, ib)
    assert Mesh((8, 8)).group_link([0, 1]) == AxisLink(ib.alpha, ib.bandwidth)


def test_mesh_errors_say_what_and_how_to_fix():
    for bad in [dict(shape=(0, 2)), dict(shape=(2, 2, 2, 2)), dict(shape=(2, 2), axes=("a", "a"))]:
        with pytest.raises(AutoshardError, match="got .*Fix: "):
            Mesh(**bad)


# --------------------------------------------------------------------- compute roofline

def t_(shape, dtype=BF16):
    return TensorInfo(tuple(shape), dtype)


def mm_op(m, k, n, dtype=BF16):
    return OpInfo(aten.mm.default, (t_((m, k), dtype), t_((k, n), dtype)), {},
                  (t_((m, n), dtype),))


def rep(op, naxes=1):
    r = (R,) * naxes
    return Strategy(tuple(r for _ in op.inputs), tuple(r for _ in op.outputs))


H100 = Mesh((4,))
C = H100.cluster


def test_big_matmul_is_compute_bound_at_efficiency_times_peak():
    op = mm_op(8192, 8192, 8192)
    assert forward_flops(op) == 2 * 8192 ** 3
    assert close(op_time(op, rep(op), H100, training=False),
                 2 * 8192 ** 3 / (C.matmul_efficiency * C.flops))
    op32 = mm_op(8192, 8192, 8192, F32)          # fp32 runs at the fp32 peak
    assert close(op_time(op32, rep(op32), H100, training=False),
                 2 * 8192 ** 3 / (C.matmul_efficiency * C.fp32_flops))


def test_elementwise_is_bandwidth_bound():
    x = t_((8192, 8192))
    op = OpInfo(aten.gelu.default, (x,), {}, (x,))
    assert record_of(op.target).family == "elementwise"
    assert close(op_time(op, rep(op), H100, training=False), 2 * x.nbytes / C.mem_bandwidth)
    # Backward moves about twice the forward's bytes (saved input, output grad, input grad).
    assert close(op_time(op, rep(op), H100, training=True), 6 * x.nbytes / C.mem_bandwidth)


def test_special_functions_are_priced_per_evaluation():
    # docs/cost-model.md §3.7: on a device whose special functions are slow (a CPU core), an
    # activation is bound by its evaluations, and its backward by the derivative's.
    import dataclasses
    slow = Mesh((1,), cluster=dataclasses.replace(C, transcendental_rate=1e9))
    x = t_((1024, 4096), F32)
    n = x.numel
    gelu = OpInfo(aten.gelu.default, (x,), {"approximate": "tanh"}, (x,))
    fwd = n / C.fp32_flops + n / 1e9
    assert close(op_time(gelu, rep(gelu), slow, training=False), fwd)
    assert close(op_time(gelu, rep(gelu), slow, training=True), 2 * fwd)   # gelu_backward: tanh
    erf = OpInfo(aten.gelu.default, (x,), {}, (x,))      # the erf form: erf and exp(-x^2) back
    assert close(op_time(erf, rep(erf), slow, training=True), fwd + n / C.fp32_flops + 2 * n / 1e9)
    # tanh's backward reuses the saved output: bandwidth-bound again.
    tanh = OpInfo(aten.tanh.default, (x,), {}, (x,))
    assert close(op_time(tanh, rep(tanh), slow, training=True),
                 fwd + 2 * 2 * x.nbytes / C.mem_bandwidth)
    # A loss evaluates its log-softmax over the logits, not over its one-element output.
    tgt = TensorInfo((1024,), torch.int64)
    ce = OpInfo(aten.cross_entropy_loss.default, (x, tgt), {}, (t_((), F32),))
    assert op_time(ce, rep(ce), slow, training=False) >= n / 1e9
    # Arithmetic evaluates none; an integral power is repeated multiplication.
    for op in (OpInfo(aten.mul.Tensor, (x, x), {}, (x,)),
               OpInfo(aten.pow.Tensor_Scalar, (x, 2), {}, (x,))):
        assert op_time(op, rep(op), slow, training=True) == op_time(op, rep(op), H100,
                                                                     training=True)
    sqrt = OpInfo(aten.pow.Tensor_Scalar, (x, 0.5), {}, (x,))
    assert op_time(sqrt, rep(sqrt), slow, training=False) >= n / 1e9
    # Sharded four ways, each rank evaluates a quarter.
    quarter = Strategy(((S(0),),), ((S(0),),), compute_scale=1 / 4)
    assert close(op_time(gelu, quarter, Mesh((4,), cluster=slow.cluster), training=False),
                 fwd / 4)


@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cross_entropy_is_priced_by_its_passes_over_the_logits(dtype):
    # docs/cost-model.md §3.9: the composite moves 4 logits' worth forward and 5 backward; the
    # vocabulary-parallel kernel (an fp32 log_softmax) 8 and 4 on 16-bit logits, 4 and 4 on
    # fp32 ones, on its shard of the classes.
    from autoshard.cost.compute import op_times
    mesh, tp = Mesh((1,), cluster="h100"), Mesh((8,), cluster="h100")
    bw = mesh.cluster.mem_bandwidth
    x, tgt = t_((2048, 128256), dtype), TensorInfo((2048,), torch.int64)
    ce = OpInfo(aten.cross_entropy_loss.default, (x, tgt), {}, (t_((), F32),))
    fwd, bwd = op_times(ce, rep(ce), mesh, training=True)
    assert close(fwd, 4 * x.nbytes / bw) and close(bwd, 5 * x.nbytes / bw)
    vocab = Strategy(((S(1),), (R,)), ((P,),), kernel="vocab_parallel", compute_scale=1 / 8)
    fwd, bwd = op_times(ce, vocab, tp, training=True)
    want = (8, 4) if dtype == BF16 else (4, 4)
    assert close(fwd, want[0] * x.nbytes / 8 / bw) and close(bwd, want[1] * x.nbytes / 8 / bw)


@pytest.mark.parametrize("preset", ["h100", "h200", "a100"])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_gpu_elementwise_ops_stay_bandwidth_bound(preset, dtype):
    # The special-function term never binds on a GPU elementwise op: the model prices them as
    # it did before that term (docs/cost-model.md §3.7).
    mesh = Mesh((1,), cluster=preset)
    c = mesh.cluster
    x = t_((8, 2048, 4096), dtype)
    for target, kwargs in ((aten.gelu.default, {}), (aten.gelu.default, {"approximate": "tanh"}),
                           (aten.silu.default, {}), (aten._softmax.default, {}),
                           (aten.exp.default, {})):
        args = (x, -1, False) if target == aten._softmax.default else (x,)
        op = OpInfo(target, args, kwargs, (x,))
        assert close(op_time(op, rep(op), mesh, training=False), 2 * x.nbytes / c.mem_bandwidth)
        assert close(op_time(op, rep(op), mesh, training=True), 6 * x.nbytes / c.mem_bandwidth)


def test_attention_pays_one_exp_per_score_each_way():
    # FlashAttention-2 evaluates exp once per score in forward, and again in backward when it
    # rebuilds the probabilities; between its matmuls, not overlapped (docs/cost-model.md §3.7).
    b, a, s, d = 1, 32, 2048, 128
    q = t_((b, a, s, d))
    op = OpInfo(aten.scaled_dot_product_attention.default, (q, q, q), {"is_causal": True}, (q,))
    flops, scores = 4 * b * a * s * s * d / 2, b * a * s * s / 2    # causal: half of each
    rate = C.flops * C.matmul_efficiency
    fwd = flops / rate + scores / C.transcendental_rate
    assert close(op_time(op, rep(op), H100, training=False), fwd)
    assert close(op_time(op, rep(op), H100, training=True),
                 fwd + 2.5 * flops / rate + scores / C.transcendental_rate)


HOSTED = Mesh((4,), cluster=Cluster._from_profile({"base": "h100",
                                                   "host_dispatch_s": HOST_DISPATCH_S}))


def test_a_biased_linear_sums_its_bias_gradient_in_backward():
    H100, C = HOSTED, HOSTED.cluster
    x, w, bias, y = t_((4096, 1024)), t_((4096, 1024)), t_((4096,)), t_((4096, 4096))
    plain = OpInfo(aten.linear.default, (x, w), {}, (y,))
    biased = OpInfo(aten.linear.default, (x, w, bias), {}, (y,))
    fwd = op_time(biased, rep(biased), H100, training=False)
    assert close(fwd, op_time(plain, rep(plain), H100, training=False))
    # derivatives.yaml: the bias's gradient is the output gradient summed over the rows, one
    # more kernel (eager: at least the host's dispatch of it, §3.10).
    assert close(op_time(biased, rep(biased), H100, training=True),
                 3 * fwd + max(y.nbytes / C.mem_bandwidth, C.host_dispatch_s))


def test_tiny_op_hits_the_host_floor_eager_and_the_kernel_floor_compiled():
    H100, C = HOSTED, HOSTED.cluster
    x = t_((4,))
    op = OpInfo(aten.add.Tensor, (x, x), {}, (x,))
    # Eager, the host's dispatch of each op (16.5 µs on a GPU host, §2.11) outlasts the kernel.
    assert C.host_dispatch_s > C.kernel_floor_s
    assert op_time(op, rep(op), H100, training=False) == C.host_dispatch_s
    assert op_time(op, rep(op), H100, training=True) == 2 * C.host_dispatch_s
    # Compiled, no op pays the host: the kernel's own floor (docs/cost-model.md §3.10).
    assert op_times(op, rep(op), H100, training=True, compiled=True) == (C.kernel_floor_s,) * 2


def test_sharding_a_matmul_four_ways_divides_its_time_by_four():
    op = mm_op(8192, 8192, 8192)
    col = Strategy(((R,), (S(1),)), ((S(1),),), compute_scale=1 / 4)   # column parallel
    whole = op_time(op, rep(op), H100, training=False)
    assert close(op_time(op, col, H100, training=False), whole / 4)
    row = Strategy(((S(1),), (S(0),)), ((P,),), compute_scale=1 / 4)   # row parallel
    assert close(op_time(op, row, H100, training=False), whole / 4)


def test_training_matmul_is_three_times_forward():
    for op in (mm_op(8192, 8192, 8192), mm_op(64, 64, 64), mm_op(16, 8192, 8192, F32)):
        fwd = op_time(op, rep(op), H100, training=False)
        assert close(op_time(op, rep(op), H100, training=True), 3 * fwd)


def test_bytes_are_local_sizes():
    # A skinny matmul is bandwidth-bound; sharding its big operand shrinks the bytes read.
    op = mm_op(8, 65536, 8192)
    whole = op_time(op, rep(op), H100, training=False)
    m, k, n = 8, 65536, 8192
    assert close(whole, (m * k + k * n + m * n) * 2 / C.mem_bandwidth)
    col = Strategy(((R,), (S(1),)), ((S(1),),), compute_scale=1 / 4)
    assert close(op_time(op, col, H100, training=False),
                 (m * k + k * n / 4 + m * n / 4) * 2 / C.mem_bandwidth)


@pytest.mark.parametrize("target,args", [
    (aten.view.default, lambda x: (x, [64, 128])),
    (aten.permute.default, lambda x: (x, [1, 0])),
    (aten.t.default, lambda x: (x,)),
    (aten.expand.default, lambda x: (x, [128, 64])),
    (aten.detach.default, lambda x: (x,)),
    (aten._assert_tensor_metadata.default, lambda x: (x,)),
    (aten.slice.Tensor, lambda x: (x, 0, 0, 64)),
])
def test_view_ops_are_free(target, args):
    x = t_((128, 64))
    op = OpInfo(target, args(x), {}, (x,))
    assert op_time(op, rep(op), H100, training=True) == 0.0
    assert saved_activation_bytes(op, rep(op), (4,)) == 0


def test_getitem_is_free():
    import operator
    x = t_((128, 64))
    op = OpInfo(operator.getitem, ((x, x), 0), {}, (x,))
    assert op_time(op, rep(op), H100, training=True) == 0.0


def forward_flops(op: OpInfo) -> float:
    return record_of(op.target).flops(op)


def test_flops_closed_forms():
    b, a, s, d = 2, 16, 1024, 64
    q = t_((b, a, s, d))
    sdpa = aten.scaled_dot_product_attention.default
    full = OpInfo(sdpa, (q, q, q), {}, (q,))
    # QK^T and PV, 2·s·s·d each per head. A causal mask is not discounted (docs/cost-model.md §6).
    assert forward_flops(full) == 4 * b * a * s * s * d
    x, w = t_((8, 512, 1024)), t_((4096, 1024))
    lin = OpInfo(aten.linear.default, (x, w), {}, (t_((8, 512, 4096)),))
    assert forward_flops(lin) == 2 * 8 * 512 * 1024 * 4096


# --------------------------------------------------------------------- §3 memory

def test_param_state_bytes():
    assert param_state_bytes(1000, BF16) == 16 * 1000       # 2 + 2 + K=12 (ZeRO paper)
    assert param_state_bytes(1000, F32) == 16 * 1000        # 4 + 4 + 8
    assert param_state_bytes(1000, BF16, optimizer="sgd") == 4 * 1000
    assert param_state_bytes(1000, BF16, optimizer="none") == 2 * 1000
    assert param_state_bytes(10**6, BF16) == zero_model_state_bytes(10**6, 8, 0)
    with pytest.raises(AutoshardError, match="got .*Fix: "):
        param_state_bytes(1, BF16, optimizer="lion")


def test_zero_closed_forms_reproduce_the_reference_table():
    psi, d = 7.5e9, 64
    want = {0: 120, 1: 31.4, 2: 16.6, 3: 1.9}                # GB, docs/cost-model.md §4.2
    for stage, gb in want.items():
        assert round(zero_model_state_bytes(psi, d, stage) / GB, 1) == gb
    for stage in range(4):                                   # one rank: nothing to shard
        assert zero_model_state_bytes(psi, 1, stage) == 16 * psi
    assert zero_model_state_bytes(psi, d, 3) == zero_model_state_bytes(psi, d, 0) / d
    stages = [zero_model_state_bytes(psi, d, k) for k in range(4)]
    assert stages == sorted(stages, reverse=True)
    with pytest.raises(AutoshardError):
        zero_model_state_bytes(psi, d, 4)


@pytest.mark.parametrize("s,b,h,a,t", [(2048, 1, 12288, 96, 8), (1024, 4, 4096, 32, 4),
                                       (512, 8, 1024, 16, 2)])
def test_korthikanti_forms_agree(s, b, h, a, t):
    act = lambda mode, tt=t: activation_bytes_per_layer(s, b, h, a, tt, mode=mode)  # noqa: E731
    assert close(act("tensor_sequence"), act("none") / t)
    assert close(act("tensor", 1), act("none"))
    assert close(act("selective"), 34 * s * b * h / t)
    assert act("full") == 2 * s * b * h
    assert act("full") < act("selective") < act("tensor_sequence") < act("tensor") < act("none")
    # Selective recompute drops exactly the attention-score term 5as²b/t.
    assert close(act("tensor_sequence") - act("selective"), 5 * a * s * s * b / t)


# A Megatron GPT layer as ops (s, b, h, a; t-way tensor parallel on a (t,) mesh), to check that
# the per-op saved-activation model sums to Korthikanti's per-layer closed form.

def _gpt_layer(s, b, h, a, t):
    d, sb = h // a, s * b
    col, row, hd = (S(1),), (S(0),), (S(0),)
    ops = []

    def add(target, args, outs, ins_specs, out_specs, exclude=()):
        ops.append((OpInfo(target, args, {}, tuple(outs)), Strategy(ins_specs, out_specs),
                    frozenset(exclude)))

    x, x2 = t_((s, b, h)), t_((sb, h))
    ln = aten.layer_norm.default
    for _ in range(2):                                       # both layer norms, replicated
        add(ln, (x, [h], t_((h,)), t_((h,)), 1e-5), [x], ((R,),) * 3, ((R,),), exclude=(1, 2))
    # QKV (column parallel), out-proj (row parallel), fc1 (column), fc2 (row).
    add(aten.addmm.default, (t_((3 * h,)), x2, t_((h, 3 * h))), [t_((sb, 3 * h))],
        ((S(0),), (R,), col), (col,), exclude=(0, 2))
    add(aten.addmm.default, (t_((h,)), x2, t_((h, h))), [x2], ((R,), col, row), ((P,),),
        exclude=(0, 2))
    add(aten.addmm.default, (t_((4 * h,)), x2, t_((h, 4 * h))), [t_((sb, 4 * h))],
        ((S(0),), (R,), col), (col,), exclude=(0, 2))
    add(aten.addmm.default, (t_((h,)), t_((sb, 4 * h)), t_((4 * h, h))), [x2],
        ((R,), col, row), ((P,),), exclude=(0, 2))
    add(aten.gelu.default, (t_((sb, 4 * h)),), [t_((sb, 4 * h))], (col,), (col,))
    # Attention core, sharded by heads.
    qh, scores = t_((b * a, s, d)), t_((b * a, s, s))
    add(aten.bmm.default, (qh, t_((b * a, d, s))), [scores], (hd, hd), (hd,))
    add(aten._softmax.default, (scores, -1, False), [scores], (hd,), (hd,))
    add(aten.dropout.default, (scores, 0.1, True), [scores], (hd,), (hd,))   # keeps a bool mask
    add(aten.bmm.default, (scores, qh), [qh], (hd, hd), (hd,))
    # Two dropouts after the all-reduces, and two residual adds (which save nothing).
    for _ in range(2):
        add(aten.dropout.default, (x, 0.1, True), [x], ((R,),), ((R,),))
        add(aten.add.Tensor, (x, x), [x], ((R,), (R,)), ((R,),))
    return ops


@pytest.mark.parametrize("t", [1, 2, 4, 8])
def test_saved_activations_sum_to_korthikanti(t):
    s, b, h, a = 512, 2, 1024, 16
    total = sum(saved_activation_bytes(op, strat, (t,), exclude=ex)
                for op, strat, ex in _gpt_layer(s, b, h, a, t))
    stats = 2 * s * b * 8                                    # fp32 mean and rstd per LN row
    assert close(total - stats, activation_bytes_per_layer(s, b, h, a, t, mode="tensor"))
    if t == 1:
        assert close(total - stats, activation_bytes_per_layer(s, b, h, a, mode="none"))


def test_saved_activation_rules():
    x, y = t_((64, 256)), t_((256, 128))
    mm = mm_op(64, 256, 128)
    assert saved_activation_bytes(mm, rep(mm), (4,)) == x.nbytes + y.nbytes
    assert saved_activation_bytes(mm, rep(mm), (4,), exclude=frozenset({1})) == x.nbytes
    sharded = Strategy(((S(0),), (R,)), ((S(0),),), compute_scale=1 / 4)
    assert saved_activation_bytes(mm, sharded, (4,), exclude=frozenset({1})) == x.nbytes // 4
    soft = OpInfo(aten._softmax.default, (x, -1, False), {}, (t_((64, 256), F32),))
    assert saved_activation_bytes(soft, rep(soft), (4,)) == 64 * 256 * 4   # the output
    mul = OpInfo(aten.mul.Tensor, (x, x), {}, (x,))
    assert saved_activation_bytes(mul, rep(mul), (4,)) == 2 * x.nbytes
    scale = OpInfo(aten.mul.Tensor, (x, 2.0), {}, (x,))
    assert saved_activation_bytes(scale, rep(scale), (4,)) == 0
    add = OpInfo(aten.add.Tensor, (x, x), {}, (x,))
    assert saved_activation_bytes(add, rep(add), (4,)) == 0
    idx, table = t_((8, 512), torch.int64), t_((50257, 768))
    emb = OpInfo(aten.embedding.default, (table, idx), {}, (t_((8, 512, 768)),))
    assert saved_activation_bytes(emb, rep(emb), (4,)) == idx.nbytes
    q = t_((2, 16, 1024, 64))
    sdpa = OpInfo(aten.scaled_dot_product_attention.default, (q, q, q), {}, (q,))
    lse = 2 * 16 * 1024 * 4
    assert saved_activation_bytes(sdpa, rep(sdpa), (4,)) == 4 * q.nbytes + lse
    heads = Strategy(((S(1),),) * 3, ((S(1),),), compute_scale=1 / 4)
    assert saved_activation_bytes(sdpa, heads, (4,)) == (4 * q.nbytes + lse) // 4
    ints = OpInfo(aten.eq.Tensor, (idx, idx), {}, (t_((8, 512), torch.bool),))
    assert saved_activation_bytes(ints, rep(ints), (4,)) == 0      # no gradient


class _ThreeReads(torch.nn.Module):
    """One activation read by three linears (the Q, K, V pattern), after ``act``."""

    def __init__(self, act, h: int = 16) -> None:
        super().__init__()
        self.act = act
        self.q, self.k, self.v = (torch.nn.Linear(h, h, bias=False) for _ in range(3))

    def forward(self, x):
        y = self.act(x)
        return (self.q(y) + self.k(y) + self.v(y)).sum()


def _replicated_memory(model, x):
    from autoshard.cost.price import Pricer
    from autoshard.ops.registry import strategies_for
    from autoshard.options import PlanOptions
    from autoshard.trace.export import trace
    traced = trace(model, (x,), training=True)
    mesh = Mesh((2,), cluster="cpu")
    pricer = Pricer(traced, mesh, PlanOptions(optimizer="none"))
    strategies = {}
    for n in traced.graph.nodes:
        if n.op == "placeholder":
            strategies[n.name] = Strategy((), ((R,),))
        elif n.op == "call_function" and n.target is not operator.getitem:
            strategies[n.name] = next(s for s in strategies_for(pricer.info(n.name), (2,))
                                      if all(sp is None or sp == (R,) for sp in
                                             (*s.inputs, *s.outputs)))
    params = {p.name for p in traced.placeholders}
    activations = sum(pricer.memory(n, s) for n, s in strategies.items() if n not in params)
    return activations + pricer.saved_copies(strategies)


@pytest.mark.parametrize("act,kept", [(torch.nn.Tanh(), "output"), (torch.nn.GELU(), "both")])
def test_a_value_saved_by_several_ops_is_counted_once(act, kept) -> None:
    """q, k and v projections all save their shared input: one tensor, not three (§4.4). tanh
    saves its output (the same tensor: nothing more); gelu saves its input x, a tensor of its
    own, and its output is kept once for the three linears."""
    x = torch.randn(4, 8, 16)
    one = x.numel() * 4
    expected = one if kept == "output" else 2 * one
    assert _replicated_memory(_ThreeReads(act), x) == expected


# -- §7 gradient buckets and overlap -----------------------------------------------------------

def test_buckets_fill_in_ready_order_and_split_by_axes_and_dtype() -> None:
    from autoshard.cost.overlap import Sync, form_buckets
    mb = 2**20
    syncs = [Sync("a", (0,), "float32", 10 * mb), Sync("b", (0,), "float32", 10 * mb),
             Sync("c", (0, 1), "float32", 1 * mb), Sync("d", (0,), "float32", 10 * mb),
             Sync("e", (0,), "bfloat16", 3 * mb), Sync("f", (0,), "float32", 40 * mb)]
    buckets = form_buckets(syncs, 25 * mb)
    got = [(b.members, b.nbytes // mb) for b in buckets]
    # a+b fit (20 MB); d would overflow them (30 > 25): a+b close, d opens the next; f (40 MB)
    # is larger than a bucket and closes d's; the rest close at the end, in opening order.
    assert got == [(("a", "b"), 20), (("d",), 10), (("c",), 1), (("e",), 3), (("f",), 40)]


def test_one_latency_per_bucket_and_a_share_per_gradient() -> None:
    """A bucket of four 1 MB gradients over 8 devices pays 2(p-1) alpha once (§7); the ILP's
    per-gradient price charges each its 1/25 share of it."""
    from autoshard.cost.comm import Step, reshard
    from autoshard.cost.overlap import (Bucket, bucket_seconds, is_grad_sync,
                                        sync_share_seconds)
    mesh = Mesh((8,), cluster="h100")
    link = mesh.links[0]
    mb = 2**20
    b = Bucket((0,), "bfloat16", ("a", "b", "c", "d"), 4 * mb)
    assert bucket_seconds(b, mesh) == pytest.approx(
        2 * 7 * link.alpha + 2 * 7 / 8 * 4 * mb / link.bandwidth)
    r = reshard((R,), (R,), (mb // 2,), 2, (8,), frozenset({0}))     # 1 MB of bf16
    assert is_grad_sync(r) and r.backward == (Step("all_reduce", 0, nbytes=mb),)
    assert sync_share_seconds(r, mesh, 25 * mb) == pytest.approx(
        2 * 7 * link.alpha / 25 + 2 * 7 / 8 * mb / link.bandwidth)
    assert not is_grad_sync(reshard((S(0),), (R,), (mb,), 2, (8,), frozenset({0})))


def test_exposed_is_what_backward_does_not_hide() -> None:
    from autoshard.cost.overlap import exposed_seconds
    assert exposed_seconds(0.010, 0.030) == 0.0
    assert exposed_seconds(0.030, 0.010) == pytest.approx(0.020)


@pytest.mark.parametrize("batch,hidden", [(512, True), (16, False)])
def test_data_parallel_gradient_sync_hides_behind_backward(batch, hidden) -> None:
    """GPT-2 124M data parallel over 8 nodes (the sync crosses InfiniBand): at batch 512 backward
    compute hides every bucket; at batch 16 it cannot, and the rest is exposed (§7)."""
    from autoshard.cost.comm import collective_time
    from autoshard.solver.baselines import baseline_plan
    from autoshard.trace.export import trace
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("gpt2", batch=batch, seq=1024, device="meta")
    h100 = PRESETS["h100"]
    link = AxisLink(h100.inter_alpha, h100.inter_bandwidth)
    p = baseline_plan(trace(model, inputs, training=True), Mesh((8,), ("dp",), cluster="h100",
                                                                links=[link]), "dp")
    pred = p.predicted
    buckets = [c for c in p.collectives if c.members]
    blocking = sum(collective_time(c.kind, 8, c.bytes, link.alpha, link.bandwidth)
                   for c in p.collectives if not c.members)
    # Each gradient is charged its share of a bucket's latency: the buckets as run cost at most
    # one latency more per bucket (the last one partly filled).
    run = sum(collective_time("all_reduce", 8, c.bytes, link.alpha, link.bandwidth)
              for c in buckets)
    sync = pred.comm_s - blocking
    assert buckets and run - 2 * 7 * link.alpha <= sync <= run
    if hidden:
        assert pred.overlapped_comm_s["dp"] == pytest.approx(sync, rel=1e-9)
        assert pred.exposed_comm_s["dp"] == pytest.approx(blocking, rel=1e-9, abs=1e-15)
    else:
        assert 0 < pred.overlapped_comm_s["dp"] < sync
        assert pred.exposed_comm_s["dp"] > blocking
    assert pred.step_time_s == pytest.approx(
        pred.compute_s + pred.exposed_comm_s["dp"], rel=1e-12)


class _Rotate(torch.nn.Module):
    """``linear(x) * cos`` with ``cos`` a buffer: RoPE's pattern."""

    def __init__(self, h: int = 16) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(h, h, bias=False)
        self.register_buffer("cos", torch.randn(4, 8, h))

    def forward(self, x):
        return (self.lin(x) * self.cos).sum()


def test_a_product_keeps_a_factor_only_for_the_others_gradient() -> None:
    """``y * cos`` keeps ``cos`` (for y's gradient; a buffer, counted once as such) and not
    ``y``, as cos needs no gradient: the activations are linear's input alone (§4.4)."""
    x = torch.randn(4, 8, 16)
    assert _replicated_memory(_Rotate(), x) == x.numel() * 4


class _Mlp3(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.down(torch.relu(self.up(x))).sum()


# A calibrated gloo host's profile: each kind at its own figures, one of them quicker to start
# than the link (the floor must take the least latency of any kind).
PER_KIND = {"base": "cpu", "collective_kinds": {
    "all_to_all": {"alpha": 3e-6, "bandwidth": 2e9},
    "reduce_scatter": {"alpha": 1.2e-4, "bandwidth": 1e9}}}


@pytest.mark.parametrize("cluster", ["h100", "per-kind"])
@pytest.mark.parametrize("merge", [None, ((0, 1), (2,))], ids=["2x2x2", "merged"])
def test_the_reshard_floor_never_exceeds_the_reshard(merge, cluster) -> None:
    """``Pricer.reshard_floor`` prunes the follower search (solver/build.py): it must stay at or
    below the priced reshard for every pair of layouts, for a value with a gradient and one
    without, on a real 3-axis mesh and one with axes merged, on a preset and on a profile
    pricing each collective kind apart; it is the least latency of one collective per changed
    axis, so 0 for a slice of a gradient-free value and for a change into partial sums."""
    from autoshard.cost.price import Pricer
    from autoshard.mesh import AxisMerge
    from autoshard.options import PlanOptions
    from autoshard.solver.build import placeholder_strategies
    from autoshard.trace.export import trace
    traced = trace(_Mlp3(), (torch.randn(4, 4, 8),), training=True)
    real = Mesh((2, 2, 2), cluster=cluster if cluster == "h100" else
                Cluster._from_profile(dict(PER_KIND)))
    mesh = real if merge is None else AxisMerge(real, merge).merged()
    pricer = Pricer(traced, real if merge is None else mesh, PlanOptions(),
                    **({} if merge is None else {"merge": AxisMerge(real, merge)}))
    x = next(p.name for p in traced.placeholders if p.kind == "input")
    up = next(n.name for n in traced.graph.nodes if n.op == "call_function")
    checked = 0
    for value in ((x, 0), (up, 0)):              # the batch (no gradient), an activation
        info = pricer.info(up) if value[0] == up else traced.placeholder(x).info
        shape = pricer.shapes[value][0]
        specs = [s.outputs[0] for s in placeholder_strategies(
            TensorInfo(shape, info.outputs[0].dtype) if value[0] == up else info,
            mesh.shape, "input")]
        for src, dst in itertools.product(specs, repeat=2):
            floor = pricer.reshard_floor(value, src, dst)
            assert floor <= pricer.reshard_seconds(value, src, dst, frozenset()) * (1 + 1e-12)
            checked += 1
    assert checked > 100
    # One changed axis of the batch's layout: one gather over 2 devices, (2 - 1)·alpha; the
    # merged axis stands for two real axes, each gathered: 2·alpha.
    alpha = real.links[0].least_alpha
    gathered = (S(0),) + (R,) * (mesh.ndim - 1)
    assert pricer.reshard_floor((up, 0), gathered, (R,) * mesh.ndim) == pytest.approx(
        alpha * (1 if merge is None else 2))
    assert pricer.reshard_floor((x, 0), (R,) * mesh.ndim, gathered) == 0.0
    assert pricer.reshard_floor((up, 0), (R,) * mesh.ndim, gathered) > 0.0


def test_no_gradient_flows_through_a_factory_or_an_integer_cast() -> None:
    """``new_zeros`` reads only its input's dtype and shape and a cast to integers has no
    gradient: a reshard read only there runs no backward collective (none would run, and the
    plan's bytes must equal the run's)."""
    from autoshard.cost.reshards import grad_values, passes_grad
    from autoshard.trace.export import trace

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            buf = h.new_zeros(h.shape)
            idx = h.to(torch.long)
            return (h * 2).sum() + buf.sum() + idx.sum()

    traced = trace(M(), (torch.randn(2, 4),))
    nodes = {n.name: n for n in traced.graph.nodes}
    grads = grad_values(traced.graph, {p.name for p in traced.params})
    by_target = {n.target: n.name for n in traced.graph.nodes if n.op == "call_function"}
    aten = torch.ops.aten
    h = by_target[aten.linear.default]
    assert h in grads and by_target[aten.new_zeros.default] not in grads
    assert not passes_grad(nodes, grads, (h, 0), by_target[aten.new_zeros.default])
    cast = next(n.name for n in traced.graph.nodes if n.op == "call_function"
                and n.args and getattr(n.args[0], "name", None) == h
                and getattr(n.meta.get("val"), "dtype", None) == torch.long)
    assert not passes_grad(nodes, grads, (h, 0), cast)
    assert passes_grad(nodes, grads, (h, 0), by_target[aten.mul.Tensor])
