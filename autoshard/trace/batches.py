"""One model traced at many batch sizes for the price of about one export.

The searches above trace a model again and again at other batch sizes: a pipeline traces one
microbatch, so every microbatch count tried (p, 2p, 4p) and every mesh tried (its data axis
sets the microbatch) is a new trace, and torch.export spends seconds per trace on a large model
(about 7 s for GPT-3 175B on 2 cores) while everything the planner reads of a graph but its
shapes is the same at every batch.

So :class:`Traces` exports the model once more with its batch dimension symbolic
(``torch.export.Dim``), and makes the graph at any batch from that export: a copy of the graph,
shapes propagated with fake tensors of that batch (``FakeTensorProp``), and every value that
shape arithmetic computes from the symbolic batch (``sym_size`` and the ints made from it)
written into its readers as a constant. Under a symbolic batch export sometimes keeps ops that a
concrete export folds away (a slice that spans a dimension it cannot prove whole, a mask
built for any batch), and then the two graphs differ. A graph made that way is therefore only
used once it is proven to be the graph a concrete trace gives: the first batch asked for is
traced concretely as always; when a second batch is asked for, the symbolic export is made
at the first batch and its graph there compared with the concrete one by fingerprint (every node's op, arguments and output shapes, trace/export.py). When they differ,
or the symbolic export fails, every batch is traced concretely, as before: the answer is the
same either way, only slower.
"""
from __future__ import annotations

import contextlib
import time
from numbers import Number
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.export import Dim, ExportedProgram

from autoshard.errors import AutoshardError
from autoshard.loss import as_loss_module
from autoshard.precision import cast_inputs, running_as
from autoshard.trace.export import TracedGraph, from_exported, parameter_aliases, trace
from autoshard.trace.repeat import Repeat, expand, shortened, signature_of


def batch_of(example_inputs: Sequence[Any]) -> int:
    """The batch of the example inputs: the first dimension of the first tensor."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return x.shape[0]
    raise AutoshardError("example inputs with a batch dimension (a tensor's first)",
                         got="no tensor input", fix="pass the model's batch as tensors")


def sliced(example_inputs: Sequence[Any], batch: int) -> tuple:
    """The first ``batch`` rows of every tensor input that has the inputs' batch dimension."""
    full = batch_of(example_inputs)
    return tuple(x[:batch] if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == full
                 else x for x in example_inputs)


def check_plannable(model: torch.nn.Module, inputs: tuple, *, training: bool) -> None:
    """Refuse up front what no step can run: a Python number among the example inputs (the
    graph would bake it in as a constant, and the planner prices tensors), and a training plan
    for a model with no trainable parameter (nothing has a gradient: the step's backward
    fails)."""
    numbers = [f"input {i} ({type(x).__name__} {x!r})" for i, x in enumerate(inputs)
               if isinstance(x, Number)]
    if numbers:
        raise AutoshardError("example inputs that are tensors",
                             got="a Python number as " + ", ".join(numbers),
                             fix="pass it as a tensor (torch.tensor(0.5)), or keep it in the "
                                 "model (an attribute, or a default of forward's argument)")
    if training and not any(p.requires_grad for p in model.parameters()):
        raise AutoshardError("a model with a trainable parameter, for a training plan",
                             got="no parameter requires grad (all frozen, or none)",
                             fix="unfreeze the parameters to train (requires_grad_(True)), or "
                                 "plan forward only (--inference, training=False)")


