"""The compute side of a node's price (docs/cost-model.md §3): an op's forward and backward
seconds (the roofline, cost/compute.py) as a step runs them, the backward window gradient syncs
hide behind (§7), and the collectives an op runs inside itself (a vocabulary-parallel
cross-entropy's all-reduces, §3.8, ring attention's hops, §3.11) with the workspace its kernel
holds. A mixin of :class:`~autoshard.cost.price.Pricer`, kept apart because these prices read an
op and its strategy alone, not the values around it."""
from __future__ import annotations

from autoshard.cost.comm import Step, step_seconds
from autoshard.cost.compute import op_times
from autoshard.ir import Phase, Strategy
from autoshard.ops.registry import op_collectives, record_of


class ComputePricing:
    """Seconds of an op's own work. Reads of its Pricer: ``_nodes``, ``info``, ``mesh``,
    ``merge``, ``options``, ``training``, ``fused`` and ``runs``; the checkpointing policy
    (``reruns``, ``reshards_again``: cost/price_recompute.py) and a parameter's optimizer step
    (``optimizer_seconds``, ``offload_step_seconds``: cost/price_state.py)."""

    def compute(self, name: str, strategy: Strategy) -> float:
        """Forward + backward seconds (+ the forward again where it is recomputed)."""
        fwd, bwd = self.times(name, strategy)
        if self._nodes[name].op == "placeholder":
            return fwd                  # its optimizer step, once per step
        return (fwd * (2 if self.reruns(name) else 1) + bwd) * self.runs

    def times(self, name: str, strategy: Strategy) -> tuple[float, float]:
        """(forward, backward) seconds of an op once (a parameter: its optimizer step, 0)."""
        if self._nodes[name].op == "placeholder":
            return self.optimizer_seconds(name, strategy), 0.0
        return op_times(self.info(name), strategy, self.mesh, training=self.training,
                        compiled=self.options.compile, fused=self.fused.get(name))

    def backward(self, name: str, strategy: Strategy) -> float:
        """The window gradient syncs hide behind: the backward part of :meth:`compute`, times
        the share of it a collective can overlap on this cluster (``Cluster.comm_overlap``).
        A parameter whose offloaded host step runs in that window (:meth:`offload_step_seconds`)
        takes its seconds out of it: the ILP's window is ``w >= sync + host - backward``.
        Compiled alike: a program that syncs gradients is compiled a region per layer
        (codegen/compile.py ``_partition``), whose syncs overlap the earlier layers' backward
        (docs/cost-model.md §3.10)."""
        if self._nodes[name].op == "placeholder":
            return -self.offload_step_seconds(name, strategy)[1]
        return self.times(name, strategy)[1] * self.mesh.cluster.comm_overlap

    def op_steps(self, name: str, strategy: Strategy) -> tuple[Step, ...]:
        """The collectives the op runs inside itself under ``strategy`` (ops/registry.py
        ``collectives``), as steps on the mesh the program runs on (an op planned on merged axes
        runs on the real ones)."""
        return tuple(st for _, st, _ in self.op_charges(name, strategy))

    def op_charges(self, name: str, strategy: Strategy) -> tuple[tuple[str, Step, float], ...]:
        """``(phase, step, exposed seconds)`` of each collective the op runs inside itself, in
        its order: a blocking one's seconds whole, an overlapped one's (ring attention's hops)
        beyond the share of the op's compute it runs beside, ``max(0, t - hides·c·overlap)``
        with ``c`` the op's forward or backward seconds (docs/cost-model.md §3.8, §3.11)."""
        node = self._nodes[name]
        if node.op != "call_function" or record_of(node.target).collectives is None:
            return ()
        strategy, mesh_shape = self._on_real_mesh(strategy)
        colls = op_collectives(self.info(name), strategy, mesh_shape)
        if not colls:
            return ()
        real = self.merge.real if self.merge else self.mesh
        fwd, bwd = self.times(name, strategy) if any(c.hides for c in colls) else (0.0, 0.0)
        overlap = self.mesh.cluster.comm_overlap
        out = []
        for c in colls:
            st = Step(c.kind, c.axis, nbytes=c.nbytes, joint=c.joint)
            hidden = c.hides * (fwd if c.phase == Phase.FORWARD else bwd) * overlap
            out.append((c.phase, st, max(0.0, step_seconds(st, real) - hidden)))
        return tuple(out)

    def _on_real_mesh(self, strategy: Strategy) -> tuple[Strategy, tuple[int, ...]]:
        """The strategy as it runs on the mesh the program runs on (an op planned on merged
        axes runs on the real ones), and that mesh's shape."""
        if self.merge is None:
            return strategy, self.mesh.shape
        return Strategy(tuple(self.merge.expand_spec(s) for s in strategy.inputs),
                        tuple(self.merge.expand_spec(s) for s in strategy.outputs),
                        strategy.kernel, strategy.compute_scale), self.merge.real.shape

    def workspace(self, name: str, strategy: Strategy) -> tuple[int, int]:
        """Bytes the op's kernel holds while it runs beyond its tensors, (forward, backward)
        (ops/registry.py ``workspace``; ring attention's blocks in flight, §3.11)."""
        node = self._nodes[name]
        fn = record_of(node.target).workspace if node.op == "call_function" else None
        if fn is None:
            return 0, 0
        strategy, mesh_shape = self._on_real_mesh(strategy)
        return fn(self.info(name), strategy, mesh_shape)

    def op_comm_seconds(self, name: str, strategy: Strategy) -> float:
        """Exposed seconds of :meth:`op_charges`; the forward ones twice where a fully
        checkpointed layer runs the op's forward again (selective stores collective outputs,
        §8)."""
        charges = self.op_charges(name, strategy)
        if not charges:
            return 0.0
        again = 2 if self.reshards_again(name) else 1
        return sum(t * (again if phase == Phase.FORWARD else 1)
                   for phase, _, t in charges) * self.runs
