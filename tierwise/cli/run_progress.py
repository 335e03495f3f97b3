"""What `planner run` says while it runs: each stage as it starts, each step with its loss, time and
the time left, a warning when the first step is far slower than the plan predicted, and the loss
curve at the end.

Lines, not a redrawn bar: they read the same in a terminal, under nohup and in a log, and the first
one is printed before torchrun starts (the workers' torch import alone takes seconds on a small
machine). The time left comes from the plan's predicted iteration time until a step is measured
(only when the plan's hardware is this machine: `machine.check` found nothing to say), then from the
measured steps (the first left out once there are others: it records the operator order).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Console

SLOW_FACTOR = 3.0
"""A first step this many times the plan's predicted iteration time gets a one-line warning."""
LINES_PER_RUN = 25
"""Above this many steps, a step line is printed every steps/LINES_PER_RUN steps (and the last)."""
QUIET_S = 10.0
"""...or when this long has passed since the last line, so a slow run never looks stalled."""
HEARTBEAT_S = 30.0
"""A stage or step that says nothing for this long gets a `still ...` line (materialising a large
model, or one slow step, can take minutes)."""
EVERY_LOSS_STEPS = 10
"""Up to this many steps the loss of every step is printed at the end; more get a sparkline."""
WIDTH = 80
SPARKS = "▁▂▃▄▅▆▇█"


def format_duration(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, rest = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{rest:02d}" if hours else f"{minutes}:{rest:02d} min"


def sparkline(values: Sequence[float], width: int) -> str:
    """`values` in at most `width` characters, each the mean of its share of the values."""
    if not values or width < 1:
        return ""
    buckets = min(width, len(values))
    means = []
    for i in range(buckets):
        part = values[i * len(values) // buckets:(i + 1) * len(values) // buckets]
        means.append(sum(part) / len(part))
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    return "".join(SPARKS[min(len(SPARKS) - 1, int((v - low) / span * len(SPARKS)))] for v in means)


def loss_curve(losses: Sequence[float], width: int = WIDTH) -> str:
    """Every step's loss for a short run; else a sparkline with min, max and last, in `width` columns."""
    if len(losses) <= EVERY_LOSS_STEPS:
        return "loss by step: " + " ".join(f"{v:.4g}" for v in losses)
    tail = f" min {min(losses):.4g} max {max(losses):.4g} last {losses[-1]:.4g}"
    head = "loss "
    return head + sparkline(losses, width - len(head) - len(tail)) + tail


@dataclass(kw_only=True)
class RunProgress:
    """The lines of one `planner run` (see the module's docstring)."""

    console: Console
    steps: int
    predicted_step_s: float | None
    """The plan's predicted iteration time, None when the plan is for other hardware."""
    plan_step_s: float | None = None
    """The plan's predicted iteration time whatever its hardware (the slow-first-step warning)."""
    hardware: str = ""
    replan_hint: str = ""
    clock: object = time.monotonic
    start_s: float = field(default=0.0, init=False)
    losses: list[float] = field(default_factory=list, init=False)
    step_times_s: list[float] = field(default_factory=list, init=False)
    first_step: int = field(default=1, init=False)
    last_line_s: float = field(default=0.0, init=False)
    doing: str = field(default="", init=False)
    """What the run is doing now, for the heartbeat's `still ...` line."""
    _stop: threading.Event = field(default_factory=threading.Event, init=False)

    def say(self, text: str) -> None:
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)
        self.last_line_s = self.clock()

    def heartbeat(self) -> None:
        """Say `still ...` after HEARTBEAT_S without a line (call `stop` at the end)."""
        if self.clock() - self.last_line_s >= HEARTBEAT_S and self.doing:
            self.say(f"  still {self.doing}  [{format_duration(self.clock() - self.start_s)} since start]")

    def beat_in_background(self) -> None:
        def loop() -> None:
            while not self._stop.wait(1.0):
                self.heartbeat()

        threading.Thread(target=loop, name="run-progress-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def checking(self, plan_path: object) -> None:
        """The first line, before this process imports torch to look at the machine."""
        self.start_s = self.clock()
        self.say(f"planner run {plan_path}: {self.steps} step(s); checking the plan against this machine")

    def started(self, processes: int) -> None:
        self.start_s = self.start_s or self.clock()
        self.doing = "starting the workers (importing torch)"
        self.say(f"starting {processes} worker process(es) with torchrun (each imports torch, then builds the model)")

    def stage(self, name: str) -> None:
        self.doing = name
        self.say(f"  {name}  [{format_duration(self.clock() - self.start_s)} since start]")

    def training(self, first_step: int) -> None:
        self.first_step = first_step
        left = self.steps - first_step + 1
        guess = (f"; about {format_duration(left * self.predicted_step_s)} at the plan's "
                 f"{self.predicted_step_s:.3g} s per step" if self.predicted_step_s else "")
        self.stage(f"training steps {first_step}-{self.steps}{guess}")

    def resumed(self, step: int) -> None:
        self.first_step = step + 1
        self.stage(f"resumed from the checkpoint of step {step}")

    def step(self, step: int, loss: float, step_time_s: float) -> None:
        self.losses.append(loss)
        self.step_times_s.append(step_time_s)
        self.doing = f"on step {step + 1} of {self.steps}" if step < self.steps else "finishing (writing the profile)"
        if len(self.step_times_s) == 1:
            self._first_step_check(step_time_s)
        every = max(1, self.steps // LINES_PER_RUN)
        if step == self.steps or (step - self.first_step) % every == 0 or self.clock() - self.last_line_s > QUIET_S:
            self.say(f"step {step}/{self.steps}  loss {loss:.4f}  {step_time_s:.3g} s/step  "
                     f"{self._left(step)} left")

    def _left(self, step: int) -> str:
        measured = self.step_times_s[1:] or self.step_times_s
        return format_duration((self.steps - step) * sum(measured) / len(measured))

    def _first_step_check(self, step_time_s: float) -> None:
        predicted = self.plan_step_s
        if predicted and step_time_s > SLOW_FACTOR * predicted:
            self.say(f"warning: the first step took {step_time_s:.3g} s, {step_time_s / predicted:.0f}x the "
                     f"{predicted:.3g} s per step the plan predicts{self.hardware}; the run will take about "
                     f"{format_duration((self.steps - self.first_step) * step_time_s)} more. {self.replan_hint}")

    def finished(self) -> None:
        self.stop()
        if self.losses:
            self.say(loss_curve(self.losses))
