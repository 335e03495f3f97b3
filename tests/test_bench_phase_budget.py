"""The NVMe benchmark's per-phase budget splits a step's measured bytes by the schedule in
docs/nvme.md: after backward the forward and the backward share the reads the optimizer does not
make (the backward reads only what the forward did not keep gathered, the forward only the shards
the overlapped step did not hand over); with the optimizer step in backward no gradient goes to
NVMe and the update's traffic is the backward's."""

import pytest

from planner.calibration.phase_budget import phase_budget

OPTIMIZER_STEP = {"ours-nvme": "after_backward", "ours-nvme-ib": "in_backward"}
"""The benchmark's systems -> their plans' `optimizer_step` (benchmarks/bench_nvme_step.py)."""


def run_of(param_bytes: int, kept_bytes: int, system: str = "ours-nvme", handed_bytes: int = 0) -> dict:
    if system == "ours-nvme":  # forward P less the handed shards, backward P - kept, optimizer 4P
        reads, writes = 6 * param_bytes - kept_bytes - handed_bytes, 4 * param_bytes
    else:  # in backward: forward P, backward P - kept + 3P of states; 3P of states written
        reads, writes = 5 * param_bytes - kept_bytes, 3 * param_bytes
    return {"io_bytes": {system: [[reads, writes]]},
            "phase_time_s": {system: [{"forward": 1.0, "backward": 2.0, "optimizer": 8.0}]},
            "adjacent_rooflines": {system: [{"read_bytes_per_s": 100.0, "write_bytes_per_s": 50.0}]}}


def test_after_backward_the_forward_and_backward_share_the_reads_the_optimizer_does_not_make():
    budget = phase_budget([run_of(param_bytes=400, kept_bytes=100)], "ours-nvme", "after_backward")
    assert list(budget) == ["forward + backward", "optimizer"]
    assert budget["forward + backward"]["ideal_disk_s"] == pytest.approx(700 / 100 + 400 / 50)
    assert budget["optimizer"]["ideal_disk_s"] == pytest.approx(1600 / 100 + 1200 / 50)
    assert budget["forward + backward"]["median_ratio"] == pytest.approx(3.0 / 15.0)


def test_shards_the_overlapped_step_handed_over_are_reads_the_forward_did_not_make():
    budget = phase_budget([run_of(param_bytes=400, kept_bytes=100, handed_bytes=300)], "ours-nvme", "after_backward")
    assert budget["forward + backward"]["ideal_disk_s"] == pytest.approx(400 / 100 + 400 / 50)
    assert budget["optimizer"]["ideal_disk_s"] == pytest.approx(1600 / 100 + 1200 / 50)


def test_in_backward_the_update_traffic_is_the_backwards():
    budget = phase_budget([run_of(param_bytes=400, kept_bytes=100, system="ours-nvme-ib")], "ours-nvme-ib",
                          "in_backward")
    assert list(budget) == ["forward", "backward + optimizer"]
    assert budget["forward"]["ideal_disk_s"] == pytest.approx(400 / 100)
    assert budget["backward + optimizer"]["ideal_disk_s"] == pytest.approx((300 + 1200) / 100 + 1200 / 50)
    assert budget["backward + optimizer"]["median_s"] == pytest.approx(10.0)


@pytest.mark.parametrize(("system", "kept_bytes"), [("ours-nvme", -500), ("ours-nvme-ib", 500)])
def test_bytes_off_the_schedule_are_refused(system, kept_bytes):
    with pytest.raises(AssertionError):  # after backward: reads beyond two passes; in backward: fewer than 4P
        phase_budget([run_of(param_bytes=400, kept_bytes=kept_bytes, system=system)], system, OPTIMIZER_STEP[system])
