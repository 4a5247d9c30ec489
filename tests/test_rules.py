"""Every registered op rule, checked against single-device execution (as DTensor's strategy validation does).

For each op and each of its samples, every strategy the rule gives on meshes (2,), (4,), (2, 2)
(and (2, 2, 2) for a few ops) runs on a simulated mesh: inputs are sharded (Partial ones split
into random, different summands), the op runs per rank through the rule's localize, outputs are
reassembled and compared with the whole op; then per-rank autograd, with local gradients summed
over divergent axes, is compared with the whole op's input gradients.

Tolerance: float64 with rtol 1e-5. A wrong rule is off by O(1); float64 keeps the legitimate
differences (summation order, random Partial splits) near 1e-15, so 1e-5 cannot hide an error
and never flakes. Ops cast to float32 compare float32 outputs with the same rtol (fp32 rounding
is ~1e-7 relative). Samples in float32 (ops with no float64 kernel: ``_grouped_mm``) add atol
1e-5: an output near zero keeps the ~1e-6 absolute rounding of the random Partial summands.
tests/test_dtypes.py runs the samples again in bfloat16 and complex64.

Sampling: a (sample, mesh) with more than ``CAP`` strategies checks a fixed pseudo-random subset
of ``CAP`` (seeded by the op, sample and mesh, so a failure reproduces), always including every
strategy that is replicated on all axes but one; the full count is still checked for duplicates
and fit.
"""
from __future__ import annotations

import importlib.util
import math
import random
import warnings
from typing import Any, Callable

import pytest
import torch
from torch.utils._pytree import tree_flatten

import autoshard.ops  # noqa: F401  (registers every rule)
from autoshard.ir import Replicate, op_info, spec_fits
from autoshard.ops import registry
from autoshard.ops.inplace import TWINS as INPLACE_TWINS, VIEW_TWINS as INPLACE_VIEWS
from autoshard.ops.moe import ROUTED_EXPERTS, ROUTED_LINEAR, register_library_ops
from autoshard.ops.ssm import LINEAR_SCAN, SELECTIVE_SCAN
from autoshard.ops.registry import (FAMILIES, FOLLOWS, RECORDS, OpRecord, Saves, record_of,
                                    strategies_for)
from autoshard.ops.simulate import call_on_copies, check_strategy

aten = torch.ops.aten
F64 = torch.float64
MESHES = [(2,), (4,), (2, 2)]
DEEP = {aten.mm.default, aten.linear.default, aten.view.default, aten.embedding.default,
        aten.scaled_dot_product_attention.default, aten.cross_entropy_loss.default,
        aten.mean.dim, aten.add.Tensor, aten.expand.default}
CAP = {1: 1000, 2: 36, 3: 16}


