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

- ``selective_scan`` (autoshard's op, Mamba-1's scan as Mamba, Falcon-Mamba and Jamba call it:
  Gu and Dao 2023, arXiv 2312.00752, Algorithm 2): the recurrence runs along the sequence, so
  the sequence stays whole; batch rows and channels are independent, so either shards (the
  channels' ``A``, ``D`` and ``dt`` bias with them; ``B`` and ``C`` are shared by the channels
  and stay whole on a channel split). Hugging Face's PyTorch path is a Python loop over the
  sequence, which torch.export unrolls into a set of ops per token (2048 per layer at the
  usual length: a trace of hundreds of thousands of nodes); zoo/hf.py routes it through this
  one op, whose kernel is that loop.

- ``linear_scan`` (autoshard's op, RecurrentGemma's RG-LRU recurrence ``h_t = a_t·h_{t-1} +
  x_t``, De et al. 2024, arXiv 2402.19427): as the selective scan, the sequence whole, batch
  rows or channels split; linear in ``x`` for a given ``a``, so a Partial ``x`` passes. 2
  FLOPs per element; its backward is a scan from the end (``linear_scan_grads``, an op of its
  own, so that a compiled program traces one call).

The chunked scan of Mamba-2 (``torch_forward``) is ``cumsum`` (ops/reduction.py), ``exp``,
``tril`` masks and broadcast products summed over dims (ops/pointwise.py, ops/reduction.py):
no op of its own, and no loop over the sequence.
"""
from __future__ import annotations

from typing import Any

import torch

from autoshard.ir import Shard, Strategy, local_shape
from autoshard.ops._common import P, R, arg, norm_dim
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


# ------------------------------------------------------------------ Mamba-1's selective scan

def selective_scan_reference(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                             B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
                             z: torch.Tensor, dt_bias: torch.Tensor,
                             dt_softplus: bool) -> torch.Tensor:
    """The scan of Mamba-1 (Gu and Dao 2023, Algorithm 2) in differentiable ops, for ``u``,
    ``dt``, ``z`` ``[batch, channels, seq]``, ``A`` ``[channels, state]``, ``B``, ``C``
    ``[batch, state, seq]``, ``D`` and ``dt_bias`` ``[channels]``: ``dt = softplus(dt +
    dt_bias)``, then along the sequence ``h_t = exp(A·dt_t)·h_{t-1} + dt_t·B_t·u_t`` and
    ``y_t = C_t·h_t + D·u_t``, gated by ``silu(z)``. The state is kept in ``u``'s dtype and the
    products in float32, as transformers' PyTorch path keeps them."""
    dt = dt + dt_bias.to(dt.dtype)[..., None]
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    decay = torch.exp(A[None, :, None, :] * dt[..., None])                  # [b, d, L, n]
    drive = dt[..., None] * B.transpose(1, 2)[:, None].float() * u[..., None].float()
    state = torch.zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=u.dtype, device=u.device)
    ys = []
    for t in range(u.shape[-1]):
        state = decay[:, :, t] * state + drive[:, :, t]
        ys.append(torch.matmul(state.to(u.dtype), C[:, :, t, None])[..., 0])
    y = torch.stack(ys, dim=-1) + u * D[None, :, None]
    return y * torch.nn.functional.silu(z)


@torch.library.custom_op("autoshard::selective_scan", mutates_args=())
def selective_scan(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor,
                   dt_softplus: bool) -> torch.Tensor:
    """Mamba-1's selective scan as one op (``selective_scan_reference``)."""
    return selective_scan_reference(u, dt, A, B, C, D, z, dt_bias, dt_softplus)


@selective_scan.register_fake
def _selective_scan_fake(u: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                         C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, *args: Any
                         ) -> torch.Tensor:
    dtype = torch.promote_types(torch.promote_types(u.dtype, D.dtype), z.dtype)
    return torch.empty(u.shape, dtype=dtype, device=u.device)


def _selective_scan_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:8])
    ctx.dt_softplus = inputs[8]


def _selective_scan_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    """The scan again under autograd (what mamba_ssm's kernel does: the states are recomputed
    in backward, not saved)."""
    leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in ctx.saved_tensors]
    with torch.enable_grad():
        out = selective_scan_reference(*leaves, ctx.dt_softplus)
        grads = torch.autograd.grad(out, leaves, grad, allow_unused=True)
    return (*(torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)), None)


selective_scan.register_autograd(_selective_scan_backward, setup_context=_selective_scan_context)
SELECTIVE_SCAN = torch.ops.autoshard.selective_scan.default

