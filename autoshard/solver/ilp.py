"""The sharding ILP (GShard/Alpa formulation), solved with OR-Tools.

    x[g,i] in {0,1}   one strategy per decision:            sum_i x[g,i] = 1
    e[o,r] >= 0       per edge, the (output class, requirement class) pair in use:
                      sum_r e[o,r] = sum_{i in class o} x[producer,i]
                      sum_o e[o,r] = sum_{j in class r} x[consumer,j]
    f[c,o,r] >= 0     per fanout and consumer c, the same transportation polytope as an edge
    z[o,r] >= f[c,o,r] for every consumer c: the reshard o -> r is paid once if any consumer
                      needs r (z is 1 exactly then, for integral x)
    w >= 0            the overlap window's exposed seconds (cost/overlap.py):
                      w >= sum n*sync*e + sum n*sync*z - sum n*backward*x
                      (a decision's backward is negative where it puts work in the window:
                      an offloaded host step, cost/price.py offload_step_seconds)
    minimise   sum n*cost*x + sum n*cost*e + sum n*cost*z + w
    subject to sum n*memory*x + sum n*memory*e + sum n*memory*z <= budget
               sum n*host*x <= host budget      (where strategies offload state to the host)

(n is the multiplicity: how many identical layers a decision, edge or fanout stands for;
the memory on e and z is a value its consumers save for backward, once per layout they read it
in: build.py adds one memory-only edge or fanout per saved value).

The edge constraints are a transportation polytope per edge: their LP relaxation is tight on
chains and trees, so the MIP solver closes most of the problem at the root. The solver runs
single-threaded with a fixed seed, so two runs give the same plan.
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from ortools.linear_solver import pywraplp

from autoshard.solver.deadline import BestStart, Deadline, best_start, step_floor
from autoshard.solver.outcomes import Infeasible, MemoryBinds, NoBetter, NoSolution
from autoshard.solver.problem import (FORBIDDEN, Edge, Fanout, Problem, Solution, Start, admits,
                                      evaluate, excluded, host_bytes, projected)

BACKENDS = ("CBC", "HIGHS", "SCIP")
# The backend that continues where the first stopped short of an optimum, from the best start.
SECOND_BACKENDS = ("HIGHS", "CBC", "SCIP")
# Backends whose OR-Tools wrapper takes a solution hint (MPSolver.SetHint).
HINTED = ("SCIP", "CP-SAT", "SAT")
Starts = Sequence[Start] | Callable[[], Sequence[Start]]
# Under a deadline (solve(verdict=False)), HiGHS first: on the ILP of a 3-axis mesh over every
# subset of axes (~10^5 edge variables), CBC's root processing overran a 4 s limit by 3 to 8 times
# where HiGHS kept to it and proved the optimum.
DEADLINE_BACKENDS = ("HIGHS", "CBC", "SCIP")
# A pipeline's stages' plan (solve(highs_first=True)) too: a pipeline search solves it once per
# microbatch count, and on GPT-3 175B's stages (16x8x8, 64 microbatches) CBC took 9.9 s where
# HiGHS took 2.0 s to the same optimum.
# A problem whose device memory binds (its optimum without the memory-only items does not fit
# with them, :func:`_search`) too, CBC second: to the same optima, HiGHS took 0.5 s where CBC
# took 15 s (Llama-2-70B, dp 8, optimizer offload), 3.5 s where CBC took 7 s (gpt2-tiny on 2x4
# at 80% of its memory), 2.5 s and 3.4 s where CBC took 7 s and 9 s (gpt2-tiny, parameter and
# optimizer offload under a tight budget). Where memory does not bind CBC stays first: it
# settles those problems quickly, and plans with and without offload keep the same layouts
# (equally fast optima are the backend's pick).
# Under a cutoff (only plans faster than one in hand) CBC stays first: its bound with the cutoff
# proves there are none quickly (Llama-3-70B on 4x8 without checkpointing, under the step of the
# plan with it: 0.9 s, where HiGHS took 4.8 s; benchmarks/RESULTS.md "Which MIP backend under a
# cutoff").
BINDING_BACKENDS = (DEADLINE_BACKENDS, BACKENDS)
# Costs enter the MIP in microseconds: CBC drops objective coefficients below ~1e-8, and a small
# op's seconds are that small.
US = 1e6


@dataclass(frozen=True, slots=True)
class LeastMemory:
    """The least memory per device of any assignment: ``exact``, with an assignment that reaches
    it (``choice``), or a lower bound without one."""

    bytes: float
    exact: bool
    choice: tuple[int, ...] | None


def least_memory(problem: Problem, *, time_limit_s: float = 30.0) -> float:
    """The least memory (bytes per device) of any assignment (see :func:`least_memory_plan`)."""
    return least_memory_plan(problem, time_limit_s=time_limit_s).bytes


def least_memory_plan(problem: Problem, *, time_limit_s: float = 30.0) -> LeastMemory:
    """The least memory of any assignment. Without memory on edges, memory depends on the
    decisions alone: each decision's least-memory strategy, exactly. With it, a MIP that
    minimises memory; if that MIP does not finish in time, the per-decision minimum, a bound."""
    bound, leanest = _leanest(problem)
    if leanest is None:
        return LeastMemory(float("inf"), True, None)   # two strategies pinned on one decision
    hosted = host_bound(problem)
    if not any(e.memory for e in (*problem.edges, *problem.fanouts)) and admits(
            problem, leanest) and (not hosted or host_bytes(problem, leanest) <= problem.host_budget):
        return LeastMemory(bound, True, leanest)
    # With the host bound, HiGHS first: CBC took over 20 s on gpt2-tiny's host-bound MIPs
    # where HiGHS took 0.2 s.
    m = _Model(problem, DEADLINE_BACKENDS if hosted else BACKENDS)
    if hosted:
        m.s.Add(m.host <= problem.host_budget)
    m.s.Minimize(m.mem)
    m.s.SetTimeLimit(int(time_limit_s * 1000))
    status = _run(m)
    if status == pywraplp.Solver.OPTIMAL:
        choice = m.choice()
        return LeastMemory(evaluate(problem, choice)[1], True, choice)
    if hosted and status == pywraplp.Solver.INFEASIBLE:
        return LeastMemory(float("inf"), True, None)    # no plan within the host memory
    if hosted and status == pywraplp.Solver.FEASIBLE:
        # Stopped at the limit: a plan within both bounds if the incumbent fits the budget,
        # else the solver's bound (over the per-decision one, which ignores the host).
        choice = m.choice()
        if evaluate(problem, choice)[1] <= problem.memory_budget:
            return LeastMemory(evaluate(problem, choice)[1], False, choice)
        return LeastMemory(max(bound, _finite(m.s.Objective().BestBound(), 0.0)), False, None)
    return LeastMemory(bound, False, None)


def least_memory_floor(problem: Problem) -> float:
    """Every decision at its least-memory strategy: a lower bound of any assignment's memory,
    without a solve (see :func:`_leanest`)."""
    return _leanest(problem)[0]


def _leanest(problem: Problem) -> tuple[float, tuple[int, ...] | None]:
    """Each decision's least-memory strategy (within its pins and restrictions) and their
    memory: the least memory of any assignment without memory on edges, a lower bound with it
    (edges and fanouts only add memory) or with other cuts. ``(inf, None)`` when a decision has
    no strategy left (two pinned, or every one cut)."""
    pins: dict[int, set[int]] = {}
    for g, i in problem.fixed:
        pins.setdefault(g, set()).add(i)
    out = excluded(problem)
    offered = [pins.get(g, set(range(len(dec.memory)))) - out.get(g, set())
               for g, dec in enumerate(problem.decisions)]
    if any(len(v) > 1 for v in pins.values()) or not all(offered):
        return float("inf"), None
    leanest = tuple(min(sorted(offered[g]), key=lambda i: dec.memory[i])
                    for g, dec in enumerate(problem.decisions))
    return sum(dec.multiplicity * dec.memory[i]
               for dec, i in zip(problem.decisions, leanest)), leanest


def least_host(problem: Problem, *, time_limit_s: float = 30.0) -> float | None:
    """The least host memory of an assignment that fits the device memory budget: exact, or
    the solver's lower bound when it stops at the time limit (None: it has none)."""
    m = _Model(problem, DEADLINE_BACKENDS)
    m.s.Add(m.mem <= problem.memory_budget)
    m.s.Minimize(m.host)
    m.s.SetTimeLimit(int(time_limit_s * 1000))
    status = _run(m)
    if status == pywraplp.Solver.OPTIMAL:
        return host_bytes(problem, m.choice())
    if status == pywraplp.Solver.FEASIBLE:
        bound = m.s.Objective().BestBound()
        return bound if math.isfinite(bound) and bound > 0 else None
    return None


