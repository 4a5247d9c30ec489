"""``autoshard calibrate``: measure this machine and write a cluster profile for the cost model.

Every figure of a preset (docs/cost-model.md §2) is a datasheet or published number; this module
measures them on the machine the plans will run on, the way the ranks run (on CPU, one thread per
rank, all ranks at once), and writes a JSON profile that :meth:`autoshard.cluster.Cluster.load`
and ``autoshard plan --cluster`` read. What is measured and which field it sets
(docs/cost-model.md §2.9):

- **matmul**: a linear layer as a training step runs it, forward ``x·Wᵀ`` through autograd and
  the backward autograd runs for it (input gradient ``dy·W``, weight gradient ``dyᵀ·x``), over
  a few shapes like those the planner prices, fp32 (and bf16 on CUDA). The fastest rate seen is
  the peak (``fp32_flops``, ``flops``); the rate over all of them (total FLOPs / total time)
  divided by that peak is ``matmul_efficiency``, so that ``peak · matmul_efficiency`` is the
  measured rate (§3.1).
- **memory bandwidth**: a large copy and a large add, bytes read + written per second, the
  larger of the two (``mem_bandwidth``; the roofline's bandwidth, §3.1).
- **kernel floor**: a chain of tiny ops run forward and backward through autograd, time per
  kernel (``kernel_floor_s``; §2.6: the model pays it once forward and once backward per op).
- **host dispatch** (CUDA): the same chain as an FX program of ATen ops, as the eager rank
  program runs, time per op (``host_dispatch_s``; §2.11: each eager op's floor, where the GPU
  is faster than the host; a compiled program does not pay it). On a CPU it is recorded under
  ``"measured"`` only: the host is the device, and the kernel floor holds it.
- **special functions**: the activations and softmaxes of transformer training (GELU in both
  forms, SiLU, softmax, log-softmax, exp, tanh), forward and backward kernels, on an op-sized
  activation: evaluations per second over all of them (``transcendental_rate``, §3.7; CPU only:
  on a GPU these kernels are bandwidth-bound and say nothing of the special-function units).
- **collectives**: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over the
  ranks, through the runtime's own functions (autoshard/codegen/collectives.py), at several
  message sizes ``S`` (§1.1's definition of ``S`` per collective), each call after a burst of
  compute as in a training step (see ``_comm``). One ``alpha`` and one
  bandwidth ``B`` are fitted by least squares to all of them under §1.1's ring formulas
  (``intra_alpha``, ``intra_bandwidth``; one host, so ``inter_*`` are set equal). The fit per
  collective is kept in the profile's ``"measured"`` record.
- **attention** (``scaled_dot_product_attention``, causal) and op-sized elementwise kernels
  (bytes per second) are measured and recorded under ``"measured"`` only: the model prices
  attention at the matmul rate plus one exp per score (§3.7), and elementwise ops by the
  roofline of §3.1, with no field of their own.

Ranks: by default ``--world`` processes spawned here (gloo on CPU, NCCL on CUDA) by
:class:`autoshard.codegen.world.World`; under ``torchrun`` (``WORLD_SIZE`` set) the launched
ranks measure and rank 0 writes the profile.
"""
from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from autoshard.cluster import Cluster
from autoshard.cost.comm import COLLECTIVE_KINDS, collective_time
from autoshard.errors import AutoshardError

DEVICES = ("cpu", "cuda")
# The collectives a plan runs (cost/reshards.py): the link figures are fitted to these. send/recv
# is measured and fitted on its own (in "measured"): no plan uses it until pipeline stages are
# searched (docs/cost-model.md §6).
PLAN_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


# ------------------------------------------------------------------------------ the alpha-beta fit

def alpha_beta_terms(kind: str, p: int) -> tuple[float, float]:
    """``(c, d)`` such that docs/cost-model.md §1.1 prices ``kind`` over ``p`` devices as
    ``c·alpha + d·S/B``: the latency steps and the bus-bandwidth factor of the ring algorithm."""
    if kind == "send_recv":
        return 1.0, 1.0
    if kind not in COLLECTIVE_KINDS:
        raise AutoshardError(f"a collective among {COLLECTIVE_KINDS}", got=repr(kind),
                             fix="name one of the cost model's collectives")
    if not (isinstance(p, int) and p >= 2):
        raise AutoshardError("a collective over at least 2 devices to fit", got=f"p={p!r}",
                             fix="measure with --world 2 or more")
    frac = (p - 1) / p
    if kind == "all_reduce":
        return 2.0 * (p - 1), 2.0 * frac
    return float(p - 1), frac


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """A fitted link: ``alpha`` (s per ring step) and ``bandwidth`` (bus bandwidth, bytes/s), with
    the largest relative error of the fit over its samples and their number."""

    alpha: float
    bandwidth: float
    max_rel_err: float
    samples: int
    clamped: str = ""          # which parameter hit its bound (noise, or sizes too narrow)


# Bounds keep a fit of noisy timings a valid Cluster figure (positive and finite).
MIN_ALPHA = 1e-9
MAX_BANDWIDTH = 1e15


