"""The optimizer step and gradient accumulation as parts of the step program (cost/program.py):
the optimizer step's records against their closed forms (docs/cost-model.md §4.6), the liveness
walk's optimizer phase read from them, and gradient accumulation priced as N micro-steps, one
gradient sync and one optimizer step, the gradients held across micro-steps (§7.2)."""
from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from autoshard import Mesh, Plan
from autoshard.cost.liveness import step_memory
from autoshard.cost.price import Pricer
from autoshard.cost import program
from autoshard.cost.program import program_for
from autoshard.cost.state import state_spec
from autoshard.errors import AutoshardError
from autoshard.ir import local_shape
from autoshard.options import PlanOptions
from autoshard.solver.assemble import assemble
from autoshard.solver.planner import plan_traced
from autoshard.trace.batches import Traces
from autoshard.trace.export import trace
from autoshard.zoo.registry import get_model
from dist import world_fixture

CLUSTER = str(Path(__file__).parent / "data" / "compute_bound.json")


@pytest.fixture(scope="module")
def gpt2():
    return trace(*get_model("gpt2-tiny", batch=8))


@pytest.fixture(scope="module")
def gpt2_bf16():
    model, inputs = get_model("gpt2-tiny", batch=8)
    traces = Traces(model, inputs, training=True, precision="bf16-mixed")
    return traces.at(traces.full)


def _local(ph, spec, mesh_shape) -> int:
    return math.prod(local_shape(tuple(ph.info.shape), spec, mesh_shape))


def _inputs(traced, plan, mesh_shape) -> int:
    """The step's inputs on one device, in the layouts the plan reads them in."""
    strategies = plan.strategies()
    return sum(_local(p, strategies[p.name].outputs[0], mesh_shape) * p.info.dtype.itemsize
               for p in traced.inputs)


@pytest.mark.parametrize("zero", ["none", "zero2"])
def test_optimizer_records_are_the_closed_forms(gpt2_bf16, zero):
    """Per updated parameter of a bf16-mixed plan under Adam (docs/cost-model.md §4.6): a
    moment is its state shard's elements x 4 bytes, the gradient's fp32 cast one more, and
    under ZeRO-2 the gather back makes its local parameter (2 bytes an element)."""
    traced = gpt2_bf16
    mesh = Mesh((2,), cluster=CLUSTER)
    plan = plan_traced(traced, mesh, zero=zero, offload="none", recompute="none")
    pricer = Pricer(traced, mesh, plan.options)
    prog = program_for(traced, plan.strategies(), pricer)
    ups = {u.name: u for u in prog.optimizer.params}
    assert set(ups) == {ph.name for ph in traced.params}
    for ph in traced.params:
        u, spec = ups[ph.name], plan.params[ph.fqn]
        sspec = state_spec(tuple(ph.info.shape), spec, mesh.shape) if u.mode else None
        ns = _local(ph, sspec or spec, mesh.shape)
        assert (u.moment, u.cast, u.host) == (4 * ns, 4 * ns, ())
        assert u.gather == (_local(ph, spec, mesh.shape) * 2 if sspec else 0)
        # The optimizer state on the device is three moments (momentum, variance, master).
        assert pricer.state_bytes(ph.name, plan.strategies()[ph.name]).optimizer == 3 * u.moment
    # The phase the walk checks: the model state, the step's inputs, and the largest moment.
    live = step_memory(traced, plan.strategies(), pricer, program=prog)
    state = live.state
    extra = max(x for _, x in prog.optimizer.moments())
    assert extra == sum(u.cast for u in ups.values()) or zero == "zero2"
    assert live.phases["optimizer"] == state["parameters"] + state["gradients"] \
        + state["optimizer"] + _inputs(traced, plan, mesh.shape) + extra


