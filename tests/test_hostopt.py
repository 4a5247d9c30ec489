"""The host optimizer of optimizer offload (codegen/hostopt.py): its fused, bucketed step equals
torch's optimizer on the same values, bit for bit (the same fused kernels, elementwise); on gloo,
the overlapped schedules give the parameters of the plain one, and the delayed update its
documented recurrence (docs/cost-model.md §9.1)."""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from autoshard.codegen import hostopt
from autoshard.codegen.hostopt import HostOptimizer, _pieces, _Slot
from autoshard.errors import AutoshardError
from dist import world_fixture

world1 = world_fixture(1, timeout_s=300)
world2 = world_fixture(2, timeout_s=300)
SHAPES = [(7, 5), (33,), (4, 4, 3), (1,)]


def _masters(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(step: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _host(opt, masters, overlap="none", bucket_bytes=200.0) -> HostOptimizer:
    kind, why = hostopt.host_kind(opt)
    assert kind is not None, why
    return HostOptimizer(opt, kind, list(range(len(masters))), masters,
                         [torch.float32] * len(masters), overlap=overlap,
                         bucket_bytes=bucket_bytes, device=torch.device("cpu"))


def _run(host: HostOptimizer, grads: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}

    def write_back(key, new):
        out[key] = new.clone()

    host.start(list(enumerate(grads)), write_back)
    host.finish(write_back)
    return out


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.1, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.01,
                               fused=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, fused=True),
], ids=["adamw", "adam-l2", "sgd-nesterov", "sgd-plain"])
def test_bucketed_host_step_equals_torch_fused_bit_for_bit(make, monkeypatch):
    """Several buckets (200 bytes each), kernel calls cut at 16 elements (a member spans
    several, small ones share one): three steps equal torch's fused optimizer exactly, and the
    torch optimizer's state is the host buffers' views, as its own step would lay it out."""
    monkeypatch.setattr(hostopt, "CHUNK", 16)
    ref = _masters()
    mine = _masters()
    ref_opt, opt = make(ref), make(mine)
    host = _host(opt, mine)
    assert len(host.buckets) > 1
    for t in range(3):
        for p, g in zip(ref, _grads(t)):
            p.grad = g
        ref_opt.step()
        out = _run(host, _grads(t))
        for i, (p, m) in enumerate(zip(ref, mine)):
            assert torch.equal(p, m) and torch.equal(out[i], m)
    for p, m in zip(ref, mine):
        a, b = ref_opt.state[p], opt.state[m]
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])), k


def test_bf16_gradients_are_converted_on_the_fly(monkeypatch):
    """16-bit gradients land as they are and are converted piece by piece: the step equals
    torch's on the gradients converted to fp32 first."""
    monkeypatch.setattr(hostopt, "CHUNK", 16)
    ref, mine = _masters(), _masters()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    host = _host(torch.optim.AdamW(mine, lr=1e-2), mine)
    for t in range(2):
        grads = _grads(t, torch.bfloat16)
        for p, g in zip(ref, grads):
            p.grad = g.float()
        ref_opt.step()
        _run(host, grads)
        assert host.buckets[0].grads.dtype == torch.bfloat16
    assert all(torch.equal(p, m) for p, m in zip(ref, mine))


def test_a_member_without_a_gradient_is_not_stepped():
    """As torch skips a parameter whose .grad is None: no state, no update, no write-back."""
    mine = _masters()
    before = [m.detach().clone() for m in mine]
    opt = torch.optim.AdamW(mine, lr=1e-2)
    host = _host(opt, mine, bucket_bytes=1e9)
    out: dict = {}
    grads = _grads(0)
    host.start([(0, grads[0]), (2, grads[2])], lambda k, v: out.setdefault(k, v))
    host.finish(lambda k, v: out.setdefault(k, v))
    assert sorted(out) == [0, 2]
    assert torch.equal(mine[1], before[1]) and not opt.state.get(mine[1])
    assert not torch.equal(mine[0], before[0])


