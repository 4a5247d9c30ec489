"""Searches as data (solver/search.py): the driver keeps the cheapest try, records every try, and
says why when none plans; every search of the planner that runs through it, listed as its
tries."""
from __future__ import annotations

import json
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions
from autoshard.options import resolve_options
from autoshard.solver.budget import offload_tries, recompute_tries, remedy_tries
from autoshard.plans.prediction import Prediction
from autoshard.plans.searches import named, on_chosen_path, searches
from autoshard.solver.merging import grouping_tries
from autoshard.solver.meshes import Candidate, mesh_tries
from autoshard.solver.pipeline import schedule_tries
from autoshard.solver.planner import microbatch_tries, pipeline_tries
from autoshard.solver.search import Try, apart, records_searches, run_search
from autoshard.trace.export import trace
from autoshard.trace.layers import checkpointable
from autoshard.zoo.registry import get_model, load_model


def _plan(step: float):
    return SimpleNamespace(predicted=Prediction(step, step, 0.0, 0.0))


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
    best, tried = run_search("s", tries, _run({"a": 3.0, "b": 1.0, "c": "no fit", "d": 1.0}))
    assert best.predicted.step_time_s == 1.0 and best is tried[1].plan
    assert [t.attempt.label for t in tried] == ["a", "b", "c", "d"]
    assert [t.step_time_s for t in tried] == [3.0, 1.0, None, 1.0]
    assert tried[2].plan is None and tried[2].error.got == "no fit"


@pytest.mark.parametrize("which, got", [("first", "one"), ("last", "two")])
def test_none_planned_raises_the_chosen_error(which: str, got: str) -> None:
    with pytest.raises(AutoshardError) as e:
        run_search("s", [Try("a", ()), Try("b", ())], _run({"a": "one", "b": "two"}),
                   error_of_none=which)
    assert e.value.got == got


def test_bad_searches_are_refused() -> None:
    with pytest.raises(AutoshardError, match="at least one try"):
        run_search("s", [], _run({}))
    with pytest.raises(AutoshardError, match='"first", "last" or "none"'):
        run_search("s", [Try("a", ())], _run({"a": 1.0}), error_of_none="best")


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


def test_a_ladder_stops_at_its_first_rung_that_plans_and_passes_on_other_errors() -> None:
    """until: the memory ladder keeps its cheapest rung that plans, not the fastest of all;
    recoverable: an error that is not the try's outcome (a bug, a bad input) ends the search."""
    best, tried = run_search("s", [Try(n, ()) for n in "abc"], _run({"a": "no fit", "b": 5.0,
                                                                 "c": 1.0}),
                             until=lambda p: True)
    assert best.predicted.step_time_s == 5.0 and [t.attempt.label for t in tried] == ["a", "b"]
    with pytest.raises(AutoshardError, match="bad input"):
        run_search("s", [Try("a", ()), Try("b", ())], _run({"a": "bad input", "b": 1.0}),
                   recoverable=lambda e: e.got != "bad input")
    best, tried = run_search("s", [Try("a", ())], _run({"a": "no fit"}), error_of_none="none")
    assert best is None and tried[0].error.got == "no fit"


def test_candidates_are_compared_on_their_price_before_any_is_assembled() -> None:
    """A search that compares what it solved (a schedule's step and tie-breaks) assembles only
    the winner: the price is the search's own; a try with nothing to compare is passed over."""
    prices = {"a": (2.0, True), "b": (2.0, False), "c": None}
    best, tried = run_search("s", [Try(n, (), announce=False) for n in "abc"],
                             lambda t: prices[t.label], price=lambda c: c)
    assert best == (2.0, False) and tried[2].result is None and tried[2].error is None


def _changes(tries):
    return [(t.label, dict(t.changes)) for t in tries]


