"""A router as Llama-4 and DeepSeek-V3 write theirs (a test factory:
``tests/data/scatter_router_model.py:make``): the top-k scores written into a tensor of
``-inf`` in place, ``full_like(logits, -inf).scatter_(1, idx, top)``, and read through the
write's result only, so a plan may give ``scatter_`` a copy of the ``-inf`` tensor in another
layout, which the write lands in (trace/aliases.py). ``make_read_before`` reads the scores
through a view made before the write instead, which pins the write's input."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, EXPERTS, TOP = 16, 8, 2


class Net(nn.Module):
    def __init__(self, through_result: bool = True) -> None:
        super().__init__()
        self.through_result = through_result
        self.router = nn.Linear(WIDTH, EXPERTS, bias=False)
        self.experts = nn.Parameter(torch.randn(EXPERTS, WIDTH) / EXPERTS ** 0.5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, idx = logits.topk(TOP, dim=-1)
        scores = torch.full_like(logits, float("-inf"))
        before = scores.view(-1, EXPERTS)
        written = scores.scatter_(1, idx, top)
        scores = written if self.through_result else before
        return F.mse_loss(scores.softmax(-1) @ self.experts + x, target)


def make(batch: int = 8, device: str = "cpu", through_result: bool = True
         ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Net(through_result).to(device), (torch.randn(batch, WIDTH, device=device),
                                            torch.randn(batch, WIDTH, device=device))


def make_read_before(batch: int = 8, device: str = "cpu"
                     ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return make(batch, device, through_result=False)
