"""Ops of state-space layers (Mamba, Mamba-2 and Jamba as Hugging Face writes them in PyTorch):

- ``softplus`` (the step size ``dt = softplus(dt + dt_bias)``): elementwise, every dim shards
  through; not linear, so no Partial.
- ``repeat_interleave`` with an int ``repeats`` along ``dim`` (Mamba-2 spreads its ``n_groups``
  B and C over the heads): every dim shards through, the repeated one too. Split into ``p``
  equal blocks, block ``i`` of the input repeated is block ``i`` of the output, since each
  element's copies sit next to each other. It is linear (a copy), so Partial passes through.
  Without ``dim`` the input is flattened first: one dim, which shards the same way when the
  input is 1-D and is replicated otherwise. An ``output_size`` hint is the global size and is
  rewritten to the rank's.

The chunked scan of Mamba-2 (``torch_forward``) is ``cumsum`` (ops/reduction.py), ``exp``,
``tril`` masks and broadcast products summed over dims (ops/pointwise.py, ops/reduction.py):
no op of its own. Jamba's Mamba-1 scan loops over the sequence in Python, which torch.export
unrolls: one set of ops per token (trace/ does not fold it; docs/cost-model.md §13).
"""
from __future__ import annotations

import torch

from autoshard.ir import Shard, Strategy, local_shape
from autoshard.ops._common import P, arg, norm_dim
from autoshard.ops.pointwise import pointwise_strategy
from autoshard.ops.registry import (ELEMENTWISE, INPUT, NO, NOTHING, OpInfo, Saves, expand,
                                    per_output_element, register_op)

aten = torch.ops.aten

REPEAT_INTERLEAVE = aten.repeat_interleave.self_int


def repeat_interleave_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    dim = arg(op, 2, "dim", None)
    if dim is None and x.ndim != 1:
        return expand(op, mesh_shape, [])
    dims = range(x.ndim)
    opts = [((Shard(d),), (Shard(d),)) for d in dims if x.shape[d] > 1]
    if x.dtype.is_floating_point:
        opts.append(((P,), (P,)))
    return expand(op, mesh_shape, opts)


def repeat_interleave_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple,
                               coords: tuple, args: tuple, kwargs: dict) -> tuple:
    """The op as it is, with a given ``output_size`` made the rank's size of the output's
    repeated dim (dim 0 when the input is flattened)."""
    size = arg(op, 3, "output_size", None)
    if size is None:
        return op.target, args, kwargs
    dim = arg(op, 2, "dim", None)
    d = 0 if dim is None else norm_dim(dim, op.inputs[0].ndim)
    local = local_shape(op.outputs[0].shape, strategy.outputs[0], mesh_shape)[d]
    if "output_size" in kwargs:
        return op.target, args, {**kwargs, "output_size": local}
    return op.target, args[:3] + (local,) + args[4:], kwargs


register_op(aten.softplus.default, strategies=pointwise_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,)), follows=INPUT, flops=per_output_element)
# A copy: backward sums each element's repeats and needs no saved tensor.
register_op(REPEAT_INTERLEAVE, strategies=repeat_interleave_strategy, family=ELEMENTWISE,
            saves=NOTHING, follows=NO, flops=per_output_element,
            localize=repeat_interleave_localize)
