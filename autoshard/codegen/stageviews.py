"""Parameters of a pipelined plan as DTensors over the whole mesh, pipeline axis included, so that
torch's own ``clip_grad_norm_`` / ``get_total_norm`` / ``clip_grad_value_`` over
``pm.parameters()`` give the norm over every stage (docs/design.md, "Parameters as DTensors").

A rank of a pipeline holds the parameters of its stages only. ``pm.parameters()`` still lists
every parameter of the model on every rank, in the model's order, each a DTensor over the mesh:

- a parameter held by one pipeline coordinate is ``Shard(0)`` along the pipeline axis: the
  holding rank's local tensor is its shard, every other rank's an empty tensor (zero rows).
  Concatenated along dim 0 over the pipeline axis they are the tensor, which is what ``Shard``
  means; only the split differs from ``torch.chunk``'s, so such a tensor is a
  :class:`PipelineView` that refuses to be gathered. The norm of a ``Shard`` is a ``_NormPartial`` over that axis (torch's
  distributed/tensor/_ops/_math_ops.py), so the stacked norms reduce over the pipeline axis
  with the others, in the one all-reduce torch issues for the total;
- a parameter every pipeline coordinate holds (a weight tied across all stages, its gradient
  all-reduced over the holders after the step) is ``Replicate`` along the axis, as it is.

Every rank thus lists the same tensors, so the collectives DTensor issues match on every rank
(torchtitan instead all-reduces the stage norms by hand in its own clip function).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from autoshard.errors import AutoshardError


class PipelineView(DTensor):
    """A DTensor of a pipeline parameter or gradient laid out as above. Its pipeline axis is
    split unlike ``torch.chunk``, which DTensor's gathers assume: gathering it is refused (not
    left to return wrong rows); the ops torch's clipping runs (norms, scaling, clamping) are
    local or reduce scalars, and are exact."""

    def full_tensor(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise _no_gather()

    def detach(self) -> "PipelineView":      # (torch.nn.Parameter keeps a detached copy's type)
        out = super().detach()
        out.__class__ = PipelineView
        return out

    def redistribute(self, *args: Any, **kwargs: Any) -> DTensor:
        raise _no_gather()


def _no_gather() -> AutoshardError:
    return AutoshardError("a DTensor that can be gathered",
                          got="a parameter (or its gradient) of a pipelined plan, held by the "
                              "ranks of its stage only",
                          fix="gather with pm.full_state_dict() (parameters) or pm.full_grads() "
                              "(gradients)")


def as_view(local: torch.Tensor, mesh: Any, placements: list, shape: tuple[int, ...]
            ) -> DTensor:
    """``local`` itself (no copy) as a :class:`PipelineView` of global ``shape`` (as
    codegen/dtensors.py ``dtensor_in_place`` builds a DTensor)."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from autoshard.codegen.dtensors import contiguous_stride
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype)
    return PipelineView(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta),
                        requires_grad=False)


def pipeline_placements(placements: list, axis: int, holders: set[int], n: int,
                        fqn: str, shape: tuple[int, ...]) -> list:
    """``placements`` (the parameter's, ``Replicate`` along the pipeline axis ``axis`` of ``n``
    coordinates) with that axis's entry set for the coordinates ``holders`` holding it."""
    from torch.distributed.tensor import Replicate
    if not isinstance(placements[axis], Replicate):
        raise AutoshardError(f"{fqn} replicated along the pipeline axis",
                             got=f"placements {placements}",
                             fix="re-plan: the plan file was edited or is damaged")
    if len(holders) == n:
        return list(placements)
    if len(holders) > 1 or not shape:
        why = (f"held by pipeline coordinates {sorted(holders)} of {n}" if len(holders) > 1
               else "a 0-dimensional parameter")
        raise AutoshardError(
            "parameters a pipeline's DTensors can lay out along the pipeline axis (held by one "
            "coordinate, or by every one)",
            got=f"{fqn}: {why}",
            fix="place the stages that read it on one pipeline rank or on all of them (or untie "
                "it); torch's clip_grad_norm_ would otherwise count it wrongly")
    out = list(placements)
    out[axis] = Shard(0)
    return out


def absent(local_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
           ) -> torch.Tensor:
    """The local tensor of a parameter on a rank that does not hold it: no rows."""
    return torch.empty((0, *local_shape[1:]), dtype=dtype, device=device)
