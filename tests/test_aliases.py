"""In-place writes through views (trace/aliases.py): BEiT and Data2Vec-Vision build their
relative position index by writing into slices of zeros and read it through a view of the
zeros afterwards. A plan that resharded a slice (or the zeros) put the write into the reshard's
copy: the ranks read an index of zeros, and the bias table's gradient landed all in row 0."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoshard import Mesh
from autoshard.ir import Replicate, Shard
from autoshard.solver.baselines import baseline_plan
from autoshard.solver.planner import plan_traced
from autoshard.tools.verify import VerifySpec, build, plan_for, summarize, verify_rank
from autoshard.trace.aliases import pinned_reads
from autoshard.trace.export import trace
from autoshard.trace.graph import value_inputs
from dist import world_fixture

aten = torch.ops.aten
MODEL = f"{Path(__file__).parent / 'data' / 'relative_bias_model.py'}:make"
ROUTER = f"{Path(__file__).parent / 'data' / 'scatter_router_model.py'}:make"
world2 = world_fixture(2, timeout_s=300)


def _traced():
    model, inputs = build(MODEL, None, None, 0)
    return trace(model, inputs)


def _even_write(graph):
    """A ``copy_`` into a slice of the zeros that splits evenly over 2 (its rows)."""
    write = next(n for n in graph.nodes if n.target is aten.copy_.default
                 and n.args[0].meta["val"].shape[0] % 2 == 0)
    assert (write.name, 0) in pinned_reads(graph)
    return write


def test_the_reads_a_write_through_a_view_pins() -> None:
    """Closed form: the index's writes go into views of one ``zeros``; each view of it made
    before a write, and each written input, is pinned. The final view, made after every
    write, and the table lookup through it read the finished index (free), and ``copy_``'s
    source is only read (free)."""
    traced = _traced()
    graph = traced.gm.graph
    pinned = pinned_reads(graph)
    zeros = next(n for n in graph.nodes if n.target is aten.zeros.default)
    writes = [n for n in graph.nodes
              if n.target in (aten.copy_.default, aten.fill_.Tensor, aten.fill_.Scalar)]
    assert len(writes) >= 4
    order = {n.name: i for i, n in enumerate(graph.nodes)}
    last = max(order[w.name] for w in writes)
    views = sorted(zeros.users, key=lambda u: order[u.name])
    assert [order[u.name] < last for u in views].count(False) == 1    # the final view
    for user in views:                # the slices and selects, then the final view
        assert ((user.name, 0) in pinned) == (order[user.name] < last), user.name
    for w in writes:
        assert (w.name, 0) in pinned, w.name
        if len(value_inputs(w)) > 1:
            assert (w.name, 1) not in pinned, w.name
    lookup = next(n for n in graph.nodes if n.target is aten.index.Tensor)
    assert (lookup.name, 1) not in pinned
    # Nothing else: nothing writes into the values the batch flows through.
    batch = {p.name for p in traced.placeholders if p.kind == "input"}
    for n in graph.nodes:
        if any(a.name in batch for a in n.all_input_nodes):
            batch.add(n.name)
    assert len(batch) > 10 and not {c for c, _ in pinned} & batch


@pytest.mark.parametrize("mesh, baseline", [((2,), None), ((2,), "dp"), ((2, 2), None)])
def test_a_plan_reads_every_pinned_value_as_it_lies(mesh, baseline) -> None:
    """Structural: no plan reshards a pinned read (the solver prices it as forbidden), whatever
    the rest of the plan does."""
    traced = _traced()
    m = Mesh(mesh, cluster="stress")
    plan = baseline_plan(traced, m, baseline) if baseline else plan_traced(traced, m)
    strategies = plan.strategies()
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    pinned = pinned_reads(traced.gm.graph)
    for consumer, k in pinned:
        src, out = value_inputs(nodes[consumer])[k]
        assert strategies[consumer].inputs[k] == strategies[src].outputs[out], (consumer, k)


@pytest.mark.parametrize("baseline", [None, "dp"])
def test_the_relative_position_index_reaches_the_ranks(world2, baseline) -> None:
    """Numerical: the step on 2 gloo ranks equals one device (loss and every gradient within
    1e-5). Before, the ranks' index was zeros inside: the table's gradient was 2.8 off."""
    plan = plan_for(MODEL, Mesh((2,), cluster="stress"), baseline=baseline)
    spec = VerifySpec(MODEL, plan.mesh_shape, plan.mesh_axes, plan.dumps(), None, None)
    ok, text = summarize(world2.run(verify_rank, spec))
    assert ok, text


def test_a_plan_that_reshards_a_pinned_read_is_refused() -> None:
    """Structural: a plan edited by hand (or pinned) so that a write into a slice of the zeros
    reads the slice in another layout makes no step program, hence neither a prediction nor a
    rank program: the error names the value, its reader and the two layouts (the solver's
    price alone would let a loaded plan run wrong)."""
    import dataclasses

    from autoshard.cost.program import step_program
    from autoshard.errors import AutoshardError
    from autoshard.ir import S, spec_str
    traced = _traced()
    plan = plan_traced(traced, Mesh((2,), cluster="stress"))
    strategies = dict(plan.strategies())
    graph = traced.gm.graph
    write = _even_write(graph)
    lies = strategies[write.name].inputs[0]
    other = (Replicate(),) if lies != (Replicate(),) else (S(0),)
    inputs = (other, *strategies[write.name].inputs[1:])
    strategies[write.name] = dataclasses.replace(strategies[write.name], inputs=inputs)
    with pytest.raises(AutoshardError) as e:
        step_program(traced, strategies, (2,), bucket_bytes=plan.options.bucket_bytes)
    text = str(e.value)
    assert f"{write.args[0].name} (output 0) for {write.name} input 0" in text
    assert f"from {spec_str(lies)} to {spec_str(other)}" in text
    # The read after every write is free: the same edit there is a plan like any other.
    lookup = next(n for n in graph.nodes if n.target is aten.index.Tensor)
    strategies = dict(plan.strategies())
    index, out = value_inputs(lookup)[1]
    assert strategies[index].outputs[out] == (Replicate(),)
    inputs = list(strategies[lookup.name].inputs)
    inputs[1] = (S(0),)
    strategies[lookup.name] = dataclasses.replace(strategies[lookup.name], inputs=tuple(inputs))
    program = step_program(traced, strategies, (2,), bucket_bytes=plan.options.bucket_bytes)
    assert any((lookup.name, 1) in e.consumers for e in program.edges)


@pytest.mark.parametrize("through_result", [True, False])
def test_a_write_read_through_its_result_alone_may_take_a_copy(through_result) -> None:
    """Closed form: a router's ``full_like(..).scatter_(..)`` (Llama-4, DeepSeek-V3): a reshard
    into ``scatter_`` gives it a copy, which its result holds; only when the storage is read
    again other than through the result (a view made before the write) must the write land in
    it. (A trace reads the tensor written as the write's result: the tracer moves its proxy
    there.)"""
    traced = trace(*build(ROUTER if through_result else ROUTER + "_read_before", None, None, 0))
    graph = traced.gm.graph
    scatter = next(n for n in graph.nodes if n.target is aten.scatter_.src)
    assert ((scatter.name, 0) in pinned_reads(graph)) is not through_result


def test_verify_refuses_a_plan_file_that_reshards_a_pinned_read(tmp_path, capsys) -> None:
    """Bad input: a plan file edited so that a write into a slice of the zeros reads the slice
    in another layout is refused in one line that names the reshard, before any rank runs (it
    would have run, the write landing in a copy, silently unlike the model)."""
    import json

    from autoshard.tools.cli import main
    traced = _traced()
    plan = json.loads(plan_traced(traced, Mesh((2,), cluster="stress")).dumps())
    write = _even_write(traced.gm.graph)
    node = next(n for n in plan["nodes"] if n["name"] == write.name)
    lies = node["inputs"][0]                 # as the plan reads it: as the slice lies
    other = node["inputs"][0] = "[S(0)]" if lies == "[R]" else "[R]"
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(plan))
    assert main(["verify", MODEL, "--mesh", "2", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error:") and err.count("\n") == 1, err
    assert f"{write.args[0].name} (output 0) for {write.name} input 0, from {lies} to {other}" \
        in err, err


def test_a_write_into_a_resharded_copy_trains_as_one_device(world2) -> None:
    """Numerical: ``full_like(logits, -inf).scatter_(1, idx, top)`` run replicated (a plan
    edited so) while the logits split with the batch, so the ``-inf`` tensor is all-gathered
    into ``scatter_`` and the write lands in that copy, which the rest reads through the
    write's result (a read no longer pinned): loss and gradients on 2 gloo ranks equal one
    device's."""
    import dataclasses

    from autoshard.solver.assemble import assemble
    model, inputs = build(ROUTER, None, None, 0)
    traced = trace(model, inputs)
    graph = traced.gm.graph
    scatter = next(n for n in graph.nodes if n.target is aten.scatter_.src)
    full = next(n for n in graph.nodes if n.target is aten.full_like.default)
    assert not {r for r in pinned_reads(graph) if r[0] == scatter.name}
    mesh = Mesh((2,), cluster="stress")
    solved = plan_traced(traced, mesh)
    strategies = dict(solved.strategies())
    assert strategies[scatter.name].inputs == ((Shard(0),),) * 3   # the rule's: tokens split
    whole = (Replicate(),)
    strategies[scatter.name] = dataclasses.replace(strategies[scatter.name],
                                                   inputs=(whole,) * 3, outputs=(whole,))
    plan = assemble(traced, mesh, strategies, solved.options, solver=dict(solved.solver),
                    model_name=solved.model, timings={})
    assert strategies[full.name].outputs[0] == (Shard(0),)
    assert any(c.kind == "all_gather" and c.node == scatter.name for c in plan.collectives)
    spec = VerifySpec(ROUTER, plan.mesh_shape, plan.mesh_axes, plan.dumps(), None, None)
    ok, text = summarize(world2.run(verify_rank, spec))
    assert ok, text
