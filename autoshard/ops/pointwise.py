"""Elementwise ops with broadcasting: every output dim may be sharded, operands that broadcast it
stay replicated. Partial passes through ops that are linear in their tensor operands:

- additive (``add``, ``sub`` with two tensors): all operands Partial -> Partial;
- scaling (``mul``, ``div`` by a replicated divisor): one operand Partial, the others replicated;
- unary linear (``neg``, copies, views, float-to-float casts, ``type_as``): Partial -> Partial;
- overwrites (``copy``, ``fill.Tensor``, ``zero``): the first operand gives only the shape and
  dtype, its values are discarded, so it may be Partial too: Partial -> Partial.

An op with a Python-number operand that is *added* (``x + 1``) is not linear in ``x``: the
constant would be added once per rank, so it gets no Partial option.

``dropout`` (p > 0) draws a mask per rank. Sharded, each rank masks its own slice — the same law
as the whole op, not the same numbers. Replicated, every rank must draw the same mask, so the
per-rank program must keep the RNG in step across the ranks of a replicated axis (as DTensor's RNG
tracker does). Validation therefore runs dropout with p = 0 or train = False.
"""
from __future__ import annotations

import torch

from autoshard.ops._common import P, R, broadcast_map, is_float, mapped_options
from autoshard.ops.registry import (ELEMENTWISE, INPUT, LARGEST, NO, NOTHING, VIEW, OpInfo, Saves,
                                    PASSES, all_but_first, all_inputs, amend, expand,
                                    per_output_element, register_op)

aten = torch.ops.aten

ADDITIVE = (aten.add.Tensor, aten.sub.Tensor)
SCALING = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
UNARY_LINEAR = (aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
                aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default)
CASTS = (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
         aten.type_as.default)
OVERWRITES = (aten.copy.default, aten.fill.Tensor, aten.zero.default)
UNARY = (aten.rsqrt.default, aten.sqrt.default, aten.exp.default, aten.log.default,
         aten.expm1.default, aten.tanh.default, aten.gelu.default, aten.silu.default,
         aten.relu.default, aten.sigmoid.default, aten.cos.default, aten.sin.default,
         aten.abs.default, aten.erf.default, aten.reciprocal.default, aten.square.default,
         aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.rsub.Scalar, aten.add.Scalar, aten.sub.Scalar,
         aten.dropout.default, aten.logical_not.default, aten.bitwise_not.default,
         aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
         aten.isnan.default, aten.isinf.default, aten.fill.Scalar, aten.hardtanh.default,
         aten.hardswish.default, aten.hardsigmoid.default, aten.leaky_relu.default)
# piecewise constant: a zero gradient (stochastic depth's floor(q + U) mask)
ROUNDING = (aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
            aten.sign.default)
BINARY = (aten.pow.Tensor_Tensor, aten.maximum.default, aten.minimum.default, aten.max.other,
          aten.min.other, aten.floor_divide.default, aten.remainder.Scalar, aten.remainder.Tensor,
          aten.fmod.Scalar, aten.fmod.Tensor,
          aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
          aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
          aten.ge.Tensor, aten.ge.Scalar, aten.__and__.Tensor, aten.__or__.Tensor,
          aten.__xor__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
          aten.bitwise_xor.Tensor, aten.logical_and.default, aten.logical_or.default,
          aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
          aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.clamp.Tensor)
POINTWISE = ADDITIVE + SCALING + UNARY_LINEAR + CASTS + OVERWRITES + UNARY + ROUNDING + BINARY


def _partial_ok(op: OpInfo) -> str | None:
    """Which Partial option the op admits: "all", "one" (one operand), or None."""
    t, ins, out = op.target, op.inputs, op.outputs[0]
    if not is_float(out) or not all(is_float(i) for i in ins):
        return None  # casts to int/bool and integer sums are not linear
    if t in ADDITIVE:
        return "all" if len(ins) == 2 else None
    if t in (aten.div.Tensor, aten.div.Scalar):
        return "first"  # linear in the dividend only
    if t in SCALING:
        return "one"
    if t in UNARY_LINEAR or t in CASTS or t in OVERWRITES:
        return "all"
    return None


