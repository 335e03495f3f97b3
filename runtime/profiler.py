"""Per-step measurements in the planner's vocabulary: phase times, bytes per link, peak bytes per tier.

Phase boundaries come from the sharded model's own hooks (forward: root pre-hook to root post-hook;
backward: first gradient to the end-of-backward callback; optimizer: `AdamW.step`).

[Note: phase times on CUDA]
A phase's time is the device's, not the launch queue's. On CUDA a boundary records a timing event on
the current stream and returns at once: boundaries run inside autograd hooks, where a host
synchronisation would stall the queue that backward's kernels are issued into. `end_step` waits for
the step's last event, once, and resolves every phase from the events. On the CPU a boundary reads
the clock (the work before it has run).
"""

from __future__ import annotations

import resource
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import torch

from planner.specs.phases import PHASES
from runtime.ledger import TIERS, MemoryLedger

MAX_SAMPLES = 10_000
"""Step samples a profiler keeps by default (the most recent)."""

LINKS = ("nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter")


@dataclass(slots=True)
class StepSample:
    step: int
    step_time_s: float
    phase_time_s: dict[str, float]
    link_bytes: dict[str, int]
    peak_bytes: dict[str, int]
    """Own accounting per tier during this step (gpu: per device, cpu: this process's host buffers)."""
    terms_at_peak: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per tier, the live bytes of each term at that tier's peak."""
    cuda_max_allocated_bytes: int = 0
    loss: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Profiler:
    ledger: MemoryLedger
    device: torch.device
    link_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    """Cumulative bytes per link since construction (this rank)."""
    samples: deque[StepSample] = field(default_factory=lambda: deque(maxlen=MAX_SAMPLES))
    """The last `MAX_SAMPLES` steps (a sample is ~2 KB: a run of millions of steps must not keep them
    all; `keep_samples` raises the bound where every step is wanted, as `planner run`'s profile)."""
    num_steps: int = 0
    _phase_start_s: dict[str, float | torch.cuda.Event] = field(default_factory=dict)
    _phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    _step_start_s: float | torch.cuda.Event | None = None
    _pending_phases: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)
    """CUDA phases ended this step, resolved in `end_step` ([Note: phase times on CUDA])."""
    _links_at_start: dict[str, int] = field(default_factory=dict)

    @property
    def open_phases(self) -> tuple[str, ...]:
        """The phases begun and not ended yet, in the order they began (a sampler's label)."""
        return tuple(self._phase_start_s)

    def keep_samples(self, num_samples: int) -> None:
        """Keep the last `num_samples` step samples from now on."""
        self.samples = deque(self.samples, maxlen=max(1, num_samples))

    def _now(self) -> float | torch.cuda.Event:
        """The CPU clock, or a timing event recorded on the device's current stream."""
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            return event
        return time.perf_counter()

    def _resolve(self, end: float | torch.cuda.Event) -> None:
        """Add this step's CUDA phases into `_phase_s` (after `end`, the step's last event, completed)."""
        if self.device.type != "cuda":
            return
        end.synchronize()
        for phase, start, stop in self._pending_phases:
            self._phase_s[phase] += start.elapsed_time(stop) / 1e3
        self._pending_phases.clear()

    @staticmethod
    def _elapsed_s(start: float | torch.cuda.Event, end: float | torch.cuda.Event) -> float:
        if isinstance(start, float):
            return end - start
        return start.elapsed_time(end) / 1e3

    def begin(self, phase: str) -> None:
        now = self._now()
        if self._step_start_s is None:
            self._step_start_s = now
            self._links_at_start = dict(self.link_bytes)
            self.ledger.reset_peaks()
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
        self._phase_start_s[phase] = now

    def end(self, phase: str) -> None:
        start = self._phase_start_s.pop(phase, None)
        if start is None:
            return
        now = self._now()
        if isinstance(now, float):
            self._phase_s[phase] += now - start
        else:
            self._pending_phases.append((phase, start, now))

    def waited(self, phase: str, seconds: float) -> None:
        """The host waited `seconds` for `phase`'s work inside the phases open now (the next forward
        waiting for an overlapped optimizer step's update, on the CPU): count them to `phase`, not to
        those, so that the phases still add up to the step and the step's own phase holds what it
        cost ([Note: the step overlaps the next forward] in runtime/optim/step_schedule.py). Waits outside
        a step (no phase open) belong to no sample."""
        if self._step_start_s is None or self.device.type == "cuda":
            return
        open_phases = [p for p in self._phase_start_s if p != phase]
        for p in open_phases:
            self._phase_s[p] -= seconds
        if open_phases:
            self._phase_s[phase] += seconds

    def cancel_step(self) -> None:
        """A forward without backward (evaluation) is not a training step: drop its timings."""
        self._step_start_s = None
        self._phase_start_s.clear()
        self._pending_phases.clear()
        self._phase_s = dict.fromkeys(PHASES, 0.0)

    def end_step(self) -> StepSample | None:
        """Close the step after the optimizer ran; returns its sample."""
        if self._step_start_s is None:
            return None
        end = self._now()
        self._resolve(end)
        step_time = self._elapsed_s(self._step_start_s, end)
        sample = StepSample(
            step=self.num_steps + 1,
            step_time_s=step_time,
            phase_time_s=dict(self._phase_s),
            link_bytes={k: self.link_bytes.get(k, 0) - self._links_at_start.get(k, 0) for k in LINKS},
            peak_bytes={tier: self.ledger.usage(tier).peak_bytes for tier in TIERS},
            terms_at_peak={tier: self.ledger.usage(tier).terms_at_peak for tier in TIERS},
            cuda_max_allocated_bytes=(torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else 0),
        )
        self.samples.append(sample)
        self.num_steps += 1
        self._step_start_s = None
        self._phase_s = dict.fromkeys(PHASES, 0.0)
        return sample


def process_peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
