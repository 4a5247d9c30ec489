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
  compute as in a training step (see ``measure_collectives``). One ``alpha`` and one
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

import os
import time
from pathlib import Path
from typing import Any

import torch

from autoshard.errors import AutoshardError
from autoshard.tools.calibrate.fields import measure_rank, profile
from autoshard.tools.calibrate.fit import PLAN_KINDS
from autoshard.tools.calibrate.timing import CalibrateSpec, DEVICES, host_cpu_seconds, other_load


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

