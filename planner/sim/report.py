"""Turn a finished simulation into the plan's `prediction` block (method `simulated`); `simulate`
runs one, and composes a pipelined or accumulating plan's step from its stage's (`composed_prediction`).

[Note: two memory views] Whether a plan fits is decided by the memory bill (`planner.cost.memory`), the
one the search ranks by and the runtime's memory test checks: `feasible`, `reason`, `peak_bytes`
and `memory_terms` come from it, so `fit` and `simulate` never disagree on a verdict. The
simulator's own view, bytes in use over time with the transient buffers it actually schedules, goes
to `details` (`simulated_peak_bytes`, `simulated_memory_terms`, `memory_timeline`); it is usually
below the bill, which adds every worst case at once plus allocator slack.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from planner.cost.memory import memory_bill
from planner.cost.pipeline import (
    compose_step,
    is_composed,
    quiet_plan,
    reduces_once,
    stage_plan,
    step_details,
)
from planner.cost.throughput import composed_link_bytes
from planner.sim.engine import Ranks, Simulation
from planner.sim.network import Link
from planner.specs.memory_terms import MemoryTerm
from planner.specs.phases import Phase
from planner.specs.plan import LINKS, Plan, Prediction

MAX_TIMELINE_POINTS = 400
"""Memory curves in the JSON are downsampled to this many points (each keeps its bucket's peak)."""


@dataclass(frozen=True, slots=True)
class MemoryCurve:
    """Bytes in use in one tier over the iteration (`TierTracker`'s record, or its extrapolation)."""

    name: str
    capacity_bytes: float
    scope: str
    points: list[tuple[float, float]]
    """(time, bytes in use) after every change, one point per instant, in time order."""
    peak_bytes: float
    peak_time_s: float
    """When the peak was first reached."""


@dataclass(frozen=True, slots=True)
class Timelines:
    """The simulated iteration as data: what the Gantt chart and the memory curves are drawn from
    (planner.output.timeline), from a whole simulation or extrapolated from a short one (periodic.py)."""

    phase_end_s: dict[Phase, float]
    num_segments: int
    intervals: dict[str, list[tuple[float, float, str]]]
    """Busy (start, end, label) of every resource, rank 0's links and the node's, in `rank0_links` order."""
    memory: dict[str, MemoryCurve]
    """Per tier, in its scope (the GPU's per GPU, the others per node)."""

    @property
    def iteration_time_s(self) -> float:
        return self.phase_end_s[Phase.OPTIMIZER]


@dataclass(frozen=True, slots=True)
class SimResult:
    plan: Plan
    prediction: Prediction
    timelines: Timelines
    simulation: Simulation | None = None
    """The finished simulation (links, trackers, trace) when the whole iteration was simulated;
    None when the timelines were extrapolated (periodic.simulate_periodic)."""
    events: int = 0
    """SimPy events simulated for it (the samples' when extrapolated): what its time is spent on."""


def simulate(plan: Plan, *, ranks: Ranks = "representative") -> SimResult:
    """Simulate one training iteration of `plan` and predict its cost. A pipelined or accumulating
    plan simulates its stage's micro-batch (the timelines) and composes the step from it."""
    if is_composed(plan):
        stage = simulate(stage_plan(plan), ranks=ranks)
        prediction = composed_prediction(plan, lambda p: stage.prediction if p == stage.plan else simulate(p).prediction)
        return SimResult(plan=plan, prediction=prediction, timelines=stage.timelines, simulation=stage.simulation,
                         events=stage.events)
    sim = Simulation(plan, ranks=ranks).run()
    return SimResult(plan=plan, prediction=build_prediction(sim), timelines=timelines_of(sim), simulation=sim,
                     events=sim.events)


def timelines_of(sim: Simulation) -> Timelines:
    return Timelines(
        phase_end_s=dict(sim.phase_end_s),
        num_segments=sim.work.num_segments,
        intervals={link.name: list(link.intervals) for link in rank0_links(sim)},
        memory={t.name: MemoryCurve(name=t.name, capacity_bytes=t.capacity_bytes, scope=t.scope, points=list(t.timeline),
                                    peak_bytes=t.peak_bytes, peak_time_s=t.peak_time_s)
                for t in sim.trackers.values()},
    )


def rank0_links(sim: Simulation) -> list[Link]:
    """One link per resource name: node-wide links and simulated rank 0's own."""
    seen: dict[str, Link] = {}
    for link in sim.links():
        seen.setdefault(link.name, link)
    return list(seen.values())


@dataclass(slots=True)
class Summary:
    """The numbers a prediction is made of, separable from the simulation (see fast.py)."""

    phase_end_s: dict[Phase, float]
    resources: dict[str, dict[str, Any]]
    """name -> busy_s, amount, unit, scope (rank 0's per-GPU links and the node's)."""
    link_bytes: dict[str, float]
    windows: dict[str, list[tuple[float, dict[MemoryTerm, float]]]]
    """tier -> (peak, terms at peak) before the optimizer step and during it."""
    capacity_bytes: dict[str, float]
    scope: dict[str, str]
    largest_gpu_allocation_bytes: float
    simulated_ranks: int
    memory_timeline: dict[str, list[list[float]]] | None = None
    memory_peak_time_s: dict[str, float] | None = None


def summarize(sim: Simulation, *, timelines: bool = True) -> Summary:
    trackers = sim.trackers.values()
    total = sim.iteration_time_s
    return Summary(
        phase_end_s=dict(sim.phase_end_s),
        resources={link.name: {"busy_s": link.busy_s, "amount": link.amount, "unit": link.unit, "scope": link.scope}
                   for link in rank0_links(sim)},
        link_bytes=dict(sim.link_bytes),
        windows={t.name: list(t.windows) for t in trackers},
        capacity_bytes={t.name: t.capacity_bytes for t in trackers},
        scope={t.name: t.scope for t in trackers},
        largest_gpu_allocation_bytes=sim.largest_gpu_allocation_bytes,
        simulated_ranks=len(sim.ranks),
        memory_timeline={t.name: downsample(t.timeline, total) for t in trackers} if timelines else None,
        memory_peak_time_s={t.name: t.peak_time_s for t in trackers} if timelines else None,
    )


def build_prediction(sim: Simulation) -> Prediction:
    return prediction_from(sim.plan, summarize(sim))


def prediction_from(plan: Plan, s: Summary, *, notes: dict[str, Any] | None = None) -> Prediction:
    total_s = s.phase_end_s[Phase.OPTIMIZER]
    forward_end, backward_end = s.phase_end_s[Phase.FORWARD], s.phase_end_s[Phase.BACKWARD]
    recompute = plan.recompute_interval > 0
    # Paper accounting (eq. 7): 8 * tokens * params with recompute, 6 * tokens * params without.
    flops = (8 if recompute else 6) * plan.tokens_per_iteration * plan.model.num_params
    resources = {name: {"busy_fraction": r["busy_s"] / total_s if total_s > 0 else 0.0, **r}
                 for name, r in s.resources.items()}
    bottleneck = max(resources, key=lambda name: resources[name]["busy_fraction"])
    peaks = {tier: max(windows, key=lambda w: w[0]) for tier, windows in s.windows.items()}
    bill = memory_bill(plan)
    details: dict[str, Any] = {
        "flops_accounting": f"paper eq. 7: {8 if recompute else 6} * tokens * params per iteration",
        "resources": resources,
        "tensor_parallel_bytes": round(s.link_bytes.get("tensor_parallel", 0.0)),
        "simulated_peak_bytes": {tier: round(peak) for tier, (peak, _) in peaks.items()},
        "simulated_memory_terms": {tier: {term.label: round(v) for term, v in terms.items()} for tier, (_, terms) in peaks.items()},
        "simulated_largest_gpu_allocation_bytes": round(s.largest_gpu_allocation_bytes),
        "memory_scope": dict(s.scope),
        "simulated_ranks": s.simulated_ranks,
    }
    if s.memory_timeline is not None:
        details["memory_timeline"] = s.memory_timeline
        details["memory_peak_time_s"] = s.memory_peak_time_s
    details.update(notes or {})
    return simulated_prediction(plan, bill, total_s, flops, bottleneck=bottleneck, details=details,
                                phase_time_s={Phase.FORWARD: forward_end, Phase.BACKWARD: backward_end - forward_end,
                                              Phase.OPTIMIZER: total_s - backward_end},
                                link_bytes={name: round(s.link_bytes.get(name, 0.0)) for name in LINKS})


def simulated_prediction(plan, bill, total_s: float, flops: float, **fields) -> Prediction:  # noqa: ANN001
    """A simulated `Prediction` of `plan` taking `total_s` per step for `flops`, with its memory `bill`."""
    return Prediction(
        feasible=bill.fits,
        reason=bill.reason(),
        iteration_time_s=total_s,
        tflops_per_gpu=flops / total_s / plan.num_gpus / 1e12 if total_s > 0 else 0.0,
        tokens_per_s=plan.tokens_per_iteration / total_s if total_s > 0 else 0.0,
        peak_bytes=bill.peak_bytes,
        capacity_bytes=bill.capacity_bytes,
        memory_terms=bill.terms,
        method="simulated",
        **fields,
    )


def composed_prediction(plan: Plan, predict_stage: Callable[[Plan], Prediction]) -> Prediction:
    """`plan`'s prediction from `predict_stage` (the fast or the full simulation) of its stage: the
    step of a pipelined or accumulating plan composed from one stage's simulated micro-batch ([Note:
    the 1F1B step] in planner/cost/pipeline.py). The analytic estimate composes its own stage
    estimate with the same `compose_step`, so the two differ only in how they time the stage."""
    stage = stage_plan(plan)
    full = predict_stage(stage)
    quiet = predict_stage(quiet_plan(stage)) if reduces_once(plan) else None
    fp = full.phase_time_s
    step = compose_step(plan, (fp["forward"], fp["backward"], fp["optimizer"]),
                        None if quiet is None else (quiet.phase_time_s["forward"], quiet.phase_time_s["backward"]))
    total_s = step.forward_s + step.backward_s + step.optimizer_s
    recompute = plan.recompute_interval > 0
    flops = (8 if recompute else 6) * plan.tokens_per_iteration * plan.model.num_params
    links = composed_link_bytes(plan, stage, {k: float(v) for k, v in full.link_bytes.items()},
                                None if quiet is None else {k: float(v) for k, v in quiet.link_bytes.items()})
    bill = memory_bill(plan)
    details = dict(full.details, pipeline=step_details(plan, step), stage_iteration_time_s=full.iteration_time_s)
    return simulated_prediction(plan, bill, total_s, flops, bottleneck=full.bottleneck, details=details, link_bytes=links,
                                phase_time_s={"forward": step.forward_s, "backward": step.backward_s,
                                              "optimizer": step.optimizer_s})


def downsample(timeline: list[tuple[float, float]], end_s: float) -> list[list[float]]:
    """Keep each bucket's peak so the curve never hides a maximum."""
    if len(timeline) <= MAX_TIMELINE_POINTS or end_s <= 0:
        return [[t, b] for t, b in timeline]
    width, last = end_s / MAX_TIMELINE_POINTS, MAX_TIMELINE_POINTS - 1
    # A curve is in time order, so its buckets come one after another: keep the current one's first
    # highest point, and emit it when the next bucket begins (a stretched curve has ~10^5 points).
    out: list[list[float]] = []
    kept_t, kept_b = timeline[0]
    key = min(int(kept_t / width), last)
    for t, b in timeline:
        k = int(t / width)
        if k > last:
            k = last
        if k != key:
            if k < key:
                return _downsample_any_order(timeline, width, last)
            out.append([kept_t, kept_b])
            key, kept_t, kept_b = k, t, b
        elif b > kept_b:
            kept_t, kept_b = t, b
    out.append([kept_t, kept_b])
    return out


def _downsample_any_order(timeline: list[tuple[float, float]], width: float, last: int) -> list[list[float]]:
    """`downsample` of points in any order: each bucket's first highest point, buckets in time order."""
    buckets: dict[int, tuple[float, float]] = {}
    for point in timeline:
        key = min(int(point[0] / width), last)
        kept = buckets.get(key)
        if kept is None or point[1] > kept[1]:
            buckets[key] = point
    return [[t, b] for t, b in (buckets[k] for k in sorted(buckets))]
