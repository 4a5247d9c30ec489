"""What a pipeline's layers and stages cost (docs/cost-model.md §10): each layer's seconds and
bytes for one microbatch from the stages' one SPMD plan on the sub-mesh (solver/pipeline.py),
the bytes a cut after it sends, and from those a cut's stages' figures and the step its schedule
runs them in. Kept apart from the cut search (solver/stage_cuts.py), which balances these
figures, and from the assembly (solver/pipeline_assembly.py), which records them in the plan."""
from __future__ import annotations

import operator
from dataclasses import dataclass

from autoshard.cost.comm import link_time
from autoshard.cost.compute import local_numel
from autoshard.cost.price import Pricer
from autoshard.ir import CollectiveKind, Phase
from autoshard.mesh import AxisLink, Mesh
from autoshard.plans import Plan
from autoshard.plans.records import CollectiveRecord
from autoshard.schedules import SPLIT_BACKWARD, in_flight, rank_stages, sends_between, \
    simulate_schedule
from autoshard.trace.export import TracedGraph
from autoshard.trace.layers import stages_of


@dataclass(frozen=True)
class LayerFigures:
    """Per layer of the traced graph, for one microbatch on the sub-mesh, from the sub-plan's
    prices; what comes before the first layer counts with it, what comes after the last with
    that one (trace/layers.py ``stages_of``, one layer per stage)."""

    where: dict[str, int]       # node -> the index of its layer
    secs: list[float]           # forward and backward seconds (a recomputed forward too)
    fwd: list[float]            # the forward's seconds alone
    wgt: list[float]            # the weights' gradient (W of a split backward): half of backward
    opt: list[float]            # the optimizer step's seconds, once per step
    comm: list[float]           # the seconds of one microbatch's collectives
    sync: list[float]           # the gradient buckets' seconds, once per step
    state: list[float]          # bytes of model state
    acts: list[float]           # bytes one microbatch keeps for backward
    boundary: tuple[list[float], list[float]]   # bytes sent forward, and back, after the layer
    send: list[float]           # seconds of those sends if a stage ended after the layer

    @property
    def balanced(self) -> tuple[list[float], ...]:
        """What the cut search balances (solver/stage_cuts.py): (secs, comm, send, state,
        acts)."""
        return self.secs, self.comm, self.send, self.state, self.acts


def layer_figures(traced: TracedGraph, spmd: Plan, strategies: dict, pricer: Pricer, sub: Mesh,
                  link: AxisLink) -> LayerFigures:
    """The figures of every layer under the sub-plan ``spmd`` (its ``strategies``), priced by
    ``pricer`` on ``sub``; ``link``: the pipeline axis's, which the sends cross."""
    where = stages_of(traced.graph, traced.layers,
                      tuple((layer.name,) for layer in traced.layers))
    L = len(traced.layers)
    secs, state, acts, opt, fwd, wgt = _node_sums(traced, strategies, pricer, where, L)
    _add_saved_copies(acts, strategies, pricer, where)
    comm, sync = _collective_sums(spmd.collectives, sub, where, L)
    boundary = (boundary_bytes(traced, where, strategies, sub),
                boundary_bytes(traced, where, strategies, sub, grads=pricer.grads))
    # Activations forward, their gradients backward: one send each way per microbatch.
    send = [link_time(link, CollectiveKind.SEND_RECV, 2, f)
            + link_time(link, CollectiveKind.SEND_RECV, 2, b)
            for f, b in zip(*boundary)]
    return LayerFigures(where, secs, fwd, wgt, opt, comm, sync, state, acts, boundary, send)


def _node_sums(traced: TracedGraph, strategies: dict, pricer: Pricer, where: dict[str, int],
               L: int) -> tuple[list[float], ...]:
    """Per layer, of its nodes: (secs, state, acts, opt, fwd, wgt) of :class:`LayerFigures`."""
    secs, state, acts, opt, fwd, wgt = ([0.0] * L for _ in range(6))
    for n in traced.graph.nodes:
        if n.name not in strategies:
            continue
        st, i = strategies[n.name], where[n.name]
        if n.op == "placeholder":
            state[i] += pricer.memory(n.name, st)
            opt[i] += pricer.compute(n.name, st)         # its optimizer step
        else:
            secs[i] += pricer.compute(n.name, st)
            acts[i] += pricer.memory(n.name, st)
            # Its forward, and its share of the weights' gradient (W of a split backward,
            # autoshard/schedules.py): half its backward, as for a matmul (dX and dW cost
            # alike); a recomputed forward runs with B.
            f, b = pricer.times(n.name, st)
            fwd[i] += f
            wgt[i] += b / 2
    return secs, state, acts, opt, fwd, wgt


def _add_saved_copies(acts: list[float], strategies: dict, pricer: Pricer,
                      where: dict[str, int]) -> None:
    """Saved copies of resharded values (what a consumer saves in its own layout), on the layer
    of the value they copy, as the ILP's memory sum counts them (Pricer.saved_copies)."""
    for ref, cons in pricer.saved_inputs().items():
        src = strategies[ref[0]].outputs[ref[1]]
        for dst in dict.fromkeys(strategies[c].inputs[k] for c, k in cons):
            acts[where.get(cons[0][0], where.get(ref[0], 0))] += \
                pricer.saved_copy_bytes(ref, src, dst) * pricer.copy_weight(ref, cons, src, dst)


