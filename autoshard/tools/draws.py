"""Random draws made the same on both sides of verify's comparison (tools/verify.py): a rank
draws dropout's masks on its own shards, so no seed gives it the single device's, and a draw it
makes whole (ops/factory.py) still follows its own generator's state. Under :class:`KeepAll`
both sides run the same deterministic function instead, every op still as planned."""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.codegen.counter_rng import counter_normal, counter_uniform
from autoshard.ops import modes as op_modes


class KeepAll(TorchDispatchMode):
    """Random draws made the same on both sides, counted. Dropout's masks run keep-all: its
    Bernoulli draws give ones (each unit kept, scaled by 1/(1 - p) as dropout does),
    ``native_dropout`` and attention's ``dropout_p`` run with p = 0; a rank draws its masks on
    its shards, so no seed makes them the single device's. A uniform or normal draw (stochastic
    depth's per-sample mask, noise), which a rank draws whole (ops/factory.py), takes at each
    element a fixed value of the element's flat index (codegen/counter_rng.py), as the single
    device does, and again when a checkpointed layer recomputes it. Under this mode both sides
    run the same deterministic function, every op still as planned."""

    def __init__(self) -> None:
        super().__init__()
        self.draws = 0          # dropout masks run keep-all
        self.fixed = 0          # uniform and normal draws given fixed values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        packet = func.overloadpacket
        if packet in (torch.ops.aten.bernoulli_, torch.ops.aten.bernoulli):
            self.draws += 1
            return args[0].fill_(1) if packet is torch.ops.aten.bernoulli_ else \
                torch.ones_like(args[0])
        if func in op_modes.DISTRIBUTIONS:
            self.fixed += 1
            return _fixed_draw(func(*args, **kwargs), *op_modes.distribution(func, args, kwargs))
        if packet is torch.ops.aten.native_dropout:
            self.draws += 1
            args = (args[0], 0.0, *args[2:])
        names = [a.name for a in func._schema.arguments]
        if "dropout_p" in names:
            i = names.index("dropout_p")
            if i < len(args) and args[i]:
                self.draws += 1
                args = (*args[:i], 0.0, *args[i + 1:])
            elif kwargs.get("dropout_p"):
                self.draws += 1
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


def _fixed_draw(out: torch.Tensor, kind: str, a: float, b: float) -> torch.Tensor:
    """``out`` overwritten with its fixed values: uniform on [a, b), normal (mean a, std b) or
    exponential of rate a (``-log(U) / a`` for U uniform on (0, 1))."""
    index = torch.arange(out.numel(), device=out.device)
    if kind == "exponential":
        values = counter_uniform(0, "verify", index).log_().neg_().div_(a)
    elif kind == "uniform":
        values = counter_uniform(0, "verify", index, low=a, high=b)
    else:
        values = counter_normal(0, "verify", index, mean=a, std=b)
    with torch.no_grad():
        out.copy_(values.view(out.shape))
    return out
