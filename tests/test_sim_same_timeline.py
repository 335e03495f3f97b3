"""The simulator's cheaper paths give the timeline of the plain ones, bit for bit: prefetches run
without SimPy's process events ([Note: unwatched processes] in planner/sim/engine.py), the periodic
stretch's slicing of busy intervals and the memory curves' downsampling, each against a plain
reference (the code they replaced, kept here); and the cyclic collector, paused while a simulation
runs, is back on after it."""

import gc
import random
from bisect import bisect_left

import pytest
from sim_support import ALL_CPU, ALL_NVME, NVME_PARAMS, small

import planner.sim.engine as engine
from planner.sim import samples
from planner.sim.engine import Simulation
from planner.sim.network import collector_paused
from planner.sim.periodic import (
    _continues,
    _pieces,
    _resident_growth,
    _stretch_intervals,
    sample_units,
    windows,
)
from planner.sim.report import MAX_TIMELINE_POINTS, _downsample_any_order, downsample
from planner.sim.workload import forward_tail_kept
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.plan import Plan

PLANS = {
    # The plan `benchmarks/sim_speed.py` times, three blocks deep: tiling 8, everything on NVMe.
    "1T tiled, all nvme": Plan(model=resolve_model("1T").replace(num_layers=3), node=resolve_hardware("dgx2-v100"),
                               num_gpus=16, placement=ALL_NVME, strategy="zero-inf-nvme", micro_batch_per_gpu=15,
                               recompute_interval=1, tiling_factor=8),
    "cpu params, 2 nodes, vocab": Plan(model=small(6, vocab_size=32000), node=resolve_hardware("dgx-a100-80g"),
                                       num_gpus=16, placement=ALL_CPU, micro_batch_per_gpu=2, recompute_interval=2),
    "step in backward, nvme": Plan(model=resolve_model("1T").replace(num_layers=4), node=resolve_hardware("dgx-h100"),
                                   num_gpus=16, placement=NVME_PARAMS, micro_batch_per_gpu=32, recompute_interval=1,
                                   optimizer_step="in_backward"),
    # The CPU computes with states on NVMe: the step overlaps the next forward, whose prefetches wait for it.
    "overlapped step, cpu machine": Plan(model=small(6, vocab_size=8000).replace(hidden_size=512, num_heads=8, seq_len=256),
                                         node=resolve_hardware("cpu-dev-2core"), num_gpus=1, placement=ALL_NVME,
                                         micro_batch_per_gpu=1, recompute_interval=1, prefetch_depth=2),
}


def everything(sim: Simulation) -> dict:
    """All a finished simulation records, as plain data compared with ==."""
    return {
        "phase_end_s": sim.phase_end_s,
        "unit_start_s": sim.unit_start_s,
        "link_bytes": sim.link_bytes,
        "largest": sim.largest_gpu_allocation_bytes,
        "links": [(link.name, link.scope, link.busy_s, link.amount, link.intervals) for link in sim.links()],
        "memory": {name: (t.timeline, t.windows, t.peak_bytes, t.peak_time_s, t.peak_by_term)
                   for name, t in sim.trackers.items()},
    }


@pytest.mark.parametrize("name", list(PLANS))
def test_prefetches_without_process_events_give_the_same_timeline(name, monkeypatch):
    plan = PLANS[name]
    cheap = Simulation(plan).run()
    reference = Simulation(plan)
    monkeypatch.setattr(engine, "run_unwatched", reference.env.process)  # each prefetch a SimPy process
    reference.run()
    assert everything(cheap) == everything(reference)  # every float equal, not close
    # A process's start and end per prefetch; the backward's head kept gathered since its forward
    # fetches nothing ([Note: the forward's tail stays gathered, simulated] in planner/sim/workload.py).
    fetched = len(cheap.work.steps) - len(forward_tail_kept(cheap.work.steps, plan.prefetch_depth, plan.model.num_layers))
    assert reference.events - cheap.events == 2 * fetched


