"""Models built on the meta device: each rank materialises only its shards (codegen/materialize.py).

On real gloo ranks: every local shard equals, bit for bit, the same slice of the tensor
materialised whole on one device (in this process) with the same seed, on a (4,) and a (2, 2)
mesh; while a rank materialises a parameter no tensor it makes is as large as a sharded
parameter (measured with a dispatch mode on every op); a training step's loss and gradients equal
the single-device model initialised the same way; a full state dict (a lazy safetensors file,
read one tensor at a time) or a DCP checkpoint loaded after a meta build gives the weights
loaded. Then, in one process: the counter-based generator (statistics, slices, the splitmix64
reference), the replay of each kind of init on shards, and the errors for inits that cannot run
on a shard.
"""
from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard import Mesh, Plan
from autoshard.codegen import counter_rng, recording, replay
from autoshard.codegen import materialize as M
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Shard
from autoshard.loss import as_loss_module
from autoshard.ops.simulate import shard_tensor
from autoshard.tools.verify import build, plan_for, rel_err
from autoshard.zoo import get_model
from dist import world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")
# Megatron's layouts shard most parameters (on the compute-bound cluster alone the planner
# keeps these tiny models' weights whole and shards optimizer state), and plan in a blink.
OPTIONS = {(4,): dict(baseline="megatron"), (2, 2): dict(baseline="megatron-dp")}
TOL = 1e-5

world4 = world_fixture(4, timeout_s=300)


@functools.lru_cache(maxsize=None)
def _plan_json(model: str, shape: tuple[int, ...]) -> str:
    return plan_for(model, Mesh(shape, cluster=CLUSTER), **OPTIONS[shape]).dumps()


def _plan(model: str, shape: tuple[int, ...]) -> Plan:
    plan = Plan.loads(_plan_json(model, shape))
    sharded = [f for f, s in plan.params.items() if any(isinstance(p, Shard) for p in s)]
    assert len(sharded) >= 4, f"the plan shards {sharded}: the case tests little"
    return plan


def _meta_model(name: str) -> nn.Module:
    """The zoo model built on the meta device with its construction recorded."""
    with M.deferred_init():
        model, _ = get_model(name)
    return model