class Traces:
    """``model(*example_inputs)`` traced at any batch up to the examples' (:meth:`at`), in
    ``precision``; concrete traces where a batch-generic one is not proven equal (see above).
    ``stats`` counts both kinds and their seconds, for the planners' timings."""

    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[Any], *,
                 training: bool, precision: str = "model") -> None:
        self.model, self.inputs = model, tuple(example_inputs)
        self.training, self.precision = training, precision
        check_plannable(model, self.inputs, training=training)
        self.full = batch_of(self.inputs)
        self._graphs: dict[int, TracedGraph] = {}
        self._generic: ExportedProgram | None = None
        self._proven: bool | None = None         # None: not tried yet
        self._repeat: Repeat | None = None       # the generic export's prefix of the layers
        self.stats = {"exported": 0, "rebatched": 0, "seconds": 0.0}

    def at(self, batch: int) -> TracedGraph:
        """The graph of one step on ``batch`` rows of the examples (a divisor of their batch)."""
        if batch < 1 or self.full % batch:
            raise AutoshardError(f"a batch that divides the example batch {self.full}",
                                 got=f"batch {batch}", fix="pick a divisor of the batch")
        if batch not in self._graphs:
            t0 = time.perf_counter()
            self._graphs[batch] = self._make(batch)
            self.stats["seconds"] += time.perf_counter() - t0
        return self._graphs[batch]

    def seconds_for(self, batch: int) -> float:
        """How long :meth:`at` took for ``batch`` (0 once it is cached)."""
        t0 = time.perf_counter()
        self.at(batch)
        return time.perf_counter() - t0

    def _make(self, batch: int) -> TracedGraph:
        # The first batch is traced concretely, as by trace(); the generic export is made (and
        # proven on that first graph) only once a second batch is asked for.
        if self._graphs and self._proven is None:
            first, graph = next(iter(self._graphs.items()))
            self._proven = self._prove(first, graph)
        if self._proven:
            try:
                graph = self._rebatch(batch)
            except Exception:   # noqa: BLE001 - a guard of the export this batch breaks
                return self._concrete(batch)
            self.stats["rebatched"] += 1
            return graph
        return self._concrete(batch)

    def _concrete(self, batch: int) -> TracedGraph:
        self.stats["exported"] += 1
        inputs = cast_inputs(sliced(self.inputs, batch), self.precision)
        with running_as(self.model, self.precision):
            return trace(self.model, inputs, training=self.training)

    def _prove(self, batch: int, concrete: TracedGraph) -> bool:
        """Export with a symbolic batch and check that it gives ``concrete`` at ``batch``."""
        if batch < 2:       # export specializes a dimension of size 1
            return False
        inputs = cast_inputs(sliced(self.inputs, batch), self.precision)
        dim = Dim("batch", min=2)
        shapes = tuple({0: dim} if isinstance(x, torch.Tensor) and x.dim() > 0
                       and x.shape[0] == batch else None for x in inputs)
        wrapped = as_loss_module(self.model) if self.training else self.model
        # Repeated layers as trace() exports them: a prefix, copied out (trace/repeat.py); the
        # comparison below with ``concrete`` proves the copy at this batch too.
        repeat = self._repeat = concrete.repeat
        short = shortened(self.model, repeat.container, repeat.prefix) if repeat else \
            contextlib.nullcontext()
        try:
            with running_as(self.model, self.precision), short:
                # The loss wrapper's forward takes *args: one spec, the tuple of them.
                self._generic = torch.export.export(
                    wrapped, inputs, dynamic_shapes=(shapes,) if self.training else shapes,
                    strict=False)
            again = self._rebatch(batch)
        except Exception:   # noqa: BLE001 - any failure only means: trace each batch concretely
            self._generic = None
            return False
        return again.fingerprint == concrete.fingerprint

    def _rebatch(self, batch: int) -> TracedGraph:
        """The batch-generic export's graph with ``batch`` written in (see the module's doc)."""
        ep = self._generic
        assert ep is not None
        src = ep.graph_module
        graph = fx.Graph()
        out = graph.graph_copy(src.graph, {}, return_output_node=True)
        graph.output(out[0])               # (the output's value, the old output node)
        gm = fx.GraphModule(src, graph)
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.passes.fake_tensor_prop import FakeTensorProp
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        args = [mode.from_tensor(_example(n.meta["val"], batch))
                for n in gm.graph.nodes if n.op == "placeholder"]
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*args)
        # A parameter's value keeps its requires_grad: a frozen one is told apart by it
        # (cost/reshards.py ``frozen``), and the propagation leaves every input without one.
        for old, new in zip((n for n in src.graph.nodes if n.op == "placeholder"),
                            (n for n in gm.graph.nodes if n.op == "placeholder")):
            val, was = new.meta.get("val"), old.meta.get("val")
            if isinstance(val, torch.Tensor) and isinstance(was, torch.Tensor) \
                    and val.requires_grad != was.requires_grad:
                val.requires_grad_(was.requires_grad)
        for node in list(gm.graph.nodes):
            if node.op == "output":
                node.meta.pop("val", None)      # a concrete export leaves it unset
            elif node.op == "call_function" and isinstance(node.meta.get("val"),
                                                           (int, float, bool)):
                value = node.meta["val"]
                for user in list(node.users):
                    user.args, user.kwargs = fx.node.map_arg(
                        (user.args, user.kwargs), lambda a: value if a is node else a)
                gm.graph.erase_node(node)
        # Shape guards of the symbolic batch: the propagation above ran them on this batch (a
        # broken one raises there, and the batch is traced concretely); now they are moot.
        for node in list(gm.graph.nodes):
            if node.op == "call_function" and not node.users and node.target in _GUARDS:
                gm.graph.erase_node(node)
        gm.recompile()
        strip = "model." if self.training else ""
        specs = None
        if self._repeat is not None:
            expanded = expand(gm, signature_of(ep), self._repeat, strip)
            if expanded is None:
                raise ValueError("the batch-generic prefix does not copy out")
            gm, specs = expanded
        traced = from_exported(ep, training=self.training, strip=strip,
                               aliases=parameter_aliases(self.model), gm=gm, specs=specs)
        traced.repeat = self._repeat
        return traced


_GUARDS = (torch.ops.aten._assert_scalar.default,
           torch.ops.aten.sym_constrain_range_for_size.default)


def _example(val: torch.Tensor, batch: int) -> torch.Tensor:
    """An empty tensor like a placeholder's fake value, its symbolic dimension ``batch``."""
    shape = [batch if isinstance(d, torch.SymInt) else int(d) for d in val.shape]
    if any(isinstance(s, torch.SymInt) for s in val.stride()):
        return torch.empty(shape, dtype=val.dtype, device=val.device)
    return torch.empty_strided(shape, tuple(int(s) for s in val.stride()), dtype=val.dtype,
                               device=val.device)
