"""Why a plan places a node or a parameter as it does, and where its communication goes.

``autoshard explain plan.json --node NAME`` (or ``--param FQN``) answers "what would the other
choices cost?" with real re-solves, not local estimates: the model is traced again from the name
and input shapes the plan records (its fingerprint must match), the ILP the plan was solved on is
built again (the same options, checkpointed layers and offload), and it is solved once with the
node held to its chosen strategy -- the *baseline* -- and once with the node held to each of the
``k`` next-best strategies. A row's deltas are that re-solved plan's predicted figures minus the
baseline's, both assembled by the planner's own ``assemble``, so they are the same prices as any
plan's. The baseline is a re-solve too, not the plan file: with a nonzero solver gap (a time
limit), or a plan the planner adjusted after its solve (re-planned for the step's liveness
peak, or checkpointing priced per layer), the file's step may differ from it; both are shown.

The next-best strategies are those whose swap *alone* (every other decision as the baseline has
it, priced by ``evaluate`` on the same ILP) is cheapest, those that fit the memory budget first:
a short list of plausible choices, which the re-solves then price with the rest of the plan free
to adapt. A node held to a strategy holds its whole decision: the follower ops merged into it
and every identical layer sharing it (trace/layers.py), as the planner decides them together.

``--top N`` lists the most expensive collectives of the plan's ledger, each repeated collective
of identical layers folded into one row, with the node that needs it, its layer and the model
source line that produced that node (from the re-trace; torch.export keeps the stack in
``node.meta``). Plan files do not store source lines: they name files on the planning machine.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from autoshard.errors import AutoshardError
from autoshard.ir import Strategy, spec_str
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.plans.records import NodePlan
from autoshard.trace.export import TracedGraph

DEFAULT_ALTERNATIVES = 3
DEFAULT_TIME_LIMIT_S = 3.0      # per re-solve: llama3-8b on 8x8 solves in ~1 s when it can


# ------------------------------------------------------------------------------ the model again

@dataclass(frozen=True)
class Rebuilt:
    """The plan's model traced again as it was planned (precision, one microbatch on a
    pipeline), its fingerprint equal to the plan's, and the plan's mesh and options."""

    traced: TracedGraph
    mesh: Mesh
    options: PlanOptions
    seconds: float


def rebuild(plan: Plan, *, model: str | None = None, cluster: str | None = None,
            task: str | None = None) -> Rebuilt:
    """Trace the plan's model again: ``model`` (default the plan's ``model`` field: a zoo name,
    ``path/to/file.py:factory`` or a Hugging Face config) at the batch and sequence length of the
    plan's inputs; ``cluster``: the profile a plan made with one was priced on."""
    from autoshard.solver.planner import trace_for
    from autoshard.zoo.registry import load_model

    t0 = time.perf_counter()
    mesh = plan_mesh(plan, cluster)
    name = model or plan.model
    if not name:
        raise AutoshardError("a plan that names its model (its `model` field) to trace it again",
                             got="a plan without a model name (made in Python without "
                                 "model_name)",
                             fix="pass --model with the zoo name, path/to/file.py:factory or "
                                 "config.json the plan was made from")
    batch, seq = _sizes(plan, name)
    options = _settled(plan)
    try:
        built, inputs = load_model(name, batch=batch, seq=seq, device="meta", task=task)
        traced = trace_for(built, inputs, options)
    except AutoshardError as e:
        raise AutoshardError(f"the plan's model {name!r} rebuilt and traced again: {e.expected}",
                             got=e.got, fix=f"{e.fix}; or pass --model (and --task) as the "
                                            f"plan was made") from e
    sizes = "".join(f", {k} {v}" for k, v in (("batch", batch), ("seq", seq)) if v)
    try:
        plan.check_matches(traced.fingerprint, traced.node_sigs, what=f"model ({name}{sizes})")
    except AutoshardError as e:
        raise AutoshardError(e.expected, got=e.got,
                             fix="pass --model (and --task) naming the model the plan was made "
                                 "from, or re-plan it") from e
    return Rebuilt(traced, mesh, options, time.perf_counter() - t0)


