"""The Timeline panel's extrapolated timelines equal the whole simulation's (planner/sim/periodic.py,
[Note: periodic timelines]): every busy interval, every memory step, the Gantt chart's bins and zoom,
and the prediction, on plans with tiling, a partial top segment, no recompute, tensor
parallelism, several nodes, and GPU / CPU / NVMe placements."""

import numpy as np
import pytest
from sim_support import ALL_CPU, ALL_NVME, GPU_OPTIMIZER, NVME_PARAMS, small

from planner.output.timeline import busy_bins, zoom_spans
from planner.sim import fast, periodic, samples, simulate
from planner.sim.periodic import NotPeriodic, check_equal, sample_units, simulate_periodic
from planner.sim.report import timelines_of
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.phases import Phase
from planner.specs.plan import Placement, Plan

PLANS = {
    # The dashboard's slow case (benchmarks/app_speed.py): 1T on 32 GPUs, tiling 8, parameters on NVMe, the rest on the CPU.
    "1T tiled, nvme params": Plan(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=32,
                                  placement=NVME_PARAMS, micro_batch_per_gpu=19, recompute_interval=4, tiling_factor=8),
    "partial top segment, cpu": Plan(model=small(30), node=resolve_hardware("dgx2-v100"), num_gpus=16, placement=ALL_CPU,
                                     micro_batch_per_gpu=4, recompute_interval=4),
    "all nvme, ci 1, vocab, 2 nodes": Plan(model=small(12, vocab_size=32000), node=resolve_hardware("dgx-a100-80g"),
                                           num_gpus=16, placement=ALL_NVME, micro_batch_per_gpu=2, recompute_interval=1),
    "no recompute, gpu optimizer, mp 2": Plan(model=small(10), node=resolve_hardware("dgx-h100"), num_gpus=8,
                                                  placement=GPU_OPTIMIZER, micro_batch_per_gpu=1, recompute_interval=0,
                                                  model_parallel_degree=2),
    # ZeRO-2 gathers the updated parameters after the step: the samples gather the real model's.
    "zero2 on the gpu, no recompute": Plan(model=small(10), node=resolve_hardware("dgx-a100-80g"), num_gpus=8,
                                           placement=Placement(params="gpu", gradients="gpu", optimizer_states="gpu",
                                                               recompute_inputs="gpu"),
                                           strategy="zero2", micro_batch_per_gpu=1, recompute_interval=0),
    # The CPU computes, states on NVMe: the after-backward step overlaps the forward (planner/sim/overlapped.py).
    "overlapped step, cpu machine": Plan(model=small(24, vocab_size=8000).replace(hidden_size=512, num_heads=8,
                                                                                 seq_len=256),
                                         node=resolve_hardware("cpu-dev-2core"), num_gpus=1, placement=ALL_NVME,
                                         micro_batch_per_gpu=1, recompute_interval=1, prefetch_depth=2),
}


@pytest.fixture(scope="module", params=list(PLANS))
def pair(request):
    plan = PLANS[request.param]
    return simulate_periodic(plan), simulate(plan)


def test_timelines_are_extrapolated_and_equal_the_whole_simulation(pair):
    fast, full = pair
    assert fast.simulation is None, "the plan is deep enough: the timelines must come from the short samples"
    check_equal(fast.timelines, timelines_of(full.simulation))  # raises NotPeriodic on any difference
    assert fast.timelines.num_segments == full.simulation.work.num_segments


