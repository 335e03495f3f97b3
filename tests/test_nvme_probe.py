"""`planner probe`: the spec it writes is what `--hardware` reads, every number is marked measured,
and the planner itself still starts without torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from planner.specs.hardware import NodeSpec

REPO = Path(__file__).resolve().parents[1]
MEASURED = {
    "cpu_memory_gib",
    "nvme_capacity_gib",
    "host_memory_gb_per_s",
    "nvme_read_gb_per_s",
    "nvme_write_gb_per_s",
    "cpu_adam_gparams_per_s",
    "host_memcpy_gb_per_s",
    "gpu_memory_gib",
    "gpu_hbm_gb_per_s",
    "host_to_gpu_gb_per_s",
    "gpu_to_host_gb_per_s",
    "gpu_peak_tflops",
}


def planner(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )


@pytest.fixture(scope="module")
def probed(tmp_path_factory) -> tuple[Path, dict, Path]:
    directory = tmp_path_factory.mktemp("probe")
    out = directory / "hw.json"
    # The bare measurements; tests/test_calibrate_probe.py covers the reference-run calibration.
    result = planner("probe", "--out", str(out), "--nvme-path", str(directory), "--nvme-test-gib", "0.0625",
                     "--no-calibrate")
    assert result.returncode == 0, result.stderr
    return out, json.loads(out.read_text()), directory


def test_probe_writes_a_spec_with_measured_sources(probed):
    out, doc, directory = probed
    spec = NodeSpec.from_dict(doc)
    assert set(doc["sources"]) >= MEASURED
    assert all(doc["sources"][key] == "measured" for key in MEASURED)
    assert all(doc[key] > 0 for key in MEASURED)
    assert spec.name.startswith("probed-")
    assert list(directory.iterdir()) == [out]  # the swap directory it measured in is gone


def test_probe_says_the_cpu_is_the_compute_device_without_cuda(probed):
    torch = pytest.importorskip("torch")
    _, doc, _ = probed
    if torch.cuda.is_available():
        assert doc["num_gpus_per_node"] == torch.cuda.device_count()
    else:
        assert "the CPU is the compute device" in doc["description"]
        assert "Collectives: skipped, one rank" in doc["notes"]
        from runtime.probe import PAGEABLE_SKIPPED

        assert PAGEABLE_SKIPPED in doc["notes"]  # pinned vs pageable copies: skipped, with the reason
        assert doc["gpu_memory_gib"] == doc["cpu_memory_gib"]
        assert doc["host_to_gpu_gb_per_s"] == doc["host_memory_gb_per_s"]


def test_the_probed_staged_memcpy_rate_prices_staged_plans(probed):
    from planner.cost.host_link import host_memcpy_bytes_per_s
    from planner.specs.units import GB

    _, doc, _ = probed
    spec = NodeSpec.from_dict(doc)
    assert host_memcpy_bytes_per_s(spec) == doc["host_memcpy_gb_per_s"] * GB > 0


def test_hardware_option_accepts_the_probed_spec(probed):
    out, doc, _ = probed
    result = planner("hardware", str(out), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["nvme_read_gb_per_s"] == doc["nvme_read_gb_per_s"]
    fit = planner("fit", "100m", "--gpus", "1", "--hardware", str(out), "--json")
    assert fit.returncode == 0, fit.stderr


def test_probe_rejects_a_missing_nvme_path_in_one_line(tmp_path):
    result = planner("probe", "--nvme-path", str(tmp_path / "missing"))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"error: nvme_path {tmp_path / 'missing'} does not exist; create it or choose another directory"
    ]


def test_planner_cli_starts_without_torch():
    code = "import sys, tierwise.cli, tierwise.cli.probe; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


def test_nvme_package_imports_without_torch():
    code = "import sys, runtime.nvme; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.slow
def test_collectives_are_measured_across_two_ranks():
    pytest.importorskip("torch")
    from runtime.probe import measure_collectives

    result = measure_collectives(2, "gloo", nbytes=8 << 20)
    assert (result.world_size, result.backend) == (2, "gloo")
    assert result.all_gather_bytes_per_s > 0 and result.reduce_scatter_bytes_per_s > 0


@pytest.mark.gpu
def test_probe_cuda_measurements_run_on_the_gpu():
    torch = pytest.importorskip("torch")
    from runtime.precision_probe import measure_precisions, torch_pass_timer
    from runtime.probe import measure_cuda_links

    device = torch.device("cuda", 0)
    links = measure_cuda_links(device, nbytes=64 << 20, repeats=2)
    assert links.host_to_device_bytes_per_s > 0 and links.device_to_host_bytes_per_s > 0
    from runtime.probe import measure_host_copy_paths

    paths = measure_host_copy_paths(device, nbytes=64 << 20, repeats=2)
    assert min(paths.pinned_h2d_bytes_per_s, paths.pinned_d2h_bytes_per_s, paths.pageable_h2d_bytes_per_s,
               paths.pageable_d2h_bytes_per_s) > 0
    assert links.device_memory_bytes_per_s > 0
    compute = measure_precisions(torch_pass_timer(device), hidden=1024, rows=1024, screen=False)
    assert set(compute.rates) == {"fp32", "bf16", "fp16"} and compute.screened_only == ()
    assert compute.fastest in ("bf16", "fp16")  # tensor cores: a 16-bit type trains fastest on a GPU


def test_read_write_sharing_picks_the_closer_model():
    from runtime.probe import read_write_sharing

    # 1 s of reads and 0.5 s of writes alone: independent budgets predict 1 s for the mix, one budget 1.5 s.
    assert read_write_sharing(1.0, 0.5, 1.05) == "independent"
    assert read_write_sharing(1.0, 0.5, 1.45) == "shared"
    assert read_write_sharing(1.0, 0.5, 1.6) == "shared"


def test_the_attention_probe_counts_flops_as_the_planner_times_a_fused_kernel(monkeypatch):
    # [Note: the CPU's fused attention]: forward half the causal square (4 b s^2 q / 2), backward 2.5 x that,
    # the count planner/cost/kernels.py's attention_flops uses for `attention: flash`; the times are given,
    # one per sequence length, and the spec's curve is each rate over the best.
    torch = pytest.importorskip("torch")
    from planner.specs.hardware import NodeSpec
    from runtime import probe

    monkeypatch.setattr(probe, "ATTENTION_HEADS", 2)
    monkeypatch.setattr(probe, "ATTENTION_HEAD_DIM", 8)
    monkeypatch.setattr(probe, "ATTENTION_SEQ_LENS", (8, 32))
    monkeypatch.setattr(probe, "ATTENTION_TOKENS", 32)
    times = iter([0.5, 0.25])
    monkeypatch.setattr(probe, "_median_time_s", lambda run, *, repeats, warmup=1: (run(), next(times))[1])
    measured = probe.measure_causal_attention(torch.device("cpu"), torch.float32)
    flops = {s: 4 * (32 // s) * s**2 * 2 * 8 / 2 * 3.5 for s in (8, 32)}
    assert measured.by_seq_len == pytest.approx({8: flops[8] / 0.5, 32: flops[32] / 0.25})
    assert measured.flops_per_s == pytest.approx(flops[32] / 0.25)
    points = measured.efficiency_points()
    assert points == [{"seq_len": 8, "efficiency": pytest.approx(round(flops[8] / 0.5 / (flops[32] / 0.25), 4))},
                      {"seq_len": 32, "efficiency": 1.0}]
    # The points are a valid `efficiency.attention` curve of a spec.
    from planner.specs.catalog import hardware_presets

    doc = hardware_presets()["dgx-a100-80g"].to_dict()
    node = NodeSpec.from_dict(dict(doc, efficiency=dict(doc.get("efficiency", {}), attention=points)), "probed spec")
    assert node.attention_efficiency.at(8) == pytest.approx(points[0]["efficiency"])
    assert node.attention_efficiency.at(4096) == 1.0


def test_the_kernel_probe_counts_bytes_as_the_planner_bills_a_blocks_memory_bound_kernels(monkeypatch):
    # [Note: the CPU's memory-bound kernels]: two norms, two residual adds and GELU, forward and
    # backward, the bytes planner/cost/kernels.py's kernel_bytes gives a GPT block; the time is given.
    torch = pytest.importorskip("torch")
    from planner.cost.kernels import kernel_bytes
    from planner.specs.catalog import hardware_presets
    from planner.specs.plan import Plan
    from runtime import probe

    monkeypatch.setattr(probe, "_median_time_s", lambda run, *, repeats, warmup=1: (run(), 0.25)[1])
    rate = probe.measure_block_kernels(torch.device("cpu"), torch.float32, hidden=64, tokens=32)
    plan = Plan.from_dict({"model": {"num_layers": 1, "hidden_size": 64, "num_heads": 1, "seq_len": 32, "vocab_size": 0},
                           "hardware": hardware_presets()["dgx2-v100"].to_dict(), "num_gpus": 1, "precision": "fp32",
                           "micro_batch_per_gpu": 1})
    fwd, bwd = kernel_bytes(plan)
    fwd.pop("softmax"), bwd.pop("softmax")  # eager attention's, not a kernel of the block a fused kernel runs
    fwd.pop("score_products", None), bwd.pop("score_products", None)
    assert set(fwd) == set(bwd) == {"norms", "residual", "activation"}
    assert rate == pytest.approx((sum(fwd.values()) + sum(bwd.values())) / 0.25)


@pytest.mark.parametrize(("cache_mib", "working_set_mib", "adam_mi_params"), [(0, 256, 16), (32, 256, 16), (320, 1280, 80)])
def test_host_measurements_stream_beyond_the_largest_cache(monkeypatch, cache_mib, working_set_mib, adam_mi_params):
    # [Note: host measurements beyond the cache]: a server CPU's 320 MB cache held most of a 256 MiB
    # Adam working set; the probe now streams 4x the largest cache, and no less than before.
    from runtime import probe

    monkeypatch.setattr(probe, "last_level_cache_bytes", lambda: cache_mib << 20)
    assert probe.host_working_set_bytes() == working_set_mib << 20
    assert probe.cpu_adam_probe_params() == adam_mi_params << 20


def test_the_largest_cache_is_read_from_sysfs(tmp_path):
    from runtime import probe

    for index, size in enumerate(("32K", "32K", "1024K", "32768K")):  # L1d, L1i, L2, L3 as sysfs writes them
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert probe.last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index4").mkdir()
    (tmp_path / "index4" / "size").write_text("2M\n")
    assert probe.last_level_cache_bytes(tmp_path) == 32 << 20
    assert probe.last_level_cache_bytes(tmp_path / "absent") == 0