# (u, dt, A, B, C, D, z, dt_bias) -> y: batch rows, or channels, over an axis.
_SCAN_BATCH = ((Shard(0), Shard(0), R, Shard(0), Shard(0), R, Shard(0), R), (Shard(0),))
_SCAN_CHANNELS = ((Shard(1), Shard(1), Shard(0), R, R, Shard(0), Shard(1), Shard(0)),
                  (Shard(1),))


def selective_scan_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    return expand(op, mesh_shape, [_SCAN_BATCH, _SCAN_CHANNELS])


def selective_scan_flops(op: OpInfo) -> float:
    """8 per element of the ``[batch, channels, seq, state]`` recurrence: the decay's product
    and exponential, the drive's two products, the state update's two, the output's
    multiply-add."""
    u, A = op.inputs[0], op.inputs[2]
    return 8.0 * u.numel * A.shape[-1]


# Backward needs the inputs, not the states (recomputed).
register_op(SELECTIVE_SCAN, strategies=selective_scan_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=tuple(range(8))), follows=NO, flops=selective_scan_flops)


# ---------------------------------------------- a linear recurrence: RecurrentGemma's RG-LRU

def _linear_scan(x: torch.Tensor, a: torch.Tensor, *, reverse: bool = False) -> torch.Tensor:
    """``h_t = a_t·h_{t-1} + x_t`` along dim 1 from ``h = 0`` (backwards from the end with
    ``reverse``), in float32, as transformers' ``_rnn_scan`` accumulates."""
    h = torch.zeros(x[:, 0].shape, dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    steps = range(x.shape[1] - 1, -1, -1) if reverse else range(x.shape[1])
    for t in steps:
        h = a[:, t].float() * h + x[:, t].float()
        out[:, t] = h
    return out


@torch.library.custom_op("autoshard::linear_scan", mutates_args=())
def linear_scan(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The diagonal linear recurrence of RecurrentGemma's RG-LRU (De et al. 2024, arXiv
    2402.19427, eq. 4) over ``x``, ``a`` ``[batch, seq, width]``: ``h_t = a_t·h_{t-1} + x_t``
    from ``h_0 = 0``, accumulated in float32, returned in ``x``'s dtype. One op where
    transformers loops over the sequence, which a trace unrolls token by token."""
    return _linear_scan(x, a).to(x.dtype)


@linear_scan.register_fake
def _linear_scan_fake(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("autoshard::linear_scan_grads", mutates_args=())
def linear_scan_grads(grad: torch.Tensor, a: torch.Tensor, y: torch.Tensor
                      ) -> list[torch.Tensor]:
    """The backward of ``linear_scan``, a scan too (so one op under a compiler): the gradient
    of every ``h_t``, ``d_t = g_t + a_{t+1}·d_{t+1}``, run from the end, is ``x_t``'s; ``a_t``'s
    is ``d_t·h_{t-1}``, from the output ``y`` (``h_{-1} = 0``)."""
    shifted = torch.cat([a[:, 1:], torch.zeros_like(a[:, :1])], dim=1)
    d = _linear_scan(grad, shifted, reverse=True)
    previous = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1).float()
    return [d.to(y.dtype), (d * previous).to(a.dtype)]


@linear_scan_grads.register_fake
def _linear_scan_grads_fake(grad: torch.Tensor, a: torch.Tensor, y: torch.Tensor
                            ) -> list[torch.Tensor]:
    return [torch.empty_like(y), torch.empty_like(a)]


def _linear_scan_context(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[1], output)


def _linear_scan_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    a, y = ctx.saved_tensors
    gx, ga = linear_scan_grads(grad, a, y)
    return gx, ga


linear_scan.register_autograd(_linear_scan_backward, setup_context=_linear_scan_context)
LINEAR_SCAN = torch.ops.autoshard.linear_scan.default


def linear_scan_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    """The recurrence runs along the sequence, which stays whole; batch rows and channels are
    independent, so either shards (``x`` and ``a`` alike). For a given ``a`` the output is
    linear in ``x``: a Partial ``x`` gives a Partial output."""
    opts = [((Shard(d), Shard(d)), (Shard(d),)) for d in (0, 2)]
    return expand(op, mesh_shape, [*opts, ((P, R), (P,))])


# 2 FLOPs per element (a multiply and an add); backward reads ``a`` and the output.
register_op(LINEAR_SCAN, strategies=linear_scan_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(1,), outputs=(0,)), follows=NO,
            flops=lambda op: 2.0 * op.inputs[0].numel)