def plan_mesh(plan: Plan, cluster: str | None = None) -> Mesh:
    """The plan's mesh on the cluster figures it records (``cluster``: the profile JSON of a
    file written before plans recorded them, Plan.priced_on)."""
    return plan.mesh(cluster)


def _sizes(plan: Plan, name: str) -> tuple[int | None, int | None]:
    """(batch, seq) of the plan's model inputs, as load_model takes them (None, None for a
    factory, which builds its own inputs)."""
    from autoshard.zoo import hf
    from autoshard.zoo.registry import ZOO

    if ":" in name and name.split(":", 1)[0].endswith(".py"):
        return None, None
    meta = plan.input_meta.get("input0")
    if meta is None:
        raise AutoshardError("a plan that records its inputs' shapes, to trace the model again",
                             got="no shape for input0",
                             fix="re-plan with this version of autoshard")
    shape = meta[0]
    batch = shape[0] * (plan.pipeline.microbatches if plan.pipeline else 1)
    if name in ZOO:
        return batch, (shape[1] if ZOO[name].seq is not None and len(shape) > 1 else None)
    if hf.is_config_path(name):          # token ids (batch, seq); images have no seq
        return batch, (shape[1] if len(shape) == 2 else None)
    return batch, None


def _settled(plan: Plan) -> PlanOptions:
    """The plan's options with its pipeline as found ("auto" settled to the plan's axis, or to
    none), so that the graph is traced as the plan's was: one microbatch on a pipeline."""
    return plan.settled_options()


# ------------------------------------------------------------------------------- source lines

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


@dataclass(frozen=True)
class Source:
    """Where the model's code made a node: the innermost frame of its stack outside torch and
    autoshard's loss wrapper (``nn.Linear.forward`` is torch's; the line calling it is the
    model's)."""

    file: str
    line: int
    function: str
    code: str
    # The model's line that called this one (``self.c_attn(x)`` for the addmm inside
    # transformers' Conv1D), None at the top of the model.
    caller: "Source | None" = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}: {self.code}"

    def to_json(self) -> dict[str, Any]:
        return {"file": self.file, "line": self.line, "function": self.function,
                "code": self.code, "caller": self.caller.to_json() if self.caller else None}


def node_source(node: Any) -> Source | None:
    """The model source line of FX node ``node`` (None: a graph input, or no stack kept)."""
    if node is None:
        return None
    frames = []
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i, text in enumerate(lines):
        m = _FRAME.search(text)
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not _FRAME.search(
                lines[i + 1]) else ""
            frames.append((m.group("file"), int(m.group("line")), m.group("func"), code))
    if not frames:
        return None
    own = [f for f in frames if not _library_frame(f[0])] or frames
    caller = None
    if len(own) > 1:
        file, line, func, code = own[-2]
        caller = Source(_short_path(file), line, func, code)
    file, line, func, code = own[-1]
    return Source(_short_path(file), line, func, code, caller)


def _library_frame(file: str) -> bool:
    """A frame of torch's own code, or of the loss wrapper autoshard puts around the model."""
    import torch
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
    return os.path.abspath(file).startswith(torch_dir) or file.endswith(
        os.path.join("autoshard", "loss.py"))


def _short_path(file: str) -> str:
    """``file`` relative to the import root (or working directory) holding it: the module path
    a reader finds it under, the same on every machine."""
    path = os.path.abspath(file)
    roots = [os.path.abspath(p) for p in (*sys.path, os.getcwd()) if p]
    inside = [r for r in roots if path.startswith(r.rstrip(os.sep) + os.sep)]
    return os.path.relpath(path, max(inside, key=len)) if inside else path


# ------------------------------------------------------------------------------- node re-solves

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
        return None if self.plan is None else self.plan.predicted["step_time_s"]

    @property
    def memory_bytes(self) -> float | None:
        return None if self.plan is None else self.plan.predicted["ilp_memory_bytes"]

    @property
    def live_peak_bytes(self) -> float | None:
        return None if self.plan is None else self.plan.predicted["memory"]["peak"]


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
    return (tuple(s.inputs), tuple(s.outputs), s.kernel)