class Gen:
    """Deterministic sample tensors."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)

    def t(self, *shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=self.g, dtype=F64)

    def pos(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g, dtype=F64) + 0.5

    def i(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.g)

    def b(self, *shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=self.g) > 0.5

    def c(self, *shape: int) -> torch.Tensor:
        return torch.complex(self.t(*shape), self.t(*shape))


Sample = Callable[[Gen], tuple]  # -> (args, kwargs) or (args, kwargs, {"no_grad": {i, ...}})
SAMPLES: dict[Any, list[Sample]] = {}
NO_VALUES = set()  # ops whose output values are undefined (empty): shapes only


def sample(*ops: Any) -> Callable[[Sample], Sample]:
    def deco(fn: Sample) -> Sample:
        for op in ops:
            SAMPLES.setdefault(op, []).append(fn)
        return fn
    return deco


def simple(ops, *makers):
    for m in makers:
        sample(*ops)(m)


# ---- matmul --------------------------------------------------------------------------------
simple([aten.mm.default], lambda g: ((g.t(8, 4), g.t(4, 8)), {}))
simple([aten.bmm.default], lambda g: ((g.t(4, 8, 4), g.t(4, 4, 8)), {}))
simple([aten.addmm.default], lambda g: ((g.t(8), g.t(4, 8), g.t(8, 8)), {}),
       lambda g: ((g.t(4, 8), g.t(4, 8), g.t(8, 8)), {"beta": 0.5, "alpha": 2.0}))
simple([aten.baddbmm.default], lambda g: ((g.t(4, 8, 8), g.t(4, 8, 4), g.t(4, 4, 8)), {"alpha": 0.5}))
simple([aten.matmul.default], lambda g: ((g.t(2, 4, 8, 4), g.t(2, 4, 4, 8)), {}),
       lambda g: ((g.t(2, 4, 8, 4), g.t(4, 8)), {}), lambda g: ((g.t(8), g.t(2, 8, 4)), {}))
simple([aten.linear.default], lambda g: ((g.t(2, 4, 8), g.t(8, 8)), {}),
       lambda g: ((g.t(2, 4, 8), g.t(16, 8), g.t(16)), {}))
simple([aten.einsum.default], lambda g: (("bhsd,bhtd->bhst", [g.t(2, 4, 8, 4), g.t(2, 4, 8, 4)]), {}),
       lambda g: (("...k,nk->...n", [g.t(2, 4, 8), g.t(4, 8)]), {}))
# GShard's MoE layer (Lepikhin et al. 2020, Algorithm 1): dispatch, an expert, combine; the
# expert dim E (size 4) is what expert parallelism shards.
simple([aten.einsum.default],
       lambda g: (("GSEC,GSM->EGCM", [g.t(4, 2, 4, 2), g.t(4, 2, 4)]), {}),
       lambda g: (("EGCM,EMH->EGCH", [g.t(4, 2, 2, 4), g.t(4, 4, 8)]), {}),
       lambda g: (("GSEC,EGCM->GSM", [g.t(4, 2, 4, 2), g.t(4, 4, 2, 4)]), {}))
simple([aten.mv.default], lambda g: ((g.t(8, 4), g.t(4)), {}))
simple([aten.dot.default], lambda g: ((g.t(8), g.t(8)), {}))

# ---- pointwise ------------------------------------------------------------------------------
for _op in (aten.add.Tensor, aten.sub.Tensor):
    simple([_op], lambda g: ((g.t(2, 4, 8), g.t(8)), {}), lambda g: ((g.t(2, 4, 8), g.t(2, 4, 8)), {"alpha": 2}),
           lambda g: ((g.t(2, 4, 8), 1.5), {}))
simple([aten.mul.Tensor], lambda g: ((g.t(2, 4, 8), g.t(2, 1, 8)), {}), lambda g: ((g.t(2, 4, 8), 0.5), {}))
simple([aten.div.Tensor], lambda g: ((g.t(4, 8), g.pos(4, 8)), {}), lambda g: ((g.t(4, 8), 4.0), {}))
simple([aten.mul.Scalar, aten.div.Scalar], lambda g: ((g.t(4, 8), 2.0), {}))
simple([aten.neg.default, aten.clone.default, aten.contiguous.default, aten.alias.default,
        aten.detach.default, aten.lift_fresh_copy.default, aten.positive.default, aten.exp.default,
        aten.expm1.default,
        aten.tanh.default, aten.gelu.default, aten.silu.default, aten.relu.default,
        aten.sigmoid.default, aten.cos.default, aten.sin.default, aten.abs.default, aten.erf.default,
        aten.square.default, aten.isnan.default, aten.isinf.default],
       lambda g: ((g.t(2, 4, 8),), {}))
simple([aten.hardtanh.default], lambda g: ((g.t(2, 4, 8),), {}),
       lambda g: ((g.t(2, 4, 8), 0.0, 6.0), {}))
simple([aten.hardswish.default, aten.hardsigmoid.default], lambda g: ((g.t(2, 4, 8) * 4,), {}))
simple([aten.leaky_relu.default], lambda g: ((g.t(2, 4, 8),), {}),
       lambda g: ((g.t(2, 4, 8), 0.2), {}))
simple([aten.rsqrt.default, aten.sqrt.default, aten.log.default, aten.reciprocal.default],
       lambda g: ((g.pos(2, 4, 8),), {}))
simple([aten.gelu.default], lambda g: ((g.t(4, 8),), {"approximate": "tanh"}))
simple([aten.to.dtype], lambda g: ((g.t(4, 8), torch.float32), {}), lambda g: ((g.t(4, 8), torch.bool), {}))
simple([aten.to.dtype_layout], lambda g: ((g.t(4, 8),), {"dtype": F64, "layout": torch.strided, "device": "cpu"}))
simple([aten.to.device], lambda g: ((g.t(4, 8), "cpu", F64), {}))
simple([aten._to_copy.default], lambda g: ((g.t(4, 8),), {"dtype": torch.float32}))
simple([aten.pow.Tensor_Scalar], lambda g: ((g.t(2, 4, 8), 2), {}), lambda g: ((g.t(4, 8), 3.0), {}))
simple([aten.pow.Scalar], lambda g: ((2.0, g.t(4, 8)), {}))
simple([aten.rsub.Scalar, aten.add.Scalar, aten.sub.Scalar], lambda g: ((g.t(4, 8), 1.0), {}))
simple([aten.dropout.default], lambda g: ((g.t(2, 4, 8), 0.0, True), {}),
       lambda g: ((g.t(2, 4, 8), 0.1, False), {}))
simple([aten.logical_not.default, aten.bitwise_not.default], lambda g: ((g.b(4, 8),), {}))
simple([aten.floor.default, aten.ceil.default, aten.round.default, aten.trunc.default,
        aten.sign.default], lambda g: ((g.t(2, 4, 8) * 3,), {}))
simple([aten.clamp.default], lambda g: ((g.t(4, 8), -0.5, 0.5), {}))
simple([aten.clamp_min.default, aten.clamp_max.default], lambda g: ((g.t(4, 8), 0.1), {}))
simple([aten.pow.Tensor_Tensor], lambda g: ((g.pos(4, 8), g.t(8)), {}))
simple([aten.maximum.default, aten.minimum.default], lambda g: ((g.t(4, 8), g.t(4, 1)), {}))
# clamp with tensor bounds, either or both (PhiMoE's router)
simple([aten.clamp.Tensor], lambda g: ((g.t(4, 8), g.t(4, 1), g.t(8)), {}),
       lambda g: ((g.t(4, 8), None, g.t(4, 8)), {}))
for _op in (aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor, aten.gt.Tensor, aten.ge.Tensor):
    simple([_op], lambda g: ((g.i(3, 2, 4, 8), g.i(3, 1, 8)), {}))
for _op in (aten.eq.Scalar, aten.ne.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar, aten.ge.Scalar):
    simple([_op], lambda g: ((g.i(3, 4, 8), 1), {}))
simple([aten.__and__.Tensor, aten.__or__.Tensor, aten.__xor__.Tensor, aten.logical_and.default,
        aten.logical_or.default], lambda g: ((g.b(2, 4, 8), g.b(4, 8)), {}))
simple([aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.bitwise_xor.Tensor],
       lambda g: ((g.i(8, 4, 8), g.i(8, 4, 8)), {}))
simple([aten.where.self], lambda g: ((g.b(4, 8), g.t(4, 8), g.t(8)), {}))
simple([aten.where.ScalarOther], lambda g: ((g.b(4, 8), g.t(4, 8), 0.0), {}))
simple([aten.where.ScalarSelf], lambda g: ((g.b(4, 8), 0.0, g.t(4, 8)), {}))
simple([aten.where.Scalar], lambda g: ((g.b(2, 4, 8), 1.0, 0.0), {}))
simple([aten.masked_fill.Scalar], lambda g: ((g.t(2, 4, 8), g.b(4, 8), -1.0), {}))
simple([aten.masked_fill.Tensor], lambda g: ((g.t(2, 4, 8), g.b(2, 4, 8), torch.tensor(0.5, dtype=F64)), {}))

# ---- reductions -----------------------------------------------------------------------------
simple([aten.sum.default, aten.mean.default], lambda g: ((g.t(4, 8),), {}))
simple([aten.sum.dim_IntList, aten.mean.dim], lambda g: ((g.t(2, 4, 8), [1]), {}),
       lambda g: ((g.t(2, 4, 8), [0, -1], True), {}))
simple([aten.mean.dim], lambda g: ((g.t(2, 4, 8), [-1], True), {}))
simple([aten.sum.dim_IntList], lambda g: ((g.b(4, 8), [1]), {}))
simple([aten.amax.default, aten.amin.default], lambda g: ((g.t(2, 4, 8), [-1], True), {}),
       lambda g: ((g.t(2, 4, 8), [0, 1]), {}))
simple([aten.max.dim, aten.min.dim], lambda g: ((g.t(2, 4, 8), 1), {}))
# DBRX's router: its top-k weights over their 1-norm; the 2-norm over all dims too
simple([aten.linalg_vector_norm.default],
       lambda g: ((g.t(2, 4, 8), 1.0, [-1], True), {}), lambda g: ((g.t(2, 4, 8),), {}),
       lambda g: ((g.t(2, 4, 8), 2.0, [0, 2]), {}))
# Granite-SWA's attention sinks: logsumexp over the keys
simple([aten.logsumexp.default], lambda g: ((g.t(2, 4, 8), [-1]), {}),
       lambda g: ((g.t(2, 4, 8), [0, 2], True), {}))
simple([aten.argmax.default, aten.argmin.default], lambda g: ((g.t(2, 4, 8), -1), {}))
simple([aten.softmax.int, aten.log_softmax.int], lambda g: ((g.t(2, 4, 8), -1), {}))
simple([aten._softmax.default, aten._log_softmax.default], lambda g: ((g.t(2, 4, 8), 1, False), {}))
simple([aten.cumsum.default], lambda g: ((g.t(2, 4, 8), 1), {}), lambda g: ((g.b(4, 8), -1), {}))
simple([aten.fft_fft.default], lambda g: ((g.c(2, 4, 8), None, 1), {}), lambda g: ((g.t(4, 8),), {}))
simple([aten.fft_ifft.default], lambda g: ((g.c(4, 8), None, -1, "ortho"), {}))
simple([aten.fft_rfft.default], lambda g: ((g.t(2, 4, 16),), {}), lambda g: ((g.t(4, 16), 8, 0), {}))
simple([aten.fft_irfft.default], lambda g: ((g.c(2, 4, 9), 16), {}),
       lambda g: ((g.c(4, 8), None, 0, "forward"), {}))

# ---- views ----------------------------------------------------------------------------------
for _op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default):
    simple([_op], lambda g: ((g.t(2, 4, 8), [8, 8]), {}), lambda g: ((g.t(8, 8), [2, 4, 8]), {}),
           lambda g: ((g.t(2, 4, 8), [2, 4, 2, 4]), {}), lambda g: ((g.t(4, 8), [8, 4]), {}),
           lambda g: ((g.t(2, 4, 8), [-1, 8]), {}))
# LeViT's reshape_as: the other tensor read for its shape only
simple([aten.reshape_as.default], lambda g: ((g.t(2, 4, 8), g.t(8, 8)), {}),
       lambda g: ((g.t(8, 8), g.t(2, 4, 8)), {}))
simple([aten.flatten.using_ints], lambda g: ((g.t(2, 4, 8), 0, 1), {}))
simple([aten.unflatten.int], lambda g: ((g.t(2, 32), 1, [4, 8]), {}))
simple([aten.expand.default], lambda g: ((g.t(4, 1, 8), [2, 4, 8, 8]), {}), lambda g: ((g.t(1, 8), [4, -1]), {}))
# GPT-NeoX-Japanese's bias expanded as the residual: the other tensor read for its shape only
simple([aten.expand_as.default], lambda g: ((g.t(4, 1, 8), g.t(2, 4, 8, 8)), {}),
       lambda g: ((g.t(8), g.t(4, 8)), {}))
simple([aten.permute.default], lambda g: ((g.t(2, 4, 8), [2, 0, 1]), {}))
simple([aten.transpose.int], lambda g: ((g.t(2, 4, 8), 1, 2), {}))
simple([aten.t.default], lambda g: ((g.t(4, 8),), {}))
simple([aten.unsqueeze.default], lambda g: ((g.t(4, 8), 1), {}))
simple([aten.squeeze.dim], lambda g: ((g.t(4, 1, 8), 1), {}))
simple([aten.squeeze.dims], lambda g: ((g.t(4, 1, 8, 1), [1, 3]), {}))
simple([aten.squeeze.default], lambda g: ((g.t(1, 4, 8),), {}))
simple([aten.select.int], lambda g: ((g.t(2, 4, 8), 1, 2), {}))
simple([aten.unbind.int], lambda g: ((g.t(2, 4, 8), 1), {}))
simple([aten.meshgrid.indexing], lambda g: (([g.t(4), g.t(8)],), {"indexing": "ij"}))
simple([aten.meshgrid.default], lambda g: (([g.t(4), g.t(8)],), {}))
simple([aten.slice.Tensor], lambda g: ((g.t(2, 4, 8), 2, 0, 4), {}),
       lambda g: ((g.t(2, 4, 8), 1, 0, 9223372036854775807), {}),
       # strided, as DeepSeek's interleaved rotary slices x[..., ::2]
       lambda g: ((g.t(2, 4, 8), 2, 0, 8, 2), {}))
simple([aten.narrow.default], lambda g: ((g.t(2, 4, 8), 2, 2, 4), {}))
simple([aten.split.Tensor], lambda g: ((g.t(2, 4, 8), 4, 2), {}))
simple([aten.split_with_sizes.default], lambda g: ((g.t(8, 4), [4, 4]), {}),
       lambda g: ((g.t(2, 4, 8), [2, 6], -1), {}))
simple([aten.chunk.default], lambda g: ((g.t(2, 4, 8), 2, 1), {}))
simple([aten.cat.default, aten.concat.default], lambda g: (([g.t(2, 4, 8), g.t(2, 4, 8)], -1), {}),
       lambda g: (([g.t(2, 4, 8), g.t(2, 4, 8)], 0), {}))
simple([aten.broadcast_tensors.default], lambda g: (([g.t(4, 8), g.t(2, 1, 8)],), {}))
simple([aten.stack.default], lambda g: (([g.t(4, 8), g.t(4, 8)], 1), {}))

# ---- norms, embedding, attention, losses ----------------------------------------------------
simple([aten.layer_norm.default], lambda g: ((g.t(2, 4, 8), [8], g.t(8), g.t(8), 1e-5), {}),
       lambda g: ((g.t(2, 4, 8), [4, 8]), {}))
simple([aten.rms_norm.default], lambda g: ((g.t(2, 4, 8), [8], g.t(8), 1e-6), {}))


def _ids(g: Gen, high: int, *shape: int) -> torch.Tensor:
    ids = g.i(high, *shape)
    ids.view(-1)[0] = 0  # hit the padding row
    return ids


simple([aten.embedding.default], lambda g: ((g.t(16, 8), _ids(g, 16, 2, 4)), {}),
       lambda g: ((g.t(16, 8), _ids(g, 16, 2, 4), 0), {}),
       lambda g: ((g.t(16, 8), _ids(g, 16, 4), -1, True), {}))
_SDPA = aten.scaled_dot_product_attention.default
simple([_SDPA], lambda g: ((g.t(2, 4, 8, 4), g.t(2, 4, 8, 4), g.t(2, 4, 8, 4)), {}),
       lambda g: ((g.t(2, 4, 8, 4), g.t(2, 4, 8, 4), g.t(2, 4, 8, 4)), {"is_causal": True, "scale": 0.3}),
       lambda g: ((g.t(2, 4, 8, 4), g.t(2, 4, 8, 4), g.t(2, 4, 8, 4),
                   torch.tril(torch.ones(8, 8, dtype=torch.bool)).expand(2, 1, 8, 8)), {}),
       lambda g: ((g.t(2, 4, 8, 4), g.t(2, 2, 8, 4), g.t(2, 2, 8, 4), g.t(8, 8)), {"enable_gqa": True}))


def _targets(g: Gen, high: int, *shape: int) -> torch.Tensor:
    t = g.i(high, *shape)
    t.view(-1)[1::3] = -100  # some ignored targets, unevenly over the rows
    return t


_CE = aten.cross_entropy_loss.default
simple([_CE], lambda g: ((g.t(8, 16), _targets(g, 16, 8)), {}),
       lambda g: ((g.t(8, 16), _targets(g, 16, 8), None, 2), {}),
       lambda g: ((g.t(8, 16), _targets(g, 16, 8), None, 0), {}),
       lambda g: ((g.t(8, 16), _targets(g, 16, 8), g.pos(16)), {}, {"no_grad": {2}}),
       lambda g: ((g.t(8, 16), _targets(g, 16, 8), None, 1, -100, 0.1), {}),
       lambda g: ((g.t(2, 16, 4), _targets(g, 16, 2, 4)), {}))
simple([aten.nll_loss_nd.default, aten.nll_loss.default],
       lambda g: ((torch.log_softmax(g.t(8, 16), -1), _targets(g, 16, 8)), {}),
       lambda g: ((torch.log_softmax(g.t(8, 16), -1), _targets(g, 16, 8), g.pos(16), 1, -100), {},
                  {"no_grad": {2}}))
simple([aten.mse_loss.default], lambda g: ((g.t(4, 8), g.t(4, 8)), {}),
       lambda g: ((g.t(4, 8), g.t(4, 8), 2), {}), lambda g: ((g.t(4, 8), g.t(4, 8), 0), {}))

# ---- factories ------------------------------------------------------------------------------
simple([aten.full.default], lambda g: (([4, 8], 1.5), {"dtype": F64}))
simple([aten.zeros.default, aten.ones.default, aten.empty.memory_format],
       lambda g: (([4, 8],), {"dtype": F64}))
NO_VALUES |= {aten.empty.memory_format, aten.new_empty.default, aten.empty_like.default}
simple([aten.arange.default], lambda g: ((8,), {}))
simple([aten.arange.start], lambda g: ((2, 10), {}))
simple([aten.arange.start_step], lambda g: ((0, 16, 2), {}), lambda g: ((0.0, 4.0, 0.5), {"dtype": F64}))
simple([aten.scalar_tensor.default], lambda g: ((1.5,), {"dtype": F64}))
simple([aten.new_ones.default, aten.new_zeros.default, aten.new_empty.default],
       lambda g: ((g.t(2, 4, 8), [4, 8]), {}))
simple([aten.new_full.default], lambda g: ((g.t(2, 4, 8), [4, 8], 2.0), {}))
simple([aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default],
       lambda g: ((g.t(4, 8),), {}))
simple([aten.full_like.default], lambda g: ((g.t(4, 8), 3.0), {}))
# Random draws: every call starts from one generator state (ops/simulate.py call_on_copies), so
# a rank's values equal the single device's only where it draws the whole tensor.
simple([aten.rand.default, aten.randn.default], lambda g: (([8, 1, 1],), {"dtype": F64}),
       lambda g: (([4, 8],), {"dtype": torch.float32}))
simple([aten.rand_like.default, aten.randn_like.default], lambda g: ((g.t(4, 8),), {}),
       lambda g: ((g.t(2, 4, 8),), {"dtype": torch.float32}))
simple([aten.bernoulli_.float], lambda g: ((g.t(8, 1, 1), 0.7), {}))
simple([aten.uniform_.default], lambda g: ((g.t(4, 8), -1.0, 2.0), {}))
simple([aten.normal_.default], lambda g: ((g.t(4, 8), 0.5, 2.0), {}))
simple([aten.eye.default], lambda g: ((4,), {}))
simple([aten.eye.m], lambda g: ((4, 6), {}))
simple([aten.exponential_.default], lambda g: ((g.t(4, 8), 2.0), {}), lambda g: ((g.t(4, 8),), {}))
simple([aten._assert_tensor_metadata.default],
       lambda g: ((g.t(4, 8),), {"dtype": F64, "layout": torch.strided}))

# ---- misc -----------------------------------------------------------------------------------
simple([aten.diff.default], lambda g: ((g.t(2, 8), 1, -1), {}))
simple([aten.index.Tensor], lambda g: ((g.t(4, 8), [g.i(4, 2, 1), g.i(8, 1, 3)]), {}))
# (gather and scatter split the dims on which all their tensors have one size: a router's
# tokens; an index shorter there than its source keeps them whole)
simple([aten.gather.default], lambda g: ((g.t(4, 8), 1, g.i(8, 4, 2)), {}),
       lambda g: ((g.t(2, 4, 8), -1, g.i(8, 2, 4, 3)), {}),
       lambda g: ((g.t(4, 8), 1, g.i(8, 2, 3)), {}))
simple([aten.index_select.default], lambda g: ((g.t(4, 8), 0, g.i(4, 3)), {}))
simple([aten.scatter.src], lambda g: ((g.t(4, 8), 1, g.i(8, 4, 2), g.t(4, 2)), {}),
       lambda g: ((g.t(2, 4, 8), 2, g.i(8, 2, 4, 2), g.t(2, 4, 2)), {}),
       lambda g: ((g.t(4, 8), 0, g.i(4, 2, 8), g.t(2, 8)), {}))
simple([aten.scatter.value], lambda g: ((g.t(4, 8), 1, g.i(8, 4, 2), 1.0), {}))
simple([aten.flip.default], lambda g: ((g.t(4, 8), [1]), {}),
       lambda g: ((g.t(2, 4, 8), [0, -1]), {}))
simple([aten.roll.default], lambda g: ((g.t(4, 8), [1], [1]), {}),
       lambda g: ((g.t(4, 8), [3]), {}), lambda g: ((g.t(2, 4, 8), [1, 2], [0, 2]), {}))
# a dim tiled once shards through; JetMoE's keys over its heads: repeat(1, k, 1, 1); new
# leading dims
simple([aten.repeat.default], lambda g: ((g.t(4, 8), [2, 1]), {}),
       lambda g: ((g.t(2, 2, 8, 4), [1, 2, 1, 1]), {}), lambda g: ((g.t(4, 8), [2, 1, 1]), {}))
simple([aten.one_hot.default], lambda g: ((g.i(8, 4), 8), {}),
       lambda g: ((g.i(4, 4, 8), 4), {}))
simple([aten.bincount.default], lambda g: ((g.i(8, 16),), {}))
simple([aten.outer.default], lambda g: ((g.t(4), g.t(8)), {}))
simple([aten.triu.default, aten.tril.default], lambda g: ((g.t(2, 8, 8), 1), {}))
simple([aten.pad.default], lambda g: ((g.i(16, 2, 8), [0, 1], "constant", -100.0), {}),
       lambda g: ((g.t(2, 4, 8), [1, 1]), {}),
       # Mamba-2's pad_tensor_by_size: every dim listed, only the sequence padded
       lambda g: ((g.t(2, 6, 4, 8), [0, 0, 0, 0, 0, 2, 0, 0], "constant", 0.0), {}),
       lambda g: ((g.t(2, 6, 4, 8), [0, 0, 0, 0, 0, 0, 0, 0], "constant", 0.0), {}))
simple([aten.constant_pad_nd.default], lambda g: ((g.t(2, 4, 8), [1, 1], 0.0), {}))

# ---- shape and dtype of another tensor, overwrites, more binaries ---------------------------
simple([aten.numpy_T.default, aten.matrix_H.default], lambda g: ((g.t(4, 8),), {}))
simple([aten.numpy_T.default, aten.mT.default, aten.mH.default], lambda g: ((g.t(2, 4, 8),), {}))
simple([aten.mH.default, aten.view_as_real.default, aten.real.default, aten.imag.default],
       lambda g: ((g.c(2, 4, 8),), {}))
simple([aten.view_as_complex.default], lambda g: ((g.t(2, 4, 8, 2),), {}))
simple([aten.type_as.default], lambda g: ((g.t(2, 4, 8), g.t(2, 4, 8).float()), {}),
       lambda g: ((g.t(4, 8), g.t(8)), {}), lambda g: ((g.t(4, 8), g.i(3, 4, 8)), {}))


def _copy_src(g: Gen) -> tuple:
    return (g.t(2, 4, 8), g.t(4, 8)), {}


# Functional ``copy`` has no eager derivative (only functionalized graphs hold it); ``copy_``,
# which training graphs hold, is checked with gradients below.
simple([aten.copy.default], lambda g: (*_copy_src(g), {"no_grad": {0, 1}}),
       lambda g: ((g.i(3, 4, 8), g.t(4, 8)), {}, {"no_grad": {1}}))
simple([aten.fill.Scalar], lambda g: ((g.t(4, 8), 1.5), {}))
simple([aten.fill.Tensor], lambda g: ((g.t(4, 8), g.t(1).view(())), {}))
simple([aten.zero.default], lambda g: ((g.t(2, 4, 8),), {}))
simple([aten.floor_divide.default], lambda g: ((g.i(16, 4, 8), 3), {}),
       lambda g: ((g.i(16, 4, 8), g.i(3, 8) + 1), {}))
# (LongT5's transient-global attention numbers its blocks with remainder)
simple([aten.remainder.Scalar, aten.fmod.Scalar], lambda g: ((g.i(16, 4, 8), 3), {}),
       lambda g: ((g.t(4, 8), 0.7), {}))
simple([aten.remainder.Tensor, aten.fmod.Tensor],
       lambda g: ((g.i(16, 4, 8), g.i(3, 8) + 1), {}),
       lambda g: ((g.t(4, 8), g.t(8).abs() + 0.5), {}))
simple([aten.max.other, aten.min.other], lambda g: ((g.t(4, 8), g.t(4, 1)), {}))

# ---- convolutions ---------------------------------------------------------------------------
simple([aten.conv2d.default], lambda g: ((g.t(2, 4, 8, 8), g.t(8, 4, 4, 4), g.t(8), [4, 4]), {}),
       lambda g: ((g.t(2, 4, 8, 8), g.t(8, 4, 3, 3), None, [2, 1], [1, 0], [1, 2]), {}),
       lambda g: ((g.t(2, 4, 8, 8), g.t(8, 2, 3, 3), g.t(8), [1, 1], [1, 1], [1, 1], 2), {}),
       lambda g: ((g.t(4, 8, 8), g.t(8, 4, 3, 3)), {}))
simple([aten.conv1d.default], lambda g: ((g.t(2, 4, 16), g.t(8, 4, 3), g.t(8), [2]), {}))
simple([aten.conv3d.default], lambda g: ((g.t(2, 4, 4, 4, 4), g.t(4, 4, 2, 2, 2)), {}))
simple([aten.conv1d.padding], lambda g: ((g.t(2, 4, 16), g.t(8, 4, 3), None, [1], "same"), {}))
simple([aten.conv2d.padding], lambda g: ((g.t(2, 4, 8, 8), g.t(8, 4, 3, 3), g.t(8), [1, 1], "same"), {}))
simple([aten.convolution.default],
       lambda g: ((g.t(2, 4, 8, 8), g.t(8, 4, 3, 3), g.t(8), [1, 1], [1, 1], [1, 1], False, [0, 0], 1), {}),
       lambda g: ((g.t(2, 4, 8, 8), g.t(4, 8, 3, 3), g.t(8), [2, 2], [1, 1], [1, 1], True, [1, 1], 1), {}))

# ---- batch and group norm (ops/batch_norm.py) ----------------------------------------------
# (input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled); the
# running statistics are buffers: no gradient. Training with batch or spatial dims sharded runs
# SyncBatchNorm, whose statistics the simulated ranks all-reduce forward and backward.
simple([aten.batch_norm.default],
       lambda g: ((g.t(4, 4, 4, 4), g.t(4), g.t(4), g.t(4), g.pos(4), True, 0.1, 1e-5, False),
                  {}, {"no_grad": {3, 4}}),
       lambda g: ((g.t(8, 4), None, None, g.t(4), g.pos(4), True, 0.1, 1e-5, False),
                  {}, {"no_grad": {1, 2}}),
       lambda g: ((g.t(4, 4, 8), g.t(4), g.t(4), None, None, True, 0.1, 1e-5, False), {}),
       lambda g: ((g.t(4, 4, 4, 4), g.t(4), g.t(4), g.t(4), g.pos(4), False, 0.1, 1e-5, False),
                  {}, {"no_grad": {3, 4}}))
simple([aten.group_norm.default], lambda g: ((g.t(4, 4, 4, 4), 2, g.t(4), g.t(4), 1e-5, False), {}),
       lambda g: ((g.t(4, 6, 8), 3), {}))

# ---- pooling (ops/pool.py) -------------------------------------------------------------------
simple([aten.max_pool2d.default], lambda g: ((g.t(2, 4, 8, 8), [2, 2]), {}),
       lambda g: ((g.t(2, 4, 8, 8), [3, 3], [2, 2], [1, 1]), {}),
       lambda g: ((g.t(4, 8, 8), [2, 2]), {}))
simple([aten.max_pool1d.default], lambda g: ((g.t(2, 4, 16), [2]), {}))
simple([aten.max_pool3d.default], lambda g: ((g.t(2, 2, 4, 4, 4), [2, 2, 2]), {}))
simple([aten.max_pool2d_with_indices.default], lambda g: ((g.t(2, 4, 8, 8), [2, 2]), {}))
simple([aten.max_pool3d_with_indices.default], lambda g: ((g.t(2, 2, 4, 4, 4), [2, 2, 2]), {}))
simple([aten.avg_pool1d.default], lambda g: ((g.t(2, 4, 16), [2]), {}))
simple([aten.avg_pool2d.default], lambda g: ((g.t(2, 4, 8, 8), [2, 2]), {}),
       lambda g: ((g.t(2, 4, 8, 8), [3, 3], [2, 2], [1, 1], False, False), {}))
simple([aten.avg_pool3d.default], lambda g: ((g.t(2, 2, 4, 4, 4), [2, 2, 2]), {}))
simple([aten.adaptive_avg_pool2d.default, aten._adaptive_avg_pool2d.default],
       lambda g: ((g.t(2, 4, 8, 8), [1, 1]), {}), lambda g: ((g.t(2, 4, 8, 8), [3, 3]), {}))
simple([aten.adaptive_avg_pool1d.default], lambda g: ((g.t(2, 4, 16), [4]), {}))
simple([aten.adaptive_avg_pool3d.default], lambda g: ((g.t(2, 2, 4, 4, 4), [1, 1, 1]), {}))
simple([aten.adaptive_max_pool1d.default], lambda g: ((g.t(2, 4, 16), [4]), {}))
simple([aten.adaptive_max_pool2d.default], lambda g: ((g.t(2, 4, 8, 8), [2, 2]), {}))
simple([aten.adaptive_max_pool3d.default], lambda g: ((g.t(2, 2, 4, 4, 4), [2, 2, 2]), {}))
# upsampling: the .vec overloads are what torch.export keeps for F.interpolate
simple([aten.upsample_nearest2d.vec], lambda g: ((g.t(2, 4, 4, 4), None, [2.0, 2.0]), {}))
simple([aten.upsample_nearest2d.default], lambda g: ((g.t(2, 4, 4, 4), [8, 8]), {}))
simple([aten.upsample_bilinear2d.vec], lambda g: ((g.t(2, 4, 4, 4), [8, 8], False, None), {}))
simple([aten.upsample_bilinear2d.default], lambda g: ((g.t(2, 4, 4, 4), [6, 6], True), {}))
simple([aten.upsample_bicubic2d.vec], lambda g: ((g.t(2, 4, 4, 4), [8, 8], False, None), {}))
simple([aten.upsample_bicubic2d.default], lambda g: ((g.t(2, 4, 4, 4), [8, 8], False), {}))
simple([aten.upsample_nearest1d.vec], lambda g: ((g.t(2, 4, 8), None, [2.0]), {}))
simple([aten.upsample_nearest1d.default], lambda g: ((g.t(2, 4, 8), [16]), {}))
simple([aten.upsample_linear1d.vec], lambda g: ((g.t(2, 4, 8), [16], False, None), {}))
simple([aten.upsample_linear1d.default], lambda g: ((g.t(2, 4, 8), [16], True), {}))
simple([aten.upsample_nearest3d.vec], lambda g: ((g.t(2, 2, 2, 4, 4), None, [2.0, 2.0, 2.0]), {}))
simple([aten.upsample_nearest3d.default], lambda g: ((g.t(2, 2, 2, 4, 4), [4, 8, 8]), {}))
simple([aten.upsample_trilinear3d.vec], lambda g: ((g.t(2, 2, 2, 4, 4), [4, 8, 8], False, None), {}))
simple([aten.upsample_trilinear3d.default], lambda g: ((g.t(2, 2, 2, 4, 4), [4, 8, 8], False), {}))

# ---- mixture-of-experts routing -------------------------------------------------------------
simple([aten.sort.default], lambda g: ((g.t(4, 8),), {}), lambda g: ((g.t(4, 8), 0, True), {}))
simple([aten.sort.stable], lambda g: ((g.t(4, 8),), {"stable": True, "dim": 0}))
simple([aten.topk.default], lambda g: ((g.t(4, 8), 3), {}), lambda g: ((g.t(8, 4), 2, 0, False), {}))
simple([aten.histc.default], lambda g: ((g.t(4, 8), 4, -2.0, 2.0), {}), lambda g: ((g.t(16),), {}),
       lambda g: ((g.i(4, 16).double(), 4, 0, 3), {}))

# Hugging Face's experts as one op (ops/moe.py): 4 experts, 8 tokens with 2 choices each; gated
# (gate_up twice down's inner width) or ungated (Switch Transformers), with a dropout mask or not,
# biased or not.
simple([ROUTED_EXPERTS],
       lambda g: ((g.t(8, 4), g.i(4, 8, 2), g.t(8, 2), g.t(4, 6, 4), g.t(4, 4, 3), 0, "silu"), {}),
       lambda g: ((g.t(8, 4), g.i(4, 8, 1), g.t(8, 1), g.t(4, 3, 4), g.t(4, 4, 3), 0, "relu",
                   g.t(8, 1, 3)), {}),
       lambda g: ((g.t(8, 4), g.i(4, 8, 2), g.t(8, 2), g.t(4, 6, 4), g.t(4, 4, 3), 0, "silu",
                   g.t(8, 2, 3)), {}),
       # GPT-OSS: interleaved gate and up, clamped, biased
       lambda g: ((g.t(8, 4), g.i(4, 8, 2), g.t(8, 2), g.t(4, 6, 4), g.t(4, 4, 3), 0,
                   "gpt_oss:1.702:0.5", None, g.t(4, 6), g.t(4, 4)), {}))

# JetMoE's attention experts (ops/moe.py routed_linear): 4 experts [E, O, H], 8 tokens with 2
# choices each, dispatched ([T, H] -> [T, k, O]) and combined with their weights.
simple([ROUTED_LINEAR],
       lambda g: ((g.t(8, 4), g.i(4, 8, 2), g.t(4, 6, 4), 0), {}),
       lambda g: ((g.t(8, 2, 6), g.i(4, 8, 2), g.t(4, 4, 6), 0, g.t(8, 2)), {}))

# ---- state-space layers (Mamba-2, Jamba) and complex rotary (Llama 4) ----------------------
simple([aten.softplus.default], lambda g: ((g.t(2, 4, 8),), {}),
       lambda g: ((g.t(4, 8), 2.0, 1.0), {}))
simple([aten.repeat_interleave.self_int], lambda g: ((g.t(2, 4, 8), 2, 1), {}),
       lambda g: ((g.t(2, 4, 8), 3), {"dim": -1, "output_size": 24}),
       lambda g: ((g.t(8), 2), {}), lambda g: ((g.t(2, 4), 2), {}))
# Mamba-1's scan (ops/ssm.py): batch 2, 4 channels, 8 steps, a state of 3.
simple([SELECTIVE_SCAN],
       lambda g: ((g.t(2, 4, 8), g.t(2, 4, 8), -g.pos(4, 3), g.t(2, 3, 8), g.t(2, 3, 8), g.t(4),
                   g.t(2, 4, 8), g.t(4), True), {}))
# RecurrentGemma's RG-LRU recurrence (ops/ssm.py): batch 2, 8 steps, width 4; a in (0, 1)
simple([LINEAR_SCAN], lambda g: ((g.t(2, 8, 4), g.pos(2, 8, 4) / 2), {}))
simple([aten.polar.default], lambda g: ((g.pos(4, 8), g.t(4, 8)), {}),
       lambda g: ((g.pos(8), g.t(2, 4, 8)), {}))
simple([aten.log1p.default], lambda g: ((g.pos(2, 4, 8),), {}))


def _perm(g: Gen, n: int, k: int) -> torch.Tensor:
    return torch.randperm(n, generator=g.g)[:k]  # distinct: a repeated index writes in any order


simple([aten.index_put.default], lambda g: ((g.t(8, 4), [_perm(g, 8, 3)], g.t(3, 4)), {}),
       lambda g: ((g.t(8, 4), [g.i(8, 5)], g.t(5, 4), True), {}),
       lambda g: ((g.t(4, 8), [None, _perm(g, 8, 3)], g.t(4, 3)), {}))
# The CPU kernel takes float32/bfloat16 with 16-byte row strides: K and N stay multiples of
# 16 bytes after a 4-way split in bfloat16 too (tests/test_dtypes.py).
_OFFS = torch.tensor([2, 2, 5, 8], dtype=torch.int32)  # cumulative rows per expert; one empty
simple([aten._grouped_mm.default], lambda g: ((g.t(8, 32).float(), g.t(4, 32, 32).float(), _OFFS), {}),
       lambda g: ((g.t(4, 8, 32).float(), g.t(4, 32, 32).float()), {}))
# transformers' float32 grouped matmul gets _grouped_mm's record once transformers defines it
# (autoshard.ops.moe.register_library_ops, which the tracer calls).
if importlib.util.find_spec("transformers") is not None:
    import transformers.integrations.moe  # noqa: F401  (defines transformers::grouped_mm_fallback)
    register_library_ops()
    simple([torch.ops.transformers.grouped_mm_fallback.default],
           lambda g: ((g.t(8, 32).float(), g.t(4, 32, 32).float(), _OFFS), {}))

# ---- in-place ops: their functional twin's samples --------------------------------------------
for _op, _twin in (*INPLACE_TWINS.items(), *INPLACE_VIEWS.items()):
    simple([_op], *SAMPLES[_twin])
simple([aten.copy_.default], _copy_src, lambda g: ((g.t(4, 8), g.t(4, 8).float()), {}))


# ---- the checks -----------------------------------------------------------------------------

def _key(op: Any) -> str:
    return str(op)


# (rtol, atol) of a sample by its floating tensors' dtype (see the module docstring).
TOLERANCE = {F64: (1e-5, 1e-8), torch.float32: (1e-5, 1e-5)}


def sample_tolerance(args: tuple, kwargs: dict) -> tuple[float, float]:
    f32 = any(isinstance(t, torch.Tensor) and t.dtype == torch.float32
              for t in tree_flatten((args, kwargs))[0])
    return TOLERANCE[torch.float32 if f32 else F64]


def make_sample(op: Any, si: int) -> tuple[tuple, dict, tuple]:
    """``(args, kwargs, no_grad)`` of the op's sample ``si``."""
    args, kwargs, *extra = SAMPLES[op][si](Gen(si))
    return args, kwargs, tuple(extra[0].get("no_grad", ()) if extra else ())


