"""The sharding ILP on hand-built problems (tier 0: pure data, no torch).

Every problem here is small enough to solve by hand or by brute force, so each test states the
known optimum and checks the solver finds it (the solver input is pure data).
"""
from __future__ import annotations

import itertools
import math
import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ortools.linear_solver import pywraplp

from autoshard.solver.deadline import Deadline
from autoshard.solver.ties import break_ties
from autoshard.solver.ilp import (Infeasible, MemoryBinds, NoBetter, NoSolution, least_memory,
                                  least_memory_plan, solve)
from autoshard.solver.problem import (FORBIDDEN, Decision, Edge, Fanout, Problem, Solution,
                                      Start, admits, evaluate, projected, restricted)

# Seconds-sized costs; the MIP's own tolerances are far below this on problems this small.
REL = 1e-9


def _switch(cost: float) -> tuple[tuple[float, ...], ...]:
    """A 2x2 edge matrix: keeping the spec is free, changing it costs ``cost``."""
    return ((0.0, cost), (cost, 0.0))


def _edge(name: str, producer: int, consumer: int, cost, *, multiplicity: int = 1) -> Edge:
    n_o, n_r = len(cost), len(cost[0])
    return Edge(name, multiplicity, producer, consumer, tuple(range(n_o)), tuple(range(n_r)), tuple(cost))


def chain() -> Problem:
    """A -> B -> C, two strategies each. Per node, (A0, B0, C1) is cheapest (1 + 1 + 1) but the
    switch B0 -> C1 costs 10, so the optimum is (1, 1, 1) at 2 + 2 + 1 = 5, not 13, and not
    (0, 0, 0) at 7."""
    decisions = (Decision("A", 1, (1.0, 2.0), (0.0, 0.0)), Decision("B", 1, (1.0, 2.0), (0.0, 0.0)),
              Decision("C", 1, (5.0, 1.0), (0.0, 0.0)))
    edges = (_edge("A:0", 0, 1, _switch(10.0)), _edge("B:0", 1, 2, _switch(10.0)))
    return Problem(decisions, edges, memory_budget=1e9)


def brute_force(problem: Problem) -> tuple[float, tuple[int, ...]] | None:
    """The optimum over every assignment within the budget (None: none fits)."""
    best = None
    pins = dict(problem.fixed)
    ranges = [[pins[g]] if g in pins else range(len(dec.cost))
              for g, dec in enumerate(problem.decisions)]
    for choice in itertools.product(*ranges):
        t, mem = evaluate(problem, choice)
        if mem <= problem.memory_budget and (best is None or t < best[0]):
            best = (t, choice)
    return best


def test_chain_optimum_is_not_the_per_node_cheapest() -> None:
    p = chain()
    greedy = tuple(min(range(len(g.cost)), key=g.cost.__getitem__) for g in p.decisions)
    assert greedy == (0, 0, 1)
    assert evaluate(p, greedy)[0] == 13.0
    sol = solve(p)
    assert sol.choice == (1, 1, 1)
    assert sol.objective == pytest.approx(5.0, rel=REL)
    assert sol.status == "OPTIMAL" and sol.gap == 0.0


def test_cutoff_searches_only_faster_plans() -> None:
    """With the step of a plan already held as the cutoff, the optimum below it is returned,
    and a cutoff at or below the optimum means there is nothing better: NoBetter."""
    from autoshard.solver.ilp import NoBetter
    assert solve(chain(), cutoff_s=6.0).objective == pytest.approx(5.0, rel=REL)
    for cutoff in (5.0, 4.0):
        with pytest.raises(NoBetter):
            solve(chain(), cutoff_s=cutoff)


def _fanout_problem(reshard: tuple[float, float, float]) -> Problem:
    """Value of P (one spec, class 0) read by C1 and C2, each with strategy 0 (needs spec 0,
    cost 5) or 1 (needs spec 1, cost 2) or, C2 only, 2 (needs spec 2, cost 1). ``reshard`` is
    the price of spec 0 -> 0, 1, 2."""
    decisions = (Decision("P", 1, (0.0,), (0.0,)),
              Decision("C1", 1, (5.0, 2.0), (0.0, 0.0)),
              Decision("C2", 1, (5.0, 2.0, 1.0), (0.0, 0.0, 0.0)))
    fan = Fanout("P:0", 1, 0, (0,), ((1, (0, 1)), (2, (0, 1, 2))), (reshard,))
    return Problem(decisions, (), memory_budget=1.0, fanouts=(fan,))


