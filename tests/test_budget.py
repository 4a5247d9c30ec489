"""The budget is the step's peak (docs/cost-model.md §4.6): every plan the planner returns peaks
within ``memory_budget`` over forward, backward and the optimizer step as the step program's
liveness walk computes it, or the planner refuses and names the least memory a plan needs; the
default budget leaves the device's reserve; the step program is the one order every consumer
reads (cost/program.py)."""
from __future__ import annotations

import json
import os

import pytest

from autoshard import Mesh
from autoshard.cluster import PRESETS
from autoshard.cost.liveness import step_memory
from autoshard.cost.memory import (ALLOCATOR_SLACK, DEVICE_RESERVE_BYTES, HOST_RESERVE_BYTES,
                                   device_budget, host_budget)
from autoshard.cost.price import Pricer
from autoshard.cost.program import step_program
from autoshard.cost.reshards import reshard_edges
from autoshard.cost.overlap import first_grad_syncs
from autoshard.plans import Plan
from autoshard.solver.planner import plan_traced
from autoshard.solver.solve import BudgetError
from autoshard.trace.export import trace
from autoshard.trace.graph import value_shapes
from autoshard.tools.verify import VerifySpec, build, summarize, verify_rank
from autoshard.zoo.registry import get_model
from dist import world_fixture

# Fractions of the unconstrained plan's step peak: from a budget that barely binds to one
# below what any technique reaches.
# (0.7 and 0.35 between them with AUTOSHARD_SLOW=1, the full matrix)
FRACTIONS = (0.9, 0.7, 0.5, 0.35, 0.1) if os.environ.get("AUTOSHARD_SLOW") else (0.9, 0.5, 0.1)
MEASURED = "gpt2-tiny"         # the model the gloo ranks run (verify's zoo batch)


@pytest.fixture(scope="module")
def gpt2():
    model, inputs = get_model("gpt2-tiny", batch=16)
    return trace(model, inputs)


@pytest.fixture(scope="module")
def gpt2_bf16():
    from autoshard.trace.batches import Traces
    model, inputs = get_model("gpt2-tiny", batch=16)
    traces = Traces(model, inputs, training=True, precision="bf16-mixed")
    return traces.at(traces.full)


def _sweep(traced, mesh: Mesh, **options) -> list[tuple[int, str]]:
    """Budgets at FRACTIONS of the unconstrained plan's peak; ``options`` for the budgeted plans
    only."""
    roomy = plan_traced(traced, mesh)
    peak = roomy.predicted.memory.peak
    seen = []
    for f in FRACTIONS:
        budget = int(peak * f)
        try:
            p = plan_traced(traced, mesh, memory_budget=budget, **options)
        except BudgetError as e:
            assert e.least_bytes > budget, (f, e)
            assert "least memory" in str(e)
            seen.append((budget, f"refused at {e.least_bytes}"))
            continue
        got = p.predicted.memory.peak
        assert got <= budget * (1 - ALLOCATOR_SLACK), (f, got, budget)
        # The figure is the walk's, recomputed from the plan alone.
        pricer = Pricer(traced, mesh, p.options, recompute=p.recompute)
        assert step_memory(traced, p.strategies(), pricer).peak == got
        assert not any("budget" in w for w in p.warnings), p.warnings
        seen.append((budget, p.predicted.peak_phase))
    return seen


@pytest.mark.slow
def test_every_plan_of_a_budget_sweep_peaks_within_it(gpt2):
    # Every layer checkpointed: what the planner picks at each of these budgets anyway (the
    # same plans and refusals), without the recompute search's three solves per rung of the
    # memory ladder; the mixed-precision sweep below keeps that search (it picks "selective"
    # at 0.7, a fraction of the full matrix), as does tests/test_planner.py
    # test_recompute_ladder_holds_the_step_peak.
    seen = _sweep(gpt2, Mesh((2,), cluster="cpu"), recompute="full")
    assert any(not s.startswith("refused") for _, s in seen)     # some budgets are met
    assert seen[-1][1].startswith("refused")                     # and 10% is below any plan


@pytest.mark.slow
def test_a_mixed_precision_sweep_on_one_device(gpt2_bf16):
    # bf16-mixed: the optimizer step casts every gradient to fp32 beside the masters, so
    # offload is what lowers its peak.
    seen = _sweep(gpt2_bf16, Mesh((1,), cluster="cpu"))
    assert seen[-1][1].startswith("refused")


def test_default_budget_is_the_device_memory_less_its_reserve():
    h100 = PRESETS["h100"]
    assert device_budget(h100, None) == pytest.approx(
        (h100.memory_bytes - DEVICE_RESERVE_BYTES) * (1 - ALLOCATOR_SLACK), rel=1e-15)
    # A given budget is the allocator's: the walk's peak is held below it by the slack.
    assert device_budget(h100, 40 * 2**30) == pytest.approx(40 * 2**30 * (1 - ALLOCATOR_SLACK),
                                                            rel=1e-15)
    assert host_budget(h100) == h100.host_memory_bytes - HOST_RESERVE_BYTES


