"""Tensor factories and metadata-only ops.

A constant fill (``full``, ``zeros``, ``ones``, ``empty``, ``new_*``) may be built replicated or
already sharded: each rank makes its local shape (the default localize turns the global size
argument into the local one). ``arange`` may be sharded on its one dim: a rank builds its own
stretch from its coordinates (kernel ``"arange_shard"``).

``new_*`` and ``*_like`` read only their input's dtype and device, so the input may arrive in any
placement; ``*_like`` outputs take the input's shape, and follow its sharding. ``_assert_*`` checks
have no output and accept any placement (a size check is made against the local size).

Random draws (``rand``, ``randn``, their ``*_like``, ``bernoulli_``, ``uniform_``, ``normal_``,
``exponential_``: stochastic depth's per-sample mask, noise, PhiMoE's Gumbel sampling) are built
whole on every rank: each rank draws the global tensor from its default generator and its
consumers take their slices for free. Ranks
seeded alike (as dropout requires, codegen/masks.py) then draw exactly what one device draws, and
the ranks that share a shard (tensor parallel) use the same values. A ``*_like`` draw reads only
its input's shape, so the input may lie anywhere: the rank draws the input's global shape.
Drawn sharded, each shard would need a generator of its own (as
dropout's masks have), and would no longer equal the single device's draw.
"""
from __future__ import annotations

import torch

from autoshard.ir import Shard, Strategy, TensorInfo
from autoshard.ops._common import P, R, Option, shard_index, with_kernel
from autoshard.ops.registry import (FACTORY, NO, NOTHING, VIEW, OpInfo, expand,
                                    per_output_element, register_op)

aten = torch.ops.aten

FILLS = (aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format)
NEW_FILLS = (aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default,
             aten.new_full.default)
LIKES = (aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
         aten.full_like.default)
ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
DRAWS = (aten.rand.default, aten.randn.default)
DRAWS_LIKE = {aten.rand_like.default: aten.rand.default, aten.randn_like.default: aten.randn.default}
DRAWS_INTO = (aten.bernoulli_.float, aten.uniform_.default, aten.normal_.default,
              aten.exponential_.default)


def _any_placement(t: TensorInfo) -> list:
    partial = [P] if t.dtype.is_floating_point else []
    return [R] + partial + [Shard(d) for d in range(t.ndim) if t.shape[d] > 1]


def _out_shards(op: OpInfo) -> list:
    out = op.outputs[0]
    return [Shard(d) for d in range(out.ndim) if out.shape[d] > 1]


def fill_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    opts: list[Option] = [((), (s,)) for s in _out_shards(op)]
    strategies = expand(op, mesh_shape, opts)
    if op.target in ARANGES:
        strategies = with_kernel(strategies, lambda s: "arange_shard" if any(
            isinstance(p, Shard) for p in s.outputs[0]) else None)
    return strategies


def new_fill_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x, out = op.inputs[0], op.outputs[0]
    opts: list[Option] = [((p,), (R,)) for p in _any_placement(x)]
    opts += [((R,), (s,)) for s in _out_shards(op)]
    # ``x.new_zeros(x.shape)`` (T5's label shift): built sharded where ``x`` already lies so,
    # rather than gathering a tensor whose values it never reads.
    opts += [((s,), (s,)) for s in _out_shards(op) if x.shape == out.shape]
    return expand(op, mesh_shape, opts)


def like_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    x = op.inputs[0]
    opts: list[Option] = [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if x.shape[d] > 1]
    opts.append(((P,), (R,)))  # the values do not depend on the input's
    return expand(op, mesh_shape, opts)


def whole_draw_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """A random draw built whole on every rank (the module's docstring); an in-place draw fills
    a whole tensor. ``eye`` is built whole too (Qwen3-Next's chunked delta rule: one chunk
    wide)."""
    return expand(op, mesh_shape, [])


def draw_like_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """``rand_like(x)``: ``x`` in any placement, the draw of its global shape whole."""
    return expand(op, mesh_shape, [((p,), (R,)) for p in _any_placement(op.inputs[0])])


def draw_like_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                       args: tuple, kwargs: dict) -> tuple:
    """``rand_like(x)`` as ``rand`` of ``x``'s global shape, in the draw's dtype (on the rank's
    device, which codegen/rewrite.py gives a factory call)."""
    return DRAWS_LIKE[op.target], (list(op.outputs[0].shape),), {"dtype": op.outputs[0].dtype}


def assert_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    return expand(op, mesh_shape, [((p,), ()) for p in _any_placement(op.inputs[0])])


def assert_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                    args: tuple, kwargs: dict) -> tuple:
    # size and stride describe the global tensor; the local one is checked for the rest
    kwargs = {k: v for k, v in kwargs.items() if k not in ("size", "stride")}
    return op.target, tuple(args[:1]), kwargs


def arange_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                    args: tuple, kwargs: dict) -> tuple:
    if strategy.kernel != "arange_shard":
        return op.target, args, kwargs
    if op.target == aten.arange.default:
        start, step = 0, 1
    else:
        start, step = args[0], (args[2] if len(args) > 2 else kwargs.get("step", 1))
    i, f = shard_index(strategy.outputs[0], 0, mesh_shape, coords)
    n = op.outputs[0].shape[0] // f
    lo = start + i * n * step
    # an int end keeps an int arange int; a float one stops half a step early against rounding
    ints = all(isinstance(v, int) for v in (start, step))
    end = lo + n * step if ints else lo + (n - 0.5) * step
    extra = {k: v for k, v in kwargs.items() if k != "step"}
    return aten.arange.start_step, (lo, end, step), extra


# Factories: no gradient flows through them, and their backward keeps nothing. ``empty`` and
# ``empty_like`` allocate without writing, so they cost nothing (the view family).
_FACTORY = dict(family=FACTORY, saves=NOTHING, follows=NO, flops=per_output_element)
register_op(aten.full.default, aten.zeros.default, aten.ones.default, aten.scalar_tensor.default,
            strategies=fill_strategy, **_FACTORY)
register_op(*ARANGES, strategies=fill_strategy, localize=arange_localize, **_FACTORY)
register_op(aten.empty.memory_format, strategies=fill_strategy, family=VIEW, saves=NOTHING,
            follows=NO, flops=per_output_element)
register_op(*NEW_FILLS, strategies=new_fill_strategy, **_FACTORY)
register_op(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default,
            strategies=like_strategy, **_FACTORY)
register_op(aten.empty_like.default, strategies=like_strategy, family=VIEW, saves=NOTHING,
            follows=NO, flops=per_output_element)
register_op(*DRAWS, aten.eye.default, aten.eye.m, strategies=whole_draw_strategy, **_FACTORY)
register_op(*DRAWS_LIKE, strategies=draw_like_strategy, localize=draw_like_localize, **_FACTORY)
register_op(*DRAWS_INTO, strategies=whole_draw_strategy, **_FACTORY)
register_op(aten._assert_tensor_metadata.default, strategies=assert_strategy, family=VIEW,
            saves=NOTHING, follows=NO, flops=per_output_element, localize=assert_localize)
