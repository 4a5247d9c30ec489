"""torch.distributed.checkpoint (DCP) of pm.optimizer's state (codegen/optimstate.py,
``ShardedOptimizer.sharded_state_dict``).

The layout first: for every parameter spec and optimizer-state spec ``_cut`` accepts, the DTensor
placements ``_placements`` gives say exactly which part of the global tensor a rank holds (the
offsets DCP computes from them, torch.distributed.tensor._utils, equal the slice ``_cut`` takes).
Then on gloo: gpt2-tiny planned with ZeRO-2, ZeRO-1 (beside tensor parallelism, two zero axes
cutting one dim), optimizer offload and parameter offload on 4 ranks takes 2 AdamW steps and is
saved with DCP; on 2 ranks, under another plan, it is loaded: the full optimizer state equals the
saved one, and one more step gives the parameters single-device AdamW has after 3 steps.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.codegen.optim import _cut, _placements, _slice
from autoshard.ir import Replicate, Shard
from autoshard.ops.simulate import shard_tensor
from autoshard.tools.verify import build, plan_for
from dist import world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
# AdamW moves an element by about lr whatever its gradient: an element whose gradient is small
# and so noisy in the last bits (summed in another order than on one device) moves up to lr
# times its relative noise apart. At 1e-4 the worst of them stays 10x inside 1e-6, while any
# state lost or misplaced in the load moves elements by about lr.
LR, WD = 1e-4, 0.1
R = Replicate()

world2 = world_fixture(2, timeout_s=300)
world4 = world_fixture(4, timeout_s=300)


# -- the layout: DTensor placements against _cut ------------------------------------------------

def _layouts(ndim: int):
    """Every (parameter spec, state spec) of a 2-d tensor on ``ndim`` mesh axes that _cut
    accepts: each axis keeps the parameter's placement or, where the parameter is replicated,
    cuts the one state dim."""
    for spec in itertools.product([R, Shard(0), Shard(1)], repeat=ndim):
        for dim in (0, 1):
            free = [a for a, p in enumerate(spec) if p == R]
            for k in range(len(free) + 1):
                for zero in itertools.combinations(free, k):
                    yield spec, tuple(Shard(dim) if a in zero else p for a, p in enumerate(spec))


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2), (2, 3), (3, 2), (2, 2, 2)])
def test_placements_say_what_cut_holds(mesh_shape):
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    n = 1
    for s in mesh_shape:
        n *= s
    shape = (2 * n * n, n * n)           # every dim splits over every set of axes
    full = torch.arange(shape[0] * shape[1]).reshape(shape)
    strided = plain = 0
    for spec, state in _layouts(len(mesh_shape)):
        placements = _placements(spec, state, mesh_shape)
        if any(isinstance(p, _StridedShard) for p in placements):
            strided += 1
        else:
            plain += 1
        for coords in itertools.product(*(range(s) for s in mesh_shape)):
            local = shard_tensor(full, spec, mesh_shape, coords)
            if state != spec:
                dim, cut = _cut(spec, state, mesh_shape, coords)
                local = _slice(local, dim, cut)
            size, offset = _compute_local_shape_and_global_offset(shape, mesh_shape,
                                                                  list(coords), placements)
            want = full[offset[0]:offset[0] + size[0], offset[1]:offset[1] + size[1]]
            assert torch.equal(local, want), (spec, state, coords, placements)
    assert plain and (strided or len(mesh_shape) == 1)


def test_the_planners_layouts_are_plain_shards():
    """The planner cuts state along a dim no parameter axis cuts (cost/state.py state_spec): the
    order _cut slices in is DTensor's, no _StridedShard needed."""
    from torch.distributed.tensor import Replicate as DR, Shard as DS
    assert _placements((R, R), (Shard(0), Shard(0)), (2, 2)) == (DS(0), DS(0))
    assert _placements((R, Shard(0)), (Shard(1), Shard(0)), (2, 2)) == (DS(1), DS(0))
    assert _placements((Shard(1), R), (Shard(1), R), (2, 2)) == (DS(1), DR())
    plan = plan_for("gpt2-tiny", Mesh((2, 2), cluster=CLUSTER), baseline="megatron-dp",
                    zero="zero2")
    for fqn, st in plan.param_state.items():
        assert all(type(p) in (DS, DR) for p in
                   _placements(plan.params[fqn], st.optimizer, plan.mesh_shape)), fqn


