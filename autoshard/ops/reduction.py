"""Reductions and scans.

- ``sum``/``mean``: a kept dim shards through; a reduced dim may be sharded, giving a Partial
  output. A local mean over ``n/f`` elements is ``f`` times too large as a summand of the global
  mean, so that strategy carries kernel ``"mean_partial"``, whose local op divides by ``f``. Both
  are linear, so Partial passes through.
- ``amax``/``amin``/``max.dim``/``min.dim``/``argmax``, ``linalg_vector_norm``, ``logsumexp``,
  ``softmax``/``log_softmax``, ``cumsum``: the reduced (or normalised, or scanned) dim stays
  replicated; the rest shard through. ``cumsum`` is linear, so it also passes Partial.
- ``fft_fft``/``fft_ifft``/``fft_rfft``/``fft_irfft``: the transformed dim stays whole, the rest
  shard through; every one is linear over the reals (``rfft`` of a real input, ``irfft`` keeping
  the real part), so Partial passes too.
"""
from __future__ import annotations

import math

import torch

from autoshard.ir import Shard, Strategy
from autoshard.ops._common import (P, Option, arg, is_float, norm_dim, norm_dims, plain_localize,
                                   with_kernel)
from autoshard.ops.registry import (ELEMENTWISE, NO, NOTHING, OpInfo, Saves, all_inputs, amend,
                                    expand, per_output_element, register_op)

aten = torch.ops.aten

SUMS = (aten.sum.default, aten.sum.dim_IntList)
MEANS = (aten.mean.default, aten.mean.dim)
EXTREMA = (aten.amax.default, aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default,
           aten.argmin.default)
SOFTMAX = (aten.softmax.int, aten.log_softmax.int, aten._softmax.default,
           aten._log_softmax.default)
# A p-norm over some dims (DBRX's router normalises its top-k weights by their 1-norm): not
# linear, so as the extrema: the reduced dims whole, the others shard through.
VECTOR_NORM = aten.linalg_vector_norm.default


def _reduced(op: OpInfo) -> tuple[tuple[int, ...], bool]:
    """(reduced dims, keepdim) of a reduction."""
    x = op.inputs[0]
    if op.target in (aten.sum.default, aten.mean.default):
        return tuple(range(x.ndim)), False
    if op.target in (aten.max.dim, aten.min.dim):
        return norm_dims(arg(op, 1, "dim"), x.ndim), bool(arg(op, 2, "keepdim", False))
    if op.target in (aten.argmax.default, aten.argmin.default):
        d = arg(op, 1, "dim")
        return norm_dims(d, x.ndim), bool(arg(op, 2, "keepdim", False)) and d is not None
    if op.target == VECTOR_NORM:              # (self, ord, dim=None, keepdim=False)
        d = arg(op, 2, "dim")
        dims = tuple(range(x.ndim)) if d is None else norm_dims(d, x.ndim)
        return dims, bool(arg(op, 3, "keepdim", False))
    return norm_dims(arg(op, 1, "dim"), x.ndim), bool(arg(op, 2, "keepdim", False))


def _reduction_options(op: OpInfo, *, linear: bool) -> list[Option]:
    x = op.inputs[0]
    reduced, keep = _reduced(op)
    n_out = len(op.outputs)
    opts: list[Option] = []
    pos = 0
    for d in range(x.ndim):
        if d in reduced:
            if linear:
                opts.append(((Shard(d),), (P,) * n_out))
            pos += keep
            continue
        opts.append(((Shard(d),), (Shard(pos),) * n_out))
        pos += 1
    if linear and is_float(x):
        opts.append(((P,), (P,) * n_out))
    return opts


def sum_mean_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    strategies = expand(op, mesh_shape, _reduction_options(op, linear=True))
    if op.target in MEANS:
        strategies = with_kernel(strategies, lambda s: "mean_partial" if _mean_factor(
            op, s.inputs[0], mesh_shape) > 1 else None)
    return strategies


def extrema_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    return expand(op, mesh_shape, _reduction_options(op, linear=False))


