"""``autoshard calibrate``: the alpha-beta fit against closed forms, and a quick run on 2 gloo
ranks whose profile ``Cluster.load`` and ``autoshard plan --cluster`` accept."""
from __future__ import annotations

import contextlib
import io
import json
import math

import pytest
import torch

from autoshard.tools.calibrate.fields import profile

from autoshard.tools.calibrate.fit import (MIN_ALPHA, alpha_beta_terms, fit_alpha_beta,
                                           predicted_time)
from autoshard.tools.cli import main
from autoshard.cluster import PRESETS, Cluster
from autoshard.cost.comm import COLLECTIVE_KINDS, collective_time
from autoshard.errors import AutoshardError

SIZES = (4096, 65536, 1 << 20, 16 << 20)


def _samples(kind: str, p: int, alpha: float, bw: float, sizes=SIZES):
    return [(kind, p, float(s), collective_time(kind, p, s, alpha, bw)) for s in sizes]


# ------------------------------------------------------------------------------ closed forms

@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_terms_are_the_cost_models_ring_formulas(kind: str, p: int) -> None:
    # docs/cost-model.md §1.1: time = c·alpha + d·S/B
    c, d = alpha_beta_terms(kind, p)
    for s in SIZES:
        assert math.isclose(c * 3e-5 + d * s / 2e9, collective_time(kind, p, s, 3e-5, 2e9),
                            rel_tol=1e-12)


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_fit_recovers_alpha_and_bandwidth_exactly(kind: str, p: int) -> None:
    alpha, bw = 37e-6, 1.7e9
    fit = fit_alpha_beta(_samples(kind, p, alpha, bw))
    assert math.isclose(fit.alpha, alpha, rel_tol=1e-9)
    assert math.isclose(fit.bandwidth, bw, rel_tol=1e-9)
    assert fit.max_rel_err < 1e-9 and fit.samples == len(SIZES) and not fit.clamped
    assert math.isclose(predicted_time(kind, p, 1 << 22, fit),
                        collective_time(kind, p, 1 << 22, alpha, bw), rel_tol=1e-9)


def test_one_fit_over_every_kind_is_the_link_the_model_prices() -> None:
    # all kinds on one link, as the model prices them (one alpha, one B per axis)
    alpha, bw = 2.5e-6, 370e9
    samples = [s for k in COLLECTIVE_KINDS for s in _samples(k, 8, alpha, bw)]
    fit = fit_alpha_beta(samples)
    assert math.isclose(fit.alpha, alpha, rel_tol=1e-9)
    assert math.isclose(fit.bandwidth, bw, rel_tol=1e-9)


def test_least_squares_is_on_relative_residuals() -> None:
    # Two exact points and one 10% slow: the relative fit is the closed-form weighted solution.
    alpha, bw = 1e-4, 1e9
    samples = _samples("all_reduce", 2, alpha, bw, sizes=(1e3, 1e6))
    samples.append(("all_reduce", 2, 1e7, 1.1 * collective_time("all_reduce", 2, 1e7, alpha, bw)))
    fit = fit_alpha_beta(samples)
    rows = [(c / t, d * s / t) for k, p, s, t in samples for c, d in [alpha_beta_terms(k, p)]]
    suu = sum(u * u for u, _ in rows)
    suv = sum(u * v for u, v in rows)
    svv = sum(v * v for _, v in rows)
    su, sv = sum(u for u, _ in rows), sum(v for _, v in rows)
    det = suu * svv - suv * suv
    assert math.isclose(fit.alpha, (svv * su - suv * sv) / det, rel_tol=1e-9)
    assert math.isclose(1 / fit.bandwidth, (suu * sv - suv * su) / det, rel_tol=1e-9)


def test_no_visible_latency_clamps_alpha_and_keeps_the_bandwidth() -> None:
    samples = [("all_gather", 2, float(s), 0.5 * s / 1e9) for s in SIZES]   # alpha = 0 exactly
    fit = fit_alpha_beta(samples)
    assert fit.clamped == "alpha" and fit.alpha == MIN_ALPHA
    assert math.isclose(fit.bandwidth, 1e9, rel_tol=1e-3)


