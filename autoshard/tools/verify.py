"""Prove a plan by running it: gloo ranks on this machine against the single-device model.

Every rank builds the same model (same seed), runs one training step of the per-rank program and
of the whole model, and reports the largest relative error of the loss and of every gradient, and
each collective's bytes as counted at run time against the plan's ledger.

After that comparison, each rank measures the peak memory of a full training step of its program
(:func:`measure_step_memory`: forward, backward and the optimizer step, with its optimizer state
already there) beside the plan's predicted peak. The measurement runs on the same per-rank module
once its gradients have been compared, so it cannot change them.
"""
from __future__ import annotations

import contextlib
import copy
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.codegen.parallelize import parallelize
from autoshard.codegen.world import World
from autoshard.errors import AutoshardError
from autoshard.precision import cast_inputs, running_as
from autoshard.loss import as_loss_module
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.solver.baselines import baseline_plan
from autoshard.tools.draws import KeepAll
from autoshard.solver.planner import plan, plan_traced, trace_for
from autoshard.trace.batches import check_plannable
from autoshard.trace.export import trace
from autoshard.zoo.registry import load_model


@dataclass(frozen=True)
class VerifySpec:
    model: str                   # zoo name, path/to/file.py:factory or a HF config.json
    mesh_shape: tuple[int, ...]
    axes: tuple[str, ...]
    plan_json: str
    batch: int | None = None
    seq: int | None = None
    seed: int = 0
    task: str | None = None      # of a Hugging Face config (default: from the config)
    measure_memory: bool = True  # also measure the peak memory of a training step
    compile: bool = False        # also run the compiled rank program, against the eager one


def build(spec_model: str, batch: int | None, seq: int | None, seed: int,
          task: str | None = None):
    """The model and its example inputs, in the model's own dtypes: the plan the user runs is
    the one verified (a bf16 model is not cast to fp32)."""
    torch.manual_seed(seed)
    model, inputs = load_model(spec_model, batch=batch, seq=seq, device="cpu", task=task)
    return model.train(), tuple(inputs)


# Errors are relative to the tensor's largest magnitude. A gradient that is zero in exact
# arithmetic (a bias before a BatchNorm, an attention key bias under softmax) comes out as
# rounding noise of the size of the terms summed into it: relative to itself that is any number.
# Such a near-zero gradient is judged against the whole gradient instead: the denominator is at
# least the root-mean-square entry of every parameter's gradient together (grad_scale), so an
# error counts by how much it moves the step's update. With fp32 on gloo, 1e-5 of that is the
# tolerance.
ERR_FLOOR = 1e-3        # the floor of rel_err's other callers (parameters compared after steps)
FP32_TOLERANCE = 1e-5
# A 16-bit model is compared with an fp32 copy of itself on one device. Its own rounding is then
# part of every error, so the tolerance is the error the single device makes in the model's
# dtype, measured in the same run, times this margin (a sharded step sums in another order and
# reduces 16-bit partial sums), and at least the dtype's unit roundoff times it.
LOW_PRECISION_MARGIN = 4.0
REFERENCE_DTYPE = torch.float32


def rel_err(got: torch.Tensor, want: torch.Tensor, floor: float = ERR_FLOOR) -> float:
    """The largest absolute difference over ``want``'s largest magnitude, or ``floor`` where
    that is larger."""
    if not want.numel():
        return 0.0
    diff = (got.to(want.dtype) - want).abs().max().item()
    denom = max(want.abs().max().item(), floor)
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


def grad_scale(grads: dict[str, torch.Tensor]) -> float:
    """The root-mean-square entry of all the gradients together: the floor a near-zero
    gradient's error is judged against."""
    n = sum(g.numel() for g in grads.values())
    total = sum(float(g.double().pow(2).sum()) for g in grads.values())
    return math.sqrt(total / n) if n else 0.0


def low_precision(model: torch.nn.Module) -> torch.dtype | None:
    """The 16-bit floating dtype the model's parameters are kept in, if any."""
    return next((p.dtype for p in model.parameters()
                 if p.is_floating_point() and p.element_size() < 4), None)


def _reference(model: torch.nn.Module, inputs: tuple) -> tuple[torch.nn.Module, tuple]:
    """The single-device reference: the model itself (a copy), or an fp32 copy of a 16-bit
    model with its floating inputs in fp32."""
    ref = copy.deepcopy(model)
    if low_precision(model) is None:
        return ref, inputs
    return ref.to(REFERENCE_DTYPE), tuple(
        t.to(REFERENCE_DTYPE) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        for t in inputs)