def check_sample(op: Any, si: int, args: tuple, kwargs: dict, no_grad: tuple, *,
                 meshes: list, cap: dict, tol: tuple[float, float],
                 backward: bool = True) -> tuple[int, list[str]]:
    """Every strategy of one sample on ``meshes`` (at most ``cap[mesh rank]`` of them run):
    ``(strategies run, failures)``."""
    checked, failures = 0, []
    info = op_info(op, args, kwargs, call_on_copies(op, args, kwargs))
    for mesh in meshes:
        strategies = strategies_for(info, mesh)
        failures += _static_checks(op, si, mesh, info, strategies)
        for s in _pick(strategies, f"{op}/{si}/{mesh}", cap[len(mesh)]):
            checked += 1
            try:
                bad = check_strategy(op, args, kwargs, s, mesh, rtol=tol[0], atol=tol[1],
                                     backward=backward, compare_values=op not in NO_VALUES,
                                     no_grad=no_grad)
            except Exception as e:  # a crash is a failure of that strategy, not of the test
                bad = [f"raised {type(e).__name__}: {e}"]
            if bad:
                failures.append(f"{op} sample {si} mesh {mesh}: {s}: "
                                + "; ".join(str(b) for b in bad))
    return checked, failures


def _check_op(op: Any) -> tuple[int, list[str]]:
    checked, failures = 0, []
    meshes = MESHES + ([(2, 2, 2)] if op in DEEP else [])
    for si in range(len(SAMPLES[op])):
        args, kwargs, no_grad = make_sample(op, si)
        c, f = check_sample(op, si, args, kwargs, no_grad, meshes=meshes, cap=CAP,
                            tol=sample_tolerance(args, kwargs))
        checked, failures = checked + c, failures + f
    return checked, failures


