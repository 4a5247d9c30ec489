"""The sub-mesh a pipeline's stages are planned on, and the whole-mesh Plan assembled from their
one sub-plan once the schedule search has chosen (docs/cost-model.md §10): the sub-plan's
decisions replicated over the pipeline axis, each collective on every stage that runs it, the
gradient buckets formed per stage, a tied weight's all-reduce across its stages, the sends
between stages, and the step's predicted figures. Kept apart from the search (solver/pipeline.py)
because only its winner is assembled."""
from __future__ import annotations

from dataclasses import replace

from autoshard.cost.comm import link_time
from autoshard.cost.compute import local_numel
from autoshard.cost.overlap import bucket_bytes_by_axis, gradient_buckets
from autoshard.cost.price import Pricer
from autoshard.cost.reshards import reshard_edges
from autoshard.ir import CollectiveKind, Phase, Replicate, Spec
from autoshard.mesh import AxisLink, Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.plans.prediction import Prediction, StagePrediction
from autoshard.plans.records import CollectiveRecord, NodePlan, Pipeline, Stage
from autoshard.schedules import VIRTUAL_STAGES, WARMUP_BYTES, sends_between, stage_rank, \
    warmup_node
from autoshard.solver.stage_figures import per_rank, record_seconds, cut_step_seconds
from autoshard.trace.export import TracedGraph
from autoshard.trace.graph import value_inputs
from autoshard.trace.layers import stages_of

DUMMY = "_"          # the axis of a one-device sub-mesh (a mesh that is all pipeline)


def sub_mesh(mesh: Mesh, axis: int) -> Mesh:
    """``mesh`` without its pipeline axis, each other axis on its own link."""
    keep = [i for i in range(mesh.ndim) if i != axis]
    if not keep:
        return Mesh((1,), (DUMMY,), cluster=mesh.cluster)
    return Mesh(tuple(mesh.shape[i] for i in keep), tuple(mesh.axes[i] for i in keep),
                cluster=mesh.cluster, links=tuple(mesh.links[i] for i in keep))


def expand_spec(spec: Spec, axis: int, ndim: int, sub_ndim: int) -> Spec:
    """A sub-mesh spec on the whole mesh: replicated over the pipeline axis."""
    placements = list(spec) if ndim > 1 else []
    placements.insert(axis, Replicate())
    assert len(placements) == ndim and (ndim > 1 or sub_ndim == 1)
    return tuple(placements)


def assemble_pipelined(traced: TracedGraph, mesh: Mesh, a: int, spmd: Plan, sub: Mesh,
                       pricer: Pricer, stage_layers, cuts, figures, boundary, schedule: str,
                       m: int, step: float, options: PlanOptions) -> Plan:
    """The whole-mesh Plan: the sub-plan's decisions replicated over the pipeline axis ``a``;
    each collective on every stage that runs it (``count``: once per microbatch; the
    optimizer's once), gradient buckets formed per stage (a rank syncs only its stage's
    parameters), the sends between stages and the loss's all-reduce (phase "pipeline")."""
    axis, ranks = mesh.axes[a], mesh.shape[a]
    p = len(stage_layers)                  # stages: the ranks times the virtual stages
    strategies = spmd.strategies()
    where = stages_of(traced.graph, traced.layers, stage_layers)
    params = {ph.name for ph in traced.params}
    edges = list(reshard_edges(traced.graph, strategies, sub.shape, pricer.shapes, params,
                               training=traced.training, grads=pricer.grads))
    collectives = _stage_collectives(traced, spmd, edges, where, p, m)
    collectives += _stage_buckets(traced, strategies, edges, where, params, p, schedule, ranks,
                                  sub, options.bucket_bytes)
    tied, tied_s = _tied_syncs(traced, spmd, where, mesh.links[a], axis, schedule, ranks)
    collectives += tied
    collectives += _sends(boundary, cuts, axis, schedule, ranks, m)
    collectives.append(CollectiveRecord(CollectiveKind.ALL_REDUCE, (axis,), 4, Phase.PIPELINE,
                                        "loss"))
    stages = tuple(Stage(i, stage_layers[i], StagePrediction(
        figures[i]["compute_s"], figures[i]["comm_s"], figures[i]["ilp_memory_bytes"],
        figures[i]["peak_bytes"])) for i in range(p))
    predicted = _predicted(spmd, figures, collectives, sub, mesh.links[a], axis, schedule, ranks,
                           m, step, tied_s)
    return replace(spmd, mesh_shape=mesh.shape, mesh_axes=mesh.axes, options=options,
                   **_on_whole_mesh(spmd, a, mesh.ndim), collectives=tuple(collectives),
                   predicted=predicted,
                   pipeline=Pipeline(axis, schedule, m, stages, VIRTUAL_STAGES[schedule]),
                   layers=traced.layers)


