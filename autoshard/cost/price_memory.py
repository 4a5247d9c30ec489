"""The memory side of a node's price (docs/cost-model.md §4): the bytes one device holds for a
node (a parameter's state or a buffer; for an op, what it saves for backward apart from its
inputs), and the copies of the values ops keep for backward, once per layout they read them in
(§4.4). A mixin of :class:`~autoshard.cost.price.Pricer`, kept apart from the seconds because the
ILP's memory sums and the plan's memory figures read these alone."""
from __future__ import annotations

import operator

import torch.fx as fx

from autoshard.cost.compute import local_numel, op_profile
from autoshard.cost.memory import saved_activation_bytes, saved_rule
from autoshard.ir import Spec, StateMode, Strategy
from autoshard.ops.registry import VIEW, record_of
from autoshard.trace.graph import ValueRef, value_inputs

Consumer = tuple[str, int]   # (consumer node, tensor input position)


class MemoryPricing:
    """Bytes per node and per saved value. Reads of its Pricer: ``_nodes``, ``info``, ``traced``,
    ``training``, ``mesh``, ``shapes``, ``params``, ``grads``, ``activation_copies`` and the memos
    ``_saved_inputs`` and ``_kept``; the checkpointing policy (cost/price_recompute.py), model
    state (``state_bytes``, ``accumulated_bytes``, ``fetch_bytes``: cost/price_state.py) and
    ``steps`` (cost/price_reshard.py)."""

    def memory(self, name: str, strategy: Strategy) -> float:
        """Bytes one device holds for the node: a parameter's state or a buffer; for an op, what
        it saves for backward apart from its inputs (those are :meth:`saved_copy_bytes`)."""
        node = self._nodes[name]
        if node.op == "placeholder":
            return float(self.state_bytes(name, strategy).device
                         + self.accumulated_bytes(name, strategy))
        if not self.training:
            return 0.0
        info = self.info(name)
        saved = saved_activation_bytes(info, strategy, self.mesh.shape,
                                       exclude=frozenset(saved_rule(info).inputs))
        if self.policy(name) == "selective" and self.stores(name):
            # Selective checkpointing stores every output of the op, saved or not.
            saved = max(saved, sum(local_numel(shape, spec, self.mesh.shape) * isz
                                   for (shape, isz), spec in zip(
                                       op_profile(info).outputs, strategy.outputs)))
        return (saved * self.memory_weight(name) + self._kept_for_checkpoint(name, strategy)) \
            * self.activation_copies

    def _kept_for_checkpoint(self, name: str, strategy: Strategy) -> float:
        """The outputs of ``name`` a checkpointed layer keeps as its inputs, in their layout."""
        total = 0.0
        for i, spec in enumerate(strategy.outputs):
            if (name, i) in self.checkpoint_inputs():
                shape, itemsize = self.shapes[(name, i)]
                total += local_numel(shape, spec, self.mesh.shape) * itemsize
        return total

    def saved_inputs(self) -> dict[ValueRef, list[Consumer]]:
        """Each value some op keeps for its backward, with those (consumer, input position)
        pairs (training only; empty for inference)."""
        if self._saved_inputs is None:
            out: dict[ValueRef, list[Consumer]] = {}
            if self.training:
                for node in self.traced.graph.nodes:
                    if node.op != "call_function" or node.target is operator.getitem:
                        continue
                    refs = value_inputs(node)
                    for k in saved_rule(self.info(node.name)).inputs:
                        if k < len(refs) and self._needed(node, refs, k):
                            out.setdefault(refs[k], []).append((node.name, k))
            self._saved_inputs = out
        return self._saved_inputs

    def _needed(self, node: fx.Node, refs: list[ValueRef], k: int) -> bool:
        """A product's backward keeps one factor only for the other's gradient: PyTorch saves
        ``a`` of ``a * b`` only if ``b`` needs a gradient (RoPE's ``q * cos`` keeps ``cos``,
        not ``q``)."""
        if not record_of(node.target).one_factor or len(refs) != 2:
            return True
        other = refs[1 - k][0]
        return other in self.grads or other in self.params

    def saved_copy_bytes(self, value: ValueRef, src: Spec, dst: Spec,
                         mode: StateMode | None = None) -> float:
        """Bytes one device keeps of ``value`` in layout ``dst`` for the ops that save it there
        (one tensor however many ops save it). Nothing when that tensor is the producer's own
        (``dst == src``) and already counted: a parameter or buffer, an output its op saves, or
        a view of one; but a parameter under offload (``mode``, its state mode) is read from
        its copy on the device, which is what the ops keep."""
        same = dst == src or not self.steps(value, src, dst, frozenset()).forward
        if same and self.kept(value) and not self.fetch_bytes(value, src, mode):
            return 0.0      # (specs that differ only on 1-device axes: same)
        shape, itemsize = self.shapes[value]
        return float(local_numel(shape, dst, self.mesh.shape) * itemsize)

    def saved_copies(self, strategies: dict[str, Strategy]) -> float:
        """:meth:`saved_copy_bytes` summed over a full assignment: every value once per layout
        its saving consumers read it in (weighted as the most-kept of its savers, see
        :meth:`memory_weight`)."""
        total = 0.0
        for ref, cons in self.saved_inputs().items():
            src = strategies[ref[0]].outputs[ref[1]]
            mode = strategies[ref[0]].kernel if ref[0] in self.params else None
            for dst in dict.fromkeys(strategies[c].inputs[k] for c, k in cons):
                total += self.saved_copy_bytes(ref, src, dst, mode) * self.copy_weight(
                    ref, cons, src, dst)
        return total

    def kept(self, value: ValueRef) -> bool:
        """Whether ``value`` in its producer's layout is already counted in memory."""
        known = self._kept.get(value)
        if known is None:
            node = self._nodes[value[0]]
            if node.op == "placeholder":
                ph = self.traced.placeholder(node.name)
                known = ph.kind != "input"
            elif record_of(node.target).family == VIEW:
                refs = value_inputs(node)
                known = bool(refs) and self.kept(refs[0])
            else:
                known = value[1] in saved_rule(self.info(node.name)).outputs \
                    or self._stored(value)
            self._kept[value] = known
        return known
