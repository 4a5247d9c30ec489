"""The training loop people write runs on a ParallelModule as on one device (issue 29).

On gloo: 8 optimizer steps of 2 micro-batches each, AdamW with weight decay, LambdaLR warmup +
cosine and torch's own ``clip_grad_norm_(pm.parameters(), 0.5)``, under data parallelism, tensor
parallelism with sharded weights, ZeRO-2, ZeRO-3 (FSDP), optimizer offload and a 2-stage
pipeline (each stage data parallel), against the same
loop on one device (tests/loop.py). Then one regression test per failure a new user met
(torch's schedulers refused the optimizer; clipping took the norm of local shards; pm.eval()
was ignored and an inference plan returned partial outputs; buffers were left out of
checkpoints; another plan's optimizer state loaded; a wrongly shaped or missing tensor loaded
and tied names were dropped; a non-elementwise optimizer stepped shards; a meta-device model
failed with a real batch), DDP's no_sync, and resume through DCP onto the same and another
mesh; clipping across pipeline stages; pm.eval()/pm.train() as model.eval()/model.train()
(dropout, batch norm) under DP, TP and ZeRO; a dropout mask per shard. Frozen parameters in the plan are tests/test_frozen.py's.

Tolerances: fp32 on gloo sums in other orders than one device; losses and gradient norms agree
to about 1e-7 relative, weights after 8 AdamW steps to about 1e-6 (1e-4 asserted, as the issue
asks). A key projection's bias is left out of the weight comparison: its exact gradient is zero
(softmax is invariant to a constant added to every score of a query), what arrives is rounding
noise, and Adam scales noise to full-size steps (tests/dist.py says the same).
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.errors import AutoshardError
from autoshard.solver.baselines import STORED, stored_plan
from autoshard.trace.export import trace
from autoshard.tools.verify import build, plan_for, rel_err
from dist import world_fixture
from loop import (CLIP, LR, WD, micro_batch, parallel, param_groups, pm_step, run_steps, schedule,
                  train_loop, warmup_cosine)
from modes import (BNNet, channel_split_plan, grads_drawn, make, masks_drawn, plan_of, refusals,
                   train_eval_train)

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
TOL = 1e-4

world2 = world_fixture(2, timeout_s=600)
world4 = world_fixture(4, timeout_s=900)


def _plan(model: str, shape: tuple[int, ...], baseline: str | None = None, **kw) -> Plan:
    # A pipelined plan's first axis is its pipeline ("pp"), the next its data parallel one.
    mesh = Mesh(shape, ("pp", "dp")[:len(shape)] if "pipeline" in kw else None, cluster=CLUSTER)
    if baseline in STORED:
        return stored_plan(trace(*build(model, None, None, 0)), mesh, baseline, **kw)
    return plan_for(model, mesh, baseline=baseline, **kw)


def _rel(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _weights_err(full: dict, ref: dict) -> float:
    return max(rel_err(full[n], p) for n, p in ref.items() if not n.endswith("k_proj.bias"))


# -- the loop, 8 steps, against one device -----------------------------------------------------

LOOPS = [(m, shape, baseline, kw) for m in ("llama-tiny", "gpt2-tiny") for shape, baseline, kw in (
    ((4,), "dp", {}),                                          # data parallel
    ((2, 2), "megatron", {}),                                  # weights sharded over 2x2
    ((4,), "dp", dict(zero="zero2", bucket_mb=0.05)),          # ZeRO-2
    ((4,), "fsdp", {}),                                        # ZeRO-3
    ((4,), "dp", dict(offload="optimizer", bucket_mb=0.05)),   # optimizer offload
    ((2, 2), None, dict(pipeline="pp", microbatches=2)))]     # 2 stages, each data parallel


# Each layout on both tiny models with AUTOSHARD_SLOW=1; by default the data-parallel ones (plain,
# ZeRO-2, offload) on GPT only, and FSDP and Megatron on Llama only.
FULL_ONLY = {"test_loop_equals_one_device[llama-tiny-4-dp-]",
             "test_loop_equals_one_device[llama-tiny-4-dp-zero2-0.05]",
             "test_loop_equals_one_device[llama-tiny-4-dp-optimizer-0.05]",
             "test_loop_equals_one_device[gpt2-tiny-4-fsdp-]",
             "test_loop_equals_one_device[gpt2-tiny-2x2-megatron-]",
             # the pipelined loop: Llama's case covers it
             "test_loop_equals_one_device[gpt2-tiny-2x2-None-pp-2]",
             # each layout under eval and train on GPT-2 (dropout 0.1, as Llama's cases)
             "test_eval_and_train_modes_equal_one_device[llama-dp]",
             "test_eval_and_train_modes_equal_one_device[llama-fsdp]",
             "test_eval_and_train_modes_equal_one_device[llama-megatron]",
             # ZeRO-2 under eval and train: the batch-norm model's case covers it
             "test_eval_and_train_modes_equal_one_device[gpt2-dp-zero2-0.05]",
             "test_eval_and_train_modes_equal_one_device[llama-dp-zero2-0.05]",
             # a pipeline's evaluation: 1F1B, InterleavedZeroBubble and DualPipeV cover one
             # stage a rank, two looped with a split backward, and two placed as a V
             "test_a_pipeline_evaluates_forward_only[llama-tiny-GPipe]",
             "test_a_pipeline_evaluates_forward_only[llama-tiny-4l-Interleaved1F1B]",
             "test_a_pipeline_evaluates_forward_only[gpt2-tiny-4l-ZBVZeroBubble]"}


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,baseline,kw", LOOPS,
                         ids=[f"{m}-{'x'.join(map(str, s))}-{b}-{'-'.join(map(str, k.values()))}"
                              for m, s, b, k in LOOPS])
def test_loop_equals_one_device(world4, model, shape, baseline, kw):
    plan = _plan(model, shape, baseline, **kw)
    (losses, norms), full, (ref_losses, ref_norms), ref = world4.run(
        train_loop, model, plan.dumps())[0]
    assert min(ref_norms) > CLIP          # the clip acts on every step
    assert _rel(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert _rel(norms, ref_norms) <= TOL, (norms, ref_norms)
    assert _weights_err(full, ref) <= TOL


@pytest.mark.slow
def test_loop_zeroing_gradients_in_place_equals_one_device(world2):
    """The loop with opt.zero_grad(set_to_none=False), the gradients kept and zeroed in place
    (as recipes that capture CUDA graphs keep them), on a data parallel plan whose synced
    gradients are views of their buckets: what one device gives, as with set_to_none."""
    plan = _plan("gpt2-tiny", (2,), "dp", bucket_mb=0.05)
    (losses, norms), full, (ref_losses, ref_norms), ref = world2.run(
        train_loop, "gpt2-tiny", plan.dumps(), 4, 2, False)[0]
    assert _rel(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert _rel(norms, ref_norms) <= TOL, (norms, ref_norms)
    assert _weights_err(full, ref) <= TOL


GROUPED = [("gpt2-tiny", (2,), "dp", dict(offload="optimizer", bucket_mb=0.05)),  # host step
           ("llama-tiny", (2,), "megatron", {}),                                  # shards
           ("llama-tiny", (2,), None, dict(pipeline="pp", microbatches=2))]       # stages


@pytest.mark.slow
@pytest.mark.parametrize("model,shape,baseline,kw", GROUPED,
                         ids=[f"{m}-{b}-{'-'.join(map(str, k.values()))}"
                              for m, _, b, k in GROUPED])
def test_loop_with_parameter_groups_equals_one_device(world2, model, shape, baseline, kw):
    """nanoGPT's AdamW groups (examples/train.py: no weight decay on biases and norms, here
    also their own learning rate) built from pm.named_parameters(): what one device gives with
    the same groups from the model's. On the host's fused step (its buckets split by group), on
    tensor parallel shards, and on pipeline stages, where a rank lists the other stage's
    parameters but steps its own."""
    plan = _plan(model, shape, baseline, **kw)
    (losses, norms), full, (ref_losses, ref_norms), ref = world2.run(
        train_loop, model, plan.dumps(), steps=6, groups=True)[0]
    assert _rel(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert _rel(norms, ref_norms) <= TOL, (norms, ref_norms)
    assert _weights_err(full, ref) <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("baseline,kw", [("dp", dict(zero="zero2", bucket_mb=0.05)),
                                         ("megatron", {})], ids=["zero2", "megatron"])
def test_nanogpts_loop_backward_through_pm_equals_one_device(world2, baseline, kw):
    """nanoGPT's micro-step, ``loss = pm(*batch); (loss / accum).backward()`` (the loss scaled
    before its backward, which pm.step cannot do), under no_sync, its parameter groups,
    clipping and schedule: what one device gives with the same loop."""
    plan = _plan("gpt2-tiny", (2,), baseline, **kw)
    (losses, norms), full, (ref_losses, ref_norms), ref = world2.run(
        train_loop, "gpt2-tiny", plan.dumps(), steps=4, groups=True, divide=True)[0]
    assert min(ref_norms) > CLIP
    assert _rel(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert _rel(norms, ref_norms) <= TOL, (norms, ref_norms)
    assert _weights_err(full, ref) <= TOL


COMPILED = [("gpt2-tiny", "dp", dict(zero="zero2", bucket_mb=0.05), False),   # no_sync, syncs
            ("llama-tiny", "megatron", {}, True),                             # nanoGPT's step
            ("llama-tiny", None, dict(pipeline="pp", microbatches=2), False)]  # stages


@pytest.mark.slow
@pytest.mark.parametrize("model,baseline,kw,divide", COMPILED,
                         ids=[f"{m}-{b}" for m, b, _, _ in COMPILED])
def test_the_loop_compiled_equals_one_device(world2, model, baseline, kw, divide):
    """The loop (AdamW, schedule, clipping, accumulation) on the compiled rank program
    (``parallelize(..., compile=True)``): ZeRO-2 with its bucketed syncs held by no_sync,
    Megatron shards through nanoGPT's ``(pm(*batch) / accum).backward()``, and pipeline stages:
    what one device gives."""
    plan = _plan(model, (2,), baseline, **kw)
    (losses, norms), full, (ref_losses, ref_norms), ref = world2.run(
        train_loop, model, plan.dumps(), steps=4, divide=divide, compile=True)[0]
    assert min(ref_norms) > CLIP
    assert _rel(losses, ref_losses) <= TOL, (losses, ref_losses)
    assert _rel(norms, ref_norms) <= TOL, (norms, ref_norms)
    assert _weights_err(full, ref) <= TOL


def _group_refusals(plan_json: str) -> dict:
    """Each wrong way to give parameter groups, and loading state saved under other groups;
    groups of the model pm was built from, as of pm's own."""
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    opt = pm.optimizer(torch.optim.AdamW, param_groups(pm.named_parameters()), lr=LR)
    ps = list(pm.parameters())
    groups = param_groups(pm.named_parameters())

    def members(o):         # each group's parameters by name
        name = {id(e.master): e.fqn for e in o.entries}
        return [sorted(name[id(p)] for p in g["params"]) for g in o.param_groups]
    other = pm.optimizer(torch.optim.AdamW, lr=LR)
    again = pm.optimizer(torch.optim.AdamW, param_groups(pm.named_parameters()), lr=LR)
    again.load_state_dict(opt.state_dict())
    return {
        "another model's": _caught(lambda: pm.optimizer(
            torch.optim.AdamW, build("gpt2-tiny", None, None, 0)[0].parameters())),
        "twice": _caught(lambda: pm.optimizer(
            torch.optim.AdamW, [{"params": ps[:1]}, {"params": ps}])),
        "left out": _caught(lambda: pm.optimizer(torch.optim.AdamW, ps[1:])),
        "one tensor": _caught(lambda: pm.optimizer(torch.optim.AdamW, ps[0])),
        "no params key": _caught(lambda: pm.optimizer(
            torch.optim.AdamW, [groups[0], {"lr": 1.0}])),
        "added": _caught(lambda: again.add_param_group({"params": []})),
        "other groups": _caught(lambda: other.load_state_dict(opt.state_dict())),
        "other groups, dcp": _caught(lambda: other.load_sharded_state_dict(
            opt.sharded_state_dict())),
        "hyperparameters": [g["weight_decay"] for g in again.param_groups],
        "named": len(pm.optimizer(torch.optim.AdamW, list(pm.named_parameters())).param_groups),
        "model's": members(pm.optimizer(torch.optim.AdamW,
                                        param_groups(model.named_parameters())))
        == members(again) and len(members(again)[1]) > 0,
    }


