"""What calibrate measures at which sizes (``SIZES``), and how one figure is timed: a kernel run
repeatedly in a window, after the device and the ranks are synchronised; the host's load by other
processes while it measures."""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch



DEVICES = ("cpu", "cuda")


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


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], Any], device: torch.device, sizes: Sizes) -> float:
    """Median over ``sizes.repeats`` of the mean seconds per call of back-to-back calls that fill
    about ``sizes.window_s``, after a warm-up call. Every repeat starts at a barrier, so that all
    ranks compute at once, as they do in a training step (on a CPU host they share cores and
    memory bandwidth: one rank alone runs faster than it will in training)."""
    fn()
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    iters = max(1, min(10_000, math.ceil(sizes.window_s / max(time.perf_counter() - t0, 1e-9))))
    out = []
    for _ in range(sizes.repeats):
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        sync_device(device)
        out.append((time.perf_counter() - t0) / iters)
    return statistics.median(out)


def timed_once(fn: Callable[[], Any], device: torch.device) -> float:
    sync_device(device)
    t0 = time.perf_counter()
    fn()
    sync_device(device)
    return time.perf_counter() - t0


def setup_device(spec: CalibrateSpec) -> torch.device:
    if spec.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


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

