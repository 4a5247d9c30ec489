"""What a model's initialisers do, recorded on the meta device (codegen/materialize.py): a
``TorchDispatchMode`` logs, per tensor storage, the ops that write it as a recipe of steps
(fills, draws, elementwise ops with scalar operands, copies), with the geometry of the views
they write through; a step that cannot be replayed elementwise marks its recipe failed, naming
the op (torchdistx's ``deferred_init`` records a module's construction the same way)."""
from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

META = torch.device("meta")

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

