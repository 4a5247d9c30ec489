"""Per-op records: importing this package registers every op family (see registry.py)."""
from autoshard.ops import (attention, batch_norm, conv, embedding, factory,  # noqa: F401
                           inplace, loss, matmul, misc, moe, norm, pointwise, pool, reduction,
                           rotary, ssm, view)
from autoshard.ops.registry import (RECORDS, OpRecord, localize, record_of,  # noqa: F401
                                    strategies_for)
