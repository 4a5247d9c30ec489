"""What a rank's optimizer steps for each parameter, laid out as the step program's optimizer
records say (cost/program.py ``ParamUpdate``, the records the plan's memory figures read):
which parameters are stepped, which keep an fp32 master apart, the layout their state is cut in
(ZeRO-1/2, offload: a slice of the local shard along one dim over the zero axes, ``_cut``) and
whether it lives on the host. codegen/optim.py runs the wrapped optimizer on these entries; the
DTensor placements of the state (``_placements``) say which part of the global tensor each
rank's entry holds, for torch.distributed.checkpoint.
"""
from __future__ import annotations

import dataclasses

import math
from dataclasses import dataclass
from typing import Any

import torch

from autoshard.cost.comm import reshard
from autoshard.cost.state import SCATTERS, master_dtype
from autoshard.errors import AutoshardError
from autoshard.ir import Shard, Spec, StateMode, spec_str


@dataclass
class _Entry:
    fqn: str
    placeholder: str
    param: torch.nn.Parameter
    master: torch.Tensor            # what the wrapped optimizer steps (may be ``param`` itself)
    dim: int | None                 # the state dim, when the state is a slice of the local shard
    cut: tuple[tuple[int, int], ...]   # (number of pieces, this rank's piece) per zero axis
    gather: tuple                   # the steps bringing the updated slice back (all-gathers)
    sharded_grad: bool              # zero2/offload: the gradient arrives as a shard
    shape: tuple[int, ...]          # the parameter's global shape
    spec: Spec                      # the parameter's spec
    placements: tuple               # DTensor placements of the master and the state (global)
    seen: int = -1                  # the parameter's version when its fp32 master was cut from it
    mode: StateMode | None = None   # the state mode (cost/state.py)
    on_host: bool = False           # its state and step on the host (its record's ``on_host``)


def records(pm: Any) -> dict[str, Any]:
    """The step program's optimizer records of this rank's parameters, by name (cost/program.py
    ``updates``, the ones the plan's memory figures read): which parameters are stepped, which
    keep an fp32 master apart, how their state is cut and whether it lives on the host. Built
    from the plan's decisions (its nodes' layouts and state modes) as the planner built
    them; the layout does not depend on the optimizer class."""
    from autoshard.cost.program import updates
    local = pm.local_parameters()
    return {u.fqn: u for u in updates(pm.traced, pm.plan.strategies(), pm.plan.mesh_shape,
                                      pm.plan.options.state_optimizer) if u.fqn in local}


def pieces(pm: Any, entries: list[_Entry], in_backward: frozenset[str] = frozenset()
           ) -> list[list[_Entry]]:
    """``entries`` in the pieces the device's update runs in after backward (cost/program.py
    ``OptimizerStep.pieces``, the moments the plan's memory figures read), less those stepped
    in backward (``in_backward``, placeholder names); those in none (state on the host, an
    optimizer without moments) are stepped with the first."""
    from autoshard.cost.program import OptimizerStep
    recs, by = records(pm), {e.fqn: e for e in entries}
    step = OptimizerStep(pm.plan.options.state_optimizer, "fused",
                         tuple(u for fqn, u in recs.items() if fqn in by), released=in_backward)
    return [[by[u.fqn] for u in piece] for piece in step.pieces()]


def entries(pm: Any) -> list[_Entry]:
    """What this rank's optimizer steps for each parameter the step program updates (module
    docstring; a frozen parameter, ``requires_grad=False`` when traced, has no record: no
    master, no state, no step), laid out as its record says."""
    plan, groups = pm.plan, pm.groups
    recs = records(pm)
    out: list[_Entry] = []
    for fqn, p in pm.local_parameters().items():
        u = recs.get(fqn)
        if u is None or not p.requires_grad:
            _refuse_unfrozen(fqn, p, u)
            continue
        u = _stage_record(plan, fqn, u)
        _check_recorded(plan, fqn, u)
        ph = pm._param_ph[fqn]
        shape = tuple(pm.traced.placeholder(ph).info.shape)
        state = u.state if u.state is not None else u.spec
        if u.state is None:
            dim, cut, gather = None, (), ()
        else:
            dim, cut = _cut(u.spec, u.state, groups.shape, groups.coords)
            gather = reshard(tuple(u.state), tuple(u.spec), shape, p.element_size(),
                             tuple(groups.shape)).forward
        src = pm.master_source.pop(fqn, None)      # bf16-mixed: the fp32 weight
        local = _slice(p.detach() if src is None else src, dim, cut)
        if not u.master:
            master = p                       # an fp32 or fp64 parameter is its own master
        else:                                # fp32, or the parameter's dtype where wider
            master = local.to(torch.device("cpu") if u.on_host else p.device,
                              master_dtype(p.dtype), copy=True)
            if u.on_host and p.is_cuda:  # the link's copies run at its speed from pinned memory
                master = master.pin_memory()
            master = torch.nn.Parameter(master)
        sharded = u.mode in SCATTERS and dim is not None
        out.append(_Entry(fqn, ph, p, master, dim, cut, gather, sharded, shape, u.spec,
                          _placements(u.spec, state, groups.shape), p._version, u.mode,
                          u.on_host))
    return out


