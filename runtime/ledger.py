"""Own accounting of every buffer the runtime holds, per memory tier and per named term.

Term names are the planner's memory vocabulary (`planner.specs.memory_terms.MemoryTerm`: `params`,
`optimizer_states`, `mswm`, `prefetch_gathered_params`, ...; a member or its value), so a profile's
peak can be compared with the plan's memory bill term by term; any other name is a bug. Tier `gpu` means "the
compute device" (the CPU itself on a machine without CUDA), `cpu` the host store, `nvme` files.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import TIERS

_TERMS = frozenset(MemoryTerm)


@dataclass(slots=True)
class TierUsage:
    """Current and peak bytes of one tier, with the term breakdown at the moment of the peak."""

    current_bytes: int = 0
    peak_bytes: int = 0
    terms: dict[str, int] = field(default_factory=dict)
    """Live bytes per term now."""
    terms_at_peak: dict[str, int] = field(default_factory=dict)
    term_peaks: dict[str, int] = field(default_factory=dict)
    """Each term's own maximum (terms peak at different moments)."""


class MemoryLedger:
    """Thread-safe add/sub of named byte counts; keeps each tier's peak and its breakdown."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tiers: dict[str, TierUsage] = {tier: TierUsage() for tier in TIERS}
        self._local = threading.local()

    def add(self, tier: str, term: str, num_bytes: int) -> None:
        assert tier in self._tiers, tier
        assert term in _TERMS, f"{term!r} is not a memory term (planner.specs.memory_terms.MemoryTerm)"
        with self._lock:
            usage = self._tiers[tier]
            usage.current_bytes += num_bytes
            now = usage.terms.get(term, 0) + num_bytes
            assert now >= 0, f"{tier}.{term} went negative ({now} bytes): unbalanced accounting"
            usage.terms[term] = now
            if not getattr(self._local, "relabelling", False):
                _record_peaks(usage, [term])

    @contextmanager
    def relabelling(self) -> Iterator[None]:
        """This thread's adds and subs inside take effect at once, but peaks are recorded only for
        the state reached at the end. For moving buffers between the terms of the slots they fill
        (a unit passing from "2 ahead" to "1 ahead"), where one move after another can pass through
        a labelling no memory was ever in; within, memory may be added but not freed, so the end
        state is the real peak of the span."""
        outer = getattr(self._local, "relabelling", False)
        self._local.relabelling = True
        try:
            yield
        finally:
            self._local.relabelling = outer
            if not outer:
                with self._lock:
                    for usage in self._tiers.values():
                        _record_peaks(usage, list(usage.terms))

    def sub(self, tier: str, term: str, num_bytes: int) -> None:
        self.add(tier, term, -num_bytes)

    def reset_peaks(self) -> None:
        """Start a new measurement window at the current usage (e.g. after warm-up)."""
        with self._lock:
            for usage in self._tiers.values():
                usage.peak_bytes = usage.current_bytes
                usage.terms_at_peak = {k: v for k, v in usage.terms.items() if v}
                usage.term_peaks = {k: v for k, v in usage.terms.items() if v}

    def usage(self, tier: str) -> TierUsage:
        with self._lock:
            u = self._tiers[tier]
            return TierUsage(u.current_bytes, u.peak_bytes, dict(u.terms), dict(u.terms_at_peak), dict(u.term_peaks))

    def peak_bytes(self) -> dict[str, int]:
        with self._lock:
            return {tier: u.peak_bytes for tier, u in self._tiers.items()}

    def current_bytes(self) -> dict[str, int]:
        with self._lock:
            return {tier: u.current_bytes for tier, u in self._tiers.items()}


def _record_peaks(usage: TierUsage, terms: list[str]) -> None:
    for term in terms:
        usage.term_peaks[term] = max(usage.term_peaks.get(term, 0), usage.terms[term])
    if usage.current_bytes > usage.peak_bytes:
        usage.peak_bytes = usage.current_bytes
        usage.terms_at_peak = {k: v for k, v in usage.terms.items() if v}


def nbytes(tensor) -> int:  # noqa: ANN001 - torch.Tensor, kept import-free for callers' type hints
    return tensor.numel() * tensor.element_size()
