"""Turn a model into a module whose forward returns the scalar training loss.

The planner traces ``forward`` of a loss module, so the loss (and hence the backward) is part of
the graph. Both wrappers keep the wrapped model as the attribute ``model``: parameter names in
the traced graph and in the plan read ``model.<name>`` (``model.layers.0.attn.qkv.weight``), and
a plan made for the wrapper addresses the original model's parameters by stripping ``model.``.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from autoshard.errors import AutoshardError

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]


class WithLoss(nn.Module):
    """``forward(*inputs, target) = loss_fn(model(*inputs), target)``.

    The target is the last positional argument (so example inputs stay one flat tuple, as
    ``torch.export`` and the zoo use them) or the keyword ``target``. A ``loss_fn`` that is an
    ``nn.Module`` (``nn.CrossEntropyLoss()``) becomes the submodule ``loss_fn``.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if target is None:
            if len(inputs) < 2:
                raise AutoshardError("with_loss modules take (*inputs, target)",
                                     got=f"{len(inputs)} positional argument(s) and no target",
                                     fix="pass the target last, or as target=...")
            *inputs, target = inputs
        return self.loss_fn(self.model(*inputs), target)


def with_loss(model: nn.Module, loss_fn: LossFn) -> WithLoss:
    """Wrap ``model`` so that calling it with ``(*inputs, target)`` returns the scalar loss."""
    return WithLoss(model, loss_fn)


class LossOutput(nn.Module):
    """Calls ``model`` with the same arguments and returns the loss it produced."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self.model(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            return out
        loss = getattr(out, "loss", None)  # a Hugging Face ModelOutput
        if not isinstance(loss, torch.Tensor):
            raise AutoshardError("a model returning a scalar loss tensor or an output with .loss",
                                 got=f"{type(out).__name__} with loss={type(loss).__name__}",
                                 fix="pass labels to the model, or use with_loss(model, loss_fn)")
        return loss


def as_loss_module(model: nn.Module) -> LossOutput:
    """Wrap a model that returns its loss: a tensor (passed through) or an object with ``.loss``.

    Whether the tensor is a scalar is left to the caller, which sees the traced shape anyway.
    Hugging Face models take labels by keyword (``labels=...``), since their second positional
    argument is not ``labels``.
    """
    return LossOutput(model)


__all__ = ["WithLoss", "with_loss", "LossOutput", "as_loss_module"]
