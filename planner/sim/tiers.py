"""Memory tiers as capacity trackers: what is allocated when, the peak, and the timeline."""

from __future__ import annotations

from dataclasses import dataclass, field

from planner.specs.memory_terms import MemoryTerm


@dataclass(eq=False, slots=True)
class TierTracker:
    """Bytes in use in one tier (`gpu` per GPU, `cpu` and `nvme` per node) over simulated time.

    Static residents (partitioned model states, decided by the placement) are set once at time 0;
    the simulation adds and removes its transient buffers (gathered parameters, gradient buckets,
    recompute inputs, staging and optimizer chunk buffers) by memory term, so the peak can be explained
    in the bill's vocabulary.
    """

    name: str
    capacity_bytes: float
    scope: str
    used_bytes: float = 0.0
    peak_bytes: float = 0.0
    peak_time_s: float = 0.0
    by_term: dict[MemoryTerm, float] = field(default_factory=dict)
    peak_by_term: dict[MemoryTerm, float] = field(default_factory=dict)
    """The named terms at the moment of the peak."""
    timeline: list[tuple[float, float]] = field(default_factory=list)
    """(time, bytes in use) after every change; last entry per instant wins."""
    windows: list[tuple[float, dict[MemoryTerm, float]]] = field(default_factory=list)
    """(peak, terms at it) of each closed window of time; see `close_window`."""
    _window_peak: float = 0.0
    _window_terms: dict[MemoryTerm, float] = field(default_factory=dict)
    held: frozenset[MemoryTerm] = frozenset()
    """Buffers the runtime allocates once and holds all iteration (the pinned host buffers): placed at
    time 0 (`place`), after which the simulation's uses of them allocate nothing."""
    slack_fraction: float = 0.0
    """The caching allocator's loss on transient buffers (the GPU's: `ALLOCATOR_SLACK_FRACTION`): it
    keeps this share of the most transient bytes ever in use at once, as `allocator_slack`."""
    _transient_bytes: float = 0.0
    _transient_high_bytes: float = 0.0

    def place(self, term: MemoryTerm, nbytes: float) -> None:
        """Allocate a resident state or a held buffer at time 0."""
        self._change(0.0, term, nbytes)

    def add(self, now: float, term: MemoryTerm, nbytes: float) -> None:
        if term not in self.held:
            self._change(now, term, nbytes)

    def _change(self, now: float, term: MemoryTerm, nbytes: float) -> None:
        assert isinstance(term, MemoryTerm) and self.name in term.tiers, f"{self.name}: {term!r} is not a term of this tier"
        if nbytes == 0:
            return
        self.used_bytes += nbytes
        self.by_term[term] = self.by_term.get(term, 0.0) + nbytes
        if self.used_bytes > self._window_peak:
            self._window_peak = self.used_bytes
            self._window_terms = {k: v for k, v in self.by_term.items() if v > 0.5}
            if self.used_bytes > self.peak_bytes:
                self.peak_bytes, self.peak_time_s = self.used_bytes, now
                self.peak_by_term = self._window_terms
        timeline = self.timeline
        if timeline and timeline[-1][0] == now:
            timeline[-1] = (now, self.used_bytes)
        else:
            timeline.append((now, self.used_bytes))
        if self.slack_fraction and term.transient:
            self._transient_bytes += nbytes
            if self._transient_bytes > self._transient_high_bytes:
                grown = self._transient_bytes - self._transient_high_bytes
                self._transient_high_bytes = self._transient_bytes
                self._change(now, MemoryTerm.ALLOCATOR_SLACK, self.slack_fraction * grown)

    def remove(self, now: float, term: MemoryTerm, nbytes: float) -> None:
        if term in self.held:
            return
        assert self.by_term.get(term, 0.0) >= nbytes * (1 - 1e-9) - 1e-6, f"{self.name}: freeing more {term} than held"
        self._change(now, term, -nbytes)

    def close_window(self) -> None:
        """Record the peak since the last window closed (the fast path extrapolates each phase's peak)."""
        self.windows.append((self._window_peak, self._window_terms))
        self._window_peak = self.used_bytes
        self._window_terms = {k: v for k, v in self.by_term.items() if v > 0.5}
