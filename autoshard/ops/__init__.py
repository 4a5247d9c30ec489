"""Per-op records: importing this package registers every op family (see registry.py)."""
from autoshard.ops import (attention, conv, embedding, factory, inplace, loss,  # noqa: F401
                           matmul, misc, moe, norm, pointwise, reduction, rotary, ssm,
                           view)
from autoshard.ops.registry import (RECORDS, OpRecord, localize, record_of,  # noqa: F401
                                    strategies_for)