def _loss_and_grads(model: torch.nn.Module, inputs: tuple
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    wrapped = as_loss_module(model)
    loss = wrapped(*inputs)
    loss.backward()
    return loss.detach(), {n.removeprefix("model."): p.grad for n, p in wrapped.named_parameters()
                           if p.grad is not None}


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
    model, inputs = build(spec.model, spec.batch, spec.seq, spec.seed, spec.task)
    dtype = low_precision(model)
    own_dtype = dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()),
                              REFERENCE_DTYPE)
    keep = KeepAll()
    with keep:
        ref_loss, ref_grads = _loss_and_grads(*_reference(model, inputs))
    draws, fixed = keep.draws, keep.fixed
    with keep:      # a 16-bit model's own error on one device: its tolerance's measure
        own = _loss_and_grads(copy.deepcopy(model), inputs) if dtype is not None else None
    scale = grad_scale(ref_grads)

    plan = Plan.loads(spec.plan_json)
    fresh = copy.deepcopy(model) if spec.compile else None
    # An fp32 model's float64 copy, compared against where its fp32 errors exceed
    # FP32_TOLERANCE (:func:`_against_float64`)
    wide = copy.deepcopy(model) if own_dtype == torch.float32 else None
    pm = parallelize(model, Mesh(spec.mesh_shape, spec.axes), plan=plan, example_inputs=inputs,
                     compile=False)
    # Only where the model draws masks: a dispatch mode around the rank program would also
    # catch what its kernels build (context parallelism's causal bias, a tensor subclass).
    # Every micro-step of the plan's optimizer step (docs/cost-model.md §7.2), the same batch
    # each time: the gradients are then N times one batch's.
    steps = plan.options.accumulation_steps
    ran: list[tuple] = []
    host_ran: list[tuple] = []
    with keep if draws or fixed else contextlib.nullcontext():
        loss = _micro_steps(pm, pm.shard_inputs(*inputs), steps, ran, host_ran)
    grads = pm.full_grads()
    if steps > 1:
        grads = {k: g / steps for k, g in grads.items()}
    grad_errs = {n: rel_err(grads[n], g, scale) for n, g in ref_grads.items() if n in grads}
    missing = sorted(set(ref_grads) - set(grads))
    # The optimizer step too: its all-gathers (ZeRO-1/2, offload) are in the plan's ledger.
    opt, _ = _optimizer_for(pm, plan.options.state_optimizer)
    if opt is not None:
        opt.step()
        opt.zero_grad()
    _seen(pm, ran, host_ran)
    mine, planned, host_planned = _planned(plan, pm)
    host_ran = host_ran if plan.pipeline is None else []
    fp32_err = max([_loss_err(loss, ref_loss), *grad_errs.values()])
    if wide is not None and not fp32_err <= FP32_TOLERANCE:
        ref_loss, ref_grads, own, grad_errs = _against_float64(wide, inputs, keep, ref_loss,
                                                               ref_grads, grads)
    else:
        fp32_err = None
    report = {
        "loss": float(loss), "ref_loss": float(ref_loss),
        "loss_err": _loss_err(loss, ref_loss),
        "grad_errs": grad_errs, "missing_grads": missing,
        "dtype": str(own_dtype).removeprefix("torch."),
        "reference_dtype": str(torch.float64 if fp32_err is not None else REFERENCE_DTYPE
                               if dtype else own_dtype).removeprefix("torch."),
        "fp32_err": fp32_err,
        "random_draws": draws,
        "fixed_draws": fixed,
        # A 16-bit model: the single device's own errors in its dtype (the tolerance's base).
        "own_loss_err": _loss_err(own[0], ref_loss) if own else None,
        "own_grad_err": max((rel_err(own[1][n], g, grad_scale(ref_grads))
                             for n, g in ref_grads.items() if n in own[1]), default=0.0)
        if own else None,
        "ledger_diff": ledger_diff(planned, ran),
        "collectives": len(ran), "bytes": sum(r[2] for r in ran),
        "planned_bytes": sum(c.bytes for c in mine),
        "host_ledger_diff": ledger_diff(host_planned, host_ran),
        "host_bytes": sum(t[1] for t in host_ran),
        "planned_host_bytes": sum(t[1] for t in host_planned),
        # The ranks each collective ran over, by its axes (a joint group: their product).
        "group_sizes": {",".join(r.axes): r.group_size for r in pm.ledger},
    }
    if spec.compile:
        report["compiled"] = _compiled_against(fresh, inputs, plan, spec, loss, grads, ran)
    # (Per-stage peaks of a pipeline are not measured yet: its stages hold different parts.)
    if spec.measure_memory and plan.pipeline is None:
        # After the comparison (its figures are final above): the same module, gradients dropped.
        del grads, ref_grads
        report["memory"] = measure_step_memory(pm, pm.shard_inputs(*inputs))
    return report


