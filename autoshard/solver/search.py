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
level, a checkpointing policy, a grouping of axes) that its ``solve`` reads.

The record: the driver itself writes every search it runs, each try with its changes, its
predicted step or error and whether it was kept (plans/searches.py), into the collector of the
planning call that is running: :func:`records_searches` opens one on the outermost call of the
planner (``plan_with``, ``plan_traced``, ``search_mesh``, ``plan_merged``) and puts what it
collected into that call's plan, ``solver["searches"]``. A search that starts while a try of
another is being solved records which try it ran inside (``within``), so the searches of a
pipeline try's memory ladder stay that try's. A context variable carries the collector and the
try being solved: no caller passes either, and none builds a record."""
from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence

from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.options import PlanOptions
from autoshard.plans.searches import SearchRecord, TryRecord, plain


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


def plan_facts(plan: Any) -> dict[str, Any]:
    """The default facts a try's record keeps of its candidate beside its step: a pipelined
    plan's microbatch count and schedule."""
    pl = getattr(plan, "pipeline", None)
    return {"microbatches": pl.microbatches, "schedule": plain(pl.schedule)} if pl else {}


# The collector of the planning call that is running (the records, one per search, in the
# order they started) and the try being solved in it (record index, try index), if any.
_AT: ContextVar[tuple[list, tuple[int, int] | None] | None] = ContextVar("autoshard_searches",
                                                                         default=None)


def run_search(name: str, tries: Sequence[Try], solve: Callable[[Try], Any], *,
               price: Callable[[Any], Any] = plan_step,
               until: Callable[[Any], bool] | None = None,
               recoverable: Callable[[AutoshardError], bool] | None = None,
               error_of_none: str = "first", step: Callable[[Any], float] = plan_step,
               facts: Callable[[Any], dict[str, Any]] = plan_facts) -> tuple[Any, list[Tried]]:
    """Solve every try with ``solve`` and keep the candidate of least ``price``; of equal ones
    the first. An AutoshardError is that try's outcome where ``recoverable`` allows it (default:
    every one), else the search's; ``until``: a candidate that ends the search (a ladder stops
    at its first rung that plans). None solved: the ``error_of_none`` ("first" or "last") try's
    error is raised, the one that says most about why (a search orders its tries so); with
    "none", or no error either: (None, the tries), for the search to say why.

    The search is recorded as ``name`` (module docstring), whether it returns or raises: each
    try with its ``step`` (default: its plan's predicted step) and ``facts``."""
    _check(tries, error_of_none)
    at = _AT.get()
    index = None
    if at is not None:
        index = len(at[0])
        at[0].append(None)          # its place: an enclosing search is listed first
    done: list[Tried] = []
    best = None
    try:
        for k, t in enumerate(tries):
            inside = (at[0], (index, k)) if at is not None else None
            try:
                done.append(_solve_one(t, solve, recoverable, inside))
            except AutoshardError as e:     # the search's error: the try is recorded with it
                done.append(Tried(t, None, e))
                raise
            if until is not None and done[-1].result is not None and until(done[-1].result):
                break
        found = [d for d in done if d.result is not None]
        if not found:
            errors = [d.error for d in done if d.error is not None]
            if errors and error_of_none != "none":
                raise errors[0] if error_of_none == "first" else errors[-1]
            return None, done
        best = min(found, key=lambda d: price(d.result))
        return best.result, done
    finally:
        if at is not None:
            at[0][index] = _record(name, at[1], done, best, step, facts)


def _solve_one(t: Try, solve: Callable[[Try], Any],
               recoverable: Callable[[AutoshardError], bool] | None,
               inside: tuple[list, tuple[int, int]] | None) -> Tried:
    """One try solved, with the collector told that searches starting now run inside it."""
    token = _AT.set(inside) if inside else None
    try:
        if t.announce:
            with progress.step(t.label):
                return Tried(t, solve(t), None)
        return Tried(t, solve(t), None)
    except AutoshardError as e:
        if recoverable is not None and not recoverable(e):
            raise
        return Tried(t, None, e)
    finally:
        if token is not None:
            _AT.reset(token)


def _record(name: str, within: tuple[int, int] | None, done: list[Tried], best: Tried | None,
            step: Callable[[Any], float], facts: Callable[[Any], dict[str, Any]]
            ) -> dict[str, Any]:
    tries = tuple(TryRecord(d.attempt.label, plain(dict(d.attempt.changes)),
                            step(d.result) if d.result is not None else None,
                            (d.error.got or str(d.error)) if d.error is not None else None,
                            d is best, facts(d.result) if d.result is not None else {})
                  for d in done)
    return SearchRecord(name, within, tries).to_json()


def records_searches(planner: Callable[..., Any]) -> Callable[..., Any]:
    """``planner`` (a function that returns a Plan) with the searches it runs recorded in its
    plan's ``solver["searches"]``, when it is the outermost planning call; called inside
    another, its searches are that call's (the module docstring)."""
    @functools.wraps(planner)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        if _AT.get() is not None:
            return planner(*args, **kwargs)
        records: list = []
        token = _AT.set((records, None))
        try:
            plan = planner(*args, **kwargs)
        finally:
            _AT.reset(token)
        return replace(plan, solver={**plan.solver, "searches": records})
    return recorded


@contextmanager
def apart() -> Iterator[None]:
    """Plans made in this block are not the running call's: their searches stay out of its
    record (a plan made only to compare with, on another mesh)."""
    token = _AT.set(None)
    try:
        yield
    finally:
        _AT.reset(token)


def _check(tries: Sequence[Try], error_of_none: str) -> None:
    if not tries:
        raise AutoshardError("a search with at least one try", got="none",
                             fix="list the candidates to compare")
    if error_of_none not in ("first", "last", "none"):
        raise AutoshardError('error_of_none "first", "last" or "none"', got=repr(error_of_none),
                             fix='pass error_of_none="first", "last" or "none"')


def fitting_edge(measure: Callable[[int], float], fit: int, far: int, budget: float, *,
                 m_fit: float, x: Callable[[int], float] = float) -> int:
    """The count nearest ``far`` (``far`` itself included) whose ``measure`` is within
    ``budget``, between ``fit``, a count known to be within it (``m_fit``), and ``far``; the
    measure is monotone from one to the other and priced once per count tried (a plan's memory
    at k layers checkpointed, solver/budget.py; its liveness peak at j offload moves undone,
    solver/offload_split.py).

    Regula falsi on ``x(k)`` (the count itself by default; a quantity the measure grows about
    linearly in): ``far`` is priced first, then where the line through the nearest count known
    to fit and the nearest known not to meets the budget, the count on the fitting side of
    that point (or next to the fitting count, if the line puts none nearer). Where the measure
    is that line, two to three pricings settle it, where a bisection takes one per halving
    (seven for 80 layers)."""
    toward = 1 if far > fit else -1
    k, miss = far, None                      # miss: (count, measure) nearest fit that overflowed
    while fit != far:
        m = measure(k)
        if m <= budget:
            fit, m_fit = k, m
        else:
            far, miss = k - toward, (k, m)
        if fit == far:
            break
        # The next count: strictly past fit, at most far.
        span = range(fit + toward, far + toward, toward)
        k = span[(len(span) - 1) // 2]           # the middle, where the line says nothing
        if miss is not None and miss[1] > m_fit and x(miss[0]) != x(fit):
            want = x(fit) + (budget - m_fit) * (x(miss[0]) - x(fit)) / (miss[1] - m_fit)
            ahead = [c for c in span if (x(c) - want) * (x(miss[0]) - x(fit)) <= 0]
            k = ahead[-1] if ahead else span[0]
    return fit