@pytest.mark.slow
def test_parameter_groups_given_wrong_are_refused(world2):
    """Every trainable parameter in exactly one group, each a parameter of pm or of the model
    it was built from (recipes build the groups before wrapping), not of another model; groups
    are given when the optimizer is built; state saved under other groups does not load (torch
    pairs state with parameters by position)."""
    plan = _plan("gpt2-tiny", (2,), "dp", zero="zero2", bucket_mb=0.05)
    out = world2.run(_group_refusals, plan.dumps())[0]
    assert "not one of them" in out["another model's"], out
    assert "in groups 0 and 1" in out["twice"], out
    assert "1 in none" in out["left out"], out
    assert "got Parameter" in out["one tensor"] or "got DTensor" in out["one tensor"], out
    assert "'params' list" in out["no params key"], out
    assert "add_param_group" in out["added"], out
    assert "parameter group" in out["other groups"], out
    assert "param_groups.1." in out["other groups, dcp"], out
    assert out["hyperparameters"] == [0.1, 0.0] and out["named"] == 1 and out["model's"], out


# -- the red-team log, one test per failure ----------------------------------------------------

def _schedulers(plan_json: str) -> dict:
    """Each scheduler on pm.optimizer sets the learning rate the wrapped step reads, as on a
    plain torch optimizer, and its state dict round-trips."""
    S = torch.optim.lr_scheduler
    makers = {
        "LambdaLR": lambda o: S.LambdaLR(o, warmup_cosine(2, 8)),
        "StepLR": lambda o: S.StepLR(o, step_size=2, gamma=0.5),
        "CosineAnnealingLR": lambda o: S.CosineAnnealingLR(o, T_max=8),
        "OneCycleLR": lambda o: S.OneCycleLR(o, max_lr=1e-2, total_steps=8),
        "SequentialLR": lambda o: S.SequentialLR(
            o, [S.LinearLR(o, 0.1, total_iters=2), S.CosineAnnealingLR(o, T_max=6)],
            milestones=[2])}
    pm, _, inputs = parallel("mlp-tiny", plan_json)
    out = {}
    for name, make_sched in makers.items():
        opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
        posts = []
        opt.register_step_post_hook(lambda *_: posts.append(1))
        ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
        sched, ref_sched = make_sched(opt), make_sched(ref_opt)
        lrs, ref_lrs = [], []
        for s in range(4):
            pm.step(*pm.shard_inputs(*micro_batch(inputs, s, 0)))
            opt.step()
            sched.step()
            opt.zero_grad()
            ref_opt.step()
            ref_sched.step()
            lrs.append(opt.optimizer.param_groups[0]["lr"])      # what the wrapped step reads
            ref_lrs.append(ref_opt.param_groups[0]["lr"])
        again = pm.optimizer(torch.optim.AdamW, lr=1e-3)
        resumed = make_sched(again)
        again.load_state_dict(opt.state_dict())
        resumed.load_state_dict(sched.state_dict())
        sched.step()
        resumed.step()
        out[name] = (lrs == ref_lrs, len(posts) == 4,
                     resumed.get_last_lr() == sched.get_last_lr() == [
                         again.optimizer.param_groups[0]["lr"]])
    return out