def test_fanout_shares_one_reshard() -> None:
    """Each consumer saves 3 by running strategy 1, which needs the value in spec 1; resharding
    spec 0 -> 1 costs 4. Priced per consumer, switching never pays (3 < 4); shared once by the
    fanout, both switch: 4 - 6 = -2 better than staying."""
    p = _fanout_problem((0.0, 4.0, 100.0))
    sol = solve(p)
    assert sol.choice == (0, 1, 1)
    assert sol.objective == pytest.approx(4.0 + 2.0 + 2.0, rel=REL)
    assert evaluate(p, sol.choice)[0] == pytest.approx(sol.objective, rel=REL)
    # The same problem with a private reshard per consumer keeps spec 0.
    private = Problem(p.decisions, (_edge("P:0", 0, 1, ((0.0, 4.0),)),
                                 _edge("P:0", 0, 2, ((0.0, 4.0, 100.0),))), memory_budget=1.0)
    sol = solve(private)
    assert sol.choice == (0, 0, 0) and sol.objective == pytest.approx(10.0, rel=REL)


def test_fanout_pays_each_requirement_in_use_from_the_producer() -> None:
    """Two different requirements are two reshards, each priced from the producer's spec.
    With both at 1.5, C1 on spec 1 and C2 on spec 2 cost 1.5 + 1.5 + 2 + 1 = 6, more than both
    sharing spec 1 (1.5 + 2 + 2 = 5.5); with spec 2 at 0.2 the split costs 4.7 and wins."""
    sol = solve(_fanout_problem((0.0, 1.5, 1.5)))
    assert sol.choice == (0, 1, 1) and sol.objective == pytest.approx(5.5, rel=REL)
    sol = solve(_fanout_problem((0.0, 1.5, 0.2)))
    assert sol.choice == (0, 1, 2) and sol.objective == pytest.approx(4.7, rel=REL)


def test_break_ties_moves_only_at_equal_cost_and_within_memory() -> None:
    """W (a weight: 0 replicated, 1 sharded) feeds C. Reading it sharded costs 1 + 1 (gather,
    then reduce-scatter its gradient); replicated, its gradient all-reduce costs 2: a tie the
    tie-break resolves towards strategy 0, unless memory or time says otherwise."""
    def problem(ar: float, budget: float) -> Problem:
        decisions = (Decision("W", 1, (0.0, 0.0), (16.0, 2.0)), Decision("C", 2, (1.0,), (0.0,)))
        return Problem(decisions, (_edge("W:0", 0, 1, ((ar,), (2.0,))),), memory_budget=budget)

    assert break_ties(problem(2.0, 100.0), (1, 0), {0: [0, 1]}) == (0, 0)
    assert break_ties(problem(2.0, 10.0), (1, 0), {0: [0, 1]}) == (1, 0)      # 16 B > budget
    assert break_ties(problem(2.5, 100.0), (1, 0), {0: [0, 1]}) == (1, 0)     # slower
    assert break_ties(replace(problem(2.0, 100.0), fixed=((0, 1),)), (1, 0), {0: [0, 1]}) == (1, 0)


def two_ways(multiplicity: int = 1) -> Problem:
    """One op, fast and memory-hungry (cost 1, 100 B) or slow and lean (cost 2, 10 B), fed by a
    producer whose two strategies cost 0.5 (7 B) or 0.9 (3 B)."""
    decisions = (Decision("prod", 1, (0.5, 0.9), (7.0, 3.0)),
              Decision("op", multiplicity, (1.0, 2.0), (100.0, 10.0)))
    return Problem(decisions, (_edge("prod:0", 0, 1, _switch(0.25)),), memory_budget=1e9)


