"""The ``autoshard`` command line, called in-process through ``autoshard.tools.cli.main``.

User mistakes exit with status 2 and one clear line on stderr, never a traceback.
"""
from __future__ import annotations

import contextlib
import io

import pytest

from autoshard.tools.cli import main
from autoshard.plans import Plan
from autoshard.zoo.registry import ZOO


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> tuple[str, str]:
    """``autoshard plan gpt2-tiny --mesh 2x2 -o p.json``, run once: (path, stdout)."""
    path = tmp_path_factory.mktemp("cli") / "p.json"
    out = io.StringIO()      # capsys is function-scoped; this fixture runs once per module
    with contextlib.redirect_stdout(out):
        code = main(["plan", "gpt2-tiny", "--mesh", "2x2", "-o", str(path)])
    assert code == 0
    return str(path), out.getvalue()


def test_plan_writes_a_loadable_plan(plan_file) -> None:
    path, out = plan_file
    assert "autoshard plan gpt2-tiny on mesh 2x2 (dp,tp), cluster h100, training" in out
    assert "planned in" in out and f"wrote {path}" in out
    p = Plan.load(path)
    assert p.mesh_shape == (2, 2) and p.mesh_axes == ("dp", "tp") and p.model == "gpt2-tiny"
    assert p.training and p.solver["status"] == "OPTIMAL"


def test_show_prints_the_summary(plan_file, capsys) -> None:
    path, _ = plan_file
    assert main(["show", path]) == 0
    out = capsys.readouterr().out
    assert out == Plan.load(path).summary() + "\n"
    assert main(["show", path, "--nodes"]) == 0
    out = capsys.readouterr().out
    assert "aten.linear.default" in out and "cross_entropy_loss" in out


def test_unknown_model_suggests_close_names(capsys) -> None:
    assert main(["plan", "gpt2-tinyy", "--mesh", "2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error:") and "Traceback" not in err
    assert "'gpt2-tinyy'" in err and "did you mean gpt2-tiny" in err


@pytest.mark.parametrize("mesh", ["2xfoo", "0x2", "", "2x"])
def test_bad_mesh_is_refused(capsys, mesh: str) -> None:
    assert main(["plan", "gpt2-tiny", "--mesh", mesh]) == 2
    err = capsys.readouterr().err
    assert repr(mesh) in err and "8x8" in err and "Fix" in err, err


@pytest.mark.parametrize("flag", [["--microbatches", "4"], ["--schedule", "1F1B"]])
def test_pipeline_flags_without_a_pipeline_are_refused(capsys, flag: list[str]) -> None:
    """Without --pipeline the batch runs whole: a schedule or microbatch count would be
    silently ignored."""
    assert main(["plan", "gpt2-tiny", "--mesh", "2", *flag]) == 2
    err = capsys.readouterr().err
    assert " ".join(flag) in err and "without a pipeline" in err and "--pipeline" in err


def test_show_of_a_missing_file(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.json"
    assert main(["show", str(missing)]) == 2
    err = capsys.readouterr().err
    assert "a readable plan file" in err and str(missing) in err and "autoshard plan -o" in err


def test_show_of_a_file_that_is_not_a_plan(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')
    assert main(["show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "autoshard.plan" in err and "something-else" in err


def test_zoo_lists_every_model(capsys) -> None:
    assert main(["zoo"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert listed == list(ZOO)


def test_usage_errors_exit_2(capsys) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", "gpt2-tiny"])                  # --mesh is required
    assert info.value.code == 2
    assert "--mesh" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["plan", "gpt2-tiny", "--mesh", "2", "--time-limit", "0"],
    ["plan", "gpt2-tiny", "--mesh", "2", "--memory-gb", "inf"],
    ["plan", "gpt2-tiny", "--mesh", "2", "--memory-gb", "nan"],
    ["plan", "gpt2-tiny", "--mesh", "2", "--memory-gb", "0"],     # once read as "unset"
    ["plan", "gpt2-tiny", "--mesh", "2", "--batch", "x"],
    ["plan", "gpt2-tiny", "--mesh", "2", "--pipeline", "auto", "--microbatches", "0"],
    ["plan", "gpt2-tiny", "--gpus", "8", "--search-budget", "-5"],
    ["plan", "gpt2-tiny", "--gpus", "8", "--gpus-per-node", "0"],
    ["verify", "gpt2-tiny", "--mesh", "2", "--tolerance", "nan"],
    ["diff", "a.json", "b.json", "--limit", "-1"],
])
def test_a_bad_number_is_refused_by_its_flag(capsys, argv: list[str]) -> None:
    """A number a flag cannot take is refused before anything loads, naming the flag, what it
    takes and the text given (a negative --search-budget used to plan anyway)."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    flag, value = argv[-2], argv[-1]
    assert f"argument {flag}: a " in err and f"got {value!r}" in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv, said", [
    (["plan", "llama3-8b", "--mesh", "8x8", "--axes", "dp"], "--axes dp,tp"),
    (["plan", "llama3-8b", "--mesh", "2x2x2", "--axes", "dp,dp,tp"], "--axes pp,dp,tp"),
    (["verify", "gpt2-tiny", "--mesh", "2", "--cluster", "nosuch"], "--cluster h100"),
])
def test_a_bad_mesh_flag_is_refused_by_its_name(capsys, argv: list[str], said: str) -> None:
    """--axes and --cluster refused in the command line's words (the flag, a value to give it),
    before the model loads, not in the Python API's (``axes=('dp', 'tp')``)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{argv[-2]}: " in err and f"got {argv[-1]!r}" in err and said in err, err
    assert "Traceback" not in err and "loading" not in err


def test_a_reader_that_goes_away_gets_no_traceback(plan_file, monkeypatch) -> None:
    """`autoshard show plan.json | head`: once the reader closes the pipe, the next write
    fails with a broken pipe; the command ends with status 1 and no traceback."""
    import os
    import sys
    r, w = os.pipe()
    os.close(r)
    saved = os.dup(1)
    out = os.fdopen(w, "w")
    monkeypatch.setattr(sys, "stdout", out)
    try:
        assert main(["show", plan_file[0]]) == 1
    finally:
        os.dup2(saved, 1)
        os.close(saved)
