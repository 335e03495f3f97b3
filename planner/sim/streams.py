"""Plans whose in-backward updates fall behind the backward: a prediction from three short samples,
the compute stream and the update stream each growing by its own period ([Note: two streams]).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.sim.periodic import NotPeriodic, extend, sample_units
from planner.sim.report import Summary
from planner.sim.resources import COMPUTE
from planner.sim.samples import Sample, simulate_samples
from planner.specs.phases import Phase
from planner.specs.plan import Plan

EXACT = 1e-9
"""Relative deviation from a line allowed of every quantity either stream alone makes (as the
periodic check's)."""
SHARED_BUSY = 1e-3
"""Busy seconds of a link both streams use: the real depth times the deviation of the deepest sample
from the line through the other two, at most this share of the iteration ([Note: two streams]). An
estimate of the error, not a bound: on twelve plans of 13B-1T on H100, A100 and V100 nodes the
extrapolated busy seconds were within 2.6e-3 of the iteration of the whole simulation's."""


# [Note: two streams] When the in-backward updates fall behind the backward ([Note: a queue that
# falls behind] in periodic.py) the iteration is two streams, each periodic on its own: the compute
# stream (forward and backward, unit after unit, period Pf and Pb) and the update stream (each
# unit's reads, CPU Adam and writes, one after another on a drive that never rests once it has
# begun, period Pu > Pb). They are coupled only at their ends: the updates begin when the top unit's
# gradient is final (after the forward, which one more unit delays by Pf) and the backward ends when
# the last update has been computed. So each phase end, each link's bytes and units carried, each
# stream's busy seconds and each memory peak (the update stream holds every swap buffer from its
# first read on) grows by the same amount with every unit: the summary of `s + R` units is the line
# through `s + 1` and `s + 2`, as [Note: periodic layers] extends the periodic ones. The line is
# checked, not assumed, on samples of `s`, `s + 1` and `s + 2` units (kept, [Note: shared samples]):
# first the unit below the periodic check's first pair and that pair, tried before the periodic
# check wherever that pair shows the backlog growing (`falls_behind_early`: a plan that falls behind
# costs one shallow sample beside the pair, and its deeper pairs are never simulated); where that set
# fails, the two pairs the falling-behind test simulates, one unit deeper. In each the backward must go on after the
# compute's last operator longer than in the one before (`backlog_s`: the updates are behind, and
# further behind with every unit, so the update stream never waits for a gradient at any depth; a
# backlog that shrinks instead ends where it is gone, and no line through short samples holds beyond
# that), and `s + 2` must lie on the line through the other two, to 1e-9 of the iteration (times) or
# of the quantity (bytes, peaks). One kind of number is not on a line: the busy seconds of a link
# both streams use (the GPU's PCIe copies, host memory), the union of two patterns whose phases
# drift against each other. For those the check is that the real depth times the deviation at `s +
# 2` stays within `SHARED_BUSY` of the iteration (an estimate of their error, not a bound); they
# only rank the links (`Prediction.bottleneck`, the critical path's waits), never a time. Where
# every set fails the whole model is simulated. The streams are not always independent: where the
# backward waits on parameter reads from the drive the updates keep busy (the runner-up of `planner
# fit 1T --gpus 16 --hardware dgx2-v100` with parameters and states on NVMe and recompute inputs on
# the GPU: its 10-layer sample waits 31 of 118 s on NVMe), each unit's backward takes what the drive
# leaves it at the update stream's phase, and that phase drifts: the backward period wanders within
# about 1e-3 of its mean (22.91 to 22.94 s per unit, no repeat over 13 units), so no line holds to
# 1e-9, at any period, and the plan is simulated whole (docs/notes/2026-11-28-fit-path-speed.md). The
# busy intervals and memory curves (the Gantt chart) are not extrapolated: `simulate_periodic`
# simulates such a plan whole.
@dataclass(frozen=True, slots=True)
class StreamSamples:
    """Three samples of `s`, `s + 1` and `s + 2` whole units, and how many units the last lacks."""

    layer_counts: list[int]
    repeats: int
    samples: list[Sample]


def stream_sample_sets(plan: Plan) -> list[tuple[list[int], int]]:
    """(layer counts, units the deepest lacks) of the sample sets [Note: two streams] tries, in
    order: one unit below the periodic check's first pair and that pair (so a plan that falls
    behind costs one shallow sample more than the pair it is simulated for anyway), then the two
    pairs the falling-behind test simulated (`check_samples`, where the first set fails). Empty
    when the model is too shallow."""
    first, second = sample_units(plan, 0), sample_units(plan, 1)
    if first is None or second is None:
        return []
    unit = plan.recompute_interval or 1
    late = sorted(set(first.layer_counts) | set(second.layer_counts))
    if len(late) != 3:
        return []
    return [([first.layer_counts[0] - unit, *first.layer_counts], first.repeats), (late, second.repeats)]


def stream_samples(plan: Plan, layer_counts: list[int] | None = None) -> StreamSamples | None:
    """The samples of the set with `layer_counts` (default: the first set), kept where a prediction
    simulated them; None when the model is too shallow or no set has those counts."""
    sets = stream_sample_sets(plan)
    chosen = next((s for s in sets if layer_counts is None or s[0] == list(layer_counts)), None)
    if chosen is None:
        return None
    counts, repeats = chosen
    return StreamSamples(counts, repeats, simulate_samples(plan, counts))


def falls_behind_early(plan: Plan) -> bool:
    """Whether the first sample set shows an in-backward plan's updates falling further behind with
    every unit: the periodic check's own first pair (simulated for it anyway) first, and only where
    its backlog grows the unit below it. Such a plan is predicted by [Note: two streams] or
    simulated whole: the periodic map cannot hold at any depth ([Note: a queue that falls behind]
    in periodic.py), so its deeper pairs are not tried."""
    sets = stream_sample_sets(plan)
    if plan.optimizer_step != "in_backward" or not sets:
        return False
    counts, _ = sets[0]
    try:
        shorter, longer = simulate_samples(plan, counts[1:])
        if not _grows(shorter, longer):
            return False
        return _grows(simulate_samples(plan, counts[:1])[0], shorter)
    except NotPeriodic:
        return False


def _grows(shorter: Sample, longer: Sample) -> bool:
    return backlog_s(longer) - backlog_s(shorter) > EXACT * max(longer.summary.phase_end_s.values())


def two_stream_summary(plan: Plan) -> tuple[StreamSamples, Summary]:
    """The summary of `plan` by [Note: two streams], from the first sample set whose checks hold;
    raises NotPeriodic where none does."""
    sets = stream_sample_sets(plan) if plan.optimizer_step == "in_backward" else []
    failure = NotPeriodic("not a plan of two streams")
    for counts, repeats in sets:
        try:
            return _two_streams(plan, StreamSamples(counts, repeats, simulate_samples(plan, counts)))
        except NotPeriodic as exc:
            failure = exc
    raise failure


def _two_streams(plan: Plan, streams: StreamSamples) -> tuple[StreamSamples, Summary]:
    """Raises NotPeriodic unless the backlog grows with every unit and the deepest sample lies on
    the line through the other two ([Note: two streams])."""
    a, b, c = (s.summary for s in streams.samples)
    first, second, third = streams.samples
    if not (_grows(first, second) and _grows(second, third)):
        raise NotPeriodic("the updates do not fall further behind with every unit")
    summary = extend(b, c, streams.repeats)
    check_line(extend(a, b, 1), c, streams.repeats, summary.phase_end_s)
    return streams, summary


def backlog_s(sample: Sample) -> float:
    """How long the backward goes on after the compute's last operator: the updates still to make."""
    compute = [end for _, end, label in sample.timelines.intervals.get(COMPUTE, []) if label != Phase.OPTIMIZER]
    if not compute:
        raise NotPeriodic("no compute")
    return sample.summary.phase_end_s[Phase.BACKWARD] - max(compute)


def check_line(predicted: Summary, simulated: Summary, repeats: int, real_end_s: dict[Phase, float]) -> None:
    """Raise NotPeriodic unless `simulated` lies on the line `predicted` drew ([Note: two streams])."""
    total = max(simulated.phase_end_s.values())
    if predicted.phase_end_s.keys() != simulated.phase_end_s.keys() or predicted.resources.keys() != simulated.resources.keys():
        raise NotPeriodic("phases or links")
    for phase, t in simulated.phase_end_s.items():
        _near(predicted.phase_end_s[phase], t, EXACT * total, f"end of {phase}")
    real_total = max(real_end_s.values())
    for name, r in simulated.resources.items():
        p = predicted.resources[name]
        _near(p["amount"], r["amount"], EXACT * max(abs(r["amount"]), 1.0), f"{name} amount")
        if abs(p["busy_s"] - r["busy_s"]) > EXACT * total:  # both streams on it: bounded, not exact
            _near(repeats * p["busy_s"], repeats * r["busy_s"], SHARED_BUSY * real_total, f"{name} busy")
    for key, nbytes in simulated.link_bytes.items():
        _near(predicted.link_bytes.get(key, 0.0), nbytes, EXACT * max(nbytes, 1.0), f"{key} bytes")
    for tier, windows in simulated.windows.items():
        mine = predicted.windows[tier]
        if len(mine) != len(windows):
            raise NotPeriodic(f"{tier} windows")
        scale = max((peak for peak, _ in windows), default=0.0)
        for (p1, t1), (p2, t2) in zip(mine, windows, strict=True):
            _near(p1, p2, EXACT * max(scale, 1.0), f"{tier} peak")
            for term in set(t1) | set(t2):
                _near(t1.get(term, 0.0), t2.get(term, 0.0), EXACT * max(scale, 1.0), f"{tier} {term}")


def _near(x: float, y: float, tolerance: float, what: str) -> None:
    if abs(x - y) > tolerance:
        raise NotPeriodic(what)
