"""Every op rule re-validated in the dtypes models run in: bfloat16 and complex64.

tests/test_rules.py checks each strategy in float64, where a wrong rule stands out from rounding
by ten orders of magnitude. A rule can still hold in float64 and fail in another dtype: Partial
through an op that is linear over the reals but not over the complex numbers, a local kernel
that rounds or casts differently from the whole op. Here every sample that takes floating
inputs runs again through the same machinery (``check_sample``: every strategy, capped per mesh
as there) with its floating tensors, and its float64 dtype arguments, cast to

- bfloat16, wherever the op has a bfloat16 CPU kernel;
- complex64 (random non-zero imaginary parts), wherever the op takes complex inputs: the whole
  op is tried on one device first, forward and backward, then forward only (some ops have no
  complex derivative); an op that does not run whole in a dtype has no case in it (see CASES).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

from autoshard.ir import Partial, Shard, Strategy, op_info
from autoshard.ops.registry import RECORDS, replicate_strategy
from autoshard.ops.simulate import call_on_copies, check_strategy
from test_rules import CAP, F64, MESHES, SAMPLES, _key, check_sample, make_sample

aten = torch.ops.aten
BF16, C64 = torch.bfloat16, torch.complex64
# (rtol, atol). A wrong rule is off by O(1): a Partial through a non-linear op adds the random
# summands' noise (standard deviation ~1), a wrong shard reads another slice.
# - bfloat16 keeps 8 significant bits (eps 2^-7). The ranks round their partial results, the
#   random Partial summands and the reassembling sum where the whole op rounds once, so a value
#   v differs by a few ulps of v (rtol 2^-6 = 2 eps), and a sum that cancels to near zero by a
#   few ulps of its largest terms: the samples' contractions (up to 36 terms) reach magnitudes
#   of ~8, whose ulp is 2^-4 (atol). test_wrong_rules_still_fail checks this keeps the teeth.
# - complex64 is two float32s (eps 2^-23): the same sums err by up to ~1e-5 on values of ~10.
#   Larger contractions (a convolution's input gradient sums 72 terms to ~26, ulp 2^-3) and
#   CPUs whose bf16 kernels accumulate differently are covered by :func:`own_error`: a sharded
#   run may differ from the whole op by a few times the whole op's own rounding.
TOLERANCE = {BF16: (2.0 ** -6, 2.0 ** -4), C64: (1e-4, 1e-5)}


def own_error(op: Any, args: tuple, kwargs: dict, backward: bool) -> float:
    """How far the whole op in bfloat16 lands from the same op in float64, over its outputs and
    (with ``backward``) its inputs' gradients under a fixed random cotangent: the rounding this
    host's kernels do on this sample."""
    def run(dtype: torch.dtype) -> list[torch.Tensor]:
        a, k = tree_map(lambda x: x.detach().to(dtype).requires_grad_(backward)
                        if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                        (args, kwargs))
        outs = [o for o in tree_flatten(op(*a, **k))[0]
                if isinstance(o, torch.Tensor) and o.is_floating_point()]
        res = [o.detach().double() for o in outs]
        leaves = [x for x in tree_flatten((a, k))[0]
                  if isinstance(x, torch.Tensor) and x.requires_grad]
        if backward and leaves and any(o.requires_grad for o in outs):
            g = torch.Generator().manual_seed(0)
            cot = [torch.randn(o.shape, generator=g).to(dtype) for o in outs]
            grads = torch.autograd.grad([o for o in outs], leaves, cot, allow_unused=True)
            res += [x.double() for x in grads if x is not None]
        return res
    try:
        low, high = run(BF16), run(F64)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return 0.0
    return max(((x - y).abs().max().item() for x, y in zip(low, high) if x.numel()), default=0.0)


def _cast(x: Any, dtype: torch.dtype, g: torch.Generator) -> Any:
    """A floating tensor in ``dtype``; float64, the samples' working precision, as a dtype
    argument (``full(..., dtype=float64)``) becomes ``dtype`` too."""
    if isinstance(x, torch.dtype):
        return dtype if x == F64 else x
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return x
    if dtype.is_complex:
        return torch.complex(x.float(), torch.randn(x.shape, generator=g))
    return x.to(dtype)


def _takes_floats(args: tuple, kwargs: dict) -> bool:
    return any(x.is_floating_point() if isinstance(x, torch.Tensor) else x == F64
               for x in tree_flatten((args, kwargs))[0]
               if isinstance(x, (torch.Tensor, torch.dtype)))