def test_fit_needs_two_sizes() -> None:
    with pytest.raises(AutoshardError, match="two or more distinct message sizes"):
        fit_alpha_beta(_samples("all_reduce", 2, 1e-5, 1e9, sizes=(4096,)))
    with pytest.raises(AutoshardError, match="two or more"):
        fit_alpha_beta(_samples("all_reduce", 2, 1e-5, 1e9, sizes=(4096, 4096)))
    with pytest.raises(AutoshardError, match="at least 2 devices"):
        fit_alpha_beta(_samples("all_reduce", 1, 1e-5, 1e9))


# ---------------------------------------------------------------------------- the profile file

def test_cluster_load_ignores_the_measured_record(tmp_path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"base": "cpu", "measured": {"anything": [1, 2]}}))
    assert Cluster.load(path) == PRESETS["cpu"]
    path.write_text(json.dumps({"base": "cpu", "measured": {}, "mesured": 1}))
    with pytest.raises(AutoshardError, match="mesured"):
        Cluster.load(path)


def _fake_report(rate: float, comm: bool = True) -> dict:
    """One rank's measurements with exact figures: matmuls at ``rate``, collectives on a link of
    alpha 50 µs and 1 GB/s."""
    # forward at ``rate``; backward: the input gradient at ``rate``, the weight's at half of it
    mm = [{"shape": [64, 64, 64], "flops": 2.0 * 64**3, "forward_s": 2.0 * 64**3 / rate,
           "backward_s": 2.0 * 64**3 / rate + 2.0 * 64**3 / (rate / 2)}]
    out = {"matmul": {"float32": mm},
           "bandwidth": {"copy_bytes_per_s": 2e10, "add_bytes_per_s": 3e10},
           "elementwise": {}, "specials": {"overall_evals_per_s": rate / 50},
           "attention": {"training_flops_per_s": rate / 2},
           "kernel_floor": {"autograd_per_kernel_s": 7e-6, "program_per_op_s": 9e-6},
           "threads": 1, "comm": {}}
    if comm:
        out["comm"] = {k: [{"bytes": s, "times_s": [t], "enter_s": [0.0], "exit_s": [t]}
                           for s in SIZES
                           for t in [collective_time(k, 2, s, 5e-5, 1e9)
                                     * (2 if k == "send_recv" else 1)]]
                       for k in COLLECTIVE_KINDS}
    return out


def test_profile_maps_measurements_onto_cluster_fields() -> None:
    from autoshard.tools.calibrate.timing import CalibrateSpec
    prof = profile(CalibrateSpec("cpu", 2), [_fake_report(1e11), _fake_report(1e11)])
    c = Cluster._from_profile(dict(prof))
    # overall rate: 3 matmuls of F flops in F/r + F/r + 2F/r = 4F/r -> 3r/4; peak r
    assert math.isclose(c.fp32_flops, 1e11) and math.isclose(c.matmul_efficiency, 0.75)
    assert c.flops == c.fp32_flops                  # no 16-bit matmul measured on a CPU
    assert c.mem_bandwidth == 3e10 and c.kernel_floor_s == 7e-6
    assert c.host_dispatch_s == 0.0          # the host is the device: in the kernel floor
    assert c.transcendental_rate == 1e11 / 50       # special functions: their measured rate
    assert math.isclose(c.intra_alpha, 5e-5) and math.isclose(c.intra_bandwidth, 1e9)
    assert (c.inter_alpha, c.inter_bandwidth) == (c.intra_alpha, c.intra_bandwidth)
    fits = prof["measured"]["collectives"]["per_kind_fit"]
    assert math.isclose(fits["send_recv"]["alpha"], 5e-5)   # a round trip is two messages
    # each kind priced on its own fit (here all one link)
    assert {k for k, _, _ in c.collective_kinds} == set(COLLECTIVE_KINDS)
    assert all(math.isclose(a, 5e-5) and math.isclose(b, 1e9) for _, a, b in c.collective_kinds)
    assert c.memory_bytes == PRESETS["cpu"].memory_bytes


