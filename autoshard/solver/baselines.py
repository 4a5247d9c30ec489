"""Hand-written plans, expressed in autoshard's own IR and priced by the same cost model.

A baseline fixes the layout of every parameter (and of the inputs) the way an expert would write
it; the ILP then only chooses the layout of activations given those parameters, i.e. the cheapest
way to run the expert's layout. What is not fixed (embeddings and the LM head, which Megatron
shards over the vocabulary with a vocab-parallel cross-entropy, a layout the solver may pick
too: ops/embedding.py, ops/loss.py) is left to the solver, for the baselines and autoshard alike.

- ``dp``: every parameter replicated, the batch split over every axis it divides.
- ``megatron``: Megatron-LM tensor parallelism over every mesh axis (Shoeybi et al. 2019):
  QKV / fc1 / gate / up column-parallel, attention out-proj / fc2 / down row-parallel.
- ``megatron-dp``: Megatron over the last axis, data parallel over the others.

Which linear is column- and which row-parallel is read off the graph (``trace/blocks.py``), not
off parameter names: in each repeated layer, the linears whose outputs are added back into the
residual stream are row-parallel and the linears feeding them from the block's input are
column-parallel, so fused projections (Phi-3's ``qkv_proj`` and ``gate_up_proj``, GPT-NeoX's and
Falcon's ``query_key_value`` and ``dense_h_to_4h``) are placed as Megatron places them. A column
split of a fused QKV is the author's layout (Megatron stores QKV interleaved per head), priced
as autoshard's IR runs it. A linear the structure does not place (outside every layer, or in a
layer without a residual add) stays replicated, and the plan's ``warnings`` name it
(:func:`unclassified_params`).

Stored-layout baselines (``STORED``, :func:`stored_plan`): the parameters are stored as the
expert writes them, and the ILP may reshard them on the way into an op (a sharded weight
all-gathered for the matmul that reads it, as FSDP does):

- ``fsdp``: ZeRO-3 / FSDP, every parameter sharded over every axis (``zero3_layouts``).
- ``fsdp-tp``: torchtitan's 2-D layout, Megatron over the last axis and FSDP over the others.
"""
from __future__ import annotations

from dataclasses import replace

from autoshard.errors import AutoshardError
from autoshard.mesh import Mesh
from autoshard.plans import Plan
from autoshard.solver.alternatives import plan_stored
from autoshard.solver.planner import plan_traced
from autoshard.solver.layouts import (BASELINES, baseline_pins, fsdp_tp_layouts,  # noqa: F401
                                      megatron_roles, tensor_parallel_spec,
                                      unclassified_params, zero3_layouts)
from autoshard.trace.export import TracedGraph

# The baselines that place linears by their Megatron role.
_TENSOR_PARALLEL = ("megatron", "megatron-dp", "fsdp-tp")
# Where a plan names the parameters the structure did not place: the first few, then a count.
_NAMED = 6


def baseline_plan(traced: TracedGraph, mesh: Mesh, name: str, **kwargs) -> Plan:
    """A hand-written layout as its user writes it: gradients and optimizer state with the
    parameters (no ZeRO-1/2, no offload) unless ``kwargs`` ask for them."""
    kwargs = {"zero": "none", "offload": "none", **kwargs}
    plan = plan_traced(traced, mesh, fixed=baseline_pins(traced, mesh, name), **kwargs)
    return _with_unclassified_note(plan, traced, name)


def _with_unclassified_note(plan: Plan, traced: TracedGraph, name: str) -> Plan:
    """``plan`` with a warning naming the parameters a tensor-parallel baseline ``name`` kept
    replicated because the graph does not place them, so none is replicated silently."""
    if name not in _TENSOR_PARALLEL:
        return plan
    left = unclassified_params(traced)
    if not left:
        return plan
    named = ", ".join(left[:_NAMED]) + (f" and {len(left) - _NAMED} more" if len(left) > _NAMED
                                        else "")
    note = (f"baseline {name}: {len(left)} linear parameter(s) stay replicated because the graph "
            f"does not say whether they are column- or row-parallel (outside every repeated "
            f"layer, or in a layer without a residual add): {named}")
    return replace(plan, warnings=(*plan.warnings, note))


def pipelined_baseline_plan(traced: TracedGraph, mesh: Mesh, name: str, options, *,
                            model_name: str = "", **kwargs) -> Plan:
    """A hand-written layout on a pipeline: the stages cut and scheduled as autoshard's are
    (``options.pipeline``, ``schedule``, ``microbatches``; ``traced`` is one microbatch's
    graph), each stage's parameters laid out over the other axes as baseline ``name`` writes
    them (``megatron-dp``: Megatron-LM's tensor 8 in a node with data parallel across, the
    layout Narayanan et al. 2021 pipeline GPT-3 175B with). ``kwargs``: options of the stages'
    plan, as for :func:`baseline_plan` (default: no ZeRO, no offload)."""
    from autoshard.solver.pipeline import plan_pipelined
    stage_options = {"zero": "none", "offload": "none", **kwargs}

    def plan_stages(g: TracedGraph, sub: Mesh, opts, **kw) -> Plan:
        return plan_traced(g, sub, opts.replace(**stage_options),
                           fixed=baseline_pins(g, sub, name), **kw)
    plan = plan_pipelined(traced, mesh, options, model_name=model_name, trace_s=0.0,
                          plan_spmd=plan_stages)
    return _with_unclassified_note(plan, traced, name)


STORED = ("fsdp", "fsdp-tp")


def stored_plan(traced: TracedGraph, mesh: Mesh, name: str, **kwargs) -> Plan:
    """The cheapest plan storing parameters as the ``STORED`` baseline ``name`` does."""
    if name not in STORED:
        raise AutoshardError(f"a stored-layout baseline among {STORED}", got=repr(name),
                             fix="pick one of the listed names")
    layouts = zero3_layouts(traced, mesh) if name == "fsdp" else fsdp_tp_layouts(traced, mesh)
    kwargs = {"zero": "none", "offload": "none", **kwargs}
    plan = plan_stored(traced, mesh, layouts, label=name, **kwargs)
    return _with_unclassified_note(plan, traced, name)

