"""solver/alternatives.py: runners-up by no-good cuts, and plans with stored layouts pinned."""
from __future__ import annotations

import pytest

from autoshard.errors import AutoshardError
from autoshard.ir import Replicate
from autoshard.mesh import Mesh
from autoshard.solver.alternatives import plan_stored, runners_up
from autoshard.solver.baselines import zero3_layouts
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.zoo.registry import get_model


@pytest.fixture(scope="module")
def traced():
    return trace(*get_model("gpt2-tiny", device="meta"))


def _layouts(plan) -> dict:
    return {k: tuple(v) for k, v in plan.params.items()}


def test_runners_up_differ_in_parameter_layouts_and_cost_no_less(traced) -> None:
    mesh = Mesh((2,), ("x",), cluster="stress")
    best = plan_traced(traced, mesh)
    ups = runners_up(traced, mesh, best, 2)
    assert len(ups) == 2
    seen = [_layouts(best)]
    for k, p in enumerate(ups, 1):
        assert p.solver["alternative"] == f"runner-up {k}"
        assert _layouts(p) not in seen            # the no-good cuts exclude every earlier plan
        seen.append(_layouts(p))
        assert p.predicted.step_time_s >= best.predicted.step_time_s * (1 - 1e-9)
        assert p.solver["objective"] == pytest.approx(p.predicted.step_time_s, rel=1e-6)
    assert ups[1].predicted.step_time_s >= ups[0].predicted.step_time_s * (1 - 1e-9)
    assert runners_up(traced, mesh, best, 0) == []


def test_zero3_layouts_store_every_weight_sharded(traced) -> None:
    mesh = Mesh((2,), ("x",), cluster="stress")
    z = plan_stored(traced, mesh, zero3_layouts(traced, mesh), label="zero3")
    assert z.solver["alternative"] == "zero3"
    assert all(not isinstance(spec[0], Replicate) for spec in z.params.values())
    assert any(c.kind == "all_gather" for c in z.collectives)   # weights gathered for their ops


def test_three_axis_meshes_are_refused(traced) -> None:
    mesh = Mesh((2, 2, 2), cluster="stress")
    with pytest.raises(AutoshardError, match="1-D or 2-D mesh"):
        runners_up(traced, mesh, None, 1)