def test_cuda_profile_takes_bf16_peak_and_the_gpus_preset() -> None:
    # The CUDA mapping, fed a GPU's measurements (no GPU needed): bf16 sets flops and the
    # efficiency; fp32_flops is scaled so that fp32_flops * efficiency is the measured fp32 rate.
    from autoshard.tools.calibrate.timing import CalibrateSpec
    reports = []
    for _ in range(2):
        r = _fake_report(50e12)                       # fp32: peak 50 T, overall 37.5 T
        r["matmul"]["bfloat16"] = _fake_report(800e12)["matmul"]["float32"]
        r.update(device_name="NVIDIA H100 80GB HBM3", device_memory_bytes=85_000_000_000)
        reports.append(r)
    prof = profile(CalibrateSpec("cuda", 2), reports)
    c = Cluster._from_profile(dict(prof))
    assert prof["base"] == "h100" and c.name == "calibrated-cuda"
    assert math.isclose(c.flops, 800e12) and math.isclose(c.matmul_efficiency, 0.75)
    assert math.isclose(c.fp32_flops * c.matmul_efficiency, 0.75 * 50e12)
    assert c.memory_bytes == 85e9 and c.devices_per_node >= 2
    # Bandwidth-bound on a GPU, the special-function kernels leave the preset's figure.
    assert c.transcendental_rate == PRESETS["h100"].transcendental_rate
    assert prof["measured"]["backend"] == "nccl"


def test_overlap_share_is_what_running_both_saves() -> None:
    """comm 10 ms, forward 5 ms, forward + backward 15 ms: side by side they take 15 (all
    hidden behind backward), in turns 25 (nothing hidden: clipped to the field's floor), 20
    half, and more than in turns (in each other's way) is nothing too; the slowest rank's times
    count."""
    from autoshard.tools.calibrate.links import overlap_share
    from autoshard.tools.calibrate.timing import CalibrateSpec

    def report(both: float, slow: float = 0.0) -> dict:
        r = _fake_report(1e11)
        r["overlap"] = {"bytes": 4096, "layers": 3, "rounds": [
            {"comm_s": 0.010 + slow, "forward_s": 0.005, "compute_s": 0.015,
             "both_s": both + slow}] * 3}
        return r
    assert overlap_share([report(0.015), report(0.015)]) == 1.0
    assert overlap_share([report(0.025), report(0.025)]) == 0.01
    assert overlap_share([report(0.040), report(0.040)]) == 0.01
    assert math.isclose(overlap_share([report(0.020), report(0.020)]), 0.5)
    # a rank 5 ms slower on comm and on both: (15 + 15 - 25) / 10
    assert math.isclose(overlap_share([report(0.020), report(0.020, slow=0.005)]), 0.5)
    prof = profile(CalibrateSpec("cpu", 2), [report(0.020), report(0.020)])
    assert math.isclose(Cluster._from_profile(dict(prof)).comm_overlap, 0.5)
    # Ranks whose threads fill their host's cores: nothing can hide, whatever the probe read.
    full = [report(0.020) | {"host": "h", "cpus": 2}, report(0.020) | {"host": "h", "cpus": 2}]
    prof = profile(CalibrateSpec("cpu", 2), full)
    assert Cluster._from_profile(dict(prof)).comm_overlap == 0.01
    assert math.isclose(prof["measured"]["overlap"]["probe_share"], 0.5)
    spare = [r | {"cpus": 4} for r in full]                 # two cores left for gloo
    assert math.isclose(Cluster._from_profile(dict(profile(CalibrateSpec("cpu", 2), spare)))
                        .comm_overlap, 0.5)