def strategy_text(s: Strategy | NodePlan, *, placeholder: bool) -> str:
    """A strategy in one line; a graph input's as the layout it is stored in (and the
    parameter's state mode: zero1, zero2, offload or offload_params)."""
    if placeholder:
        return ", ".join(spec_str(x) for x in s.outputs) + (f" {s.kernel}" if s.kernel else "")
    ins = " x ".join(spec_str(x) for x in s.inputs)
    outs = ", ".join(spec_str(x) for x in s.outputs)
    return f"{ins} -> {outs}" + (f" ({s.kernel})" if s.kernel else "")


class _Problem:
    """The ILP the plan was solved on, built again, and re-solves of it with one decision's
    strategies restricted (a cut of the problem, solved through the planner's one entry)."""

    def __init__(self, plan: Plan, rebuilt: Rebuilt, time_limit_s: float) -> None:
        from autoshard.solver.build import build_problem
        from autoshard.trace.layers import regroup

        _check_resolvable(plan)
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
            least = f"{'' if e.exact else 'at least '}{_size(e.least_memory)}"
            return Resolved(strategy, None, f"no plan fits the memory budget of "
                                            f"{_size(e.budget)} (the least memory with it is "
                                            f"{least})")
        except NoSolution:
            return Resolved(strategy, None, f"no plan found within {self.time_limit_s:g} s")
        status = sol.status + (f", gap {sol.gap:.2%}" if sol.gap > 0 else "") + (
            f"; {sol.note}" if sol.note else "")
        plan, choice = solved_plan(self.traced, self.mesh, self.options, self.built, p, sol,
                                   model_name=self.plan.model, timings={},
                                   recompute=self.recompute)
        step = plan.predicted["step_time_s"]
        return Resolved(strategy, plan, status, choice,
                        step if sol.status == "OPTIMAL" else min(sol.bound, step))


def _check_resolvable(plan: Plan) -> None:
    if plan.pipeline is not None:
        raise AutoshardError("a plan without a pipeline to re-solve with a node pinned",
                             got=f"a plan pipelined over {plan.pipeline.axis!r} (its stages' "
                                 f"cuts are a search of their own)",
                             fix="use --top on this plan, or explain a plan made without "
                                 "--pipeline")
    if len(plan.mesh_shape) > 2:
        raise AutoshardError("a plan on a 1-D or 2-D mesh to re-solve with a node pinned",
                             got=f"mesh {'x'.join(map(str, plan.mesh_shape))} (a 3-axis plan is "
                                 f"the best of several 2-axis merges)",
                             fix="use --top on this plan, or explain a plan of the same model "
                                 "on a 2-axis mesh")


def explain_node(plan: Plan, name: str, *, rebuilt: Rebuilt,
                 alternatives: int = DEFAULT_ALTERNATIVES,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S) -> Explanation:
    """Node ``name`` of ``plan`` (a graph node, as ``autoshard show --nodes`` lists them): its
    strategy, the baseline re-solve with it pinned, and up to ``alternatives`` next-best
    strategies, each re-solved with it pinned (see the module docstring)."""
    _check_count(alternatives, time_limit_s)
    node = _node_of(plan, name)
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
        strategies=len(groups) - (1 if notes else 0), file_step_s=plan.predicted["step_time_s"],
        file_memory_bytes=plan.predicted["ilp_memory_bytes"], baseline=baseline, rows=rows,
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
    _check_param(plan, fqn)
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


def _check_count(alternatives: int, time_limit_s: float) -> None:
    if isinstance(alternatives, bool) or not isinstance(alternatives, int) or alternatives < 0:
        raise AutoshardError("a number of alternatives >= 0", got=repr(alternatives),
                             fix="e.g. --alternatives 3")
    if isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float)) or not (
            0 < time_limit_s < float("inf")):
        raise AutoshardError("a positive time limit per re-solve, in seconds",
                             got=repr(time_limit_s), fix="e.g. --time-limit 3")


