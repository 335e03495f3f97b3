"""The bottleneck as the exposed critical path: where the iteration's time goes while the GPU computes nothing.

[Note: exposed critical path]
The GPU's compute is the work itself; every second of the iteration it does not compute is time a
resource made it wait. So the iteration splits into GPU compute, the waits inside forward and
backward (a transfer the prefetch did not hide), and the optimizer step where it is not overlapped
with compute (after the backward, the GPU idles while the CPU and the drives update the states). A
resource's *exposed* time is the time it is busy while the GPU computes nothing: what the iteration
would lose, at least, if that resource were infinitely fast and nothing else took its place.

From a simulation these are measured on the busy intervals of the whole iteration (rank 0's and the
node's resources); from the analytic estimate they follow from its phases (forward and backward
take the max of compute and each traffic, the optimizer step follows the backward), the waits
counted against the largest traffic. The bottleneck is GPU compute when less than
`EXPOSED_SHARE` of the iteration is exposed, else the larger exposed part: the optimizer step, or
the resource the forward and backward wait on most.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass

from planner.output.report import bottleneck_label, fmt_seconds, resource_labels
from planner.sim.report import Timelines
from planner.sim.resources import COMPUTE
from planner.specs.phases import Phase
from planner.specs.plan import Plan

EXPOSED_SHARE = 0.05
"""Below this share of the iteration exposed, the plan is compute-bound."""


@dataclass(frozen=True, slots=True)
class CriticalPath:
    """The iteration split into GPU compute and the time the GPU waits ([Note: exposed critical path])."""

    iteration_s: float
    compute_s: float
    """Seconds the GPU computes (forward, recompute, backward, and the optimizer where it runs on the GPU)."""
    waits_s: float
    """Seconds of forward and backward in which the GPU computes nothing."""
    step_s: float
    """Seconds of the optimizer step in which the GPU computes nothing (not overlapped)."""
    waits_by: dict[str, float]
    """Display label of a resource -> its exposed seconds within `waits_s` (largest first)."""
    step_by: dict[str, float]
    """Display label of a resource -> its exposed seconds within `step_s` (largest first)."""
    method: str
    """`simulated` (measured on the simulated intervals) or `analytic` (from the estimate's phases)."""
    compute_label: str = "GPU compute"

    @property
    def exposed_s(self) -> float:
        return self.waits_s + self.step_s

    @property
    def step_exposed(self) -> bool:
        """The optimizer step is the bottleneck: exposed, and longer than the waits."""
        return self.exposed_s >= EXPOSED_SHARE * self.iteration_s and self.step_s >= self.waits_s

    @property
    def bottleneck(self) -> str:
        """One short label: `GPU compute`, `optimizer step` (not overlapped: `sentence` says so) or
        `waits on RESOURCE`."""
        if self.exposed_s < EXPOSED_SHARE * self.iteration_s:
            return self.compute_label
        if self.step_exposed:
            return "optimizer step"
        return f"waits on {next(iter(self.waits_by), 'transfers')}"

    def sentence(self) -> str:
        """The bottleneck with its numbers, in one line (saying so when they are the analytic estimate's)."""
        total = fmt_seconds(self.iteration_s)
        source = " (analytic estimate)" if self.method == "analytic" else ""
        if self.exposed_s < EXPOSED_SHARE * self.iteration_s:
            return (f"{self.compute_label}: busy {fmt_seconds(self.compute_s)} of {total}; "
                    f"{fmt_seconds(self.exposed_s)} exposed{source}")
        if self.step_exposed:
            return (f"the optimizer step is exposed: {fmt_seconds(self.step_s)} of {total} with the GPU idle"
                    f"{self._whose(self.step_by)}{source}")
        return (f"the GPU waits {fmt_seconds(self.waits_s)} of {total} in forward and backward"
                f"{self._whose(self.waits_by)}{source}")

    def _whose(self, by: dict[str, float]) -> str:
        """Measured: the resource busiest while the GPU waits; estimated: the largest traffic of the part."""
        if not by:
            return ""
        label, seconds = next(iter(by.items()))
        return f" ({label} busy {fmt_seconds(seconds)} of it)" if self.method == "simulated" else f" (mostly {label})"


def compute_label(plan: Plan) -> str:
    """What computes: the GPU, or the CPU on a machine whose host is the device."""
    return "CPU compute" if plan.node.host_is_device else "GPU compute"


def simulated_path(plan: Plan, timelines: Timelines) -> CriticalPath:
    """The critical path measured on a simulated iteration's busy intervals."""
    total = timelines.iteration_time_s
    backward_end = timelines.phase_end_s[Phase.BACKWARD]
    compute = _merged(timelines.intervals.get(COMPUTE, []))
    idle = _complement(compute, 0.0, total)
    waiting, stepping = _clipped(idle, 0.0, backward_end), _clipped(idle, backward_end, total)
    labels = resource_labels()
    busy = {labels.get(name, name): _merged(spans) for name, spans in timelines.intervals.items() if name != COMPUTE}
    return CriticalPath(
        iteration_s=total, compute_s=_length(compute), waits_s=_length(waiting), step_s=_length(stepping),
        waits_by=_ranked({label: _overlap(spans, waiting) for label, spans in busy.items()}),
        step_by=_ranked({label: _overlap(spans, stepping) for label, spans in busy.items()}),
        method="simulated", compute_label=compute_label(plan),
    )


def two_stream_path(plan: Plan, layer_counts: list[int]) -> CriticalPath | None:
    """The critical path of a plan predicted by [Note: two streams] (planner/sim/streams.py), from
    the paths of its three kept samples: compute, waits and step seconds grow by the same amount
    with every unit (checked on the three, to 1e-9 of the iteration), and so, up to the drift of
    two streams, does each resource's share of the waits. Those are taken on the line through the
    two deeper samples, and kept only while the order of the largest cannot change: the largest,
    less the real depth times its deviation from the line at the deepest sample, must exceed every
    other plus its own. None where a check fails (then the caller simulates the whole model)."""
    from planner.sim.streams import stream_samples

    streams = stream_samples(plan, layer_counts)  # the samples the prediction came from (kept), and their repeats
    if streams is None:
        return None
    a, b, c = (simulated_path(s.plan, s.timelines) for s in streams.samples)
    repeats = streams.repeats

    def line(x: float, y: float) -> float:
        return y + repeats * (y - x)

    scalars = {}
    for field in ("iteration_s", "compute_s", "waits_s", "step_s"):
        x, y, z = (getattr(p, field) for p in (a, b, c))
        if abs(2 * y - x - z) > 1e-9 * c.iteration_s:
            return None
        scalars[field] = line(y, z)
    shares = {}
    for field, limit in (("waits_by", scalars["waits_s"]), ("step_by", scalars["step_s"])):
        x, y, z = (getattr(p, field) for p in (a, b, c))
        labels = set(x) | set(y) | set(z)
        value = {k: min(limit, max(0.0, line(y.get(k, 0.0), z.get(k, 0.0)))) for k in labels}
        spread = {k: repeats * abs(2 * y.get(k, 0.0) - x.get(k, 0.0) - z.get(k, 0.0)) for k in labels}
        ranked = sorted(labels, key=lambda k: -value[k])
        if len(ranked) > 1 and value[ranked[0]] - spread[ranked[0]] <= max(value[k] + spread[k] for k in ranked[1:]):
            return None
        shares[field] = _ranked(value)
    return CriticalPath(**scalars, waits_by=shares["waits_by"], step_by=shares["step_by"], method="simulated",
                        compute_label=compute_label(plan))


def analytic_path(plan: Plan) -> CriticalPath:
    """The critical path from an analytic prediction's phases and components."""
    pred = plan.prediction
    assert pred is not None and pred.method == "analytic" and pred.feasible
    components: dict[str, float] = pred.details["component_time_s"]
    phases = pred.phase_time_s
    compute = components.get("compute", 0.0)
    optimizer_key = next((k for k in components if k.startswith("optimizer")), "")
    on_device = plan.placement.optimizer_states.on_device or plan.node.host_is_device
    step = 0.0 if on_device else phases[Phase.OPTIMIZER]
    compute += phases[Phase.OPTIMIZER] if on_device else 0.0
    waits = max(0.0, phases[Phase.FORWARD] + phases[Phase.BACKWARD] - components.get("compute", 0.0))
    traffic = {k: v for k, v in components.items() if k not in ("compute", optimizer_key) and v > 0}
    largest = max(traffic, key=lambda k: traffic[k], default=None)
    return CriticalPath(
        iteration_s=pred.iteration_time_s, compute_s=compute, waits_s=waits, step_s=step,
        waits_by={bottleneck_label(largest): waits} if largest and waits > 0 else {},
        step_by={bottleneck_label(optimizer_key): step} if optimizer_key and step > 0 else {},
        method="analytic", compute_label=compute_label(plan),
    )


# Interval arithmetic on sorted, disjoint (start, end) spans.
def _merged(spans: Iterable[tuple[float, float, object]] | Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the spans of positive length, as sorted disjoint spans (those that touch joined).
    The span being joined is kept open in `lo, hi` and written once it closes (a busy link's
    timeline joins thousands of spans into a few: one tuple per joined span, not per span)."""
    out: list[tuple[float, float]] = []
    lo = hi = 0.0
    is_open = False
    for span in sorted(spans):
        start, end = span[0], span[1]
        if is_open and start <= hi:
            if end > hi:
                hi = end
        elif end > start:
            if is_open:
                out.append((lo, hi))
            lo, hi, is_open = start, end, True
    if is_open:
        out.append((lo, hi))
    return out


def _complement(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    out, at = [], lo
    for start, end in spans:
        if start > at:
            out.append((at, min(start, hi)))
        at = max(at, end)
    if at < hi:
        out.append((at, hi))
    return [(a, b) for a, b in out if b > a]


def _clipped(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if min(b, hi) > max(a, lo)]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two merged span lists: for each span of the shorter, the
    spans of the longer that meet it, found by bisection, in the order one sweep over both adds them
    (the intersections are disjoint and taken left to right)."""
    if len(a) < len(b):
        a, b = b, a
    total = 0.0
    for b_lo, b_hi in b:
        i = bisect_right(a, b_lo, key=_end)  # the first span of `a` ending after `b_lo`
        while i < len(a) and a[i][0] < b_hi:
            total += min(a[i][1], b_hi) - max(a[i][0], b_lo)
            i += 1
    return total


def _end(span: tuple[float, float]) -> float:
    return span[1]


def _length(spans: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in spans)


def _ranked(seconds: dict[str, float]) -> dict[str, float]:
    return dict(sorted(((k, v) for k, v in seconds.items() if v > 0), key=lambda kv: -kv[1]))
