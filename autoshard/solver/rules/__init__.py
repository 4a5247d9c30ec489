"""Per-op sharding rules. Importing this package registers every rule family."""
from autoshard.solver.rules import (attention, embedding, factory, loss, matmul, misc, norm,  # noqa: F401
                                    pointwise, reduction, view)
from autoshard.solver.rules.registry import (RULES, OpInfo, TensorInfo, default_localize,  # noqa: F401
                                             localize, op_flops, strategies_for)
