"""Where a pipeline's layers are cut into stages (docs/cost-model.md §10, §10.4): dynamic
programs over the cut points that minimise the slowest stage within memory (Alpa's stage
construction, Zheng et al. 2022, arXiv 2201.12023 §5, here on one axis), on the per-layer figures
of solver/stage_figures.py, and each cut's stages held to the budget by their walked peaks
(:class:`StageWalk`). Kept apart from the schedule search (solver/pipeline.py), which runs these
once per schedule and compares the steps."""
from __future__ import annotations

from autoshard.cost.liveness import MemoryBreakdown, stage_memory
from autoshard.cost.price import Pricer
from autoshard.cost.program import StepProgram, stage_program
from autoshard.mesh import Mesh
from autoshard.schedules import in_flight, rank_stages, sends_between
from autoshard.trace.export import TracedGraph

# Rounds of the cut search per schedule, each with its memory bound lowered by the walked
# peak's excess (docs/cost-model.md §10.4), before the schedule is found not to fit.
ROUNDS = 4


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


def cut_stages(secs, comm, send, state, acts, p: int, m: int, schedule: str, budget: float,
               *, stages: int):
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


def cut_v_stages(secs, comm, send, state, acts, p: int, m: int, schedule: str, budget: float):
    """V-placed stages (rank ``r``: stages ``r`` and ``2p - 1 - r``) minimising the slowest
    stage's seconds per microbatch with every *rank* within ``budget`` (its two stages'
    microbatches in flight together), or None. :func:`cut_stages` holds each stage within half a
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
