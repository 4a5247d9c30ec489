"""The rank program compiled with inductor, region by region (``parallelize(..., compile=True)``).

The rank program (codegen/rewrite.py) is an ATen FX graph whose collectives are calls of
``torch.distributed._functional_collectives``. Traced by AOTAutograd (``compile_fx``, the entry
``torch.compile`` hands a Dynamo graph to), each reshard's forward steps and the backward steps
of its autograd function become ``_c10d_functional`` nodes of the forward and backward graphs,
which inductor schedules among the fused kernels (torch/_inductor/comms.py reorders them for
overlap), as SimpleFSDP and autoparallel compile their collectives.

What cannot enter a traced graph runs eagerly between the compiled regions, node by node as
today, and the graph is split there (``torch.fx.passes.split_module``):

- a bucketed gradient sync (its backward hands the gradient to a bucket, host-side
  bookkeeping that issues the bucket's all-reduce when it fills: codegen/buckets.py). A
  parameter's sync is first moved up to the program's inputs, where it splits nothing, and the
  program is cut into a region per layer instead, so that each layer's syncs start when its
  backward is done, overlapping the earlier layers' backward;
- a host copy of an offloaded parameter (codegen/hostlink.py: pinned buffers kept between
  steps);
- ring attention's kernel (codegen/ring.py): its point-to-point sends to the ring
  neighbours are not functional collectives a traced graph can hold;
- a checkpointed layer's call: ``torch.utils.checkpoint`` stays eager around the layer's own
  regions, compiled inside it, so that forward keeps the layer's inputs only and backward runs
  the compiled forward again, its collectives included. Under selective checkpointing the policy
  chooses op by op what to keep, which a compiled kernel hides: such a layer runs eagerly, with
  a warning naming it.

A region that fails to compile, or whose compiled graphs do not hold the collectives its trace
recorded, runs eagerly with a warning naming its first and last op.

**Draws kept eager for verify.** Inductor draws a compiled region's dropout masks and random
values from its own generator, which no dispatch mode reaches, so ``autoshard verify
--compile`` could not give them the fixed values (tools/draws.py ``KeepAll``) the eager run
compared with one device had. Under :func:`eager_draws` every op that draws runs eagerly between
the regions, where ``KeepAll`` sees it; the regions around it compile as they would.

**The byte ledger.** A traced region's Python runs once, at compile time, on fake tensors: its
collectives write their records then (each ``S`` measured on the fake tensor, whose shape is
the real one). Those records are checked, kind and bytes in order, against the collective nodes
of the forward and backward graphs inductor compiles, and each call of the region adds them to
the ledger again: the forward's as it runs (in the phase the rank is in: "recompute" when a
checkpointed layer runs again), the backward's when the region's backward has produced its
inputs' gradients (:class:`_BackwardMark`). So ``autoshard verify --compile`` compares the
compiled program's collectives, as compiled, with the plan.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import operator
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx

from autoshard.codegen.collectives import ExecutedCollective, Ledger
from autoshard.ir import CollectiveKind, Phase
from autoshard.ops import modes as op_modes

# The functional collectives of a traced graph, as the ledger names them; each moves the bytes
# of its input (all-gather: its output), as codegen/collectives.py measures S.
_KINDS = {"all_gather_into_tensor": CollectiveKind.ALL_GATHER,
          "reduce_scatter_tensor": CollectiveKind.REDUCE_SCATTER,
          "all_reduce": CollectiveKind.ALL_REDUCE, "all_to_all_single": CollectiveKind.ALL_TO_ALL}


# The ledger phases of collectives a backward runs (codegen/collectives.py Redistribute).
BACKWARD_PHASES = (Phase.BACKWARD, Phase.GRAD_SYNC)

# Whether the programs compiled now keep their random draws eager (:func:`eager_draws`).
_EAGER_DRAWS = contextvars.ContextVar("autoshard_eager_draws", default=False)


@contextlib.contextmanager
def eager_draws() -> Iterator[None]:
    """Programs compiled inside run every op that draws eagerly, between their regions (the
    module's docstring)."""
    token = _EAGER_DRAWS.set(True)
    try:
        yield
    finally:
        _EAGER_DRAWS.reset(token)


class CompileFallback(UserWarning):
    """A region of the rank program runs eagerly under ``compile=True``."""


def compile_program(gm: fx.GraphModule, runtime: Any, *, name: str = "program",
                    layer_of: dict[str, str] | None = None) -> fx.GraphModule:
    """``gm`` with every run of traceable nodes replaced by a :class:`CompiledRegion`; the nodes
    that must stay eager (see the module's docstring) run between them. ``name`` prefixes the
    regions' names in warnings (a pipeline stage, a checkpointed layer). ``layer_of``: the
    layer of each op of the traced graph by name; where the program syncs gradients, a region
    ends with each layer (:func:`_partition`)."""
    from autoshard.codegen.recompute import Checkpointed
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, Checkpointed):
            _compile_checkpointed(node.target, runtime)
    syncs = any(_is_sync(n) for n in gm.graph.nodes)
    if syncs:
        _hoist_syncs(gm)
    ids = _partition(gm.graph, layer_of if syncs else None)
    if not any(compiled for _, compiled in ids.values()):
        return gm
    from torch.fx.passes.split_module import split_module
    split = split_module(gm, gm, lambda n: ids[n.name][0], keep_original_order=True)
    for child_name, child in list(split.named_children()):
        k = int(child_name.removeprefix("submod_"))
        if _region_compiled(ids, k):
            ops = [n.name for n in child.graph.nodes if n.op == "call_function"]
            label = f"{name}: {ops[0]} .. {ops[-1]}" if ops else name
            setattr(split, child_name, CompiledRegion(child, runtime, label))
    split.meta.update(gm.meta)
    return split


