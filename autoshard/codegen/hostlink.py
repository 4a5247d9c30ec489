"""Copies over the host link for optimizer and parameter offload (cost/state.py), at the link's
speed: each copy lands in a host buffer allocated once and kept from step to step, pinned when
the other side is a GPU (FSDP2's ``CPUOffloadPolicy`` and DeepSpeed's ZeRO-Offload keep theirs
pinned too). The cost model prices these copies at the link's bandwidth (docs/cost-model.md
§2.10), which on one H100 pinned copies reach (53.7-55.0 GB/s) and pageable ones do not (10-19
GB/s, before a fresh tensor's allocation): with fresh pageable tensors GPT-2 small's shape
stepped 2.5x its price under optimizer offload, with these buffers 1.01x (docs/cost-model.md
§9, benchmarks/RESULTS.md "On one GPU: CPU offload against its prediction").

A buffer handed out holds the same memory every step, as DDP's ``gradient_as_bucket_view``
gradients do: a gradient kept past the next backward must be copied by whoever keeps it.
"""
from __future__ import annotations

import torch


class HostBuffers:
    """One rank's host buffers for the copies down and up the link, by key."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}

    def _buffer(self, key: str, role: str, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        buf = self._bufs.get((key, role))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
            self._bufs[(key, role)] = buf
        return buf

    def down(self, g: torch.Tensor, key: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """``g`` copied to the host. With ``into`` (a host tensor: a gradient already there), it
        is added to ``into``, which is returned; without, the copy itself is returned: the
        buffer kept under ``key``, which the next call for ``key`` without ``into`` overwrites."""
        buf = self._buffer(key, "sum" if into is None else "stage", g, pinned=g.is_cuda)
        buf.copy_(g)
        return buf if into is None else into.add_(buf)

    def up(self, t: torch.Tensor, key: str, device: torch.device) -> torch.Tensor:
        """Host tensor ``t`` on ``device``, copied from pinned memory (``t`` itself where it is
        pinned, else the buffer kept under ``key``). The copy is complete on return, so the
        host may write ``t`` or the buffer again at once."""
        if device.type != "cuda":
            return t.to(device)
        if not t.is_pinned():
            t = self._buffer(key, "up", t, pinned=True).copy_(t)
        return t.to(device)
