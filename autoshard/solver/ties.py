"""Ties between equally fast plans, broken toward the layouts a user expects (solver/solve.py
``storage_preferences`` lists them, fewest sharded mesh axes first)."""
from __future__ import annotations

from autoshard.solver.ilp import host_bound
from autoshard.solver.problem import Problem, host_bytes, price, totals


def break_ties(problem: Problem, choice: tuple[int, ...], order: dict[int, list[int]],
               *, rel_tol: float = 1e-12) -> tuple[int, ...]:
    """Break ties: move each decision of ``order`` (in that order) to the first of its listed
    strategies that leaves the objective unchanged (within ``rel_tol``), memory in budget and
    the problem's cuts kept.

    Equal-cost plans are common under alpha-beta pricing (a replicated weight's gradient
    all-reduce costs exactly its sharded twin's all-gather + reduce-scatter); the ILP picks one
    arbitrarily, so the planner lists the layouts a user expects first (fewest sharded axes)."""
    choice = list(choice)
    fixed = {g for g, _ in problem.fixed}
    touching: dict[int, list] = {g: [] for g in order}
    for item in (*problem.edges, *problem.fanouts):
        for g in ({item.producer} | {c for c, _ in item.consumers}) & touching.keys():
            touching[g].append(item)

    def local(g: int) -> tuple[float, float, float, float]:
        """(cost, memory, sync, backward) of decision ``g`` and the items touching it."""
        dec, c = problem.decisions[g], choice[g]
        t, mem = dec.cost[c] * dec.multiplicity, dec.memory[c] * dec.multiplicity
        bwd = dec.backward[c] * dec.multiplicity if dec.backward else 0.0
        sync = 0.0
        for item in touching[g]:
            dt, dm, ds = price(item, choice)
            t, mem, sync = t + dt, mem + dm, sync + ds
        return t, mem, sync, bwd

    # The step is cost + max(0, sync - backward); keep the sums as choices move.
    cost, mem, sync, bwd = totals(problem, choice)
    total = cost + max(0.0, sync - bwd)
    tol = rel_tol * max(total, 0.0)
    hosted = host_bound(problem)
    host = host_bytes(problem, choice) if hosted else 0.0
    cuts_of: dict[int, list[int]] = {}
    for k, c in enumerate(problem.cuts):
        for g in {g for g, _ in c.terms}:
            cuts_of.setdefault(g, []).append(k)

    def kept(g: int) -> bool:
        """Whether the cuts touching ``g`` still hold."""
        return all(sum(1 for d, i in problem.cuts[k].terms if choice[d] == i)
                   <= problem.cuts[k].most for k in cuts_of.get(g, ()))

    for g, prefs in order.items():
        if g in fixed:
            continue
        now = choice[g]
        before = local(g)
        for i in prefs:
            if i == now:
                break
            choice[g] = i
            after = local(g)
            c1, m1, s1, b1 = (a + x - y for a, x, y in zip((cost, mem, sync, bwd), after, before))
            dec = problem.decisions[g]
            h1 = host + (dec.host[i] - dec.host[now]) * dec.multiplicity if hosted and dec.host \
                else host
            if c1 + max(0.0, s1 - b1) - total <= tol and m1 <= problem.memory_budget and (
                    not hosted or h1 <= problem.host_budget) and kept(g):
                cost, mem, sync, bwd, host = c1, m1, s1, b1, h1
                total = cost + max(0.0, sync - bwd)
                break
            choice[g] = now
    return tuple(choice)
