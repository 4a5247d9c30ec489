"""The liveness walk's view of the step program (cost/liveness.py): what each value and
resharded copy weighs on this device, what each event reads, and when a tensor is made and let
go in forward; the base the walk's phases (cost/walk_forward.py, cost/walk_backward.py) build
on."""
from __future__ import annotations

import operator
from typing import Any, Iterable

import torch
import torch.fx as fx

from autoshard.cost.comm import Reshard
from autoshard.cost.compute import local_numel
from autoshard.cost.live_memory import LiveMemory, Storage, fake_value, storage_key
from autoshard.cost.program import Event, StepProgram, node_reads
from autoshard.ir import CollectiveKind, Strategy
from autoshard.trace.graph import ValueRef, value_inputs

aten = torch.ops.aten


class ValueWalk:
    """The walk's state and its sizes and reads; each phase is a subclass's."""

    def __init__(self, traced: Any, strategies: dict[str, Strategy], pricer: Any,
                 program: StepProgram) -> None:
        self.traced, self.strategies, self.pricer = traced, strategies, pricer
        self.graph: fx.Graph = traced.graph
        self.mesh_shape = tuple(pricer.mesh.shape)
        self.training = bool(traced.training)
        self.nodes = {n.name: n for n in self.graph.nodes}
        self.params = {p.name for p in traced.params}
        self.tied_to: dict[str, str] = getattr(pricer, "tied_to", {})
        self.grads: set[str] = pricer.grads if self.training else set()
        self.mem = LiveMemory()
        self.program = program
        self.edges = program.edges
        self.edge_of = program.edge_of
        self.saved_at: set[tuple[str, int]] = {c for cons in pricer.saved_inputs().values()
                                               for c in cons} if self.training else set()
        recompute = getattr(pricer, "recompute", None) or {}
        # Layer -> checkpointing policy ("full", "selective"); a set of names is all "full".
        self.policies: dict[str, str] = dict(recompute) if isinstance(recompute, dict) else {
            layer: "full" for layer in recompute}
        self.recompute: frozenset[str] = frozenset(self.policies)
        self.stored: dict[str, list[tuple[Any, Storage]]] = {}
        self.events = program.events
        self.edge_region = {ev.edge: ev.region for ev in self.events if ev.kind == "reshard"}
        self.op_region = {ev.name: ev.region for ev in self.events if ev.kind == "op"}
        self.region_ops: dict[str, set[str]] = {}
        self.region_events: dict[str, list[Event]] = {}
        for ev in self.events:
            if ev.region is not None:
                self.region_events.setdefault(ev.region, []).append(ev)
                if ev.kind == "op":
                    self.region_ops.setdefault(ev.region, set()).add(ev.name)
        self.buckets = program.buckets
        self.bucket_of = program.bucket_of
        # A pipeline stage (cost/program.py stage_program): its ops, and the values it makes
        # that later stages read (sent after its forward, their gradients received back).
        self.stage = program.stage
        self.sent: list[ValueRef] = []
        if self.stage is not None:
            seen: set[ValueRef] = set()
            for n in self.graph.nodes:
                if n.op == "call_function" and n.name not in self.stage \
                        and n.target is not operator.getitem:
                    for ref in value_inputs(n):
                        if ref[0] in self.stage and ref not in seen:
                            seen.add(ref)
                            self.sent.append(ref)
        self.in_flight = 1     # a stage's microbatches whose activations are alive at once
        # Parameters kept on the host (offload_params), by every placeholder name they have.
        self.fetched = program.fetched
        # Where the copy the direct readers of such a parameter share is made: the checkpointed
        # layer of the first of them (None: outside any).
        self.fetch_region: dict[str, str | None] = {}
        for ev in self.events:
            if ev.kind == "op" and self.fetched:
                for key in self._event_reads(ev):
                    if key[0] == "fetch" and key[1] not in self.fetch_region:
                        self.fetch_region[key[1]] = ev.region

    # -- sizes -----------------------------------------------------------------------------
    def _local_bytes(self, ref: ValueRef, spec: Any) -> int:
        shape, itemsize = self.pricer.shapes[ref]
        return local_numel(tuple(shape), spec, self.mesh_shape) * itemsize

    def _out_spec(self, ref: ValueRef) -> Any:
        strat = self.strategies.get(ref[0])
        if strat is None or ref[1] >= len(strat.outputs):
            return None
        return strat.outputs[ref[1]]

    def _value_bytes(self, ref: ValueRef) -> int:
        return self._local_bytes(ref, self._out_spec(ref))

    def _edge_bytes(self, i: int) -> int:
        e = self.edges[i]
        return self._local_bytes(e.value, e.dst)

    def _fake_of(self, ref: ValueRef) -> Any:
        return fake_value(self.nodes[ref[0]], ref[1])

    def _floating(self, ref: ValueRef) -> bool:
        t = self._fake_of(ref)
        return t is not None and (t.dtype.is_floating_point or t.dtype.is_complex)

    def _needs_grad(self, ref: ValueRef) -> bool:
        """Whether autograd computes a gradient for the value: a floating value computed from a
        parameter; an output that aliases an input (a view among several outputs) only if
        that input needs one."""
        if not (self.training and ref[0] in self.grads and self._floating(ref)):
            return False
        node = self.nodes[ref[0]]
        if node.op != "call_function":
            return True
        val = node.meta.get("val")
        if not isinstance(val, (tuple, list)):
            return True
        ins = [k for k, j in self._aliases(node).items() if j == ref[1]]
        refs = value_inputs(node)
        return not ins or any(self._needs_grad(refs[k]) for k in ins)

    def _steps_transient(self, steps: Iterable, nbytes: int) -> tuple[int, int]:
        """(the largest bytes alive at once besides the input while ``steps`` run on a tensor
        of ``nbytes``, the final bytes): each collective's output is made while its input is
        alive; an all-gather or a reduce-scatter along a dim other than 0 and an all-to-all
        stage one more copy (autoshard/codegen/collectives.py)."""
        cur, most, first = nbytes, 0, True
        for s in steps:
            n = s.group_size(self.mesh_shape) if s.axis < len(self.mesh_shape) else 1
            if s.kind == CollectiveKind.ALL_GATHER:
                out, stage = cur * n, (cur * n if s.dim != 0 else 0)
            elif s.kind in (CollectiveKind.REDUCE_SCATTER, "slice"):
                out, stage = cur // n, (cur if s.kind == CollectiveKind.REDUCE_SCATTER
                                        and s.dim != 0 else 0)
            elif s.kind == CollectiveKind.ALL_TO_ALL:
                out, stage = cur, 2 * cur
            else:
                out, stage = cur, 0
            held = 0 if first else cur      # an intermediate is held while the next step runs
            most = max(most, held + stage + out)
            cur, first = out, False
        return most, cur

    def _reshard_aliases(self, r: Reshard) -> bool:
        """Whether the reshard's forward leaves the tensor where it is (no steps, or a slice of
        a contiguous block: ``chunk(...)[i].contiguous()`` along dim 0 copies nothing)."""
        return all(s.kind == "slice" and s.dim == 0 for s in r.forward)

    # -- reads, births and last uses -------------------------------------------------------
    def _loss_keys(self) -> list[Any]:
        """What the graph's output reads (the loss), where this program makes it."""
        out_node = next(n for n in self.graph.nodes if n.op == "output")
        return [self._delivered(ref, (out_node.name, k))
                for k, ref in enumerate(node_reads(out_node)) if self._made_here(ref)]

    def _made_here(self, ref: ValueRef) -> bool:
        """Whether this program makes ``ref``: always, unless it is a pipeline stage's
        (``StepProgram.stage``) and another stage's op makes it."""
        return self.stage is None or ref[0] in self.stage or \
            self.nodes[ref[0]].op != "call_function"

    def _received(self, key: Any) -> bool:
        return key[0] not in ("edge", "fetch") and not self._made_here(key)

    def _event_reads(self, ev: Event) -> list[Any]:
        if ev.kind == "reshard":
            return [self.edges[ev.edge].value]
        node = self.nodes[ev.name]
        return [self._delivered(ref, (node.name, k)) for k, ref in enumerate(value_inputs(node))]

    def _delivered(self, ref: ValueRef, consumer: tuple[str, int]) -> Any:
        """The tensor a consumer reads: the value, or its resharded copy, or (a parameter kept
        on the host, read where it lies) the copy its direct readers share."""
        i = self.edge_of.get((ref, consumer))
        if i is not None:
            return ("edge", i)
        if ref[0] in self.fetched:
            return ("fetch", ref[0])
        return ref

    def _born(self, key: Any, uses: dict[Any, int]) -> None:
        """A tensor just made: it holds its storage while forward reads remain."""
        self.born_here.add(key)
        if uses.get(key, 0) == 0 and key not in self.pinned:
            self.mem.unref(self.tensors.get(key))

    def _use(self, key: Any, uses: dict[Any, int]) -> None:
        """One forward read of ``key`` done; its last releases the tensor (a tensor made before
        a recomputation, a checkpointed layer's input, is held by the layer instead)."""
        if key in self.pinned or key not in self.born_here:
            return
        uses[key] -= 1
        if uses[key] == 0:
            self.mem.unref(self.tensors.get(key))

    def _outputs(self, node: fx.Node, reads: list[Any]) -> list[Any]:
        """Make the op's outputs: a new storage each, or the input's storage where the traced
        graph's output aliases an input."""
        in_keys = {}
        for k, ref in enumerate(value_inputs(node)):      # (memoized per node)
            t = self._fake_of(ref) if ref[0] in self.nodes else None
            sk = storage_key(t) if t is not None else None
            if sk is not None:
                in_keys.setdefault(sk, k)
        val = node.meta.get("val")
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        outs = []
        for j in range(n_out):
            ref = (node.name, j)
            t = fake_value(node, j)
            if t is None:
                continue
            sk = storage_key(t)
            k = in_keys.get(sk) if sk is not None else None
            if k is not None and k < len(reads) and reads[k] in self.tensors:
                self.tensors[ref] = self.mem.ref(self.tensors[reads[k]])
            else:
                self.tensors[ref] = self.mem.alloc(self._value_bytes(ref), "activations")
            outs.append(ref)
        return outs

    # -- kernels and aliases ---------------------------------------------------------------
    def _workspace(self, name: str) -> tuple[int, int]:
        """What the op's kernel holds while it runs (ops/registry.py ``workspace``)."""
        fn = getattr(self.pricer, "workspace", None)
        return fn(name, self.strategies[name]) if callable(fn) else (0, 0)

    def _in_spec(self, node: fx.Node, k: int) -> Any:
        strat = self.strategies[node.name]
        return strat.inputs[k] if k < len(strat.inputs) else None

    def _aliases(self, node: fx.Node) -> dict[int, int]:
        """Input position -> the output that shares its storage in the traced graph."""
        cache = self.__dict__.setdefault("_alias_cache", {})
        if node.name in cache:
            return cache[node.name]
        val = node.meta.get("val")
        outs = {}
        for j, t in enumerate(val if isinstance(val, (tuple, list)) else [val]):
            if isinstance(t, torch.Tensor):
                sk = storage_key(t)
                if sk is not None:
                    outs.setdefault(sk, j)
        found = {}
        for k, ref in enumerate(value_inputs(node)):
            t = self._fake_of(ref)
            sk = storage_key(t) if t is not None else None
            if sk is not None and sk in outs:
                found[k] = outs[sk]
        cache[node.name] = found
        return found

    @staticmethod
    def _permutes(node: fx.Node) -> bool:
        return node.target in (aten.transpose.int, aten.permute.default, aten.t.default)

    @staticmethod
    def _reshapes(node: fx.Node) -> bool:
        return node.target in (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
