"""``pm.eval()``: the rank program as ``model.eval()`` would run it (docs/design.md, "Modes").

A program is traced in training mode: its dropout ops draw masks and its batch norms use and
update batch statistics. In eval mode ``model.eval()`` makes dropout the identity and batch norm
use (and leave alone) its running statistics. Those are flags of the traced ops (dropout's
``train``, batch norm's ``training``, attention's ``dropout_p``), so the eval program is the
same program with those flags flipped and the update of ``num_batches_tracked`` dropped: every
node keeps its inputs and outputs, so the plan's layouts and collectives stay valid (a batch
norm the plan replicated reads the same replicated input; a dropout's output keeps its input's
layout either way). The backward, where one is run, is autograd's of the rewritten ops.

Stochastic depth (drop path) has no flag: its module skips the mask in Python when it is not
training, and the trace holds the draw. Its mask is a Bernoulli draw of keep probability ``q``
that scales the branch by ``mask / q``, so the eval program fills the mask with its mean ``q``
and the branch passes unscaled, as ``model.eval()`` runs it (up to rounding of ``x / q * q``).
The two idioms are recognised: ``bernoulli_(q)`` (timm) and ``floor(q + U)`` for ``U``
uniform on [0, 1) (Hugging Face). Multiplicative jitter, ``x * U`` for ``U`` uniform on
[1 - e, 1 + e) (Switch Transformers' router, which jitters only in training), has no flag
either: the eval program fills its draw with 1, so ``x`` passes exactly. Any other random draw
is kept, with a warning naming it: the trace cannot say whether the module draws it in eval
mode too.
"""
from __future__ import annotations

import warnings

import torch
import torch.fx as fx

from autoshard.codegen.masks import arg as _arg, unwrapped
from autoshard.ops import modes as op_modes

aten = torch.ops.aten


def mode_dependent(gm: fx.GraphModule) -> list[str]:
    """Nodes that compute otherwise in eval mode: dropout drawing masks (p > 0, train),
    attention with dropout, batch norm using and updating batch statistics, a stochastic-depth
    mask (checkpointed layers' included)."""
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
        elif mask_mean(n) is not None or jitter(n):
            out.append(f"{n.name} ({target})")
    return out


def jitter(n: fx.Node) -> bool:
    """Whether ``n`` draws a multiplicative jitter (the module's docstring): uniform on [lo,
    hi) with lo + hi = 2 and lo < hi, every use of it a multiplication (through reshards)."""
    from autoshard.codegen.rewrite import ReshardCall
    t = unwrapped(n.target) if n.op == "call_function" else None
    if t not in op_modes.JITTER:
        return False
    i = op_modes.JITTER[t]
    lo, hi = _arg(n, i, "from"), _arg(n, i + 1, "to")
    if not (isinstance(lo, (int, float)) and isinstance(hi, (int, float))
            and lo < hi and abs(lo + hi - 2) < 1e-9):
        return False
    uses, seen = list(n.users), 0
    while uses:
        u = uses.pop()
        if isinstance(u.target, ReshardCall):
            uses += list(u.users)
        elif unwrapped(u.target) not in op_modes.JITTER_USES:
            return False
        seen += 1
    return seen > 0


def mask_mean(n: fx.Node) -> float | None:
    """The keep probability of the stochastic-depth mask ``n`` draws (the module's docstring),
    or None where ``n`` draws none."""
    t = unwrapped(n.target)
    if t in op_modes.BERNOULLI:
        i = op_modes.BERNOULLI[t]
        q = _arg(n, i, "p")
        if q is None:           # (the trace leaves out an argument at its default, 0.5)
            q = t._schema.arguments[i].default_value
    elif t in op_modes.FLOORS and isinstance(n.args[0], fx.Node) \
            and n.args[0].target in (aten.add.Tensor, aten.add.Scalar):
        a, b = n.args[0].args[:2]
        draw, q = (a, b) if isinstance(a, fx.Node) else (b, a)
        if not (isinstance(draw, fx.Node) and _uniform_draw(draw) is not None):
            return None
    else:
        return None
    return float(q) if isinstance(q, (int, float)) and 0 <= q <= 1 else None


def _other_draws(gm: fx.GraphModule) -> list[str]:
    """The random draws of an eval program that no mask rewrite consumed (checkpointed layers'
    included)."""
    from autoshard.codegen.recompute import Checkpointed
    out = []
    for n in gm.graph.nodes:
        if isinstance(n.target, Checkpointed):
            out += _other_draws(n.target.gm)
        elif n.op == "call_function" and unwrapped(n.target) in op_modes.DRAWS:
            source = n.meta.get("stack_trace", "").strip().splitlines()
            out.append(f"{n.name} ({unwrapped(n.target)})"
                       + (f" at {source[-2].strip()}" if len(source) > 1 else ""))
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
        elif (q := mask_mean(n)) is not None:
            _fill_mask(n, q)
        elif jitter(n):
            _fill_mask(n, 1.0)
        elif _counts(n, counters):
            n.replace_all_uses_with(n.args[0])
            graph.erase_node(n)
    graph.lint()
    return fx.GraphModule(gm, graph, class_name="AutoshardEvalProgram")


def _fill_mask(n: fx.Node, q: float) -> None:
    """The mask ``n`` draws filled with its mean ``q`` instead, in place where ``n`` draws in
    place; ``floor(q + U)``'s uniform draw, read by nothing else, made zeros (no draw; the
    sum keeps its shape for the fill)."""
    if n.target in op_modes.FLOORS:
        draw = _uniform_draw(next(a for a in n.args[0].args[:2] if isinstance(a, fx.Node)),
                             only_use=True)
        if draw is not None:
            draw.target = op_modes.NO_DRAW[unwrapped(draw.target)]
    in_place = n.target._schema.name.endswith("_")
    n.target = aten.fill_.Scalar if in_place else aten.fill.Scalar
    n.args, n.kwargs = (n.args[0], q), {}


def _uniform_draw(n: fx.Node, only_use: bool = False) -> fx.Node | None:
    """The uniform draw ``n`` is, or is a reshard of (a slice of the whole draw), or None; with
    ``only_use``, None unless each tensor on the way is read once."""
    from autoshard.codegen.rewrite import ReshardCall
    while isinstance(n.target, ReshardCall):
        if only_use and len(n.users) != 1:
            return None
        n = n.args[0]
    if unwrapped(n.target) not in op_modes.UNIFORM or (only_use and len(n.users) != 1):
        return None
    return n


def eval_version(gm: fx.GraphModule, pm, name: str = "eval") -> fx.GraphModule | None:
    """``gm`` (a program of the ParallelModule ``pm``, as emitted) in eval mode, compiled as
    ``pm``'s programs are; None where nothing in it runs otherwise in eval mode."""
    prog = None
    if mode_dependent(gm):
        counters = {ph.name for ph in pm.traced.placeholders if ph.kind == "buffer"
                    and ph.fqn.endswith("num_batches_tracked")}
        prog = eval_program(gm, counters)
    draws = _other_draws(gm if prog is None else prog)
    if draws:
        warnings.warn(f"pm.eval(): {len(draws)} random draws stay in the eval program, as "
                      f"traced in training mode: {'; '.join(draws[:5])}. Whether the module draws "
                      "them in eval mode too is decided in Python, which the trace cannot see; "
                      "if it draws them only in training, evaluate a model built without them "
                      "(e.g. drop_path_rate=0)",
                      stacklevel=3)
    if prog is None:
        return None
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
