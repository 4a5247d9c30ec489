"""Frozen parameters (issue 29 item 6): a parameter with ``requires_grad=False`` costs no
gradient, no optimizer state, no optimizer step and no gradient sync in the plan
(docs/cost-model.md §4.1), codegen emits no gradient collective for it (it runs the step
program's buckets), and the runtime leaves it unchanged while the trainable ones train as on
one device."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.cost.price import Pricer
from autoshard.ir import local_shape
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.tools.verify import build
from dist import world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
MODEL = "llama-tiny"
TOL = 1e-4

world2 = world_fixture(2, timeout_s=600)


def trainable(name: str) -> bool:
    """Fine-tuning the head: the embedding and the backbone frozen, the final norm and the
    output projection trained."""
    return name.startswith(("lm_head", "norm"))


def frozen_model(seed: int = 0):
    model, inputs = build(MODEL, None, None, seed)
    for name, p in model.named_parameters():
        p.requires_grad_(trainable(name))
    return model, inputs


@pytest.fixture(scope="module")
def traced():
    return trace(*frozen_model())


def _plan(traced, **kw) -> Plan:
    return plan_traced(traced, Mesh((2,), cluster=CLUSTER), zero="none", offload="none",
                       recompute="none", **kw)


def test_frozen_state_is_the_parameter_alone(traced):
    """Closed form (docs/cost-model.md §4.1): a trainable fp32 parameter under Adam holds
    4 (weight) + 4 (gradient) + 8 (moments) bytes per local element, a frozen one 4."""
    plan = _plan(traced)
    want = 0
    for ph in traced.params:
        n = math.prod(local_shape(ph.info.shape, plan.params[ph.fqn], plan.mesh_shape))
        want += n * (16 if trainable(ph.fqn) else 4)
    assert plan.predicted.memory.model_state == want
    # The ILP's memory sum reads the same state: a frozen placeholder is its weight only.
    pricer = Pricer(traced, Mesh((2,), cluster=CLUSTER), plan.options)
    strategies = plan.strategies()
    for ph in traced.params:
        sb = pricer.state_bytes(ph.name, strategies[ph.name])
        n = math.prod(local_shape(ph.info.shape, plan.params[ph.fqn], plan.mesh_shape)) * 4
        assert (sb.gradients, sb.optimizer) == ((n, 2 * n) if trainable(ph.fqn) else (0, 0))
        assert pricer.memory(ph.name, strategies[ph.name]) == sb.device
        if not trainable(ph.fqn):
            assert pricer.param_states(ph.name, plan.params[ph.fqn]) == [(None, None)]
            assert pricer.optimizer_seconds(ph.name, strategies[ph.name]) == 0.0


def test_no_gradient_sync_for_frozen_parameters(traced):
    """Structural: the ledger's gradient syncs hold only trainable parameters, of their bytes,
    and the step is no slower than training every parameter."""
    plan = _plan(traced)
    names = {ph.name: ph.fqn for ph in traced.params}
    syncs = [c for c in plan.collectives if c.phase == "grad_sync"]
    assert syncs, "the trainable head's gradients are synced"
    for c in syncs:
        members = c.members or (c.value,)
        assert all(trainable(names[m]) for m in members), c
    # An all-reduce moves a gradient's local bytes: the trainable ones' at most.
    synced = sum(c.bytes for c in syncs)
    assert 0 < synced <= sum(
        math.prod(local_shape(ph.info.shape, plan.params[ph.fqn], plan.mesh_shape)) * 4
        for ph in traced.params if trainable(ph.fqn))
    full = trace(*build(MODEL, None, None, 0))
    everything = _plan(full)
    assert plan.predicted.comm_s < everything.predicted.comm_s
    assert plan.predicted.memory.model_state < everything.predicted.memory.model_state


def _fine_tune(plan_json: str, steps: int) -> dict:
    """On one rank: ``steps`` AdamW steps of the head-only fine-tuning under the plan and on one
    device; the losses, the largest trainable weight difference, whether the frozen weights are
    bit-identical to where they started, and whether every step ran the plan's collectives (the
    ledger's: no gradient sync of a frozen parameter) and no others."""
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    from autoshard.tools.verify import rel_err
    plan = Plan.loads(plan_json)
    model, inputs = frozen_model()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    ref = as_loss_module(frozen_model()[0])
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                                weight_decay=0.1)
    local = pm.shard_inputs(*inputs)
    losses, ref_losses, ran = [], [], []
    for _ in range(steps):
        losses.append(float(pm.step(*local)))
        opt.step()
        opt.zero_grad()
        ran.append(sorted((r.kind, r.axes, r.nbytes, r.phase, r.node) for r in pm.ledger))
        pm.ledger.clear()
        loss = ref(*inputs)
        loss.backward()
        ref_losses.append(float(loss.detach()))
        ref_opt.step()
        ref_opt.zero_grad()
    full = pm.full_state_dict()
    moved = {n: not torch.equal(full[n], start[n]) for n in start}
    err = max(rel_err(full[n.removeprefix("model.")], p.detach())
              for n, p in ref.named_parameters())
    planned = sorted((c.kind, c.axes, c.bytes, c.phase, c.node) for c in plan.collectives)
    return {"losses": losses, "ref": ref_losses, "err": err, "moved": moved,
            "ledger": all(r == planned for r in ran)}


@pytest.mark.slow
@pytest.mark.parametrize("kw", [{}, {"zero": "zero2", "bucket_mb": 0.001},
                                {"offload": "optimizer"}], ids=["plain", "zero2", "offload"])
def test_frozen_backbone_fine_tuning_equals_one_device(world2, traced, kw):
    """Numerical, on gloo: three fine-tuning steps equal one device's, the frozen weights stay
    exactly as they were, the trainable ones move, and the collectives run are the ledger's;
    with the trainable state plain, sharded (ZeRO-2) or on the host."""
    plan = plan_traced(traced, Mesh((2,), cluster=CLUSTER), recompute="none",
                       **{"zero": "none", "offload": "none", **kw})
    out = world2.run(_fine_tune, plan.dumps(), 3)
    for r in out:
        assert max(abs(a - b) / abs(b) for a, b in zip(r["losses"], r["ref"])) <= TOL, r
        assert r["err"] <= TOL, r
        assert r["ledger"], r
        for name, moved in r["moved"].items():
            assert moved == trainable(name), (name, moved)
