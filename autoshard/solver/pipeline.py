"""Pipeline planning: cut the model's layers into stages along one mesh axis (docs/cost-model.md
§10).

The graph is traced for one microbatch. Every stage runs its part of that graph as one SPMD plan
over the other axes of the mesh, and stages built from identical layers take identical
decisions, so that plan is solved once, for the whole graph, on the sub-mesh (the ILP's
identical-layer templates make one layer's decision every layer's). Its prices then give each
layer's seconds per microbatch and its memory, and a dynamic program over the cut points (Alpa's
stage construction, Zheng et al. 2022, arXiv 2201.12023 §5, here on one axis) picks the stages
that minimise the slowest one within the device memory, with each schedule's microbatches in
flight (autoshard/schedules.py). The step: the schedule's forward and backward over every
microbatch, its order of actions run with the stages' own seconds (``simulate_schedule``), then
the slowest stage's gradient sync (its buckets run once, after the last microbatch) and
optimizer step. The SPMD plan is chosen for one microbatch's run, which bears
1/m of the gradient sync and optimizer step (cost/price.py ``step_share``), as the pipelined
step does.
"""
from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Sequence

from autoshard import progress
from autoshard.cost.liveness import MemoryBreakdown, stage_memory
from autoshard.cost.memory import budget_for, device_budget
from autoshard.cost.comm import link_time
from autoshard.cost.compute import local_numel
from autoshard.cost.overlap import bucket_bytes_by_axis, gradient_buckets
from autoshard.cost.price import Pricer
from autoshard.cost.program import StepProgram, program_for, stage_program
from autoshard.cost.reshards import reshard_edges
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Spec
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.plans.records import CollectiveRecord, NodePlan, Pipeline, Stage
from autoshard.schedules import (SCHEDULES, SPLIT_BACKWARD, V_PLACED, VIRTUAL_STAGES,
                                 WARMUP_BYTES, check_microbatches, fullest_stage, in_flight, rank_stages,
                                 sends_between, simulate_schedule, stage_rank, warmup_node)
from autoshard.solver.search import Try, run_search
from autoshard.trace.export import TracedGraph
from autoshard.trace.graph import value_inputs
from autoshard.trace.layers import stages_of

DUMMY = "_"          # the axis of a one-device sub-mesh (a mesh that is all pipeline)
# Rounds of the cut search per schedule, each with its memory bound lowered by the walked
# peak's excess (docs/cost-model.md §10.4), before the schedule is found not to fit.
ROUNDS = 4


def sub_mesh(mesh: Mesh, axis: int) -> Mesh:
    """``mesh`` without its pipeline axis, each other axis on its own link."""
    keep = [i for i in range(mesh.ndim) if i != axis]
    if not keep:
        return Mesh((1,), (DUMMY,), cluster=mesh.cluster)
    return Mesh(tuple(mesh.shape[i] for i in keep), tuple(mesh.axes[i] for i in keep),
                cluster=mesh.cluster, links=tuple(mesh.links[i] for i in keep))


def expand_spec(spec: Spec, axis: int, ndim: int, sub_ndim: int) -> Spec:
    """A sub-mesh spec on the whole mesh: replicated over the pipeline axis."""
    placements = list(spec) if ndim > 1 else []
    placements.insert(axis, Replicate())
    assert len(placements) == ndim and (ndim > 1 or sub_ndim == 1)
    return tuple(placements)


