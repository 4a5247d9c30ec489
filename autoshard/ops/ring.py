"""Ring attention: the query, key and value sequences all sharded over a ring of ranks in the
causal zigzag layout (ir.py ``ZIGZAG``), K/V blocks passed around the ring.

Each of the ``n`` ranks holds query, key and value chunks ``r`` and ``2n-1-r`` of ``2n``. In
``n`` steps every rank attends its queries to every rank's K/V block: at step ``i`` it holds the
block of rank ``(r - i) mod n`` and, while it computes on it, already sends it on to rank
``r + 1`` and receives the next from rank ``r - 1`` (Liu, Zaharia and Abbeel, "Ring Attention
with Blockwise Transformers for Near-Infinite Context", arXiv 2310.01889, §3). The block results
merge by their log-sum-exp (the online softmax of FlashAttention, Dao et al., arXiv 2205.14135,
§3.1): ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a·e^(lse_a - lse) + out_b·e^(lse_b - lse)``.

Under a causal mask the zigzag layout skips the fully masked blocks and keeps every step's work
equal (the layout of zhuzilin/ring-flash-attention's ``zigzag_ring_flash_attn`` and torch's
``context_parallel``, ``torch/distributed/tensor/experimental/_attention.py``):

- step 0, the rank's own block: its two query chunks against its two key chunks under the
  ordinary causal mask (the chunks keep their order, so the diagonal blocks are causal, the late
  query chunk reads the early key chunk whole, and the early query chunk skips the late keys);
- a block from an earlier rank (``src < r``): both query chunks read only its early key chunk,
  whole (its late chunk lies after both);
- a block from a later rank (``src > r``): only the late query chunk reads it, whole.

Every step is two chunk-pairs of full attention, so each rank does ``2n`` of the ``2n²`` pairs
the causal mask leaves: ``1/n`` of the work, ``1/n`` per step. Without a mask every step is the
whole local query against the whole block.

Backward runs the ring again: the K/V blocks go round once more, each with an fp32 accumulator
of its gradient (dK, dV) that travels with it and is sent home after the last step, ``n`` hops;
dQ stays local. The block gradients are FlashAttention's, given the merged output and
log-sum-exp (the same recurrence as torch's ``_templated_ring_attention_backward``).

The kernel runs on local tensors with a ``Ring`` transport bound by whoever runs it: codegen
binds the axis' process group (codegen/ring.py, point-to-point sends on gloo or NCCL, every hop
in the ledger), the mesh simulator binds its threads (ops/simulate.py). The hops it makes are
:func:`ring_hops`, the one account of them the cost model and the plan's ledger read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from autoshard.ir import Phase

aten = torch.ops.aten


class Pending(Protocol):
    def wait(self) -> list[torch.Tensor]: ...


class Ring(Protocol):
    """Point-to-point transport around the ring: ``shift(tensors, backward, channel)`` sends
    ``tensors`` to the next rank and receives tensors of the same shapes and dtypes from the
    previous one; ``wait()`` on what it returns gives them. ``backward`` says which pass runs it
    (the ledger's phase); ``channel`` tells apart shifts in flight at once (backward's blocks,
    0, and their gradients, 1)."""

    def shift(self, tensors: Sequence[torch.Tensor], backward: bool,
              channel: int = 0) -> Pending: ...


class RingKernel:
    """A local kernel passing blocks around the ring of the mesh ``axes`` (their joint group,
    row-major): ``fn(ring, *args)``. Whoever runs the op binds the transport (see the module
    docstring); ``ops/`` cannot reach process groups (it sits below codegen/)."""

    def __init__(self, fn: Callable[..., Any], axes: tuple[int, ...], name: str) -> None:
        self.fn, self.axes, self.__name__ = fn, tuple(axes), name

    def bind(self, ring: Ring) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            return self.fn(ring, *args, **kwargs)
        run.__name__ = self.__name__
        return run

    def __repr__(self) -> str:
        return self.__name__


@dataclass(frozen=True, slots=True)
class Hop:
    """One shift around the ring: ``phase`` ("forward" or "backward") and the tensors it moves,
    by name: ``"kv"`` the K/V block, ``"dkv"`` its gradient accumulators (fp32 at least)."""

    phase: Phase
    moves: tuple[str, ...]


def ring_hops(n: int) -> tuple[Hop, ...]:
    """The shifts of one ring attention over ``n`` ranks, in the order the kernel makes them:
    ``n - 1`` K/V hops in forward; in backward ``n - 1`` K/V hops and ``n`` hops of their
    gradients, interleaved step by step."""
    if n <= 1:
        return ()
    fwd = [Hop(Phase.FORWARD, ("kv",))] * (n - 1)
    bwd = [h for i in range(n) for h in ((Hop(Phase.BACKWARD, ("kv",)),) if i < n - 1 else ())
           + (Hop(Phase.BACKWARD, ("dkv",)),)]
    return (*fwd, *bwd)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the merged output, the log-sum-exp and the dK/dV accumulators: fp32, or the
    inputs' where wider."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True, slots=True)
class RingLayout:
    """This rank's place: ``rank`` of ``n`` on the ring, whether the mask is causal, the
    softmax ``scale`` and GQA's query heads per K/V head (``rep``)."""

    rank: int
    n: int
    causal: bool
    scale: float | None
    rep: int

    def blocks(self, step: int, rows: int) -> tuple[slice, slice, bool]:
        """(query rows, key rows, causal) of step ``step``'s block, for ``rows`` local rows
        (see the module docstring)."""
        every, half = slice(0, rows), rows // 2
        if not self.causal:
            return every, every, False
        src = (self.rank - step) % self.n
        if src == self.rank:
            return every, every, True
        if src < self.rank:
            return every, slice(0, half), False
        return slice(half, rows), every, False