@pytest.mark.parametrize("multiplicity", [1, 3])
def test_memory_budget_flips_to_the_lean_strategy(multiplicity: int) -> None:
    roomy = solve(two_ways(multiplicity))
    assert roomy.choice[1] == 0
    assert roomy.objective == pytest.approx(0.5 + multiplicity * 1.0, rel=REL)
    # Room for the lean op but not the fast one: the op flips; the producer keeps its cheap
    # strategy and pays the switch (0.5 + 0.25 < 0.9).
    tight = replace(two_ways(multiplicity), memory_budget=multiplicity * 10.0 + 7.0)
    sol = solve(tight)
    assert sol.choice == (0, 1)
    assert sol.objective == pytest.approx(0.5 + multiplicity * 2.0 + 0.25, rel=REL)
    assert evaluate(tight, sol.choice)[1] <= tight.memory_budget
    # Tighter still: the producer must take its lean strategy too, and no switch is needed.
    tighter = replace(two_ways(multiplicity), memory_budget=multiplicity * 10.0 + 3.0)
    sol = solve(tighter)
    assert sol.choice == (1, 1)
    assert sol.objective == pytest.approx(0.9 + multiplicity * 2.0, rel=REL)


def test_infeasible_budget_reports_the_true_least_memory() -> None:
    p = replace(two_ways(3), memory_budget=32.9)      # least is 3 + 3 * 10 = 33
    with pytest.raises(Infeasible) as info:
        solve(p)
    exact = min(evaluate(p, c)[1] for c in itertools.product(range(2), range(2)))
    assert exact == 33.0
    assert info.value.least_memory == pytest.approx(exact, rel=REL)
    assert least_memory(p) == exact
    # A pin counts: with the fast op pinned, the least memory is 3 + 3 * 100.
    pinned = replace(p, fixed=((1, 0),))
    with pytest.raises(Infeasible) as info:
        solve(pinned)
    assert info.value.least_memory == pytest.approx(303.0, rel=REL)


# The four outcomes of a solve, each forced: optimal (the tests above), feasible with a stated
# gap, no incumbent in time (a plan of least memory when one fits, else no solution), infeasible
# (with the least memory, exact or a bound).

def _status(monkeypatch, status: int, *, solve_first: bool = False) -> None:
    """Make every MIP solve report ``status`` (after really solving, with ``solve_first``)."""
    real = pywraplp.Solver.Solve

    def fake(self, *a):
        if solve_first:
            real(self, *a)
        return status

    monkeypatch.setattr(pywraplp.Solver, "Solve", fake)


def test_feasible_incumbent_states_its_gap(monkeypatch) -> None:
    _status(monkeypatch, pywraplp.Solver.FEASIBLE, solve_first=True)
    sol = solve(chain())
    assert sol.status == "FEASIBLE" and sol.objective == pytest.approx(5.0, rel=REL)
    assert 0.0 <= sol.gap <= 1.0 and sol.note == ""


def test_a_backend_without_a_proven_optimum_hands_over_to_the_next(monkeypatch) -> None:
    """CBC solves first, for half the time limit; where it proves no optimum, HiGHS gets the
    other half and its optimum is kept."""
    from autoshard.solver import ilp
    real, calls = ilp._attempt, []

    def attempt(problem, backends, limit, cutoff, *hint):
        run = real(problem, backends, limit, cutoff, *hint)
        calls.append((run.backend, limit))
        # CBC stops at its time limit with an incumbent it could not prove
        return replace(run, status=pywraplp.Solver.FEASIBLE) if run.backend == "CBC" else run

    monkeypatch.setattr(ilp, "_attempt", attempt)
    sol = solve(chain(), time_limit_s=8.0)
    # half of what is left of the limit (a solve's parts share one deadline)
    assert [b for b, _ in calls] == ["CBC", "HIGHS"] and calls[0][1] == pytest.approx(4.0, abs=0.1)
    assert sol.status == "OPTIMAL" and sol.objective == pytest.approx(5.0, rel=REL)
    # infeasibility CBC proves well before its limit is not tried again: here the switch's
    # saved copy (edge memory) is what does not fit, which no decision's own memory shows
    calls.clear()
    monkeypatch.setattr(ilp, "_attempt", lambda *a: calls.append(a[1][0]) or real(*a))
    p = replace(two_ways(3), memory_budget=33.5)
    p = replace(p, edges=(replace(p.edges[0], memory=((1.0, 1.0), (1.0, 1.0))),))
    with pytest.raises(Infeasible):
        solve(p, time_limit_s=8.0)
    assert calls == ["CBC"]


