"""The parameter layouts of the hand-written plans (solver/baselines.py explains them): pinned
(``baseline_pins``: each weight read where it lies) or stored (``zero3_layouts``,
``fsdp_tp_layouts``: the ILP may reshard them on the way into an op). Pure functions of the
traced graph and the mesh, so the solver's starts (solver/starts.py) read them without the
planner."""
from __future__ import annotations

import torch

from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Shard, Spec, Strategy, spec_fits
from autoshard.mesh import Mesh
from autoshard.trace.blocks import COLUMN, ROW, block_linears
from autoshard.trace.export import TracedGraph

aten = torch.ops.aten
BASELINES = ("dp", "megatron", "megatron-dp")


def _weight_layout(traced: TracedGraph, ph_name: str) -> str:
    """"out_in" for nn.Linear weights (aten.linear), "in_out" for Conv1D-style (addmm/mm)."""
    node = next(n for n in traced.graph.nodes if n.name == ph_name)
    for user in node.users:
        if user.target in (aten.addmm.default, aten.mm.default, aten.matmul.default):
            return "in_out"
    return "out_in"


def megatron_roles(traced: TracedGraph) -> dict[str, str | None]:
    """The Megatron role of every parameter a linear reads, by placeholder: COLUMN, ROW, or
    None where the graph does not say (``trace/blocks.py``). A weight read by linears of
    different roles has none."""
    params = {p.name for p in traced.params}
    roles: dict[str, str | None] = {}
    for lin in block_linears(traced.graph, traced.layers, params):
        for ph in (lin.weight, lin.bias):
            if ph is not None:
                roles[ph] = lin.role if roles.get(ph, lin.role) == lin.role else None
    return roles


def unclassified_params(traced: TracedGraph) -> tuple[str, ...]:
    """The FQNs of the linears' parameters the Megatron baselines keep replicated because the
    graph does not say whether they are column- or row-parallel; embeddings and the LM head,
    left to the solver, are not among them (nor the bias of a head tied to the embedding)."""
    roles = megatron_roles(traced)
    params = {p.name for p in traced.params}
    left: dict[str, None] = {}
    for lin in block_linears(traced.graph, traced.layers, params):
        if _is_embedding_or_head(traced, lin.weight):
            continue
        for ph in (lin.weight, lin.bias):
            if ph is not None and roles[ph] is None:
                left[traced.placeholder(ph).fqn] = None
    return tuple(left)


def tensor_parallel_spec(traced: TracedGraph, ph_name: str, role: str | None,
                         shape: tuple[int, ...], axes: list[int], ndim_mesh: int) -> Spec:
    """The Megatron spec of one parameter of ``role`` (``megatron_roles``), sharded over
    ``axes``; R elsewhere. A column-parallel linear's bias is sharded with its output, a
    row-parallel one's is replicated (added once, after the reduction)."""
    # A fused projection's output dim, later split into Q, K and V (or gate and up), is sharded
    # strided: each rank its part of every group (trace/fused.py), as Megatron does.
    groups = dict(traced.placeholder(ph_name).info.groups)

    def on(dim: int) -> Spec:
        return tuple(Shard(dim, groups.get(dim, ())) if a in axes else Replicate()
                     for a in range(ndim_mesh))

    is_bias = len(shape) == 1
    out_dim, in_dim = (0, 1) if _weight_layout(traced, ph_name) == "out_in" else (1, 0)
    if role == COLUMN:
        return on(0) if is_bias else on(out_dim)
    if role == ROW and not is_bias:
        return on(in_dim)
    return (Replicate(),) * ndim_mesh


