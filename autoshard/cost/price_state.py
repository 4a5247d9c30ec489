"""Model state in the price (docs/cost-model.md §4.1, §9): what a parameter or buffer holds on the
device and the host under its state mode (cost/state.py: ZeRO, offload), the optimizer step's
seconds and the all-gathers that follow it, and the host-link copies of offloaded parameters and
optimizer state. A mixin of :class:`~autoshard.cost.price.Pricer`, kept apart because these read
a placeholder and its state mode, and run once per step where an op runs once per microbatch
(``step_share``)."""
from __future__ import annotations

import math

from autoshard.cost.comm import Reshard, reshard, steps_time
from autoshard.cost.compute import local_numel
from autoshard.cost.overlap import is_grad_sync
from autoshard.cost.state import (ADAM_STEP_BYTES, MASTER_CAST_BYTES, PARAM_OFFLOAD_COPIES,
                                  SGD_STEP_BYTES, StateBytes,
                                  host_copies, state_bytes, state_choices, state_spec,
                                  step_elements)
from autoshard.ir import OffloadOverlap, Spec, StateMode, Strategy, local_shape
from autoshard.trace.graph import ValueRef


class StatePricing:
    """A placeholder's state, its optimizer step and its host copies. Reads of its Pricer:
    ``traced``, ``mesh``, ``merge``, ``options``, ``params``, ``frozen``, ``tied_to``, ``modes``,
    ``shapes``, ``runs`` and ``step_share``; ``has_grad``, and ``steps`` (cost/price_reshard.py)
    for whether a use's gradient is a bucketed sync."""

    def param_states(self, name: str, spec) -> list[tuple[str | None, tuple[int, ...] | None]]:
        """The (state mode, state axes) (cost/state.py) a parameter stored in ``spec`` may
        take."""
        ph = self.traced.placeholder(name)
        return state_choices(ph.info.shape, spec, self.mesh.shape, self.optimizer_of(name),
                             self.modes, ph.info.dtype.itemsize)

    def optimizer_of(self, name: str) -> str:
        """The optimizer whose state parameter ``name`` carries: "none" for a frozen one (no
        gradient, no state, no step: docs/cost-model.md §4.1), else the options'."""
        return "none" if name in self.frozen else self.options.state_optimizer

    def state_bytes(self, name: str, strategy: Strategy) -> StateBytes:
        """What one device (and its host) holds for a parameter or buffer placeholder: the
        parameter, its gradient, its optimizer state (docs/cost-model.md §4.1, §9)."""
        ph = self.traced.placeholder(name)
        if ph.info is None or ph.kind == "input" or name in self.tied_to:
            return StateBytes()
        spec = strategy.outputs[0]
        if ph.kind != "param":
            numel = math.prod(local_shape(ph.info.shape, spec, self.mesh.shape))
            return StateBytes(buffers=numel * ph.info.dtype.itemsize)
        return state_bytes(ph.info.shape, ph.info.dtype, spec, strategy.kernel, self.mesh.shape,
                           self.optimizer_of(name), strategy.state_axes)

    def accumulated_bytes(self, name: str, strategy: Strategy) -> float:
        """What gradient accumulation holds for a parameter beyond its state's gradient: its
        gradient whole, in its stored layout, across micro-steps (codegen/buckets.py under
        ``no_sync``), where ZeRO-2 or offload keep only a shard after the step's sync
        (docs/cost-model.md §7.2). 0 without accumulation, for a frozen parameter, and under
        parameter offload (its gradient goes down to the host)."""
        if self.runs == 1 or name in self.frozen or name not in self.params:
            return 0.0
        st = self.state_bytes(name, strategy)
        return max(0.0, st.parameters - st.gradients)

    def optimizer_seconds(self, name: str, strategy: Strategy) -> float:
        """The optimizer step's seconds for one parameter (docs/cost-model.md §9): its shard of
        the update, streamed at the device's (or with offload the host's) memory bandwidth, and
        with offload the gradient shard down and the updated shard up the host link. Under
        parameter offload the gradient is on the host already; a shard of a replicated
        parameter goes up to be all-gathered, and the gathered parameter comes back down to its
        host copy (:meth:`host_steps`). Under optimizer offload, the blocking part of
        :meth:`offload_step_seconds`. The all-gather of the updated shards is a collective
        (:meth:`optimizer_steps`)."""
        ph = self.traced.placeholder(name)
        opt = self.optimizer_of(name)
        if ph.kind != "param" or opt == "none" or name in self.tied_to:
            return 0.0
        spec, mode = strategy.outputs[0], strategy.kernel
        if mode == StateMode.OFFLOAD:
            return self.offload_step_seconds(name, strategy)[0]
        n = step_elements(ph.info.shape, spec, mode, self.mesh.shape, strategy.state_axes)
        per = SGD_STEP_BYTES if opt == "sgd" else ADAM_STEP_BYTES
        c = self.mesh.cluster
        if mode == StateMode.OFFLOAD_PARAMS:
            copies = PARAM_OFFLOAD_COPIES * ph.info.dtype.itemsize * (
                n + local_numel(ph.info.shape, spec, self.mesh.shape))
            t = (n * per + copies) / c.host_mem_bandwidth + sum(
                b for _, b in self.host_steps(name, strategy)) / c.host_bandwidth
        else:
            casts = MASTER_CAST_BYTES if ph.info.dtype.itemsize < 4 else 0
            t = n * (per + casts) / c.mem_bandwidth
        return t * self.step_share

    def offload_step_seconds(self, name: str, strategy: Strategy) -> tuple[float, float]:
        """Optimizer offload's host step of one parameter (docs/cost-model.md §9.1), as
        (blocking, overlapped) seconds: its state shard's update streamed at the host's memory
        bandwidth, its gradient shard down and the updated shard up the host link. Under
        ``PlanOptions.offload_overlap`` "backward" or "delayed" (codegen/hostopt.py) all of it
        runs on the host while the device computes: it is work in the overlap window of §7
        (beside the gradient buckets' sync), which the step pays only where backward compute
        cannot hide it; under "none" it blocks, and on a pipeline's stages too (the runtime
        lands their gradients at the step, after every microbatch). (0, 0) for any other
        mode."""
        ph = self.traced.placeholder(name)
        opt = self.optimizer_of(name)
        mode = strategy.kernel
        if ph.kind != "param" or opt == "none" or name in self.tied_to or mode != StateMode.OFFLOAD:
            return 0.0, 0.0
        n = step_elements(ph.info.shape, strategy.outputs[0], mode, self.mesh.shape)
        c = self.mesh.cluster
        t = (n * (SGD_STEP_BYTES if opt == "sgd" else ADAM_STEP_BYTES) / c.host_mem_bandwidth
             + 2 * n * ph.info.dtype.itemsize / c.host_bandwidth) * self.step_share
        if self.options.offload_overlap == OffloadOverlap.NONE \
                or self.options.stage_run is not None:
            return t, 0.0
        return 0.0, t

    def host_steps(self, name: str, strategy: Strategy) -> list[tuple[str, int]]:
        """The host-link copies of one parameter's optimizer step (cost/state.py
        ``host_copies``; none for a buffer, a tied alias or a frozen parameter)."""
        ph = self.traced.placeholder(name)
        if ph.kind != "param" or name in self.tied_to or self.optimizer_of(name) == "none":
            return []
        return host_copies(ph.info.shape, ph.info.dtype, strategy.outputs[0], strategy.kernel,
                           self.mesh.shape)

    def fetch_bytes(self, value: ValueRef, src: Spec, mode: StateMode | None) -> int:
        """Bytes one use of a parameter under parameter offload copies to the device: its
        stored local shard (0 for any other value or mode)."""
        if mode != StateMode.OFFLOAD_PARAMS or value[0] not in self.params:
            return 0
        shape, itemsize = self.shapes[value]
        return local_numel(shape, src, self.mesh.shape) * itemsize

    def host_seconds(self, value: ValueRef, src: Spec, dst: Spec, divergent: frozenset[int],
                     mode: StateMode | None, again: bool = False) -> float:
        """Seconds on the host link of one use of a parameter under parameter offload
        (docs/cost-model.md §9), read in ``dst``: its stored shard copied to the device (again
        where ``again``: the use is recomputed), and the gradient that comes back copied down:
        the stored-layout gradient of this use, or for a bucketed gradient sync its bucket's
        share (its reduce-scattered shard). Blocking: the runtime copies at the use, without
        prefetch."""
        n = self.fetch_bytes(value, src, mode)
        if not n:
            return 0.0
        down = 0
        if self.has_grad(value):
            steps = self.steps(value, src, dst, divergent)
            down = n
            if is_grad_sync(steps):
                shape, itemsize = self.shapes[value]
                sspec = state_spec(shape, src, self.mesh.shape)
                if sspec is not None:
                    down = local_numel(shape, sspec, self.mesh.shape) * itemsize
        return (n * (2 if again else 1) + down) / self.mesh.cluster.host_bandwidth \
            * self.step_share * self.runs

    def optimizer_steps(self, name: str, strategy: Strategy) -> Reshard | None:
        """The all-gather(s) that bring the updated state shards back to the parameter's
        layout after the step (zero1/zero2/offload over its zero axes), or None."""
        ph = self.traced.placeholder(name)
        if strategy.kernel is None or ph.kind != "param" or name in self.tied_to:
            return None
        spec = strategy.outputs[0]
        sspec = state_spec(ph.info.shape, spec, self.mesh.shape, strategy.state_axes)
        if sspec is None:
            return None
        if self.merge is not None:
            sspec, spec = self.merge.expand_spec(sspec), self.merge.expand_spec(spec)
            mesh_shape = self.merge.real.shape
        else:
            mesh_shape = self.mesh.shape
        return reshard(sspec, spec, ph.info.shape, ph.info.dtype.itemsize, mesh_shape)

    def optimizer_comm_seconds(self, name: str, strategy: Strategy) -> float:
        r = self.optimizer_steps(name, strategy)
        mesh = self.merge.real if self.merge else self.mesh
        return steps_time(r.forward, mesh) * self.step_share if r else 0.0
