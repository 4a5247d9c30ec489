"""Pipeline stages (docs/cost-model.md §10): the closed forms of the schedules, the planner's
stages and their records, and gloo runs equal to the single-device model with the bytes the
plan lists, sends included."""
from __future__ import annotations

import json

import pytest

from autoshard import Mesh, Plan
from autoshard.cost.pipeline import (bubble_fraction, in_flight, pipeline_seconds,
                                     schedule_seconds)
from autoshard.errors import AutoshardError
from autoshard.verify import VerifySpec, plan_for, summarize, verify_rank
from dist import world_fixture

world2 = world_fixture(2, timeout_s=300)
world4 = world_fixture(4, timeout_s=300)
world8 = world_fixture(8, timeout_s=300)


# -- closed forms (REFERENCE: GPipe / 1F1B bubble (p-1)/(m+p-1); 1F1B keeps p - i in flight) ---

def test_balanced_stages_idle_for_the_bubble() -> None:
    p, m, t = 4, 8, 2.0
    total = pipeline_seconds([t] * p, m)
    assert total == pytest.approx((m + p - 1) * t)
    assert 1 - m * t / total == pytest.approx(bubble_fraction(p, m)) == pytest.approx(3 / 11)
    # The slowest stage sets the pace of the m - 1 microbatches after the first.
    assert pipeline_seconds([1.0, 3.0], 4) == pytest.approx(1 + 3 + 3 * 3)


def test_interleaving_shrinks_the_bubble_v_times() -> None:
    """Interleaved 1F1B, v = 2 stages per rank (rank r runs stages r and r + p): balanced, the
    step is (m + (p - 1)/v)·t_rank, an idle fraction (p - 1)/(v·m + p - 1)."""
    p, m, t = 4, 8, 1.0
    stages = [t / 2] * (2 * p)                      # each rank: two halves of t
    total = schedule_seconds(stages, m, p, "Interleaved1F1B")
    assert total == pytest.approx((m + (p - 1) / 2) * t)
    assert 1 - m * t / total == pytest.approx(bubble_fraction(p, m, 2)) == pytest.approx(3 / 19)
    assert schedule_seconds([t] * p, m, p, "1F1B") == pytest.approx(pipeline_seconds([t] * p, m))
    assert in_flight("Interleaved1F1B", 5, 4, 8) == 4


def test_microbatches_in_flight_per_schedule() -> None:
    assert [in_flight("1F1B", i, 4, 8) for i in range(4)] == [4, 3, 2, 1]
    assert [in_flight("GPipe", i, 4, 8) for i in range(4)] == [8] * 4
    assert in_flight("1F1B", 0, 4, 2) == 2          # never more than there are


# -- the planner ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt2_pp() -> Plan:
    """GPT-2 124M (12 layers) on 4 stages x 2-way tensor parallel, 8 microbatches."""
    return plan_for("gpt2", Mesh((4, 2), ("pp", "tp"), cluster="h100"), batch=8, seq=1024,
                    pipeline="pp", schedule="1F1B", microbatches=8)


def test_stages_cover_the_layers_in_order_and_balance(gpt2_pp) -> None:
    pl = gpt2_pp.pipeline
    assert (pl.axis, pl.schedule, pl.microbatches, len(pl.stages)) == ("pp", "1F1B", 8, 4)
    layers = [name for st in pl.stages for name in st.layers]
    assert layers == [f"layers.{i}" for i in range(12)]
    # The last stage carries the head and the loss over a 50257-word vocabulary, worth several
    # layers: it gets fewer layers than a middle stage.
    assert len(pl.stages[-1].layers) < len(pl.stages[1].layers)
    slowest = max(st.predicted["compute_s"] + st.predicted["comm_s"] for st in pl.stages)
    assert all(st.predicted["compute_s"] + st.predicted["comm_s"] >= 0.5 * slowest
               for st in pl.stages)
    # Every spec is replicated over the pipeline axis; the inner plan decides the rest.
    assert all(spec[0].__class__.__name__ == "Replicate" for n in gpt2_pp.nodes
               for spec in n.outputs)


def test_step_is_the_schedule_over_the_stages(gpt2_pp) -> None:
    pl, pred = gpt2_pp.pipeline, gpt2_pp.predicted
    stage_s = [st.predicted["compute_s"] + st.predicted["comm_s"] for st in pl.stages]
    # + the slowest stage's optimizer step, the loss all-reduce and the tied weight's sync
    assert pred["step_time_s"] >= pipeline_seconds(stage_s, pl.microbatches)
    assert pred["step_time_s"] <= pipeline_seconds(stage_s, pl.microbatches) * 1.2
    assert pred["peak_memory_bytes"] == max(st.predicted["peak_memory_bytes"]
                                            for st in pl.stages)