# -- saved on 4 ranks, loaded on 2 under another plan -------------------------------------------

def _full(sd: dict) -> dict:
    from torch.distributed.tensor import DTensor
    # (full_tensor() of a replicated DTensor is its local tensor, the live state: cloned.)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
            if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


def _parallel(model_name: str, plan_json: str, seed: int):
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model, _ = build(model_name, None, None, seed)
    inputs = build(model_name, None, None, 0)[1]
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    return pm, pm.shard_inputs(*inputs)


def _train_and_save(model_name: str, plan_json: str, path: str, steps: int):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor
    pm, local = _parallel(model_name, plan_json, 0)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    for _ in range(steps):
        pm.step(*local)
        opt.step()
        opt.zero_grad()
    osd = opt.sharded_state_dict()
    dcp.save({"model": pm.sharded_state_dict(), "optim": osd}, checkpoint_id=path)
    # What this rank holds of each state tensor, beside the whole: a quarter where it is cut.
    held = {k: v.to_local().numel() / v.numel() for k, v in osd.items() if isinstance(v, DTensor)}
    devices = {k: v.to_local().device.type for k, v in osd.items() if isinstance(v, DTensor)}
    # Parameters kept on the host are saved from there (the DTensor holds the host tensor).
    devices.update({f"param.{k}": v.to_local().device.type
                    for k, v in pm.sharded_state_dict().items() if k in pm.on_host})
    return _full(osd), held, devices


