"""The obvious plans, as restrictions of the planner's own problem: where the solver stops at its
time limit, the plan it returns is never slower than the best of them (ilp.solve's ``starts``).

Each start is the problem with some decisions held to a subset of their strategies (a cut per
decision, ``problem.restricted``), solved only when the first backend proves no optimum:

- the hand-written layouts of solver/baselines.py, stored as their authors store them (``dp``:
  every weight replicated; ``megatron-dp``: Megatron-LM over the last axis, data parallel over
  the others; ``fsdp``: ZeRO-3; ``fsdp-tp``: torchtitan's 2-D layout). The ILP may still reshard a
  weight on the way into an op and choose ZeRO's state modes, so each start is at least as fast
  as the baseline plan of that name;
- the plan on the smaller mesh: every tensor replicated over one mesh axis, which is the plan of
  the mesh without that axis, its devices repeating the work (the same step time);
- the plan on the merged mesh: every tensor placed alike on every axis, which is the plan of
  the mesh with its axes merged into one, each of its collectives run one axis at a time;
- the smaller meshes' plans combined axis by axis (each axis placed as the plan without the
  next axis places it), solved after them from their choices (``problem.combined``).
"""
from __future__ import annotations

from collections import defaultdict

from autoshard.ir import Replicate, Spec, Strategy
from autoshard.mesh import Mesh
from autoshard.solver.build import Built
from autoshard.solver.problem import Start, restricted
from autoshard.trace.export import TracedGraph


def obvious_starts(traced: TracedGraph, mesh: Mesh, built: Built) -> tuple[Start, ...]:
    """The starts above that the problem can express, in the order they share one part of the
    solve's time (solver/deadline.py): the smaller meshes' plans and their combination first,
    which hold every decision and solve at once (0.2 to 2 s each on DeepSeek-V3's 8x8 problem,
    loaded), then the baselines, which hold only the weights and leave a MIP (none of the four
    found a plan in 7 s there), then the merged mesh."""
    from autoshard.solver import layouts as b

    by_decision = _members(built)
    # The baselines that found plans on Gemma-3 12B's 8x8 problem first (fsdp-tp 428 ms,
    # fsdp 449 ms; dp and megatron-dp nothing in 13.6 s; benchmarks/RESULTS.md "solver starts").
    layouts = {"fsdp-tp": b.fsdp_tp_layouts(traced, mesh)} if mesh.ndim > 1 else {}
    layouts.update({"fsdp": b.zero3_layouts(traced, mesh),
                    "megatron-dp": b.baseline_pins(traced, mesh, "megatron-dp"),
                    "dp": b.baseline_pins(traced, mesh, "dp")})
    starts = []
    if mesh.ndim > 1:
        starts += _smaller_meshes(built, by_decision, mesh)
        if all(n > 1 for n in mesh.shape):
            starts.append(_axes_combined(built, by_decision, mesh))
    starts += [_stored(built, label, stored) for label, stored in layouts.items()]
    if mesh.ndim > 1:       # never the best measured (DeepSeek-V3, Jamba, Gemma-3 on 8x8)
        starts.append(_merged_mesh(built, by_decision))
    return tuple(s for s in starts if s is not None)


def _axes_combined(built: Built, by_decision: dict[int, list], mesh: Mesh) -> Start:
    """Each axis placed as the plan of a smaller mesh that keeps it places it (axis ``a`` as
    the plan without the next axis does): on a 2-D mesh, the data axis of the plan without the
    model axis and the model axis of the plan without the data axis, the product of two 1-D
    plans. The baselines' restrictions hold only the weights, and on MoE and latent-attention
    layers (DeepSeek-V3 on 8x8) their activations alone are a MIP no backend solves in its
    share of the time limit; this one holds nearly every decision, so it is solved at once,
    and where the data axis was left idle (the plan without it was the best start) it is the
    incumbent that splits the batch."""
    parts = tuple(_without(mesh, (a + 1) % mesh.ndim) for a in range(mesh.ndim))
    return Start("axes of the smaller meshes' plans", parts=parts, keys=axis_keys(built, mesh))


