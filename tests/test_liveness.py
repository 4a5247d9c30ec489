"""Peak memory over the whole step from liveness (autoshard/cost/liveness.py, docs/cost-model.md
§4.5): hand-computed peaks of a small MLP, what checkpointing and ZeRO-3 gathers change, and one
prediction against a peak measured on gloo ranks.

The MLP: two identical blocks ``Linear(d, 2d) -> ReLU -> Linear(2d, d)`` (no biases), MSE loss,
fp32, batch B. With ``a = B·d·4`` bytes (one block output) the forward keeps, per block, the
ReLU output (2a, saved by the ReLU and the second Linear) and the block's input (saved by the
first Linear); every weight is ``2d·d·4 = a`` bytes when B = 2d.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from autoshard import Mesh, with_loss
from autoshard.errors import AutoshardError
from autoshard.cost.liveness import MemoryBreakdown, step_memory
from autoshard.cost.price import Pricer
from autoshard.solver.alternatives import plan_stored
from autoshard.solver.baselines import baseline_plan, zero3_layouts
from autoshard.solver.planner import plan_traced
from autoshard.trace.export import trace
from autoshard.trace.layers import checkpointable
from autoshard.tools.verify import VerifySpec, build, verify_rank
from dist import world_fixture

B, D = 32, 16
A = B * D * 4                    # bytes of one (B, d) fp32 activation: 2048
W = 2 * D * D * 4                # bytes of one weight: 2048 (= A)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, 2 * d, bias=False)
        self.down = nn.Linear(2 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int = D, n: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    return trace(with_loss(Net(), nn.MSELoss()), (torch.randn(B, D), torch.randn(B, D)))


def predict(traced, plan, recompute=None, **kw) -> MemoryBreakdown:
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster=plan.cluster)
    layers = dict(plan.recompute) if recompute is None else recompute
    return step_memory(traced, plan.strategies(), Pricer(traced, mesh, plan.options,
                                                         recompute=layers), **kw)


def parts(m: MemoryBreakdown) -> int:
    return m.parameters + m.gradients + m.optimizer + m.activations + m.temporaries


# ------------------------------------------------------------------------ closed forms

def test_mlp_on_one_device_peaks_where_hand_computed(mlp):
    plan = plan_traced(mlp, Mesh((1,), cluster="stress"), recompute="none")
    m = predict(mlp, plan)
    # Always alive: 4 weights (4W), their two Adam moments (8W), the input and target (2a).
    base = 4 * W + 8 * W + 2 * A
    # Forward, at the second ReLU: block 0 keeps u0 (2a) and y0 (a); block 1 holds its first
    # Linear's output (2a, freed once the ReLU has read it) and the ReLU's output (2a): 7a.
    assert m.phases["forward"] == base + 7 * A
    # Backward, at the second ReLU's backward: u0, y0, u1 (5a) + the gradient of u1 (2a) and of
    # the first Linear's output (2a) + the last weight's gradient in .grad (W = a): 10a.
    assert (m.peak, m.phase, m.at) == (base + 10 * A, "backward", "relu_1")
    assert (m.gradients, m.activations, m.temporaries) == (W, 2 * A + 5 * A, 4 * A)
    assert (m.parameters, m.optimizer, m.host) == (4 * W, 8 * W, 0)
    assert m.state == {"parameters": 4 * W, "gradients": 4 * W, "optimizer": 8 * W, "host": 0}
    # The AdamW step (fused, pm.optimizer's default): every gradient (4W), no temporaries.
    assert m.phases["optimizer"] == base + 4 * W
    assert parts(m) == m.peak


def test_recomputation_takes_saved_bytes_out_of_the_forward_peak(mlp):
    mesh = Mesh((1,), cluster="stress")
    plain = predict(mlp, plan_traced(mlp, mesh, recompute="none"))
    full = predict(mlp, plan_traced(mlp, mesh, recompute="full"))
    assert set(checkpointable(mlp.graph, mlp.layers)) == {"model.layers.0", "model.layers.1"}
    base = 12 * W + 2 * A
    # Forward: block 0 keeps nothing of its own; block 1 keeps its input y0 (a), and at its
    # ReLU holds 2a + 2a as before: 5a, block 0's ReLU output (2a) has left the peak.
    assert full.phases["forward"] == base + 5 * A == plain.phases["forward"] - 2 * A
    # Backward: block 1 runs forward again while block 0 keeps only y0. At block 0's ReLU
    # backward (after its own recomputation): u0 (2a) + gradients of u0 and a0 (4a) + three
    # weight gradients (3W): 9a, one a under the plain step's 10a.
    assert (full.peak, full.phase, full.at) == (base + 9 * A, "backward", "relu")
    assert full.gradients == 3 * W
    assert parts(full) == full.peak


def test_selective_recomputation_keeps_the_matmul_outputs(mlp):
    mesh = Mesh((1,), cluster="stress")
    plan = plan_traced(mlp, mesh, recompute="selective")
    assert set(plan.recompute.values()) == {"selective"}
    log: list = []
    m = predict(mlp, plan, log=log)
    base = 12 * W + 2 * A
    # Forward: each block keeps its two linears' outputs (2a + a) and drops the ReLU's (2a,
    # recomputed from the first linear's); at the last linear: a0, y0, a1, u1 and y1: 8a.
    assert m.phases["forward"] == base + 8 * A
    assert [b for phase, _, b in log if phase == "forward"][-1] == base + 6 * A + 4
    # Backward: block 1's recomputation hands a1 and y1 back and makes u1 again; at its ReLU's
    # backward a0, y0, u1 + the gradients of u1 and a1 + one weight gradient: 10a.
    assert (m.peak, m.phase, m.at) == (base + 10 * A, "backward", "relu_1")


def test_a_zero3_weight_gathered_for_a_matmul_lives_while_it_is_used(mlp):
    mesh = Mesh((2,), cluster="stress")
    plan = plan_stored(mlp, mesh, zero3_layouts(mlp, mesh))
    assert {n.outputs[0][0].__class__.__name__ for n in plan.nodes
            if n.name.startswith("p_")} == {"Shard"}
    layers = frozenset(checkpointable(mlp.graph, mlp.layers))
    # Per rank: half of every weight and of the batch.
    w, u, y = W // 2, 2 * A // 2, A // 2
    base = 4 * w + 8 * w + 2 * y
    kept, again = [], []
    plain = predict(mlp, plan, recompute=frozenset(), log=kept)
    full = predict(mlp, plan, recompute=layers, log=again)

    def end_of_forward(log):
        return [b for phase, _, b in log if phase == "forward"][-1]

    # Without checkpointing each linear keeps the whole weight it gathered until its backward:
    # all four gathered copies (4W) are alive when the forward ends, beside u0, y0, u1, y1 and
    # the loss (4 bytes, and 4 more once all-reduced).
    assert end_of_forward(kept) == base + 4 * W + 2 * u + 2 * y + 8
    # Checkpointed, a gathered weight lives from its gather to its linear: none is left when the
    # forward ends (block 1 keeps y0, the loss keeps y1), and the forward's peak holds one.
    assert end_of_forward(again) == base + 2 * y + 8
    assert full.phases["forward"] == base + W + y + u + y     # at the last linear: W3, y0, u1, y1
    # In backward each layer gathers its weights again; the optimizer step sees none of them.
    assert plain.phases["optimizer"] == full.phases["optimizer"] == base + 4 * w
    assert full.peak < plain.peak


def test_forward_only_holds_parameters_and_the_live_activations():
    torch.manual_seed(0)
    traced = trace(Net(), (torch.randn(B, D),), training=False)
    plan = plan_traced(traced, Mesh((1,), cluster="stress"))
    m = predict(traced, plan)
    # Parameters only (no gradient, no optimizer state); at the second ReLU: the input (a),
    # the first Linear's output and the ReLU's (2a + 2a).
    assert (m.phase, m.at, m.peak) == ("forward", "relu", 4 * W + 5 * A)
    assert (m.gradients, m.optimizer, m.temporaries) == (0, 0, 0)
    assert set(m.phases) == {"forward"}


def test_model_state_without_pricer_state_bytes_comes_from_param_state_bytes(mlp):
    plan = plan_traced(mlp, Mesh((2,), cluster="stress"), recompute="none")
    mesh = Mesh(plan.mesh_shape, plan.mesh_axes, cluster=plan.cluster)
    pricer = Pricer(mesh=mesh, traced=mlp, options=plan.options)

    class Older:                     # a Pricer from before state_bytes
        def __getattr__(self, name):
            if name == "state_bytes":
                raise AttributeError(name)
            return getattr(pricer, name)

    older = step_memory(mlp, plan.strategies(), Older())
    assert older == step_memory(mlp, plan.strategies(), pricer)
    assert older.to_json()["peak"] == older.peak and older.to_json()["phases"] == older.phases


def test_the_optimizer_update_holds_what_its_implementation_makes(mlp):
    """The fused kernel (pm.optimizer's default) makes no temporaries; the single-tensor loop
    two moments of a parameter and one of the previous; foreach one of every variance."""
    plan = plan_traced(mlp, Mesh((1,), cluster="stress"), recompute="none")
    base = 12 * W + 2 * A
    assert predict(mlp, plan).phases["optimizer"] == base + 4 * W
    assert predict(mlp, plan, update="loop").phases["optimizer"] == base + 4 * W + 3 * W
    assert predict(mlp, plan, update="foreach").phases["optimizer"] == base + 4 * W + 4 * W
    with pytest.raises(AutoshardError, match="fused"):
        predict(mlp, plan, update="adam")


# ------------------------------------------------------------------------ a transformer

@pytest.fixture(scope="module")
def gpt2():
    return trace(*build("gpt2-tiny", None, None, 0))


def test_checkpointing_a_transformer_lowers_its_forward_peak(gpt2):
    mesh = Mesh((4,), cluster="stress")
    plain = predict(gpt2, baseline_plan(gpt2, mesh, "megatron", recompute="none"))
    full = predict(gpt2, baseline_plan(gpt2, mesh, "megatron", recompute="full"))
    assert full.phases["forward"] < plain.phases["forward"]
    assert full.peak < plain.peak
    for m in (plain, full):
        assert parts(m) == m.peak and m.phase in ("forward", "backward", "optimizer")


# ------------------------------------------------------------------------ measured

world2 = world_fixture(2, timeout_s=120)


def test_prediction_matches_the_peak_measured_on_two_gloo_ranks(world2, gpt2):
    """Data parallel gpt2-tiny on 2 ranks: parameters, Adam state, the bucket that all-reduces
    every gradient, and the activations alive when backward allocates it. MemTracker on CPU
    (autoshard verify's measurement) sees the same bytes."""
    mesh = Mesh((2,), cluster="stress")
    plan = baseline_plan(gpt2, mesh, "dp")
    m = predict(gpt2, plan)
    reports = world2.run(verify_rank, VerifySpec("gpt2-tiny", plan.mesh_shape, plan.mesh_axes,
                                                 plan.dumps()))
    measured = max(r["memory"]["measured"] for r in reports)
    assert m.phase == "backward"
    assert abs(m.peak - measured) / measured < 0.02, (m, measured)
