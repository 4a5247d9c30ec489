"""In-place ops (``add_``, ``mul_``, ``copy_``, ``masked_fill_``, ``relu_``...), which
torch.export's training IR keeps as written (T5, Falcon, Mixtral and ``inplace=True`` modules).

An in-place op writes its result into its first input, so on every rank the output *is* the
local first input: the output spec must equal the first input's. Each in-place op takes the
record of its functional twin (``add_`` -> ``add``) with the strategies that break that
removed: ``mul_``'s ``R x P -> P`` would have each rank write a summand into a tensor that is
replicated, while ``P x R -> P`` scales each rank's own summand. Family, saved tensors, how it
joins the ILP and FLOPs are the twin's (autograd saves what the functional op saves). The local
call is the in-place op itself on the rank's local tensor.

In-place views (``unsqueeze_``, ``squeeze_``, ``t_``, ``transpose_``) change the tensor's dims,
not its values: they take their functional view's record whole (``VIEW_TWINS`` below).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autoshard.ir import OpInfo, Strategy
from autoshard.ops import misc, moe, pointwise, view  # noqa: F401  (register the twins first)
from autoshard.ops._common import plain_localize
from autoshard.ops.registry import PASSES, RECORDS, Saves, amend, default_localize, register_op

aten = torch.ops.aten

TWINS = {
    aten.add_.Tensor: aten.add.Tensor, aten.sub_.Tensor: aten.sub.Tensor,
    aten.mul_.Tensor: aten.mul.Tensor, aten.div_.Tensor: aten.div.Tensor,
    aten.masked_fill_.Scalar: aten.masked_fill.Scalar,
    aten.masked_fill_.Tensor: aten.masked_fill.Tensor,
    aten.copy_.default: aten.copy.default, aten.fill_.Scalar: aten.fill.Scalar,
    aten.fill_.Tensor: aten.fill.Tensor, aten.zero_.default: aten.zero.default,
    aten.clamp_.default: aten.clamp.default, aten.clamp_min_.default: aten.clamp_min.default,
    aten.clamp_max_.default: aten.clamp_max.default, aten.neg_.default: aten.neg.default,
    aten.exp_.default: aten.exp.default, aten.sqrt_.default: aten.sqrt.default,
    aten.rsqrt_.default: aten.rsqrt.default, aten.tanh_.default: aten.tanh.default,
    aten.sigmoid_.default: aten.sigmoid.default, aten.relu_.default: aten.relu.default,
    aten.silu_.default: aten.silu.default, aten.gelu_.default: aten.gelu.default,
    aten.pow_.Scalar: aten.pow.Tensor_Scalar, aten.dropout_.default: aten.dropout.default,
    aten.detach_.default: aten.detach.default, aten.index_put_.default: aten.index_put.default,
    aten.scatter_.src: aten.scatter.src, aten.scatter_.value: aten.scatter.value,
    aten.floor_.default: aten.floor.default, aten.ceil_.default: aten.ceil.default,
    aten.round_.default: aten.round.default, aten.trunc_.default: aten.trunc.default,
}


def _as_twin(op: OpInfo, twin: Any) -> OpInfo:
    return dataclasses.replace(op, target=twin)


def writes_first_input(s: Strategy) -> bool:
    """Whether a strategy can run in place: the output lies as the first input does."""
    return s.outputs[0] == s.inputs[0]


def _register(target: Any, twin: Any, *, as_view: bool = False) -> None:
    """``target`` registered with its functional ``twin``'s record: an in-place op writing its
    first input keeps the twin's strategies that lay the output as that input and runs itself
    locally; an in-place view (``as_view``, below) keeps them all and runs the twin's local call."""
    rec = RECORDS[twin]
    if as_view:
        def localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                     args: tuple, kwargs: dict) -> tuple:
            return rec.localize(_as_twin(op, twin), strategy, mesh_shape, coords, args, kwargs)
    else:
        # These localizers call ``op.target``, the in-place op here; a twin with a local kernel
        # of its own would need an in-place kernel too.
        assert rec.localize in (default_localize, plain_localize), f"{twin} has a local kernel"
        localize = rec.localize

    def strategies(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
        return [s for s in rec.strategies(_as_twin(op, twin), mesh_shape)
                if as_view or writes_first_input(s)]

    def saves(op: OpInfo) -> Saves:
        return rec.saved(_as_twin(op, twin))

    register_op(target, strategies=strategies, family=rec.family, saves=saves,
                follows=rec.follows, flops=lambda op: rec.flops(_as_twin(op, twin)),
                localize=localize)


for _target, _twin in TWINS.items():
    _register(_target, _twin)
# ``x += y`` (a residual added in place) passes its gradient on as ``x + y`` does.
amend(aten.add_.Tensor, grad=PASSES)


# In-place views change a tensor's shape, not its values (BigBird's ``unsqueeze_``): the output
# is the functional view of the input, whose spec the view's rule gives (a dim after the one
# added shards one place later), not the input's. The export names the op's result as the value
# every later read takes, so a rank computes the functional view of its local tensor: the same
# local result, and no read of the value before it changed comes after.
VIEW_TWINS = {
    aten.unsqueeze_.default: aten.unsqueeze.default, aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.default: aten.squeeze.default, aten.squeeze_.dims: aten.squeeze.dims,
    aten.t_.default: aten.t.default, aten.transpose_.default: aten.transpose.int,
}


for _target, _twin in VIEW_TWINS.items():
    _register(_target, _twin, as_view=True)
