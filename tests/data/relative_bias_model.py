"""Attention with BEiT's relative position bias (a test factory:
``tests/data/relative_bias_model.py:make``). The bias table is indexed by a relative position
index the forward builds by writing into slices of zeros, as Hugging Face's BEiT and
Data2Vec-Vision do (``index[1:, 1:] = coords.sum(-1)``), and reads afterwards through a view of
the zeros: the writes reach the read only through the storage the slices share
(trace/aliases.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WINDOW, WIDTH, HEADS = 4, 32, 4
TOKENS = WINDOW * WINDOW + 1


def relative_position_index() -> torch.Tensor:
    coords = torch.stack(torch.meshgrid(torch.arange(WINDOW), torch.arange(WINDOW),
                                        indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0).contiguous()
    rel[:, :, 0] += WINDOW - 1
    rel[:, :, 1] += WINDOW - 1
    rel[:, :, 0] *= 2 * WINDOW - 1
    distances = (2 * WINDOW - 1) ** 2
    index = torch.zeros(TOKENS, TOKENS, dtype=rel.dtype)
    index[1:, 1:] = rel.sum(-1)
    index[0, 0:] = distances          # cls to token
    index[0:, 0] = distances + 1      # token to cls
    index[0, 0] = distances + 2       # cls to cls
    return index


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.table = nn.Parameter(torch.randn((2 * WINDOW - 1) ** 2 + 3, HEADS))
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        bias = self.table[relative_position_index().view(-1)].view(n, n, HEADS)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.permute(2, 0, 1))
        return F.mse_loss(self.out(y.transpose(1, 2).reshape(b, n, WIDTH)), target)


def make(batch: int = 8, device: str = "cpu") -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return Net().to(device), (torch.randn(batch, TOKENS, WIDTH, device=device),
                              torch.randn(batch, TOKENS, WIDTH, device=device))
