"""Pipeline schedules in closed form (docs/cost-model.md §10).

With ``p`` stages and ``m`` microbatches, GPipe (Huang et al. 2019, arXiv 1811.06965) and 1F1B
(PipeDream-Flush: Narayanan et al. 2021, arXiv 2006.09503; Megatron-LM, arXiv 2104.04473 §2.2)
take the same time: one microbatch passes every stage, then the other ``m - 1`` follow at the
pace of the slowest stage. With balanced stages of ``t`` seconds per microbatch (forward and
backward) that is ``(m + p - 1)·t``, an idle fraction of ``(p - 1)/(m + p - 1)`` (the bubble).
They differ in memory: GPipe keeps every microbatch's activations until its backward; 1F1B at
most ``p - i`` on stage ``i``.
"""
from __future__ import annotations

from typing import Sequence

SCHEDULES = ("GPipe", "1F1B")


def pipeline_seconds(stage_s: Sequence[float], microbatches: int) -> float:
    """One step's forward and backward over every microbatch: ``sum(t_i) + (m - 1)·max(t_i)``,
    ``t_i`` stage ``i``'s seconds per microbatch (its sends included)."""
    return sum(stage_s) + (microbatches - 1) * max(stage_s)


def bubble_fraction(stages: int, microbatches: int) -> float:
    """The idle fraction of balanced stages: ``(p - 1)/(m + p - 1)``."""
    return (stages - 1) / (microbatches + stages - 1)


def in_flight(schedule: str, stage: int, stages: int, microbatches: int) -> int:
    """Microbatches whose activations stage ``stage`` holds at its peak: all ``m`` under GPipe,
    ``min(m, p - stage)`` under 1F1B (its warm-up forwards, then one forward per backward)."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, stages - stage)
    raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
