"""Running a pipelined plan: the rank program cut into stage programs, driven by
torch.distributed.pipelining (docs/cost-model.md §10).

The rank program is emitted once for the whole graph (codegen/rewrite.py, every node tagged with
its stage), then cut: stage ``s`` is an FX GraphModule holding the ops of its stage, taking the
values that cross into it (every value made before the stage and read in it or after it; stage
0 takes the model's inputs) and returning the values that cross out of it (the last stage: the
loss). Parameters and buffers are not sent: each stage binds those its ops read (a weight tied
across stages is held by every stage reading it, its gradients all-reduced after the last
microbatch, as Megatron-LM does for its tied embedding). torch.distributed.pipelining's
``PipelineStage`` sends and receives the crossing values over the pipeline axis's process
group, its ``ScheduleGPipe`` / ``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` /
``ScheduleInterleavedZeroBubble`` / ``ScheduleZBVZeroBubble`` / ``ScheduleDualPipeV`` run the
microbatches (the last two place a rank's stages as a V and hand a microbatch from stage
``p - 1`` to stage ``p``, both on one rank, without a send); the loss of each is the last
stage's output divided by the number of microbatches (the step's loss is their mean; no
gradient scaling afterwards), and the last stage's sum is all-reduced over the pipeline axis so
every rank returns it. Gradient buckets are held over the microbatches and synced once, in the
last one's backward (codegen/buckets.py ``defer``), or under a split backward after the last
one's weight pass or whole backward (:class:`StageModule`). The sends are counted in the byte
ledger as they are issued.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from autoshard.codegen.collectives import ExecutedCollective
from autoshard.errors import AutoshardError
from autoshard.ir import CollectiveKind, Phase, local_shape
from autoshard.plans import Plan
from autoshard.cost.reshards import traced_grads
from autoshard.schedules import SPLIT_BACKWARD, WARMUP_BYTES, warmup_node


def cut(gm: fx.GraphModule, stages: int, input_names: list[str]
        ) -> list[tuple[fx.GraphModule, list[str], list[str]]]:
    """Per stage: its program, the placeholders it binds (parameters, buffers, constants, by
    name) and the names of the values it takes (placeholders of the emitted program or its
    nodes). Its program's inputs are the bound values, then the taken ones; its outputs, the
    values that cross into the next stage (the last stage: the program's output)."""
    g = gm.graph
    nodes = list(g.nodes)
    inputs = [n for n in nodes if n.op == "placeholder" and n.name in input_names]
    stage: dict[fx.Node, int] = {}
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if "autoshard_stage" in n.meta:
            stage[n] = n.meta["autoshard_stage"]
        else:      # made by a pass after emit (a checkpointed layer's parts): its inputs' stage
            stage[n] = max((stage[a] for a in n.all_input_nodes if a in stage), default=0)
    out_node = next(n for n in nodes if n.op == "output")
    last_use = {}
    for n in nodes:
        users = [stages - 1 if u is out_node else stage[u] for u in n.users]
        if users:
            last_use[n] = max(users)
    crossing: list[list[fx.Node]] = []
    for s in range(stages - 1):
        made = [n for n in nodes if (n in inputs or stage.get(n, stages) <= s)
                and last_use.get(n, -1) > s]
        crossing.append(made)
    out = []
    for s in range(stages):
        sg = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        takes = inputs if s == 0 else crossing[s - 1]
        mine = [n for n in nodes if stage.get(n) == s]
        bound = [a for a in dict.fromkeys(a for n in mine for a in n.all_input_nodes)
                 if a.op == "placeholder" and a not in inputs]
        for a in bound:
            env[a] = sg.placeholder(a.name)
        for a in takes:
            env[a] = sg.placeholder(f"in_{a.name}")
        for n in mine:
            env[n] = sg.node_copy(n, lambda x: env[x])
        if s == stages - 1:
            sg.output(fx.node.map_arg(out_node.args[0], lambda x: env[x]))
        else:
            sg.output(tuple(env[n] for n in crossing[s]))
        prog = fx.GraphModule(gm, sg, class_name=f"AutoshardStage{s}")
        out.append((prog, [a.name for a in bound], [a.name for a in takes]))
    return out


class StageModule(torch.nn.Module):
    """One stage of the rank program, with its parameters bound: ``forward(*taken)`` runs the
    stage on the values that cross into it.

    Its ``parameters()`` are the leaves autograd gives a gradient to, as the split backward of
    the zero-bubble schedules needs (torch/distributed/pipelining/_backward.py
    ``stage_backward_weight`` asks autograd for the gradient of every one of them, unused ones
    an error). A parameter read only through a bucketed gradient sync gets none: its
    :class:`~autoshard.codegen.buckets.DeferredGradSync` hands the gradient to the bucket and
    returns none to autograd (as DDP's reducer takes it). Such a parameter enters the program
    through a :class:`_GradHandle` and is replaced, among the parameters, by the handle's
    zero-dimensional leaf: asking autograd for the handle's gradient runs the parameter's path
    (the bucket's hand-over included) in the weight pass, and returns a zero scalar."""

    def __init__(self, program: fx.GraphModule, bound: list[torch.Tensor]) -> None:
        super().__init__()
        self.program = program
        self._bound = bound
        only = bucketed_only(program)
        self._handles: dict[int, torch.nn.Parameter] = {}
        for i, t in enumerate(bound):
            if isinstance(t, torch.nn.Parameter) and i in only:
                self._handles[i] = torch.nn.Parameter(t.new_zeros((), dtype=torch.float32))
        self.params = torch.nn.ParameterList(
            [self._handles.get(i, t) for i, t in enumerate(bound)
             if isinstance(t, torch.nn.Parameter)])

    def forward(self, *taken: Any) -> Any:
        bound = [_GradHandle.apply(t, self._handles[i]) if i in self._handles else t
                 for i, t in enumerate(self._bound)]
        return self.program(*bound, *taken)


class _GradHandle(torch.autograd.Function):
    """Identity on a parameter; in backward, whatever gradient reaches it (none where a bucket
    took it) to the parameter, and a zero scalar to ``handle`` (StageModule)."""

    @staticmethod
    def forward(ctx, param: torch.Tensor, handle: torch.Tensor) -> torch.Tensor:
        ctx.set_materialize_grads(False)
        ctx.handle = (handle.dtype, handle.device)
        return param.view_as(param)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        dtype, device = ctx.handle
        return grad, torch.zeros((), dtype=dtype, device=device)


def bucketed_only(program: fx.GraphModule) -> set[int]:
    """The positions, among a stage program's placeholders, of those read only through bucketed
    gradient syncs (codegen/rewrite.py ``ReshardCall`` with ``bucketed``), inside checkpointed
    layers too (codegen/recompute.py ``Checkpointed``: a placeholder of its region)."""
    return {i for i, ph in enumerate(program.graph.find_nodes(op="placeholder"))
            if _bucketed_only(ph)}


def _bucketed_only(value: fx.Node) -> bool:
    from autoshard.codegen.recompute import Checkpointed
    from autoshard.codegen.rewrite import ReshardCall
    if not value.users:
        return False
    for u in value.users:
        if isinstance(u.target, ReshardCall) and u.target.bucketed:
            continue
        if isinstance(u.target, Checkpointed) and value not in u.kwargs.values():
            inner = u.target.gm.graph.find_nodes(op="placeholder")
            if all(_bucketed_only(inner[k]) for k, a in enumerate(u.args) if a is value):
                continue
        return False
    return True


def local_value(gm: fx.GraphModule, name: str, traced, plan: Plan, mesh_shape) -> torch.Tensor:
    """An empty tensor of the local shape and dtype of the emitted value ``name`` (for the
    static shapes PipelineStage is given)."""
    node = next(n for n in gm.graph.nodes if n.name == name)
    (src, idx), dst = node.meta["autoshard_ref"]
    tnode = next(n for n in traced.graph.nodes if n.name == src)
    val = tnode.meta["val"]
    val = val[idx] if isinstance(val, (tuple, list)) else val
    if dst is None:
        strategies = plan.strategies()
        dst = strategies[src].outputs[idx] if src in strategies else None
    shape = tuple(val.shape) if dst is None else local_shape(tuple(val.shape), dst, mesh_shape)
    # Floating values crossing stages carry a gradient back (StageModule), as their metadata
    # must say.
    return torch.empty(shape, dtype=val.dtype).requires_grad_(val.dtype.is_floating_point)


def _carries_grad(gm: fx.GraphModule, name: str, grads: set) -> bool:
    """Whether the emitted value ``name`` has a gradient in the plan (cost/reshards.py
    traced_grads): a floating value that a parameter or input gradient flows through. A table
    made from constants (rotary angles) has none, and crosses stages without one."""
    node = next(n for n in gm.graph.nodes if n.name == name)
    (src, idx), _ = node.meta["autoshard_ref"]
    return src in grads


class Pipelined:
    """One rank's pipeline: its stages of the rank program (stage ``k`` runs on coordinate
    ``k mod p`` of the pipeline axis: one per rank, or ``v`` interleaved; V-placed, coordinate
    ``r`` runs ``r`` and ``2p - 1 - r``: plans.py ``Pipeline.stages_of``), the schedule, the
    groups for tied weights. ``step(*local_inputs)`` (the first stage's ranks read the inputs;
    the others may be given them, they are not read) runs one schedule over the microbatches
    and returns the step's loss on every rank."""

    def __init__(self, pm: Any, programs: list, device: torch.device) -> None:
        plan, groups = pm.plan, pm.groups
        pl = plan.pipeline
        self.pm, self.plan, self.device = pm, plan, device
        self.axis = plan.mesh_axes.index(pl.axis)
        self.ranks = plan.mesh_shape[self.axis]           # p
        self.n = len(pl.stages)                           # p * v
        self.mine = pl.stages_of(groups.coords[self.axis])
        self.m = pl.microbatches
        self.group = groups.groups[self.axis]
        stage_cls = _counted_stage(pm.runtime.buckets, pm.ledger, pl.axis,
                                   pl.schedule in SPLIT_BACKWARD,
                                   _WeightPasses(plan, self.mine, programs))
        self.modules, self.pstages = self._stages(programs, stage_cls)
        self.schedule = self._schedule()
        self._tied = self._tied_groups(pm)
        self._emitted = [programs[k][0] for k in self.mine]
        self._programs: dict[bool, list] = {}        # training mode -> each stage's program

    def _in_mode(self) -> None:
        """Each stage module runs its program as traced, or in eval mode (``pm.eval()``) its
        eval-mode copy (codegen/modes.py), made at the first need (and compiled where the
        programs are); a program with nothing that runs otherwise in eval mode is its own."""
        training = self.pm.training
        if not self._programs:
            if training:
                return
            from autoshard.codegen.modes import eval_version
            self._programs[True] = [m.program for m in self.modules]
            self._programs[False] = [
                eval_version(gm, self.pm, name=f"eval stage {k}") or module.program
                for k, gm, module in zip(self.mine, self._emitted, self.modules)]
        for module, program in zip(self.modules, self._programs[training]):
            module.program = program

    def _stages(self, programs: list, stage_cls: type) -> tuple[list, list]:
        """This rank's stage modules, and the pipeline stages torch's schedule runs them as,
        given the static shapes of the values crossing in and out of each."""
        pm, plan, device = self.pm, self.plan, self.device
        values = pm.bound_values()
        traced, shape = pm.traced, plan.mesh_shape
        grads = traced_grads(traced)

        def example(name: str, needs_grad: bool) -> torch.Tensor:
            t = local_value(pm.program, name, traced, plan, shape).detach().to(device)
            return t.requires_grad_(needs_grad and _carries_grad(pm.program, name, grads))

        modules, pstages = [], []
        for k in self.mine:
            prog, bound, takes = programs[k]
            module = StageModule(prog, [values[name] for name in bound])
            ins = tuple(example(n, k > 0) for n in takes)
            outs = tuple(example(n, True) for n in programs[k + 1][2]) if k < self.n - 1 else \
                (torch.empty((), device=device, requires_grad=True),)
            modules.append(module)
            pstages.append(stage_cls(module, k, self.n, device, input_args=ins,
                                     output_args=outs, group=self.group))
        return modules, pstages

    def _schedule(self) -> Any:
        """torch's schedule of the plan over this rank's stages."""
        from torch.distributed.pipelining import (Schedule1F1B, ScheduleDualPipeV,
                                                  ScheduleGPipe, ScheduleInterleaved1F1B,
                                                  ScheduleInterleavedZeroBubble,
                                                  ScheduleZBVZeroBubble)
        pl, m = self.plan.pipeline, self.m
        cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B,
               "Interleaved1F1B": ScheduleInterleaved1F1B,
               "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
               "ZBVZeroBubble": ScheduleZBVZeroBubble,
               "DualPipeV": ScheduleDualPipeV}[pl.schedule]
        # the multi-stage schedules take every stage of the rank, the others its one
        return cls(self.pstages if pl.virtual_stages > 1 else self.pstages[0],
                   n_microbatches=m, loss_fn=lambda out, _: out / m, scale_grads=False)

    def _tied_groups(self, pm: Any) -> list[tuple[str, Any]]:
        """A process group per weight tied across ranks' stages: the ranks holding those stages
        with this rank's coordinates on the other axes (every rank creates every group, as
        dist.new_group requires)."""
        out = []
        shape, coords = self.plan.mesh_shape, pm.groups.coords
        for fqn, stages in sorted(_tied(self.plan).items()):
            holders = sorted({self.plan.pipeline.rank_of(s) for s in stages})
            if len(holders) < 2:
                continue               # one rank holds every stage reading it: one copy
            mine = None
            others = [range(n) for i, n in enumerate(shape) if i != self.axis]
            for rest in itertools.product(*others):
                ranks = []
                for h in holders:
                    c = list(rest)
                    c.insert(self.axis, h)
                    ranks.append(_rank(c, shape))
                g = dist.new_group(ranks)
                here = list(coords)
                del here[self.axis]
                if tuple(here) == tuple(rest) and coords[self.axis] in holders:
                    mine = g
            if mine is not None:
                out.append((fqn, mine))
        return out

    def step(self, *local_inputs: Any) -> torch.Tensor:
        self._in_mode()
        # A tied weight's gradient already summed over its stages (an earlier step accumulated
        # into): set aside, so that only this step's part is summed below, then added back.
        params = self.pm.local_parameters()
        buckets = self.pm.runtime.buckets
        earlier = {}
        for fqn, _ in self._tied:
            ph = self.pm._param_ph[fqn]
            held = buckets.shards.pop(ph, None) if buckets is not None else None
            earlier[fqn] = (params[fqn].grad, held)
            params[fqn].grad = None
        losses = self._run(self.schedule.step, local_inputs)
        for fqn, group in self._tied:
            # The stages' gradients summed: in .grad, or under ZeRO-2 and offload in the
            # bucket's shard the sharded optimizer reads (codegen/optim.py grad_shard).
            ph = self.pm._param_ph[fqn]
            shard = buckets.shards.get(ph) if buckets is not None else None
            for grad in (params[fqn].grad, shard):
                if grad is None:
                    continue
                dist.all_reduce(grad, group=group)
                self.pm.ledger.add(ExecutedCollective(
                    CollectiveKind.ALL_REDUCE, (self.plan.pipeline.axis,),
                    grad.numel() * grad.element_size(),
                    grad.numel() * grad.element_size(), Phase.GRAD_SYNC, f"tied:{fqn}",
                    dist.get_world_size(group)))
            grad, held = earlier[fqn]
            if grad is not None:
                params[fqn].grad = grad if params[fqn].grad is None else \
                    grad.add_(params[fqn].grad)
            if held is not None:
                buckets.shards[ph] = held if shard is None else held.add_(shard)
        return self._loss(losses)

    def evaluate(self, *local_inputs: Any) -> torch.Tensor:
        """The schedule's forwards alone over the microbatches (torch's ``schedule.eval``): the
        loss ``step`` would return, on every rank, with no backward and no gradient touched.
        Called as ``pm(...)`` under ``torch.no_grad()`` or ``pm.eval()``, or refused: a loss
        to call backward on would have no graph."""
        if torch.is_grad_enabled() and self.pm.training:
            raise AutoshardError(
                "pm(...) on a pipelined plan only to evaluate, under torch.no_grad() or "
                "pm.eval() (the schedule runs backward inside pm.step)",
                got="a call with gradients enabled in training mode",
                fix="train with loss = pm.step(*pm.shard_inputs(*batch)); evaluate with "
                    "`with torch.no_grad(): loss = pm(*pm.shard_inputs(*batch))`")
        self.pm.ledger.clear()
        self._in_mode()
        with torch.no_grad():
            return self._loss(self._run(self.schedule.eval, local_inputs))

    def _run(self, run: Any, local_inputs: tuple) -> list[torch.Tensor]:
        """``run`` (the schedule's ``step``, or ``eval``) over the microbatches: the first
        stage's ranks read the inputs, the last stage's return the microbatches' losses."""
        losses: list[torch.Tensor] = []
        args = local_inputs if 0 in self.mine else ()
        if self.n - 1 in self.mine:
            run(*args, target=torch.zeros(self.m, device=self.device), losses=losses,
                return_outputs=False)
        else:
            run(*args, return_outputs=False)
        return losses

    def _loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The microbatches' losses (the last stage's ranks hold them) summed on every rank of
        the pipeline axis."""
        loss = torch.stack([x.detach() for x in losses]).sum() if losses else \
            torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.group)
        self.pm.ledger.add(ExecutedCollective(CollectiveKind.ALL_REDUCE,
                                              (self.plan.pipeline.axis,), 4, 4,
                                              Phase.PIPELINE, "loss", self.ranks))
        return loss


class _WeightPasses:
    """Per bucketed parameter, this rank's stages whose weight passes are still to finish
    before it syncs: every stage of the rank reading it (under a V, a weight tied across stages
    0 and 2p - 1 is one copy on rank 0, in one bucket, its gradient from both)."""

    def __init__(self, plan: Plan, mine: list[int], programs: list) -> None:
        members: dict[int, list[str]] = {}          # stage -> its buckets' parameters
        for c in plan.collectives:
            if c.members:
                members.setdefault(c.stage, []).extend(c.members)
        mine_members = {x for k in mine for x in members.get(k, ())}
        self.waiting = {x: {k for k in mine if x in programs[k][1]} for x in mine_members}

    def finished(self, stage: int) -> list[str]:
        """The members whose last weight pass on this rank was ``stage``'s."""
        out = []
        for x, left in self.waiting.items():
            left.discard(stage)
            if not left:
                out.append(x)
        for x in out:
            del self.waiting[x]
        return out


