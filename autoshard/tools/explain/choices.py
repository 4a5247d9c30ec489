"""What the other choices of a node or parameter would cost: the plan's ILP built again, solved
with the node held to its chosen strategy (the baseline) and to each of the next-best ones."""
from __future__ import annotations

import difflib
import time
from dataclasses import dataclass, field, replace
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir import Strategy, spec_str
from autoshard.plans import Plan
from autoshard.plans.records import NodePlan
from autoshard.plans.summary import size_text
from autoshard.trace.export import TracedGraph
from autoshard.tools.explain.rebuild import Rebuilt, Source, check_resolvable, node_source

DEFAULT_ALTERNATIVES = 3
DEFAULT_TIME_LIMIT_S = 3.0      # per re-solve: llama3-8b on 8x8 solves in ~1 s when it can


@dataclass(frozen=True)
class Resolved:
    """One re-solve: the node held to ``strategy``. ``plan`` is None when no plan exists with
    it (``status`` says why: the memory budget, or the time limit)."""

    strategy: str
    plan: Plan | None
    status: str
    choice: tuple[int, ...] | None = None
    # The solver's lower bound on the step with this strategy: below the plan's step when the
    # time limit stopped it (FEASIBLE), so the true optimum lies between the two.
    bound_s: float | None = None
    alone_step_s: float | None = None        # the swap alone, the rest as the baseline has it
    alone_memory_bytes: float | None = None

    @property
    def step_time_s(self) -> float | None:
        return None if self.plan is None else self.plan.predicted.step_time_s

    @property
    def memory_bytes(self) -> float | None:
        return None if self.plan is None else self.plan.predicted.ilp_sum_bytes

    @property
    def live_peak_bytes(self) -> float | None:
        return None if self.plan is None else self.plan.predicted.memory.peak


@dataclass(frozen=True)
class Row:
    """An alternative with its deltas against the baseline (re-solved plan minus baseline)."""

    resolved: Resolved
    step_delta_s: float | None
    memory_delta_bytes: float | None
    live_peak_delta_bytes: float | None
    moved: int | None                 # other decisions the re-solve changed
    params_moved: int | None          # parameters whose layout it changed
    # The least the step delta can be: the solver's bound minus the baseline's step (equal to
    # step_delta_s when the re-solve is optimal).
    step_delta_bound_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        r = self.resolved
        return {"strategy": r.strategy, "status": r.status, "step_time_s": r.step_time_s,
                "ilp_memory_bytes": r.memory_bytes, "live_peak_bytes": r.live_peak_bytes,
                "step_delta_s": self.step_delta_s, "step_delta_bound_s": self.step_delta_bound_s,
                "memory_delta_bytes": self.memory_delta_bytes,
                "live_peak_delta_bytes": self.live_peak_delta_bytes,
                "alone_step_s": r.alone_step_s, "alone_memory_bytes": r.alone_memory_bytes,
                "other_decisions_moved": self.moved, "params_moved": self.params_moved}


@dataclass(frozen=True)
class Explanation:
    """What ``explain --node`` / ``--param`` prints: the node, where it comes from, its chosen
    strategy, the baseline re-solve and the alternatives."""

    node: str
    op: str
    param: str                       # the parameter's FQN ("" for any other node)
    module: str
    layer: str
    shared_layers: tuple[str, ...]   # the identical layers whose nodes share its decision
    template: str                    # the node of the first identical layer it copies (or itself)
    decision_nodes: tuple[str, ...]  # every node of the template's decision (its followers too)
    source: Source | None
    source_node: str                 # whose line ``source`` is: the node, or a graph input's reader
    chosen: str
    strategies: int                  # distinct strategies the node has
    file_step_s: float
    file_memory_bytes: float
    baseline: Resolved
    rows: tuple[Row, ...]
    time_limit_s: float
    seconds: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        b = self.baseline
        return {"node": self.node, "op": self.op, "param": self.param, "module": self.module,
                "layer": self.layer, "shared_layers": list(self.shared_layers),
                "template": self.template, "decision_nodes": list(self.decision_nodes),
                "source": self.source.to_json() if self.source else None,
                "source_node": self.source_node, "chosen": self.chosen,
                "strategies": self.strategies,
                "plan_file": {"step_time_s": self.file_step_s,
                              "ilp_memory_bytes": self.file_memory_bytes},
                "baseline": {"strategy": b.strategy, "status": b.status,
                             "step_time_s": b.step_time_s, "ilp_memory_bytes": b.memory_bytes,
                             "live_peak_bytes": b.live_peak_bytes},
                "alternatives": [r.to_json() for r in self.rows],
                "time_limit_s": self.time_limit_s, "seconds": self.seconds,
                "notes": list(self.notes)}