class _Largest(TorchDispatchMode):
    """The most elements of any tensor an op makes (meta tensors hold none)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self.largest = max(self.largest, t.numel())
        return out


# -- on gloo ranks --------------------------------------------------------------------------

def _meta_rank(name: str, plan_json: str, seed: int) -> dict:
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    model = _meta_model(name)
    largest: dict[str, int] = {}
    original = M.local_shard

    def probe(model, fqn, t, spec, *rest):
        with _Largest() as mode:
            out = original(model, fqn, t, spec, *rest)
        largest[fqn] = mode.largest
        return out

    M.local_shard = probe           # the runtime looks it up on the module for every tensor
    try:
        pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan, seed=seed)
    finally:
        M.local_shard = original
    assert all(not p.is_meta for p in pm.parameters())
    local = {f: p.detach().clone() for f, p in pm.local_parameters().items()}
    _, inputs = build(name, None, None, 0)
    loss = pm.step(*pm.shard_inputs(*inputs))
    return {"coords": pm.groups.coords, "local": local, "largest": largest,
            "loss": float(loss), "grads": pm.full_grads()}


CASES = [("gpt2-tiny", (4,)), ("llama-tiny", (2, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("name,shape", CASES,
                         ids=[f"{n}-{'x'.join(map(str, s))}" for n, s in CASES])
def test_meta_build_materialises_the_single_device_slices(world4, name, shape):
    seed = 7
    plan = _plan(name, shape)
    reports = world4.run(_meta_rank, name, plan.dumps(), seed)
    whole = M.materialized_state_dict(_meta_model(name), seed=seed)
    assert set(whole) >= set(plan.params)
    for r in reports:
        # (a) each shard is its slice of the one-device tensor, bit for bit
        assert set(r["local"]) == set(plan.params)
        for fqn, local in r["local"].items():
            want = shard_tensor(whole[fqn], plan.params[fqn], plan.mesh_shape, r["coords"])
            assert local.dtype == want.dtype and torch.equal(local, want), (fqn, r["coords"])
        # (b) no tensor made while materialising a parameter is as large as a sharded one
        for fqn, spec in plan.params.items():
            n_local, n_full = r["local"][fqn].numel(), whole[fqn].numel()
            assert r["largest"][fqn] <= n_local, (fqn, r["largest"][fqn], n_local)
            if any(isinstance(p, Shard) for p in spec):
                assert r["largest"][fqn] < n_full, (fqn, r["largest"][fqn], n_full)
    # (c) a training step equals the single-device model initialised the same way
    ref = as_loss_module(M.materialize(_meta_model(name), seed=seed))
    _, inputs = build(name, None, None, 0)
    loss = ref(*inputs)
    loss.backward()
    for r in reports:
        assert abs(r["loss"] - loss.item()) <= TOL * abs(loss.item()), (r["loss"], loss.item())
        for n, p in ref.named_parameters():
            assert rel_err(r["grads"][n.removeprefix("model.")], p.grad) <= TOL, n


class _OneAtATime(Mapping):
    """A Mapping that records how many of the tensors it handed out were alive at once."""

    def __init__(self, inner: Mapping) -> None:
        self.inner, self.alive, self.most, self.reads = inner, [], 0, 0

    def __getitem__(self, key):
        t = self.inner[key]
        self.alive = [r for r in self.alive if r() is not None] + [weakref.ref(t)]
        self.most, self.reads = max(self.most, len(self.alive)), self.reads + 1
        return t

    def __iter__(self):
        return iter(self.inner)

    def __len__(self):
        return len(self.inner)


def _full_state_after_meta_build(plan_json: str, path: str) -> dict:
    from autoshard.codegen.parallelize import parallelize
    plan = Plan.loads(plan_json)
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes)
    real, inputs = build("llama-tiny", None, None, 0)
    want = {k: v.clone() for k, v in real.state_dict().items()}
    meta, _ = get_model("llama-tiny")                      # plain meta build: nothing recorded
    pm = parallelize(meta, mesh, plan=plan, init="empty")
    unset = all(torch.isnan(p).all() for p in pm.local_parameters().values())
    lazy = _OneAtATime(M.safetensors_state_dict(path))
    pm.load_full_state_dict(lazy)
    got = pm.full_state_dict()
    pm_real = parallelize(real, mesh, plan=plan)
    pm_real.load_full_state_dict(want)
    return {"unset": unset, "most_alive": lazy.most, "reads": lazy.reads,
            "equal": {k: torch.equal(got[k], want[k]) for k in got},
            "same_as_real": all(torch.equal(got[k], v)
                                for k, v in pm_real.full_state_dict().items()),
            "losses": (float(pm.step(*pm.shard_inputs(*inputs))),
                       float(pm_real.step(*pm_real.shard_inputs(*inputs))))}


def test_full_state_dict_loads_into_a_meta_build_one_tensor_at_a_time(world4, tmp_path):
    from safetensors.torch import save_file
    plan = _plan("llama-tiny", (2, 2))
    real, _ = build("llama-tiny", None, None, 0)
    save_file({k: v.contiguous() for k, v in real.state_dict().items()}, tmp_path / "w.safetensors")
    path = str(tmp_path / "w.safetensors")
    for r in world4.run(_full_state_after_meta_build, plan.dumps(), path):
        assert r["unset"], "init='empty' shards should read NaN until loaded"
        assert r["reads"] >= len(plan.params) and r["most_alive"] == 1, r
        assert r["equal"] and all(r["equal"].values()), r["equal"]
        assert r["same_as_real"] and r["losses"][0] == r["losses"][1], r["losses"]


def _dcp_after_meta_build(save_json: str, load_json: str, path: str, seed: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from autoshard.codegen.parallelize import parallelize
    save, load = Plan.loads(save_json), Plan.loads(load_json)
    pm = parallelize(_meta_model("gpt2-tiny"), Mesh(save.mesh_shape, save.mesh_axes), plan=save,
                     seed=seed)
    dcp.save(pm.sharded_state_dict(), checkpoint_id=path)
    meta, _ = get_model("gpt2-tiny")
    pm2 = parallelize(meta, Mesh(load.mesh_shape, load.mesh_axes), plan=load, init="empty")
    sd = pm2.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    pm2.load_sharded_state_dict(sd)
    return pm2.full_state_dict()


def test_dcp_checkpoint_of_a_meta_build_loads_into_another_mesh(world4, tmp_path):
    save = _plan("gpt2-tiny", (4,))
    load = plan_for("gpt2-tiny", Mesh((2, 2), cluster=CLUSTER), baseline="megatron-dp")
    assert save.params != load.params
    full = world4.run(_dcp_after_meta_build, save.dumps(), load.dumps(), str(tmp_path / "ckpt"), 5)
    want = M.materialized_state_dict(_meta_model("gpt2-tiny"), seed=5)
    for r in full:
        for fqn in load.params:
            assert torch.equal(r[fqn], want[fqn]), fqn


# -- the counter-based generator ----------------------------------------------------------------

def _splitmix_reference(key: int, i: int) -> int:
    z = (key + (i + 1) * 0x9E3779B97F4A7C15) & (2 ** 64 - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2 ** 64 - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2 ** 64 - 1)
    return z ^ (z >> 31)


def test_random_bits_are_splitmix64_with_wrapping_int64():
    key = counter_rng.stream_key(3, "w", 0)
    idx = torch.tensor([0, 1, 2, 12345, 2 ** 40 + 7, 2 ** 62])
    got = [b & (2 ** 64 - 1) for b in counter_rng.random_bits(key, idx).tolist()]
    assert got == [_splitmix_reference(key, i) for i in idx.tolist()]


def test_uniform_and_normal_draws_have_their_distributions():
    idx = torch.arange(1 << 20)
    u = M.counter_uniform(0, "w", idx, low=-2.0, high=4.0)
    assert u.min() >= -2.0 and u.max() < 4.0
    assert abs(u.mean().item() - 1.0) < 0.01 and abs(u.std().item() - 6 / math.sqrt(12)) < 0.01
    z = M.counter_normal(0, "w", idx, mean=1.5, std=0.5)
    assert abs(z.mean().item() - 1.5) < 0.002 and abs(z.std().item() - 0.5) < 0.002
    within = ((z - 1.5).abs() < 0.5).double().mean().item()
    assert abs(within - 0.682689) < 0.002                        # one sigma
    p = torch.rand(4096, dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    assert (counter_rng._ndtri(p) - torch.special.ndtri(p)).abs().max() < 1e-12


def test_draws_of_a_slice_are_the_slice_of_the_draws():
    idx = torch.arange(10_000)
    for draws in (M.counter_uniform, M.counter_normal):
        whole = draws(1, "layers.0.w", idx)
        assert torch.equal(draws(1, "layers.0.w", idx[1234:5678]), whole[1234:5678])
        assert torch.equal(draws(1, "layers.0.w", idx[::7]), whole[::7])
        for other in (draws(2, "layers.0.w", idx), draws(1, "layers.1.w", idx),
                      draws(1, "layers.0.w", idx, draw=1)):
            assert not torch.equal(other, whole)


def test_replayed_elementwise_ops_compute_each_element_alone():
    """A replayed op (pow here) gives each element what the op gives that element alone, so a
    shard's values do not depend on where its elements sit (torch's vectorised loop and its
    scalar tail may differ in the last bit)."""
    x = torch.rand(4099) * 3
    step = recording._Step("pointwise", None, (10000.0, recording._SELF), torch.ops.aten.pow.Scalar)
    got = replay._scalar_loop(torch.ops.aten.pow.Scalar, x, step, inplace=False)
    alone = torch.stack([torch.ops.aten.pow.Scalar(10000.0, v) for v in x])
    assert torch.equal(got, alone)


# -- replaying recorded inits on shards ----------------------------------------------------

class _Zoo(nn.Module):
    """One parameter or buffer per kind of init the recorder replays."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 12)                           # kaiming_uniform_, uniform_
        self.emb = nn.Embedding(10, 4, padding_idx=3)         # normal_, a row filled with 0
        self.norm = nn.LayerNorm(12)                          # ones_, zeros_
        self.trunc = nn.Parameter(torch.empty(8, 12))
        nn.init.trunc_normal_(self.trunc, std=0.5, a=-0.6, b=0.6)
        self.scaled = nn.Parameter(torch.randn(12, 4) * 0.02)   # a factory, then elementwise
        self.math = nn.Parameter(torch.rand(8, 4))
        with torch.no_grad():
            self.math.mul_(3).add_(0.5).pow_(1.7).exp_()      # pow/exp: the per-element loop
            self.math[2:6, 1:].clamp_(max=5.0)                # on a box of it
        self.copied = nn.Parameter(torch.zeros(3, 4))
        with torch.no_grad():                                 # known values through a transpose
            self.copied.t().copy_(torch.tensor([[0., 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]))
        self.padded = nn.Parameter(F.pad(torch.zeros(6, 4), (0, 0, 1, 1), value=1.0))
        self.register_buffer("pos", torch.arange(16).expand((1, -1)).clone())
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)))


