"""A plan's predicted figures, typed (autoshard/plans/prediction.py): written exactly as plan
files have always held them (the same keys, in the same order, the same numbers, ints kept
ints), read back equal, and a malformed ``predicted`` section refused by the plan file reader
with its error, naming the value. And the names plan files hold as str enums (autoshard/ir.py:
``StateMode``, ``CollectiveKind``, ``Phase``, ``OffloadLevel``, ``OffloadOverlap``), written as
the strings plan files have always held; a phase or offload level a file names wrongly refused."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autoshard import Mesh
from autoshard.errors import AutoshardError
from autoshard.ir import CollectiveKind, OffloadLevel, OffloadOverlap, Phase, StateMode
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.plans.prediction import PredictedMemory, Prediction, StagePrediction
from autoshard.plans.records import MODE_NAMES, PHASES
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.zoo.registry import get_model

# The order plans have always written the figures in (solver/assemble.py); a key is left out
# where the plan has no such figure.
ORDER = ("step_time_s", "compute_s", "host_s", "comm_s", "ilp_memory_bytes", "optimizer_s",
         "peak_phase", "host_step_s", "memory", "exposed_comm_s", "overlapped_comm_s")
MEMORY_ORDER = ("peak", "parameters", "gradients", "optimizer", "activations", "temporaries",
                "host", "model_state")


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """Real plans: one on a 2x2 mesh, one pipelined, one with parameters kept on the host."""
    model, inputs = get_model("llama-tiny")
    traced = trace(model, inputs)
    return {"2x2": plan_traced(traced, Mesh((2, 2), cluster="cpu")),
            "pipelined": plan_traced(traced, Mesh((2, 2), ("pp", "dp"), cluster="cpu"),
                                     pipeline="pp", schedule="1F1B", microbatches=2),
            "offload": plan_traced(traced, Mesh((2,), cluster="cpu"), offload="parameters")}


@pytest.mark.parametrize("case", ["2x2", "pipelined", "offload"])
def test_round_trip_is_equal_and_the_file_unchanged(plans, case: str) -> None:
    p = plans[case]
    text = p.dumps()
    d = json.loads(text)["predicted"]
    again = Prediction.from_json(d)
    assert again == p.predicted
    assert Prediction.from_json(p.predicted.to_json()) == p.predicted
    # The section as the file holds it, number for number (an int stays an int).
    assert json.dumps(again.to_json(), sort_keys=True) == json.dumps(d, sort_keys=True)
    assert Plan.loads(text).dumps() == text
    if p.pipeline is not None:
        for st, sd in zip(p.pipeline.stages, json.loads(text)["pipeline"]["stages"]):
            assert StagePrediction.from_json(sd["predicted"]) == st.predicted
            assert list(st.predicted.to_json()) == ["compute_s", "comm_s", "ilp_memory_bytes",
                                                    "peak_bytes"]


@pytest.mark.parametrize("case", ["2x2", "pipelined", "offload"])
def test_the_keys_are_todays_in_todays_order(plans, case: str) -> None:
    p = plans[case]
    keys = list(p.predicted.to_json())
    assert keys == [k for k in ORDER if k in keys]
    assert {"step_time_s", "compute_s", "comm_s", "ilp_memory_bytes", "optimizer_s",
            "exposed_comm_s", "overlapped_comm_s"} <= set(keys)
    # A pipelined plan's stages carry the peaks: the whole plan has none; the host link's
    # seconds only where parameters are kept on the host.
    assert ("memory" in keys) == ("peak_phase" in keys) == (case != "pipelined")
    assert ("host_s" in keys) == (case == "offload")
    if case != "pipelined":
        assert list(p.predicted.memory.to_json()) == list(MEMORY_ORDER)
        assert p.predicted.peak_phase in ("forward", "backward", "optimizer")


def test_the_figures_add_up_as_the_plan_format_says(plans) -> None:
    for p in plans.values():
        pr = p.predicted
        assert pr.step_time_s == pytest.approx(
            pr.compute_s + sum(pr.exposed_comm_s.values()) + pr.host_s, rel=1e-12)
        assert pr.exposed_comm_total_s == pytest.approx(sum(pr.exposed_comm_s.values()),
                                                         rel=1e-9, abs=1e-15)
    off = plans["offload"].predicted
    assert off.host_s > 0 and off.memory.host > 0
    m = plans["2x2"].predicted.memory
    assert m.peak == m.parameters + m.gradients + m.optimizer + m.activations + m.temporaries


def test_numbers_keep_their_type() -> None:
    """The file writes 0 and 0.0 apart: a figure read as an int is written as an int."""
    d = {"step_time_s": 1.5, "compute_s": 1, "comm_s": 0.5, "ilp_memory_bytes": 1024,
         "optimizer_s": 0.0, "exposed_comm_s": {"dp": 0, "pp": 0.5}, "overlapped_comm_s": {}}
    p = Prediction.from_json(d)
    assert p.exposed_comm_s == {"dp": 0, "pp": 0.5} and p.overlapped_comm_s == {}
    assert json.dumps(p.to_json()) == json.dumps(d)


def test_a_plan_made_before_the_later_figures_loads(plans) -> None:
    """Files written before overlap, liveness and the optimizer step were priced: the absent
    figures stay absent (optimizer_s, 0 where absent, is written)."""
    d = json.loads(plans["2x2"].dumps())
    for k in ("memory", "peak_phase", "exposed_comm_s", "overlapped_comm_s", "optimizer_s"):
        del d["predicted"][k]
    p = Plan.loads(json.dumps(d))
    assert p.predicted.memory is None and p.predicted.exposed_comm_s is None
    assert p.predicted.optimizer_s == 0.0
    assert list(p.predicted.to_json()) == ["step_time_s", "compute_s", "comm_s",
                                           "ilp_memory_bytes", "optimizer_s"]
    assert "predicted step" in p.summary()


@pytest.mark.parametrize("change, where, expected", [
    (lambda d: d.update(memory="lots"), "predicted.memory", "a JSON object"),
    (lambda d: d["memory"].pop("peak"), "predicted.memory.peak", "given"),
    (lambda d: d["memory"].update(peak=-1), "predicted.memory.peak", "a finite number >= 0"),
    (lambda d: d.update(peak_phase="sideways"), "predicted.peak_phase",
     'one of "forward", "backward", "optimizer"'),
    (lambda d: d.update(peak_phase=3), "predicted.peak_phase", 'one of "forward"'),
    (lambda d: d.update(step_time=1.0), "predicted.step_time", "not a figure"),
    (lambda d: d["exposed_comm_s"].update(dp="1"), "predicted.exposed_comm_s.dp",
     "a finite number >= 0"),
    (lambda d: d.update(host_s=float("inf")), "predicted.host_s", "a finite number >= 0"),
    (lambda d: d.pop("ilp_memory_bytes"), "predicted.ilp_memory_bytes", "given"),
])
def test_a_malformed_predicted_section_is_refused(plans, change, where, expected) -> None:
    d = json.loads(plans["2x2"].dumps())
    change(d["predicted"])
    with pytest.raises(AutoshardError) as info:
        Plan.loads(json.dumps(d), source="plan.json")
    msg = str(info.value)
    # The plan file reader's error: the file, the value, and the fix.
    assert msg.startswith("a complete plan (mesh, nodes, params, collectives, predicted, "
                          "solver)"), msg
    assert f"with {where} {expected}" in msg and "plan.json: malformed" in msg, msg
    assert "docs/plan-format.md" in msg and "autoshard plan -o" in msg
    # Read alone, the section raises an AutoshardError naming the value too.
    with pytest.raises(AutoshardError, match=where.replace(".", r"\.")):
        Prediction.from_json(d["predicted"])


def test_a_malformed_stage_section_is_refused(plans) -> None:
    d = json.loads(plans["pipelined"].dumps())
    d["pipeline"]["stages"][1]["predicted"]["comm_s"] = "fast"
    with pytest.raises(AutoshardError, match=r"pipeline\.stages\[1\]\.predicted\.comm_s"):
        Plan.loads(json.dumps(d))


def test_typed_and_frozen(plans) -> None:
    p = plans["2x2"].predicted
    assert isinstance(p.memory, PredictedMemory)
    with pytest.raises(AttributeError):
        p.step_time_s = 0.0            # frozen: a new figure is a new Prediction
    faster = replace(p, step_time_s=p.step_time_s / 2)
    assert faster.to_json()["step_time_s"] == p.step_time_s / 2
    assert faster.to_json()["ilp_memory_bytes"] == p.ilp_sum_bytes


# ------------------------------------------------------------------------------ state modes

def test_state_modes_are_their_strings_on_disk_and_in_text() -> None:
    """A str enum: JSON, f-strings and comparisons see the string plan files have always held."""
    assert [m.value for m in StateMode] == ["zero1", "zero2", "offload", "offload_params"]
    for m in StateMode:
        assert json.dumps(m) == f'"{m.value}"' and f"{m}" == m.value and m == m.value
        assert json.dumps({m: 1}) == f'{{"{m.value}": 1}}'
    assert StateMode.of("offload_params") is StateMode.OFFLOAD_PARAMS
    assert StateMode.of("vocab_parallel") is None and StateMode.of(None) is None
    assert set(MODE_NAMES) == set(StateMode)


def test_a_plan_carries_state_modes_as_the_enum(plans) -> None:
    p = plans["offload"]
    modes = {st.mode for st in p.param_state.values()}
    assert modes == {StateMode.OFFLOAD_PARAMS}
    assert all(type(st.mode) is StateMode for st in p.param_state.values())
    d = json.loads(p.dumps())
    kernels = {n["kernel"] for n in d["nodes"] if n["op"] == "placeholder" and "kernel" in n}
    assert kernels == {"offload_params"}
    again = Plan.loads(p.dumps())
    placeholder_kernels = {n.kernel for n in again.nodes if n.op == "placeholder" and n.kernel}
    assert all(type(k) is StateMode for k in placeholder_kernels)
    assert all(type(st.mode) is StateMode for st in again.param_state.values())
    # An op's kernel that names no state mode stays its text.
    ops = {n.kernel for n in again.nodes if n.op != "placeholder" and n.kernel}
    assert all(type(k) is str for k in ops)


def test_collective_kinds_are_their_strings_on_disk(plans) -> None:
    assert [k.value for k in CollectiveKind] == ["all_reduce", "all_gather", "reduce_scatter",
                                                 "all_to_all", "send_recv"]
    for k in CollectiveKind:
        assert json.dumps(k) == f'"{k.value}"' and f"{k}" == k.value and repr(k) == repr(k.value)
    assert CollectiveKind.of("slice") is None
    assert plans["pipelined"].collectives and plans["offload"].collectives
    for p in plans.values():
        assert all(type(c.kind) is CollectiveKind for c in p.collectives)
        d = json.loads(p.dumps())
        assert [c["kind"] for c in d["collectives"]] == [c.kind.value for c in p.collectives]
        again = Plan.loads(p.dumps())
        assert all(type(c.kind) is CollectiveKind for c in again.collectives)
    # A kind no plan writes is kept as its text (the ledger describes, steers nothing).
    d = json.loads(plans["pipelined"].dumps())
    d["collectives"][0]["kind"] = "broadcast"
    assert Plan.loads(json.dumps(d)).collectives[0].kind == "broadcast"


def test_phases_and_offload_levels_are_their_strings_on_disk() -> None:
    """Str enums like the state modes: JSON, f-strings and comparisons see the names plan files
    and options have always held; the recorded phases in step order, "replay" not among them."""
    assert [p.value for p in Phase] == ["forward", "backward", "grad_sync", "optimizer",
                                        "recompute", "pipeline", "replay"]
    assert PHASES == tuple(Phase)[:-1] and Phase.REPLAY not in PHASES
    assert [o.value for o in OffloadLevel] == ["auto", "none", "optimizer", "parameters"]
    assert [o.value for o in OffloadOverlap] == ["backward", "delayed", "none"]
    for m in (*Phase, *OffloadLevel, *OffloadOverlap):
        assert json.dumps(m) == f'"{m.value}"' and f"{m}" == m.value and repr(m) == repr(m.value)
    # Options given as text hold the members, and write the text.
    o = PlanOptions(offload="parameters", offload_overlap="delayed")
    assert o.offload is OffloadLevel.PARAMETERS and o.offload_overlap is OffloadOverlap.DELAYED
    assert o.to_json()["offload"] == "parameters" and PlanOptions.from_json(o.to_json()) == o


def test_a_plan_round_trips_its_phases_and_offload_levels(plans) -> None:
    p = plans["offload"]
    assert p.host_transfers and {st.offload for st in p.param_state.values()} == {"parameters"}
    for plan in (p, Plan.loads(p.dumps())):
        assert plan.dumps() == p.dumps()
        assert all(type(c.phase) is Phase for c in plan.collectives)
        assert all(type(t.phase) is Phase for t in plan.host_transfers)
        assert all(type(st.offload) is OffloadLevel for st in plan.param_state.values())
        assert type(plan.options.offload) is OffloadLevel
        assert type(plan.predicted.peak_phase) is Phase
    d = json.loads(p.dumps())
    assert {c["phase"] for c in d["collectives"]} <= set(PHASES)
    assert all(x["offload"] == "parameters" for x in d["params"].values())
    # A parameter with nothing on the host is written false, as plan files always have.
    two = json.loads(plans["2x2"].dumps())
    assert {x["offload"] for x in two["params"].values()} == {False}
    again = Plan.loads(plans["2x2"].dumps())
    assert all(st.offload is OffloadLevel.NONE for st in again.param_state.values())


@pytest.mark.parametrize("where, value, fragment", [
    ("collectives", "sideways", "collectives[0].phase one of \"forward\""),
    ("collectives", "replay", "collectives[0].phase one of"),       # the runtime's, unrecorded
    ("host_transfers", "forwards", "host_transfers[0].phase one of"),
    ("params", "disk", 'offload false, "optimizer" or "parameters"'),
    ("options", "disk", "PlanOptions.offload is one of"),
])
def test_a_bad_phase_or_offload_level_in_a_plan_file_is_refused(plans, where: str, value: str,
                                                                 fragment: str) -> None:
    d = json.loads(plans["offload"].dumps())
    if where == "params":
        d["params"][next(iter(d["params"]))]["offload"] = value
    elif where == "options":
        d["options"]["offload"] = value
    else:
        d[where][0]["phase"] = value
    with pytest.raises(AutoshardError) as info:
        Plan.loads(json.dumps(d), source="plan.json")
    msg = str(info.value)
    assert fragment in msg and "plan.json" in msg and repr(value)[1:-1] in msg, msg
    assert ". Fix: " in msg
