"""A model that checks a value read off a tensor with a plain ``assert``, as XLM checks its
lengths (a test factory: ``tests/data/value_check_model.py:make`` returns the model and a
batch). It lives outside the test modules, whose asserts pytest rewrites."""
from __future__ import annotations

import torch
from torch import nn


class ChecksItsData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = (x != 0).sum(dim=1).long()
        assert lengths.max().item() <= x.shape[1]
        return self.fc(x).sum()


def make():
    return ChecksItsData(), (torch.randn(8, 4),)