def test_offload_records_carry_the_host_copies(gpt2):
    """Optimizer offload: no moment on the device, the gradient shard down and the updated
    shard up (§9), the same copies the plan's host transfers list."""
    mesh = Mesh((2,), cluster=CLUSTER)
    plan = plan_traced(gpt2, mesh, offload="optimizer", recompute="none")
    prog = program_for(gpt2, plan.strategies(), Pricer(gpt2, mesh, plan.options))
    listed = sorted((t.direction, t.bytes, t.value) for t in plan.host_transfers
                    if t.phase == "optimizer")
    ran = sorted((d, n, u.name) for u in prog.optimizer.params for d, n in u.host)
    assert ran == listed and ran
    for u in prog.optimizer.params:
        assert u.moment == 0 and u.mode == "offload"
        (d1, n1), (d2, n2) = u.host
        assert (d1, d2) == ("d2h", "h2d") and n1 == n2


def test_update_implementations_are_program_records(gpt2):
    mesh = Mesh((1,), cluster=CLUSTER)
    plan = plan_traced(gpt2, mesh, recompute="none")
    pricer = Pricer(gpt2, mesh, plan.options)
    moments = [u.moment for u in program_for(gpt2, plan.strategies(), pricer).optimizer.params]
    phase = {u: step_memory(gpt2, plan.strategies(), pricer, update=u).phases["optimizer"]
             for u in ("fused", "foreach", "loop")}
    assert phase["foreach"] - phase["fused"] == sum(moments)
    pairs = [moments[0] * 2] + [p + 2 * m for p, m in zip(moments, moments[1:])]
    assert phase["loop"] - phase["fused"] == max(pairs)
    with pytest.raises(AutoshardError, match="fused"):
        step_memory(gpt2, plan.strategies(), pricer, update="adam")


