"""`autoshard explain`: a node's or parameter's alternatives re-solved, its source line, and the
most expensive collectives."""
from __future__ import annotations

import dataclasses
import inspect
import json
import random

import pytest

from autoshard.cost.comm import collective_time
from autoshard.errors import AutoshardError
from autoshard.tools.explain import explain_file
from autoshard.tools.explain.choices import explain_node, explain_param, strategy_text
from autoshard.tools.explain.ledger import top_collectives
from autoshard.tools.explain.rebuild import rebuild
from autoshard.tools.explain.render import render_explanation
from autoshard.ir import Strategy
from autoshard.plans import Plan
from autoshard.plans.prediction import StagePrediction
from autoshard.plans.records import Pipeline, Stage
from autoshard.solver.alternatives import plan_stored
from autoshard.solver.build import build_problem
from autoshard.solver.ilp import solve
from autoshard.solver.planner import plan_traced
from autoshard.solver.problem import admits, evaluate, restricted
from autoshard.zoo import models
from test_diff import run

# gpt2-tiny, one sequence, on 2x2 of the slow-compute cluster: tensor-parallel layers, so its
# nodes have alternatives that move the step and its layers run collectives.
PLAN_ARGS = ["plan", "gpt2-tiny", "--batch", "1", "--mesh", "2x2", "--cluster", "stress"]
NODE = "linear_2"                     # layers.0.attn.v_proj: a decision of its own, followed
PARAM = "layers.0.mlp.fc1.weight"


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("explain") / "plan.json")
    assert run(PLAN_ARGS + ["-o", path])[0] == 0
    return path


@pytest.fixture(scope="module")
def plan(plan_file) -> Plan:
    return Plan.load(plan_file)


@pytest.fixture(scope="module")
def rebuilt(plan):
    return rebuild(plan)


def _builder_strategy(rebuilt, plan: Plan, node: str, text: str) -> Strategy:
    """The strategy object the planner offers ``node`` whose one-line text is ``text``."""
    built = build_problem(rebuilt.traced, rebuilt.mesh, plan.options)
    member = built.members[node]
    ph = node.startswith("p_")
    found = [s for s in member.strategies if strategy_text(s, placeholder=ph) == text]
    assert len(found) == 1, (text, found)
    return found[0]


def test_node_deltas_are_independent_resolves_with_the_strategy_pinned(plan, rebuilt) -> None:
    e = explain_node(plan, NODE, rebuilt=rebuilt, alternatives=2)
    assert len(e.rows) == 2 and e.strategies > 2
    # The same pins through the planner's own path (plan_traced with a fixed strategy).
    def pinned(text: str) -> Plan:
        s = _builder_strategy(rebuilt, plan, NODE, text)
        return plan_traced(rebuilt.traced, rebuilt.mesh, plan.options, fixed={NODE: s})

    base = pinned(e.chosen)
    assert e.baseline.step_time_s == pytest.approx(base.predicted.step_time_s, rel=1e-9)
    # The plan was solved to optimality: its own re-solve is the file's step.
    assert e.baseline.step_time_s == pytest.approx(plan.predicted.step_time_s, rel=1e-9)
    for row in e.rows:
        other = pinned(row.resolved.strategy)
        assert row.resolved.status == "OPTIMAL"
        assert row.step_delta_s == pytest.approx(
            other.predicted.step_time_s - base.predicted.step_time_s, rel=1e-6, abs=1e-12)
        assert row.memory_delta_bytes == pytest.approx(
            other.predicted.ilp_sum_bytes - base.predicted.ilp_sum_bytes,
            rel=1e-6, abs=1e-3)
        assert row.step_delta_s >= -1e-12 * base.predicted.step_time_s  # chosen is optimal
        # The re-solve lets the rest adapt: never slower than the swap alone.
        assert row.resolved.step_time_s <= row.resolved.alone_step_s * (1 + 1e-9)
    assert [r.step_delta_s for r in e.rows] == sorted(r.step_delta_s for r in e.rows)
    # Real re-solves, not the swap alone: other decisions moved, and the step fell below it.
    assert any(r.moved and r.resolved.step_time_s < r.resolved.alone_step_s * (1 - 1e-9)
               for r in e.rows)


