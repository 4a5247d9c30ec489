"""Fitting the memory budget: the ladder of techniques (ZeRO, activation checkpointing whole or
per layer, optimizer and parameter offload), cheapest first, and the outer loop that holds the
step's liveness peak to the budget (docs/cost-model.md §4.6)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence


from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, Phase
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.cost.memory import budget_for, device_budget, host_budget
from autoshard.solver.ilp import Infeasible, MemoryBinds, NoBetter, NoSolution
from autoshard.solver.diagnostics import gib
from autoshard.trace.export import TracedGraph
from autoshard.trace.layers import checkpointable
from autoshard.solver.assemble import assemble, forward_memory
from autoshard.solver.merging import plan_once
from autoshard.solver.search import Try, fitting_edge, run_search
from autoshard.solver.solve import BudgetError, forced_offload, grouped, offload_level


def plan_memory(traced: TracedGraph, mesh: Mesh, options: PlanOptions, **kw: Any) -> Plan:
    """Plan with the memory techniques ``options`` allows, cheapest first: parameter, gradient
    and optimizer-state sharding (ZeRO-1/2/3) are always in the search; activation
    checkpointing as :func:`_plan_recompute` decides; under offload "auto", optimizer offload
    only when no plan fits without it, and parameter offload (beside it) only when no plan fits
    with optimizer offload alone, since each costs host-link time. When nothing fits, the error
    names the least memory found and the techniques that were tried."""
    ladder = offload_tries(traced, options)
    try:
        plan, _ = run_search("memory ladder", ladder, lambda t: _plan_recompute(
            traced, mesh, options, offload=t.get("offload"), **kw),
            until=lambda p: True, recoverable=lambda e: isinstance(e.__cause__, Infeasible),
            error_of_none="last")
    except AutoshardError as e:
        raise _with_techniques(e, traced, options, ladder[-1].get("offload"))
    _check_host(plan, mesh)
    return plan


def offload_tries(traced: TracedGraph, options: PlanOptions) -> list[Try]:
    """The memory ladder's rungs, cheapest first, the first that plans kept: the offload
    ``options`` forces (none under "auto"); under "auto", optimizer offload, then parameter
    offload beside it (not for a pipeline's stages), each costing host-link time."""
    forced = forced_offload(options)
    ladder = [Try("without offload" if forced == OffloadLevel.NONE else "as asked",
                  (("offload", forced),), announce=False)]
    if options.offload == OffloadLevel.AUTO and traced.training \
            and options.state_optimizer not in ("none", "sgd"):
        ladder.append(Try("no plan fits: with optimizer offload",
                          (("offload", OffloadLevel.OPTIMIZER),)))
        if options.stage_run is None:
            ladder.append(Try("no plan fits: with parameter offload",
                              (("offload", OffloadLevel.PARAMETERS),)))
    return ladder


def _with_techniques(e: AutoshardError, traced: TracedGraph, options: PlanOptions,
                     offload: OffloadLevel) -> AutoshardError:
    if not isinstance(e.__cause__, Infeasible):
        return e
    tried = ["parameter sharding (ZeRO-3)"]
    if traced.training and options.state_optimizer not in ("none", "sgd"):
        tried.append({"auto": "ZeRO-2", "none": "", "zero1": "ZeRO-1",
                      "zero2": "ZeRO-2"}[options.zero])
    layers = checkpointable(traced.graph, traced.layers) if traced.training else []
    if layers and options.recompute != "none":
        tried.append(f"full activation checkpointing of its {len(layers)} repeated layers")
    if offload != OffloadLevel.NONE:
        tried.append("optimizer offload to the host")
    if offload == OffloadLevel.PARAMETERS:
        tried.append("parameter offload to the host")
    fix = e.fix
    if offload == OffloadLevel.NONE and traced.training and options.offload == OffloadLevel.NONE:
        fix += ", or allow optimizer offload (offload='auto')"
    if layers and options.recompute == "none":
        fix += ", or allow activation checkpointing (recompute='auto')"
    got = f"{e.got}; techniques tried: {', '.join(t for t in tried if t)}"
    if isinstance(e, BudgetError):
        return BudgetError(e.expected, got=got, fix=fix, least_bytes=e.least_bytes,
                           phase=e.phase)
    return AutoshardError(e.expected, got=got, fix=fix)


def _check_host(plan: Plan, mesh: Mesh) -> None:
    memory = plan.predicted.memory
    host = memory.host if memory is not None else 0.0
    if host > host_budget(mesh.cluster):
        raise AutoshardError(
            f"state offloaded within the host memory of one device "
            f"({gib(host_budget(mesh.cluster))}: the cluster field host_memory_bytes less a "
            f"process's own, cost/memory.py)",
            got=f"the plan offloads {gib(host)} per device",
            fix="use a larger mesh, or a cluster profile with more host memory per device")


BINDS = 0.9     # a plan above this fraction of the budget may be held back by it


def _plan_recompute(traced: TracedGraph, mesh: Mesh, options: PlanOptions, **kw: Any) -> Plan:
    """Plan with activation checkpointing as ``options.recompute`` says: "none", "selective" or
    "full" on every checkpointable layer. "auto": without it first; recomputing only adds time
    to the same layouts, so it is tried only when memory binds (no plan fits, or the plan fills
    the budget): selective and full, each kept if it is the fastest plan that fits (memory it
    frees can buy faster layouts)."""
    layers = checkpointable(traced.graph, traced.layers) if traced.training else []
    if not layers or options.recompute == "none":
        return plan_once(traced, mesh, options, recompute={}, **kw)
    if options.recompute in ("selective", "full"):
        return plan_once(traced, mesh, options,
                            recompute=dict.fromkeys(layers, options.recompute), **kw)
    ladder = _Ladder(traced, mesh, options, layers, kw)
    # No plan fits, or none was found in time (memory that binds makes the ILP hard):
    # checkpointing frees memory either way.
    _, done = run_search("checkpointing", ladder.tries, ladder.solve, until=ladder.unbound,
                         error_of_none="last",
                         recoverable=lambda e: isinstance(e.__cause__, (Infeasible, NoSolution)))
    plans = [d.result for d in done if d.result is not None]
    if len(done) == 1 and plans:
        return plans[0]             # without checkpointing, and memory does not bind
    assert plans, "a checkpointing search without a plan raises its last error"
    # Compared by the step's liveness peak too (a selective plan's can be twice the sum the ILP
    # bounds): each re-planned for it as plan_traced would, and the fastest that fits kept.
    # Fastest first: re-planning a plan for its peak never makes it faster, so once one fits,
    # a plan already slower than it needs no re-planning.
    fitting = None
    for p in sorted(plans, key=lambda p: p.predicted.step_time_s):
        if fitting is not None and p.predicted.step_time_s >= fitting.predicted.step_time_s:
            break
        f = ladder.fit(p)
        if f is not None and (fitting is None or f.predicted.step_time_s
                              < fitting.predicted.step_time_s):
            fitting = f
    if fitting is None:
        return min(plans, key=lambda p: p.predicted.step_time_s)
    partial = _plan_partial(traced, mesh, options, fitting, layers, ladder.budget, **kw)
    return fitting if partial is None else partial


# A plan within this fraction of its solver's bound sets a later rung's bar (_Ladder.bar): the
# Llama-3-70B plan on 4x8 re-planned for its peak stopped at 0.96% from its bound.
BAR_GAP = 0.02


class _Ladder:
    """The checkpointing search's rungs (recompute "auto"): none, selective, full on every
    checkpointable layer, each solved with the fastest settled plan in hand as its cutoff, and
    every plan re-planned for its liveness peak at most once."""

    def __init__(self, traced: TracedGraph, mesh: Mesh, options: PlanOptions,
                 layers: Sequence[str], kw: dict[str, Any]) -> None:
        self.traced, self.mesh, self.options, self.layers, self.kw = traced, mesh, options, \
            layers, kw
        self.budget = device_budget(mesh.cluster, options.memory_budget)
        self.tries = recompute_tries()
        self.last = self.tries[-1].get("recompute")
        self.held: dict[str | None, Plan | AutoshardError] = {}   # each rung solved, by policy
        self.fitted: list[tuple[Plan, Plan | None]] = []    # (plan, it fitted to its peak)

    def fit(self, p: Plan) -> Plan | None:
        for q, f in self.fitted:
            if q is p:
                return f
        self.fitted.append((p, _fit_live(self.traced, self.mesh, self.options, p, self.budget,
                                         self.kw)))
        return self.fitted[-1][1]

    def rung(self, policy: str | None, **more: Any) -> Plan:
        # A rung before the last whose every decision at its least memory already sums above
        # the budget is refused without the MIP that finds its exact least memory (selective
        # on GPT-3 175B at 8x8, batch 64: 28 to 95 s): only the last rung's refusal is reported.
        return plan_once(self.traced, self.mesh, self.options, least_exact=policy == self.last,
                         recompute={} if policy is None else dict.fromkeys(self.layers, policy),
                         **more, **self.kw)

    def bar(self) -> float | None:
        """The step of the fastest plan in hand that fits by liveness too and is settled
        (proven optimal, or within BAR_GAP of its bound): a later rung searches only faster
        plans (re-planning for the peak never makes a plan faster). One the time limit stopped
        far from its best sets none (Llama-3-70B on 4x8 without checkpointing: 8,457 ms
        stopped at the limit, where full checkpointing plans 1,533 ms): it would leave the
        later rungs a quarter of the time limit to find better. 2-D meshes only."""
        if self.mesh.ndim >= 3:
            return None
        held = [p for p in self.held.values() if isinstance(p, Plan) and _settled(p)]
        steps = [f.predicted.step_time_s for f in map(self.fit, held)
                 if f is not None and _settled(f)]
        return min(steps, default=None)

    def solve(self, t: Try) -> Plan | None:
        policy = t.get("recompute")
        if policy not in self.held:
            try:
                self.held[policy] = self._solve(policy)
            except AutoshardError as e:
                self.held[policy] = e
        if isinstance(self.held[policy], AutoshardError):
            raise self.held[policy]
        return self.held[policy]

    def _solve(self, policy: str | None) -> Plan | None:
        cutoff = self.bar()
        try:
            try:
                return self.rung(policy, cutoff_s=cutoff,
                                 stop_if_binds=policy is None and self.mesh.ndim < 3)
            except MemoryBinds:
                # Memory binds without checkpointing: its whole MIP is the hard one (Llama-3-70B
                # on 4x8: 25 s to a plan 5.5x its optimum). The last rung, which frees the most
                # memory, solved first and fitted to its peak, bounds it (the same MIP under
                # that cutoff: proved empty in 1 s, benchmarks/RESULTS.md "Planning time").
                with progress.step(f"{self.tries[-1].label} first, to bound it"):
                    try:
                        self.solve(self.tries[-1])
                    except AutoshardError as e:
                        if not isinstance(e.__cause__, (Infeasible, NoSolution)):
                            raise
                cutoff = self.bar()
                return self.rung(policy, cutoff_s=cutoff, binds=True, whole_limit=True)
        except NoBetter:
            progress.note(f"no plan faster than {cutoff * 1e3:.3f} ms")
            return None

    def unbound(self, p: Plan) -> bool:
        """Memory no longer binds: checkpointing (more of it) would only add time. Without
        it, memory binds near the budget (a layout the budget ruled out may be faster with the
        memory checkpointing frees; a plan 1% under the budget can be one)."""
        if not p.recompute:
            return p.predicted.ilp_sum_bytes < self.budget * BINDS
        return set(p.recompute.values()) == {"selective"} and \
            p.predicted.ilp_sum_bytes < self.budget * 0.98 and \
            p.predicted.memory.peak <= self.budget


def _settled(p: Plan) -> bool:
    return p.solver.get("status") == "OPTIMAL" or p.solver.get("gap", 1.0) <= BAR_GAP


def recompute_tries() -> list[Try]:
    """The checkpointing search's tries (recompute "auto"), cheapest first: none, selective,
    full on every checkpointable layer; it stops once memory no longer binds."""
    return [Try("without activation checkpointing", (("recompute", None),)),
            *[Try(f"activation checkpointing ({p})", (("recompute", p),))
              for p in ("selective", "full")]]


def _fit_live(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan, budget: float,
              kw: dict[str, Any]) -> Plan | None:
    """``plan`` if its liveness peak fits ``budget``, else :func:`_tighten`'s plan with the
    same techniques, if one fits; else None. Pinned or merged sub-problems are left to their
    caller."""
    if plan.predicted.memory.peak <= budget or kw.get("fixed") or kw.get("merge") is not None:
        return plan
    fit, _ = _tighten(traced, mesh, options, plan, budget, kw, kw.get("offload"))
    return fit


TIGHTEN = 6      # rounds of the outer loop per set of techniques (docs/cost-model.md §4.6)


def _tighten(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan, budget: float,
             kw: dict[str, Any], offload: OffloadLevel | None = None
             ) -> tuple[Plan | None, list[Plan]]:
    """The outer loop that holds the step's peak to ``budget`` (docs/cost-model.md §4.6): the ILP
    bounds the sum of what forward saves and the model state, which lies below the liveness
    peak by what backward's gradients and the optimizer's temporaries add; so solve again with
    the ILP's bound lowered by the peak's excess, with ``plan``'s techniques, until the peak
    fits, the ILP finds no plan, or :data:`TIGHTEN` rounds are spent; ``offload``: the offload
    level offered (default: as far as ``plan`` went). The peak need not fall
    as fast as the sum (a 16-bit parameter the ILP moves off the device takes its fp32
    gradient copy out of the optimizer step too; a layout that saves less may gather more), so
    each round that leaves the peak above the budget doubles the next one's cut. (The plan that
    fits, or None; every plan solved on the way.)"""
    solved: list[Plan] = []
    p = plan
    offload = offload_level(plan) if offload is None else offload
    for k in range(TIGHTEN):
        live = p.predicted.memory.peak
        if live <= budget:
            return p, solved
        lower = p.predicted.ilp_sum_bytes - (live - budget) * 2**k
        if lower <= 0:
            break
        try:
            with progress.step(f"re-planning for the step's peak (ILP bound {gib(lower)})"):
                # A refusal ends the loop whatever least memory it names: no exact figure. The
                # budget is below this plan's own sum: memory binds (ilp.py BINDING_BACKENDS).
                p = plan_once(traced, mesh, options.replace(memory_budget=lower),
                              **{**kw, "offload": offload}, recompute=dict(p.recompute),
                              least_exact=False, binds=True)
        except AutoshardError:
            break
        p = replace(p, options=options)
        solved.append(p)
    return (p if p.predicted.memory.peak <= budget else None), solved


def fit_budget(traced: TracedGraph, mesh: Mesh, options: PlanOptions, plan: Plan, *,
                model_name: str, trace_s: float) -> Plan:
    """``plan``, or a plan whose step peaks within the memory budget, or a refusal: the budget
    is the step's peak over forward, backward and the optimizer step (cost/liveness.py). The
    plan's own techniques are tightened first (:func:`_tighten`); then the ones that lower the
    phase that binds: optimizer offload, then parameter offload, for an optimizer-step peak;
    full checkpointing for a forward or backward one (then offload too), as far as ``options``
    allows. None fits: an error naming the least peak found, and its phase."""
    budget = device_budget(mesh.cluster, options.memory_budget)
    if plan.predicted.memory.peak <= budget:
        return plan
    kw = {"model_name": model_name, "fixed": None, "trace_s": trace_s, "merge": None}
    fit, tried = _tighten(traced, mesh, options, plan, budget, kw)
    tried.append(plan)
    techniques = [_technique(plan.recompute, offload_level(plan))]
    remedies = [] if fit is not None else remedy_tries(traced, options, plan)
    techniques += [t.label.removeprefix(_REMEDY) for t in remedies]

    def solve(t: Try) -> Plan | None:
        """The remedy's plan, tightened to the budget if it can be (None: it cannot)."""
        # A remedy's refusal is not reported (the error below names the plans solved).
        p = plan_once(traced, mesh, options, **kw, recompute=t.get("recompute"),
                      offload=t.get("offload"), least_exact=False)
        fit, more = _tighten(traced, mesh, options, p, budget, kw, t.get("offload"))
        tried.extend([p, *more])
        return fit

    if remedies:
        # The first remedy that fits is kept: they are ordered by what they cost.
        fit, _ = run_search("budget remedies", remedies, solve, until=lambda p: True,
                            recoverable=lambda e: isinstance(e, BudgetError)
                            or isinstance(e.__cause__, NoSolution), error_of_none="none")
    if fit is not None:
        return fit
    least = min(tried, key=lambda p: p.predicted.memory.peak)
    need = budget_for(least.predicted.memory.peak)
    raise BudgetError(
        f"a plan whose step peaks within the memory budget of {gib(budget_for(budget))} per "
        f"device (forward, backward and the optimizer step, cost/liveness.py, with the "
        f"allocator's slack, docs/cost-model.md §4.6)",
        got=f"none; the least memory any plan found needs is {gib(need)} per device, at "
            f"its {least.predicted.peak_phase} peak; techniques tried: "
            f"{'; '.join(dict.fromkeys(techniques))}",
        fix="raise memory_budget, use a larger mesh, or a smaller batch"
            + ("" if options.offload == OffloadLevel.AUTO
               else ", or allow offload (offload='auto')")
            + ("" if options.recompute == "auto"
               else ", or allow activation checkpointing (recompute='auto')"),
        least_bytes=need, phase=least.predicted.peak_phase)


def remedy_tries(traced: TracedGraph, options: PlanOptions, plan: Plan) -> list[Try]:
    """The techniques to try, in order, when ``plan``'s step peaks above the budget: those that
    lower its binding phase first (an optimizer-step peak falls with offload, which takes the
    optimizer state off the device; a forward or backward one with checkpointing), as far as
    ``options`` allows them, each with ``plan``'s others."""
    recompute, offload = dict(plan.recompute), offload_level(plan)
    layers = checkpointable(traced.graph, traced.layers) if traced.training else []
    ckpt = [dict.fromkeys(layers, "full")] if layers and options.recompute == "auto" \
        and plan.recompute != dict.fromkeys(layers, "full") else []
    offloads: list[OffloadLevel] = []
    if options.offload == OffloadLevel.AUTO and traced.training \
            and options.state_optimizer not in ("none", "sgd"):
        # Up the ladder from where the plan is: parameter offload is not built for stages.
        offloads = [o for o in (OffloadLevel.OPTIMIZER, OffloadLevel.PARAMETERS)
                    if o != offload and (o == OffloadLevel.OPTIMIZER or options.stage_run is None)
                    and not (o == OffloadLevel.OPTIMIZER and offload == OffloadLevel.PARAMETERS)]
    if plan.predicted.peak_phase == Phase.OPTIMIZER:
        out = [(recompute, o) for o in offloads] + [(c, offloads[-1] if offloads else offload)
                                                    for c in ckpt]
    else:
        out = [(c, offload) for c in ckpt] + [(ckpt[0] if ckpt else recompute, o)
                                              for o in offloads]
    return [Try(_REMEDY + _technique(r, o), (("recompute", r), ("offload", o))) for r, o in out]


_REMEDY = "the step peaks above the budget: with "


def _technique(recompute: dict[str, str], offload: OffloadLevel) -> str:
    policies = sorted(set(recompute.values()))
    ckpt = f"{'/'.join(policies)} checkpointing of {len(recompute)} layers" if recompute \
        else "no checkpointing"
    return ckpt + {OffloadLevel.NONE: "", OffloadLevel.OPTIMIZER: ", optimizer offload",
                   OffloadLevel.PARAMETERS: ", parameter offload"}[offload]


def _plan_partial(traced: TracedGraph, mesh: Mesh, options: PlanOptions, best: Plan,
                  layers: Sequence[str], budget: float, **kw: Any) -> Plan | None:
    """Checkpointing per layer: when the fastest plan applies one policy to every layer, the
    first k layers with it and the rest with a cheaper one (full over selective or none,
    selective over none) may fit too, with less recomputation: Megatron-LM's
    ``--recompute-num-layers`` (block method), the per-layer search of Galvatron and Mist. For
    each cheaper policy the least such k is found by pricing ``best``'s own layouts (memory never
    falls as fewer layers recompute; the sum the ILP bounds, as the ladder compares), raised a
    little until the step's liveness peak fits too. The faster of these, with ``best``'s
    layouts, if it beats ``best``, else None. (Solving the ILP again at that k might find faster
    layouts, at the price of one more solve.)"""
    policies = set(best.recompute.values())
    if len(policies) != 1 or len(best.recompute) != len(layers) or len(layers) < 2:
        return None
    hi = policies.pop()
    with progress.step(f"checkpointing per layer: {hi} on the first layers only"):
        candidates = _partial_candidates(traced, mesh, options, best, layers, budget, hi, **kw)
    if not candidates:
        return None
    pick = min(candidates, key=lambda p: p.predicted.step_time_s)
    # ``best`` may still be re-planned for its own liveness peak: never faster than it is now.
    return pick if pick.predicted.step_time_s < best.predicted.step_time_s else None


def _partial_candidates(traced: TracedGraph, mesh: Mesh, options: PlanOptions, best: Plan,
                        layers: Sequence[str], budget: float, hi: str, **kw: Any) -> list[Plan]:
    """For each policy cheaper than ``hi``: best's layouts with the first k layers under ``hi``
    and the rest under it, at the least k that fits (see :func:`_plan_partial`)."""
    strategies = best.strategies()

    def fits(p: Plan) -> bool:      # the ILP's bound and the step's liveness peak alike
        return max(p.predicted.ilp_sum_bytes, p.predicted.memory.peak) <= budget

    candidates = []
    for lo in {"full": ("selective", None), "selective": (None,)}[hi]:
        def mixed(k: int, lo: str | None = lo) -> dict[str, str]:
            out = {layer: hi for layer in layers[:k]}
            if lo is not None:
                out.update({layer: lo for layer in layers[k:]})
            return out

        # The least k whose memory sum (on best's layouts, as the ILP bounds it) fits; with
        # every layer recomputed (k = n) it is best's own.
        hi_k = least_fitting(lambda k, rc=mixed: forward_memory(
            grouped(traced, rc(k)), mesh, strategies, options, rc(k), best.joint_groups()),
            len(layers), best.predicted.ilp_sum_bytes, budget)
        # The step's liveness peak lies above that sum (backward's gradients, the optimizer's
        # temporaries): a few more layers recomputed until it fits too.
        for k in sorted({hi_k, hi_k + max(1, len(layers) // 8), hi_k + len(layers) // 4}):
            if k >= len(layers):
                break
            rc = mixed(k)
            p = assemble(grouped(traced, rc), mesh, strategies, options,
                         solver=dict(best.solver), model_name=kw.get("model_name", ""),
                         timings=dict(best.timings), recompute=rc, joint=best.joint_groups())
            # Not solved again: the layouts are best's, priced with these policies.
            p = replace(p, solver={**p.solver, "objective": p.predicted.step_time_s,
                                   "note": f"layouts solved with every layer {hi}; "
                                           f"checkpointing then priced per layer"})
            if fits(p):
                candidates.append(p)
                break
    return candidates


def least_fitting(memory: Callable[[int], float], n: int, at_n: float, budget: float) -> int:
    """The least k in [0, n] with ``memory(k) <= budget``, where ``memory`` does not grow with k
    and ``memory(n) = at_n`` (n where even that does not fit): where the layers are alike, three
    pricings (k = 0, the count the line gives, and the one below it; solver/search.py
    ``fitting_edge``)."""
    if at_n > budget:
        return n
    return fitting_edge(memory, n, 0, budget, m_fit=at_n)