def _hoist_syncs(gm: fx.GraphModule) -> None:
    """Each bucketed gradient sync of a parameter moved up to the program's inputs, so that the
    traceable ops around it make one region instead of being split there (each region pays the
    compiled graphs' runtime wrappers, forward and backward: on one H200 a Llama layer's TP 8
    rank ran 4 regions, 3.0x its kernels' time). The sync is the identity in forward, and its
    backward hands the gradient to its bucket once every reader has added to it, wherever it
    stands in the graph: moving it changes nothing it does."""
    graph = gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    if not inputs:
        return
    anchor = inputs[-1]
    for node in list(graph.nodes):
        if _is_sync(node) and all(
                a.op == "placeholder" for a in node.all_input_nodes):
            anchor.append(node)
            anchor = node
    graph.lint()
    gm.recompile()


def _is_sync(node: fx.Node) -> bool:
    from autoshard.codegen.rewrite import ReshardCall
    return isinstance(node.target, ReshardCall) and node.target.bucketed


def regions(gm: fx.GraphModule) -> int:
    """The compiled regions of a rank program, those inside its checkpointed layers included
    (``autoshard verify --compile`` reports them)."""
    from autoshard.codegen.recompute import Checkpointed
    n = sum(isinstance(m, CompiledRegion) for m in gm.modules())
    return n + sum(regions(node.target.gm) for node in gm.graph.nodes
                   if node.op == "call_function" and isinstance(node.target, Checkpointed))


def _region_compiled(ids: dict[str, tuple[int, bool]], k: int) -> bool:
    return any(part == k and compiled for part, compiled in ids.values())


def _eager(node: fx.Node) -> bool:
    """Whether ``node`` must run outside a traced graph (the module's docstring)."""
    from autoshard.codegen.masks import ShardMasks, draws_masks, unwrapped
    from autoshard.codegen.recompute import Checkpointed
    from autoshard.codegen.rewrite import FetchCall
    from autoshard.codegen.ring import RingCall
    if node.op != "call_function":
        return False
    t = node.target
    if _EAGER_DRAWS.get() and (draws_masks(node) or unwrapped(t) in op_modes.DRAWS):
        return True
    # (a shard's dropout seeds the generators around its op: codegen/masks.py; the ring's
    # point-to-point sends are not functional collectives a traced graph holds)
    return _is_sync(node) or isinstance(t, (FetchCall, Checkpointed, ShardMasks, RingCall))