def _planned(plan: Plan, pm) -> tuple[list, list[tuple], list[tuple]]:
    """This rank's collectives as the plan lists them (on a pipeline, its stage's), each as
    often as the step runs it (``count``: per microbatch, per micro-step of accumulation), and
    as ledger tuples; and the host link's copies (offload; a pipelined plan lists its stages'
    together: not compared yet)."""
    mine = [c for c in plan.collectives if c.stage in pm.runtime.stages
            for _ in range(c.count)]
    host = [(t.direction, t.bytes, t.phase, t.node, t.value)
            for t in plan.host_transfers for _ in range(t.count)] if plan.pipeline is None else []
    return mine, [(c.kind, c.axes, c.bytes, c.phase, c.node) for c in mine], host


def _against_float64(model: torch.nn.Module, inputs: tuple, keep: KeepAll, loss32: torch.Tensor,
                     grads32: dict, grads: dict) -> tuple:
    """An fp32 model whose plan misses FP32_TOLERANCE against one device in fp32 may be
    conditioned so that fp32's rounding alone moves its gradients that far (a batch norm over a
    few near-equal values: tiny MobileNets). The reference becomes the model in float64, and
    the tolerance, as for a 16-bit model, a margin over the single device's own fp32 error
    against it (:func:`tolerance_for`). Returns the float64 loss and gradients, the fp32 single
    device's as ``own``, and the plan's gradient errors against float64."""
    wide = tuple(t.to(torch.float64) if isinstance(t, torch.Tensor) and t.is_floating_point()
                 else t for t in inputs)
    with keep:
        loss64, grads64 = _loss_and_grads(model.to(torch.float64), wide)
    scale = grad_scale(grads64)
    errs = {n: rel_err(grads[n].double(), g, scale) for n, g in grads64.items() if n in grads}
    return loss64, grads64, (loss32, grads32), errs


def _micro_steps(pm, local_inputs: tuple, n: int, ran: list, host_ran: list) -> torch.Tensor:
    """``n`` micro-steps of ``pm`` on ``local_inputs``, all but the last under ``pm.no_sync()``
    (one optimizer step of a plan with ``accumulation_steps=n``); the ledger records of the
    first ``n - 1`` appended to ``ran`` and ``host_ran`` (each forward starts the ledger anew:
    the last one's are the caller's to take, after the optimizer step). The last loss."""
    if n > 1:
        with pm.no_sync():
            for _ in range(n - 1):
                pm.step(*local_inputs)
                _seen(pm, ran, host_ran)
    return pm.step(*local_inputs)


def _seen(pm, ran: list, host_ran: list) -> None:
    """The ledger's records so far, as the plan's are compared with them."""
    ran.extend((r.kind, r.axes, r.nbytes, r.phase, r.node) for r in pm.ledger)
    host_ran.extend((t.direction, t.nbytes, t.phase, t.node, t.value) for t in pm.ledger.host)


def _loss_err(loss: torch.Tensor, ref: torch.Tensor) -> float:
    return abs(float(loss) - float(ref)) / max(abs(float(ref)), 1e-30)


def _compiled_against(model, inputs, plan: Plan, spec: VerifySpec, loss, grads,
                      ran: list[tuple]) -> dict[str, Any]:
    """The same step compiled (codegen/compile.py): its loss, gradients and collectives
    (optimizer step included) against the eager rank program's; the regions that fell back."""
    import time
    import warnings
    from autoshard.codegen.compile import CompileFallback, eager_draws, regions
    keep = KeepAll()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CompileFallback)
        # Draws as the eager run had them (keep-all, fixed values): run eagerly between the
        # compiled regions, where KeepAll sees them (codegen/compile.py).
        with eager_draws():
            cpm = parallelize(model, Mesh(spec.mesh_shape, spec.axes), plan=plan,
                              example_inputs=inputs, compile=True)
        steps, cran, chost = plan.options.accumulation_steps, [], []
        t0 = time.perf_counter()
        with keep:
            closs = _micro_steps(cpm, cpm.shard_inputs(*inputs), steps, cran, chost)
        first = time.perf_counter() - t0
    cgrads = {n: g / steps for n, g in cpm.full_grads().items()}
    opt, _ = _optimizer_for(cpm, plan.options.state_optimizer)
    if opt is not None:
        opt.step()
        opt.zero_grad()
    _seen(cpm, cran, chost)
    return {"loss_err": abs(float(closs) - float(loss)) / max(abs(float(loss)), 1e-30),
            "grad_errs": {n: rel_err(cgrads[n], g) for n, g in grads.items()},
            "ledger_diff": ledger_diff(ran, cran), "first_step_s": first,
            "eager_draws": keep.draws + keep.fixed,
            "regions": sum(regions(m.program) for m in cpm.pipeline.modules)
            if cpm.pipeline is not None else regions(cpm.program),
            "fallbacks": [str(w.message) for w in caught
                          if issubclass(w.category, CompileFallback)]}