def test_a_budget_below_every_decisions_least_memory_is_refused_without_a_search(
        monkeypatch) -> None:
    """Every decision at its leanest already over the budget: Infeasible at once, with the
    least memory, and no step-time MIP run (on a memory-bound 70B model each ran to its time
    limit before it said so)."""
    from autoshard.solver import ilp
    calls = []
    monkeypatch.setattr(ilp, "_attempt", lambda *a: calls.append(a[1][0]))
    with pytest.raises(Infeasible) as e:
        solve(replace(two_ways(3), memory_budget=32.9), time_limit_s=8.0)
    assert calls == [] and e.value.exact and e.value.least_memory == pytest.approx(33.0)
    # under a deadline, the bound itself, at once; beside a plan in hand, no better one
    with pytest.raises(Infeasible) as e:
        solve(replace(two_ways(3), memory_budget=32.9), time_limit_s=8.0, verdict=False)
    assert calls == [] and not e.value.exact and e.value.least_memory == pytest.approx(33.0)
    with pytest.raises(NoBetter):
        solve(replace(two_ways(3), memory_budget=32.9), time_limit_s=8.0, cutoff_s=10.0)
    assert calls == []


def test_time_limit_without_a_plan_is_not_reported_as_infeasible(monkeypatch) -> None:
    """The solver stopping before its first incumbent (status NOT_SOLVED) used to be reported as
    an infeasible memory budget, quoting a least memory far below the budget. Now the plan of
    least memory, which fits, is returned as a feasible plan that says why."""
    _status(monkeypatch, pywraplp.Solver.NOT_SOLVED)
    p = two_ways(3)
    sol = solve(p, time_limit_s=0.5)
    assert sol.status == "FEASIBLE" and sol.choice == (1, 1)          # the leanest strategies
    assert sol.objective == pytest.approx(evaluate(p, (1, 1))[0], rel=REL)
    assert "no plan within 0.5 s" in sol.note and "least memory" in sol.note
    # Some backends say INFEASIBLE on a time limit too: the least memory contradicts them.
    _status(monkeypatch, pywraplp.Solver.INFEASIBLE)
    assert solve(p).status == "FEASIBLE"


def _with_copy_memory(p: Problem) -> Problem:
    """Reshard memory on the edge makes the least memory a MIP of its own."""
    e = p.edges[0]
    return replace(p, edges=(replace(e, memory=((0.0, 1.0), (1.0, 0.0))),))


def _forbidden_lean() -> Problem:
    """A -> B where A0 is the leaner strategy (10 bytes against 12), but B reads A's output
    through an in-place write that only A1's layout allows: the reshard from A0 is forbidden."""
    decisions = (Decision("A", 1, (1.0, 1.0), (10.0, 12.0)), Decision("B", 1, (1.0,), (5.0,)))
    edge = Edge("A:0", 1, 0, 1, (0, 1), (0,), ((FORBIDDEN,), (0.0,)))
    return Problem(decisions, (edge,), memory_budget=100.0)


@pytest.mark.parametrize("memory", [False, True])
def test_a_forbidden_reshard_is_in_no_plan(memory: bool) -> None:
    """Neither the fastest plan nor the least-memory one holds a forbidden reshard, whatever
    it would save; a full assignment that holds one is not admitted (with edge memory the least
    memory is a MIP of its own, without it each decision's leanest strategy, checked)."""
    p = _forbidden_lean()
    if memory:
        p = replace(p, edges=(replace(p.edges[0], memory=((0.0,), (1.0,))),))
    assert not admits(p, (0, 0)) and admits(p, (1, 0))
    assert solve(p).choice == (1, 0)
    least = least_memory_plan(p)
    assert least.choice == (1, 0) and least.bytes == pytest.approx(17.0 + memory)
    # The pair's flow is held at zero, not priced: the objective is the plan's own seconds.
    assert solve(p).objective == pytest.approx(2.0, rel=REL)


