"""The planner's predictions for a recorded H200 run's planner chains (`planner probe` -> `fit` ->
`run --model` -> `compare`, benchmarks/gpu/planner_chain.py), from a cut of the recorded documents:
tests/data/h200_2026_11_28_planner_chains.json holds the probe's hardware spec, each chain's plan and
the measured phases of its profile. The plans are simulated here as `planner simulate` does, and each
phase is held to the band this checkout reaches (docs/notes/2026-11-28-offload-prediction-h200.md);
the kit's target is 15 % per phase, met where the band is 0.15.
"""

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from planner.calibration.compare import IN_BACKWARD_STEP_PHASES, compare
from planner.sim import simulate
from planner.specs.plan import Plan
from planner.specs.profile import Profile

FIXTURE = json.loads((Path(__file__).parent / "data" / "h200_2026_11_28_planner_chains.json").read_text())

BANDS = {
    # chain: {metric: largest |relative error| reached}
    "cpu": {"phase_time_s.forward": 0.15, IN_BACKWARD_STEP_PHASES: 0.30, "iteration_time_s": 0.30},
    "nvme": {"phase_time_s.forward": 0.30, IN_BACKWARD_STEP_PHASES: 0.20, "iteration_time_s": 0.20},
    "device": {"phase_time_s.forward": 0.25, IN_BACKWARD_STEP_PHASES: 0.20, "iteration_time_s": 0.20},
}
"""cpu: the forward is met (-12 %); backward + optimizer -26 % (the host-memory contention of the
in-backward step beyond what the fluid model shares, not met); nvme: forward +26 % and backward +
optimizer -19 % (not met); device: +21 % and +18 %, the GPU compute terms of the fitted H200 preset
(not met)."""


@functools.cache
def _chain(name: str) -> tuple[Plan, Profile]:
    chain = FIXTURE["chains"][name]
    plan = Plan.from_dict(chain["plan"] | {"hardware": FIXTURE["hardware"]})
    plan = plan.replace(prediction=simulate(plan).prediction)
    measured = chain["measured"]
    profile = Profile(measured=dataclasses.replace(plan.prediction, iteration_time_s=measured["iteration_time_s"],
                                                       phase_time_s=measured["phase_time_s"],
                                                       link_bytes=measured["link_bytes"]),
                      samples=(), warmup_steps=1, plan=chain["plan"])
    return plan, profile


@pytest.fixture(scope="module", params=sorted(BANDS))
def chain(request):
    return request.param, *_chain(request.param)


def test_each_phase_is_within_the_band_reached(chain):
    name, plan, profile = chain
    rows = {row.metric: row for row in compare(plan, profile)}
    for metric, band in BANDS[name].items():
        error = rows[metric].relative_error
        assert error is not None and abs(error) <= band, (name, metric, error)


LINK_BANDS = {"cpu": 0.05, "nvme": 0.20, "device": 0.0}
"""The host links' bytes: the host plan's within 5 %; the NVMe plan's h2d +17 % (1.23 GB predicted,
1.05 GB moved; not examined); the device plan moves none."""


def test_the_link_bytes_are_within_the_band_reached(chain):
    name, plan, profile = chain
    rows = {row.metric: row for row in compare(plan, profile)}
    for link in ("h2d", "d2h"):
        row = rows[f"link_bytes.{link}"]
        if row.measured == 0:
            assert row.predicted == 0, (name, link, row)
        else:
            assert abs(row.relative_error) <= LINK_BANDS[name], (name, link, row)


def test_the_host_plans_backward_waits_for_the_host_memory():
    # Every state in host memory, the step in backward: the GPU computes 0.39 s of the iteration, but
    # the host memory carries CPU Adam (1.1 G parameters at 4.38 G/s alone), the update's cast into
    # the bf16 shards (6 B a parameter), the gradients' landing (6 B a gradient byte) and both DMAs,
    # and the backward waits for it: it was predicted 0.29 s against 0.73 s measured before these
    # terms, -60 %.
    _, plan, profile = chain_named("cpu")
    resources = plan.prediction.details["resources"]
    assert resources["host_memory"]["busy_s"] > resources["gpu_compute"]["busy_s"]
    rows = {row.metric: row for row in compare(plan, profile)}
    assert rows[IN_BACKWARD_STEP_PHASES].relative_error > -0.30


def chain_named(name: str) -> tuple[str, Plan, Profile]:
    return name, *_chain(name)
