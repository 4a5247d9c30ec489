"""Pipeline stages (docs/cost-model.md §10): the closed forms of the schedules, the planner's
stages and their records, and gloo runs equal to the single-device model with the bytes the
plan lists, sends included."""
from __future__ import annotations

import json
import random

import pytest

from autoshard import Mesh, Plan
from autoshard.schedules import (SCHEDULES, SPLIT_BACKWARD, VIRTUAL_STAGES, balanced_bubble,
                                 bubble_fraction, dualpipev_excess, fullest_stage, in_flight,
                                 order_in_flight, pipeline_seconds, rank_stages,
                                 schedule_order, schedule_seconds, sends_between,
                                 simulate_schedule, zbv_excess, zero_bubble_idle)
from autoshard.errors import AutoshardError
from autoshard.tools.verify import VerifySpec, plan_for, summarize, verify_rank
from autoshard.zoo.registry import get_model
from dist import world_fixture

world2 = world_fixture(2, timeout_s=300)
world4 = world_fixture(4, timeout_s=300)
world8 = world_fixture(8, timeout_s=300)


# -- closed forms (REFERENCE: GPipe / 1F1B bubble (p-1)/(m+p-1); 1F1B keeps p - i in flight) ---

def test_balanced_stages_idle_for_the_bubble() -> None:
    p, m, t = 4, 8, 2.0
    total = pipeline_seconds([t] * p, m)
    assert total == pytest.approx((m + p - 1) * t)
    assert 1 - m * t / total == pytest.approx(bubble_fraction(p, m)) == pytest.approx(3 / 11)
    # The slowest stage sets the pace of the m - 1 microbatches after the first.
    assert pipeline_seconds([1.0, 3.0], 4) == pytest.approx(1 + 3 + 3 * 3)


def test_interleaving_shrinks_the_bubble_v_times() -> None:
    """Interleaved 1F1B, v = 2 stages per rank (rank r runs stages r and r + p): balanced, the
    step is (m + (p - 1)/v)·t_rank, an idle fraction (p - 1)/(v·m + p - 1)."""
    p, m, t = 4, 8, 1.0
    stages = [t / 2] * (2 * p)                      # each rank: two halves of t
    total = schedule_seconds(stages, m, p, "Interleaved1F1B")
    assert total == pytest.approx((m + (p - 1) / 2) * t)
    assert 1 - m * t / total == pytest.approx(bubble_fraction(p, m, 2)) == pytest.approx(3 / 19)
    assert schedule_seconds([t] * p, m, p, "1F1B") == pytest.approx(pipeline_seconds([t] * p, m))
    assert in_flight("Interleaved1F1B", 5, 4, 8) == 4 and in_flight("Interleaved1F1B", 0, 4, 8) == 8


