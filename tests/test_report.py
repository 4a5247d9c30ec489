"""``autoshard report``: a plan's figures (autoshard/tools/report.py) computed from the plan, drawn into
one self-contained HTML page, fast on the main job's plan, and rendered by a real browser."""
from __future__ import annotations

import base64
import re
import struct
import sys
import time
from pathlib import Path

import pytest

from autoshard.tools.cli import main
from autoshard.schedules import SCHEDULES, SPLIT_BACKWARD, VIRTUAL_STAGES, schedule_seconds
from autoshard.ir import spec_str
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.plans.prediction import StagePrediction
from autoshard.plans.records import Pipeline, Stage
from autoshard.tools.report import (gantt_slots, layer_map, memory_parts, pipeline_bubble,
                              render_html, save_gantt, step_parts, write_report)
from autoshard.solver.planner import plan as make_plan
from autoshard.zoo.registry import load_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import report_screens  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory) -> Path:
    """gpt2-tiny on 2x2 (pp, tp), pipelined over pp in 2 microbatches: a plan file. (2 is what
    the microbatch search picks here; pinned, the plan is the same without the search's two
    other counts planned, and the report is not about the search.)"""
    path = tmp_path_factory.mktemp("report") / "pp.json"
    model, inputs = load_model("gpt2-tiny", batch=None, seq=None, device="meta")
    p = make_plan(model, inputs, Mesh((2, 2), ("pp", "tp"), cluster="h100"), pipeline="pp",
                  microbatches=2, model_name="gpt2-tiny")
    assert p.pipeline is not None and p.pipeline.microbatches == 2
    p.save(path)
    return path


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> Path:
    """The main job's plan file: llama3-8b on 8x8 (dp, tp), batch 8, seq 2048."""
    path = tmp_path_factory.mktemp("main_job") / "plan.json"
    model, inputs = load_model("llama3-8b", batch=8, seq=2048, device="meta")
    make_plan(model, inputs, Mesh((8, 8), ("dp", "tp"), cluster="h100"),
              model_name="llama3-8b").save(path)
    return path


def images(page: str) -> dict[str, bytes]:
    """Every <img> of a page: its id and the PNG its data URI holds."""
    found = re.findall(r'<img id="([\w-]+)" alt="[^"]*" src="data:image/png;base64,([^"]+)">',
                       page)
    return {i: base64.b64decode(data) for i, data in found}


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_step_parts_add_up_to_the_step(main_job, pipelined) -> None:
    plain, pp = Plan.load(main_job), Plan.load(pipelined)
    parts = dict(step_parts(plain))
    assert sum(parts.values()) == pytest.approx(plain.predicted.step_time_s, rel=1e-12)
    assert parts["compute"] == plain.predicted.compute_s
    for axis in ("dp", "tp"):
        assert parts[f"comm over {axis}"] == plain.predicted.exposed_comm_s[axis]
    parts = dict(step_parts(pp))
    assert sum(parts.values()) == pytest.approx(pp.predicted.step_time_s, rel=1e-12)
    # The bubble is the idle share of the schedule's compute: with 2 stages and balanced
    # layers, (p - 1) stage-microbatches of the slowest stage.
    bubble = pipeline_bubble(pp.pipeline)
    assert parts["pipeline bubble"] == bubble > 0
    stages = [s.predicted.compute_s for s in pp.pipeline.stages]
    assert bubble == pytest.approx(sum(stages) - max(stages))
    assert parts["compute"] == pytest.approx(pp.predicted.compute_s - bubble)


def test_memory_parts_are_the_liveness_peak(main_job, pipelined) -> None:
    plan = Plan.load(main_job)
    parts = dict(memory_parts(plan))
    assert list(parts) == ["parameters", "gradients", "optimizer", "activations", "temporaries"]
    assert sum(parts.values()) == pytest.approx(plan.predicted.memory.peak)
    assert memory_parts(Plan.load(pipelined)) == []     # per stage instead: no liveness peak