def test_loaded_state_is_adopted_into_the_flat_buffers():
    """A state dict loaded into the torch optimizer (new tensors) is copied into the host
    buffers at the next step, which then continues it exactly."""
    ref, mine = _masters(), _masters()
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    for p, g in zip(ref, _grads(0)):
        p.grad = g
    ref_opt.step()
    opt = torch.optim.AdamW(mine, lr=1e-2)
    host = _host(opt, mine)
    with torch.no_grad():
        for p, m in zip(ref, mine):
            m.copy_(p)
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    for p, g in zip(ref, _grads(1)):
        p.grad = g
    ref_opt.step()
    _run(host, _grads(1))
    assert all(torch.equal(p, m) for p, m in zip(ref, mine))
    b, s = host.slot_of[id(0)]
    assert opt.state[mine[0]]["exp_avg"].data_ptr() == b.moments[0][s.offset:].data_ptr()


def test_pieces_cover_each_member_once_within_the_chunk(monkeypatch):
    monkeypatch.setattr(hostopt, "CHUNK", 10)
    slots = [_Slot(i, None, off, n) for i, (off, n) in enumerate([(0, 3), (3, 25), (28, 4),
                                                                  (40, 2)])]
    calls = _pieces(slots)
    assert all(hi - lo <= 10 for lo, hi, _ in calls)
    covered = sorted((a, z) for _, _, parts in calls for _, a, z in parts)
    assert covered[0][0] == 0 and sum(z - a for a, z in covered) == 3 + 25 + 4 + 2
    # a gap (member 3 starts at 40) starts a new call: each call is one contiguous range
    assert all(parts[0][1] == lo and parts[-1][2] == hi for lo, hi, parts in calls)


def test_an_optimizer_without_a_fused_host_step_is_named():
    ps = _masters()
    assert hostopt.host_kind(torch.optim.AdamW(ps, amsgrad=True))[0] is None
    assert hostopt.host_kind(torch.optim.RMSprop(ps))[0] is None
    assert hostopt.host_kind(torch.optim.AdamW(ps, lr=torch.tensor(1e-3)))[0] is None


def test_a_second_landing_before_the_step_is_refused():
    """Under "backward", a parameter's step starts as soon as its gradient is complete, from
    the first backward on: a second backward before the step (gradient accumulation) is
    refused, not stepped twice."""
    mine = _masters()
    host = _host(torch.optim.AdamW(mine), mine, overlap="backward", bucket_bytes=1e9)
    grads = _grads(0)
    for i, g in enumerate(grads):           # the bucket starts at its last gradient
        assert host.land(i, g, early=True)
    assert host.started_early == 1
    with pytest.raises(AutoshardError, match="offload_overlap='none'"):
        host.land(0, grads[0], early=True)
    _run(host, [])
    host.close()


def test_a_released_gradient_is_read_where_it_landed():
    """A gradient landed from backward whose device copy was freed (``release``) is the
    landing buffer's slice until the step, and is not checked for changes (nothing can change
    it); the step clears the record."""
    mine = _masters()
    host = _host(torch.optim.AdamW(mine), mine, overlap="backward", bucket_bytes=1e9)
    grads = _grads(0)
    for i, g in enumerate(grads):
        host.land(i, g, early=True)
        host.release(i)
    grads[0].mul_(0.5)                       # (freed on a device: no one holds it any more)
    assert list(host.released.values()) == list(range(len(grads)))
    for i, g in enumerate(_grads(0)):
        assert torch.equal(host.landed_grad(i), g)
    _run(host, [])                           # not refused: a released gradient is not checked
    assert host.released == {} and host.landed_grad(0) is None
    host.close()