# ------------------------------------------------------------------------------ memory

# MemTracker's reference types (torch.distributed._tools.mem_tracker._MemRefType values) under
# the names verify reports them by.
_MEM_PARTS = {"Parameter": "params", "Gradient": "grads", "Optstate": "optimizer",
              "Activation": "activations", "Temp": "temporaries", "Buffer": "buffers",
              "Other": "other"}
MEM_PARTS = tuple(_MEM_PARTS.values())


def _optimizer_for(pm, optimizer: str):
    """The torch optimizer whose state the plan's ``options.optimizer`` counts (docs/cost-model.md
    §4.1): AdamW for adam/adamw (the same two moments), plain SGD for sgd, none for none."""
    if optimizer in ("adam", "adamw"):
        return pm.optimizer(torch.optim.AdamW, lr=1e-4), "AdamW"
    if optimizer == "sgd":
        return pm.optimizer(torch.optim.SGD, lr=1e-4), "SGD"
    return None, "no optimizer"


def predicted_memory(pm) -> dict[str, int]:
    """The plan's predicted peak split as the cost model sums it (docs/cost-model.md §4.4): model
    state (parameter, gradient and optimizer state of this rank's shards, §4.1), buffers, and the
    rest, what the forward saves for backward (activations and resharded copies)."""
    plan = pm.plan
    mem = plan.predicted.memory
    if mem is not None:
        state = int(mem.model_state)
    else:                       # a pipelined plan (its stages carry their own peaks)
        from autoshard.cost.memory import param_state_bytes
        state = sum(param_state_bytes(p.numel(), p.dtype, optimizer=plan.options.state_optimizer)
                    for p in pm.local_parameters().values())
    buffers = sum(t.numel() * t.element_size() for t in pm._buffers_local.values())
    # The peak over the step from liveness (cost/liveness.py) where the plan has it.
    peak = int(plan.predicted.peak_bytes)
    return {"peak": peak, "model_state": state, "buffers": buffers,
            "saved": peak - state - buffers}


