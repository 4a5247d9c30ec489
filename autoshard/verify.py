"""Prove a plan by running it: gloo ranks on this machine against the single-device model.

Every rank builds the same model (same seed), runs one training step of the per-rank program and
of the whole model, and reports the largest relative error of the loss and of every gradient, and
each collective's bytes as counted at run time against the plan's ledger.
"""
from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.codegen.runtime import parallelize
from autoshard.codegen.world import World
from autoshard.errors import AutoshardError
from autoshard.loss import as_loss_module
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.solver.baselines import baseline_plan
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.zoo.registry import load_model


@dataclass(frozen=True)
class VerifySpec:
    model: str                   # zoo name or path/to/file.py:factory
    mesh_shape: tuple[int, ...]
    axes: tuple[str, ...]
    plan_json: str
    batch: int | None = None
    seq: int | None = None
    seed: int = 0


def build(spec_model: str, batch: int | None, seq: int | None, seed: int):
    torch.manual_seed(seed)
    model, inputs = load_model(spec_model, batch=batch, seq=seq, device="cpu")
    model = model.float().train()
    inputs = tuple(t.float() if t.is_floating_point() else t for t in inputs)
    return model, inputs


# Errors are relative to the tensor's largest magnitude, floored at 1e-3: some exact gradients
# are zero up to rounding (an attention key bias cancels in softmax), and relative noise on
# a zero is no error. With fp32 on gloo, 1e-5 of that is the tolerance.
ERR_FLOOR = 1e-3


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    if not want.numel():
        return 0.0
    return (got - want).abs().max().item() / max(want.abs().max().item(), ERR_FLOOR)


def ledger_diff(plan_records: list[tuple], run_records: list[tuple]) -> list[str]:
    """Collectives in one list and not the other, as readable lines (empty when equal)."""
    a, b = Counter(plan_records), Counter(run_records)
    out = [f"planned, not run: {k} x{n}" for k, n in (a - b).items()]
    out += [f"run, not planned: {k} x{n}" for k, n in (b - a).items()]
    return sorted(out)


def verify_rank(spec: VerifySpec) -> dict[str, Any]:
    """Runs on every rank of an initialised gloo world. A user mistake found here comes back as
    ``{"error": (expected, got, fix)}`` for the parent to raise as one line: raised here, World
    would hand it back as a RankError holding a traceback."""
    try:
        return _run_rank(spec)
    except AutoshardError as e:
        return {"error": (e.expected, e.got, e.fix)}


def _run_rank(spec: VerifySpec) -> dict[str, Any]:
    model, inputs = build(spec.model, spec.batch, spec.seq, spec.seed)
    ref = as_loss_module(copy.deepcopy(model))
    ref_loss = ref(*inputs)
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    ref_grads = {n.removeprefix("model."): p.grad for n, p in ref.named_parameters() if p.grad is not None}

    plan = Plan.loads(spec.plan_json)
    pm = parallelize(model, Mesh(spec.mesh_shape, spec.axes), plan=plan, example_inputs=inputs)
    loss = pm.step(*pm.shard_inputs(*inputs))
    grads = pm.full_grads()
    grad_errs = {n: rel_err(grads[n], g) for n, g in ref_grads.items() if n in grads}
    missing = sorted(set(ref_grads) - set(grads))
    planned = [(c.kind, c.axes, c.bytes, c.phase, c.node) for c in plan.collectives]
    ran = [(r.kind, r.axes, r.nbytes, r.phase, r.node) for r in pm.ledger]
    return {
        "loss": float(loss), "ref_loss": float(ref_loss.detach()),
        "loss_err": abs(float(loss) - float(ref_loss)) / max(abs(float(ref_loss)), 1e-30),
        "grad_errs": grad_errs, "missing_grads": missing,
        "ledger_diff": ledger_diff(planned, ran),
        "collectives": len(ran), "bytes": sum(r.nbytes for r in pm.ledger),
        "planned_bytes": sum(c.bytes for c in plan.collectives),
    }