def _load_and_step(model_name: str, plan_json: str, path: str, step_first: bool):
    import torch.distributed.checkpoint as dcp
    pm, local = _parallel(model_name, plan_json, 7)        # other weights: the load replaces them
    opt = pm.optimizer(torch.optim.AdamW, lr=0.5, weight_decay=0.0)    # replaced by the load
    if step_first:                                         # state to overwrite, masters to recut
        pm.step(*local)
        opt.step()
        opt.zero_grad()
    sd = {"model": pm.sharded_state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    opt.load_sharded_state_dict(sd["optim"])
    pm.load_sharded_state_dict(sd["model"])
    loaded = _full(opt.sharded_state_dict())
    pm.step(*local)
    opt.step()
    opt.zero_grad()
    return loaded, pm.full_state_dict()


def _reference(model_name: str, steps: int):
    """Single-device AdamW: the state after ``steps - 1`` steps, the parameters after ``steps``."""
    from autoshard.loss import as_loss_module
    model, inputs = build(model_name, None, None, 0)
    ref = as_loss_module(model)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    names = {p: n.removeprefix("model.") for n, p in ref.named_parameters()}
    state = {}
    for i in range(steps):
        ref(*inputs).backward()
        opt.step()
        opt.zero_grad()
        if i == steps - 2:
            state = {f"state.{names[p]}.{k}": v.clone() for p, s in opt.state.items()
                     for k, v in s.items()}
    return state, {n: p.detach().clone() for p, n in names.items()}


def _noise(key: str) -> bool:
    # A key projection's bias has a gradient of exactly zero in exact arithmetic (softmax is
    # invariant to one constant added to every score of a query): what arrives is rounding
    # noise, which Adam's g / sqrt(v) scales up to full-size steps, differently in every
    # summation order (tests/test_state.py). No program can match it; the rest must.
    return "k_proj.bias" in key


CASES = [((4,), "dp", dict(zero="zero2"), (2,), "dp", {}, False),
         ((2, 2), "megatron-dp", dict(zero="zero1"), (2,), "dp", dict(zero="zero2"), True),
         ((4,), "dp", dict(offload="optimizer"), (2,), "megatron", {}, False),
         ((4,), "dp", dict(offload="parameters"), (2,), "megatron", dict(offload="parameters"),
          True)]


@pytest.mark.slow
@pytest.mark.parametrize("save_shape,save_base,save_kw,load_shape,load_base,load_kw,step_first",
                         CASES, ids=["zero2-4-to-dp-2", "tp-zero1-2x2-to-zero2-2",
                                     "offload-4-to-tp-2", "offload-params-4-to-tp-2"])
def test_optimizer_state_saved_on_four_loads_on_two_under_another_plan(
        world4, world2, tmp_path, save_shape, save_base, save_kw, load_shape, load_base, load_kw,
        step_first):
    model = "gpt2-tiny"
    save = plan_for(model, Mesh(save_shape, cluster=CLUSTER), baseline=save_base, **save_kw)
    load = plan_for(model, Mesh(load_shape, cluster=CLUSTER), baseline=load_base, **load_kw)
    assert save.param_state and (save.params, save.param_state) != (load.params, load.param_state)
    path = str(tmp_path / "ckpt")
    saved, held, devices = world4.run(_train_and_save, model, save.dumps(), path, 2)[0]
    # The state is sharded: rank 0 holds the share of every state tensor of a cut parameter
    # that its optimizer placements cut it to (a quarter on 4 ranks; a half where ZeRO cuts
    # it over one of two replicated axes alone), the whole of none of them (offload's on the
    # host).
    share = {f"state.{f}.exp_avg": 1 / math.prod(n for n, p in zip(save_shape, st.optimizer)
                                                 if isinstance(p, Shard))
             for f, st in save.param_state.items()}
    cut = list(share)
    assert cut and all(held[k] == share[k] < 1 for k in cut), (held, share)
    assert 0.25 in share.values()
    assert all(devices[k] == "cpu" for k in cut)
    if save_kw.get("offload") == "parameters":
        assert {k for k in devices if k.startswith("param.")} == {f"param.{f}"
                                                                 for f in save.param_state}
        assert all(v == "cpu" for v in devices.values())
    loaded, params = world2.run(_load_and_step, model, load.dumps(), path, step_first)[0]

    # (a) the full state loaded under the other plan is the saved one, entry for entry.
    assert set(loaded) == set(saved)
    for k, v in saved.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(loaded[k], v), k
        else:
            assert loaded[k] == v, k
    assert saved["param_groups.0.lr"] == LR and saved["param_groups.0.weight_decay"] == WD
    assert not any(k.startswith("master.") for k in saved)       # fp32: the parameter is it
    # ... and it is single-device AdamW's after 2 steps, laid out globally.
    want_state, want_params = _reference(model, 3)
    assert {k for k in saved if k.startswith("state.")} == set(want_state)
    for k, want in want_state.items():
        if not _noise(k):
            tol = 1e-4 * max(want.abs().max().item(), 1e-12)
            assert (saved[k] - want).abs().max().item() <= tol, k

    # (b) one more step after the load is the third step of the original run.
    worst = max((params[n] - p).abs().max().item() for n, p in want_params.items()
                if not _noise(n))
    # One AdamW step moves an element by about LR at most; where an element's gradient is
    # rounding-sized, g / sqrt(v) turns the summation order's noise into a visible part of a
    # step (as for _noise's keys, less so). Measured: up to 1.4% of a step (layers.1.mlp.fc1)
    # on an Intel Xeon host, under 1% on an AMD EPYC one; a wrong state is a whole step off.
    assert worst <= 0.02 * LR, worst


# -- bad state dicts ----------------------------------------------------------------------------

def _bad_state_dicts(plan_json: str) -> dict:
    from torch.distributed.tensor import DTensor, Replicate
    from autoshard.errors import AutoshardError
    pm, local = _parallel("mlp-tiny", plan_json, 0)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR)
    pm.step(*local)
    opt.step()
    opt.zero_grad()
    key = "state.layers.1.fc.weight.exp_avg"
    before = _full(opt.sharded_state_dict())

    def refused(sd):
        try:
            opt.load_sharded_state_dict(sd)
        except AutoshardError as e:
            return str(e)
        return None

    out = {}
    sd = dict(opt.sharded_state_dict())
    del sd[key]
    out["missing"] = refused(sd)
    sd = dict(opt.sharded_state_dict())
    sd[key] = torch.zeros(8, 16)
    out["shape"] = refused(sd)
    sd = dict(opt.sharded_state_dict())
    sd[key] = DTensor.from_local(torch.zeros(16, 16), pm.groups.device_mesh,
                                 [Replicate()], run_check=False)     # whole on every rank
    out["placements"] = refused(sd)
    sd = dict(opt.sharded_state_dict())
    sd["state.layers.1.fc.weight.max_exp_avg_sq"] = sd[key]
    out["unexpected"] = refused(sd)
    out["unchanged"] = all(torch.equal(v, before[k]) if isinstance(v, torch.Tensor)
                           else v == before[k] for k, v in _full(opt.sharded_state_dict()).items())
    # Full tensors under the same keys load too (each rank takes its part), into an optimizer
    # that has not stepped.
    fresh = pm.optimizer(torch.optim.AdamW, lr=0.5)
    fresh.load_sharded_state_dict(before)
    out["full"] = all(torch.equal(v, before[k]) if isinstance(v, torch.Tensor) else v == before[k]
                      for k, v in _full(fresh.sharded_state_dict()).items())
    return out


