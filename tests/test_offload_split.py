"""Offload per parameter (solver/offload_split.py, docs/cost-model.md §9.2): a plan whose ILP
offloaded a parameter kind in every identical layer gets as many of those parameters back on the
device, earliest read first, as its step's liveness peak allows; the step it saves is the host
step of those parameters less their device step, by hand; the rank program runs the mixed plan
as single-device AdamW does."""
from __future__ import annotations

from dataclasses import replace

import pytest

from autoshard import Mesh
from autoshard.cost.memory import device_budget
from autoshard.ir import StateMode
from autoshard.options import resolve_options
from autoshard.solver import planner
from autoshard.solver.assemble import assemble
from autoshard.solver.offload_split import _fitting, _moves, offload_per_parameter
from autoshard.solver.search import fitting_edge
from autoshard.solver.planner import plan_traced
from autoshard.solver.solve import grouped
from autoshard.tools.verify import build
from autoshard.trace.export import trace
from dist import world_fixture

MODEL = "llama-tiny"
CLUSTER = "stress"
FRACTION = 0.9      # of the roomy plan's peak: optimizer offload of some kinds, per decision

world1 = world_fixture(1, timeout_s=300)


@pytest.fixture(scope="module")
def planned():
    """(traced, mesh, budget, the plan as the ILP leaves it, the plan split per parameter),
    fp32, one device, blocking host step (closed form below)."""
    traced = trace(*build(MODEL, None, None, 0))
    mesh = Mesh((1,), cluster=CLUSTER)
    budget = int(plan_traced(traced, mesh).predicted.memory.peak * FRACTION)
    kw = {"memory_budget": budget, "offload_overlap": "none"}
    with pytest.MonkeyPatch.context() as m:
        m.setattr(planner, "offload_per_parameter", lambda *a: None)
        whole = plan_traced(traced, mesh, **kw)
    split = plan_traced(traced, mesh, **kw)
    return traced, mesh, device_budget(mesh.cluster, budget), whole, split


def _offloaded(plan) -> set[str]:
    return {n for n, s in plan.strategies().items() if s.kernel == StateMode.OFFLOAD}


def test_some_offloaded_parameters_come_back_and_the_peak_stays_within_the_budget(planned):
    traced, mesh, budget, whole, split = planned
    back = _offloaded(whole) - _offloaded(split)
    assert back and _offloaded(split) <= _offloaded(whole)
    assert split.predicted.memory.peak <= budget
    assert split.predicted.step_time_s < whole.predicted.step_time_s
    assert split.solver["objective"] == split.predicted.step_time_s
    assert "per parameter" in split.solver["note"]
    # One decision stands for every layer; the split offloads a kind in one layer only.
    kind = lambda n: n.split("_layers_")[-1].split("_", 1)[-1]
    assert any(kind(a) == kind(b) for a in back for b in _offloaded(split) if "_layers_" in a)
    # ... which the summary says of its layers: one decision, two layouts now.
    line = lambda p: next(x for x in p.summary().splitlines() if "layers.0 .." in x)
    assert line(whole).endswith("identical (decided once)")
    assert line(split).endswith("identical ops in 2 different layouts")
    # On one device the only device mode is plain, and nothing else changed.
    s, w = split.strategies(), whole.strategies()
    assert all(s[n].kernel is None for n in back)
    assert {n for n in s if s[n] != w[n]} == back


def test_the_earliest_read_come_back_first_as_many_as_fit(planned):
    traced, mesh, budget, whole, split = planned
    options = resolve_options(None, {"memory_budget": whole.options.memory_budget,
                                     "offload_overlap": "none"})
    moves = _moves(traced, mesh, options, whole.strategies())
    back = _offloaded(whole) - _offloaded(split)
    assert {n for n, _, _ in moves[:len(back)]} == back
    order = [n.name for n in traced.graph.nodes]
    node = {n.name: n for n in traced.graph.nodes}
    first = {p: min(order.index(u.name) for u in node[p].users) for p, _, _ in moves}
    assert [first[n] for n, _, _ in moves] == sorted(first[n] for n, _, _ in moves)
    # One more would not fit.
    more = dict(split.strategies())
    name, mode, axes = moves[len(back)]
    more[name] = replace(more[name], kernel=mode, state_axes=axes)
    over = assemble(grouped(traced, split.recompute), mesh, more, split.options,
                    solver={}, model_name="", timings={}, recompute=dict(split.recompute))
    assert over.predicted.memory.peak > budget


def test_the_step_saved_is_the_host_step_less_the_device_step_by_hand(planned):
    """fp32 Adam, one device, ``offload_overlap="none"`` (docs/cost-model.md §9, §9.1): an
    offloaded parameter of n elements steps in n·28 / host_mem_bandwidth + 2·n·4 /
    host_bandwidth; on the device in n·28 / mem_bandwidth. The optimizer step and the host
    link bytes fall by those of the parameters brought back; the host holds 24 bytes an
    element less of each (12 of state, a 4-byte gradient copy, two 4-byte buffers), and the
    device 8 more (its moments)."""
    traced, mesh, budget, whole, split = planned
    c = mesh.cluster
    numel = {p.name: 1 for p in traced.params}
    for p in traced.params:
        for d in traced.placeholder(p.name).info.shape:
            numel[p.name] *= d
    n = sum(numel[x] for x in _offloaded(whole) - _offloaded(split))
    saved = n * 28 / c.host_mem_bandwidth + 2 * n * 4 / c.host_bandwidth - n * 28 / c.mem_bandwidth
    w, s = whole.predicted, split.predicted
    assert w.optimizer_s - s.optimizer_s == pytest.approx(saved, rel=1e-9)
    assert w.step_time_s - s.step_time_s == pytest.approx(saved, rel=1e-9)
    link = lambda p: sum(t.bytes for t in p.host_transfers)
    assert link(whole) - link(split) == 2 * n * 4
    assert whole.predicted.memory.host - split.predicted.memory.host == 24 * n