def measure_step_memory(pm, local_inputs: tuple, *, warmup: bool = True) -> dict[str, Any]:
    """Peak bytes this rank holds during one training step of ``pm``: forward, backward (the
    gradient syncs included; under ``accumulation_steps=N`` the last of N micro-steps, the
    gradients of the others held, as the liveness walk's, docs/cost-model.md §7.2), the
    optimizer step (the plan's optimizer: AdamW for adam/adamw)
    and ``zero_grad``. Collective: every rank of the world must call it.

    With ``warmup`` (the default) a first, untracked step creates the optimizer state and the
    second step is measured: the steady state, whose moments exist through forward and backward
    (the first step's peak is not higher). On CPU the figure is the peak of
    ``torch.distributed._tools.mem_tracker.MemTracker``; on CUDA it is the caching allocator's
    ``max_memory_allocated`` over the step (every tensor on the device: the module, its inputs
    and whatever else the process keeps there), with the tracker's peak beside it
    (``tracked_peak``). The breakdown is the tracker's at its peak: params, grads, optimizer,
    activations (made in forward), temporaries (made in backward: activation gradients, and
    parameter gradients while the runtime still holds them in a sync bucket), buffers, and other
    (the module's buffers and the step's inputs). The module's gradients are dropped before and
    after.

    Returns ``{"measured": bytes, "breakdown": {...}, "tracked_peak": bytes, "after_forward":
    {...}, "source": ..., "step": ..., "predicted": predicted_memory(pm), "error": (predicted -
    measured) / measured}``; ``after_forward`` holds the same parts when the forward returned
    (its activations are what the forward keeps for backward, the predicted "saved" part). When
    the step fails under the tracker (an op or tensor type it cannot follow) it returns
    ``{"not_measured": reason, "predicted": ...}``. A failure that strikes one rank only would
    leave the others waiting in a collective; the program is the same on every rank, so a
    failure of the tracker strikes them all."""
    from torch.distributed._tools.mem_tracker import MemTracker

    predicted = predicted_memory(pm)
    params = list(pm.parameters())
    device = params[0].device if params else torch.device("cpu")
    mem = pm.plan.predicted.memory
    host = int(mem.host) if mem is not None else 0
    if device.type == "cpu" and host:
        # On a CPU run the host is the device: what the plan keeps on the host (offload) sits
        # in the memory the tracker measures, beside the device's peak.
        predicted = {**predicted, "peak": predicted["peak"] + host, "host": host}
    opt, opt_name = _optimizer_for(pm, pm.plan.options.state_optimizer)
    steps = pm.plan.options.accumulation_steps
    tracker = MemTracker()
    pm.zero_grad(set_to_none=True)
    try:
        with warnings.catch_warnings():
            # The runtime hands bucketed gradients over itself: the tracker's gradient hook
            # then sees a parameter whose .grad is not set yet, and warns (harmlessly).
            warnings.filterwarnings("ignore", message="Expected a tensor or a traceable")
            allocator_peak = _measured_step(pm, local_inputs, opt, device, tracker, warmup)
    except Exception as e:         # noqa: BLE001 (reported, not raised: verify goes on)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"not_measured": f"{type(e).__name__}: {reason}" if reason else type(e).__name__,
                "predicted": predicted}
    finally:
        pm.zero_grad(set_to_none=True)
    breakdown, tracked = _parts(tracker.get_tracker_snapshot("peak"), device)
    measured = int(allocator_peak if allocator_peak is not None else tracked)
    return {"measured": measured, "breakdown": breakdown, "tracked_peak": tracked,
            "after_forward": _after_forward(tracker, pm, device),
            "source": ("torch.cuda.max_memory_allocated" if allocator_peak is not None
                       else "MemTracker"),
            "step": f"{'second (steady-state)' if warmup else 'first'} step: "
                    + (f"the last of {steps} micro-steps of forward and backward, the "
                       f"gradients of the first {steps - 1} held, " if steps > 1
                       else "forward, backward, ") + f"{opt_name} step",
            "predicted": predicted,
            "error": (predicted["peak"] - measured) / measured if measured else math.inf}


def _parts(snap: dict, device: torch.device) -> tuple[dict[str, int], int]:
    """A MemTracker snapshot (device -> reference type -> bytes) as verify's parts, and total."""
    dev_snap = next((v for d, v in snap.items() if torch.device(d).type == device.type), {})
    parts = dict.fromkeys(MEM_PARTS, 0)
    for k, v in dev_snap.items():
        name = getattr(k, "value", str(k))
        if name in _MEM_PARTS:
            parts[_MEM_PARTS[name]] += int(v)
    return parts, int(dev_snap.get("Total", sum(parts.values())))


def _after_forward(tracker, pm, device: torch.device) -> dict[str, int] | None:
    """What the rank held when its forward returned (the tracker's post-forward snapshot of the
    module): the activations then are what the forward keeps for backward, plus the loss, the
    quantity the plan's "saved" part predicts. None where the tracker kept no such snapshot."""
    try:
        stats = tracker.memory_tracking[pm]
        snap = next(v[-1] for k, v in stats.snapshots.items()
                    if getattr(k, "value", k) == "Post-Forward" and v)
    except (KeyError, StopIteration, AttributeError, TypeError):
        return None
    return _parts(snap, device)[0]


