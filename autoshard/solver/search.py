"""Searches as data: a search is a list of :class:`Try` (a label and a change of what is
planned) and :func:`run_search` solves each, keeps the best by its price, and returns what
every try gave, for the search's record in the plan (Alpa's stage construction: typed options,
a pure search, one driver; Zheng et al. 2022, arXiv 2201.12023, §5).

The planner's searches that run through it (docs/design.md, "Searches as data"): the pipeline
axis and the microbatch count (solver/planner.py), the memory ladder, the checkpointing search
and the budget's remedies (solver/budget.py), the groupings of a 3-axis mesh
(solver/merging.py), the pipeline schedules (solver/pipeline.py) and, one round at a time,
the meshes (solver/meshes.py: a local search, each round the best one's neighbours). A try's
``changes`` are PlanOptions fields (:meth:`Try.options`) or the search's own knobs (an offload
level, a checkpointing policy, a grouping of axes) that its ``solve`` reads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.options import PlanOptions


@dataclass(frozen=True)
class Try:
    """One candidate of a search: ``label`` names it (in the progress lines unless ``announce``
    is off: a try whose solver names its own step), ``changes`` what it plans with in place of
    the search's own."""

    label: str
    changes: tuple[tuple[str, Any], ...]
    announce: bool = True

    def options(self, base: PlanOptions) -> PlanOptions:
        return base.replace(**dict(self.changes))

    def get(self, name: str, default: Any = None) -> Any:
        return dict(self.changes).get(name, default)


@dataclass(frozen=True)
class Tried:
    """What a try gave: its candidate (a Plan, or what the search compares before it assembles
    the winner), None when it has none to compare and no error says why, or the error."""

    attempt: Try
    result: Any
    error: AutoshardError | None

    @property
    def plan(self) -> Any:
        return self.result

    @property
    def step_time_s(self) -> float | None:
        return self.result.predicted.step_time_s if self.result is not None else None


def plan_step(plan: Any) -> float:
    """The default price of a candidate: its plan's predicted step."""
    return plan.predicted.step_time_s


def run_search(tries: Sequence[Try], solve: Callable[[Try], Any], *,
               price: Callable[[Any], Any] = plan_step,
               until: Callable[[Any], bool] | None = None,
               recoverable: Callable[[AutoshardError], bool] | None = None,
               error_of_none: str = "first") -> tuple[Any, list[Tried]]:
    """Solve every try with ``solve`` and keep the candidate of least ``price``; of equal ones
    the first. An AutoshardError is that try's outcome where ``recoverable`` allows it (default:
    every one), else the search's; ``until``: a candidate that ends the search (a ladder stops
    at its first rung that plans). None solved: the ``error_of_none`` ("first" or "last") try's
    error is raised, the one that says most about why (a search orders its tries so); with
    "none", or no error either: (None, the tries), for the search to say why."""
    _check(tries, error_of_none)
    done: list[Tried] = []
    for t in tries:
        try:
            if t.announce:
                with progress.step(t.label):
                    done.append(Tried(t, solve(t), None))
            else:
                done.append(Tried(t, solve(t), None))
        except AutoshardError as e:
            if recoverable is not None and not recoverable(e):
                raise
            done.append(Tried(t, None, e))
        if until is not None and done[-1].result is not None and until(done[-1].result):
            break
    found = [d for d in done if d.result is not None]
    if not found:
        errors = [d.error for d in done if d.error is not None]
        if errors and error_of_none != "none":
            raise errors[0] if error_of_none == "first" else errors[-1]
        return None, done
    return min(found, key=lambda d: price(d.result)).result, done


def _check(tries: Sequence[Try], error_of_none: str) -> None:
    if not tries:
        raise AutoshardError("a search with at least one try", got="none",
                             fix="list the candidates to compare")
    if error_of_none not in ("first", "last", "none"):
        raise AutoshardError('error_of_none "first", "last" or "none"', got=repr(error_of_none),
                             fix='pass error_of_none="first", "last" or "none"')
