"""``parallelize``: a model, a mesh and a plan (or the options to make one) to this rank's
:class:`~autoshard.codegen.runtime.ParallelModule`: trace the model, plan it where no plan is
given, check the plan against the graph and the world, and bind this rank's shards.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

from autoshard.codegen.groups import MeshGroups
from autoshard.codegen.runtime import ParallelModule
from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.options import PlanOptions, resolve_options
from autoshard.plans import Plan
from autoshard.precision import cast_inputs, running_as
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace


def parallelize(model: torch.nn.Module, mesh: Any, *, plan: Plan | str | Path | None = None,
                example_inputs: Sequence[Any] | None = None, options: PlanOptions | None = None,
                init: Any = "auto", seed: int = 0, compile: bool | None = None,
                **overrides: Any) -> ParallelModule:
    """This rank's :class:`ParallelModule` for ``model`` under ``plan`` (planned here with
    ``options`` and keyword ``overrides`` of its fields if None; a given plan brings its own).

    ``mesh`` is the :class:`autoshard.Mesh` used for planning or a torch DeviceMesh; the current
    torch.distributed world is bound to it, ranks row-major over the mesh shape.

    ``model`` may hold its tensors on the meta device: each rank then materialises only its own
    shard of each, never a whole sharded tensor (autoshard/codegen/materialize.py). ``init``
    says from what: ``"auto"`` (default: the construction recorded by
    ``autoshard.codegen.materialize.deferred_init()`` when the model was built inside it, else
    ``"model"``), ``"model"`` (every submodule's ``reset_parameters()``, then the model's own
    ``init_weights``/``_init_weights``), a callable ``init_fn(model)`` run on the meta model and
    recorded, or ``"empty"`` (NaN until ``pm.load_full_state_dict`` / ``pm.load_sharded_state_dict``
    fills it). Random draws are keyed by (``seed``, tensor name, element index), so every shard
    equals its slice of the tensor ``materialize(model, seed=seed)`` gives on one device.

    ``compile``: run each rank's program compiled by inductor (codegen/compile.py), or eagerly
    (False); None: as the plan's ``options.compile`` says (the program its figures price).
    """
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(plan, (str, Path)):
        plan = Plan.load(plan)
    if plan is not None and (options is not None or overrides):
        raise AutoshardError("plan options only when planning here (plan=None)",
                             got=f"a plan and options {sorted(overrides) or 'options'}",
                             fix="drop the options: a plan was made with its own (plan.options)")
    options = plan.options if plan is not None else resolve_options(options, overrides)
    if example_inputs is None:
        if plan is None:
            raise AutoshardError("example_inputs (the global batch to plan for) when no plan is "
                                 "given", got="neither", fix="pass plan=... or example_inputs=...")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        example_inputs = plan.example_inputs(device)       # one microbatch on a pipeline
    elif options.pipeline is not None and isinstance(options.microbatches, int):
        from autoshard.solver.planner import microbatch
        example_inputs = microbatch(example_inputs, options.microbatches)
    if not dist.is_initialized():
        raise AutoshardError("an initialised torch.distributed world", got="none",
                             fix="launch with torchrun and call dist.init_process_group()")
    if isinstance(mesh, DeviceMesh):
        groups = MeshGroups.from_device_mesh(mesh)
        pmesh = Mesh(groups.shape, groups.axes)
    else:
        groups = MeshGroups.from_mesh(mesh)
        pmesh = mesh
    from autoshard.codegen.materialize import bound, prepare
    sources = prepare(model, init=init, seed=seed)
    # Under bf16-mixed the step runs (and is traced) in bf16; the model's own fp32 weights seed
    # the optimizer's fp32 masters (autoshard/precision.py).
    with running_as(model, options.precision) as originals:
        traced = trace(model, cast_inputs(example_inputs, options.precision),
                       training=options.training)
        if plan is None:
            plan = plan_traced(traced, pmesh, options)
        plan.check_mesh(groups.shape, groups.axes)
        plan.check_matches(traced.fingerprint, traced.node_sigs)
        sources.check([ph.fqn for ph in traced.placeholders if ph.kind in ("param", "buffer")])
        with bound(model, sources):
            pm = ParallelModule(traced, plan, groups, model,
                                compile=plan.options.compile if compile is None else compile)
    for fqn in pm.fqns:
        full = originals.get(fqn)
        if full is not None and full.device.type != "meta":
            pm.master_source[fqn] = pm._shard(full.detach(), pm._specs[pm._param_ph[fqn]])
    return pm