def _check_top(n: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AutoshardError("a number of collectives >= 1", got=repr(n), fix="e.g. --top 10")


def _node_of(plan: Plan, name: str) -> NodePlan:
    """The plan's entry for node ``name``; an unknown name names the closest ones."""
    node = next((n for n in plan.nodes if n.name == name), None)
    if node is None:
        raise _unknown("a node of the plan (as `autoshard show --nodes` lists them)", name,
                       [n.name for n in plan.nodes], "--node", other=(plan.params, "--param"))
    return node


def _check_param(plan: Plan, fqn: str) -> None:
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


# ------------------------------------------------------------------------------- collectives

@dataclass(frozen=True)
class TopCollective:
    """One collective of the ledger, or the same collective of identical layers folded: its
    seconds each (alpha-beta on the plan's mesh, times its ``count`` per step on a pipeline) and
    in total over ``instances``."""

    kind: str
    axes: tuple[str, ...]
    phase: str
    bytes: int
    seconds_each: float
    instances: int
    node: str              # the node that needs it (the first layer's, when folded)
    op: str
    value: str             # the node whose output moves
    layers: str            # "layers 0-31", or "" outside the repeated layers
    members: tuple[str, ...] = ()     # a gradient bucket's parameters
    source: Source | None = None
    stage: int = -1                   # on a pipeline, the stage whose ranks run it (-1: all)
    module: str = ""                  # the node's module path (from the re-trace)

    @property
    def seconds(self) -> float:
        return self.seconds_each * self.instances

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "axes": list(self.axes), "phase": self.phase,
                "bytes": self.bytes, "seconds_each": self.seconds_each,
                "instances": self.instances, "seconds": self.seconds, "node": self.node,
                "op": self.op, "value": self.value, "layers": self.layers,
                "members": list(self.members), "stage": self.stage, "module": self.module,
                "source": self.source.to_json() if self.source else None}


def top_collectives(plan: Plan, n: int, *, rebuilt: Rebuilt | None = None,
                    cluster: str | None = None) -> list[TopCollective]:
    """The ``n`` most expensive collectives of ``plan`` by seconds per step, a collective
    repeated by identical layers folded into one entry (the seconds of all of them); source
    lines when ``rebuilt`` is given."""
    _check_top(n)
    mesh = rebuilt.mesh if rebuilt is not None else plan_mesh(plan, cluster)
    where = _layer_positions(plan)
    groups: dict[tuple, list] = {}
    for c in plan.collectives:
        w = where.get(c.node) or where.get(c.value)     # the optimizer's: its parameter's layer
        base = w[1] if w else None
        key = (c.phase, c.kind, c.axes, c.bytes, c.count, c.stage, c.members or None,
               _relative(where, c.node, base), _relative(where, c.value, base))
        groups.setdefault(key, []).append((c, w))
    graph = {x.name: x for x in rebuilt.traced.graph.nodes} if rebuilt is not None else {}
    fqns = {p.name: p.fqn for p in rebuilt.traced.placeholders} if rebuilt is not None else {}
    ops = {x.name: x.op for x in plan.nodes}
    out = []
    for members in groups.values():
        c, w = members[0]
        if c.members:
            ws = [where[m] for m in c.members if m in where]
            layers = f"{ws[0][0]} {_ranges(x[1] for x in ws)}" if ws else ""
        else:
            numbers = [x[1] for _, x in members if x]
            layers = f"{w[0]} {_ranges(numbers)}" if w else ""
        out.append(TopCollective(
            c.kind, c.axes, c.phase, c.bytes, _seconds(c, mesh) * c.count, len(members),
            c.node, ops.get(c.node, ""), fqns.get(c.value, c.value), layers,
            tuple(fqns.get(m, m) for m in c.members), node_source(graph.get(c.node)),
            c.stage, rebuilt.traced.module_of(graph[c.node]) if c.node in graph else ""))
    out.sort(key=lambda t: -t.seconds)
    return out[:n]


def ledger_seconds(plan: Plan, mesh: Mesh) -> float:
    """Every collective of the plan's ledger per step, by alpha-beta on its axis."""
    return sum(_seconds(c, mesh) * c.count for c in plan.collectives)


