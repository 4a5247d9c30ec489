"""Export a plan as a torchtitan-style ``parallelize(model, mesh)`` (``autoshard export``).

The generated file applies the plan with PyTorch's own parallel APIs instead of autoshard's
runtime: ``parallelize_module`` with the tensor-parallel styles (ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput/Output, loss parallel) over one mesh axis, and FSDP2
(``fully_shard``) or FSDP2's replicate over the others. It imports torch only.

Those APIs express a subset of what the planner decides, so the export maps what they can say and
lists the rest, in the generated docstring, as not expressible (docs/export.md):

- The **tensor axis** is the mesh axis over which the plan reads Linear or Embedding weights
  sharded (a name like "tp" means nothing here: the planner may pick either axis). A Linear whose
  weight is read ``S(0)`` there is column-parallel, ``S(1)`` row-parallel; an Embedding read
  ``S(0)`` (its vocabulary) is row-parallel, ``S(1)`` column-parallel.
- The **stream layout** is how the activations between those modules lie over the tensor axis:
  replicated, or sharded on one dim (sequence parallel) when every norm-like module (parameters
  all 1-D) runs on activations sharded there. The plan lays out every activation on its own; the
  styles need one layout for all of them, so a plan that mixes several is exported replicated.
- Every other axis is a **data axis**: ``fully_shard`` when the plan stores some parameter sharded
  over it (ZeRO-3), else replicate (DDP over FSDP2's machinery). The batch is split over the axes
  on which the plan splits the inputs.

The styles compose only where the activations they hand each other agree, which the plan's
per-node layouts do not guarantee once some decision is not expressible. :func:`export_plan`
therefore walks the plan's graph and gives every value the class the generated program would
produce (replicated input, the stream, a column-parallel output, a gathered whole tensor); where
two classes meet that the program cannot combine, it gathers the column-parallel outputs involved,
drops sequence parallelism, or, as a last resort, tensor parallelism, and says so. The program
always computes the plan's model; what it may not do is run the plan's collectives, and the
docstring's table compares the two per phase, kind and axis.
"""
from __future__ import annotations

from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.files import check_output, write_output
from autoshard.plangraph import graph_of
from autoshard.plans import Plan
from autoshard.tools.export.data import (layer_loops, map_data_axes, map_inputs, match_ledger,
                                         module_order, other_decisions)
from autoshard.tools.export.graph import Export, FORMATS, modules_of
from autoshard.tools.export.render import source
from autoshard.tools.export.tensor import map_tensor_axis, tensor_axis


def check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise AutoshardError(f"an export format among {', '.join(FORMATS)}", got=repr(fmt),
                             fix="use --format dtensor")


def export_plan(plan: Plan, fmt: str = "dtensor") -> Export:
    """Map ``plan`` onto DTensor's parallel styles and FSDP2 (see the module docstring)."""
    check_format(fmt)
    g = graph_of(plan)
    mods = modules_of(plan, g)
    notes: list[str] = []
    t = tensor_axis(plan, mods, notes)
    mapping = map_tensor_axis(plan, g, mods, t, notes) if t is not None else None
    if mapping is None and t is not None:
        t = None
    data_axes = tuple(a for i, a in enumerate(plan.mesh_axes) if i != t)
    exp = Export(plan=plan, tensor_axis=plan.mesh_axes[t] if t is not None else None,
                 stream=mapping.stream if mapping else None, data_axes=data_axes,
                 styles=mapping.styles if mapping else [],
                 parents=mapping.parents if mapping else {}, data_parallel=None,
                 fsdp_groups=[], reshard_after_forward=False, input_split={},
                 loss_parallel=mapping.loss_parallel if mapping else False,
                 not_expressible=notes, expected=list(mapping.expected) if mapping else [],
                 unexpressed=[])
    map_data_axes(exp, g, mods)
    map_inputs(exp)
    other_decisions(exp)
    match_ledger(exp, g, mapping.boundaries if mapping else {})
    exp.layers = layer_loops(exp)
    exp.order = module_order(g, mods)
    return exp


def export_file(plan_path: str | Path, output: str | Path, fmt: str = "dtensor") -> Export:
    """``autoshard export``: read a plan file, write the generated module to ``output``."""
    check_format(fmt)             # before reading anything: the cheapest mistake first
    check_output(output, [("plan file", plan_path)], suffix=".py")
    exp = export_plan(Plan.load(plan_path), fmt)
    write_output(output, source(exp), what="generated file")
    return exp