def test_gantt_bins_and_zoom_equal_the_whole_simulation(pair):
    fast, full = pair
    total = full.timelines.iteration_time_s
    mine, theirs = busy_bins(fast, 300), busy_bins(full, 300)
    assert [b["resource"] for b in mine] == [b["resource"] for b in theirs]
    for key in ("start_s", "end_s", "busy", "forward_share", "recompute_share", "backward_share", "optimizer_share"):
        a = np.array([b.get(key, 0.0) for b in mine])
        b = np.array([b.get(key, 0.0) for b in theirs])
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-9 * (total if key.endswith("_s") else 1))
    # A bin's colour is its largest phase share; where two phases share a bin equally it is either.
    for m, t in zip(mine, theirs, strict=True):
        assert m[f"{m['phase']}_share"] == pytest.approx(t[f"{t['phase']}_share"], abs=1e-9)
    (lo, hi), spans = zoom_spans(fast)
    (lo2, hi2), spans2 = zoom_spans(full)
    assert (lo, hi) == pytest.approx((lo2, hi2), rel=1e-9)
    assert [(s["resource"], s["phase"]) for s in spans] == [(s["resource"], s["phase"]) for s in spans2]
    assert [s["start_s"] for s in spans] == pytest.approx([s["start_s"] for s in spans2], rel=1e-9)


def test_memory_curves_and_peaks_equal_the_whole_simulation(pair):
    fast, full = pair
    for tier, curve in full.timelines.memory.items():
        mine = fast.timelines.memory[tier]
        assert mine.peak_bytes == pytest.approx(curve.peak_bytes, rel=1e-9)
        assert len(mine.points) == len(curve.points)
        assert np.allclose(np.array(mine.points), np.array(curve.points), rtol=1e-9, atol=0)
        if not curve.points:  # nothing ever lives in this tier
            continue
        # The extrapolated peak time holds the peak in the whole simulation too.
        times = np.array([t for t, _ in curve.points])
        at = np.searchsorted(times, mine.peak_time_s * (1 + 1e-12), side="right") - 1
        assert curve.points[at][1] == pytest.approx(curve.peak_bytes, rel=1e-9)


def test_prediction_equals_the_whole_simulation(pair):
    fast, full = pair
    f, s = fast.prediction, full.prediction
    assert f.iteration_time_s == pytest.approx(s.iteration_time_s, rel=1e-9)
    assert f.phase_time_s == pytest.approx(s.phase_time_s, rel=1e-9)
    assert f.bottleneck == s.bottleneck
    assert f.link_bytes == pytest.approx(s.link_bytes, rel=1e-9)
    for name, r in s.details["resources"].items():
        assert f.details["resources"][name]["busy_s"] == pytest.approx(r["busy_s"], rel=1e-9)
        assert f.details["resources"][name]["amount"] == pytest.approx(r["amount"], rel=1e-9)
    assert f.details["simulated_peak_bytes"] == pytest.approx(s.details["simulated_peak_bytes"], rel=1e-9)
    assert set(f.details["memory_timeline"]) == {"gpu", "cpu", "nvme"}


def test_planner_simulates_fewer_events_for_the_same_prediction(pair):
    # `planner simulate` without --timeline: the memory curves stretched, no busy interval.
    fast, full = pair
    plan = full.plan
    quick = simulate_periodic(plan, intervals=False)
    assert quick.timelines.intervals == {}
    assert quick.prediction.iteration_time_s == pytest.approx(full.prediction.iteration_time_s, rel=1e-9)
    assert quick.prediction.details["simulated_peak_bytes"] == fast.prediction.details["simulated_peak_bytes"]
    assert quick.prediction.details["memory_timeline"] == fast.prediction.details["memory_timeline"]
    assert quick.events == fast.events > 0  # the same two samples
    sampled = sum(quick.prediction.details["extrapolated_from_layers"])
    if sampled < plan.model.num_layers:  # deep enough that the samples are the smaller job
        assert quick.events < full.events


def test_shallow_models_are_simulated_whole():
    plan = PLANS["partial top segment, cpu"].replace(model=small(12))
    assert sample_units(plan) is None
    result = simulate_periodic(plan)
    assert result.simulation is not None and result.prediction == simulate(plan).prediction


def test_check_equal_rejects_a_moved_interval():
    full = simulate(PLANS["partial top segment, cpu"])
    tl = timelines_of(full.simulation)
    check_equal(tl, tl)
    moved = dict(tl.intervals)
    a, b, label = moved["h2d"][5]
    moved["h2d"] = [*moved["h2d"][:5], (a, b + 1e-6 * tl.iteration_time_s, label), *moved["h2d"][6:]]
    with pytest.raises(NotPeriodic):
        check_equal(tl.__class__(tl.phase_end_s, tl.num_segments, moved, tl.memory), tl)


