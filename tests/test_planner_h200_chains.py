"""The planner's predictions for the recorded H200 runs' planner chains (`planner probe` -> `fit` ->
`run --model` -> `compare`, benchmarks/gpu/planner_chain.py), from cuts of the recorded documents:
tests/data/h200_2026_11_28_planner_chains.json (the first run's call 1) and
tests/data/h200_2026_11_28_call5_planner_chains.json (call 5, the day's second H200 run) hold the probe's
hardware spec, each chain's plan and the measured phases and link bytes of its profile. The plans are
simulated here as `planner simulate` does, and each phase is held to the band this checkout reaches
(docs/notes/2026-11-28-offload-prediction-h200.md,
docs/notes/2026-11-28-offload-prediction-h200-second-lease.md); the kit's target is 15 % per phase,
met where the band is 0.15.
"""

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from planner.calibration.compare import IN_BACKWARD_STEP_PHASES, compare
from planner.sim import simulate
from planner.sim.workload import build_workload, forward_tail_kept
from planner.specs.plan import Plan
from planner.specs.profile import Profile

DATA = Path(__file__).parent / "data"
FIXTURES = {"call1": "h200_2026_11_28_planner_chains.json", "call5": "h200_2026_11_28_call5_planner_chains.json"}

FORWARD, ITERATION = "phase_time_s.forward", "iteration_time_s"
BANDS = {
    # (run, chain): {metric: largest |relative error| reached}
    ("call1", "cpu"): {FORWARD: 0.15, IN_BACKWARD_STEP_PHASES: 0.30, ITERATION: 0.30},
    ("call1", "nvme"): {FORWARD: 0.10, IN_BACKWARD_STEP_PHASES: 0.20, ITERATION: 0.20},
    ("call1", "device"): {FORWARD: 0.25, IN_BACKWARD_STEP_PHASES: 0.20, ITERATION: 0.20},
    ("call5", "cpu"): {FORWARD: 0.30, IN_BACKWARD_STEP_PHASES: 0.35, ITERATION: 0.35},
    ("call5", "nvme"): {FORWARD: 0.75, IN_BACKWARD_STEP_PHASES: 0.20, ITERATION: 0.25},
    ("call5", "device"): {FORWARD: 0.15, IN_BACKWARD_STEP_PHASES: 0.20, ITERATION: 0.15},
}
"""call1: cpu forward met (-13 %), backward + optimizer -26 % (not met); nvme forward met (+7 %),
backward + optimizer -20 % (not met); device +21 % and +18 %, the GPU compute terms of the fitted
H200 preset (not met). call5: cpu -26 % and -32 % (the runtime's host thread in the forward and its
optimizer worker in the backward, not met); nvme +73 % and +16 % (the drive served the run's reads
faster than the probe measured it: the forward read its 614 MB of parameters at 2.2 GB/s or more,
against the probed 1.64; not met); device +14 % (met) and +19 % (not met)."""


@functools.cache
def _fixture(run: str) -> dict:
    return json.loads((DATA / FIXTURES[run]).read_text())


@functools.cache
def _chain(run: str, name: str) -> tuple[Plan, Profile]:
    fixture = _fixture(run)
    chain = fixture["chains"][name]
    plan = Plan.from_dict(chain["plan"] | {"hardware": fixture["hardware"]})
    plan = plan.replace(prediction=simulate(plan).prediction)
    measured = chain["measured"]
    profile = Profile(measured=dataclasses.replace(plan.prediction, iteration_time_s=measured["iteration_time_s"],
                                                       phase_time_s=measured["phase_time_s"],
                                                       link_bytes=measured["link_bytes"]),
                      samples=(), warmup_steps=1, plan=chain["plan"])
    return plan, profile


@pytest.fixture(scope="module", params=sorted(BANDS), ids=lambda key: "-".join(key))
def chain(request):
    return request.param, *_chain(*request.param)


def test_each_phase_is_within_the_band_reached(chain):
    key, plan, profile = chain
    rows = {row.metric: row for row in compare(plan, profile)}
    for metric, band in BANDS[key].items():
        error = rows[metric].relative_error
        assert error is not None and abs(error) <= band, (key, metric, error)


