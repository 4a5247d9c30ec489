"""Fuzzing the loaders of user files: whatever a plan file or a cluster profile holds, loading it
gives a usable value or an AutoshardError, never another exception (docs/design.md, "Errors").

Hypothesis mutates valid files: it drops keys at any depth, retypes values (str, int, list, dict,
null, bool, nan, inf), reorders, duplicates and renames entries, edits strings and numbers, and
truncates the text. ``derandomize=True``: CI runs the same cases every time, and a failure here
reproduces with the same seed on any machine.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import autoshard
from autoshard.cluster import PRESETS, Cluster
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.zoo.registry import get_model

# 200 mutations of each plan by default, 500 with AUTOSHARD_SLOW=1 (the full matrix).
FUZZ = settings(max_examples=500 if os.environ.get("AUTOSHARD_SLOW") else 200, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

# Values a hand edit or a damaged file may leave anywhere: every JSON type, the numbers that
# break arithmetic (nan, inf, huge, negative, zero) and strings that look like plan content.
JUNK = (None, True, False, 0, -1, 1, 2, 3, 2**70, -(2**70), 10**400, 0.5, -0.0, 1e308,
        float("nan"), float("inf"), float("-inf"), "", "x", "R", "[R]", "[S(0)]", "[S(-1)]",
        "[S(0), R]", "input0", "h100", [], [1], ["x"], [[]], {}, {"a": 1})
EDIT_CHARS = "RPS()[], -0123456789x.\n"


# ------------------------------------------------------------------------------ mutations

def _pick(data: st.DataObject, doc: Any) -> tuple[Any, Any]:
    """A random place in ``doc``: (container, key or index). It walks down from the root, one
    level per draw, so that top-level keys are hit as often as the entries of long lists."""
    parent, key, value = None, None, doc
    while isinstance(value, (dict, list)) and value:
        keys = list(value) if isinstance(value, dict) else list(range(len(value)))
        i = data.draw(st.integers(-1, len(keys) - 1))
        if i < 0 and parent is not None:
            break
        parent, key = value, keys[max(i, 0)]
        value = value[key]
    return parent, key


def _junk(data: st.DataObject) -> Any:
    # A copy: a later mutation may edit it in place, and JUNK must stay as it is for the next case.
    return copy.deepcopy(data.draw(st.sampled_from(JUNK)))


def _edited(data: st.DataObject, value: Any) -> Any:
    if isinstance(value, str):
        at = data.draw(st.integers(0, len(value)))
        cut = data.draw(st.integers(0, 3))
        return value[:at] + data.draw(st.text(EDIT_CHARS, max_size=3)) + value[at + cut:]
    if isinstance(value, float):
        return data.draw(st.sampled_from([value + 1, -value, value * 2**60, value / 3,
                                          int(value) if abs(value) < 1e300 else 0]))
    if isinstance(value, int) and not isinstance(value, bool):
        return data.draw(st.sampled_from([value + 1, value - 1, -value, value * 2**60,
                                          value // 3, float(value) if abs(value) < 1e300 else 0.5]))
    return _junk(data)


def _mutate_once(data: st.DataObject, doc: Any) -> None:
    parent, key = _pick(data, doc)
    value = parent[key]
    op = data.draw(st.sampled_from(["drop", "retype", "edit", "duplicate", "reorder"]))
    if op == "drop":
        del parent[key]
    elif op == "retype":
        parent[key] = _junk(data)
    elif op == "edit":
        parent[key] = _edited(data, value)
    elif op == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(value))
    elif op == "duplicate":                 # a dict's key renamed, as a typo would
        parent[f"{key}{data.draw(st.sampled_from(['', '_', '0', 'X']))}"] = parent.pop(key)
    elif isinstance(value, list):
        parent[key] = data.draw(st.permutations(value))
    elif isinstance(value, dict):
        parent[key] = dict(data.draw(st.permutations(list(value.items()))))
    # (reordering a scalar leaves it as it is)


def mutated_text(data: st.DataObject, doc: dict) -> str:
    """``doc`` after one to three mutations, as JSON text, sometimes truncated."""
    root = {"doc": copy.deepcopy(doc)}     # a parent, so that the document itself may change
    for _ in range(data.draw(st.integers(1, 3))):
        if "doc" in root:
            _mutate_once(data, root)
    text = json.dumps(root.get("doc"))
    if data.draw(st.integers(0, 9)) == 0:
        text = text[:data.draw(st.integers(0, len(text)))]
    return text


def assert_refusal(e: AutoshardError) -> None:
    msg = str(e)
    assert "got" in msg and "Fix:" in msg, msg


# ------------------------------------------------------------------------------ plan files

# Small real plans: an MLP on a 1-D mesh, GPTs with layers on a 2-D one (the Hugging Face GPT-2
# ties its embedding and head: a plan with "tied").
PLANS = {"mlp-tiny": (2,), "gpt2-tiny": (2, 2), "hf-gpt2-tiny": (2, 2)}


@pytest.fixture(scope="module", params=sorted(PLANS))
def plan_doc(request: pytest.FixtureRequest) -> dict:
    name = request.param        # transformers is a test dependency: the HF model always runs
    model, inputs = get_model(name, device="meta")
    plan = autoshard.plan(model, inputs, Mesh(PLANS[name], cluster="stress"), model_name=name)
    return json.loads(plan.dumps())


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_a_mutated_plan_loads_usable_or_is_refused(plan_doc: dict, data: st.DataObject) -> None:
    text = mutated_text(data, plan_doc)
    try:
        plan = Plan.loads(text, source="fuzz.json")
    except AutoshardError as e:
        assert_refusal(e)
        return
    again = plan.dumps()
    assert plan.summary() and plan.explain() is not None
    assert Plan.loads(again).dumps() == again       # what loads, dumps and loads the same


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(blob=st.binary(max_size=64))
def test_any_bytes_as_a_plan_file_are_refused(tmp_path_factory, blob: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "blob_plan.json"
    path.write_bytes(blob)
    with pytest.raises(AutoshardError) as info:
        Plan.load(path)
    assert_refusal(info.value)


# ------------------------------------------------------------------------------ cluster profiles

PROFILES = {
    "partial": {"base": "h100", "name": "lab", "inter_bandwidth": 25e9, "devices_per_node": 4,
                "matmul_efficiency": 0.7},
    "full": {"base": "cpu", **dataclasses.asdict(PRESETS["cpu"])},
}


def _load_cluster(path) -> Cluster | None:
    try:
        return Cluster.load(path)
    except AutoshardError as e:
        assert_refusal(e)
        return None


@pytest.mark.parametrize("profile", sorted(PROFILES))
@FUZZ
@given(data=st.data())
def test_a_mutated_cluster_profile_loads_usable_or_is_refused(tmp_path_factory, profile: str,
                                                              data: st.DataObject) -> None:
    path = tmp_path_factory.getbasetemp() / f"fuzz_{profile}.json"
    path.write_text(mutated_text(data, PROFILES[profile]))
    cluster = _load_cluster(path)
    if cluster is not None:                          # usable: a mesh prices links with it
        mesh = Mesh((2, 4), cluster=str(path))
        assert mesh.cluster == cluster and json.dumps(cluster.to_json())


@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(blob=st.binary(max_size=64))
def test_any_bytes_as_a_cluster_profile_load_or_are_refused(tmp_path_factory, blob: bytes) -> None:
    path = tmp_path_factory.getbasetemp() / "blob_cluster.json"
    path.write_bytes(blob)
    _load_cluster(path)