def pointwise_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    ins, out = op.inputs, op.outputs[0]
    opts = mapped_options(op, [broadcast_map(t, out.ndim) for t in ins])
    mode = _partial_ok(op)
    if mode == "all":
        opts.append((tuple(P for _ in ins), (P,)))
    elif mode == "one":
        opts += [(tuple(P if j == i else R for j in range(len(ins))), (P,)) for i in range(len(ins))]
    elif mode == "first":
        opts.append((tuple(P if j == 0 else R for j in range(len(ins))), (P,)))
    return expand(op, mesh_shape, opts)


def operands_saved(op: OpInfo) -> Saves:
    """``x * y`` needs both operands for its gradients; ``x * 2`` needs nothing."""
    return Saves(inputs=(0, 1)) if len(op.inputs) >= 2 else NOTHING


INPUT0, OUTPUT0 = Saves(inputs=(0,)), Saves(outputs=(0,))
# (targets, family, what backward keeps, how the op joins the ILP). Unary ops that follow their
# input are the ones between a matmul and the next (activations, casts, copies).
_RECORDS = (
    ((aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar), ELEMENTWISE, NOTHING,
     LARGEST),
    (SCALING, ELEMENTWISE, operands_saved, LARGEST),
    ((aten.neg.default, aten.clone.default, aten.contiguous.default, aten.to.dtype,
      aten.to.dtype_layout, aten._to_copy.default, aten.type_as.default, aten.zero.default,
      aten.fill.Scalar), ELEMENTWISE, NOTHING, INPUT),
    # ``copy`` and ``fill.Tensor`` write their second operand over the first; no gradient
    # needs either. ``floor_divide`` has no gradient.
    ((aten.copy.default, aten.fill.Tensor, aten.floor_divide.default), ELEMENTWISE, NOTHING, NO),
    # ``x mod c`` passes its gradient through (a slope of 1); ``x mod y`` also gives ``y`` one,
    # ``-grad · floor(x / y)`` (trunc for fmod), from both operands (derivatives.yaml)
    ((aten.remainder.Scalar, aten.fmod.Scalar), ELEMENTWISE, NOTHING, NO),
    ((aten.remainder.Tensor, aten.fmod.Tensor), ELEMENTWISE, all_inputs, NO),
    (ROUNDING, ELEMENTWISE, NOTHING, INPUT),
    ((aten.alias.default, aten.detach.default), VIEW, NOTHING, INPUT),
    ((aten.lift_fresh_copy.default,), VIEW, NOTHING, NO),
    ((aten.to.device, aten.rsub.Scalar), ELEMENTWISE, NOTHING, NO),
    ((aten.rsqrt.default, aten.tanh.default, aten.relu.default), ELEMENTWISE, OUTPUT0, INPUT),
    # (expm1's gradient is grad · (result + 1): Apertus's xIELU activation)
    ((aten.sqrt.default, aten.exp.default, aten.expm1.default, aten.sigmoid.default,
      aten.reciprocal.default), ELEMENTWISE, OUTPUT0, NO),
    # (hardtanh is ReLU6 and the clamps of MobileNets; their backward reads the input)
    ((aten.gelu.default, aten.silu.default, aten.hardtanh.default, aten.hardswish.default,
      aten.hardsigmoid.default, aten.leaky_relu.default), ELEMENTWISE, INPUT0, INPUT),
    ((aten.log.default, aten.cos.default, aten.sin.default, aten.abs.default, aten.erf.default,
      aten.square.default, aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default),
     ELEMENTWISE, INPUT0, NO),
    ((aten.pow.Tensor_Scalar,), ELEMENTWISE, all_inputs, LARGEST),
    ((aten.pow.Scalar, aten.pow.Tensor_Tensor), ELEMENTWISE, all_inputs, NO),
    # A dropout keeps its boolean mask, one byte per element.
    ((aten.dropout.default,), ELEMENTWISE, Saves(extra=(("out", 0, "elem", 1),)), INPUT),
    # ``clamp(x, min, max)`` with tensor bounds (PhiMoE's router): each operand's gradient is
    # where it is the one taken
    ((aten.positive.default, aten.logical_not.default, aten.bitwise_not.default,
      aten.isnan.default, aten.isinf.default, aten.maximum.default, aten.minimum.default,
      aten.clamp.Tensor,
      aten.max.other, aten.min.other,
      aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
      aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
      aten.ge.Tensor, aten.ge.Scalar, aten.__and__.Tensor, aten.__or__.Tensor,
      aten.__xor__.Tensor, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
      aten.bitwise_xor.Tensor, aten.logical_and.default, aten.logical_or.default),
     ELEMENTWISE, all_inputs, NO),
    # ``where`` keeps its condition; ``masked_fill`` its mask.
    ((aten.where.self,), ELEMENTWISE, INPUT0, LARGEST),
    ((aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar), ELEMENTWISE, INPUT0,
     NO),
    ((aten.masked_fill.Scalar, aten.masked_fill.Tensor), ELEMENTWISE, all_but_first, LARGEST),
)
for _targets, _family, _saves, _follows in _RECORDS:
    register_op(*_targets, strategies=pointwise_strategy, family=_family, saves=_saves,
                follows=_follows, flops=per_output_element)


