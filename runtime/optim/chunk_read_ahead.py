"""The streamed optimizer's chunks and the one mechanism that reads them ahead of their update.

[Note: one read-ahead]
Whatever the schedule, the streamed update is a pass over chunks in an expected order: claim a
chunk's buffer, wait for its reads, update, submit its writes. `ChunkReadAhead` is the only place
that reads chunks before they are claimed: it keeps the expected order, reads the next expected
chunks into pool buffers that are free (or whose writes have landed: with `wait`, it waits for the
oldest write to land, else it stops), and hands the head of its queue to a claim that matches it.
A claim that does not match (a changed order) drops the queue and reads that chunk on demand from
then on; the order is re-learned by whoever starts the next pass. Its three uses differ only in
when they start a pass and how far they fill it (runtime/optim/streamed_optimizer.py):

- the after-backward step: one pass over the chunks of the units that got a gradient, each read
  with its gradient region, `B - 2` chunks ahead of the update (at least 1), waiting for writes;
- before it, during backward: the first `B - 1` of those chunks' states, one more each time a
  unit's gradient is final ([Note: reading the next step's states ahead]), continued by the step's
  pass when they are the step's first chunks and nothing wrote the stores since;
- the in-backward update: the states of the chunks in the order of the last step, from the
  forward's tail, as far as buffers are free, never waiting for a write ([Note: the optimizer
  step in backward]).

It is not thread-safe and need not be: in backward only the optimizer worker uses it, between
backwards only the main thread, and the worker is drained at each hand-over ([Note: the
optimizer worker] in runtime/optim/optimizer_worker.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from planner.cost.memory import OPTIMIZER_CHUNK_REGIONS, optimizer_chunk_numel
from runtime.nvme import AlignedBuffer, BufferPool
from runtime.transfer.stores import Pending

REGIONS = OPTIMIZER_CHUNK_REGIONS
"""master, exp_avg, exp_avg_sq, grad."""


def chunk_numel_for(chunk_bytes: int) -> int:
    """Elements per chunk so that the four fp32 regions fit one buffer of `chunk_bytes` (the memory
    bill's geometry, `planner.cost.memory.optimizer_chunk_numel`)."""
    numel = optimizer_chunk_numel(chunk_bytes)
    assert numel > 0, chunk_bytes
    return numel


@dataclass(frozen=True, slots=True)
class Chunk:
    """Elements [start, start + numel) of unit `key`'s shards."""

    key: str
    start: int
    numel: int


Reads = Callable[[Chunk, AlignedBuffer], list[Pending]]
"""Submits a chunk's reads into a buffer."""
InFlight = tuple[AlignedBuffer, list[Pending]]


class ChunkReadAhead:
    """Chunks read ahead of their claim, in an expected order, into a pool's buffers; also the
    writes in flight, whose buffers it takes back once they land ([Note: one read-ahead])."""

    def __init__(self, pool: BufferPool, write_stamp: Callable[[], tuple[int, ...]]) -> None:
        self.pool = pool
        self._write_stamp = write_stamp
        self.queue: deque[tuple[Chunk, AlignedBuffer, list[Pending]]] = deque()
        """Chunks read (or being read) ahead, in the order they are expected to be claimed."""
        self.writes: deque[InFlight] = deque()
        self.diverged = False
        """A claim did not match the expected order: no more reading ahead in this pass."""
        self.since: tuple[int, ...] | None = None
        """The state stores' write stamp when this pass started (None: no pass)."""
        self._expected: list[Chunk] = []
        self._next = 0
        self._read: Reads = lambda chunk, buffer: []  # noqa: ARG005 - replaced by each pass

    def start(self, expected: list[Chunk], read: Reads) -> None:
        """A new pass over `expected`, each chunk read with `read` (what is queued is dropped)."""
        self.drop()
        self.since = self._write_stamp()
        self._expected, self._next, self._read = expected, 0, read
        self.diverged = False

    def resume(self, expected: list[Chunk], read: Reads) -> list[tuple[Chunk, AlignedBuffer, list[Pending]]]:
        """Continue the pass over `expected` (the chunks after those queued read with `read`),
        keeping what is queued when it is `expected`'s first chunks and read since the stores were
        last written, else dropping it; returns what is kept."""
        if self.queue and (self.stale or [c for c, _, _ in self.queue] != expected[: len(self.queue)]):
            self.drop()
        self._expected, self._next, self._read = expected, len(self.queue), read
        self.diverged = False
        return list(self.queue)

    @property
    def stale(self) -> bool:
        """No pass started, or the stores were written since it did."""
        return self.since != self._write_stamp()

    def fill(self, *, limit: int | None = None, wait: bool = False) -> None:
        """Read the next expected chunks until `limit` are queued, into free buffers or buffers whose
        write has landed (with `wait`, waiting for the oldest write to land)."""
        while not self.diverged and self._next < len(self._expected) and (limit is None or len(self.queue) < limit):
            if not self.pool.num_free:
                if not self.writes or not (wait or all(p.ready() for p in self.writes[0][1])):
                    return
                self.retire(self.writes.popleft())
            chunk = self._expected[self._next]
            self._next += 1
            buffer = self.pool.acquire()
            self.queue.append((chunk, buffer, self._read(chunk, buffer)))

    def claim(self, chunk: Chunk) -> InFlight:
        """The buffer `chunk`'s reads are in flight into: read ahead, or read now."""
        if self.queue and self.queue[0][0] == chunk:
            _, buffer, pendings = self.queue.popleft()
            return buffer, pendings
        expected = (not self.diverged and not self.queue and self._next < len(self._expected)
                    and self._expected[self._next] == chunk)
        if expected:  # next in order, not read ahead for want of a free buffer
            self._next += 1
        else:  # the order changed: read on demand from here on
            self.diverged = True
            self.drop()
        if not self.pool.num_free and self.writes:
            self.retire(self.writes.popleft())
        buffer = self.pool.acquire()
        return buffer, self._read(chunk, buffer)

    def stop(self) -> None:
        """End the pass: drop what was read ahead and not claimed."""
        self.drop()
        self.since = None

    def drop(self) -> None:
        while self.queue:
            _, buffer, pendings = self.queue.popleft()
            self.retire((buffer, pendings))

    def retire_writes(self) -> None:
        while self.writes:
            self.retire(self.writes.popleft())

    def retire(self, entry: InFlight) -> None:
        buffer, pendings = entry
        for p in pendings:
            p.wait()
        self.pool.release(buffer)
