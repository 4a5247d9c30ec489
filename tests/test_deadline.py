"""One time budget per solve (solver/deadline.py): the starts and the backends share
``time_limit_s``, so a solve ends near its limit however many starts it has, and a start that
cannot beat what is in hand is not solved."""
from __future__ import annotations

import time

import pytest
from ortools.linear_solver import pywraplp

from autoshard.solver import ilp
from autoshard.solver.deadline import MIN_PART_S, Deadline, best_start
from autoshard.solver.problem import Problem, Solution, Start, restricted
from test_solve_path import chain


# Eight distinct restrictions of the chain: as many starts as the planner gives a 2-D mesh.
HELD = ({0: {0}}, {0: {1}}, {1: {0}}, {1: {1}}, {2: {0}}, {2: {1}}, {0: {0}, 1: {0}},
        {0: {1}, 1: {1}})


def test_a_solve_keeps_to_its_time_limit_however_many_starts(monkeypatch) -> None:
    """Every backend runs to its time limit and finds nothing (as CBC and HiGHS did on the
    DeepSeek-V3 and Jamba shapes' 8x8 problems): with eight starts to solve, the solve ends
    within twice its limit plus a few seconds. When each start got half the limit, this solve
    took about five times it (2 s: a second for the first backend, a second per start, a
    second for the last backend)."""
    limits: dict[int, float] = {}
    real_limit = pywraplp.Solver.SetTimeLimit

    def set_limit(self, ms):
        limits[id(self)] = ms / 1000
        return real_limit(self, ms)

    def solve(self, *a):
        time.sleep(limits.get(id(self), 0.0))
        return pywraplp.Solver.NOT_SOLVED

    monkeypatch.setattr(pywraplp.Solver, "SetTimeLimit", set_limit)
    monkeypatch.setattr(pywraplp.Solver, "Solve", solve)
    p = chain()
    starts = [Start(f"held {k}", within=restricted(p, held).cuts) for k, held in enumerate(HELD)]
    limit = 2.0
    t0 = time.perf_counter()
    sol = ilp.solve(p, time_limit_s=limit, starts=starts)
    took = time.perf_counter() - t0
    assert took <= 2 * limit + 3.0, took
    # no backend proved anything: a start's plan (each a restriction's plan of least memory)
    assert sol.status == "FEASIBLE" and sol.start


def _recorder(answers: dict[int, tuple[tuple[int, ...], str]]):
    """A ``solve_held`` that answers each restriction (keyed by its cut count) with a choice
    and status, and records the order it was asked in."""
    asked: list[int] = []

    def solve_held(held: Problem, limit: float) -> Solution | None:
        asked.append(len(held.cuts))
        assert limit >= MIN_PART_S
        choice, status = answers[len(held.cuts)]
        return Solution(choice, status, 0.0, 0.0, 0, 0.0)

    return solve_held, asked


def test_starts_that_cannot_help_are_not_solved() -> None:
    """A restriction identical to one solved is not solved again; one that excludes at least
    what a restriction solved to its optimum excludes cannot hold a faster plan; one whose
    every decision at its cheapest allowed strategy is already no faster than the start in
    hand is not solved either. Full choices always count."""
    p = chain()
    a = Start("C fast", within=restricted(p, {2: {1}}).cuts)               # 1 cut
    same = Start("C fast again", within=a.within)
    tighter = Start("C fast, B fast", within=restricted(p, {1: {1}, 2: {1}}).cuts)   # 2 cuts
    slow = Start("every op slow", within=restricted(p, {0: {1}, 1: {1}, 2: {0}}).cuts)
    full = Start("given", (0, 0, 0))
    solve_held, asked = _recorder({1: ((1, 1, 1), "OPTIMAL"), 3: ((1, 1, 0), "OPTIMAL")})
    best = best_start(p, (a, same, tighter, slow, full), Deadline.after(60.0), solve_held)
    # (1, 1, 1) at 5; "every op slow" is at least 2 + 2 + 5 = 9 > 5: skipped too
    assert asked == [1] and best is not None and best[0] == "C fast" and best[2] == 5.0
    # the tighter one is solved where the looser one was not proved optimal
    solve_held, asked = _recorder({1: ((1, 1, 1), "FEASIBLE"), 2: ((1, 1, 1), "OPTIMAL")})
    best_start(p, (a, tighter), Deadline.after(60.0), solve_held)
    assert asked == [1, 2]


def test_starts_share_their_part_of_the_deadline() -> None:
    """Each restriction gets half of what is left of the starts' part (the last, and one
    combined from others, all of it);
    once the part is spent, the rest are not solved (the first restriction excepted,
    which gets the least part), and without a deadline only full choices count."""
    p = chain()
    starts = [Start(f"held {k}", within=restricted(p, held).cuts) for k, held in enumerate(HELD)]
    limits: list[float] = []

    def solve_held(held: Problem, limit: float) -> Solution | None:
        limits.append(limit)
        return None

    best_start(p, starts, Deadline.after(8.0), solve_held)
    assert len(limits) == 8 and limits[0] == pytest.approx(4.0, abs=0.05)
    assert limits[-1] == pytest.approx(8.0, abs=0.05)     # nothing was used
    limits.clear()
    assert best_start(p, starts, Deadline.after(-1.0), solve_held) is None
    assert limits == [MIN_PART_S]
    limits.clear()
    # a start combined from two others may take all that is left, though a restriction follows
    # (its keys alike for every strategy: it holds nothing, so no bound rules it out)
    both = Start("both", parts=("A", "B"), keys=(((0, 0), (0, 0)),) * 3)
    best_start(p, [Start("A", (1, 1, 1)), Start("B", (1, 1, 1)), both, starts[0]],
               Deadline.after(8.0), solve_held)
    assert len(limits) == 2 and limits[0] == pytest.approx(8.0, abs=0.05)
    limits.clear()
    given = Start("given", (1, 1, 1))
    assert best_start(p, [*starts, given], None, solve_held)[0] == "given" and limits == []


def test_a_deadline_shares_what_is_left() -> None:
    d = Deadline.after(10.0)
    half = d.share(0.5)
    assert half.t0 == d.t0 and half.end - time.perf_counter() == pytest.approx(5.0, abs=0.1)
    assert d.limit_s == pytest.approx(10.0) and not d.passed()
    late = Deadline.after(-1.0)
    assert late.passed() and late.left() == MIN_PART_S
    now = time.perf_counter()       # a share of a passed deadline ends now, not before it
    assert now <= late.share(0.5).end <= time.perf_counter()
