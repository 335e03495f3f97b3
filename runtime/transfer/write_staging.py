"""An NVMe store's write staging: a few reused page-aligned buffers that its writes go out from.

[Note: write staging]
A write copies its data into a staging buffer, submits it and returns: the caller may reuse its
tensor at once. The buffers are reused (a fresh one per write would cost the kernel a zeroed page
per 4 KiB, every step), `count` of them of the largest shard (two; the gradient store has the
bill's `gradient_write_buffers`, [Note: gradient write buffers] in planner/cost/memory.py): a write
takes a free one, or waits for the oldest write in flight to land. Where a device's gradients are
copied into them (the gradient store with a device of its own), they are pinned, all of one size
known up front (`fixed_bytes`) and kept for the run: a buffer then is out from the copy's issue
(the autograd thread) to its write's end, and the write is submitted by the rank's transfer worker
once the copy landed ([Note: NVMe gradient writes from the device] in runtime/transfer/nvme_store.py).
With every buffer out and no write submitted yet, taking one waits for the worker to submit one.
`drain` waits for the writes in flight and, unless told to keep them, gives the buffers back.
"""

from __future__ import annotations

import threading
from collections import deque

from planner.specs.units import round_up_4kib
from runtime.ledger import MemoryLedger
from runtime.nvme import AlignedBuffer, Handle
from runtime.transfer.streams import Streams
from runtime.transfer.trace import WaitKind


class WriteStaging:
    """`count` reused staging buffers of one NVMe store ([Note: write staging]), charged to `term`."""

    def __init__(self, *, count: int, ledger: MemoryLedger, term: str, lock: threading.RLock,
                 streams: Streams | None = None, fixed_bytes: int = 0) -> None:
        """`lock`: the store's (its swap space's) lock, held by every caller. `streams`: pin the
        buffers through it, each `fixed_bytes` (4 KiB-rounded) for the run."""
        self.count, self.ledger, self.term = count, ledger, term
        self.streams = streams
        self.fixed_bytes = round_up_4kib(fixed_bytes) if fixed_bytes else 0
        self.largest_bytes = self.fixed_bytes
        """Buffers are at least this large: the largest shard so far (shards may be created after
        the first write, and an unpinned buffer outgrown is replaced)."""
        self._free: list[AlignedBuffer] = []
        self._out = 0
        """Buffers handed out: being filled, or written from."""
        self._in_flight: deque[tuple[Handle, AlignedBuffer]] = deque()
        self._available = threading.Condition(lock)

    def grow(self, nbytes: int) -> None:
        """A shard of `nbytes` exists."""
        assert not self.fixed_bytes or round_up_4kib(nbytes) <= self.fixed_bytes, (nbytes, self.fixed_bytes)
        self.largest_bytes = max(self.largest_bytes, round_up_4kib(nbytes))

    def acquire(self, nbytes: int) -> AlignedBuffer:
        """A free buffer of at least `nbytes`; with every one out, wait for the oldest write to land
        (or, with none submitted yet, for the transfer worker to submit one)."""
        while not self._free and self._out >= self.count:
            if self._in_flight:
                self.retire_oldest()
            else:
                if self.streams is not None:
                    self.streams.blocked(WaitKind.BACKPRESSURE, "a write staging buffer")
                self._available.wait()
        self._out += 1
        fitting = [b for b in self._free if b.capacity_bytes >= nbytes]
        if fitting:
            self._free.remove(fitting[0])
            return fitting[0]
        if self._free:  # too small for this shard (unpinned only): replace it
            self._close(self._free.pop())
        return self._new(max(nbytes, self.largest_bytes))

    def submitted(self, handle: Handle, buffer: AlignedBuffer) -> None:
        """`buffer` is written from by `handle`: it comes back once the write landed."""
        self._in_flight.append((handle, buffer))
        self._available.notify()  # a writer waiting for a buffer can now wait for this write

    def release(self, buffer: AlignedBuffer) -> None:
        self._out -= 1
        self._free.append(buffer)
        self._available.notify()

    def retire_oldest(self) -> None:
        handle, buffer = self._in_flight.popleft()
        handle.wait()
        self.release(buffer)

    def drain(self, *, keep: bool) -> None:
        """Wait for every write in flight; then, unless `keep`, give the free buffers back."""
        while self._in_flight:
            self.retire_oldest()
        if not keep:
            while self._free:
                self._close(self._free.pop())

    def _new(self, nbytes: int) -> AlignedBuffer:
        size = round_up_4kib(nbytes)
        if self.streams is not None:
            assert size == self.fixed_bytes, (size, self.fixed_bytes)
            buffer = self.streams.pinned_buffer(size, self.term)
        else:
            buffer = AlignedBuffer(size)
        self.ledger.add("cpu", self.term, buffer.capacity_bytes)
        return buffer

    def _close(self, buffer: AlignedBuffer) -> None:
        self.ledger.sub("cpu", self.term, buffer.capacity_bytes)
        if self.streams is not None:
            self.streams.release_pinned(buffer, self.term)
        else:
            buffer.close()