def test_no_incumbent_and_no_least_memory_plan_is_no_solution(monkeypatch) -> None:
    _status(monkeypatch, pywraplp.Solver.NOT_SOLVED)
    with pytest.raises(NoSolution) as info:
        solve(_with_copy_memory(two_ways(3)), time_limit_s=0.5)
    assert info.value.time_limit_s == 0.5
    assert not isinstance(info.value, Infeasible)


def test_infeasible_by_a_bound_says_so(monkeypatch) -> None:
    """A lower bound above the budget proves infeasibility even when the least-memory MIP does not
    finish; the verdict says the figure is a bound."""
    _status(monkeypatch, pywraplp.Solver.NOT_SOLVED)
    p = replace(_with_copy_memory(two_ways(3)), memory_budget=32.9)    # bound 3 + 3 * 10 = 33
    with pytest.raises(Infeasible) as info:
        solve(p)
    assert info.value.least_memory == pytest.approx(33.0) and not info.value.exact
    assert "at least" in str(info.value)
    bound = least_memory_plan(_with_copy_memory(two_ways(3)))
    assert not bound.exact and bound.choice is None


def test_fixed_pins_a_strategy() -> None:
    p = replace(chain(), fixed=((2, 0),))        # force C0: then (0, 0, 0) at 7 is best
    sol = solve(p)
    assert sol.choice == (0, 0, 0)
    assert sol.objective == pytest.approx(7.0, rel=REL)
    p = replace(chain(), fixed=((1, 0), (2, 1)))  # force B0 and C1: the greedy plan, 13
    sol = solve(p)
    assert sol.choice == brute_force(p)[1] == (0, 0, 1)
    assert sol.objective == pytest.approx(13.0, rel=REL)


@pytest.mark.parametrize("make", [lambda: replace(chain(), fixed=((1, 1),), memory_budget=123.5),
                                  lambda: _fanout_problem((0.0, 1.5, 0.2))])
def test_json_round_trip_and_same_solution(make) -> None:
    p = make()
    text = p.to_json()
    q = Problem.from_json(text)
    assert q == p
    assert q.to_json() == text
    assert solve(q).choice == solve(p).choice


@pytest.mark.parametrize("make", [chain, two_ways])
def test_evaluate_agrees_with_the_objective(make) -> None:
    p = make()
    sol = solve(p)
    assert evaluate(p, sol.choice)[0] == pytest.approx(sol.objective, rel=REL)


def test_determinism_on_ties() -> None:
    """Every assignment costs the same: the solver must still pick the same one each time."""
    decisions = tuple(Decision(f"g{i}", 1, (1.0, 1.0, 1.0), (1.0, 1.0, 1.0)) for i in range(5))
    edges = tuple(_edge(f"g{i}:0", i, i + 1, ((0.0, 0.0, 0.0),) * 3) for i in range(4))
    p = Problem(decisions, edges, memory_budget=100.0)
    assert len({solve(p).choice for _ in range(3)}) == 1
    assert solve(chain()).choice == solve(chain()).choice


def _window(sync_a: float) -> Problem:
    """One decision: strategy 0 costs 10 s with 5 s of backward and a gradient sync of
    ``sync_a`` s; strategy 1 costs 12 s and syncs nothing."""
    decisions = (Decision("w", 1, (10.0, 12.0), (0.0, 0.0), (5.0, 6.0)),
                 Decision("out", 1, (0.0,), (0.0,)))
    edge = Edge("w:0", 1, 0, 1, (0, 1), (0,), ((0.0,), (0.0,)), (), ((sync_a,), (0.0,)))
    return Problem(decisions, (edge,), memory_budget=1e9)


@pytest.mark.parametrize("sync_a,step,choice", [(4.0, 10.0, 0), (5.0, 10.0, 0), (6.5, 11.5, 0),
                                                (8.0, 12.0, 1)])