def _measured_step(pm, local_inputs: tuple, opt, device: torch.device, tracker,
                   warmup: bool) -> int | None:
    """The (warm-up and) measured step of :func:`measure_step_memory`; on CUDA the allocator's
    peak over the measured step."""
    n = pm.plan.options.accumulation_steps       # micro-steps per optimizer step (§7.2)
    if warmup:
        _micro_steps(pm, local_inputs, n, [], [])
        if opt is not None:
            opt.step()
        opt.zero_grad() if opt is not None else pm.zero_grad(set_to_none=True)
    if n > 1:
        # The micro-steps before the last, untracked (the tracker follows one forward of a
        # module per iteration): the last starts with their gradients held, as the liveness
        # walk's (docs/cost-model.md §7.2), and those are counted from the start.
        with pm.no_sync():
            for _ in range(n - 1):
                pm.step(*local_inputs)
    buckets = pm.runtime.buckets
    externals = [pm, *pm._buffers_local.values(),
                 *(t for t in local_inputs if isinstance(t, torch.Tensor)),
                 *(buckets.held() if buckets is not None else ())]
    if opt is not None:
        externals.append(opt.optimizer)      # the torch optimizer inside pm.optimizer(...)
        # and its fp32 masters where they are not the parameters (mixed precision, ZeRO-1/2)
        externals += [e.master for e in opt.entries if e.master is not e.param]
    tracker.track_external(*externals)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with tracker:
        pm.step(*local_inputs)
        # Gradients the runtime hands over itself (a bucket's sync assigns ``.grad`` at the end
        # of backward) pass no gradient hook: label them gradients before the optimizer reads
        # them. Until then the tracker counts them as temporaries.
        # (its local parameters: pm.parameters() is refused while gradients sent to the host
        # in backward are away, codegen/gradviews.py)
        tracker.track_external(torch.nn.ParameterList(pm.local_parameters().values()))
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device)


def plan_for(model_name: str, mesh, *, batch: int | None = None, seq: int | None = None,
             baseline: str | None = None, seed: int = 0, task: str | None = None,
             **plan_kwargs: Any):
    model, inputs = build(model_name, batch, seq, seed, task)
    check_plannable(model, inputs, training=plan_kwargs.get("training", True))
    if plan_kwargs.get("pipeline") is not None:      # microbatches chosen, traced per microbatch
        return plan(model, inputs, mesh, model_name=model_name, **plan_kwargs)
    precision = plan_kwargs.get("precision", "model")
    with running_as(model, precision):
        traced = trace(model, cast_inputs(inputs, precision))
    if baseline:
        return baseline_plan(traced, mesh, baseline, **plan_kwargs)
    return plan_traced(traced, mesh, model_name=model_name, **plan_kwargs)


def tolerance_for(report: dict[str, Any], given: float | None) -> tuple[float, str]:
    """The tolerance a run is held to, and how it was set: ``given``; else 1e-5 for an fp32
    model; else, for a 16-bit model against its fp32 copy (or an fp32 model against its
    float64 copy, :func:`_against_float64`), LOW_PRECISION_MARGIN times the larger of the error
    the single device makes in the model's dtype and that dtype's unit roundoff."""
    if given is not None:
        return given, f"tolerance {given:g} (as given)"
    if report.get("own_grad_err") is None:
        return FP32_TOLERANCE, f"tolerance {FP32_TOLERANCE:g} ({report.get('dtype', 'float32')})"
    dtype = getattr(torch, report["dtype"])
    roundoff = torch.finfo(dtype).eps / 2
    own = max(report["own_loss_err"], report["own_grad_err"])
    tol = LOW_PRECISION_MARGIN * max(own, roundoff)
    if dtype == torch.float32:           # never stricter than the fp32 comparison it replaced
        tol = max(tol, FP32_TOLERANCE)
    return tol, (f"tolerance {tol:.2e} ({report['dtype']} model against its "
                 f"{report['reference_dtype']} copy on one device: {LOW_PRECISION_MARGIN:g} x "
                 f"the larger of the single device's own {report['dtype']} error {own:.2e} and "
                 f"{report['dtype']}'s unit roundoff {roundoff:.2e})")