def _stage_collectives(traced: TracedGraph, spmd: Plan, edges: list, where: dict[str, int],
                       p: int, m: int) -> list[CollectiveRecord]:
    """The sub-plan's collectives apart from its buckets, each on every stage that runs it (a
    reshard on the stages of its consumers, an optimizer's all-gather on the stages holding the
    parameter), as often as it runs: once per microbatch, the optimizer's once."""
    runs_on = {(e.value[0], e.consumers[0][0]): sorted({where[c] for c, _ in e.consumers
                                                        if c in where})
               for e in edges}
    out = []
    for c in spmd.collectives:
        if c.members:
            continue                                    # buckets: formed per stage
        if c.phase == Phase.OPTIMIZER:
            stages = holders(traced, c.value, where)
        else:
            stages = runs_on.get((c.value, c.node)) or [where.get(c.node, p - 1)]
        for s in stages:
            out.append(replace(c, axes=c.axes, stage=s,
                               count=1 if c.phase == Phase.OPTIMIZER else m))
    return out


def _stage_buckets(traced: TracedGraph, strategies: dict, edges: list, where: dict[str, int],
                   params: set[str], p: int, schedule: str, ranks: int, sub: Mesh,
                   bucket_bytes: float) -> list[CollectiveRecord]:
    """The gradient buckets of each of the ``p`` stages, formed from the parameters its ops
    read: a rank syncs only its stages' parameters."""
    nodes = [n for n in traced.graph.nodes if n.name in strategies]
    reads = {s: {ref[0] for n in nodes if where.get(n.name) == s and n.op != "placeholder"
                 for ref in value_inputs(n)} & params for s in range(p)}
    # A parameter two stages of one rank read (under a V, the embedding on stage 0 and the head
    # tied to it on stage 2p - 1) has one copy there, synced once: in the first one's buckets.
    bucketed_on: dict[int, set[str]] = {}
    out = []
    for s in range(p):
        held = bucketed_on.setdefault(stage_rank(schedule, ranks, s), set())
        mine = [e for e in edges if e.value[0] in reads[s] - held]
        held |= reads[s]
        for k, b in enumerate(gradient_buckets(mine, nodes, bucket_bytes, strategies, sub.shape)):
            for ax, nbytes in zip(b.axes, bucket_bytes_by_axis(b, sub.shape)):
                out.append(CollectiveRecord(b.kind_on(ax), (sub.axes[ax],), nbytes, Phase.GRAD_SYNC,
                                            f"stage{s}.bucket{k}", "", b.members, stage=s))
    return out


def _tied_syncs(traced: TracedGraph, spmd: Plan, where: dict[str, int], link: AxisLink,
                axis: str, schedule: str, ranks: int) -> tuple[list[CollectiveRecord], float]:
    """The all-reduce of each weight read on stages of two or more ranks (a head tied to the
    embedding), one per rank holding it, and the seconds of the longest."""
    tied_s = 0.0
    out = []
    for fqn, stages in tied_stages(traced, where).items():
        # One all-reduce per rank holding the weight (a rank may hold two of its stages).
        by_rank = {stage_rank(schedule, ranks, s): s for s in reversed(stages)}
        if len(by_rank) < 2:
            continue
        ph = next(x for x in traced.params if x.fqn == fqn)
        # The gradient as the stage holds it after backward: reduce-scattered into its bucket's
        # shard under ZeRO-2 or offload (the ParamState's grad spec), whole otherwise.
        st = spmd.param_state.get(fqn)
        nbytes = local_numel(tuple(ph.info.shape), st.grad if st else spmd.params[fqn],
                             spmd.mesh_shape) * ph.info.dtype.itemsize
        tied_s = max(tied_s, link_time(link, CollectiveKind.ALL_REDUCE, len(by_rank), nbytes))
        for s in sorted(by_rank.values()):
            out.append(CollectiveRecord(CollectiveKind.ALL_REDUCE, (axis,), nbytes, Phase.GRAD_SYNC,
                                        f"tied:{fqn}", ph.name, stage=s))
    return out, tied_s


