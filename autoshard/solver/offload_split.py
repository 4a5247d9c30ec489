"""Offload per parameter (docs/cost-model.md §9.2): the ILP decides a parameter's state mode once
per decision, and a decision stands for one parameter of every identical layer (its
multiplicity), so a plan that must offload some MLP weights offloads them in all 32 layers and
leaves the memory between its step's peak and the budget unused (Llama-3-8B on one 80 GB H100:
63.6 of 69.3 GiB). This pass brings offloaded parameters back to the device one at a time,
about as many as the step's liveness peak allows, priced on the plan's own layouts.

Order: the earliest read in forward first. Their gradients arrive last in backward, so their
host step is the part the backward window cannot hide (ZeRO-Offload steps each partition as
its gradients land, Ren et al. 2021, arXiv 2101.06840, §4-5); the parameters whose gradients
land first stay on the host, stepping while backward goes on. Parameter offload is undone
first (the stored parameter back on the device, its optimizer state still on the host): per byte
of device memory it costs, it saves more of the step (each use's copies for 2 bytes an element,
where the host step's saving costs the 12 bytes an element of the optimizer state)."""
from __future__ import annotations

from collections import Counter
from dataclasses import replace
from itertools import accumulate

from autoshard import progress
from autoshard.cost.memory import device_budget
from autoshard.cost.state import HOST_MODES, state_bytes, state_choices
from autoshard.ir import OffloadLevel, StateMode, Strategy
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions, state_modes
from autoshard.plans import Plan
from autoshard.solver.search import fitting_edge
from autoshard.solver.solve import offload_level, repriced
from autoshard.trace.export import TracedGraph
from autoshard.trace.graph import first_reads
from autoshard.trace.layers import checkpointable

# A parameter, and the state mode and state axes it moves to (cost/state.py).
Move = tuple[str, "StateMode | None", "tuple[int, ...] | None"]


def offload_per_parameter(traced: TracedGraph, mesh: Mesh, options: PlanOptions,
                          plan: Plan) -> Plan | None:
    """``plan`` with about as many of its offloaded parameters back on the device (in the order
    the module docstring gives) as keep the step's liveness peak within the budget (the search
    of :func:`_bring_back`), if that is faster; else None. Only under offload "auto" (a forced
    offload is what the user asked for) and not for a pipeline's stages, whose peak their caller
    holds. Under recompute "auto" the same layouts with every layer checkpointed in full are
    tried too: the checkpointing search chose its mix against the ILP's offload, one mode per
    decision, and the memory full checkpointing frees can bring more state back than its
    recomputation costs (Llama-3-8B on one 80 GB GPU: 0.8% faster, docs/cost-model.md §9.2)."""
    if options.offload != OffloadLevel.AUTO or options.stage_run is not None \
            or offload_level(plan) == OffloadLevel.NONE:
        return None
    tries = [plan]
    layers = checkpointable(traced.graph, traced.layers) if traced.training else ()
    full = dict.fromkeys(layers, "full")
    if options.recompute == "auto" and full and plan.recompute != full:
        tries.append(repriced(traced, mesh, options, plan, plan.strategies(), full))
    found = [p for p in (_bring_back(traced, mesh, options, t) for t in tries) if p is not None]
    best = min(found, key=lambda p: p.predicted.step_time_s, default=None)
    if best is None or best.predicted.step_time_s >= plan.predicted.step_time_s:
        return None
    if best.recompute == plan.recompute:
        return best
    mix = ", ".join(f"{n} {policy}"
                    for policy, n in sorted(Counter(plan.recompute.values()).items()))
    return replace(best, solver={**best.solver, "note": (
        f"{best.solver['note']}; every checkpointable layer recomputed in full, where the "
        f"checkpointing search's plan had {mix or 'none'}")})


