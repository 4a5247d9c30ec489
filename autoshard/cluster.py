"""Hardware figures per device and per link, with presets and their sources in
docs/cost-model.md §2.

Every figure can be overridden from a JSON profile: ``Cluster.load("my_cluster.json")`` takes any
subset of the fields below on top of a ``"base"`` preset, and ignores a ``"measured"`` record (the
raw measurements ``autoshard calibrate`` writes beside its figures).
"""
from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.ir import CollectiveKind

MEASURED_KEY = "measured"    # a profile's raw measurements, not a figure (docs/cost-model.md §2.1)
# The collectives a plan's steps use (docs/cost-model.md §1.1; priced in cost/comm.py).
COLLECTIVE_KINDS = tuple(CollectiveKind)


@dataclass(frozen=True, slots=True)
class Cluster:
    name: str
    flops: float                 # peak dense 16-bit FLOP/s per device
    fp32_flops: float            # peak fp32 FLOP/s per device (non tensor-core)
    mem_bandwidth: float         # bytes/s of device memory
    memory_bytes: float          # device memory capacity
    devices_per_node: int
    intra_alpha: float           # s, latency of one collective step inside a node
    intra_bandwidth: float       # bytes/s, bus bandwidth inside a node (NCCL busbw)
    inter_alpha: float           # s, latency of one step across nodes
    inter_bandwidth: float       # bytes/s per device across nodes
    matmul_efficiency: float = 0.75   # achievable / peak on large matmuls (docs/cost-model.md §2.6)
    kernel_floor_s: float = 4e-6      # launch-bound floor per op (docs/cost-model.md §2.6)
    # Host seconds to dispatch one op of the eager rank program, forward or backward (Python,
    # the dispatcher, autograd; docs/cost-model.md §2.11, §3.10): the floor of every op of an
    # eager step, where the device is faster. 0: not known, the kernel floor alone.
    host_dispatch_s: float = 0.0
    # Special-function evaluations (exp, tanh, erf, ...) per second (docs/cost-model.md §2.1,
    # §3.7). H100/H200 SXM5: 3.9e12 (FlashAttention-3, arXiv 2407.08608: "989 TFLOPS of FP16
    # matmul but only 3.9 TFLOPS of special functions"); A100 SXM: 16 per clock per SM (CUDA C++
    # Programming Guide, arithmetic instruction throughput, cc 8.0) x 108 SMs x 1.41 GHz = 2.4e12.
    transcendental_rate: float = 3.9e12
    # The host side of one device (docs/cost-model.md §2.10), for CPU offload: the host link's
    # bandwidth each way, the host memory one device's process may use, and the host memory
    # bandwidth one device's share of the CPUs streams the optimizer step at.
    host_bandwidth: float = 55e9
    host_memory_bytes: float = 250e9
    host_mem_bandwidth: float = 76.75e9
    # The share of backward compute a gradient sync issued behind it can hide under (docs/
    # cost-model.md §7), in (0, 1]. GPUs: 1, NCCL runs on its own stream and DDP's bucketed
    # all-reduce overlaps backward (Li et al., "PyTorch Distributed", VLDB 2020, §3.2.3). A CPU
    # host shares its cores between gloo's threads and the compute: `autoshard calibrate`
    # measures it (an all-reduce issued asynchronously beside a matmul burst).
    comm_overlap: float = 1.0
    # Per collective kind, (kind, alpha, bandwidth) in place of the link figures above, on every
    # axis (docs/cost-model.md §2.9): where a backend's collectives do not share one alpha-beta
    # (gloo's reduce-scatter costs about what its all-reduce does). `autoshard calibrate` fits
    # them on one host, where the intra- and inter-node link is one; the presets have none.
    # A profile gives them as {"reduce_scatter": {"alpha": ..., "bandwidth": ...}, ...}.
    collective_kinds: tuple[tuple[str, float, float], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise AutoshardError("Cluster field 'name' must be a non-empty string",
                                 got=repr(self.name), fix="name the profile, e.g. \"my_h100\"")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            # bool is an int subclass and JSON's true would pass as 1. The upper bound refuses
            # inf, and an int too large for a float (the cost model divides by these); nan
            # fails every comparison.
            if f.name == "collective_kinds":
                self._check_kinds()
                continue
            if f.name == "host_dispatch_s" and v == 0 and not isinstance(v, bool):
                continue                                  # not known (see the field)
            if f.name != "name" and not (isinstance(v, (int, float)) and not isinstance(v, bool)
                                         and 0 < v <= sys.float_info.max):
                raise AutoshardError(f"Cluster field {f.name!r} must be a positive, finite number",
                                     got=repr(v), fix=f"set {f.name} to the device's figure")
        self._check_plausible()
        if not isinstance(self.devices_per_node, int):
            raise AutoshardError("Cluster field 'devices_per_node' must be an int",
                                 got=repr(self.devices_per_node), fix="e.g. 8 for a DGX H100 node")
        if self.matmul_efficiency > 1:
            raise AutoshardError("Cluster field 'matmul_efficiency' is a fraction of peak, (0, 1]",
                                 got=repr(self.matmul_efficiency),
                                 fix="e.g. 0.75 (docs/cost-model.md §2.6: ~70-80% on large matmuls)")
        if self.comm_overlap > 1:
            raise AutoshardError("Cluster field 'comm_overlap' is a fraction of backward compute, "
                                 "(0, 1]", got=repr(self.comm_overlap),
                                 fix="1 where collectives overlap compute fully (GPUs); "
                                     "`autoshard calibrate` measures it")

    def _check_plausible(self) -> None:
        """Figures no hardware has (a link of 1e-300 B/s) are refused here, naming the figure:
        priced, they make step times of 1e300 s that overflow the solver's precision, which
        then finds no plan and would blame its time limit."""
        figures = [(f, f, getattr(self, f)) for f in PLAUSIBLE if hasattr(self, f)] + [
            (f"collective_kinds.{k}.{what}", what, v) for k, a, b in self.collective_kinds
            for what, v in (("alpha", a), ("bandwidth", b))]
        for name, kind, v in figures:
            unit, lo, hi, example = PLAUSIBLE[kind]
            if not lo <= v <= hi:
                raise AutoshardError(f"Cluster field {name!r} within what hardware has, "
                                     f"{lo:g} to {hi:g} {unit}", got=repr(v),
                                     fix=f"give it in {unit}, e.g. {example}")

    def _check_kinds(self) -> None:
        kinds = self.collective_kinds
        ok = isinstance(kinds, tuple) and all(
            isinstance(e, tuple) and len(e) == 3 and e[0] in COLLECTIVE_KINDS
            and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                    and 0 < x <= sys.float_info.max for x in e[1:]) for e in kinds)
        if not ok or len({e[0] for e in kinds}) != len(kinds):
            raise AutoshardError("Cluster field 'collective_kinds' maps collective kinds among "
                                 f"{list(COLLECTIVE_KINDS)} to positive alpha and bandwidth",
                                 got=repr(kinds),
                                 fix='e.g. {"reduce_scatter": {"alpha": 4e-4, "bandwidth": 5e8}}')
        if kinds and (self.intra_alpha, self.intra_bandwidth) != (self.inter_alpha,
                                                                  self.inter_bandwidth):
            raise AutoshardError("per-kind collective figures on a cluster whose links inside "
                                 "and across nodes are one (a host `autoshard calibrate` "
                                 "measured)", got=f"collective_kinds with intra figures "
                                 f"{self.intra_alpha}, {self.intra_bandwidth} and inter figures "
                                 f"{self.inter_alpha}, {self.inter_bandwidth}",
                                 fix="drop collective_kinds, or give equal intra and inter "
                                     "figures")

    @classmethod
    def preset(cls, name: str) -> "Cluster":
        if not isinstance(name, str) or name not in PRESETS:
            raise AutoshardError(f"a cluster preset is one of {sorted(PRESETS)} or a JSON file",
                                 got=repr(name), fix="pass cluster='h100' or Cluster.load(path)")
        return PRESETS[name]

    @classmethod
    def load(cls, path: str | Path) -> "Cluster":
        try:
            data = json.loads(Path(path).read_text())
        # UnicodeDecodeError: a binary file; ValueError: bad JSON or an integer of over 4300
        # digits; RecursionError: deep nesting.
        except (OSError, ValueError, RecursionError) as e:
            raise AutoshardError("a cluster profile is a readable JSON object", got=f"{path}: {e}",
                                 fix="write e.g. {\"base\": \"h100\", \"inter_bandwidth\": 25e9}") from e
        if not isinstance(data, dict):
            raise AutoshardError("a cluster profile is a JSON object",
                                 got=f"{path}: {type(data).__name__}", fix="wrap the figures in {...}")
        try:
            return cls._from_profile(data)
        except AutoshardError as e:     # the same mistake, said of this file
            raise AutoshardError(e.expected, got=f"{path}: {e.got}", fix=e.fix) from e

    @classmethod
    def _from_profile(cls, data: dict) -> "Cluster":
        base = cls.preset(data.pop("base", "h100"))
        # The raw measurements `autoshard calibrate` keeps beside its figures: a record for
        # people, ignored here (docs/cost-model.md §2.1).
        data.pop(MEASURED_KEY, None)
        return dataclasses.replace(base, **cls._figures(data))

    @classmethod
    def from_json(cls, data: dict) -> "Cluster":
        """The figures :meth:`to_json` wrote (a plan records the cluster it was priced on, so
        that every tool prices it again on those, docs/plan-format.md). Every field without a
        default must be there; one added to Cluster since the file was written takes its
        default."""
        required = sorted(f.name for f in dataclasses.fields(cls)
                          if f.default is dataclasses.MISSING and f.name not in data)
        if required:
            raise AutoshardError("a cluster's figures as Cluster.to_json writes them",
                                 got=f"no {', '.join(required)}",
                                 fix="re-create the plan (it records its cluster's figures)")
        return cls(**cls._figures(dict(data)))

    @classmethod
    def _figures(cls, data: dict) -> dict:
        """``data``'s fields checked against Cluster's, ``collective_kinds`` as the tuple the
        field holds (a profile and a plan write it as {kind: {alpha, bandwidth}})."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutoshardError(f"cluster profile keys are among {sorted(known)}", got=str(unknown),
                                 fix="remove or rename the unknown keys")
        kinds = data.get("collective_kinds")
        if isinstance(kinds, dict):
            try:
                data["collective_kinds"] = tuple(sorted(
                    (CollectiveKind.of(k) or k, v["alpha"], v["bandwidth"])
                    for k, v in kinds.items()))
            except (TypeError, KeyError) as e:
                raise AutoshardError("collective_kinds entries of the form "
                                     '{"alpha": ..., "bandwidth": ...}', got=repr(kinds),
                                     fix='e.g. {"reduce_scatter": {"alpha": 4e-4, '
                                         '"bandwidth": 5e8}}') from e
        return data

    @classmethod
    def resolve(cls, value: "Cluster | str | Path") -> "Cluster":
        if isinstance(value, Cluster):
            return value
        if isinstance(value, Path) or str(value).endswith(".json"):
            return cls.load(value)
        return cls.preset(str(value))

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["collective_kinds"] = {k: {"alpha": a, "bandwidth": b}
                                   for k, a, b in self.collective_kinds}
        return out

    def describe(self) -> str:
        """The name, and for figures that are not the preset's of that name (a profile), the
        figures that differ: what a plan was priced on, in one line."""
        preset = PRESETS.get(self.name)
        if preset == self:
            return self.name
        if preset is None:
            return f"{self.name} (profile)"
        changed = [f"{f.name} {getattr(self, f.name):g}" for f in dataclasses.fields(self)
                   if f.name != "collective_kinds" and getattr(self, f.name) != getattr(preset, f.name)]
        if self.collective_kinds != preset.collective_kinds:
            changed.append("collective_kinds " + ",".join(k for k, _, _ in self.collective_kinds))
        return f"{self.name} (profile: {', '.join(changed)})"


# The range of each figure a cluster may have (unit, least, most, an example): wide around
# every device and link in use, from a laptop's CPU to a GPU generation or two ahead.
_RATE = ("per second", 1e3, 1e18, "989e12 (H100 bf16 FLOP/s)")
_BANDWIDTH = ("bytes/s", 1e3, 1e16, "46e9 (one 400 Gb/s InfiniBand NIC)")
_SECONDS = ("seconds", 1e-12, 10.0, "45e-6 (an inter-node all-reduce's latency)")
_BYTES = ("bytes", 1e3, 1e18, "80e9 (an H100's memory)")
PLAUSIBLE = {"flops": _RATE, "fp32_flops": _RATE, "transcendental_rate": _RATE,
             "mem_bandwidth": _BANDWIDTH, "intra_bandwidth": _BANDWIDTH,
             "inter_bandwidth": _BANDWIDTH, "host_bandwidth": _BANDWIDTH,
             "host_mem_bandwidth": _BANDWIDTH, "bandwidth": _BANDWIDTH,
             "intra_alpha": _SECONDS, "inter_alpha": _SECONDS, "kernel_floor_s": _SECONDS,
             "alpha": _SECONDS, "memory_bytes": _BYTES, "host_memory_bytes": _BYTES}

GB = 1e9
# The share of a host's theoretical DRAM bandwidth (channels x transfer rate x 8 bytes) a
# streaming kernel sustains: STREAM's copy/add/triad reach 73-79% of the wire rate (the STREAM
# benchmark, McCalpin; vendors' STREAM tables), and the host optimizer's fused AdamW is such a
# kernel (docs/cost-model.md §2.10). A preset's host_mem_bandwidth is that share of the node's
# sockets, divided among its GPUs' processes.
SUSTAINED = 0.75

# One op of an eager training step on the host of a GPU: 16.5 µs, forward and backward alike,
# the time per op of a chain of tiny ops through autograd measured by `autoshard calibrate
# --device cuda` on an H100 host (benchmarks/h100-calibrated.json; the bare op without autograd
# 11.4 µs). The presets leave ``host_dispatch_s`` at 0 (not priced): with every small op at one
# floor whatever its layout, the ILP's strategies tie and the main job's solve went from 1.5 s
# OPTIMAL to a time-limited FEASIBLE one (docs/cost-model.md §2.11). A calibrated profile, or
# ``{"base": "h100", "host_dispatch_s": 16.5e-6}``, prices it.
HOST_DISPATCH_S = 16.5e-6
PRESETS: dict[str, Cluster] = {
    # H100 SXM: 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 80 GB HBM3 at 3.35 TB/s (NVIDIA H100
    # datasheet); NVLink4 NCCL ring busbw ~370 GB/s (nccl-tests #212); IB NDR 400 Gb/s, ~46 GB/s
    # achieved (nccl-tests #290); ~45 µs inter-node small all-reduce latency (nccl #1244).
    "h100": Cluster(name="h100", flops=989e12, fp32_flops=67e12, mem_bandwidth=3.35e12,
                    memory_bytes=80 * GB, devices_per_node=8, intra_alpha=3e-6,
                    intra_bandwidth=370 * GB, inter_alpha=45e-6 / 2, inter_bandwidth=46 * GB,
                    host_bandwidth=55 * GB, host_memory_bytes=2000 * GB / 8,
                    host_mem_bandwidth=SUSTAINED * 614 * GB / 8),
    # H200: 141 GB HBM3e at 4.8 TB/s, same compute and links as H100 (NVIDIA).
    "h200": Cluster(name="h200", flops=989e12, fp32_flops=67e12, mem_bandwidth=4.8e12,
                    memory_bytes=141 * GB, devices_per_node=8, intra_alpha=3e-6,
                    intra_bandwidth=370 * GB, inter_alpha=45e-6 / 2, inter_bandwidth=46 * GB,
                    host_bandwidth=55 * GB, host_memory_bytes=2000 * GB / 8,
                    host_mem_bandwidth=SUSTAINED * 614 * GB / 8),
    # A100 SXM: 312 TFLOP/s bf16, 19.5 TFLOP/s fp32, 80 GB at 2.039 TB/s; all-reduce busbw
    # ~200 GB/s (NVIDIA; nccl-tests #149); HDR IB 200 Gb/s per GPU.
    "a100": Cluster(name="a100", flops=312e12, fp32_flops=19.5e12, mem_bandwidth=2.039e12,
                    memory_bytes=80 * GB, devices_per_node=8, intra_alpha=5e-6,
                    intra_bandwidth=200 * GB, inter_alpha=45e-6 / 2, inter_bandwidth=23 * GB,
                    host_bandwidth=25 * GB, host_memory_bytes=2000 * GB / 8,
                    host_mem_bandwidth=SUSTAINED * 410 * GB / 8),
    # A laptop/CI CPU with gloo over loopback: rough figures, useful for tests and for ranking
    # plans that will run on this machine.
    "cpu": Cluster(name="cpu", flops=2e11, fp32_flops=1e11, mem_bandwidth=2e10,
                   memory_bytes=16 * GB, devices_per_node=64, intra_alpha=3e-5,
                   intra_bandwidth=2 * GB, inter_alpha=3e-5, inter_bandwidth=2 * GB,
                   kernel_floor_s=5e-6, host_bandwidth=2e10, host_memory_bytes=16 * GB,
                   host_mem_bandwidth=2e10,
                   # (host_dispatch_s 0: the host is the device, and its kernel floor, a chain
                   # of ops through autograd, holds the host's dispatch already; §2.11)
                   # gloo's threads share the cores the compute fills (torch runs as many
                   # compute threads as a process has cores): a gradient sync issued during
                   # backward hides behind none of it (docs/cost-model.md §7; measured in
                   # benchmarks/RESULTS.md "Predicted vs measured step time").
                   comm_overlap=0.01),
    # Not hardware: a CPU whose compute is 10,000x slower than the "cpu" preset and whose links
    # have ~no latency, so every op is worth sharding. `autoshard verify` plans with it by
    # default, so that even tiny models get plans that shard and move data on gloo.
    "stress": Cluster(name="stress", flops=1e7, fp32_flops=1e7, mem_bandwidth=2e10,
                      memory_bytes=16 * GB, devices_per_node=64, intra_alpha=1e-6,
                      intra_bandwidth=2 * GB, inter_alpha=1e-6, inter_bandwidth=2 * GB,
                      kernel_floor_s=1e-9, host_bandwidth=2e10, host_memory_bytes=16 * GB,
                      host_mem_bandwidth=2e10),
}