@pytest.mark.parametrize("update", ["fused", "foreach"])
def test_the_update_runs_in_pieces_of_at_most_piece_bytes(gpt2_bf16, monkeypatch, update):
    """The device's update in pieces (docs/cost-model.md §4.5): maximal runs, in order, of at
    most ``PIECE_BYTES`` of moment (one larger parameter alone); the phase's moment is the
    largest piece's casts (fused) or casts and moments (foreach), not every parameter's."""
    traced = gpt2_bf16
    mesh = Mesh((1,), cluster=CLUSTER)
    plan = plan_traced(traced, mesh, zero="none", offload="none", recompute="none")
    pricer = Pricer(traced, mesh, plan.options)
    whole = program_for(traced, plan.strategies(), pricer, update=update)
    stepped = [u for u in whole.optimizer.params if u.moment]
    monkeypatch.setattr(program, "PIECE_BYTES", sum(u.moment for u in stepped) // 5)
    prog = program_for(traced, plan.strategies(), pricer, update=update)
    pieces = prog.optimizer.pieces()
    assert len(pieces) > 3 and [u for p in pieces for u in p] == stepped
    for p, after in zip(pieces, pieces[1:] + [()]):
        size = sum(u.moment for u in p)
        assert size <= program.PIECE_BYTES or len(p) == 1
        assert not after or size + after[0].moment > program.PIECE_BYTES
    extra = [sum(u.cast + (u.moment if update == "foreach" else 0) for u in p) for p in pieces]
    assert max(x for _, x in prog.optimizer.moments()) == max(extra)
    phase = step_memory(traced, plan.strategies(), pricer, program=prog).phases["optimizer"]
    state = step_memory(traced, plan.strategies(), pricer, program=whole).state
    assert phase == state["parameters"] + state["gradients"] + state["optimizer"] \
        + _inputs(traced, plan, mesh.shape) + max(extra)


def test_gradients_sent_to_the_host_in_backward_leave_the_device(gpt2):
    """Optimizer offload under offload_overlap="backward" (docs/cost-model.md §9.1): each
    gradient that is a parameter's whole ``.grad`` goes to the host as autograd completes it
    (codegen/hostopt.py), and the walk frees it there: at the end of backward the device holds
    the plain schedule's bytes less exactly those gradients. Where the state is cut over a
    zero axis (its gradient reduce-scattered by a bucket) it lands at the step."""
    mesh = Mesh((1,), cluster=CLUSTER)
    ends = {}
    for overlap in ("none", "backward", "delayed"):
        plan = plan_traced(gpt2, mesh, offload="optimizer", offload_overlap=overlap,
                           recompute="none")
        pricer = Pricer(gpt2, mesh, plan.options)
        prog = program_for(gpt2, plan.strategies(), pricer)
        offloaded = {u.name for u in prog.optimizer.params if u.mode == "offload"}
        assert offloaded
        assert prog.released == (offloaded if overlap == "backward" else frozenset())
        log: list = []
        step_memory(gpt2, plan.strategies(), pricer, program=prog, log=log)
        ends[overlap] = next(b for ph, at, b in log if at == "end of backward")
        grads = sum(pricer.state_bytes(n, plan.strategies()[n]).gradients for n in offloaded)
    assert ends["none"] == ends["delayed"] and ends["none"] - ends["backward"] == grads > 0
    wide = plan_traced(gpt2, Mesh((2,), cluster=CLUSTER), offload="optimizer",
                       offload_overlap="backward", recompute="none")
    prog = program_for(gpt2, wide.strategies(), Pricer(gpt2, Mesh((2,), cluster=CLUSTER),
                                                       wide.options))
    cut = {u.name for u in prog.optimizer.params if u.mode == "offload" and u.state is not None}
    assert cut and not cut & prog.released
    assert all(u.state is None and u.name not in prog.bucket_of
               for u in prog.optimizer.params if u.name in prog.released)


# -- gradient accumulation ---------------------------------------------------------------------

def test_accumulation_steps_is_validated():
    assert PlanOptions().accumulation_steps == 1
    assert "accumulation_steps" not in PlanOptions().to_json()
    assert PlanOptions.from_json(PlanOptions(accumulation_steps=4).to_json()) \
        == PlanOptions(accumulation_steps=4)
    for bad in (0, -1, 2.0, True, "4"):
        with pytest.raises(AutoshardError, match="accumulation_steps"):
            PlanOptions(accumulation_steps=bad)
    with pytest.raises(AutoshardError, match="training"):
        PlanOptions(accumulation_steps=2, training=False)
    with pytest.raises(AutoshardError, match="microbatches"):
        PlanOptions(accumulation_steps=2, pipeline="pp")


def _assemble(traced, mesh, strategies, options):
    return assemble(traced, mesh, strategies, options, solver={}, model_name="", timings={})


@pytest.mark.parametrize("zero", ["none", "zero2"])
def test_accumulation_is_priced_as_n_micro_steps_one_sync_one_update(gpt2, zero):
    """docs/cost-model.md §7.2: T(N) = N·(C + B) + O + G + max(0, S − W) for the same
    layouts, with C the forward and backward compute, B the blocking collectives, O the
    optimizer step, G its gathers (ZeRO), S the gradient sync and W one micro-step's backward
    window; memory: each gradient whole across micro-steps."""
    n = 4
    mesh = Mesh((2,), cluster=CLUSTER)
    one = plan_traced(gpt2, mesh, zero=zero, offload="none", recompute="none")
    st = one.strategies()
    acc = _assemble(gpt2, mesh, st, one.options.replace(accumulation_steps=n))
    p1, pn = one.predicted, acc.predicted
    opt = p1.optimizer_s
    pricer = Pricer(gpt2, mesh, one.options)
    window = sum(pricer.backward(k, s) for k, s in st.items())
    sync = sum(p1.overlapped_comm_s.values())      # all of it hidden on this cluster
    assert sync < window
    # The updated shards' gathers after the step (ZeRO-2) run once; the rest every micro-step.
    gathers = sum(pricer.optimizer_comm_seconds(k, s) for k, s in st.items()
                  if k in pricer.params)
    assert (gathers > 0) == (zero == "zero2")
    blocking = p1.comm_s - sync - gathers
    assert pn.compute_s == pytest.approx(n * (p1.compute_s - opt) + opt, rel=1e-12)
    assert pn.optimizer_s == pytest.approx(opt, rel=1e-12)
    assert pn.comm_s == pytest.approx(n * blocking + gathers + sync, rel=1e-12)
    assert pn.step_time_s == pytest.approx(
        n * (p1.compute_s - opt + blocking) + opt + gathers + max(0.0, sync - window),
        rel=1e-12)
    # One micro-step's window: the sync no longer hidden once it exceeds it.
    pricer_n = Pricer(gpt2, mesh, acc.options)
    assert sum(pricer_n.backward(k, s) for k, s in st.items()) == pytest.approx(window)
    # Memory: the program holds every trainable gradient whole; the forward phase carries it.
    prog = program_for(gpt2, st, pricer_n)
    whole = {ph.name: _local(ph, one.params[ph.fqn], mesh.shape) * 4 for ph in gpt2.params}
    assert dict(prog.held) == whole
    assert pn.memory.peak >= p1.memory.peak
    m1 = step_memory(gpt2, st, pricer)
    mn = step_memory(gpt2, st, pricer_n, program=prog)
    assert mn.phases["forward"] == m1.phases["forward"] + sum(whole.values())
    # The ILP's sum: what ZeRO-2 keeps of a gradient after the sync, raised to the whole one.
    shard = sum(pricer.state_bytes(k, st[k]).gradients for k in whole)
    assert pn.ilp_sum_bytes - p1.ilp_sum_bytes == pytest.approx(
        sum(whole.values()) - shard)
    assert (shard < sum(whole.values())) == (zero == "zero2")


def test_the_planner_plans_with_accumulation(gpt2):
    mesh = Mesh((2,), cluster=CLUSTER)
    p = plan_traced(gpt2, mesh, accumulation_steps=2, recompute="none")
    assert p.options.accumulation_steps == 2
    assert json.loads(p.dumps())["options"]["accumulation_steps"] == 2
    assert Plan.loads(p.dumps()).options.accumulation_steps == 2


# -- pipeline stages: each stage's peak is the walk of its part of the step program ------------

def _stage_setup(plan, model: str = "gpt2-tiny"):
    """The traced microbatch, the sub-mesh strategies, the pricer and each stage's layer range
    of a pipelined plan, rebuilt from the plan alone."""
    from dataclasses import replace

    from autoshard.solver.pipeline import sub_mesh
    from autoshard.solver.planner import microbatch
    from autoshard.trace.layers import stages_of
    from autoshard.tools.verify import build
    pl = plan.pipeline
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster=plan.cluster)
    a = mesh.axes.index(pl.axis)
    model_, inputs = build(model, None, None, 0)
    traced = trace(model_, microbatch(inputs, pl.microbatches))
    cut = lambda spec: None if spec is None else spec[:a] + spec[a + 1:]     # noqa: E731
    strategies = {n: replace(s, inputs=tuple(cut(x) for x in s.inputs),
                             outputs=tuple(cut(x) for x in s.outputs))
                  for n, s in plan.strategies().items()}
    sub = sub_mesh(mesh, a)
    pricer = Pricer(traced, sub, plan.options.replace(pipeline=None, microbatches="auto"),
                    recompute=dict(plan.recompute))
    names = [layer.name for layer in traced.layers]
    where = stages_of(traced.graph, traced.layers, tuple((n,) for n in names))
    ranges = [(names.index(st.layers[0]), names.index(st.layers[-1]) + 1) for st in pl.stages]
    return traced, strategies, sub, pricer, where, ranges