def _counted_stage(buckets: Any, ledger: Any, axis_name: str, split: bool,
                   passes: _WeightPasses) -> type:
    """torch's PipelineStage with the sends counted and the buckets held as below."""
    from torch.distributed.pipelining import PipelineStage

    class CountedStage(PipelineStage):
        """PipelineStage whose sends are counted in the byte ledger (phase "pipeline"), and
        whose gradient buckets sync once, in the last microbatch's backward."""

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True,
                               last_backward=False):
            if not self.has_backward:      # torch's schedule.eval: no backward runs
                return None
            # Under a split backward a stage's last backward may be whole (DualPipeV runs
            # some backwards whole): held too, then synced once its rank's other stage
            # reading the same weight (a V's tied head) is done with it, as after a weight
            # pass.
            release = split and last_backward
            with _held(buckets, not last_backward or release):
                out = super().backward_one_chunk(bwd_chunk_id, loss=loss,
                                                 full_backward=full_backward,
                                                 last_backward=last_backward)
            if release and buckets is not None:
                buckets.release(passes.finished(self.stage_index))
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            # A split backward's weight pass (the zero-bubble schedules): one autograd run
            # per parameter group, each ending a backward for the buckets. They are held
            # over every run, the last microbatch's too, then synced once.
            if not self.has_backward:
                return
            with _held(buckets, True):
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if last_backward and buckets is not None:
                buckets.release(passes.finished(self.stage_index))

        # Under a V two stages of a rank hand their input gradients over in memory; in
        # torch's schedule.eval the backwards are skipped but the hand-over is still called,
        # and asserts: there is nothing to hand over.
        def get_local_bwd_output(self, mb_index):
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        # torch's warm-up of the links on the first step (schedules.py WARMUP_BYTES): one
        # int32 to the next stage and one back to the previous, on other ranks.
        def _warmup_forward_vote(self, has_backward, received_acc=None):
            out = super()._warmup_forward_vote(has_backward, received_acc=received_acc)
            self._count_warmup(self.stage_index + 1, not self.is_last)
            return out

        def _warmup_backward_result(self, received_result=None):
            out = super()._warmup_backward_result(received_result=received_result)
            self._count_warmup(self.stage_index - 1, not self.is_first)
            return out

        def _count_warmup(self, peer: int, sends: bool) -> None:
            if sends and not self._is_same_rank(peer):
                ledger.add(ExecutedCollective(CollectiveKind.SEND_RECV, (axis_name,), WARMUP_BYTES,
                                              WARMUP_BYTES, Phase.PIPELINE,
                                              warmup_node(self.stage_index, peer), 2))

        def get_fwd_send_ops(self, fwd_chunk_id):
            ops = super().get_fwd_send_ops(fwd_chunk_id)
            k = self.stage_index
            _count(ledger, ops, axis_name, f"stage{k}->stage{k + 1}")
            return ops

        def get_bwd_send_ops(self, bwd_chunk_id):
            ops = super().get_bwd_send_ops(bwd_chunk_id)
            k = self.stage_index
            _count(ledger, ops, axis_name, f"stage{k}->stage{k - 1}")
            return ops

    return CountedStage


@contextlib.contextmanager
def _held(buckets: Any, hold: bool):
    """Gradient buckets held over (codegen/buckets.py ``defer``) while ``hold``: a backward
    before the stage's last microbatch's."""
    if buckets is not None:
        buckets.defer = hold
    try:
        yield
    finally:
        if buckets is not None:
            buckets.defer = False


def _tied(plan: Plan) -> dict[str, tuple[int, ...]]:
    """Weights tied across stages, with the stages holding them (the plan's "tied:" records)."""
    out: dict[str, set[int]] = {}
    for c in plan.collectives:
        if c.node.startswith("tied:"):
            out.setdefault(c.node.removeprefix("tied:"), set()).add(c.stage)
    return {fqn: tuple(sorted(stages)) for fqn, stages in out.items()}


def _rank(coords: list[int], shape: tuple[int, ...]) -> int:
    r = 0
    for c, n in zip(coords, shape):
        r = r * n + c
    return r


def _count(ledger, ops, axis: str, node: str) -> None:
    nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
    if ops:
        ledger.add(ExecutedCollective(CollectiveKind.SEND_RECV, (axis,), nbytes, nbytes,
                                      Phase.PIPELINE, node, 2))