def host_bound(problem: Problem) -> bool:
    """Whether the problem's host memory bound can bind: a budget and offloading strategies."""
    return problem.host_budget is not None and any(any(d.host) for d in problem.decisions
                                                   if d.host)


def _run(m: "_Model") -> int:
    """``m.s.Solve()``, with file descriptor 1 closed to HiGHS: it prints its banner on the
    process's stdout once any option is set, whatever its output flag, which would break
    ``autoshard plan --json``."""
    if m.backend != "HIGHS":
        return m.s.Solve()
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 1)
            return m.s.Solve()
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _solver(backends: tuple[str, ...] = BACKENDS) -> tuple[pywraplp.Solver, str]:
    for name in backends:
        s = pywraplp.Solver.CreateSolver(name)
        if s is not None:
            s.SuppressOutput()
            s.SetNumThreads(1)         # one thread: two runs give the same plan
            return s, name
    raise RuntimeError(f"OR-Tools offers none of the MIP backends {backends}")


class _Model:
    """The MIP of a problem: variables, the objective's terms and the memory expression."""

    def __init__(self, problem: Problem, backends: tuple[str, ...] = BACKENDS) -> None:
        s, self.backend = _solver(backends)
        self.s = s
        x = self.x = [[s.BoolVar(f"x{g}_{i}") for i in range(len(dec.cost))]
                      for g, dec in enumerate(problem.decisions)]
        for xs in x:
            s.Add(s.Sum(xs) == 1)
        for g, i in problem.fixed:
            s.Add(x[g][i] == 1)
        for c in problem.cuts:
            s.Add(s.Sum([x[g][i] for g, i in c.terms]) <= c.most)
        obj = [US * dec.cost[i] * dec.multiplicity * v for g, dec in enumerate(problem.decisions)
               for i, v in enumerate(x[g]) if dec.cost[i]]
        mem = [dec.memory[i] * dec.multiplicity * v for g, dec in enumerate(problem.decisions)
               for i, v in enumerate(x[g]) if dec.memory[i]]
        host = [dec.host[i] * dec.multiplicity * v for g, dec in enumerate(problem.decisions)
                if dec.host for i, v in enumerate(x[g]) if dec.host[i]]
        sync: list = []
        self.n_aux = 0

        def pays(item, o: int, r: int) -> bool:
            return bool(item.cost[o][r] or (item.memory and item.memory[o][r])
                        or (item.sync and item.sync[o][r]))

        def charge(item, o: int, r: int, var) -> None:
            if item.cost[o][r]:
                obj.append(US * item.cost[o][r] * item.multiplicity * var)
            if item.memory and item.memory[o][r]:
                mem.append(item.memory[o][r] * item.multiplicity * var)
            if item.sync and item.sync[o][r]:
                sync.append(US * item.sync[o][r] * item.multiplicity * var)

        for k, item in enumerate((*problem.edges, *problem.fanouts)):
            n_o, n_r = len(item.cost), len(item.cost[0])
            paid = [(o, r) for o in range(n_o) for r in range(n_r) if pays(item, o, r)]
            if not paid:
                continue
            flows = [self._transport(f"f{k}_{c}", item.producer, item.out, g, req, n_o, n_r)
                     for c, (g, req) in enumerate(item.consumers)]
            for o, r in paid:
                if item.cost[o][r] == FORBIDDEN:   # no plan holds it: its flow stays zero
                    for f in flows:
                        f[o][r].SetUb(0.0)
                    continue
                if len(flows) == 1:              # an edge: the flow itself is the pair in use
                    charge(item, o, r, flows[0][o][r])
                    continue
                z = s.NumVar(0.0, 1.0, f"z{k}_{o}_{r}")
                self.n_aux += 1
                for f in flows:
                    s.Add(z >= f[o][r])
                charge(item, o, r, z)
        # (a negative backward is work in the window: an offloaded host step, cost/price.py)
        if sync or any(b < 0 for dec in problem.decisions for b in dec.backward):
            w = s.NumVar(0.0, s.infinity(), "exposed")
            self.n_aux += 1
            backward = [US * dec.backward[i] * dec.multiplicity * v
                        for g, dec in enumerate(problem.decisions) if dec.backward
                        for i, v in enumerate(x[g]) if dec.backward[i]]
            s.Add(w >= s.Sum(sync) - s.Sum(backward))
            obj.append(w)
        self.obj, self.mem, self.host = s.Sum(obj), s.Sum(mem), s.Sum(host)

    def _transport(self, name: str, producer: int, out: tuple[int, ...], consumer: int,
                   req: tuple[int, ...], n_o: int, n_r: int) -> list[list]:
        """Flow variables f[o][r] whose margins are the producer's and consumer's classes."""
        s, x = self.s, self.x
        f = [[s.NumVar(0.0, 1.0, f"{name}_{o}_{r}") for r in range(n_r)] for o in range(n_o)]
        self.n_aux += n_o * n_r
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

    def choice(self) -> tuple[int, ...]:
        return tuple(max(range(len(xs)), key=lambda i: xs[i].solution_value()) for xs in self.x)


