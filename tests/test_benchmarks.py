"""The benchmark scripts' own logic on tiny models: compare_plans.py's baseline columns (the
checkpointed stored-layout baselines, the failure cells) and memory_curve.py's budget sweep."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import compare_plans  # noqa: E402
import memory_curve  # noqa: E402

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
    assert full.predicted["peak_memory_bytes"] < plain.predicted["peak_memory_bytes"]


def test_out_of_memory_is_reported_as_such(gpt2_tiny):
    with pytest.raises(AutoshardError) as info:
        plan_traced(gpt2_tiny, Mesh((4,), cluster="h100"), memory_budget=1000)
    assert compare_plans.failure_cell(info.value).startswith("infeasible: OOM (needs ")
    least = memory_curve.infeasible_cause(info.value).least_memory
    assert f"{least / 2**30:.4g} GiB" in str(info.value)      # the figure the error names


def test_budgets_fall_from_the_peak_to_the_least():
    gib = 2**30
    bs = memory_curve.budgets(55.6 * gib, 5.2 * gib, 12)
    assert len(bs) == 12 and bs == sorted(bs, reverse=True)
    assert bs[0] < 55.6 * gib and bs[-1] > 5.2 * gib