def _partition(graph: fx.Graph, layer_of: dict[str, str] | None = None
               ) -> dict[str, tuple[int, bool]]:
    """Node name -> (partition, compiled): runs of traceable ops share a compiled partition;
    each eager node is a partition of its own, with the ``getitem`` nodes reading its tuple.
    With ``layer_of`` (op name -> layer), a compiled partition also ends where the next layer's
    first op comes: each layer's gradients then reach their buckets when its region's backward
    is done, and their syncs overlap the earlier layers' backward, as in the eager program
    (docs/cost-model.md §3.10); an op of no layer (a reshard between two) stays where it is."""
    out: dict[str, tuple[int, bool]] = {}
    part, compiled, layer = 0, False, None
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.target is operator.getitem and node.args[0].name in out \
                and not out[node.args[0].name][1]:
            out[node.name] = out[node.args[0].name]
            continue
        if _eager(node):
            part += 1
            out[node.name] = (part, False)
            compiled = False
            continue
        mine = (layer_of or {}).get(node.name)
        if not compiled or (mine is not None and mine != layer):
            part += 1
            compiled = True
        layer = mine if mine is not None else layer
        out[node.name] = (part, True)
    return out


def _compile_checkpointed(target: Any, runtime: Any) -> None:
    if target.policy == "selective":
        warnings.warn(f"compile: {target.layer} runs eagerly: selective activation "
                      "checkpointing chooses op by op what to keep, which compiled kernels "
                      "hide; plan it with recompute='full' or 'none' to compile it",
                      CompileFallback, stacklevel=3)
        return
    target.gm = compile_program(target.gm, runtime, name=target.layer)