def test_microbatches_in_flight_per_schedule() -> None:
    assert [in_flight("1F1B", i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("GPipe", i, 4, 8) for i in range(4)] == [8] * 4
    assert in_flight("1F1B", 0, 4, 2) == 2          # never more than there are


def _torch_order(p: int, m: int, schedule: str = "InterleavedZeroBubble") -> dict:
    """torch's interleaved schedule's actions per rank (2 stages per rank), computed as its
    constructor does, without process groups."""
    from types import SimpleNamespace
    from torch.distributed.pipelining import schedules
    cls = {"InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
           "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
           "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
           "DualPipeV": schedules.ScheduleDualPipeV}[schedule]
    me = SimpleNamespace(n_local_stages=2, pp_group_size=p, _n_microbatches=m,
                         number_of_rounds=max(1, m // p), num_stages=2 * p)
    me.microbatches_per_round = m // me.number_of_rounds
    me.pipeline_order = {r: cls._calculate_single_rank_operations(me, r) for r in range(p)}
    if schedule in ("Interleaved1F1B", "ZBVZeroBubble", "DualPipeV"):
        return me.pipeline_order
    return cls._add_bubbles_to_actions(me, 2 * p)


def test_interleaved_1f1b_holds_what_torchs_order_keeps() -> None:
    """ScheduleInterleaved1F1B's own order, read rank by rank: the most microbatches between a
    stage's forward and its backward are min(m, m/k + p) on a rank's first stage (2p once
    m >= 2p, as Megatron-LM's warm-up of 2(p-1) + p chunk forwards) and min(m, p) on its
    second: the activation memory the planner charges."""
    from torch.distributed.pipelining.schedules import _ComputationType as C
    for p, m in ((2, 2), (2, 8), (3, 6), (4, 4), (4, 8), (4, 16), (8, 64)):
        peak: dict[int, int] = {}
        for acts in _torch_order(p, m, "Interleaved1F1B").values():
            live: dict[int, int] = {}
            for a in acts:
                if a is not None:
                    s = a.stage_index
                    live[s] = live.get(s, 0) + (1 if a.computation_type == C.FORWARD else -1)
                    peak[s] = max(peak.get(s, 0), live[s])
        assert peak == {s: in_flight("Interleaved1F1B", s, p, m) for s in range(2 * p)}, (p, m)


def _run_order(order: dict, stages: int, f, b, w,
               scale: list[float] | None = None) -> tuple[float, dict]:
    """Each rank runs its actions in order, each once its inputs are done (F after the previous
    stage's F, B after its own F and the next stage's B, W after its B; no sends): the step's
    seconds, and per stage the most microbatches between an F and its W. A whole backward
    under a split-backward schedule is its B then its W, an overlapped F&B its F then that;
    their results are handed on when the whole action ends. ``f``, ``b``, ``w``: seconds, one
    for every stage or a list per stage; ``scale``: stage ``s``'s durations times
    ``scale[s]``."""
    from torch.distributed.pipelining.schedules import _ComputationType as C

    def per(x, s):
        return (x[s] if isinstance(x, (list, tuple)) else x) * (scale[s] if scale else 1.0)

    def parts(a):
        t, s, k = a.computation_type, a.stage_index, a.microbatch_index
        if t == C.OVERLAP_F_B:
            return [x for sub in a.sub_actions for x in parts(sub)]
        if t == C.FULL_BACKWARD:
            return [("B", s, k), ("W", s, k)]
        return [({C.FORWARD: "F", C.BACKWARD_INPUT: "B", C.BACKWARD_WEIGHT: "W"}[t], s, k)]

    durations = {"F": f, "B": b, "W": w}
    todo = {r: [parts(a) for a in acts if a is not None] for r, acts in order.items()}
    done, clock, live, peak = {}, dict.fromkeys(order, 0.0), {}, {}
    while any(todo.values()):
        moved = False
        for r, acts in todo.items():
            while acts:
                needs = [[x for x in {"F": [("F", s - 1, k)] if s else [],
                                      "B": [("F", s, k)] + ([("B", s + 1, k)]
                                                            if s < stages - 1 else []),
                                      "W": [("B", s, k)]}[kind] if x not in acts[0]]
                         for kind, s, k in acts[0]]
                if any(x not in done for xs in needs for x in xs):
                    break
                t = clock[r]
                for (kind, s, k), xs in zip(acts[0], needs):
                    t = max([t] + [done[x] for x in xs]) + per(durations[kind], s)
                    live[s] = live.get(s, 0) + {"F": 1, "B": 0, "W": -1}[kind]
                    peak[s] = max(peak.get(s, 0), live[s])
                for x in acts[0]:
                    done[x] = t
                clock[r] = t
                acts.pop(0)
                moved = True
        assert moved, "the order deadlocks"
    return max(clock.values()), peak


def test_zero_bubble_matches_torchs_schedule() -> None:
    """InterleavedZeroBubble, v = 2 (REFERENCE: Qi et al. 2024, arXiv 2401.10241 §3.1: ZB-H1
    idles (p - 1)(T_F + T_B - T_W)): torch's own order of actions, run with per-stage F, B, W
    seconds, takes 2m(f + b + w) + (p - 1)·max(f, b, f + b - w), never less than the paper's
    idle time; and holds min(m, m/k + p) microbatches on a rank's first stage, min(m, p) on its
    second, from F to W."""
    for p, m in ((2, 2), (2, 8), (3, 6), (4, 4), (4, 8), (4, 10)):
        order = _torch_order(p, m)
        for f, b, w in ((1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 0.5, 1.5), (0.7, 1.3, 1.1)):
            step, peak = _run_order(order, 2 * p, f, b, w)
            stage_s = [f + b + w] * (2 * p)
            formula = schedule_seconds(stage_s, m, p, "InterleavedZeroBubble",
                                       forward_s=[f] * (2 * p), weight_s=[w] * (2 * p))
            assert step == pytest.approx(formula), (p, m, f, b, w)
            assert zero_bubble_idle(f, b, w) >= f + b - w
        assert peak == {s: in_flight("InterleavedZeroBubble", s, p, m) for s in range(2 * p)}
    # Fewer microbatches than ranks: a bound above the schedule's time.
    step, _ = _run_order(_torch_order(4, 2), 8, 1.0, 1.0, 1.0)
    assert step <= schedule_seconds([3.0] * 8, 2, 4, "InterleavedZeroBubble") + 1e-9


def test_zero_bubble_closed_form() -> None:
    """Balanced, F = B = W (the default split, a third of a stage's time each): the idle time
    is a third of Interleaved 1F1B's, (p - 1)/v · t/3 on a rank of t seconds per microbatch."""
    p, m, t = 4, 8, 1.0
    stages = [t / 2] * (2 * p)
    zb = schedule_seconds(stages, m, p, "InterleavedZeroBubble")
    i1 = schedule_seconds(stages, m, p, "Interleaved1F1B")
    assert zb == pytest.approx(m * t + (p - 1) / 2 * t / 3)
    assert zb - m * t == pytest.approx((i1 - m * t) / 3)
    assert balanced_bubble("InterleavedZeroBubble", p, m) == pytest.approx(0.5 / (8 + 0.5))
    for x in SCHEDULES[:3]:
        assert balanced_bubble(x, p, m) == pytest.approx(bubble_fraction(p, m, VIRTUAL_STAGES[x]))
    # A long W fills the gaps no further than F and B leave them.
    assert zero_bubble_idle(1.0, 1.0, 3.0) == 1.0 and zero_bubble_idle(1.0, 1.0, 0.5) == 1.5
    assert [in_flight("InterleavedZeroBubble", s, 4, 8) for s in (0, 3, 4, 7)] == [8, 8, 4, 4]
    assert in_flight("InterleavedZeroBubble", 0, 4, 2) == 2


# Per-stage (F, B, W) seconds the V-placed schedules' closed forms are checked with: equal,
# each longer than the others, W zero, and six drawn at random.
_rng = random.Random(0)
V_DURATIONS = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 0.5, 1.5), (0.7, 1.3, 1.1),
               (2.0, 1.0, 1.0), (1.0, 1.0, 3.0), (1.0, 1.0, 0.0)] + \
    [tuple(_rng.uniform(0.1, 3.0) for _ in range(3)) for _ in range(6)]


def test_zbv_matches_torchs_schedule() -> None:
    """ZBVZeroBubble (REFERENCE: Qi et al. 2024, arXiv 2401.10241 §6, ZB-V; torch's
    ScheduleZBVZeroBubble): rank r runs stages r and 2p - 1 - r, and torch's own order of
    actions, run with per-stage F, B, W seconds, takes 2m(f + b + w) + zbv_excess exactly for
    m <= p and m >= 2p - 1, at most the time of 2p - 1 microbatches between them; stage s holds
    min(m, 2p - s) microbatches from F to W (2p + 1 on every rank once m >= 2p)."""
    durations = V_DURATIONS
    for p in (2, 3, 4, 5):
        assert [rank_stages("ZBVZeroBubble", p, r) for r in range(p)] == \
            [(r, 2 * p - 1 - r) for r in range(p)]
        for m in range(1, 3 * p + 2):
            order = _torch_order(p, m, "ZBVZeroBubble")
            # torch's order runs exactly the stages the plan places on each rank
            assert all({a.stage_index for a in acts if a is not None}
                       == set(rank_stages("ZBVZeroBubble", p, r)) for r, acts in order.items())
            for f, b, w in durations:
                step, peak = _run_order(order, 2 * p, f, b, w)
                formula = schedule_seconds([f + b + w] * (2 * p), m, p, "ZBVZeroBubble",
                                           forward_s=[f] * (2 * p), weight_s=[w] * (2 * p))
                if m <= p or m >= 2 * p - 1:
                    assert step == pytest.approx(formula), (p, m, f, b, w)
                    assert step == pytest.approx(2 * m * (f + b + w) + zbv_excess(f, b, w, p, m))
                else:
                    assert step <= formula + 1e-9, (p, m, f, b, w)
            assert peak == {s: in_flight("ZBVZeroBubble", s, p, m) for s in range(2 * p)}
    # Balanced with F = B = W: the interleaved zero-bubble time, on a rank of t = 1 per
    # microbatch; every rank keeps 2p + 1 of its stages' microbatches (p + 1/2 of its layers').
    assert schedule_seconds([0.5] * 8, 8, 4, "ZBVZeroBubble") == pytest.approx(
        schedule_seconds([0.5] * 8, 8, 4, "InterleavedZeroBubble")) == pytest.approx(8 + 0.5)
    assert fullest_stage("ZBVZeroBubble", 4, 8) == 4.5 \
        < fullest_stage("InterleavedZeroBubble", 4, 8) == 6
    # With fewer microbatches than 2p the fullest rank is not rank 0: rank 1 of 2 holds stages
    # 1 and 2, min(2, 3) + min(2, 2) = 4 microbatches of half its layers.
    assert fullest_stage("ZBVZeroBubble", 2, 2) == 2.0
    # The turn of the V (stages p - 1 and p) is on one rank: no send; every other cut sends.
    assert [sends_between("ZBVZeroBubble", 4, s) for s in range(7)] == [True] * 3 + [False] + \
        [True] * 3
    assert all(sends_between("InterleavedZeroBubble", 4, s) for s in range(7))


def _torch_single_order(p: int, m: int, schedule: str) -> dict:
    """The order of actions of torch's one-stage-per-rank schedules: ScheduleGPipe's as its
    ``_get_pipeline_order`` writes it; Schedule1F1B's as its ``_step_microbatches`` runs it,
    ``min(m, p - r)`` forwards, then a backward and a forward in turn (its
    ``_get_pipeline_order``, a picture of the schedule, numbers the last rank's forwards from
    1: not what runs)."""
    from types import SimpleNamespace
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining.schedules import _Action, _ComputationType as C
    if schedule == "GPipe":
        order = schedules.ScheduleGPipe._get_pipeline_order(
            SimpleNamespace(_num_stages=p, _n_microbatches=m))
        return {r: [a for a in acts if a is not None and a.computation_type in
                    (C.FORWARD, C.FULL_BACKWARD)] for r, acts in order.items()}
    out = {}
    for r in range(p):
        warm = min(m, p - r)
        acts = [_Action(r, C.FORWARD, k) for k in range(warm)]
        for k in range(m):
            acts.append(_Action(r, C.FULL_BACKWARD, k))
            if warm + k < m:
                acts.append(_Action(r, C.FORWARD, warm + k))
        out[r] = acts
    return out


def test_simulation_is_the_closed_forms_where_they_hold() -> None:
    """simulate_schedule runs a schedule's order of actions one by one; with balanced stages it
    takes each closed form's time where that form is exact: every m for GPipe and 1F1B, m a
    multiple of p for the interleaved ones, m <= p or m >= 2p - 1 for ZB-V, any m from 2p for
    DualPipeV. Without a split backward B is the whole backward (W's seconds added to it)."""
    durations = [(1.0, 1.0, 1.0), (1.0, 2.0, 0.5), (1.0, 0.5, 1.5), (0.7, 1.3, 1.1),
                 (2.0, 1.0, 0.0)]
    for schedule in SCHEDULES:
        v = VIRTUAL_STAGES[schedule]
        for p in (2, 3, 4):
            n = p * v
            for m in range(1, 4 * p + 2):
                if not {"Interleaved1F1B": m % p == 0, "InterleavedZeroBubble": m % p == 0,
                        "ZBVZeroBubble": m <= p or m >= 2 * p - 1,
                        "DualPipeV": m >= 2 * p}.get(schedule, True):
                    continue
                for f, b, w in durations:
                    step = simulate_schedule(schedule, p, m, [f] * n, [b] * n, [w] * n)
                    assert step == pytest.approx(schedule_seconds(
                        [f + b + w] * n, m, p, schedule, forward_s=[f] * n,
                        weight_s=[w] * n)), (schedule, p, m, f, b, w)


def test_simulation_runs_torchs_order_with_uneven_stages() -> None:
    """Uneven stages: simulate_schedule takes the time of torch's own order of actions run one
    by one (``_run_order``, written apart from it), for every schedule, each stage with its own
    F, B and W seconds; and it is the makespan worked out by hand on two small cases, where the
    closed form is not (GPipe with a stage slow forward and the other slow backward) or where a
    send adds its latency on the way (1F1B, one microbatch)."""
    rng = random.Random(2)
    for schedule in SCHEDULES:
        v = VIRTUAL_STAGES[schedule]
        split = schedule in SPLIT_BACKWARD
        for p in (2, 3, 4):
            n = p * v
            for m in sorted({p, 2 * p, 2 * p + 1, 3 * p}):
                if (v > 1 and not split or schedule == "InterleavedZeroBubble") and m % p \
                        or schedule == "DualPipeV" and m < 2 * p:
                    continue
                order = _torch_order(p, m, schedule) if v > 1 else \
                    _torch_single_order(p, m, schedule)
                if not split:      # the one schedule_order writes itself: torch's, action by action
                    assert [[((a.computation_type.value, a.stage_index, a.microbatch_index),)
                             for a in order[r] if a is not None] for r in range(p)] == \
                        [list(acts) for acts in schedule_order(schedule, p, m)], (schedule, p, m)
                for _ in range(3):
                    f, b, w = ([rng.uniform(0.1, 2.0) for _ in range(n)] for _ in range(3))
                    if not split:
                        w = [0.0] * n
                    step, peak = _run_order(order, n, f, b, w)
                    assert simulate_schedule(schedule, p, m, f, b, w) == pytest.approx(step), \
                        (schedule, p, m)
                if split:   # the microbatches a stage holds from F to W, by either count
                    assert tuple(peak[s] for s in range(n)) == order_in_flight(schedule, p, m)
    # GPipe, 2 stages, 2 microbatches, F = (2, 1), B = (1, 2): forwards end at 2, 4 on rank 0
    # and 3, 5 on rank 1; its backwards 5-7, 7-9; rank 0's 7-8, then 9-10. The closed form,
    # both stages 3 s per microbatch: 3 + 3 + 3 = 9.
    assert simulate_schedule("GPipe", 2, 2, [2.0, 1.0], [1.0, 2.0]) == pytest.approx(10.0)
    assert schedule_seconds([3.0, 3.0], 2, 2, "GPipe") == pytest.approx(9.0)
    # 1F1B, one microbatch, every F and B 1 s, 0.5 s to cross the cut: F 0-1, F 1.5-2.5,
    # B 2.5-3.5, B 4-5.
    assert simulate_schedule("1F1B", 2, 1, [1.0, 1.0], [1.0, 1.0], send=[0.5]) == \
        pytest.approx(5.0)


def test_dualpipev_matches_torchs_schedule() -> None:
    """DualPipeV (REFERENCE: DeepSeek-V3 Technical Report, arXiv 2412.19437 §3.2.1 and Table 2;
    the deepseek-ai/DualPipe README's DualPipeV row: bubble (PP/2 - 1)(F&B + B - 3W), activations
    PP + 1 per device, PP stages on PP/2 devices; torch's ScheduleDualPipeV): rank r runs stages
    r and 2p - 1 - r, and torch's order of actions, each overlapped F&B run as the F then the
    full backward (as torch's runtime runs it), takes 2m(f + b + w) + dualpipev_excess with
    balanced stages for every m >= 2p: the README's bubble when F = B = W (PP = 2p, F&B =
    F + B, B the full backward b + w), not otherwise. Stage s holds 2p - s microbatches from F
    to W: 2p + 1 per rank, the README's PP + 1. Fewer than 2p microbatches are refused."""
    durations = V_DURATIONS
    for p in (2, 3, 4, 5):
        assert [rank_stages("DualPipeV", p, r) for r in range(p)] == \
            [(r, 2 * p - 1 - r) for r in range(p)]
        assert [sends_between("DualPipeV", p, s) for s in range(2 * p - 1)] == \
            [sends_between("ZBVZeroBubble", p, s) for s in range(2 * p - 1)]
        for m in range(2 * p, 3 * p + 2):
            order = _torch_order(p, m, "DualPipeV")
            assert all({a.stage_index for a in acts if a.sub_actions is None}
                       == set(rank_stages("DualPipeV", p, r)) for r, acts in order.items())
            for f, b, w in durations:
                step, peak = _run_order(order, 2 * p, f, b, w)
                assert step == pytest.approx(2 * m * (f + b + w) + dualpipev_excess(f, b, w, p))
                assert step == pytest.approx(schedule_seconds(
                    [f + b + w] * (2 * p), m, p, "DualPipeV", forward_s=[f] * (2 * p),
                    weight_s=[w] * (2 * p))), (p, m, f, b, w)
            assert peak == {s: in_flight("DualPipeV", s, p, m) == 2 * p - s and 2 * p - s
                            for s in range(2 * p)}
            assert all(sum(peak[s] for s in rank_stages("DualPipeV", p, r)) == 2 * p + 1
                       for r in range(p))
        # the README's bubble, PP = 2p: (p - 1)(F&B + B - 3W), F&B = f + (b + w), B = b + w
        readme = (p - 1) * ((1.0 + 2.0) + 2.0 - 3 * 1.0)
        assert dualpipev_excess(1.0, 1.0, 1.0, p) == pytest.approx(readme)
        # not otherwise: with b = 2, w = 0.5, one F under it (a B longer than W leaves less)
        readme = (p - 1) * ((1.0 + 2.5) + 2.5 - 3 * 0.5)
        assert dualpipev_excess(1.0, 2.0, 0.5, p) == pytest.approx(readme - 1.0)
    # With F = B = W it idles twice ZB-V's (torch runs the pair's F and B one after the other;
    # DeepSeek overlaps their communication, not the two computations)
    assert dualpipev_excess(1.0, 1.0, 1.0, 4) == 2 * zbv_excess(1.0, 1.0, 1.0, 4, 16) == 6.0
    assert balanced_bubble("DualPipeV", 4, 16) > balanced_bubble("ZBVZeroBubble", 4, 16)
    for bad in (1, 7):
        with pytest.raises(AutoshardError, match="at least 8 microbatches for DualPipeV"):
            simulate_schedule("DualPipeV", 4, bad, [1.0] * 8, [1.0] * 8, [1.0] * 8)


# -- the planner ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_pp() -> Plan:
    """GPT-2 124M (12 layers) on 4 stages x 2-way tensor parallel, 8 microbatches."""
    return plan_for("gpt2", Mesh((4, 2), ("pp", "tp"), cluster="h100"), batch=8, seq=1024,
                    pipeline="pp", schedule="1F1B", microbatches=8)


@pytest.mark.slow
def test_stages_cover_the_layers_in_order_and_balance(gpt2_pp) -> None:
    pl = gpt2_pp.pipeline
    assert (pl.axis, pl.schedule, pl.microbatches, len(pl.stages)) == ("pp", "1F1B", 8, 4)
    layers = [name for st in pl.stages for name in st.layers]
    assert layers == [f"layers.{i}" for i in range(12)]
    # The last stage carries the head and the loss over a 50257-word vocabulary, worth several
    # layers: it gets fewer layers than a middle stage.
    assert len(pl.stages[-1].layers) < len(pl.stages[1].layers)
    slowest = max(st.predicted.compute_s + st.predicted.comm_s for st in pl.stages)
    assert all(st.predicted.compute_s + st.predicted.comm_s >= 0.5 * slowest
               for st in pl.stages)
    # Every spec is replicated over the pipeline axis; the inner plan decides the rest.
    assert all(spec[0].__class__.__name__ == "Replicate" for n in gpt2_pp.nodes
               for spec in n.outputs)


def test_step_is_the_schedule_over_the_stages(gpt2_pp) -> None:
    pl, pred = gpt2_pp.pipeline, gpt2_pp.predicted
    stage_s = [st.predicted.compute_s + st.predicted.comm_s for st in pl.stages]
    # + the slowest stage's optimizer step, the loss all-reduce and the tied weight's sync
    assert pred.step_time_s >= pipeline_seconds(stage_s, pl.microbatches)
    assert pred.step_time_s <= pipeline_seconds(stage_s, pl.microbatches) * 1.2
    assert pred.ilp_sum_bytes == max(st.predicted.ilp_sum_bytes for st in pl.stages)


def test_sends_between_stages_are_in_the_plan(gpt2_pp) -> None:
    """One send per microbatch each way between neighbouring stages: the residual stream of a
    microbatch (b/m x s x h in bf16, the preset's dtype, which the plan runs in; h = 768 for
    GPT-2; split over tp where the plan keeps it
    sequence-parallel) forward and its gradient backward; the labels (int64, 1 x 1024, at most)
    go forward only: they have no gradient."""
    sends = [c for c in gpt2_pp.collectives if c.phase == "pipeline" and c.kind == "send_recv"
             and not c.node.endswith(":warmup")]
    assert len(sends) == 2 * 3 and all(c.count == 8 for c in sends)
    # and torch's warm-up on the first step: one int32 each way over every cut
    warmup = [c for c in gpt2_pp.collectives if c.node.endswith(":warmup")]
    assert sorted((c.node, c.stage, c.bytes, c.count) for c in warmup) == sorted(
        (f"stage{a}->stage{b}:warmup", a, 4, 1) for s in range(3) for a, b in ((s, s + 1),
                                                                               (s + 1, s)))
    stream = 1 * 1024 * 768 * 2
    back = {c.stage: c.bytes for c in sends if c.node == f"stage{c.stage}->stage{c.stage - 1}"}
    for c in sends:
        if c.node == f"stage{c.stage}->stage{c.stage + 1}":
            assert back[c.stage + 1] in (stream, stream // 2), back
            assert 0 < c.bytes - back[c.stage + 1] <= 1024 * 8, (c, back)
    # GPT-2's head is tied to the token embedding: the first and last stages sync its gradient.
    tied = [c for c in gpt2_pp.collectives if c.node.startswith("tied:")]
    assert sorted(c.stage for c in tied) == [0, 3]


def test_pipelined_plan_round_trips_through_json(gpt2_pp) -> None:
    again = Plan.loads(gpt2_pp.dumps())
    assert again == gpt2_pp
    d = json.loads(gpt2_pp.dumps())
    assert set(d["pipeline"]) == {"axis", "schedule", "microbatches", "virtual_stages", "stages"}
    assert set(d["pipeline"]["stages"][0]["predicted"]) == {"compute_s", "comm_s",
                                                           "ilp_memory_bytes", "peak_bytes"}
    assert "pipeline over pp: 1F1B, 8 microbatches, 4 stages on 4 ranks" in gpt2_pp.summary()


def test_pipeline_errors_say_what_to_do() -> None:
    mesh = Mesh((2, 2), ("pp", "tp"), cluster="cpu")
    with pytest.raises(AutoshardError, match="an axis of the mesh"):
        plan_for("gpt2-tiny", mesh, pipeline="dp", microbatches=2)
    with pytest.raises(AutoshardError, match="divisible by the 3 microbatches"):
        plan_for("gpt2-tiny", mesh, pipeline="pp", microbatches=3)
    with pytest.raises(AutoshardError, match="at least one layer per pipeline stage"):
        plan_for("gpt2-tiny", Mesh((4,), ("pp",), cluster="cpu"), pipeline="pp",
                 microbatches=4)
    with pytest.raises(AutoshardError, match="at least 4 layers for Interleaved1F1B"):
        plan_for("gpt2-tiny", mesh, pipeline="pp", schedule="Interleaved1F1B", microbatches=2)
    four = Mesh((2,), ("pp",), cluster="cpu")
    with pytest.raises(AutoshardError, match="microbatches divisible by the 2 pipeline ranks"):
        plan_for("gpt2-tiny-4l", four, pipeline="pp", schedule="Interleaved1F1B",
                 microbatches=1, batch=3)
    with pytest.raises(AutoshardError, match="microbatches only with a pipeline"):
        plan_for("gpt2-tiny", mesh, microbatches=2)


def test_a_stages_plan_bears_its_share_of_the_step() -> None:
    """The SPMD plan the stages share is of one microbatch of m: it bears 1/m of the step's
    optimizer step and gradient sync, and its activations weigh the k microbatches the fullest
    stage keeps alive (1F1B's first stage: min(m, p)) against the stages' memory."""
    from autoshard.schedules import fullest_stage
    from autoshard.cost.price import Pricer
    from autoshard.options import PlanOptions
    from autoshard.solver.planner import plan_traced, trace_for
    from autoshard.zoo.registry import load_model
    assert fullest_stage("1F1B", 4, 8) == fullest_stage("auto", 4, 8) == 4
    assert fullest_stage("GPipe", 4, 8) == 8
    assert fullest_stage("Interleaved1F1B", 4, 8) == (8 + 4) / 2
    model, inputs = load_model("gpt2-tiny", batch=8, seq=16, device="meta")
    options = PlanOptions(pipeline="pp", microbatches=4)
    traced = trace_for(model, inputs, options)
    sub = Mesh((2,), ("tp",), cluster="cpu")
    plan = plan_traced(traced, sub, options.replace(pipeline=None, microbatches="auto"))
    whole = Pricer(traced, sub, plan.options)
    share = Pricer(traced, sub, plan.options.replace(stage_run=(4, 3.0)))
    strategies = plan.strategies()
    params = [p.name for p in traced.params]
    ops = [n for n, st in strategies.items() if n not in params and whole.memory(n, st) > 0]
    assert ops and all(share.memory(n, strategies[n]) == pytest.approx(
        3 * whole.memory(n, strategies[n])) for n in ops)
    assert all(share.optimizer_seconds(n, strategies[n]) == pytest.approx(
        whole.optimizer_seconds(n, strategies[n]) / 4) for n in params)
    assert "stage_run" not in plan.options.to_json()


def test_auto_microbatches_pick_the_fastest() -> None:
    mesh = Mesh((2,), ("pp",), cluster="cpu")
    auto = plan_for("gpt2-tiny", mesh, pipeline="pp")
    m = auto.pipeline.microbatches
    assert m in (2, 4) and auto.options.microbatches == m
    for k in (2, 4):
        other = plan_for("gpt2-tiny", mesh, pipeline="pp", microbatches=k)
        assert auto.predicted.step_time_s <= other.predicted.step_time_s + 1e-12


# -- gloo: the pipelined program equals the single-device model -------------------------------

CASES = [("gpt2-tiny", (2,), ("pp",), "1F1B", 2, "cpu"),
         ("llama-tiny", (2,), ("pp",), "GPipe", 4, "cpu"),
         ("gpt2-tiny-4l", (2,), ("pp",), "Interleaved1F1B", 2, "cpu"),
         ("gpt2-tiny", (2, 2), ("pp", "tp"), "GPipe", 2, "stress"),
         ("llama-tiny", (2, 2), ("pp", "tp"), "1F1B", 2, "stress"),
         ("llama-tiny-4l", (2, 2), ("pp", "tp"), "Interleaved1F1B", 4, "stress"),
         # Split backward (B, then W): on pp x tp the norms' weights are bucketed over tp (their
         # gradients reach their buckets in the weight pass, synced once per step).
         ("gpt2-tiny-4l", (2,), ("pp",), "InterleavedZeroBubble", 2, "cpu"),
         ("llama-tiny-4l", (2,), ("pp",), "InterleavedZeroBubble", 2, "cpu"),
         ("gpt2-tiny-4l", (2, 2), ("pp", "tp"), "InterleavedZeroBubble", 2, "stress"),
         ("llama-tiny-4l", (2, 2), ("pp", "tp"), "InterleavedZeroBubble", 4, "stress"),
         # V-placed: rank 0 runs stages 0 and 3 (the inputs and the loss), rank 1 stages 1 and
         # 2, handed from one to the other in memory (no send: the ledgers say so)
         ("gpt2-tiny-4l", (2,), ("pp",), "ZBVZeroBubble", 2, "cpu"),
         ("llama-tiny-4l", (2,), ("pp",), "ZBVZeroBubble", 4, "cpu"),
         ("gpt2-tiny-4l", (2, 2), ("pp", "tp"), "ZBVZeroBubble", 2, "stress"),
         ("llama-tiny-4l", (2, 2), ("pp", "tp"), "ZBVZeroBubble", 4, "stress"),
         # DualPipeV: the V of ZB-V, at least one microbatch per stage, some backwards whole
         # and overlapped with a forward (torch runs the pair one after the other), the rest
         # split; GPT-2's tied head and embedding one copy on rank 0, whose bucket waits for
         # both stages' last backward (whole on stage 3, split on stage 0)
         ("gpt2-tiny-4l", (2,), ("pp",), "DualPipeV", 4, "cpu"),
         ("llama-tiny-4l", (2,), ("pp",), "DualPipeV", 4, "cpu"),
         ("gpt2-tiny-4l", (2, 2), ("pp", "tp"), "DualPipeV", 4, "stress"),
         ("llama-tiny-4l", (2, 2), ("pp", "tp"), "DualPipeV", 4, "stress")]


def check(world, model: str, plan: Plan, batch: int | None = None) -> dict:
    spec = VerifySpec(model, plan.mesh_shape, plan.mesh_axes, plan.dumps(), batch=batch)
    reports = world.run(verify_rank, spec)
    ok, text = summarize(reports, 1e-5)
    assert ok, text
    for r in reports:      # every rank's own ledger: its stage's collectives and sends
        assert not r["ledger_diff"] and r["bytes"] == r["planned_bytes"], r["ledger_diff"]
    return reports[0]


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,axes,schedule,m,cluster", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}" for c in CASES])
def test_pipelined_step_equals_single_device(world2, world4, model, shape, axes, schedule, m,
                                             cluster) -> None:
    plan = plan_for(model, Mesh(shape, axes, cluster=cluster), pipeline="pp",
                    schedule=schedule, microbatches=m)
    v = VIRTUAL_STAGES[schedule]
    assert plan.pipeline.schedule == schedule and len(plan.pipeline.stages) == 2 * v
    assert plan.pipeline.virtual_stages == v
    sends = {c.node.removesuffix(":warmup") for c in plan.collectives if c.kind == "send_recv"}
    ranks = shape[axes.index("pp")]
    assert sends == {f"stage{s + d}->stage{s + 1 - d}" for s in range(2 * v - 1) for d in (0, 1)
                     if sends_between(schedule, ranks, s)}
    report = check(world2 if len(shape) == 1 else world4, model, plan)
    assert report["collectives"] > 0