def _key(s: Strategy | NodePlan) -> tuple:
    """A strategy as the plan file records it (the work fraction is derived, not stored)."""
    return (tuple(s.inputs), tuple(s.outputs), s.kernel, s.state_axes)


def strategy_text(s: Strategy | NodePlan, *, placeholder: bool) -> str:
    """A strategy in one line; a graph input's as the layout it is stored in (and the
    parameter's state mode: zero1, zero2, offload or offload_params, and the mesh axes it
    shards the state over where those are some of the replicated ones only)."""
    if placeholder:
        over = f" over axes {list(s.state_axes)}" if s.state_axes is not None else ""
        return ", ".join(spec_str(x) for x in s.outputs) + (f" {s.kernel}{over}" if s.kernel
                                                             else "")
    ins = " x ".join(spec_str(x) for x in s.inputs)
    outs = ", ".join(spec_str(x) for x in s.outputs)
    return f"{ins} -> {outs}" + (f" ({s.kernel})" if s.kernel else "")


class _Problem:
    """The ILP the plan was solved on, built again, and re-solves of it with one decision's
    strategies restricted (a cut of the problem, solved through the planner's one entry)."""

    def __init__(self, plan: Plan, rebuilt: Rebuilt, time_limit_s: float) -> None:
        from autoshard.solver.build import build_problem
        from autoshard.trace.layers import regroup

        check_resolvable(plan)
        self.plan, self.mesh, self.options = plan, rebuilt.mesh, rebuilt.options
        self.time_limit_s = time_limit_s
        self.recompute = dict(plan.recompute)
        traced = rebuilt.traced
        layers = regroup(traced.layers, self.recompute)    # as the planner groups them
        self.traced = traced if layers == traced.layers else replace(traced, layers=layers)
        from autoshard.solver.solve import offload_level
        offload = offload_level(plan)       # the state modes the plan was solved with
        t0 = time.perf_counter()
        self.built = build_problem(self.traced, self.mesh, self.options,
                                   recompute=self.recompute, offload=offload)
        self.build_s = time.perf_counter() - t0

    def solve(self, g: int, allowed: tuple[int, ...], strategy: str,
              start: tuple[int, ...] | None = None, start_is: str = "") -> Resolved:
        """The plan with decision ``g`` held to the strategies ``allowed``, solved and assembled
        as the planner solves and assembles every plan (``ilp.solve``, ``solve.solved_plan``):
        the same ILP, tie-break and pricing. ``start``: a full choice known to obey the pin
        (``start_is`` says which), which the solve is never worse than."""
        from autoshard.solver.ilp import Infeasible, NoSolution, solve
        from autoshard.solver.solve import solved_plan
        from autoshard.solver.problem import Start, fits, restricted

        p = restricted(self.built.problem, {g: allowed})
        if start is not None and not fits(p, start):
            start = None              # not a plan: only the solver can tell what fits
        try:
            sol = solve(p, time_limit_s=self.time_limit_s, verdict=start is None,
                        starts=(Start(start_is, start),) if start is not None else ())
        except Infeasible as e:
            least = f"{'' if e.exact else 'at least '}{size_text(e.least_memory)}"
            return Resolved(strategy, None, f"no plan fits the memory budget of "
                                            f"{size_text(e.budget)} (the least memory with it is "
                                            f"{least})")
        except NoSolution:
            return Resolved(strategy, None, f"no plan found within {self.time_limit_s:g} s")
        status = sol.status + (f", gap {sol.gap:.2%}" if sol.gap > 0 else "") + (
            f"; {sol.note}" if sol.note else "")
        plan, choice = solved_plan(self.traced, self.mesh, self.options, self.built, p, sol,
                                   model_name=self.plan.model, timings={},
                                   recompute=self.recompute)
        step = plan.predicted.step_time_s
        return Resolved(strategy, plan, status, choice,
                        step if sol.status == "OPTIMAL" else min(sol.bound, step))


