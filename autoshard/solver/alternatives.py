"""Other plans from the same ILP: runners-up, and plans whose stored parameter layouts are fixed.

- :func:`runners_up`: the next-best plans whose parameter layouts differ from every plan before
  them. Each is the same problem solved again with a *no-good cut* per excluded plan (Balas and
  Jeroslow, "Canonical cuts on the unit hypercube", SIAM J. Appl. Math. 1972): of the parameter
  decisions, at least one must leave the layout that plan gave it,

      sum over parameters p of  sum_{i : layout_p(i) = L_p}  x[p, i]   <=   #parameters - 1.

  Activations are free: a runner-up is the cheapest program for a different way of storing the
  weights, which is what a user chooses between.
- :func:`plan_stored`: a plan whose parameters are *stored* in given layouts but, unlike the
  hand-written baselines (solver/baselines.py, which read every weight where it lies), may be
  resharded on the way into an op: a ZeRO-3-style plan stores every weight sharded and lets the
  ILP all-gather it for the ops that need it whole.

Both build the problem as the planner does (solver/build.py), add their pins and cuts to it as
data (solver/problem.py), solve it through the planner's one entry (``ilp.solve``: the same
backends, fallback and verdicts) and assemble the Plan as the planner does
(``solve.solved_plan``), so their predicted figures are the same prices as any other plan's. 1-D and 2-D
meshes only (the planner searches 3-axis meshes over axis merges).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from autoshard.errors import AutoshardError
from autoshard.ir import Spec, Strategy
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions, resolve_options
from autoshard.plans import Plan
from autoshard.solver.build import Built, build_problem
from autoshard.solver.ilp import Infeasible, NoSolution, solve
from autoshard.solver.solve import check_mesh_fits, solved_plan
from autoshard.solver.problem import Cut
from autoshard.trace.export import TracedGraph


def _options(traced: TracedGraph, options: PlanOptions | None,
             overrides: dict[str, Any]) -> PlanOptions:
    if options is None:
        overrides = {"training": traced.training, **overrides}
    return resolve_options(options, overrides)


def _check_mesh(traced: TracedGraph, mesh: Mesh) -> None:
    if mesh.ndim > 2:
        raise AutoshardError("a 1-D or 2-D mesh for runners-up and stored-layout plans",
                             got=f"mesh {mesh.shape}",
                             fix="merge axes into a 2-D mesh, e.g. (2, 2, 2) -> (4, 2)")
    check_mesh_fits(traced, mesh)


def _param_classes(traced: TracedGraph, built: Built) -> dict[str, tuple[int, list[Spec]]]:
    """Each parameter that owns its decision (not a repeated layer's copy, not a tied weight's
    second name) -> (its decision, its stored layout under each strategy of the decision)."""
    out = {}
    for p in traced.params:
        m = built.members.get(p.name)
        if m is None or p.name in built.tied_to:
            continue
        out[p.name] = (m.decision, [m.strategies[j].outputs[0] for j in m.index])
    return out


def _layouts_of(plan: Plan, traced: TracedGraph) -> dict[str, Spec]:
    """A plan's stored layout per parameter placeholder."""
    return {p.name: tuple(plan.params[p.fqn]) for p in traced.params if p.fqn in plan.params}


def _pins(built: Built, fixed: dict[str, Strategy]) -> list[tuple[int, int]]:
    """(decision, strategy) pairs that store each named placeholder in the given layout (and
    a parameter's state mode and state axes, when the strategy's ``kernel`` names one)."""
    pins = []
    for name, strat in fixed.items():
        if name in built.tied_to or built.template.get(name, name) != name:
            continue          # a tied weight's second name, or a repeated layer's copy
        m = built.members[name]
        want = strat.outputs[0]
        idx = [i for i, j in enumerate(m.index) if m.strategies[j].outputs[0] == want
               and (strat.kernel is None or (strat.kernel, strat.state_axes)
                    == (m.strategies[j].kernel, m.strategies[j].state_axes))]
        if not idx:
            raise AutoshardError(f"a layout {name} can be stored in",
                                 got=str(want), fix="pick a spec whose sharded dims divide evenly")
        pins.append((m.decision, idx[0]))
    return pins