def test_a_tied_weight_under_zero2_is_summed_across_stages(world4) -> None:
    """GPT-2's token embedding is read by the first stage and, tied, by the last; under ZeRO-2
    over "tp" each stage's gradient is a bucket's reduce-scattered shard, and that shard (not
    the empty ``.grad``) is what the stages all-reduce over "pp" (the plan records its bytes)."""
    plan = plan_for("gpt2-tiny", Mesh((2, 2), ("pp", "tp"), cluster="stress"), pipeline="pp",
                    schedule="GPipe", microbatches=2, zero="zero2")
    assert plan.param_state["tok_emb.weight"].mode == "zero2"
    weight = get_model("gpt2-tiny")[0].tok_emb.weight
    tied = [c for c in plan.collectives if c.node == "tied:tok_emb.weight"]
    assert [c.bytes for c in tied] == [weight.numel() * weight.element_size() // 2] * 2
    check(world4, "gpt2-tiny", plan)


# The interleaved schedules and DualPipeV run on 4 ranks in
# test_pipelined_step_equals_single_device; on 8 (data x pipeline x tensor) by default 1F1B.
FULL_ONLY = {"test_data_pipeline_tensor_on_eight_ranks[llama-tiny-4l-Interleaved1F1B]",
             "test_data_pipeline_tensor_on_eight_ranks[llama-tiny-4l-DualPipeV]",
             "test_data_pipeline_tensor_on_eight_ranks[llama-tiny-4l-ZBVZeroBubble]",
             "test_data_pipeline_tensor_on_eight_ranks[llama-tiny-4l-InterleavedZeroBubble]",
             # a schedule the other tiny model runs on the same mesh, or the same model on 2x2
             "test_pipelined_step_equals_single_device[gpt2-tiny-2-1F1B]",
             "test_pipelined_step_equals_single_device[llama-tiny-2-GPipe]",
             "test_pipelined_step_equals_single_device[gpt2-tiny-4l-2-Interleaved1F1B]",
             "test_pipelined_step_equals_single_device[llama-tiny-4l-2-InterleavedZeroBubble]",
             "test_pipelined_step_equals_single_device[llama-tiny-4l-2-ZBVZeroBubble]",
             "test_pipelined_step_equals_single_device[llama-tiny-4l-2-DualPipeV]"}


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule", [("llama-tiny", "1F1B"),
                                            ("llama-tiny-4l", "Interleaved1F1B"),
                                            ("llama-tiny-4l", "InterleavedZeroBubble"),
                                            ("llama-tiny-4l", "ZBVZeroBubble"),
                                            ("llama-tiny-4l", "DualPipeV")])