def solve(problem: Problem, *, time_limit_s: float = 30.0,
          cutoff_s: float | None = None, verdict: bool = True,
          highs_first: bool = False, starts: Starts = (), least_exact: bool = True,
          binds: bool = False, stop_if_binds: bool = False) -> Solution:
    """The best plan the solver finds in ``time_limit_s``: optimal, or feasible with its gap to
    the best bound. Raises :class:`Infeasible` when no plan fits memory, :class:`NoSolution` when
    the solver found no plan in time and none could be built without it. With ``cutoff_s`` (the
    step of a plan the caller already holds) only faster plans are searched, which prunes the
    branch and bound; :class:`NoBetter` when none is found. ``verdict=False``: without an
    incumbent, raise :class:`NoSolution` at once, without the least-memory MIP that tells the two
    apart (and may take the time limit again): for a caller that has other plans (a search under
    a deadline, ``autoshard explain``'s swap alone), solved HiGHS first, as ``highs_first``
    problems are, in a child process stopped at :data:`WALL_SLACK` times the limit. A budget
    below the sum of every decision's least memory is refused before any search (Infeasible;
    NoBetter with ``cutoff_s``); ``least_exact=False``: refused with that sum as the bound,
    without the least-memory MIP that makes it exact (up to the time limit again), for a caller
    that goes on to other techniques when refused (a rung of the memory ladder).

    Edges and fanouts that only add memory (a saved activation kept once per layout, build.py)
    matter only when the budget binds, and they make the MIP much harder (T5-large on 8x8 finds
    no incumbent in 20 s with them): the problem without them is solved first, and if its plan
    fits with them counted, it is optimal for the whole problem too (dropping them relaxes the
    memory constraint only).

    ``starts``: incumbents (``problem.Start``) the solve is never worse than: the best that fits
    is returned where the solver finds nothing faster, and bounds the solver's search once its
    first backend stops short of an optimum (:func:`_solve`). A start given as a restriction is
    solved only then, and ``starts`` may be a function that makes them, called only then: a
    problem the first backend settles costs nothing more. The Solution
    names the start (``start``) whenever one was in play.

    ``binds``: the caller knows the device memory binds (a re-plan under a budget lowered below
    a plan's own sum, a problem that raised MemoryBinds): the whole problem is solved at once,
    by the backends that suit such problems (:data:`BINDING_BACKENDS`). ``stop_if_binds``:
    raise :class:`MemoryBinds` once the problem without its memory-only items is solved to an
    optimum that does not fit with them, before the whole problem's MIP: for a caller that can
    first find a plan that bounds it (the checkpointing search, solver/budget.py)."""
    t0 = time.perf_counter()
    floor = _leanest(problem)[0]
    if floor > problem.memory_budget:
        # Every decision at its leanest already exceeds the budget: no plan fits, which the
        # step-time MIP would only find out at its time limit (or past it, see WALL_SLACK).
        # The least memory for the error, unless the caller holds a plan (cutoff) or is under
        # a deadline (no verdict).
        if cutoff_s is not None:
            raise NoBetter()
        if not verdict or not least_exact:
            raise Infeasible(floor, budget=problem.memory_budget, exact=False)
        least = least_memory_plan(problem, time_limit_s=time_limit_s)
        raise Infeasible(least.bytes, budget=problem.memory_budget, exact=least.exact)
    deadline = Deadline.after(time_limit_s, t0)
    if not verdict:
        try:
            return _bounded(_search, problem, deadline, cutoff_s, verdict, highs_first, starts,
                            binds, stop_if_binds, limit_s=time_limit_s)
        except NoSolution as e:       # the child was stopped: a start in hand still stands
            given = () if callable(starts) else tuple(s for s in starts if s.choice)
            start = best_start(problem, given, None, solve_held)
            if start is None or (cutoff_s is not None and start[2] >= cutoff_s):
                raise
            return _from_start(start, e.bound, False, 0, deadline)
    return _search(problem, deadline, cutoff_s, verdict, highs_first, starts, binds,
                   stop_if_binds)


