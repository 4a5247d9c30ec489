"""The training loop people write (AdamW, warmup + cosine LambdaLR, global-norm clipping with
torch's own clip_grad_norm_, accumulation over micro-batches), run on one rank through a
ParallelModule and beside it on the single-device model. Used by tests/test_training_loop.py;
module level, so the world's ranks unpickle it by reference."""
from __future__ import annotations

import contextlib
import importlib.util
import warnings
from pathlib import Path

import torch


def _example():
    """examples/train.py, the recipe: its schedule is the one tested here."""
    spec = importlib.util.spec_from_file_location(
        "autoshard_train_example", Path(__file__).parents[1] / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_recipe = _example()
warmup_cosine = _recipe.warmup_cosine

LR, WD, CLIP = 1e-3, 0.1, 0.5


def micro_batch(inputs: tuple, step: int, micro: int) -> tuple:
    """Inputs shaped like ``inputs``, drawn anew per (step, micro-batch), the same on every rank."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return tuple(torch.randn(t.shape, generator=g, dtype=t.dtype) if t.is_floating_point()
                 else torch.randint(0, int(t.max()) + 1, t.shape, generator=g, dtype=t.dtype)
                 for t in inputs)


def run_steps(opt, sched, step_fn, params_fn, inputs, steps: range, micro: int,
              accumulating=lambda: contextlib.nullcontext(), set_to_none: bool = True):
    """Optimizer steps ``steps`` of ``micro`` micro-batches each: (losses, norms before clip).
    Every micro-batch but the last runs inside ``accumulating()`` (DDP's ``no_sync``); the
    gradients are zeroed with ``opt.zero_grad(set_to_none)``."""
    losses, norms = [], []
    for s in steps:
        total = 0.0
        for m in range(micro):
            with accumulating() if m < micro - 1 else contextlib.nullcontext():
                total += float(step_fn(micro_batch(inputs, s, m)))
        losses.append(total)
        norm = torch.nn.utils.clip_grad_norm_(params_fn(), CLIP)
        norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=set_to_none)
    return losses, norms


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(2, 8))


def param_groups(named_parameters) -> list[dict]:
    """examples/train.py's groups (weight decay on matrices only), the undecayed group at 3x the
    learning rate (a group's own rate, which the schedule scales)."""
    groups = _recipe.param_groups(named_parameters, WD)
    groups[1]["lr"] = 3 * LR
    return groups


def parallel(model_name: str, plan_json: str, seed: int = 0, groups: bool = False,
             compile: bool = False):
    """(pm, its AdamW, the example inputs) for ``plan_json`` on this rank, the model's weights
    drawn from ``seed`` (the inputs, which fix the data's vocabulary, from seed 0); with
    ``groups``, over :func:`param_groups`; with ``compile``, the rank program compiled."""
    from autoshard import Mesh, Plan
    from autoshard.codegen.parallelize import parallelize
    from autoshard.tools.verify import build
    plan = Plan.loads(plan_json)
    model, inputs = build(model_name, None, None, seed)[0], build(model_name, None, None, 0)[1]
    pm = parallelize(model, Mesh(plan.mesh_shape, plan.mesh_axes), plan=plan,
                     example_inputs=inputs, compile=compile)
    params = param_groups(pm.named_parameters()) if groups else None
    return pm, pm.optimizer(torch.optim.AdamW, params, lr=LR, weight_decay=WD), inputs


def pm_step(pm, divide: int = 0):
    """One micro-step: ``pm.step``, or with ``divide`` nanoGPT's ``(loss / divide).backward()``
    through the graph ``pm(...)`` returns (plans without a pipeline)."""
    if not divide:
        return lambda batch: pm.step(*pm.shard_inputs(*batch))

    def step(batch):
        loss = pm(*pm.shard_inputs(*batch))
        (loss / divide).backward()
        return loss.detach()
    return step


def single_device(model_name: str, steps: int, micro: int, set_to_none: bool = True,
                  groups: bool = False, divide: bool = False):
    """The same loop on the single-device model: (losses, norms), its parameters by name."""
    from autoshard.loss import as_loss_module
    from autoshard.tools.verify import build
    ref = as_loss_module(build(model_name, None, None, 0)[0])
    inputs = build(model_name, None, None, 0)[1]

    def step(batch):
        loss = ref(*batch)
        (loss / micro if divide else loss).backward()
        return loss.detach()
    opt = torch.optim.AdamW(param_groups(ref.named_parameters()) if groups else
                            ref.parameters(), lr=LR, weight_decay=WD)
    out = run_steps(opt, schedule(opt), step, ref.parameters, inputs, range(steps), micro,
                    set_to_none=set_to_none)
    return out, {n.removeprefix("model."): p.detach() for n, p in ref.named_parameters()}


def train_loop(model_name: str, plan_json: str, steps: int = 8, micro: int = 2,
               set_to_none: bool = True, groups: bool = False, divide: bool = False,
               compile: bool = False):
    """The loop under the plan and on one device: ((losses, norms), full weights) of each.
    ``divide``: each micro-step's loss divided by ``micro`` before its backward (nanoGPT);
    ``compile``: the rank program compiled."""
    from autoshard.codegen.compile import CompileFallback
    with warnings.catch_warnings():
        if compile:        # every region compiled: one that runs eagerly instead fails the test
            warnings.simplefilter("error", CompileFallback)
        pm, opt, inputs = parallel(model_name, plan_json, groups=groups, compile=compile)
        sync = pm.no_sync if pm.pipeline is None else contextlib.nullcontext
        got = run_steps(opt, schedule(opt), pm_step(pm, micro if divide else 0), pm.parameters,
                        inputs, range(steps), micro, sync, set_to_none)
    return got, pm.full_state_dict(), *single_device(model_name, steps, micro, set_to_none,
                                                     groups, divide)
