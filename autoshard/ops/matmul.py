"""Matmul-like ops, every rule generated from an einsum equation (as DTensor's einsum strategies are).

One 1-D option per index letter: a letter kept in the output shards every operand holding it and
the output; a contracted letter shards its operands and makes the output Partial (each rank holds
a partial sum). Additive terms (``addmm``'s bias) follow the output: replicated where they
broadcast, Partial when the product is Partial, so that the sum over ranks adds them once.
Dims of size 1 that broadcast against a larger size are never sharded.

Partial *inputs* (``P x R -> P``, linearity) are not offered, as in DTensor's mm rules: the ILP
reduces a Partial operand before the matmul; this keeps mm at 1 + #letters options per axis.
"""
from __future__ import annotations

import math
import string
from typing import Sequence

import torch

from autoshard.ir import Shard, TensorInfo
from autoshard.ops._common import P, R, Option, arg
from autoshard.ops.registry import (ELEMENTWISE, MATMUL, NO, OpInfo, Saves, all_inputs, amend,
                                    expand, register_op)

aten = torch.ops.aten


def einsum_options(op: OpInfo, subs: Sequence[str], out: str, *,
                   addends: Sequence[int] = ()) -> list[Option]:
    """1-D options for ``op`` computing ``out`` from operands with index strings ``subs``.

    ``subs[i]`` labels the dims of tensor input ``i`` (``op.inputs`` order); inputs listed in
    ``addends`` are summed onto the product (their labels are right-aligned output letters).
    """
    ins = op.inputs
    sizes = letter_sizes(ins, subs)
    opts: list[Option] = []
    for letter in dict.fromkeys("".join(subs) + out):
        if sizes.get(letter, 1) <= 1:
            continue
        contracted = letter not in out
        pl = []
        for i, (t, sub) in enumerate(zip(ins, subs)):
            d = sub.find(letter)
            if d >= 0 and sub.count(letter) > 1:
                break  # a repeated letter (a diagonal) is never sharded
            if d >= 0 and t.shape[d] == sizes[letter]:
                pl.append(Shard(d))
            elif d < 0 and contracted and i in addends:
                pl.append(P)
            else:
                pl.append(R)  # absent, or a size-1 dim that broadcasts
        else:
            o = (P,) if contracted else (Shard(out.index(letter)),)
            opts.append((tuple(pl), o))
    return opts


def letter_sizes(ins: Sequence[TensorInfo], subs: Sequence[str]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for t, sub in zip(ins, subs):
        for letter, n in zip(sub, t.shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    return sizes


def einsum_flops(op: OpInfo, subs: Sequence[str], out: str) -> float:
    """2 x the product of every index size (one multiply and one add per term)."""
    sizes = letter_sizes(op.inputs, subs)
    return 2.0 * math.prod(sizes.get(c, 1) for c in set("".join(subs) + out))


# ---- equations per op --------------------------------------------------------------------------

def _matmul_subs(a: TensorInfo, b: TensorInfo) -> tuple[list[str], str]:
    """torch.matmul's equation, broadcast batch dims included."""
    batch = "abcdefghij"[:max(a.ndim, b.ndim, 2) - 2]
    sa = "k" if a.ndim == 1 else batch[len(batch) - (a.ndim - 2):] + "mk"
    sb = "k" if b.ndim == 1 else batch[len(batch) - (b.ndim - 2):] + "kn"
    out = batch + ("m" if a.ndim > 1 else "") + ("n" if b.ndim > 1 else "")
    return [sa, sb], out


def _addend_sub(t: TensorInfo, out: str) -> str:
    return out[len(out) - t.ndim:] if t.ndim else ""


def _subs(op: OpInfo) -> tuple[list[str], str, tuple[int, ...]]:
    """``(operand subs, output sub, addend positions)`` of one matmul-like op."""
    ins = op.inputs
    t = op.target
    if t == aten.mm.default:
        return ["mk", "kn"], "mn", ()
    if t == aten.bmm.default:
        return ["bmk", "bkn"], "bmn", ()
    if t == aten.addmm.default:
        return [_addend_sub(ins[0], "mn"), "mk", "kn"], "mn", (0,)
    if t == aten.baddbmm.default:
        return [_addend_sub(ins[0], "bmn"), "bmk", "bkn"], "bmn", (0,)
    if t in (aten.matmul.default, aten.dot.default, aten.mv.default):
        subs, out = _matmul_subs(ins[0], ins[1])
        return subs, out, ()
    if t == aten.linear.default:
        x = ins[0]
        batch = string.ascii_lowercase[:x.ndim - 1].replace("k", "y").replace("n", "z")
        out = batch + "n"
        subs = [batch + "k", "nk"]
        if len(ins) == 3:
            return subs + [_addend_sub(ins[2], out)], out, (2,)
        return subs, out, ()
    if t == aten.outer.default:
        return ["i", "j"], "ij", ()
    if t == aten.einsum.default:
        return _einsum_equation(arg(op, 0, "equation"), ins)
    raise AssertionError(f"no equation for {t}")


def _einsum_equation(eq: str, ins: Sequence[TensorInfo]) -> tuple[list[str], str, tuple[int, ...]]:
    eq = eq.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    subs = lhs.split(",")
    if "..." in eq:
        free = [c for c in string.ascii_letters if c not in eq]
        nell = max(t.ndim - (len(s) - 3) for t, s in zip(ins, subs) if "..." in s)
        ell = "".join(free[:nell])
        subs = [s.replace("...", ell[nell - (t.ndim - (len(s) - 3)):]) if "..." in s else s
                for t, s in zip(ins, subs)]
        rhs = rhs.replace("...", ell) if rhs else None
    if not rhs:  # implicit output: letters seen once, sorted
        joined = "".join(subs)
        rhs = "".join(sorted(c for c in set(joined) if joined.count(c) == 1))
    return subs, rhs, ()


MATMUL_OPS = (aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default,
              aten.matmul.default, aten.linear.default, aten.einsum.default, aten.mv.default,
              aten.dot.default, aten.outer.default)


def matmul_strategy(op: OpInfo, mesh_shape: tuple) -> list:
    subs, out, addends = _subs(op)
    opts = einsum_options(op, subs, out, addends=addends)
    return expand(op, mesh_shape, opts)


def matmul_flops(op: OpInfo) -> float:
    subs, out, addends = _subs(op)
    return einsum_flops(op, [s for i, s in enumerate(subs) if i not in addends], out)


def matmul_saves(op: OpInfo) -> Saves:
    """Both operands (each gradient needs the other), never the bias of addmm/baddbmm."""
    if op.target in (aten.addmm.default, aten.baddbmm.default):
        return Saves(inputs=(1, 2))
    if op.target == aten.einsum.default:
        return all_inputs(op)
    return Saves(inputs=(0, 1))


register_op(*(t for t in MATMUL_OPS if t != aten.outer.default), strategies=matmul_strategy,
            family=MATMUL, saves=matmul_saves, follows=NO, flops=matmul_flops)
# The additive input a matmul broadcasts over its rows (a bias), by position: its gradient is a
# sum of the output gradient over the rows (derivatives.yaml: addmm's ``self``, linear's bias).
amend(aten.linear.default, bias=2)
amend(aten.addmm.default, aten.baddbmm.default, bias=0)
# An outer product contracts nothing: it is bound by the bytes it writes, like an elementwise op.
register_op(aten.outer.default, strategies=matmul_strategy, family=ELEMENTWISE, saves=all_inputs,
            follows=NO, flops=matmul_flops)