def _sends(boundary, cuts, axis: str, schedule: str, ranks: int, m: int
           ) -> list[CollectiveRecord]:
    """The sends between stages, once per microbatch each way, and torch's warm-up of each
    link; none at the turn of a V (the stages are on one rank)."""
    out = []
    for s in range(len(cuts) - 1):
        if not sends_between(schedule, ranks, s):
            continue                      # the turn of a V: handed over on one rank, no send
        fwd, bwd = (int(b[cuts[s][1] - 1]) for b in boundary)
        out.append(CollectiveRecord(CollectiveKind.SEND_RECV, (axis,), fwd, Phase.PIPELINE,
                                    f"stage{s}->stage{s + 1}", stage=s, count=m))
        out.append(CollectiveRecord(CollectiveKind.SEND_RECV, (axis,), bwd, Phase.PIPELINE,
                                    f"stage{s + 1}->stage{s}", stage=s + 1, count=m))
        # torch's warm-up of the link on the first step, one int32 each way (schedules.py)
        out += [CollectiveRecord(CollectiveKind.SEND_RECV, (axis,), WARMUP_BYTES, Phase.PIPELINE,
                                 warmup_node(a, b), stage=a) for a, b in ((s, s + 1), (s + 1, s))]
    return out


def _predicted(spmd: Plan, figures: list[dict], collectives: list[CollectiveRecord], sub: Mesh,
               link: AxisLink, axis: str, schedule: str, ranks: int, m: int, step: float,
               tied_s: float) -> Prediction:
    """The pipelined step's predicted figures: ``step`` (the schedule's), the loss's all-reduce
    and ``tied_s`` (the tied weights'); its compute; per axis, what the slowest stage
    exposes."""
    p = len(figures)
    loss_s = link_time(link, CollectiveKind.ALL_REDUCE, ranks, 4)
    compute = cut_step_seconds(figures, m, ranks, schedule, comm=False) \
        + per_rank(figures, ranks, schedule, "optimizer_s")
    total = step + loss_s + tied_s
    keep = [x for x in sub.axes if x != DUMMY]
    # Per axis, the collectives of the slowest stage, as often as they run; the pipeline axis
    # the rest of what the step waits for beyond compute (sends, the bubble's share of them).
    slow = max(range(p), key=lambda i: figures[i]["compute_s"] + figures[i]["comm_s"])
    exposed = {x: sum(record_seconds(c, sub) * c.count for c in collectives
                      if c.stage == slow and c.axes[0] == x) for x in keep}
    # The sub-plan's liveness figures are of the whole model with one microbatch: not a stage's
    # peak. Each stage's is its own ``peak_bytes``, the walk of its program with the schedule's
    # microbatches in flight (solver/stage_cuts.py StageWalk), beside ``ilp_sum_bytes``, the
    # sums the cut search balances.
    return replace(spmd.predicted, step_time_s=total, compute_s=compute,
                   comm_s=total - compute,
                   ilp_sum_bytes=per_rank(figures, ranks, schedule, "ilp_memory_bytes"),
                   memory=None, peak_phase=None,
                   exposed_comm_s={**exposed,
                                   axis: max(0.0, total - compute - sum(exposed.values()))},
                   overlapped_comm_s={x: 0.0 for x in keep})


def _on_whole_mesh(spmd: Plan, a: int, ndim: int) -> dict:
    """The sub-plan's layouts on the whole mesh: replicated over the pipeline axis ``a``."""
    snd = len(spmd.mesh_shape)

    def ex(spec: Spec) -> Spec:
        return expand_spec(spec, a, ndim, snd)

    def ex_axes(axes: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return None if axes is None else tuple(x + (x >= a) for x in axes)

    return dict(nodes=tuple(NodePlan(n.name, n.op, tuple(ex(x) for x in n.inputs),
                                     tuple(ex(x) for x in n.outputs), n.kernel,
                                     ex_axes(n.state_axes))
                            for n in spmd.nodes),
                params={k: ex(v) for k, v in spmd.params.items()},
                inputs={k: ex(v) for k, v in spmd.inputs.items()},
                tied={k: tuple(ex(x) for x in v) for k, v in spmd.tied.items()},
                param_state={k: replace(st, grad=ex(st.grad), optimizer=ex(st.optimizer))
                             for k, st in spmd.param_state.items()})


def holders(traced: TracedGraph, placeholder: str, where: dict[str, int]) -> list[int]:
    """The stages holding a parameter or buffer: every stage with an op reading it."""
    node = traced.graph.find_nodes(op="placeholder", target=placeholder)
    return sorted({where[u.name] for n in node for u in n.users if u.name in where}) or \
        [where.get(placeholder, 0)]


def tied_stages(traced: TracedGraph, where: dict[str, int]) -> dict[str, tuple[int, ...]]:
    """Parameters read by more than one stage (a head tied to the embedding), with the stages
    that read them (``where``: node -> stage): each such stage keeps a copy, and their
    gradients are all-reduced over the pipeline axis after the last microbatch (as Megatron-LM
    does for its tied embedding)."""
    out = {}
    for ph in traced.params:
        stages = holders(traced, ph.name, where)
        if len(stages) > 1:
            out[ph.fqn] = tuple(stages)
    return out