def test_bad_state_dicts_are_refused_before_anything_is_written(world2):
    plan = plan_for("mlp-tiny", Mesh((2,), cluster=CLUSTER), baseline="dp", zero="zero1")
    out = world2.run(_bad_state_dicts, plan.dumps())[0]
    assert "every entry of opt.sharded_state_dict()" in out["missing"]
    assert "1 missing: state.layers.1.fc.weight.exp_avg" in out["missing"]
    assert "global shape (16, 16)" in out["shape"] and "got global shape (8, 16)" in out["shape"]
    assert "laid out as this plan keeps it" in out["placements"]
    assert "max_exp_avg_sq" in out["unexpected"] and "amsgrad" in out["unexpected"]
    assert out["unchanged"] and out["full"]


def _load(model_name: str, plan_json: str, path: str):
    import torch.distributed.checkpoint as dcp
    pm, _ = _parallel(model_name, plan_json, 7)
    opt = pm.optimizer(torch.optim.AdamW, lr=0.5)
    sd = {"model": pm.sharded_state_dict(), "optim": opt.sharded_state_dict()}
    dcp.load(sd, checkpoint_id=path)
    pm.load_sharded_state_dict(sd["model"])
    opt.load_sharded_state_dict(sd["optim"])
    return _full(opt.sharded_state_dict()), pm.full_state_dict()


def test_bf16_mixed_saves_the_fp32_masters(world4, world2, tmp_path):
    """A 16-bit parameter's fp32 master holds what the parameter cannot: it is saved as
    ``master.<fqn>`` (cut as the state under ZeRO-2, whole under data parallelism) and loads
    across plans bit for bit."""
    save = plan_for("mlp-tiny", Mesh((4,), cluster=CLUSTER), baseline="dp", zero="zero2",
                    precision="bf16-mixed")
    load = plan_for("mlp-tiny", Mesh((2,), cluster=CLUSTER), baseline="dp",
                    precision="bf16-mixed")
    path = str(tmp_path / "ckpt")
    saved, held, _ = world4.run(_train_and_save, "mlp-tiny", save.dumps(), path, 2)[0]
    masters = {k for k in saved if k.startswith("master.")}
    assert masters == {f"master.{f}" for f in save.params}
    assert all(held[k] == 0.25 for k in masters) and saved["master.layers.0.fc.weight"].dtype \
        == torch.float32
    loaded, params = world2.run(_load, "mlp-tiny", load.dumps(), path)[0]
    assert set(loaded) == set(saved)
    for k, v in saved.items():
        assert torch.equal(loaded[k], v) if isinstance(v, torch.Tensor) else loaded[k] == v, k
    for f in save.params:        # the bf16 parameter is its master rounded, as after a step
        assert params[f].dtype == torch.bfloat16
        assert torch.equal(params[f], saved[f"master.{f}"].to(torch.bfloat16)), f


def test_the_fused_kernel_is_the_default_where_the_class_has_one():
    """pm.optimizer asks for the fused kernel the plan prices (docs/cost-model.md §9) unless the
    caller chose an implementation or the class has none."""
    from autoshard.codegen.optim import _fused_by_default
    masters = [torch.zeros(4), torch.zeros(2, 3)]
    assert _fused_by_default(torch.optim.AdamW, {"lr": 1e-3}, masters)
    assert _fused_by_default(torch.optim.SGD, {"lr": 1e-3}, masters)
    assert not _fused_by_default(torch.optim.AdamW, {"foreach": True}, masters)
    assert not _fused_by_default(torch.optim.AdamW, {"fused": False}, masters)
    assert not _fused_by_default(torch.optim.RMSprop, {}, masters)       # no fused kernel
    assert not _fused_by_default(torch.optim.AdamW, {}, [])


