"""autoshard: a compiler-style auto-sharding planner for PyTorch.

    mesh = autoshard.Mesh((8, 8), ("dp", "tp"), cluster="h100")
    plan = autoshard.plan(model, example_inputs, mesh)               # PlanOptions as keywords
    plan = autoshard.search_mesh(model, example_inputs, gpus=64)      # or search the meshes
    pm = autoshard.parallelize(model, mesh, plan=plan)                # under torchrun
"""
from autoshard.cluster import Cluster
from autoshard.errors import AutoshardError
from autoshard.ir import Partial, Replicate, Shard
from autoshard.loss import with_loss
from autoshard.mesh import AxisLink, Mesh
from autoshard.options import PlanOptions
from autoshard.plans import Plan
from autoshard.solver.meshes import search_mesh
from autoshard.solver.planner import plan

__all__ = ["AutoshardError", "AxisLink", "Cluster", "Mesh", "Partial", "Plan", "PlanOptions",
           "Replicate", "Shard", "parallelize", "plan", "search_mesh", "with_loss"]


def parallelize(model, mesh, *, plan=None, example_inputs=None, options=None, **overrides):
    """Plan (or load ``plan``) and return this rank's :class:`ParallelModule`."""
    from autoshard.codegen.parallelize import parallelize as _parallelize
    return _parallelize(model, mesh, plan=plan, example_inputs=example_inputs, options=options,
                        **overrides)
