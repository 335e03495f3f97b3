"""Plans whose in-backward NVMe updates fall behind the backward are predicted from three short
samples, the compute stream and the update stream each growing by its own period ([Note: two
streams] in planner/sim/streams.py): the prediction and the critical path equal the whole
simulation's, on the runner-ups `planner fit 1T --gpus 16` ranks and on a small plan."""

import dataclasses

import pytest

from planner.output.critical_path import simulated_path, two_stream_path
from planner.output.verdict import critical_path
from planner.sim import fast, periodic, samples, simulate, streams
from planner.sim.periodic import NotPeriodic
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.phases import Phase
from planner.specs.plan import Placement, Plan


def one_t(layers: int = 128, **kw) -> Plan:
    return Plan(model=resolve_model("1T").replace(num_layers=layers), node=resolve_hardware(kw.pop("node", "dgx-h100")),
                num_gpus=16, optimizer_step="in_backward", **kw)


PLANS = {
    # `planner fit 1T --gpus 16`'s runner-ups: 4, 5 and 6 units for 128, and 3 of 2 blocks with tiling 8.
    "fit 1T runner-up, params on nvme": one_t(placement=Placement(params="nvme", gradients="cpu", optimizer_states="nvme",
                                                                  recompute_inputs="cpu"),
                                              micro_batch_per_gpu=32, recompute_interval=1),
    "fit 1T runner-up, tiling 8": one_t(placement=Placement(params="cpu", gradients="cpu", optimizer_states="nvme",
                                                            recompute_inputs="gpu"),
                                        micro_batch_per_gpu=15, recompute_interval=2, tiling_factor=8),
    "small, 16 blocks": one_t(16, placement=Placement(params="nvme", gradients="nvme", optimizer_states="nvme",
                                                      recompute_inputs="cpu"),
                              micro_batch_per_gpu=32, recompute_interval=1),
}


@pytest.fixture(scope="module", params=list(PLANS))
def pair(request):
    plan = PLANS[request.param]
    samples.forget_samples()
    return plan, fast.predict(plan), simulate(plan)


