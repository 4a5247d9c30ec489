"""The host's optimizer step under optimizer offload (cost/state.py mode ``offload``), at the
host's memory bandwidth and overlapped with the device, and parameter offload's
(``offload_params``) through the same buckets at ``opt.step()`` (docs/cost-model.md §9.1).

ZeRO-Offload (Ren et al. 2021, arXiv 2101.06840, §4-5) makes the host step cheap in two ways,
and so does this module:

- **One pass over flat state.** The masters of the offloaded parameters are packed, in the order
  their gradients appear in backward, into buckets of up to ``PlanOptions.bucket_mb`` of fp32
  master: one contiguous buffer per bucket for the masters and one per moment. Each master
  (the ``torch.nn.Parameter`` the wrapped torch optimizer holds) becomes a view of its bucket's
  buffer, and the torch optimizer's state holds views of the moment buffers, so its
  ``state_dict``, DCP and learning-rate schedulers work unchanged. A bucket steps with torch's
  fused CPU kernels (``torch._fused_adamw_``, ``_fused_adam_``, ``_fused_sgd_``: one read of
  gradient, master and moments and one write of the last three per element, parallel over all
  the host's cores) over pieces of :data:`CHUNK` elements; a 16-bit gradient is converted into
  an fp32 scratch piece first, which the kernel then reads from the cache, so the conversion
  adds no pass over host memory. benchmarks/host_optimizer.py measures this beyond the
  last-level cache against torch's AdamW (fused and foreach).
- **Overlap.** The gradients land in a landing buffer per bucket (pinned when the device is a
  GPU, so the copy down runs at the link's speed without waiting) and the bucket's step runs on
  one host thread (:class:`concurrent.futures.ThreadPoolExecutor`; torch's kernels release the
  interpreter lock) while the device goes on (``PlanOptions.offload_overlap``):

  - ``"backward"``: a parameter whose whole gradient is its ``.grad`` lands from a
    post-accumulate-grad hook, the moment autograd has finished it, its device copy is freed
    (the copy down is queued on the same stream first), and its bucket steps as soon as every
    member has landed, while backward continues with the earlier layers. The optimizer's
    ``step()`` lands the rest (the reduce-scattered shards of a sharded bucket, read after
    backward), then takes the buckets in order: waits for each and writes its updated
    parameters back (the copy up, any all-gather) while the thread steps the later ones. The
    numbers are those of ``"none"``: the same kernels on the same values. As ZeRO-Offload's
    engine couples its backward and step, this starts a step on the host before ``step()`` is
    called, from the first backward after ``pm.optimizer(...)``: it needs one backward per
    optimizer step (a second backward before the step would add to a gradient that already
    stepped: a parameter landing twice is refused; a backward whose gradients are thrown away,
    as a skipped step, needs ``"none"``). The freed gradients are not on the device for torch's
    ``clip_grad_norm_`` (``pm.parameters()`` refuses to hand them out until the step);
    ``pm.full_grads()`` reads them where they landed. The parameters whose state is on the
    device step in backward too (codegen/earlystep.py). On a pipeline (a backward per
    microbatch) every gradient lands in ``step()``.
  - ``"delayed"``: ZeRO-Offload's delayed parameter update (DPU, §5.2): ``step()`` of step t
    waits for step t-1's host step, writes its parameters back, lands step t's gradients and
    returns while the host steps them, overlapped with step t+1's forward and backward. With
    ``M_t`` the masters after t host steps and ``W_t`` the parameters step t's forward reads:
    ``W_1 = W_2 = M_0``, ``W_t = M_(t-2)`` and ``M_t = U(M_(t-1), g(W_t))``: each update uses
    the gradient at the parameters one update behind the masters. Step t's write-back comes
    with step t+1's ``step()`` (or :meth:`HostOptimizer.flush`); on the device, the first
    step's parameters are left as they were.
  - ``"none"``: everything at ``step()``, each bucket still on the thread so that its write
    back overlaps the later buckets' steps.

An optimizer whose step this module has no fused kernel for (another class, ``amsgrad``,
``capturable``, ``differentiable``, a tensor learning rate) keeps torch's own step on the host
masters (codegen/optim.py), which a warning says, as it is slower than the plan's price.
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch

from autoshard.errors import AutoshardError
from autoshard.cost.program import steps_in_backward
from autoshard.cost.state import HOST_MODES
from autoshard.ir import OffloadOverlap, Phase, StateMode
from autoshard.options import OFFLOAD_OVERLAP

# Elements per fused kernel call: a 16-bit gradient's fp32 conversion of this size (16 MiB)
# stays in the last-level cache until the kernel reads it.
CHUNK = 1 << 22
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


def host_threads(device: torch.device) -> int:
    """The host threads one rank's optimizer step runs on: next to a GPU, the rank's share of
    the cores it may run on (``LOCAL_WORLD_SIZE`` ranks on this host, as torchrun sets it),
    whatever ``OMP_NUM_THREADS`` says (torchrun sets it to 1, which would leave the step, a
    pass over the host's memory, on one core); on a CPU run the host is the device, and the
    rank's compute threads are the step's too."""
    if device.type != "cuda":
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        (os.cpu_count() or 1)
    return max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def host_kind(optimizer: torch.optim.Optimizer) -> tuple[str | None, str]:
    """Which fused math steps ``optimizer`` ("adam" covers AdamW: its decoupled weight decay is a
    flag of Adam's in torch), or None and why not."""
    if isinstance(optimizer, torch.optim.Adam):
        kind, bad = "adam", ("amsgrad", "capturable", "differentiable")
    elif isinstance(optimizer, torch.optim.SGD):
        kind, bad = "sgd", ("differentiable",)
    else:
        return None, f"{type(optimizer).__name__} (fused host steps: Adam, AdamW, SGD)"
    for group in optimizer.param_groups:
        on = [k for k in bad if group.get(k)]
        if on:
            return None, f"{type(optimizer).__name__} with {', '.join(on)}"
        if isinstance(group["lr"], torch.Tensor):
            return None, f"{type(optimizer).__name__} with a tensor learning rate"
    return kind, ""


@dataclass(eq=False)
class _Slot:
    key: Any                       # the caller's handle of the parameter (codegen/optim.py _Entry)
    master: torch.nn.Parameter     # a view of its bucket's master buffer
    offset: int
    numel: int
    landed: bool = False
    early: Any = None              # "backward": the gradient landed from backward, and its version


@dataclass(eq=False)
class _Bucket:
    slots: list[_Slot]
    group: int                     # the torch optimizer's param group of every member, by
                                   # index: a load_state_dict replaces the group dicts
    master: torch.Tensor           # flat fp32
    moments: list[torch.Tensor]    # Adam: exp_avg, exp_avg_sq; SGD with momentum: the buffer
    grads: torch.Tensor | None = None      # the landing buffer, in the gradients' dtype
    up: torch.Tensor | None = None         # the updated masters cast to ``up_dtype``
    up_dtype: torch.dtype | None = None
    landed: int = 0
    event: Any = None              # the copies down, on a GPU
    first: bool = False            # SGD: the momentum buffers' first step
    future: Future | None = None
    active: list[_Slot] = field(default_factory=list)    # the members stepping now

    @property
    def numel(self) -> int:
        return self.master.numel()


class HostOptimizer:
    """The host step of ``keys`` (each with its fp32 host ``master`` in ``masters``, a parameter
    of ``optimizer``), in buckets of up to ``bucket_bytes`` of master, in the order given (the
    order their gradients appear). ``up_dtype``: per key, the dtype the updated master is copied
    back in (the parameter's). ``record(key, grad)``: counts a gradient's copy down (the ledger)."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, keys: list[Any],
                 masters: list[torch.nn.Parameter], up_dtypes: list[torch.dtype], *,
                 overlap: OffloadOverlap, bucket_bytes: float, device: torch.device,
                 record: Callable[[Any, torch.Tensor], None] | None = None) -> None:
        if overlap not in OFFLOAD_OVERLAP:
            raise AutoshardError(f"offload_overlap one of {OFFLOAD_OVERLAP}", got=repr(overlap),
                                 fix="PlanOptions(offload_overlap='backward')")
        self.optimizer, self.kind, self.overlap = optimizer, kind, OffloadOverlap(overlap)
        self.device, self.record = device, record
        self.pinned = device.type == "cuda"
        group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.buckets: list[_Bucket] = []
        self.slot_of: dict[int, tuple[_Bucket, _Slot]] = {}
        run: list[tuple[Any, torch.nn.Parameter, torch.dtype]] = []
        for key, m, dt in zip(keys, masters, up_dtypes):
            assert m.dtype == torch.float32 and m.device.type == "cpu", (m.dtype, m.device)
            if run and (group_of[id(run[0][1])] != group_of[id(m)] or run[0][2] != dt
                        or 4 * (sum(r[1].numel() for r in run) + m.numel()) > bucket_bytes):
                self._pack(run, group_of[id(run[0][1])])
                run = []
            run.append((key, m, dt))
        if run:
            self._pack(run, group_of[id(run[0][1])])
        self.threads = host_threads(device)
        # (set in the worker itself: torch's intra-op thread count is the calling thread's)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autoshard-hostopt",
                                        initializer=torch.set_num_threads,
                                        initargs=(self.threads,))
        self._scratch = torch.empty(0)
        self._inflight: list[_Bucket] = []         # "delayed": the buckets stepping now
        self.handles: list = []
        self.started_early = 0                     # buckets started from backward, all steps
        # "backward": the members whose device gradients were freed as they landed, this step
        self.released: dict[int, Any] = {}
        self.hold: Callable[[], bool] = lambda: False     # True: accumulating, land at the step
        self._todo: list[_Bucket] = []

    # -- layout --------------------------------------------------------------------------------
    def _pack(self, run: list[tuple[Any, torch.nn.Parameter, torch.dtype]], group: int) -> None:
        n = sum(m.numel() for _, m, _ in run)
        flat = torch.empty(n, dtype=torch.float32, pin_memory=self.pinned)
        moments = [torch.zeros(n, dtype=torch.float32) for _ in
                   (_ADAM_KEYS if self.kind == "adam" else ())]
        slots, off = [], 0
        for key, m, _ in run:
            k = m.numel()
            flat[off:off + k].copy_(m.detach().reshape(-1))
            with torch.no_grad():                  # the parameter object stays the optimizer's
                m.data = flat[off:off + k].view(m.shape)
            slots.append(_Slot(key, m, off, k))
            off += k
        b = _Bucket(slots, group, flat, moments)
        b.up_dtype = run[0][2]              # one dtype per bucket, the members' parameters'
        if b.up_dtype != torch.float32 or self.pinned:
            b.up = torch.empty(n, dtype=b.up_dtype, pin_memory=self.pinned)
        self.buckets.append(b)
        for s in slots:
            self.slot_of[id(s.key)] = (b, s)

    def owns(self, key: Any) -> bool:
        return id(key) in self.slot_of

    # -- gradients in ----------------------------------------------------------------------------
    def land(self, key: Any, grad: torch.Tensor, *, early: bool = False) -> bool:
        """Copy ``key``'s gradient into its bucket's landing buffer (down the link, without
        waiting, from a GPU). ``early``: from backward; the bucket is stepped once every member
        has landed. Returns whether it landed now (from backward: not inside ``pm.no_sync()``)."""
        if early and self.hold():
            return False   # (inside pm.no_sync(): at the step)
        b, s = self.slot_of[id(key)]
        if s.landed:
            if early:
                raise second_backward()
            return False
        if b.grads is None or b.grads.dtype != grad.dtype:
            b.grads = torch.empty(b.numel, dtype=grad.dtype, pin_memory=self.pinned)
        if self.record is not None:
            self.record(key, grad)
        b.grads[s.offset:s.offset + s.numel].view(grad.shape).copy_(grad,
                                                                    non_blocking=grad.is_cuda)
        s.landed = True
        s.early = (grad, grad._version) if early else None
        b.landed += 1
        if grad.is_cuda:
            b.event = torch.cuda.Event()
            b.event.record()
        if early and b.landed == len(b.slots):
            self.started_early += 1
            self._submit(b)
        return True

    def release(self, key: Any) -> None:
        """``key``'s gradient, landed from backward, leaves the device: its caller frees the
        device copy (the copy down was queued on the same stream before anything can reuse the
        memory), and it is no longer checked for changes (nothing can change it)."""
        _, s = self.slot_of[id(key)]
        s.early = None
        self.released[id(key)] = key

    def landed_grad(self, key: Any) -> torch.Tensor | None:
        """``key``'s gradient as it landed on the host this step (its landing buffer's slice,
        which the step only reads), or None where it has not landed."""
        b, s = self.slot_of[id(key)]
        if not s.landed or b.grads is None:
            return None
        if self.pinned:                  # (its copy down may still be in flight)
            torch.cuda.current_stream(self.device).synchronize()
        return b.grads[s.offset:s.offset + s.numel].view(s.master.shape)

    def unhook(self) -> None:
        """Land nothing early any more: every gradient at the step."""
        for h in self.handles:
            h.remove()
        self.handles = []

    def hooks(self, params: Iterable[tuple[Any, torch.nn.Parameter]]) -> list:
        """Under ``"backward"``: land each of ``params``' ``.grad`` (its whole gradient) from a
        post-accumulate-grad hook, as autograd finishes it, and free the device's copy (the
        step program's ``released``, which the liveness walk frees there too). Returns the
        hook handles."""
        if self.overlap != OffloadOverlap.BACKWARD:
            return []
        out = []
        for key, p in params:
            def hook(p: torch.Tensor, key: Any = key) -> None:
                if self.land(key, p.grad, early=True):
                    self.release(key)
                    p.grad = None
            out.append(p.register_post_accumulate_grad_hook(hook))
        return out

    # -- the step ------------------------------------------------------------------------------
    def start(self, grads: list[tuple[Any, torch.Tensor]],
              write_back: Callable[[Any, torch.Tensor], None]) -> None:
        """Land ``grads`` (those not landed in backward) and step every bucket with a gradient
        on the host thread; :meth:`finish` writes them back. Under ``"delayed"``, the previous
        step's buckets are waited for and written back first, and :meth:`finish` leaves this
        step's stepping. ``write_back(key, updated)``: the updated master in the parameter's
        dtype, on the host (pinned on a GPU run)."""
        if self.overlap == OffloadOverlap.DELAYED:
            self.flush(write_back)
        self._check_unchanged()
        self.released = {}
        for key, g in grads:
            self.land(key, g)
        self._todo = [b for b in self.buckets if b.landed or b.future is not None]
        for b in self._todo:
            if b.future is None:
                self._submit(b)

    def _check_unchanged(self) -> None:
        """A gradient stepped during backward must reach the step as backward left it: one
        changed since (torch's clip_grad_norm_, a grad scaler's unscale) was stepped unchanged."""
        for b in self.buckets:
            for s in b.slots:
                if s.early is not None and s.early[0]._version != s.early[1]:
                    raise AutoshardError(
                        "gradients left as backward made them under "
                        "offload_overlap='backward' (each bucket's host step starts in backward)",
                        got="a gradient changed after backward (clip_grad_norm_, unscaling?); "
                            "this step's host state already used it unchanged",
                        fix="plan with offload_overlap='none' (the default) to clip or scale "
                            "gradients between backward and the step, and resume from a "
                            "checkpoint")

    def finish(self, write_back: Callable[[Any, torch.Tensor], None]) -> None:
        """Bucket by bucket in order: wait for its host step, write its parameters back, while
        the later buckets step (under ``"delayed"``: left stepping until the next step)."""
        todo, self._todo = self._todo, []
        if self.overlap == OffloadOverlap.DELAYED:
            self._inflight = todo
            return
        for b in todo:
            self._collect(b, write_back)

    def flush(self, write_back: Callable[[Any, torch.Tensor], None] | None = None) -> None:
        """Wait for every host step still running (``"delayed"``: the last step's) and write
        its parameters back (when ``write_back`` is given)."""
        inflight, self._inflight = self._inflight, []
        for b in inflight:
            self._collect(b, write_back)

    def _collect(self, b: _Bucket, write_back: Callable[[Any, torch.Tensor], None] | None
                 ) -> None:
        assert b.future is not None
        fut, b.future = b.future, None
        fut.result()
        for s in b.slots:
            s.landed = False
        b.landed = 0
        if write_back is None:
            return
        src = b.up if b.up is not None else b.master
        for s in b.active:
            write_back(s.key, src[s.offset:s.offset + s.numel].view(s.master.shape))

    def _submit(self, b: _Bucket) -> None:
        # A member without a gradient this step is not stepped, as torch's optimizers skip it.
        b.active = [s for s in b.slots if s.landed]
        _adopt(self.optimizer, self.kind, b)
        hp = {k: v for k, v in self.optimizer.param_groups[b.group].items() if k != "params"}
        event, b.event = b.event, None
        b.future = self._pool.submit(self._run, b, hp, event)

    # -- on the host thread ----------------------------------------------------------------------
    def _run(self, b: _Bucket, hp: dict, event: Any) -> None:
        if event is not None:
            event.synchronize()
        with torch.no_grad():
            if self.kind == "adam":
                self._adam(b, hp)
            else:
                self._sgd(b, hp)
            if b.up is not None:
                for s in b.active:
                    b.up[s.offset:s.offset + s.numel].copy_(b.master[s.offset:s.offset + s.numel])

    def _grad_piece(self, b: _Bucket, lo: int, hi: int) -> torch.Tensor:
        g = b.grads[lo:hi]
        if g.dtype == torch.float32:
            return g
        if self._scratch.numel() < hi - lo:
            self._scratch = torch.empty(CHUNK, dtype=torch.float32)
        return self._scratch[:hi - lo].copy_(g)

    def _adam(self, b: _Bucket, hp: dict) -> None:
        state = self.optimizer.state
        steps = [state[s.master]["step"] for s in b.active]
        torch._foreach_add_(steps, 1)
        decoupled = hp.get("decoupled_weight_decay", isinstance(self.optimizer,
                                                                torch.optim.AdamW))
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        beta1, beta2 = hp["betas"]
        m1, m2 = b.moments
        for lo, hi, parts in _pieces(b.active):
            g = self._grad_piece(b, lo, hi)
            cut = [(a - lo, z - lo) for _, a, z in parts]
            kernel([b.master[lo + a:lo + z] for a, z in cut], [g[a:z] for a, z in cut],
                   [m1[lo + a:lo + z] for a, z in cut], [m2[lo + a:lo + z] for a, z in cut],
                   [], [state[s.master]["step"] for s, _, _ in parts],
                   lr=hp["lr"], beta1=beta1, beta2=beta2, weight_decay=hp["weight_decay"],
                   eps=hp["eps"], amsgrad=False, maximize=hp["maximize"])

    def _sgd(self, b: _Bucket, hp: dict) -> None:
        momentum = hp["momentum"]
        for lo, hi, parts in _pieces(b.active):
            g = self._grad_piece(b, lo, hi)
            cut = [(a - lo, z - lo) for _, a, z in parts]
            torch._fused_sgd_([b.master[lo + a:lo + z] for a, z in cut],
                              [g[a:z] for a, z in cut],
                              [b.moments[0][lo + a:lo + z] for a, z in cut] if momentum else [],
                              weight_decay=hp["weight_decay"], momentum=momentum, lr=hp["lr"],
                              dampening=hp["dampening"], nesterov=hp["nesterov"],
                              maximize=hp["maximize"], is_first_step=bool(momentum and b.first))

    def close(self) -> None:
        self.flush()
        self._pool.shutdown(wait=True)


def _pieces(slots: list[_Slot]) -> list[tuple[int, int, list[tuple[_Slot, int, int]]]]:
    """``slots`` (in flat order) cut into kernel calls of at most :data:`CHUNK` elements over
    one contiguous range of the bucket each, as (start, end, [(slot, start, end)]): small
    members share a call, a large one spans several."""
    out: list[list] = []
    for s in slots:
        a, end = s.offset, s.offset + s.numel
        while a < end:
            if not out or out[-1][1] != a or out[-1][1] - out[-1][0] >= CHUNK:
                out.append([a, a, []])
            call = out[-1]
            z = min(end, call[0] + CHUNK)
            call[2].append((s, a, z))
            call[1], a = z, z
    return [(lo, hi, parts) for lo, hi, parts in out]


def _adopt(optimizer: torch.optim.Optimizer, kind: str, b: _Bucket) -> None:
    """The torch optimizer's state of ``b``'s members as views of ``b``'s buffers: created
    as its first step would, or copied in where a load replaced the tensors."""
    state = optimizer.state
    for s in b.active:
        st = state[s.master]
        views = [m[s.offset:s.offset + s.numel].view(s.master.shape) for m in b.moments]
        if kind == "adam":
            if not st:
                st["step"] = torch.tensor(0.0, dtype=torch.float32)
                for k, v in zip(_ADAM_KEYS, views):
                    st[k] = v.zero_()
                continue
            if not isinstance(st["step"], torch.Tensor):
                st["step"] = torch.tensor(float(st["step"]), dtype=torch.float32)
            for k, v in zip(_ADAM_KEYS, views):
                if st[k].data_ptr() != v.data_ptr():
                    st[k] = v.copy_(st[k])
    if kind == "sgd" and optimizer.param_groups[b.group]["momentum"]:
        # torch's SGD: the first step sets the buffer to the gradient; later ones update it.
        have = [state[s.master].get("momentum_buffer") is not None for s in b.active]
        if any(have) and not all(have):
            raise AutoshardError("momentum buffers for all of an SGD optimizer's offloaded "
                                 "parameters or for none", got="a state with some of them",
                                 fix="load a state dict saved by the same optimizer")
        b.first = not any(have)
        if not b.moments:
            b.moments.append(torch.zeros(b.numel, dtype=torch.float32))
        for s in b.active:
            st = state[s.master]
            v = b.moments[0][s.offset:s.offset + s.numel].view(s.master.shape)
            if st.get("momentum_buffer") is not None \
                    and st["momentum_buffer"].data_ptr() != v.data_ptr():
                v.copy_(st["momentum_buffer"])
            st["momentum_buffer"] = v


def second_backward() -> AutoshardError:
    """The error of a parameter whose gradient completes twice before ``opt.step()`` under
    ``offload_overlap="backward"`` (here, and codegen/earlystep.py): it already stepped."""
    return AutoshardError(
        "one backward per optimizer step under offload_overlap='backward' (each parameter "
        "steps as soon as its gradient is complete)",
        got="a second backward before opt.step()",
        fix="run every micro-batch but the last inside `with pm.no_sync():` (its gradients "
            "then step at the last one), or plan with PlanOptions(offload_overlap='none')")


def fallback_warning(why: str) -> None:
    warnings.warn(f"offloaded optimizer: {why} has no fused host step; torch's own step runs on "
                  "the host masters after backward, slower than the plan prices it, and under "
                  "offload_overlap='backward' the gradients stay on the device until the step, "
                  "above the plan's memory peak (docs/cost-model.md §9.1)", stacklevel=3)


def attach(opt: Any) -> HostOptimizer | None:
    """The host step of a ShardedOptimizer's (codegen/optim.py) parameters whose state is on
    the host (optimizer and parameter offload), or None where it has none or its optimizer has
    no fused host step (torch's runs then). A parameter-offloaded gradient is on the host
    already (copied down in backward, without waiting: codegen/hostlink.py), so it lands at the
    step, after the copies settle, under every ``offload_overlap``; the buckets' steps and
    write-backs still overlap one another."""
    entries = [e for e in opt.entries if e.mode in HOST_MODES]
    if not entries:
        return None
    kind, why = host_kind(opt.optimizer)
    if kind is None:
        fallback_warning(why)
        return None
    rt, options = opt.pm.runtime, opt.pm.plan.options
    order = entries[::-1]              # backward makes the gradients of the last layers first

    def record(e: Any, g: torch.Tensor) -> None:
        if e.mode == StateMode.OFFLOAD:        # (a parameter-offloaded one came down in backward)
            rt.ledger.add_host("d2h", g, Phase.OPTIMIZER, "optimizer", e.placeholder)

    host = HostOptimizer(opt.optimizer, kind, order, [e.master for e in order],
                         [e.param.dtype for e in order], overlap=options.offload_overlap,
                         bucket_bytes=options.bucket_bytes, device=rt.device, record=record)
    # A gradient that is the parameter's whole ``.grad`` is complete when autograd has
    # accumulated it; a bucket's (codegen/buckets.py) lands in the optimizer's step, and so
    # does every gradient on a pipeline (its microbatches' backwards add to ``.grad``).
    bucketed = set(rt.buckets.of) if rt.buckets is not None else set()
    if opt.pm.plan.pipeline is None:    # (only the latest optimizer keeps them: optim.py)
        host.hold = lambda: opt.pm.accumulating
        host.handles = host.hooks(
            (e, e.param) for e in order
            if e.mode == StateMode.OFFLOAD
            and steps_in_backward(e.mode, e.dim is not None, e.placeholder in bucketed,
                                  options.offload_overlap))
    return host