def summarize(reports: list[dict[str, Any]], tolerance: float | None = None
              ) -> tuple[bool, str]:
    """The verdict over every rank's report, and the text: what was compared and how (dtypes,
    tolerance, random masks), the figures, and PASS, or FAIL with each reason."""
    r = reports[0]
    tol, how = tolerance_for(r, tolerance)
    worst = max(r["grad_errs"].items(), key=lambda kv: kv[1], default=("-", 0.0))
    lines = [f"compared: the plan's step in the model's own {r.get('dtype', 'float32')} against "
             f"one device in {r.get('reference_dtype', 'float32')}; {how}; a gradient's error "
             f"relative to its largest entry, or to the root-mean-square entry of the whole "
             f"gradient where that is larger (a near-zero gradient)"]
    if r.get("fp32_err") is not None:
        lines.append(f"against one device in float32 the largest error was {r['fp32_err']:.2e}, "
                     f"beyond {FP32_TOLERANCE:g}: judged against one device in float64 instead, "
                     f"by the single device's own float32 error")
    if r.get("random_draws"):
        lines.append(f"random masks: {r['random_draws']} dropout draws per step run keep-all on "
                     f"both sides (a rank draws its masks on its own shards, so no seed can "
                     f"match the single device's); every op runs as planned")
    if r.get("fixed_draws"):
        lines.append(f"random draws: {r['fixed_draws']} uniform or normal draws per step take a "
                     f"fixed value per element on both sides (ranks draw them whole, as one "
                     f"device does); every op runs as planned")
    lines += [f"loss {r['loss']:.6f} vs single device {r['ref_loss']:.6f}: rel err {r['loss_err']:.2e}",
              f"gradients: {len(r['grad_errs'])} compared, largest rel err {worst[1]:.2e} ({worst[0]})",
              f"collectives per rank: {r['collectives']}, {r['bytes']} bytes run, "
              f"{r['planned_bytes']} bytes planned"]
    if r.get("host_bytes") or r.get("planned_host_bytes"):
        lines.append(f"host link per rank: {r['host_bytes']} bytes copied, "
                     f"{r['planned_host_bytes']} bytes planned")
    reasons: list[str] = []
    for rank, rep in enumerate(reports):
        if rep["ledger_diff"]:
            reasons.append(f"rank {rank}'s collectives differ from the plan's ledger")
            lines.append(f"rank {rank}: run-time collectives differ from the plan:")
            lines += [f"  {d}" for d in rep["ledger_diff"][:20]]
        if rep.get("host_ledger_diff"):
            reasons.append(f"rank {rank}'s host copies differ from the plan's")
            lines.append(f"rank {rank}: run-time host copies differ from the plan:")
            lines += [f"  {d}" for d in rep["host_ledger_diff"][:20]]
        if rep["missing_grads"]:
            reasons.append(f"rank {rank} computed no gradient for {len(rep['missing_grads'])} "
                           f"parameters")
            lines.append(f"rank {rank}: no gradient for {rep['missing_grads'][:5]}")
        bad = sorted(((e, n) for n, e in rep["grad_errs"].items() if not e <= tol), reverse=True)
        if not rep["loss_err"] <= tol or bad:        # `not <=`: a nan error fails too
            what = ([f"loss {rep['loss_err']:.2e}"] if not rep["loss_err"] <= tol else []) + \
                [f"{n} {e:.2e}" for e, n in bad[:5]]
            reasons.append(f"rank {rank}: beyond tolerance {tol:.2g}: " + ", ".join(what)
                           + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else ""))
    lines += memory_lines(reports)
    if r.get("fp32_err") is not None and any("beyond tolerance" in x for x in reasons):
        # (HF's MobileNetV1 on 4 ranks: 7.7e-5 against a tolerance of 7.2e-5 in float32, and
        # 1.7e-13 with the model in float64)
        lines.append("the errors may still be float32 rounding, which a plan's other order of "
                     "sums can make larger than one device's: verify the model in float64 (a "
                     "config with \"torch_dtype\": \"float64\", or a factory returning "
                     "model.double()), where a plan's error stays and rounding does not")
    if "compiled" in r and not _compiled_lines(reports, tol, lines):
        reasons.append("the compiled program differs from the eager one")
    ok = not reasons
    lines.append("PASS" if ok else "FAIL: " + "; ".join(reasons))
    return ok, "\n".join(lines)


def _compiled_lines(reports: list[dict[str, Any]], tolerance: float, lines: list[str]) -> bool:
    ok = True
    for rank, rep in enumerate(reports):
        c = rep["compiled"]
        worst = max(c["grad_errs"].values(), default=0.0)
        if rank == 0:
            lines.append(f"compiled vs eager: loss rel err {c['loss_err']:.2e}, gradients "
                         f"largest {worst:.2e}; first step (compiling) {c['first_step_s']:.1f} s"
                         f"; {c['regions']} compiled region(s), "
                         f"{len(c['fallbacks'])} eager"
                         + (f"; {c['eager_draws']} random draws per step run eagerly between "
                            "them, fixed as in the eager run" if c.get("eager_draws") else ""))
        lines += [f"rank {rank}: {w}" for w in c["fallbacks"][:5]]
        if c["ledger_diff"]:
            lines.append(f"rank {rank}: compiled collectives differ from eager:")
            lines += [f"  {d}" for d in c["ledger_diff"][:20]]
        if c["ledger_diff"] or c["loss_err"] > tolerance or worst > tolerance:
            ok = False
    return ok


