"""The whole iteration's timelines from a short simulation: what the dashboard's Timeline panel shows.

A deep model's blocks come in identical units; once the prefetch pipeline is full the forward and
the backward repeat unit after unit, so two short samples, checked against each other, are
stretched to the real depth instead of simulating every block ([Note: periodic timelines], above
`simulate_periodic`); where the check fails the whole model is simulated.
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from planner.sim.engine import resident_terms
from planner.sim.network import collector_paused
from planner.sim.report import (
    MemoryCurve,
    SimResult,
    Summary,
    Timelines,
    downsample,
    prediction_from,
)
from planner.sim.samples import Sample, kept_whole, simulate_samples, simulate_whole
from planner.specs.memory_terms import MemoryTerm
from planner.specs.phases import Phase
from planner.specs.plan import Plan
from planner.specs.tiers import TIERS

MIN_BLOCKS = 4
"""Blocks of the shorter sample at least (units of one block: the prefetch pipeline must fill)."""
FIRST_UNITS = 3
"""Whole units of the shorter sample at least: the window unit with a whole unit below it (where
the forward pipeline fills) and one above it (where the backward pipeline fills)."""
ATTEMPTS = 3
"""Sample pairs tried before simulating the whole model: `s`, `s + 1`, then `2 s` units, for
pipelines that take longer to settle (small transfers drifting against each other)."""
MIN_REPEATS = 2
"""Fewer extra units than this and the samples cost about as much as the whole model."""
_TOLERANCE = 1e-9
_JOIN = 1e-12
"""Relative gap under which two same-label pieces of a link's busy time are one interval."""


class NotPeriodic(Exception):
    pass


@dataclass(frozen=True, slots=True)
class SamplePair:
    """Two samples, `units` and `units + 1` whole units (plus the real partial top unit)."""

    layer_counts: list[int]
    repeats: int
    """Units the longer is short of the real model."""
    window_unit: int
    """The unit whose forward and backward are the windows ([Note: periodic timelines])."""


