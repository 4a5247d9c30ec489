"""Op facts of training and eval mode (codegen/modes.py reads them for ``pm.eval()``,
codegen/masks.py for per-shard dropout masks): which arguments of an op say that it draws a
random mask or uses batch statistics. Several of these ops have no sharding rule (they run
replicated), so the facts sit here, beside the records, rather than in them.
"""
from __future__ import annotations

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