def _refuse_unfrozen(fqn: str, p: torch.Tensor, u: Any) -> None:
    """A parameter trainable now that was frozen when the model was traced (or the other way)
    would be stepped with no state laid out for it, or laid out for none: refuse it."""
    if u is None and p.requires_grad:
        raise AutoshardError(
            f"{fqn} trainable as it was when the model was parallelized",
            got="requires_grad=True now, False when traced (no gradient or optimizer state is "
                "planned for it)",
            fix="set requires_grad before autoshard.parallelize (and plan), not after")


def _stage_record(plan: Any, fqn: str, u: Any) -> Any:
    """On a pipelined plan the stages are planned apart (solver/pipeline.py), and a weight tied
    across stages has its state cut as the stage that steps it decides; the records, built over
    the whole graph, do not see the stages: the plan's state layout is the one that holds."""
    st = plan.param_state.get(fqn)
    if plan.pipeline is None or st is None:
        return u
    state = tuple(st.optimizer)
    return dataclasses.replace(u, state=None if state == tuple(u.spec) else state)


def _check_recorded(plan: Any, fqn: str, u: Any) -> None:
    """The plan file's ``params`` entry repeats what its nodes decide (docs/plan-format.md):
    the optimizer placements must be the records' (one edited alone would lay out state the
    ledger does not gather)."""
    st = plan.param_state.get(fqn)
    listed = st.optimizer if st is not None else plan.params[fqn]
    want = u.state if u.state is not None else u.spec
    if tuple(listed) != tuple(want):
        raise AutoshardError(
            f"{fqn}: optimizer_placements {spec_str(want)}, as its layout, state mode "
            f"({u.mode or 'plain'}) and its node's state_axes place them", got=spec_str(listed),
            fix="re-plan: the plan file was edited or is damaged")


def _zero_axes(spec: Spec, state: Spec) -> list[int]:
    """The mesh axes on which the optimizer state is cut apart from the parameter, in order."""
    return [a for a, (p, q) in enumerate(zip(spec, state)) if p != q]


def _cut(spec: Spec, state: Spec, mesh_shape: tuple[int, ...], coords: tuple[int, ...]
         ) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The state dim and, per zero axis in order (row-major, the first outermost), the number of
    pieces and this rank's piece."""
    axes = _zero_axes(spec, state)
    dims = {state[a].dim for a in axes if isinstance(state[a], Shard)}
    if len(dims) != 1 or len(axes) != sum(isinstance(state[a], Shard) for a in axes):
        raise AutoshardError("optimizer placements that shard one dim over the parameter's "
                             "replicated axes", got=f"{spec} -> {state}",
                             fix="re-plan: the plan file was edited or is damaged")
    return dims.pop(), tuple((mesh_shape[a], coords[a]) for a in axes)


def _slice(t: torch.Tensor, dim: int | None, cut: tuple[tuple[int, int], ...]) -> torch.Tensor:
    for n, r in cut:
        t = t.chunk(n, dim)[r]
    return t


def _placements(spec: Spec, state: Spec, mesh_shape: tuple[int, ...]) -> tuple:
    """DTensor placements saying exactly which part of the global tensor a rank holds of state
    kept as ``state`` for a parameter stored as ``spec`` (``state == spec``: with the parameter).

    The rank's part is cut along each tensor dim first over the parameter's axes (its local
    shard, row-major in mesh order as docs/plan-format.md "Specs" and DTensor both cut), then over
    the zero axes (``_cut``, in mesh order). DTensor cuts a dim over mesh axes in mesh order, the
    first outermost (torch.distributed.tensor ``Shard``): the two orders agree, and each axis is
    ``Shard(d)``, unless a zero axis comes before a parameter axis that cuts the same dim (a plan
    the planner does not make, cost/state.py ``state_spec``, but one ``_cut`` accepts). Such an
    axis cuts after pieces the later axes already made: it is ``_StridedShard(d, split_factor=``
    their number ``)``, the layout of FSDP2 over tensor parallelism (torch.distributed.tensor
    ``_StridedShard``). tests/test_optim_state.py checks every layout against ``_cut``.
    """
    from torch.distributed.tensor import Replicate as DReplicate, Shard as DShard
    from torch.distributed.tensor.placement_types import _StridedShard
    order: dict[int, list[int]] = {}          # tensor dim -> the axes cutting it, outermost first
    for a, p in enumerate(spec):
        if isinstance(p, Shard):
            order.setdefault(p.dim, []).append(a)
    for a in _zero_axes(spec, state):
        order.setdefault(state[a].dim, []).append(a)
    out: list = [DReplicate()] * len(spec)
    for d, axes in order.items():
        for i, a in enumerate(axes):
            split = math.prod(mesh_shape[b] for b in axes[:i] if b > a)
            out[a] = DShard(d) if split == 1 else _StridedShard(d, split_factor=split)
    return tuple(out)