def _flash_forward(q, k, v, causal, scale):
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        out, lse, *rest = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal,
                                                                    False, scale=scale)
        return out, lse, tuple(rest[:6])
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal,
                                                                    scale=scale)
        return out, lse, ()
    return (*_math_forward(q, k, v, causal, scale), ())


def _flash_backward(g, q, k, v, out, lse, causal, scale, extra):
    if extra:       # CUDA flash: its sequence offsets, maxima and RNG state
        cq, ck, mq, mk, seed, offset = extra
        return aten._scaled_dot_product_flash_attention_backward(
            g, q, k, v, out, lse, cq, ck, mq, mk, 0.0, causal, seed, offset, scale=scale)[:3]
    if q.device.type == "cpu":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, k, v, out, lse, 0.0, causal, scale=scale)[:3]
    return _math_backward(g, q, k, v, out, lse, causal, scale)


def _scores(q, k, causal, scale):
    acc = accumulator_dtype(q.dtype)
    s = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device)
                          .triu(1), float("-inf"))
    return s


def _math_forward(q, k, v, causal, scale):
    """Where no flash kernel applies (fp32 on CUDA, other devices): the block in fp32 (or the
    inputs' wider dtype)."""
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    return ((s - lse.unsqueeze(-1)).exp() @ v.to(s.dtype)).to(q.dtype), lse


def _math_backward(g, q, k, v, out, lse, causal, scale):
    p = (_scores(q, k, causal, scale) - lse.unsqueeze(-1)).exp()
    acc = p.dtype
    g32 = g.to(acc)
    dv = p.transpose(-1, -2) @ g32
    dp = g32 @ v.to(acc).transpose(-1, -2)
    ds = p * (dp - (g32 * out.to(acc)).sum(-1, keepdim=True)) * (scale or q.shape[-1] ** -0.5)
    return (ds @ k.to(acc)).to(q.dtype), (ds.transpose(-1, -2) @ q.to(acc)).to(q.dtype), \
        dv.to(q.dtype)


def _heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """K/V heads repeated for their query heads (GQA), after the transfer: the ring moves the
    small K/V."""
    return t if rep == 1 else t.repeat_interleave(rep, dim=-3)


def _unheads(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t if rep == 1 else t.unflatten(-3, (t.shape[-3] // rep, rep)).sum(-3)


class RingAttention(torch.autograd.Function):
    """Forward and backward of ring attention on one rank (the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, ring: Ring, lay: RingLayout):
        acc = accumulator_dtype(q.dtype)
        rows = q.shape[-2]
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=acc, device=q.device)
        kv = [k, v]
        extras = []      # per step, what a CUDA flash kernel's backward takes from its forward
        for step in range(lay.n):
            pending = ring.shift(kv, False) if step < lay.n - 1 else None
            qr, kr, causal = lay.blocks(step, rows)
            o, l, extra = _flash_forward(q[..., qr, :], _heads(kv[0][..., kr, :], lay.rep),
                                     _heads(kv[1][..., kr, :], lay.rep), causal, lay.scale)
            new = torch.logaddexp(lse[..., qr], l.to(acc))
            out[..., qr, :] = out[..., qr, :] * (lse[..., qr] - new).exp().unsqueeze(-1) \
                + o.to(acc) * (l.to(acc) - new).exp().unsqueeze(-1)
            lse[..., qr] = new
            extras.append(extra)
            if pending is not None:
                kv = pending.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.lay, ctx.extras = ring, lay, extras
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        ring, lay = ctx.ring, ctx.lay
        acc = accumulator_dtype(q.dtype)
        rows = q.shape[-2]
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = [k, v]
        dkv = [torch.zeros(k.shape, dtype=acc, device=k.device),
               torch.zeros(v.shape, dtype=acc, device=v.device)]
        moving = None
        for step in range(lay.n):
            pending = ring.shift(kv, True) if step < lay.n - 1 else None
            qr, kr, causal = lay.blocks(step, rows)
            kb, vb = _heads(kv[0][..., kr, :], lay.rep), _heads(kv[1][..., kr, :], lay.rep)
            # The block's gradients under the merged softmax: its output and log-sum-exp.
            dqb, dkb, dvb = _flash_backward(
                grad[..., qr, :], q[..., qr, :].contiguous(), kb.contiguous(), vb.contiguous(),
                out[..., qr, :].contiguous(), lse[..., qr].contiguous(),
                causal, lay.scale, ctx.extras[step])
            dq[..., qr, :] += dqb.to(acc)
            if moving is not None:              # this block's accumulator, from the previous rank
                dkv = moving.wait()
            dkv[0][..., kr, :] += _unheads(dkb.to(acc), lay.rep)
            dkv[1][..., kr, :] += _unheads(dvb.to(acc), lay.rep)
            moving = ring.shift(dkv, True, 1) if lay.n > 1 else None
            if pending is not None:
                kv = pending.wait()
        if moving is not None:
            dkv = moving.wait()                 # the rank's own block, home after n hops
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_attention(ring: Ring, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                   lay: RingLayout) -> torch.Tensor:
    """Attention of the local queries over every rank's keys (see the module docstring)."""
    return RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), ring, lay)