def _mean_factor(op: OpInfo, in_spec: tuple, mesh_shape: tuple) -> int:
    reduced, _ = _reduced(op)
    return math.prod(n for p, n in zip(in_spec, mesh_shape)
                     if isinstance(p, Shard) and p.dim in reduced)


def reduction_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                       args: tuple, kwargs: dict) -> tuple:
    return op.target, args, kwargs  # dim lists are dims, never sizes


def mean_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                  args: tuple, kwargs: dict) -> tuple:
    f = _mean_factor(op, strategy.inputs[0], mesh_shape)
    if f == 1:
        return op.target, args, kwargs
    target = op.target

    def mean_partial(*a, **k):
        return target(*a, **k) / f

    return mean_partial, args, kwargs


def _along_dim_options(op: OpInfo, dim: int, *, linear: bool) -> list[Option]:
    x = op.inputs[0]
    opts: list[Option] = [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]
    if linear and is_float(x) and is_float(op.outputs[0]):
        opts.append(((P,), (P,)))
    return opts


FFTS = (aten.fft_fft.default, aten.fft_ifft.default, aten.fft_rfft.default,
        aten.fft_irfft.default)
REAL_FFTS = (aten.fft_rfft.default, aten.fft_irfft.default)


def fft_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    dim = norm_dim(arg(op, 2, "dim", -1), op.inputs[0].ndim)
    return expand(op, mesh_shape, _along_dim_options(op, dim, linear=True))


def fft_flops(op: OpInfo) -> float:
    """5·n·log2(n) per complex transform of length n (the radix-2 Cooley-Tukey count FFT
    benchmarks quote), half that for a real one; n is the longer side of the transformed dim."""
    x, out = op.inputs[0], op.outputs[0]
    dim = norm_dim(arg(op, 2, "dim", -1), x.ndim)
    n = max(x.shape[dim], out.shape[dim], 2)
    per_point = 2.5 if op.target in REAL_FFTS else 5.0
    return per_point * x.numel / max(x.shape[dim], 1) * n * math.log2(n)


def softmax_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    dim = norm_dim(arg(op, 1, "dim"), op.inputs[0].ndim)
    return expand(op, mesh_shape, _along_dim_options(op, dim, linear=False))


def cumsum_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    dim = norm_dim(arg(op, 1, "dim"), op.inputs[0].ndim)
    return expand(op, mesh_shape, _along_dim_options(op, dim, linear=True))


_REDUCTION = dict(family=ELEMENTWISE, follows=NO, flops=per_output_element)
register_op(*SUMS, strategies=sum_mean_strategy, saves=NOTHING, localize=reduction_localize,
            **_REDUCTION)
register_op(*MEANS, strategies=sum_mean_strategy, saves=NOTHING, localize=mean_localize,
            **_REDUCTION)
register_op(*EXTREMA, strategies=extrema_strategy, saves=all_inputs, localize=reduction_localize,
            **_REDUCTION)
# Its backward reads the input and the norm; ``logsumexp``'s (Granite-SWA's attention sinks) the
# input and its result, ``exp(x - lse)``.
register_op(VECTOR_NORM, aten.logsumexp.default, strategies=extrema_strategy,
            saves=Saves(inputs=(0,), outputs=(0,)), localize=reduction_localize, **_REDUCTION)
# Softmax's backward needs only its output.
register_op(*SOFTMAX, strategies=softmax_strategy, saves=Saves(outputs=(0,)), **_REDUCTION)
# One exp per element (docs/cost-model.md §3.7); backward: softmax's is grad·y - y·sum, none;
# log_softmax's takes exp of its saved output.
amend(aten.softmax.int, aten._softmax.default, specials=(1, 0))
amend(aten.log_softmax.int, aten._log_softmax.default, specials=(1, 1))
register_op(aten.cumsum.default, strategies=cumsum_strategy, saves=NOTHING, **_REDUCTION)
# Linear: backward keeps nothing. ``n`` is the length of the dim kept whole, never a local size.
register_op(*FFTS, strategies=fft_strategy, family=ELEMENTWISE, saves=NOTHING, follows=NO,
            flops=fft_flops, localize=plain_localize)
