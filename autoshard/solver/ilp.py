"""The sharding ILP (GShard/Alpa formulation), solved with OR-Tools.

    x[g,i] in {0,1}   one strategy per group:            sum_i x[g,i] = 1
    e[o,r] >= 0       per edge, the (output class, requirement class) pair in use:
                      sum_r e[o,r] = sum_{i in class o} x[producer,i]
                      sum_o e[o,r] = sum_{j in class r} x[consumer,j]
    f[c,o,r] >= 0     per fanout and consumer c, the same transportation polytope as an edge
    z[o,r] >= f[c,o,r] for every consumer c: the reshard o -> r is paid once if any consumer
                      needs r (z is 1 exactly then, for integral x)
    minimise   sum mult*cost*x + sum mult*cost*e + sum mult*cost*z
    subject to sum mult*memory*x <= budget

The edge constraints are a transportation polytope per edge: their LP relaxation is tight on
chains and trees, so the MIP solver closes most of the problem at the root. The solver runs
single-threaded with a fixed seed, so two runs give the same plan.
"""
from __future__ import annotations

import time

from ortools.linear_solver import pywraplp

from autoshard.solver.problem import Fanout, Problem, Solution, evaluate

BACKENDS = ("CBC", "HIGHS", "SCIP")
# Costs enter the MIP in microseconds: CBC drops objective coefficients below ~1e-8, and a small
# op's seconds are that small.
US = 1e6


class Infeasible(Exception):
    def __init__(self, least_memory: float) -> None:
        self.least_memory = least_memory
        super().__init__(f"no plan fits; the least memory per device is {least_memory:.4g} bytes")


class NoSolution(Exception):
    """The solver stopped (time limit) before it found any plan, though plans within the memory
    budget exist: not an infeasible budget, and must not be reported as one."""

    def __init__(self, time_limit_s: float, status: int) -> None:
        self.time_limit_s, self.status = time_limit_s, status
        super().__init__(f"the solver found no plan within {time_limit_s:g} s (status {status})")


def least_memory(problem: Problem) -> float:
    """The least memory (bytes per device) of any assignment. Memory depends on the group choices
    alone and every choice satisfies the edge constraints, so it is a per-group minimum."""
    pins: dict[int, set[int]] = {}
    for g, i in problem.fixed:
        pins.setdefault(g, set()).add(i)
    total = 0.0
    for g, grp in enumerate(problem.groups):
        allowed = pins.get(g, range(len(grp.memory)))
        if len(allowed) != 1 and g in pins:
            return float("inf")      # two different strategies pinned on one group
        total += grp.mult * min(grp.memory[i] for i in allowed)
    return total


def _solver() -> tuple[pywraplp.Solver, str]:
    for name in BACKENDS:
        s = pywraplp.Solver.CreateSolver(name)
        if s is not None:
            return s, name
    raise RuntimeError(f"OR-Tools offers none of the MIP backends {BACKENDS}")


