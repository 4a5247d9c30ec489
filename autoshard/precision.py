"""Mixed-precision training, ``PlanOptions(precision="bf16-mixed")``.

The step runs in bf16 (parameters, activations, gradients, the collectives) while the optimizer
keeps fp32 master weights and fp32 Adam moments (Micikevicius et al., "Mixed Precision
Training", arXiv 1710.03740; with bf16 no loss scaling is needed: Kalamkar et al., arXiv
1905.12322). The planner traces the model as it will run, in bf16, so every price sees 2-byte
tensors and the optimizer's K = 12 bytes per parameter (docs/cost-model.md §4.1); the runtime
keeps each rank's fp32 shard of the model's own weights as the master's starting value
(codegen/optim.py), so nothing is lost to a round trip through bf16.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Sequence

import torch

MIXED = "bf16-mixed"


def _cast(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.bfloat16:
        return x.to(torch.bfloat16)
    return x


def cast_inputs(inputs: Sequence[Any], precision: str) -> tuple:
    """The model's inputs as the step runs them: floating-point tensors in bf16 under
    "bf16-mixed" (token ids and masks keep their dtypes)."""
    if precision != MIXED:
        return tuple(inputs)
    return tuple(_cast(x) for x in inputs)


@contextmanager
def running_as(model: torch.nn.Module, precision: str) -> Iterator[dict[str, torch.Tensor]]:
    """Inside, ``model``'s floating-point parameters and buffers are in the dtype the step runs
    in (bf16 under "bf16-mixed"); on exit the model holds its own tensors again, untouched.
    Yields the model's own floating-point parameters by name (the masters' source); empty when
    nothing is cast."""
    if precision != MIXED:
        yield {}
        return
    own: list[tuple[torch.Tensor, torch.Tensor]] = []
    originals: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.dtype != torch.bfloat16:
            originals[name] = p.data
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or not t.is_floating_point() or t.dtype == torch.bfloat16:
            continue
        seen.add(id(t))
        own.append((t, t.data))
        t.data = t.data.to(torch.bfloat16)
    try:
        yield originals
    finally:
        for t, data in own:
            t.data = data
