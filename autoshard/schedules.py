"""Pipeline schedules in closed form (docs/cost-model.md §10).

With ``p`` stages and ``m`` microbatches, GPipe (Huang et al. 2019, arXiv 1811.06965) and 1F1B
(PipeDream-Flush: Narayanan et al. 2021, arXiv 2006.09503; Megatron-LM, arXiv 2104.04473 §2.2)
take the same time: one microbatch passes every stage, then the other ``m - 1`` follow at the
pace of the slowest stage. With balanced stages of ``t`` seconds per microbatch (forward and
backward) that is ``(m + p - 1)·t``, an idle fraction of ``(p - 1)/(m + p - 1)`` (the bubble).
They differ in memory: GPipe keeps every microbatch's activations until its backward; 1F1B at
most ``p - i`` on stage ``i``. Interleaved 1F1B (Narayanan et al. 2021, §2.2.2) gives each
rank ``v`` stages (rank ``r`` runs stages ``r``, ``r + p``, ...): the bubble shrinks to
``(p - 1)/(v·m + p - 1)`` for ``v`` times the sends, and a rank's first stage keeps up to
``2p`` microbatches in flight, its second ``p`` (:func:`in_flight`).

The zero-bubble schedules (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241)
split a stage's backward into B, the gradient of its input, which the previous stage waits for,
and W, the gradient of its weights, which nothing waits for: W fills the bubble. For one stage
per rank the paper's ZB-H1 idles ``(p - 1)(T_F + T_B - T_W)`` (§3.1, 1F1B's
``(p - 1)(T_F + T_B + T_W)``) and keeps 1F1B's peak memory. torch.distributed.pipelining's
``ScheduleInterleavedZeroBubble`` (:data:`SCHEDULES` "InterleavedZeroBubble") is that schedule
interleaved, ``v`` = 2 stages per rank placed as Interleaved 1F1B places them; its idle time is
:func:`zero_bubble_idle`, its memory :func:`in_flight`.

ZB-V (Qi et al. 2024, §6; Qi et al. 2024, "Pipeline Parallelism with Controllable Memory",
arXiv 2405.15362) places a rank's two stages as a V: rank ``r`` runs stages ``r`` and
``2p - 1 - r`` (:func:`rank_stages`), so stages ``p - 1`` and ``p`` are on one rank and torch
hands a microbatch between them without a send, and every rank keeps about the same
activations. torch.distributed.pipelining's ``ScheduleZBVZeroBubble`` (:data:`SCHEDULES`
"ZBVZeroBubble") orders it; its time is :func:`zbv_excess` beyond the busy time, its memory
:func:`in_flight`.

DualPipeV (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", arXiv 2412.19437 §3.2.1: DualPipe;
its V-shaped half, DualPipeV, in the deepseek-ai/DualPipe repository) places stages as ZB-V
does and pairs, in its steady state, the forward of one microbatch on one of a rank's stages
with the backward of another on the other, as one action; torch.distributed.pipelining's
``ScheduleDualPipeV`` (:data:`SCHEDULES` "DualPipeV") orders it, takes at least ``2p``
microbatches, and runs a pair's forward and backward one after the other (DeepSeek overlaps
the pair's communication with its computation, not the two computations). Its time is
:func:`dualpipev_excess` beyond the busy time.

The closed forms hold for balanced stages. :func:`simulate_schedule` runs a schedule's own
order of actions (:func:`schedule_order`: torch's, for the split-backward ones) with each
stage's own F, B and W seconds: exact for uneven stages too; the planner prices its stages so.
"""
from __future__ import annotations

import functools
from typing import Sequence

from autoshard.errors import AutoshardError

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
VIRTUAL_STAGES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2,     # stages per rank
                  "InterleavedZeroBubble": 2, "ZBVZeroBubble": 2, "DualPipeV": 2}
# Schedules whose backward runs as B then W, apart (Qi et al. 2024); DualPipeV splits some of
# its backwards (the others run B and W as one action).
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# Schedules placing a rank's two stages as a V: rank r runs stages r and 2p - 1 - r (torch's
# ``generate_stage_to_rank_mapping(style="v")``); the others loop: r, r + p, ...
V_PLACED = ("ZBVZeroBubble", "DualPipeV")