def plan_pipelined(traced: TracedGraph, mesh: Mesh, options: PlanOptions, *, model_name: str,
                   trace_s: float, plan_spmd: Any) -> Plan:
    """The pipelined plan of ``traced`` (one microbatch) on ``mesh``; ``plan_spmd`` plans a
    graph on a mesh without a pipeline (planner.plan_traced)."""
    axis_name = options.pipeline
    if axis_name not in mesh.axes:
        raise AutoshardError(f"PlanOptions.pipeline naming an axis of the mesh {mesh.axes}",
                             got=repr(axis_name), fix="pass one of the mesh's axis names")
    a = mesh.axes.index(axis_name)
    p = mesh.shape[a]
    layers = [layer.name for layer in traced.layers]
    if not traced.training:
        raise AutoshardError("a training plan when pipelining", got="training=False",
                             fix="plan inference without a pipeline (pipeline=None)")
    if p < 2:
        raise AutoshardError("a pipeline axis of 2 or more devices",
                             got=f"axis {axis_name} of {p} device",
                             fix="pipeline over an axis of 2 or more devices (a larger mesh "
                                 "axis), or plan without a pipeline")
    if len(layers) < p:
        raise AutoshardError("at least one layer per pipeline stage",
                             got=f"axis {axis_name} of {p} devices, {len(layers)} layers",
                             fix="pipeline over a smaller axis, or plan without a pipeline")
    m = options.microbatches
    if not isinstance(m, int):
        raise AutoshardError("a number of microbatches here", got=repr(m),
                             fix="autoshard.plan and the CLI choose it; pass an int to "
                                 "plan_traced")
    if options.schedule != "auto":
        check_microbatches(options.schedule, p, m)
    sub = sub_mesh(mesh, a)
    budget = device_budget(mesh.cluster, options.memory_budget)
    # The sub-plan holds every layer's state where a stage holds 1/p of it: its bound is the
    # stage's budget times p (the stages' exact peaks are checked below).
    # Its activations weigh the microbatches the fullest stage keeps alive, and each run of it
    # bears 1/m of the step's gradient sync and optimizer step (PlanOptions.stage_run).
    sub_options = options.replace(pipeline=None, memory_budget=budget_for(budget) * p,
                                  microbatches="auto",
                                  stage_run=(m, fullest_stage(options.schedule, p, m)))
    if options.schedule in SPLIT_BACKWARD and options.recompute == "auto":
        sub_options = sub_options.replace(recompute="none")     # see ``recomputed`` below
    with progress.step(f"layouts of the stages over {','.join(sub.axes)}, {m} microbatches"):
        spmd = plan_spmd(traced, sub, sub_options, model_name=model_name, trace_s=trace_s)
    # The sub-mesh has at most two axes (meshes have three): no axes merged, no joint groups.
    assert not spmd.joint_axes, spmd.joint_axes
    strategies = spmd.strategies()
    # Priced per step (the optimizer step whole), as the stages' figures are.
    pricer = Pricer(traced, sub, sub_options.replace(stage_run=None),
                    recompute=dict(spmd.recompute))
    graph = traced.graph
    # Seconds and bytes per layer; what comes before the first layer counts with it, what
    # comes after the last with that one (trace/layers.py stages_of, one layer per stage).
    L = len(layers)
    where = stages_of(graph, traced.layers, tuple((name,) for name in layers))
    secs, state, acts, opt, comm, sync, fwd, wgt = ([0.0] * L for _ in range(8))
    for n in graph.nodes:
        if n.name not in strategies:
            continue
        st, i = strategies[n.name], where[n.name]
        if n.op == "placeholder":
            state[i] += pricer.memory(n.name, st)
            opt[i] += pricer.compute(n.name, st)         # its optimizer step
        else:
            secs[i] += pricer.compute(n.name, st)
            acts[i] += pricer.memory(n.name, st)
            # Its forward, and its share of the weights' gradient (W of a split backward,
            # autoshard/schedules.py): half its backward, as for a matmul (dX and dW cost
            # alike); a recomputed forward runs with B.
            f, b = pricer.times(n.name, st)
            fwd[i] += f
            wgt[i] += b / 2
    # Saved copies of resharded values (what a consumer saves in its own layout), on the layer
    # of the value they copy, as the ILP's memory sum counts them (Pricer.saved_copies).
    for ref, cons in pricer.saved_inputs().items():
        src = strategies[ref[0]].outputs[ref[1]]
        for dst in dict.fromkeys(strategies[c].inputs[k] for c, k in cons):
            acts[where.get(cons[0][0], where.get(ref[0], 0))] += \
                pricer.saved_copy_bytes(ref, src, dst) * pricer.copy_weight(ref, cons, src, dst)
    # Collectives of one microbatch, on the layer of the op that runs them; gradient buckets,
    # synced once per step after the last microbatch (codegen/buckets.py ``defer``), on their
    # first member's, with the optimizer step.
    for c in spmd.collectives:
        if c.members:
            sync[where.get(c.members[0], L - 1)] += _record_seconds(c, sub)
        elif c.phase != "optimizer":
            comm[where.get(c.node, L - 1)] += _record_seconds(c, sub)
    boundary = (_boundary_bytes(traced, where, strategies, sub),
                _boundary_bytes(traced, where, strategies, sub, grads=pricer.grads))
    link = mesh.links[a]
    # Activations forward, their gradients backward: one send each way per microbatch.
    send = [link_time(link, "send_recv", 2, f) + link_time(link, "send_recv", 2, b)
            for f, b in zip(*boundary)]
    # A split backward (zero bubble) computes the weights' gradients in autograd runs apart
    # from the inputs': a checkpointed layer's forward would run again in each of them
    # (torch.utils.checkpoint recomputes per backward run), so it is offered without one.
    recomputed = sorted(k for k, v in spmd.recompute.items() if v != "none")
    if options.schedule != "auto":
        schedules: tuple[str, ...] = (options.schedule,)
        if L < p * VIRTUAL_STAGES[options.schedule]:
            raise AutoshardError(f"at least {p * VIRTUAL_STAGES[options.schedule]} layers for "
                                 f"{options.schedule} on {p} ranks (one per stage)",
                                 got=f"{L} layers", fix="schedule='1F1B', or fewer ranks")
        if _needs_rounds(options.schedule) and m % p:
            raise AutoshardError(f"a number of microbatches divisible by the {p} pipeline ranks "
                                 f"for {options.schedule} (as Megatron-LM requires; the "
                                 f"activations it keeps are priced for whole rounds of {p})",
                                 got=f"{m} microbatches",
                                 fix=f"microbatches={m - m % p or p}, or schedule='1F1B'")
        if options.schedule in SPLIT_BACKWARD and recomputed:
            raise AutoshardError(f"{options.schedule} without activation checkpointing (its "
                                 f"split backward would recompute a layer once per weight "
                                 f"group)", got=f"{len(recomputed)} layers recomputed "
                                 f"({recomputed[0]}, ...)",
                                 fix="recompute='none', or schedule='Interleaved1F1B'")
    else:
        schedules = tuple(x for x in SCHEDULES if L >= p * VIRTUAL_STAGES[x]
                          and not (_needs_rounds(x) and m % p)
                          and not (x == "DualPipeV" and m < 2 * p)
                          and not (x in SPLIT_BACKWARD and recomputed))
    # Each stage's peak is the liveness walk of its part of the step program (§10.4).
    walker = StageWalk(traced, strategies, pricer, program_for(traced, strategies, pricer),
                       where, sub, p, m)

    def solve(t: Try):
        schedule = t.get("schedule")
        v = VIRTUAL_STAGES[schedule]
        # A rank holds v stages: each within 1/v of its memory.
        tries = [walker.fitting(lambda b: _cuts(
            secs, comm, send, state, acts, p, m, schedule, b / v, stages=p * v),
            budget, schedule)]
        if schedule in V_PLACED:
            tries.append(walker.fitting(lambda b: _cuts_v(
                secs, comm, send, state, acts, p, m, schedule, b), budget, schedule))
        # Each cut priced by running the schedule's order with its stages' own seconds
        # (``_schedule_seconds``): the closed forms the cut search balances hold for balanced
        # stages only.
        priced = []
        for c, peaks in (t for t in tries if t is not None):
            f = _stage_figures(c, secs, comm, send, state, acts, opt, sync, fwd, wgt, p, m,
                               schedule)
            for fig, peak in zip(f, peaks):
                fig["peak_bytes"] = peak.peak
            priced.append((_schedule_seconds(f, m, p, schedule, comm=True)
                           + _per_rank(f, p, schedule, "optimizer_s", "sync_s"), c, f))
        if not priced:
            progress.note(f"{schedule}: no cut into {p * v} stages fits")
            return None
        step, cuts, figures = min(priced, key=lambda x: x[0])
        # Equal times: fewer microbatches in flight, then fewer sends, then one backward pass;
        # of the split ones, the V (a send fewer, its activations even across the ranks).
        key = (step, schedule != "1F1B", VIRTUAL_STAGES[schedule] > 1,
               schedule in SPLIT_BACKWARD, schedule not in V_PLACED)
        progress.note(f"{schedule}: {p * v} stages, step {step * 1e3:.3f} ms")
        return key, schedule, cuts, figures, step

    best, _ = run_search(schedule_tries(schedules), solve, price=lambda c: c[0]) \
        if schedules else (None, [])
    if best is None:
        raise AutoshardError(f"pipeline stages within the memory budget of {budget / 2**30:.2f} "
                             f"GiB per device",
                             got=f"no cut of {L} layers into stages on {p} ranks fits with {m} "
                                 f"microbatches under {' or '.join(schedules)}",
                             fix="use more pipeline stages, a larger mesh, the 1F1B schedule, "
                                 "or activation checkpointing (recompute='full')")
    _, schedule, cuts, figures, step = best
    stage_layers = tuple(tuple(layers[i] for i in range(lo, hi)) for lo, hi in cuts)
    return _assemble(traced, mesh, a, spmd, sub, pricer, stage_layers, cuts, figures, boundary,
                     schedule, m, step, options)


