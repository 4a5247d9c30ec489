"""A two-layer perceptron in float64 (a test factory: ``tests/data/fp64_model.py:make``): an
fp64 model keeps its optimizer's master and moments in fp64 (cost/state.py ``master_dtype``),
so its steps under ZeRO match one device's to fp64's rounding, not fp32's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(torch.relu(self.fc1(x))), target)


def make(batch: int = 16, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(batch, WIDTH, generator=g, dtype=torch.float64),
              torch.randn(batch, WIDTH, generator=g, dtype=torch.float64))
    return Net().to(device, torch.float64), tuple(t.to(device) for t in inputs)
