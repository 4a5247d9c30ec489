"""The record of the planner's searches that a plan carries in ``solver["searches"]``: one
:class:`SearchRecord` per search that ran (its name, the try it ran inside, its tries), each try
a :class:`TryRecord` (label, changes, predicted step or error, whether the search kept it).
The search driver (solver/search.py ``run_search``) writes them; the summary and the tools read
them through :func:`searches` (docs/design.md, "Searches as data"; docs/plan-format.md)."""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

# The keys every try's JSON has; any other key is one of the search's own facts about what
# the try gave (a pipeline's microbatches and schedule, a mesh's planning seconds, ...).
TRY_KEYS = ("label", "changes", "step_time_s", "error", "chosen")


@dataclass(frozen=True)
class TryRecord:
    """One try of a search: ``changes`` as plain JSON values; ``step_time_s`` its predicted
    step (None: no plan, or none to compare); ``error`` why it has no plan (None: it has one,
    or the search passed it over without an error, e.g. a time budget spent)."""

    label: str
    changes: dict[str, Any]
    step_time_s: float | None = None
    error: str | None = None
    chosen: bool = False
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        clash = set(self.facts) & set(TRY_KEYS)
        assert not clash, f"a search's facts may not reuse the try's keys: {clash}"
        return {"label": self.label, "changes": self.changes, "step_time_s": self.step_time_s,
                "error": self.error, "chosen": self.chosen, **self.facts}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TryRecord:
        return cls(str(d.get("label", "")), dict(d.get("changes") or {}), d.get("step_time_s"),
                   d.get("error"), bool(d.get("chosen", False)),
                   {k: v for k, v in d.items() if k not in TRY_KEYS})


@dataclass(frozen=True)
class SearchRecord:
    """One search that ran: ``within`` (i, k) when it ran inside try k of ``searches[i]`` (a
    memory ladder inside a pipeline try), None at the top; its tries in the order tried."""

    search: str
    within: tuple[int, int] | None
    tries: tuple[TryRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {"search": self.search,
                "within": list(self.within) if self.within is not None else None,
                "tries": [t.to_json() for t in self.tries]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SearchRecord:
        w = d.get("within")
        return cls(str(d.get("search", "")), (int(w[0]), int(w[1])) if w else None,
                   tuple(TryRecord.from_json(t) for t in d.get("tries", ())))

    @property
    def chosen(self) -> TryRecord | None:
        return next((t for t in self.tries if t.chosen), None)


def searches(solver: dict[str, Any]) -> list[SearchRecord]:
    """The searches a plan's ``solver`` records, in the order they started (an enclosing
    search before the ones inside its tries); none for a plan file written before they were
    recorded, or whose record is not a list."""
    raw = solver.get("searches")
    if not isinstance(raw, list):
        return []
    return [SearchRecord.from_json(d) for d in raw if isinstance(d, dict)]


def named(records: list[SearchRecord], name: str, *, top: bool = False) -> list[SearchRecord]:
    """The records of the search ``name``; ``top``: only those that ran inside no try."""
    return [r for r in records if r.search == name and not (top and r.within is not None)]


def on_chosen_path(records: list[SearchRecord], name: str) -> list[SearchRecord]:
    """The records of the search ``name`` that ran inside kept tries only (every enclosing
    try, up to the top, the one its search kept): the searches that made the plan's own
    candidate, rather than one a search passed over."""
    def kept(r: SearchRecord) -> bool:
        while r.within is not None:
            i, k = r.within
            r = records[i]
            if not r.tries[k].chosen:
                return False
        return True
    return [r for r in named(records, name) if kept(r)]


def plain(value: Any) -> Any:
    """A try's change as a JSON value: numbers, strings, None and bools as they are; tuples
    and lists as lists; dicts with string keys; a dataclass as its fields; an enum as its
    value; anything else as its text."""
    if isinstance(value, enum.Enum):
        return plain(value.value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)