SPECS = [((Shard(0),), (2,)), ((Shard(1),), (4,)), ((Shard(0), Shard(1)), (2, 2)),
         ((Shard(1), Shard(1)), (2, 2)), ((Replicate(), Shard(0)), (2, 2))]


def test_every_kind_of_recorded_init_replays_on_any_shard():
    with M.deferred_init():
        model = _Zoo()
    assert all(t.is_meta for t in model.state_dict().values())
    whole = M.materialized_state_dict(model, seed=3)
    sources = M.prepare(model, seed=3)
    assert sources.init == "recorded"
    for name, full in whole.items():
        for spec, mesh in SPECS:
            if any(isinstance(p, Shard) and (p.dim >= full.ndim or full.shape[p.dim] % math.prod(
                    n for q, n in zip(spec, mesh) if q == p)) for p in spec):
                continue
            for coords in itertools.product(*(range(n) for n in mesh)):
                got = sources.local(name, spec, mesh, coords)
                want = shard_tensor(full, spec, mesh, coords)
                assert torch.equal(got, want), (name, spec, coords)
    for name in ("math", "trunc", "lin.weight"):     # shards are made without the whole
        with _Largest() as mode:
            half = sources.local(name, (Shard(0),), (2,), (1,))
        assert mode.largest <= half.numel() < whole[name].numel(), (name, mode.largest)
    other_seed = M.materialized_state_dict(model, seed=4)
    assert not torch.equal(whole["lin.weight"], other_seed["lin.weight"])
    bound = 1 / math.sqrt(8)
    assert whole["lin.weight"].abs().max() <= bound and whole["lin.weight"].std() > bound / 3
    assert torch.equal(whole["emb.weight"][3], torch.zeros(4)) and whole["emb.weight"].std() > 0.5
    assert torch.equal(whole["norm.weight"], torch.ones(12))
    assert whole["trunc"].abs().max() <= 0.6 and 0.2 < whole["trunc"].std() < 0.4
    assert 0.005 < whole["scaled"].std() < 0.04
    m = whole["math"]
    assert m[2:6, 1:].max() <= 5.0 and m.max() > 5.0 and m.min() >= math.exp(0.5 ** 1.7) * 0.999
    assert torch.equal(whole["copied"], torch.arange(12.).reshape(4, 3).t())
    assert torch.equal(whole["padded"], F.pad(torch.zeros(6, 4), (0, 0, 1, 1), value=1.0))
    assert torch.equal(whole["pos"], torch.arange(16).expand((1, -1)))
    real_inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    assert torch.allclose(whole["inv_freq"], real_inv, rtol=1e-6, atol=0)


