"""Op facts of training and eval mode (codegen/modes.py reads them for ``pm.eval()``,
codegen/masks.py for per-shard dropout masks, codegen/recompute.py for the buffers a recomputed
layer must not update twice): which arguments of an op say that it draws a random mask or uses
batch statistics, and which it writes in place. Some of these ops have no sharding rule (they
run replicated), so the facts sit here, beside the records, rather than in them.
"""
from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten

# dropout op -> (index of its probability argument, index of its training flag)
DROPOUTS = {aten.dropout.default: (1, 2), aten.feature_dropout.default: (1, 2),
            aten.alpha_dropout.default: (1, 2), aten.feature_alpha_dropout.default: (1, 2),
            aten.native_dropout.default: (1, 2)}
# attention whose dropout_p is a training-mode argument (models pass 0.0 in eval mode)
SDPA = {aten.scaled_dot_product_attention.default: 4}
# op -> (index of its probability argument or None, index of its training flag)
TRAIN_FLAGS = {**DROPOUTS,
               aten.batch_norm.default: (None, 5), aten.native_batch_norm.default: (None, 5)}
# op -> positions of the buffers it updates in place in training mode (batch norm's running
# statistics), which its schema does not mark as written
RUNNING_STATS = {aten.batch_norm.default: (3, 4), aten.native_batch_norm.default: (3, 4)}


def written_args(target: Any, args: tuple, kwargs: dict) -> list:
    """The arguments a call of ``target`` writes in place: those its schema marks written
    (``add_``'s ``self``), and a batch norm's running statistics when it trains."""
    out = []
    schema = getattr(target, "_schema", None)
    for i, a in enumerate(schema.arguments if schema is not None else ()):
        if a.alias_info is not None and a.alias_info.is_write:
            out.append(args[i] if i < len(args) else kwargs.get(a.name))
    if target in RUNNING_STATS:
        flag = TRAIN_FLAGS[target][1]
        if (args[flag] if flag < len(args) else kwargs.get("training")) is True:
            out += [args[i] for i in RUNNING_STATS[target] if i < len(args)]
    return out
