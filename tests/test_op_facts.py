"""Op facts that change a price live in the op's record (ops/registry.py) and nowhere else: the
cost model and the rank program hold no table of ops of their own, and read what they price
from the record (tier 1: one process, no gloo)."""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch._ops import OpOverload

import autoshard.cost
import autoshard.codegen
from autoshard.cost import compute
from autoshard.ops.registry import (PASSES, RECORDS, WIDENS, amend, record_of,
                                    stored_kernels)
from autoshard.trace.export import op_info, trace

aten = torch.ops.aten


def _op_tables(package) -> list[str]:
    """Module-level containers of ATen ops in ``package``'s modules (the registry's own
    ``RECORDS``, imported for lookups, aside)."""
    found = []
    for info in pkgutil.iter_modules(package.__path__):
        mod = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(mod).items():
            if value is RECORDS or not isinstance(value, (set, frozenset, dict, tuple, list)):
                continue
            items = value.keys() if isinstance(value, dict) else value
            if any(isinstance(x, OpOverload) for x in items):
                found.append(f"{mod.__name__}.{name}")
    return found


@pytest.mark.parametrize("package", [autoshard.cost, autoshard.codegen],
                         ids=["cost", "codegen"])
def test_pricing_and_codegen_hold_no_table_of_ops(package) -> None:
    """An op fact kept beside the records can drift from them: declare it with
    ``ops.registry.amend`` next to the op's registration instead."""
    assert _op_tables(package) == []


class _Facts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc(x)) * torch.exp(x)
        return torch.log_softmax(h, -1).sum()


@pytest.fixture(scope="module")
def ops() -> dict:
    traced = trace(_Facts(), (torch.randn(4, 8),))
    return {n.target: op_info(n) for n in traced.graph.nodes if n.op == "call_function"}


def test_prices_read_the_record(ops, monkeypatch) -> None:
    """Special functions per element (docs/cost-model.md §3.7) and the bias gradient's kernel
    come from the record: the erf form of GELU evaluates 1 forward and 2 backward per element,
    exp 1 and 0, log_softmax 1 and 1, and linear's bias is its input 2. Change the record and
    the price follows."""
    n = 4 * 8
    want = {aten.gelu.default: (1, 2), aten.exp.default: (1, 0),
            aten.log_softmax.int: (1, 1)}
    for target, (fwd, bwd) in want.items():
        p = compute._make_profile(ops[target])
        assert (p.specials, p.specials_backward) == (fwd * n, bwd * n), target
    assert compute._make_profile(ops[aten.linear.default]).bias == 2
    monkeypatch.setitem(RECORDS, aten.exp.default,
                        replace(RECORDS[aten.exp.default], specials=(0, 0)))
    assert compute._make_profile(ops[aten.exp.default]).specials == 0


def test_liveness_and_checkpointing_facts_are_in_the_records() -> None:
    """What the liveness walk and selective checkpointing read (cost/liveness.py,
    codegen/recompute.py), each on the record of every op it concerns."""
    assert all(record_of(t).grad == PASSES for t in (
        aten.add.Tensor, aten.add_.Tensor, aten.clone.default, aten.detach.default))
    assert all(record_of(t).grad == WIDENS for t in (
        aten.slice.Tensor, aten.select.int, aten.expand.default, aten.split.Tensor))
    assert record_of(aten.cross_entropy_loss.default).logits
    assert record_of(aten.mul.Tensor).one_factor and not record_of(aten.mul.Scalar).one_factor
    stored = stored_kernels()
    assert {aten.mm.default, aten.addmm.default, aten.bmm.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default} <= stored
    assert aten.relu.default not in stored
    with pytest.raises(AssertionError):
        amend(aten.relu.default, grad="sideways")
