"""The device's steps in backward under ``offload_overlap="backward"`` (codegen/earlystep.py,
docs/cost-model.md §9.1): a parameter whose whole gradient is its ``.grad`` and whose state is on
the device steps as autograd completes that gradient, which is freed there; the liveness walk
frees it at the same event and holds the update's fp32 cast beside it; the numbers are those of
stepping after backward, bit for bit."""
from __future__ import annotations

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.cost.liveness import step_memory
from autoshard.cost.price import Pricer
from autoshard.cost.program import program_for
from autoshard.errors import AutoshardError
from autoshard.solver.planner import plan_traced
from autoshard.trace.batches import Traces
from autoshard.tools.verify import build, plan_for
from autoshard.zoo.registry import get_model
from dist import world_fixture

world1 = world_fixture(1, timeout_s=300)
STEPS = 3


@pytest.fixture(scope="module")
def gpt2_bf16():
    model, inputs = get_model("gpt2-tiny", batch=2)
    traces = Traces(model, inputs, training=True, precision="bf16-mixed")
    return traces.at(traces.full)


def test_the_walk_steps_each_device_parameter_as_its_gradient_completes(gpt2_bf16):
    """One device, nothing offloaded, bf16-mixed: every parameter is stepped in backward. At
    the end of backward the device holds the plain schedule's bytes less every gradient; the
    optimizer phase holds no cast (no piece is left to it); each parameter's cast is alive at
    its completion, beside its gradient."""
    traced, mesh = gpt2_bf16, Mesh((1,), cluster="h100")
    walked = {}
    for overlap in ("none", "backward"):
        plan = plan_traced(traced, mesh, offload="none", offload_overlap=overlap,
                           recompute="none")
        pricer = Pricer(traced, mesh, plan.options)
        prog = program_for(traced, plan.strategies(), pricer)
        log: list = []
        live = step_memory(traced, plan.strategies(), pricer, program=prog, log=log)
        walked[overlap] = (plan, pricer, prog, live, log)
    plan, pricer, prog, live, log = walked["backward"]
    names = {u.name for u in prog.optimizer.params}
    assert prog.released == names == prog.optimizer.released
    assert prog.optimizer.pieces() == [] and walked["none"][2].optimizer.pieces()
    grads = sum(pricer.state_bytes(n, plan.strategies()[n]).gradients for n in names)
    end = {o: next(b for _, at, b in w[4] if at == "end of backward") for o, w in walked.items()}
    assert end["none"] - end["backward"] == grads > 0
    assert live.phases["optimizer"] == end["backward"]
    casts = max(u.cast for u in prog.optimizer.params)
    assert live.phases["backward"] >= end["backward"] + casts
    assert plan.predicted.memory.peak < walked["none"][0].predicted.memory.peak


def _train(plan_json: str) -> dict:
    """``STEPS`` AdamW steps through pm.optimizer on one rank: the full parameters after each,
    what was stepped in backward, and whether the gradients were handed out in between."""
    from autoshard.codegen.optim import stepped
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    local = pm.shard_inputs(*inputs)
    out = {"params": [], "stepped": [], "left": [], "refused": []}
    for _ in range(STEPS):
        pm.step(*local)
        out["stepped"].append(len(stepped(pm)))
        out["left"].append(sum(p.grad is not None for p in pm.local_parameters().values()))
        refused = 0
        for read in (lambda: list(pm.parameters()), pm.full_grads):
            try:
                read()
            except AutoshardError:
                refused += 1
        out["refused"].append(refused)
        opt.step()
        opt.zero_grad()
        out["params"].append({k: v.clone() for k, v in pm.full_state_dict().items()})
    try:             # a second backward before the step
        pm.step(*local)
        pm.step(*local)
        out["twice"] = ""
    except AutoshardError as e:
        out["twice"] = str(e)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("precision, recompute", [("bf16-mixed", "none"), ("model", "none"),
                                                   ("model", "full")])
def test_steps_in_backward_give_the_parameters_of_steps_after_it(world1, precision, recompute):
    """bf16-mixed (an fp32 master per parameter) and fp32 (each parameter its own master), and
    with every layer checkpointed (its forward runs again in backward, before its weights'
    gradients complete): every parameter steps in backward, none keeps a gradient, and after 3 steps the parameters
    equal, bit for bit, those of stepping after backward. Between backward and the step,
    ``pm.parameters()`` and ``pm.full_grads()`` refuse (the gradients are gone); a second
    backward before the step is refused, not stepped twice."""
    plans = {o: plan_for("gpt2-tiny", Mesh((1,), cluster="stress"), offload="none",
                         offload_overlap=o, recompute=recompute, precision=precision).dumps()
             for o in ("none", "backward")}
    plain, early = (world1.run(_train, plans[o])[0] for o in ("none", "backward"))
    n = len(plain["params"][0])
    assert early["stepped"] == [n] * STEPS and plain["stepped"] == [0] * STEPS
    assert early["left"] == [0] * STEPS and plain["left"] == [n] * STEPS
    assert early["refused"] == [2] * STEPS and plain["refused"] == [0] * STEPS
    for a, b in zip(plain["params"], early["params"]):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "second backward" in early["twice"] and plain["twice"] == ""


def _second_optimizer(plan_json: str, second: str, first: bool) -> dict:
    """One step through ``second`` ("adamw": AdamW not said to be elementwise, so it steps
    after backward; "adagrad": no fused host step, so torch's runs after backward), made after
    an AdamW (``first``) whose hooks would step in backward: what stepped in backward, whether
    the first optimizer ever stepped, and the parameters after the step."""
    import warnings

    from autoshard.codegen.optim import released_grads, stepped
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    earlier = pm.optimizer(torch.optim.AdamW, lr=1e-2) if first else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")            # (each says it steps after backward)
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, elementwise=False) \
            if second == "adamw" else pm.optimizer(torch.optim.Adagrad, lr=1e-2)
    pm.step(*pm.shard_inputs(*inputs))
    out = {"in_backward": len(stepped(pm)) + len(released_grads(pm))}
    opt.step()
    if earlier is not None:
        out["earlier_stepped"] = bool(earlier.optimizer.state) or bool(
            earlier.host is not None and earlier.host.started_early)
    out["params"] = {k: v.clone() for k, v in pm.full_state_dict().items()}
    return out


@pytest.mark.slow
@pytest.mark.parametrize("offload, second", [("none", "adamw"), ("optimizer", "adagrad")])
def test_a_later_optimizer_takes_the_steps_in_backward_from_an_earlier_one(world1, offload,
                                                                            second):
    """Under offload_overlap="backward" an optimizer's hooks step parameters as backward
    completes them (on the device, or on the host after the copy down). A later
    pm.optimizer(...) that steps after backward instead (not known elementwise; no fused host
    step) takes them over: the earlier one never steps, nothing steps in backward, and the
    parameters are those of the later optimizer alone."""
    plan = plan_for("gpt2-tiny", Mesh((1,), cluster="stress"), offload=offload,
                    offload_overlap="backward", recompute="none").dumps()
    both, alone = (world1.run(_second_optimizer, plan, second, first)[0] for first in (True, False))
    assert both["in_backward"] == alone["in_backward"] == 0
    assert not both["earlier_stepped"]
    assert all(torch.equal(both["params"][k], alone["params"][k]) for k in alone["params"])