# A deadline solve is stopped at this multiple of its time limit (plus a second): the backends
# check their limit between phases, and a phase can run far past it (HiGHS minutes past a
# seconds' limit in presolve on Llama-3-70B's 2x2x2 problem over every subset of axes, CBC 3 to
# 8 times in root processing).
WALL_SLACK = 1.25
_IN_CHILD = False            # this process is a child of _bounded


def _bounded(fn, *args, limit_s: float):
    """``fn(*args)`` in a forked child killed after ``limit_s`` times :data:`WALL_SLACK` plus a
    second (NoSolution then): the only hard bound on a backend that overruns its own limit. The child returns the
    Solution, or which of the solver's exceptions it raised, through a pipe. In a child (its
    own solves need no child of their own) or where one cannot fork, ``fn(*args)`` here."""
    global _IN_CHILD
    if _IN_CHILD or not hasattr(os, "fork"):
        return fn(*args)
    import pickle
    import select
    import signal
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                   # the child: solve, report, exit at once
        _IN_CHILD = True                           # its own solves need no child of their own
        os.close(r)
        try:
            out = ("ok", fn(*args))
        except Infeasible as e:
            out = ("infeasible", (e.least_memory, e.budget, e.exact, e.least_host,
                                  e.host_budget))
        except NoSolution as e:
            out = ("nosolution", (e.time_limit_s, e.status, e.bound))
        except NoBetter as e:
            out = ("nobetter", (e.proved,))
        except MemoryBinds as e:
            out = ("binds", (e.bound,))
        except BaseException as e:  # noqa: BLE001 - re-raised in the parent
            out = ("error", repr(e))
        with os.fdopen(w, "wb") as f:
            f.write(pickle.dumps(out))
        os._exit(0)
    os.close(w)
    end, data = time.perf_counter() + limit_s * WALL_SLACK + 1.0, []
    try:
        while True:
            left = end - time.perf_counter()
            if left <= 0 or not select.select([r], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                raise NoSolution(limit_s, -1)
            chunk = os.read(r, 1 << 20)
            if not chunk:
                break
            data.append(chunk)
    finally:
        os.close(r)
        os.waitpid(pid, 0)
    kind, value = pickle.loads(b"".join(data))
    if kind == "ok":
        return value
    if kind == "infeasible":
        raise Infeasible(value[0], budget=value[1], exact=value[2], least_host=value[3],
                         host_budget=value[4])
    if kind == "nosolution":
        raise NoSolution(*value)
    if kind == "nobetter":
        raise NoBetter(*value)
    if kind == "binds":
        raise MemoryBinds(*value)
    raise RuntimeError(f"the solver's process failed: {value}")


def _search(problem: Problem, deadline: Deadline, cutoff_s: float | None,
            verdict: bool, highs_first: bool, starts: Starts = (), binds: bool = False,
            stop_if_binds: bool = False) -> Solution:
    """:func:`solve` within ``deadline``: the problem without its memory-only items in half of
    the time left, then, unless its plan stands, the whole problem in the rest. That problem
    relaxes the whole one's memory: where it has no plan within the budget (or under the
    cutoff), proved, neither has the whole problem (selective checkpointing on Llama-3-70B's
    4x8 problem: the whole problem's search took 43 s to find nothing before)."""
    relaxed = without_memory_only(problem)
    probe = True
    if binds:       # known: the problem without those items would be solved for nothing
        return _solve(problem, deadline, cutoff_s, verdict, highs_first, starts, binds=True,
                      stoppable=bool(starts))
    if len(relaxed.edges) + len(relaxed.fanouts) < len(problem.edges) + len(problem.fanouts):
        try:        # half the time: the whole problem may still need the other half.
            # HiGHS alone, as fast as CBC or faster on each problem measured (benchmarks/
            # RESULTS.md "Which MIP backend first": Llama-3-8B on 8x8 1.3 s both; Llama-3-70B
            # on 4x8 1.7 s against 5.3 s; GPT-3 175B on 8x8 at batch 64 2.4 s against 3.5 s);
            # under a cutoff, CBC first (see BINDING_BACKENDS).
            sol = _solve(relaxed, deadline.share(0.5), cutoff_s, verdict,
                         highs_first or cutoff_s is None, (), stoppable=bool(starts))
        except Infeasible as e:   # its least memory is a lower bound on the whole problem's
            raise Infeasible(e.least_memory, budget=e.budget, exact=False,
                             least_host=e.least_host, host_budget=e.host_budget) from None
        except NoBetter as e:
            if e.proved:
                raise
            sol = None
        except NoSolution:
            sol = None            # the whole problem is no easier: solve it for its verdict
        # (The host bound has no edge terms: the relaxed solve kept it.) A plan that fits with
        # the memory-only items counted is a plan of the whole problem, and the relaxed bound
        # bounds it too: optimal, it is the whole problem's optimum; the solver's incumbent
        # (not a plan of least memory, which says why in its note) with no starts to compare
        # it with (pinned layouts), it is kept: the whole problem, larger, gave no plan at all
        # in the other half (gshard-moe's experts pinned replicated on 2x4, a plan of least
        # memory twice as slow after 30 s).
        if sol is not None and (sol.status == "OPTIMAL" or not (starts or sol.note)) and \
                evaluate(problem, sol.choice)[1] <= problem.memory_budget:
            return sol
        if sol is not None and sol.status == "OPTIMAL":          # its optimum does not fit
            binds = True
            if stop_if_binds:
                raise MemoryBinds(sol.objective)
        # Neither backend found a plan of the problem without those items: the whole problem,
        # no easier, goes straight to the starts (DeepSeek-V3 and Jamba shapes on 8x8: CBC 6 s
        # for nothing, loaded).
        probe = sol is not None and not sol.note
    return _solve(problem, deadline, cutoff_s, verdict, highs_first, starts, binds=binds,
                  probe=probe, stoppable=bool(starts))


def without_memory_only(problem: Problem) -> Problem:
    """``problem`` without its memory-only edges and fanouts (a saved activation kept once per
    layout: no seconds, build.py): a relaxation of its memory, solved first (:func:`_search`)."""
    return replace(problem, edges=tuple(e for e in problem.edges if _prices_time(e)),
                   fanouts=tuple(f for f in problem.fanouts if _prices_time(f)))


def _prices_time(item: Edge | Fanout) -> bool:
    return any(any(row) for row in item.cost) or any(any(row) for row in item.sync)


@dataclass(frozen=True, slots=True)
class Run:
    """One backend's run on a MIP, as :func:`_solve` keeps it (picklable: it may come from a
    child process): its status, backend, size, best bound on the step (seconds; 0 where it has
    none) and, where it found one, its plan."""

    status: int
    backend: str
    variables: int
    bound: float
    choice: tuple[int, ...] | None = None


# A MIP of at least this many variables (strategies, and class pairs of edges and fanouts), in a
# solve with starts to fall back on, is solved in a child process stopped at WALL_SLACK times its
# limit: on DeepSeek-V3's 8x8 problem
# (75,000 variables), loaded, CBC ran 15 s on a 3.3 s limit and HiGHS 9.5 s on 0.5 s. Smaller
# ones settle well within their limit, and a fork costs them ~50 ms each.
BOUNDED_VARIABLES = 30_000


def _attempt(problem: Problem, backends: tuple[str, ...], time_limit_s: float,
             cutoff_s: float | None, hint: tuple[int, ...] = (), *,
             stoppable: bool = False) -> Run:
    """One solve of the MIP by the first available of ``backends``; ``stoppable`` (the solve
    has starts to fall back on): stopped, as NOT_SOLVED, at :data:`WALL_SLACK` times
    ``time_limit_s`` where it is large (above) and one can fork. Without starts a backend that
    overruns is waited for: its plan is the only one."""
    if not stoppable or mip_size(problem) < BOUNDED_VARIABLES:
        return _attempt_here(problem, backends, time_limit_s, cutoff_s, hint)
    try:
        return _bounded(_attempt_here, problem, backends, time_limit_s, cutoff_s, hint,
                        limit_s=time_limit_s)
    except NoSolution:
        return Run(pywraplp.Solver.NOT_SOLVED, backends[0], mip_size(problem), 0.0)


def mip_size(problem: Problem) -> int:
    """The MIP's variables, near enough: strategies and the class pairs of edges and fanouts."""
    return sum(len(d.cost) for d in problem.decisions) + sum(
        len(e.cost) * len(e.cost[0]) * len(e.consumers)
        for e in (*problem.edges, *problem.fanouts) if e.cost)


def _attempt_here(problem: Problem, backends: tuple[str, ...], time_limit_s: float,
                  cutoff_s: float | None, hint: tuple[int, ...] = ()) -> Run:
    """:func:`_attempt` in this process. ``hint``: a full choice handed to a backend that takes
    solution hints (not HiGHS, whose OR-Tools wrapper crashes on one; the cutoff is its warm
    start)."""
    m = _Model(problem, backends)
    if hint and m.backend in HINTED:
        m.s.SetHint([v for xs in m.x for v in xs],
                     [float(i == c) for xs, c in zip(m.x, hint) for i in range(len(xs))])
    m.s.Add(m.mem <= problem.memory_budget)
    if host_bound(problem):
        m.s.Add(m.host <= problem.host_budget)
    if cutoff_s is not None:
        m.s.Add(m.obj <= US * cutoff_s * (1 - 1e-9))
    m.s.Minimize(m.obj)
    m.s.SetTimeLimit(int(time_limit_s * 1000))
    status = _run(m)
    found = status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
    return Run(status, m.backend, sum(len(xs) for xs in m.x) + m.n_aux,
               _finite(m.s.Objective().BestBound() / US, 0.0), m.choice() if found else None)


def _solve(problem: Problem, deadline: Deadline, cutoff_s: float | None = None,
           verdict: bool = True, highs_first: bool = False, starts: Starts = (),
           binds: bool = False, probe: bool = True, stoppable: bool = False) -> Solution:
    """``binds``: the device memory budget is known to bind (:data:`BINDING_BACKENDS`);
    ``probe=False``: with starts, no first backend before them (:func:`_attempts`);
    ``stoppable``: the backends may be stopped at their limit (:func:`_attempt`)."""
    runs, start, proved = _attempts(problem, deadline, cutoff_s, verdict, highs_first,
                                    starts, binds, probe, stoppable)
    warm = start is not None          # the second backend started from it
    if start is None and not callable(starts):
        start = best_start(problem, tuple(s for s in starts if s.choice), None, solve_held)
    variables = max(r.variables for r in runs)
    # The plain floor too: a backend stopped early may have no bound at all (a 100% gap).
    bound = max(step_floor(problem), *(r.bound for r in runs))
    best = None          # a proven optimum, else the fastest incumbent
    for r in runs:
        if r.choice is not None:          # (a run has a choice where it found a plan)
            objective = evaluate(problem, r.choice)[0]  # exact, not within the solver's tolerances
            optimal = r.status == pywraplp.Solver.OPTIMAL
            if best is None or optimal or (not best[2] and objective < best[1]):
                best = (r.choice, objective, optimal, r.backend)
    if start is not None and (best is None or not best[2] and start[2] < best[1]):
        if cutoff_s is not None and start[2] >= cutoff_s:
            raise NoBetter()
        return _from_start(start, bound, proved, variables, deadline)
    if best is not None:
        choice, objective, optimal, backend = best
        return Solution(choice, "OPTIMAL" if optimal else "FEASIBLE", objective,
                        objective if optimal else min(objective, _finite(bound, objective)),
                        variables, time.perf_counter() - deadline.t0,
                        start=start[0] if warm else "", backend=backend)
    status = runs[-1].status
    if cutoff_s is not None:
        raise NoBetter(proved)
    return _no_incumbent(problem, deadline.limit_s, status, bound, variables, deadline.t0,
                         verdict)


# The share of what is left after the first backend that the starts take together; the final
# backend, from the best of them, takes the rest. Where no backend found a plan of the problem
# without its memory-only items (no first backend, :func:`_search`), the starts take nearly all:
# on the DeepSeek-V3 and Jamba shapes' 8x8 problems they gave the plan, and the final backend,
# cut off at the best start, found nothing in 2 to 6 s (HiGHS nothing in 30 s, loaded).
STARTS_SHARE = 0.5
STARTS_ALONE_SHARE = 0.9


def _attempts(problem: Problem, deadline: Deadline, cutoff_s: float | None, verdict: bool,
              highs_first: bool, starts: Starts, binds: bool, probe: bool = True,
              stoppable: bool = False) -> tuple[list[Run], BestStart | None, bool]:
    """The backends' runs within ``deadline``, the start the last one began from (if any)
    and whether the last run proved that no plan is faster than that start, or than the
    cutoff, or (without either) fits: the first backend in half the time, which settles most
    problems in a fraction of it. Where it proves no optimum, the starts are solved in a share
    of what is left and the best is the incumbent a second backend starts from, in the rest;
    the better plan is kept (on Gemma-7B's 8x8 problem CBC's 20 s incumbent was 22x the
    optimum HiGHS proved in 3 s)."""
    runs: list[Run] = []
    stop = {"stoppable": True} if stoppable else {}     # (a backend stand-in may take none)
    if not verdict or highs_first:
        runs.append(_attempt(problem, DEADLINE_BACKENDS, deadline.left(), cutoff_s, **stop))
        return runs, None, False
    first, second = BINDING_BACKENDS if binds and cutoff_s is None else \
        (BACKENDS, SECOND_BACKENDS)
    if probe or not starts:
        t1, limit = time.perf_counter(), deadline.left() / 2
        runs.append(_attempt(problem, first, limit, cutoff_s, **stop))
        # INFEASIBLE well before the limit is a proof (at the limit some backends say it too)
        status = runs[0].status
        proved = status == pywraplp.Solver.INFEASIBLE and time.perf_counter() - t1 < 0.9 * limit
        if status == pywraplp.Solver.OPTIMAL or proved:
            return runs, None, proved
    start = best_start(problem, tuple(starts() if callable(starts) else starts),
                       deadline.share(STARTS_SHARE if runs else STARTS_ALONE_SHARE),
                       solve_held)
    hint, cut = (start[1] if start else ()), cutoff_s
    if start is not None and (cut is None or start[2] < cut):
        cut = start[2]
    t2, left = time.perf_counter(), deadline.left()
    run = _attempt(problem, second, left, cut, hint, **stop)
    # Under a cutoff (a start's step, or the caller's), the run's bound bounds only the plans
    # faster than it, so the whole problem's bound is at most the cutoff.
    runs.append(replace(run, bound=min(run.bound, cut)) if cut is not None else run)
    # Nothing beats the start (or the cutoff; without either, nothing fits).
    proved = run.status == pywraplp.Solver.INFEASIBLE and time.perf_counter() - t2 < 0.9 * left
    return runs, start, proved


def solve_held(held: Problem, limit: float) -> Solution | None:
    """A start's restriction solved as any problem is (CBC, then HiGHS where it proves no
    optimum) in ``limit``, its excluded strategies projected away (``problem.projected``: on
    DeepSeek-V3's 8x8 problem the restrictions that hold every decision were built and solved
    in 2-3 s whole), in a child stopped at :data:`WALL_SLACK` times it where one can fork: a
    restriction that leaves every activation free is still a hard MIP (on Gemma-3 12B's 8x8
    problem, loaded, Megatron's layouts ran 200 s on a 10 s limit). None where it found no
    plan, or where every decision at its leanest exceeds the budget (every weight replicated,
    on a model that needs it sharded)."""
    proj = projected(held)
    if proj is None or _leanest(proj.problem)[0] > held.memory_budget:
        return None
    deadline = Deadline.after(limit)
    try:
        sol = _bounded(_search, proj.problem, deadline, None, True, False, limit_s=limit)
    except (Infeasible, NoSolution):
        return None
    return replace(sol, choice=proj.lift(sol.choice))


def _no_incumbent(problem: Problem, time_limit_s: float, status: int, bound: float,
                  variables: int, t0: float, verdict: bool) -> Solution:
    """Neither backend found a plan. The budget is infeasible, or the time limit came first
    (status NOT_SOLVED; some backends then say INFEASIBLE too): only the least memory tells
    which, and where memory is not the cause its plan is the one returned."""
    if not verdict:
        raise NoSolution(time_limit_s, status, _finite(bound, 0.0))
    least = least_memory_plan(problem, time_limit_s=time_limit_s)
    if least.bytes > problem.memory_budget:
        if host_bound(problem):
            # The host memory may be what rules every plan out: the device alone is then
            # within reach, and the error says how much host memory that takes.
            free = least_memory_plan(replace(problem, host_budget=None),
                                     time_limit_s=time_limit_s)
            if free.bytes <= problem.memory_budget:
                host = least_host(problem, time_limit_s=time_limit_s)
                if host is not None:
                    raise Infeasible(free.bytes, budget=problem.memory_budget,
                                     exact=free.exact, least_host=host,
                                     host_budget=problem.host_budget)
        raise Infeasible(least.bytes, budget=problem.memory_budget, exact=least.exact)
    if least.choice is None:
        raise NoSolution(time_limit_s, status, _finite(bound, 0.0))
    objective = evaluate(problem, least.choice)[0]
    return Solution(least.choice, "FEASIBLE", objective, _finite(bound, 0.0), variables,
                    time.perf_counter() - t0,
                    note=f"the solver found no plan within {time_limit_s:g} s; this is the plan "
                         "of least memory, whose step time was not optimised")


def _from_start(start: BestStart, bound: float, proved: bool, variables: int,
                deadline: Deadline) -> Solution:
    """The Solution of a start the solver found nothing faster than: optimal where that is
    proved (the solver's bound reaches it, or nothing under it is feasible)."""
    label, choice, step = start
    optimal = proved or bound >= step * (1 - 1e-9)
    return Solution(choice, "OPTIMAL" if optimal else "FEASIBLE", step,
                    step if optimal else min(step, _finite(bound, 0.0)), variables,
                    time.perf_counter() - deadline.t0, start=label,
                    note=f"the solver found no plan faster than the start ({label}) within "
                         f"{deadline.limit_s:g} s")


def _finite(bound: float, default: float) -> float:
    """The solver's best bound where it has a meaningful one (CBC reports +-inf without)."""
    return bound if math.isfinite(bound) and bound >= 0 else default