class StageWalk:
    """Each stage's peak for a cut: the liveness walk (cost/liveness.py ``stage_memory``) of
    its part of the step program (cost/program.py ``stage_program``: its ops, its buckets, its
    optimizer records), with the schedule's microbatches in flight (``in_flight``)."""

    def __init__(self, traced: TracedGraph, strategies: dict, pricer: Pricer,
                 program: StepProgram, where: dict[str, int], sub: Mesh, ranks: int,
                 microbatches: int) -> None:
        self.traced, self.strategies, self.pricer, self.program = traced, strategies, pricer, \
            program
        self.where, self.sub, self.ranks, self.m = where, sub, ranks, microbatches
        self._memo: dict[tuple, MemoryBreakdown] = {}

    def peak(self, lo: int, hi: int, in_flight_mb: int) -> MemoryBreakdown:
        """The peak of a stage of layers ``lo`` to ``hi`` (exclusive) holding ``in_flight_mb``
        microbatches."""
        key = (lo, hi, in_flight_mb)
        if key not in self._memo:
            ops = frozenset(n for n, i in self.where.items() if lo <= i < hi)
            sp = stage_program(self.program, self.traced, self.strategies, ops, self.sub.shape,
                               bucket_bytes=self.pricer.options.bucket_bytes)
            self._memo[key] = stage_memory(self.traced, self.strategies, self.pricer, sp,
                                           in_flight=in_flight_mb)
        return self._memo[key]

    def peaks(self, cuts, schedule: str) -> list[MemoryBreakdown]:
        return [self.peak(lo, hi, in_flight(schedule, s, self.ranks, self.m))
                for s, (lo, hi) in enumerate(cuts)]

    def fitting(self, search, budget: float, schedule: str):
        """(cuts, their stages' peaks) from ``search`` (a bound on the sums -> cuts or None)
        whose every rank's walked peak (its stages' summed: an upper bound where a rank holds
        two) is within ``budget``; the bound lowered by the excess for at most ``ROUNDS``
        rounds. None where no cut fits."""
        bound = budget
        for _ in range(ROUNDS):
            cuts = search(bound)
            if cuts is None:
                return None
            peaks = self.peaks(cuts, schedule)
            worst = max(sum(peaks[s].peak for s in rank_stages(schedule, self.ranks, r))
                        for r in range(self.ranks))
            if worst <= budget:
                return cuts, peaks
            bound -= worst - budget
        return None