def cast_sample(op: Any, si: int, dtype: torch.dtype) -> tuple[tuple, dict, tuple] | None:
    """Sample ``si`` of ``op`` in ``dtype``, or None if it takes nothing floating."""
    args, kwargs, no_grad = make_sample(op, si)
    if not _takes_floats(args, kwargs):
        return None
    g = torch.Generator().manual_seed(si)
    args, kwargs = tree_map(lambda x: _cast(x, dtype, g), (args, kwargs))
    return args, kwargs, no_grad


def runs_whole(op: Any, args: tuple, kwargs: dict, no_grad: tuple) -> bool | None:
    """Whether the whole op runs on these inputs on one device with its backward (True), forward
    only (False), or not at all (None: no kernel for the dtype)."""
    for backward in (True, False):
        try:
            info = op_info(op, args, kwargs, call_on_copies(op, args, kwargs))
            check_strategy(op, args, kwargs, replicate_strategy(info, (1,)), (1,),
                           backward=backward, no_grad=no_grad)
            return backward
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            continue
    return None


def runnable(op: Any, dtype: torch.dtype) -> list[tuple[int, tuple, bool]]:
    """(sample, the sample in ``dtype``, with backward?) for every sample the whole op runs on in
    ``dtype``: the cases there is a single-device result to validate the rule against."""
    out = []
    for si in range(len(SAMPLES.get(op, ()))):
        sample = cast_sample(op, si, dtype)
        backward = sample and runs_whole(op, *sample)
        if backward is not None:
            out.append((si, sample, backward))
    return out


# Decided at collection: an op that does not run whole in a dtype (max, sort, softmax and the
# losses are not defined on complex numbers; rfft takes real input; view_as_complex takes float
# pairs; no CPU kernel) has nothing to validate its rules against, so it has no case, not a skip.
CASES = {(op, dtype): cases for dtype in (BF16, C64)
         for op in sorted(RECORDS, key=_key) if (cases := runnable(op, dtype))}


@pytest.mark.parametrize("op,dtype", list(CASES), ids=lambda v: _key(v) if not isinstance(
    v, torch.dtype) else str(v))
def test_rule_holds_in_dtype(op: Any, dtype: torch.dtype) -> None:
    checked, failures = 0, []
    for si, sample, backward in CASES[(op, dtype)]:
        rtol, atol = TOLERANCE[dtype]
        if dtype == BF16:
            atol = max(atol, 4 * own_error(op, sample[0], sample[1], backward))
        c, f = check_sample(op, si, *sample, meshes=MESHES, cap=CAP, tol=(rtol, atol),
                            backward=backward)
        checked, failures = checked + c, failures + f
    assert checked > 0
    assert not failures, f"{len(failures)} failing strategies of {op} in {dtype}:\n" + "\n".join(
        failures[:20])


def test_bfloat16_covers_every_real_op() -> None:
    """Every op with floating samples runs in bfloat16 but the four whose inputs must be
    complex or float pairs in float32 and up (polar: torch has no bf16 complex), and
    avg_pool3d, whose CPU kernel torch has in no bf16: if a kernel went missing, coverage would
    shrink without a word."""
    floating = {op for op in RECORDS if any(cast_sample(op, si, BF16)
                                            for si in range(len(SAMPLES.get(op, ()))))}
    missing = {str(op) for op in floating if (op, BF16) not in CASES}
    assert missing == {"aten.fft_fft.default", "aten.fft_rfft.default", "aten.polar.default",
                       "aten.view_as_complex.default", "aten.avg_pool3d.default"}, missing


WRONG = {  # rules that must not be offered, each a strategy that looks plausible
    "exp of a Partial": (aten.exp.default, ((Partial(),),), ((Partial(),),)),
    "abs of a Partial": (aten.abs.default, ((Partial(),),), ((Partial(),),)),
    "softmax split on its dim": (aten.softmax.int, ((Shard(1),),), ((Shard(1),),)),
}
# softmax is not defined on complex numbers.
WRONG_CASES = [(name, dtype) for name in WRONG for dtype in (BF16, C64)
               if not (WRONG[name][0] == aten.softmax.int and dtype.is_complex)]


@pytest.mark.parametrize("name,dtype", WRONG_CASES, ids=str)
def test_wrong_rules_still_fail(name: str, dtype: torch.dtype) -> None:
    """The tolerances above still catch a wrong rule (they are not so loose that all passes)."""
    op, ins, outs = WRONG[name]
    args = (torch.randn(4, 8, dtype=dtype),) + ((1,) if op == aten.softmax.int else ())
    assert runs_whole(op, args, {}, ()) is not None
    rtol, atol = TOLERANCE[dtype]
    try:
        bad = check_strategy(op, args, {}, Strategy(ins, outs), (2,), rtol=rtol, atol=atol)
    except AssertionError:  # replicated gradients that disagree across ranks: caught too
        return
    assert bad, f"{name} passed validation in {dtype}"
