"""The plan file: round trip, refusal of bad or stale files, and committed plan snapshots.

Snapshots: ``tests/snapshots/<name>.txt`` hold ``plan.summary()`` and
``plan.explain()`` of a few small models, so a change in planning shows up as a readable diff in
review. After an intended change, regenerate them and commit the diff::

    AUTOSHARD_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_plan_format.py
"""
from __future__ import annotations

import builtins
import difflib
import json
import os
import pickle
from pathlib import Path

import pytest

from autoshard import Mesh
from autoshard.errors import AutoshardError
from autoshard.plans import Plan
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import TracedGraph, trace
from autoshard.zoo.registry import get_model

SNAPSHOTS = Path(__file__).parent / "snapshots"
UPDATE = os.environ.get("AUTOSHARD_UPDATE_SNAPSHOTS") == "1"
# Batches large enough, on the compute-bound ``cpu`` cluster, that the plans shard and move data:
# at their zoo batches these tiny models replicate everything, which would make dull snapshots.
BATCH = {"gpt2-tiny": 256, "mlp-tiny": 65536}
CLUSTER = "cpu"
CASES = {"gpt2-tiny-2": ("gpt2-tiny", (2,)), "gpt2-tiny-2x2": ("gpt2-tiny", (2, 2)),
         "mlp-tiny-4": ("mlp-tiny", (4,))}


@pytest.fixture(scope="module")
def traces() -> dict[str, TracedGraph]:
    out = {}
    for name, batch in BATCH.items():
        model, inputs = get_model(name, batch=batch)
        out[name] = trace(model, inputs)
    return out


@pytest.fixture(scope="module")
def plans(traces) -> dict[str, Plan]:
    return {case: plan_traced(traces[model], Mesh(shape, cluster=CLUSTER), model_name=model)
            for case, (model, shape) in CASES.items()}


def snapshot_text(case: str, p: Plan) -> str:
    model, shape = CASES[case]
    head = f"# {model}, batch {BATCH[model]}, mesh {shape}, cluster {CLUSTER}"
    return f"{head}\n{p.summary()}\n\n{p.explain()}\n"


# ------------------------------------------------------------------------------ round trip

@pytest.mark.parametrize("case", sorted(CASES))
def test_save_load_round_trip(plans, tmp_path, case: str) -> None:
    p = plans[case]
    path = tmp_path / "plan.json"
    p.save(path)
    q = Plan.load(path)
    assert q == p
    assert q.dumps() == p.dumps() == path.read_text()
    assert q.strategies() == p.strategies()


# ------------------------------------------------------------------------------ refusals

def _doc(plans) -> dict:
    return json.loads(plans["gpt2-tiny-2x2"].dumps())


def _refused(text: str, *fragments: str) -> str:
    with pytest.raises(AutoshardError) as info:
        Plan.loads(text, source="plan.json")
    msg = str(info.value)
    assert "got" in msg and "Fix" in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


@pytest.mark.parametrize("text", ["", "{not json", '{"format": "autoshard.plan",'])
def test_malformed_json_is_refused(text: str) -> None:
    _refused(text, "JSON", "plan.json")


def test_wrong_format_is_refused(plans) -> None:
    d = _doc(plans)
    d["format"] = "someone.else"
    _refused(json.dumps(d), '"format": "autoshard.plan"', "someone.else")
    _refused(json.dumps([1, 2]), '"format": "autoshard.plan"', "list")


@pytest.mark.parametrize("version", [0, 1, 3, "2", None])
def test_wrong_version_is_refused(plans, version) -> None:
    d = _doc(plans)
    d["version"] = version
    _refused(json.dumps(d), "version 2", repr(version))


@pytest.mark.parametrize("key", ["mesh", "fingerprint", "options", "layers", "nodes", "params",
                                 "inputs", "collectives", "predicted", "solver"])