def rank_stages(schedule: str, ranks: int, rank: int) -> tuple[int, ...]:
    """The stages rank ``rank`` of ``ranks`` runs under ``schedule``: ``(r, 2p - 1 - r)`` when
    V-placed, else ``r, r + p, ...`` (its :data:`VIRTUAL_STAGES`)."""
    if schedule in V_PLACED:
        return (rank, 2 * ranks - 1 - rank)
    return tuple(range(rank, ranks * VIRTUAL_STAGES[schedule], ranks))


def stage_rank(schedule: str, ranks: int, stage: int) -> int:
    """The rank running stage ``stage`` (:func:`rank_stages` inverted)."""
    if schedule in V_PLACED and stage >= ranks:
        return 2 * ranks - 1 - stage
    return stage % ranks


# On a schedule's first step torch.distributed.pipelining warms the point-to-point links up:
# every stage sends one 1-element int32 (4 bytes) to its next stage on another rank (the
# forward vote on static shapes) and one back (the result), PipelineStage._warmup_forward_vote
# and _warmup_backward_result (torch 2.13, which pyproject.toml pins).
# Once per schedule: the plan lists them as such, node ``warmup_node(src, dst)``.
WARMUP_BYTES = 4


def warmup_node(src: int, dst: int) -> str:
    """The ledger's name for the warm-up send from stage ``src`` to stage ``dst``."""
    return f"stage{src}->stage{dst}:warmup"


def sends_between(schedule: str, ranks: int, stage: int) -> bool:
    """Whether the values crossing from stage ``stage`` to ``stage + 1`` are sent: not when one
    rank runs both (the turn of a V, which torch hands over in memory)."""
    return stage_rank(schedule, ranks, stage) != stage_rank(schedule, ranks, stage + 1)


def pipeline_seconds(stage_s: Sequence[float], microbatches: int) -> float:
    """One step's forward and backward over every microbatch: ``sum(t_i) + (m - 1)·max(t_i)``,
    ``t_i`` stage ``i``'s seconds per microbatch (its sends included)."""
    return sum(stage_s) + (microbatches - 1) * max(stage_s)


def schedule_seconds(stage_s: Sequence[float], microbatches: int, ranks: int,
                     schedule: str, *, forward_s: Sequence[float] | None = None,
                     weight_s: Sequence[float] | None = None) -> float:
    """A step's forward and backward over every microbatch under ``schedule``, ``stage_s`` the
    seconds per microbatch of each of its ``ranks · v`` stages: :func:`pipeline_seconds` for one
    stage per rank; interleaved, ``(m + (p - 1)/v)·max_r t_r``, ``t_r`` the sum of rank ``r``'s
    stages (its slowest rank's share of the bubble shrinks ``v`` times).

    Zero bubble: ``max(m, p)·max_r t_r + (p - 1)/v · max_r zero_bubble_idle(F_r, B_r, W_r)``,
    ``F_r``, ``W_r`` the sums of rank ``r``'s ``forward_s`` and ``weight_s`` (each stage's F and
    W; by default a third of its time each, the paper's ``T_F = T_B = T_W``), ``B_r`` the rest of
    ``t_r``. With balanced stages and ``m`` a multiple of ``p`` this is the time of torch's
    schedule exactly (its order of actions, run with those durations and no sends); with fewer
    microbatches than ranks it is the time of ``p`` microbatches, a bound above it.

    ZB-V (V-placed): ``m'·max_r t_r + max_r zbv_excess(F_r/2, B_r/2, W_r/2, p, m)``, ``m' = m``
    for ``m <= p`` or ``m >= 2p - 1``, where it is torch's order exactly with balanced stages,
    else ``2p - 1`` (the time of ``2p - 1`` microbatches, a bound above: fewer actions in the
    same order never take longer). DualPipeV: ``m·max_r t_r + max_r dualpipev_excess(F_r/2,
    B_r/2, W_r/2, p)``, torch's order exactly with balanced stages (it takes ``m >= 2p``).

    Uneven stages: :func:`simulate_schedule` (exact)."""
    v = VIRTUAL_STAGES[schedule]
    if v == 1:
        return pipeline_seconds(stage_s, microbatches)
    mine = [rank_stages(schedule, ranks, r) for r in range(ranks)]
    per_rank = [sum(stage_s[k] for k in ks) for ks in mine]
    if schedule not in SPLIT_BACKWARD:
        return (microbatches + (ranks - 1) / v) * max(per_rank)
    f = forward_s if forward_s is not None else [t / 3 for t in stage_s]
    w = weight_s if weight_s is not None else [t / 3 for t in stage_s]
    fw = [(sum(f[k] for k in ks), sum(w[k] for k in ks)) for ks in mine]
    if schedule == "DualPipeV":
        check_microbatches(schedule, ranks, microbatches)
        return microbatches * max(per_rank) + max(
            dualpipev_excess(fr / 2, (t - fr - wr) / 2, wr / 2, ranks)
            for (fr, wr), t in zip(fw, per_rank))
    if schedule in V_PLACED:
        # A rank's mean stage: F, B and W per stage are the rank's over v = 2.
        m, p = microbatches, ranks
        busy = m if m <= p or m >= 2 * p - 1 else 2 * p - 1
        return busy * max(per_rank) + max(zbv_excess(fr / 2, (t - fr - wr) / 2, wr / 2, p, m)
                                          for (fr, wr), t in zip(fw, per_rank))
    idle = max(zero_bubble_idle(fr, t - fr - wr, wr) for (fr, wr), t in zip(fw, per_rank))
    return max(microbatches, ranks) * max(per_rank) + (ranks - 1) / v * idle