def test_overlap_window_exposes_only_what_backward_cannot_hide(sync_a, step, choice) -> None:
    """Sync within the backward's 5 s is free; beyond it the excess is paid (cost/overlap.py),
    until the strategy without sync wins."""
    sol = solve(_window(sync_a))
    assert sol.choice[0] == choice
    assert sol.objective == pytest.approx(step, rel=REL)
    assert evaluate(_window(sync_a), (0, 0))[0] == pytest.approx(10.0 + max(0.0, sync_a - 5.0))


# -------------------------------------------------------------------- property: brute force


def copy_memory(n_o: int, n_r: int):
    """No reshard memory, or integer bytes per (output, requirement) class pair."""
    return st.one_of(st.just(()), st.tuples(*[st.tuples(*[st.integers(0, 6).map(float)] * n_r)]
                                            * n_o))


@st.composite
def problems(draw) -> Problem:
    n = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 3)) for _ in range(n)]
    cost = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)
    # Some problems carry an overlap window: backward seconds on decisions, gradient-sync
    # seconds on edges and fanouts (the step adds max(0, sync - backward)).
    window = draw(st.booleans())
    decisions = tuple(Decision(f"g{g}", draw(st.integers(1, 3)),
                               tuple(draw(cost) for _ in range(k)),
                               tuple(float(draw(st.integers(0, 10))) for _ in range(k)),
                               tuple(draw(cost) for _ in range(k)) if window else ())
                      for g, k in enumerate(sizes))

    def sync(n_o: int, n_r: int) -> tuple:
        return tuple(tuple(draw(cost) for _ in range(n_r)) for _ in range(n_o)) if window else ()

    edges = []
    for _ in range(draw(st.integers(0, 4)) if n > 1 else 0):
        a, b = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        # Output / requirement classes: several strategies may share one spec.
        n_o, n_r = draw(st.integers(1, sizes[a])), draw(st.integers(1, sizes[b]))
        out = tuple(draw(st.integers(0, n_o - 1)) for _ in range(sizes[a]))
        req = tuple(draw(st.integers(0, n_r - 1)) for _ in range(sizes[b]))
        matrix = tuple(tuple(draw(cost) for _ in range(n_r)) for _ in range(n_o))
        edges.append(Edge(f"e{len(edges)}", draw(st.integers(1, 2)), a, b, out, req, matrix,
                          draw(copy_memory(n_o, n_r)), sync(n_o, n_r)))
    fanouts = []
    for _ in range(draw(st.integers(0, 2)) if n > 2 else 0):
        a, *cons = draw(st.lists(st.integers(0, n - 1), min_size=3, max_size=4, unique=True))
        n_o, n_r = draw(st.integers(1, sizes[a])), draw(st.integers(1, 3))
        out = tuple(draw(st.integers(0, n_o - 1)) for _ in range(sizes[a]))
        classes = tuple((b, tuple(draw(st.integers(0, n_r - 1)) for _ in range(sizes[b])))
                        for b in cons)
        matrix = tuple(tuple(draw(cost) for _ in range(n_r)) for _ in range(n_o))
        fanouts.append(Fanout(f"f{len(fanouts)}", draw(st.integers(1, 2)), a, out, classes,
                              matrix, draw(copy_memory(n_o, n_r)), sync(n_o, n_r)))
    # Integer memories and a half-integer budget: no assignment sits on the boundary.
    budget = draw(st.integers(0, 60)) + 0.5
    return Problem(decisions, tuple(edges), float(budget), fanouts=tuple(fanouts))


