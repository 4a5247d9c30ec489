"""Copies over the host link for optimizer and parameter offload (cost/state.py), at the link's
speed: each copy lands in a host buffer allocated once and kept from step to step, pinned when
the other side is a GPU (FSDP2's ``CPUOffloadPolicy`` and DeepSpeed's ZeRO-Offload keep theirs
pinned too). The cost model prices these copies at the link's bandwidth (docs/cost-model.md
§2.10), which on one H100 pinned copies reach (53.7-55.0 GB/s) and pageable ones do not (10-19
GB/s, before a fresh tensor's allocation): with fresh pageable tensors GPT-2 small's shape
stepped 2.5x its price under optimizer offload, with these buffers 1.01x (docs/cost-model.md
§9, benchmarks/RESULTS.md "On one GPU: CPU offload against its prediction").

A buffer handed out holds the same memory every step, as DDP's ``gradient_as_bucket_view``
gradients do: a gradient kept past the next backward must be copied by whoever keeps it. A
copy that the host does not read at once is not waited for where it is issued: a copy that
waits stops the CPU until the GPU has run everything queued before it, and the GPU then idles
while the CPU queues the next kernels, at every read of every parameter kept on the host.
"""
from __future__ import annotations

import torch


class HostBuffers:
    """One rank's host buffers for the copies down and up the link, by key, and the copies
    still in flight: a copy between pinned memory and the GPU is issued without waiting (the
    CPU goes on queueing kernels, the GPU stays busy), and :meth:`settle` waits for all of them
    before the host reads or writes what they touch: at the end of backward, before the
    optimizer step, before a state dict is loaded."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._bufs: dict[tuple[str, str], torch.Tensor] = {}
        self.pending = False
        self._queued = False

    def _buffer(self, key: str, role: str, like: torch.Tensor, pinned: bool) -> torch.Tensor:
        buf = self._bufs.get((key, role))
        if buf is None or buf.shape != like.shape or buf.dtype != like.dtype:
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
            self._bufs[(key, role)] = buf
        return buf

    def settle(self) -> None:
        """Wait for every copy issued without waiting."""
        self._queued = False
        if self.pending:
            torch.cuda.current_stream(self.device).synchronize()
            self.pending = False

    def settle_after_backward(self) -> None:
        """From inside a backward: :meth:`settle` once the backward has run (an autograd
        engine callback), so that the gradients copied down are there when it returns."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.settle)

    def fetch(self, x: torch.Tensor) -> torch.Tensor:
        """Host tensor ``x`` on the device, not waited for where ``x`` is pinned (the stream
        orders it before the kernels that read it)."""
        if self.device.type != "cuda" or not x.is_pinned():
            return x.to(self.device)
        self.pending = True
        return x.to(self.device, non_blocking=True)

    def down(self, g: torch.Tensor, key: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """``g`` copied to the host. With ``into`` (a host tensor: a gradient already there), it
        is added to ``into``, which is returned; without, the copy itself is returned: the
        buffer kept under ``key``, which the next call for ``key`` without ``into`` overwrites.
        A copy into the returned buffer may still be in flight: :meth:`settle` before reading."""
        if into is None:
            buf = self._buffer(key, "sum", g, pinned=g.is_cuda)
            if g.is_cuda:
                self.pending = True
            return buf.copy_(g, non_blocking=g.is_cuda)
        self.settle()                       # ``into`` may be a copy still in flight
        return into.add_(self._buffer(key, "stage", g, pinned=g.is_cuda).copy_(g))

    def up(self, t: torch.Tensor, key: str, device: torch.device) -> torch.Tensor:
        """Host tensor ``t`` on ``device``, copied from pinned memory (``t`` itself where it is
        pinned, else the buffer kept under ``key``). The copy is complete on return, so the
        host may write ``t`` or the buffer again at once."""
        if device.type != "cuda":
            return t.to(device)
        if not t.is_pinned():
            t = self._buffer(key, "up", t, pinned=True).copy_(t)
        return t.to(device)