def test_data_pipeline_tensor_on_eight_ranks(world8, model, schedule) -> None:
    """`autoshard verify llama-tiny --mesh 2x2x2 --axes dp,pp,tp --pipeline pp`: data parallel
    gradient buckets per stage (two stages per rank interleaved), synced once per step; under
    the zero-bubble schedule every weight's gradient reaches its bucket in the weight pass."""
    # DualPipeV takes a microbatch per stage at least: 4 of 2 rows each, split over dp
    batch, m = (8, 4) if schedule == "DualPipeV" else (None, 2)
    plan = plan_for(model, Mesh((2, 2, 2), ("dp", "pp", "tp"), cluster="stress"),
                    pipeline="pp", schedule=schedule, microbatches=m, batch=batch)
    assert any(c.members for c in plan.collectives)
    check(world8, model, plan, batch=batch)


def test_zero_bubble_in_the_search() -> None:
    """The zero-bubble schedule is priced with the others: on the same cuts its W fills part of
    Interleaved 1F1B's bubble, and "auto" is never slower than it. A split backward would run a
    checkpointed layer's forward again in each weight pass: with recompute it is left out."""
    mesh = Mesh((2,), ("pp",), cluster="cpu")
    kw = dict(pipeline="pp", microbatches=2)
    zb = plan_for("gpt2-tiny-4l", mesh, schedule="InterleavedZeroBubble", **kw)
    i1 = plan_for("gpt2-tiny-4l", mesh, schedule="Interleaved1F1B", **kw)
    assert [st.layers for st in zb.pipeline.stages] == [st.layers for st in i1.pipeline.stages]
    assert zb.predicted.step_time_s < i1.predicted.step_time_s
    auto = plan_for("gpt2-tiny-4l", mesh, **kw)
    assert auto.predicted.step_time_s <= zb.predicted.step_time_s + 1e-12
    assert "InterleavedZeroBubble, 2 microbatches, 4 stages on 2 ranks" in zb.summary()
    with pytest.raises(AutoshardError, match="without activation checkpointing"):
        plan_for("gpt2-tiny-4l", mesh, schedule="InterleavedZeroBubble", recompute="full", **kw)
    full = plan_for("gpt2-tiny-4l", mesh, recompute="full", **kw)
    assert full.pipeline.schedule != "InterleavedZeroBubble"


