"""The running count the liveness walk keeps (cost/liveness.py): tensor storages with their
bytes, category and references; the bytes alive by category, with each phase's peak and the
split at it; and :class:`MemoryBreakdown`, the walk's report (docs/cost-model.md §4.5)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autoshard.ir import Phase

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")



@dataclass(frozen=True)
class MemoryBreakdown:
    """One device's peak over a training step and what it holds then (bytes; see the module
    docstring). ``parameters + gradients + optimizer + activations + temporaries == peak``;
    ``phases``: the peak of each phase; ``state``: the model state's totals over the step
    (parameters, gradients, optimizer, host: ``Pricer.state_bytes`` summed), whatever part of
    it is alive at the peak."""

    peak: int
    phase: Phase
    at: str
    parameters: int
    gradients: int
    optimizer: int
    activations: int
    temporaries: int
    host: int = 0
    phases: dict[str, int] = field(default_factory=dict)
    state: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)



class Storage:
    """One tensor storage: its bytes, category, and the references holding it. ``permuted``: a
    gradient that is a transposed view (reshaping it copies)."""

    __slots__ = ("nbytes", "cat", "refs", "permuted")

    def __init__(self, nbytes: int, cat: str) -> None:
        self.nbytes, self.cat, self.refs, self.permuted = int(nbytes), cat, 0, False



class LiveMemory:
    """Live bytes by category, with the peak of each phase and the split at it."""

    def __init__(self) -> None:
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.phase = Phase.FORWARD
        # Per phase, in the order they run: its peak, where, and the split then.
        self.best: dict[str, tuple[int, str, dict[str, int]]] = {}
        self.log: list[tuple[str, str, int]] | None = None     # (phase, at, bytes) per moment

    def alloc(self, nbytes: int, cat: str, refs: int = 1) -> Storage:
        s = Storage(nbytes, cat)
        self.live[cat] += s.nbytes
        self.total += s.nbytes
        s.refs = refs
        if refs == 0:
            self._free(s)
        return s

    def ref(self, s: Storage, n: int = 1) -> Storage:
        s.refs += n
        return s

    def unref(self, s: Storage | None, n: int = 1) -> None:
        if s is None:
            return
        s.refs -= n
        assert s.refs >= 0, "a storage released more often than held"
        if s.refs == 0:
            self._free(s)

    def _free(self, s: Storage) -> None:
        self.live[s.cat] -= s.nbytes
        self.total -= s.nbytes

    def recategorize(self, s: Storage, cat: str) -> None:
        if s.refs > 0:
            self.live[s.cat] -= s.nbytes
            self.live[cat] += s.nbytes
        s.cat = cat

    def mark(self, at: str, extra: int = 0, extra_cat: str = "temporaries") -> None:
        """A moment to check: what is alive now, plus ``extra`` bytes that exist only during
        this moment (a kernel's transient output)."""
        total = self.total + extra
        if self.log is not None:
            self.log.append((self.phase, at, total))
        if total > self.best.get(self.phase, (-1,))[0]:
            live = dict(self.live)
            live[extra_cat] += extra
            self.best[self.phase] = (total, at, live)



def fake_value(node: fx.Node, idx: int) -> Any:
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        val = val[idx] if idx < len(val) else None
    return val if isinstance(val, torch.Tensor) else None



def storage_key(t: Any) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except Exception:     # noqa: BLE001 (a tensor without a storage: no aliasing known)
        return None