LINK_BAND = 0.001
"""Every host link's and the drive's bytes, each way, within 0.1 % (the largest difference: 0.009 %,
the host plans' d2h): the parameter reads of both passes, less the forward's tail kept gathered for the
backward ([Note: the forward's tail stays gathered, simulated] in planner/sim/workload.py; before it,
h2d was +4 % on the host plans and +17 % on the NVMe plans), the gradients off the GPU, the states
to and from the drive."""


def test_the_link_bytes_are_the_runs(chain):
    key, plan, profile = chain
    rows = {row.metric: row for row in compare(plan, profile)}
    for link in ("h2d", "d2h", "nvme_read", "nvme_write"):
        row = rows[f"link_bytes.{link}"]
        if row.measured == 0:
            assert row.predicted == 0, (key, link, row)
        else:
            assert abs(row.relative_error) <= LINK_BAND, (key, link, row)


def test_the_forwards_tail_is_not_read_again():
    # The NVMe plan of call 5 (4 layers of the 1.1 B Llama, bf16): the runtime read 1.052 GB of
    # parameters (P = 614.5 MB in the forward, the backward's P less the head and two of the last
    # block's MLP linears, 177 MB, which stayed gathered); at the probed 1.64 GB/s those 177 MB are
    # 0.11 s of the drive, which the simulation used to spend inside the forward (the backward's
    # first reads start during the forward's tail) and in the backward.
    _, plan, profile = chain_named("call5", "nvme")
    kept_bytes = 65_536_000 * 2 + 2 * 11_534_336 * 2
    parameter_bytes = plan.model.num_params * 2
    assert plan.prediction.link_bytes["h2d"] == pytest.approx(2 * parameter_bytes - kept_bytes, rel=1e-3)
    assert profile.measured.link_bytes["h2d"] == pytest.approx(2 * parameter_bytes - kept_bytes, rel=1e-3)
    rows = {row.metric: row for row in compare(plan, profile)}
    assert rows[FORWARD].predicted < 0.48  # 0.559 s before


def test_the_host_plans_backward_waits_for_the_host_memory():
    # Every state in host memory, the step in backward: the GPU computes 0.39 s of the iteration, but
    # the host memory carries CPU Adam (1.1 G parameters at 4.38 G/s alone), the update's cast into
    # the bf16 shards (6 B a parameter), the gradients' landing (6 B a gradient byte) and both DMAs,
    # and the backward waits for it: it was predicted 0.29 s against 0.73 s measured before these
    # terms, -60 %.
    _, plan, profile = chain_named("call1", "cpu")
    resources = plan.prediction.details["resources"]
    assert resources["host_memory"]["busy_s"] > resources["gpu_compute"]["busy_s"]
    rows = {row.metric: row for row in compare(plan, profile)}
    assert rows[IN_BACKWARD_STEP_PHASES].relative_error > -0.30


def chain_named(run: str, name: str) -> tuple[tuple[str, str], Plan, Profile]:
    return (run, name), *_chain(run, name)


@pytest.mark.parametrize(("depth", "recompute_interval", "kept"), [
    (3, 0, ["lm_head", "mlp_up", "mlp_gate"]),  # the down projection: the final norm is used after it
    (2, 0, ["lm_head", "mlp_up"]),
    (1, 0, ["lm_head"]),
    (0, 0, []),
    (3, 1, ["lm_head"]),  # the backward opens with the last block's recompute, in forward order
])
def test_the_units_the_forward_keeps_for_the_backward(depth, recompute_interval, kept):
    _, plan, _ = chain_named("call5", "nvme")
    plan = plan.replace(prefetch_depth=depth, recompute_interval=recompute_interval)
    steps = build_workload(plan).steps
    pairs = forward_tail_kept(steps, depth, plan.model.num_layers)
    assert [steps[i].op.name for i in sorted(pairs, reverse=True)] == kept
    for forward, backward in pairs.items():
        assert steps[forward].op is steps[backward].op and steps[forward].block == steps[backward].block