def baseline_pins(traced: TracedGraph, mesh: Mesh, name: str) -> dict[str, Strategy]:
    if name not in BASELINES:
        raise AutoshardError(f"a baseline among {BASELINES}", got=repr(name),
                             fix="pick one of the listed names")
    nd = mesh.ndim
    tp_axes = {"dp": [], "megatron": list(range(nd)), "megatron-dp": [nd - 1]}[name]
    dp_axes = [a for a in range(nd) if a not in tp_axes]
    roles = megatron_roles(traced) if tp_axes else {}
    pins: dict[str, Strategy] = {}
    for p in traced.params:
        if p.info is None:
            continue
        spec = tensor_parallel_spec(traced, p.name, roles.get(p.name), p.info.shape, tp_axes, nd)
        if _is_embedding_or_head(traced, p.name):
            continue            # left to the solver, see the module docstring
        if not spec_fits(p.info.shape, spec, mesh.shape):
            spec = (Replicate(),) * nd
        pins[p.name] = Strategy((), (spec,))
    for p in traced.inputs:
        if p.info is None or p.info.ndim == 0:
            continue
        spec, used = [Replicate()] * nd, 1
        for a in dp_axes:
            if p.info.shape[0] % (used * mesh.shape[a]) == 0:
                spec[a] = Shard(0)
                used *= mesh.shape[a]
        pins[p.name] = Strategy((), (tuple(spec),))
    return pins


def _is_embedding_or_head(traced: TracedGraph, ph_name: str) -> bool:
    node = next(n for n in traced.graph.nodes if n.name == ph_name)
    return any(u.target is aten.embedding.default for u in node.users) or any(
        "lm_head" in (p.fqn if (p := traced.placeholder(ph_name)) else "") for _ in [0])


def fsdp_tp_layouts(traced: TracedGraph, mesh: Mesh) -> dict[str, Strategy]:
    """torchtitan's 2-D storage: Megatron's spec over the last axis (embeddings and head
    replicated there), and over every other axis FSDP's shard of the first dim that divides
    evenly; the batch split over the other axes."""
    nd = mesh.ndim
    out = dict(zero3_layouts(traced, mesh))
    roles = megatron_roles(traced)
    for p in traced.params:
        if p.info is None:
            continue
        tp = tensor_parallel_spec(traced, p.name, roles.get(p.name), p.info.shape, [nd - 1], nd)
        if _is_embedding_or_head(traced, p.name) or not spec_fits(p.info.shape, tp, mesh.shape):
            tp = (Replicate(),) * nd
        spec = tp
        for d in range(len(p.info.shape)):
            cand = tuple(Shard(d) if a < nd - 1 else tp[a] for a in range(nd))
            if spec_fits(p.info.shape, cand, mesh.shape):
                spec = cand
                break
        out[p.name] = Strategy((), (spec,))
    for p in traced.inputs:
        if p.info is not None and p.info.ndim > 0:
            spec_l, used = [Replicate()] * nd, 1
            for a in range(nd - 1):
                if p.info.shape[0] % (used * mesh.shape[a]) == 0:
                    spec_l[a] = Shard(0)
                    used *= mesh.shape[a]
            out[p.name] = Strategy((), (tuple(spec_l),))
    return out


def zero3_layouts(traced: TracedGraph, mesh: Mesh) -> dict[str, Strategy]:
    """ZeRO-3 / FSDP storage (Rajbhandari et al., "ZeRO", arXiv 1910.02054, stage 3): every
    parameter sharded over all mesh axes on its first dim that divides evenly (replicated if
    none does), the inputs split on the batch over every axis that divides it.

    These are *stored* layouts, for ``solver.alternatives.plan_stored``: the ILP may all-gather
    a weight for the ops that read it whole, which ``baseline_plan`` (weights read in place)
    would not allow."""
    nd = mesh.ndim
    out: dict[str, Strategy] = {}
    for p in traced.params:
        if p.info is None:
            continue
        spec: Spec = (Replicate(),) * nd
        for d in range(len(p.info.shape)):
            cand = (Shard(d),) * nd
            if spec_fits(p.info.shape, cand, mesh.shape):
                spec = cand
                break
        out[p.name] = Strategy((), (spec,))
    for p in traced.inputs:
        if p.info is None or p.info.ndim == 0:
            continue
        spec_l, used = [Replicate()] * nd, 1
        for a in range(nd):
            if p.info.shape[0] % (used * mesh.shape[a]) == 0:
                spec_l[a] = Shard(0)
                used *= mesh.shape[a]
        out[p.name] = Strategy((), (tuple(spec_l),))
    return out
