"""`autoshard diff`: what two plans of one model place differently, and the step's delta."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from autoshard.tools.cli import main
from autoshard.plans.summary import ranges
from autoshard.tools.diff import diff_files, diff_plans, render
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.plans.prediction import PREDICTED
from autoshard.plans.records import PHASES
from autoshard.tools.verify import plan_for


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, str]:
    """gpt2-tiny on mesh 2 (cpu cluster): autoshard's plan (from the CLI), Megatron's layout,
    autoshard's plan with SGD, and one for another batch size (another graph)."""
    root = tmp_path_factory.mktemp("diff")
    paths = {k: str(root / f"{k}.json") for k in ("auto", "megatron", "sgd", "batch2")}
    base = ["plan", "gpt2-tiny", "--mesh", "2", "--cluster", "cpu"]
    assert run(base + ["-o", paths["auto"]])[0] == 0
    assert run(base + ["--optimizer", "sgd", "-o", paths["sgd"]])[0] == 0
    assert run(base + ["--batch", "2", "-o", paths["batch2"]])[0] == 0
    plan_for("gpt2-tiny", Mesh((2,), cluster="cpu"), baseline="megatron").save(paths["megatron"])
    return paths


def test_diff_names_the_changed_parameters(plans) -> None:
    a, b = Plan.load(plans["auto"]), Plan.load(plans["megatron"])
    d = diff_plans(a, b)
    changed = {n for c in d.params for n in c.names}
    assert changed == {k for k in a.params if a.params[k] != b.params[k]} and changed
    # The same change in both blocks is one line naming the layers.
    q = next(c for c in d.params if c.what == "attn.q_proj.weight")
    assert q.layers == "layers 0-1" and q.names == ("layers.0.attn.q_proj.weight",
                                                    "layers.1.attn.q_proj.weight")
    assert (q.a, q.b) == ("[R]", "[S(0)]")
    assert d.nodes and all(len(c.names) == 2 for c in d.nodes if c.layers == "layers 0-1")
    text = render(d, limit=0)
    assert "layers 0-1: attn.q_proj.weight  [R] -> [S(0)]" in text
    assert text.count("attn.q_proj.weight  [R]") == 1


def test_step_delta_is_the_difference_of_predicted_figures(plans) -> None:
    a, b = Plan.load(plans["auto"]), Plan.load(plans["megatron"])
    d = diff_plans(a, b)
    for k in PREDICTED:
        x, y = a.predicted.to_json()[k], b.predicted.to_json()[k]
        assert d.predicted[k].a == x and d.predicted[k].b == y
        assert d.predicted[k].delta == y - x
    assert d.predicted["comm_s"].delta > 0          # Megatron all-reduces activations
    for p, side in ((a, "a"), (b, "b")):
        per_phase = {k: getattr(r["bytes"], side) for k, r in d.comm_by_phase.items()}
        assert per_phase == {ph: p.bytes_by(phase=ph) for ph in PHASES if ph in per_phase}
        assert sum(getattr(r["bytes"], side) for r in d.comm_by_axis.values()) == p.bytes_by()
        # Each collective priced by alpha-beta on the plan's mesh: they sum to the plan's comm.
        seconds = sum(getattr(r["seconds"], side) for r in d.comm_by_axis.values())
        assert math.isclose(seconds, p.predicted.comm_s, rel_tol=1e-9, abs_tol=1e-15)
    assert d.collectives and all(c.a != c.b for c in d.collectives)


def test_identical_plans_give_an_empty_diff(plans) -> None:
    a = Plan.load(plans["auto"])
    d = diff_plans(a, Plan.load(plans["auto"]))
    assert d.empty and not (d.params or d.nodes or d.collectives or d.settings)
    assert all(f.delta == 0 for f in d.predicted.values())
    code, out, _ = run(["diff", plans["auto"], plans["auto"]])
    assert code == 0 and "no difference" in out
    code, out, _ = run(["diff", plans["auto"], plans["auto"], "--json"])
    assert code == 0 and json.loads(out)["empty"] is True


def test_options_are_named(plans) -> None:
    d = diff_files(plans["auto"], plans["sgd"])
    assert d.settings["options.optimizer"] == ("adam", "sgd")
    assert d.predicted["ilp_memory_bytes"].delta < 0       # no Adam moments
    assert "options.optimizer: adam -> sgd" in render(d)


def test_fingerprint_mismatch_is_an_error_unless_forced(plans) -> None:
    with pytest.raises(AutoshardError, match="fingerprint") as err:
        diff_files(plans["auto"], plans["batch2"])
    assert "--force" in str(err.value)
    code, _, stderr = run(["diff", plans["auto"], plans["batch2"]])
    assert code == 2 and stderr.startswith("autoshard: error:") and stderr.count("\n") == 1
    assert "fingerprint" in stderr and "--force" in stderr
    code, out, _ = run(["diff", plans["auto"], plans["batch2"], "--force"])
    assert code == 0 and "DIFFERENT fingerprints" in out


def test_cli_text_and_json(plans) -> None:
    code, out, _ = run(["diff", plans["auto"], plans["megatron"]])
    assert code == 0
    assert out.startswith(f"autoshard diff {plans['auto']} -> {plans['megatron']}: model gpt2-tiny")
    assert "predicted per device (b - a):" in out and "ILP memory sum" in out
    assert "collectives per mesh axis" in out and "collectives per phase" in out
    code, out, _ = run(["diff", plans["auto"], plans["megatron"], "--json"])
    data = json.loads(out)
    assert code == 0 and data == json.loads(json.dumps(
        diff_files(plans["auto"], plans["megatron"]).to_json()))
    assert data["fingerprint"]["same"] and not data["empty"]
    assert data["predicted"]["step_time_s"]["delta"] == pytest.approx(
        data["predicted"]["step_time_s"]["b"] - data["predicted"]["step_time_s"]["a"])
    code, out, _ = run(["diff", plans["auto"], plans["megatron"], "--limit", "1"])
    assert "more lines" in out
    code, _, stderr = run(["diff", plans["auto"], plans["auto"] + ".missing"])
    assert code == 2 and "a readable plan file" in stderr


def testranges() -> None:
    assert ranges([7, 0, 1, 2, 3]) == "0-3, 7"
    assert ranges([5]) == "5" and ranges([]) == ""