def test_the_memory_searches_as_tries() -> None:
    """The memory ladder (offload, cheapest first), the checkpointing search (none, selective,
    full) and the budget's remedies (what lowers the phase that binds first) as their lists of
    tries."""
    assert _changes(recompute_tries()) == [
        ("without activation checkpointing", {"recompute": None}),
        ("activation checkpointing (selective)", {"recompute": "selective"}),
        ("activation checkpointing (full)", {"recompute": "full"})]
    traced = trace(*get_model("gpt2-tiny", batch=4))
    assert _changes(offload_tries(traced, resolve_options(None, {}))) == [
        ("without offload", {"offload": "none"}),
        ("no plan fits: with optimizer offload", {"offload": "optimizer"}),
        ("no plan fits: with parameter offload", {"offload": "parameters"})]
    assert _changes(offload_tries(traced, resolve_options(None, {"offload": "optimizer"}))) \
        == [("as asked", {"offload": "optimizer"})]
    assert _changes(offload_tries(traced, resolve_options(None, {"optimizer": "sgd"}))) == [
        ("without offload", {"offload": "none"})]
    layers = checkpointable(traced.graph, traced.layers)
    full = dict.fromkeys(layers, "full")
    opts = resolve_options(None, {})
    n = len(layers)

    def plan_at(phase: str):
        return SimpleNamespace(recompute={}, param_state={}, options=opts,
                               predicted=Prediction(1.0, 1.0, 0.0, 0.0, peak_phase=phase))
    with_ = "the step peaks above the budget: with "
    assert _changes(remedy_tries(traced, opts, plan_at("optimizer"))) == [
        (with_ + "no checkpointing, optimizer offload",
         {"recompute": {}, "offload": "optimizer"}),
        (with_ + "no checkpointing, parameter offload",
         {"recompute": {}, "offload": "parameters"}),
        (with_ + f"full checkpointing of {n} layers, parameter offload",
         {"recompute": full, "offload": "parameters"})]
    assert _changes(remedy_tries(traced, opts, plan_at("backward"))) == [
        (with_ + f"full checkpointing of {n} layers", {"recompute": full, "offload": "none"}),
        (with_ + f"full checkpointing of {n} layers, optimizer offload",
         {"recompute": full, "offload": "optimizer"}),
        (with_ + f"full checkpointing of {n} layers, parameter offload",
         {"recompute": full, "offload": "parameters"})]


def test_the_axis_groupings_and_schedules_as_tries() -> None:
    """A 3-axis mesh's groupings, each solved merged and then priced one axis at a time (every
    axis on its own only when each has 2 or more devices); the pipeline schedules in order."""
    labels = [t.label for t in grouping_tries(Mesh((2, 2, 2), ("a", "b", "c"), cluster="cpu"))]
    groupings = ["a,b+c", "a+b,c", "a,b,c", "a,c+b", "a+b+c"]
    assert labels == [x for g in groupings
                      for x in (f"axes grouped as {g}", f"axes grouped as {g}, one axis at a time")]
    assert all(dict(t.changes)["joint"] == (k % 2 == 0)
               for k, t in enumerate(grouping_tries(Mesh((2, 2, 2), cluster="cpu"))))
    assert len(grouping_tries(Mesh((2, 1, 2), ("a", "b", "c"), cluster="cpu"))) == 8
    assert _changes(schedule_tries(("1F1B", "GPipe"))) == [
        ("1F1B", {"schedule": "1F1B"}), ("GPipe", {"schedule": "GPipe"})]


def test_the_mesh_search_rounds_as_tries() -> None:
    """The mesh search (a local search: each round's meshes are the best one's neighbours, then
    the rest, then the chosen mesh at the other microbatch counts) gives each round to the
    driver as its tries."""
    a, b = Candidate(1, 2, 2), Candidate(2, 1, 2)
    assert _changes(mesh_tries([a, b])) == [(str(a), {"mesh": a}), (str(b), {"mesh": b})]
    assert _changes(mesh_tries([b], [2, 8])) == [
        (f"{b} at 2 microbatches", {"mesh": b, "microbatches": 2, "again": True}),
        (f"{b} at 8 microbatches", {"mesh": b, "microbatches": 8, "again": True})]