def fit_alpha_beta(samples: Sequence[tuple[str, int, float, float]]) -> AlphaBeta:
    """Fit one ``alpha`` and one bus bandwidth ``B`` to timings of collectives.

    ``samples`` are ``(kind, p, S, seconds)``: a collective of docs/cost-model.md §1.1 over ``p``
    devices on a buffer of ``S`` bytes (§1.1's ``S``: the all-reduced tensor, the all-gather's
    output, the reduce-scatter's input, each device's all-to-all input, the message). The model
    is ``t = c·alpha + d·S/B`` with ``(c, d)`` from :func:`alpha_beta_terms`: linear in
    ``(alpha, 1/B)``. Least squares on relative residuals ``(model - t) / t``, so that small
    messages (latency) weigh as much as large ones (bandwidth); timings that follow the formula
    exactly give ``alpha`` and ``B`` back exactly. Mixing kinds fits the single link figure the
    model uses for all of them.
    """
    rows = []
    for kind, p, nbytes, t in samples:
        c, d = alpha_beta_terms(kind, p)
        if not (t > 0 and math.isfinite(t) and nbytes >= 0):
            raise AutoshardError("timings that are positive and finite, sizes >= 0",
                                 got=f"{kind} p={p} S={nbytes} t={t}",
                                 fix="drop the failed measurement")
        rows.append((c / t, d * nbytes / t))        # u·alpha + v·beta ≈ 1
    suu = sum(u * u for u, _ in rows)
    suv = sum(u * v for u, v in rows)
    svv = sum(v * v for _, v in rows)
    su, sv = sum(u for u, _ in rows), sum(v for _, v in rows)
    det = suu * svv - suv * suv
    if len(rows) < 2 or det <= 1e-12 * max(suu * svv, 1e-300):
        sizes = sorted({s for _, _, s, _ in samples})
        raise AutoshardError("timings at two or more distinct message sizes to fit alpha and B",
                             got=f"{len(rows)} sample(s)" + (f", sizes {sizes}" if rows else ""),
                             fix="measure each collective at several sizes")
    alpha, beta = (svv * su - suv * sv) / det, (suu * sv - suv * su) / det
    clamped = ""
    if alpha < MIN_ALPHA:        # no visible latency: refit the bandwidth alone
        alpha, beta, clamped = MIN_ALPHA, (sv - MIN_ALPHA * suv) / svv, "alpha"
    if beta < 1.0 / MAX_BANDWIDTH:   # no visible bandwidth term: refit the latency alone
        beta, clamped = 1.0 / MAX_BANDWIDTH, "bandwidth"
        alpha = max(MIN_ALPHA, (su - beta * suv) / suu)
    err = max(abs(u * alpha + v * beta - 1.0) for u, v in rows)
    return AlphaBeta(alpha, 1.0 / beta, err, len(rows), clamped)


def predicted_time(kind: str, p: int, nbytes: float, fit: AlphaBeta) -> float:
    """The cost model's time for one collective on a fitted link (cost/comm.py)."""
    return collective_time(kind, p, nbytes, fit.alpha, fit.bandwidth)


# ---------------------------------------------------------------------------- what is measured

@dataclass(frozen=True)
class Sizes:
    """The workloads of one calibration: per device kind, full or ``quick`` (tests)."""

    window_s: float                            # time filled by one timing of a kernel
    repeats: int                               # timings per kernel (median taken)
    matmul: tuple[tuple[int, int, int], ...]   # (m, k, n): x (m, k), W (n, k)
    copy_bytes: int                            # each tensor of the copy / add
    elementwise_shape: tuple[int, ...]         # an activation (batch, seq, hidden)
    attention: tuple[int, int, int, int]       # (batch, heads, seq, head_dim)
    tiny_chain: int                            # tiny ops per autograd chain
    message_bytes: tuple[int, ...]             # S of each collective, §1.1
    comm_calls: int                            # timed calls per (collective, size)
    burst: tuple[int, int, int]                # (m, k, n) of the matmul run before each call
    # The compute before each timed collective: the burst repeated to last at least this long.
    # A step's blocking collectives come tens of ms apart on a CPU host (the predict_vs_measure
    # GPT: 21 in a step of about 900 ms), and there a gloo call takes up to 2.9x longer after 30 ms of compute
    # than after 3 (benchmarks/RESULTS.md "Collectives against the compute before them").
    comm_gap_s: float = 0.0
    overlap_bytes: int = 2**22                 # the all-reduce the overlap figure hides
    overlap_calls: int = 7                     # timed rounds of it (median taken)
    # Optimizer offload's host step over this much fp32 state (master and moments), beyond the
    # last-level cache, and the pinned copies each way of ``copy_bytes`` (docs/cost-model.md
    # §2.10).
    host_state_bytes: int = 2**30


SIZES = {
    ("cpu", False): Sizes(
        window_s=0.1, repeats=3,
        matmul=((256, 512, 512), (256, 512, 2048), (512, 512, 512), (512, 2048, 512),
                (1024, 1024, 1024), (2048, 1024, 1024)),
        copy_bytes=256 * 2**20, elementwise_shape=(4, 128, 512),
        attention=(4, 8, 128, 64), tiny_chain=200,
        message_bytes=tuple(2**k for k in (12, 14, 16, 18, 20, 22, 23, 24)),
        comm_calls=15, burst=(512, 512, 512), overlap_calls=31, comm_gap_s=0.03),
    ("cpu", True): Sizes(
        window_s=0.005, repeats=2, matmul=((64, 64, 128), (128, 64, 64)), copy_bytes=2**20,
        elementwise_shape=(2, 16, 32), attention=(2, 2, 16, 8), tiny_chain=20,
        message_bytes=(2**12, 2**15, 2**18), comm_calls=3, burst=(64, 64, 64),
        overlap_bytes=2**16, overlap_calls=2, host_state_bytes=3 * 2**20),
    ("cuda", False): Sizes(
        window_s=0.05, repeats=5,
        matmul=((4096, 4096, 4096), (8192, 4096, 4096), (8192, 4096, 14336),
                (8192, 14336, 4096), (2048, 8192, 8192)),
        copy_bytes=1 * 2**30, elementwise_shape=(8, 2048, 4096),
        attention=(8, 32, 2048, 128), tiny_chain=500,
        message_bytes=tuple(2**k for k in range(12, 31, 2)),
        comm_calls=9, burst=(4096, 4096, 4096), overlap_bytes=2**28),
    ("cuda", True): Sizes(
        window_s=0.005, repeats=2, matmul=((512, 512, 512), (1024, 512, 1024)),
        copy_bytes=16 * 2**20,
        elementwise_shape=(2, 128, 256), attention=(2, 4, 128, 64), tiny_chain=50,
        message_bytes=(2**12, 2**16, 2**20), comm_calls=3, burst=(512, 512, 512),
        overlap_bytes=2**20, overlap_calls=2, host_state_bytes=3 * 2**20),
}


