"""Independent dropout masks per shard (docs/design.md, "Random masks").

Every rank runs its dropout on its shard of the input. Ranks seeded alike (as a training script
seeds them, so that replicas draw the same masks) would then draw the same mask on every shard:
the units of different shards dropped together, which one device never does. As Megatron-LM's
model-parallel RNG tracker does (megatron/core/tensor_parallel/random.py), a dropout whose input
is split over some mesh axes draws from a generator seeded for its shard: a seed is drawn from
the default generator (the same on every rank, and replayed by ``torch.utils.checkpoint``'s
preserved RNG state when a layer is recomputed), offset by the rank's shard index over the
axes that split the input, and the op runs with it under ``torch.random.fork_rng`` (the default
generators are left as they were). Ranks holding the same shard (replicas, along the other
axes) draw the same mask; a dropout nothing splits draws from the default generator as before.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from autoshard.ir import Shard
from autoshard.ops import modes as op_modes

# Seeds of one draw's shards lie this far apart (a prime: distinct for any shard count here).
_STRIDE = 1_000_003


class ShardMasks:
    """``op`` run with the generators seeded for shard ``shard`` of its input."""

    def __init__(self, op: Any, shard: int, device: torch.device) -> None:
        self.op, self.shard, self.device = op, shard, device
        self.__name__ = f"shard_masks_{getattr(op, '__name__', 'op')}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        seed = int(torch.randint(0, 2 ** 62, ()))       # the default CPU generator, every rank
        seed = (seed + _STRIDE * (self.shard + 1)) % 2 ** 63
        cuda = self.device.type == "cuda"
        devices = [self.device.index if self.device.index is not None
                   else torch.cuda.current_device()] if cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.default_generator.manual_seed(seed)
            if cuda:
                torch.cuda.manual_seed(seed)
            return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        return f"ShardMasks({self.op}, shard={self.shard})"


def seed_shards(gm: fx.GraphModule, plan: Any, coords: tuple[int, ...],
                device: torch.device) -> list[str]:
    """Wrap, in place, each op of ``gm`` that draws a mask over an input the plan splits in a
    :class:`ShardMasks` for this rank's shard (``coords``: its mesh coordinates). Returns the
    wrapped nodes' names."""
    from autoshard.codegen.recompute import Checkpointed
    strategies = plan.strategies()
    out = []
    for n in gm.graph.nodes:
        if isinstance(n.target, Checkpointed):        # a checkpointed layer's own program
            out += seed_shards(n.target.gm, plan, coords, device)
            continue
        if n.op != "call_function" or not draws_masks(n):
            continue
        ref = n.meta.get("autoshard_ref")
        strat = strategies.get(ref[0][0]) if ref else None
        if strat is None:
            continue
        axes = [i for i, p in enumerate(strat.outputs[0]) if isinstance(p, Shard)]
        if not axes:
            continue
        shard = 0
        for i in axes:
            shard = shard * plan.mesh_shape[i] + coords[i]
        n.target = ShardMasks(n.target, shard, device)
        out.append(n.name)
    gm.recompile()
    return out


def unwrapped(target: Any) -> Any:
    """The op a node runs, seen through :class:`ShardMasks`, and through a kernel that reduces
    across ranks where its op computes the same on the local tensors in eval mode
    (ops/registry.py ``CollectiveKernel.eval_op``: SyncBatchNorm is a batch norm there)."""
    if isinstance(target, ShardMasks):
        return target.op
    return getattr(getattr(target, "kernel", None), "eval_op", None) or target


def draws_masks(n: fx.Node) -> bool:
    """A dropout (or attention with dropout) drawing a random mask as the node stands."""
    target = unwrapped(n.target)
    if target in op_modes.DROPOUTS:
        return arg(n, 2, "train") is True and arg(n, 1, "p") != 0
    return target in op_modes.SDPA and bool(arg(n, op_modes.SDPA[target], "dropout_p"))


def arg(n: fx.Node, i: int, name: str) -> Any:
    """Argument ``i`` (keyword ``name``) of ``n``, or None."""
    return n.args[i] if len(n.args) > i else n.kwargs.get(name)
