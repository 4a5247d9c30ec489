"""The price of a reshard (docs/cost-model.md §1, §7): the collectives that move a value from its
producer's layout to a requirement, forward and backward, on the mesh the program runs on (an
axis merged for planning expanded to its real ones, §1.4); their blocking seconds, and a
parameter's gradient sync priced as its bucket runs it behind backward. A mixin of
:class:`~autoshard.cost.price.Pricer`, kept apart from the node prices because the ILP prices
these per edge and the plan's ledger lists them."""
from __future__ import annotations

from autoshard.cost.comm import Reshard, reshard, reshard_time, steps_time
from autoshard.cost.overlap import is_grad_sync, sync_share_seconds
from autoshard.cost.reshards import no_backward
from autoshard.cost.state import scatter_axes, zero_grad_sync
from autoshard.ir import Partial, Replicate, Shard, Spec, StateMode
from autoshard.trace.graph import ValueRef


class ReshardPricing:
    """Seconds of the collectives between layouts. Reads of its Pricer: ``mesh``, ``merge``,
    ``joint``, ``options``, ``shapes``, ``params``, ``runs``, ``step_share`` and the memo
    ``_reshard_memo``; ``has_grad``."""

    def reshard_seconds(self, value: ValueRef, src: Spec, dst: Spec,
                        divergent: frozenset[int]) -> float:
        """All the seconds of :meth:`reshard_cost`, blocking or not."""
        return sum(self.reshard_cost(value, src, dst, divergent))

    def reshard_cost(self, value: ValueRef, src: Spec, dst: Spec,
                     divergent: frozenset[int], mode: StateMode | None = None,
                     axes: tuple[int, ...] | None = None) -> tuple[float, float]:
        """(blocking seconds, bucketed gradient-sync seconds) of the reshard; ``mode``,
        ``axes``: the state mode and state axes of the parameter ``value`` is (zero2 and offload
        reduce-scatter the bucketed gradient over them, cost/state.py)."""
        shape, itemsize = self.shapes[value]
        grad = self.has_grad(value)
        param = value[0] in self.params
        key = (src, dst, shape, itemsize, divergent if grad else frozenset(), grad, param, mode,
               axes)
        t = self._reshard_memo.get(key)
        if t is None:
            steps = self.steps(value, src, dst, divergent)
            mesh = self.merge.real if self.merge else self.mesh
            if param and is_grad_sync(steps):
                steps = self.bucketed_sync(value, src, steps, mode, axes)
                t = (0.0, self.step_share * sync_share_seconds(steps, mesh,
                                                               self.options.bucket_bytes))
            else:
                t = (reshard_time(steps, mesh) * self.runs, 0.0)
            self._reshard_memo[key] = t
        return t

    def reshard_floor(self, value: ValueRef, src: Spec, dst: Spec) -> float:
        """A lower bound on :meth:`reshard_seconds` without building the reshard: every real
        mesh axis whose placement changes needs a collective on it — forward, or backward for a
        value with a gradient — unless it changes from replicated to partial, or to a shard of a
        value without a gradient (local steps both). A collective over ``p`` devices pays at
        least ``(p - 1)·alpha`` of its axis (docs/cost-model.md §1.1), and one over several axes
        at least the sum of theirs (``p1·p2 - 1 >= (p1 - 1) + (p2 - 1)`` at the slowest
        member's alpha). A parameter's gradient sync is priced in buckets, one latency per
        bucket: 0 for parameters."""
        if value[0] in self.params:
            return 0.0
        mesh = self.mesh
        if self.merge is not None:
            src, dst, mesh = self.merge.expand_spec(src), self.merge.expand_spec(dst), \
                self.merge.real
        grad = self.has_grad(value)
        t = 0.0
        for a, (x, y) in enumerate(zip(src, dst)):
            if x == y or (isinstance(x, Replicate)
                          and (isinstance(y, Partial) or (isinstance(y, Shard) and not grad))):
                continue
            t += (mesh.shape[a] - 1) * mesh.links[a].least_alpha
        return t * self.runs

    def bucketed_sync(self, value: ValueRef, src: Spec, steps: Reshard, mode: StateMode | None,
                      axes: tuple[int, ...] | None = None) -> Reshard:
        """A parameter's pure gradient sync as its bucket runs it: all-reduces, or under
        zero2/offload reduce-scatters over its state ``axes`` (None: its zero axes) and
        all-reduces of the shard over the others (on the real mesh)."""
        axes = scatter_axes(self.shapes[value][0], src, mode, axes, self.mesh.shape)
        if axes is None:
            return steps
        mesh_shape = self.mesh.shape
        if self.merge is not None:
            axes = tuple(sorted(self.merge.expand_axes(frozenset(axes))))
            mesh_shape = self.merge.real.shape
        return zero_grad_sync(steps, axes, mesh_shape)

    def forward_seconds(self, value: ValueRef, src: Spec, dst: Spec) -> float:
        """The forward collectives of a reshard alone: what recomputing it runs again."""
        steps = self.steps(value, src, dst, frozenset())
        return steps_time(steps.forward, self.merge.real if self.merge else self.mesh) * self.runs

    def steps(self, value: ValueRef, src: Spec, dst: Spec, divergent: frozenset[int]) -> Reshard:
        """The collectives, forward and backward, on the mesh the program runs on."""
        shape, itemsize = self.shapes[value]
        grad = self.has_grad(value)
        mesh_shape = self.mesh.shape
        if self.merge is not None:
            src, dst = self.merge.expand_spec(src), self.merge.expand_spec(dst)
            divergent = self.merge.expand_axes(divergent)
            mesh_shape = self.merge.real.shape
        r = reshard(src, dst, shape, itemsize, mesh_shape, divergent if grad else frozenset(),
                    self.joint)
        return r if grad else no_backward(r)