def solve(problem: Problem, *, time_limit_s: float = 30.0) -> Solution:
    t0 = time.perf_counter()
    s, backend = _solver()
    s.SetNumThreads(1)
    x = [[s.BoolVar(f"x{g}_{i}") for i in range(len(grp.cost))]
         for g, grp in enumerate(problem.groups)]
    for xs in x:
        s.Add(s.Sum(xs) == 1)
    for g, i in problem.fixed:
        s.Add(x[g][i] == 1)
    obj = [US * grp.cost[i] * grp.mult * v for g, grp in enumerate(problem.groups)
           for i, v in enumerate(x[g]) if grp.cost[i]]
    n_aux = 0

    def transport(name: str, producer: int, out: tuple[int, ...], consumer: int,
                  req: tuple[int, ...], n_o: int, n_r: int) -> list[list]:
        """Flow variables f[o][r] whose margins are the producer's and consumer's classes."""
        nonlocal n_aux
        f = [[s.NumVar(0.0, 1.0, f"{name}_{o}_{r}") for r in range(n_r)] for o in range(n_o)]
        n_aux += n_o * n_r
        by_o: list[list] = [[] for _ in range(n_o)]
        for i, o in enumerate(out):
            by_o[o].append(x[producer][i])
        by_r: list[list] = [[] for _ in range(n_r)]
        for j, r in enumerate(req):
            by_r[r].append(x[consumer][j])
        for o in range(n_o):
            s.Add(s.Sum(f[o]) == s.Sum(by_o[o]))
        for r in range(n_r):
            s.Add(s.Sum([f[o][r] for o in range(n_o)]) == s.Sum(by_r[r]))
        return f

    for k, e in enumerate(problem.edges):
        n_o, n_r = len(e.cost), len(e.cost[0])
        if all(c == 0 for row in e.cost for c in row):
            continue
        ev = transport(f"e{k}", e.producer, e.out, e.consumer, e.req, n_o, n_r)
        obj += [US * e.cost[o][r] * e.mult * ev[o][r] for o in range(n_o) for r in range(n_r)
                if e.cost[o][r]]
    for k, fo in enumerate(problem.fanouts):
        n_o, n_r = len(fo.cost), len(fo.cost[0])
        paid = [(o, r) for o in range(n_o) for r in range(n_r) if fo.cost[o][r]]
        if not paid:
            continue
        flows = [transport(f"f{k}_{c}", fo.producer, fo.out, g, req, n_o, n_r)
                 for c, (g, req) in enumerate(fo.consumers)]
        for o, r in paid:
            z = s.NumVar(0.0, 1.0, f"z{k}_{o}_{r}")
            n_aux += 1
            for f in flows:
                s.Add(z >= f[o][r])
            obj.append(US * fo.cost[o][r] * fo.mult * z)
    mem = s.Sum([grp.memory[i] * grp.mult * v for g, grp in enumerate(problem.groups)
                 for i, v in enumerate(x[g]) if grp.memory[i]])
    s.Add(mem <= problem.memory_budget)
    s.Minimize(s.Sum(obj))
    s.SetTimeLimit(int(time_limit_s * 1000))
    status = s.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        # A time limit hit before the first incumbent also lands here (NOT_SOLVED): only a budget
        # below the least memory makes the problem infeasible.
        least = least_memory(problem)
        if least > problem.memory_budget or status == pywraplp.Solver.INFEASIBLE:
            raise Infeasible(least)
        raise NoSolution(time_limit_s, status)
    choice = tuple(max(range(len(xs)), key=lambda i: xs[i].solution_value()) for xs in x)
    objective = evaluate(problem, choice)[0]     # exact, not within the solver's tolerances
    bound = s.Objective().BestBound() / US if status != pywraplp.Solver.OPTIMAL else objective
    return Solution(choice=choice, status="OPTIMAL" if status == pywraplp.Solver.OPTIMAL else "FEASIBLE",
                    objective=objective, bound=bound,
                    variables=sum(len(xs) for xs in x) + n_aux, seconds=time.perf_counter() - t0)


def break_ties(problem: Problem, choice: tuple[int, ...], order: dict[int, list[int]],
               *, rel_tol: float = 1e-12) -> tuple[int, ...]:
    """Break ties: move each group of ``order`` (in that order) to the first of its listed
    strategies that leaves the objective unchanged (within ``rel_tol``) and memory in budget.

    Equal-cost plans are common under alpha-beta pricing (a replicated weight's gradient
    all-reduce costs exactly its sharded twin's all-gather + reduce-scatter); the ILP picks one
    arbitrarily, so the planner lists the layouts a user expects first (fewest sharded axes)."""
    choice = list(choice)
    fixed = {g for g, _ in problem.fixed}
    touching: dict[int, list] = {g: [] for g in order}
    for e in problem.edges:
        for g in {e.producer, e.consumer} & touching.keys():
            touching[g].append(e)
    for f in problem.fanouts:
        for g in ({f.producer} | {c for c, _ in f.consumers}) & touching.keys():
            touching[g].append(f)

    def local(g: int) -> float:
        grp = problem.groups[g]
        t = grp.cost[choice[g]] * grp.mult
        for x in touching[g]:
            if isinstance(x, Fanout):
                row = x.cost[x.out[choice[x.producer]]]
                t += sum(row[r] for r in {req[choice[c]] for c, req in x.consumers}) * x.mult
            else:
                t += x.cost[x.out[choice[x.producer]]][x.req[choice[x.consumer]]] * x.mult
        return t

    total, mem = evaluate(problem, tuple(choice))
    tol = rel_tol * max(total, 0.0)
    for g, prefs in order.items():
        if g in fixed:
            continue
        grp, now = problem.groups[g], choice[g]
        before = local(g)
        for i in prefs:
            if i == now:
                break
            choice[g] = i
            dmem = (grp.memory[i] - grp.memory[now]) * grp.mult
            if local(g) - before <= tol and mem + dmem <= problem.memory_budget:
                mem += dmem
                break
            choice[g] = now
    return tuple(choice)
