"""Turn a finished simulation into the DESIGN.md `prediction` block (method `simulated`)."""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan import LINKS, Plan, Prediction
from planner.sim.engine import Ranks, Simulation
from planner.sim.network import Link
from planner.sim.tiers import TierTracker
from planner.units import GIB

MAX_TIMELINE_POINTS = 400
"""Memory curves in the JSON are downsampled to this many points (each keeps its bucket's peak)."""


@dataclass(frozen=True, slots=True)
class SimResult:
    plan: Plan
    prediction: Prediction
    simulation: Simulation
    """The finished simulation: links with busy intervals, tier timelines (for the Gantt chart)."""


def simulate(plan: Plan, *, ranks: Ranks = "representative") -> SimResult:
    """Simulate one training iteration of `plan` and predict its cost."""
    sim = Simulation(plan, ranks=ranks).run()
    return SimResult(plan=plan, prediction=build_prediction(sim), simulation=sim)


def rank0_links(sim: Simulation) -> list[Link]:
    """One link per resource name: node-wide links and simulated rank 0's own."""
    seen: dict[str, Link] = {}
    for link in sim.links():
        seen.setdefault(link.name, link)
    return list(seen.values())


def build_prediction(sim: Simulation) -> Prediction:
    plan = sim.plan
    total_s = sim.iteration_time_s
    forward_end = sim.phase_end_s["forward"]
    backward_end = sim.phase_end_s["backward"]
    recompute = plan.checkpoint_interval > 0
    # Paper accounting (eq. 7): 8 * tokens * params with recompute, 6 * tokens * params without.
    flops = (8 if recompute else 6) * plan.tokens_per_iteration * plan.model.num_params
    trackers = (sim.gpu, sim.cpu, sim.nvme)
    resources = {
        link.name: {
            "busy_fraction": link.busy_s / total_s if total_s > 0 else 0.0,
            "busy_s": link.busy_s,
            "amount": link.amount,
            "unit": link.unit,
            "scope": link.scope,
        }
        for link in rank0_links(sim)
    }
    bottleneck = max(resources, key=lambda name: resources[name]["busy_fraction"])
    feasible, reason = _fits(sim, trackers)
    return Prediction(
        feasible=feasible,
        reason=reason,
        iteration_time_s=total_s,
        tflops_per_gpu=flops / total_s / plan.num_gpus / 1e12 if total_s > 0 else 0.0,
        tokens_per_s=plan.tokens_per_iteration / total_s if total_s > 0 else 0.0,
        bottleneck=bottleneck,
        peak_bytes={t.name: round(t.peak_bytes) for t in trackers},
        capacity_bytes={t.name: round(t.capacity_bytes) for t in trackers},
        phase_time_s={"forward": forward_end, "backward": backward_end - forward_end, "optimizer": total_s - backward_end},
        link_bytes={name: round(sim.link_bytes.get(name, 0.0)) for name in LINKS},
        memory_terms={t.name: {k: round(v) for k, v in t.peak_by_name.items()} for t in trackers},
        method="simulated",
        details={
            "flops_accounting": f"paper eq. 7: {8 if recompute else 6} * tokens * params per iteration",
            "resources": resources,
            "tensor_parallel_bytes": round(sim.link_bytes.get("tensor_parallel", 0.0)),
            "largest_gpu_allocation_bytes": round(sim.largest_gpu_allocation_bytes),
            "memory_timeline": {t.name: _downsample(t.timeline, total_s) for t in trackers},
            "memory_peak_time_s": {t.name: t.peak_time_s for t in trackers},
            "memory_scope": {t.name: t.scope for t in trackers},
            "simulated_ranks": len(sim.ranks),
        },
    )


def _fits(sim: Simulation, trackers: tuple[TierTracker, ...]) -> tuple[bool, str]:
    problems = [
        f"{t.name} peak {t.peak_bytes / GIB:.1f} GiB exceeds {t.capacity_bytes / GIB:.1f} GiB ({t.scope})"
        for t in trackers
        if t.peak_bytes > t.capacity_bytes
    ]
    max_alloc = sim.plan.node.gpu_max_alloc_bytes
    if sim.largest_gpu_allocation_bytes > max_alloc:
        problems.append(
            f"largest GPU allocation {sim.largest_gpu_allocation_bytes / GIB:.2f} GiB exceeds the "
            f"{max_alloc / GIB:.2f} GiB contiguous limit; raise tiling_factor"
        )
    return not problems, "; ".join(problems)


def _downsample(timeline: list[tuple[float, float]], end_s: float) -> list[list[float]]:
    """Keep each bucket's peak so the curve never hides a maximum."""
    if len(timeline) <= MAX_TIMELINE_POINTS or end_s <= 0:
        return [[t, b] for t, b in timeline]
    width = end_s / MAX_TIMELINE_POINTS
    buckets: dict[int, tuple[float, float]] = {}
    for t, b in timeline:
        key = min(int(t / width), MAX_TIMELINE_POINTS - 1)
        if key not in buckets or b > buckets[key][1]:
            buckets[key] = (t, b)
    return [[t, b] for t, b in (buckets[k] for k in sorted(buckets))]
