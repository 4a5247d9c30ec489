"""Activation checkpointing in the price (docs/cost-model.md §8): which ops a layer's policy runs
again in backward, how much of what they save counts toward the peak (one layer's worth per
group of identical layers), what selective checkpointing stores (the outputs of matmuls,
attention and collectives: Korthikanti et al. 2022, §5), and the inputs a checkpointed layer
keeps. A mixin of :class:`~autoshard.cost.price.Pricer`, kept apart because the compute, memory
and reshard prices all ask the one policy."""
from __future__ import annotations

import operator

from autoshard.cost.compute import local_numel
from autoshard.cost.price_memory import Consumer
from autoshard.ir import Spec
from autoshard.ops.registry import STORED_FAMILIES, record_of
from autoshard.trace.graph import ValueRef, value_inputs


class RecomputePricing:
    """The checkpointing policy of each op and what it keeps. Reads of its Pricer: ``recompute``,
    ``_group_size``, ``traced``, ``_nodes``, ``params``, ``shapes``, ``mesh``,
    ``activation_copies`` and the memo ``_ckpt_inputs``; ``steps`` (cost/price_reshard.py), to
    tell a collective's output."""

    def policy(self, name: str) -> str | None:
        """The checkpointing policy of the layer op ``name`` is in, if any."""
        if not self.recompute or self._nodes[name].op != "call_function":
            return None
        return self.recompute.get(self.traced.layer_of_node.get(name))

    def recomputed(self, name: str) -> bool:
        """Whether ``name`` is an op of a checkpointed layer."""
        return self.policy(name) is not None

    def stores(self, name: str) -> bool:
        """Whether selective checkpointing keeps the op's outputs: a matmul or attention (their
        outputs are what is costly to recompute: Korthikanti et al. 2022, §5)."""
        return record_of(self._nodes[name].target).family in STORED_FAMILIES

    def reruns(self, name: str) -> bool:
        """Whether the op's forward runs again in backward."""
        policy = self.policy(name)
        return policy == "full" or (policy == "selective" and not self.stores(name))

    def reshards_again(self, name: str) -> bool:
        """Whether reshards read by ``name`` run their forward collectives again in backward:
        under full recomputation; selective stores collective outputs."""
        return self.policy(name) == "full"

    def memory_weight(self, name: str) -> float:
        """How much of what ``name`` saves for backward counts toward the peak: 1, or for an op
        of a checkpointed layer whose saved tensors are recomputed, 1/(its group of identical
        layers): one layer's worth per group is alive, while that layer is recomputed."""
        if self.policy(name) == "selective" and self.stores(name):
            return 1.0
        return self._layer_weight(name)

    def copy_weight(self, value: ValueRef, consumers: list[Consumer], src: Spec, dst: Spec
                    ) -> float:
        """The weight of a saved copy of ``value`` in layout ``dst`` (:meth:`memory_weight`):
        the least of its savers'. Under selective checkpointing a copy is recomputed (one
        layer's worth alive) unless a collective delivered it (stored, counted by
        :meth:`stored_reshard_bytes`)."""
        if any(self.policy(c) == "selective" for c, _ in consumers):
            if self._collective(value, src, dst):
                return 0.0      # a stored collective output: :meth:`stored_reshard_bytes`
            # Recomputed in backward from what is stored (a stored op's own output, kept in
            # its producer's layout, is :meth:`memory`'s and costs nothing here).
            return min(self._layer_weight(c) for c, _ in consumers) * self.activation_copies
        return min(self.memory_weight(c) for c, _ in consumers) * self.activation_copies

    def _layer_weight(self, name: str) -> float:
        if not self.recomputed(name):
            return 1.0
        return 1.0 / self._group_size[self.traced.layer_of_node[name]]

    def _collective(self, value: ValueRef, src: Spec, dst: Spec) -> bool:
        return any(st.is_collective for st in self.steps(value, src, dst, frozenset()).forward)

    def stored_reshard_bytes(self, value: ValueRef, src: Spec, dst: Spec, consumer: str
                             ) -> float:
        """Bytes selective checkpointing stores for a reshard run inside a selectively
        checkpointed layer (``consumer`` is where it runs): its output, when it comes from a
        collective."""
        if self.policy(consumer) != "selective" or not self._collective(value, src, dst):
            return 0.0
        shape, itemsize = self.shapes[value]
        return float(local_numel(shape, dst, self.mesh.shape) * itemsize) * self.activation_copies

    def _stored(self, value: ValueRef) -> bool:
        node = self._nodes[value[0]]
        return node.op == "call_function" and self.policy(node.name) == "selective" \
            and self.stores(node.name)

    def checkpoint_inputs(self) -> dict[ValueRef, None]:
        """The activations checkpointed layers read from outside themselves: what
        ``torch.utils.checkpoint`` keeps for each (parameters are model state)."""
        if self._ckpt_inputs is not None:
            return self._ckpt_inputs
        out: dict[ValueRef, None] = {}
        self._ckpt_inputs = out
        if not self.recompute:
            return out
        where = self.traced.layer_of_node
        for node in self.traced.graph.nodes:
            if not self.recomputed(node.name) or node.target is operator.getitem:
                continue
            for ref in value_inputs(node):
                if where.get(ref[0]) != where[node.name] and ref[0] not in self.params:
                    out[ref] = None
        return out