def test_layer_map_shows_what_the_plan_records(main_job) -> None:
    plan = Plan.load(main_job)
    lm = layer_map(plan)
    assert lm.rows == tuple(layer.name for layer in plan.layers)
    assert set(lm.outside) == {"tok_emb.weight", "norm.weight", "lm_head.weight"}
    params = [c for c in lm.columns if "." in c]
    assert "attn.q_proj.weight" in params and "mlp.down_proj.weight" in params
    for i, layer in enumerate(plan.layers):
        for j, column in enumerate(lm.columns):
            fqn = f"{layer.name}.{column}"
            if column in params:
                assert lm.cells[i][j] == spec_str(plan.params[fqn])
                state = plan.param_state.get(fqn)
                assert lm.modes[i][j] == (state.mode if state else "")
    # the matmul-like ops follow the parameters: 7 linears and the attention in a llama layer
    ops = lm.columns[len(params):]
    assert sum(c.startswith("linear ") for c in ops) == 7
    assert sum("attention" in c for c in ops) == 1
    nodes = {n.name: n for n in plan.nodes}
    first = [n for n in plan.layers[0].nodes if nodes[n].op == "aten.linear.default"][0]
    assert lm.cells[0][lm.columns.index("linear 1")] == spec_str(nodes[first].outputs[0])


def _pipeline(schedule: str, p: int, m: int, seconds: list[float] | None = None) -> Pipeline:
    v = VIRTUAL_STAGES[schedule]
    seconds = seconds or [0.3] * (p * v)
    return Pipeline("pp", schedule, m, tuple(
        Stage(i, (f"l.{i}",), StagePrediction(t * 0.9, t * 0.1, 0))
        for i, t in enumerate(seconds)), v)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_gantt_follows_the_schedule(schedule) -> None:
    # F, B and W slots: torch's order (DualPipeV: from 2p microbatches, a full backward a B
    # and its W back to back, an overlapped F&B an F, a B and a W)
    split = schedule in SPLIT_BACKWARD
    for p in (2, 3, 4):
        for m in ((2 * p, 2 * p + 1, 4 * p) if schedule == "DualPipeV" else
                  (p, 2 * p, 4 * p) if split else (1, 2, 3, p, 2 * p, 4 * p + 1)):
            pl = _pipeline(schedule, p, m)
            slots = gantt_slots(pl)
            assert len(slots) == (3 if split else 2) * m * len(pl.stages)
            end = {(s.kind, s.stage, s.microbatch): s.start + s.seconds for s in slots}
            last = len(pl.stages) - 1
            for s in slots:
                assert s.rank == pl.rank_of(s.stage)    # ZB-V: rank r runs r and 2p - 1 - r
                before = ("F", s.stage - 1, s.microbatch) if s.kind == "F" else (
                    ("B", s.stage, s.microbatch) if s.kind == "W" else
                    ("F", s.stage, s.microbatch) if s.stage == last else
                    ("B", s.stage + 1, s.microbatch))
                if s.kind != "F" or s.stage > 0:
                    assert s.start >= end[before] - 1e-12, (schedule, p, m, s)
            for r in range(p):                      # a rank runs one slot at a time
                mine = sorted((s.start, s.start + s.seconds) for s in slots if s.rank == r)
                assert all(a[1] <= b[0] + 1e-12 for a, b in zip(mine, mine[1:]))
            # balanced stages: the closed form of docs/cost-model.md §10 (interleaved: for a
            # number of microbatches the ranks divide, as Megatron-LM's schedule asks)
            if not schedule.startswith("Interleaved") or m % p == 0:
                makespan = max(end.values())
                assert makespan == pytest.approx(schedule_seconds(
                    [0.3] * len(pl.stages), m, p, schedule)), (schedule, p, m)


