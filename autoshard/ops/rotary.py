"""Ops of rotary embeddings written in complex numbers (Llama 4, and Llama's original code):
``freqs_cis = polar(ones, t ⊗ inv_freq)``, then ``view_as_complex(x) * freqs_cis`` and
``view_as_real`` (the complex views are in ops/view.py), and of Llama 4's attention temperature
on its layers without rotary, ``log1p(floor((position + 1) / floor_scale))``.

- ``polar(abs, angle)``: elementwise with broadcasting, a complex output; every output dim
  shards through, the operands that broadcast it stay whole. Not linear in either operand.
- ``log1p``: elementwise (``floor``, with the rounding ops, is in ops/pointwise.py).
"""
from __future__ import annotations

import torch

from autoshard.ops.pointwise import pointwise_strategy
from autoshard.ops.registry import (ELEMENTWISE, INPUT, NO, Saves, all_inputs,
                                    per_output_element, register_op)

aten = torch.ops.aten

# Backward of polar needs both operands (d/d abs = e^{iθ}, d/dθ = i·abs·e^{iθ}).
register_op(aten.polar.default, strategies=pointwise_strategy, family=ELEMENTWISE,
            saves=all_inputs, follows=NO, flops=per_output_element)
register_op(aten.log1p.default, strategies=pointwise_strategy, family=ELEMENTWISE,
            saves=Saves(inputs=(0,)), follows=INPUT, flops=per_output_element)
