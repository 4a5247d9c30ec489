"""Tensors crossing between the global view and one rank's: a global batch cut into this rank's
inputs (each microbatch as planned, on a pipeline) and checked against the plan, an inference
plan's output gathered whole, and any one tensor cut to this rank's shard or gathered back
(the whole state dicts, codegen/statedicts.py). The one place the plan's input and output
layouts meet user tensors; :class:`Shards` is mixed into codegen/runtime.py's
``ParallelModule``, whose attributes it reads.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from autoshard.codegen.collectives import apply_steps
from autoshard.cost.comm import reshard
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Spec, local_shape
from autoshard.ops.simulate import shard_tensor
from autoshard.precision import cast_inputs


class Shards:
    """A ``ParallelModule``'s inputs cut to this rank, its output gathered, single tensors cut
    and gathered.

    Mixed into ``ParallelModule`` (codegen/runtime.py), which sets what is read here: ``plan``,
    ``groups``, ``traced``, ``runtime``, ``microbatches``, ``_input_specs`` and
    ``_input_infos``."""

    def _shard(self, full: torch.Tensor, spec: Spec | None) -> torch.Tensor:
        """This rank's shard of ``full`` laid out as ``spec``, a tensor of its own."""
        if spec is None:
            return full
        return shard_tensor(full, spec, self.plan.mesh_shape, self.groups.coords).contiguous().clone()

    def _gather(self, local: torch.Tensor, spec: Spec, shape: Sequence[int]) -> torch.Tensor:
        """The whole tensor of global ``shape`` whose shard ``local`` is. Collective."""
        r = reshard(tuple(spec), (Replicate(),) * len(spec), tuple(shape), local.element_size(),
                    self.plan.mesh_shape)
        with torch.no_grad():     # (a tensor kept on the host is gathered on the device)
            return apply_steps(local.detach().to(self.runtime.device), r.forward, self.groups)

    def shard_inputs(self, *global_args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        fix = "pass the same arguments as the example inputs"
        self._check_count(global_args, "inputs", fix)
        out = []
        global_args = cast_inputs(global_args, self.plan.options.precision)
        m = self.microbatches
        for i, (a, spec, info) in enumerate(zip(global_args, self._input_specs, self._input_infos)):
            shape = info.shape if info is not None else None
            # On a pipeline the plan is of one microbatch: the batch is m of them.
            want = None if shape is None else (shape[0] * m, *shape[1:]) if m > 1 else shape
            if isinstance(a, torch.Tensor) and want is not None and tuple(a.shape) != tuple(want):
                raise AutoshardError(f"input {i} of shape {tuple(want)}, the planned shape"
                                     + (f" ({m} microbatches of {tuple(shape)})" if m > 1 else ""),
                                     got=f"shape {tuple(a.shape)}",
                                     fix="re-plan for these shapes, or batch the data as planned")
            self._check_kind(i, a, info, fix)
            if not isinstance(a, torch.Tensor):
                out.append(a)
            elif m > 1:       # each microbatch sharded as planned, stacked back in order
                out.append(torch.cat([self._shard(c, spec) for c in a.chunk(m)]))
            else:
                out.append(self._shard(a, spec))
        return tuple(out)

    def _check_local(self, local_args: Sequence[Any]) -> None:
        fix = "pass pm.shard_inputs(*global_batch) to the module"
        self._check_count(local_args, "local inputs", fix)
        m = self.microbatches
        for i, (a, spec, info) in enumerate(zip(local_args, self._input_specs, self._input_infos)):
            if isinstance(a, torch.Tensor) and info is not None:
                want = local_shape(info.shape, spec, self.plan.mesh_shape)
                want = (want[0] * m, *want[1:]) if m > 1 else want
                if tuple(a.shape) != want:
                    raise AutoshardError(f"local input {i} of shape {want} (the plan shards the "
                                         f"global {tuple(info.shape)} as {spec})",
                                         got=f"shape {tuple(a.shape)}", fix=fix)
            self._check_kind(i, a, info, fix)

    def _check_count(self, args: Sequence[Any], what: str, fix: str) -> None:
        if len(args) != len(self._input_specs):
            raise AutoshardError(f"{len(self._input_specs)} {what}, as planned",
                                 got=f"{len(args)}", fix=fix)

    @staticmethod
    def _check_kind(i: int, a: Any, info: Any, fix: str) -> None:
        """Input ``i`` floating-point where the traced one was, integer where it was (token ids
        of another width pass; a float where ids were traced fails inside the model's ops)."""
        if isinstance(a, torch.Tensor) and info is not None \
                and a.is_floating_point() != info.dtype.is_floating_point:
            raise AutoshardError(f"input {i} of dtype {info.dtype}, as traced",
                                 got=f"{a.dtype}", fix=fix)

    def gather_output(self, local: torch.Tensor) -> torch.Tensor:
        out = next(n for n in self.plan.nodes if n.name == self._output_node())
        return self._gather(local, out.outputs[0], self._output_shape())

    def _output_node(self) -> str:
        out = next(n for n in self.traced.graph.nodes if n.op == "output")
        return torch.utils._pytree.tree_flatten(out.args)[0][0].name

    def _output_shape(self):
        out = next(n for n in self.traced.graph.nodes if n.name == self._output_node())
        return tuple(out.meta["val"].shape)