@pytest.fixture(scope="module")
def gpt2_pp():
    from autoshard.tools.verify import plan_for
    return plan_for("gpt2-tiny", Mesh((2, 2), ("pp", "dp"), cluster=CLUSTER), pipeline="pp",
                    microbatches=4, schedule="1F1B")


def test_a_stage_peak_is_the_walk_of_its_program(gpt2_pp):
    from autoshard.cost.liveness import stage_memory
    from autoshard.cost.program import stage_program
    from autoshard.schedules import in_flight
    traced, st, sub, pricer, where, ranges = _stage_setup(gpt2_pp)
    prog = program_for(traced, st, pricer)
    pl = gpt2_pp.pipeline
    for s, (lo, hi) in enumerate(ranges):
        ops = frozenset(n for n, i in where.items() if lo <= i < hi)
        sp = stage_program(prog, traced, st, ops, sub.shape,
                           bucket_bytes=pricer.options.bucket_bytes)
        k = in_flight(pl.schedule, s, len(ranges), pl.microbatches)
        walked = stage_memory(traced, st, pricer, sp, in_flight=k)
        assert pl.stages[s].predicted.peak_bytes == walked.peak
        # Its state is its own parameters' alone; more microbatches in flight, more memory.
        mine = {ref for n in traced.graph.nodes if n.name in ops and n.op == "call_function"
                for ref, _ in [(a.name, 0) for a in n.all_input_nodes]} & {
            p.name for p in traced.params}
        assert walked.state["parameters"] == sum(
            pricer.state_bytes(p, st[p]).parameters for p in mine)
        assert {u.name for u in sp.optimizer.params} == mine - set(pricer.tied_to)
        if k > 1:
            assert walked.peak > stage_memory(traced, st, pricer, sp).peak