@settings(max_examples=int(os.environ.get("AUTOSHARD_EXAMPLES", 80)), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_ilp_matches_brute_force(p: Problem) -> None:
    best = brute_force(p)
    if best is None:
        with pytest.raises(Infeasible) as info:
            solve(p)
        exact = min(evaluate(p, c)[1] for c in itertools.product(
            *(range(len(g.cost)) for g in p.decisions)))
        assert info.value.least_memory == pytest.approx(exact, rel=REL)
        return
    sol = solve(p)
    assert sol.objective == pytest.approx(best[0], rel=1e-6, abs=1e-9)
    t, mem = evaluate(p, sol.choice)
    assert t == pytest.approx(best[0], rel=1e-6, abs=1e-9)
    assert mem <= p.memory_budget
    assert math.isfinite(sol.objective)


@pytest.mark.parametrize("budget,choice", [(100.0, 0), (5.0, 1)])
def test_memory_only_items_count_when_the_budget_binds(budget, choice) -> None:
    """A memory-only edge (a saved activation, no seconds): strategy 0 is faster but keeps 10
    bytes through the edge. With room, the plan solved without the edge stands (HiGHS solves
    that problem); under a budget of 5 it does not fit once the edge is counted, and the whole
    problem, whose memory binds, is solved HiGHS first (ilp.BINDING_BACKENDS) and gives
    strategy 1."""
    decisions = (Decision("a", 1, (1.0, 2.0), (0.0, 0.0)), Decision("b", 1, (0.0,), (0.0,)))
    saved = Edge("a:saved", 1, 0, 1, (0, 1), (0,), ((0.0,), (0.0,)), ((10.0,), (1.0,)))
    p = Problem(decisions, (saved,), memory_budget=budget)
    sol = solve(p)
    assert sol.choice[0] == choice and sol.backend == "HIGHS"
    assert evaluate(p, sol.choice)[1] <= budget


@pytest.mark.parametrize("starts,whole", [((), False), ((Start("given", (0, 0)),), True)])
def test_an_incumbent_of_the_relaxed_problem_that_fits_is_kept_without_starts(
        monkeypatch, starts, whole) -> None:
    """The problem without its memory-only items is solved first; its solver's incumbent,
    stopped short of an optimum, is a plan of the whole problem where it fits with them
    counted: without starts to compare it with (pinned layouts) it is returned as it is, and
    the whole problem is not solved; with starts, the whole problem is solved as before."""
    from autoshard.solver import ilp
    decisions = (Decision("a", 1, (1.0, 2.0), (0.0, 0.0)), Decision("b", 1, (0.0,), (0.0,)))
    saved = Edge("a:saved", 1, 0, 1, (0, 1), (0,), ((0.0,), (0.0,)), ((10.0,), (1.0,)))
    p = Problem(decisions, (saved,), memory_budget=100.0)
    incumbent = Solution((0, 0), "FEASIBLE", 1.0, 0.5, 3, 0.1, backend="CBC")
    calls = []

    def fake(problem, *a, **k):
        calls.append(len(problem.edges))
        return incumbent if not problem.edges else Solution((0, 0), "OPTIMAL", 1.0, 1.0, 5, 0.1)

    monkeypatch.setattr(ilp, "_solve", fake)
    sol = ilp._search(p, Deadline.after(10.0), None, True, False, starts)
    assert calls == ([0, 1] if whole else [0])
    assert (sol.status == "OPTIMAL") == whole and (sol is incumbent) != whole


def test_solves_under_a_deadline_print_nothing(capfd) -> None:
    """HiGHS (the backend under a deadline) prints a banner on the process's stdout once an
    option is set; `autoshard plan --json` must stay JSON: nothing reaches file descriptor 1."""
    sol = solve(chain(), time_limit_s=5.0, verdict=False)
    assert sol.objective == pytest.approx(5.0, rel=REL)
    out, err = capfd.readouterr()
    assert out == "" and "HiGHS" not in err


def test_a_deadline_solve_that_overruns_its_limit_is_stopped(monkeypatch) -> None:
    """Under a deadline (verdict=False) the solve runs in a child process killed at
    WALL_SLACK times its limit: a backend stuck past its own limit (HiGHS in presolve on a
    3-axis ILP) costs the caller its time limit, not minutes. The child's
    answers come back as they are: a solution, or the solver's own exceptions."""
    import time as _time
    from autoshard.solver import ilp
    real = ilp._search
    monkeypatch.setattr(ilp, "_search", lambda *a: _time.sleep(30))
    t0 = _time.perf_counter()
    with pytest.raises(NoSolution):
        solve(two_ways(3), time_limit_s=0.4, verdict=False)
    assert _time.perf_counter() - t0 < 5.0
    monkeypatch.setattr(ilp, "_search", real)
    sol = solve(chain(), time_limit_s=8.0, verdict=False)
    assert sol.status == "OPTIMAL" and sol.objective == pytest.approx(5.0, rel=REL)
    p = replace(two_ways(3), memory_budget=33.5)
    p = replace(p, edges=(replace(p.edges[0], memory=((1.0, 1.0), (1.0, 1.0))),))
    with pytest.raises(NoSolution):          # no incumbent, and no verdict asked for
        solve(p, time_limit_s=8.0, verdict=False)


@settings(max_examples=int(os.environ.get("AUTOSHARD_EXAMPLES", 80)), deadline=None,
          derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_a_projected_restriction_has_the_same_plans_at_the_same_prices(p: Problem, data) -> None:
    """``projected`` drops the strategies a restriction excludes (and the edge and fanout
    classes no kept strategy uses): its plans, lifted, are exactly the restriction's, each with
    the same step time and memory, so a start solved projected is the start's own optimum."""
    allowed = {g: set(data.draw(st.sets(st.integers(0, len(d.cost) - 1), min_size=1)))
               for g, d in enumerate(p.decisions) if data.draw(st.booleans())}
    held = restricted(p, allowed)
    proj = projected(held)
    assert proj is not None and not proj.problem.cuts
    ours = {proj.lift(c): evaluate(proj.problem, c) for c in itertools.product(
        *(range(len(d.cost)) for d in proj.problem.decisions))}
    theirs = {c for c in itertools.product(*(range(len(d.cost)) for d in p.decisions))
              if admits(held, c)}
    assert set(ours) == theirs
    for c, (t, mem) in ours.items():
        assert (t, mem) == pytest.approx(evaluate(p, c), rel=1e-12, abs=1e-12)
    # a pin the restriction excludes leaves no plan
    g = next(iter(allowed), None)
    if g is not None and len(allowed[g]) < len(p.decisions[g].cost):
        out = next(i for i in range(len(p.decisions[g].cost)) if i not in allowed[g])
        assert projected(replace(held, fixed=((g, out),))) is None


def _binding(budget: float, *, timed_memory: float = 0.0) -> Problem:
    """Strategy 0 of ``a`` is faster (1 s against 2 s) but keeps 10 bytes through a memory-only
    edge (strategy 1: 1 byte); a second edge prices time and keeps ``timed_memory`` bytes
    whatever is chosen (a reshard's output stored for recompute)."""
    decisions = (Decision("a", 1, (1.0, 2.0), (0.0, 0.0)), Decision("b", 1, (0.0,), (0.0,)))
    saved = Edge("a:saved", 1, 0, 1, (0, 1), (0,), ((0.0,), (0.0,)), ((10.0,), (1.0,)))
    timed = Edge("a:0", 1, 0, 1, (0, 0), (0,), ((0.5,),), ((timed_memory,),))
    return Problem(decisions, (saved, timed), memory_budget=budget)


def test_memory_binds_is_said_before_the_whole_problem_is_searched() -> None:
    """``stop_if_binds``: the optimum without the memory-only edge (1.5 s) does not fit with
    it, so solve says MemoryBinds with that optimum as the bound; ``binds``: the whole problem
    is solved at once, to strategy 1."""
    p = _binding(5.0)
    with pytest.raises(MemoryBinds) as info:
        solve(p, stop_if_binds=True)
    assert info.value.bound == pytest.approx(1.5)
    sol = solve(p, binds=True)
    assert sol.choice[0] == 1 and sol.status == "OPTIMAL"
    assert solve(_binding(50.0), stop_if_binds=True).choice[0] == 0     # room: no verdict


def test_what_the_problem_without_memory_only_items_proves_holds_for_the_whole() -> None:
    """That problem relaxes the whole one's memory: its proof that nothing fits is the whole
    problem's, reported with its least memory as a lower bound (the whole problem's own exact
    figure, 21 bytes, would have taken its own search); its proof that nothing is faster than
    the cutoff is too."""
    with pytest.raises(Infeasible) as info:
        solve(_binding(15.0, timed_memory=20.0))
    assert not info.value.exact and info.value.least_memory == pytest.approx(20.0)
    with pytest.raises(NoBetter) as better:
        solve(_binding(50.0), cutoff_s=1.0)
    assert better.value.proved
