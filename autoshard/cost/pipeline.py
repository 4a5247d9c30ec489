"""Pipeline schedules in closed form (docs/cost-model.md §10).

With ``p`` stages and ``m`` microbatches, GPipe (Huang et al. 2019, arXiv 1811.06965) and 1F1B
(PipeDream-Flush: Narayanan et al. 2021, arXiv 2006.09503; Megatron-LM, arXiv 2104.04473 §2.2)
take the same time: one microbatch passes every stage, then the other ``m - 1`` follow at the
pace of the slowest stage. With balanced stages of ``t`` seconds per microbatch (forward and
backward) that is ``(m + p - 1)·t``, an idle fraction of ``(p - 1)/(m + p - 1)`` (the bubble).
They differ in memory: GPipe keeps every microbatch's activations until its backward; 1F1B at
most ``p - i`` on stage ``i``. Interleaved 1F1B (Narayanan et al. 2021, §2.2.2) gives each
rank ``v`` stages (rank ``r`` runs stages ``r``, ``r + p``, ...): the bubble shrinks to
``(p - 1)/(v·m + p - 1)`` for ``v`` times the sends, and each of a rank's stages keeps up to
``p`` microbatches in flight.
"""
from __future__ import annotations

from typing import Sequence

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
VIRTUAL_STAGES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}     # stages per rank


def pipeline_seconds(stage_s: Sequence[float], microbatches: int) -> float:
    """One step's forward and backward over every microbatch: ``sum(t_i) + (m - 1)·max(t_i)``,
    ``t_i`` stage ``i``'s seconds per microbatch (its sends included)."""
    return sum(stage_s) + (microbatches - 1) * max(stage_s)


def schedule_seconds(stage_s: Sequence[float], microbatches: int, ranks: int,
                     schedule: str) -> float:
    """A step's forward and backward over every microbatch under ``schedule``, ``stage_s`` the
    seconds per microbatch of each of its ``ranks · v`` stages: :func:`pipeline_seconds` for one
    stage per rank; interleaved, ``(m + (p - 1)/v)·max_r t_r``, ``t_r`` the sum of rank ``r``'s
    stages (its slowest rank's share of the bubble shrinks ``v`` times)."""
    v = VIRTUAL_STAGES[schedule]
    if v == 1:
        return pipeline_seconds(stage_s, microbatches)
    per_rank = [sum(stage_s[r::ranks]) for r in range(ranks)]
    return (microbatches + (ranks - 1) / v) * max(per_rank)


def bubble_fraction(stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction of balanced stages: ``(p - 1)/(v·m + p - 1)``, ``p`` ranks."""
    return (stages - 1) / (virtual * microbatches + stages - 1)


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak: all ``m`` under GPipe,
    ``min(m, p - stage)`` under 1F1B (its warm-up forwards, then one forward per backward)."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, stages - stage)
    if schedule == "Interleaved1F1B":      # ``stages``: the ranks; each of a rank's stages
        return min(microbatches, stages)
    raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
