"""Op facts of training and eval mode (codegen/modes.py reads them for ``pm.eval()``,
codegen/masks.py for per-shard dropout masks, codegen/recompute.py for the buffers a recomputed
layer must not update twice): which arguments of an op say that it draws a random mask or uses
batch statistics, which draws make a stochastic-depth mask, and which arguments an op writes in
place. Some of these ops have no sharding rule (they run replicated), so the facts sit here,
beside the records, rather than in them.
"""
from __future__ import annotations

from typing import Any

import torch

from autoshard.ops import factory

aten = torch.ops.aten

# dropout op -> (index of its probability argument, index of its training flag)
DROPOUTS = {aten.dropout.default: (1, 2), aten.feature_dropout.default: (1, 2),
            aten.alpha_dropout.default: (1, 2), aten.feature_alpha_dropout.default: (1, 2),
            aten.native_dropout.default: (1, 2)}
# attention whose dropout_p is a training-mode argument (models pass 0.0 in eval mode)
SDPA = {aten.scaled_dot_product_attention.default: 4}
# batch norm -> (index of its training flag, positions of the running statistics it updates in
# place when it trains, which its schema does not mark as written)
BATCH_NORMS = {aten.batch_norm.default: (5, (3, 4)), aten.native_batch_norm.default: (5, (3, 4))}
# op -> (index of its probability argument or None, index of its training flag)
TRAIN_FLAGS = {**DROPOUTS, **{op: (None, flag) for op, (flag, _) in BATCH_NORMS.items()}}

# Random draws no flag turns off (their rules: ops/factory.py): a module that draws only in
# training decides so in Python, and the trace holds the draw either way.
DRAWS = factory.DRAWS + tuple(factory.DRAWS_LIKE) + factory.DRAWS_INTO
# A Bernoulli mask drawn as ``bernoulli(p)`` (timm's drop path): op -> index of p
BERNOULLI = {aten.bernoulli_.float: 1}
# ... or as ``floor(c + U)`` for U uniform on [0, 1) (Hugging Face's drop path): one with
# probability c
FLOORS = (aten.floor.default, aten.floor_.default)
UNIFORM = (aten.rand.default, aten.rand_like.default)
# Multiplicative jitter, ``x * U`` for U uniform on [1 - e, 1 + e) (Switch Transformers'
# router, drawn as ``empty_like(x).uniform_(1 - e, 1 + e)``): draw -> index of its low bound
JITTER = {aten.uniform_.default: 1, aten.uniform.default: 1}
# ... and what may read it for it to be one: multiplications
JITTER_USES = (aten.mul.Tensor, aten.mul_.Tensor)
# a uniform draw -> the factory of the same signature that draws nothing
NO_DRAW = {aten.rand.default: aten.zeros.default, aten.rand_like.default: aten.zeros_like.default}
# draw -> (distribution, (index, name) of each parameter the call may give): uniform on
# [a, b), normal with mean a and standard deviation b, or exponential of rate a; (0, 1) where
# the call gives none, rate 1
DISTRIBUTIONS = {
    aten.rand.default: ("uniform", ()), aten.rand_like.default: ("uniform", ()),
    aten.randn.default: ("normal", ()), aten.randn_like.default: ("normal", ()),
    aten.uniform_.default: ("uniform", ((1, "from"), (2, "to"))),
    aten.normal_.default: ("normal", ((1, "mean"), (2, "std"))),
    aten.exponential_.default: ("exponential", ((1, "lambd"),)),
}


def distribution(target: Any, args: tuple, kwargs: dict) -> tuple[str, float, float]:
    """A ``DISTRIBUTIONS`` draw's distribution and its two parameters, as the call gives them."""
    kind, params = DISTRIBUTIONS[target]
    values = [1.0, 1.0] if kind == "exponential" else [0.0, 1.0]
    for k, (i, name) in enumerate(params):
        values[k] = args[i] if len(args) > i else kwargs.get(name, values[k])
    return kind, values[0], values[1]


def trains(target: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of a ``TRAIN_FLAGS`` op has its training flag set."""
    p, i = TRAIN_FLAGS[target]
    return (args[i] if i < len(args) else kwargs.get("train" if p is not None else "training")) \
        is True


def written_args(target: Any, args: tuple, kwargs: dict) -> list:
    """The arguments a call of ``target`` writes in place: those its schema marks written
    (``add_``'s ``self``), and a batch norm's running statistics when it trains."""
    out = []
    schema = getattr(target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    if target in BATCH_NORMS and trains(target, args, kwargs):
        out += [args[i] for i in BATCH_NORMS[target][1] if i < len(args)]
    return out
