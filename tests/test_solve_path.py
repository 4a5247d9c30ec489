"""One solve path: pins, restrictions and no-good cuts are problem data, and a solve that stops
at its time limit returns a plan no slower than the obvious ones it started from."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from ortools.linear_solver import pywraplp

from autoshard import Mesh
from autoshard.solver import ilp
from autoshard.solver.baselines import baseline_plan, stored_plan
from autoshard.solver.diagnostics import smaller_mesh
from autoshard.solver.planner import plan_traced
from autoshard.solver.ties import break_ties
from autoshard.solver.problem import (Cut, Decision, Edge, Problem, Start, admits, combined,
                                      evaluate, excluded, restricted)
from autoshard.trace.export import trace
from autoshard.zoo.registry import get_model

REL = 1e-9


def chain() -> Problem:
    """A -> B -> C, two strategies each; switching strategy along an edge costs 10. The optimum
    is (1, 1, 1) at 5; (0, 0, 0) costs 7."""
    switch = ((0.0, 10.0), (10.0, 0.0))
    decisions = (Decision("A", 1, (1.0, 2.0), (0.0, 0.0)),
                 Decision("B", 1, (1.0, 2.0), (0.0, 0.0)),
                 Decision("C", 1, (5.0, 1.0), (0.0, 0.0)))
    edges = tuple(Edge(f"e{k}", 1, k, k + 1, (0, 1), (0, 1), switch) for k in range(2))
    return Problem(decisions, edges, memory_budget=1e9)


def brute_force(problem: Problem) -> tuple[float, tuple[int, ...]]:
    return min((evaluate(problem, c)[0], c) for c in itertools.product(
        *(range(len(d.cost)) for d in problem.decisions)) if admits(problem, c))


def test_cuts_are_problem_data_every_solve_keeps() -> None:
    """A no-good cut excludes the optimum: the solve gives the runner-up, as brute force does;
    a restriction (most=0) holds a decision to its other strategies; both round-trip JSON."""
    p = chain()
    best = ilp.solve(p)
    assert best.choice == (1, 1, 1)
    no_good = replace(p, cuts=(Cut(tuple(enumerate(best.choice)), 2),))
    second = ilp.solve(no_good)
    assert second.choice != best.choice
    assert second.objective == pytest.approx(brute_force(no_good)[0], rel=REL) == 7.0
    held = restricted(p, {2: {0}})
    assert ilp.solve(held).objective == pytest.approx(brute_force(held)[0], rel=REL) == 7.0
    assert Problem.from_json(no_good.to_json()) == no_good
    # ties are broken within the cuts: C's strategy 1 is cut, so no move puts it back
    assert break_ties(held, (0, 0, 0), {2: [1, 0]}) == (0, 0, 0)


def _never_solves(monkeypatch) -> list[tuple[str, bool]]:
    """Every backend stops at its time limit without a plan on the whole problem (as on
    Gemma-3 12B's 8x8 problem, status NOT_SOLVED); restricted problems (with cuts, or with
    strategies projected away: fewer than the first problem solved) solve as they do."""
    real, calls, whole_shape = ilp._attempt, [], []

    def attempt(problem, backends, limit, cutoff, hint=(), **kw):
        shape = tuple(len(d.cost) for d in problem.decisions)
        whole_shape[:] = whole_shape or [shape]
        whole = not problem.cuts and shape == whole_shape[0]
        if whole:
            m = ilp._Model(problem, backends)        # built, never solved: no bound either
            calls.append((m.backend, whole))
            return ilp.Run(pywraplp.Solver.NOT_SOLVED, m.backend, len(m.x), 0.0)
        calls.append((backends[0], whole))
        return real(problem, backends, limit, cutoff, hint, **kw)

    monkeypatch.setattr(ilp, "_attempt", attempt)
    return calls


def test_a_start_is_returned_where_the_solver_finds_nothing(monkeypatch) -> None:
    _never_solves(monkeypatch)
    p = chain()
    sol = ilp.solve(p, time_limit_s=2.0, starts=[Start("all zero", (0, 0, 0)),
                                                 Start("held", within=restricted(p, {2: {1}}).cuts)])
    # the restriction solves to (1, 1, 1), faster than the full choice (0, 0, 0)
    assert sol.choice == (1, 1, 1) and sol.start == "held" and sol.status == "FEASIBLE"
    assert sol.objective == pytest.approx(5.0, rel=REL) and sol.bound <= sol.objective
    assert "start" in sol.note
    # without starts the verdict is the solver's own: no plan in the time limit
    with pytest.raises(ilp.NoSolution):
        ilp.solve(replace(p, memory_budget=1e9), time_limit_s=2.0, verdict=False)


def test_a_start_is_never_kept_over_a_faster_solver_plan() -> None:
    sol = ilp.solve(chain(), starts=[Start("all zero", (0, 0, 0))])
    assert sol.choice == (1, 1, 1) and sol.status == "OPTIMAL" and sol.start == ""


@pytest.fixture(scope="module")
def gpt2_tiny():
    model, inputs = get_model("gpt2-tiny")
    return trace(model, inputs)


def test_time_limited_plan_is_no_slower_than_the_baselines_and_the_smaller_mesh(
        monkeypatch, gpt2_tiny) -> None:
    """The solver stops early without a plan of its own: the plan is the best start, no slower
    than each hand-written plan and than the plan on the mesh without either axis, and the plan
    file names the start and the gap."""
    mesh = Mesh((2, 4), ("dp", "tp"), cluster="h100")
    others = {name: baseline_plan(gpt2_tiny, mesh, name) for name in ("dp", "megatron-dp")}
    others["fsdp"] = stored_plan(gpt2_tiny, mesh, "fsdp")
    for a in range(mesh.ndim):
        small = smaller_mesh(mesh, (a,))
        others[f"on {small.shape}"] = plan_traced(gpt2_tiny, small)
    calls = _never_solves(monkeypatch)
    # The whole problem's solves return at once; the limit is the starts' restricted solves'
    # (half of it each, in a child process), wide enough that a loaded machine does not cut
    # them short.
    plan = plan_traced(gpt2_tiny, mesh, time_limit_s=120.0)
    assert any(whole for _, whole in calls)
    assert plan.solver["status"] == "FEASIBLE" and plan.solver["start"]
    assert 0.0 <= plan.solver["gap"] <= 1.0
    ours = plan.predicted.step_time_s
    for name, other in others.items():
        assert ours <= other.predicted.step_time_s * (1 + 1e-6), (name, ours, other.predicted)


def test_starts_cost_nothing_where_the_first_backend_proves_the_optimum(monkeypatch,
                                                                       gpt2_tiny) -> None:
    """The obvious plans are built and solved only when the solver stops short of an optimum:
    a problem CBC settles plans as before, with no start in its record."""
    from autoshard.solver import solve

    def boom(*a, **k):
        raise AssertionError("starts built for a problem the first backend settles")

    monkeypatch.setattr(solve, "obvious_starts", boom)
    plan = plan_traced(gpt2_tiny, Mesh((2, 4), ("dp", "tp"), cluster="h100"))
    assert plan.solver["status"] == "OPTIMAL" and "start" not in plan.solver


# Four strategies per decision, numbered by their placements on two axes: (axis 0, axis 1).
_GRID = ((0, 0), (0, 1), (1, 0), (1, 1))


def test_combined_start_takes_each_axis_from_its_part() -> None:
    """A combined start holds each decision to the strategies placed on axis ``a`` as the
    plan of ``parts[a]`` places it; a decision no strategy of which matches both is left free,
    and nothing is held before every part has a plan."""
    p = Problem(tuple(Decision(f"d{g}", 1, (1.0,) * 4, (0.0,) * 4) for g in range(2))
                + (Decision("d2", 1, (1.0, 1.0), (0.0, 0.0)),), (), memory_budget=1e9)
    start = Start("both", parts=("A", "B"), keys=(_GRID, _GRID, ((0, 0), (1, 1))))
    assert combined(p, start, {"A": (2, 0, 0)}) is None
    cuts = combined(p, start, {"A": (2, 0, 0), "B": (1, 3, 1)})
    held = excluded(replace(p, cuts=cuts))
    # d0: axis 0 as A's strategy 2 (1), axis 1 as B's strategy 1 (1) -> (1, 1), strategy 3;
    # d1: (0, 1) -> strategy 1; d2: A's (0, .) and B's (., 1) are no strategy of it, and
    # each of its two matches one axis: both kept, free
    assert held == {0: {0, 1, 2}, 1: {0, 2, 3}}
    # d2 with a third strategy matching neither axis: held to the two that match one
    p3 = replace(p, decisions=(*p.decisions[:2], Decision("d2", 1, (1.0,) * 3, (0.0,) * 3)))
    start3 = replace(start, keys=(_GRID, _GRID, ((0, 0), (1, 1), (1, 0))))
    assert excluded(replace(p3, cuts=combined(p3, start3, {"A": (2, 0, 0), "B": (1, 3, 1)}))) \
        == {0: {0, 1, 2}, 1: {0, 2, 3}, 2: {2}}


def test_combined_start_is_solved_after_its_parts_and_kept_when_fastest(monkeypatch) -> None:
    """The solver finds nothing: the plans of the two parts are solved first, and the
    combination of their axes, faster than either, is the plan returned."""
    _never_solves(monkeypatch)
    cost = (5.0, 5.0, 5.0, 1.0)               # (1, 1) on both axes is the fastest
    p = Problem(tuple(Decision(f"d{g}", 1, cost, (0.0,) * 4) for g in range(2)), (),
                memory_budget=1e9)
    starts = [Start("A", (2, 2)), Start("B", (1, 1)),
              Start("both", parts=("A", "B"), keys=(_GRID, _GRID))]
    sol = ilp.solve(p, time_limit_s=2.0, starts=starts)
    assert sol.choice == (3, 3) and sol.start == "both"
    assert sol.objective == pytest.approx(2.0, rel=REL)


def test_obvious_starts_combine_the_smaller_meshes_plans(gpt2_tiny) -> None:
    """On a 2-D mesh one start combines the data axis of the plan without the model axis
    with the model axis of the plan without the data axis; its keys number every strategy's
    placements on each axis, alike where they are alike."""
    from autoshard.solver.build import build_problem
    from autoshard.solver.starts import obvious_starts
    mesh = Mesh((2, 4), ("dp", "tp"), cluster="h100")
    built = build_problem(gpt2_tiny, mesh)
    start = next(s for s in obvious_starts(gpt2_tiny, mesh, built) if s.parts)
    assert start.parts == ("mesh without axis tp", "mesh without axis dp")
    assert [len(k) for k in start.keys] == [len(d.cost) for d in built.problem.decisions]
    for m in built.members.values():
        for i, j in enumerate(m.index):
            for i2, j2 in enumerate(m.index):
                s, s2 = m.strategies[j], m.strategies[j2]
                for a in range(2):
                    if start.keys[m.decision][i][a] == start.keys[m.decision][i2][a]:
                        assert [x[a] for x in (*s.inputs, *s.outputs) if x is not None] == \
                            [x[a] for x in (*s2.inputs, *s2.outputs) if x is not None]


def test_no_reshard_runs_for_a_check_alone() -> None:
    """A dtype check export writes beside each ``.to`` (``aten._assert_tensor_metadata``) costs
    the same in every layout it can read, so ties are broken toward reading its input as it
    lies: no reshard is made for checks alone, which the rank program would run for nothing (a
    partial read is a zeroed copy on every rank but the first), at each layer's first op
    (Megatron over 8: the embedding's output and the layer's, each read by an RMSNorm's
    ``.float()`` check)."""
    import torch

    from autoshard.cost.reshards import reshard_edges
    from autoshard.trace.graph import value_shapes
    from autoshard.zoo.models import Llama, LlamaConfig
    torch.manual_seed(0)
    model = Llama(LlamaConfig(n_layers=1, hidden=64, n_heads=8, n_kv_heads=8, ffn=128,
                              vocab_size=512, context=8))
    traced = trace(model, model.example_inputs(1, 8, device="cpu"))
    mesh = Mesh((8,), ("tp",), cluster="h100")
    plan = baseline_plan(traced, mesh, "megatron")
    check = torch.ops.aten._assert_tensor_metadata.default
    names = {n.name for n in traced.graph.nodes if n.target is check}
    edges = list(reshard_edges(traced.graph, plan.strategies(), mesh.shape,
                               value_shapes(traced.graph), {p.name for p in traced.params},
                               training=True))
    assert names and edges
    assert not [e.value for e in edges if {c for c, _ in e.consumers} <= names]


def test_a_plan_the_solver_stops_short_of_proving_is_improved_one_axis_at_a_time(
        monkeypatch, gpt2_tiny) -> None:
    """The solver stops at its time limit with a plan it cannot prove (here: its optimum with
    one decision moved to its slowest strategy that fits): the planner improves it one mesh
    axis at a time (solver/descent.py), and its record says so."""
    from autoshard.solver import solve as solve_path
    mesh = Mesh((2, 4), ("dp", "tp"), cluster="stress")
    optimum = plan_traced(gpt2_tiny, mesh).predicted.step_time_s
    real, worse = solve_path.solve, []

    def stopped_short(problem, **kw):
        sol = real(problem, **kw)
        slowest = max(((evaluate(problem, c)[0], c) for g, d in enumerate(problem.decisions)
                       for c in [sol.choice[:g] + (i,) + sol.choice[g + 1:]
                                 for i in range(len(d.cost))]
                       if evaluate(problem, c)[1] <= problem.memory_budget and
                       admits(problem, c)))
        worse.append(slowest[0])
        return replace(sol, choice=slowest[1], objective=slowest[0], status="FEASIBLE")

    monkeypatch.setattr(solve_path, "solve", stopped_short)
    plan = plan_traced(gpt2_tiny, mesh)
    assert worse and worse[0] > optimum * 1.01
    assert optimum * (1 - 1e-9) <= plan.predicted.step_time_s < worse[0]
    assert "improved one mesh axis at a time" in plan.solver["note"]