def test_comm_overlap_shrinks_the_window_gradient_sync_hides_behind() -> None:
    """The plan's hidden sync is min(sync, comm_overlap x backward compute) (§7): GPT-2 data
    parallel at batch 512 on 8 GPUs hides every bucket; with a cluster whose collectives hide
    behind only 1% of backward, almost all of it is exposed."""
    import dataclasses
    from autoshard.mesh import Mesh
    from autoshard.solver.baselines import baseline_plan
    from autoshard.trace.export import trace
    from autoshard.zoo.registry import load_model
    model, inputs = load_model("gpt2", batch=64, seq=1024, device="meta")
    traced = trace(model, inputs, training=True)
    plans = {}
    for share in (1.0, 0.01):
        cluster = dataclasses.replace(PRESETS["h100"], comm_overlap=share)
        plans[share] = baseline_plan(traced, Mesh((8,), ("dp",), cluster=cluster), "dp")
    full, low = plans[1.0].predicted, plans[0.01].predicted
    assert full.overlapped_comm_s["dp"] > 0
    # hidden at most 1% of backward (itself under the compute) where everything hid before
    assert low.overlapped_comm_s["dp"] <= 0.01 * low.compute_s + 1e-12
    assert low.overlapped_comm_s["dp"] < 0.5 * full.overlapped_comm_s["dp"]
    assert low.step_time_s > full.step_time_s
    with pytest.raises(AutoshardError, match="comm_overlap"):
        dataclasses.replace(PRESETS["h100"], comm_overlap=1.5)


# ---------------------------------------------------------------------- a real run on 2 ranks

def _cli(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    return code, out.getvalue()


def test_quick_calibration_on_two_gloo_ranks_plans(tmp_path) -> None:
    path = tmp_path / "cluster.json"
    code, out = _cli(["calibrate", "--device", "cpu", "--world", "2", "--quick", "-o", str(path)])
    assert code == 0, out
    assert "calibrated cpu x2 (gloo" in out and f"wrote {path}" in out
    prof = json.loads(path.read_text())
    assert prof["base"] == "cpu" and prof["measured"]["world"] == 2
    link = prof["measured"]["collectives"]["link_fit"]
    assert set(prof["measured"]["collectives"]["per_kind_fit"]) == set(COLLECTIVE_KINDS)
    c = Cluster.load(path)
    assert c.name == "calibrated-cpu"
    assert (c.intra_alpha, c.intra_bandwidth) == (link["alpha"], link["bandwidth"])
    assert 0 < c.matmul_efficiency <= 1 and c.fp32_flops > 1e8 and c.mem_bandwidth > 1e8
    assert c.transcendental_rate == prof["transcendental_rate"] > 1e6
    assert 0 < c.comm_overlap <= 1 and prof["measured"]["overlap"]["rounds"]
    assert {"gelu_tanh", "silu_backward"} <= set(prof["measured"]["specials"])
    code, out = _cli(["plan", "gpt2-tiny", "--mesh", "2", "--cluster", str(path)])
    assert code == 0 and "cluster calibrated-cpu" in out


def test_calibrate_refuses_bad_arguments(capsys, tmp_path) -> None:
    assert main(["calibrate", "--world", "0", "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "--world is a positive number of ranks" in err and "Fix" in err
    if not torch.cuda.is_available():
        assert main(["calibrate", "--device", "cuda", "-o", str(tmp_path / "c.json")]) == 2
        assert "a CUDA device for --device cuda" in capsys.readouterr().err


def test_the_host_dispatch_is_measured_on_a_program_of_aten_ops() -> None:
    from autoshard.tools.calibrate.kernels import measure_kernel_floor, program_chain
    from autoshard.tools.calibrate.timing import SIZES as _S
    g = program_chain(5)
    assert [n.target for n in g.graph.nodes if n.op == "call_function"].count(
        torch.ops.aten.mul.Tensor) == 5
    x, c = torch.ones(1, requires_grad=True), torch.full((1,), 2.0)
    assert g(x, c).item() == 32.0
    out = measure_kernel_floor(_S[("cpu", True)], torch.device("cpu"))
    assert out["program_per_op_s"] > 0 and out["chain"] > 0