def test_v_cuts_balance_stages_within_each_ranks_memory() -> None:
    """The V's cut search (solver/stage_cuts.py ``cut_v_stages``) finds the least slowest stage over
    every cut whose ranks (stages r and 2p - 1 - r together) fit the budget: checked against all
    cuts of small random problems."""
    import itertools
    from autoshard.solver.stage_cuts import cut_v_stages
    from autoshard.schedules import in_flight, rank_stages, sends_between
    zbv = "ZBVZeroBubble"
    rng = random.Random(1)
    for _ in range(25):
        p, m = rng.choice([2, 3]), rng.choice([2, 4, 8])
        L = rng.randint(2 * p, 9)
        secs, comm, send, state, acts = ([rng.random() * k for _ in range(L)]
                                         for k in (1.0, 0.1, 0.2, 1.0, 0.1))
        budget = rng.uniform(1.0, 6.0)

        def stage(b, s):
            i, j = b[s], b[s + 1]
            t = sum(secs[i:j]) + sum(comm[i:j]) \
                + (send[j - 1] if j < L and sends_between(zbv, p, s) else 0.0) \
                + (send[i - 1] if i > 0 and sends_between(zbv, p, s - 1) else 0.0)
            return t, sum(state[i:j]) + in_flight(zbv, s, p, m) * sum(acts[i:j])

        def score(b):
            fits = all(sum(stage(b, s)[1] for s in rank_stages(zbv, p, r)) <= budget
                       for r in range(p))
            return max(stage(b, s)[0] for s in range(2 * p)) if fits else None

        scores = [x for c in itertools.combinations(range(1, L), 2 * p - 1)
                  if (x := score((0, *c, L))) is not None]
        got = cut_v_stages(secs, comm, send, state, acts, p, m, zbv, budget)
        if not scores:
            assert got is None
            continue
        bounds = [i for i, _ in got] + [L]
        assert score(bounds) == pytest.approx(min(scores))


