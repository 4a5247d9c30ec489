"""A router as Llama-4 and DeepSeek-V3 write theirs (a test factory:
``tests/data/scatter_router_model.py:make``): the top-k scores written into a tensor of
``-inf`` in place, ``full_like(logits, -inf).scatter_(1, idx, top)``, and read through the
write's result only, so a plan may give ``scatter_`` a copy of the ``-inf`` tensor in another
layout, which the write lands in (trace/aliases.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, EXPERTS, TOP = 16, 8, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, WIDTH) / EXPERTS ** 0.5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, idx = logits.topk(TOP, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, idx, top)
        return F.mse_loss(scores.softmax(-1) @ self.experts + x, target)


def make(batch: int = 8, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Net().to(device), (torch.randn(batch, WIDTH, device=device),
                              torch.randn(batch, WIDTH, device=device))