def sample_units(plan: Plan, attempt: int = 0) -> SamplePair | None:
    """The `attempt`-th sample pair of `plan`, or None when the model is too shallow for it."""
    layers, ci = plan.model.num_layers, plan.recompute_interval
    unit = ci or 1
    whole, partial = divmod(layers, unit)
    least = max(FIRST_UNITS, math.ceil(MIN_BLOCKS / unit))
    first = (least, least + 1, 2 * least)[attempt]
    repeats = whole - (first + 1)
    if repeats < MIN_REPEATS:
        return None
    # The window in the middle: the forward settles in the units below it, the backward in those above.
    return SamplePair([unit * (first + x) + partial for x in range(2)], repeats, window_unit=first // 2)


@dataclass(frozen=True, slots=True)
class Verified:
    """A sample pair whose shorter sample, stretched by one unit, is the longer one."""

    pair: SamplePair
    shorter: Sample
    longer: Sample


@dataclass(frozen=True, slots=True)
class FallsBehind:
    """Two pairs in a row show a queue falling behind ([Note: a queue that falls behind]): no pair
    verifies at any depth; the samples are kept for [Note: two streams] in streams.py."""


SampleCheck = Verified | FallsBehind | None
"""What `check_samples` finds; None: no pair verifies (simulate the whole model)."""


def verified_samples(plan: Plan) -> Verified | None:
    """The first sample pair whose shorter sample, stretched by one unit, is the longer one (the
    check of [Note: periodic timelines]); None when there is none (simulate the whole model), or
    when two pairs in a row show a queue falling behind ([Note: a queue that falls behind])."""
    checked = check_samples(plan)
    return checked if isinstance(checked, Verified) else None


def check_samples(plan: Plan) -> SampleCheck:
    """`verified_samples`, except that a queue falling behind is told apart (`FallsBehind`)."""
    lag: dict[Phase, float] | None = None
    for attempt in range(ATTEMPTS):
        pair = sample_units(plan, attempt)
        if pair is None:
            return None
        # Usually kept from refine's prediction of the same plan ([Note: shared samples]).
        shorter, longer = simulate_samples(plan, pair.layer_counts)
        try:
            stretched = stretch(shorter.timelines, windows(shorter, pair.window_unit), 1,
                                _resident_growth(shorter.plan, longer.plan))
        except NotPeriodic:
            lag = None
            continue
        try:
            check_equal(stretched, longer.timelines)
        except NotPeriodic:
            previous, lag = lag, _phase_lag(stretched, longer.timelines)
            if previous is not None and _falls_behind(previous, lag, longer.timelines.iteration_time_s):
                return FallsBehind()
            continue
        return Verified(pair, shorter, longer)
    return None


# [Note: a queue that falls behind] Some plans have a stream of work that cannot keep up with the
# compute it follows: the optimizer step in backward with its states on NVMe, where a unit's update
# (read 12 B per parameter, CPU Adam, write the states and the 16-bit parameters back, every read
# and write sharing the drive's budget) takes longer than the unit's backward. The drive is then
# busy without a break from the first update on, the updates fall further behind with every unit,
# and the backward ends when the last update has been computed: `s + 1` units end later than `s`
# stretched by one unit by the same lag (0.353 s per unit for 1T on 16 x dgx-h100 with parameters
# on NVMe, the 2.88 s backward period against 3.23 s of updates per unit). Such a timeline is two
# streams with different periods, compute and updates, drifting against each other; busy intervals
# of a link both use (host memory) and memory curves both add to (the CPU's) are not copies of one
# window, so the map of [Note: periodic timelines] cannot hold at any depth. Each pair's lag is what
# the longer sample's phase ends lack of the stretched shorter one's; when two pairs in a row lag by
# the same amount (to the check's 1e-9 of the iteration), the backlog grows linearly, and the whole
# model is simulated without trying the deeper pair (or predicted by [Note: two streams] in
# streams.py, where the backlog grows). A queue whose backward ends *earlier* by the same amount in
# both pairs (a backlog from the first units that shrinks until it is gone: 70B on 8 x dgx-h100 with
# states on NVMe, gone at 7 units) is simulated whole the same way. A transient (a pipeline still
# settling) shrinks its lag from one pair to the next and goes on to the next pair. Either way no
# timeline is extrapolated unchecked: this only decides how soon to simulate the whole model.
def _phase_lag(stretched: Timelines, simulated: Timelines) -> dict[Phase, float] | None:
    """Per phase, how much later the longer sample ends it than the stretched shorter one."""
    if stretched.phase_end_s.keys() != simulated.phase_end_s.keys():
        return None
    return {phase: t - stretched.phase_end_s[phase] for phase, t in simulated.phase_end_s.items()}


def _falls_behind(previous: dict[Phase, float], lag: dict[Phase, float] | None, total_s: float) -> bool:
    """Two consecutive pairs lag by the same nonzero amount in every phase end."""
    if lag is None or previous.keys() != lag.keys():
        return False
    tolerance = _TOLERANCE * total_s
    same = all(abs(lag[phase] - previous[phase]) <= tolerance for phase in lag)
    return same and max(abs(d) for d in lag.values()) > tolerance


# [Note: periodic timelines] [Note: periodic layers] in fast.py extrapolates a deep model's summary
# numbers; the Gantt chart and the memory curves need every busy interval and every allocation of
# the iteration, so we extrapolate those too. A model's blocks come in identical *units* (one
# recompute segment, or one block without recompute). Once the prefetch pipeline is full, the
# forward pass repeats unit after unit with a period `Pf`, and the backward pass (recompute, then
# backward, from the top unit down) with a period `Pb`. In a sample model of `s` whole units (plus
# the real model's partial top unit), cut at the marks the engine records when compute starts on a
# unit (`Simulation.unit_start_s`): the forward window is unit K's forward, [F(K), F(K+1)), the
# backward window unit K's backward, [B(K), B(K-1)). The real model with `s + R` whole units is
# then, piece by piece of the sample's time axis:
#
#     before F(K)          as simulated
#     forward window       R + 1 copies, copy m shifted by m * Pf
#     F(K+1) .. B(K)       shifted by R * Pf       (the forward's top, the backward's top units)
#     backward window      R + 1 copies, copy m shifted by R * Pf + m * Pb
#     after B(K-1)         shifted by R * (Pf + Pb) (the bottom units, the optimizer step)
#
# Busy intervals are cut at the window edges and each piece is placed by that map; memory curves
# are placed the same way, each copy of a window also adding what the window adds (a forward unit
# adds its recompute input, a backward unit frees one), and every point the deeper model's larger
# resident states. The map is checked, not assumed: two samples of `s` and `s + 1` whole units
# (s = 3, at least 4 blocks; K = s // 2, so the pipeline settles on both sides of the windows) are
# simulated with the real model's optimizer step (usually `refine` has just simulated them, [Note:
# shared samples] in samples.py), and the shorter stretched by one unit must reproduce the longer's
# timelines (every busy interval and every memory step, to 1e-9 of the iteration time and of the
# tier's peak; failing that, pairs of s + 1 and 2 s units are tried). Only then is the longer
# stretched to the real depth, and the summary numbers (busy seconds, bytes, memory peaks and their terms) are the longer
# sample's plus `R` times what the extra unit added, each checked against the stretched timelines
# where they carry it (`extend`); otherwise the whole model is simulated. For 1T (128 blocks,
# recompute interval 4) this simulates 3 + 4 units instead of 32, and tests/test_sim_periodic.py
# compares the result with the whole simulation.
@collector_paused()  # the samples, the check and the stretch allocate ~10^5 short-lived tuples
def simulate_periodic(plan: Plan, *, intervals: bool = True) -> SimResult:
    """`simulate(plan)` for the Timeline panel and `planner simulate`: the same prediction and
    timelines, from two short simulations when [Note: periodic timelines] applies (then `simulation`
    is None). Without `intervals` the timelines keep the memory curves only (no busy intervals: no
    Gantt chart), which is all a prediction needs."""
    kept = kept_whole(plan)  # its samples failed the check before ([Note: shared samples])
    if kept is not None:
        return kept
    verified = verified_samples(plan)
    if verified is None:
        return simulate_whole(plan)
    pair, shorter, longer = verified.pair, verified.shorter, verified.longer
    repeats = pair.repeats
    try:
        timelines = stretch(longer.timelines, windows(longer, pair.window_unit), repeats,
                            _resident_growth(longer.plan, plan), intervals=intervals)
        # A unit is a recompute segment, or a block of the one segment there is without recompute.
        segments = longer.timelines.num_segments + (repeats if plan.recompute_interval else 0)
        timelines = dataclasses.replace(timelines, num_segments=segments)
        summary = extend(shorter.summary, longer.summary, repeats, timelines)
    except NotPeriodic:
        return simulate_whole(plan)
    total = timelines.iteration_time_s
    summary.memory_timeline = {name: downsample(c.points, total) for name, c in timelines.memory.items()}
    summary.memory_peak_time_s = {name: c.peak_time_s for name, c in timelines.memory.items()}
    prediction = prediction_from(plan, summary, notes={"extrapolated_from_layers": pair.layer_counts})
    return SimResult(plan=plan, prediction=prediction, timelines=timelines, events=shorter.events + longer.events)


def extend(a: Summary, b: Summary, repeats: int, timelines: Timelines | None = None) -> Summary:
    """The summary of `b` with `repeats` more units: what one unit adds (b - a) added `repeats` times.

    The samples' timelines are checked periodic (`check_equal`), so every time-dependent quantity
    adds the same each unit; given the extrapolated `timelines`, each is also checked against them
    (phase ends, busy seconds, memory peaks). Bytes moved per link are the trace's sizes, the same
    each unit.
    """
    if a.largest_gpu_allocation_bytes != b.largest_gpu_allocation_bytes or a.scope != b.scope:
        raise NotPeriodic("largest allocation or scopes")

    def line(x: float, y: float) -> float:
        return y + repeats * (y - x)

    phase_end_s = {phase: line(a.phase_end_s[phase], t) for phase, t in b.phase_end_s.items()}
    if timelines is not None:
        total = timelines.iteration_time_s
        for phase, t in phase_end_s.items():
            _close(t, timelines.phase_end_s[phase], total, f"end of {phase}")
    resources = {}
    for name, rb in b.resources.items():
        ra = a.resources[name]
        busy_s = line(ra["busy_s"], rb["busy_s"])
        if timelines is not None and name in timelines.intervals:
            _close(busy_s, sum(end - start for start, end, _ in timelines.intervals[name]), total, f"{name} busy")
        resources[name] = {**rb, "busy_s": busy_s, "amount": line(ra["amount"], rb["amount"])}
    windows = {}
    for tier, wb in b.windows.items():
        wa = a.windows[tier]
        if len(wa) != len(wb):
            raise NotPeriodic(f"{tier} windows")
        windows[tier] = [(line(pa, pb), {k: line(ta.get(k, 0.0), tb.get(k, 0.0)) for k in sorted(set(ta) | set(tb), key=_by_label)})
                         for (pa, ta), (pb, tb) in zip(wa, wb, strict=True)]
        if timelines is not None:
            peak = timelines.memory[tier].peak_bytes
            _close(max(p for p, _ in windows[tier]), peak, max(peak, 1.0), f"{tier} peak")
    return Summary(
        phase_end_s=phase_end_s,
        resources=resources,
        link_bytes={k: line(a.link_bytes.get(k, 0.0), v) for k, v in b.link_bytes.items()},
        windows=windows,
        capacity_bytes=dict(b.capacity_bytes),
        scope=dict(b.scope),
        largest_gpu_allocation_bytes=b.largest_gpu_allocation_bytes,
        simulated_ranks=b.simulated_ranks,
    )


def _by_label(term: MemoryTerm) -> str:
    """Terms in the order of their labels: the order `simulated_memory_terms` lists them in."""
    return term.label


def _resident_growth(sample: Plan, deeper: Plan) -> dict[str, float]:
    """Per tier, how many more bytes of resident model states the deeper model keeps all along."""
    growth = dict.fromkeys(TIERS, 0.0)
    for sign, plan in ((-1, sample), (1, deeper)):
        for tier, _, nbytes in resident_terms(plan):
            growth[tier] += sign * nbytes
    return growth


@dataclass(frozen=True, slots=True)
class Windows:
    """The sample's forward and backward windows (sample time, seconds)."""

    forward: tuple[float, float]
    backward: tuple[float, float]


def windows(sample: Sample, k: int) -> Windows:
    marks = sample.unit_start_s
    try:
        return Windows(forward=(marks[Phase.FORWARD, k], marks[Phase.FORWARD, k + 1]),
                       backward=(marks[Phase.BACKWARD, k], marks[Phase.BACKWARD, k - 1]))
    except KeyError:
        raise NotPeriodic from None


@dataclass(frozen=True, slots=True)
class _Piece:
    """A stretch of the sample's time axis and where its copies go in the real iteration."""

    lo: float
    hi: float
    shift_s: float
    copies: int
    period_s: float
    offset: dict[str, float]
    """Per tier, bytes every copy adds to the sample's values (copy 0)."""
    delta: dict[str, float]
    """Per tier, bytes each further copy adds (what one window adds)."""


def _pieces(tl: Timelines, w: Windows, repeats: int, base: dict[str, float]) -> list[_Piece]:
    (f_lo, f_hi), (b_lo, b_hi) = w.forward, w.backward
    if not (0 < f_lo < f_hi <= b_lo < b_hi):
        raise NotPeriodic
    pf, pb = f_hi - f_lo, b_hi - b_lo
    # What a window adds: between the states just before its two edges. At the edge instant itself
    # the sample already does what follows the window (a different unit, the head), which the tail
    # keeps.
    times = {name: [t for t, _ in c.points] for name, c in tl.memory.items()}
    df = {name: _value_before(c.points, times[name], f_hi) - _value_before(c.points, times[name], f_lo)
          for name, c in tl.memory.items()}
    db = {name: _value_before(c.points, times[name], b_hi) - _value_before(c.points, times[name], b_lo)
          for name, c in tl.memory.items()}
    zero = {n: base[n] for n in tl.memory}
    after_f = {n: base[n] + repeats * df[n] for n in tl.memory}
    after_b = {n: base[n] + repeats * (df[n] + db[n]) for n in tl.memory}
    inf = math.inf
    return [
        _Piece(-inf, f_lo, 0.0, 1, 0.0, zero, zero),
        _Piece(f_lo, f_hi, 0.0, repeats + 1, pf, zero, df),
        _Piece(f_hi, b_lo, repeats * pf, 1, 0.0, after_f, zero),
        _Piece(b_lo, b_hi, repeats * pf, repeats + 1, pb, after_f, db),
        _Piece(b_hi, inf, repeats * (pf + pb), 1, 0.0, after_b, zero),
    ]


def stretch(tl: Timelines, w: Windows, repeats: int, base: dict[str, float], *, intervals: bool = True) -> Timelines:
    """The sample's timelines with `repeats` more units in both passes ([Note: periodic timelines]);
    `base` adds to every memory point (per tier: the deeper model's larger resident states). The
    segment count is the caller's to set; without `intervals`, the busy intervals are left out."""
    pieces = _pieces(tl, w, repeats, base)
    phase_end_s = {}
    for phase, t in tl.phase_end_s.items():
        piece = next(p for p in pieces if p.lo <= t < p.hi or (t == p.hi == pieces[-1].hi))
        if piece.copies != 1:  # a phase ending inside a window: the passes are not what the map assumes
            raise NotPeriodic
        phase_end_s[phase] = t + piece.shift_s
    stretched = {name: _stretch_intervals(spans, pieces) for name, spans in tl.intervals.items()} if intervals else {}
    memory = {}
    for name, curve in tl.memory.items():
        points = _stretch_points(curve.points, pieces, name)
        peak_bytes, peak_time_s = 0.0, 0.0
        for t, nbytes in points:  # the first time the peak is reached, as TierTracker records it
            if nbytes > peak_bytes:
                peak_bytes, peak_time_s = nbytes, t
        memory[name] = MemoryCurve(name=name, capacity_bytes=curve.capacity_bytes, scope=curve.scope, points=points,
                                   peak_bytes=peak_bytes, peak_time_s=peak_time_s)
    return Timelines(phase_end_s=phase_end_s, num_segments=tl.num_segments, intervals=stretched, memory=memory)


def _stretch_intervals(spans: list[tuple[float, float, str]], pieces: list[_Piece]) -> list[tuple[float, float, str]]:
    spans = sorted(spans)
    starts = [a for a, _, _ in spans]
    ends = [b for _, b, _ in spans]  # a link's intervals never overlap: sorted by start is sorted by end
    out: list[tuple[float, float, str]] = []
    for p in pieces:
        # The spans with b > lo and a < hi; only the first can start before lo, only the last end after hi.
        inside = spans[bisect_right(ends, p.lo):bisect_left(starts, p.hi)]
        if inside:
            a, b, label = inside[0]
            if a < p.lo or b > p.hi:
                inside[0] = (max(a, p.lo), min(b, p.hi), label)
            a, b, label = inside[-1]
            if a < p.lo or b > p.hi:
                inside[-1] = (max(a, p.lo), min(b, p.hi), label)
        for m in range(p.copies):
            shift = p.shift_s + m * p.period_s
            copy = [(a + shift, b + shift, label) for a, b, label in inside]
            # An interval the cut split continues across it: rejoin it (its pieces touch to rounding).
            if copy and _continues(out, copy[0]):
                out[-1] = (out[-1][0], copy[0][1], copy[0][2])
                copy = copy[1:]
            out += copy
    return out


def _stretch_points(points: list[tuple[float, float]], pieces: list[_Piece], tier: str) -> list[tuple[float, float]]:
    times = [t for t, _ in points]
    out: list[tuple[float, float]] = []
    for p in pieces:
        inside = points[bisect_left(times, p.lo):bisect_left(times, p.hi)]
        for m in range(p.copies):
            shift, add = p.shift_s + m * p.period_s, p.offset[tier] + m * p.delta[tier]
            out += [(t + shift, b + add) for t, b in inside]
    return out


def _value_before(points: list[tuple[float, float]], times: list[float], t: float) -> float:
    """Bytes in use after every change before `t` (not those at `t`); `times` are the points' times."""
    i = bisect_left(times, t)
    return points[i - 1][1] if i > 0 else 0.0


def _continues(out: list[tuple[float, float, str]], span: tuple[float, float, str]) -> bool:
    """`span` carries on `out`'s last interval: the same label, starting where it ended (to rounding)."""
    return bool(out) and out[-1][2] == span[2] and span[0] - out[-1][1] <= _JOIN * abs(span[0])


def _joined(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Same-label intervals that touch (to rounding) as one, empty ones dropped: the form two
    timelines are compared in (a simulated link may stop and start again at one instant)."""
    # `_continues`, inlined: this runs over every interval of both samples' timelines.
    out: list[tuple[float, float, str]] = []
    last_end, last_label = 0.0, None
    for span in spans:
        a, b, label = span
        if b <= a:
            continue
        if label == last_label and out and a - last_end <= _JOIN * abs(a):
            out[-1] = (out[-1][0], b, label)
        else:
            out.append(span)
        last_end, last_label = b, label
    return out


# -- the check -------------------------------------------------------------------------------------
def check_equal(stretched: Timelines, simulated: Timelines) -> None:
    """Raise NotPeriodic unless `stretched` reproduces `simulated` (times to 1e-9 of the iteration,
    bytes to 1e-9 of the tier's peak)."""
    total = simulated.iteration_time_s
    if stretched.phase_end_s.keys() != simulated.phase_end_s.keys() or stretched.intervals.keys() != simulated.intervals.keys():
        raise NotPeriodic
    for phase, t in simulated.phase_end_s.items():
        _close(stretched.phase_end_s[phase], t, total, phase)
    for name, spans in simulated.intervals.items():
        mine, theirs = _joined(stretched.intervals[name]), _joined(spans)
        if len(mine) != len(theirs):
            raise NotPeriodic
        within = _TOLERANCE * total  # `_close`, inlined: every interval and memory step is compared
        for (a1, b1, l1), (a2, b2, l2) in zip(mine, theirs, strict=True):
            if not (-within <= a1 - a2 <= within and -within <= b1 - b2 <= within) or l1 != l2:
                raise NotPeriodic(name)
    for name, curve in simulated.memory.items():
        mine, theirs = stretched.memory[name].points, curve.points
        if len(mine) != len(theirs):
            raise NotPeriodic
        within, by = _TOLERANCE * total, _TOLERANCE * max(curve.peak_bytes, 1.0)
        for (t1, v1), (t2, v2) in zip(mine, theirs, strict=True):
            if not (-within <= t1 - t2 <= within and -by <= v1 - v2 <= by):
                raise NotPeriodic(name)


def _close(x: float, y: float, scale: float, what: str) -> None:
    if abs(x - y) > _TOLERANCE * scale:
        raise NotPeriodic(what)