def test_zbv_uneven_stages_are_priced_by_their_order() -> None:
    """Why the V's cuts balance stages, not just ranks, and how the plan prices the cut it keeps
    (docs/cost-model.md §10): GPT-3 175B's 96 layers on 16 ranks as 32 stages of 3 run torch's
    ZB-V order in the closed form's time; as a 1-layer and a 5-layer stage on every rank (the
    same load per rank) they run 12% longer than the closed form says. The planner's price of a
    cut (solver/stage_figures.py ``cut_step_seconds``) is that order run with the stages' own
    seconds (``simulate_schedule``): the plan's prediction is the run's time in both cases."""
    from autoshard.solver.stage_figures import cut_step_seconds
    p, m = 16, 64
    order = _torch_order(p, m, "ZBVZeroBubble")
    for layers, over in (([3] * 32, 1.0), ([1] * 16 + [5] * 16, 1.12)):
        scale = [float(x) for x in layers]
        ran, _ = _run_order(order, 2 * p, 1.0, 1.0, 1.0, scale=scale)
        closed = schedule_seconds([3.0 * x for x in layers], m, p, "ZBVZeroBubble",
                                  forward_s=scale, weight_s=scale)
        assert ran / closed == pytest.approx(over, abs=0.005)
        figures = [{"compute_s": 3.0 * x, "comm_s": 0.0, "forward_s": x, "weight_s": x}
                   for x in scale]
        assert cut_step_seconds(figures, m, p, "ZBVZeroBubble", comm=True) == \
            pytest.approx(ran, rel=1e-12)
        assert simulate_schedule("ZBVZeroBubble", p, m, scale, scale, scale) == \
            pytest.approx(ran, rel=1e-12)