def test_param_deltas_are_independent_resolves_with_the_layout_stored(plan, rebuilt) -> None:
    e = explain_param(plan, PARAM, rebuilt=rebuilt, alternatives=2)
    assert e.param == PARAM and e.node == "p_model_layers_0_mlp_fc1_weight"

    def stored(text: str) -> Plan:
        s = _builder_strategy(rebuilt, plan, e.node, text)
        return plan_stored(rebuilt.traced, rebuilt.mesh, {e.node: s}, plan.options)

    base = stored(e.chosen)
    assert e.baseline.step_time_s == pytest.approx(base.predicted.step_time_s, rel=1e-9)
    for row in e.rows:
        other = stored(row.resolved.strategy)
        # another layout, or the same with another state mode (or its state axes)
        assert other.params[PARAM] != plan.params[PARAM] or {"zero1", "zero2", "offload"} & set(
            row.resolved.strategy.split())
        assert row.step_delta_s == pytest.approx(
            other.predicted.step_time_s - base.predicted.step_time_s, rel=1e-6, abs=1e-12)
        assert row.memory_delta_bytes == pytest.approx(
            other.predicted.ilp_sum_bytes - base.predicted.ilp_sum_bytes,
            rel=1e-6, abs=1e-3)


def test_restricting_a_decision_solves_as_the_best_of_its_pins(plan, rebuilt) -> None:
    """What a follower's pin needs: a decision held to a set of its strategies (a cut of the
    problem) solves to the best of the problems each pinning one of them, and prices every
    choice as the whole problem does."""
    p = build_problem(rebuilt.traced, rebuilt.mesh, plan.options).problem
    g = max(range(len(p.decisions)), key=lambda d: len(p.decisions[d].cost))
    allowed = {g: (3, 0, 5)}
    r = restricted(p, allowed)
    rng = random.Random(0)
    for _ in range(20):
        c = tuple(rng.randrange(len(d.cost)) for d in r.decisions)
        assert evaluate(r, c) == evaluate(p, c)
        assert admits(r, c) == (c[g] in allowed[g])
    best = min(solve(dataclasses.replace(p, fixed=((g, i),))).objective for i in allowed[g])
    sol = solve(r)
    assert sol.objective == pytest.approx(best, rel=1e-9)
    assert sol.choice[g] in allowed[g]
    with pytest.raises(ValueError):
        restricted(p, {g: ()})


def test_source_line_is_the_models_own(plan, rebuilt) -> None:
    e = explain_node(plan, NODE, rebuilt=rebuilt, alternatives=0)
    assert e.rows == () and e.module == "layers.0.attn.v_proj"
    assert e.shared_layers == ("layers.0", "layers.1")
    # aten.linear runs inside torch's nn.Linear: the line shown is the model's call of it.
    lines = inspect.getsource(models).splitlines()
    want = next(i + 1 for i, text in enumerate(lines) if "for p in projections" in text)
    assert e.source.file.endswith("autoshard/zoo/models.py") and e.source.line == want
    assert "projections" in e.source.code
    p = explain_param(plan, PARAM, rebuilt=rebuilt, alternatives=0)
    assert p.source_node != p.node and "self.fc1(x)" in p.source.code   # its first reader
    text = render_explanation(e)
    assert f"models.py:{want}" in text and "layers 0-1" in text


def test_a_later_layers_node_is_decided_by_its_first_layers_counterpart(plan, rebuilt) -> None:
    first, second = plan.layers[0], plan.layers[1]
    assert second.same_as == first.name
    twin = second.nodes[first.nodes.index(NODE)]
    e = explain_node(plan, twin, rebuilt=rebuilt, alternatives=1)
    assert e.template == NODE and e.layer == second.name and twin not in e.decision_nodes
    assert e.chosen == explain_node(plan, NODE, rebuilt=rebuilt, alternatives=0).chosen
    assert f"decided as its counterpart in {first.name}: {NODE}" in render_explanation(e)


def test_top_collectives_sum_to_the_plans_comm(plan, rebuilt) -> None:
    everything = top_collectives(plan, 10_000, rebuilt=rebuilt)
    # Folding identical layers loses nothing: the rows' seconds sum to the ledger's, each
    # collective priced by alpha-beta on its axis.
    mesh = rebuilt.mesh
    ledger = 0.0
    for c in plan.collectives:
        a = mesh.axes.index(c.axes[0])
        ledger += collective_time(c.kind, mesh.shape[a], c.bytes, mesh.links[a].alpha,
                                  mesh.links[a].bandwidth) * c.count
    assert sum(t.seconds for t in everything) == pytest.approx(ledger, rel=1e-9)
    assert sum(t.instances for t in everything) == len(plan.collectives)
    # Apart from gradient buckets (the plan prices each gradient's share of its bucket), that
    # is the plan's comm.
    blocking = sum(t.seconds for t in everything if t.phase != "grad_sync")
    sync = plan.predicted.comm_s - blocking
    assert 0 < sync <= sum(t.seconds for t in everything if t.phase == "grad_sync")
    seconds = [t.seconds for t in everything]
    assert seconds == sorted(seconds, reverse=True)
    folded = [t for t in everything if t.instances == 2]
    assert folded and all(t.layers == "layers 0-1" and t.source is not None for t in folded)
    top = top_collectives(plan, 3, rebuilt=rebuilt)
    assert top == everything[:3]