def _seconds(c: Any, mesh: Mesh) -> float:
    """One run of collective ``c``: alpha-beta on its axis (docs/cost-model.md §1)."""
    from autoshard.cost.comm import link_time
    if len(c.axes) != 1 or c.axes[0] not in mesh.axes:
        raise AutoshardError(f"collectives over one axis of the plan's mesh {mesh.axes}",
                             got=f"{c.kind} over {list(c.axes)} for {c.node}",
                             fix="re-plan: the plan file was edited or is damaged")
    a = mesh.axes.index(c.axes[0])
    return link_time(mesh.links[a], c.kind, mesh.shape[a], c.bytes)


def _layer_positions(plan: Plan) -> dict[str, tuple[str, int, int, str]]:
    """node -> (container, block number, position in its layer, the first identical layer)."""
    out = {}
    for layer in plan.layers:
        container, _, number = layer.name.rpartition(".")
        for pos, name in enumerate(layer.nodes):
            out.setdefault(name, (container, int(number), pos, layer.same_as))
    return out


def _relative(where: dict, name: str, base: int | None) -> Any:
    """Equal for the same node of identical layers (relative to block ``base``)."""
    w = where.get(name)
    if w is None:
        return name
    return (w[3], w[1] - (w[1] if base is None else base), w[2])


def _ranges(numbers) -> str:
    """0,1,2,3,7 -> '0-3, 7'."""
    out: list[list[int]] = []
    for x in sorted(set(numbers)):
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


# ------------------------------------------------------------------------------------ text

def _size(nbytes: float) -> str:
    sign, n = ("-" if nbytes < 0 else ""), abs(nbytes)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{n:.0f} B"


def _ms(seconds: float, *, signed: bool = False) -> str:
    """Milliseconds to the microsecond; below 10 us in microseconds, so that a tiny model's
    deltas do not all read 0.000 ms."""
    sign = "+" if signed else ""
    if 0 < abs(seconds) < 1e-5:
        return f"{seconds * 1e6:{sign}.3f} us"
    return f"{seconds * 1e3:{sign}.3f} ms"


def _signed_size(nbytes: float) -> str:
    return ("+" if nbytes >= 0 else "") + _size(nbytes)


def render_explanation(e: Explanation) -> str:
    """The explanation as ``autoshard explain --node/--param`` prints it."""
    what = f"parameter {e.param} (graph input {e.node})" if e.param else \
        f"node {e.node} ({e.op})"
    lines = [f"autoshard explain: {what}"]
    if e.module:
        lines.append(f"  module: {e.module}")
    if e.source is None:
        lines.append("  source: (torch.export kept no stack for this node)")
    elif e.source_node != e.node:
        lines.append(f"  source (its first reader, {e.source_node}): {e.source}")
    else:
        lines.append(f"  source: {e.source}")
    if e.source is not None and e.source.caller is not None:
        lines.append(f"    called from {e.source.caller}")
    if len(e.shared_layers) > 1:
        lines.append(f"  layer: {e.layer}, decided once with the identical layers "
                     f"{_layer_span(e.shared_layers)}: a strategy held here holds in all "
                     f"{len(e.shared_layers)}")
    elif e.layer:
        lines.append(f"  layer: {e.layer}")
    if e.template != e.node:
        lines.append(f"  decided as its counterpart in {e.shared_layers[0]}: {e.template}")
    others = [n for n in e.decision_nodes if n != e.template]
    if others:
        shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6
                                          else "")
        lines.append(f"  one decision with {_plural(len(others), 'other node')} (the ops that "
                     f"follow one producer's layout): {shown}")
    lines.append(f"  chosen: {e.chosen}   ({_plural(e.strategies, 'strategy', 'strategies')} "
                 f"in all)")
    b = e.baseline
    lines.append(f"  plan file: step {_ms(e.file_step_s)}, peak memory "
                 f"{_size(e.file_memory_bytes)} per device")
    lines.append(f"  baseline = the plan re-solved with the chosen strategy pinned ({b.status}): "
                 f"step {_ms(b.step_time_s)}{_file_gap(e)}, peak memory "
                 f"{_size(b.memory_bytes)}, step peak (liveness) {_size(b.live_peak_bytes)}")
    if not e.rows:
        lines.append("  no alternative: the node has no other strategy" if e.strategies <= 1
                     else "  no alternative asked for (--alternatives 0)")
    else:
        lines.append(f"  next-best strategies (the {len(e.rows)} cheapest swapped in alone), each "
                     f"re-solved with it pinned ({e.time_limit_s:g} s limit); delta = re-solved "
                     f"plan - baseline:")
        for i, r in enumerate(e.rows, 1):
            lines += _row_lines(i, r)
    lines += [f"  note: {n}" for n in e.notes]
    s = e.seconds
    solves = s.get("baseline_s", 0.0) + s.get("alternatives_s", 0.0)
    lines.append(f"  took {s.get('rebuild_s', 0.0) + s.get('explain_s', 0.0):.1f} s: trace "
                 f"{s.get('rebuild_s', 0.0):.1f} s, ILP build {s.get('build_s', 0.0):.1f} s, "
                 f"{len(e.rows) + 1} re-solves {solves:.1f} s")
    return "\n".join(lines)


