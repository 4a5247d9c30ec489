"""Random draws no flag turns off: stochastic depth (drop path) and noise. A rank draws them
whole (ops/factory.py), verify gives them fixed values on both sides (tools/draws.py
``KeepAll``), and ``pm.eval()`` fills a stochastic-depth mask with its mean (codegen/modes.py).
The gloo runs, training and eval against one device, are in tests/test_training_loop.py
(``droppath`` in ``MODES``)."""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from autoshard import Mesh
from autoshard.codegen.modes import eval_program, eval_version, mask_mean, mode_dependent
from autoshard.ir import Replicate
from autoshard.ops import modes as op_modes
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from modes import CLUSTER, drop_path_model

aten = torch.ops.aten


def test_drop_path_plans_with_rules_and_draws_whole() -> None:
    """Why: "Swin's drop path (aten.rand) has no rule and runs replicated, with a warning".
    Both idioms (HF's ``floor(q + U)``, timm's ``bernoulli_(q)``) plan under data parallelism
    with no op left without a rule; each draw is made whole on every rank."""
    model, inputs = drop_path_model()
    traced = trace(model, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = plan_traced(traced, Mesh((2,), cluster=CLUSTER))
    assert not [w for w in caught if "no sharding rule" in str(w.message)]
    draws = [n.name for n in traced.gm.graph.nodes if n.target in op_modes.DRAWS]
    assert len(draws) == 4
    strategies = plan.strategies()
    for name in draws:
        assert all(isinstance(p, Replicate) for p in strategies[name].outputs[0]), name
    # the batch itself is split: the draws are the only whole tensors of the blocks' ends
    assert any(not isinstance(p, Replicate) for p in strategies["add_1"].outputs[0])


def test_eval_program_fills_each_mask_with_its_keep_probability() -> None:
    """Closed form: the blocks' keep probabilities are 1 - 0.5 (i + 1) / 2, 0.75 then 0.5 (the
    timm mask's 0.5 is its argument's default, which the trace leaves out); in eval mode each
    mask is that constant, no draw is left, and the eval program computes model.eval()'s
    loss."""
    model, inputs = drop_path_model()
    gm = trace(model, inputs).gm
    assert len(mode_dependent(gm)) == 4
    means = [mask_mean(n) for n in gm.graph.nodes if mask_mean(n) is not None]
    assert means == [0.75, 0.75, 0.5, 0.5]
    prog = eval_program(gm, set())
    targets = [n.target for n in prog.graph.nodes if n.op == "call_function"]
    assert not set(targets) & set(op_modes.DRAWS)
    assert targets.count(aten.fill_.Scalar) == 4
    params = [p.detach() for p in model.parameters()]
    got = prog(*params, *inputs)
    model.eval()
    assert torch.allclose(got[0] if isinstance(got, (tuple, list)) else got,
                          model(*inputs), rtol=1e-6)


class Jittered(torch.nn.Module):
    """Switch Transformers' router jitter: in training the input is scaled by U on [0.99,
    1.01), in place (the module skips it in eval mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        if self.training:
            h = h.clone()
            h *= torch.empty_like(h).uniform_(0.99, 1.01)
        return self.fc(h).pow(2).mean()


def test_eval_program_takes_multiplicative_jitter_out() -> None:
    """A draw uniform on [1 - e, 1 + e) read only by multiplications is jitter: eval mode fills
    it with 1, no draw is left, and the program computes model.eval()'s loss exactly; no
    warning. A draw on [0, 2) read by an addition is not."""
    from autoshard.codegen.modes import jitter
    model, x = Jittered(), torch.randn(4, 8)
    gm = trace(model, (x,)).gm
    assert [jitter(n) for n in gm.graph.nodes].count(True) == 1
    assert len(mode_dependent(gm)) == 1
    prog = eval_program(gm, set())
    targets = [n.target for n in prog.graph.nodes if n.op == "call_function"]
    assert not set(targets) & set(op_modes.DRAWS) and aten.fill_.Scalar in targets
    params = [p.detach() for p in model.parameters()]
    got = prog(*params, x)
    model.eval()
    assert torch.equal(got[0] if isinstance(got, (tuple, list)) else got, model(x))
    pm = SimpleNamespace(traced=SimpleNamespace(placeholders=[]), _compile=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert eval_version(gm, pm) is not None

    class Added(Jittered):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x + torch.empty_like(x).uniform_(0.0, 2.0)).pow(2).mean()

    assert not any(jitter(n) for n in trace(Added(), (x,)).gm.graph.nodes)


def test_switch_eval_program_computes_model_eval() -> None:
    """Switch Transformers traced in training mode (dropout, the experts' dropout mask, router
    jitter): its eval program computes what model.eval() computes."""
    pytest.importorskip("transformers")
    import json
    from pathlib import Path
    import tempfile

    from autoshard.tools.verify import build
    from test_unseen import CONFIGS
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(CONFIGS["switch_transformers"]))
        model, inputs = build(str(path), 2, 16, 0)
    traced = trace(model, inputs)
    prog = eval_program(traced.gm, set())
    assert not {n.target for n in prog.graph.nodes} & set(op_modes.DRAWS)
    state = {**dict(model.named_parameters(remove_duplicate=False)),
             **dict(model.named_buffers(remove_duplicate=False))}
    args = [traced.constants[p.name] if p.kind == "constant" else
            inputs[int(p.fqn.removeprefix("input"))] if p.kind == "input" else
            state.get(p.fqn, state.get(traced.module_prefix + p.fqn)).detach()
            for p in traced.placeholders]
    got = prog(*args)
    model.eval()
    with torch.no_grad():
        want = model(*inputs)
    assert torch.allclose(got[0] if isinstance(got, (tuple, list)) else got, want, rtol=1e-6)


def test_verify_fixes_exponential_draws_by_inversion() -> None:
    """Under verify's ``KeepAll`` an ``exponential_`` draw (PhiMoE's Gumbel sampling) of rate
    λ takes at each element ``-log(U) / λ`` of the element's fixed uniform, the same on every
    call and every side; rate 1 where the call gives none."""
    from autoshard.codegen.counter_rng import counter_uniform
    from autoshard.tools.draws import KeepAll
    u = counter_uniform(0, "verify", torch.arange(6))
    with KeepAll() as mode:
        got = torch.empty(2, 3).exponential_(2.0)
        unit = torch.empty(2, 3).exponential_()
    assert mode.fixed == 2
    assert torch.allclose(got.flatten(), (-u.log() / 2).float())
    assert torch.allclose(unit.flatten(), (-u.log()).float())


class Noisy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.fc(x) + 0.1 * torch.randn_like(x)).pow(2).mean()


def test_eval_mode_names_the_draws_it_keeps() -> None:
    """A draw that is no stochastic-depth mask may be the module's in eval mode too: pm.eval()
    keeps it, and says so, naming it and the line that drew it."""
    gm = trace(Noisy(), (torch.randn(4, 8),)).gm
    pm = SimpleNamespace(traced=SimpleNamespace(placeholders=[]), _compile=False)
    with pytest.warns(UserWarning, match=r"1 random draws stay.*randn_like.*drop_path_rate=0"):
        assert eval_version(gm, pm) is None
