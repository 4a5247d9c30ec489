"""One causal attention block with grouped K/V heads and nothing else around it (a test factory:
``tests/data/ring_attention_model.py:make`` returns the model and a batch): the least program
in which ring attention runs between compiled regions (tests/test_ring.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, KV_HEADS, SEQ = 32, 4, 2, 16
HEAD_DIM = HIDDEN // HEADS


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.kv = nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, HEADS, HEAD_DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, KV_HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return F.mse_loss(self.out(att.transpose(1, 2).reshape(b, s, HIDDEN)), target)


def make(batch: int = 1, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = Attention().to(device)
    return model, (torch.randn(batch, SEQ, HIDDEN, device=device),
                   torch.randn(batch, SEQ, HIDDEN, device=device))