def explain_node(plan: Plan, name: str, *, rebuilt: Rebuilt,
                 alternatives: int = DEFAULT_ALTERNATIVES,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> Explanation:
    """Node ``name`` of ``plan`` (a graph node, as ``autoshard show --nodes`` lists them): its
    strategy, the baseline re-solve with it pinned, and up to ``alternatives`` next-best
    strategies, each re-solved with it pinned (see the module docstring)."""
    check_count(alternatives, time_limit_s)
    node = node_of(plan, name)
    t0 = time.perf_counter()
    problem = _Problem(plan, rebuilt, time_limit_s)
    member = problem.built.members[problem.built.template[name]]
    g = member.decision
    is_ph = node.op == "placeholder"
    # The node's distinct strategies, each with the decision's strategies that give it.
    groups: dict[tuple, tuple[int, ...]] = {}
    texts: dict[tuple, str] = {}
    for i, j in enumerate(member.index):
        k = _key(member.strategies[j])
        groups[k] = groups.get(k, ()) + (i,)
        texts.setdefault(k, strategy_text(member.strategies[j], placeholder=is_ph))
    chosen, notes = _key(node), []
    t1 = time.perf_counter()
    if chosen not in groups:   # the unpinned re-solve is the baseline, and says so
        notes.append("the plan's strategy for this node is not among those the rebuilt problem "
                     "offers it; the baseline is the re-solve with nothing pinned")
        texts[chosen], groups[chosen] = strategy_text(node, placeholder=is_ph), tuple(
            range(len(member.index)))
    start = _plan_choice(plan, problem.built)
    baseline = problem.solve(g, groups[chosen], texts[chosen],
                             start if start and start[g] in groups[chosen] else None,
                             "the plan file's own choice")
    seconds = {"rebuild_s": rebuilt.seconds, "build_s": problem.build_s,
               "baseline_s": time.perf_counter() - t1}
    if baseline.plan is None:
        raise AutoshardError("a plan for the baseline: the plan's model re-solved with this "
                             "node's chosen strategy pinned", got=baseline.status,
                             fix="raise --time-limit (seconds per re-solve)")
    t1 = time.perf_counter()
    rows = tuple(_row(replace(problem.solve(g, groups[k], texts[k], start,
                                            "the strategy swapped in alone"),
                              alone_step_s=step, alone_memory_bytes=mem), baseline, g)
                 for k, step, mem, start in _next_best(problem, g, groups, chosen, baseline,
                                                       alternatives, texts))
    # Shown by the re-solved step: the swap alone only chose which to re-solve.
    rows = tuple(sorted(rows, key=lambda r: (r.step_delta_s is None, r.step_delta_s or 0.0)))
    seconds["alternatives_s"] = time.perf_counter() - t1
    seconds["explain_s"] = time.perf_counter() - t0
    traced = problem.traced
    layer = traced.layer_of_node.get(name, "")
    same = next((x.same_as for x in traced.layers if x.name == layer), None)
    ph = traced.placeholder(name) if is_ph else None
    source_node = _source_node(traced, name)
    return Explanation(
        node=name, op=node.op, param=ph.fqn if ph is not None and ph.kind == "param" else "",
        module=_module(traced, name), layer=layer,
        shared_layers=tuple(x.name for x in traced.layers if same and x.same_as == same),
        template=problem.built.template[name],
        decision_nodes=tuple(n for n, m in problem.built.members.items() if m.decision == g),
        source=node_source(source_node), source_node=getattr(source_node, "name", ""),
        chosen=texts[chosen] if chosen in texts else strategy_text(node, placeholder=is_ph),
        strategies=len(groups) - (1 if notes else 0), file_step_s=plan.predicted.step_time_s,
        file_memory_bytes=plan.predicted.ilp_sum_bytes, baseline=baseline, rows=rows,
        time_limit_s=time_limit_s, seconds=seconds, notes=tuple(notes))


def _plan_choice(plan: Plan, built: Any) -> tuple[int, ...] | None:
    """The plan file's own choice in the rebuilt problem (each decision's strategy that gives
    its first node the plan's strategy), or None where the plan's is not on offer."""
    nodes = {n.name: _key(n) for n in plan.nodes}
    choice = []
    for d in built.problem.decisions:
        if d.name not in nodes:           # the graph's output: one strategy
            choice.append(0)
            continue
        m = built.members[d.name]
        i = next((i for i, j in enumerate(m.index) if _key(m.strategies[j]) == nodes[d.name]),
                 None)
        if i is None:
            return None
        choice.append(i)
    return tuple(choice)


def _next_best(problem: "_Problem", g: int, groups: dict[tuple, tuple[int, ...]],
               chosen: tuple, baseline: Resolved, count: int, texts: dict[tuple, str]
               ) -> list[tuple[tuple, float, float, tuple[int, ...]]]:
    """Up to ``count`` strategies of the node other than ``chosen``, as (key, step, memory,
    choice) of their swap alone into the baseline (its other decisions kept): the cheapest
    first, those within the memory budget before those above it. A strategy's swap is its
    decision's best strategy giving it."""
    from autoshard.solver.problem import evaluate

    p = problem.built.problem
    base = list(baseline.choice)
    out = []
    for k, idx in groups.items():
        if k == chosen:
            continue
        best = None
        for i in idx:
            base[g] = i
            step, mem = evaluate(p, tuple(base))
            if best is None or (mem > p.memory_budget, step) < (best[1] > p.memory_budget,
                                                                 best[0]):
                best = (step, mem, tuple(base))
        out.append((k, *best))
    out.sort(key=lambda r: (r[2] > p.memory_budget, r[1], texts[r[0]]))
    return out[:count]


def _source_node(traced: TracedGraph, name: str) -> Any:
    """The FX node whose source line tells where ``name`` comes from: itself, or for a graph
    input (a parameter has no line of its own) the first op that reads it."""
    node = next((n for n in traced.graph.nodes if n.name == name), None)
    if node is not None and node.op == "placeholder":
        return next((u for u in node.users if u.op == "call_function"), None)
    return node


def explain_param(plan: Plan, fqn: str, *, rebuilt: Rebuilt, **kw: Any) -> Explanation:
    """``explain_node`` of the graph input parameter ``fqn`` is lifted as (its first, for a
    tied weight)."""
    check_param(plan, fqn)
    name = next((p.name for p in rebuilt.traced.params if p.fqn == fqn), None)
    if name is None:
        raise AutoshardError(f"the plan's parameter {fqn} among the re-traced model's",
                             got="no graph input of that name",
                             fix="pass --model naming the model the plan was made from")
    return explain_node(plan, name, rebuilt=rebuilt, **kw)


def _row(r: Resolved, baseline: Resolved, g: int) -> Row:
    """``r`` with its deltas against ``baseline`` (re-solved plan minus baseline), and how
    many other decisions and parameter layouts its re-solve moved."""
    if r.plan is None:
        return Row(r, None, None, None, None, None)
    moved = sum(1 for d, (a, b) in enumerate(zip(r.choice, baseline.choice)) if a != b and d != g)
    params = sum(1 for k, v in r.plan.params.items() if baseline.plan.params.get(k) != v)
    return Row(r, r.step_time_s - baseline.step_time_s, r.memory_bytes - baseline.memory_bytes,
               r.live_peak_bytes - baseline.live_peak_bytes, moved, params,
               r.bound_s - baseline.step_time_s)


def _module(traced: TracedGraph, name: str) -> str:
    """The module path of node ``name``, or of the module owning a parameter."""
    node = next((n for n in traced.graph.nodes if n.name == name), None)
    if node is None:
        return ""
    if node.op == "placeholder":
        fqn = traced.placeholder(name).fqn
        return fqn.rpartition(".")[0] if "." in fqn else ""
    return traced.module_of(node)


def check_count(alternatives: int, time_limit_s: float) -> None:
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise AutoshardError("a number of alternatives >= 0", got=repr(alternatives),
                             fix="e.g. --alternatives 3")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
            0 < time_limit_s < float("inf")):
        raise AutoshardError("a positive time limit per re-solve, in seconds",
                             got=repr(time_limit_s), fix="e.g. --time-limit 3")


def node_of(plan: Plan, name: str) -> NodePlan:
    """The plan's entry for node ``name``; an unknown name names the closest ones."""
    node = next((n for n in plan.nodes if n.name == name), None)
    if node is None:
        raise _unknown("a node of the plan (as `autoshard show --nodes` lists them)", name,
                       [n.name for n in plan.nodes], "--node", other=(plan.params, "--param"))
    return node


def check_param(plan: Plan, fqn: str) -> None:
    if fqn not in plan.params:
        raise _unknown("a parameter of the plan (a named_parameters() name)", fqn,
                       list(plan.params), "--param",
                       other=({n.name for n in plan.nodes}, "--node"))


def _unknown(expected: str, name: str, known: list[str], flag: str, *,
             other: tuple[Any, str]) -> AutoshardError:
    """A name not in the plan: the closest names, or the other flag if it names that kind."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if name in other[0]:
        fix = f"use {other[1]} {name}"
    elif close:
        fix = f"did you mean {', '.join(close)}?"
    else:
        fix = ("list them with `autoshard show PLAN --nodes`" if flag == "--node" else
               "list them with `autoshard show PLAN` (parameter layouts)")
    return AutoshardError(expected, got=f"{flag} {name!r}, not in the plan", fix=fix)