def zero_bubble_idle(forward: float, backward_input: float, backward_weight: float) -> float:
    """A rank's idle seconds per rank of pipeline depth under the interleaved zero-bubble
    schedule, from its F, B and W seconds per microbatch: ``max(F, B, F + B - W)``.

    Qi et al. (2024, §3.1) give ZB-H1's bubble as ``(p - 1)(T_F + T_B - T_W)``, reached while W
    is no longer than F or B (it fills the gaps between them); a W longer than that cannot fill
    more than the gap, and the idle time stays that of the longer of F and B. So written, it
    is never below the paper's figure, and it is what torch's ``ScheduleInterleavedZeroBubble``
    takes: run action by action with per-stage durations f, b, w (tests/test_pipeline.py), its
    step is ``2m(f + b + w) + (p - 1)·max(f, b, f + b - w)``, i.e. this over ``v`` = 2 for the
    rank's sums."""
    return max(forward, backward_input, forward + backward_input - backward_weight)


def zbv_excess(forward: float, backward_input: float, backward_weight: float, ranks: int,
               microbatches: int) -> float:
    """Seconds torch's ``ScheduleZBVZeroBubble`` takes beyond ``2m'(f + b + w)`` (``m'`` as in
    :func:`schedule_seconds`), from a stage's F, B and W seconds ``f``, ``b``, ``w`` per
    microbatch, ``p`` ranks, ``q = p - 1``: the longest chain of its order of actions, a maximum
    of linear forms read off that order (each the critical path for some durations) and checked
    against it action by action (tests/test_pipeline.py). With ``m >= 2p - 1``:
    ``max(b + (q-1)w, q·b, 2q(b - w), f + (q-1)w, (2q-1)f - (q-1)b, (2q-1)f + b - 2q·w,
    2q·f - q·b - w, 2q·f - (2q+1)w)``, ``q·f`` when ``f = b = w`` (the warm-up's forwards; the
    paper's ZB-V, §6, reaches zero only counting from the first rank's start); with
    ``m <= p``, ``j = m - 1``: ``max(2(q-j)f + 2q·b, (2q-j)(f + b), 2q·f + (2q-3j)b - j·w,
    2q·f + (2q-2j)b - 2j·w)``; between them, that of ``2p - 1`` microbatches."""
    f, b, w, q = forward, backward_input, backward_weight, ranks - 1
    if microbatches <= ranks:
        j = microbatches - 1
        return max(2 * (q - j) * f + 2 * q * b, (2 * q - j) * (f + b),
                   2 * q * f + (2 * q - 3 * j) * b - j * w,
                   2 * q * f + (2 * q - 2 * j) * b - 2 * j * w)
    return max(b + (q - 1) * w, q * b, 2 * q * (b - w), f + (q - 1) * w,
               (2 * q - 1) * f - (q - 1) * b, (2 * q - 1) * f + b - 2 * q * w,
               2 * q * f - q * b - w, 2 * q * f - (2 * q + 1) * w)