def test_cli_prints_each_mode(plan_file) -> None:
    code, out, _ = run(["explain", plan_file, "--top", "3"])
    assert code == 0 and out.count("\n   ") >= 3 and "source: autoshard/zoo/models.py:" in out
    code, out, _ = run(["explain", plan_file, "--node", NODE, "--alternatives", "1", "--json"])
    d = json.loads(out)
    assert code == 0 and d["node"] == NODE and len(d["alternatives"]) == 1
    row = d["alternatives"][0]
    assert row["step_delta_s"] == pytest.approx(row["step_time_s"] - d["baseline"]["step_time_s"])
    code, out, _ = run(["explain", plan_file, "--param", PARAM, "--alternatives", "1"])
    assert code == 0 and "baseline = the plan re-solved with the chosen strategy pinned" in out


@pytest.mark.parametrize("argv, message", [
    (["--node", "linear_22"], "did you mean linear_2"),
    (["--node", PARAM], f"use --param {PARAM}"),
    (["--param", "layers.0.mlp.fc1.weihgt"], f"did you mean {PARAM}"),
    (["--param", NODE], f"use --node {NODE}"),
    (["--top", "0"], "a number of collectives >= 1"),
    (["--node", NODE, "--alternatives", "-1"], "a number of alternatives >= 0"),
    (["--node", NODE, "--time-limit", "0"], "a positive time limit"),
])
def test_cli_refuses_names_and_numbers_outside_the_plan(plan_file, argv, message) -> None:
    code, out, err = run(["explain", plan_file, *argv])
    assert code == 2 and not out and message in err and "Traceback" not in err


def _edited(plan_file: str, tmp_path, **changes) -> str:
    d = json.loads(open(plan_file).read())
    d.update(changes)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    return str(path)


def test_a_model_that_cannot_be_rebuilt_is_refused(plan_file, tmp_path) -> None:
    unnamed = _edited(plan_file, tmp_path, model="")
    code, _, err = run(["explain", unnamed, "--node", NODE])
    assert code == 2 and "names its model" in err and "--model" in err
    code, _, err = run(["explain", _edited(plan_file, tmp_path, model="gpt2-tyni"), "--node",
                        NODE])
    assert code == 2 and "did you mean gpt2-tiny" in err
    # Another model's graph: the fingerprints differ.
    code, _, err = run(["explain", plan_file, "--node", NODE, "--model", "llama-tiny"])
    assert code == 2 and "fingerprint" in err and "--model" in err
    # The right model named explicitly rebuilds an unnamed plan.
    assert run(["explain", unnamed, "--node", NODE, "--alternatives", "0", "--model",
                "gpt2-tiny"])[0] == 0
    # --top needs no model: the ledger alone, without source lines, says so.
    code, out, _ = run(["explain", unnamed, "--top", "2"])
    assert code == 0 and "no source lines: " in out and "source: " not in out


def test_plans_it_cannot_re_solve_are_refused(plan, rebuilt, tmp_path) -> None:
    piped = dataclasses.replace(plan, pipeline=Pipeline("dp", "1F1B", 2, (
        Stage(0, ("layers.0",), StagePrediction(0.0, 0.0, 0.0)),
        Stage(1, ("layers.1",), StagePrediction(0.0, 0.0, 0.0)))))
    with pytest.raises(AutoshardError, match="without a pipeline"):
        explain_node(piped, NODE, rebuilt=rebuilt)
    # A plan priced on a cluster profile: the profile is needed to price it again.
    path = tmp_path / "profiled.json"
    dataclasses.replace(plan, cluster="my-profile").save(path)
    with pytest.raises(AutoshardError, match="cluster the plan was priced on.*--cluster"):
        explain_file(path, top=1)