def test_the_panel_reuses_the_samples_refine_simulated(monkeypatch):
    # [Note: shared samples]: predict (refine's stage) keeps its samples; the Timeline panel's
    # extrapolation of the same plan then simulates nothing and gives the same timelines.
    plan = PLANS["partial top segment, cpu"]
    monkeypatch.setattr(samples, "_kept", samples.OrderedDict())
    alone = simulate_periodic(plan)
    monkeypatch.setattr(samples, "_kept", samples.OrderedDict())
    predicted = fast.predict(plan)
    assert predicted.details["extrapolated_from_layers"] == sample_units(plan).layer_counts
    monkeypatch.setattr(samples.Simulation, "run", lambda self: pytest.fail("a kept sample was simulated again"))
    shared = simulate_periodic(plan)
    assert shared.timelines == alone.timelines and shared.prediction == alone.prediction


def test_a_queue_falling_behind_is_simulated_whole_after_two_pairs(monkeypatch):
    # [Note: a queue that falls behind]: the in-backward updates of states on NVMe take longer per
    # unit than the backward they follow, so each pair's longer sample ends its backward later than
    # the stretched shorter one by the same lag; the third, deeper pair is not simulated, and the
    # timelines are the whole simulation's.
    placement = Placement(params="nvme", gradients="cpu", optimizer_states="nvme", recompute_inputs="cpu")
    plan = Plan(model=resolve_model("1T").replace(num_layers=12), node=resolve_hardware("dgx-h100"), num_gpus=16,
                placement=placement, micro_batch_per_gpu=32, recompute_interval=1, optimizer_step="in_backward")
    monkeypatch.setattr(samples, "_kept", samples.OrderedDict())
    monkeypatch.setattr(samples, "_whole", samples.OrderedDict())
    asked: list[list[int]] = []
    real = periodic.simulate_samples
    monkeypatch.setattr(periodic, "simulate_samples", lambda p, counts: asked.append(counts) or real(p, counts))
    assert periodic.verified_samples(plan) is None
    assert asked == [sample_units(plan, 0).layer_counts, sample_units(plan, 1).layer_counts]
    lags = []
    for counts in asked:
        shorter, longer = real(plan, counts)
        w = periodic.windows(shorter, sample_units(plan, asked.index(counts)).window_unit)
        stretched = periodic.stretch(shorter.timelines, w, 1, periodic._resident_growth(shorter.plan, longer.plan))
        lags.append(periodic._phase_lag(stretched, longer.timelines)[Phase.BACKWARD])
    assert lags[0] > 0.1  # seconds per unit the updates fall further behind
    assert lags[1] == pytest.approx(lags[0], rel=1e-9)
    assert isinstance(periodic.check_samples(plan), periodic.FallsBehind)
    whole = simulate(plan)
    # The prediction comes from the three samples ([Note: two streams], tests/test_sim_streams.py).
    predicted = fast.predict(plan)
    assert simulate_periodic(plan).simulation is not None  # the timelines are the whole simulation's
    # One unit below the periodic check's first pair, and that pair (streams.py `stream_sample_sets`).
    assert predicted.details["two_streams_from_layers"] == [3, 4, 5]
    assert predicted.iteration_time_s == pytest.approx(whole.prediction.iteration_time_s, rel=1e-9)


def test_a_settling_pipeline_is_not_taken_for_a_queue_falling_behind():
    lag = {Phase.FORWARD: 0.0, Phase.BACKWARD: 0.3, Phase.OPTIMIZER: 0.3}
    assert periodic._falls_behind(lag, dict(lag), 100.0)
    assert not periodic._falls_behind(lag, {**lag, Phase.BACKWARD: 0.2, Phase.OPTIMIZER: 0.2}, 100.0)  # shrinking
    assert not periodic._falls_behind(dict.fromkeys(lag, 0.0), dict.fromkeys(lag, 0.0), 100.0)
    assert not periodic._falls_behind(lag, None, 100.0)