def test_sends_between_stages_are_in_the_plan(gpt2_pp) -> None:
    """One send per microbatch each way between neighbouring stages: the residual stream of a
    microbatch (b/m x s x h fp32, h = 768 for GPT-2; split over tp where the plan keeps it
    sequence-parallel) forward and its gradient backward; the labels (int64, 1 x 1024, at most)
    go forward only: they have no gradient."""
    sends = [c for c in gpt2_pp.collectives if c.phase == "pipeline" and c.kind == "send_recv"]
    assert len(sends) == 2 * 3 and all(c.count == 8 for c in sends)
    stream = 1 * 1024 * 768 * 4
    back = {c.stage: c.bytes for c in sends if c.node == f"stage{c.stage}->stage{c.stage - 1}"}
    for c in sends:
        if c.node == f"stage{c.stage}->stage{c.stage + 1}":
            assert back[c.stage + 1] in (stream, stream // 2), back
            assert 0 < c.bytes - back[c.stage + 1] <= 1024 * 8, (c, back)
    # GPT-2's head is tied to the token embedding: the first and last stages sync its gradient.
    tied = [c for c in gpt2_pp.collectives if c.node.startswith("tied:")]
    assert sorted(c.stage for c in tied) == [0, 3]


def test_pipelined_plan_round_trips_through_json(gpt2_pp) -> None:
    again = Plan.loads(gpt2_pp.dumps())
    assert again == gpt2_pp
    d = json.loads(gpt2_pp.dumps())
    assert set(d["pipeline"]) == {"axis", "schedule", "microbatches", "virtual_stages", "stages"}
    assert set(d["pipeline"]["stages"][0]["predicted"]) == {"compute_s", "comm_s",
                                                           "peak_memory_bytes"}
    assert "pipeline over pp: 1F1B, 8 microbatches, 4 stages on 4 ranks" in gpt2_pp.summary()


def test_pipeline_errors_say_what_to_do() -> None:
    mesh = Mesh((2, 2), ("pp", "tp"), cluster="cpu")
    with pytest.raises(AutoshardError, match="an axis of the mesh"):
        plan_for("gpt2-tiny", mesh, pipeline="dp", microbatches=2)
    with pytest.raises(AutoshardError, match="divisible by the 3 microbatches"):
        plan_for("gpt2-tiny", mesh, pipeline="pp", microbatches=3)
    with pytest.raises(AutoshardError, match="at least one layer per stage"):
        plan_for("gpt2-tiny", Mesh((4,), ("pp",), cluster="cpu"), pipeline="pp",
                 microbatches=4)
    with pytest.raises(AutoshardError, match="at least 4 layers for Interleaved1F1B"):
        plan_for("gpt2-tiny", mesh, pipeline="pp", schedule="Interleaved1F1B", microbatches=2)


def test_auto_microbatches_pick_the_fastest() -> None:
    mesh = Mesh((2,), ("pp",), cluster="cpu")
    auto = plan_for("gpt2-tiny", mesh, pipeline="pp")
    m = auto.pipeline.microbatches
    assert m in (2, 4) and auto.options.microbatches == m
    for k in (2, 4):
        other = plan_for("gpt2-tiny", mesh, pipeline="pp", microbatches=k)
        assert auto.predicted["step_time_s"] <= other.predicted["step_time_s"] + 1e-12


# -- gloo: the pipelined program equals the single-device model -------------------------------

CASES = [("gpt2-tiny", (2,), ("pp",), "1F1B", 2, "cpu"),
         ("llama-tiny", (2,), ("pp",), "GPipe", 4, "cpu"),
         ("gpt2-tiny-4l", (2,), ("pp",), "Interleaved1F1B", 2, "cpu"),
         ("gpt2-tiny", (2, 2), ("pp", "tp"), "GPipe", 2, "stress"),
         ("llama-tiny", (2, 2), ("pp", "tp"), "1F1B", 2, "stress"),
         ("llama-tiny-4l", (2, 2), ("pp", "tp"), "Interleaved1F1B", 4, "stress")]


def check(world, model: str, plan: Plan) -> dict:
    spec = VerifySpec(model, plan.mesh_shape, plan.mesh_axes, plan.dumps())
    reports = world.run(verify_rank, spec)
    ok, text = summarize(reports, 1e-5)
    assert ok, text
    for r in reports:      # every rank's own ledger: its stage's collectives and sends
        assert not r["ledger_diff"] and r["bytes"] == r["planned_bytes"], r["ledger_diff"]
    return reports[0]


@pytest.mark.parametrize("model,shape,axes,schedule,m,cluster", CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}-{c[3]}" for c in CASES])
def test_pipelined_step_equals_single_device(world2, world4, model, shape, axes, schedule, m,
                                             cluster) -> None:
    plan = plan_for(model, Mesh(shape, axes, cluster=cluster), pipeline="pp",
                    schedule=schedule, microbatches=m)
    v = 2 if schedule == "Interleaved1F1B" else 1
    assert plan.pipeline.schedule == schedule and len(plan.pipeline.stages) == 2 * v
    assert plan.pipeline.virtual_stages == v
    report = check(world2 if len(shape) == 1 else world4, model, plan)
    assert report["collectives"] > 0


@pytest.mark.parametrize("model,schedule", [("llama-tiny", "1F1B"),
                                            ("llama-tiny-4l", "Interleaved1F1B")])
def test_data_pipeline_tensor_on_eight_ranks(world8, model, schedule) -> None:
    """`autoshard verify llama-tiny --mesh 2x2x2 --axes dp,pp,tp --pipeline pp`: data parallel
    gradient buckets per stage (two stages per rank interleaved), synced once per step."""
    plan = plan_for(model, Mesh((2, 2, 2), ("dp", "pp", "tp"), cluster="stress"),
                    pipeline="pp", schedule=schedule, microbatches=2)
    assert any(c.members for c in plan.collectives)
    check(world8, model, plan)


def test_auto_pipeline_keeps_the_faster_and_records_the_search() -> None:
    """pipeline='auto': the plan without a pipeline and one over each axis; the fastest is kept
    and every try is in solver["pipeline_search"] (and in the summary)."""
    from autoshard.solver.planner import plan
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("gpt2-tiny", batch=8, seq=16, device="meta")
    mesh = Mesh((2, 2), ("pp", "dp"), cluster="cpu")
    p = plan(model, inputs, mesh, pipeline="auto")
    search = p.solver["pipeline_search"]
    assert [t["pipeline"] for t in search] == [None, "pp", "dp"]
    steps = [t["step_time_s"] for t in search if t["step_time_s"] is not None]
    assert p.predicted["step_time_s"] == min(steps)
    chosen = p.pipeline.axis if p.pipeline else None
    assert p.options.pipeline == chosen
    assert "pipeline search (pipeline='auto')" in p.summary() and "<- chosen" in p.summary()
    with pytest.raises(AutoshardError, match="searches the axes"):
        from autoshard.solver.planner import plan_traced, trace_for
        plan_traced(trace_for(model, inputs, p.options.replace(pipeline=None)), mesh,
                    pipeline="auto")


def test_megatron_layout_on_a_pipeline_pins_every_stage() -> None:
    """A hand-written layout priced on the same pipeline: the stages' parameters are laid out
    as Megatron writes them (column-parallel fc1, row-parallel fc2 over tp), the cuts and
    schedule come from the same program, and autoshard's own stage layouts, which the ILP
    chose with Megatron's among its options, are no slower."""
    from autoshard.ir import Shard
    from autoshard.options import PlanOptions
    from autoshard.solver.baselines import pipelined_baseline_plan
    from autoshard.solver.planner import plan_traced, trace_for
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("gpt2", batch=8, seq=1024, device="meta")
    options = PlanOptions(pipeline="pp", schedule="1F1B", microbatches=8)
    traced = trace_for(model, inputs, options)
    mesh = Mesh((4, 2), ("pp", "tp"), cluster="h100")
    meg = pipelined_baseline_plan(traced, mesh, "megatron-dp", options, model_name="gpt2")
    assert meg.pipeline is not None and len(meg.pipeline.stages) == 4
    # nn.Linear stores (out, in): column-parallel shards dim 0, row-parallel dim 1; over tp,
    # the mesh's last axis, in every stage.
    for i in range(12):
        assert meg.params[f"layers.{i}.mlp.fc1.weight"][-1] == Shard(0)
        assert meg.params[f"layers.{i}.mlp.fc2.weight"][-1] == Shard(1)
        assert meg.params[f"layers.{i}.attn.q_proj.weight"][-1] == Shard(0)
    ours = plan_traced(traced, mesh, options, model_name="gpt2")
    assert ours.predicted["step_time_s"] <= meg.predicted["step_time_s"] * (1 + 1e-9)