def _file_gap(e: Explanation) -> str:
    d = e.baseline.step_time_s - e.file_step_s
    if abs(d) <= 1e-9 * e.file_step_s:
        return " (the plan file's)"
    return f" ({_ms(d, signed=True)} from the plan file's)"


def _row_lines(i: int, r: Row) -> list[str]:
    x = r.resolved
    alone = "" if x.alone_step_s is None else f"; swapped in alone {_ms(x.alone_step_s)}"
    if x.plan is None:
        return [f"    {i}. {x.strategy}", f"       {x.status}{alone}"]
    delta = _ms(r.step_delta_s, signed=True)
    if r.step_delta_bound_s is not None and r.step_delta_bound_s < r.step_delta_s - 1e-12:
        delta = f"between {_ms(r.step_delta_bound_s, signed=True)} and {delta}: time limit"
    return [f"    {i}. {x.strategy}",
            f"       step {_ms(x.step_time_s)} ({delta}), peak memory {_size(x.memory_bytes)} "
            f"({_signed_size(r.memory_delta_bytes)}), step peak "
            f"{_signed_size(r.live_peak_delta_bytes)}{alone}",
            f"       {x.status}; moves {_plural(r.moved, 'other decision')}, "
            f"{_plural(r.params_moved, 'parameter layout')}"]


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else many or word + 's'}"


def _layer_span(names: tuple[str, ...]) -> str:
    container = names[0].rpartition(".")[0]
    if all(n.rpartition(".")[0] == container for n in names):
        return f"{container} {_ranges(int(n.rpartition('.')[2]) for n in names)}"
    return ", ".join(names)