# -- the runtime lays the state out as the step program's records say ----------------------------

def _allocated(cases: list[tuple[str, str]]) -> list[dict]:
    """Per (model, plan): each stepped parameter's optimizer state as pm.optimizer allocated
    it after one AdamW step (its fp32 master where apart, and every state tensor shaped like
    it), beside its record (cost/program.py ``ParamUpdate``)."""
    from autoshard.codegen.optim import records
    out = []
    for model_name, plan_json in cases:
        pm, local = _parallel(model_name, plan_json, 0)
        opt = pm.optimizer(torch.optim.AdamW, lr=LR)
        pm.step(*local)
        opt.step()
        recs = records(pm)
        got = {}
        for e in opt.entries:
            tensors = [v for v in opt.state[e.master].values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0]
            if e.master is not e.param:
                tensors.append(e.master)
            got[e.fqn] = {
                "bytes": sum(t.numel() * t.element_size() for t in tensors),
                "elements": sorted({t.numel() for t in tensors}),
                "dtypes": sorted({str(t.dtype) for t in tensors}),
                "master": e.master is not e.param, "placements": [str(p) for p in e.placements]}
        out.append({"got": got, "records": {f: (u.state_bytes("adamw"), u.elements, u.master,
                                                u.moment, u.name) for f, u in recs.items()},
                    "frozen": sorted(f for f, p in pm.local_parameters().items()
                                     if not p.requires_grad)})
    return out


@pytest.mark.slow
def test_the_optimizer_allocates_the_state_its_records_say(world2):
    """For plans under data parallelism, ZeRO-1, ZeRO-2, optimizer and parameter offload and
    bf16-mixed (with and without ZeRO-2): pm.optimizer keeps, per parameter, the bytes of state
    the step program's optimizer records say (an fp32 master where the record keeps one apart,
    two AdamW moments, each of the record's state-shard elements), on the host where they say,
    and the device's share is the moments the liveness walk counts (``moment``) and the cost
    model's optimizer state (``Pricer.state_bytes``)."""
    from autoshard.cost.price import Pricer
    from autoshard.solver.planner import trace_for
    mesh = Mesh((2,), cluster=CLUSTER)
    kws = {"dp": ("gpt2-tiny", {"zero": "none", "offload": "none"}),
           "zero1": ("gpt2-tiny", {"zero": "zero1", "offload": "none"}),
           "zero2": ("gpt2-tiny", {"zero": "zero2", "offload": "none"}),
           "offload": ("gpt2-tiny", {"offload": "optimizer"}),
           "offload-params": ("gpt2-tiny", {"offload": "parameters"}),
           "bf16-dp": ("mlp-tiny", {"zero": "none", "offload": "none",
                                    "precision": "bf16-mixed"}),
           "bf16-zero2": ("mlp-tiny", {"zero": "zero2", "offload": "none",
                                       "precision": "bf16-mixed"})}
    plans = {k: plan_for(m, mesh, baseline="dp", **kw) for k, (m, kw) in kws.items()}
    runs = world2.run(_allocated, [(kws[k][0], p.dumps()) for k, p in plans.items()])[0]
    modes = set()
    for (key, plan), run in zip(plans.items(), runs):
        got, recs = run["got"], run["records"]
        assert set(got) == set(recs) == set(plan.params), key
        bf16 = key.startswith("bf16")
        model, inputs = build(kws[key][0], None, None, 0)
        traced = trace_for(model, inputs, plan.settled_options())
        pricer = Pricer(traced, mesh, plan.options)
        strategies = plan.strategies()
        for fqn, (where, elements, master, moment, name) in recs.items():
            g = got[fqn]
            assert g["bytes"] == where["device"] + where["host"], (key, fqn)
            assert g["master"] == master and g["elements"] == [elements], (key, fqn)
            assert g["dtypes"] == ["torch.float32"]
            assert master == (bf16 or plan.strategies()[name].kernel is not None)
            mode = strategies[name].kernel
            modes.add(mode)
            if mode in ("offload", "offload_params"):
                assert where["device"] == 0 and moment == 0
            else:
                assert where["host"] == 0
                assert where["device"] == (2 + master) * moment
                assert where["device"] == pricer.state_bytes(name, strategies[name]).optimizer
    assert modes == {None, "zero1", "zero2", "offload", "offload_params"}
