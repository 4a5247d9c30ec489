"""A linear layer feeding a BatchNorm (a test factory: ``tests/data/batchnorm_model.py:make``
returns the model and a batch). The linear's bias has a gradient of zero in exact arithmetic
(BatchNorm subtracts the batch mean, and the bias with it): what a step computes for it is
rounding noise, which verify must judge against the size of the whole gradient."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH = 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Summed, not averaged: gradients of tens, and the bias's noise with them (a fixed
        # floor of 1e-3 read it as a 1e-2 error).
        return F.mse_loss(self.fc2(torch.relu(self.norm(self.fc1(x)))), target, reduction="sum")


def make(batch: int = 64, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Net().to(device), (torch.randn(batch, WIDTH, device=device),
                              torch.randn(batch, WIDTH, device=device))
