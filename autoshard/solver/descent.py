"""The problem over every subset of a 3-axis mesh's axes, solved one or two axes at a time.

That problem (solver/merging.py) lets each tensor dim split over any subset of the axes, so its
MIP is the product of three axes' choices, and no backend solves it whole: at 1646ba0
``autoshard plan llama3-8b --mesh 4x4x4 --axes dp,tp,cp --batch 8 --seq 8192 --time-limit 120``
found no plan of it in 120 s, and even llama-tiny's on 2x2x2 found none in 20 s. Yet the plans
it holds are the ones no grouping of the axes can express: the batch over one axis, the
sequence over a second, Megatron's heads over the third (torchtitan's data x context x tensor
layout).

So it is solved by block coordinate descent over the mesh axes, a large-neighbourhood search
(Shaw, "Using constraint programming and local search methods to solve vehicle routing
problems", CP 1998): from a start, each decision is held to the strategies that place every
value as the incumbent does on all axes but one, a MIP the size of a 1-D problem, solved, and
its plan kept where it is faster; once no single axis improves it, the same with two axes free
(a 2-D problem's size); back to single axes after each gain, until neither improves it or the
deadline comes. The starts are the obvious plans that hold every decision (solver/starts.py
:func:`~autoshard.solver.starts.descent_starts`): every axis placed alike (the merged mesh),
then each mesh without one axis. Each start is descended in turn while time is left, and the
fastest plan is kept: a local optimum, reported FEASIBLE with its gap to the problem's plain
bound. Like any solve stopped by its time limit, a slower or busier machine may stop at
another plan.

On Llama-3-8B at batch 8 x 8192 on 4x4x4 (h100) its plan steps in 293.7 ms, where the best
grouping of the axes steps in 610.2 ms; Llama-3-70B 2625.6 against 4703.8 ms
(benchmarks/RESULTS.md, "A 3-axis mesh, every subset of axes").
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace
from typing import Sequence

from autoshard import progress
from autoshard.solver.deadline import MIN_PART_S, BestStart, Deadline, SolveHeld, step_floor
from autoshard.solver.problem import Problem, Solution, Start, evaluate, fits, restricted

# keys[g][i][a]: the placement on mesh axis ``a`` of every value decision ``g``'s strategy ``i``
# places, numbered per decision and axis (starts.axis_keys): two strategies with equal numbers on
# an axis place every value alike there.
Keys = tuple[tuple[tuple[int, ...], ...], ...]

# How a plan of the descent begins its solver record's note.
NOTE = "solved one and two mesh axes at a time"


def neighbourhood(keys: Keys, choice: Sequence[int], free: tuple[int, ...]
                  ) -> dict[int, set[int]]:
    """Each decision's strategies that place every value as ``choice`` does on each axis
    outside ``free`` (``choice``'s own among them)."""
    out = {}
    for g, row in enumerate(keys):
        mine = row[choice[g]]
        out[g] = {i for i, k in enumerate(row)
                  if all(k[a] == mine[a] for a in range(len(mine)) if a not in free)}
    return out


def descend(problem: Problem, keys: Keys, start: BestStart, deadline: Deadline,
            solve_held: SolveHeld) -> BestStart:
    """``start`` improved one axis free at a time, then two, back to one after each gain,
    until neither improves it or ``deadline`` passes (the module's docstring)."""
    label, choice, step = start
    ndim = len(keys[0][0]) if keys and keys[0] else 0
    floor = step_floor(problem)
    tried: set[tuple] = set()
    width = 1
    while width < max(ndim, 2) and not deadline.passed() and step > floor * (1 + 1e-9):
        gained = False
        for free in itertools.combinations(range(ndim), width):
            held = tuple(tuple(k[choice[g]][a] for a in range(ndim) if a not in free)
                         for g, k in enumerate(keys))
            if (free, held) in tried or deadline.passed():
                continue              # the same neighbourhood: its optimum is in hand
            tried.add((free, held))
            sol = solve_held(restricted(problem, neighbourhood(keys, choice, free)),
                             max(MIN_PART_S, deadline.end - time.perf_counter()))
            if sol is None or not fits(problem, sol.choice):
                continue
            new = evaluate(problem, sol.choice)[0]
            if new < step * (1 - 1e-9):
                choice, step, gained = tuple(sol.choice), new, True
        width = 1 if gained else width + 1
    return label, choice, step


def solve_by_axes(problem: Problem, keys: Keys, starts: Sequence[Start], deadline: Deadline,
                  solve_held: SolveHeld) -> Solution | None:
    """The fastest plan :func:`descend` reaches from ``starts`` (restrictions, each solved in
    half of what is left, or all of it while none has a plan) before ``deadline``; None where
    no start has a plan."""
    best: BestStart | None = None
    floor = step_floor(problem)
    for st in starts:
        if best is not None and (deadline.passed() or best[2] <= floor * (1 + 1e-9)):
            break
        left = deadline.end - time.perf_counter()
        sol = solve_held(replace(problem, cuts=(*problem.cuts, *st.within)),
                         max(MIN_PART_S, left / 2 if best is not None else left))
        if sol is None or not fits(problem, sol.choice):
            continue
        first = evaluate(problem, sol.choice)[0]
        got = descend(problem, keys, (st.label, tuple(sol.choice), first), deadline, solve_held)
        progress.note(f"from the {st.label}: {first * 1e3:.3f} ms, descended to "
                      f"{got[2] * 1e3:.3f} ms")
        if best is None or got[2] < best[2]:
            best = got
    if best is None:
        return None
    label, choice, step = best
    bound = min(step, floor)
    optimal = bound >= step * (1 - 1e-9)
    return Solution(choice, "OPTIMAL" if optimal else "FEASIBLE", step, bound,
                    sum(len(d.cost) for d in problem.decisions),
                    time.perf_counter() - deadline.t0, start=label,
                    note=f"{NOTE} from the start ({label}): no plan found faster that changes "
                         "the placements on fewer than all axes")
