"""Descent over mesh axes (solver/descent.py), tier 0: hand-built problems whose strategies are
products of per-axis placements, against brute force."""
from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from autoshard.solver.deadline import Deadline
from autoshard.solver.descent import descend, neighbourhood, solve_by_axes
from autoshard.solver.ilp import solve_held
from autoshard.solver.problem import Decision, Edge, Problem, Start, evaluate, restricted
from test_ilp import brute_force

AXES = 3
BITS = tuple(itertools.product((0, 1), repeat=AXES))     # strategy i places bits BITS[i]
KEYS = tuple(BITS for _ in range(3))


def _reshard(per_axis: float) -> tuple[tuple[float, ...], ...]:
    """An edge between two decisions of BITS strategies: each axis whose placement changes
    costs ``per_axis``."""
    return tuple(tuple(per_axis * sum(x != y for x, y in zip(a, b)) for b in BITS) for a in BITS)


def coupled(memory_budget: float = 1e9) -> Problem:
    """Three decisions in a chain, 8 strategies each. A decision placing axes 0 and 1 both saves
    3 s, placing one of them alone costs 1 s; placing axis 2 costs 0.5 s, except on the last,
    where it saves 0.5 s; each axis whose placement changes along an edge costs 4 s. From all
    zeros no single axis gains, yet (1, 1, 0) everywhere is the optimum, 21 s, above the plain
    bound of 20.5 s (each decision at its cheapest). Placing axis 0 costs 5 B."""
    def cost(g: int, b: tuple[int, ...]) -> float:
        return 10.0 - 3.0 * (b[0] & b[1]) + (b[0] ^ b[1]) + (0.5 if g < 2 else -0.5) * b[2]

    decisions = tuple(Decision(f"d{g}", 1, tuple(cost(g, b) for b in BITS),
                               tuple(5.0 * b[0] for b in BITS)) for g in range(3))
    edges = tuple(Edge(f"e{g}", 1, g, g + 1, tuple(range(8)), tuple(range(8)), _reshard(4.0))
                  for g in range(2))
    return Problem(decisions, edges, memory_budget=memory_budget)


ZEROS = Start("zeros", within=restricted(coupled(), {g: {0} for g in range(3)}).cuts)


def test_neighbourhood_holds_the_other_axes():
    choice = (BITS.index((1, 0, 1)), 0, 7)
    out = neighbourhood(KEYS, choice, (1,))
    assert out[0] == {BITS.index((1, 0, 1)), BITS.index((1, 1, 1))}
    assert out[1] == {0, BITS.index((0, 1, 0))} and out[2] == {BITS.index((1, 0, 1)), 7}
    assert neighbourhood(KEYS, choice, (0, 1, 2)) == {g: set(range(8)) for g in range(3)}


def test_descent_takes_two_axes_where_no_single_axis_gains():
    p = coupled()
    start = (0, 0, 0)
    step0 = evaluate(p, start)[0]
    for a in range(AXES):          # no single axis improves the start
        allowed = neighbourhood(KEYS, start, (a,))
        assert min(evaluate(p, c)[0] for c in itertools.product(*allowed.values())) == step0
    label, choice, step = descend(p, KEYS, ("zeros", start, step0), Deadline.after(30), solve_held)
    both = BITS.index((1, 1, 0))
    assert brute_force(p) == (pytest.approx(21.0), (both,) * 3)
    assert label == "zeros" and choice == (both,) * 3 and step == pytest.approx(21.0)


def test_descent_keeps_to_the_memory_budget():
    """Axis 0 placed costs 5 B a decision: within 10 B the last decision keeps axis 0 whole
    and pays an edge's change (7 + 7 + 11 + 4 s), the optimum by brute force."""
    p = coupled(memory_budget=10.0)
    start = (0, 0, 0)
    _, choice, step = descend(p, KEYS, ("zeros", start, evaluate(p, start)[0]),
                              Deadline.after(30), solve_held)
    assert evaluate(p, choice)[1] <= 10.0 and step == pytest.approx(brute_force(p)[0])
    assert step == pytest.approx(29.0)


def test_solve_by_axes_keeps_the_faster_of_its_starts_and_says_how():
    p = coupled()
    ones = Start("ones", within=restricted(p, {g: {7} for g in range(3)}).cuts)
    sol = solve_by_axes(p, KEYS, (ZEROS, ones), Deadline.after(30), solve_held)
    assert sol.choice == (BITS.index((1, 1, 0)),) * 3 and sol.objective == pytest.approx(21.0)
    assert sol.start == "zeros" and sol.note.startswith("solved one and two mesh axes")
    assert sol.status == "FEASIBLE" and sol.bound == pytest.approx(20.5)    # a local optimum


def test_solve_by_axes_proves_a_plan_at_the_plain_bound():
    """Without the edges, every decision takes its cheapest strategy: the plan meets the sum
    of each decision's least cost, and is optimal."""
    p = replace(coupled(), edges=())
    sol = solve_by_axes(p, KEYS, (ZEROS,), Deadline.after(30), solve_held)
    assert sol.status == "OPTIMAL" and sol.gap == 0 and sol.objective == pytest.approx(20.5)


def test_solve_by_axes_without_a_start_that_fits_has_no_plan():
    p = coupled(memory_budget=10.0)
    firsts = Start("axis 0 everywhere", within=restricted(
        p, {g: {i for i, b in enumerate(BITS) if b[0]} for g in range(3)}).cuts)
    assert solve_by_axes(p, KEYS, (firsts,), Deadline.after(30), solve_held) is None


def test_solve_by_axes_past_its_deadline_keeps_its_first_start():
    p = coupled()
    late = Deadline.after(0.0)
    sol = solve_by_axes(p, KEYS, (ZEROS,), late, solve_held)
    assert sol.choice == (0, 0, 0) and sol.start == "zeros"
