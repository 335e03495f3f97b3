"""A probed GPU takes its generation's published-run fit (planner/calibration/fitted_gpus.py), checked against the
first run of the runtime on a GPU (an H200, kept in benchmarks/gpu/runs/)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from planner.calibration.fitted_gpus import FITTED_KEYS, fitted_compute
from planner.sim.report import simulate
from planner.specs.catalog import resolve_hardware
from planner.specs.hardware import NodeSpec
from planner.specs.plan import Plan
from planner.specs.units import GIB

ROOT = Path(__file__).resolve().parents[1]
H200_RUN = ROOT / "benchmarks" / "gpu" / "runs" / "2026-11-26-h200.json"


@pytest.mark.parametrize(("name", "memory_gib", "preset"), [
    ("NVIDIA H200", 139.8, "h200-x1"),
    ("NVIDIA H100 80GB HBM3", 79.6, "dgx-h100"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "dgx-a100-40g"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "dgx-a100-80g"),
    ("Tesla V100-SXM3-32GB", 31.7, "dgx2-v100"),
])
def test_a_gpu_takes_the_preset_of_its_generation_nearest_in_memory(name: str, memory_gib: float, preset: str) -> None:
    found = fitted_compute(name, memory_gib)
    assert found is not None
    assert found.preset == preset
    doc = resolve_hardware(preset).to_dict()
    assert {k: v for k, v in found.fields.items() if k != "efficiency"} == {k: doc[k] for k in FITTED_KEYS if k in doc}
    assert found.fields["efficiency"] == {"matmul": doc["efficiency"]["matmul"]}
    # The preset's own provenance: its corpus rows where fitted, `nominal` for the datasheet numbers.
    assert found.sources["gpu_peak_tflops"] == doc["sources"]["gpu_peak_tflops"]
    assert found.sources["gpu_peak_tflops"].startswith("fitted: published_runs (rows ")
    assert found.sources["gpu_nominal_tflops"] == found.sources["gpu_hbm_gb_per_s"] == "nominal"


def test_a_gpu_of_no_fitted_generation_gets_none() -> None:
    assert fitted_compute("NVIDIA L40S", 44.4) is None
    assert fitted_compute("NVIDIA GeForce RTX 4090", 23.6) is None


def _probed(name: str, memory_gib: float) -> tuple[Any, dict, dict, list[str]]:
    from runtime.probe import _Findings, _take_generation_fit

    measured = {"num_gpus_per_node": 1, "gpu_memory_gib": memory_gib, "gpu_peak_tflops": 811.05,
                "gpu_hbm_gb_per_s": 3996.95, "host_to_gpu_gb_per_s": 55.1, "gpu_to_host_gb_per_s": 55.3,
                "cpu_memory_gib": 125.9, "host_memory_gb_per_s": 70.1, "cpu_adam_gparams_per_s": 6.56}
    found = _Findings(dict(measured), dict.fromkeys(measured, "measured"), [])
    _take_generation_fit(found, SimpleNamespace(name=name, total_memory=memory_gib * GIB))
    return found, found.doc, found.sources, found.notes


def test_the_probe_keeps_its_links_and_takes_the_fitted_compute_model() -> None:
    found, doc, sources, notes = _probed("NVIDIA H200", 139.8)
    assert doc["gpu_peak_tflops"] == 576.5 and doc["gpu_hbm_gb_per_s"] == 4800.0 and doc["flash_attention_tflops"] == 346.0
    assert doc["host_to_gpu_gb_per_s"] == 55.1 and sources["host_to_gpu_gb_per_s"] == "measured"
    assert sources["gpu_peak_tflops"] == resolve_hardware("h200-x1").to_dict()["sources"]["gpu_peak_tflops"]
    assert sources["gpu_hbm_gb_per_s"] == "nominal"
    assert "preset h200-x1's" in notes[-1]
    assert "gpu_peak_tflops 811," in notes[-1] and "gpu_hbm_gb_per_s 3997" in notes[-1]
    # The document the probe writes is one a spec loads (every source a known provenance).
    node = NodeSpec.from_dict(found.document("probed", "an H200"), "the probed document")
    assert node.flash_attention_flops_per_s == pytest.approx(346.0e12)


def test_the_probe_keeps_bare_rates_where_no_fit_covers_the_gpu_and_says_so() -> None:
    _, doc, sources, notes = _probed("NVIDIA L40S", 44.4)
    assert doc["gpu_peak_tflops"] == 811.05 and sources["gpu_peak_tflops"] == "measured"
    assert "no published-run fit covers NVIDIA L40S" in notes[-1]


def _h200_chain(chain: str) -> tuple[dict, dict]:
    run = json.loads(H200_RUN.read_text())["planner"]["chains"][chain]
    return run["profile"]["plan"], run["profile"]["measured"]


def test_the_h200_run_is_predicted_within_10_percent_with_the_fit_and_2x_fast_without() -> None:
    """The all-on-GPU chain of the recorded H200 run (`H200_RUN`: 1.2 B GPT, seq 1024, batch 4, bf16):
    its probed spec as it was (bare kernels) predicts the step at about half what the run measured;
    with the generation's fit in the probed spec (links as probed), and the fused attention the
    runtime ran, within 10 %."""
    plan_doc, measured = _h200_chain("searched")
    bare = Plan.from_dict(plan_doc)
    assert simulate(bare.replace(prediction=None)).prediction.iteration_time_s < 0.55 * measured["iteration_time_s"]
    from runtime.probe import _Findings, _take_generation_fit

    hardware = {k: v for k, v in plan_doc["hardware"].items() if k not in ("name", "description", "sources", "notes")}
    found = _Findings(hardware, dict(plan_doc["hardware"]["sources"]), [])
    _take_generation_fit(found, SimpleNamespace(name="NVIDIA H200", total_memory=hardware["gpu_memory_gib"] * GIB))
    node = NodeSpec.from_dict(found.document("probed", "the H200 run's probed spec"), "the H200 run's probed spec")
    assert node.flash_attention_flops_per_s > 0  # so a fit plans the fused attention the runtime runs
    predicted = simulate(bare.replace(node=node, attention="flash", prediction=None)).prediction.iteration_time_s
    assert predicted == pytest.approx(measured["iteration_time_s"], rel=0.10)
