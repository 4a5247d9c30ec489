"""The liveness walk's forward (cost/liveness.py; docs/cost-model.md §4.5): the program's
events in order, each op's outputs made and every tensor freed after its last forward use
unless an op keeps it for backward; a checkpointed layer keeping its inputs, and under
selective checkpointing the outputs it stores for its recomputation."""
from __future__ import annotations

from typing import Any

import torch.fx as fx

from autoshard.cost.comm import Reshard
from autoshard.cost.compute import local_numel, op_profile
from autoshard.cost.live_memory import Storage, fake_value
from autoshard.cost.memory import saved_rule
from autoshard.cost.program import Event
from autoshard.cost.walk_values import ValueWalk
from autoshard.ir import CollectiveKind, shard_factor
from autoshard.ops.registry import record_of


class ForwardWalk(ValueWalk):
    """Forward, and recomputation (a checkpointed layer's forward run again in backward)."""

    def _forward(self, events: list[Event], *, recompute: bool) -> list[Storage]:
        """Run ``events`` forward. Outside recomputation: the whole program, returning the loss's
        storages (held until backward starts). Recomputing a checkpointed layer: its events,
        whose saved tensors are held for their backward."""
        uses: dict[Any, int] = {}
        self.born_here: set[Any] = set()
        for ev in events:
            for key in self._event_reads(ev):
                uses[key] = uses.get(key, 0) + 1
        if not recompute:
            self._ends(uses)
        started: set[str] = set()
        for ev in events:
            if ev.region is not None and not recompute and ev.region not in started:
                started.add(ev.region)
                self._hold_region_inputs(ev.region)
            if ev.kind == "reshard":
                self._forward_reshard(ev, uses, recompute=recompute)
            else:
                self._forward_op(ev, uses, recompute=recompute)
        if recompute:
            return []
        for key in self.sent:
            self._use(key, uses)
        loss = []
        for key in self._loss_keys():
            if key in self.tensors:
                loss.append(self.mem.ref(self.tensors[key]))
                self._use(key, uses)
        return loss

    def _forward_reshard(self, ev: Event, uses: dict[Any, int], *, recompute: bool) -> None:
        """A reshard's forward: its copy made (or the tensor itself, where it aliases), the
        collectives' staging alive while it runs; under selective checkpointing, its
        collectives' outputs stored (in forward) or handed back (recomputing)."""
        mem, tensors, region = self.mem, self.tensors, ev.region
        e = self.edges[ev.edge]
        src = tensors.get(e.value)
        key = ("edge", ev.edge)
        if src is None:
            return
        store = self._stores_reshard(ev)
        raw = self._collective_outputs(e.reshard, self._local_bytes(e.value, e.src)) \
            if store else []
        if recompute and store and raw[-1][1]:
            tensors[key] = self._take(region, key)        # stored: replayed
            mem.mark(ev.name)
            self._drop_staging(region, ev.edge)
        elif self._reshard_aliases(e.reshard):
            if e.value[0] in self.fetched:     # the copy in from the host
                tensors[key] = mem.alloc(self._local_bytes(e.value, e.src), "activations")
            else:
                tensors[key] = mem.ref(src)
            mem.mark(ev.name)
        else:
            nin = self._local_bytes(e.value, e.src)
            most, _ = self._steps_transient(e.reshard.forward, nin)
            out = self._edge_bytes(ev.edge)
            tensors[key] = mem.alloc(out, "activations")
            # A parameter kept on the host: its copy in is alive while it is gathered.
            held = nin if e.value[0] in self.fetched else 0
            mem.mark(ev.name, extra=max(0, most - out) + held, extra_cat="activations")
            if recompute and store:     # made again from the stored staging output
                self._drop_staging(region, ev.edge)
        if store and not recompute:
            # Selective checkpointing keeps every collective's own output: the final
            # tensor, or a staging one the final is cut or concatenated from.
            for nbytes, final in raw:
                if final:
                    self._store(region, key)
                else:
                    self.stored.setdefault(region, []).append(
                        (("staging", ev.edge), mem.alloc(nbytes, "activations")))
        self._born(key, uses)
        self._use(e.value, uses)

    def _forward_op(self, ev: Event, uses: dict[Any, int], *, recompute: bool) -> None:
        """An op's forward: a host-kept parameter's copy in for its first direct reader, its
        outputs made (or handed back by the selective store), what it saves held."""
        mem, tensors, region = self.mem, self.tensors, ev.region
        node = self.nodes[ev.name]
        reads = self._event_reads(ev)
        for key in reads:
            if key[0] == "fetch" and key not in self.born_here and (
                    not recompute or self.fetch_region.get(key[1]) == region):
                # The copy in of a parameter kept on the host, made for its first direct
                # reader (again where that reader is recomputed).
                tensors[key] = mem.alloc(self._local_bytes((key[1], 0),
                                                           self._out_spec((key[1], 0))),
                                         "activations")
                self._born(key, uses)
        store = self._stores_op(node.name)
        if recompute and store:
            outs = self._replayed_outputs(region, node)
        else:
            outs = self._outputs(node, reads)
        mem.mark(node.name, extra=self._workspace(node.name)[0])
        if store and not recompute:
            for key in outs:
                self._store(region, key)
        if self.training and (recompute or region is None):
            self._hold_saved(node, reads, outs)
        for key in outs:
            self._born(key, uses)
        for key in reads:
            self._use(key, uses)

    def _ends(self, uses: dict[Any, int]) -> None:
        """The program's ends in forward: the loss and, on a pipeline stage, the values sent
        on to the next stages are read once more at its end; the values received from earlier
        stages are there before its first op."""
        for key in [*self._loss_keys(), *self.sent]:
            uses[key] = uses.get(key, 0) + 1
        for key in [k for k in uses if self._received(k)]:
            self.tensors[key] = self.mem.alloc(self._value_bytes(key), "activations")
            self._born(key, uses)

    def _hold_saved(self, node: fx.Node, reads: list[Any], outs: list[Any]) -> None:
        """What the op keeps for its backward, held until it runs."""
        if node.name not in self.grads:
            return                           # no gradient flows through it: autograd keeps nothing
        info = self.pricer.info(node.name)
        rule = saved_rule(info)
        held: list[Storage] = []
        for k in rule.inputs:
            if k < len(reads) and (node.name, k) in self.saved_at and reads[k] in self.tensors:
                held.append(self.mem.ref(self.tensors[reads[k]]))
        for j in rule.outputs:
            ref = (node.name, j)
            if ref in self.tensors and ref in outs:
                held.append(self.mem.ref(self.tensors[ref]))
        extra = self._extra_bytes(node.name, info, rule)
        if extra:
            held.append(self.mem.alloc(extra, "activations"))
        if held:
            self.held.setdefault(node.name, []).extend(held)

    def _saves(self, node: fx.Node) -> bool:
        """Whether the op keeps anything for its backward."""
        if not self.training or node.name not in self.grads:
            return False
        rule = saved_rule(self.pricer.info(node.name))
        return bool(rule.outputs or rule.extra) or any((node.name, k) in self.saved_at
                                                       for k in rule.inputs)

    def _extra_bytes(self, name: str, info: Any, rule: Any) -> int:
        """Buffers the op keeps that are not graph values: per-row statistics, masks
        (``Saves.extra``, as memory.saved_activation_bytes counts them)."""
        prof = op_profile(info)
        strat = self.strategies[name]
        ins = strat.inputs if len(strat.inputs) == len(prof.inputs) else tuple(
            s for s in strat.inputs if s is not None)
        total = 0
        for side, idx, per, nbytes in rule.extra:
            infos = prof.inputs if side == "in" else prof.outputs
            specs = ins if side == "in" else strat.outputs
            if idx >= len(infos):
                continue
            shape, isz = infos[idx]
            spec = specs[idx] if idx < len(specs) else None
            n = local_numel(tuple(shape), spec, self.mesh_shape)
            if per == "row" and shape:
                last = shape[-1] // (shard_factor(spec, len(shape) - 1, self.mesh_shape)
                                     if spec else 1)
                n //= max(last, 1)
            total += n * (nbytes or isz)
        return total

    def _hold_region_inputs(self, region: str) -> None:
        """A checkpointed layer keeps the tensors it reads from outside itself (its inputs;
        parameters are alive anyway) until its backward has run."""
        inside = self.region_ops.get(region, set())
        held: dict[int, Storage] = {}
        for ev in self.region_events.get(region, []):
            keys = [self.edges[ev.edge].value] if ev.kind == "reshard" else self._event_reads(ev)
            for key in keys:
                produced_inside = (key[0] not in ("edge", "fetch") and key[0] in inside) or (
                    key[0] == "edge" and self.edge_region.get(key[1]) == region) or (
                    key[0] == "fetch" and self.fetch_region.get(key[1]) == region)
                if produced_inside or key in self.pinned or key not in self.tensors:
                    continue
                s = self.tensors[key]
                if id(s) not in held:
                    held[id(s)] = self.mem.ref(s)
        self.region_held[region] = list(held.values())

    # -- selective checkpointing ------------------------------------------------------------
    def _selective(self, region: str | None) -> bool:
        return region is not None and self.policies.get(region) == "selective"

    def _stores_op(self, name: str) -> bool:
        """Whether selective checkpointing keeps the op's outputs from forward to its layer's
        recomputation (codegen/recompute.py: matmuls and attention, ``Pricer.stores``)."""
        if not self._selective(self.op_region.get(name)):
            return False
        stores = getattr(self.pricer, "stores", None)
        if callable(stores):
            return bool(stores(name))
        return record_of(self.nodes[name].target).family in ("matmul", "attention")

    def _stores_reshard(self, ev: Event) -> bool:
        """Selective checkpointing keeps every collective's output (a replay moves nothing)."""
        return self._selective(ev.region) and any(
            st.is_collective for st in self.edges[ev.edge].reshard.forward)

    def _collective_outputs(self, r: Reshard, nbytes: int) -> list[tuple[int, bool]]:
        """(bytes, whether it is the reshard's result) of the output of each collective of
        ``r``'s forward, run on a tensor of ``nbytes`` (codegen/collectives.py: an all-gather
        along a dim other than 0 and an all-to-all concatenate their collective's output)."""
        out, cur = [], nbytes
        steps = list(r.forward)
        for i, st in enumerate(steps):
            n = st.group_size(self.mesh_shape) if st.axis < len(self.mesh_shape) else 1
            last = i == len(steps) - 1
            if st.kind == CollectiveKind.ALL_GATHER:
                cur *= n
                out.append((cur, last and st.dim == 0))
            elif st.kind == CollectiveKind.REDUCE_SCATTER:
                cur //= n
                out.append((cur, last))
            elif st.kind in (CollectiveKind.ALL_REDUCE, CollectiveKind.ALL_TO_ALL):
                out.append((cur, last and st.kind == CollectiveKind.ALL_REDUCE))
            elif st.kind == "slice":
                cur //= n
        return out or [(0, False)]

    def _store(self, region: str, key: Any) -> None:
        s = self.tensors.get(key)
        if s is not None:
            self.stored.setdefault(region, []).append((key, self.mem.ref(s)))

    def _take(self, region: str, key: Any) -> Storage:
        """A stored output handed back by the replay (the store's reference goes with it)."""
        entries = self.stored.get(region, [])
        for i, (k, s) in enumerate(entries):
            if k == key:
                return entries.pop(i)[1]
        return self.mem.alloc(self._value_bytes(key) if key[0] != "edge"
                              else self._edge_bytes(key[1]), "activations")

    def _drop_staging(self, region: str, edge: int) -> None:
        """The stored staging outputs of a reshard, once its result is made from them."""
        entries = self.stored.get(region, [])
        for s in [s for k, s in entries if k == ("staging", edge)]:
            self.mem.unref(s)
        self.stored[region] = [(k, s) for k, s in entries if k != ("staging", edge)]

    def _replayed_outputs(self, region: str, node: fx.Node) -> list[Any]:
        val = node.meta.get("val")
        n_out = len(val) if isinstance(val, (tuple, list)) else 1
        outs = []
        for j in range(n_out):
            if fake_value(node, j) is not None:
                self.tensors[(node.name, j)] = self._take(region, (node.name, j))
                outs.append((node.name, j))
        return outs