def test_the_prediction_comes_from_three_samples_and_equals_the_whole_simulation(pair):
    plan, mine, whole = pair
    unit = plan.recompute_interval or 1
    counts = mine.details["two_streams_from_layers"]
    assert [(n - counts[0]) // unit for n in counts] == [0, 1, 2]
    assert "extrapolated_from_layers" not in mine.details
    theirs = whole.prediction
    assert mine.iteration_time_s == pytest.approx(theirs.iteration_time_s, rel=1e-9)
    assert mine.phase_time_s == pytest.approx(theirs.phase_time_s, rel=1e-9, abs=1e-9 * theirs.iteration_time_s)
    assert mine.link_bytes == pytest.approx(theirs.link_bytes, rel=1e-9)
    assert mine.details["simulated_peak_bytes"] == pytest.approx(theirs.details["simulated_peak_bytes"], rel=1e-9)
    assert mine.bottleneck == theirs.bottleneck
    for name, r in theirs.details["resources"].items():
        assert mine.details["resources"][name]["amount"] == pytest.approx(r["amount"], rel=1e-9)
        # Links both streams use are not on a line; the check bounds them ([Note: two streams]).
        tolerance = streams.SHARED_BUSY * theirs.iteration_time_s
        assert mine.details["resources"][name]["busy_s"] == pytest.approx(r["busy_s"], abs=tolerance)
    if plan.model.num_layers == 128:  # deep enough that the samples are the smaller job
        assert sum(s.events for s in samples.simulate_samples(plan, counts)) < whole.events / 4


def test_the_critical_path_equals_the_whole_simulation(pair):
    plan, mine, whole = pair
    planned = plan.replace(prediction=mine)
    path = critical_path(planned)
    assert path == two_stream_path(planned, mine.details["two_streams_from_layers"])
    truth = simulated_path(plan, whole.timelines)
    for field in ("iteration_s", "compute_s", "waits_s", "step_s"):
        assert getattr(path, field) == pytest.approx(getattr(truth, field), rel=1e-9, abs=1e-9 * truth.iteration_s)
    assert path.bottleneck == truth.bottleneck
    assert next(iter(path.waits_by)) == next(iter(truth.waits_by))
    assert path.waits_by[next(iter(path.waits_by))] == pytest.approx(truth.waits_by[next(iter(truth.waits_by))], rel=1e-9)
    assert path.sentence() == truth.sentence()


def test_a_sample_off_the_line_is_simulated_whole(monkeypatch):
    plan = PLANS["small, 16 blocks"]
    samples.forget_samples()
    ss = streams.stream_samples(plan, fast.predict(plan).details["two_streams_from_layers"])
    a, b, c = (s.summary for s in ss.samples)
    real_end_s = periodic.extend(b, c, ss.repeats).phase_end_s  # the real depth's, as two_stream_summary checks
    streams.check_line(periodic.extend(a, b, 1), c, ss.repeats, real_end_s)
    moved = dataclasses.replace(c, phase_end_s={**c.phase_end_s, Phase.BACKWARD: c.phase_end_s[Phase.BACKWARD] * (1 + 1e-6)})
    with pytest.raises(NotPeriodic):
        streams.check_line(periodic.extend(a, b, 1), moved, ss.repeats, real_end_s)
    real = streams.check_line
    monkeypatch.setattr(streams, "check_line", lambda *args: real(args[0], moved, *args[2:]))
    predicted = fast.predict(plan)
    assert "two_streams_from_layers" not in predicted.details
    assert predicted == simulate(plan).prediction


def test_a_plan_that_keeps_up_is_extrapolated_as_before():
    # Optimizer states in host memory: the updates keep up, one periodic timeline (periodic.py).
    plan = one_t(16, placement=Placement(params="nvme", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu"),
                 micro_batch_per_gpu=32, recompute_interval=1)
    samples.forget_samples()
    assert isinstance(periodic.check_samples(plan), periodic.Verified)
    assert "extrapolated_from_layers" in fast.predict(plan).details


def test_a_backlog_that_shrinks_is_not_two_streams(monkeypatch):
    # 70B on 8 x dgx-h100, states on NVMe: the first units' updates start behind and catch up (at the
    # preset's fitted rates the samples' backlogs are 1.12, 1.04 and 0.99 s at micro-batch 7), so a line
    # through the samples would not describe the whole model.
    plan = Plan(model=resolve_model("70B"), node=resolve_hardware("dgx-h100"), num_gpus=8, optimizer_step="in_backward",
                placement=Placement(params="cpu", gradients="cpu", optimizer_states="nvme", recompute_inputs="gpu"),
                micro_batch_per_gpu=7, recompute_interval=2, attention="flash")
    samples.forget_samples()
    ss = streams.stream_samples(plan)
    backlogs = [streams.backlog_s(s) for s in ss.samples]
    assert backlogs[0] > backlogs[1] > backlogs[2]
    with pytest.raises(NotPeriodic):
        streams.two_stream_summary(plan)
    predicted = fast.predict(plan)
    assert "two_streams_from_layers" not in predicted.details
    assert predicted.iteration_time_s == pytest.approx(simulate(plan).prediction.iteration_time_s, rel=1e-9)



def test_a_plan_falling_behind_is_predicted_from_one_shallow_sample_beside_the_periodic_checks_first_pair(monkeypatch):
    # The first pair shows the backlog growing, so the unit below it is simulated and the three are
    # checked; the falling-behind test's second, deeper pair is never simulated.
    plan = PLANS["fit 1T runner-up, tiling 8"]
    samples.forget_samples()
    layers: list[int] = []
    real = samples.Simulation.run
    monkeypatch.setattr(samples.Simulation, "run", lambda self: layers.append(self.plan.model.num_layers) or real(self))
    predicted = fast.predict(plan)
    first = periodic.sample_units(plan, 0).layer_counts
    assert first == [6, 8]
    assert sorted(layers) == predicted.details["two_streams_from_layers"] == [4, 6, 8]