def test_a_gradient_changed_after_its_early_step_is_refused_and_accumulation_holds():
    """Under "backward" a bucket steps on the gradients backward made: one clipped (scaled in
    place) before ``opt.step()`` would be silently ignored, so the step refuses it. Inside
    ``pm.no_sync()`` (``hold``) nothing lands early: accumulation's micro-steps wait for the
    last one."""
    mine = _masters()
    host = _host(torch.optim.AdamW(mine), mine, overlap="backward", bucket_bytes=1e9)
    grads = _grads(0)
    host.hold = lambda: True
    for i, g in enumerate(grads):
        host.land(i, g, early=True)
    assert host.started_early == 0 and not any(b.landed for b in host.buckets)
    host.hold = lambda: False
    for i, g in enumerate(grads):
        host.land(i, g, early=True)
    assert host.started_early == 1
    grads[0].mul_(0.5)                       # what clip_grad_norm_ does to a .grad
    with pytest.raises(AutoshardError, match="changed after backward"):
        host.start([], lambda key, new: None)
    host.close()


# -- the price (docs/cost-model.md §9.1) --------------------------------------------------------
def _priced(overlap: str):
    from autoshard import Mesh
    from autoshard.cost.price import Pricer
    from autoshard.options import PlanOptions
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    from autoshard.tools.verify import build
    traced = trace(*build("mlp-tiny", None, None, 0))
    mesh = Mesh((1,), cluster="h100")
    plan = plan_traced(traced, mesh, offload="optimizer", offload_overlap=overlap)
    pricer = Pricer(traced, mesh, PlanOptions(offload="optimizer", offload_overlap=overlap),
                    offload="optimizer")
    return traced, mesh, plan, pricer


def test_the_host_step_is_priced_in_the_overlap_window():
    """Per parameter: ``n * 28 / host_mem_bandwidth + 2 * n * i / host_bandwidth`` (Adam, the
    gradient down and the update up), blocking under "none", in the window otherwise, where it
    takes its seconds out of the backward the window holds. The plan's step is the ILP's
    objective, and overlapping saves exactly ``min(host, backward window)``."""
    plans, prices = {}, {}
    for overlap in ("none", "backward"):
        traced, mesh, plans[overlap], prices[overlap] = _priced(overlap)
    c = mesh.cluster
    strategies = plans["none"].strategies()
    host = 0.0
    for ph in traced.params:
        s = strategies[ph.name]
        assert s.kernel == "offload"
        n = math.prod(ph.info.shape)
        t = n * 28 / c.host_mem_bandwidth + 2 * n * ph.info.dtype.itemsize / c.host_bandwidth
        assert prices["none"].offload_step_seconds(ph.name, s) == pytest.approx((t, 0.0))
        assert prices["backward"].offload_step_seconds(ph.name, s) == pytest.approx((0.0, t))
        assert prices["backward"].backward(ph.name, s) == pytest.approx(-t)
        assert prices["backward"].optimizer_seconds(ph.name, s) == 0.0
        host += t
    window = sum(prices["backward"].backward(n.name, strategies[n.name])
                 for n in traced.graph.nodes
                 if n.name in strategies and n.op != "placeholder")
    assert window > 0
    none, over = plans["none"].predicted, plans["backward"].predicted
    assert over.host_step_s == pytest.approx(host)
    assert none.step_time_s - over.step_time_s == pytest.approx(min(host, window))
    for p in plans.values():
        assert p.predicted.step_time_s == pytest.approx(p.solver["objective"], rel=1e-6)


def test_the_ilp_offloads_more_when_the_host_step_hides():
    """Two parameters that either keep their state (memory 10) or offload it (host step 3 s in
    the window); backward compute of 4 s. Under a budget of 20 both stay; under 10 one goes,
    for free (3 <= 4); under 0 both go and 2 s of the 6 are exposed."""
    from autoshard.solver.ilp import solve
    from autoshard.solver.problem import Decision, Problem
    params = tuple(Decision(f"p{i}", 1, (0.0, 0.0), (10.0, 0.0), (0.0, -3.0)) for i in range(2))
    op = Decision("op", 1, (8.0,), (0.0,), (4.0,))
    for budget, offloaded, step in ((20.0, 0, 8.0), (10.0, 1, 8.0), (0.0, 2, 10.0)):
        sol = solve(Problem((*params, op), (), budget))
        assert sum(sol.choice[:2]) == offloaded and sol.objective == pytest.approx(step)


