"""``pm.eval()``: the rank program as ``model.eval()`` would run it (docs/design.md, "Modes").

A program is traced in training mode: its dropout ops draw masks and its batch norms use and
update batch statistics. In eval mode ``model.eval()`` makes dropout the identity and batch norm
use (and leave alone) its running statistics. Those are flags of the traced ops (dropout's
``train``, batch norm's ``training``, attention's ``dropout_p``), so the eval program is the
same program with those flags flipped and the update of ``num_batches_tracked`` dropped: every
node keeps its inputs and outputs, so the plan's layouts and collectives stay valid (a batch
norm the plan replicated reads the same replicated input; a dropout's output keeps its input's
layout either way). The backward, where one is run, is autograd's of the rewritten ops.
"""
from __future__ import annotations

import torch.fx as fx

from autoshard.codegen.masks import arg as _arg, unwrapped
from autoshard.ops import modes as op_modes

def mode_dependent(gm: fx.GraphModule) -> list[str]:
    """Nodes that compute otherwise in eval mode: dropout drawing masks (p > 0, train),
    attention with dropout, batch norm using and updating batch statistics (checkpointed
    layers' included)."""
    from autoshard.codegen.recompute import Checkpointed
    out = []
    for n in gm.graph.nodes:
        if isinstance(n.target, Checkpointed):
            out += mode_dependent(n.target.gm)
            continue
        if n.op != "call_function":
            continue
        target = unwrapped(n.target)
        if target in op_modes.TRAIN_FLAGS:
            p = op_modes.TRAIN_FLAGS[target][0]
            if op_modes.trains(target, n.args, n.kwargs) and (p is None or _arg(n, p, "p") != 0):
                out.append(f"{n.name} ({target})")
        elif target in op_modes.SDPA and _arg(n, op_modes.SDPA[target], "dropout_p"):
            out.append(f"{n.name} ({target})")
    return out


def eval_program(gm: fx.GraphModule, counters: set[str]) -> fx.GraphModule:
    """A copy of ``gm`` run as in eval mode; ``gm`` is left as it is. ``counters``: the
    placeholders of batch norms' ``num_batches_tracked`` buffers (not counted in eval mode)."""
    from autoshard.codegen.recompute import Checkpointed
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for n in list(graph.nodes):
        if n.op != "call_function":
            continue
        n.target = unwrapped(n.target)         # (no mask is drawn in eval mode)
        if isinstance(n.target, Checkpointed):     # the layer's program, in eval mode too
            t = n.target
            n.target = Checkpointed(eval_program(t.gm, counters), t.rt, t.layer, t.policy,
                                    t.state)
        elif n.target in op_modes.TRAIN_FLAGS:
            _set(n, op_modes.TRAIN_FLAGS[n.target][1],
                 "train" if op_modes.TRAIN_FLAGS[n.target][0] is not None else "training", False)
        elif n.target in op_modes.SDPA:
            _set(n, op_modes.SDPA[n.target], "dropout_p", 0.0)
        elif _counts(n, counters):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="AutoshardEvalProgram")


def eval_version(gm: fx.GraphModule, pm, name: str = "eval") -> fx.GraphModule | None:
    """``gm`` (a program of the ParallelModule ``pm``, as emitted) in eval mode, compiled as
    ``pm``'s programs are; None where nothing in it runs otherwise in eval mode."""
    if not mode_dependent(gm):
        return None
    counters = {ph.name for ph in pm.traced.placeholders if ph.kind == "buffer"
                and ph.fqn.endswith("num_batches_tracked")}
    prog = eval_program(gm, counters)
    if pm._compile:
        from autoshard.codegen.compile import compile_program
        prog = compile_program(prog, pm.runtime, name=name)
    return prog


def _counts(n: fx.Node, counters: set[str]) -> bool:
    """An in-place update (``aten::add_``) of a ``num_batches_tracked`` buffer."""
    schema = getattr(n.target, "_schema", None)
    return (schema is not None and schema.name.endswith("_") and bool(n.args)
            and isinstance(n.args[0], fx.Node) and n.args[0].name in counters)


def _set(n: fx.Node, i: int, name: str, value) -> None:
    if len(n.args) > i:
        args = list(n.args)
        args[i] = value
        n.args = tuple(args)
    elif name in n.kwargs:        # (absent: attention's default dropout_p, 0)
        n.kwargs = {**n.kwargs, name: value}
