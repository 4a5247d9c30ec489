"""A pre-norm transformer with a fused QKV viewed as ``[b, s, 3, heads, head_dim]`` and unbound
(as timm and many hand-written models do) and a fused gate-up chunked in two (a test factory:
``tests/data/fused_qkv_model.py:make`` returns the model and a batch)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, FFN = 32, 4, 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv, self.out = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)
        self.gate_up, self.down = nn.Linear(HIDDEN, 2 * FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(att.transpose(1, 2).reshape(b, s, HIDDEN))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.norm(x), target)


def make(batch: int = 4, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = Stack().to(device)
    x = torch.randn(batch, 16, HIDDEN, device=device)
    return model, (x, torch.randn(batch, 16, HIDDEN, device=device))