def plan_for(model_name: str, mesh, *, batch: int | None = None, seq: int | None = None,
             baseline: str | None = None, seed: int = 0, **plan_kwargs: Any):
    traced = trace(*build(model_name, batch, seq, seed))
    if baseline:
        return baseline_plan(traced, mesh, baseline, **plan_kwargs)
    return plan_traced(traced, mesh, model_name=model_name, **plan_kwargs)


def summarize(reports: list[dict[str, Any]], tolerance: float) -> tuple[bool, str]:
    r = reports[0]
    worst = max(r["grad_errs"].items(), key=lambda kv: kv[1], default=("-", 0.0))
    lines = [f"loss {r['loss']:.6f} vs single device {r['ref_loss']:.6f}: rel err {r['loss_err']:.2e}",
             f"gradients: {len(r['grad_errs'])} compared, largest rel err {worst[1]:.2e} ({worst[0]})",
             f"collectives per rank: {r['collectives']}, {r['bytes']} bytes run, "
             f"{r['planned_bytes']} bytes planned"]
    ok = r["loss_err"] <= tolerance and worst[1] <= tolerance and not r["missing_grads"]
    for rank, rep in enumerate(reports):
        if rep["ledger_diff"]:
            ok = False
            lines.append(f"rank {rank}: run-time collectives differ from the plan:")
            lines += [f"  {d}" for d in rep["ledger_diff"][:20]]
        if rep["missing_grads"]:
            lines.append(f"rank {rank}: no gradient for {rep['missing_grads'][:5]}")
        if rep["loss_err"] > tolerance or max(rep["grad_errs"].values(), default=0) > tolerance:
            bad = sorted(((e, n) for n, e in rep["grad_errs"].items() if e > tolerance), reverse=True)
            lines.append(f"rank {rank}: beyond tolerance {tolerance:g}: loss {rep['loss_err']:.2e}; "
                         + ", ".join(f"{n} {e:.2e}" for e, n in bad[:5]))
            ok = False
    lines.append("PASS" if ok else "FAIL")
    return ok, "\n".join(lines)


def verify(model_name: str, mesh: Mesh, *, plan: Plan | None = None, batch: int | None = None,
           seq: int | None = None, baseline: str | None = None,
           tolerance: float = 1e-5) -> tuple[bool, str]:
    """Run ``plan`` (or a fresh plan, or a hand-written ``baseline``) on ``mesh.size`` gloo ranks
    here; (passed, report)."""
    if not (isinstance(tolerance, (int, float)) and 0 < tolerance < math.inf):   # nan fails too
        raise AutoshardError("a tolerance that is a positive number", got=repr(tolerance),
                             fix="e.g. --tolerance 1e-5")
    if plan is not None and baseline:
        raise AutoshardError("a plan file or a baseline to verify, not both",
                             got=f"a plan and baseline {baseline!r}", fix="drop one of them")
    if plan is not None:
        check_plan(plan, model_name, mesh, batch=batch, seq=seq)
    else:
        plan = plan_for(model_name, mesh, batch=batch, seq=seq, baseline=baseline)
    spec = VerifySpec(model_name, mesh.shape, mesh.axes, plan.dumps(), batch, seq)
    with World(mesh.size, timeout_s=600) as world:
        reports = world.run(verify_rank, spec)
    for r in reports:
        if "error" in r:
            expected, got, fix = r["error"]
            raise AutoshardError(expected, got=f"{got} (on the gloo ranks)", fix=fix)
    return summarize(reports, tolerance)


def check_plan(plan: Plan, model_name: str, mesh: Mesh, *, batch: int | None,
               seq: int | None) -> None:
    """Refuse, before any rank is spawned, a plan that cannot run here: one made for another
    mesh, for forward only (verify runs a training step), or for another model or input shapes
    (a stale plan). The ranks would find the same, but late and as tracebacks."""
    plan.check_mesh(mesh.shape, mesh.axes)
    if not plan.training:
        raise AutoshardError("a plan made for training: verify runs a training step",
                             got="a forward-only plan (options.training is false)",
                             fix="re-plan without --inference")
    traced = trace(*build(model_name, batch, seq, seed=0))
    plan.check_matches(traced.fingerprint, traced.node_sigs)
