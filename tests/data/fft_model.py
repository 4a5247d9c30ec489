"""A model with complex intermediate values: an rfft between two linear layers (a test factory:
``tests/data/fft_model.py:make`` returns the model and a batch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Spectral(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = nn.Linear(width // 2 + 1, width // 2 + 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(self.proj(x), dim=-1).abs()
        return F.mse_loss(self.out(spectrum), target)


def make(batch: int = 4, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = Spectral()
    x = torch.randn(batch, 8, 32, device=device)
    return model, (x, torch.randn(batch, 8, 17, device=device))