# Special-function evaluations (exp, log, tanh, erf, sqrt, ...) per element of the op's largest
# tensor, (forward, backward), from the op's formula and its derivative in PyTorch
# (tools/autograd/derivatives.yaml) (docs/cost-model.md §3.7). A backward that reuses the saved
# output needs none (exp: grad·result; tanh_backward, sigmoid_backward; rsqrt, sqrt: powers of
# the result; log: a division); one that recomputes the function from the saved input needs it
# again (gelu_backward, silu_backward; erf's derivative exp(-x²); the erf form of GELU
# evaluates erf and the density). Ops not listed evaluate none (arithmetic, comparisons,
# copies, reductions, norms: layer_norm and rms_norm take one rsqrt per row, not per element).
for _t, _per in ((aten.exp.default, (1, 0)), (aten.expm1.default, (1, 0)),
                 (aten.log.default, (1, 0)),
                 (aten.tanh.default, (1, 0)), (aten.sigmoid.default, (1, 0)),
                 (aten.rsqrt.default, (1, 0)), (aten.sqrt.default, (1, 0)),
                 (aten.erf.default, (1, 1)), (aten.silu.default, (1, 1)),
                 (aten.sin.default, (1, 1)), (aten.cos.default, (1, 1))):
    amend(_t, specials=_per)


def gelu_specials(op: OpInfo) -> tuple[int, int]:
    """gelu(approximate="none") evaluates erf, and its backward erf and the density; "tanh"
    one tanh each way."""
    approx = op.kwargs.get("approximate", op.args[1] if len(op.args) > 1 else "none")
    return (1, 1) if approx == "tanh" else (1, 2)


def pow_specials(op: OpInfo) -> tuple[int, int]:
    """An integral exponent is repeated multiplication; any other is exp(e·log(x))."""
    e = op.args[1] if len(op.args) > 1 else None
    integral = isinstance(e, (int, float)) and float(e).is_integer()
    return (0, 0) if integral else (1, 1)


amend(aten.gelu.default, specials=gelu_specials)
amend(aten.pow.Tensor_Scalar, aten.pow.Scalar, aten.pow.Tensor_Tensor, specials=pow_specials)
# ``a * b`` keeps ``a`` only if ``b`` needs a gradient (RoPE's ``q * cos`` keeps ``cos``).
amend(aten.mul.Tensor, one_factor=True)
# Backward hands the output's gradient on to an input of the output's size.
amend(aten.add.Tensor, aten.clone.default, aten.contiguous.default, aten.alias.default,
      aten.detach.default, grad=PASSES)
