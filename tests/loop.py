"""The training loop people write (AdamW, warmup + cosine LambdaLR, global-norm clipping,
accumulation over micro-batches), run on one rank through a ParallelModule and, beside it, on the
single-device model; used by tests/test_training_loop.py (module level, so it pickles)."""
from __future__ import annotations

import math

import torch

LR, WD, CLIP = 1e-3, 0.1, 0.5


def warmup_cosine(warmup: int, total: int):
    """The LambdaLR factor of torchtitan's and nanoGPT's schedules: linear warmup, cosine decay."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    return factor


def micro_batch(inputs: tuple, step: int, micro: int) -> tuple:
    """Inputs shaped like ``inputs``, drawn anew per (step, micro-batch), the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    out = []
    for t in inputs:
        if t.is_floating_point():
            out.append(torch.randn(t.shape, generator=g, dtype=t.dtype))
        else:
            hi = int(t.max()) + 1
            out.append(torch.randint(0, hi, t.shape, generator=g, dtype=t.dtype))
    return tuple(out)


def _loop(model, opt, step_fn, params_fn, inputs, steps: int, micro: int):
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, steps))
    losses, norms = [], []
    for s in range(steps):
        loss = 0.0
        for m in range(micro):
            loss += float(step_fn(micro_batch(inputs, s, m)))
        norm = torch.nn.utils.clip_grad_norm_(params_fn(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(loss)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
    return losses, norms


def train_loop(model_name: str, plan_json: str, steps: int = 8, micro: int = 2, *,
               offload_frozen: bool = False):
    """Losses, gradient norms (before clipping) and final weights of ``steps`` optimizer steps
    of ``micro`` micro-batches each, under the plan and on one device: (parallel, single)."""
    from autoshard import Mesh, Plan
    from autoshard.codegen.runtime import parallelize
    from autoshard.loss import as_loss_module
    from autoshard.verify import build
    plan = Plan.loads(plan_json)
    model, inputs = build(model_name, None, None, 0)
    ref = as_loss_module(build(model_name, None, None, 0)[0])
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs)
    opt = pm.optimizer(torch.optim.AdamW, lr=LR, weight_decay=WD)
    got = _loop(pm, opt, lambda b: pm.step(*pm.shard_inputs(*b)), pm.parameters, inputs,
                steps, micro)

    def ref_step(b):
        loss = ref(*b)
        loss.backward()
        return loss.detach()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    want = _loop(ref, ref_opt, ref_step, ref.parameters, inputs, steps, micro)
    full = pm.full_state_dict()
    ref_sd = {n.removeprefix("model."): p.detach() for n, p in ref.named_parameters()}
    return got, want, full, ref_sd