def test_torch_schedulers_step_pm_optimizer(world2):
    """Why: "LambdaLR(pm.optimizer(...)) raises TypeError: ShardedOptimizer is not an
    Optimizer"; so did every scheduler. Under ZeRO-2, so the optimizer steps state shards."""
    plan = _plan("mlp-tiny", (2,), "dp", zero="zero2", bucket_mb=0.05)
    assert plan.param_state
    out = world2.run(_schedulers, plan.dumps())[0]
    assert out == {k: (True, True, True) for k in out} and len(out) == 5, out


def _clipping(plan_json: str, model: str) -> dict:
    """torch's clip_grad_norm_ / get_total_norm / clip_grad_value_ over pm.parameters() against
    the same on one device, after one step; the clipped gradients too."""
    from autoshard.loss import as_loss_module
    pm, _, inputs = parallel(model, plan_json)
    ref = as_loss_module(build(model, None, None, 0)[0])
    batch = micro_batch(inputs, 0, 0)
    pm.step(*pm.shard_inputs(*batch))
    ref(*batch).backward()
    clip = torch.nn.utils
    total = clip.get_total_norm([p.grad for p in pm.parameters()]).full_tensor()
    norm = clip.clip_grad_norm_(pm.parameters(), CLIP).full_tensor()
    want = clip.clip_grad_norm_(ref.parameters(), CLIP)
    named = {n.removeprefix("model."): p for n, p in ref.named_parameters()}
    clipped = max(rel_err(g, named[n].grad) for n, g in pm.full_grads().items())
    clip.clip_grad_value_(pm.parameters(), 1e-3)
    clip.clip_grad_value_(ref.parameters(), 1e-3)
    return {"total": float(total), "norm": float(norm), "want": float(want),
            "sharded": sum(any(not p.is_replicate() for p in v.placements)
                           for v in pm.parameters()),
            "clipped_norm": clipped,
            "clipped_value": max(rel_err(g, named[n].grad) for n, g in pm.full_grads().items())}


