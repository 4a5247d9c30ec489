"""The benchmark scripts' own logic on tiny models: compare_plans.py's baseline columns (the
checkpointed stored-layout baselines, the failure cells), memory_curve.py's budget sweep, and
what gpu.py decides without a GPU (which ops need gradients, their classes), and the GPU
scripts' tables."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import compare_plans  # noqa: E402
import gpu  # noqa: E402
import gpu_compile  # noqa: E402
import gpu_offload  # noqa: E402
import memory_curve  # noqa: E402
import three_axis  # noqa: E402

from autoshard.cost.memory import budget_for
from autoshard.errors import AutoshardError  # noqa: E402
from autoshard.mesh import Mesh  # noqa: E402
from autoshard.solver.planner import plan_traced  # noqa: E402
from autoshard.trace.export import trace  # noqa: E402
from autoshard.zoo.registry import get_model  # noqa: E402


@pytest.fixture(scope="module")
def gpt2_tiny():
    model, inputs = get_model("gpt2-tiny")
    return trace(model, inputs, training=True)


def test_row_has_every_baseline_and_autoshard_is_not_worse(gpt2_tiny):
    row = compare_plans.plan_row("gpt2-tiny", gpt2_tiny, (4,), "h100", 20.0)
    assert "auto" in row, row.get("auto_err")
    for b in compare_plans.ALL:
        assert b in row or b + "_err" in row
        assert b in row, row.get(b + "_err")       # every baseline fits a tiny model
    assert not row["worse"]
    assert row["best"] == min(row[b] for b in compare_plans.ALL)
    # Checkpointing only adds time to a layout that fits without it.
    for b in ("fsdp", "fsdp-tp", "zero1", "zero2"):
        assert row[b + "+ckpt"] >= row[b] * (1 - 1e-9)


def test_checkpointed_stored_baseline_recomputes(gpt2_tiny):
    mesh = Mesh((4,), cluster="h100")
    plain = compare_plans.stored_baseline(gpt2_tiny, mesh, "fsdp", recompute="none")
    full = compare_plans.stored_baseline(gpt2_tiny, mesh, "fsdp", recompute="full")
    assert not plain.recompute and len(full.recompute) == 2
    assert full.params == plain.params
    assert full.predicted.ilp_sum_bytes < plain.predicted.ilp_sum_bytes


def test_out_of_memory_is_reported_as_such(gpt2_tiny):
    with pytest.raises(AutoshardError) as info:
        plan_traced(gpt2_tiny, Mesh((4,), cluster="h100"), memory_budget=1000)
    assert compare_plans.failure_cell(info.value).startswith("infeasible: OOM (needs ")
    least = memory_curve.infeasible_cause(info.value).least_memory
    # The figure the error names: the memory_budget that sum needs (cost/memory.py budget_for).
    assert f"{budget_for(least) / 2**30:.4g} GiB" in str(info.value)


def test_a_host_too_small_is_reported_as_such() -> None:
    """A plan that fits the device only by keeping state on the host, and a host too small for
    it: the cell says the host is what ran out, with the host memory needed."""
    from autoshard.solver.ilp import Infeasible
    cause = Infeasible(6.1 * 2**30, budget=74.5 * 2**30, least_host=324.1 * 2**30,
                       host_budget=232.8 * 2**30)
    try:
        raise AutoshardError("a plan within both", got="none fits both", fix="-") from cause
    except AutoshardError as e:
        cell = compare_plans.failure_cell(e)
    assert cell.startswith("infeasible: host OOM") and "324.1 GiB on the host" in cell


def test_budgets_fall_from_the_peak_to_the_least():
    gib = 2**30
    bs = memory_curve.budgets(55.6 * gib, 5.2 * gib, 12)
    assert len(bs) == 12 and bs == sorted(bs, reverse=True)
    assert bs[0] < 55.6 * gib and bs[-1] > 5.2 * gib


def _row(model: str, mesh: str, auto: float | None, **baselines) -> dict:
    """A row as ``compare_plans.plan_row`` makes it (seconds; a str: the failure's cell)."""
    row = {"model": model, "mesh": mesh, "wall_s": 1.0}
    if auto is None:
        row["auto_err"] = "infeasible: OOM (needs 99.0 GiB)"
    else:
        row.update(auto=auto, peak=2**30, status="OPTIMAL", gap=0.0, techniques="-", small=0)
    for b, v in baselines.items():
        row[b if isinstance(v, float) else b + "_err"] = v
    feasible = [(v, b) for b, v in baselines.items() if isinstance(v, float)]
    row["best"], row["best_name"] = min(feasible) if feasible else (None, None)
    row["worse"] = auto is not None and row["best"] is not None and auto > row["best"]
    return row


TINY = [_row("mlp", "8", 0.001, dp=0.002, fsdp="infeasible: OOM (needs 1.0 GiB)"),
        _row("mlp", "2x4", 0.0009, dp=0.0025, fsdp=0.0011),
        _row("gpt | x", "8", None, dp="n/a (1-D, 2-D meshes)", fsdp=0.5)]


def test_table_parses_back_for_its_chart():
    columns = ("dp", "fsdp")
    rows, cols = compare_plans.rows_from_markdown(compare_plans.table(TINY, columns))
    assert cols == columns
    assert [(r["model"], r["mesh"]) for r in rows] == [("mlp", "8"), ("mlp", "2x4"),
                                                       ("gpt \\| x", "8")]
    assert rows[0]["auto"] == pytest.approx(0.001) and rows[0]["dp"] == pytest.approx(0.002)
    assert rows[0]["fsdp_err"].startswith("infeasible: OOM")
    assert rows[2]["auto_err"].startswith("infeasible") and rows[2]["fsdp"] == 0.5
    assert "dp" not in rows[2] and rows[2]["dp_err"].startswith("n/a")


def test_chart_is_drawn_and_linked_from_its_section(tmp_path):
    columns = ("dp", "fsdp")
    results = tmp_path / "RESULTS.md"
    text = "## a section\n\n" + compare_plans.table(TINY, columns) + "\n\nSummary:\n"
    compare_plans.write_section(results, "compare_plans", text)
    png = compare_plans.replot(results)
    assert png == tmp_path / "compare_plans.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    once = results.read_text()
    link = compare_plans.chart_link("compare_plans")
    assert once.count(link) == 1 and once.index(link) < once.index("Summary:")
    compare_plans.replot(results)                       # the link is not added twice
    assert results.read_text() == once
    with pytest.raises(ValueError, match="no section"):
        compare_plans.replot(results, "compare_plans_quick")


def test_gpu_benchmark_grads_and_classes_follow_the_training_step():
    """Only what the step differentiates gets a gradient (parameters and what is computed from
    them, not the ids or the rotary tables), and a norm's elementwise ops count as the norm."""
    model, inputs = get_model("llama-tiny")
    traced = trace(model, inputs, training=True)
    grads = gpu.needs_grad(traced)
    kinds = {p.name: p.kind for p in traced.placeholders}
    assert {n for n, k in kinds.items() if k == "param"} <= grads
    assert not {n for n, k in kinds.items() if k != "param"} & grads
    classes = {}
    for node in traced.graph.nodes:
        if node.op == "call_function" and (c := gpu.op_class(node)) is not None:
            classes.setdefault(c, set()).add(str(node.target))
    assert classes["matmul"] == {"aten.linear.default"}
    assert "aten.rsqrt.default" in classes["norm"] and "aten.silu.default" in classes["pointwise"]
    assert classes["loss"] == {"aten.cross_entropy_loss.default"}
    cos = next(n for n in traced.graph.nodes if str(n.target) == "aten.cos.default")
    assert cos.name not in grads                    # the rotary table: no gradient flows


@pytest.mark.parametrize("script", [gpu, gpu_compile, gpu_offload],
                         ids=["gpu", "gpu_compile", "gpu_offload"])
def test_gpu_benchmarks_say_they_need_a_gpu(capsys, monkeypatch, script):
    monkeypatch.setattr(script.torch.cuda, "is_available", lambda: False)
    assert script.main([]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err


def test_the_offload_table_shows_the_peak_beside_the_liveness_prediction(monkeypatch):
    """benchmarks/gpu_offload.py's Llama table: each run's allocator peak beside the plan's
    liveness peak (the memory the planner holds to the budget), and a failed run's row."""
    monkeypatch.setattr(gpu_offload.torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    ran = {"label": "Llama-3-8B / 32 layers", "offload": "auto", "overlap": "backward",
           "losses": [12.6, 11.2], "modes": {"offload": 61, None: 230},
           "median_s": {"iter": 1.9, "fb": 0.4, "opt": 1.5},
           "predicted": {"step_time_s": 2.0, "host_step_s": 1.8},
           "peak_bytes": 70 * 2**30, "predicted_peak_bytes": 68.8 * 2**30}
    failed = {"label": "Llama-3-8B / 32 layers", "offload": "auto", "overlap": "none",
              "failed": "exit status 1"}
    lines = gpu_offload.render_llama([ran, failed]).splitlines()
    header = next(x for x in lines if x.startswith("| model"))
    row = next(x for x in lines if "(plain 230, offload 61)" in x)
    assert "peak GPU memory, measured / liveness (GiB)" in header
    assert "| 70.0 / 68.8 |" in row and "| 0.95 |" in row
    cols = header.count("|")
    assert row.count("|") == cols and next(x for x in lines if "failed" in x).count("|") == cols


def test_the_compile_table_reports_each_variant_and_the_targets_of_autoshards_own():
    """benchmarks/gpu_compile.py's table: a row per program, a failed experiment's row with its
    error, the targets judged on the compiled rank program (not on an experiment), and an
    experiment's kernels taken from the program without its graph said so."""
    def r(wall_ms, kernels_ms):
        return {"wall_s": wall_ms / 1e3, "kernels_s": kernels_ms / 1e3, "first_step_s": 1.0}
    tp = {"eager": r(17.0, 2.7), "eager graphed": {"error": "RuntimeError: capture failed"},
          "compiled": r(11.0, 2.0), "cudagraphs": r(4.0, 2.0),
          "compiled graphed": {**r(2.2, 2.0), "kernels_from": "the program without the graph"},
          "plain_compiled": r(4.4, 2.2)}
    two = {name: {"step_s": s, "predicted_step_s": 0.03, "first_step_s": 1.0,
                  "losses": [2.0, 1.5, 1.0]} for name, s in (("eager", 0.046), ("compiled", 0.04))}
    lines = gpu_compile.render(tp, two, 60.0).splitlines()
    head = lines.index("| program | wall | kernels | wall / kernels | first step s |")
    rows = lines[head + 2:lines.index("", head)]
    assert len(rows) == 6 and all(x.count("|") == 6 for x in rows)
    assert "failed: RuntimeError: capture failed" in rows[1]
    assert rows[4].split("|")[3].strip() == "2.00*" and "1.10" in rows[4]
    text = "\n".join(lines)
    assert "compiled wall / kernels 5.50 (target <= 1.15: not met)" in text
    assert "2.50x the plain compiled layer (target <= 1: not met)" in text
    assert "wall / kernels 1.10, 0.50x the plain compiled layer" in text
    assert "speed-up 1.15x (target >= 1.15: met)" in text


def test_the_three_axis_table_lists_each_try_and_the_gain_over_the_best_grouping():
    """benchmarks/three_axis.py: a row per try of the search, the one without a plan with its
    error, and the chosen plan against the fastest grouping (not against itself)."""
    def t(label, step, chosen=False, error=""):
        return {"label": label, "step_ms": step, "status": "OPTIMAL" if step else "",
                "chosen": chosen, "error": error, "every_subset": label.count(",") == 0}
    result = {"case": ("llama3-8b", (4, 4, 4), ("dp", "tp", "cp"), 8, 8192), "seconds": 30.0,
              "step_ms": 290.0, "note": "", "tries": [
                  t("axes grouped as dp,tp+cp", 613.3), t("axes grouped as dp,tp,cp", 2320.1),
                  t("axes grouped as dp+tp+cp", 300.0, chosen=True),
                  t("axes grouped as dp,cp+tp", None, error="building it took 30 s")]}
    lines = three_axis.section([result], 60.0).splitlines()
    head = lines.index("| try | step ms | status | why no plan |")
    rows = lines[head + 2:lines.index("", head)]
    assert len(rows) == 4 and all(x.count("|") == 5 for x in rows)
    assert rows[2].startswith("| axes grouped as dp+tp+cp (chosen) | 300.0 |")
    assert "| no plan |" in rows[3] and "building it took 30 s" in rows[3]
    assert "the plan's predicted step 290.0 ms; every axis its own 2.04x faster than the best " \
        "grouping (300.0 against 613.3 ms)" in "\n".join(lines)


@pytest.mark.slow
def test_compile_host_times_the_four_programs_against_the_plain_compiled_layer(capsys):
    """benchmarks/compile_host.py: a row per program, each against the plain compiled layer,
    the rank program's embedding and head at the rows the plan stores."""
    import compile_host
    assert compile_host.main(["--hidden", "64", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| rank program")
            or line.startswith("| plain layer")]
    assert len(rows) == 4 and "| plain layer, compiled |" in out and "| 1.00 |" in out
    assert "embedding rows" in out
    import torch.distributed as dist
    assert not dist.is_initialized()          # the fake world is gone again