def test_gantt_of_unbalanced_stages_waits_for_the_slowest() -> None:
    # The slowest stage sets the pace: at least its m microbatches, at most the closed form
    # (which charges every stage the slowest one's pace after the first microbatch).
    for schedule in ("GPipe", "1F1B"):
        pl = _pipeline(schedule, 3, 6, [0.1, 0.5, 0.2])
        slots = gantt_slots(pl)
        makespan = max(s.start + s.seconds for s in slots)
        busy = sum(s.seconds for s in slots if s.stage == 1)
        assert busy == pytest.approx(6 * 0.5)
        assert busy + 0.1 < makespan <= schedule_seconds([0.1, 0.5, 0.2], 6, 3, schedule) + 1e-9


def test_report_page_is_self_contained(pipelined, tmp_path) -> None:
    out = tmp_path / "pp.html"
    figures = write_report(pipelined, out)
    assert figures == ["step time", "memory per device", "placements per layer",
                       "pipeline schedule"]
    page = out.read_text()
    imgs = images(page)
    assert list(imgs) == ["img-step", "img-memory", "img-layers", "img-pipeline"]
    for data in imgs.values():
        w, h = png_size(data)
        assert w > 100 and h > 100
    # nothing fetched from elsewhere: one file is the whole report
    assert page.count("<img") == 4 and "http" not in page and "<link" not in page
    assert "<script" not in page
    plan = Plan.load(pipelined)
    assert plan.summary().splitlines()[0] in page      # and the text summary
    assert "1F1B" in page and "pipeline bubble" in page


def test_save_gantt_writes_a_png(pipelined, tmp_path) -> None:
    path = save_gantt(Plan.load(pipelined).pipeline, tmp_path / "gantt.png")
    assert png_size(path.read_bytes())[0] > 100


def test_main_job_report_in_30_seconds(main_job, tmp_path, capsys) -> None:
    out = tmp_path / "report.html"
    t0 = time.perf_counter()
    assert main(["report", str(main_job), "-o", str(out)]) == 0
    took = time.perf_counter() - t0
    assert took <= 30, f"autoshard report took {took:.1f} s on the main job's plan"
    stdout = capsys.readouterr().out
    assert stdout.startswith(f"wrote {out} (step time, memory per device, placements per "
                             f"layer) in ")
    assert list(images(out.read_text())) == ["img-step", "img-memory", "img-layers"]


def test_report_default_path_and_errors(pipelined, tmp_path, capsys) -> None:
    copy = tmp_path / "copy.json"
    copy.write_text(Path(pipelined).read_text())
    assert main(["report", str(copy)]) == 0
    assert (tmp_path / "copy.html").exists()          # next to the plan by default
    capsys.readouterr()
    assert main(["report", str(copy), "-o", str(tmp_path / "no" / "such" / "r.html")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: a writable path for the report (-o)")
    assert "Traceback" not in err
    assert main(["report", str(tmp_path / "missing.json")]) == 2
    assert "a readable plan file" in capsys.readouterr().err


def test_page_text_around_the_figures(pipelined) -> None:
    plan = Plan.load(pipelined)
    page = render_html(plan, figures=[])
    assert "<img" not in page and "<h1>autoshard plan gpt2-tiny on mesh 2x2</h1>" in page
    assert "Parameters outside the repeated layers" in page and "tok_emb.weight" in page


BROWSER = report_screens.find_chromium()


@pytest.mark.skipif(BROWSER is None, reason="no chromium on PATH to open the report in "
                                            "(Debian: apt-get install -y chromium)")
def test_every_figure_renders_in_a_browser(main_job, pipelined, tmp_path) -> None:
    for plan, count in ((main_job, 3), (pipelined, 4)):
        page = tmp_path / (Path(plan).stem + ".html")
        write_report(plan, page)
        shown = report_screens.rendered_images(BROWSER, page)
        assert len(shown) == count, shown
        for img in shown:
            assert img["complete"] and img["width"] > 100 and img["height"] > 100, img
    shots = report_screens.screenshot_figures(BROWSER, tmp_path / "pp.html", tmp_path / "shots",
                                              "pp")
    assert [p.name for p in shots] == ["pp-step.png", "pp-memory.png", "pp-layers.png",
                                       "pp-pipeline.png"]
    for shot in shots:
        assert png_size(shot.read_bytes())[0] > 100