@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_torch_clipping_returns_one_devices_norm(world2, model):
    """Why: "clip_grad_norm_(pm.parameters(), 0.5) on llama-tiny over 2x2 with sharded weights
    returns 0.41 where one device's norm is 1.06". Megatron over 2 ranks shards the weights."""
    plan = _plan(model, (2,), "megatron")
    out = world2.run(_clipping, plan.dumps(), model)
    for r in out:
        assert r["sharded"] > 0
        assert abs(r["total"] - r["want"]) <= TOL * r["want"], r
        assert abs(r["norm"] - r["want"]) <= TOL * r["want"], r
        # (clip_grad_value_'s gradients are at most 1e-3, the floor of rel_err: the rounding of
        # gradients of order 1 shows at about 1e-5 of that)
        assert r["clipped_norm"] <= 1e-5 and r["clipped_value"] <= 1e-4, r


def _stage_clipping(plan_json: str, model: str) -> dict:
    """The clipping checks on a pipeline, and a view's gather refused (not wrong rows)."""
    out = _clipping(plan_json, model)
    pm, _, _ = parallel(model, plan_json)
    names = [n for n, _ in pm.named_parameters()]
    out["names"] = names == [n.removeprefix("model.") for n, _ in
                             build(model, None, None, 0)[0].named_parameters()]
    out["gather"] = _caught(lambda: next(iter(pm.parameters())).full_tensor())
    return out


@pytest.mark.parametrize("model", ["llama-tiny", "gpt2-tiny"])
def test_torch_clipping_spans_pipeline_stages(world2, model):
    """Why (issue 29, "the norm over every stage"): on a 2-stage pipeline torch's
    clip_grad_norm_ over pm.parameters() returned each stage's own norm (0.807 and 0.759 on
    llama-tiny where one device's is 1.108). Every rank now lists every parameter, another
    stage's with no rows, so DTensor's norm reduces over the pipeline axis too."""
    plan = _plan(model, (2,), pipeline="pp", microbatches=2)
    for r in world2.run(_stage_clipping, plan.dumps(), model):
        assert r["names"], r
        assert abs(r["total"] - r["want"]) <= TOL * r["want"], r
        assert abs(r["norm"] - r["want"]) <= TOL * r["want"], r
        assert r["clipped_norm"] <= 1e-5 and r["clipped_value"] <= 1e-4, r
        assert "pm.full_state_dict()" in r["gather"], r


def _caught(fn) -> str:
    try:
        fn()
    except AutoshardError as e:
        return str(e)
    return "accepted"


def _other_layouts(zero_json: str, tp_json: str) -> dict:
    """Optimizer state saved under one plan offered to another plan's optimizer."""
    out = {}
    pms = {k: parallel("gpt2-tiny", j) for k, j in (("zero2", zero_json), ("megatron", tp_json))}
    for k, (pm, opt, inputs) in pms.items():
        pm.step(*pm.shard_inputs(*inputs))
        opt.step()
    for a, b in (("zero2", "megatron"), ("megatron", "zero2")):
        sd = pms[a][1].state_dict()
        out[f"{a}->{b}"] = _caught(lambda: pms[b][1].load_state_dict(sd))
        out[f"{a}->{a}"] = _caught(lambda: pms[a][1].load_state_dict(sd))
    inner = pms["zero2"][1].optimizer.state_dict()          # a plain torch state dict
    out["plain"] = _caught(lambda: pms["zero2"][1].load_state_dict(inner))
    return out


def test_another_plans_optimizer_state_is_refused(world2):
    """Why: "ZeRO-2 state into a Megatron plan's optimizer killed both ranks with SIGSEGV in
    fused Adam; the other way loads silently and the next step is off by up to 29%"."""
    zero = _plan("gpt2-tiny", (2,), "dp", zero="zero2", bucket_mb=0.05)
    tp = _plan("gpt2-tiny", (2,), "megatron")
    for out in world2.run(_other_layouts, zero.dumps(), tp.dumps()):
        assert out["zero2->zero2"] == out["megatron->megatron"] == "accepted", out
        for k in ("zero2->megatron", "megatron->zero2"):
            assert "laid out as this optimizer keeps" in out[k] and "sharded_state_dict" in out[k]
        assert "records the layout" in out["plain"]


def _whole_tensor_optimizers(plans: dict) -> dict:
    out = {}
    for k, j in plans.items():
        pm, _, inputs = parallel("mlp-tiny", j)
        out[k] = _caught(lambda: pm.optimizer(torch.optim.Adafactor, lr=1e-2))
        if k == "dp":         # replicated: it steps, as on one device
            opt = pm.optimizer(torch.optim.Adafactor, lr=1e-2)
            pm.step(*pm.shard_inputs(*inputs))
            opt.step()
        out[k + "-declared"] = _caught(
            lambda: pm.optimizer(torch.optim.Adafactor, lr=1e-2, elementwise=True))
    return out


def test_non_elementwise_optimizer_is_refused_on_shards(world2):
    """Why: "pm.optimizer(torch.optim.Adafactor) computes its factored statistics per shard:
    off by 1.9e-2 after 3 steps under TP and ZeRO-2". Replicated it runs."""
    plans = {"dp": _plan("mlp-tiny", (2,), "dp", zero="none"),
             "fsdp": _plan("mlp-tiny", (2,), "fsdp"),
             "zero2": _plan("mlp-tiny", (2,), "dp", zero="zero2", bucket_mb=0.05)}
    out = world2.run(_whole_tensor_optimizers, {k: p.dumps() for k, p in plans.items()})[0]
    assert out["dp"] == out["dp-declared"] == "accepted", out
    for k in ("fsdp", "zero2"):
        assert "Adafactor" in out[k] and "per shard" in out[k] and "elementwise=True" in out[k]
        assert out[k + "-declared"] == "accepted"