def test_zoo_models_built_in_deferred_init_get_their_own_init():
    model = _meta_model("llama-tiny")
    whole = M.materialized_state_dict(model, seed=0)
    # the zoo's _init_weights (N(0, 0.02), applied in the constructor), not Linear's kaiming
    # (uniform with bound 1/sqrt(32): std 0.10)
    w = whole["layers.0.mlp.up_proj.weight"]
    assert 0.015 < w.std() < 0.025
    assert torch.equal(whole["norm.weight"], torch.ones(32))              # torch.ones
    same = M.materialize(_meta_model("llama-tiny"), seed=0)
    for n, p in same.named_parameters():
        assert not p.is_meta and torch.equal(p.detach(), whole[n]), n


def test_hf_models_built_in_deferred_init_record_hf_init_and_rotary_buffers():
    pytest.importorskip("transformers")
    from autoshard.zoo.hf import hf_llama_tiny
    with M.deferred_init():
        model = hf_llama_tiny()
    whole = M.materialized_state_dict(model, seed=0)
    torch.manual_seed(0)
    real = hf_llama_tiny()
    for name, b in real.named_buffers():                  # inv_freq: arange, pow, reciprocal
        assert torch.allclose(whole[name], b, rtol=1e-6, atol=0), name
    w = whole["model.model.layers.0.mlp.up_proj.weight"]
    std = real.model.config.initializer_range                         # HF's _init_weights ran
    assert abs(w.std().item() - std) < 0.3 * std