def _writes_first_input(op: Any) -> bool:
    alias = op._schema.arguments[0].alias_info if op._schema.arguments else None
    return alias is not None and alias.is_write


def _static_checks(op, si, mesh, info, strategies) -> list[str]:
    where = f"{op} sample {si} mesh {mesh}"
    errs = []
    if len(set(strategies)) != len(strategies):
        errs.append(f"{where}: duplicate strategies")
    for s in strategies:
        if len(s.inputs) != len(info.inputs) or len(s.outputs) != len(info.outputs):
            errs.append(f"{where}: {s}: wrong number of specs")
            continue
        for t, spec in list(zip(info.inputs, s.inputs)) + list(zip(info.outputs, s.outputs)):
            if len(spec) != len(mesh) or not spec_fits(t.shape, spec, mesh):
                errs.append(f"{where}: {s}: spec {spec} does not fit {t.shape}")
        # (an in-place view changes the tensor's dims, not its values: its output lies as
        # the functional view's does)
        if _writes_first_input(op) and op not in INPLACE_VIEWS and s.outputs[0] != s.inputs[0]:
            errs.append(f"{where}: {s}: an in-place op's output must lie as its first input")
    return errs


def _pick(strategies: list, seed: str, cap: int) -> list:
    if len(strategies) <= cap:
        return strategies
    one_axis = [s for s in strategies if _sharded_axes(s) <= 1]
    rest = [s for s in strategies if _sharded_axes(s) > 1]
    k = max(cap - len(one_axis), 0)
    return one_axis + random.Random(seed).sample(rest, min(k, len(rest)))