def test_zbv_in_the_search() -> None:
    """ZBVZeroBubble: the V's turn (stages 1 and 2 on rank 1 of 2) has no send in the plan or in
    the cut search, GPT-2's head tied to the embedding is one copy on rank 0 (stages 0 and 3:
    no all-reduce), any number of microbatches is taken, and "auto" is never slower than it.
    Too few layers or a recomputed layer are refused, saying what to do."""
    mesh = Mesh((2,), ("pp",), cluster="cpu")
    kw = dict(pipeline="pp", microbatches=2)
    zbv = plan_for("gpt2-tiny-4l", mesh, schedule="ZBVZeroBubble", **kw)
    izb = plan_for("gpt2-tiny-4l", mesh, schedule="InterleavedZeroBubble", **kw)
    pl = zbv.pipeline
    assert (pl.stages_of(0), pl.stages_of(1)) == ((0, 3), (1, 2))
    sends = sorted(c.node for c in zbv.collectives
                   if c.kind == "send_recv" and not c.node.endswith(":warmup"))
    assert sends == ["stage0->stage1", "stage1->stage0", "stage2->stage3", "stage3->stage2"]
    assert not any(c.node.startswith("tied:") for c in zbv.collectives)
    assert any(c.node.startswith("tied:") for c in izb.collectives)
    # the same cuts; rank 1's stages pay no send between them
    assert [st.layers for st in pl.stages] == [st.layers for st in izb.pipeline.stages]
    assert pl.stages[1].predicted.comm_s < izb.pipeline.stages[1].predicted.comm_s
    auto = plan_for("gpt2-tiny-4l", mesh, **kw)
    assert auto.predicted.step_time_s <= zbv.predicted.step_time_s + 1e-12
    odd = plan_for("gpt2-tiny-4l", mesh, schedule="ZBVZeroBubble", pipeline="pp",
                   microbatches=3, batch=6)
    assert odd.pipeline.microbatches == 3
    with pytest.raises(AutoshardError, match="at least 4 layers for ZBVZeroBubble"):
        plan_for("gpt2-tiny", mesh, schedule="ZBVZeroBubble", **kw)
    with pytest.raises(AutoshardError, match="without activation checkpointing"):
        plan_for("gpt2-tiny-4l", mesh, schedule="ZBVZeroBubble", recompute="full", **kw)


