"""A recorded recipe replayed on one rank's shard (codegen/materialize.py): the shard's box of
the whole tensor, generated in blocks of bounded size, each step run elementwise on it, draws
from the counter-based generator at the block's flat indices (codegen/counter_rng.py)."""
from __future__ import annotations

import itertools
import math
from typing import Any, Iterator, Sequence

import torch

from autoshard.codegen.counter_rng import _ndtri, _phi, _uniform01, stream_key
from autoshard.codegen.recording import (_SELF, Region, _from_base, _intersect, _is_whole,
                                         _place, _Recipe, _Step, _strides, _whole_place)
from autoshard.errors import AutoshardError
from autoshard.ir import Partial, Shard, Spec

_CHUNK = 1 << 20         # elements per generated block: bounds temporaries on huge shards


def _local_box(shape: tuple[int, ...], spec: Spec | None, mesh_shape: Sequence[int],
               coords: Sequence[int], name: str) -> list[tuple[int, int]]:
    """This rank's [lo, hi) per dim, as ``shard_tensor`` cuts it (chunks, row-major over the
    mesh axes that split one dim)."""
    box = [(0, n) for n in shape]
    for p, n, c in zip(spec or (), mesh_shape, coords):
        if isinstance(p, Shard):
            lo, hi = box[p.dim]
            if (hi - lo) % n:
                raise AutoshardError(f"{name}: dim {p.dim} divisible by the mesh axis of size {n}",
                                     got=f"{hi - lo} elements", fix="re-plan for this shape")
            size = (hi - lo) // n
            box[p.dim] = (lo + c * size, lo + (c + 1) * size)
        elif isinstance(p, Partial):
            raise AutoshardError(f"{name}: a parameter or buffer placed Shard or Replicate",
                                 got="Partial", fix="re-plan: the plan file is damaged")
    return box


def _chunks(shape: Sequence[int], limit: int = _CHUNK) -> Iterator[tuple[slice, ...]]:
    """Slices cutting ``shape`` into blocks of at most ``limit`` elements (more when one row of
    the last dim is longer)."""
    shape = list(shape)
    if not shape:
        yield ()
        return
    k = next(k for k in range(len(shape)) if math.prod(shape[k + 1:]) <= limit)
    step = max(1, limit // max(1, math.prod(shape[k + 1:])))
    for outer in itertools.product(*(range(n) for n in shape[:k])):
        for lo in range(0, shape[k], step):
            yield (tuple(slice(i, i + 1) for i in outer) + (slice(lo, min(lo + step, shape[k])),)
                   + tuple(slice(0, n) for n in shape[k + 1:]))


def _flat_index(region: Region, base: Sequence[int], device: torch.device) -> torch.Tensor:
    """The flat (row-major) index in the base tensor of every element of ``region``."""
    strides = _strides(base)
    idx = torch.zeros((), dtype=torch.int64, device=device)
    for d, ((lo, hi), st) in enumerate(zip(region, strides)):
        shape = [1] * len(region)
        shape[d] = hi - lo
        idx = idx + (torch.arange(lo, hi, dtype=torch.int64, device=device) * st).reshape(shape)
    return idx


def _values(step: _Step, key: int, idx: torch.Tensor) -> torch.Tensor:
    """float64 values of a random or arange step at flat indices ``idx``."""
    a = step.args
    if step.kind == "uniform":
        return _uniform01(key, idx).mul_(a[1] - a[0]).add_(a[0])
    if step.kind == "normal":
        return _ndtri(_uniform01(key, idx)).mul_(a[1]).add_(a[0])
    if step.kind == "trunc_normal":
        mean, std, lo, hi = a
        plo, phi = _phi((lo - mean) / std), _phi((hi - mean) / std)
        p = _uniform01(key, idx).mul_(phi - plo).add_(plo)
        return _ndtri(p).mul_(std).add_(mean).clamp_(lo, hi)
    raise AssertionError(step.kind)


def _scalar_loop(func: Any, x: torch.Tensor, step: _Step, inplace: bool) -> torch.Tensor:
    """``func`` on ``x`` through torch's per-element (non-vectorised) CPU loop: the operand is
    given a stride of 2, so the result of an element does not depend on its position (the
    vectorised loop and its scalar tail may differ in the last bit for pow, exp, ...)."""
    flat = x.reshape(-1)
    buf = torch.empty(2 * flat.numel(), dtype=flat.dtype, device=flat.device)[::2]
    buf.copy_(flat)
    args = tuple(buf if a is _SELF else a for a in step.args)
    kwargs = {k: (buf if v is _SELF else v) for k, v in step.kwargs}
    out = func(*args, **kwargs)
    return (buf if inplace else out).reshape(x.shape)


def _loop_chunk(n: int) -> int:
    """Blocks for :func:`_scalar_loop`, whose scratch is twice a block: a quarter of the shard
    at most, so that even the scratch of a shard of half a tensor is smaller than the tensor."""
    return max(1, min(_CHUNK, n // 4))


def _replay(rec: _Recipe, name: str, seed: int, target: torch.Tensor,
            box: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    """The sub-box ``box`` of ``target`` (a meta tensor recorded as ``rec``), on ``device``."""
    if _is_whole(target) or (target.is_contiguous() and target.storage_offset() == 0
                             and target.numel() == math.prod(rec.shape)):
        rec = rec.rebased(tuple(target.shape)) or rec
    place = _whole_place(rec.shape) if rec.shape == tuple(target.shape) \
        else _place(target, rec.shape)
    if place is None:
        raise AutoshardError(f"{name}: a view autoshard can map onto its storage",
                             got=f"sizes {tuple(target.shape)}, strides {tuple(target.stride())} "
                                 f"in a storage of shape {rec.shape}",
                             fix="make the parameter a tensor of its own (.clone() it)")
    region = place.box(box)
    cur = torch.empty([hi - lo for lo, hi in region], dtype=rec.dtype, device=device)
    draw = 0
    for step in rec.steps:
        if step.kind == "cast":
            cur = cur.to(step.args[0])
            continue
        if step.kind == "pointwise":
            out = None
            for sl in _chunks(cur.shape, _loop_chunk(cur.numel())):
                piece = _scalar_loop(step.func, cur[sl], step, inplace=False)
                if out is None:
                    out = torch.empty(cur.shape, dtype=piece.dtype, device=device)
                out[sl] = piece
            cur = out if out is not None else cur
            continue
        key = stream_key(seed, name, draw) if step.random else 0
        draw += step.random
        inter = _intersect(step.region or tuple((0, n) for n in rec.shape), region)
        if inter is None:
            continue
        sub = cur[tuple(slice(lo - r[0], hi - r[0]) for (lo, hi), r in zip(inter, region))]
        if step.kind == "fill":
            sub.fill_(step.args[0])
        elif step.kind == "tensor":
            src, origin = step.args[0], step.region or tuple((0, n) for n in rec.shape)
            sub.copy_(src[tuple(slice(lo - o[0], hi - o[0]) for (lo, hi), o in zip(inter, origin))])
        elif step.kind == "pointwise_":
            for sl in _chunks(sub.shape, _loop_chunk(cur.numel())):
                sub[sl] = _scalar_loop(step.func, sub[sl], step, inplace=True)
        else:
            for sl in _chunks(sub.shape):
                part = tuple((lo + s.start, lo + s.stop) for (lo, _), s in zip(inter, sl))
                idx = _flat_index(part, rec.shape, device)
                if step.kind == "arange":
                    start, by = step.args
                    vals = idx * by + start if not sub.is_floating_point() and \
                        isinstance(start, int) and isinstance(by, int) \
                        else idx.to(torch.float64) * by + start
                else:
                    vals = _values(step, key, idx)
                sub[sl] = vals
    if cur.dtype != target.dtype:
        cur = cur.to(target.dtype)
    return _from_base(cur, place, box).contiguous()


# ------------------------------------------------------------------- the runtime's entry point