def _names(keys: list[str]) -> str:
    """Keys for an error message: the first five, and how many in all."""
    return ", ".join(keys[:5]) + (f", ... ({len(keys)} in all)" if len(keys) > 5 else "")


def grouped(pm: Any, entries: list[_Entry], params: Any) -> list[dict[str, Any]]:
    """``params`` as torch.optim takes it (an iterable of parameters, of ``(name, parameter)``
    pairs, or of dicts, each a parameter group with its own hyperparameters), of the parameters
    ``pm.named_parameters()`` yields or of the model ``pm`` was built from (while it lives), as
    groups of ``entries``: ``[{"params": [entries], **its hyperparameters}]``, in the order
    given. ``None``: one group of every entry.

    Every parameter this rank steps is in exactly one group. A frozen parameter is left out, as
    torch's optimizers leave one without a gradient; so is another pipeline stage's, which a
    rank lists but does not step, and a group may then be empty on this rank (every rank keeps
    every group, so group ``i`` is the same group everywhere: schedulers, state dicts)."""
    if params is None:
        return [{"params": list(entries)}]
    fix = ("pm.optimizer(torch.optim.AdamW, [{'params': decay, 'weight_decay': 0.1}, "
           "{'params': no_decay, 'weight_decay': 0.0}], lr=...) with the parameters taken from "
           "pm.named_parameters()")
    if isinstance(params, (torch.Tensor, dict)):
        raise AutoshardError("an iterable of parameters or of parameter groups (dicts)",
                             got=type(params).__name__, fix=fix)
    groups = list(params)
    if not groups:
        raise AutoshardError("at least one parameter or parameter group", got="an empty list",
                             fix=fix)
    if not all(isinstance(g, dict) for g in groups):
        groups = [{"params": groups}]
    fqns = pm.fqns if pm.pipeline is None else list(pm._every_spec)
    of: dict[int, str] = {id(pm._view(f)): f for f in fqns}
    of.update({id(p): f for f, p in pm.local_parameters().items()})
    of.update({k: f for k, (ref, f) in pm._origin.items() if ref() is not None})
    seen: dict[str, int] = {}
    hyper = []
    for i, g in enumerate(groups):
        if not isinstance(g, dict) or "params" not in g:
            raise AutoshardError("every parameter group a dict with a 'params' list",
                                 got=f"group {i}: {type(g).__name__}"
                                     + (f" with keys {sorted(g)}" if isinstance(g, dict) else ""),
                                 fix=fix)
        items = g["params"]
        items = [items] if isinstance(items, torch.Tensor) else list(items)
        for item in items:
            t = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            fqn = of.get(id(t))
            if fqn is None:
                raise AutoshardError(
                    "parameters of the ParallelModule, as pm.named_parameters() yields them, "
                    "or of the model it was built from",
                    got=f"in group {i}, " + (f"a tensor of shape {tuple(t.shape)} that is not "
                                             f"one of them, nor of the model it was built from"
                                             if isinstance(t, torch.Tensor)
                                             else f"a {type(item).__name__}"),
                    fix=fix)
            if fqn in seen:
                raise AutoshardError("each parameter in one group",
                                     got=f"{fqn} in groups {seen[fqn]} and {i}", fix=fix)
            seen[fqn] = i
        hyper.append({k: v for k, v in g.items() if k not in ("params", "param_names")})
    left = [e.fqn for e in entries if e.fqn not in seen]
    if left:
        raise AutoshardError(
            "every trainable parameter in a group (the plan holds gradients and optimizer "
            "state for each)", got=f"{len(left)} in none: {_names(left)}",
            fix="add them to a group, or set requires_grad=False before autoshard.parallelize "
                "and plan to leave them out")
    # (a group's entries in the rank's order, however listed: torch's state dicts pair state
    # with parameters by position, so one grouping saves and loads alike; frozen parameters and
    # another stage's have no entry)
    return [{**h, "params": [e for e in entries if seen[e.fqn] == i]}
            for i, h in enumerate(hyper)]
