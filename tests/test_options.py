"""PlanOptions (validated, recorded in the plan, restored by Plan.load), the model's layers, and
the one pricing function: a plan's predicted figures are its prices summed."""
from __future__ import annotations

import json
import math

import pytest
import torch

import autoshard
from autoshard import Mesh, PlanOptions
from autoshard.tools.cli import build_parser, plan_options
from autoshard.cost.price import Pricer
from autoshard.cost.reshards import reshard_edges
from autoshard.errors import AutoshardError
from autoshard.plans import Plan
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.zoo.registry import get_model


@pytest.fixture(scope="module")
def gpt2_tiny():
    model, inputs = get_model("gpt2-tiny", batch=8, device="meta")
    return model, inputs, trace(model, inputs)


# ------------------------------------------------------------------------------- options

def test_defaults_and_frozen() -> None:
    o = PlanOptions()
    assert (o.training, o.optimizer, o.precision, o.memory_budget, o.time_limit_s) == (
        True, "adam", "model", None, 20.0)
    with pytest.raises(AttributeError):
        o.training = False            # type: ignore[misc]
    assert PlanOptions(training=False).state_optimizer == "none"


@pytest.mark.parametrize("field,value,fragment", [
    ("training", 1, "training is True or False"),
    ("optimizer", "lamb", "optimizer is one of"),
    ("precision", "fp8", "precision is one of"),
    ("memory_budget", -1.0, "memory_budget is a positive number"),
    ("memory_budget", float("nan"), "memory_budget is a positive number"),
    ("memory_budget", True, "memory_budget is a positive number"),
    ("memory_budget", 10**400, "memory_budget is a positive number"),
    ("time_limit_s", 0, "time_limit_s is a positive number"),
    ("bucket_mb", 0, "bucket_mb is a positive number"),
    ("bucket_mb", float("inf"), "bucket_mb is a positive number"),
])
def test_bad_option_is_refused(field: str, value, fragment: str) -> None:
    with pytest.raises(AutoshardError) as info:
        PlanOptions(**{field: value})
    msg = str(info.value)
    assert fragment in msg and "got" in msg and "Fix" in msg, msg


def test_unknown_override_names_the_fields(gpt2_tiny) -> None:
    model, inputs, _ = gpt2_tiny
    with pytest.raises(AutoshardError, match="plan options among .*memory_budget.*got \\['budget'\\]"):
        autoshard.plan(model, inputs, Mesh((2,)), budget=1e9)
    with pytest.raises(AutoshardError, match="options is an autoshard.PlanOptions"):
        autoshard.plan(model, inputs, Mesh((2,)), {"training": True})


def test_plan_records_its_options_and_load_restores_them(gpt2_tiny, tmp_path) -> None:
    model, inputs, _ = gpt2_tiny
    base = PlanOptions(optimizer="sgd", time_limit_s=5.0)
    p = autoshard.plan(model, inputs, Mesh((2,), cluster="cpu"), base, memory_budget=2**30)
    assert p.options == PlanOptions(optimizer="sgd", time_limit_s=5.0, memory_budget=2**30)
    d = json.loads(p.dumps())
    assert d["options"] == {"training": True, "optimizer": "sgd", "precision": "model",
                            "memory_budget": 2**30, "time_limit_s": 5.0, "bucket_mb": 25.0,
                            "recompute": "auto", "zero": "auto", "offload": "auto",
                            "pipeline": None, "schedule": "auto", "microbatches": "auto"}
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").options == p.options


def test_optimizer_option_prices_model_state(gpt2_tiny) -> None:
    """SGD keeps no optimizer state: parameter state is 2 copies (value, gradient) in place of
    Adam's 4 in fp32 (docs/cost-model.md §4.1); its step streams 12 bytes per element in place
    of Adam's 28 (docs/cost-model.md §9), and nothing else changes."""
    _, _, traced = gpt2_tiny
    mesh = Mesh((1,), cluster="cpu")
    adam = plan_traced(traced, mesh)
    sgd = plan_traced(traced, mesh, optimizer="sgd")
    n = sum(math.prod(p.info.shape) for p in traced.params)
    # (the model state the step holds: the ILP's sum may differ by equally fast layouts that
    # a 1-device mesh does not tell apart)
    assert adam.predicted.memory.model_state - sgd.predicted.memory.model_state == \
        pytest.approx(2 * 4 * n)
    bw = mesh.cluster.mem_bandwidth
    assert adam.predicted.optimizer_s == pytest.approx(28 * n / bw)
    assert sgd.predicted.optimizer_s == pytest.approx(12 * n / bw)
    assert adam.predicted.step_time_s - sgd.predicted.step_time_s == \
        pytest.approx((28 - 12) * n / bw)


def test_a_16_bit_parameter_pays_the_casts_to_and_from_its_master() -> None:
    """A bf16 model trains with fp32 masters: the step streams AdamW's 28 bytes per element
    plus 12 for the casts (docs/cost-model.md §9)."""
    model, inputs = get_model("gpt2-tiny", batch=8, device="meta", dtype=torch.bfloat16)
    traced = trace(model, inputs)
    mesh = Mesh((1,), cluster="cpu")
    mixed = plan_traced(traced, mesh)
    n = sum(math.prod(p.info.shape) for p in traced.params)
    assert mixed.predicted.optimizer_s == pytest.approx((28 + 12) * n / mesh.cluster.mem_bandwidth)


