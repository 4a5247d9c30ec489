"""The one pricing function: what a node costs under a strategy, and what a reshard costs.

The ILP's coefficients (solver/build.py) and a Plan's predicted figures (solver/assemble.py) are
both sums of these two prices, the first over every (node, strategy) and (value, source layout,
requirement) the search may pick, the second over the ones a plan picked. A change to a price
(overlap, recomputation, offload) is made here once: :class:`Pricer` holds what every price
reads of the graph, the mesh and the options, and its parts by concern are mixins, each in its
own module.

- :meth:`Pricer.node`: seconds of compute on one device (forward, + backward in training;
  docs/cost-model.md §3; cost/price_compute.py) and bytes one device holds for the node
  (cost/price_memory.py): a parameter's state (weights, gradient, optimizer; cost/price_state.py),
  a buffer, or the outputs (and per-row statistics) an op saves for backward (§4).
- :meth:`Pricer.reshard_cost` (cost/price_reshard.py): seconds of the collectives that move a
  value from its producer's layout to a requirement, both directions (§1): blocking seconds, and
  the seconds of a data-parallel gradient sync that runs in buckets behind backward compute
  (§7), which the step pays only where backward compute (:meth:`Pricer.backward`) cannot hide it.
- :meth:`Pricer.op_charges` / :meth:`Pricer.op_comm_seconds` (cost/price_compute.py): the
  collectives an op runs inside itself (a vocabulary-parallel cross-entropy's all-reduces, §3.8,
  blocking; ring attention's hops, §3.11, each behind one step's block compute), priced like a
  reshard's and listed in the plan's ledger.
- :meth:`Pricer.saved_copy_bytes` (cost/price_memory.py): the bytes of a value that the ops
  reading it keep for backward, once per layout they read it in (§4.4): the normed input that
  q, k and v projections all save is one tensor, and a ZeRO-3 weight gathered for a linear is
  one gathered copy.
- Activation checkpointing (§8) in all of them: cost/price_recompute.py.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from autoshard.cost.comm import Groups
from autoshard.cost.compute import fusions
from autoshard.cost.price_compute import ComputePricing
from autoshard.cost.price_memory import Consumer, MemoryPricing
from autoshard.cost.price_recompute import RecomputePricing
from autoshard.cost.price_reshard import ReshardPricing
from autoshard.cost.price_state import StatePricing
from autoshard.cost.reshards import carries_grad, frozen, traced_grads
from autoshard.errors import AutoshardError
from autoshard.ir import OffloadLevel, OpInfo, Strategy
from autoshard.mesh import AxisMerge, Mesh
from autoshard.options import PlanOptions, state_modes
from autoshard.trace.export import TracedGraph, op_info
from autoshard.trace.graph import ValueRef, value_inputs


@dataclass(frozen=True, slots=True)
class Price:
    seconds: float
    bytes: float


class Pricer(ComputePricing, RecomputePricing, MemoryPricing, StatePricing, ReshardPricing):
    """Prices on ``mesh`` (the mesh the strategies are written for). With ``merge``, ``mesh`` is
    ``merge.merged()`` and reshards are priced as they run on the real mesh, each merged axis's
    collectives as one over its real axes' joint group. ``joint``: without ``merge``, the groups
    of ``mesh``'s axes whose collectives run as one (a plan's ``joint_axes``,
    docs/cost-model.md §1.4).

    ``recompute``: layer name -> activation checkpointing policy (docs/cost-model.md §8), or a
    set of layer names (all "full"). "full": every op of the layer runs its forward again in
    backward, its reshards' collectives included; of what its ops save, one layer's worth per
    group of identical layers is alive at once (the layer being recomputed), which
    :meth:`memory_weight` expresses as a weight of 1/(group size); the values the layer reads
    from outside are kept whole (:meth:`checkpoint_inputs`). "selective" (Korthikanti et al.
    2022, §5): the outputs of matmuls, attention and collectives are stored (:meth:`stores`)
    and everything else (norms, activations, RoPE, residual adds, local slices) is recomputed
    from them.

    ``offload``: whether parameters may keep their optimizer state on the host ("optimizer"), or
    their stored shards and gradients too ("parameters") (cost/state.py, options.state_modes); the
    ZeRO modes ``options`` allows are offered either way."""

    def __init__(self, traced: TracedGraph, mesh: Mesh, options: PlanOptions, *,
                 merge: AxisMerge | None = None,
                 recompute: Mapping[str, str] | frozenset[str] = frozenset(),
                 offload: OffloadLevel = OffloadLevel.NONE, joint: Groups = ()) -> None:
        self.traced, self.mesh, self.options, self.merge = traced, mesh, options, merge
        # A pipeline's stages share one SPMD plan of one microbatch (solver/pipeline.py): they
        # run the graph m times per step and the gradient sync and optimizer step once, so each
        # run bears 1/m of those; and k microbatches' activations are alive at once on the
        # fullest stage, so its activations weigh k against the stages' memory.
        m, k = options.stage_run or (1, 1.0)
        self.step_share, self.activation_copies = 1.0 / m, float(k)
        # Gradient accumulation (docs/cost-model.md §7.2): the prices are an optimizer step's,
        # whose N micro-steps each run forward and backward with their collectives (``runs``
        # times), then one gradient sync, behind the last micro-step's backward only (the
        # window, :meth:`backward`, is one micro-step's), and one optimizer step.
        self.runs = options.accumulation_steps if traced.training else 1
        self.joint: Groups = merge.joint() if merge is not None else joint
        self.training = traced.training
        self.modes = state_modes(options, OffloadLevel(offload)) if self.training else (None,)
        if not isinstance(recompute, Mapping):
            recompute = {layer: "full" for layer in recompute}
        self.recompute: dict[str, str] = dict(recompute) if self.training else {}
        groups: dict[str, int] = {}
        for layer in traced.layers:
            groups[layer.same_as] = groups.get(layer.same_as, 0) + 1
        self._group_size = {layer.name: groups[layer.same_as] for layer in traced.layers
                            if layer.name in self.recompute}
        self.params = {p.name for p in traced.params}
        # A tied weight (one tensor under several names) is lifted as one graph input per name:
        # the first holds the weight's state, every later one maps to it.
        names: dict[str, list[str]] = {}
        for p in traced.params:
            names.setdefault(p.fqn, []).append(p.name)
        tied = {fqn: ns for fqn, ns in names.items() if len(ns) > 1}
        self.tied_to = {n: ns[0] for ns in tied.values() for n in ns[1:]}
        self.tied_fqns = {n: fqn for fqn, ns in tied.items() for n in ns}
        self.shapes = traced.value_shapes
        self.grads = traced_grads(traced) if self.training else frozenset()
        self._nodes = {n.name: n for n in traced.graph.nodes}
        # Frozen parameters (requires_grad=False): their state is the parameter alone.
        self.frozen = frozenset(n for n in self.params if frozen(self._nodes[n]))
        if self.training and options.offload in (OffloadLevel.OPTIMIZER, OffloadLevel.PARAMETERS):
            _refuse_wide_offload(traced, self.frozen)
        self._infos: dict[str, OpInfo] = {}
        self._saved_inputs: dict[ValueRef, list[Consumer]] | None = None
        self._kept: dict[ValueRef, bool] = {}
        self._ckpt_inputs: dict[ValueRef, None] | None = None
        self._reshard_memo: dict[tuple, float] = {}
        self._has_grad: dict[ValueRef, bool] = {}
        # Compiled, elementwise chains run as one kernel each (docs/cost-model.md §3.10).
        self.fused = fusions(traced.graph) if options.compile else {}

    # -- per node ---------------------------------------------------------------------------
    def has_grad(self, value: ValueRef) -> bool:
        """Whether ``value`` carries a gradient in training (cost/reshards.py ``carries_grad``);
        asked for every reshard priced, so kept per value."""
        known = self._has_grad.get(value)
        if known is None:
            known = self._has_grad[value] = carries_grad(self._nodes, self.grads, value)
        return known

    def info(self, name: str) -> OpInfo:
        """The op's view of a call_function node (computed once)."""
        info = self._infos.get(name)
        if info is None:
            info = self._infos[name] = op_info(self._nodes[name])
        return info

    def node(self, name: str, strategy: Strategy) -> Price:
        return Price(self.compute(name, strategy), self.memory(name, strategy))

    def reads(self, name: str) -> list[str]:
        """The nodes whose values ``name`` reads, by input position."""
        return [ref[0] for ref in value_inputs(self._nodes[name])]


def _refuse_wide_offload(traced: TracedGraph, frozen_: frozenset[str]) -> None:
    """A forced offload of an fp64 model: the host's step keeps fp32 masters and moments
    (codegen/hostopt.py), so no fp64 parameter may take it (cost/state.py ``state_choices``)."""
    wide = [p.fqn for p in traced.params
            if p.name not in frozen_ and p.info.dtype.itemsize > 4]
    if wide:
        raise AutoshardError("offload of 16-bit or fp32 parameters (the host's step keeps fp32 "
                             "masters and moments)",
                             got=f"{len(wide)} fp64 parameters ({wide[0]}, ...)",
                             fix="plan with --offload none (or auto), or cast the model to "
                                 "fp32")
