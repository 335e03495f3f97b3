"""Hardware specs: presets, units converted once, provenance, validation."""

import json

import pytest

from planner.specs.catalog import hardware_presets, resolve_hardware
from planner.specs.errors import PlannerError
from planner.specs.hardware import Cluster, NodeSpec
from planner.specs.units import GB, GIB


def test_required_presets_exist_and_round_trip():
    presets = hardware_presets()
    for name in ("dgx2-v100", "dgx-a100-80g", "dgx-h100", "h200-x1"):
        spec = presets[name]
        assert NodeSpec.from_dict(spec.to_dict()) == spec
    assert resolve_hardware(None).name == "dgx-h100"


def test_dgx2_is_the_papers_machine():
    node = resolve_hardware("dgx2-v100")
    assert node.num_gpus_per_node == 16
    assert node.gpu_memory_bytes == 32 * GIB
    assert node.provenance("gpu_peak_tflops").startswith("fitted: published_runs")  # planner/validation/fit.py
    assert node.citations["gpu_peak_tflops"].endswith("before fitting: 70 (paper)")
    assert node.cpu_memory_bytes == 1536 * GIB
    assert node.nvme_capacity_bytes == 28 * 1024 * GIB
    # 3.0 GB/s per GPU from CPU memory when all 16 read at once, 1.6 GB/s from NVMe.
    assert node.host_memory_bytes_per_s / 16 == 3.0 * GB
    assert node.nvme_read_bytes_per_s / 16 == 1.6 * GB
    assert node.provenance("host_memory_gb_per_s") == "paper"
    assert node.provenance("nvme_write_gb_per_s") == "estimate"
    assert node.provenance("gpu_nominal_tflops") == "nominal"


def test_max_alloc_defaults_to_gpu_memory():
    node = resolve_hardware("dgx-h100")
    assert node.gpu_max_alloc_bytes == node.gpu_memory_bytes


def _doc(**changes):
    doc = resolve_hardware("dgx-h100").to_dict()
    doc.update(changes)
    return doc


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"nvme_read_gb_per_s": -1}, "nvme_read_gb_per_s must be at least 0"),
        ({"host_to_gpu_gb_per_s": 0}, "must be greater than 0"),
        ({"gpu_memory_gib": "80"}, "must be a number"),
        ({"gpu_max_alloc_gib": 100}, "exceeds gpu_memory_gib"),
        ({"num_gpus_per_node": 2.5}, "whole number"),
        ({"bogus_gb_per_s": 1}, "unknown key"),
        ({"sources": {"gpu_memory_gib": "guessed"}}, "must be one of"),
    ],
)
def test_bad_hardware_documents(changes, message):
    with pytest.raises(PlannerError, match=message):
        NodeSpec.from_dict(_doc(**changes))


def test_nan_in_a_hardware_file_is_refused(tmp_path):
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(_doc()).replace('"cpu_memory_gib": 2048.0', '"cpu_memory_gib": NaN'))
    with pytest.raises(PlannerError, match="NaN is not a number"):
        resolve_hardware(str(path))


def test_cluster_needs_whole_nodes():
    node = resolve_hardware("dgx-h100")
    assert Cluster(node=node, num_gpus=16).num_nodes == 2
    assert Cluster(node=node, num_gpus=4).gpus_per_node == 4
    with pytest.raises(PlannerError, match="not a whole number"):
        Cluster(node=node, num_gpus=12)
    with pytest.raises(PlannerError, match="at least 1"):
        Cluster(node=node, num_gpus=0)