# -- the init modes and their errors ---------------------------------------------------------

def test_plain_meta_builds_use_the_models_init_or_say_what_is_missing():
    gpt, _ = get_model("gpt2-tiny")                # torch.device("meta"): nothing recorded
    sources = M.prepare(gpt, seed=0)
    assert sources.init == "model" and not sources.problems()   # reset_parameters covers all
    llama, _ = get_model("llama-tiny")              # RMSNorm's torch.ones was never seen
    with pytest.raises(AutoshardError) as e:
        M.materialized_state_dict(llama)
    assert "layers.0.attn_norm.weight" in str(e.value) and "deferred_init" in str(e.value)

    def init_norms(model):
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if hasattr(m, "eps") and hasattr(m, "weight"):
                nn.init.ones_(m.weight)
    whole = M.materialized_state_dict(llama, init=init_norms, seed=0)
    assert torch.equal(whole["norm.weight"], torch.ones(32))
    assert 0.015 < whole["lm_head.weight"].std() < 0.025
    empty = M.materialized_state_dict(llama, init="empty")
    assert all(torch.isnan(v).all() for v in empty.values())


@pytest.mark.parametrize("make,says", [
    (lambda p: nn.init.orthogonal_(p), "orthogonal_"),
    (lambda p: nn.init.eye_(p), "eye"),
    (lambda p: p.data.copy_(torch.ones(8, 8) @ torch.ones(8, 8)), "aten.mm"),
    (lambda p: p.data[:4].normal_(), "not every element was written"),
    (lambda p: p.data.diagonal().fill_(1.0), "not a box"),
], ids=["orthogonal", "eye", "matmul", "partly-written", "diagonal"])
def test_inits_that_cannot_run_on_a_shard_raise_naming_the_tensor(make, says):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.ok = nn.Parameter(torch.ones(8))
            self.bad = nn.Parameter(torch.empty(8, 8))
            make(self.bad)

    with M.deferred_init():
        net = Net()
    with pytest.raises(AutoshardError) as e:
        M.materialize(net)
    assert "got bad:" in str(e.value) and says in str(e.value), str(e.value)
    assert M.prepare(net).problems(["ok"]) == []


def test_bad_init_arguments_are_refused():
    real = nn.Linear(4, 4)
    with pytest.raises(AutoshardError, match="a model on the meta device"):
        M.prepare(real, init="model")
    assert M.prepare(real).entries == {}                  # real weights: cut as they are
    with M.deferred_init():
        meta = nn.Linear(4, 4)
    with pytest.raises(AutoshardError, match="init is one of"):
        M.prepare(meta, init="xavier")
    with pytest.raises(AutoshardError, match="an int seed"):
        M.prepare(meta, seed=1.5)
