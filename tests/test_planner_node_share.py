"""Part of a node bills its GPUs' share of the node (planner/specs/hardware.py [Note: part of a node])."""

import json
import os
import subprocess
import sys

import pytest

from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.hardware import SHARED_BY_GPUS, NodeSpec
from planner.specs.plan import Plan
from planner.specs.units import GB, GIB

DGX_H100 = resolve_hardware("dgx-h100")


def test_one_gpu_of_eight_gets_an_eighth_of_the_host():
    share = DGX_H100.for_gpus(1)
    assert share.num_gpus_per_node == 1 and share.whole_node_gpus == 8
    assert share.cpu_memory_bytes == 256 * GIB  # 2 TiB / 8
    assert share.nvme_capacity_bytes == DGX_H100.nvme_capacity_bytes / 8
    assert share.nvme_read_bytes_per_s == 50 * GB / 8 and share.nvme_write_bytes_per_s == 28 * GB / 8
    assert share.host_memory_bytes_per_s == 25 * GB
    assert share.cpu_adam_params_per_s == 1.25e9
    # Per-GPU numbers are the GPU's own, whatever the rest of the node does.
    for attr in ("gpu_memory_bytes", "gpu_flops_per_s", "gpu_hbm_bytes_per_s", "host_to_gpu_bytes_per_s",
                 "gpu_to_host_bytes_per_s", "gpu_gpu_intra_node_bytes_per_s", "inter_node_bytes_per_s"):
        assert getattr(share, attr) == getattr(DGX_H100, attr), attr


def test_per_gpu_share_of_every_shared_resource_is_the_full_nodes():
    for used in (1, 2, 4):
        share = DGX_H100.for_gpus(used)
        for attr in SHARED_BY_GPUS:
            assert getattr(share, attr) / used == pytest.approx(getattr(DGX_H100, attr) / 8), (used, attr)


def test_whole_nodes_are_untouched_and_shares_are_idempotent():
    assert DGX_H100.for_gpus(8) is DGX_H100 and DGX_H100.for_gpus(16) is DGX_H100
    share = DGX_H100.for_gpus(2)
    assert share.for_gpus(2) is share
    assert share.for_gpus(4) == DGX_H100.for_gpus(4)
    assert share.for_gpus(8) == DGX_H100  # back to the whole node
    assert NodeSpec.from_dict(share.to_dict()) == share  # a plan file keeps the share


def test_a_plan_bills_its_share_once():
    plan = Plan(model=resolve_model("1.4B"), node=DGX_H100, num_gpus=1)
    assert plan.node == DGX_H100.for_gpus(1)
    reloaded = Plan.from_dict(plan.to_dict())
    assert reloaded.node == plan.node and reloaded.node.cpu_memory_bytes == 256 * GIB
    assert Plan(model=resolve_model("1.4B"), node=DGX_H100, num_gpus=16).node is DGX_H100


def test_share_line_names_each_share():
    line = DGX_H100.for_gpus(1).share_line()
    assert line == ("8-GPU node, using 1 GPU: 1/8 of its DRAM (256 GiB), NVMe (3,576 GiB, 6.25/3.5 GB/s read/write), "
                    "host memory bandwidth (25 GB/s) and CPU optimizer (1.25 G params/s)")
    assert DGX_H100.share_line() == ""


def test_share_of_a_node_without_nvme_names_no_nvme():
    node = DGX_H100.replace(nvme_capacity_bytes=0.0, nvme_read_bytes_per_s=0.0, nvme_write_bytes_per_s=0.0)
    assert "NVMe" not in node.for_gpus(2).share_line()


@pytest.mark.parametrize("bad", [1, 8])
def test_whole_node_gpus_must_exceed_the_share(bad):
    doc = DGX_H100.to_dict() | {"num_gpus_per_node": 8, "whole_node_gpus": bad}
    with pytest.raises(Exception, match="whole_node_gpus"):
        NodeSpec.from_dict(doc)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_fit_memory_and_simulate_say_what_part_of_the_node_they_bill(tmp_path):
    expected = "8-GPU node, using 1 GPU: 1/8 of its DRAM (256 GiB)"
    plan_path = tmp_path / "plan.json"
    fit = _cli("fit", "1.4B", "--gpus", "1", "--out", str(plan_path))
    assert fit.returncode == 0, fit.stderr
    memory = _cli("memory", "1.4B", "--gpus", "1")
    simulate = _cli("simulate", str(plan_path))
    for result in (fit, memory, simulate):
        assert result.returncode == 0, result.stderr
        lines = [line for line in result.stdout.splitlines() if line.startswith("8-GPU node")]
        assert len(lines) == 1 and lines[0].startswith(expected)
    doc = json.loads(plan_path.read_text())
    assert doc["hardware"]["whole_node_gpus"] == 8 and doc["hardware"]["cpu_memory_gib"] == 256
    whole = _cli("fit", "1T", "--gpus", "16")
    assert whole.returncode == 0 and "GPU node, using" not in whole.stdout


def test_gpus_across_nodes_without_a_network_are_refused_in_one_line() -> None:
    """A preset that states no network between nodes (one-GPU machines) cannot plan two nodes: the
    prediction would be infinite and the plan file would hold `Infinity`, which is not JSON."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tierwise", "fit", "0.01T", "--gpus", "2", "--hardware",
                           "rtx4090-workstation", "--out", "/dev/null"], capture_output=True, text=True)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: --gpus 2 spans 2 rtx4090-workstation nodes, but the hardware states no network between nodes "
        "(inter_node_gb_per_s is 0): use at most 1 GPU(s), or a hardware file with inter_node_gb_per_s"]