def _sharded_axes(s) -> int:
    specs = list(s.inputs) + list(s.outputs)
    n = len(specs[0]) if specs else 0
    return sum(any(not isinstance(sp[a], Replicate) for sp in specs) for a in range(n))


@pytest.mark.parametrize("op", sorted(RECORDS, key=_key), ids=_key)
def test_rule_matches_single_device(op: Any) -> None:
    if op not in SAMPLES:
        pytest.fail(f"{op} has a record but no sample in tests/test_rules.py")
    checked, failures = _check_op(op)
    assert not failures, f"{len(failures)} failing strategies of {op}:\n" + "\n".join(failures[:20])
    assert checked > 0


def test_every_registered_op_has_a_sample() -> None:
    missing = sorted(str(op) for op in RECORDS if op not in SAMPLES)
    assert not missing, f"records without a validation sample: {missing}"


@pytest.mark.parametrize("op", sorted(RECORDS, key=_key), ids=_key)
def test_every_record_is_complete(op: Any) -> None:
    """Every part of an op's record is there and answers on the op's samples: its family and how
    it joins the ILP are known values, what it saves names existing inputs and outputs, its FLOPs
    are a finite, non-negative number."""
    record = RECORDS[op]
    assert isinstance(record, OpRecord) and record_of(op) is record
    assert record.family in FAMILIES and record.follows in FOLLOWS
    assert callable(record.strategies) and callable(record.flops) and callable(record.localize)
    for si, make in enumerate(SAMPLES.get(op, ())):
        args, kwargs, *_ = make(Gen(si))
        info = op_info(op, args, kwargs, op(*args, **kwargs))
        saves = record.saved(info)
        assert isinstance(saves, Saves), f"{op} sample {si}: saves gave {saves!r}"
        assert all(0 <= i < len(info.inputs) for i in saves.inputs), (op, si, saves)
        assert all(0 <= j < len(info.outputs) for j in saves.outputs), (op, si, saves)
        for side, idx, per, nbytes in saves.extra:
            assert side in ("in", "out") and per in ("elem", "row") and nbytes >= 0, saves
        flops = record.flops(info)
        assert math.isfinite(flops) and flops >= 0, f"{op} sample {si}: flops {flops!r}"