def _state_checks(plan_json: str) -> dict:
    from autoshard.tools.verify import build
    pm, _, _ = parallel("hf-gpt2-tiny", plan_json)
    model = build("hf-gpt2-tiny", None, None, 0)[0]
    full = pm.full_state_dict()
    out = {"keys": set(full) == set(model.state_dict())}
    fresh = build("hf-gpt2-tiny", None, None, 1)[0]
    fresh.load_state_dict(full, strict=True)
    out["strict"] = all(torch.equal(v, full[k]) for k, v in fresh.state_dict().items())
    name = next(k for k, v in full.items() if v.dim() == 1 and v.numel() > 1)
    out["shape"] = _caught(lambda: pm.load_full_state_dict({**full, name: torch.zeros(1)}))
    out["missing"] = _caught(lambda: pm.load_full_state_dict(
        {k: v for k, v in full.items() if k != name}))
    out["name"] = name
    out["unchanged"] = all(torch.equal(v, full[k]) for k, v in pm.full_state_dict().items())
    # a fused projection's strided shards: torch's state_dict() refuses as DCP's does
    out["strided"] = _caught(pm.state_dict)
    return out


def _module_api(plan_json: str) -> dict:
    """torch's Module API on a ParallelModule: state dicts, and pm.to(...) and the like."""
    from torch.distributed.tensor import DTensor
    pm, _, _ = parallel("llama-tiny", plan_json)
    full = pm.full_state_dict()
    sd = pm.state_dict()
    name = next(iter(sd))
    out = {"keys": set(sd) == set(full), "dtensors": all(isinstance(v, DTensor)
                                                          for v in sd.values()),
           "loads": [_caught(lambda: pm.load_state_dict(sd)),
                     _caught(lambda: pm.load_state_dict(full))],
           "loose": _caught(lambda: pm.load_state_dict(full, strict=False)),
           "mixed": _caught(lambda: pm.load_state_dict({**full, name: sd[name]})),
           "to": [_caught(lambda: pm.to("cpu")), _caught(lambda: pm.float()),
                  _caught(lambda: pm.to(torch.float64)), _caught(lambda: pm.half())]}
    out["unchanged"] = all(torch.equal(v, full[k]) for k, v in pm.full_state_dict().items())
    out["fp32"] = all(p.dtype == torch.float32 for p in pm.local_parameters().values())
    return out


def test_full_state_dict_names_tied_aliases_and_loads_check_shapes(world2):
    """Why: "load_full_state_dict broadcasts a (1,) tensor into a (32,) weight without a word
    ... For a tied embedding, full_state_dict() drops the alias key, so a strict
    load_state_dict of it fails"."""
    plan = _plan("hf-gpt2-tiny", (2,), "megatron")
    out = world2.run(_state_checks, plan.dumps())[0]
    assert out["keys"] and out["strict"] and out["unchanged"], out
    assert out["name"] in out["shape"] and "(1,)" in out["shape"], out
    assert out["name"] in out["missing"], out
    assert "full_state_dict" in out["strided"], out


def test_torch_module_api_reads_and_loads_the_shards(world2):
    """pm.state_dict() is the sharded state dict under the model's names (each value a DTensor,
    as FSDP2 gives it; DCP saves it as it is: test_checkpoints_carry_buffers), and
    pm.load_state_dict() loads it or a whole one, strictly. pm.to(...), .float() and the like
    pass where they change nothing and are refused where they would move or cast a shard,
    which the optimizer and the gradient buckets hold views of."""
    out = world2.run(_module_api, _plan("llama-tiny", (2,), "megatron").dumps())[0]
    assert out["keys"] and out["dtensors"] and out["loads"] == ["accepted"] * 2, out
    assert "strict=False" in out["loose"] and "both kinds" in out["mixed"], out
    assert out["to"][:2] == ["accepted"] * 2, out
    assert "torch.float64" in out["to"][2] and "torch.float16" in out["to"][3], out
    assert out["unchanged"] and out["fp32"], out


# -- checkpoints: buffers, and resume through DCP -----------------------------------------------

