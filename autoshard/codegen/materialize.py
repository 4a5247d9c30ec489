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
import importlib.util
import inspect
import itertools
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence, Union

import torch
from torch import nn

from autoshard.codegen.counter_rng import counter_normal, counter_uniform
from autoshard.codegen.recording import _Recipe, _Recorder, _storage_key
from autoshard.codegen.replay import _local_box, _replay
from autoshard.errors import AutoshardError
from autoshard.ir import Replicate, Shard, Spec, spec_str

__all__ = ["Sources", "counter_normal", "counter_uniform", "deferred_init", "local_shard",
           "materialize", "materialized_state_dict", "prepare", "safetensors_state_dict"]

Init = Union[str, Callable[[nn.Module], Any]]
INIT_MODES = ("auto", "model", "recorded", "empty")


# The counter-based generator (codegen/counter_rng.py), the recording (codegen/recording.py) and
# the replay on a shard (codegen/replay.py) are their own modules; this one holds the sources.

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