def _unit(nbytes: float) -> tuple[str, float]:
    """The largest binary unit that keeps ``nbytes`` >= 1 (a tiny model must not read 0.00)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return unit, scale
    return "B", 1


def memory_lines(reports: list[dict[str, Any]]) -> list[str]:
    """One line per rank: the plan's predicted peak memory against the measured peak of a
    training step, with what each held. For information: it does not decide PASS or FAIL."""
    mems = [(rank, r["memory"]) for rank, r in enumerate(reports) if r.get("memory")]
    if not mems:
        return []
    largest = max(max(m["predicted"]["peak"], m.get("measured", 0)) for _, m in mems)
    unit, scale = _unit(largest)

    def f(n: float) -> str:
        return f"{n / scale:.2f}" if scale > 1 else f"{n:.0f}"

    first = next((m for _, m in mems if "measured" in m), None)
    head = f"peak memory per rank, {unit}"
    if first is not None:
        head += f" ({first['step']}; measured by {first['source']})"
    lines = [head + ":"]
    for rank, m in mems:
        p = m["predicted"]
        pred = (f"predicted {f(p['peak'])} (model state {f(p['model_state'])} + saved "
                f"{f(p['saved'])}" + (f" + buffers {f(p['buffers'])}" if p["buffers"] else "")
                + (f" + host {f(p['host'])}, the same memory on CPU" if p.get("host") else "")
                + ")")
        if "not_measured" in m:
            lines.append(f"  rank {rank}: {pred}, not measured: {m['not_measured']}")
            continue
        parts = " + ".join(f"{k} {f(v)}" for k, v in m["breakdown"].items() if v)
        lines.append(f"  rank {rank}: {pred}, measured {f(m['measured'])} ({parts}); "
                     f"error {100 * m['error']:+.1f}%")
    return lines


def verify(model_name: str, mesh: Mesh, *, plan: Plan | None = None, batch: int | None = None,
           seq: int | None = None, baseline: str | None = None,
           tolerance: float | None = None, task: str | None = None, compile: bool = False,
           **plan_kwargs: Any) -> tuple[bool, str]:
    """Run ``plan`` (or a fresh plan, or a hand-written ``baseline``) on ``mesh.size`` gloo ranks
    here; (passed, report). ``tolerance``: default per dtype (:func:`tolerance_for`); ``task``:
    of a Hugging Face config.json model; ``plan_kwargs``: options of a fresh plan
    (``pipeline``, ``schedule``, ``microbatches``); ``compile``: also run the rank program
    compiled, against the eager one (loss, gradients, collectives)."""
    if tolerance is not None and not (isinstance(tolerance, (int, float))
                                      and 0 < tolerance < math.inf):   # nan fails too
        raise AutoshardError("a tolerance that is a positive number", got=repr(tolerance),
                             fix="e.g. --tolerance 1e-5")
    if plan is not None and baseline:
        raise AutoshardError("a plan file or a baseline to verify, not both",
                             got=f"a plan and baseline {baseline!r}", fix="drop one of them")
    if plan is not None:
        check_plan(plan, model_name, mesh, batch=batch, seq=seq, task=task)
    else:
        plan = plan_for(model_name, mesh, batch=batch, seq=seq, baseline=baseline, task=task,
                        **plan_kwargs)
    spec = VerifySpec(model_name, mesh.shape, mesh.axes, plan.dumps(), batch, seq, task=task,
                      compile=compile)
    with World(mesh.size, timeout_s=600) as world:
        reports = world.run(verify_rank, spec)
    for r in reports:
        if "error" in r:
            expected, got, fix = r["error"]
            raise AutoshardError(expected, got=f"{got} (on the gloo ranks)", fix=fix)
    return summarize(reports, tolerance)


def check_plan(plan: Plan, model_name: str, mesh: Mesh, *, batch: int | None,
               seq: int | None, task: str | None = None) -> None:
    """Refuse, before any rank is spawned, a plan that cannot run here: one made for another
    mesh, for forward only (verify runs a training step), or for another model or input shapes
    (a stale plan). The ranks would find the same, but late and as tracebacks."""
    plan.check_mesh(mesh.shape, mesh.axes)
    if not plan.training:
        raise AutoshardError("a plan made for training: verify runs a training step",
                             got="a forward-only plan (options.training is false)",
                             fix="re-plan without --inference")
    model, inputs = build(model_name, batch, seq, seed=0, task=task)
    # As the planner traced it: in the plan's precision, one microbatch on a pipeline.
    traced = trace_for(model, inputs, plan.settled_options())
    plan.check_matches(traced.fingerprint, traced.node_sigs)