BN_INPUTS = (torch.randn(8, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(8, 1))


def _bn_plan() -> Plan:
    from autoshard.solver.planner import plan
    with warnings.catch_warnings():       # batch_norm has no rule: replicated, said once
        warnings.filterwarnings("ignore", message=".*batch_norm")
        return plan(BNNet(), BN_INPUTS, Mesh((2,), cluster=CLUSTER))


def _buffers_through_dcp(plan_json: str, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    pms = [parallelize(BNNet(), Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                       example_inputs=BN_INPUTS) for _ in range(2)]
    full = pms[0].full_state_dict()
    full["bn.running_mean"] = torch.arange(16.0)
    full["bn.running_var"] = torch.arange(16.0) + 1
    full["bn.num_batches_tracked"] = torch.tensor(7)
    pms[0].load_full_state_dict(full)
    dcp.save(pms[0].state_dict(), checkpoint_id=path)      # (the sharded state dict)
    sd = pms[1].state_dict()
    dcp.load(sd, checkpoint_id=path)
    pms[1].load_state_dict(sd)
    return all(torch.equal(v, full[k]) for k, v in pms[1].full_state_dict().items())


def test_checkpoints_carry_buffers(world2, tmp_path):
    """Why: "pm.sharded_state_dict() holds parameters only: a DCP resume silently resets
    BatchNorm's running statistics (and any buffer)"."""
    p = _bn_plan()
    assert world2.run(_buffers_through_dcp, p.dumps(), str(tmp_path / "ckpt")) == [True, True]


def _resume(model: str, first: str, then: dict, path: str) -> dict:
    """8 steps under ``first``; 4 steps, a DCP checkpoint of the whole training state (model,
    optimizer, scheduler, step), and each plan of ``then`` built afresh from another seed,
    loaded and run for the last 4: the largest difference of any weight from the 8-step run."""
    import torch.distributed.checkpoint as dcp
    pm, opt, inputs = parallel(model, first)
    run_steps(opt, schedule(opt), pm_step(pm), pm.parameters, inputs, range(8), 2)
    want = pm.full_state_dict()
    pm, opt, inputs = parallel(model, first)
    sched = schedule(opt)
    run_steps(opt, sched, pm_step(pm), pm.parameters, inputs, range(4), 2)
    dcp.save({"model": pm.sharded_state_dict(), "optim": opt.sharded_state_dict(),
              "sched": sched.state_dict(), "step": 4}, checkpoint_id=path)
    out = {}
    for name, plan_json in then.items():
        pm, opt, inputs = parallel(model, plan_json, seed=1)
        sched = schedule(opt)
        state = {"model": pm.sharded_state_dict(), "optim": opt.sharded_state_dict(),
                 "sched": sched.state_dict(), "step": 0}
        dcp.load(state, checkpoint_id=path)
        pm.load_sharded_state_dict(state["model"])
        opt.load_sharded_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        run_steps(opt, sched, pm_step(pm), pm.parameters, inputs, range(state["step"], 8), 2)
        got = pm.full_state_dict()
        out[name] = _weights_err(got, want)
    return out


@pytest.mark.slow
def test_resume_through_dcp_onto_the_same_and_another_mesh(world2, tmp_path):
    """4 steps, a checkpoint, 4 more from it equal 8 straight: under the same ZeRO-2 plan and
    under tensor parallelism (another layout of every weight and of the optimizer state)."""
    zero = _plan("gpt2-tiny", (2,), "dp", zero="zero2", bucket_mb=0.05)
    tp = _plan("gpt2-tiny", (2,), "megatron")
    for out in world2.run(_resume, "gpt2-tiny", zero.dumps(),
                          {"same": zero.dumps(), "other": tp.dumps()}, str(tmp_path / "ckpt")):
        assert out["same"] <= 1e-6 and out["other"] <= TOL, out


def _resume_rank(model: str, plan_json: str) -> float:
    """8 steps; then 4, the full weights and this rank's optimizer and scheduler state dicts
    saved, a ParallelModule built afresh from another seed, loaded from them and run for the
    last 4: the largest difference of any weight from the 8-step run (under nanoGPT's parameter
    groups, tests/loop.py)."""
    import copy
    pm, opt, inputs = parallel(model, plan_json, groups=True)
    run_steps(opt, schedule(opt), pm_step(pm), pm.parameters, inputs, range(8), 2)
    want = pm.full_state_dict()
    pm, opt, inputs = parallel(model, plan_json, groups=True)
    sched = schedule(opt)
    run_steps(opt, sched, pm_step(pm), pm.parameters, inputs, range(4), 2)
    saved = copy.deepcopy({"model": pm.full_state_dict(), "optim": opt.state_dict(),
                           "sched": sched.state_dict()})
    pm, opt, inputs = parallel(model, plan_json, seed=1, groups=True)
    sched = schedule(opt)
    pm.load_full_state_dict(saved["model"])
    opt.load_state_dict(saved["optim"])
    sched.load_state_dict(saved["sched"])
    run_steps(opt, sched, pm_step(pm), pm.parameters, inputs, range(4, 8), 2)
    return _weights_err(pm.full_state_dict(), want)


@pytest.mark.slow
def test_resume_from_each_ranks_state_dict_under_offload(world2):
    """Why: after ``opt.load_state_dict``, which builds new parameter groups, the host's fused
    step went on reading the groups it was built with, so the learning rate the scheduler set
    from then on never reached the offloaded parameters. 4 steps, a per-rank checkpoint, 4
    more equal 8 straight."""
    plan = _plan("gpt2-tiny", (2,), "dp", offload="optimizer", bucket_mb=0.05)
    assert max(world2.run(_resume_rank, "gpt2-tiny", plan.dumps())) <= 1e-6


def _pipeline_evaluation(model: str, plan_json: str) -> dict:
    """Two training steps, each with an evaluation of a held-out batch under torch.no_grad()
    between backward and the optimizer's step, and one after; the same on one device."""
    from autoshard.loss import as_loss_module
    pm, opt, inputs = parallel(model, plan_json)
    ref = as_loss_module(build(model, None, None, 0)[0])
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    held_out = micro_batch(inputs, 99, 0)
    out = {"refused": _caught(lambda: pm(*pm.shard_inputs(*held_out))),
           "loss": [], "ref": []}

    def evaluate():
        with torch.no_grad():
            out["loss"].append(float(pm(*pm.shard_inputs(*held_out))))
            out["ref"].append(float(ref(*held_out)))
    for s in range(2):
        batch = micro_batch(inputs, s, 0)
        out["loss"].append(float(pm.step(*pm.shard_inputs(*batch))))
        loss = ref(*batch)
        loss.backward()
        out["ref"].append(float(loss))
        evaluate()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    evaluate()
    out["weights"] = _weights_err(pm.full_state_dict(), {
        n.removeprefix("model."): p.detach() for n, p in ref.named_parameters()})
    return out


EVALUATED = [("llama-tiny", "1F1B", 2), ("llama-tiny", "GPipe", 2),
             ("llama-tiny-4l", "Interleaved1F1B", 4), ("llama-tiny-4l", "InterleavedZeroBubble", 4),
             ("gpt2-tiny-4l", "ZBVZeroBubble", 2), ("gpt2-tiny-4l", "DualPipeV", 4)]


@pytest.mark.slow
@pytest.mark.parametrize("model,schedule,m", EVALUATED,
                         ids=[f"{m}-{s}" for m, s, _ in EVALUATED])
def test_a_pipeline_evaluates_forward_only(world2, model, schedule, m):
    """Why: examples/train.py's own pipelined run (--pipeline pp) failed at its first
    evaluation: pm(...) was refused on a pipeline. It now runs the schedule's forwards alone
    (torch's schedule.eval) and returns the held-out loss one device gives, between backward
    and the optimizer's step too, leaving the gradients and the training that follows as one
    device's; with gradients on in training mode it says how to train instead."""
    plan = _plan(model, (2,), None, pipeline="pp", schedule=schedule, microbatches=m)
    for out in world2.run(_pipeline_evaluation, model, plan.dumps()):
        assert "only to evaluate" in out["refused"], out
        assert _rel(out["loss"], out["ref"]) <= TOL and out["weights"] <= TOL, out


# -- accumulation without sync -----------------------------------------------------------------

def _no_sync(plan_json: str) -> dict:
    from autoshard.loss import as_loss_module
    pm, opt, inputs = parallel("gpt2-tiny", plan_json)
    ref = as_loss_module(build("gpt2-tiny", None, None, 0)[0])
    syncs = []
    with pm.no_sync():
        pm.step(*pm.shard_inputs(*micro_batch(inputs, 0, 0)))
        syncs.append(sum(r.phase == "grad_sync" for r in pm.ledger.records))
        refused = _caught(opt.step)
    pm.step(*pm.shard_inputs(*micro_batch(inputs, 0, 1)))
    syncs.append(sum(r.phase == "grad_sync" for r in pm.ledger.records))
    for m in range(2):
        ref(*micro_batch(inputs, 0, m)).backward()
    named = {n.removeprefix("model."): p.grad for n, p in ref.named_parameters()}
    err = max(rel_err(g, named[n]) for n, g in pm.full_grads().items())
    buckets = len({b.name for b in pm.runtime.buckets.buckets})
    return {"syncs": syncs, "buckets": buckets, "err": err, "refused": refused}


def test_no_sync_defers_the_gradient_sync_to_the_last_micro_step(world2):
    """DDP's ``no_sync``: no gradient sync in the first micro-step, one per bucket in the last,
    the gradients those of both micro-batches; stepping while they are held is refused."""
    plan = _plan("gpt2-tiny", (2,), "dp", zero="zero2", bucket_mb=0.05)
    for out in world2.run(_no_sync, plan.dumps()):
        assert out["syncs"][0] == 0 and out["syncs"][1] >= out["buckets"] > 1, out
        assert out["err"] <= 1e-5, out
        assert "no_sync" in out["refused"], out


# -- a model on the meta device, planned and built with the real batch ---------------------------

def _meta_with_real_batch(plan_json: str) -> float:
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    plan = Plan.loads(plan_json)
    real, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(build("gpt2-tiny", None, None, 0)[0].to("meta"),
                     Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, example_inputs=inputs,
                     init="empty")
    pm.load_full_state_dict(real.state_dict())
    got = pm.step(*pm.shard_inputs(*inputs))
    want = as_loss_module(real)(*inputs)
    return abs(float(got) - float(want)) / abs(float(want))


def test_meta_model_with_a_real_batch(world2):
    """Why: "a model built on the meta device planned or parallelized with the real batch fails
    with 'a model that torch.export can capture ... make forward traceable'"."""
    from autoshard.solver.planner import plan
    real, inputs = build("gpt2-tiny", None, None, 0)
    p = plan(real.to("meta"), inputs, Mesh((2,), cluster=CLUSTER))
    assert max(world2.run(_meta_with_real_batch, p.dumps())) <= 1e-6


# -- modes and inference outputs ----------------------------------------------------------------

def _modes(bn_json: str, infer_json: str) -> dict:
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    bn, infer = Plan.loads(bn_json), Plan.loads(infer_json)
    pm = parallelize(BNNet(), Mesh(bn.mesh_shape, bn.mesh_axes), plan=bn, example_inputs=BN_INPUTS)
    out = {"bn_eval": _caught(pm.eval)}
    real, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(real, Mesh(infer.mesh_shape, infer.mesh_axes), plan=infer,
                     example_inputs=inputs)
    out["plain_eval"] = _caught(pm.eval)
    with torch.no_grad():
        got = pm(*pm.shard_inputs(*inputs))
        want = as_loss_module(real)(*inputs)
    out["output"] = abs(float(got) - float(want)) / abs(float(want))
    out["step"] = _caught(lambda: pm.step(*pm.shard_inputs(*inputs)))
    return out


def test_modes_and_inference_outputs(world2):
    """Why: "pm.eval() is ignored: dropout stays on, BatchNorm uses and overwrites batch
    statistics ... A training=False plan's pm(...) returns per-rank partial values (2.073 and
    2.069 where the loss is 4.142) ...; stepping it fails with an internal assertion". eval()
    is accepted, with batch norm or without (tests/test_modes.py holds the numbers: eval losses
    and running statistics against model.eval()); an inference plan's output is whole;
    stepping it says why not."""
    from autoshard.solver.planner import plan
    bn = _bn_plan()
    model, inputs = build("gpt2-tiny", None, None, 0)
    infer = plan(model, inputs, Mesh((2,), cluster=CLUSTER), training=False)
    for out in world2.run(_modes, bn.dumps(), infer.dumps()):
        assert out["bn_eval"] == "accepted", out
        assert out["plain_eval"] == "accepted" and out["output"] <= 1e-6, out
        assert "inference plan" in out["step"], out


# -- modes as model.eval() / model.train(), and dropout masks per shard ---------------------------

MODES = [(kind, baseline, kw) for kind in ("gpt2", "llama", "bn") for baseline, kw in (
    ("dp", {}), ("megatron", {}), ("dp", dict(zero="zero2", bucket_mb=0.05)), ("fsdp", {}))
    if not (kind == "bn" and baseline == "megatron")] + [
    ("gpt2", "dp", dict(recompute="full")), ("resnet", "dp", {}),
    ("conv", "dp", dict(recompute="full")), ("droppath", "dp", dict(recompute="full")),
    ("droppath", "fsdp", {})]


@pytest.mark.parametrize("kind,baseline,kw", MODES,
                         ids=[f"{k}-{b}{''.join('-' + str(v) for v in kw.values())}"
                              for k, b, kw in MODES])
def test_eval_and_train_modes_equal_one_device(world2, kind, baseline, kw):
    """Why: "pm.eval() is ignored: dropout stays on, BatchNorm uses and overwrites batch
    statistics (eval losses 0.913/0.788/0.795 against eager's 0.739)"; then eval was refused.
    HF GPT-2 and Llama with dropout 0.1 and a batch-norm model under DP, TP and ZeRO-2/3 (and
    HF's ResNet, and a CNN whose checkpointed blocks hold batch norms: their running statistics
    updated once a step, not again in recompute, their batch synced across the ranks; and
    stochastic depth, HF's and timm's, which no flag turns off: its masks filled with their
    means in eval mode): a training step, two evaluations, a training step, against one device.
    Eval losses are model.eval()'s, evaluation leaves the running statistics alone, training
    afterwards equals one device again (dropout draws made keep-all, uniform draws fixed
    values, on both sides by verify's dispatch mode, as a rank draws its own masks)."""
    plan = plan_of(kind, (2,), baseline, **kw)
    for out in world2.run(train_eval_train, kind, plan.dumps()):
        _as_one_device(out, kind)


def _as_one_device(out: dict, kind: str) -> None:
    assert out["modes"] == (False, False), out
    eval_err = max(abs(a - b) / abs(b) for a, b in zip(out["loss"][1:3], out["ref"][1:3]))
    assert eval_err <= 1e-5, out
    train_err = max(abs(a - b) / abs(b) for a, b in zip(out["loss"][::3], out["ref"][::3]))
    assert train_err <= 1e-5, out
    assert out["grad_err"] <= 1e-5, out
    assert out["eval_kept_buffers"] and out["buffer_err"] <= 1e-6, out
    assert out["has_buffers"] == (kind in ("bn", "resnet", "conv")), out


def test_channel_split_batch_norm_trains_and_evaluates_as_one_device(world2):
    """Why: a batch norm could split its channels only in eval mode, as its running statistics
    were buffers every rank held whole, and a reshard's copy would have taken the update. The
    statistics are stored split now: each rank normalises its own channels with no collective
    and updates their statistics; training, evaluation and training again equal one device,
    the running statistics included."""
    from autoshard.ir import Shard
    plan = channel_split_plan("conv", (2,))
    norms = [s for n, s in plan.strategies().items() if n.startswith("batch_norm")]
    assert len(norms) == 2 and all(
        s.inputs[0] == (Shard(1),) and s.inputs[3:] == ((Shard(0),),) * 2 and s.kernel is None
        for s in norms), norms
    for out in world2.run(train_eval_train, "conv", plan.dumps()):
        _as_one_device(out, "conv")


def test_split_dropout_draws_a_mask_per_shard_and_replicas_agree(world2):
    """Why: "Sharded dropout draws the same mask on every shard when ranks are seeded alike".
    Data parallel, ranks seeded alike: the two dropouts over the batch's rows are split (a mask
    per shard), the one on the replicated gain is not (the same mask on both replicas)."""
    plan = plan_of("mlp", (2,), "dp")
    a, b = world2.run(masks_drawn, "mlp", plan.dumps())
    assert a["split"] == b["split"] and sorted(a["split"]) == [False, True, True], a["split"]
    assert len(a["masks"]) == len(b["masks"]) == 3
    for split, x, y in zip(a["split"], a["masks"], b["masks"]):
        assert (x != y) if split else (x == y)
    assert math.isfinite(a["loss"]) and a["loss"] == b["loss"]


def test_sequence_parallel_dropouts_are_seeded_per_shard(world2):
    """Megatron with sequence parallelism on HF GPT-2 with dropout: every dropout (attention's
    over the heads, the residual ones over the sequence) is split, each shard's mask its own."""
    plan = plan_of("gpt2", (2,), "megatron")
    a, b = world2.run(masks_drawn, "gpt2", plan.dumps())
    assert a["split"] == b["split"] and all(a["split"]), a["split"]
    assert a["masks"] and all(x != y for x, y in zip(a["masks"], b["masks"]))
    assert math.isfinite(a["loss"]) and a["loss"] == b["loss"]


def test_recomputed_layers_draw_the_forwards_masks(world2):
    """A checkpointed layer's dropout, seeded per shard, draws in recompute the masks its
    forward drew (the seed comes from the default generator, which checkpointing restores):
    the gradients equal those of the same plan without recompute, real masks on both."""
    full = plan_of("gpt2", (2,), "dp", recompute="full")
    plain = plan_of("gpt2", (2,), "dp")
    assert full.recompute and not plain.recompute
    a, seeded = world2.run(grads_drawn, "gpt2", full.dumps())[0]
    b, seeded_plain = world2.run(grads_drawn, "gpt2", plain.dumps())[0]
    assert seeded == seeded_plain > 0            # the layers' own dropouts are seeded too
    assert max(rel_err(a[n], g) for n, g in b.items()) <= 1e-6


@pytest.mark.slow
def test_a_pipeline_in_eval_mode_equals_one_device(world2):
    """Why: pm.eval() was refused on a pipeline whose program has dropout (its stages were cut
    from the program traced in training mode), and pm(...) on any pipeline. Each stage now
    runs its program's eval-mode copy: HF GPT-2 with dropout 0.1 on 2 stages, a training step,
    two evaluations, a training step, against one device (as the unpipelined layouts'
    test_eval_and_train_modes_equal_one_device)."""
    from autoshard.solver.planner import plan
    model, inputs = make("gpt2")
    two = plan(model, inputs, Mesh((2,), ("pp",), cluster=CLUSTER), pipeline="pp",
               microbatches=2)
    for out in world2.run(train_eval_train, "gpt2", two.dumps()):
        assert out["modes"] == (False, False), out
        assert _rel(out["loss"], out["ref"]) <= 1e-5, out
        assert out["grad_err"] <= 1e-5, out
    for out in world2.run(refusals, "gpt2", two.dumps()):
        assert out == {"eval": "accepted", "parameters": "accepted"}, out


def test_a_weight_tied_across_some_pipeline_ranks_refuses_clipping(world4):
    """A weight tied across some pipeline ranks but not all (GPT-2's embedding and head on the
    first and last of 4 stages) would be clipped unequally: pm.parameters() refuses it, naming
    it, where torch's clip_grad_norm_ would go wrong."""
    four = _plan("gpt2-tiny-4l", (4,), pipeline="pp", microbatches=4)
    assert len(four.pipeline.stages) == 4
    for out in world4.run(_parameters_of, "gpt2-tiny-4l", four.dumps()):
        assert "tok_emb.weight" in out and "[0, 3]" in out, out


def _parameters_of(model: str, plan_json: str) -> str:
    pm, _, _ = parallel(model, plan_json)
    return _caught(lambda: list(pm.parameters()))