def test_registering_an_op_needs_every_part() -> None:
    from autoshard.ops.registry import register_op
    with pytest.raises(TypeError, match="flops"):
        register_op(aten.erfinv.default, strategies=lambda op, mesh: [], family="elementwise",
                    saves=Saves(), follows="no")       # no flops
    assert aten.erfinv.default not in RECORDS


def test_unruled_op_falls_back_to_replicate_with_one_warning(monkeypatch) -> None:
    op = aten.erfinv.default
    assert op not in RECORDS
    monkeypatch.setattr(registry, "_warned", set())
    x = torch.randn(4, 8)
    info = op_info(op, (x,), {}, op(x), source="model.py:12: y = x.erfinv()")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            (s,) = strategies_for(info, (2, 2))
            assert all(p == Replicate() for spec in s.inputs + s.outputs for p in spec)
    msgs = [str(w.message) for w in rec]
    assert len(msgs) == 1, msgs
    assert "aten.erfinv.default" in msgs[0] and "model.py:12" in msgs[0]


# ---- coverage: every op of the zoo's model families has a rule --------------------------------

import operator  # noqa: E402

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from autoshard.ir import OpInfo, TensorInfo  # noqa: E402


class _GPT(nn.Module):
    """GPT-2 style: learned positions, fused qkv split, causal sdpa, tanh-gelu MLP, tied head."""

    def __init__(self, v: int = 64, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.wte, self.wpe = nn.Embedding(v, d), nn.Embedding(16, d)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.wte(ids) + self.wpe(torch.arange(s, device=ids.device))
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(b, s, self.h, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(y.transpose(1, 2).contiguous().view(b, s, -1)), 0.1)
        x = x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))
        logits = F.linear(self.lnf(x), self.wte.weight)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))


