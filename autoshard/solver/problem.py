"""The solver's input as pure data (docs/design.md): JSON round-trippable, no torch.

A *decision* is one choice of the ILP: a node plus the follower ops merged into it, with one cost
and one memory figure per strategy, and a multiplicity (how many identical layers it stands for).
An *edge* joins a producer decision to a consumer decision: the producer's strategy picks an output
spec class, the consumer's strategy a requirement class (the spec it needs plus the axes on which
its gradient must be all-reduced), and ``cost[o][r]`` prices the reshard. A value read by several
decisions is a *fanout*: each distinct requirement its consumers pick is resharded once from the
producer's output and shared by every consumer that needs it, which is what the program does
(lowering.reshard_edges), so the objective is the plan's price.

What a caller asks beyond the cheapest plan is data of the problem too, so that every caller
(the planner, the baselines, ``autoshard explain``, the runner-up search) solves it through the
one entry, ``ilp.solve``: ``fixed`` pins a decision to a strategy, and a :class:`Cut` bounds how
many of a set of (decision, strategy) pairs a plan may take: a no-good cut excludes one plan's
parameter layouts (Balas and Jeroslow, "Canonical cuts on the unit hypercube", SIAM J. Appl.
Math. 1972), and a cut with ``most=0`` restricts decisions to the other strategies
(:func:`restricted`).
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True, slots=True)
class Decision:
    name: str
    multiplicity: int
    cost: tuple[float, ...]      # seconds per strategy (compute + internal reshards), one copy
    memory: tuple[float, ...]    # bytes per device per strategy, one copy
    backward: tuple[float, ...] = ()   # of ``cost``, the backward compute seconds; () for none
    host: tuple[float, ...] = ()   # bytes of host memory per strategy, one copy (offload)


# An edge's or fanout's price of a reshard no plan may hold (an in-place write must land in the
# storage later reads see, solver/build.py): the MIP holds that pair's flow at zero, whatever it
# minimises (time, or memory for the least-memory plan), and a full assignment that uses it is
# not admitted (:func:`admits`).
FORBIDDEN = math.inf


@dataclass(frozen=True, slots=True)
class Edge:
    name: str
    multiplicity: int
    producer: int
    consumer: int
    out: tuple[int, ...]         # output-spec class per strategy of the producer decision
    req: tuple[int, ...]         # requirement class per strategy of the consumer decision
    # [out class][requirement class] seconds; FORBIDDEN where no plan may hold that reshard
    cost: tuple[tuple[float, ...], ...]
    # [out class][requirement class] bytes per device kept alive for backward: the value in
    # the requirement's layout, saved by the consumers (0 where that is the producer's own
    # tensor, already counted); () for none.
    memory: tuple[tuple[float, ...], ...] = ()
    # [out class][requirement class] seconds of bucketed gradient sync, which backward compute
    # hides (the overlap window, see Problem); () for none.
    sync: tuple[tuple[float, ...], ...] = ()

    @property
    def consumers(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """As :attr:`Fanout.consumers`: an edge is a fanout with one consumer."""
        return ((self.consumer, self.req),)


@dataclass(frozen=True, slots=True)
class Fanout:
    """One value read by several consumer decisions. ``cost[o][r]`` is paid once for every
    requirement class ``r`` that at least one consumer picks."""

    name: str
    multiplicity: int
    producer: int
    out: tuple[int, ...]                               # output class per producer strategy
    consumers: tuple[tuple[int, tuple[int, ...]], ...]  # (decision, requirement class per strategy)
    cost: tuple[tuple[float, ...], ...]                # as Edge.cost
    memory: tuple[tuple[float, ...], ...] = ()         # as Edge.memory, paid once per class
    sync: tuple[tuple[float, ...], ...] = ()           # as Edge.sync, paid once per class


@dataclass(frozen=True, slots=True)
class Cut:
    """At most ``most`` of the (decision, strategy) pairs ``terms`` are chosen."""

    terms: tuple[tuple[int, int], ...]
    most: int


@dataclass(frozen=True, slots=True)
class Problem:
    """The step time of an assignment is the sum of the chosen costs plus the overlap window's
    exposed part, ``max(0, sum of chosen sync - sum of chosen backward)`` (cost/overlap.py).
    ``host_budget``: the host memory one device's process may fill with offloaded state
    (``Cluster.host_memory_bytes``), bounding the decisions' ``host`` bytes; None: unbounded
    (nothing offered is offloaded)."""

    decisions: tuple[Decision, ...]
    edges: tuple[Edge, ...]
    memory_budget: float
    fixed: tuple[tuple[int, int], ...] = ()   # (decision, strategy) forced by the caller
    fanouts: tuple[Fanout, ...] = ()
    host_budget: float | None = None
    cuts: tuple[Cut, ...] = ()               # constraints the caller adds (see the docstring)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Problem":
        d = json.loads(text)
        def table(rows) -> tuple:
            return tuple(tuple(r) for r in rows)

        decisions = tuple(Decision(g["name"], g["multiplicity"], tuple(g["cost"]),
                                   tuple(g["memory"]), tuple(g.get("backward", ())),
                                   tuple(g.get("host", ())))
                          for g in d["decisions"])
        edges = tuple(Edge(e["name"], e["multiplicity"], e["producer"], e["consumer"],
                           tuple(e["out"]), tuple(e["req"]), table(e["cost"]),
                           table(e.get("memory", ())), table(e.get("sync", ())))
                      for e in d["edges"])
        fanouts = tuple(Fanout(f["name"], f["multiplicity"], f["producer"], tuple(f["out"]),
                               tuple((g, tuple(req)) for g, req in f["consumers"]),
                               table(f["cost"]), table(f.get("memory", ())),
                               table(f.get("sync", ())))
                        for f in d.get("fanouts", ()))
        cuts = tuple(Cut(tuple(tuple(t) for t in c["terms"]), c["most"])
                     for c in d.get("cuts", ()))
        return cls(decisions, edges, d["memory_budget"], tuple(tuple(f) for f in d["fixed"]),
                   fanouts, d.get("host_budget"), cuts)


@dataclass(frozen=True, slots=True)
class Start:
    """An incumbent a solve may start from: a full ``choice``, or (empty choice) the best plan
    of the problem with the cuts ``within`` added, a restriction whose plan is one of the
    obvious ones (parameter layouts held as a baseline writes them, a mesh axis replicated)."""

    label: str
    choice: tuple[int, ...] = ()
    within: tuple[Cut, ...] = ()
    # A start combined from the plans of other starts, solved only after them: ``parts[a]``
    # labels the start whose placements on mesh axis ``a`` this one takes, and ``keys[g][i][a]``
    # numbers the placements on axis ``a`` of every spec of decision ``g``'s strategy ``i``.
    # Each decision is held to the strategies whose key on every axis is that of its part's
    # choice; where none is (an op whose layouts on one axis constrain the other), to those
    # matching on the most axes (left free where none matches any), which :func:`combined`
    # writes as cuts. Left free, a decision makes the restriction a MIP again (Jamba's
    # Mamba and MoE layers on 8x8: 46 of 120 free, no plan in 30 s).
    parts: tuple[str, ...] = ()
    keys: tuple[tuple[tuple[int, ...], ...], ...] = ()


def combined(problem: Problem, start: Start, choices: dict[str, tuple[int, ...]]
             ) -> tuple[Cut, ...] | None:
    """The cuts of a combined ``start`` (above) given the choices its parts were solved to;
    None while a part has none."""
    if any(label not in choices for label in start.parts):
        return None
    allowed: dict[int, set[int]] = {}
    for g, keys in enumerate(start.keys):
        want = [keys[choices[label][g]][a] for a, label in enumerate(start.parts)]
        matches = [sum(k[a] == w for a, w in enumerate(want)) for k in keys]
        most = max(matches)
        keep = {i for i, m in enumerate(matches) if m == most}
        if most and len(keep) < len(keys):
            allowed[g] = keep
    return restricted(problem, allowed).cuts[len(problem.cuts):]


@dataclass(frozen=True, slots=True)
class Solution:
    choice: tuple[int, ...]      # strategy per decision
    status: str                  # OPTIMAL | FEASIBLE
    objective: float             # seconds
    bound: float
    variables: int
    seconds: float
    note: str = ""               # why a FEASIBLE plan is not the solver's own incumbent
    start: str = ""              # the label of the incumbent the solve started from, if any
    backend: str = ""            # the MIP backend whose plan this is ("" for a start's)

    @property
    def gap(self) -> float:
        return 0.0 if self.objective <= 0 else max(0.0, (self.objective - self.bound) / self.objective)


def price(item: Edge | Fanout, choice: tuple[int, ...] | list[int]) -> tuple[float, float, float]:
    """Blocking seconds, bytes per device and gradient-sync seconds an edge or fanout adds under
    a full assignment."""
    o = item.out[choice[item.producer]]
    used = {req[choice[g]] for g, req in item.consumers}
    n = item.multiplicity
    t = sum(item.cost[o][r] for r in used) * n
    mem = sum(item.memory[o][r] for r in used) * n if item.memory else 0.0
    sync = sum(item.sync[o][r] for r in used) * n if item.sync else 0.0
    return t, mem, sync


def totals(problem: Problem, choice: tuple[int, ...] | list[int]
           ) -> tuple[float, float, float, float]:
    """The sums a step is made of under a full assignment: blocking seconds (costs), memory
    bytes, bucketed gradient-sync seconds and backward compute seconds."""
    t = sum(g.cost[c] * g.multiplicity for g, c in zip(problem.decisions, choice))
    mem = sum(g.memory[c] * g.multiplicity for g, c in zip(problem.decisions, choice))
    backward = sum(g.backward[c] * g.multiplicity for g, c in zip(problem.decisions, choice)
                   if g.backward)
    sync = 0.0
    for item in (*problem.edges, *problem.fanouts):
        dt, dm, ds = price(item, choice)
        t, mem, sync = t + dt, mem + dm, sync + ds
    return t, mem, sync, backward


def host_bytes(problem: Problem, choice: tuple[int, ...] | list[int]) -> float:
    """Host memory bytes of a full assignment (offloaded state)."""
    return sum(g.host[c] * g.multiplicity for g, c in zip(problem.decisions, choice) if g.host)


def evaluate(problem: Problem, choice: tuple[int, ...]) -> tuple[float, float]:
    """Step time (s) and memory (bytes) of a full assignment, outside the ILP (for tests and
    for pricing hand-written plans in exactly the solver's terms)."""
    t, mem, sync, backward = totals(problem, choice)
    return t + max(0.0, sync - backward), mem


def admits(problem: Problem, choice: tuple[int, ...] | list[int]) -> bool:
    """Whether ``choice`` keeps the caller's pins and cuts and holds no forbidden reshard
    (memory is :func:`evaluate`'s)."""
    chosen = set(enumerate(choice))
    return all(p in chosen for p in problem.fixed) and all(
        sum(1 for t in c.terms if t in chosen) <= c.most for c in problem.cuts) and all(
        item.cost[item.out[choice[item.producer]]][req[choice[g]]] != FORBIDDEN
        for item in (*problem.edges, *problem.fanouts) for g, req in item.consumers)


def fits(problem: Problem, choice: tuple[int, ...] | list[int]) -> bool:
    """Whether ``choice`` is a plan of ``problem``: its pins and cuts kept, within the memory
    budget and the host budget."""
    return admits(problem, choice) and evaluate(problem, choice)[1] <= problem.memory_budget \
        and (problem.host_budget is None or host_bytes(problem, choice) <= problem.host_budget)


def restricted(problem: Problem, allowed: dict[int, tuple[int, ...] | set[int]]) -> Problem:
    """``problem`` with decision ``g`` held to the strategies ``allowed[g]``: one cut of the
    others (which the solver's presolve removes), so a choice keeps its indices. ``fixed`` pins
    one strategy; this holds a set, which is what holding one node to one strategy takes when
    it follows its decision (several of the decision's strategies give it that one)."""
    cuts = []
    for g, keep in allowed.items():
        n = len(problem.decisions[g].cost)
        if not keep or not all(0 <= i < n for i in keep):
            raise ValueError(f"decision {g}: allowed strategies {sorted(keep)} are not a "
                             f"non-empty set of indices of its {n} strategies")
        out = tuple((g, i) for i in range(n) if i not in keep)
        if out:
            cuts.append(Cut(out, 0))
    return replace(problem, cuts=(*problem.cuts, *cuts))


def excluded(problem: Problem) -> dict[int, set[int]]:
    """The strategies each decision may not take under the ``most=0`` cuts (restrictions)."""
    out: dict[int, set[int]] = {}
    for c in problem.cuts:
        if c.most == 0:
            for g, i in c.terms:
                out.setdefault(g, set()).add(i)
    return out


@dataclass(frozen=True, slots=True)
class Projection:
    """A problem with each decision's excluded strategies removed (:func:`projected`), and the
    kept strategies of each decision, to map its choices back."""

    problem: Problem
    kept: tuple[tuple[int, ...], ...]

    def lift(self, choice: tuple[int, ...]) -> tuple[int, ...]:
        """A choice of the projected problem as a choice of the original."""
        return tuple(k[c] for k, c in zip(self.kept, choice))


def projected(problem: Problem) -> Projection | None:
    """``problem`` without the strategies its restrictions (``most=0`` cuts) exclude, and
    without the edge and fanout classes no kept strategy uses: the same plans at the same
    prices, in a MIP the size of what is left (a start that holds every decision to a few
    strategies is built and solved in a fraction of the whole problem's time). None where a
    pin is excluded or a decision has nothing left (no plan)."""
    out = excluded(problem)
    kept = tuple(tuple(i for i in range(len(d.cost)) if i not in out.get(g, ()))
                 for g, d in enumerate(problem.decisions))
    if not all(kept) or any(i in out.get(g, ()) for g, i in problem.fixed):
        return None
    index = [{i: k for k, i in enumerate(ks)} for ks in kept]

    def pick(row: tuple, g: int) -> tuple:
        return tuple(row[i] for i in kept[g]) if row else row

    decisions = tuple(replace(d, cost=pick(d.cost, g), memory=pick(d.memory, g),
                              backward=pick(d.backward, g), host=pick(d.host, g))
                      for g, d in enumerate(problem.decisions))
    edges = []
    for e in problem.edges:
        out_cls, req_cls = _classes(pick(e.out, e.producer)), _classes(pick(e.req, e.consumer))
        edges.append(replace(e, out=tuple(out_cls[o] for o in pick(e.out, e.producer)),
                             req=tuple(req_cls[r] for r in pick(e.req, e.consumer)),
                             **_tables(e, out_cls, req_cls)))
    fanouts = []
    for f in problem.fanouts:
        out_cls = _classes(pick(f.out, f.producer))
        req_cls = _classes(tuple(r for g, req in f.consumers for r in pick(req, g)))
        fanouts.append(replace(f, out=tuple(out_cls[o] for o in pick(f.out, f.producer)),
                               consumers=tuple((g, tuple(req_cls[r] for r in pick(req, g)))
                                               for g, req in f.consumers),
                               **_tables(f, out_cls, req_cls)))
    cuts = tuple(Cut(tuple((g, index[g][i]) for g, i in c.terms if i in index[g]), c.most)
                 for c in problem.cuts if c.most > 0)
    fixed = tuple((g, index[g][i]) for g, i in problem.fixed)
    return Projection(replace(problem, decisions=decisions, edges=tuple(edges),
                              fanouts=tuple(fanouts), cuts=cuts, fixed=fixed), kept)


def _classes(used: tuple[int, ...]) -> dict[int, int]:
    """The classes in use, renumbered in order."""
    return {c: k for k, c in enumerate(sorted(set(used)))}


def _tables(item: Edge | Fanout, out_cls: dict[int, int], req_cls: dict[int, int]) -> dict:
    """An item's [out class][requirement class] tables over the classes kept."""
    def cut(table: tuple) -> tuple:
        return tuple(tuple(table[o][r] for r in req_cls) for o in out_cls) if table else table
    return {"cost": cut(item.cost), "memory": cut(item.memory), "sync": cut(item.sync)}