def axis_keys(built: Built, mesh: Mesh) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """``keys[g][i][a]``: the placements on mesh axis ``a`` of every spec decision ``g``'s
    strategy ``i`` places (of every node that follows it), numbered per decision and axis."""
    by_decision = _members(built)
    keys = []
    for g in range(len(built.problem.decisions)):
        members = by_decision[g]
        numbers: list[dict] = [{} for _ in range(mesh.ndim)]
        row = []
        for i in range(len(built.problem.decisions[g].cost)):
            specs = [x for m in members for x in _specs(m.strategies[m.index[i]])]
            row.append(tuple(numbers[a].setdefault(tuple(x[a] for x in specs), len(numbers[a]))
                             for a in range(mesh.ndim)))
        keys.append(tuple(row))
    return tuple(keys)


def descent_starts(built: Built, mesh: Mesh) -> tuple[Start, ...]:
    """The starts of the descent over mesh axes (solver/descent.py): the obvious
    plans that hold every decision, so that each is a small MIP (the baselines hold only the
    weights, which leaves the activations a MIP the size of the whole): every axis placed alike
    first, the quickest, then each mesh without one axis."""
    by_decision = _members(built)
    starts = [_merged_mesh(built, by_decision, loose=True),
              *_smaller_meshes(built, by_decision, mesh, loose=True)]
    return tuple(s for s in starts if s is not None)


def _smaller_meshes(built: Built, by_decision: dict[int, list], mesh: Mesh,
                    loose: bool = False) -> list[Start | None]:
    """The plan of each mesh without one axis (of 2 or more devices): that axis replicated
    (``loose``: as :func:`_where` takes it)."""
    return [_where(built, by_decision, _without(mesh, a),
                   lambda spec, a=a: isinstance(spec[a], Replicate), loose)
            for a in range(mesh.ndim) if mesh.shape[a] > 1]


def _merged_mesh(built: Built, by_decision: dict[int, list], loose: bool = False
                 ) -> Start | None:
    """The plan of the mesh with its axes merged into one: every value placed alike on each."""
    return _where(built, by_decision, "merged mesh", lambda spec: all(p == spec[0] for p in spec),
                  loose)


def _members(built: Built) -> dict[int, list]:
    out: dict[int, list] = defaultdict(list)
    for m in built.members.values():
        out[m.decision].append(m)
    return out


def _stored(built: Built, label: str, stored: dict[str, Strategy]) -> Start | None:
    """Each graph input named in ``stored`` held to the strategies that store it in its layout
    (any state mode); a layout the problem does not offer is left free."""
    allowed: dict[int, set[int]] = {}
    for name, strat in stored.items():
        if name in built.tied_to or built.template.get(name, name) != name \
                or name not in built.members:
            continue      # a tied weight's second name, a repeated layer's copy: decided once
        m = built.members[name]
        want = strat.outputs[0]
        keep = {i for i, j in enumerate(m.index) if m.strategies[j].outputs[0] == want}
        if keep:
            allowed[m.decision] = allowed.get(m.decision, keep) & keep
    return _start(built, label, allowed)


def _where(built: Built, by_decision: dict[int, list], label: str, spec_ok,
           loose: bool = False) -> Start | None:
    """Every decision held to the strategies whose every spec, of every node that follows it,
    passes ``spec_ok``; None where a decision has none, or with ``loose``, that decision left
    free (a follower may shard a view of a replicated value for free: llama-tiny's positions)."""
    allowed: dict[int, set[int]] = {}
    for g, members in by_decision.items():
        n = len(built.problem.decisions[g].cost)
        keep = {i for i in range(n) if all(_specs_ok(m.strategies[m.index[i]], spec_ok)
                                           for m in members)}
        if not keep and not loose:
            return None
        if keep:
            allowed[g] = keep
    return _start(built, label, allowed)


def _specs(s: Strategy) -> list[Spec]:
    """Every spec a strategy places, inputs then outputs."""
    return [x for x in (*s.inputs, *s.outputs) if x is not None]


def _specs_ok(s: Strategy, spec_ok) -> bool:
    return all(spec_ok(x) for x in _specs(s))


def _start(built: Built, label: str, allowed: dict[int, set[int]]) -> Start | None:
    if not allowed or not all(allowed.values()):
        return None
    cut = restricted(built.problem, allowed).cuts[len(built.problem.cuts):]
    return Start(label, within=cut)


__all__ = ["axis_keys", "descent_starts", "obvious_starts"]


def _without(mesh: Mesh, axis: int) -> str:
    """The label of the start made from the plan on ``mesh`` less ``axis``: the combined start
    finds its parts by it."""
    return f"mesh without axis {mesh.axes[axis]}"
