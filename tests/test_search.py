"""Searches as data (solver/search.py): the driver keeps the fastest try, records every try, and
says why when none plans; the planner's searches that run through it, listed as their tries."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.solver.planner import microbatch_tries, pipeline_tries
from autoshard.solver.search import Try, run_search


def _plan(step: float):
    return SimpleNamespace(predicted={"step_time_s": step})


def _run(steps: dict[str, float | str]):
    """A plan_one that gives each label its step, or raises its text as the try's error."""
    def plan_one(t: Try):
        v = steps[t.label]
        if isinstance(v, str):
            raise AutoshardError("a plan", got=v, fix="-")
        return _plan(v)
    return plan_one


def test_fastest_kept_first_on_ties_and_every_try_recorded() -> None:
    tries = [Try(n, ()) for n in "abcd"]
    best, tried = run_search(tries, _run({"a": 3.0, "b": 1.0, "c": "no fit", "d": 1.0}))
    assert best.predicted["step_time_s"] == 1.0 and best is tried[1].plan
    assert [t.attempt.label for t in tried] == ["a", "b", "c", "d"]
    assert [t.step_time_s for t in tried] == [3.0, 1.0, None, 1.0]
    assert tried[2].plan is None and tried[2].error.got == "no fit"


@pytest.mark.parametrize("which, got", [("first", "one"), ("last", "two")])
def test_none_planned_raises_the_chosen_error(which: str, got: str) -> None:
    with pytest.raises(AutoshardError) as e:
        run_search([Try("a", ()), Try("b", ())], _run({"a": "one", "b": "two"}),
                   error_of_none=which)
    assert e.value.got == got


def test_bad_searches_are_refused() -> None:
    with pytest.raises(AutoshardError, match="at least one try"):
        run_search([], _run({}))
    with pytest.raises(AutoshardError, match="error_of_none"):
        run_search([Try("a", ())], _run({"a": 1.0}), error_of_none="best")


def test_a_try_changes_the_options() -> None:
    t = Try("pipeline over pp", (("pipeline", "pp"), ("microbatches", 4)))
    o = t.options(PlanOptions())
    assert (o.pipeline, o.microbatches) == ("pp", 4)


def test_the_searches_that_run_through_the_driver() -> None:
    """Each search as its list of tries: a change here changes what the planner compares."""
    mesh = Mesh((2, 1, 4), ("pp", "x", "dp"), cluster="cpu")
    assert [(t.label, dict(t.changes)) for t in pipeline_tries(mesh)] == [
        ("without a pipeline", {"pipeline": None, "microbatches": "auto"}),
        ("pipeline over pp", {"pipeline": "pp"}),
        ("pipeline over dp", {"pipeline": "dp"})]
    assert [(t.label, dict(t.changes)) for t in microbatch_tries([2, 4, 8])] == [
        ("2 microbatches", {"microbatches": 2}), ("4 microbatches", {"microbatches": 4}),
        ("8 microbatches", {"microbatches": 8})]