def test_edited_options_in_a_plan_file_are_refused(gpt2_tiny) -> None:
    model, inputs, traced = gpt2_tiny
    d = json.loads(plan_traced(traced, Mesh((2,), cluster="cpu")).dumps())
    d["options"]["optimizer"] = "lamb"
    with pytest.raises(AutoshardError, match="optimizer is one of"):
        Plan.loads(json.dumps(d))


def test_training_must_match_the_trace(gpt2_tiny) -> None:
    _, _, traced = gpt2_tiny
    with pytest.raises(AutoshardError, match="options.training equal to the traced graph's"):
        plan_traced(traced, Mesh((2,)), PlanOptions(training=False))


def test_cli_flags_map_onto_options() -> None:
    args = build_parser().parse_args(["plan", "gpt2-tiny", "--mesh", "2", "--inference",
                                      "--memory-gb", "10", "--time-limit", "5",
                                      "--optimizer", "sgd", "--offload-overlap", "backward"])
    assert plan_options(args) == PlanOptions(training=False, optimizer="sgd",
                                             memory_budget=10 * 2**30, time_limit_s=5.0,
                                             offload_overlap="backward")
    defaults = build_parser().parse_args(["plan", "gpt2-tiny", "--mesh", "2"])
    assert plan_options(defaults) == PlanOptions()


def test_parallelize_refuses_options_beside_a_plan(gpt2_tiny) -> None:
    model, inputs, traced = gpt2_tiny
    p = plan_traced(traced, Mesh((2,), cluster="cpu"))
    with pytest.raises(AutoshardError, match="plan options only when planning here"):
        autoshard.parallelize(model, Mesh((2,)), plan=p, memory_budget=1e9)


# -------------------------------------------------------------------------------- layers

def test_layers_name_parameters_and_ops_together(gpt2_tiny) -> None:
    model, _, traced = gpt2_tiny
    names = [layer.name for layer in traced.layers]
    assert names == ["layers.0", "layers.1"]
    first, second = traced.layers
    assert first.same_as == "layers.0" and second.same_as == "layers.0"
    assert len(first.nodes) == len(second.nodes)
    fqns = {p.name: p.fqn for p in traced.params}
    params = [fqns[n] for n in first.nodes if n in fqns]
    assert params == [n for n, _ in model.named_parameters() if n.startswith("layers.0.")]
    ops = [n for n in first.nodes if n not in fqns]
    assert ops and all(traced.layer_of_node[n] == "layers.0" for n in ops)


def test_a_different_layer_is_not_folded() -> None:
    """A layer whose shapes differ from the first of its container decides for itself."""

    class Uneven(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList([torch.nn.Linear(8, 8), torch.nn.Linear(8, 8),
                                               torch.nn.Linear(8, 4)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x.sum()

    traced = trace(Uneven(), (torch.randn(4, 8),))
    assert [(l.name, l.same_as) for l in traced.layers] == [
        ("layers.0", "layers.0"), ("layers.1", "layers.0"), ("layers.2", "layers.2")]


def test_plan_carries_layers_and_show_prints_them(gpt2_tiny, tmp_path) -> None:
    _, _, traced = gpt2_tiny
    p = plan_traced(traced, Mesh((2,), cluster="cpu"))
    assert p.layers == traced.layers
    p.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json").layers == traced.layers
    text = p.summary()
    assert "layers: 2" in text and "layers.0 .. 1" in text and "identical (decided once)" in text


# ------------------------------------------------------------------------------- pricing

@pytest.mark.slow
@pytest.mark.parametrize("shape,cluster", [((2,), "stress"), ((2, 2), "stress"),
                                            ((2, 2, 2), "stress")])
def test_predicted_figures_are_the_prices_summed(gpt2_tiny, shape, cluster) -> None:
    """The plan's figures are the pricing function summed over its nodes and the reshards the
    program runs, and equal the ILP's objective (on a 3-axis mesh, the merged problem's). The
    3-axis plan gets a 2 s time limit: the every-subset ILP's build alone takes longer and is
    given up, where under the default 20 s it was built and solved for a plan that ties the
    merged one, which comes first and is kept either way (idle: the same plan, 26 s to 5 s)."""
    _, _, traced = gpt2_tiny
    mesh = Mesh(shape, cluster=cluster)
    p = plan_traced(traced, mesh, **({"time_limit_s": 2.0} if len(shape) == 3 else {}))
    pricer = Pricer(traced, mesh, p.options)
    strategies = p.strategies()
    compute = sum(pricer.node(n, s).seconds for n, s in strategies.items())
    memory = sum(pricer.node(n, s).bytes for n, s in strategies.items())
    memory += pricer.saved_copies(strategies)
    comm = sum(pricer.reshard_seconds(e.value, e.src, e.dst, e.divergent)
               for e in reshard_edges(traced.graph, strategies, mesh.shape, pricer.shapes,
                                      {q.name for q in traced.params}, training=True))
    assert p.predicted.compute_s == pytest.approx(compute, rel=1e-12)
    assert p.predicted.comm_s == pytest.approx(comm, rel=1e-12)
    assert p.predicted.ilp_sum_bytes == pytest.approx(memory, rel=1e-12)
    assert p.solver["objective"] == pytest.approx(p.predicted.step_time_s, rel=1e-9)
    assert comm > 0        # the stress preset makes these plans move data
