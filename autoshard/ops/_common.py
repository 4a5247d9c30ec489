"""Helpers shared by the rule families: argument lookup, dim maps, shard offsets, localizers."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Sequence

from autoshard.ir import OpInfo, Partial, Replicate, Shard, Spec, Strategy, TensorInfo
from autoshard.ops.registry import expand, replicate_strategy

R, P = Replicate(), Partial()
Option = tuple  # (input placements, output placements): one 1-D option for expand()


def arg(op: OpInfo, index: int, name: str, default: Any = None) -> Any:
    """A schema argument by position, else by keyword, else ``default``."""
    if index < len(op.args):
        return op.args[index]
    return op.kwargs.get(name, default)


def norm_dim(dim: int, ndim: int) -> int:
    return dim % max(ndim, 1)


def norm_dims(dims: Any, ndim: int) -> tuple[int, ...]:
    """A dim argument (int, list, or None/empty meaning every dim) as sorted non-negative dims."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return tuple(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return tuple(sorted({norm_dim(d, ndim) for d in dims}))


def shard_index(spec: Spec, dim: int, mesh_shape: Sequence[int], coords: Sequence[int]) -> tuple[int, int]:
    """``(index, factor)``: which of ``factor`` row-major pieces of ``dim`` this rank holds.

    A dim sharded over several axes is split with the first such axis outermost (ir.py).
    """
    index, factor = 0, 1
    for p, n, c in zip(spec, mesh_shape, coords):
        if isinstance(p, Shard) and p.dim == dim:
            index, factor = index * n + c, factor * n
    return index, factor


def replicate_only(op: OpInfo, mesh_shape: tuple) -> list[Strategy]:
    """The rule of an op that is not sharded: every tensor whole on every device."""
    return [replicate_strategy(op, mesh_shape)]


def plain_localize(op: OpInfo, strategy: Strategy, mesh_shape: tuple, coords: tuple,
                   args: tuple, kwargs: dict) -> tuple:
    """The op unchanged: for ops whose int-list arguments are dims or pads, never sizes, so the
    default's size rewriting must not touch them even where a list happens to equal a shape."""
    return op.target, args, kwargs


def mapped_options(op: OpInfo, maps: Sequence[dict[int, int]], *, partial: bool = False,
                   broadcast: bool = False) -> list[Option]:
    """1-D options of an op whose tensor inputs all share a dim map to the first output.

    ``maps[i]`` maps dims of tensor input ``i`` to dims of output 0 (every output gets the same
    placement). An output dim is sharded when every input holding it at full size is sharded
    alike; inputs that lack the dim (or broadcast it) stay replicated. An output dim that no
    input holds at full size is sharded only under ``broadcast`` (``expand``: each rank expands
    the same data to its local size); elsewhere it is a dim the op builds whole (``cat``'s dim).
    ``partial`` adds the all-partial option of an op linear in all of its tensor inputs jointly.
    """
    out = op.outputs[0]
    ins = op.inputs
    opts: list[Option] = []
    for od in range(out.ndim):
        if out.shape[od] <= 1:
            continue
        pl = []
        for t, m in zip(ins, maps):
            src = [d for d, o in m.items() if o == od and t.shape[d] == out.shape[od]]
            pl.append(Shard(src[0]) if src else R)
        if not broadcast and all(p == R for p in pl):
            continue
        opts.append((tuple(pl), tuple(Shard(od) for _ in op.outputs)))
    if partial:
        opts.append((tuple(P for _ in ins), tuple(P for _ in op.outputs)))
    return opts


def broadcast_map(t: TensorInfo, out_ndim: int) -> dict[int, int]:
    """Right-aligned dim map of a broadcast operand."""
    off = out_ndim - t.ndim
    return {d: d + off for d in range(t.ndim)}


def with_kernel(strategies: Iterable[Strategy],
                pick: Callable[[Strategy], str | None]) -> list[Strategy]:
    return [dataclasses.replace(s, kernel=pick(s)) for s in strategies]


def expand_mapped(op: OpInfo, mesh_shape: tuple, maps: Sequence[dict[int, int]], *,
                  partial: bool = False) -> list[Strategy]:
    return expand(op, mesh_shape, mapped_options(op, maps, partial=partial))


def is_float(t: TensorInfo) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex
