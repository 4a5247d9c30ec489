"""Build a model on the meta device; materialise only this rank's shard of each tensor.

A model built on the meta device holds no values, so every rank can build the whole of a model
that would not fit on one device. :func:`autoshard.parallelize` then gives each tensor of it
values on this rank only, for this rank's shard, from one of three sources:

1. **The model's own initialisers**, replayed on the shard (``parallelize(..., init=, seed=)``).
   What the initialisers do is *recorded* on the meta model, as torchdistx's ``deferred_init``
   records the construction of a module on a fake device and replays it later
   (github.com/pytorch/torchdistx, ``deferred_init.py``): a ``TorchDispatchMode`` logs, per tensor
   storage, the ops that write it. Fills, ``uniform_``/``normal_``/``trunc_normal_``, elementwise
   ops with scalar operands (``mul_``, ``add_``, ``clamp_``, ``erfinv_``, ...), copies, ``arange``
   and dtype casts replay elementwise on any slice. Random draws come from a counter-based
   generator instead of torch's stateful one: the value at flat index ``i`` of a tensor is a pure
   function of (seed, the tensor's name, the draw's number, ``i``), so a rank computes its own
   indices and nothing else, and the shard on any mesh equals, bit for bit, the same slice of the
   tensor materialised on one device (:func:`materialize`) with the same seed. (The same idea as
   Philox-style counter-based generators, Salmon et al., "Parallel random numbers: as easy as 1,
   2, 3", SC 2011, and DTensor's offset-based RNG tracker; the hash is splitmix64, Steele, Lea &
   Flood, "Fast splittable pseudorandom number generators", OOPSLA 2014.) The values follow the
   same distributions as torch's, not torch's draws. An op that cannot be replayed elementwise
   (``orthogonal_``, ``eye_``, a matmul, ...) makes that tensor's materialisation raise an
   :class:`AutoshardError` naming it, never a silently wrong value.

   Where the init comes from (``init=``):

   - ``"auto"`` (default): the recording of the model's construction when it was built inside
     :func:`deferred_init` (its constructor's ``reset_parameters``, ``self.apply(_init_weights)``,
     ``torch.ones`` ..., exactly what it did), else ``"model"``.
   - ``"model"``: ``reset_parameters()`` of every submodule that has one, then the model's own
     init method: Hugging Face's ``initialize_weights()``/``init_weights()`` (which apply its
     ``_init_weights``), or a module's own ``init_weights()``/``_init_weights()``.
   - a callable ``init_fn(model)``, run on the meta model (under ``torch.no_grad``) and recorded.
   - ``"empty"``: no init; floating shards hold NaN until weights are loaded (sources 2 and 3).

2. **A full state dict**, read one tensor at a time: ``pm.load_full_state_dict(mapping)`` takes
   any ``Mapping``; :func:`safetensors_state_dict` is a lazy one over a ``.safetensors`` file.
3. **A DCP checkpoint**: ``pm.load_sharded_state_dict`` after ``torch.distributed.checkpoint.load``
   into ``pm.sharded_state_dict()``.

Buffers are handled like parameters: a buffer the constructor or init computed from ``arange``
and elementwise ops (Hugging Face's rotary ``inv_freq``, BERT's ``position_ids``) is recomputed
from the recording; one whose values cannot be replayed raises, and ``init="empty"`` leaves it
NaN (or the dtype's minimum) for a state dict to fill.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import inspect
import itertools
import math
import sys
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from autoshard.errors import AutoshardError
from autoshard.ir import Partial, Replicate, Shard, Spec, spec_str

__all__ = ["Sources", "counter_normal", "counter_uniform", "deferred_init", "local_shard",
           "materialize", "materialized_state_dict", "prepare", "safetensors_state_dict"]

META = torch.device("meta")
Init = Union[str, Callable[[nn.Module], Any]]
INIT_MODES = ("auto", "model", "recorded", "empty")

# ------------------------------------------------------------------ the counter-based generator

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15          # splitmix64's increment (2^64 / golden ratio)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits."""
    c &= _MASK64
    return c - (1 << 64) if c >> 63 else c


def _mix_int(x: int) -> int:
    """splitmix64's finaliser on a Python int (the reference the tensor version must equal)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 bits (``>>`` on int64 is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; multiplication wraps modulo 2^64."""
    x = (x ^ _srl(x, 30)) * _signed(_MIX1)
    x = (x ^ _srl(x, 27)) * _signed(_MIX2)
    return x ^ _srl(x, 31)


def stream_key(seed: int, name: str, draw: int) -> int:
    """The 64-bit key of draw number ``draw`` into tensor ``name`` under ``seed``."""
    h = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")
    return _mix_int(_mix_int(seed ^ h) + (draw + 1) * _GOLDEN)


def random_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """64 random bits (int64) per flat index: splitmix64's output number ``index + 1`` of the
    stream whose state starts at ``key``; element ``i`` needs nothing but ``i``."""
    state = (index + 1) * _signed(_GOLDEN) + _signed(key)
    return _mix(state)


def _uniform01(key: int, index: torch.Tensor) -> torch.Tensor:
    """float64 uniform on (0, 1): the top 53 bits, centred in their cell (never 0 or 1)."""
    return (_srl(random_bits(key, index), 11).to(torch.float64) + 0.5) * 2.0 ** -53


def counter_uniform(seed: int, name: str, index: torch.Tensor, *, low: float = 0.0,
                    high: float = 1.0, draw: int = 0) -> torch.Tensor:
    """float64 values uniform on [low, high), one per element of the int64 ``index`` tensor,
    each a pure function of (seed, name, draw, index)."""
    return _uniform01(stream_key(seed, name, draw), index).mul_(high - low).add_(low)


def counter_normal(seed: int, name: str, index: torch.Tensor, *, mean: float = 0.0,
                   std: float = 1.0, draw: int = 0) -> torch.Tensor:
    """float64 normal values by inversion (:func:`_ndtri` of a counter uniform)."""
    return _ndtri(_uniform01(stream_key(seed, name, draw), index)).mul_(std).add_(mean)


# Everything below is + - * / sqrt and frexp, each a correctly rounded IEEE op, one torch op at a
# time: the result for an element does not depend on where it sits in the tensor (vectorised
# and scalar loops agree), which is what makes a shard equal its slice of the whole bit for bit.
# torch's log/exp may differ in the last bit between those loops.

_LN2 = math.log(2.0)
_LOG_COEFS = [2.0 / (2 * k + 1) for k in range(12)]      # 2 atanh(s) = log((1+s)/(1-s))


def _poly(x: torch.Tensor, coefs: Sequence[float]) -> torch.Tensor:
    """sum(coefs[k] * x**k) by Horner's rule."""
    acc = torch.full_like(x, coefs[-1])
    for c in reversed(coefs[:-1]):
        acc = acc * x + c
    return acc


def _log(x: torch.Tensor) -> torch.Tensor:
    """Natural log of positive float64: x = m 2^e with m in [sqrt(1/2), sqrt(2)), then
    log m = 2 atanh((m-1)/(m+1)) by its series (|s| <= 0.172: 12 terms reach 1e-18)."""
    m, e = torch.frexp(x)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)
    e = e.to(torch.float64) - low.to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    return s * _poly(s * s, _LOG_COEFS) + e * _LN2


# Wichura, "Algorithm AS 241: The percentage points of the normal distribution", Applied
# Statistics 37(3), 1988: PPND16, accurate to about 1e-16.
_AS241_A = [3.3871328727963666080e0, 1.3314166789178437745e2, 1.9715909503065514427e3,
            1.3731693765509461125e4, 4.5921953931549871457e4, 6.7265770927008700853e4,
            3.3430575583588128105e4, 2.5090809287301226727e3]
_AS241_B = [1.0, 4.2313330701600911252e1, 6.8718700749205790830e2, 5.3941960214247511077e3,
            2.1213794301586595867e4, 3.9307895800092710610e4, 2.8729085735721942674e4,
            5.2264952788528545610e3]
_AS241_C = [1.42343711074968357734e0, 4.63033784615654529590e0, 5.76949722146069140550e0,
            3.64784832476320460504e0, 1.27045825245236838258e0, 2.41780725177450611770e-1,
            2.27238449892691845833e-2, 7.74545014278341407640e-4]
_AS241_D = [1.0, 2.05319162663775882187e0, 1.67638483018380384940e0, 6.89767334985100004550e-1,
            1.48103976427480074590e-1, 1.51986665636164571966e-2, 5.47593808499534494600e-4,
            1.05075007164441684324e-9]
_AS241_E = [6.65790464350110377720e0, 5.46378491116411436990e0, 1.78482653991729133580e0,
            2.96560571828504891230e-1, 2.65321895265761230930e-2, 1.24266094738807843860e-3,
            2.71155556874348757815e-5, 2.01033439929228813265e-7]
_AS241_F = [1.0, 5.99832206555887937690e-1, 1.36929880922735805310e-1,
            1.48753612908506148525e-2, 7.86869131145613259100e-4, 1.84631831751005468180e-5,
            1.42151175831644588870e-7, 2.04426310338993978564e-15]


def _ndtri(p: torch.Tensor) -> torch.Tensor:
    """The standard normal quantile of float64 ``p`` in (0, 1) (AS 241)."""
    q = p - 0.5
    r = 0.180625 - q * q
    central = q * _poly(r, _AS241_A) / _poly(r, _AS241_B)
    s = torch.sqrt(-_log(torch.minimum(p, 1.0 - p)))
    near = _poly(s - 1.6, _AS241_C) / _poly(s - 1.6, _AS241_D)
    far = _poly(s - 5.0, _AS241_E) / _poly(s - 5.0, _AS241_F)
    tail = torch.where(s <= 5.0, near, far)
    tail = torch.where(q < 0, -tail, tail)
    return torch.where(q.abs() <= 0.425, central, tail)


def _phi(x: float) -> float:
    """The standard normal CDF (Python float)."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


# ----------------------------------------------------------------------- geometry of views

Region = tuple[tuple[int, int], ...]       # [lo, hi) per dim of a storage's base shape


def _strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


@dataclass(frozen=True)
class _Place:
    """A view of a storage as a box of the storage's base shape: view dim ``v`` runs along base
    dim ``dims[v]`` (None for a view dim of size 1) from ``start``."""

    start: tuple[int, ...]
    dims: tuple[int | None, ...]
    sizes: tuple[int, ...]

    def region(self) -> Region:
        hi = [s + 1 for s in self.start]
        for v, b in enumerate(self.dims):
            if b is not None:
                hi[b] = self.start[b] + self.sizes[v]
        return tuple(zip(self.start, hi))

    def box(self, local: Sequence[tuple[int, int]]) -> Region:
        """The base-coordinate region of the sub-box ``local`` ([lo, hi) per view dim)."""
        out = [(s, s + 1) for s in self.start]
        for v, b in enumerate(self.dims):
            if b is not None:
                out[b] = (self.start[b] + local[v][0], self.start[b] + local[v][1])
        return tuple(out)


def _whole_place(shape: Sequence[int]) -> _Place:
    dims = tuple(d if n != 1 else None for d, n in enumerate(shape))
    return _Place(tuple(0 for _ in shape), dims, tuple(shape))


def _place(t: torch.Tensor, base: Sequence[int]) -> _Place | None:
    """Where ``t`` lies in its storage of base shape ``base`` (contiguous); None when it is not
    a box of it (a diagonal, overlapping or merged-dims view)."""
    strides = _strides(base)
    off, start = t.storage_offset(), []
    for st in strides:
        start.append(off // st)
        off %= st
    if any(s >= n for s, n in zip(start, base)) and t.numel():
        return None
    dims, used = [], set()
    for size, stride in zip(t.shape, t.stride()):
        if size == 1:
            dims.append(None)
            continue
        b = next((b for b in range(len(base)) if base[b] > 1 and strides[b] == stride
                  and b not in used), None)
        if b is None or start[b] + size > base[b]:
            return None
        used.add(b)
        dims.append(b)
    return _Place(tuple(start), tuple(dims), tuple(t.shape))


def _is_whole(t: torch.Tensor) -> bool:
    """``t`` is its whole storage, laid out contiguously."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.numel() * t.element_size() == t.untyped_storage().nbytes())


def _intersect(a: Region, b: Region) -> Region | None:
    out = tuple((max(x[0], y[0]), min(x[1], y[1])) for x, y in zip(a, b))
    return None if any(lo >= hi for lo, hi in out) else out


def _to_base(t: torch.Tensor, place: _Place, ndim: int) -> torch.Tensor:
    """A tensor in the coordinates of the view at ``place`` as a tensor in base coordinates of
    its region: size-1 view dims dropped, the others permuted into base order (views only)."""
    mapped = [(b, v) for v, b in enumerate(place.dims) if b is not None]
    t = t.reshape([place.sizes[v] for _, v in mapped])
    t = t.permute(sorted(range(len(mapped)), key=lambda i: mapped[i][0]))
    shape = [1] * ndim
    for b, v in mapped:
        shape[b] = place.sizes[v]
    return t.reshape(shape)


def _from_base(t: torch.Tensor, place: _Place, local: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Inverse of :func:`_to_base` for the sub-box ``local`` of the view."""
    mapped = [(b, v) for v, b in enumerate(place.dims) if b is not None]
    order = sorted(mapped)                                    # base order of the mapped dims
    t = t.reshape([local[v][1] - local[v][0] for _, v in order])
    perm = [order.index(m) for m in mapped]                   # back to view order
    t = t.permute(perm)
    return t.reshape([hi - lo for lo, hi in local])


# --------------------------------------------------------------------------- recipes

@dataclass(frozen=True)
class _Step:
    """One recorded write: ``kind`` is fill | uniform | normal | trunc_normal | arange | tensor
    (a copy of known values) | pointwise_ (an in-place elementwise op) | pointwise (an
    out-of-place one, whole tensor) | cast. ``region`` None: the whole tensor."""

    kind: str
    region: Region | None = None
    args: tuple = ()
    func: Any = None
    kwargs: tuple = ()

    @property
    def random(self) -> bool:
        return self.kind in ("uniform", "normal", "trunc_normal")


class _Self:
    """Where the recorded tensor goes in a pointwise op's arguments."""

    def __repr__(self) -> str:
        return "<self>"


_SELF = _Self()


@dataclass
class _Recipe:
    """How a storage's values came to be: its base shape and creation dtype, and the writes
    since the last one that set every element without reading any."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    steps: list[_Step] = field(default_factory=list)
    defined: bool = False         # every element written by a replayable op
    problem: str | None = None    # why the values cannot be replayed
    origin: str = ""              # the op that made the storage

    def copy(self) -> _Recipe:
        return dataclasses.replace(self, steps=list(self.steps))

    def set(self, step: _Step) -> None:
        """A write of every element that reads none: the history before it no longer matters."""
        self.steps, self.defined, self.problem = [step], True, None

    def add(self, step: _Step) -> None:
        self.steps.append(step)

    def fail(self, why: str) -> None:
        if self.problem is None:
            self.problem = why

    def rebased(self, shape: Sequence[int]) -> _Recipe | None:
        """The same values read as a contiguous tensor of ``shape`` (same numel): possible when
        every step covers the whole tensor (values keyed by flat index)."""
        shape = tuple(shape)
        if shape == self.shape:
            return self.copy()
        if math.prod(shape) != math.prod(self.shape) \
                or any(s.region is not None for s in self.steps):
            return None
        steps = [dataclasses.replace(s, args=(s.args[0].reshape(shape),)) if s.kind == "tensor"
                 else s for s in self.steps]
        return dataclasses.replace(self, shape=shape, steps=steps)


def _bind(func: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """An op's arguments by schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(func._schema.arguments):
        if i < len(args):
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_pointwise(func: Any) -> bool:
    if torch.Tag.pointwise in func.tags:
        return True
    name = func.overloadpacket.__name__            # abs_ has no tag; abs has
    if name.endswith("_"):
        packet = getattr(torch.ops.aten, name[:-1], None)
        if packet is not None and func._overloadname in packet.overloads():
            return torch.Tag.pointwise in getattr(packet, func._overloadname).tags
    return False


def _scalar_template(func: Any, args: Sequence[Any], kwargs: dict[str, Any],
                     target: torch.Tensor) -> tuple[tuple, tuple] | str:
    """The op's arguments with ``target`` replaced by a marker; a reason string when another
    argument is a tensor whose values are not known here (a meta tensor, or more than one
    element)."""
    def swap(x: Any) -> Any:
        if x is target:
            return _SELF
        if isinstance(x, torch.Tensor):
            if x.is_meta or x.numel() != 1:
                raise _NotScalar(x)
            return x.detach().clone()
        if isinstance(x, (list, tuple)):
            return type(x)(swap(y) for y in x)
        return x
    try:
        a = tuple(swap(x) for x in args)
        k = tuple(sorted((n, swap(v)) for n, v in kwargs.items()))
    except _NotScalar as e:
        return (f"{func} with a tensor operand of shape {tuple(e.args[0].shape)}"
                f"{' on the meta device' if e.args[0].is_meta else ''} (only scalars replay)")
    return a, k


class _NotScalar(Exception):
    pass


_FILLS = {"zeros": 0, "zeros_like": 0, "new_zeros": 0, "ones": 1, "ones_like": 1, "new_ones": 1}
_FULLS = {"full": "fill_value", "full_like": "fill_value", "new_full": "fill_value",
          "scalar_tensor": "s"}
_EMPTIES = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
            "empty_permuted"}
_RANDS = {"rand": "uniform", "rand_like": "uniform", "randn": "normal", "randn_like": "normal"}
_COPIES = {"_to_copy", "clone", "lift_fresh_copy", "_copy_from_and_resize"}


def _watched_inits() -> dict[Any, str]:
    """torch.nn.init functions that return early on meta tensors (so no op would be seen):
    their calls are recorded by a profile hook instead."""
    init = torch.nn.init
    out = {}
    trunc = getattr(init, "_no_grad_trunc_normal_", None) or init.trunc_normal_
    out[trunc.__code__] = "trunc_normal_"
    for name in ("orthogonal_", "dirac_", "sparse_"):
        fn = getattr(init, name, None)
        if fn is not None:
            out[fn.__code__] = name
    return out


class _Recorder(TorchDispatchMode):
    """Logs the writes to every meta storage (see the module docstring). With ``redirect``,
    every tensor factory (an op that takes no tensor) makes its tensor on the meta device."""

    def __init__(self, *, redirect: bool) -> None:
        super().__init__()
        self.redirect = redirect
        self.records: dict[int, tuple[torch.UntypedStorage, _Recipe]] = {}
        self._watch = _watched_inits()
        self._inside: list[Any] = []        # frames of watched init functions being run
        self._old_profile: Any = None

    # -- the profile hook for nn.init functions that skip meta tensors ---------------------
    def __enter__(self) -> _Recorder:
        self._old_profile = sys.getprofile()
        sys.setprofile(self._profile)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            sys.setprofile(self._old_profile)

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            name = self._watch.get(frame.f_code)
            if name is not None:
                self._inside.append(frame)
                self._init_call(name, frame.f_locals)
        elif event == "return" and self._inside and frame is self._inside[-1]:
            self._inside.pop()
        if self._old_profile is not None:
            self._old_profile(frame, event, arg)

    def _init_call(self, name: str, loc: dict[str, Any]) -> None:
        t = loc.get("tensor")
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return
        if name == "trunc_normal_" and t.is_floating_point():
            self._write(t, _Step("trunc_normal", None, (float(loc["mean"]), float(loc["std"]),
                                                        float(loc["a"]), float(loc["b"]))),
                        reads=False)
        else:
            self._fail(t, f"torch.nn.init.{name} (not elementwise: it cannot run on a shard)")

    # -- records ---------------------------------------------------------------------------
    def seed(self, t: torch.Tensor, recipe: _Recipe) -> None:
        self.records[_storage_key(t)] = (t.untyped_storage(), recipe)

    def recipe(self, t: torch.Tensor, origin: str = "") -> _Recipe:
        """The record of ``t``'s storage, made (unknown values) when none exists."""
        key = _storage_key(t)
        if key not in self.records:
            shape = tuple(t.shape) if _is_whole(t) else \
                (t.untyped_storage().nbytes() // t.element_size(),)
            self.records[key] = (t.untyped_storage(),
                                 _Recipe(shape, t.dtype, origin=origin or "a tensor made before "
                                         "recording began, or by an op that hides its values"))
        return self.records[key][1]

    def _fresh(self, t: torch.Tensor, recipe: _Recipe) -> None:
        self.records[_storage_key(t)] = (t.untyped_storage(), recipe)

    def _region(self, t: torch.Tensor, rec: _Recipe) -> tuple[Region | None, bool] | None:
        """(region, whole) of view ``t`` in its storage; None when it is no box of it."""
        if _is_whole(t) or (t.numel() == math.prod(rec.shape) and t.is_contiguous()
                            and t.storage_offset() == 0):
            return None, True
        place = _place(t, rec.shape)
        if place is None:
            return None
        region = place.region()
        whole = all(lo == 0 and hi == n for (lo, hi), n in zip(region, rec.shape))
        return (None if whole else region), whole

    def _write(self, t: torch.Tensor, step: _Step, *, reads: bool) -> None:
        if t.numel() == 0:
            return
        rec = self.recipe(t)
        got = self._region(t, rec)
        if got is None:
            rec.fail(f"a write through a view of sizes {tuple(t.shape)} and strides "
                     f"{tuple(t.stride())} that is not a box of the tensor")
            return
        region, whole = got
        step = dataclasses.replace(step, region=region)
        if step.kind == "tensor":             # the values, in base coordinates of the region
            const = step.args[0]
            if t.is_contiguous() and t.storage_offset() == 0 and t.numel() == math.prod(rec.shape):
                const = const.reshape(rec.shape)
            else:
                const = _to_base(const, _place(t, rec.shape), len(rec.shape))
            step = dataclasses.replace(step, args=(const,))
        (rec.set if whole and not reads else rec.add)(step)

    def _fail(self, t: torch.Tensor, why: str) -> None:
        rec = self.recipe(t)
        got = self._region(t, rec)
        if got is not None and got[1]:
            rec.steps, rec.defined = [], False
        rec.problem = why

    # -- the dispatch hook -----------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if self.redirect and any(a.name == "device" for a in func._schema.arguments) \
                and not any(isinstance(x, torch.Tensor) for x in tree_flatten((args, kwargs))[0]):
            kwargs["device"] = META           # a factory: zeros, empty, arange, randn, ...
        out = func(*args, **kwargs)
        if not self._inside:
            self._note(func, args, kwargs, out)
        return out

    def _note(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        ins = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        self._on_write(func, t, args, kwargs)
        seen = {_storage_key(t) for t in ins if t.is_meta}
        for o in tree_flatten(out)[0]:
            if isinstance(o, torch.Tensor) and o.is_meta and _storage_key(o) not in seen:
                self._on_fresh(func, o, args, kwargs, ins)

    def _on_write(self, func: Any, t: torch.Tensor, args: tuple, kwargs: dict) -> None:
        name = func.overloadpacket.__name__
        bound = _bind(func, args, kwargs)
        if name == "fill_" or name == "zero_":
            value = bound.get("value", 0)
            if isinstance(value, torch.Tensor):
                if value.is_meta or value.numel() != 1:
                    return self._fail(t, f"{func} with a tensor value whose value is not known")
                value = value.item()
            return self._write(t, _Step("fill", None, (value,)), reads=False)
        if name in ("uniform_", "normal_"):
            if not t.is_floating_point():
                return self._fail(t, f"{func} on a {t.dtype} tensor")
            a, b = (bound.get("from", 0.0), bound.get("to", 1.0)) if name == "uniform_" else \
                (bound.get("mean", 0.0), bound.get("std", 1.0))
            return self._write(t, _Step(name[:-1], None, (float(a), float(b))), reads=False)
        if name == "copy_":
            return self._on_copy(t, bound["src"])
        if _is_pointwise(func) and bound and next(iter(bound.values())) is t:
            template = _scalar_template(func, args, kwargs, t)
            if isinstance(template, str):
                return self._fail(t, template)
            return self._write(t, _Step("pointwise_", None, template[0], func, template[1]),
                               reads=True)
        self._fail(t, f"{func} (not an elementwise op autoshard can replay on a shard)")

    def _on_copy(self, t: torch.Tensor, src: torch.Tensor) -> None:
        if not src.is_meta:
            if src.numel() == 1:
                return self._write(t, _Step("fill", None, (src.item(),)), reads=False)
            return self._write(t, _Step("tensor", None, (src.detach().expand(t.shape),)),
                               reads=False)
        flat = t.is_contiguous() and t.storage_offset() == 0 \
            and t.numel() == math.prod(self.recipe(t).shape)
        if _storage_key(src) in self.records and _is_whole(src) and flat:
            new = self.records[_storage_key(src)][1].rebased(self.recipe(t).shape)
            if new is not None:
                if src.dtype != t.dtype:
                    new.add(_Step("cast", None, (t.dtype,)))
                new.origin = self.recipe(t).origin
                self._fresh(t, new)
                return None
        self._fail(t, "copy_ of a meta tensor that is not a whole contiguous one, or into a "
                      "part or a permuted view of this one")

    def _on_fresh(self, func: Any, o: torch.Tensor, args: tuple, kwargs: dict,
                  ins: list[torch.Tensor]) -> None:
        name = func.overloadpacket.__name__
        bound = _bind(func, args, kwargs)
        shape, origin = tuple(o.shape), f"{func}"
        if not _is_whole(o):
            rec = _Recipe((o.untyped_storage().nbytes() // o.element_size(),), o.dtype,
                          origin=origin)
            rec.fail(f"{func} made it with a layout other than contiguous")
            return self._fresh(o, rec)
        rec = _Recipe(shape, o.dtype, origin=origin)
        if name in _EMPTIES:
            pass
        elif name in _FILLS:
            rec.set(_Step("fill", None, (_FILLS[name],)))
        elif name in _FULLS:
            value = bound.get(_FULLS[name])
            if isinstance(value, torch.Tensor):
                value = value.item() if not value.is_meta else None
            if value is None:
                rec.fail(f"{func} with a value that is not known")
            else:
                rec.set(_Step("fill", None, (value,)))
        elif name == "arange":
            rec.set(_Step("arange", None, (bound.get("start", 0), bound.get("step", 1))))
        elif name in _RANDS:
            if o.is_floating_point():
                rec.set(_Step(_RANDS[name], None, (0.0, 1.0)))
            else:
                rec.fail(f"{func} on {o.dtype}")
        elif name in _COPIES and len(ins) == 1:
            src = ins[0]
            if not src.is_meta:
                rec.set(_Step("tensor", None, (src.detach().reshape(shape),)))
            elif _storage_key(src) in self.records and _is_whole(src):
                new = self.records[_storage_key(src)][1].rebased(shape)
                if new is None:
                    rec.fail(f"{func} of a tensor of another shape")
                else:
                    rec = new
                    rec.origin = origin
                    if o.dtype != src.dtype:
                        rec.add(_Step("cast", None, (o.dtype,)))
            else:
                rec.fail(f"{func} of part of a meta tensor")
        elif name == "constant_pad_nd" and len(ins) == 1 and ins[0].is_meta:
            rec = self._padded(func, ins[0], bound, rec)
        elif _is_pointwise(func):
            metas = [t for t in ins if t.is_meta]
            src = metas[0] if len(metas) == 1 else None
            template = _scalar_template(func, args, kwargs, src) if src is not None else None
            new = (self.records[_storage_key(src)][1].rebased(shape)
                   if src is not None and _storage_key(src) in self.records and _is_whole(src)
                   and tuple(src.shape) == shape else None)
            if new is None or isinstance(template, str) or template is None:
                rec.fail(template if isinstance(template, str) else
                         f"{func} on several meta tensors, or on part of one")
            else:
                rec = new
                rec.origin = origin
                rec.add(_Step("pointwise", None, template[0], func, template[1]))
        else:
            rec.fail(f"{func} (autoshard replays fills, random fills, arange, copies and "
                     f"elementwise ops with scalar operands)")
        self._fresh(o, rec)


    def _padded(self, func: Any, src: torch.Tensor, bound: dict, rec: _Recipe) -> _Recipe:
        """``F.pad(src, pad, value=v)`` (Hugging Face pads the MLM decoder bias when it ties
        weights): a copy when nothing is added; else the fill ``v`` with ``src`` in a box of it,
        when ``src`` holds fills only (other values are keyed by index, which padding moves)."""
        pad, value = list(bound["pad"]), bound.get("value", 0.0)
        key = _storage_key(src)
        old = self.records[key][1] if key in self.records and _is_whole(src) else None
        if old is None or any(p < 0 for p in pad):
            rec.fail(f"{func} of part of a meta tensor, or cropping")
            return rec
        if not any(pad):
            new = old.rebased(rec.shape)
            if new is None:
                rec.fail(f"{func} of a tensor of another shape")
                return rec
            new.origin = rec.origin
            return new
        if any(st.kind != "fill" for st in old.steps) or not old.defined:
            rec.fail(f"{func} adding elements to a tensor holding more than fills")
            return rec
        before = [0] * len(rec.shape)
        for i in range(len(pad) // 2):
            before[len(rec.shape) - 1 - i] = pad[2 * i]
        box = tuple((b, b + n) for b, n in zip(before, src.shape))
        rec.set(_Step("fill", None, (value,)))
        for st in old.steps:
            region = st.region or tuple((0, n) for n in src.shape)
            rec.add(dataclasses.replace(st, region=tuple(
                (lo + b[0], hi + b[0]) for (lo, hi), b in zip(region, box))))
        return rec


# ------------------------------------------------------------------------- building on meta

@dataclass(frozen=True)
class _Snapshot:
    storage: torch.UntypedStorage
    key: int
    recipe: _Recipe


_BUILT: "weakref.WeakKeyDictionary[nn.Module, dict[str, _Snapshot]]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def deferred_init() -> Iterator[None]:
    """Build models inside: every tensor is made on the meta device, and what the constructors
    write into parameters and buffers (``reset_parameters``, ``self.apply(_init_weights)``,
    ``torch.ones(...)``, Hugging Face's ``post_init``) is recorded, for ``parallelize`` to replay
    on each rank's shards (the default ``init="auto"``) or :func:`materialize` on one device::

        with deferred_init():
            model = Llama(cfg)              # no memory; not even the current device's RNG moves
        pm = autoshard.parallelize(model, mesh, plan=plan, seed=0)

    Build as on the CPU, without a ``torch.device("meta")`` block (``get_model(name,
    device="cpu")``): models see the default device as usual, so Hugging Face models run their
    init, which they skip under ``torch.device("meta")``. Changes to the model's meta tensors
    after the block are not recorded (pass ``init=`` for those).
    """
    rec = _Recorder(redirect=True)
    owners: list[weakref.ref] = []

    def _registered(module: nn.Module, name: str, value: Any) -> None:
        owners.append(weakref.ref(module))

    hooks = [nn.modules.module.register_module_parameter_registration_hook(_registered),
             nn.modules.module.register_module_buffer_registration_hook(_registered)]
    try:
        with rec:
            yield
    finally:
        for h in hooks:
            h.remove()
        for ref in owners:
            module = ref()
            if module is None or module in _BUILT:
                continue
            snaps = {}
            for name, t in itertools.chain(module._parameters.items(), module._buffers.items()):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    snaps[name] = _Snapshot(t.untyped_storage(), _storage_key(t),
                                            rec.recipe(t).copy())
            _BUILT[module] = snaps


# --------------------------------------------------------------------------- the init modes

def _default_init(model: nn.Module) -> None:
    """``reset_parameters()`` of every submodule, then the model's own init method: that of the
    outermost modules having one of ``initialize_weights()`` (Hugging Face >= 5),
    ``init_weights()`` or ``_init_weights()`` (a Hugging Face-style ``_init_weights(module)`` is
    applied to every submodule). Hugging Face's ``_is_hf_initialized`` marks, which make its init
    skip what it already initialised, are cleared first."""
    for m in model.modules():
        reset = getattr(m, "reset_parameters", None)
        if callable(reset):
            reset()
    covered: set[int] = set()
    for m in model.modules():
        if id(m) in covered:
            continue
        for name in ("initialize_weights", "init_weights", "_init_weights"):
            fn = getattr(m, name, None)
            if not callable(fn):
                continue
            for x in itertools.chain(m.modules(), m.parameters(), m.buffers()):
                if getattr(x, "_is_hf_initialized", False):
                    x._is_hf_initialized = False
            try:
                n_args = len(inspect.signature(fn).parameters)
            except (TypeError, ValueError):
                n_args = 0
            if n_args == 0:
                fn()
            else:                              # Hugging Face style: _init_weights(module)
                m.apply(fn)
            covered |= {id(x) for x in m.modules()}
            break


@dataclass
class _Entry:
    name: str                       # the canonical name: the RNG key
    tensor: torch.Tensor
    recipe: _Recipe | None          # None: init="empty"
    kind: str                       # "parameter" | "buffer"


@dataclass
class Sources:
    """Where each meta tensor of a model gets its values (:func:`prepare`)."""

    init: str
    seed: int
    entries: dict[str, _Entry]       # every name of every meta tensor (tied names too)

    def problems(self, names: Sequence[str] | None = None) -> list[tuple[str, str]]:
        out = []
        for name in names if names is not None else list(self.entries):
            e = self.entries.get(name)
            if e is not None and e.recipe is not None:
                why = _why_not(e.recipe)
                if why is not None:
                    out.append((name, why))
        return out

    def check(self, names: Sequence[str] | None = None) -> None:
        bad = self.problems(None if names is None else list(dict.fromkeys(names)))
        if not bad:
            return
        first, why = bad[0]
        others = f" (and {len(bad) - 1} more: {', '.join(n for n, _ in bad[1:6])})" \
            if len(bad) > 1 else ""
        load = "or pass init='empty' and load weights next (pm.load_full_state_dict / " \
               "pm.load_sharded_state_dict)"
        fix = (f"pass init=fn that rewrites these tensors with such ops (it runs on the recorded "
               f"model), {load}" if self.init == "recorded" else
               f"build the model inside autoshard.codegen.materialize.deferred_init() so that its "
               f"constructor's init is recorded, pass init=fn that writes these tensors with such "
               f"ops, {load}")
        raise AutoshardError(
            f"every tensor on the meta device written by initialisers autoshard can replay on "
            f"a shard (fills, uniform_/normal_/trunc_normal_, elementwise ops with scalars, "
            f"copies, arange) under init={self.init!r}", got=f"{first}: {why}{others}", fix=fix)

    def local(self, name: str, spec: Spec | None, mesh_shape: Sequence[int],
              coords: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
        e = self.entries[name]
        shape = tuple(e.tensor.shape)
        device = torch.device(device) if device is not None else torch.device("cpu")
        if e.recipe is not None:
            self.check([name])
        strided = {p.dim: p.groups for p in spec or () if isinstance(p, Shard) and p.groups}
        if len(strided) > 1:
            raise AutoshardError(f"{name}: at most one strided dim per tensor",
                                 got=f"spec {spec_str(spec)}", fix="re-plan: the plan is damaged")
        if strided:     # a strided dim: the rank's box in each group, in group order (ir.py)
            (dim, groups), = strided.items()
            plain = tuple(Replicate() if isinstance(p, Shard) and p.dim == dim else p
                          for p in spec)
            inner = tuple(Shard(0) if isinstance(p, Shard) and p.dim == dim else Replicate()
                          for p in spec)
            box = _local_box(shape, plain, mesh_shape, coords, name)
            parts, lo = [], 0
            for size in Shard(dim, groups).group_sizes(shape[dim]):
                (a, b), = _local_box((size,), inner, mesh_shape, coords, name)
                box[dim] = (lo + a, lo + b)
                parts.append(self._box(e, box, device))
                lo += size
            return torch.cat(parts, dim)
        return self._box(e, _local_box(shape, spec, mesh_shape, coords, name), device)

    def _box(self, e: "_Entry", box: list[tuple[int, int]], device: torch.device) -> torch.Tensor:
        if e.recipe is None:
            return _unset([hi - lo for lo, hi in box], e.tensor.dtype, device)
        return _replay(e.recipe, e.name, self.seed, e.tensor, box, device)


def _why_not(rec: _Recipe) -> str | None:
    if rec.problem is not None:
        return rec.problem
    if not rec.defined:
        written = ", ".join(sorted({s.kind for s in rec.steps})) or "nothing"
        return (f"it was made by {rec.origin or 'an unrecorded op'} and not every element was "
                f"written after (recorded: {written})")
    return None


def _unset(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Values that say "not loaded": NaN, or the integer dtype's minimum."""
    if dtype.is_floating_point or dtype.is_complex:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)


def _meta_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    out = [(n, p, "parameter") for n, p in model.named_parameters(remove_duplicate=False)]
    out += [(n, b, "buffer") for n, b in model.named_buffers(remove_duplicate=False)]
    return [(n, t, k) for n, t, k in out if t.is_meta]


def _snapshot_of(model: nn.Module, name: str, t: torch.Tensor) -> _Snapshot | None:
    owner, _, local = name.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    snap = _BUILT.get(module, {}).get(local)
    return snap if snap is not None and snap.key == _storage_key(t) else None


def prepare(model: nn.Module, *, init: Init = "auto", seed: int = 0) -> Sources:
    """The values of ``model``'s meta tensors, recorded (module docstring: the init modes).

    Recording the ``"model"`` or a callable init runs it on the meta model, which costs no
    memory and changes nothing that holds values.
    """
    if not (callable(init) or init in INIT_MODES):
        raise AutoshardError(f"init is one of {', '.join(map(repr, INIT_MODES))} or a callable "
                             f"init_fn(model)", got=f"init={init!r}",
                             fix="pass init='model' (the model's own init), a function, or "
                                 "leave the default")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise AutoshardError("an int seed", got=f"seed={seed!r}", fix="pass seed=<int>")
    metas = _meta_tensors(model)
    if not metas:
        if init != "auto":
            raise AutoshardError(f"a model on the meta device for init={init!r}",
                                 got="a model whose tensors all hold values",
                                 fix="drop init= (its values are sharded as they are), or build "
                                     "the model on the meta device")
        return Sources("auto", seed, {})
    snaps = {n: _snapshot_of(model, n, t) for n, t, _ in metas}
    mode = init if not callable(init) else getattr(init, "__name__", "callable")
    if init == "auto":
        mode = "recorded" if all(s is not None for s in snaps.values()) else "model"
    canonical: dict[int, str] = {}
    for n, t, _ in metas:                     # the first name of a tensor keys its draws
        canonical.setdefault(id(t), n)
    recipes: dict[str, _Recipe | None] = {}
    if mode == "empty":
        for n, t, kind in metas:             # buffers keep recorded values (rotary tables)
            s = snaps[n]
            ok = kind == "buffer" and s is not None and _why_not(s.recipe) is None
            recipes[n] = s.recipe if ok else None
    elif mode == "recorded":
        for n, t, _ in metas:
            s = snaps[n]
            recipes[n] = s.recipe if s is not None else _Recipe(
                tuple(t.shape), t.dtype, origin="a constructor outside deferred_init()")
    else:
        fn = _default_init if init in ("auto", "model") else init
        rec = _Recorder(redirect=True)
        for n, t, _ in metas:
            if snaps[n] is not None:
                rec.seed(t, snaps[n].recipe.copy())
        with torch.no_grad(), rec:
            fn(model)
        for n, t, _ in metas:
            recipes[n] = rec.recipe(t, origin="a constructor outside deferred_init()").copy()
    entries = {n: _Entry(canonical[id(t)], t, recipes[n], kind) for n, t, kind in metas}
    return Sources(mode, seed, entries)


# ------------------------------------------------------------------------------- the replay

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

_BOUND: "weakref.WeakKeyDictionary[nn.Module, Sources]" = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def bound(model: nn.Module, sources: Sources) -> Iterator[Sources]:
    """Make ``sources`` the values :func:`local_shard` gives ``model``'s meta tensors."""
    _BOUND[model] = sources
    try:
        yield sources
    finally:
        _BOUND.pop(model, None)


def local_shard(model: nn.Module, name: str, t: torch.Tensor, spec: Spec | None,
                mesh_shape: Sequence[int], coords: Sequence[int],
                device: torch.device | str | None = None) -> torch.Tensor:
    """This rank's shard of ``model``'s tensor ``name`` (``t``): cut from its values, or, on the
    meta device, materialised from the model's :class:`Sources` (those bound by ``parallelize``,
    else ``prepare(model)``) without ever making the whole tensor."""
    from autoshard.ops.simulate import shard_tensor
    t = t.detach()
    if not t.is_meta:
        return t if spec is None else shard_tensor(t, spec, mesh_shape, coords).contiguous().clone()
    sources = _BOUND.get(model)
    if sources is None:
        sources = _BOUND[model] = prepare(model)
    if name not in sources.entries:
        raise AutoshardError(f"{name}: a tensor with values (a parameter, buffer or constant "
                             f"of the traced model)",
                             got="a meta tensor that is none of the model's parameters or "
                                 "buffers (a constant made in forward from a meta tensor?)",
                             fix="make it from the inputs in forward, or register it as a buffer")
    return sources.local(name, spec, mesh_shape, coords, device)


# --------------------------------------------------------------------------- one device

def materialized_state_dict(model: nn.Module, *, init: Init = "auto", seed: int = 0,
                            device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """Every meta tensor of ``model`` materialised whole on ``device``: what ``parallelize``
    materialises on a one-device mesh, under every name of a tied tensor."""
    sources = prepare(model, init=init, seed=seed)
    sources.check()
    out, done = {}, {}
    for name, e in sources.entries.items():
        if e.name not in done:
            done[e.name] = sources.local(e.name, None, (), (), device)
        out[name] = done[e.name]
    return out


def materialize(model: nn.Module, *, init: Init = "auto", seed: int = 0,
                device: torch.device | str = "cpu") -> nn.Module:
    """Give ``model``'s meta tensors their values on ``device``, in place (tied tensors stay
    tied); returns ``model``. The single-device counterpart of ``parallelize(..., init=, seed=)``:
    each shard there equals its slice of these tensors, bit for bit."""
    values = materialized_state_dict(model, init=init, seed=seed, device=device)
    made: dict[int, torch.Tensor] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in made:
                    v = values[prefix + name]
                    made[id(t)] = nn.Parameter(v, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else v
                table[name] = made[id(t)]
    return model


# ------------------------------------------------------------------ a lazy full state dict

class _SafetensorsDict(Mapping):
    """A ``.safetensors`` file as a Mapping that reads a tensor when it is asked for."""

    def __init__(self, path: Path, device: str) -> None:
        from safetensors import safe_open
        self._file = safe_open(str(path), framework="pt", device=device)
        self._keys = list(self._file.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._file.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys


def safetensors_state_dict(path: str | Path, *, device: str = "cpu") -> Mapping[str, torch.Tensor]:
    """A lazy full state dict over a ``.safetensors`` file, for ``pm.load_full_state_dict``:
    each tensor is read when asked for, so a rank holds one whole tensor at a time."""
    if importlib.util.find_spec("safetensors") is None:
        raise AutoshardError("the safetensors package to read .safetensors files",
                             got="it is not installed", fix="pip install safetensors")
    path = Path(path)
    if not path.is_file():
        raise AutoshardError("a .safetensors file", got=f"{path}: no such file",
                             fix="pass the path of the checkpoint file")
    return _SafetensorsDict(path, device)