@pytest.mark.parametrize("steps, kept", [({2: 3.0, 4: 1.0}, 4), ({2: 2.0, 4: 5.0}, 8)])
def test_the_chosen_mesh_keeps_another_microbatch_count_only_if_faster(steps, kept) -> None:
    """The last round: the chosen pipelined mesh (screened at 8 microbatches, step 2.0) planned
    at 2 and 4; another count replaces it only when strictly faster (ties keep the screened)."""
    from autoshard.solver.meshes import Tried as MeshTried, _other_counts
    c = Candidate(2, 1, 1)
    best = MeshTried(c, 8, plan=_plan(2.0))
    seen = []

    def solve(t: Try):
        seen.append(t.get("microbatches"))
        return MeshTried(c, t.get("microbatches"), plan=_plan(steps[t.get("microbatches")]))
    _other_counts(best, 8, solve)
    assert seen == [2, 4] and best.microbatches == kept
    assert best.plan.predicted.step_time_s == min(2.0, *steps.values())


# ------------------------------------------------------------------ the record of the searches

@dataclass(frozen=True)
class _Planned:
    """What a planning call returns, as far as the record goes: a plan's ``solver`` dict."""
    solver: dict


def _outer(t: Try):
    """An outer search's try that runs an inner search of its own: "x" plans, "y" does not."""
    inner = {"x": {"a": 3.0, "b": "no fit"}, "y": {"c": 1.0}}[t.label]
    run_search("inner", [Try(n, ((n, [1, (2, 3)]),)) for n in inner], _run(inner))
    if t.label == "y":
        raise AutoshardError("a plan", got="too big", fix="-")
    return _plan(3.0)


def test_the_driver_records_every_try_and_what_it_ran_inside() -> None:
    """Each search's tries in order with their changes as JSON values, the step or the error
    and the kept one; a search inside a try names that try (within: its search's index in the
    record, the try's index in it), so the inner searches of the two outer tries stay apart."""
    @records_searches
    def planner() -> _Planned:
        run_search("outer", [Try("x", (("k", 1),)), Try("y", (("k", (2, 3)),))], _outer)
        return _Planned({"status": "OPTIMAL"})

    solver = planner().solver
    assert solver["status"] == "OPTIMAL"
    got = solver["searches"]
    assert json.loads(json.dumps(got)) == got
    assert [(r["search"], r["within"]) for r in got] == [
        ("outer", None), ("inner", [0, 0]), ("inner", [0, 1])]
    assert got[0]["tries"] == [
        {"label": "x", "changes": {"k": 1}, "step_time_s": 3.0, "error": None, "chosen": True},
        {"label": "y", "changes": {"k": [2, 3]}, "step_time_s": None, "error": "too big",
         "chosen": False}]
    assert [(t["label"], t["changes"], t["step_time_s"], t["error"], t["chosen"])
            for t in got[1]["tries"]] == [("a", {"a": [1, [2, 3]]}, 3.0, None, True),
                                          ("b", {"b": [1, [2, 3]]}, None, "no fit", False)]
    records = searches(solver)
    assert records[2].chosen.label == "c" and records[0].chosen.label == "x"
    assert on_chosen_path(records, "inner") == [records[1]]        # inside the kept try only