def test_dualpipev_in_the_search() -> None:
    """DualPipeV: placed as ZB-V (rank 0: stages 0 and 3, rank 1: 1 and 2, handed from one to
    the other in memory), so the plan's sends are the V's, once per microbatch each way, each
    of the values crossing its cut: GPT-2's residual stream of a microbatch forward (1 row x 16
    x 32 fp32) with its labels (16 int64), its gradient backward; the tied head is one copy on
    rank 0 (no all-reduce). At least a microbatch per stage: asked for fewer, the planner and a
    plan file say so and how to fix it, and "auto" leaves it out; else "auto" is never slower.
    Too few layers or a recomputed layer are refused as for ZB-V."""
    mesh = Mesh((2,), ("pp",), cluster="cpu")
    kw = dict(pipeline="pp", microbatches=4)
    dpv = plan_for("gpt2-tiny-4l", mesh, schedule="DualPipeV", **kw)
    pl = dpv.pipeline
    assert (pl.schedule, pl.virtual_stages, pl.stages_of(0), pl.stages_of(1)) == \
        ("DualPipeV", 2, (0, 3), (1, 2))
    assert [st.layers for st in pl.stages] == [(f"layers.{i}",) for i in range(4)]
    sends = {c.node: c for c in dpv.collectives
             if c.kind == "send_recv" and not c.node.endswith(":warmup")}
    stream, labels = 1 * 16 * 32 * 4, 16 * 8
    assert {k: (c.bytes, c.count, c.axes, c.stage) for k, c in sends.items()} == {
        "stage0->stage1": (stream + labels, 4, ("pp",), 0),
        "stage1->stage0": (stream, 4, ("pp",), 1),
        "stage2->stage3": (stream + labels, 4, ("pp",), 2),
        "stage3->stage2": (stream, 4, ("pp",), 3)}
    assert not any(c.node.startswith("tied:") for c in dpv.collectives)
    assert "DualPipeV, 4 microbatches, 4 stages on 2 ranks" in dpv.summary()
    assert Plan.loads(dpv.dumps()) == dpv
    auto = plan_for("gpt2-tiny-4l", mesh, **kw)
    assert auto.predicted.step_time_s <= dpv.predicted.step_time_s + 1e-12
    few = plan_for("gpt2-tiny-4l", mesh, pipeline="pp", microbatches=2)
    assert few.pipeline.schedule != "DualPipeV"
    with pytest.raises(AutoshardError, match="at least 4 microbatches for DualPipeV on 2 ranks"):
        plan_for("gpt2-tiny-4l", mesh, schedule="DualPipeV", pipeline="pp", microbatches=2)
    d = json.loads(dpv.dumps())
    d["pipeline"]["microbatches"] = 2
    with pytest.raises(AutoshardError, match="microbatches at least 4 under DualPipeV"):
        Plan.loads(json.dumps(d))
    with pytest.raises(AutoshardError, match="at least 4 layers for DualPipeV"):
        plan_for("gpt2-tiny", mesh, schedule="DualPipeV", **kw)
    with pytest.raises(AutoshardError, match="without activation checkpointing"):
        plan_for("gpt2-tiny-4l", mesh, schedule="DualPipeV", recompute="full", **kw)


@pytest.mark.slow
def test_auto_pipeline_keeps_the_faster_and_records_the_search() -> None:
    """pipeline='auto': the plan without a pipeline and one over each axis; the fastest is kept
    and every try is in the plan's record of its searches (and in the summary)."""
    from autoshard.plans.searches import named, searches
    from autoshard.solver.planner import plan
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("gpt2-tiny", batch=8, seq=16, device="meta")
    mesh = Mesh((2, 2), ("pp", "dp"), cluster="cpu")
    p = plan(model, inputs, mesh, pipeline="auto")
    [search] = named(searches(p.solver), "pipeline axis")
    assert search.within is None and "pipeline_search" not in p.solver
    assert [t.changes["pipeline"] for t in search.tries] == [None, "pp", "dp"]
    steps = [t.step_time_s for t in search.tries if t.step_time_s is not None]
    assert p.predicted.step_time_s == min(steps) == search.chosen.step_time_s
    chosen = p.pipeline.axis if p.pipeline else None
    assert p.options.pipeline == chosen
    assert "pipeline search (pipeline='auto')" in p.summary() and "<- chosen" in p.summary()
    with pytest.raises(AutoshardError, match="searches the axes"):
        from autoshard.solver.planner import plan_traced, trace_for
        plan_traced(trace_for(model, inputs, p.options.replace(pipeline=None)), mesh,
                    pipeline="auto")


def test_megatron_layout_on_a_pipeline_pins_every_stage() -> None:
    """A hand-written layout priced on the same pipeline: the stages' parameters are laid out
    as Megatron writes them (column-parallel fc1, row-parallel fc2 over tp), the cuts and
    schedule come from the same program, and autoshard's own stage layouts, which the ILP
    chose with Megatron's among its options, are no slower."""
    from autoshard.ir import Shard
    from autoshard.options import PlanOptions
    from autoshard.solver.baselines import pipelined_baseline_plan
    from autoshard.solver.planner import plan_traced, trace_for
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("gpt2", batch=8, seq=1024, device="meta")
    options = PlanOptions(pipeline="pp", schedule="1F1B", microbatches=8)
    traced = trace_for(model, inputs, options)
    mesh = Mesh((4, 2), ("pp", "tp"), cluster="h100")
    meg = pipelined_baseline_plan(traced, mesh, "megatron-dp", options, model_name="gpt2")
    assert meg.pipeline is not None and len(meg.pipeline.stages) == 4
    # nn.Linear stores (out, in): column-parallel shards dim 0, row-parallel dim 1; over tp,
    # the mesh's last axis, in every stage.
    for i in range(12):
        assert meg.params[f"layers.{i}.mlp.fc1.weight"][-1] == Shard(0)
        assert meg.params[f"layers.{i}.mlp.fc2.weight"][-1] == Shard(1)
        assert meg.params[f"layers.{i}.attn.q_proj.weight"][-1] == Shard(0)
    ours = plan_traced(traced, mesh, options, model_name="gpt2")
    assert ours.predicted.step_time_s <= meg.predicted.step_time_s * (1 + 1e-9)
