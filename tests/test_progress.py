"""Progress lines on stderr (autoshard/progress.py): silent in library use, shown by the CLI's
``plan`` unless ``--quiet``; and ``plan --json``, the summary for scripts."""
from __future__ import annotations

import io
import json
import re

import pytest

from autoshard.cost.memory import DEVICE_RESERVE_BYTES
from autoshard import progress
from autoshard.tools.cli import main
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.solver.planner import plan
from autoshard.zoo.registry import get_model

STAMP = re.compile(r"^\[ *\d+\.\d s\] ")


def lines(text: str) -> list[str]:
    """The progress lines of ``text``, each without its time stamp (and asserted to have one)."""
    out = []
    for line in text.splitlines():
        assert STAMP.match(line), f"a progress line without its time stamp: {line!r}"
        out.append(STAMP.sub("", line))
    return out


def test_nothing_is_shown_unless_enabled(capsys) -> None:
    assert not progress.is_enabled()
    with progress.step("tracing"):
        progress.note("a note")
    model, inputs = get_model("mlp-tiny")
    plan(model, inputs, Mesh((2,), cluster="h100"))     # library use: silent
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_steps_nest_and_say_their_seconds_or_why_they_stopped() -> None:
    out = io.StringIO()
    with progress.enabled(stream=out):
        assert progress.is_enabled()
        with progress.step("outer"):
            with progress.step("leaf"):
                pass
            progress.note("a [bracketed] note")       # printed as is: no rich markup
        with pytest.raises(AutoshardError):
            with progress.step("failing"):
                raise AutoshardError("x", got="no plan fits", fix="y")
        with progress.step("quiet leaf"):        # planning went on: "failing" is shown
            with progress.enabled(False):             # --quiet wins over an outer block
                progress.note("never shown")
    assert not progress.is_enabled()
    got = lines(out.getvalue())
    assert got[0] == "outer"                          # named once something inside it prints
    assert re.fullmatch(r"  leaf: \d+\.\d s", got[1])
    assert got[2] == "  a [bracketed] note"
    assert re.fullmatch(r"outer: \d+\.\d s", got[3])
    assert re.fullmatch(r"failing: stopped \(no plan fits\) after \d+\.\d s", got[4])
    assert re.fullmatch(r"quiet leaf: \d+\.\d s", got[5]) and len(got) == 6


def test_an_error_that_ends_planning_is_left_to_the_caller() -> None:
    out = io.StringIO()
    with pytest.raises(AutoshardError):
        with progress.enabled(stream=out):
            with progress.step("outer"):
                with progress.step("leaf"):
                    pass
                with progress.step("failing"):
                    raise AutoshardError("x", got="no plan fits", fix="y")
    got = lines(out.getvalue())
    assert got[0] == "outer" and got[1].startswith("  leaf: ") and len(got) == 2


def test_cli_plan_shows_progress_on_stderr(capsys) -> None:
    assert main(["plan", "gpt2-tiny", "--mesh", "2x2"]) == 0
    captured = capsys.readouterr()
    got = lines(captured.err)
    assert any(re.fullmatch(r"tracing gpt2-tiny \(batch 4\): \d+\.\d s", x) for x in got), got
    assert any(re.fullmatch(r" *building the ILP on mesh 2x2 \(dp,tp\): \d+\.\d s", x)
               for x in got), got
    assert any(re.fullmatch(r" *solving \(\d+ decisions\): \d+\.\d s", x) for x in got), got
    assert any(x.strip().startswith("OPTIMAL: ") for x in got), got
    # stdout keeps the summary alone
    assert captured.out.startswith("autoshard plan gpt2-tiny on mesh 2x2")
    assert "tracing" not in captured.out


def test_quiet_silences_progress(capsys) -> None:
    """The same command as above with --quiet, on mlp-tiny: its plan on 2x2 prints the same
    kinds of progress line (tracing, building, solving) in a fraction of gpt2-tiny's time."""
    assert main(["plan", "mlp-tiny", "--mesh", "2x2"]) == 0
    assert lines(capsys.readouterr().err)                 # progress shown without --quiet
    assert main(["plan", "mlp-tiny", "--mesh", "2x2", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.startswith("autoshard plan mlp-tiny on mesh 2x2")


def test_json_summary_of_a_pipelined_plan(tmp_path, capsys) -> None:
    path = tmp_path / "pp.json"
    assert main(["plan", "gpt2-tiny", "--mesh", "2x2", "--axes", "pp,tp", "--pipeline", "pp",
                 "--json", "-o", str(path)]) == 0
    captured = capsys.readouterr()
    got = lines(captured.err)
    # every microbatch try, and each schedule's step within it
    assert "2 microbatches" in got and "4 microbatches" in got, got
    assert any(re.fullmatch(r"  1F1B: 2 stages, step \d+\.\d+ ms", x) for x in got), got
    summary = json.loads(captured.out)                 # stdout is the JSON alone
    p = Plan.load(path)
    assert summary["model"] == "gpt2-tiny" and summary["output"] == str(path)
    assert summary["mesh"] == {"shape": [2, 2], "axes": ["pp", "tp"], "cluster": "h100"}
    pred = summary["predicted"]
    assert pred["step_time_s"] == p.predicted.step_time_s
    assert sum(pred["parts"].values()) == pytest.approx(pred["step_time_s"], rel=1e-9)
    assert pred["parts"]["pipeline bubble"] > 0 and "comm over pp" in pred["parts"]
    tech = summary["techniques"]
    assert tech["pipeline"]["axis"] == "pp" and tech["pipeline"]["stages"] == 2
    assert tech["pipeline"]["microbatches"] == p.pipeline.microbatches
    assert tech["params"] == len(p.params)
    assert summary["memory"]["bound_bytes"] == p.predicted.ilp_sum_bytes
    assert summary["solver"]["status"] == "OPTIMAL"
    assert set(summary["timings"]) >= {"trace_s", "build_s", "solve_s", "total_s"}
    assert summary["timings"]["total_s"] > 0


def test_json_summary_without_output(capsys) -> None:
    assert main(["plan", "mlp-tiny", "--mesh", "2", "--json", "--quiet"]) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert captured.err == "" and summary["output"] is None
    mem = summary["memory"]
    assert mem["peak_bytes"] == pytest.approx(sum(mem[k] for k in (
        "parameters", "gradients", "optimizer", "activations", "temporaries")))
    # h100's memory less the device reserve: no budget given (cost/memory.py default_budget)
    assert mem["budget_bytes"] == 80e9 - DEVICE_RESERVE_BYTES
    assert summary["predicted"]["parts"]["compute"] == summary["predicted"]["compute_s"]