@dataclass(frozen=True)
class CalibrateSpec:
    device: str = "cpu"
    world: int = 2
    quick: bool = False
    seed: int = 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def _timed(fn: Callable[[], Any], device: torch.device, sizes: Sizes) -> float:
    """Median over ``sizes.repeats`` of the mean seconds per call of back-to-back calls that fill
    about ``sizes.window_s``, after a warm-up call. Every repeat starts at a barrier, so that all
    ranks compute at once, as they do in a training step (on a CPU host they share cores and
    memory bandwidth: one rank alone runs faster than it will in training)."""
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    iters = max(1, min(10_000, math.ceil(sizes.window_s / max(time.perf_counter() - t0, 1e-9))))
    out = []
    for _ in range(sizes.repeats):
        _barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        out.append((time.perf_counter() - t0) / iters)
    return statistics.median(out)


def _once(fn: Callable[[], Any], device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


def _matmuls(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """A linear layer per shape as a training step runs it: the forward ``x·Wᵀ`` recorded by
    autograd, and the backward autograd runs for it (``torch.autograd.grad`` of the output:
    the input gradient ``dy·W`` and the weight gradient ``dyᵀ·x``, with the layouts, copies and
    engine work a step pays), timed as forward + backward less the forward."""
    import torch.nn.functional as F
    out = []
    for m, k, n in sizes.matmul:
        x = torch.randn(m, k, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(n, k, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(m, n, device=device, dtype=dtype)
        flops = 2.0 * m * k * n
        forward = _timed(lambda: F.linear(x, w), device, sizes)
        both = _timed(lambda: torch.autograd.grad(F.linear(x, w), (x, w), dy), device, sizes)
        out.append({"shape": [m, k, n], "flops": flops, "forward_s": forward,
                    # noise can leave a tiny difference: at most twice the forward's rate
                    "backward_s": max(both - forward, forward)})
    return out


def _bandwidth(sizes: Sizes, device: torch.device) -> dict:
    n = sizes.copy_bytes // 4
    a = torch.randn(n, device=device)
    b = torch.randn(n, device=device)
    c = torch.empty(n, device=device)
    copy_s = _timed(lambda: c.copy_(a), device, sizes)
    add_s = _timed(lambda: torch.add(a, b, out=c), device, sizes)
    del a, b, c
    return {"bytes_per_tensor": n * 4, "copy_s": copy_s, "copy_bytes_per_s": 2 * n * 4 / copy_s,
            "add_s": add_s, "add_bytes_per_s": 3 * n * 4 / add_s}


def _host_side(sizes: Sizes, device: torch.device) -> dict:
    """Optimizer offload's host figures (docs/cost-model.md §2.10), every rank at once as they
    share the host in training: codegen/hostopt.py's AdamW step over ``host_state_bytes`` of
    fp32 state, its gradient landed as training lands it (from the GPU in bf16, pinned; on a
    CPU run a host copy of the fp32 gradient); in the model's terms, 28 bytes an element per
    second, the gradient's copy down the link taken out (it is priced at ``host_bandwidth``).
    On a GPU, pinned copies of ``copy_bytes`` each way."""
    from autoshard.codegen.hostopt import HostOptimizer
    n = sizes.host_state_bytes // 12
    master = torch.nn.Parameter(torch.randn(n))
    grad = torch.randn(n, device=device,
                       dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
    host = HostOptimizer(torch.optim.AdamW([master], lr=1e-3), "adam", [0], [master],
                         [torch.float32], overlap="none", bucket_bytes=25 * 2**20,
                         device=device)

    def step() -> None:
        host.land(0, grad)
        host.start([], _dropped)
        host.finish(_dropped)

    t = _timed(step, device, sizes)
    host.close()
    out: dict[str, Any] = {"state_bytes": 12 * n, "step_s": t}
    link_s = 0.0
    if device.type == "cuda":
        m = sizes.copy_bytes // 4
        pinned = torch.empty(m, pin_memory=True)
        dev = torch.empty(m, device=device)
        h2d = _timed(lambda: dev.copy_(pinned, non_blocking=True), device, sizes)
        d2h = _timed(lambda: pinned.copy_(dev, non_blocking=True), device, sizes)
        out.update(h2d_bytes_per_s=4 * m / h2d, d2h_bytes_per_s=4 * m / d2h)
        link_s = n * grad.element_size() / out["d2h_bytes_per_s"]
        del pinned, dev
    out["adam_bytes_per_s"] = 28 * n / max(t - link_s, 1e-12)
    return out


def _dropped(key: Any, new: torch.Tensor) -> None:
    """(a calibration step's updated parameters go nowhere)"""


def _elementwise(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Op-sized elementwise kernels: bytes read + written per second (§3.1's count)."""
    import torch.nn.functional as F
    x = torch.randn(*sizes.elementwise_shape, device=device, dtype=dtype)
    y = torch.randn_like(x)
    nb = x.numel() * x.element_size()
    h = sizes.elementwise_shape[-1]
    ops = {"add": (lambda: x + y, 3 * nb),
           "gelu_tanh": (lambda: F.gelu(x, approximate="tanh"), 2 * nb),
           "layer_norm": (lambda: F.layer_norm(x, (h,)), 2 * nb),
           "softmax": (lambda: torch.softmax(x, -1), 2 * nb)}
    out: dict[str, Any] = {"shape": list(x.shape), "dtype": str(dtype).removeprefix("torch.")}
    total_b = total_s = 0.0
    for name, (fn, moved) in ops.items():
        t = _timed(fn, device, sizes)
        out[name] = {"s": t, "bytes_per_s": moved / t}
        total_b, total_s = total_b + moved, total_s + t
    out["overall_bytes_per_s"] = total_b / total_s      # the four kernels back to back
    return out


def _special_kernels(x: torch.Tensor) -> dict[str, tuple[Callable[[], Any], int]]:
    """The special-function kernels of transformer training, forward and backward, each with
    its evaluations per element as the cost model counts them (autoshard/cost/compute.py
    ``SPECIALS``, docs/cost-model.md §3.7): the activations (GELU in both forms, SiLU) and the
    softmaxes (attention's, the loss's log-softmax), through the ATen kernels autograd runs."""
    import torch.nn.functional as F
    aten = torch.ops.aten
    g = torch.randn_like(x)
    y = torch.softmax(x, -1)
    ly = torch.log_softmax(x, -1)
    return {
        "gelu_tanh": (lambda: F.gelu(x, approximate="tanh"), 1),
        "gelu_tanh_backward": (lambda: aten.gelu_backward(g, x, approximate="tanh"), 1),
        "gelu_erf": (lambda: F.gelu(x), 1),
        "gelu_erf_backward": (lambda: aten.gelu_backward(g, x), 2),
        "silu": (lambda: F.silu(x), 1),
        "silu_backward": (lambda: aten.silu_backward(g, x), 1),
        "softmax": (lambda: torch.softmax(x, -1), 1),
        "log_softmax": (lambda: torch.log_softmax(x, -1), 1),
        "log_softmax_backward": (lambda: aten._log_softmax_backward_data(g, ly, -1, x.dtype), 1),
        "exp": (lambda: torch.exp(y), 1),
        "tanh": (lambda: torch.tanh(x), 1),
    }


def _specials(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Special-function evaluations per second (§3.7): every kernel of ``_special_kernels`` on
    an op-sized activation, evaluations over time, per kernel and over all of them (total
    evaluations over total time, the rate the model prices them at)."""
    x = torch.randn(*sizes.elementwise_shape, device=device, dtype=dtype)
    out: dict[str, Any] = {"shape": list(x.shape), "dtype": str(dtype).removeprefix("torch.")}
    evals = secs = 0.0
    for name, (fn, per) in _special_kernels(x).items():
        t = _timed(fn, device, sizes)
        n = per * x.numel()
        out[name] = {"s": t, "per_element": per, "evals_per_s": n / t}
        evals, secs = evals + n, secs + t
    out["overall_evals_per_s"] = evals / secs
    return out


def _attention(sizes: Sizes, device: torch.device, dtype: torch.dtype) -> dict:
    """Causal SDPA forward and forward + backward. FLOPs as the model counts them (§3.4:
    ``4·batch·heads·L²·d``, halved for the causal mask; backward 2.5× forward, §3.5)."""
    import torch.nn.functional as F
    b, h, s, d = sizes.attention
    q, k, v = (torch.randn(b, h, s, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    flops = 4.0 * b * h * s * s * d / 2

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    with torch.no_grad():
        tf = _timed(fwd, device, sizes)
    tfb = _timed(fwd_bwd, device, sizes)
    return {"shape": [b, h, s, d], "dtype": str(dtype).removeprefix("torch."), "flops": flops,
            "forward_s": tf, "forward_backward_s": tfb,
            "forward_flops_per_s": flops / tf,
            # the model's training FLOPs (1 + 2.5) x forward, over the measured time
            "training_flops_per_s": 3.5 * flops / tfb}


def _kernel_floor(sizes: Sizes, device: torch.device) -> dict:
    """A tiny op alone, and a chain of tiny ops forward + backward (per kernel)."""
    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    n = sizes.tiny_chain
    bare = _timed(lambda: torch.add(a, b), device, sizes)
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(n):
            y = y * 1.0001
        y.backward()

    per_kernel = _timed(chain, device, sizes) / (2 * n)
    program = _program_chain(n)

    def program_step():
        program(x, b).backward()

    per_op = _timed(program_step, device, sizes) / (2 * n)
    return {"bare_op_s": bare, "autograd_per_kernel_s": per_kernel,
            "program_per_op_s": per_op, "chain": n}


def _program_chain(n: int) -> "torch.fx.GraphModule":
    """``n`` ATen multiplications as an FX GraphModule, as the eager rank program runs its ops
    (codegen/rewrite.py: generated Python calling ATen overloads): its time per op forward and
    backward on tiny tensors is the host's dispatch of one op (``host_dispatch_s``), where the
    device is faster than the host (a GPU; on a CPU the host is the device)."""
    import torch.fx as fx
    g = fx.Graph()
    y, c = g.placeholder("x"), g.placeholder("c")
    for _ in range(n):
        y = g.call_function(torch.ops.aten.mul.Tensor, (y, c))
    g.output(g.call_function(torch.ops.aten.sum.default, (y,)))
    return fx.GraphModule(torch.nn.Module(), g)


def _setup_device(spec: CalibrateSpec) -> torch.device:
    if spec.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _comm(sizes: Sizes, device: torch.device) -> dict:
    """Per collective kind and size: this rank's entry and exit of each timed call, on the
    host's wall clock, and its seconds in it.

    Each call comes after a burst of compute (a matmul), as a collective does in a training
    step: timed back to back, collectives run with the communication threads awake and their
    buffers hot, and take a fraction of what they take between ops (on a CPU host, 2-4x less for
    gloo). The ranks do not arrive together after the burst; the parent times each call from the
    last rank's entry to the last rank's exit (``comm_samples``)."""
    import torch.distributed as dist
    from autoshard.codegen import collectives as C
    p, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    m, k, n = sizes.burst
    a = torch.randn(m, k, device=device)
    b = torch.randn(k, n, device=device)
    bursts = 1
    if sizes.comm_gap_s > 0:
        one = min(_once(lambda: a @ b, device) for _ in range(3))
        bursts = max(1, math.ceil(sizes.comm_gap_s / max(one, 1e-9)))
    out: dict[str, list] = {}
    for kind in COLLECTIVE_KINDS:
        rows = []
        for size in sizes.message_bytes:
            nbytes = max(4 * p, size // (4 * p) * 4 * p)      # S divisible into p float chunks
            numel = nbytes // 4
            if kind == "all_gather":
                x = torch.randn(numel // p, device=device)   # S is the gathered output
                fn = lambda x=x: C.all_gather(x, 0, group)  # noqa: E731
            elif kind == "all_reduce":
                x = torch.randn(numel, device=device)
                fn = lambda x=x: C.all_reduce(x, group)  # noqa: E731
            elif kind == "reduce_scatter":
                x = torch.randn(numel, device=device)        # S is the input
                fn = lambda x=x: C.reduce_scatter(x, 0, group)  # noqa: E731
            elif kind == "all_to_all":
                x = torch.randn(numel, device=device)        # S is each device's input
                fn = lambda x=x: C.all_to_all(x, 0, 0, group)  # noqa: E731
            else:
                x = torch.randn(numel, device=device)
                fn = _ping_pong(x, rank)
            fn()
            dist.barrier()
            times, enter, leave = [], [], []
            for _ in range(sizes.comm_calls):
                for _ in range(bursts):
                    a @ b
                _sync(device)
                w0, t0 = time.time(), time.perf_counter()
                fn()
                _sync(device)
                times.append(time.perf_counter() - t0)
                enter.append(w0)
                leave.append(w0 + times[-1])
            rows.append({"bytes": nbytes, "times_s": times, "enter_s": enter, "exit_s": leave})
        out[kind] = rows
    return out


def _overlap(sizes: Sizes, device: torch.device) -> dict:
    """How much of a gradient bucket's all-reduce hides behind backward, issued as DDP and the
    runtime issue it (docs/cost-model.md §7): from a gradient hook, asynchronously, once
    backward has begun, and waited for when it ends. Per round: the all-reduce alone
    (``comm``), a chain of matmuls and tanh (``burst`` sizes, about as long as the all-reduce)
    forward alone (``forward``) and forward + backward alone (``compute``), then forward +
    backward with the all-reduce issued from the last layer's gradient hook (``both``). The
    hidden share is ``(comm + compute - both) / min(comm, compute - forward)``: 1 where they run
    side by side (a GPU's NCCL stream), 0 or below (clipped) where they take turns or get in
    each other's way (a CPU host whose cores gloo's threads and the autograd engine share)."""
    import torch.distributed as dist
    x = torch.randn(sizes.overlap_bytes // 4, device=device)
    m, k, _ = sizes.burst
    inp = torch.randn(m, k, device=device)

    def comm() -> None:
        dist.all_reduce(x, async_op=True).wait()

    def chain(depth: int) -> list[torch.Tensor]:
        return [(torch.randn(k, k, device=device) / k ** 0.5).requires_grad_()
                for _ in range(depth)]

    def forward(ws: list[torch.Tensor]) -> torch.Tensor:
        h = inp
        for w in ws:
            h = torch.tanh(h @ w)
        return h.sum()

    def step(ws: list[torch.Tensor], bucket: bool = False) -> None:
        loss, work = forward(ws), []
        # the last layer's gradient is backward's first: the bucket goes then
        hook = ws[-1].register_hook(lambda g: work.append(dist.all_reduce(x, async_op=True))) \
            if bucket else None
        loss.backward()
        for w in work:
            w.wait()
        if hook is not None:
            hook.remove()
        for w in ws:
            w.grad = None

    def timed(fn: Callable[[], Any]) -> float:
        dist.barrier()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    comm()
    one = min(timed(lambda: step(chain(1))) for _ in range(3))
    depth = max(1, round(timed(comm) / max(one, 1e-9)))
    ws = chain(depth)
    rounds = []
    for _ in range(sizes.overlap_calls):
        with torch.no_grad():
            t_forward = timed(lambda: forward(ws))
        rounds.append({"comm_s": timed(comm), "forward_s": t_forward,
                       "compute_s": timed(lambda: step(ws)),
                       "both_s": timed(lambda: step(ws, bucket=True))})
    return {"bytes": sizes.overlap_bytes, "layers": depth, "rounds": rounds}


MIN_OVERLAP = 0.01      # Cluster.comm_overlap is positive: "hides nothing" is its floor


def cores_full(spec: CalibrateSpec, reports: list[dict]) -> bool:
    """Whether the ranks' compute threads fill every core of their one CPU host: then gloo's
    threads have no core of their own, a collective beside backward takes its time from the
    compute, and nothing hides (``comm_overlap`` is its floor, whatever the probe reads: its
    reading varies from run to run there, while predict_vs_measure's data-parallel step pays
    its whole bucketed sync, benchmarks/RESULTS.md "Predicted vs measured step time")."""
    if spec.device != "cpu" or len({r.get("host") for r in reports}) != 1:
        return False
    cpus = reports[0].get("cpus")
    return cpus is not None and sum(r.get("threads", 1) for r in reports) >= cpus


def overlap_share(reports: list[dict]) -> float:
    """``Cluster.comm_overlap`` from every rank's :func:`_overlap` rounds: per round the
    slowest rank's times (a step waits for it); per quantity the median over rounds; the hidden
    share of those medians, clipped to [0.01, 1] (the field is positive). On a CPU host the share
    of one round is a difference of four timings of a few ms, each as noisy as the difference,
    so a median of per-round shares swings with a few rounds; the medians of the timings over
    many rounds (31 on CPU, about 1 s) are steadier."""
    rounds = reports[0]["overlap"]["rounds"]
    slowest = [{k: max(r["overlap"]["rounds"][i].get(k, 0.0) for r in reports)
                for k in ("comm_s", "forward_s", "compute_s", "both_s")}
               for i in range(len(rounds))]
    comm, forward, compute, both = (_median([row[k] for row in slowest])
                                    for k in ("comm_s", "forward_s", "compute_s", "both_s"))
    window = min(comm, compute - forward)
    return (min(1.0, max(MIN_OVERLAP, (comm + compute - both) / window)) if window > 0
            else MIN_OVERLAP)


def _ping_pong(x: torch.Tensor, rank: int) -> Callable[[], None]:
    """send/recv between ranks 0 and 1: one call is a round trip, timed as two messages
    (the parent halves it); other ranks wait."""
    import torch.distributed as dist
    buf = torch.empty_like(x)

    def fn() -> None:
        if rank == 0:
            dist.send(x, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(x, 0)
    return fn


def measure_rank(spec: CalibrateSpec) -> dict:
    """Everything one rank measures; runs on every rank of an initialised world at once, so
    the ranks share the host (cores, memory bandwidth) as they do in training."""
    import torch.distributed as dist
    torch.manual_seed(spec.seed + dist.get_rank())
    device = _setup_device(spec)
    sizes = SIZES[(spec.device, spec.quick)]
    t0, c0 = time.perf_counter(), time.process_time()
    dist.barrier()
    out: dict[str, Any] = {"matmul": {"float32": _matmuls(sizes, device, torch.float32)}}
    if spec.device == "cuda":
        out["matmul"]["bfloat16"] = _matmuls(sizes, device, torch.bfloat16)
    low = torch.bfloat16 if spec.device == "cuda" else torch.float32
    out["bandwidth"] = _bandwidth(sizes, device)
    out["elementwise"] = _elementwise(sizes, device, low)
    out["specials"] = _specials(sizes, device, low)
    out["attention"] = _attention(sizes, device, low)
    out["kernel_floor"] = _kernel_floor(sizes, device)
    out["host_side"] = _host_side(sizes, device)
    out["compute_wall_s"] = time.perf_counter() - t0
    dist.barrier()
    t1 = time.perf_counter()
    out["comm"] = _comm(sizes, device) if dist.get_world_size() > 1 else {}
    if dist.get_world_size() > 1:
        out["overlap"] = _overlap(sizes, device)
    out["comm_wall_s"] = time.perf_counter() - t1
    out["threads"] = torch.get_num_threads()
    out["cpus"] = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count()
    out["host"] = socket.gethostname()       # ranks on one host compare wall-clock entries
    out["cpu_s"] = time.process_time() - c0
    if device.type == "cuda":
        out["device_name"] = torch.cuda.get_device_name(device)
        out["device_memory_bytes"] = torch.cuda.get_device_properties(device).total_memory
    return out


# ------------------------------------------------------------------- from measurements to fields

def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def matmul_figures(rows_per_rank: list[list[dict]]) -> dict:
    """Peak (fastest rate of any shape and pass, median over ranks) and the overall rate (total
    FLOPs over total time, median over ranks). A backward is two matmuls of the forward's FLOPs
    (docs/cost-model.md §3.5)."""
    peaks, overall = [], []
    for rows in rows_per_rank:
        rates, flops, secs = [], 0.0, 0.0
        for r in rows:
            for name, mult in (("forward_s", 1.0), ("backward_s", 2.0)):
                rates.append(mult * r["flops"] / r[name])
                flops += mult * r["flops"]
                secs += r[name]
        peaks.append(max(rates))
        overall.append(flops / secs)
    return {"peak_flops_per_s": _median(peaks), "overall_flops_per_s": _median(overall)}


def _call_seconds(reports: list[dict], kind: str, i: int, j: int) -> float:
    """Call ``j`` of size ``i`` of ``kind``: from the last rank's entry to the last rank's exit,
    what a step waits for once every rank has reached the call. A rank's own time is no
    measure: the first to arrive also waits for the others, and the last finds their parts
    already sent (gloo writes them into its sockets at once), so the shortest time over ranks
    reads under the call. Ranks on several hosts (or of no recorded host) share no clock to
    compare entries: there, and for a send/recv round trip (which the rank that starts it times
    whole), the shortest time over ranks."""
    rows = [r["comm"][kind][i] for r in reports]
    hosts = {r.get("host") for r in reports}
    if kind == "send_recv" or len(hosts) != 1 or None in hosts:
        return min(row["times_s"][j] for row in rows)
    return max(row["exit_s"][j] for row in rows) - max(row["enter_s"][j] for row in rows)


def comm_samples(reports: list[dict], p: int) -> dict[str, list[tuple[str, int, float, float]]]:
    """Per kind, ``(kind, p, S, seconds)``: per call the time a step waits for it once every
    rank has reached it (``_call_seconds``), median over calls. A send/recv round trip is two
    messages."""
    out: dict[str, list] = {}
    for kind in COLLECTIVE_KINDS:
        rows = []
        for i, row in enumerate(reports[0]["comm"][kind]):
            per_call = [_call_seconds(reports, kind, i, j) for j in range(len(row["times_s"]))]
            t = _median(per_call) / (2 if kind == "send_recv" else 1)
            rows.append((kind, p, float(row["bytes"]), t))
        out[kind] = rows
    return out


def base_preset(spec: CalibrateSpec, reports: list[dict]) -> str:
    if spec.device == "cpu":
        return "cpu"
    name = reports[0].get("device_name", "").upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return key.lower()
    return "h100"


def profile(spec: CalibrateSpec, reports: list[dict], *, wall_s: float = 0.0,
            other_load: float | None = None) -> dict:
    """The cluster profile JSON (a dict) from every rank's measurements."""
    p = len(reports)
    base = base_preset(spec, reports)
    fp32 = matmul_figures([r["matmul"]["float32"] for r in reports])
    fields: dict[str, Any] = {"base": base, "name": f"calibrated-{spec.device}"}
    if spec.device == "cuda":
        bf16 = matmul_figures([r["matmul"]["bfloat16"] for r in reports])
        eff = bf16["overall_flops_per_s"] / bf16["peak_flops_per_s"]
        fields["flops"] = bf16["peak_flops_per_s"]
    else:
        # No 16-bit matmul is measured on a CPU: 16-bit ops are priced at the fp32 figures.
        eff = fp32["overall_flops_per_s"] / fp32["peak_flops_per_s"]
        fields["flops"] = fp32["peak_flops_per_s"]
    # peak · efficiency is the measured overall rate for either precision (§3.1).
    fields["fp32_flops"] = fp32["overall_flops_per_s"] / eff
    fields["matmul_efficiency"] = eff
    bw = [max(r["bandwidth"]["copy_bytes_per_s"], r["bandwidth"]["add_bytes_per_s"])
          for r in reports]
    fields["mem_bandwidth"] = _median(bw)
    fields["kernel_floor_s"] = _median([r["kernel_floor"]["autograd_per_kernel_s"]
                                        for r in reports])
    if spec.device == "cuda":
        # The host's dispatch of one op of the eager rank program (docs/cost-model.md §2.11).
        # On a CPU the host is the device: the kernel floor above already holds it.
        fields["host_dispatch_s"] = _median([r["kernel_floor"]["program_per_op_s"]
                                             for r in reports])
    if spec.device == "cpu" and all("specials" in r for r in reports):
        # On a GPU these kernels are bandwidth-bound (§3.7): their rate says nothing of the
        # special-function units, and the preset's figure stays.
        fields["transcendental_rate"] = _median([r["specials"]["overall_evals_per_s"]
                                                 for r in reports])
    if all("host_side" in r for r in reports):        # the host figures of offload (§2.10)
        fields["host_mem_bandwidth"] = _median([r["host_side"]["adam_bytes_per_s"]
                                                for r in reports])
        if spec.device == "cuda":
            fields["host_bandwidth"] = _median([min(r["host_side"]["h2d_bytes_per_s"],
                                                    r["host_side"]["d2h_bytes_per_s"])
                                                for r in reports])
    if spec.device == "cuda":
        fields["memory_bytes"] = float(reports[0]["device_memory_bytes"])
        if p >= 2:     # one rank measures no link: the preset's node and links stand
            fields["devices_per_node"] = max(p, torch.cuda.device_count()
                                             if torch.cuda.is_available() else p)
    measured: dict[str, Any] = {
        "tool": "autoshard calibrate", "date": datetime.datetime.now(datetime.timezone.utc)
        .strftime("%Y-%m-%d %H:%M UTC"), "device": spec.device, "world": p,
        "quick": spec.quick, "backend": "nccl" if spec.device == "cuda" else "gloo",
        "host": f"{platform.system()} {platform.machine()}, {os.cpu_count()} logical CPUs, "
                f"torch {torch.__version__}",
        "threads_per_rank": reports[0]["threads"], "wall_s": wall_s,
        # share of the host's CPU time other processes used while the ranks measured
        "other_load": other_load,
        "matmul_float32": fp32,
        "bandwidth": reports[0]["bandwidth"]
        | {"median_over_ranks_bytes_per_s": fields["mem_bandwidth"]},
        "elementwise": reports[0]["elementwise"], "specials": reports[0].get("specials", {}),
        "attention": reports[0]["attention"],
        "kernel_floor": reports[0]["kernel_floor"],
        "host_side": reports[0].get("host_side", {}),
        "matmul_shapes": reports[0]["matmul"],
    }
    if spec.device == "cuda":
        measured["matmul_bfloat16"] = bf16
        measured["device_name"] = reports[0]["device_name"]
    # The model prices attention at the matmul rate (§3.2): how far off that is here.
    matmul_rate = (bf16 if spec.device == "cuda" else fp32)["overall_flops_per_s"]
    measured["attention"]["training_rate_over_matmul_rate"] = (
        measured["attention"]["training_flops_per_s"] / matmul_rate)
    if p >= 2:
        samples = comm_samples(reports, p)
        link = fit_alpha_beta([s for k in PLAN_KINDS for s in samples[k]])
        per_kind = {k: asdict(fit_alpha_beta(rows)) for k, rows in samples.items()}
        fields.update(intra_alpha=link.alpha, intra_bandwidth=link.bandwidth,
                      inter_alpha=link.alpha, inter_bandwidth=link.bandwidth,
                      # Each kind on its own fit: gloo's do not share one alpha-beta.
                      collective_kinds={k: {"alpha": f["alpha"], "bandwidth": f["bandwidth"]}
                                        for k, f in per_kind.items()})
        if all("overlap" in r for r in reports):
            probe, full = overlap_share(reports), cores_full(spec, reports)
            fields["comm_overlap"] = MIN_OVERLAP if full else probe
            measured["overlap"] = reports[0]["overlap"] | {
                "comm_overlap": fields["comm_overlap"], "probe_share": probe, "cores_full": full}
        measured["collectives"] = {
            "link_fit": asdict(link), "link_fit_kinds": list(PLAN_KINDS),
            "per_kind_fit": per_kind,
            "samples": {k: [{"bytes": s, "seconds": t,
                             "model_seconds": predicted_time(k, p, s, AlphaBeta(
                                 **per_kind[k]))}
                            for _, _, s, t in rows] for k, rows in samples.items()},
            "compute_before_each_call_s": SIZES[(spec.device, spec.quick)].comm_gap_s,
            "note": "one host: inter_alpha and inter_bandwidth are set to the intra figures; "
                    "each kind is priced on its own fit (collective_kinds)"}
    else:
        measured["collectives"] = {"note": "one rank: no collective measured; the link figures "
                                           f"are the {base!r} preset's"}
    fields["measured"] = measured
    Cluster._from_profile(dict(fields))        # every figure valid before anything is written
    return fields


# ------------------------------------------------------------------------------------- driving

def _check(spec: CalibrateSpec) -> None:
    if spec.device not in DEVICES:
        raise AutoshardError(f"--device among {DEVICES}", got=repr(spec.device),
                             fix="pass --device cpu or --device cuda")
    if isinstance(spec.world, bool) or not isinstance(spec.world, int) or spec.world < 1:
        raise AutoshardError("--world is a positive number of ranks", got=repr(spec.world),
                             fix="e.g. --world 2")
    if spec.device == "cuda":
        if not torch.cuda.is_available():
            raise AutoshardError("a CUDA device for --device cuda", got="torch.cuda.is_available() "
                                 "is False", fix="run on a GPU machine, or pass --device cpu")
        if spec.world > torch.cuda.device_count():
            raise AutoshardError(f"--world at most the {torch.cuda.device_count()} visible GPUs",
                                 got=f"--world {spec.world}",
                                 fix=f"pass --world {torch.cuda.device_count()} or fewer")


def host_cpu_seconds() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of this host since boot, all cores (Linux /proc/stat); None
    elsewhere."""
    try:
        with open("/proc/stat") as f:
            vals = [int(v) for v in f.readline().split()[1:]]
        tick = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals) - idle) / tick, sum(vals) / tick


def other_load(before: tuple[float, float] | None, after: tuple[float, float] | None,
               own_cpu_s: float) -> float | None:
    """The share of the host's CPU time that processes other than ours used between two
    :func:`host_cpu_seconds` samples: measurements taken while it is large are slowed by them."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return max(0.0, (after[0] - before[0] - own_cpu_s) / (after[1] - before[1]))


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def writes_profile() -> bool:
    """Whether this process writes the profile: always, except on torchrun's ranks but 0."""
    return not under_torchrun() or os.environ.get("RANK") == "0"


def calibrate(device: str = "cpu", world: int | None = None, *, quick: bool = False) -> dict:
    """Measure this machine; return the profile (``{"base": ..., fields..., "measured": ...}``).

    Spawns ``world`` local ranks (default 2), or, under torchrun, measures on the launched ranks
    (every rank returns the same profile)."""
    if under_torchrun():
        size = int(os.environ["WORLD_SIZE"])
        if world is not None and world != size:
            raise AutoshardError("--world equal to torchrun's WORLD_SIZE", got=f"--world {world}, "
                                 f"WORLD_SIZE {size}", fix="drop --world under torchrun")
        spec = CalibrateSpec(device, size, quick)
        _check(spec)
        return _calibrate_torchrun(spec)
    spec = CalibrateSpec(device, 2 if world is None else world, quick)
    _check(spec)
    from autoshard.codegen.world import World
    t0 = time.perf_counter()
    backend = "nccl" if device == "cuda" else "gloo"
    with World(spec.world, backend=backend, timeout_s=900) as w:
        w.start()
        before, c0 = host_cpu_seconds(), time.process_time()
        reports = w.run(measure_rank, spec)
        own = time.process_time() - c0 + sum(r["cpu_s"] for r in reports)
        other = other_load(before, host_cpu_seconds(), own)
    return profile(spec, reports, wall_s=time.perf_counter() - t0, other_load=other)


def _calibrate_torchrun(spec: CalibrateSpec) -> dict:
    import torch.distributed as dist
    t0 = time.perf_counter()
    own = not dist.is_initialized()
    if own:
        if spec.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if spec.device == "cuda" else "gloo")
    try:
        mine = measure_rank(spec)
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, mine)
    finally:
        if own:
            dist.destroy_process_group()
    return profile(spec, reports, wall_s=time.perf_counter() - t0)


def write_profile(prof: dict, path: str | Path) -> None:
    import json

    from autoshard.files import write_output
    write_output(path, json.dumps(prof, indent=1) + "\n", what="cluster profile")


def summary(prof: dict) -> str:
    """The profile's figures in a few lines, as the command prints them."""
    m = prof["measured"]
    bf16 = f"; bf16 peak {prof['flops'] / 1e12:.1f} TFLOP/s" if m["device"] == "cuda" else ""
    lines = [f"calibrated {m['device']} x{m['world']} ({m['backend']}, {m['threads_per_rank']} "
             f"thread(s) per rank) in {m['wall_s']:.1f} s; base preset {prof['base']!r}",
             f"  matmul: peak {prof['fp32_flops'] / 1e9:.1f} GFLOP/s fp32, efficiency "
             f"{prof['matmul_efficiency']:.3f} (overall "
             f"{m['matmul_float32']['overall_flops_per_s'] / 1e9:.1f} GFLOP/s){bf16}",
             f"  memory bandwidth {prof['mem_bandwidth'] / 1e9:.2f} GB/s; kernel floor "
             f"{prof['kernel_floor_s'] * 1e6:.2f} us"
             + (f"; host dispatch {prof['host_dispatch_s'] * 1e6:.2f} us per op"
                if prof.get("host_dispatch_s") else "") + "; attention (training) "
             f"{m['attention']['training_flops_per_s'] / 1e9:.1f} GFLOP/s"
             + (f"; special functions {prof['transcendental_rate'] / 1e9:.2f} G/s"
                if "transcendental_rate" in prof else "")]
    if m.get("other_load") is not None and m["other_load"] > 0.1:
        lines.append(f"  warning: other processes used {m['other_load']:.0%} of this host's CPU "
                     "time while measuring; the figures are slowed by them (measure again when "
                     "the host is quiet)")
    c = m["collectives"]
    if "link_fit" in c:
        f = c["link_fit"]
        lines.append(f"  link ({', '.join(PLAN_KINDS)}): alpha {f['alpha'] * 1e6:.1f} us, "
                     f"bandwidth {f['bandwidth'] / 1e9:.3f} GB/s, max rel err "
                     f"{f['max_rel_err']:.0%}")
        for k, f in c["per_kind_fit"].items():
            lines.append(f"    {k:15s} alpha {f['alpha'] * 1e6:8.1f} us, bandwidth "
                         f"{f['bandwidth'] / 1e9:7.3f} GB/s, max rel err {f['max_rel_err']:.0%}")
    else:
        lines.append(f"  {c['note']}")
    if "overlap" in m:
        lines.append(f"  overlap: {prof['comm_overlap']:.2f} of backward compute can hide a "
                     f"gradient sync (an all-reduce issued from a gradient hook during backward)"
                     + (f"; the ranks' threads fill every core, so none (the probe read "
                        f"{m['overlap']['probe_share']:.2f})" if m["overlap"].get("cores_full")
                        else ""))
    return "\n".join(lines)


__all__ = ["AlphaBeta", "CalibrateSpec", "alpha_beta_terms", "calibrate", "fit_alpha_beta",
           "measure_rank", "profile", "summary", "write_profile", "writes_profile"]