def test_the_search_interpolates_between_what_fits_and_what_does_not():
    """Regula falsi on the resident bytes (solver/search.py ``fitting_edge``, the coordinate
    ``added``): where the peak is linear in them, the first count priced past a miss is the
    last that fits; with uneven bytes per move, the count found is still the most that fit."""
    added = [0.0, 1.0, 2.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0]
    for budget in (0.5, 1.0, 5.5, 6.0, 9.5, 13.0):
        calls = []

        def peak(j):
            calls.append(j)
            return added[j]
        got = fitting_edge(peak, 0, 10, budget, m_fit=0.0, x=added.__getitem__)
        assert got == max(j for j, a in enumerate(added) if a <= budget), budget
        # far first; then (the line exact) the count the line gives, and the one past it
        assert calls[0] == 10 and len(calls) <= 3, (budget, calls)
    # a peak that grows faster than the bytes: still the most that fit, in fewer pricings
    # than a scan
    calls = []
    got = fitting_edge(lambda j: calls.append(j) or added[j] ** 2, 0, 10, 40.0, m_fit=0.0,
                       x=added.__getitem__)
    assert got == 3 and len(calls) < 10, calls
    assert fitting_edge(lambda j: 1.0, 0, 0, 0.5, m_fit=0.0) == 0      # nothing to price


def test_a_move_that_alone_overfills_is_dropped_not_blocking_the_rest():
    """A move adding more resident bytes than the room left can never fit (Llama-3-8B's
    embedding, read first): it is dropped, with its parameter's later move (optimizer offload
    undone after parameter offload), and the moves after it stay in order."""
    off = StateMode.OFFLOAD
    moves = [("emb", off, None), ("a", off, None), ("emb", None, None), ("a", None, None),
             ("b", None, None)]
    steps = [2.0, 1.0, 12.0, 12.0, 30.0]
    assert _fitting(moves, steps, 30.0) == (moves, steps)
    assert _fitting(moves, steps, 15.0) == (moves[:4], steps[:4])
    assert _fitting(moves, steps, 1.5) == ([("a", off, None)], [1.0])


def test_a_forced_offload_is_left_as_asked(planned):
    traced, mesh, budget, whole, split = planned
    forced = plan_traced(traced, mesh, offload="optimizer")
    assert offload_per_parameter(traced, mesh, forced.options, forced) is None
    assert _offloaded(forced) == {p.name for p in traced.params}


def _plan_json() -> str:
    # (on "stress" the host step hides in backward and nothing comes back; on "cpu" it shows)
    traced = trace(*build(MODEL, None, None, 0))
    mesh = Mesh((1,), cluster="cpu")
    budget = int(plan_traced(traced, mesh).predicted.memory.peak * FRACTION)
    plan = plan_traced(traced, mesh, memory_budget=budget, offload_overlap="backward",
                       bucket_mb=0.004)
    assert "per parameter" in plan.solver["note"]
    return plan.dumps()


@pytest.mark.slow
def test_the_split_plan_trains_as_single_device(world1):
    """Some parameters of a kind stepped on the host (their buckets during backward), the
    others on the device: 3 AdamW steps within 1e-4 of single-device AdamW (fp32 on gloo, as
    tests/test_hostopt.py's)."""
    from test_hostopt import _train
    out = world1.run(_train, _plan_json())[0]
    assert out["hooked"] > 0 and out["err"] < 1e-4 and out["settled_err"] < 1e-4


@pytest.mark.slow
def test_every_layer_checkpointed_in_full_is_tried_when_faster_after_the_pass():
    """Llama-3-8B (32 layers) on one 80 GB H100, batch 1 x 2048, bf16-mixed (docs/cost-model.md
    §9.2): the checkpointing search picks a mix of full and selective against the ILP's
    offload, one mode per decision; with every layer fully checkpointed the pass brings more
    state back, and the planner's plan is that one: no slower than recompute="full" asked for,
    its note naming the mix it replaced."""
    from autoshard.zoo.registry import load_model
    traced = trace(*load_model("llama3-8b", batch=1, seq=2048, device="meta"))
    mesh = Mesh((1,), cluster="h100")
    kw = {"precision": "bf16-mixed", "memory_budget": 80e9, "offload_overlap": "backward"}
    auto = plan_traced(traced, mesh, **kw)
    full = plan_traced(traced, mesh, recompute="full", **kw)
    assert set(auto.recompute.values()) == {"full"}
    assert auto.predicted.step_time_s <= full.predicted.step_time_s * (1 + 1e-9)
    assert auto.predicted.memory.peak <= device_budget(mesh.cluster, 80e9)
    note = auto.solver["note"]
    assert "every checkpointable layer recomputed in full" in note and "selective" in note