class _Llama(nn.Module):
    """Llama style: RMSNorm by hand, rotary by slicing/cat/neg, GQA repeat, SwiGLU."""

    def __init__(self, v: int = 64, d: int = 32, h: int = 4, kv: int = 2) -> None:
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.emb = nn.Embedding(v, d)
        self.n1, self.n2 = nn.Parameter(torch.ones(d)), nn.Parameter(torch.ones(d))
        self.q, self.k = nn.Linear(d, d, bias=False), nn.Linear(d, kv * self.hd, bias=False)
        self.v, self.o = nn.Linear(d, kv * self.hd, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False)
        self.down, self.head = nn.Linear(2 * d, d, bias=False), nn.Linear(d, v, bias=False)

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rot * sin

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        inv = 1.0 / (10000.0 ** (torch.arange(0, self.hd, 2, device=ids.device).float() / self.hd))
        f = torch.arange(s, device=ids.device).float()[:, None] * inv[None, :]
        emb = torch.cat((f, f), -1)
        cos, sin = emb.cos(), emb.sin()
        x = self.emb(ids)
        hN = self._rms(x, self.n1)
        q = self._rope(self.q(hN).view(b, s, self.h, self.hd).transpose(1, 2), cos, sin)
        k = self._rope(self.k(hN).view(b, s, self.kv, self.hd).transpose(1, 2), cos, sin)
        v = self.v(hN).view(b, s, self.kv, self.hd).transpose(1, 2)
        rep = self.h // self.kv
        k = k[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.h, s, self.hd)
        v = v[:, :, None].expand(b, self.kv, rep, s, self.hd).reshape(b, self.h, s, self.hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, -1))
        hN = self._rms(x, self.n2)
        x = x + self.down(F.silu(self.gate(hN)) * self.up(hN))
        logits = self.head(self._rms(x, self.n2))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