def test_the_whole_program_as_one_stage_is_the_step_walk(gpt2):
    from autoshard.cost.liveness import stage_memory
    from autoshard.cost.program import stage_program
    mesh = Mesh((2,), cluster=CLUSTER)
    for kw in (dict(zero="zero2"), dict(recompute="full"), dict(offload="parameters")):
        plan = plan_traced(gpt2, mesh, **kw)
        st = plan.strategies()
        pricer = Pricer(gpt2, mesh, plan.options, recompute=plan.recompute)
        prog = program_for(gpt2, st, pricer)
        every = frozenset(n.name for n in gpt2.graph.nodes if n.op == "call_function")
        sp = stage_program(prog, gpt2, st, every, mesh.shape,
                           bucket_bytes=plan.options.bucket_bytes)
        assert stage_memory(gpt2, st, pricer, sp) == step_memory(gpt2, st, pricer, program=prog)


def test_pipelined_plans_hold_their_stages_walked_peaks_to_the_budget(gpt2_pp):
    from autoshard.cost.memory import budget_for, device_budget
    from autoshard.tools.verify import plan_for
    top = max(st.predicted.peak_bytes for st in gpt2_pp.pipeline.stages)
    for f in (1.5, 1.0, 0.9):
        budget = budget_for(top * f)
        try:
            p = plan_for("gpt2-tiny", Mesh((2, 2), ("pp", "dp"), cluster=CLUSTER),
                         pipeline="pp", microbatches=4, schedule="1F1B", memory_budget=budget)
        except AutoshardError as e:
            assert f < 1, (f, e)
            continue
        assert all(st.predicted.peak_bytes <= device_budget(p.cluster, budget)
                   for st in p.pipeline.stages), f


# -- accumulation at run time: what the plan counts once runs once ------------------------------

world2 = world_fixture(2, timeout_s=600)


def _accumulate(plan_json: str) -> tuple[list, list, list, list]:
    """On one rank: one optimizer step of the plan's micro-steps, all but the last under
    ``pm.no_sync()``; the collectives and host copies it ran, and those the ledger lists, each
    as often as its ``count`` says."""
    import torch

    from autoshard.codegen.parallelize import parallelize
    from autoshard.tools.verify import build
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    opt = pm.optimizer(torch.optim.AdamW, lr=1e-3)
    local = pm.shard_inputs(*inputs)
    n = plan.options.accumulation_steps
    ran, host = [], []

    def seen():       # each forward starts the ledger anew: keep what each micro-step ran
        ran.extend((r.kind, r.axes, r.nbytes, r.phase, r.node) for r in pm.ledger)
        host.extend((t.direction, t.nbytes, t.phase, t.node, t.value) for t in pm.ledger.host)
    with pm.no_sync():
        for _ in range(n - 1):
            pm.step(*local)
            seen()
    pm.step(*local)
    opt.step()
    seen()
    listed = [(c.kind, c.axes, c.bytes, c.phase, c.node) for c in plan.collectives
              for _ in range(c.count)]
    host_listed = [(t.direction, t.bytes, t.phase, t.node, t.value) for t in plan.host_transfers
                   for _ in range(t.count)]
    return sorted(ran), sorted(listed), sorted(host), sorted(host_listed)


@pytest.mark.slow
@pytest.mark.parametrize("state", [{"zero": "zero2", "offload": "none"},
                                   {"offload": "parameters"}])