def _collective_sums(collectives, sub: Mesh, where: dict[str, int], L: int
                     ) -> tuple[list[float], list[float]]:
    """(comm, sync) of :class:`LayerFigures`: collectives of one microbatch, on the layer of the
    op that runs them; gradient buckets, synced once per step after the last microbatch
    (codegen/buckets.py ``defer``), on their first member's, with the optimizer step."""
    comm, sync = [0.0] * L, [0.0] * L
    for c in collectives:
        if c.members:
            sync[where.get(c.members[0], L - 1)] += record_seconds(c, sub)
        elif c.phase != Phase.OPTIMIZER:
            comm[where.get(c.node, L - 1)] += record_seconds(c, sub)
    return comm, sync


def record_seconds(c: CollectiveRecord, mesh: Mesh) -> float:
    """Seconds of one run of a collective of the plan on ``mesh`` (its first axis's link)."""
    axis = mesh.axes.index(c.axes[0])
    return link_time(mesh.links[axis], c.kind, mesh.shape[axis], c.bytes)


def boundary_bytes(traced: TracedGraph, where: dict[str, int], strategies: dict,
                   sub: Mesh, grads: set[str] | None = None) -> list[float]:
    """Bytes one rank sends forward after each layer if a stage ended there: every value made
    at or before it (graph inputs included) and read after it, in its local layout; with
    ``grads`` (the values with a gradient), only those: the gradients sent back."""
    L = max(where.values()) + 1
    out = [0.0] * L
    for n in traced.graph.nodes:
        if n.op == "output" or (n.op == "placeholder" and
                                traced.placeholder(n.name).kind != "input"):
            continue
        made = 0 if n.op == "placeholder" else where.get(n.name, 0)   # inputs enter stage 0
        readers = [where[u.name] for u in n.users if u.name in where]
        if not readers or "val" not in n.meta or not hasattr(n.meta["val"], "shape"):
            continue
        last = max(readers)
        src, k = (n.args[0].name, n.args[1]) if n.target is operator.getitem else (n.name, 0)
        if grads is not None and src not in grads:
            continue
        spec = strategies[src].outputs[k] if src in strategies and \
            len(strategies[src].outputs) > k else None
        nbytes = local_numel(tuple(n.meta["val"].shape), spec, sub.shape) \
            * n.meta["val"].element_size()
        for k in range(made, last):
            out[k] += nbytes
    return out


def stage_figures(cuts, figs: LayerFigures, p: int, m: int, schedule: str) -> list[dict]:
    """Each stage's figures for ``cuts`` ((first layer, end) pairs) on ``p`` ranks: its seconds
    per microbatch (compute, the forward, the weights' gradient, collectives and its sends), its
    share of the step (optimizer, gradient sync), and the cut search's memory sum with the
    schedule's microbatches in flight."""
    secs, comm, send, state, acts = figs.balanced
    L = len(secs)
    out = []
    for s, (i, j) in enumerate(cuts):
        sends = (send[j - 1] if j < L and sends_between(schedule, p, s) else 0.0) \
            + (send[i - 1] if i > 0 and sends_between(schedule, p, s - 1) else 0.0)
        out.append({"compute_s": sum(secs[i:j]), "comm_s": sum(comm[i:j]) + sends,
                    "forward_s": sum(figs.fwd[i:j]), "weight_s": sum(figs.wgt[i:j]),
                    "optimizer_s": sum(figs.opt[i:j]), "sync_s": sum(figs.sync[i:j]),
                    "ilp_memory_bytes": sum(state[i:j])
                    + in_flight(schedule, s, p, m) * sum(acts[i:j])})
    return out


def cut_step_seconds(figures: list[dict], m: int, ranks: int, schedule: str, *,
                     comm: bool) -> float:
    """The schedule's forward and backward over ``m`` microbatches, of the stages' compute, and
    their communication with ``comm``: its order of actions run with each stage's own F, B and W
    seconds (autoshard/schedules.py ``simulate_schedule``; exact for uneven stages, where the
    closed forms are not). F is a stage's forward and, under a split backward, W its weights'
    gradient (``stage_figures``); its communication (collectives and sends, forward and
    backward about alike) counts half with F, half with B, none with W. Without a split
    backward B is the rest, the whole backward."""
    total = [f["compute_s"] + (f["comm_s"] if comm else 0.0) for f in figures]
    forward = [f["forward_s"] + (f["comm_s"] / 2 if comm else 0.0) for f in figures]
    weight = [f["weight_s"] if schedule in SPLIT_BACKWARD else 0.0 for f in figures]
    backward = [t - x - y for t, x, y in zip(total, forward, weight)]
    return simulate_schedule(schedule, ranks, m, forward, backward, weight)


def per_rank(figures: list[dict], ranks: int, schedule: str, *keys: str) -> float:
    """The largest sum of ``keys`` over one rank's stages (rank ``r``: stages ``r``, ``r + p``,
    ..., or ``r`` and ``2p - 1 - r`` V-placed)."""
    return max(sum(figures[s][k] for s in rank_stages(schedule, ranks, r) for k in keys)
               for r in range(ranks))
