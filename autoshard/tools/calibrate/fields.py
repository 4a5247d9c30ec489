"""From every rank's measurements to a cluster profile: the measurements one rank makes
(``measure_rank``), and the fields they set (``profile``), each with its record under
``"measured"``."""
from __future__ import annotations

import datetime
import os
import platform
import socket
import time
from dataclasses import asdict
from typing import Any

import torch

from autoshard.cluster import Cluster
from autoshard.cost.comm import COLLECTIVE_KINDS
from autoshard.ir import CollectiveKind
from autoshard.tools.calibrate.fit import AlphaBeta, PLAN_KINDS, fit_alpha_beta, predicted_time
from autoshard.tools.calibrate.kernels import (measure_attention, measure_bandwidth,
                                               measure_elementwise, measure_host_side,
                                               measure_kernel_floor, measure_matmuls,
                                               measure_specials)
from autoshard.tools.calibrate.links import (MIN_OVERLAP, cores_full, measure_collectives,
                                             measure_overlap, overlap_share)
from autoshard.tools.calibrate.timing import CalibrateSpec, SIZES, median, setup_device


def measure_rank(spec: CalibrateSpec) -> dict:
    """Everything one rank measures; runs on every rank of an initialised world at once, so
    the ranks share the host (cores, memory bandwidth) as they do in training."""
    import torch.distributed as dist
    torch.manual_seed(spec.seed + dist.get_rank())
    device = setup_device(spec)
    sizes = SIZES[(spec.device, spec.quick)]
    t0, c0 = time.perf_counter(), time.process_time()
    dist.barrier()
    out: dict[str, Any] = {"matmul": {"float32": measure_matmuls(sizes, device, torch.float32)}}
    if spec.device == "cuda":
        out["matmul"]["bfloat16"] = measure_matmuls(sizes, device, torch.bfloat16)
    low = torch.bfloat16 if spec.device == "cuda" else torch.float32
    out["bandwidth"] = measure_bandwidth(sizes, device)
    out["elementwise"] = measure_elementwise(sizes, device, low)
    out["specials"] = measure_specials(sizes, device, low)
    out["attention"] = measure_attention(sizes, device, low)
    out["kernel_floor"] = measure_kernel_floor(sizes, device)
    out["host_side"] = measure_host_side(sizes, device)
    out["compute_wall_s"] = time.perf_counter() - t0
    dist.barrier()
    t1 = time.perf_counter()
    out["comm"] = measure_collectives(sizes, device) if dist.get_world_size() > 1 else {}
    if dist.get_world_size() > 1:
        out["overlap"] = measure_overlap(sizes, device)
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
    return {"peak_flops_per_s": median(peaks), "overall_flops_per_s": median(overall)}


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
    if kind == CollectiveKind.SEND_RECV or len(hosts) != 1 or None in hosts:
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
            t = median(per_call) / (2 if kind == CollectiveKind.SEND_RECV else 1)
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


def _compute_fields(spec: CalibrateSpec, reports: list[dict], fields: dict[str, Any]
                    ) -> tuple[dict, dict | None]:
    """The compute figures (matmul, bandwidth, kernel floor, special functions, the host side,
    the device's memory) into ``fields``; the fp32 and, on CUDA, bf16 matmul figures."""
    p = len(reports)
    fp32 = matmul_figures([r["matmul"]["float32"] for r in reports])
    bf16 = None
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
    fields["mem_bandwidth"] = median(bw)
    fields["kernel_floor_s"] = median([r["kernel_floor"]["autograd_per_kernel_s"]
                                       for r in reports])
    if spec.device == "cuda":
        # The host's dispatch of one op of the eager rank program (docs/cost-model.md §2.11).
        # On a CPU the host is the device: the kernel floor above already holds it.
        fields["host_dispatch_s"] = median([r["kernel_floor"]["program_per_op_s"]
                                            for r in reports])
    if spec.device == "cpu" and all("specials" in r for r in reports):
        # On a GPU these kernels are bandwidth-bound (§3.7): their rate says nothing of the
        # special-function units, and the preset's figure stays.
        fields["transcendental_rate"] = median([r["specials"]["overall_evals_per_s"]
                                                for r in reports])
    if all("host_side" in r for r in reports):        # the host figures of offload (§2.10)
        fields["host_mem_bandwidth"] = median([r["host_side"]["adam_bytes_per_s"]
                                               for r in reports])
        if spec.device == "cuda":
            fields["host_bandwidth"] = median([min(r["host_side"]["h2d_bytes_per_s"],
                                                   r["host_side"]["d2h_bytes_per_s"])
                                               for r in reports])
    if spec.device == "cuda":
        fields["memory_bytes"] = float(reports[0]["device_memory_bytes"])
        if p >= 2:     # one rank measures no link: the preset's node and links stand
            fields["devices_per_node"] = max(p, torch.cuda.device_count()
                                             if torch.cuda.is_available() else p)
    return fp32, bf16


def _measured(spec: CalibrateSpec, reports: list[dict], fields: dict[str, Any], fp32: dict,
              bf16: dict | None, wall_s: float, other_load: float | None) -> dict[str, Any]:
    """The profile's ``"measured"`` record of the compute figures: what the fields came from."""
    measured: dict[str, Any] = {
        "tool": "autoshard calibrate", "date": datetime.datetime.now(datetime.timezone.utc)
        .strftime("%Y-%m-%d %H:%M UTC"), "device": spec.device, "world": len(reports),
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
    return measured


def _link_fields(spec: CalibrateSpec, reports: list[dict], fields: dict[str, Any],
                 measured: dict[str, Any]) -> None:
    """The link figures fitted to the collectives (2 ranks or more), into ``fields``, and their
    record into ``measured``."""
    p = len(reports)
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
                         "model_seconds": predicted_time(k, p, s, AlphaBeta(**per_kind[k]))}
                        for _, _, s, t in rows] for k, rows in samples.items()},
        "compute_before_each_call_s": SIZES[(spec.device, spec.quick)].comm_gap_s,
        "note": "one host: inter_alpha and inter_bandwidth are set to the intra figures; "
                "each kind is priced on its own fit (collective_kinds)"}


def profile(spec: CalibrateSpec, reports: list[dict], *, wall_s: float = 0.0,
            other_load: float | None = None) -> dict:
    """The cluster profile JSON (a dict) from every rank's measurements."""
    base = base_preset(spec, reports)
    fields: dict[str, Any] = {"base": base, "name": f"calibrated-{spec.device}"}
    fp32, bf16 = _compute_fields(spec, reports, fields)
    measured = _measured(spec, reports, fields, fp32, bf16, wall_s, other_load)
    if len(reports) >= 2:
        _link_fields(spec, reports, fields, measured)
    else:
        measured["collectives"] = {"note": "one rank: no collective measured; the link figures "
                                           f"are the {base!r} preset's"}
    fields["measured"] = measured
    Cluster._from_profile(dict(fields))        # every figure valid before anything is written
    return fields

