"""Activation checkpointing in the rank program (docs/cost-model.md §8).

Each layer the plan recomputes is a contiguous region of the emitted graph: its ops and the
reshards they read (a reshard is emitted just before its first consumer). The region becomes a
submodule run under ``torch.utils.checkpoint`` (non-reentrant).

- "full": forward keeps only the region's inputs, and backward runs the region's forward again,
  its collectives included, which the ledger records in phase "recompute", as the plan lists
  them (solver/assemble.py).
- "selective": torch's selective activation checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) stores the outputs of the
  matmuls, attention kernels and collectives (``ops.registry.stored_kernels``) and recomputes everything else from
  them; a collective replayed in recompute returns its stored output and moves nothing, so the
  ledger does not count it (phase "replay" below).
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts,
                                    set_checkpoint_early_stop)

from autoshard.ir import Phase
from autoshard.ops.modes import written_args
from autoshard.ops.registry import stored_kernels

aten = torch.ops.aten


def _selective(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # What the pricing's ``Pricer.stores`` keeps (the matmul and attention records' ops and the
    # kernels they dispatch to, ops/registry.py), and every collective.
    if op in stored_kernels() or getattr(op, "namespace", "") == "_c10d_functional":
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed:
    """A graph target: the region's submodule, run under torch.utils.checkpoint.

    ``state``: the positions of its inputs that are buffers the region writes in place (batch
    norm's running statistics and its ``num_batches_tracked``: ops/modes.py ``written_args``).
    They are not checkpoint inputs, whose versions checkpointing checks: forward updates them
    once, as one device does, and recompute runs on copies of what forward read, so it sees the
    same values and its updates are dropped."""

    def __init__(self, gm: fx.GraphModule, runtime: Any, layer: str, policy: str = "full",
                 state: tuple[int, ...] = ()) -> None:
        self.gm, self.rt, self.layer, self.policy = gm, runtime, layer, policy
        self.state = state
        self.__name__ = "checkpoint_" + layer.replace(".", "_")
        self.calls = 0
        self._buffers: dict[int, torch.Tensor] = {}
        self._read: dict[int, torch.Tensor] = {}

    def __call__(self, *args: Any) -> tuple:
        if not torch.is_grad_enabled():
            return tuple(self.gm(*args))
        self.calls = 0
        self._buffers = {i: args[i] for i in self.state}
        self._read = {i: t.clone() for i, t in self._buffers.items()}
        rest = [a for i, a in enumerate(args) if i not in self._buffers]
        kw: dict[str, Any] = {}
        if self.policy == "selective":
            kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _selective)
        # The whole forward again, as priced: early stop would skip the region's tail (ops
        # whose outputs backward does not need, and their collectives).
        with set_checkpoint_early_stop(False):
            return checkpoint(self._run, *rest, use_reentrant=False, **kw)

    def _run(self, *rest: Any) -> tuple:
        self.calls += 1                   # the first call is forward, a later one recompute
        args = list(rest)
        for i in sorted(self._buffers):
            args.insert(i, self._buffers[i] if self.calls == 1 else self._read[i].clone())
        previous = self.rt.phase
        again = Phase.REPLAY if self.policy == "selective" else Phase.RECOMPUTE
        self.rt.phase = again if self.calls > 1 else previous
        try:
            return tuple(self.gm(*args))
        finally:
            self.rt.phase = previous

    def __repr__(self) -> str:
        return self.__name__


def outline(g: fx.Graph, after: fx.Node, last: fx.Node, runtime: Any, layer: str,
            policy: str = "full") -> None:
    """Replace the nodes strictly after ``after`` up to ``last`` by one call of a
    :class:`Checkpointed` submodule taking what they read from outside and returning what the
    rest of the graph reads from them."""
    region: list[fx.Node] = []
    n = after.next
    while True:
        region.append(n)
        if n is last:
            break
        n = n.next
    inside = set(region)
    inputs: dict[fx.Node, None] = {}
    for n in region:
        for a in n.all_input_nodes:
            if a not in inside:
                inputs[a] = None
    written = {a for n in region if n.op == "call_function"
               for v in written_args(n.meta.get("autoshard_op", n.target), n.args, n.kwargs)
               for a in (v if isinstance(v, (list, tuple)) else (v,)) if isinstance(a, fx.Node)}
    state = tuple(i for i, a in enumerate(inputs) if a.op == "placeholder" and a in written)
    outputs = [n for n in region if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in inputs}
    for n in region:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    gm = fx.GraphModule(torch.nn.Module(), sub, class_name="CheckpointedLayer")
    with g.inserting_before(region[0]):
        call = g.call_function(Checkpointed(gm, runtime, layer, policy, state), tuple(inputs))
        call.meta["autoshard"] = {"checkpoint": layer, "policy": policy}
        if "autoshard_stage" in last.meta:          # a pipeline stage (codegen/pipeline.py)
            call.meta["autoshard_stage"] = last.meta["autoshard_stage"]
        for k, o in enumerate(outputs):
            item = g.call_function(operator.getitem, (call, k))
            item.meta.update({key: o.meta[key] for key in ("autoshard_ref", "autoshard_stage")
                              if key in o.meta})
            o.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for n in reversed(region):
        g.erase_node(n)