def test_a_search_that_fails_is_recorded_and_calls_inside_record_nothing_of_their_own() -> None:
    """A search that raises (none planned; an error that is not a try's outcome) is in the
    record with every try it made; a planning call inside another adds its searches to the
    outer call's record; a plan made apart (to compare with) adds none."""
    @records_searches
    def inner_call() -> _Planned:
        run_search("inside", [Try("i", ())], _run({"i": 2.0}))
        return _Planned({})

    @records_searches
    def planner() -> _Planned:
        with pytest.raises(AutoshardError):
            run_search("none plans", [Try("a", ()), Try("b", ())], _run({"a": "x", "b": "y"}))
        with pytest.raises(AutoshardError):
            run_search("bad input", [Try("a", ()), Try("b", ())],
                       _run({"a": "bad", "b": 1.0}), recoverable=lambda e: e.got != "bad")
        assert "searches" not in inner_call().solver
        with apart():
            assert [r["search"] for r in inner_call().solver["searches"]] == ["inside"]
        return _Planned({})

    got = planner().solver["searches"]
    assert [r["search"] for r in got] == ["none plans", "bad input", "inside"]
    assert [t["error"] for t in got[0]["tries"]] == ["x", "y"]
    assert [(t["label"], t["error"]) for t in got[1]["tries"]] == [("a", "bad")]
    assert not any(t["chosen"] for r in got[:2] for t in r["tries"])
    # Outside a planning call nothing is collected, and the search runs as before.
    assert run_search("alone", [Try("a", ())], _run({"a": 1.0}))[0].predicted.step_time_s == 1.0


def test_a_plan_records_its_searches_and_keeps_them_in_its_file() -> None:
    """pipeline='auto' on a pipeline axis: the search over it at the top, each try's own
    searches (memory ladder, checkpointing, the pipeline's schedules) inside it; the record
    survives the plan file, and the summary's pipeline line is read from it."""
    from autoshard.plans import Plan
    from autoshard.solver.planner import plan
    model, inputs = load_model("gpt2-tiny", batch=4, seq=8, device="meta")
    p = plan(model, inputs, Mesh((2,), ("pp",), cluster="cpu"), pipeline="auto",
             microbatches=2)
    records = searches(p.solver)
    [top] = named(records, "pipeline axis", top=True)
    assert [(t.label, t.changes) for t in top.tries] == [
        ("without a pipeline", {"pipeline": None, "microbatches": "auto"}),
        ("pipeline over pp", {"pipeline": "pp"})]
    assert all(t.step_time_s is not None and t.error is None for t in top.tries)
    assert top.chosen.step_time_s == p.predicted.step_time_s == min(
        t.step_time_s for t in top.tries)
    assert top.tries[1].facts["microbatches"] == 2
    # Every other search ran inside a try, of a search listed before it.
    assert all(r.within is not None and r.within[0] < i and
               r.within[1] < len(records[r.within[0]].tries)
               for i, r in enumerate(records) if r is not top)
    inside_pp = {r.search for r in records if r.within == (0, 1)}
    assert {"memory ladder", "schedules"} <= inside_pp
    assert {r.search for r in records if r.within == (0, 0)} == {"memory ladder"}
    assert "pipeline_search" not in p.solver
    again = Plan.loads(p.dumps())
    assert again.solver["searches"] == p.solver["searches"] and again.dumps() == p.dumps()
    assert "pipeline search (pipeline='auto'): none " in again.summary()
    assert "<- chosen" in again.summary()


def test_a_plan_file_with_the_old_search_keys_still_loads_and_summarises() -> None:
    """Files written before the record: their ad-hoc ``pipeline_search`` and ``mesh_search``
    stay in the free ``solver`` dict, and the summary leaves their lines out."""
    from autoshard.plans import Plan
    from autoshard.solver.planner import plan_traced
    traced = trace(*get_model("mlp-tiny", batch=4))
    d = json.loads(plan_traced(traced, Mesh((2,), cluster="cpu")).dumps())
    del d["solver"]["searches"]
    d["solver"]["pipeline_search"] = [{"pipeline": None, "step_time_s": 1e-3}]
    d["solver"]["mesh_search"] = {"gpus": 2, "gpus_per_node": 2, "candidates": 1,
                                  "tried": [], "not_tried": [], "search_s": 0.1}
    old = Plan.loads(json.dumps(d))
    assert searches(old.solver) == [] and old.solver["mesh_search"]["gpus"] == 2
    assert "search" not in old.summary()
