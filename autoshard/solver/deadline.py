"""One wall-clock budget for the whole solve of a problem, and the obvious plans solved within it.

A solve (solver/ilp.py ``solve``) runs several MIPs: the problem without its memory-only items,
the first backend, the obvious plans it starts from (solver/starts.py) and the final backend from
the best of them. Each used to get its own share of ``time_limit_s``, so seven starts at half the
limit each made a 20 s limit a 100 s solve (DeepSeek-V3 and Jamba shapes on 8x8). Here they
share one :class:`Deadline`: each part takes a share of what is left, and the last takes the
rest, so the solve ends near ``time_limit_s`` however many parts it has.

The starts share their part in order, each taking half of what is left of it (the last all of
it): a start that holds every decision is solved in a fraction of its half (0.2 to 2.5 s on the
DeepSeek-V3 and Jamba shapes' 8x8 problems, loaded) and leaves the rest to the next, where an
equal split among eight starts left the combined one 0.7 s and cut it off. They skip what cannot
help: a restriction identical to one solved before, one at least as tight as a restriction
already solved to its optimum (no faster plan can be in it), and one whose plain lower bound
(each decision at its cheapest allowed strategy, edges and exposed communication at nothing) is
no faster than the best start in hand; and once the starts' part is spent, the rest (the first
restriction excepted).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from autoshard.solver.problem import Problem, Solution, Start, combined, evaluate, excluded, fits

# The least time a part of a solve gets, even when the deadline has passed (a MIP given no time
# returns no plan; half a second settles a restricted problem holding nearly every decision).
MIN_PART_S = 0.5


@dataclass(frozen=True, slots=True)
class Deadline:
    """The wall-clock end (``time.perf_counter()`` seconds) of one solve that began at ``t0``."""

    t0: float
    end: float

    @classmethod
    def after(cls, seconds: float, t0: float | None = None) -> "Deadline":
        t0 = time.perf_counter() if t0 is None else t0
        return cls(t0, t0 + seconds)

    @property
    def limit_s(self) -> float:
        return self.end - self.t0

    def left(self) -> float:
        """Seconds until the end, at least :data:`MIN_PART_S`: a part started late still gets
        a chance to return a plan."""
        return max(MIN_PART_S, self.end - time.perf_counter())

    def passed(self) -> bool:
        return time.perf_counter() >= self.end

    def share(self, fraction: float) -> "Deadline":
        """A deadline ``fraction`` of the way from now to this one's end."""
        now = time.perf_counter()
        return Deadline(self.t0, now + fraction * max(0.0, self.end - now))


BestStart = tuple[str, tuple[int, ...], float]      # (label, choice, step)
# Solves a restriction of the problem in a time limit: its Solution, or None where it found none.
SolveHeld = Callable[[Problem, float], Solution | None]


def best_start(problem: Problem, starts: Sequence[Start], deadline: Deadline | None,
               solve_held: SolveHeld) -> BestStart | None:
    """The fastest of ``starts`` that is a plan of ``problem``: (label, choice, step). A
    restriction is solved by ``solve_held`` in half of what is left of ``deadline`` (the last,
    and a combined one, in all of it; None: none is solved, only full choices count), and
    skipped where it cannot beat what is in hand (above) or once that time is spent (the first
    restriction excepted: a solve whose earlier parts overran still tries one)."""
    best: BestStart | None = None
    solved: dict[str, tuple[int, ...]] = {}     # each start's plan, for the combined ones
    seen: list[tuple[dict[int, frozenset[int]], bool]] = []   # restrictions solved: (held, optimal)
    pending = sum(1 for s in starts if not s.choice)
    solved_any = False        # the first restriction is solved however late it comes
    for st in starts:
        choice = st.choice
        if not choice:
            pending -= 1
            if deadline is None or (deadline.passed() and solved_any):
                continue                   # the starts' time is spent
            within = combined(problem, st, solved) if st.parts else st.within
            if within is None:
                continue                   # a part of it has no plan
            held = replace(problem, cuts=(*problem.cuts, *within))
            out = _held_sets(held)
            if _covered(out, seen) or (best is not None and step_floor(held, out) >= best[2]):
                continue
            left = deadline.end - time.perf_counter()
            # A combined start may take all of it: it gave the best start's plan on the
            # DeepSeek-V3 and Jamba shapes' 8x8 problems (Jamba's the only one with no idle
            # axis), and half of what was left, loaded, cut it off.
            limit = max(MIN_PART_S, left / 2 if pending and not st.parts else left)
            solved_any = True
            sol = solve_held(held, limit)
            if sol is None:
                continue
            choice = sol.choice
            seen.append((out, sol.status == "OPTIMAL"))
        if len(choice) != len(problem.decisions) or not fits(problem, choice):
            continue
        solved[st.label] = tuple(choice)
        step = evaluate(problem, choice)[0]
        if best is None or step < best[2]:
            best = (st.label, tuple(choice), step)
    return best


def _held_sets(held: Problem) -> dict[int, frozenset[int]]:
    return {g: frozenset(out) for g, out in excluded(held).items()}


def _covered(out: dict[int, frozenset[int]],
             seen: list[tuple[dict[int, frozenset[int]], bool]]) -> bool:
    """Whether a restriction excluding ``out`` can give nothing faster than one already solved:
    it is identical to one, or it excludes at least what one solved to its optimum excludes
    (its plans are among that one's)."""
    for prev, optimal in seen:
        if prev == out:
            return True
        if optimal and all(out.get(g, frozenset()) >= ex for g, ex in prev.items()):
            return True
    return False


def step_floor(problem: Problem, out: dict[int, frozenset[int]] | None = None) -> float:
    """A lower bound on the step of any plan of ``problem``: each decision at its cheapest
    strategy its restrictions allow (``out``: the excluded ones, by default its own), since
    edges, fanouts and the exposed-communication term only add time."""
    out = _held_sets(problem) if out is None else out
    pins = dict(problem.fixed)
    total = 0.0
    for g, dec in enumerate(problem.decisions):
        ex = out.get(g, frozenset())
        costs = [dec.cost[pins[g]]] if g in pins else \
            [c for i, c in enumerate(dec.cost) if i not in ex]
        total += dec.multiplicity * min(costs, default=0.0)
    return total


__all__ = ["Deadline", "MIN_PART_S", "best_start", "step_floor"]