def _bring_back(traced: TracedGraph, mesh: Mesh, options: PlanOptions,
                plan: Plan) -> Plan | None:
    """``plan`` with the most moves (:func:`_moves`) that keep its liveness peak within the
    budget, found as below; None where none fits."""
    budget = device_budget(mesh.cluster, options.memory_budget)
    if plan.predicted.memory.peak > budget:
        return None
    strategies = plan.strategies()
    moves = _moves(traced, mesh, options, strategies)
    if not moves:
        return None

    plans: dict[int, Plan] = {}

    def peak_at(j: int) -> float:
        s = dict(strategies)
        for name, mode, axes in moves[:j]:
            s[name] = replace(s[name], kernel=mode, state_axes=axes)
        plans[j] = repriced(traced, mesh, options, plan, s, plan.recompute)
        return plans[j].predicted.memory.peak

    # The most moves that fit: each adds device memory. What a move keeps on the device for
    # the whole step (the parameter, its optimizer state) raises the peak by about its bytes
    # (less where the step's peak lies where an offloaded parameter held buffers of its own), so
    # their running sum estimates the count, and the first pricing is there; the peak grows
    # about linearly in that sum, the coordinate of the search (solver/search.py
    # ``fitting_edge``): two to four pricings. A move that alone adds more than the room left
    # is dropped (Llama-3-8B's embedding, the first read, where a few GiB are left): it would
    # block every move after it.
    peak = plan.predicted.memory.peak
    now = {name: (strategies[name].kernel, strategies[name].state_axes) for name, _, _ in moves}
    steps = []
    for name, mode, axes in moves:
        spec = strategies[name].outputs[0]
        steps.append(_resident(traced, mesh, options, name, spec, (mode, axes))
                     - _resident(traced, mesh, options, name, spec, now[name]))
        now[name] = (mode, axes)
    moves, steps = _fitting(moves, steps, budget - peak)
    if not moves:
        return None
    added = [0.0, *accumulate(steps)]          # resident bytes the first j moves add
    hi = max(j for j, a in enumerate(added) if peak + a <= budget)
    with progress.step(f"offload per parameter: about {hi} of {len(moves)} moves fit"):
        lo = fitting_edge(peak_at, 0, hi, budget, m_fit=peak, x=added.__getitem__)
    if lo == 0:
        return None
    best = plans[lo]
    kept = sum(1 for _, mode, _ in moves[:lo] if mode not in HOST_MODES)
    return replace(best, solver={
        **best.solver, "objective": best.predicted.step_time_s,
        "note": f"state modes solved per decision (one for every identical layer); then "
                f"{lo} of {len(moves)} offload moves priced per parameter ({kept} parameters' "
                f"optimizer state back on the device)"})


def _fitting(moves: list[Move], steps: list[float], room: float
             ) -> tuple[list[Move], list[float]]:
    """``moves`` (with the resident bytes each adds, ``steps``) less those that add more than
    ``room`` alone, and less a parameter's second move (optimizer offload undone) where its
    first (parameter offload undone) was dropped."""
    out, kept, gone = [], [], set()
    for move, step in zip(moves, steps):
        if step > room or move[0] in gone:
            gone.add(move[0])
            continue
        out.append(move)
        kept.append(step)
    return out, kept


def _resident(traced: TracedGraph, mesh: Mesh, options: PlanOptions, name: str, spec,
              state: tuple[StateMode | None, tuple[int, ...] | None]) -> float:
    """The bytes a parameter keeps on the device through the whole step under ``state``
    (its mode and state axes): itself and its optimizer state (its gradient lives only from
    backward to the step)."""
    ph = traced.placeholder(name)
    st = state_bytes(ph.info.shape, ph.info.dtype, spec, state[0], mesh.shape,
                     options.state_optimizer, state[1])
    return st.parameters + st.optimizer


def _moves(traced: TracedGraph, mesh: Mesh, options: PlanOptions,
           strategies: dict[str, Strategy]) -> list[Move]:
    """The moves that bring ``strategies``' offloaded parameters back, in the order they are
    tried: parameter offload undone (to optimizer offload), then optimizer offload undone (to the
    device mode with the least memory that ``options`` allows for the parameter's layout), each
    in the order forward first reads the parameters. A tied parameter is left as it is (its
    names share one state)."""
    first_read = first_reads(traced.graph.nodes)
    names = Counter(p.fqn for p in traced.params)      # a tied weight: one fqn, several names
    hosted = sorted((p for p in traced.params
                     if p.name in strategies and names[p.fqn] == 1
                     and strategies[p.name].kernel in HOST_MODES),
                    key=lambda p: first_read.get(p.name, len(first_read)))
    allowed = state_modes(options, OffloadLevel.NONE)
    optimizer = options.state_optimizer
    moves: list[Move] = [(p.name, StateMode.OFFLOAD, None) for p in hosted
                         if strategies[p.name].kernel == StateMode.OFFLOAD_PARAMS]
    for p in hosted:
        ph = traced.placeholder(p.name)
        spec = strategies[p.name].outputs[0]
        choices = state_choices(ph.info.shape, spec, mesh.shape, optimizer, allowed,
                                ph.info.dtype.itemsize)
        moves.append((p.name, *min(choices, key=lambda c: state_bytes(
            ph.info.shape, ph.info.dtype, spec, c[0], mesh.shape, optimizer, c[1]).device)))
    return moves