def schedule_tries(schedules: Sequence[str]) -> list[Try]:
    """The schedule search's tries: each schedule's fastest cut into stages that fits,
    compared on its step (ties: the simpler schedule), and only the winner assembled."""
    return [Try(s, (("schedule", s),), announce=False) for s in schedules]


def _needs_rounds(schedule: str) -> bool:
    """Whether ``schedule`` takes microbatches in rounds of ``p`` (the looped interleaved
    schedules, as Megatron-LM's; torch's ZB-V takes any number, DualPipeV any from ``2p``:
    autoshard/schedules.py ``check_microbatches``)."""
    return VIRTUAL_STAGES[schedule] > 1 and schedule not in V_PLACED


def _record_seconds(c: CollectiveRecord, mesh: Mesh) -> float:
    axis = mesh.axes.index(c.axes[0])
    return link_time(mesh.links[axis], c.kind, mesh.shape[axis], c.bytes)


def _boundary_bytes(traced: TracedGraph, where: dict[str, int], strategies: dict,
                    sub: Mesh, grads: set[str] | None = None) -> list[float]:
    """Bytes one rank sends forward after each layer if a stage ended there: every value made
    at or before it (graph inputs included) and read after it, in its local layout; with
    ``grads`` (the values with a gradient), only those: the gradients sent back."""
    L = max(where.values()) + 1
    out = [0.0] * L
    for n in traced.graph.nodes:
        if n.op == "output" or (n.op == "placeholder" and
                                traced.placeholder(n.name).kind != "input"):
            continue
        made = 0 if n.op == "placeholder" else where.get(n.name, 0)   # inputs enter stage 0
        readers = [where[u.name] for u in n.users if u.name in where]
        if not readers or "val" not in n.meta or not hasattr(n.meta["val"], "shape"):
            continue
        last = max(readers)
        src, k = (n.args[0].name, n.args[1]) if n.target is operator.getitem else (n.name, 0)
        if grads is not None and src not in grads:
            continue
        spec = strategies[src].outputs[k] if src in strategies and \
            len(strategies[src].outputs) > k else None
        nbytes = local_numel(tuple(n.meta["val"].shape), spec, sub.shape) \
            * n.meta["val"].element_size()
        for k in range(made, last):
            out[k] += nbytes
    return out