def _solve(traced: TracedGraph, mesh: Mesh, options: PlanOptions, built: Built, *,
           pins: Sequence[tuple[int, int]], exclude: Sequence[dict[str, Spec]],
           model_name: str, label: str) -> Plan | None:
    """The cheapest plan under ``pins`` and a no-good cut per ``exclude`` (None if none is
    feasible within the memory budget and the time limit)."""
    classes = _param_classes(traced, built)
    cuts = tuple(c for c in (_no_good(classes, layouts) for layouts in exclude) if c)
    problem = replace(built.problem, fixed=tuple(sorted(set(pins))), cuts=cuts)
    try:
        sol = solve(problem, time_limit_s=options.time_limit_s)
    except (Infeasible, NoSolution):
        return None
    return solved_plan(traced, mesh, options, built, problem, sol, model_name=model_name,
                       timings={"trace_s": 0.0, "build_s": 0.0, "solve_s": sol.seconds},
                       alternative=label)[0]


def _no_good(classes: dict[str, tuple[int, list[Spec]]], layouts: dict[str, Spec]) -> Cut | None:
    """Of the parameters ``layouts`` names, at least one leaves the layout it gives it."""
    terms = tuple((g, i) for name, (g, specs) in classes.items() if name in layouts
                  for i, spec in enumerate(specs) if spec == layouts[name])
    n = sum(1 for name in classes if name in layouts)
    return Cut(terms, n - 1) if n else None


def runners_up(traced: TracedGraph, mesh: Mesh, best: Plan, count: int = 2,
               options: PlanOptions | None = None, *, model_name: str = "",
               **overrides: Any) -> list[Plan]:
    """Up to ``count`` plans, each the cheapest whose parameter layouts differ from ``best``'s
    and from every earlier runner-up's (fewer when no other plan fits memory). Ordered by
    predicted step time, as found; a runner-up may tie with the plan before it."""
    if not (isinstance(count, int) and not isinstance(count, bool) and count >= 0):
        raise AutoshardError("a count of runners-up that is an int >= 0", got=repr(count),
                             fix="e.g. count=2")
    options = _options(traced, options, overrides)
    _check_mesh(traced, mesh)
    built = build_problem(traced, mesh, options)
    exclude = [_layouts_of(best, traced)]
    out: list[Plan] = []
    for k in range(count):
        plan = _solve(traced, mesh, options, built, pins=(), exclude=exclude,
                      model_name=model_name, label=f"runner-up {k + 1}")
        if plan is None:
            break
        out.append(plan)
        exclude.append(_layouts_of(plan, traced))
    return out


def plan_stored(traced: TracedGraph, mesh: Mesh, stored: dict[str, Strategy],
                options: PlanOptions | None = None, *, model_name: str = "",
                label: str = "stored layouts", **overrides: Any) -> Plan:
    """The cheapest plan that stores the placeholders named in ``stored`` (parameters, inputs)
    in the given layouts; ops may still reshard them on the way in (unlike
    ``solver.baselines.baseline_plan``, which pins weights in place)."""
    options = _options(traced, options, overrides)
    _check_mesh(traced, mesh)
    built = build_problem(traced, mesh, options)
    plan = _solve(traced, mesh, options, built, pins=_pins(built, stored), exclude=(),
                  model_name=model_name, label=label)
    if plan is None:
        raise AutoshardError(f"a plan with the {label} within the memory budget and time limit",
                             got="none found",
                             fix="raise memory_budget or time_limit_s, or store fewer weights "
                                 "whole")
    return plan


__all__ = ["plan_stored", "runners_up"]
