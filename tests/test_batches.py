"""trace/batches.py: a graph made from the batch-generic export is the concrete trace's graph
at that batch, node for node, or it is not used at all."""
from __future__ import annotations

import pytest
import torch

from autoshard.errors import AutoshardError
from autoshard.trace.batches import Traces, sliced
from autoshard.trace.export import trace
from autoshard.zoo.registry import load_model


def _traces(name: str, batch: int = 12, **kw) -> Traces:
    seq = None if name.startswith("mlp") else 8
    model, inputs = load_model(name, batch=batch, seq=seq, device="meta")
    return Traces(model, inputs, training=kw.pop("training", True), **kw)


@pytest.mark.parametrize("name", ["mlp-tiny", "gpt2-tiny-4l", "bert-tiny", "hf-bert-tiny"])
def test_rebatched_graph_is_the_concrete_trace(name):
    traces = _traces(name)
    first = traces.at(6)                  # concrete, and the generic export proven on it
    assert traces.stats["exported"] == 1
    for batch in (4, 2, 12):
        graph = traces.at(batch)
        model, inputs = load_model(name, batch=batch, seq=None if name.startswith("mlp") else 8,
                                   device="meta")
        concrete = trace(model, inputs)
        assert graph.fingerprint == concrete.fingerprint
        assert graph.node_sigs == concrete.node_sigs
        assert [p.fqn for p in graph.placeholders] == [p.fqn for p in concrete.placeholders]
        assert [l.name for l in graph.layers] == [l.name for l in concrete.layers]
    assert traces.stats == {**traces.stats, "exported": 1, "rebatched": 3}
    assert traces.at(6) is first          # cached


def test_unproven_model_is_traced_concretely_every_time():
    """Hugging Face Llama's export under a symbolic batch keeps slices a concrete export folds:
    the generic graph differs, so every batch is a concrete trace (and still the right graph).
    (The zoo's Llama, whose attention takes grouped K/V whole, now rebatches.)"""
    traces = _traces("hf-llama-tiny")
    traces.at(6)
    graph = traces.at(4)
    assert traces.stats["exported"] == 2 and traces.stats["rebatched"] == 0
    model, inputs = load_model("hf-llama-tiny", batch=4, seq=8, device="meta")
    assert graph.fingerprint == trace(model, inputs).fingerprint


def test_rebatched_graph_prices_like_the_concrete_one():
    """What the planner reads of a graph: every node's output shapes at the new batch."""
    traces = _traces("gpt2-tiny-4l")
    traces.at(6)
    g = traces.at(3)
    assert g.inputs[0].info.shape == (3, 8)
    shapes = [tuple(n.meta["val"].shape) for n in g.graph.nodes
              if isinstance(n.meta.get("val"), torch.Tensor) and n.op == "call_function"]
    assert any(s[:2] == (3, 8) for s in shapes)
    assert not any(6 in s[:1] for s in shapes)


def test_inference_and_bf16_traces():
    traces = _traces("gpt2-tiny-4l", training=False, precision="bf16-mixed")
    traces.at(6)
    g = traces.at(2)
    assert traces.stats["rebatched"] == 1
    assert any(n.meta["val"].dtype == torch.bfloat16 for n in g.graph.nodes
               if isinstance(n.meta.get("val"), torch.Tensor))


def test_batch_must_divide_the_examples():
    traces = _traces("gpt2-tiny-4l")
    with pytest.raises(AutoshardError, match="divides the example batch 12"):
        traces.at(5)


def test_sliced_keeps_non_batch_inputs():
    x, y, w = torch.zeros(8, 3), torch.zeros(8), torch.zeros(3, 3)
    a, b, c = sliced((x, y, w), 2)
    assert a.shape == (2, 3) and b.shape == (2,) and c.shape == (3, 3)


def test_rebatched_graph_keeps_which_parameters_train():
    """A parameter's traced value carries its requires_grad, which tells a frozen parameter
    (no gradient, sync or optimizer state) from a trained one: the rebatched graph keeps it
    (it once left every parameter frozen, and a mesh search planned no gradient sync)."""
    from autoshard.cost.reshards import frozen
    model, inputs = load_model("gpt2-tiny-4l", batch=8, seq=8, device="meta")
    model.tok_emb.weight.requires_grad_(False)
    traces = Traces(model, inputs, training=True)
    for batch in (8, 4, 2):
        traced = traces.at(batch)
        nodes = {n.name: n for n in traced.graph.nodes}
        assert {p.fqn for p in traced.params if frozen(nodes[p.name])} == {"tok_emb.weight"}


def test_op_info_is_computed_once_per_node_and_again_once_rewritten():
    """Every Pricer asks for every node's OpInfo: it is kept on the node, and a node whose
    arguments are rewritten (a new args tuple, as codegen's rewrite makes) gets a new one that
    describes them."""
    from autoshard.trace.export import op_info
    graph = _traces("gpt2-tiny-4l").at(12).graph
    node = next(n for n in graph.nodes if n.op == "call_function"
                and n.target is torch.ops.aten.linear.default)
    first = op_info(node)
    assert op_info(node) is first
    x = node.args[0]
    node.args = (x, *node.args[1:])         # same values, new tuple: computed again, equal
    again = op_info(node)
    assert again is not first and again == first
    node.args = (node.args[1], *node.args[1:])     # the weight read as the activation too
    changed = op_info(node)
    assert changed.inputs[0] == changed.inputs[1] != first.inputs[0]
    node.args = (x, *node.args[1:])
