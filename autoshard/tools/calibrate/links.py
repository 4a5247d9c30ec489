"""The link figures of one rank: collectives at several sizes after a burst of compute, as a
training step runs them, and how much of a collective hides behind compute (``comm_overlap``)."""
from __future__ import annotations

import math
import time
from typing import Any, Callable

import torch

from autoshard.cost.comm import COLLECTIVE_KINDS
from autoshard.ir import CollectiveKind
from autoshard.tools.calibrate.timing import CalibrateSpec, Sizes, median, sync_device, timed_once


def measure_collectives(sizes: Sizes, device: torch.device) -> dict:
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
        one = min(timed_once(lambda: a @ b, device) for _ in range(3))
        bursts = max(1, math.ceil(sizes.comm_gap_s / max(one, 1e-9)))
    out: dict[str, list] = {}
    for kind in COLLECTIVE_KINDS:
        rows = []
        for size in sizes.message_bytes:
            nbytes = max(4 * p, size // (4 * p) * 4 * p)      # S divisible into p float chunks
            numel = nbytes // 4
            if kind == CollectiveKind.ALL_GATHER:
                x = torch.randn(numel // p, device=device)   # S is the gathered output
                fn = lambda x=x: C.all_gather(x, 0, group)  # noqa: E731
            elif kind == CollectiveKind.ALL_REDUCE:
                x = torch.randn(numel, device=device)
                fn = lambda x=x: C.all_reduce(x, group)  # noqa: E731
            elif kind == CollectiveKind.REDUCE_SCATTER:
                x = torch.randn(numel, device=device)        # S is the input
                fn = lambda x=x: C.reduce_scatter(x, 0, group)  # noqa: E731
            elif kind == CollectiveKind.ALL_TO_ALL:
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
                sync_device(device)
                w0, t0 = time.time(), time.perf_counter()
                fn()
                sync_device(device)
                times.append(time.perf_counter() - t0)
                enter.append(w0)
                leave.append(w0 + times[-1])
            rows.append({"bytes": nbytes, "times_s": times, "enter_s": enter, "exit_s": leave})
        out[kind] = rows
    return out


def measure_overlap(sizes: Sizes, device: torch.device) -> dict:
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
        sync_device(device)
        t0 = time.perf_counter()
        fn()
        sync_device(device)
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
    """``Cluster.comm_overlap`` from every rank's :func:`measure_overlap` rounds: per round the
    slowest rank's times (a step waits for it); per quantity the median over rounds; the hidden
    share of those medians, clipped to [0.01, 1] (the field is positive). On a CPU host the share
    of one round is a difference of four timings of a few ms, each as noisy as the difference,
    so a median of per-round shares swings with a few rounds; the medians of the timings over
    many rounds (31 on CPU, about 1 s) are steadier."""
    rounds = reports[0]["overlap"]["rounds"]
    slowest = [{k: max(r["overlap"]["rounds"][i].get(k, 0.0) for r in reports)
                for k in ("comm_s", "forward_s", "compute_s", "both_s")}
               for i in range(len(rounds))]
    comm, forward, compute, both = (median([row[k] for row in slowest])
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

