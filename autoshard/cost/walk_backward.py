"""The liveness walk's backward and optimizer step (cost/liveness.py; docs/cost-model.md §4.5):
the program's events in reverse, each op's input gradients made while its output gradients and
saved tensors are alive; gradients accumulated, landed on ``.grad`` or handed to their
gradient buckets; a checkpointed layer recomputed at its first saved tensor's unpack; then the
optimizer step's moments from the step program."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from autoshard.cost.live_memory import Storage
from autoshard.cost.program import Event
from autoshard.cost.walk_forward import ForwardWalk
from autoshard.ir import CollectiveKind
from autoshard.ops.registry import PASSES, VIEW, WIDENS, record_of
from autoshard.trace.graph import value_inputs


class BackwardWalk(ForwardWalk):
    """Backward, the gradient buckets, and the optimizer step."""

    def _backward(self) -> None:
        mem = self.mem
        self.grad: dict[Any, Storage] = {}
        self.bucket_buf: dict[int, Storage] = {}
        self.bucket_out: dict[int, Storage] = {}
        self.bucket_held: dict[int, list[Storage]] = {}
        # The loss's gradient: a scalar (ones_like), for the loss's producer.
        for key in self._loss_keys():
            self.grad[key] = mem.alloc(4, "temporaries")
        # A stage's sent values: their gradients come back from the next stage.
        for key in self.sent:
            if self._needs_grad(key):
                self.grad[key] = mem.alloc(self._value_bytes(key), "temporaries")
        regions_done: set[str] = set()
        region_first: dict[str, int] = {}
        for i, ev in enumerate(self.events):
            if ev.region is not None:
                region_first.setdefault(ev.region, i)
        complete = self._completions()
        for i in range(len(self.events) - 1, -1, -1):
            ev = self.events[i]
            # torch.utils.checkpoint recomputes a layer when its backward first unpacks a saved
            # tensor: at the layer's last op that saves one (the backward of the reshards and
            # adds after it runs before that).
            if ev.region is not None and ev.region not in regions_done and ev.kind == "op" \
                    and self._saves(self.nodes[ev.name]):
                regions_done.add(ev.region)
                self._recompute(ev.region)
            if ev.kind == "reshard":
                self._reshard_backward(ev)
            else:
                self._op_backward(self.nodes[ev.name])
            if ev.region is not None and region_first[ev.region] == i:
                for s in self.region_held.pop(ev.region, []):
                    mem.unref(s)
            for param, u in complete.get(i, ()):
                self._step_in_backward(param, u, ev.name)
        for s in list(self.grad.values()):
            mem.unref(s)
        self.grad.clear()
        self._finish_buckets()

    def _step_in_backward(self, param: str, u: Any, at: str) -> None:
        """A parameter stepped as autograd completes its gradient (the step program's
        ``released``): on the device (``u``, its record), its update's moments (the gradient's
        fp32 cast, the implementation's temporaries) beside the gradient; then the gradient
        goes (on the device, used; offloaded, copied down to the host, codegen/hostopt.py)."""
        if u is not None:
            for _, extra in self.program.optimizer.piece_moments((u,)):
                self.mem.mark(at, extra=extra)
        self.mem.unref(self.p_grad.pop(param, None))

    def _completions(self) -> dict[int, list[tuple[str, Any]]]:
        """The parameters stepped as autograd completes their gradients (the step program's
        ``released``), each with its optimizer record where it steps on the device, by the
        event after whose backward that is: the first event of forward that reads the
        parameter (an op, or a reshard of it), whose backward adds the gradient's last part."""
        opt = self.program.optimizer
        device = {u.name: u for u in opt.params if u.name in opt.released and not u.on_host}
        out: dict[int, list[tuple[str, Any]]] = {}
        left = set(opt.released)
        for i, ev in enumerate(self.events):
            if not left:
                break
            for key in self._event_reads(ev):
                param = self.tied_to.get(key[0], key[0]) if key[0] not in ("edge", "fetch") \
                    else None
                if param in left:
                    left.discard(param)
                    out.setdefault(i, []).append((param, device.get(param)))
        return out

    def _recompute(self, region: str) -> None:
        """The layer's forward again, its reshards included, holding what its ops save; under
        selective checkpointing the stored outputs are handed back instead of made again, and
        the store lets go of them."""
        phase = self.mem.phase
        self._forward(self.region_events.get(region, []), recompute=True)
        self.mem.phase = phase
        for _, s in self.stored.pop(region, []):
            self.mem.unref(s)

    def _contribute(self, key: Any, s: Storage, at: str) -> None:
        """A gradient for ``key`` arrives (one reference on ``s`` handed over)."""
        mem = self.mem
        if key[0] == "fetch":
            self._land(self.tied_to.get(key[1], key[1]), s, at)
            return
        if key[0] != "edge" and (key[0] in self.params or key[0] in self.tied_to):
            self._land(self.tied_to.get(key[0], key[0]), s, at)
            return
        old = self.grad.get(key)
        if old is None:
            self.grad[key] = s
            return
        # Accumulate: in place into whichever of the two is not shared, else into a new one.
        if old.refs == 1 or s.refs == 1:
            mem.mark(at)
            keep, drop = (old, s) if old.refs == 1 else (s, old)
            self.grad[key] = keep
            mem.unref(drop)
            return
        new = mem.alloc(max(old.nbytes, s.nbytes), "temporaries")
        mem.mark(at)
        self.grad[key] = new
        mem.unref(old)
        mem.unref(s)

    def _land(self, param: str, s: Storage, at: str) -> None:
        """A parameter's gradient reaches ``.grad`` (AccumulateGrad): stolen if no one else
        holds it, else copied; a second one is added in place."""
        mem = self.mem
        if param in self.fetched:
            # Kept on the host: the gradient goes down to it as it lands (codegen/rewrite.py).
            mem.mark(at)
            mem.unref(s)
            return
        old = self.p_grad.get(param)
        if old is None:
            if s.refs == 1:
                mem.recategorize(s, "gradients")
                self.p_grad[param] = s
            else:
                self.p_grad[param] = mem.alloc(s.nbytes, "gradients")
                mem.mark(at)
                mem.unref(s)
            return
        mem.mark(at)
        mem.unref(s)

    def _op_backward(self, node: fx.Node) -> None:
        mem = self.mem
        name = node.name
        val = node.meta.get("val")
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        out_grads = {j: self.grad.pop((name, j)) for j in range(n_out) if (name, j) in self.grad}
        held = self.held.pop(name, [])
        if not out_grads or name not in self.grads:
            for s in [*out_grads.values(), *held]:
                mem.unref(s)
            return
        refs = value_inputs(node)
        record = record_of(node.target)     # how its backward makes gradients (ops/registry.py)
        view = record.family == VIEW
        alias = self._aliases(node)
        new_grads: list[tuple[Any, Storage]] = []
        for k, ref in enumerate(refs):
            if not self._needs_grad(ref):
                continue
            key = self._delivered(ref, (name, k))
            nbytes = self._local_bytes(ref, self.edges[key[1]].dst) if key[0] == "edge" \
                else self._value_bytes(ref)      # (a parameter's copy in: its stored bytes)
            g0 = out_grads.get(alias.get(k, -1))
            if g0 is not None and record.grad != WIDENS:
                # A view's (or an aliasing op's) gradient is its output's, reshaped: a copy only
                # where a transposed gradient has to become contiguous.
                if view and self._reshapes(node) and g0.permuted:
                    new_grads.append((key, mem.alloc(nbytes, "temporaries")))
                else:
                    if view and self._permutes(node):
                        g0.permuted = not g0.permuted
                    new_grads.append((key, mem.ref(g0)))
            elif record.grad == PASSES and len(out_grads) == 1 \
                    and next(iter(out_grads.values())).nbytes == nbytes:
                new_grads.append((key, mem.ref(next(iter(out_grads.values())))))
            else:
                new_grads.append((key, mem.alloc(nbytes, "temporaries")))
        extra = 0
        if record.logits and refs:     # the log-softmax's gradient, then the logits'
            extra = self._local_bytes(refs[0], self._in_spec(node, 0))
        mem.mark(name, extra=extra + self._workspace(name)[1])
        for s in [*out_grads.values(), *held]:
            mem.unref(s)
        for key, s in new_grads:
            self._contribute(key, s, name)

    def _reshard_backward(self, ev: Event) -> None:
        mem = self.mem
        e = self.edges[ev.edge]
        key = ("edge", ev.edge)
        g = self.grad.pop(key, None)
        if g is None:
            return
        if not self._needs_grad(e.value):
            mem.unref(g)
            return
        param = self.tied_to.get(e.value[0], e.value[0])
        if self.program.bucketed.get(param) == ev.edge and param in self.bucket_of:
            if param in self.held_grad:       # added in place to the held sum, which goes on
                mem.mark(ev.name)
                mem.unref(g)
                g = self.held_grad.pop(param)
            self._arrive(self.bucket_of[param], g, ev.name)
            return
        if not e.reshard.backward:
            self._contribute(e.value, g, ev.name)
            return
        most, final = self._steps_transient(e.reshard.backward, self._edge_bytes(ev.edge))
        out = mem.alloc(self._local_bytes(e.value, e.src), "temporaries")
        mem.mark(ev.name, extra=max(0, most - out.nbytes))
        mem.unref(g)
        self._contribute(e.value, out, ev.name)

    # -- gradient buckets -------------------------------------------------------------------
    def _arrive(self, b: int, g: Storage, at: str) -> None:
        """A gradient reaches its bucket (codegen/buckets.py). An all-reduce bucket copies it
        into its flat buffer, allocated whole at the first arrival. A reduce-scatter bucket
        keeps the gradients until all have come, then lays them out in one buffer and
        reduce-scatters it; the buffer lives until the next reduce-scatter bucket is issued
        (the runtime finishes one before it issues the next), or the end of backward."""
        mem, bucket = self.mem, self.buckets[b]
        if getattr(bucket, "kind", CollectiveKind.ALL_REDUCE) != CollectiveKind.REDUCE_SCATTER:
            if b not in self.bucket_buf:
                self.bucket_buf[b] = mem.alloc(bucket.nbytes, "gradients")
            mem.mark(at)
            mem.unref(g)
            return
        mem.recategorize(g, "gradients")
        held = self.bucket_held.setdefault(b, [])
        held.append(g)
        mem.mark(at)
        if len(held) == len(bucket.members):
            self._scatter(b, at)

    def _scatter(self, b: int, at: str) -> None:
        for prev in list(self.bucket_out):      # one reduce-scatter bucket in flight
            self._complete(prev)
        mem, bucket = self.mem, self.buckets[b]
        n = self.mesh_shape[bucket.axes[0]] if bucket.axes else 1
        self.bucket_buf[b] = mem.alloc(bucket.nbytes, "gradients")
        self.bucket_out[b] = mem.alloc(bucket.nbytes // max(n, 1), "gradients")
        mem.mark(at)
        for g in self.bucket_held.pop(b, []):
            mem.unref(g)

    def _finish_buckets(self) -> None:
        """End of backward: an all-reduced buffer becomes its parameters' ``.grad`` (views of
        it); a reduce-scattered bucket leaves each member its gradient shard (the state's
        gradient bytes, cost/state.py) and frees its buffers."""
        mem = self.mem
        for b in list(self.bucket_held):
            self._scatter(b, "gradient buckets")        # a member's gradient never came
        for b in list(self.bucket_out):
            self._complete(b)
        mem.mark("end of backward")

    def _complete(self, b: int) -> None:
        """A reduce-scatter bucket done: its members' shards stay, its buffers go."""
        mem = self.mem
        out = self.bucket_out.pop(b)
        for m in self.buckets[b].members:
            if m in self.state and m not in self.fetched:    # (a host one's goes down)
                self.p_grad.setdefault(m, mem.alloc(int(self.state[m]["gradients"]),
                                                    "gradients"))
        mem.mark("gradient buckets")
        mem.unref(out)
        mem.unref(self.bucket_buf.pop(b))

    # -- optimizer step ---------------------------------------------------------------------
    def _optimizer(self) -> None:
        """Parameters, gradients and optimizer state, plus each moment of the step program's
        optimizer step (cost/program.py ``OptimizerStep.moments``)."""
        for at, extra in self.program.optimizer.moments():
            self.mem.mark(at, extra=extra)
