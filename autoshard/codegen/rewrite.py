"""Rewrite the traced graph into one rank's program.

Every node keeps its op; size arguments become local sizes (the rule's ``localize``); at every
point where a value's spec differs from what its consumer needs, or its gradient must be summed
over an axis, a :class:`ReshardCall` node applies the reshard's collectives in forward and their
duals in backward. The graph is stamped with the plan that produced it.
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from autoshard.codegen.buckets import DeferredGradSync, GradBuckets
from autoshard.codegen.collectives import Ledger, redistribute, reduce_over_axis
from autoshard.codegen.hostlink import HostBuffers
from autoshard.codegen.recompute import outline
from autoshard.codegen.ring import RingCall
from autoshard.cost.program import step_program
from autoshard.cost.reshards import ReshardEdge
from autoshard.errors import AutoshardError
from autoshard.ir import Phase, spec_str
from autoshard.ops.registry import CollectiveKernel, OpCollective, localize, op_collectives
from autoshard.ops.ring import RingKernel
from autoshard.plans import Plan
from autoshard.trace.export import TracedGraph, op_info
from autoshard.trace.graph import value_ref


class ReshardCall:
    """A graph target that moves one value from its spec to what its consumers need."""

    def __init__(self, edge: ReshardEdge, runtime: "RankRuntime", *, bucketed: bool = False,
                 written: bool = False) -> None:
        self.edge, self.rt, self.bucketed, self.written = edge, runtime, bucketed, written
        self.__name__ = f"reshard_{spec_str(edge.src)}_to_{spec_str(edge.dst)}".replace(
            "[", "").replace("]", "").replace(", ", "_").replace("(", "").replace(")", "")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        e = self.edge
        if self.bucketed:
            # A bucketed gradient sync: the bucket all-reduces it (codegen/buckets.py).
            return DeferredGradSync.apply(x, functools.partial(self.rt.buckets.arrive,
                                                               e.value[0]))
        y = redistribute(x, e.reshard, self.rt.groups, ledger=self.rt.ledger,
                         node=e.consumers[0][0], phase=self.rt.phase,
                         grad_phase=Phase.GRAD_SYNC if e.from_param else Phase.BACKWARD)
        # An in-place consumer (ops/inplace.py) writes into what it is given; autograd forbids
        # writing into a view that a custom Function returned (its own backward would be
        # bypassed), and a reshard whose forward moves nothing, or slices the leading dim,
        # returns one. That consumer gets its own copy: the write lands in the resharded
        # value, as it does when the reshard's collectives make a new tensor.
        if self.written and y._is_view():
            y = y.clone()
        return y

    def __repr__(self) -> str:
        return self.__name__


def writes_into(targets: dict[str, Any], edge: ReshardEdge) -> bool:
    """Whether a consumer of ``edge`` writes into the input it reads there (an in-place op's
    first argument, as its schema marks it)."""
    for node, index in edge.consumers:
        schema = getattr(targets.get(node), "_schema", None)
        if schema is not None and index < len(schema.arguments):
            alias = schema.arguments[index].alias_info
            if alias is not None and alias.is_write:
                return True
    return False


HOST = torch.device("cpu")


class HostFetch(torch.autograd.Function):
    """A parameter kept on the host (parameter offload, cost/state.py ``offload_params``): its
    stored shard copied to the device for one use; in backward, the gradient of that use
    copied back down into the host parameter's ``.grad`` (codegen/hostlink.py: pinned memory
    kept from step to step; autograd's own accumulation would copy into a fresh pageable tensor
    at a fraction of the link's speed). Both copies are counted in the ledger's host records,
    as the plan lists them; on a CPU run the host is the device and nothing moves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, call: "FetchCall") -> torch.Tensor:
        ctx.call, ctx.param = call, x
        ctx.set_materialize_grads(False)
        rt = call.rt
        # A checkpointed layer's recomputation copies it in again, selective or not: the copy
        # is not one of the outputs selective checkpointing stores.
        phase = Phase.RECOMPUTE if rt.phase in (Phase.RECOMPUTE, Phase.REPLAY) else rt.phase
        rt.ledger.add_host("h2d", x, phase, call.node, call.value)
        if x.device == rt.device:
            return x.view_as(x)
        return rt.host.fetch(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:        # a bucket took the gradient (codegen/buckets.py)
            return None, None
        call = ctx.call
        call.rt.ledger.add_host("d2h", grad, Phase.BACKWARD, call.node, call.value)
        if grad.device == HOST:
            return grad, None
        p, host = ctx.param, call.rt.host
        p.grad = host.down(grad, call.value, p.grad)
        host.settle_after_backward()
        return None, None


class FetchCall:
    """A graph target: one use's copy in of a parameter kept on the host (:class:`HostFetch`);
    ``node``: the first op of the use, ``value``: the parameter's placeholder."""

    def __init__(self, runtime: "RankRuntime", node: str, value: str) -> None:
        self.rt, self.node, self.value = runtime, node, value
        self.__name__ = "fetch_" + value

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return HostFetch.apply(x, self)

    def __repr__(self) -> str:
        return self.__name__


class KernelCall:
    """A graph target: an op's kernel that reduces across ranks inside itself (ops/registry.py
    ``CollectiveKernel``, e.g. the vocabulary-parallel cross-entropy), bound to this rank's
    groups. Its all-reduces are written to the ledger under the op's node, each next to the
    bytes the plan lists for it (``planned``, in the order the kernel runs them in each phase):
    forward ones in the phase the rank is in, backward ones (SyncBatchNorm's) in "backward"."""

    def __init__(self, kernel: CollectiveKernel, runtime: "RankRuntime", node: str,
                 planned: tuple[OpCollective, ...]) -> None:
        self.kernel, self.rt, self.node, self.planned = kernel, runtime, node, planned
        self.__name__ = kernel.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        planned = {p: iter([c for c in self.planned if c.phase == p])
                   for p in (Phase.FORWARD, Phase.BACKWARD)}
        phase = self.rt.phase       # (the backward runs later, whatever the rank's phase then)

        def reduce(x: torch.Tensor, how: str, backward: bool = False) -> torch.Tensor:
            for axis in self.kernel.axes:
                want = next(planned[Phase.BACKWARD if backward else Phase.FORWARD], None)
                x = reduce_over_axis(x, how, axis, self.rt.groups, ledger=self.rt.ledger,
                                     planned_nbytes=want.nbytes if want else -1,
                                     phase=Phase.BACKWARD if backward else phase,
                                     node=self.node)
            return x

        return self.kernel.bind(reduce)(*args, **kwargs)

    def __repr__(self) -> str:
        return self.__name__


class RankRuntime:
    """What the emitted program needs at run time: this rank's groups, the byte ledger and the
    plan's gradient buckets."""

    def __init__(self, groups: Any, device: torch.device, plan: Plan | None = None) -> None:
        self.groups = groups
        self.device = device
        self.ledger = Ledger()
        self.host = HostBuffers(device)     # offload's copies over the host link (hostlink.py)
        # "recompute" while a checkpointed layer runs again; "replay" while a selectively
        # checkpointed one does (its collectives return stored outputs: nothing is counted).
        self.phase = Phase.FORWARD
        # On a pipeline, this rank's stages (plans.py Pipeline.stages_of) and their buckets;
        # -1 stands for every rank.
        self.stages: tuple[int, ...] = (-1,)
        if plan is not None and plan.pipeline is not None:
            axis = plan.mesh_axes.index(plan.pipeline.axis)
            self.stages = (-1, *plan.pipeline.stages_of(groups.coords[axis]))
        records = [c for c in (plan.collectives if plan else ())
                   if c.members and c.stage in self.stages]
        self.buckets = GradBuckets(records, groups, self.ledger, self.host) if records else None


class _Emitter:
    """The rank program as it is emitted: the graph ``g``, each traced value's node (``env``),
    and the reshards and host fetches emitted so far (``moved``), shared by the consumers that
    read one value in one layout in one stage."""

    def __init__(self, traced: TracedGraph, plan: Plan, runtime: RankRuntime,
                 stages: dict[str, int] | None) -> None:
        self.runtime, self.stages = runtime, stages
        self.strategies = plan.strategies()
        self.targets = {n.name: n.target for n in traced.graph.nodes}
        # What the rank runs, in order (cost/program.py): the liveness walk reads the same
        # program.
        self.program = step_program(traced, self.strategies, plan.mesh_shape,
                                    bucket_bytes=plan.options.bucket_bytes,
                                    recompute=plan.recompute, joint=plan.joint_groups(),
                                    shapes=traced.value_shapes)
        # The gradient sync each bucket member's bucket runs, as the planner picked it.
        members = set(runtime.buckets.of) if runtime.buckets is not None else set()
        self.bucketed = {self.program.edges[i] for p, i in self.program.bucketed.items()
                         if p in members}
        # Parameters kept on the host: each use copies them in (a reshard's input, or one copy
        # the ops reading them where they lie share), as solver/assemble.py host_transfers
        # lists.
        self.fetched = self.program.fetched
        self.g = fx.Graph()
        self.env: dict[str, fx.Node] = {}
        self.moved: dict[tuple, fx.Node] = {}   # (value, dst, divergent, stage) -> node
        self.last_stage = max(stages.values(), default=0) if stages else 0

    def fetch(self, ref: tuple[str, int], src: fx.Node, node: str, stage: int | None
              ) -> fx.Node:
        n = self.g.call_function(FetchCall(self.runtime, node, ref[0]), (src,))
        n.meta["autoshard"] = {"fetch": ref[0]}
        n.meta["autoshard_ref"] = (ref, None)
        if stage is not None:
            n.meta["autoshard_stage"] = stage
        return n

    def local(self, ref: tuple[str, int], consumer: tuple[str, int]) -> fx.Node:
        """The node holding ``ref`` as ``consumer`` reads it: resharded, fetched, or as is."""
        src = self.env.get(f"{ref[0]}#{ref[1]}", self.env.get(ref[0]))
        e = self.program.edge(ref, consumer)
        stage = None if self.stages is None else self.stages.get(consumer[0], self.last_stage)
        if e is None:
            if ref[0] not in self.fetched:
                return src
            key = (ref, "fetch", stage)
            if key not in self.moved:
                self.moved[key] = self.fetch(ref, src, consumer[0], stage)
            return self.moved[key]
        key = (ref, e.dst, e.divergent, stage)
        if key not in self.moved:
            if ref[0] in self.fetched:
                src = self.fetch(ref, src, e.consumers[0][0], stage)
            n = self.g.call_function(ReshardCall(e, self.runtime, bucketed=e in self.bucketed,
                                                 written=writes_into(self.targets, e)), (src,))
            n.meta["autoshard"] = {"reshard": f"{spec_str(e.src)} -> {spec_str(e.dst)}",
                                   "divergent": sorted(e.divergent)}
            n.meta["autoshard_ref"] = (ref, e.dst)
            if stage is not None:
                n.meta["autoshard_stage"] = stage
            self.moved[key] = n
        return self.moved[key]

    def getitems(self, node: fx.Node, new: fx.Node, items: list[fx.Node]) -> None:
        """The getitem nodes reading a multi-output op's ``new`` node."""
        for item in items:
            idx = item.args[1]
            n = self.g.call_function(operator.getitem, (new, idx))
            n.meta["autoshard_ref"] = ((node.name, idx), None)
            if self.stages is not None:
                n.meta["autoshard_stage"] = self.stages[node.name]
            self.env[f"{node.name}#{idx}"] = n
            self.env[item.name] = n


def emit(traced: TracedGraph, plan: Plan, runtime: RankRuntime,
         stages: dict[str, int] | None = None) -> fx.GraphModule:
    """The rank program of ``plan``. With ``stages`` (node -> pipeline stage, a pipelined plan),
    every emitted node's ``meta["autoshard_stage"]`` says which stage runs it, and a reshard
    read in two stages is emitted in each (codegen/pipeline.py cuts the program there); every
    node's ``meta["autoshard_ref"]`` names the traced value it holds."""
    mesh_shape, coords = plan.mesh_shape, runtime.groups.coords
    em = _Emitter(traced, plan, runtime, stages)
    g, env, program = em.g, em.env, em.program
    for layer in plan.recompute:
        _layer_nodes(traced, layer)          # (a layer the model lacks: a damaged plan file)
    nodes = {n.name: n for n in traced.graph.nodes}
    getitems: dict[str, list[fx.Node]] = {}
    for node in traced.graph.nodes:
        if node.op == "placeholder":
            env[node.name] = g.placeholder(node.name)
            env[node.name].meta["autoshard_ref"] = ((node.name, 0), None)
        elif node.target is operator.getitem:
            getitems.setdefault(node.args[0].name, []).append(node)
    # Checkpointed layers: (node before the layer's first event, the layer's last op) in g.
    regions: dict[str, list] = {}
    for ev in program.events:
        if ev.region is not None and ev.region not in regions:
            regions[ev.region] = [list(g.nodes)[-1], None]
        if ev.kind == "reshard":
            e = program.edges[ev.edge]
            em.local(e.value, next(c for c in e.consumers if c[0] == ev.name))
            continue
        node = nodes[ev.name]
        new = _emit_op(g, node, em.local, em.strategies[node.name], runtime, mesh_shape, coords)
        if stages is not None:
            new.meta["autoshard_stage"] = stages[node.name]
        env[node.name] = new
        if ev.region is not None:
            regions[ev.region][1] = new
        em.getitems(node, new, getitems.get(node.name, []))
    out = next(n for n in traced.graph.nodes if n.op == "output")
    refs = [value_ref(a) for a in torch.utils._pytree.tree_flatten(out.args)[0]
            if isinstance(a, fx.Node)]
    outs = [em.local(r, (out.name, k)) for k, r in enumerate(refs)]
    g.output(outs[0] if len(outs) == 1 else tuple(outs))
    for layer, (after, last) in regions.items():
        outline(g, after, last, runtime, layer, plan.recompute[layer])
    gm = fx.GraphModule(torch.nn.Module(), g, class_name="AutoshardRankProgram")
    gm.meta["autoshard_plan"] = {"fingerprint": plan.fingerprint, "mesh": list(mesh_shape),
                                 "axes": list(plan.mesh_axes), "coords": list(coords)}
    return gm


def _makes_from_nothing(fn: Any) -> bool:
    """Whether ``fn`` is an ATen factory: a ``device`` argument and no tensor one."""
    schema = getattr(fn, "_schema", None)
    if not isinstance(fn, torch._ops.OpOverload) or schema is None:
        return False
    args = schema.arguments
    return any(a.name == "device" for a in args) and not any("Tensor" in str(a.type)
                                                             for a in args)


def _emit_op(g: fx.Graph, node: fx.Node, local: Any, strat: Any, runtime: RankRuntime,
             mesh_shape: tuple[int, ...], coords: tuple[int, ...]) -> fx.Node:
    """One op of the traced graph on this rank: its inputs as ``local`` delivers them (resharded
    or copied in), its sizes local (the rule's ``localize``)."""
    k = iter(range(10**6))
    args, kwargs = fx.node.map_aggregate(
        (node.args, node.kwargs),
        lambda a: local(value_ref(a), (node.name, next(k))) if isinstance(a, fx.Node) else a)
    if "device" in kwargs:   # traced on meta or another device: run where this rank runs
        kwargs = {**kwargs, "device": runtime.device}
    if node.target is torch.ops.aten.to.device:    # (self, device, dtype, ...) positionally
        args = (args[0], runtime.device, *args[2:])
    info = op_info(node)
    fn, args, kwargs = localize(info, strat, mesh_shape, coords, args, kwargs)
    if "device" not in kwargs and _makes_from_nothing(fn):
        # (a ``*_like`` draw localized as a draw of its input's global shape: ops/factory.py)
        kwargs = {**kwargs, "device": runtime.device}
    if isinstance(fn, CollectiveKernel):
        fn = KernelCall(fn, runtime, node.name, op_collectives(info, strat, mesh_shape))
    elif isinstance(fn, RingKernel):
        fn = RingCall(fn, runtime, node.name, op_collectives(info, strat, mesh_shape))
    new = g.call_function(fn, tuple(args), dict(kwargs))
    new.meta["autoshard"] = {"strategy": str(strat)}
    new.meta["autoshard_op"] = node.target      # the traced op (the target may be its kernel)
    new.meta["autoshard_ref"] = ((node.name, 0), None)
    return new


def _layer_nodes(traced: TracedGraph, layer: str) -> tuple[str, ...]:
    """The ops of a layer (trace/layers.py: contiguous in the graph, the planner checked)."""
    found = next((lay for lay in traced.layers if lay.name == layer), None)
    if found is None:
        raise AutoshardError(f"layers to recompute among the model's {len(traced.layers)}",
                             got=repr(layer), fix="re-plan: the plan file was edited or is damaged")
    ops = {n.name for n in traced.graph.nodes if n.op == "call_function"}
    return tuple(n for n in found.nodes if n in ops)