def render_top(plan: Plan, rows: list[TopCollective], *, ledger_s: float,
               sources: str = "") -> str:
    """The list ``autoshard explain --top N`` prints: ``ledger_s`` is the seconds of every
    collective of the plan (``ledger_seconds``); ``sources``: why it has no source lines."""
    p = plan.predicted
    if not plan.collectives:
        return (f"autoshard explain: the plan of {plan.model or 'this model'} runs no "
                f"collectives (every device runs the whole step on its own data)")
    comm = ledger_s
    lines = [f"autoshard explain: the {len(rows)} most expensive collectives per step of "
             f"{plan.model or 'the plan'} on mesh {'x'.join(map(str, plan.mesh_shape))} "
             f"(alpha-beta seconds; a collective of identical layers is one row, with the "
             f"seconds of all) of the ledger's {_ms(comm)} per step. The plan's comm: "
             f"{_ms(p['comm_s'])} (each gradient priced by its share of its bucket), of which "
             f"{_ms(p['step_time_s'] - p['compute_s'])} exposed"]
    for i, t in enumerate(rows, 1):
        share = f", {t.seconds / comm:.1%}" if comm else ""
        each = f" x{t.instances} ({_ms(t.seconds_each)} each)" if t.instances > 1 else ""
        stage = f" on stage {t.stage}" if t.stage >= 0 else ""
        lines.append(f"  {i:2d}. {_ms(t.seconds)}{share}: {t.phase} {t.kind} over "
                     f"{','.join(t.axes)}{stage}, {_size(t.bytes)}{each}")
        if t.members:
            lines.append(f"      gradient bucket {t.node} of {_plural(len(t.members), 'parameter')}"
                         + (f" in {t.layers}" if t.layers else "") + f": {t.members[0]}"
                         + (f" .. {t.members[-1]}" if len(t.members) > 1 else ""))
            continue
        if t.node == "optimizer":        # codegen/optim.py: after the step, shards gathered
            lines.append(f"      after the optimizer step, gathering {t.value}'s updated shards"
                         + (f" in {t.layers}" if t.layers else ""))
            continue
        moves = f", moving {t.value}" if t.value and t.value != t.node else ""
        lines.append(f"      for {t.node}" + (f" ({t.op})" if t.op else "")
                     + (f", {t.module}," if t.module else "")
                     + (f" in {t.layers}" if t.layers else "") + moves)
        if t.source is not None:
            lines.append(f"      source: {t.source}")
    total = sum(t.seconds for t in rows)
    lines.append(f"  these rows: {_ms(total)}"
                 + (f", {total / comm:.1%} of the ledger's" if comm else "")
                 + "; grad_sync buckets run behind backward compute as far as it hides them")
    if sources:
        lines.append(f"  no source lines: {sources}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ the command

def explain_file(path: str | Path, *, node: str | None = None, param: str | None = None,
                 top: int | None = None, alternatives: int = DEFAULT_ALTERNATIVES,
                 time_limit_s: float = DEFAULT_TIME_LIMIT_S, model: str | None = None,
                 cluster: str | None = None, task: str | None = None,
                 as_json: bool = False) -> str:
    """What ``autoshard explain PLAN`` prints: exactly one of ``node``, ``param``, ``top``."""
    if sum(x is not None for x in (node, param, top)) != 1:
        raise AutoshardError("exactly one of --node NAME, --param FQN, --top N",
                             got=f"node={node!r}, param={param!r}, top={top!r}",
                             fix="e.g. autoshard explain plan.json --top 10")
    plan = Plan.load(path)
    if top is not None:
        _check_top(top)
        rebuilt, why = None, ""
        try:
            rebuilt = rebuild(plan, model=model, cluster=cluster, task=task)
        except AutoshardError as e:       # the ledger alone still ranks the collectives
            why = str(e)
        rows = top_collectives(plan, top, rebuilt=rebuilt, cluster=cluster)
        ledger_s = ledger_seconds(plan, rebuilt.mesh if rebuilt else plan_mesh(plan, cluster))
        if as_json:
            return json.dumps({"collectives": [r.to_json() for r in rows],
                               "ledger_s": ledger_s, "sources": why or "re-traced",
                               "seconds": {"rebuild_s": rebuilt.seconds if rebuilt else 0.0}},
                              indent=1)
        return render_top(plan, rows, ledger_s=ledger_s, sources=why)
    # Every mistake the file alone shows is refused before the model is traced again.
    _check_count(alternatives, time_limit_s)
    if node is not None:
        _node_of(plan, node)
    else:
        _check_param(plan, param)
    _check_resolvable(plan)
    rebuilt = rebuild(plan, model=model, cluster=cluster, task=task)
    kw = {"rebuilt": rebuilt, "alternatives": alternatives, "time_limit_s": time_limit_s}
    e = explain_node(plan, node, **kw) if node is not None else explain_param(plan, param, **kw)
    return json.dumps(e.to_json(), indent=1) if as_json else render_explanation(e)


__all__ = ["Explanation", "Rebuilt", "Resolved", "Row", "Source", "TopCollective",
           "explain_file", "explain_node", "explain_param", "node_source", "rebuild",
           "ledger_seconds", "render_explanation", "render_top", "top_collectives"]
