"""Per-op records: importing this package registers every op family (see registry.py)."""
from autoshard.ops import (attention, embedding, factory, loss, matmul, misc, norm,  # noqa: F401
                           pointwise, reduction, view)
from autoshard.ops.registry import (RECORDS, OpRecord, localize, record_of,  # noqa: F401
                                    strategies_for)