def dualpipev_excess(forward: float, backward_input: float, backward_weight: float,
                     ranks: int) -> float:
    """Seconds torch's ``ScheduleDualPipeV`` takes beyond ``2m(f + b + w)`` (any ``m >= 2p``:
    it does not grow with ``m``), from a stage's F, B and W seconds per microbatch, ``p``
    ranks, ``q = p - 1``: ``q·max(0, b - w) + max((q-1)f + q·b, 2q·f)``, the longest chain of
    its order of actions (each overlapped F&B run as F then the full backward, as torch's
    runtime runs it), read off the order's critical paths and checked against it action by
    action (tests/test_pipeline.py). With ``F = B = W`` it is ``2q·f``, the DualPipe README's
    ``(PP/2 - 1)(F&B + B - 3W)`` for DualPipeV (``PP = 2p`` stages, ``F&B = F + B``, ``B`` the
    full backward); twice ZB-V's ``q·f``."""
    f, b, w, q = forward, backward_input, backward_weight, ranks - 1
    return q * max(0.0, b - w) + max((q - 1) * f + q * b, 2 * q * f)


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of balanced stages: ``(p - 1)/(v·m + p - 1)``, ``p`` ranks."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def balanced_bubble(schedule: str, ranks: int, microbatches: int) -> float:
    """The idle fraction of :func:`schedule_seconds` with balanced stages (zero bubble: F, B and W
    a third of a stage's time each): :func:`bubble_fraction` for the others."""
    v = VIRTUAL_STAGES[schedule]
    step = schedule_seconds([1.0 / v] * (ranks * v), microbatches, ranks, schedule)
    return 1 - microbatches / step


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak: all ``m`` under GPipe,
    ``min(m, p - stage)`` under 1F1B (its warm-up forwards, then one forward per backward).

    Interleaved 1F1B and zero bubble (``stages``: the ranks ``p``; ``stage`` of ``2p``, rank
    ``r = stage mod p``), counted from torch's orders of actions (tests/test_pipeline.py): a
    rank's second stage keeps ``c_r = min(m, p)`` under zero bubble, ``min(m, p, 2(p - r) - 1)``
    under interleaved 1F1B (a later rank's backwards start sooner); its first stage
    ``min(m, m/k + c_r)`` (``k = max(1, m // p)`` rounds of ``m/k`` microbatches: ``p + c_r``
    once ``m >= 2p``). Rank 0 holds ``1.5·p`` microbatches of its layers' activations where
    1F1B's holds ``p`` (Megatron-LM's interleaved warm-up on rank 0, ``2(p-1) + p`` chunk
    forwards, is the same). Zero bubble defers W and keeps every rank at rank 0's count: the
    paper's ZB-H1 keeps 1F1B's peak, this interleaved variant does not.

    ZB-V (``stage`` of ``2p``, V-placed): ``min(m, 2p - stage)`` from F to W, so rank ``r``
    (stages ``r`` and ``2p - 1 - r``) holds ``2p + 1`` once ``m >= 2p``, the same on every rank
    (Qi et al. 2024, §6: ZB-V's memory is balanced across ranks). DualPipeV (``m >= 2p``) the
    same, ``2p - stage``: ``2p + 1`` per rank, the DualPipe README's ``PP + 1`` (checked against
    torch's order by :func:`order_in_flight`)."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, stages - stage)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        p, m = stages, microbatches
        per_round = m // max(1, m // p)
        # zero bubble: every rank alike; interleaved 1F1B: later ranks' backwards come sooner
        second = p if schedule == "InterleavedZeroBubble" else min(p, 2 * (p - stage % p) - 1)
        return min(m, per_round + second if stage < p else second)
    if schedule in V_PLACED:
        return min(microbatches, 2 * stages - stage)
    raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")


def fullest_stage(schedule: str, ranks: int, microbatches: int) -> float:
    """Microbatches of a rank's share of the layers whose activations the fullest rank keeps
    alive (rank 0): ``m`` under GPipe, ``min(m, p)`` under 1F1B, under an interleaved schedule
    its two stages' counts (:func:`in_flight`), each of half its layers; V-placed, the fullest
    rank's (with fewer than ``2p`` microbatches not rank 0). ``schedule`` "auto": 1F1B's (the
    others' cuts are checked on their own)."""
    p, m = ranks, microbatches
    if schedule in ("auto", "1F1B", "GPipe"):
        return float(in_flight("1F1B" if schedule == "auto" else schedule, 0, p, m))
    return max(sum(in_flight(schedule, k, p, m) for k in rank_stages(schedule, p, r))
               for r in range(p)) / VIRTUAL_STAGES[schedule]



# ------------------------------------------------------------------ orders of actions, simulated

# One action of a rank: sub-actions (kind, stage, microbatch) run back to back, their results
# handed on once the last ends (torch runs an overlapped F&B, or a full backward on a split
# schedule, as one action and sends after it). Kinds: "F" forward, "B" the backward (the
# inputs' gradient under a split backward, the whole backward otherwise), "W" the weights'
# gradient (split backward only).
Action = tuple[tuple[str, int, int], ...]


@functools.lru_cache(maxsize=128)
def schedule_order(schedule: str, ranks: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Per rank, its actions in the order ``schedule`` runs them.

    GPipe: every forward, then every backward. 1F1B (PipeDream-Flush): rank ``r`` warms up with
    ``p - r`` forwards, then alternates backward and forward. Interleaved 1F1B (Megatron-LM,
    Narayanan et al. 2021 §2.2.2): microbatches in groups of ``p``, each group through the
    rank's first stage, then its next; ``2(p - r - 1) + (v - 1)p`` forwards of warm-up, then
    one forward per backward, backwards taking the rank's stages last first. The split-backward
    schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV): torch's own order, computed as
    its class's constructor computes it (``_calculate_single_rank_operations``, no process
    groups); DualPipeV's full backwards are a B and its W in one action, its overlapped F&B
    pairs an F, a B and a W in one action, as torch's runtime runs them (one after the other,
    sending after both)."""
    p, m = ranks, microbatches
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    check_microbatches(schedule, p, m)
    if schedule in SPLIT_BACKWARD:
        return _torch_order(schedule, p, m)
    v = VIRTUAL_STAGES[schedule]
    out = []
    for r in range(p):
        if schedule == "GPipe":
            out.append(tuple((("F", r, k),) for k in range(m))
                       + tuple((("B", r, k),) for k in range(m)))
            continue
        fwd: list[Action] = []
        bwd: list[Action] = []
        for g in range(0, m, p):
            group = range(g, min(m, g + p))
            fwd += [(("F", c * p + r, k),) for c in range(v) for k in group]
            bwd += [(("B", c * p + r, k),) for c in reversed(range(v)) for k in group]
        warm = min(len(fwd), p - r if v == 1 else 2 * (p - r - 1) + (v - 1) * p)
        order, nf = fwd[:warm], warm
        for b in bwd:
            if v > 1 and nf < len(fwd):      # Megatron: the steady state's forward first
                order.append(fwd[nf])
                nf += 1
                order.append(b)
                continue
            order.append(b)
            if nf < len(fwd):
                order.append(fwd[nf])
                nf += 1
        out.append(tuple(order))
    return tuple(out)


def check_microbatches(schedule: str, ranks: int, microbatches: int) -> None:
    """Refuse a number of microbatches ``schedule`` cannot run on ``ranks`` ranks: DualPipeV
    takes at least one per stage, ``2p`` (torch's ScheduleDualPipeV refuses fewer)."""
    if schedule == "DualPipeV" and microbatches < 2 * ranks:
        raise AutoshardError(f"at least {2 * ranks} microbatches for DualPipeV on {ranks} ranks "
                             f"(one per stage, as torch's ScheduleDualPipeV requires)",
                             got=f"{microbatches} microbatches",
                             fix=f"microbatches={2 * ranks} or more (a divisor of the batch), "
                                 f"or schedule='ZBVZeroBubble' (the same V, any number)")


def _torch_order(schedule: str, p: int, m: int) -> tuple[tuple[Action, ...], ...]:
    from types import SimpleNamespace
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.schedules import _ComputationType as C
    cls = {"InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
           "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
           "DualPipeV": schedules.ScheduleDualPipeV}[schedule]
    me = SimpleNamespace(n_local_stages=2, pp_group_size=p, _n_microbatches=m,
                         number_of_rounds=max(1, m // p), num_stages=2 * p)
    me.microbatches_per_round = m // me.number_of_rounds

    def subs(a) -> Action:
        t, s, k = a.computation_type, a.stage_index, a.microbatch_index
        if t == C.OVERLAP_F_B:
            return tuple(x for sub in a.sub_actions for x in subs(sub))
        if t == C.FULL_BACKWARD:
            return (("B", s, k), ("W", s, k))
        return ((({C.FORWARD: "F", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W"}[t]), s, k),)

    return tuple(tuple(subs(a) for a in cls._calculate_single_rank_operations(me, r)
                       if a is not None) for r in range(p))


@functools.lru_cache(maxsize=128)
def _compiled(schedule: str, ranks: int, microbatches: int):
    """:func:`schedule_order` as the simulator reads it: per rank, per action, per sub-action
    (its result's slot, its duration's slot ``kind·S + stage``, its inputs as (result slot,
    cut crossed or -1)); a result's slot is ``(kind·S + stage)·m + microbatch``."""
    p, m = ranks, microbatches
    S = p * VIRTUAL_STAGES[schedule]
    code = {"F": 0, "B": 1, "W": 2}
    cross = [s if sends_between(schedule, p, s) else -1 for s in range(S - 1)]
    out = []
    for acts in schedule_order(schedule, p, m):
        rank = []
        for act in acts:
            subs = []
            for kind, s, k in act:
                c = code[kind]
                if kind == "F":
                    deps = ((s - 1) * m + k, cross[s - 1]) if s else None
                elif kind == "B":
                    # and its own forward, which its rank ran before it
                    deps = ((S + s + 1) * m + k, cross[s]) if s < S - 1 else None
                else:
                    deps = ((S + s) * m + k, -1)
                if deps is not None and any(deps[0] == x[0] for x in subs):
                    deps = None          # made earlier in this action, just before
                subs.append(((c * S + s) * m + k, c * S + s, deps))
            rank.append(tuple(subs))
        out.append(tuple(rank))
    return tuple(out), S


def simulate_schedule(schedule: str, ranks: int, microbatches: int, forward: Sequence[float],
                      backward: Sequence[float], weight: Sequence[float] | None = None,
                      send: Sequence[float] | None = None, *, slots: list | None = None
                      ) -> float:
    """The makespan of ``schedule`` run action by action in its order (:func:`schedule_order`)
    on ``ranks`` ranks with ``microbatches`` microbatches, stage ``s`` taking ``forward[s]``
    seconds per F, ``backward[s]`` per B (the inputs' gradient under a split backward) and
    ``weight[s]`` per W (a schedule without a split backward runs B and W as one: its B takes
    ``backward[s] + weight[s]``). Each rank runs its actions in its order, one at a time, each
    sub-action once its inputs are there: F of stage ``s`` after F of ``s - 1`` (same
    microbatch), B after B of ``s + 1`` (the last stage's B after its own F, which its rank ran
    before), W after B; a result is handed on when its action ends, ``send[c]`` seconds later
    across cut ``c`` (stages ``c`` and ``c + 1``) where it is sent (not at a V's turn).
    Exact, where the closed forms (:func:`schedule_seconds`) hold only for balanced stages.
    ``slots``: a list to which each sub-action is appended as
    ``(rank, kind, stage, microbatch, start, seconds)``."""
    acts, S = _compiled(schedule, ranks, microbatches)
    m = microbatches
    w = list(weight) if weight is not None else [0.0] * S
    b = list(backward) if schedule in SPLIT_BACKWARD else [x + y for x, y in zip(backward, w)]
    dur = [*forward, *b, *w]
    assert len(dur) == 3 * S, (len(forward), len(backward), S)
    lat = [*(send if send is not None else [0.0] * (S - 1)), 0.0]    # lat[-1]: no send
    done = [-1.0] * (3 * S * m)
    clock = [0.0] * ranks
    pos = [0] * ranks
    left = sum(len(a) for a in acts)
    names = "FBW"
    while left:
        moved = False
        for r in range(ranks):
            mine, i, t = acts[r], pos[r], clock[r]
            n = len(mine)
            while i < n:
                act = mine[i]
                if any(d is not None and done[d[0]] < 0 for _, _, d in act):
                    break
                for out, k, d in act:
                    if d is not None:
                        ready = done[d[0]] + lat[d[1]]
                        if ready > t:
                            t = ready
                    if slots is not None:
                        slots.append((r, names[k // S], k % S, out % m, t, dur[k]))
                    t += dur[k]
                for out, _, _ in act:
                    done[out] = t
                i += 1
            if i != pos[r]:
                left -= i - pos[r]
                pos[r], clock[r] = i, t
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule}'s order of actions deadlocks")
    return max(clock)


@functools.lru_cache(maxsize=256)
def order_in_flight(schedule: str, ranks: int, microbatches: int) -> tuple[int, ...]:
    """Per stage, the most microbatches whose F has run and whose backward has not finished
    (its W under a split backward, its B otherwise), read off :func:`schedule_order`: the
    activations each stage keeps at its peak."""
    last = "W" if schedule in SPLIT_BACKWARD else "B"
    peak = [0] * (ranks * VIRTUAL_STAGES[schedule])
    for acts in schedule_order(schedule, ranks, microbatches):
        live = dict.fromkeys(range(len(peak)), 0)
        for act in acts:
            for kind, s, _ in act:
                if kind == "F":
                    live[s] += 1
                    peak[s] = max(peak[s], live[s])
                elif kind == last:
                    live[s] -= 1
    return tuple(peak)