def test_a_plan_file_with_the_old_name_of_the_ilp_sum_loads(gpt2):
    p = plan_traced(gpt2, Mesh((2,), cluster="cpu"))
    d = json.loads(p.dumps())
    d["predicted"]["peak_memory_bytes"] = d["predicted"].pop("ilp_memory_bytes")
    old = Plan.loads(json.dumps(d))
    assert old.predicted.ilp_sum_bytes == p.predicted.ilp_sum_bytes
    assert "peak_memory_bytes" not in old.predicted.to_json()
    assert old.dumps() == p.dumps()         # saved again under the new name


def test_the_step_program_runs_each_reshard_before_its_first_reader(gpt2):
    p = plan_traced(gpt2, Mesh((2, 2), cluster="cpu"), recompute="full")
    strategies = p.strategies()
    prog = step_program(gpt2, strategies, p.mesh_shape, bucket_bytes=p.options.bucket_bytes,
                        recompute=p.recompute)
    order = [n.name for n in gpt2.graph.nodes]
    ops = [ev.name for ev in prog.events if ev.kind == "op"]
    assert ops == [n.name for n in gpt2.graph.nodes if n.op == "call_function"
                   and n.target.__name__ != "getitem"]
    # Every reshard once, just before its first consumer, in that consumer's layer.
    seen = [ev.edge for ev in prog.events if ev.kind == "reshard"]
    assert sorted(seen) == list(range(len(prog.edges)))
    for k, ev in enumerate(prog.events):
        if ev.kind == "reshard":
            e = prog.edges[ev.edge]
            assert ev.name == min((c for c, _ in e.consumers), key=order.index)
            nxt = next(x for x in prog.events[k:] if x.kind == "op" or x.name == "output")
            assert nxt.name == ev.name or ev.name == "output"
    assert {ev.region for ev in prog.events} - {None} == set(p.recompute)
    # The same reshards and the same bucketed syncs as every other reader computes them.
    edges = list(reshard_edges(gpt2.graph, strategies, p.mesh_shape, value_shapes(gpt2.graph),
                               {x.name for x in gpt2.params}, training=True))
    assert list(prog.edges) == edges
    assert {k: prog.edges[i] for k, i in prog.bucketed.items()} == first_grad_syncs(edges)
    # The plan's ledger lists the program's buckets.
    records = [c for c in p.collectives if c.members]
    assert sorted({c.node for c in records}) == sorted(f"bucket{k}"
                                                       for k in range(len(prog.buckets)))
    assert {m for b in prog.buckets for m in b.members} == set(prog.bucketed)


# ------------------------------------------------------------------ measured on gloo ranks

world2 = world_fixture(2, timeout_s=300)


@pytest.mark.slow
def test_measured_peaks_of_a_budget_sweep_stay_within_it(world2):
    """verify's MemTracker peak (the CPU allocator as the tracker sees it) of every plan a budget
    sweep returns is within the budget, and within 10% of the predicted step peak (as
    docs/cost-model.md §4.5 measures it)."""
    traced = trace(*build(MEASURED, None, None, 0))
    mesh = Mesh((2,), cluster="stress")
    peak = plan_traced(traced, mesh).predicted.memory.peak
    checked = 0
    for f in (0.85, 0.6):
        budget = int(peak * f)
        try:
            p = plan_traced(traced, mesh, memory_budget=budget)
        except BudgetError as e:
            assert e.least_bytes > budget
            continue
        reps = world2.run(verify_rank, VerifySpec(MEASURED, p.mesh_shape, p.mesh_axes,
                                                  p.dumps()))
        ok, text = summarize(reps, 1e-5)
        assert ok, text
        for r in reps:
            m = r["memory"]
            assert m["measured"] <= budget, (f, m["measured"], budget)
            assert abs(m["error"]) <= 0.10, (f, m)
        checked += 1
    assert checked


def test_the_least_fitting_count_takes_three_pricings_where_layers_are_alike():
    """solver/budget.py ``least_fitting``: the least k whose memory fits, memory falling by the
    same bytes per layer (3 pricings: k = 0, the line's count, the one below), and by uneven
    steps (the answer of a scan, in fewer pricings than a scan)."""
    from autoshard.solver.budget import least_fitting
    calls = []

    def line(k):
        calls.append(k)
        return 100.0 - 7.0 * k
    for budget in (99.0, 60.0, 44.0, 30.0, 3.0):
        calls.clear()
        want = min(k for k in range(15) if line(k) <= budget)
        calls.clear()
        assert least_fitting(line, 14, line(14), budget) == want
        assert len(calls) - 1 <= 3, (budget, calls)      # (one call above is at_n's)
    steps = [100, 90, 89, 88, 60, 59, 58, 20, 19, 18, 5]       # uneven, never rising
    for budget in (95, 89, 61, 58, 18, 5):
        calls.clear()
        got = least_fitting(lambda k: calls.append(k) or steps[k], 10, steps[10], budget)
        assert got == min(k for k, m in enumerate(steps) if m <= budget)
        assert len(calls) < 10
    assert least_fitting(lambda k: 0.0, 10, 0.0, 1.0) == 0
    assert least_fitting(lambda k: 50.0 - k, 10, 40.0, 30.0) == 10     # nothing fits: n