def test_an_accumulating_step_runs_its_ledger_exactly(world2, state):
    """A plan of N = 3 micro-steps (§7.2): the runtime runs every collective and host copy of
    the ledger as often as its ``count`` says, the forward and backward ones N times, each
    gradient bucket and the optimizer's gathers and copies once."""
    from autoshard.tools.verify import build
    n = 3
    plan = plan_traced(trace(*build("gpt2-tiny", None, None, 0)), Mesh((2,), cluster=CLUSTER),
                       accumulation_steps=n, recompute="none", bucket_mb=0.05, **state)
    ran, listed, host, host_listed = world2.run(_accumulate, plan.dumps())[0]
    assert any(c.phase == "grad_sync" and c.count == 1 for c in plan.collectives)
    assert any(c.phase == "forward" and c.count == n for c in plan.collectives)
    assert ran == listed
    assert host == host_listed
    assert bool(host) == (state["offload"] == "parameters")


def _stepped_in_pieces(plan_json: str, piece_bytes: int) -> dict:
    """On one rank: 3 AdamW steps through pm.optimizer, with the update's pieces of
    ``piece_bytes``; the masters with a gradient at each call of the
    wrapped optimizer's step, the pieces, and the parameters after the last step."""
    was, program.PIECE_BYTES = program.PIECE_BYTES, piece_bytes
    try:
        return _steps(plan_json)
    finally:
        program.PIECE_BYTES = was


def _steps(plan_json: str) -> dict:
    import torch

    from autoshard.codegen.parallelize import parallelize
    from autoshard.tools.verify import build
    plan = Plan.loads(plan_json)
    model, inputs = build("gpt2-tiny", None, None, 0)
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    calls: list[list[int]] = []

    class Seen(torch.optim.AdamW):
        def step(self, closure=None):
            calls.append([id(p) for g in self.param_groups for p in g["params"]
                          if p.grad is not None])
            return super().step(closure)

    opt = pm.optimizer(Seen, lr=1e-2, weight_decay=0.1)
    name = {id(e.master): e.placeholder for e in opt.entries}
    local = pm.shard_inputs(*inputs)
    grads = []
    for _ in range(3):
        pm.step(*local)
        before = {k: v.grad for k, v in pm.named_parameters()}
        opt.step()
        grads.append(all(before[k] is v.grad for k, v in pm.named_parameters()))
        opt.zero_grad()
    return {"calls": [[name[i] for i in c] for c in calls], "grads_kept": all(grads),
            "pieces": [[e.placeholder for e in p] for p in opt.pieces],
            "params": {k: v.clone() for k, v in pm.full_state_dict().items()}}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-mixed", "model"])
def test_an_update_in_pieces_steps_each_parameter_once_as_one_update_does(world2, precision):
    """codegen/optim.py steps the wrapped optimizer once per piece of the step program
    (cost/program.py ``OptimizerStep.pieces``), each call seeing its piece's gradients only
    (16-bit ones cast for their masters; fp32 parameters are their own masters); the
    parameters after 3 steps equal, bit for bit, those of one update over everything, and the
    parameters' own gradients are left as backward made them."""
    from autoshard.tools.verify import plan_for
    plan = plan_for("gpt2-tiny", Mesh((2,), cluster=CLUSTER), baseline="dp", zero="none",
                    precision=precision).dumps()
    whole = world2.run(_stepped_in_pieces, plan, program.PIECE_BYTES)[0]
    cut = world2.run(_stepped_in_pieces, plan, 16 << 10)[0]
    assert len(whole["pieces"]) == 1 and len(cut["pieces"]) > 2
    assert cut["calls"] == cut["pieces"] * 3 and whole["calls"] == whole["pieces"] * 3
    assert cut["grads_kept"] and whole["grads_kept"]
    assert cut["params"].keys() == whole["params"].keys()
    assert all(torch.equal(cut["params"][k], whole["params"][k]) for k in cut["params"])


# -- the ledger counts what runs per micro-step --------------------------------------------------