@pytest.mark.parametrize("name", list(PLANS))
def test_every_timer_follows_the_rates_a_full_allocation_gives(name, monkeypatch):
    # [Note: a lone flow changes no other rate] in planner/sim/network.py: where a flow starts or ends
    # alone on its links the network keeps the other flows' rates and only sets the next timer. At
    # every timer, a full max-min allocation of the flows then flowing must give the rates they have.
    from planner.sim import network

    timers = []
    next_timer = network.Network._next_timer

    def checked(self):  # noqa: ANN001, ANN202
        rates = [flow.rate for flow in self.flows]
        if len(self.flows) == 1:
            self.flows[0].rate = self.flows[0].alone_rate
        else:
            network._max_min_rates(self.flows)
        assert [flow.rate for flow in self.flows] == rates
        timers.append(len(self.flows))
        next_timer(self)

    monkeypatch.setattr(network.Network, "_next_timer", checked)
    Simulation(PLANS[name]).run()
    assert len(timers) > 100 and max(timers) > 1


def test_an_unwatched_process_must_begin_by_waiting():
    sim = Simulation(PLANS["cpu params, 2 nodes, vocab"])
    ready = sim.env.event().succeed()

    def proc():
        yield ready

    with pytest.raises(AssertionError, match="must begin by waiting"):
        engine.run_unwatched(proc())


def reference_stretch_intervals(spans, pieces):
    """`_stretch_intervals` as it was: every span of a piece clipped to it."""
    spans = sorted(spans)
    ends = [b for _, b, _ in spans]
    out = []
    for p in pieces:
        inside = []
        for a, b, label in spans[bisect_left(ends, p.lo):]:
            if a >= p.hi:
                break
            if b > p.lo:
                inside.append((max(a, p.lo), min(b, p.hi), label))
        for m in range(p.copies):
            shift = p.shift_s + m * p.period_s
            copy = [(a + shift, b + shift, label) for a, b, label in inside]
            if copy and _continues(out, copy[0]):
                out[-1] = (out[-1][0], copy[0][1], copy[0][2])
                copy = copy[1:]
            out += copy
    return out


@pytest.mark.parametrize("name", ["1T tiled, all nvme", "cpu params, 2 nodes, vocab"])
def test_stretched_intervals_equal_the_plain_slicing(name):
    plan = PLANS[name]
    deep = plan.replace(model=plan.model.replace(num_layers=40))
    pair = sample_units(deep)
    shorter, _ = samples.simulate_samples(deep, pair.layer_counts)
    pieces = _pieces(shorter.timelines, windows(shorter, pair.window_unit), 7, _resident_growth(shorter.plan, deep))
    for spans in shorter.timelines.intervals.values():
        assert _stretch_intervals(spans, pieces) == reference_stretch_intervals(spans, pieces)


def test_downsampled_curves_equal_the_bucket_table():
    rng = random.Random(7)
    t, points = 0.0, []
    for _ in range(20 * MAX_TIMELINE_POINTS):
        t += rng.choice((0.0, rng.random()))  # an instant may repeat
        points.append((t, float(rng.randrange(50))))  # equal values: the first highest point of a bucket is kept
    width = t / MAX_TIMELINE_POINTS
    assert downsample(points, t) == _downsample_any_order(points, width, MAX_TIMELINE_POINTS - 1)
    shuffled = points[:]
    rng.shuffle(shuffled)
    assert downsample(shuffled, t) == _downsample_any_order(shuffled, width, MAX_TIMELINE_POINTS - 1)


def test_the_collector_is_paused_while_simulating_and_restored_after():
    sim = Simulation(PLANS["cpu params, 2 nodes, vocab"])
    during = []

    def look():
        yield sim.env.timeout(0)
        during.append(gc.isenabled())

    sim.env.process(look())
    assert gc.isenabled()
    sim.run()
    assert during == [False] and gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # left as it was found
    finally:
        gc.enable()
    with pytest.raises(ValueError), collector_paused():
        raise ValueError
    assert gc.isenabled()