def _schedule_seconds(figures: list[dict], m: int, ranks: int, schedule: str, *,
                      comm: bool) -> float:
    """The schedule's forward and backward over ``m`` microbatches, of the stages' compute, and
    their communication with ``comm``: its order of actions run with each stage's own F, B and W
    seconds (autoshard/schedules.py ``simulate_schedule``; exact for uneven stages, where the
    closed forms are not). F is a stage's forward and, under a split backward, W its weights'
    gradient (``_stage_figures``); its communication (collectives and sends, forward and
    backward about alike) counts half with F, half with B, none with W. Without a split
    backward B is the rest, the whole backward."""
    total = [f["compute_s"] + (f["comm_s"] if comm else 0.0) for f in figures]
    forward = [f["forward_s"] + (f["comm_s"] / 2 if comm else 0.0) for f in figures]
    weight = [f["weight_s"] if schedule in SPLIT_BACKWARD else 0.0 for f in figures]
    backward = [t - x - y for t, x, y in zip(total, forward, weight)]
    return simulate_schedule(schedule, ranks, m, forward, backward, weight)


def _per_rank(figures: list[dict], ranks: int, schedule: str, *keys: str) -> float:
    """The largest sum of ``keys`` over one rank's stages (rank ``r``: stages ``r``, ``r + p``,
    ..., or ``r`` and ``2p - 1 - r`` V-placed)."""
    return max(sum(figures[s][k] for s in rank_stages(schedule, ranks, r) for k in keys)
               for r in range(ranks))


def _cuts(secs, comm, send, state, acts, p: int, m: int, schedule: str, budget: float, *,
          stages: int):
    """``stages`` stages as (first layer, end) pairs minimising the slowest stage's seconds per
    microbatch, every stage within ``budget`` with the schedule's microbatches in flight on ``p``
    ranks: a dynamic program over the cut points, O(L² · stages). A cut between two stages of one
    rank (the turn of a V) sends nothing."""
    L = len(secs)
    n = stages
    inf = float("inf")
    # best[s][j]: the least max over stages 0..s-1 covering layers 0..j-1; arg for the cut.
    best = [[inf] * (L + 1) for _ in range(n + 1)]
    arg = [[-1] * (L + 1) for _ in range(n + 1)]
    best[0][0] = 0.0
    for s in range(1, n + 1):
        for j in range(s, L - (n - s) + 1):
            for i in range(s - 1, j):
                if best[s - 1][i] == inf:
                    continue
                mem = sum(state[i:j]) + in_flight(schedule, s - 1, p, m) * sum(acts[i:j])
                if mem > budget:
                    continue
                t = sum(secs[i:j]) + sum(comm[i:j]) \
                    + (send[j - 1] if j < L and sends_between(schedule, p, s - 1) else 0.0) \
                    + (send[i - 1] if i > 0 and sends_between(schedule, p, s - 2) else 0.0)
                v = max(best[s - 1][i], t)
                if v < best[s][j]:
                    best[s][j], arg[s][j] = v, i
    if best[n][L] == inf:
        return None
    cuts, j = [], L
    for s in range(n, 0, -1):
        i = arg[s][j]
        cuts.append((i, j))
        j = i
    return cuts[::-1]


