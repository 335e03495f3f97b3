"""Progress over a known number of items (`planner validate`'s rows, the sweep's runs): `k/N`, what
is being done, the time so far and the time left from the mean item so far.

A line per item, at most LINES of them (and always the last), on stderr: the same in a terminal,
a pipe and a log, and never in the way of `--json` on stdout.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from tierwise.cli.run_progress import format_duration

LINES = 20


@dataclass
class Counted:
    """Call `done(label)` after each of `total` items."""

    total: int
    what: str
    stream: TextIO = field(default_factory=lambda: sys.stderr)
    clock: Callable[[], float] = time.monotonic
    count: int = field(default=0, init=False)
    start_s: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.start_s = self.clock()
        self.stream.write(f"{self.what}: {self.total} to do\n")
        self.stream.flush()

    def done(self, label: str) -> None:
        self.count += 1
        every = max(1, self.total // LINES)
        if self.count % every and self.count != self.total:
            return
        spent = self.clock() - self.start_s
        left = spent / self.count * (self.total - self.count)
        self.stream.write(f"  {self.count}/{self.total} {label}  [{format_duration(spent)} so far, "
                          f"{format_duration(left)} left]\n")
        self.stream.flush()