def test_missing_key_is_refused(plans, key: str) -> None:
    d = _doc(plans)
    del d[key]
    _refused(json.dumps(d), "a complete plan", repr(key))


def test_bad_placement_is_refused(plans) -> None:
    d = _doc(plans)
    d["params"][next(iter(d["params"]))]["placements"] = "[S(zero)]"
    _refused(json.dumps(d), "malformed", "zero")


def test_loading_never_executes_code(plans, tmp_path, monkeypatch) -> None:
    """Strings that look like code stay strings; loading uses no eval, exec or pickle."""
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    d = _doc(plans)
    d["model"] = code
    d["nodes"][0]["op"] = code
    d["solver"]["status"] = code
    d["collectives"] = [{"kind": code, "axes": [code], "bytes": 1, "phase": "forward",
                         "node": code, "value": code}]

    def refuse(*args, **kwargs):
        raise AssertionError("Plan.loads must not evaluate anything")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    p = Plan.loads(json.dumps(d))
    assert p.model == code and p.nodes[0].op == code and p.solver["status"] == code
    assert p.collectives[0].kind == code
    assert not marker.exists()
    # A phase or a placement written as code is refused, not run.
    with pytest.raises(AutoshardError):
        Plan.loads(json.dumps({**d, "collectives": [{**d["collectives"][0], "phase": code}]}))
    d["params"][next(iter(d["params"]))]["placements"] = f"[{code}]"
    with pytest.raises(AutoshardError):
        Plan.loads(json.dumps(d))
    assert not marker.exists()


# ------------------------------------------------------------------------------ stale plans

def test_stale_plan_is_refused_naming_the_first_differences(plans, traces) -> None:
    p = plans["gpt2-tiny-2"]                      # planned for seq 16
    fresh = traces["gpt2-tiny"]
    p.check_matches(fresh.fingerprint, fresh.node_sigs)     # the same graph passes
    model, inputs = get_model("gpt2-tiny", batch=BATCH["gpt2-tiny"], seq=8)
    short = trace(model, inputs)
    assert short.fingerprint != p.fingerprint
    first = next(n for n in p.node_sigs if p.node_sigs[n] != short.node_sigs.get(n))
    with pytest.raises(AutoshardError) as info:
        p.check_matches(short.fingerprint, short.node_sigs)
    msg = str(info.value)
    assert short.fingerprint in msg and p.fingerprint in msg
    assert f"{first}: plan has {p.node_sigs[first]}" in msg, msg
    b = BATCH["gpt2-tiny"]
    assert f"[{b}, 16]" in msg and f"[{b}, 8]" in msg    # the differing input shapes
    assert "got" in msg and "Fix" in msg
    # Another model altogether.
    mlp = traces["mlp-tiny"]
    with pytest.raises(AutoshardError) as info:
        p.check_matches(mlp.fingerprint, mlp.node_sigs)
    assert "first differences" in str(info.value)


def test_plan_for_another_mesh_is_refused(plans) -> None:
    p = plans["gpt2-tiny-2x2"]
    p.check_mesh((2, 2), p.mesh_axes)
    with pytest.raises(AutoshardError) as info:
        p.check_mesh((4,), ("x",))
    assert "(2, 2)" in str(info.value) and "(4,)" in str(info.value)


# ------------------------------------------------------------------------------ snapshots

@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_snapshot(plans, case: str) -> None:
    path = SNAPSHOTS / f"{case}.txt"
    text = snapshot_text(case, plans[case])
    if UPDATE:
        SNAPSHOTS.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.exists(), (f"no snapshot {path.name}; create it with "
                           "AUTOSHARD_UPDATE_SNAPSHOTS=1 python -m pytest tests/test_plan_format.py")
    want = path.read_text()
    if text != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                            f"snapshots/{case}.txt", "this run"))
        pytest.fail(f"the plan of {case} changed (if intended, regenerate with "
                    f"AUTOSHARD_UPDATE_SNAPSHOTS=1 and commit the diff):\n{diff}")