def _cuts_v(secs, comm, send, state, acts, p: int, m: int, schedule: str, budget: float):
    """V-placed stages (rank ``r``: stages ``r`` and ``2p - 1 - r``) minimising the slowest
    stage's seconds per microbatch with every *rank* within ``budget`` (its two stages'
    microbatches in flight together), or None. :func:`_cuts` holds each stage within half a
    rank's memory; but a rank's early stage keeps ``2p - r`` microbatches and its late one
    ``r + 1``, so the early one may take more than half. Stages stay balanced, not only ranks:
    torch's order of actions runs a rank's two stages in turn, and with uneven ones (1 layer
    and 5 on every rank of GPT-3 175B) it idles 12% beyond the same ranks' balanced time (the
    plan prices the cut it keeps by running that order: autoshard/schedules.py
    ``simulate_schedule``). A dynamic program over the ranks from the outside
    in, on (left cut, right cut) pairs, a stage at most ``width`` layers wide (vectorised over
    the pairs)."""
    import numpy as np
    L, n = len(secs), 2 * p
    if L < n:
        return None
    width = min(L - n + 1, max(4, 4 * -(-L // n)))
    t = np.concatenate(([0.0], np.cumsum(np.add(secs, comm))))
    st = np.concatenate(([0.0], np.cumsum(state)))
    ac = np.concatenate(([0.0], np.cumsum(acts)))
    cut_send = np.array([0.0, *send[:L - 1], 0.0])        # the send at cut j (layers j-1 | j)
    inf = float("inf")
    best = np.full((L + 1, L + 1), inf)                   # [left cut, right cut]
    best[0, L] = 0.0
    moves = []
    for r in range(p):
        lo, hi = r, n - 1 - r
        last = r == p - 1
        nxt = np.full((L + 1, L + 1), inf)
        arg = np.zeros((L + 1, L + 1, 2), dtype=np.int32)
        sl = (cut_send * sends_between(schedule, p, lo - 1)) if lo > 0 else 0 * cut_send
        sr = cut_send * sends_between(schedule, p, hi)
        for dx in range(1, width + 1):
            x = np.arange(L + 1 - dx)
            left = t[x + dx] - t[x] + sl[x] + cut_send[x + dx] * sends_between(schedule, p, lo)
            mem_l = st[x + dx] - st[x] + in_flight(schedule, lo, p, m) * (ac[x + dx] - ac[x])
            for dy in range(1, width + 1):
                y = np.arange(dy, L + 1)
                right = t[y] - t[y - dy] + sr[y] \
                    + cut_send[y - dy] * sends_between(schedule, p, hi - 1)
                mem_r = st[y] - st[y - dy] + in_flight(schedule, hi, p, m) * (ac[y] - ac[y - dy])
                cand = np.maximum(best[:L + 1 - dx, dy:],
                                  np.maximum(left[:, None], right[None, :]))
                gap = (y - dy)[None, :] - (x + dx)[:, None]     # layers left in the middle
                ok = (mem_l[:, None] + mem_r[None, :] <= budget) & (
                    gap == 0 if last else gap >= 2 * (p - 1 - r))
                cand = np.where(ok, cand, inf)
                view = nxt[dx:, :L + 1 - dy]
                better = cand < view
                view[better] = cand[better]
                arg[dx:, :L + 1 - dy][better] = (dx, dy)
        best = nxt
        moves.append(arg)
    ends = np.diagonal(best)
    x = int(np.argmin(ends))
    if not np.isfinite(ends[x]):
        return None
    bounds_l, bounds_r, y = [x], [x], x
    for arg in reversed(moves):
        dx, dy = (int(v) for v in arg[x, y])
        x, y = x - dx, y + dy
        bounds_l.append(x)
        bounds_r.append(y)
    cuts_at = bounds_l[::-1] + bounds_r[1:]               # 0, ..., x (the V's turn), ..., L
    return [(cuts_at[s], cuts_at[s + 1]) for s in range(n)]


def _stage_figures(cuts, secs, comm, send, state, acts, opt, sync, fwd, wgt, p, m, schedule
                   ) -> list[dict]:
    L = len(secs)
    out = []
    for s, (i, j) in enumerate(cuts):
        sends = (send[j - 1] if j < L and sends_between(schedule, p, s) else 0.0) \
            + (send[i - 1] if i > 0 and sends_between(schedule, p, s - 1) else 0.0)
        out.append({"compute_s": sum(secs[i:j]), "comm_s": sum(comm[i:j]) + sends,
                    "forward_s": sum(fwd[i:j]), "weight_s": sum(wgt[i:j]),
                    "optimizer_s": sum(opt[i:j]), "sync_s": sum(sync[i:j]),
                    "ilp_memory_bytes": sum(state[i:j])
                    + in_flight(schedule, s, p, m) * sum(acts[i:j])})
    return out


def _assemble(traced: TracedGraph, mesh: Mesh, a: int, spmd: Plan, sub: Mesh,
              pricer: Pricer, stage_layers, cuts, figures, boundary, schedule: str, m: int,
              step: float, options: PlanOptions) -> Plan:
    """The whole-mesh Plan: the sub-plan's decisions replicated over the pipeline axis; each
    collective on every stage that runs it (``count``: once per microbatch; the optimizer's
    once), gradient buckets formed per stage (a rank syncs only its stage's parameters), the
    sends between stages and the loss's all-reduce (phase "pipeline")."""
    axis = mesh.axes[a]
    nd, snd = mesh.ndim, len(spmd.mesh_shape)

    def ex(spec: Spec) -> Spec:
        return expand_spec(spec, a, nd, snd)

    graph = traced.graph
    strategies = spmd.strategies()
    where = stages_of(graph, traced.layers, stage_layers)
    params = {ph.name for ph in traced.params}
    edges = list(reshard_edges(graph, strategies, sub.shape, pricer.shapes, params,
                               training=traced.training))
    runs_on = {(e.value[0], e.consumers[0][0]): sorted({where[c] for c, _ in e.consumers
                                                        if c in where})
               for e in edges}
    p = len(stage_layers)                  # stages: the ranks times the virtual stages
    ranks = mesh.shape[a]
    collectives = []
    for c in spmd.collectives:
        if c.members:
            continue                                    # buckets: formed per stage below
        if c.phase == "optimizer":
            stages = holders(traced, c.value, where)
        else:
            stages = runs_on.get((c.value, c.node)) or [where.get(c.node, p - 1)]
        for s in stages:
            collectives.append(replace(c, axes=c.axes, stage=s,
                                       count=1 if c.phase == "optimizer" else m))
    modes = {n: strategies[n].kernel for n in params}
    nodes = [n for n in graph.nodes if n.name in strategies]
    reads = {s: {ref[0] for n in nodes if where.get(n.name) == s and n.op != "placeholder"
                 for ref in value_inputs(n)} & params for s in range(p)}
    # A parameter two stages of one rank read (under a V, the embedding on stage 0 and the head
    # tied to it on stage 2p - 1) has one copy there, synced once: in the first one's buckets.
    bucketed_on: dict[int, set[str]] = {}
    for s in range(p):
        held = bucketed_on.setdefault(stage_rank(schedule, ranks, s), set())
        mine = [e for e in edges if e.value[0] in reads[s] - held]
        held |= reads[s]
        for k, b in enumerate(gradient_buckets(mine, nodes, options.bucket_bytes, modes,
                                               sub.shape)):
            for ax, nbytes in zip(b.axes, bucket_bytes_by_axis(b, sub.shape)):
                collectives.append(CollectiveRecord(b.kind, (sub.axes[ax],), nbytes,
                                                    "grad_sync", f"stage{s}.bucket{k}", "",
                                                    b.members, stage=s))
    link = mesh.links[a]
    tied = tied_stages(traced, where)
    tied_s = 0.0
    for fqn, stages in tied.items():
        # One all-reduce per rank holding the weight (a rank may hold two of its stages).
        by_rank = {stage_rank(schedule, ranks, s): s for s in reversed(stages)}
        if len(by_rank) < 2:
            continue
        ph = next(x for x in traced.params if x.fqn == fqn)
        # The gradient as the stage holds it after backward: reduce-scattered into its bucket's
        # shard under ZeRO-2 or offload (the ParamState's grad spec), whole otherwise.
        st = spmd.param_state.get(fqn)
        nbytes = local_numel(tuple(ph.info.shape), st.grad if st else spmd.params[fqn],
                             spmd.mesh_shape) * ph.info.dtype.itemsize
        tied_s = max(tied_s, link_time(link, "all_reduce", len(by_rank), nbytes))
        for s in sorted(by_rank.values()):
            collectives.append(CollectiveRecord("all_reduce", (axis,), nbytes, "grad_sync",
                                                f"tied:{fqn}", ph.name, stage=s))
    for s in range(p - 1):
        if not sends_between(schedule, ranks, s):
            continue                      # the turn of a V: handed over on one rank, no send
        fwd, bwd = (int(b[cuts[s][1] - 1]) for b in boundary)
        collectives.append(CollectiveRecord("send_recv", (axis,), fwd, "pipeline",
                                            f"stage{s}->stage{s + 1}", stage=s, count=m))
        collectives.append(CollectiveRecord("send_recv", (axis,), bwd, "pipeline",
                                            f"stage{s + 1}->stage{s}", stage=s + 1, count=m))
        # torch's warm-up of the link on the first step, one int32 each way (schedules.py)
        collectives += [CollectiveRecord("send_recv", (axis,), WARMUP_BYTES, "pipeline",
                                         warmup_node(a, b), stage=a) for a, b in ((s, s + 1),
                                                                                  (s + 1, s))]
    collectives.append(CollectiveRecord("all_reduce", (axis,), 4, "pipeline", "loss"))
    stages = tuple(Stage(i, stage_layers[i], {k: figures[i][k] for k in
                                              ("compute_s", "comm_s", "ilp_memory_bytes",
                                               "peak_bytes")})
                   for i in range(p))
    loss_s = link_time(link, "all_reduce", ranks, 4)
    compute = _schedule_seconds(figures, m, ranks, schedule, comm=False) \
        + _per_rank(figures, ranks, schedule, "optimizer_s")
    total = step + loss_s + tied_s
    keep = [x for x in sub.axes if x != DUMMY]
    # Per axis, the collectives of the slowest stage, as often as they run; the pipeline axis
    # the rest of what the step waits for beyond compute (sends, the bubble's share of them).
    slow = max(range(p), key=lambda i: figures[i]["compute_s"] + figures[i]["comm_s"])
    exposed = {x: sum(_record_seconds(c, sub) * c.count for c in collectives
                      if c.stage == slow and c.axes[0] == x) for x in keep}
    # The sub-plan's liveness figures are of the whole model with one microbatch: not a stage's
    # peak. Each stage's is its own "peak_bytes", the walk of its program with the schedule's
    # microbatches in flight (StageWalk), beside "ilp_memory_bytes", the sums the cut search
    # balances.
    inner = {k: v for k, v in spmd.predicted.items() if k not in ("memory", "peak_phase")}
    predicted = {**inner, "step_time_s": total, "compute_s": compute,
                 "comm_s": total - compute,
                 "ilp_memory_bytes": _per_rank(figures, ranks, schedule, "ilp_memory_bytes"),
                 "exposed_comm_s": {**exposed,
                                    axis: max(0.0, total - compute - sum(exposed.values()))},
                 "overlapped_comm_s": {x: 0.0 for x in keep}}
    return replace(spmd, mesh_shape=mesh.shape, mesh_axes=mesh.axes, options=options,
                   nodes=tuple(NodePlan(n.name, n.op, tuple(ex(x) for x in n.inputs),
                                        tuple(ex(x) for x in n.outputs), n.kernel)
                               for n in spmd.nodes),
                   params={k: ex(v) for k, v in spmd.params.items()},
                   inputs={k: ex(v) for k, v in spmd.inputs.items()},
                   tied={k: tuple(ex(x) for x in v) for k, v in spmd.tied.items()},
                   param_state={k: replace(st, grad=ex(st.grad), optimizer=ex(st.optimizer))
                                for k, st in spmd.param_state.items()},
                   collectives=tuple(collectives), predicted=predicted,
                   pipeline=Pipeline(axis, schedule, m, stages, VIRTUAL_STAGES[schedule]),
                   layers=traced.layers)


def holders(traced: TracedGraph, placeholder: str, where: dict[str, int]) -> list[int]:
    """The stages holding a parameter or buffer: every stage with an op reading it."""
    node = traced.graph.find_nodes(op="placeholder", target=placeholder)
    return sorted({where[u.name] for n in node for u in n.users if u.name in where}) or \
        [where.get(placeholder, 0)]


def tied_stages(traced: TracedGraph, where: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Parameters read by more than one stage (a head tied to the embedding), with the stages
    that read them (``where``: node -> stage): each such stage keeps a copy, and their
    gradients are all-reduced over the pipeline axis after the last microbatch (as Megatron-LM
    does for its tied embedding)."""
    out = {}
    for ph in traced.params:
        stages = holders(traced, ph.name, where)
        if len(stages) > 1:
            out[ph.fqn] = tuple(stages)
    return out