class _Bert(nn.Module):
    """BERT style: token types, padding mask as an additive float mask, post-norm, MLM head."""

    def __init__(self, v: int = 64, d: int = 32, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.tok, self.pos, self.typ = nn.Embedding(v, d, padding_idx=0), nn.Embedding(16, d), nn.Embedding(2, d)
        self.ln0, self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2, self.head = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, v)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.tok(ids) + self.pos(torch.arange(s, device=ids.device)) + self.typ(torch.zeros_like(ids))
        x = self.ln0(x)
        mask = (1.0 - (ids != 0)[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        q, k, v = (t.reshape(b, s, self.h, -1).permute(0, 2, 1, 3) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.out(y.permute(0, 2, 1, 3).flatten(2)))
        x = self.ln2(x + self.fc2(F.gelu(self.fc1(x))))
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def _graph_ops(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """call_function nodes of the graph and of its subgraphs (higher-order ops' bodies)."""
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"]


def _is_op(node: torch.fx.Node) -> bool:
    return node.target is not operator.getitem and isinstance(node.target, torch._ops.OpOverload)


def _node_info(node: torch.fx.Node) -> OpInfo:
    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            v = a.meta["val"]
            return TensorInfo(tuple(int(s) for s in v.shape), v.dtype)
        return a

    outs = [v for v in torch.utils._pytree.tree_flatten(node.meta.get("val"))[0]
            if isinstance(v, torch.Tensor)]
    return OpInfo(node.target, tuple(torch.fx.node.map_aggregate(node.args, conv)),
                  dict(torch.fx.node.map_aggregate(node.kwargs, conv)),
                  tuple(TensorInfo(tuple(int(s) for s in o.shape), o.dtype) for o in outs))


def _export(model: nn.Module, batch: int = 2, seq: int = 16, vocab: int = 64) -> torch.fx.GraphModule:
    ids = torch.randint(1, vocab, (batch, seq), device="meta")
    labels = torch.randint(0, vocab, (batch, seq), device="meta")
    return torch.export.export(model, (ids, labels), strict=False).graph_module


def _assert_covered(gm: torch.fx.GraphModule, name: str) -> None:
    nodes = [n for n in _graph_ops(gm) if _is_op(n)]
    missing = sorted({str(n.target) for n in nodes if n.target not in RECORDS})
    assert not missing, f"{name}: ops without a sharding rule: {missing}"
    for n in nodes:  # every rule accepts the real node, on 1-D and 2-D meshes
        info = _node_info(n)
        for mesh in ((4,), (2, 2)):
            strategies = strategies_for(info, mesh)
            assert strategies and len(set(strategies)) == len(strategies), (name, n.format_node())


@pytest.mark.parametrize("cls", [_GPT, _Llama, _Bert], ids=lambda c: c.__name__.strip("_"))
def test_stand_in_models_are_covered(cls) -> None:
    with torch.device("meta"):
        model = cls()
    _assert_covered(_export(model), cls.__name__)


class _HFLoss(nn.Module):
    """A Hugging Face model whose loss is the graph's output."""

    def __init__(self, m: nn.Module, key: str = "input_ids") -> None:
        super().__init__()
        self.m, self.key = m, key

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.m(**{self.key: x}, labels=labels).loss


_SMALL = dict(vocab_size=64, max_position_embeddings=32, use_cache=False)
_LAYER = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=4)
# One-layer models, each a family of graphs: what its export holds beyond the others is noted.
HF_MODELS = {
    "GPT2LMHeadModel": lambda tr: tr.GPT2LMHeadModel(tr.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False)),
    "LlamaForCausalLM": lambda tr: tr.LlamaForCausalLM(tr.LlamaConfig(
        num_key_value_heads=2, **_LAYER, **_SMALL)),
    "BertForMaskedLM": lambda tr: tr.BertForMaskedLM(tr.BertConfig(
        **_LAYER, vocab_size=64, max_position_embeddings=32)),
    # x @ weight.T (numpy_T), add_
    "FalconForCausalLM": lambda tr: tr.FalconForCausalLM(tr.FalconConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
        use_cache=False)),
    # type_as
    "GemmaForCausalLM": lambda tr: tr.GemmaForCausalLM(tr.GemmaConfig(
        num_key_value_heads=2, head_dim=8, **_LAYER, **_SMALL)),
    # masked_fill_, copy_ and fill_ through views, min.other
    "T5ForConditionalGeneration": lambda tr: tr.T5ForConditionalGeneration(tr.T5Config(
        num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4, d_kv=8,
        vocab_size=64, use_cache=False, decoder_start_token_id=0, pad_token_id=0)),
    # topk, div_, sort, floor_divide, histc, _grouped_mm, index_put_. In bfloat16, as it trains:
    # in float32 transformers routes the experts through its own transformers::grouped_mm_fallback.
    "MixtralForCausalLM": lambda tr: tr.MixtralForCausalLM(tr.MixtralConfig(
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **_LAYER,
        **_SMALL)).to(torch.bfloat16),
    # polar (complex rotary), view_as_complex/view_as_real, floor and log1p (the attention
    # temperature of layers without rotary), the routed experts as one [E, K, N] tensor.
    "Llama4ForCausalLM": lambda tr: tr.Llama4ForCausalLM(tr.Llama4TextConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=1, no_rope_layers=[1, 0], attention_chunk_size=8, pad_token_id=0,
        **_SMALL)).to(torch.bfloat16),
    # softplus, repeat_interleave and the chunked scan (cumsum, tril, exp, products summed)
    "Mamba2ForCausalLM": lambda tr: tr.Mamba2ForCausalLM(tr.Mamba2Config(
        num_hidden_layers=1, hidden_size=32, num_heads=8, head_dim=8, n_groups=2, state_size=8,
        chunk_size=8, vocab_size=64, use_cache=False)),
    # multi-head latent attention, group-limited routing, a shared expert
    "DeepseekV3ForCausalLM": lambda tr: tr.DeepseekV3ForCausalLM(tr.DeepseekV3Config(
        num_hidden_layers=2, first_k_dense_replace=1, hidden_size=32, intermediate_size=64,
        moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2,
        **_SMALL)).to(torch.bfloat16),
    # learned positions, an encoder and a decoder with cross-attention, the label shift
    "BartForConditionalGeneration": lambda tr: tr.BartForConditionalGeneration(tr.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=32, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2)),
    # where.Scalar and remainder (transient-global attention's blocks), traced with the
    # attention mask autoshard's seq2seq inputs pass (LongT5's encoder needs one)
    "LongT5ForConditionalGeneration": lambda tr: tr.LongT5ForConditionalGeneration(
        tr.LongT5Config(num_layers=1, num_decoder_layers=1, d_model=32, d_ff=64, num_heads=4,
                        d_kv=8, vocab_size=64, use_cache=False, decoder_start_token_id=0,
                        pad_token_id=0, encoder_attention_type="transient-global",
                        local_radius=4, global_block_size=4)),
    # conv2d (patch embedding)
    "ViTForImageClassification": lambda tr: tr.ViTForImageClassification(tr.ViTConfig(
        **_LAYER, image_size=16, patch_size=4, num_labels=10)),
    # hardtanh (ReLU6), depthwise convolutions
    "MobileNetV2ForImageClassification": lambda tr: tr.MobileNetV2ForImageClassification(
        tr.MobileNetV2Config(depth_multiplier=0.25, num_labels=10, image_size=32)),
    # batch_norm, max_pool2d, adaptive_avg_pool2d
    "ResNetForImageClassification": lambda tr: tr.ResNetForImageClassification(tr.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
        num_labels=10)),
}


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hugging_face_models_are_covered(name: str) -> None:
    tr = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = HF_MODELS[name](tr)
    if name.endswith("ForImageClassification"):
        images = torch.randn(2, 3, 16, 16, device="meta")
        labels = torch.zeros(2, dtype=torch.long, device="meta")
        ep = torch.export.export(_HFLoss(model, "pixel_values"), (images, labels), strict=False)
        gm = ep.graph_module
    elif name.endswith("ForConditionalGeneration"):
        from autoshard.zoo.hf import HFLossModel
        gm = _export(HFLossModel(model, task="seq2seq"))
    else:
        gm = _export(_HFLoss(model))
    _assert_covered(gm, name)


# ---- the strategies the planner relies on exist, and the ones that are wrong do not -----------

def _strs(op: Any, args: tuple, mesh: tuple = (4,), **kwargs: Any) -> set[str]:
    info = op_info(op, args, kwargs, op(*args, **kwargs))
    return {str(s) for s in strategies_for(info, mesh)}


def test_key_strategies() -> None:
    x, w, b = torch.randn(4, 8, 16), torch.randn(32, 16), torch.randn(32)
    lin = _strs(aten.linear.default, (x, w, b))
    assert "[R] x [S(0)] x [S(0)] -> [S(2)]" in lin            # column parallel
    assert "[S(2)] x [S(1)] x [P] -> [P]" in lin               # row parallel
    assert "[S(0)] x [R] x [R] -> [S(0)]" in lin               # data parallel
    emb = _strs(aten.embedding.default, (torch.randn(64, 16), torch.randint(0, 64, (2, 8))))
    assert "[S(0)] x [R] -> [P] (vocab_parallel)" in emb
    view = _strs(aten.view.default, (torch.randn(8, 16, 32), [128, 32]))
    assert "[S(0)] -> [S(0)]" in view and "[S(1)] -> [S(0)]" not in view
    q, kv = torch.randn(2, 8, 4, 2), torch.randn(2, 4, 4, 2)
    gqa = _strs(aten.scaled_dot_product_attention.default, (q, kv, kv), (4,), enable_gqa=True)
    assert "[S(1)] x [S(1)] x [S(1)] -> [S(1)]" in gqa
    gqa8 = _strs(aten.scaled_dot_product_attention.default, (q, kv, kv), (8,), enable_gqa=True)
    assert "[S(1)] x [S(1)] x [S(1)] -> [S(1)]" not in gqa8   # 4 kv heads do not split 8 ways
    ce = _strs(aten.cross_entropy_loss.default, (torch.randn(8, 16), torch.randint(0, 16, (8,))))
    assert ce == {"[R] x [R] -> [R]", "[S(0)] x [R] -> [P] (loss_rows)",
                  "[S(1)] x [R] -> [P] (vocab_parallel)"}
    weighted = _strs(aten.cross_entropy_loss.default,
                     (torch.randn(8, 16), torch.randint(0, 16, (8,)), torch.rand(16)))
    assert not any("vocab_parallel" in s for s in weighted)  # a class weight keeps classes whole
    sm = _strs(aten.softmax.int, (torch.randn(4, 8, 8), -1))
    assert "[S(2)] -> [S(2)]" not in sm and "[S(1)] -> [S(1)]" in sm


def op_flops(op) -> float:
    return record_of(op.target).flops(op)


def test_flops() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 16)
    assert op_flops(op_info(aten.mm.default, (a, b), {}, a @ b)) == 2 * 4 * 8 * 16
    x, w, bias = torch.randn(2, 4, 8), torch.randn(16, 8), torch.randn(16)
    y = F.linear(x, w, bias)
    assert op_flops(op_info(aten.linear.default, (x, w, bias), {}, y)) == 2 * 2 * 4 * 8 * 16
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 32, 16)
    o = F.scaled_dot_product_attention(q, k, k)
    assert op_flops(op_info(aten.scaled_dot_product_attention.default, (q, k, k), {}, o)) == \
        4 * 2 * 4 * 8 * 32 * 16
