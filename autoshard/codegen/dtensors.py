"""This rank's tensors as torch DTensors (torch.distributed.tensor): the placements of a plan's
spec, a DTensor over a tensor wherever it lies (the host included), and the layouts
torch.distributed.checkpoint cannot describe. The parameter views (codegen/gradviews.py), the
state dicts of the module and of its optimizer (codegen/statedicts.py, codegen/optimstate.py)
and the pipeline's views (codegen/stageviews.py) all build theirs with these.
"""
from __future__ import annotations

from typing import Any

import torch

from autoshard.errors import AutoshardError
from autoshard.ir import Shard, Spec, spec_str


def dtensor_placements(spec: Spec):
    """DTensor placements of a parameter kept as ``spec``. A strided shard (a fused projection)
    is ``Shard`` of its dim here: the same elements per rank, so norms and elementwise ops are
    exact; its offsets are not, which is why DCP refuses it (refuse_strided)."""
    from torch.distributed.tensor import Replicate as DR, Shard as DS
    return [DS(p.dim) if isinstance(p, Shard) else DR() for p in spec]


def refuse_strided(fqn: str, spec: Spec) -> None:
    """torch.distributed.checkpoint describes a rank's part of a tensor as one box; a strided
    shard (ir.py) is one box per group, which DCP refuses as overlapping chunks. Say so."""
    if any(isinstance(p, Shard) and p.groups for p in spec):
        raise AutoshardError(
            f"{fqn}: parameters DCP can describe (one box of the global tensor per rank)",
            got=f"a strided shard {spec_str(spec)} (a fused projection, each rank its part of "
                f"every group)",
            fix="save with pm.full_state_dict() / load_full_state_dict(), or plan with "
                "pins={...: contiguous spec} for this parameter")


def dtensor_in_place(local: torch.Tensor, device_mesh: Any, placements: tuple,
                     shape: tuple[int, ...]) -> Any:
    """``local`` as the DTensor of global ``shape`` and ``placements``, the tensor itself
    wherever it lies: ``DTensor.from_local`` would copy a host tensor to the mesh's device. As
    FSDP2's CPU offload builds its sharded parameters (torch.distributed.fsdp,
    ``_from_local_no_grad``); DCP reads and writes it in place."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    meta = TensorMeta(torch.Size(shape), contiguous_stride(shape), local.dtype)
    return DTensor(local, DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta),
                   requires_grad=False)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))
