"""What the transfer path did, as records: host waits, stream waits, copies, pins. For tests.

Every synchronisation of the runtime goes through the rank's `Streams` (runtime/transfer/streams.py),
which notes it here while a `Trace` is active (`tracing()`); nothing is kept otherwise. The runtime's
hooks mark themselves (`hook`), so each record says whether it happened inside one, and on which
thread: the tests of the transfer path read the properties of a GPU program off these records,
on the emulated device as on CUDA ([Note: the transfer path as a GPU program] in
runtime/transfer/streams.py).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TypeVar


class Role(enum.Enum):
    """A stream of the rank's device, by what it carries."""

    COMPUTE = "compute"
    """The stream the compute runs on (the current stream of the launching thread)."""
    H2D = "h2d"
    """Host-to-device copies, and a prefetch's cast and all-gather."""
    D2H = "d2h"
    """Device-to-host copies, and the post-reduce-scatter work on the host worker."""


class Direction(enum.Enum):
    H2D = "h2d"
    D2H = "d2h"


class WaitKind(enum.Enum):
    """Why a host thread blocked."""

    EVENT = "event"
    """For a device event (a copy, a kernel)."""
    DEVICE = "device"
    """For the whole device: a device synchronisation, or a copy to or from pageable memory."""
    COLLECTIVE = "collective"
    """For a collective whose completion only the host can see (gloo)."""
    WORKER = "worker"
    """For the rank's host worker to finish its jobs (a drain with jobs in flight)."""
    BACKPRESSURE = "backpressure"
    """For a bounded buffer to come free (its consumer, the drive or the host worker, is behind)."""


@dataclass(frozen=True, slots=True)
class HostWait:
    kind: WaitKind
    why: str
    hook: str | None
    """The runtime hook the wait happened in (None: outside every hook)."""
    thread: str


@dataclass(frozen=True, slots=True)
class StreamWait:
    """Stream `waiter` waits, on the device, for an event of stream `on` (None: a collective);
    `whole_stream`: for everything queued on `on` so far, not for one event of the tensors it moves."""

    waiter: Role
    on: Role | None
    whole_stream: bool
    hook: str | None


@dataclass(frozen=True, slots=True)
class Copy:
    direction: Direction
    stream: Role
    nbytes: int
    hook: str | None


@dataclass(frozen=True, slots=True)
class Pin:
    """Host memory page-locked (`pinned`) or unlocked, and the ledger term it belongs to."""

    nbytes: int
    term: str
    pinned: bool


@dataclass(frozen=True, slots=True)
class Mark:
    """A point the test named (a step's start, a backward's end)."""

    label: str


Record = HostWait | StreamWait | Copy | Pin | Mark


@dataclass
class Trace:
    """The records of one traced span, in order."""

    records: list[Record] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, record: Record) -> None:
        with self._lock:
            self.records.append(record)

    def mark(self, label: str) -> None:
        self.add(Mark(label))

    def between(self, first: str | None, last: str | None = None) -> list[Record]:
        """The records after mark `first` (None: from the start) and before mark `last` (None: to the end)."""
        with self._lock:
            records = list(self.records)
        labels = [r.label if isinstance(r, Mark) else None for r in records]
        start = labels.index(first) + 1 if first is not None else 0
        end = labels.index(last, start) if last is not None else len(records)
        return records[start:end]

    def of(self, kind: type[Record], first: str | None = None, last: str | None = None) -> list:
        return [r for r in self.between(first, last) if isinstance(r, kind)]


_ACTIVE: Trace | None = None


@contextlib.contextmanager
def tracing() -> Iterator[Trace]:
    """Record the transfer path of every rank's `Streams` in this process until the block ends."""
    global _ACTIVE  # noqa: PLW0603 - one trace per process, seen by every thread
    trace, outer = Trace(), _ACTIVE
    _ACTIVE = trace
    try:
        yield trace
    finally:
        _ACTIVE = outer


def note(record: Record) -> None:
    """Add `record` to the active trace, if any."""
    if _ACTIVE is not None:
        _ACTIVE.add(record)


def tracing_active() -> bool:
    return _ACTIVE is not None


_HOOK: ContextVar[str | None] = ContextVar("tierwise_hook", default=None)

F = TypeVar("F", bound=Callable)


def hook(name: str) -> Callable[[F], F]:
    """Mark `fn` as the runtime hook `name`: what it does is noted as done inside a hook."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def marked(*args: object, **kwargs: object) -> object:
            token = _HOOK.set(name)
            try:
                return fn(*args, **kwargs)
            finally:
                _HOOK.reset(token)

        return marked  # type: ignore[return-value]

    return wrap


def current_hook() -> str | None:
    """The runtime hook this thread is in (None: none; a worker thread never is)."""
    return _HOOK.get()


def thread_name() -> str:
    return threading.current_thread().name