# -- on gloo: the schedules through pm.optimizer ---------------------------------------------
MODEL = "llama-tiny"
STEPS = 3


def _train(plan_json: str) -> dict:
    """``STEPS`` AdamW steps through pm.optimizer: the full parameters after each, and the
    largest relative difference from the single-device recurrence of the plan's
    ``offload_overlap`` (fused AdamW; "delayed": the forward reads the masters one update
    behind, docs/cost-model.md §9.1)."""
    from autoshard import Mesh, Plan
    from autoshard.codegen.parallelize import parallelize
    from autoshard.loss import as_loss_module
    from autoshard.tools.verify import build, rel_err
    plan = Plan.loads(plan_json)
    model, inputs = build(MODEL, None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    # (lr as tests/dist.py's: the rounding noise of a near-zero gradient, which Adam's
    # g / sqrt(v) scales to a step of up to lr, stays below the tolerance on every CPU's kernels)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3, weight_decay=0.1)
    assert opt.host is not None
    fwd = as_loss_module(build(MODEL, None, None, 0)[0])        # W: what forward reads
    masters = copy.deepcopy(fwd)                                 # M: what the optimizer steps
    ref_opt = torch.optim.AdamW(masters.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    delayed = plan.options.offload_overlap == "delayed"
    local = pm.shard_inputs(*inputs)
    out = {"params": [], "err": 0.0, "hooked": len(opt.host.handles),
           "buckets": len(opt.host.buckets)}
    for t in range(STEPS):
        pm.step(*local)
        if t == 0:
            try:            # (refused where a parameter on the device stepped in backward)
                out["grads"] = {k: v.clone() for k, v in pm.full_grads().items()}
            except AutoshardError:
                out["grads"] = None
            out["released"] = sum(p.grad is None for p in pm.local_parameters().values())
            try:
                list(pm.parameters())
                out["views_refused"] = False
            except AutoshardError:
                out["views_refused"] = True
        opt.step()
        opt.zero_grad()
        fwd(*inputs).backward()
        behind = [m.detach().clone() for m in masters.parameters()]
        for w, m in zip(fwd.parameters(), masters.parameters()):
            m.grad = w.grad
        ref_opt.step()
        with torch.no_grad():
            for w, m, b in zip(fwd.parameters(), masters.parameters(), behind):
                w.copy_(b if delayed else m)
                w.grad = None
        full = {k: v.clone() for k, v in pm.full_state_dict().items()}
        out["params"].append(full)
        # (a key projection's bias: rounding noise that Adam scales up, tests/dist.py)
        out["err"] = max(out["err"], max(rel_err(full[n.removeprefix("model.")], w.detach())
                                         for n, w in fwd.named_parameters()
                                         if not n.endswith("k_proj.bias")))
    out["early"] = opt.host.started_early
    opt.settle()           # the last host step written back: the parameters are the masters
    full = pm.full_state_dict()
    out["settled_err"] = max(rel_err(full[n.removeprefix("model.")], m.detach())
                             for n, m in masters.named_parameters()
                             if not n.endswith("k_proj.bias"))
    return out


def _plans(mesh_shape: tuple[int, ...]) -> dict[str, str]:
    from autoshard import Mesh
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    from autoshard.tools.verify import build
    traced = trace(*build(MODEL, None, None, 0))
    mesh = Mesh(mesh_shape, cluster="stress")
    return {o: plan_traced(traced, mesh, offload="optimizer", offload_overlap=o,
                           bucket_mb=0.004).dumps()
            for o in ("none", "backward", "delayed")}


@pytest.fixture(scope="module")
def runs(world2):
    return {o: world2.run(_train, p) for o, p in _plans((2,)).items()}


@pytest.mark.slow
def test_overlapped_schedule_gives_the_plain_parameters(runs):
    """Buckets stepped on the host thread while the write-backs run: the same parameters,
    exactly, as stepping everything after backward, on every rank; both the single-device
    AdamW's within 1e-4 (fp32 on gloo over 3 steps, as tests/dist.py's)."""
    for plain, over in zip(runs["none"], runs["backward"]):
        for a, b in zip(plain["params"], over["params"]):
            assert a.keys() == b.keys()
            assert all(torch.equal(a[k], b[k]) for k in a)
        assert plain["err"] < 1e-4 and over["err"] < 1e-4


@pytest.mark.slow
def test_delayed_update_follows_its_recurrence(runs):
    """W_1 = W_2 = M_0, W_t = M_(t-2), M_t = U(M_(t-1), g(W_t)), as single-device AdamW
    stepped that way gives it; it is not the plain run's (which the check would pass too if
    the recurrence were plain)."""
    for plain, delayed in zip(runs["none"], runs["delayed"]):
        assert delayed["err"] < 1e-4 and delayed["settled_err"] < 1e-4
        assert plain["settled_err"] < 1e-4
        assert all(torch.equal(delayed["params"][1][k], plain["params"][0][k])
                   for k in plain["params"][0])
        last_p, last_d = plain["params"][-1], delayed["params"][-1]
        assert any(not torch.allclose(last_d[k], last_p[k], atol=1e-4) for k in last_p)


@pytest.mark.slow
def test_on_one_device_each_bucket_steps_during_backward(world1):
    """One device (the issue's Llama-3-8B case): no bucket collects the gradients, so each
    parameter lands from its post-accumulate-grad hook, from the first backward on, and its
    bucket starts on the host thread during backward; the parameters are the plain schedule's, exactly, and
    single-device AdamW's."""
    plans = _plans((1,))
    plain, over = (world1.run(_train, plans[o])[0] for o in ("none", "backward"))
    assert over["hooked"] > 0 and over["buckets"] > 1
    assert over["early"] == over["buckets"] * STEPS and plain["early"] == 0
    for a, b in zip(plain["params"], over["params"]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert over["err"] < 1e-4
    # Each hooked gradient left the device as it landed (the liveness walk's ``released``);
    # pm.full_grads() reads it on the host, equal to the plain run's; pm.parameters() refuses
    # to hand torch's utilities a set without them until the step.
    assert over["released"] == over["hooked"] and plain["released"] == 0
    assert over["grads"].keys() == plain["grads"].keys()
    assert all(torch.equal(over["grads"][k], plain["grads"][k]) for k in plain["grads"])
    assert over["views_refused"] and not plain["views_refused"]


def test_calibrate_maps_the_host_side_onto_the_host_fields():
    """The host step's rate (median over ranks) is host_mem_bandwidth; on a GPU the slower way
    of the pinned copies (median over ranks) is host_bandwidth; on a CPU the link stays the
    preset's (the host is the device)."""
    from test_calibrate import _fake_report

    from autoshard.tools.calibrate.fields import profile

    from autoshard.tools.calibrate.timing import CalibrateSpec
    from autoshard.cluster import PRESETS, Cluster
    reports = []
    for rate in (30e9, 40e9, 50e9):
        r = _fake_report(50e12)
        r["matmul"]["bfloat16"] = r["matmul"]["float32"]
        r.update(device_name="NVIDIA H100 80GB HBM3", device_memory_bytes=85_000_000_000,
                 host_side={"adam_bytes_per_s": rate, "h2d_bytes_per_s": rate + 5e9,
                            "d2h_bytes_per_s": rate + 1e9})
        reports.append(r)
    c = Cluster._from_profile(dict(profile(CalibrateSpec("cuda", 3), reports)))
    assert c.host_mem_bandwidth == 40e9 and c.host_bandwidth == 41e9
    cpu = Cluster._from_profile(dict(profile(CalibrateSpec("cpu", 3), reports)))
    assert cpu.host_mem_bandwidth == 40e9
    assert cpu.host_bandwidth == PRESETS["cpu"].host_bandwidth


def test_calibrate_measures_the_host_step_here():
    """One rank's host measurement, quick sizes, on this CPU: a positive rate over the state it
    says it stepped."""
    from autoshard.tools.calibrate.kernels import measure_host_side
    from autoshard.tools.calibrate.timing import SIZES
    out = measure_host_side(SIZES[("cpu", True)], torch.device("cpu"))
    assert out["state_bytes"] == SIZES[("cpu", True)].host_state_bytes // 12 * 12
    assert out["adam_bytes_per_s"] > 1e7 and "h2d_bytes_per_s" not in out


def test_the_host_step_runs_on_the_ranks_share_of_the_cores(monkeypatch):
    """Next to a GPU the step takes this rank's share of the host's cores whatever
    OMP_NUM_THREADS says (torchrun sets it to 1, and a pass over host memory on one core runs
    at a fraction of the host's bandwidth); on a CPU run it keeps the rank's compute threads.
    The host thread itself runs with that count (torch's intra-op count is per thread)."""
    from autoshard.codegen.hostopt import host_threads
    cores = len(os.sched_getaffinity(0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert host_threads(torch.device("cuda")) == max(1, cores // 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert host_threads(torch.device("cuda")) == cores
    assert host_threads(torch.device("cpu")) == torch.get_num_threads()
    # A count no thread has by default: the host thread reports it only if set there.
    wanted = torch.get_num_threads() + 1
    monkeypatch.setattr(hostopt, "host_threads", lambda device: wanted)
    p = torch.nn.Parameter(torch.zeros(8))
    host = HostOptimizer(torch.optim.AdamW([p]), "adam", [0], [p], [torch.float32],
                         overlap="none", bucket_bytes=2**20, device=torch.device("cpu"))
    try:
        assert host.threads == wanted
        assert host._pool.submit(torch.get_num_threads).result() == wanted
    finally:
        host.close()
        torch.set_num_threads(wanted - 1)


@pytest.mark.slow
def test_a_plan_offloaded_under_none_says_what_backward_overlap_gives():
    """Optimizer offload with the host's step after backward (offload_overlap "none", the
    default): the plan's warnings give the step of its layouts under "backward" (the same
    numbers, the host's step hidden behind backward), each parameter's state split chosen
    again, where that is at least 5% faster; here that is the step of the plan made with
    "backward". A plan that offloads nothing says nothing of it. Llama-3-8B cut to 4 layers,
    batch 2 x 2048, bf16-mixed, one H100 (preset), 20 GiB."""
    from autoshard import Mesh
    from autoshard.solver.planner import plan_traced
    from autoshard.trace.export import trace
    from autoshard.zoo.models import Llama, LlamaConfig
    cfg = LlamaConfig(4, 4096, 32, 8, 14336, vocab_size=128256, context=8192,
                      rope_theta=500000.0)
    with torch.device("meta"):
        model = Llama(cfg)
    traced = trace(model, model.example_inputs(2, 2048, device="meta"))
    mesh = Mesh((1,), cluster="h100")
    kw = {"precision": "bf16-mixed", "memory_budget": 20 * 2**30}
    plan = plan_traced(traced, mesh, **kw)
    overlapped = plan_traced(traced, mesh, offload_overlap="backward", **kw)
    assert any(st.mode == "offload" for st in plan.param_state.values())
    [note] = [w for w in plan.warnings if "offload_overlap='backward'" in w]
    now, then = plan.predicted.step_time_s, overlapped.predicted.step_time_s
    assert f"step in {then * 1e3:.3f} ms against {now * 1e3:.3f} ms here" in note
    assert then < 0.95 * now
    assert not any("offload_overlap" in w for w in overlapped.warnings)
    roomy = plan_traced(traced, mesh, precision="bf16-mixed", memory_budget=80e9)
    assert not any(st.mode == "offload" for st in roomy.param_state.values())
    assert not any("offload_overlap" in w for w in roomy.warnings)
