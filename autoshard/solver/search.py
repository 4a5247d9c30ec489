"""Searches as data: a search is a list of :class:`Try` (a label and a change of the options),
and :func:`run_search` plans each, keeps the fastest by its predicted step, and returns what
every try gave, for the search's record in the plan (Alpa's stage construction: typed options,
a pure search, one driver; Zheng et al. 2022, arXiv 2201.12023, §5).

So far the planner's searches over the pipeline axis and the microbatch count
(solver/planner.py) run through it; the memory ladder, checkpointing, axis merging, schedules
and meshes still run their own loops (docs/design.md, "The ILP")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.options import PlanOptions
from autoshard.plans import Plan


@dataclass(frozen=True)
class Try:
    """One candidate of a search: ``label`` names it in the progress lines, ``changes`` are the
    PlanOptions fields it plans with in place of the search's own."""

    label: str
    changes: tuple[tuple[str, Any], ...]

    def options(self, base: PlanOptions) -> PlanOptions:
        return base.replace(**dict(self.changes))


@dataclass(frozen=True)
class Tried:
    """What a try gave: its plan, or the error that says why it has none."""

    attempt: Try
    plan: Plan | None
    error: AutoshardError | None

    @property
    def step_time_s(self) -> float | None:
        return self.plan.predicted["step_time_s"] if self.plan is not None else None


def run_search(tries: Sequence[Try], plan_one: Callable[[Try], Plan], *,
               error_of_none: str = "first") -> tuple[Plan, list[Tried]]:
    """Plan every try with ``plan_one`` (an AutoshardError is that try's outcome, not the
    search's), and keep the fastest plan; of equally fast ones the first. None planned: the
    ``error_of_none`` ("first" or "last") try's error is raised, the one that says most about
    why (a search orders its tries so)."""
    if not tries:
        raise AutoshardError("a search with at least one try", got="none",
                             fix="list the candidates to compare")
    if error_of_none not in ("first", "last"):
        raise AutoshardError('error_of_none "first" or "last"', got=repr(error_of_none),
                             fix='pass error_of_none="first" or "last"')
    done: list[Tried] = []
    for t in tries:
        try:
            with progress.step(t.label):
                done.append(Tried(t, plan_one(t), None))
        except AutoshardError as e:
            done.append(Tried(t, None, e))
    found = [d for d in done if d.plan is not None]
    if not found:
        errors = [d.error for d in done]
        raise errors[0] if error_of_none == "first" else errors[-1]
    best = min(found, key=lambda d: d.step_time_s)
    assert best.plan is not None
    return best.plan, done