@pytest.mark.parametrize("offload", ["none", "parameters"])
def test_the_ledger_counts_each_record_as_often_as_the_step_runs_it(gpt2, offload):
    """docs/plan-format.md: under ``accumulation_steps=N`` every record of forward and backward
    (collectives and host copies) has ``count`` N, a gradient bucket and the optimizer's once;
    the same layouts without accumulation list the same records once each."""
    n = 3
    mesh = Mesh((2,), cluster=CLUSTER)
    one = plan_traced(gpt2, mesh, zero="zero2", offload=offload, recompute="none")
    acc = assemble(gpt2, mesh, one.strategies(), one.options.replace(accumulation_steps=n),
                   solver=one.solver, model_name="", timings={})
    per_step = lambda r: r.phase == "optimizer" or getattr(r, "members", ())    # noqa: E731
    assert [c.count for c in acc.collectives] == [1 if per_step(c) else n
                                                  for c in acc.collectives]
    assert [replace(c, count=1) for c in acc.collectives] == list(one.collectives)
    assert all(c.count == 1 for c in one.collectives)
    assert [t.count for t in acc.host_transfers] == [
        1 if t.phase in ("optimizer", "grad_sync") else n for t in acc.host_transfers]
    assert [replace(t, count=1) for t in acc.host_transfers] == list(one.host_transfers)
    assert bool(acc.host_transfers) == (offload == "parameters")
    # The file says so, and reads back the same.
    data = json.loads(acc.dumps())
    assert {c.get("count", 1) for c in data["collectives"]} == {1, n}
    back = Plan.loads(acc.dumps())
    assert back.collectives == acc.collectives and back.host_transfers == acc.host_transfers


# -- the command line --------------------------------------------------------------------------

def test_the_cli_plans_with_accumulation_and_show_says_so(tmp_path, capsys):
    from autoshard.tools.cli import main
    path = tmp_path / "acc.json"
    assert main(["plan", "gpt2-tiny", "--mesh", "2", "--cluster", CLUSTER,
                 "--accumulation-steps", "3", "--recompute", "none", "--quiet",
                 "-o", str(path)]) == 0
    plan = Plan.load(path)
    assert plan.options.accumulation_steps == 3
    assert any(c.count == 3 for c in plan.collectives)
    capsys.readouterr()
    assert main(["show", str(path)]) == 0
    assert "gradient accumulation: 3 micro-steps per optimizer step" in capsys.readouterr().out


@pytest.mark.parametrize("flags, says", [
    (["--accumulation-steps", "0"], "argument --accumulation-steps: a positive integer"),
    (["--accumulation-steps", "2", "--inference"], "training plan"),
    (["--accumulation-steps", "2", "--pipeline", "auto"], "on a pipeline")])
def test_the_cli_refuses_a_bad_accumulation(flags, says, capsys):
    from autoshard.tools.cli import main
    try:
        code = main(["plan", "gpt2-tiny", "--mesh", "2", "--quiet", *flags])
    except SystemExit as e:       # a number the flag cannot take: argparse's usage error
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert says in err and "error" in err and "Traceback" not in err


@pytest.mark.slow
def test_verify_runs_the_micro_steps_of_an_accumulating_plan():
    """``autoshard verify`` of a plan of 3 micro-steps: the ledger (every count) and the host
    copies hold exactly, the gradients are one micro-step's (the sum over the 3 divided by 3),
    and the memory line says what it measured."""
    from autoshard.tools.verify import plan_for, verify
    mesh = Mesh((2,), cluster=CLUSTER)
    plan = plan_for("gpt2-tiny", mesh, accumulation_steps=3, zero="zero2", offload="none",
                    recompute="none", bucket_mb=0.05)
    assert any(c.count == 3 for c in plan.collectives)
    ok, report = verify("gpt2-tiny", mesh, plan=plan)
    assert ok, report
    assert "the last of 3 micro-steps of forward and backward" in report
    assert "not measured" not in report


def test_the_graph_is_read_once_for_every_pricing(gpt2) -> None:
    """What pricing reads off the traced graph (every value's shape, which nodes carry a
    gradient) is read once per traced model and shared by every pricing after it: the offload
    and memory passes price a plan many times, and each pricing walked the whole graph for
    them again."""
    from autoshard.cost.reshards import grad_values, traced_grads
    options = PlanOptions()
    first, second = (Pricer(gpt2, Mesh((2,), cluster=CLUSTER), options),
                     Pricer(gpt2, Mesh((2, 2), cluster=CLUSTER), options))
    assert first.shapes is second.shapes is gpt2.value_shapes
    assert first.grads is second.grads is traced_grads(gpt2)
    # ... and they are what reading the graph gives
    assert first.grads == grad_values(gpt2.graph, {p.name for p in gpt2.params})
    assert len(first.shapes) > len(gpt2.params)