class CompiledRegion(torch.nn.Module):
    """One traceable run of the rank program, compiled by inductor at its first call for each
    signature of its inputs (shapes, dtypes, which need a gradient, grad mode), and run eagerly
    where compiling fails (:class:`CompileFallback`)."""

    def __init__(self, gm: fx.GraphModule, runtime: Any, label: str) -> None:
        super().__init__()
        self.gm, self.rt, self.label = gm, runtime, label
        self._compiled: dict[tuple, "_Artifact | None"] = {}
        self.compile_seconds = 0.0

    def forward(self, *args: Any) -> Any:
        key = _signature(args)
        if key not in self._compiled:
            self._compiled[key] = self._compile(args)
        art = self._compiled[key]
        if art is None:
            return self.gm(*args)
        phase = self.rt.phase
        if phase != Phase.REPLAY:
            for r in art.forward:
                self.rt.ledger.add(r if r.phase != art.phase else
                                   dataclasses.replace(r, phase=phase))
        if art.backward and torch.is_grad_enabled():
            # One input marked is enough: the region's backward is one autograd node, which
            # makes every input's gradient at once (each marked input cost a view and a
            # detach per call, on the host)
            i = next((i for i, a in enumerate(args)
                      if isinstance(a, torch.Tensor) and a.requires_grad), None)
            if i is not None:
                args = (*args[:i], _BackwardMark.apply(_Replay(self.rt, art.backward), args[i]),
                        *args[i + 1:])
        out = art.fn(*args)
        return out[0] if art.single else tuple(out)

    @property
    def compiled(self) -> bool:
        return any(a is not None for a in self._compiled.values())

    def _compile(self, args: tuple) -> "_Artifact | None":
        import time
        t0 = time.perf_counter()
        try:
            return self._trace(args)
        except Exception as e:         # any failure: this region runs eagerly, said once
            warnings.warn(f"compile: region {self.label} runs eagerly: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                          CompileFallback, stacklevel=2)
            return None
        finally:
            self.compile_seconds += time.perf_counter() - t0

    def _trace(self, args: tuple) -> "_Artifact | None":
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner
        graphs: dict[str, list[tuple[str, int]]] = {}

        def inner(gm: fx.GraphModule, example_inputs: Any, **kw: Any) -> Callable:
            graphs["backward" if kw.get("is_backward") else "forward"] = graph_collectives(gm)
            return compile_fx_inner(gm, example_inputs, **kw)

        gm, single = _tuple_output(self.gm)
        captured, real = Ledger(), self.rt.ledger
        self.rt.ledger = captured          # the trace's records, not this step's
        try:
            # The backward compiled now, not at the first backward: its collectives are
            # checked before the region is used, and a failure falls back here. One compile
            # thread: a worker pool costs more than it saves on a rank's share of a host. No
            # common subexpressions merged by AOTAutograd: two reshards of one value that begin
            # with the same all-gathers (CodeGen at 2x2) would run them once, and the step
            # would no longer run the collectives the plan prices and the eager program runs.
            with torch._functorch.config.patch(force_non_lazy_backward_lowering=True, cse=False), \
                    torch._inductor.config.patch(compile_threads=1):
                fn = compile_fx(gm, list(args), inner_compile=inner)
        finally:
            self.rt.ledger = real
        fwd, bwd = graphs.get("forward", []), graphs.get("backward", [])
        # AOTAutograd runs the forward more than once (its metadata, then the joint with the
        # backward): the last run's records are the graphs'; the backward's are in its phases.
        back = [r for r in captured.records if r.phase in BACKWARD_PHASES]
        front = [r for r in captured.records if r.phase not in BACKWARD_PHASES]
        front = front[len(front) - len(fwd):] if fwd else []
        ran = [(r.kind, r.nbytes) for r in front + back]
        if ran != fwd + bwd:
            raise RuntimeError(f"the compiled graphs' collectives {fwd + bwd} are not those "
                               f"its trace ran {ran}")
        return _Artifact(fn, single, tuple(front), tuple(back), self.rt.phase)


@dataclasses.dataclass(frozen=True)
class _Artifact:
    fn: Callable
    single: bool                                  # the region returns one value, not a tuple
    forward: tuple[ExecutedCollective, ...]       # the ledger records of a forward call
    backward: tuple[ExecutedCollective, ...]      # ... and of its backward
    phase: Phase                                  # the rank's phase when it was traced


def graph_collectives(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """(ledger kind, bytes moved) of each functional collective of a traced graph, in order."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "namespace", "") != \
                "_c10d_functional":
            continue
        kind = _KINDS.get(node.target._opname)
        if kind is None:
            continue                                  # wait_tensor
        t = node.meta["val"] if kind == CollectiveKind.ALL_GATHER else node.args[0].meta["val"]
        out.append((kind, t.numel() * t.element_size()))
    return out


def _tuple_output(gm: fx.GraphModule) -> tuple[fx.GraphModule, bool]:
    """``gm`` returning a tuple (what compile_fx returns a list of), and whether it returned
    one value."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    if isinstance(out.args[0], (tuple, list)):
        return gm, False
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        if n.op == "output":
            g.output((env[n.args[0]],))
        else:
            env[n] = g.node_copy(n, lambda x: env[x])
    return fx.GraphModule(gm, g), True


def _signature(args: tuple) -> tuple:
    return (torch.is_grad_enabled(),) + tuple(
        (tuple(a.shape), a.dtype, a.requires_grad, a.device.type) if isinstance(a, torch.Tensor)
        else repr(a) for a in args)


class _Replay:
    """The backward records of one call of a compiled region, added to the ledger once."""

    def __init__(self, rt: Any, records: tuple[ExecutedCollective, ...]) -> None:
        self.rt, self.records, self.done = rt, records, False

    def __call__(self) -> None:
        if not self.done:
            self.done = True
            for r in self.records:
                self.rt.ledger.add(r)


class _BackwardMark(torch.autograd.Function):
    """Identity on one input of a region; its backward runs once the region's compiled backward
    has made the input's gradient (and run its collectives), and writes their records."""

    @staticmethod
    def forward(ctx, replay: _Replay, x: torch.Tensor) -> torch.Tensor:
        ctx.replay = replay
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Any) -> Any:
        ctx.replay()
        return None, grad
