"""The rank's pinned staging pool: every host<->device copy of CPU-tier state goes through it.

[Note: staged host copies]
CPU-tier shards, offloaded recompute inputs and host gradient shards are ordinary pageable memory. A
copy to the device takes a buffer from this pool, copies the piece into it on the host (a memcpy),
queues the asynchronous host-to-device copy on the copy stream and records an event; the buffer
goes back to the pool when that event has completed. A copy off the device is the reverse: the
device-to-host copy into a leased buffer is queued on the copy stream, and once its event
completed the piece is copied (or added) into its pageable destination and the buffer returned.
Transfers larger than a buffer go through it in pieces, one lease each.

The pool has `num_buffers` buffers of `buffer_bytes` (planner.cost.memory.pinned_staging_pool: what the
bill charges) and never grows: a lease that finds every buffer out waits for the oldest copy in
flight and finishes it (its event, then its host side), in the order the copies were queued on the
one copy stream. Finished copies are also reaped at every lease, so a buffer returns as soon as its
copy is done without anybody waiting for it. A device-to-host copy brought back to the device
before it landed (an offloaded recompute input reloaded early, `back_to_device`) goes from its buffer,
which then returns after that copy too: the host waits for neither direction.

On a machine without CUDA the buffers are ordinary memory, copies complete in the call and every
buffer returns at once; the lease/return path and its bounds are the same.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from planner.cost.memory import PinnedPoolShape
from runtime.nvme.buffers import AlignedBuffer, BufferPool
from runtime.transfer.trace import Direction, Role, WaitKind

if TYPE_CHECKING:
    from runtime.transfer.streams import DeviceEvent, Streams


class _StagedCopy:
    """One piece in flight through a leased buffer: done once `event` completed and `then` (the
    host side of a device-to-host copy) ran; `finish` does both, once, and returns the buffer."""

    __slots__ = ("pool", "buffer", "event", "then", "staged", "_finished", "_lock")

    def __init__(self, pool: StagingPool, buffer: AlignedBuffer, event: DeviceEvent | None,
                 then: Callable[[], None] | None, staged: torch.Tensor | None = None) -> None:
        self.pool, self.buffer, self.event, self.then = pool, buffer, event, then
        self.staged = staged
        """The piece in the buffer (a device-to-host copy's), for `reissue`."""
        self._finished = False
        self._lock = threading.Lock()

    def copied(self) -> bool:
        """The device copy has finished (never blocks)."""
        return self.event is None or self.event.query()

    def finish(self, kind: WaitKind = WaitKind.EVENT) -> None:
        with self._lock:
            if self._finished:
                return
            if not self.copied():
                self.event.layer.host_wait(self.event, "a staged copy", kind)
            if self.then is not None:
                self.then()
            self._finished = True
            self.then = self.staged = None  # they view the buffer: nothing may outlive the return
        self.pool.release(self.buffer)

    def reissue(self, dst: torch.Tensor, stream: Role) -> bool:
        """Queue `dst = piece` from the buffer, after its device-to-host copy on the same stream, if
        the piece has not been finished (landed and returned) yet; the buffer then comes back after
        this copy too. False when it was: the bytes are in host memory only."""
        with self._lock:
            if self._finished or self.staged is None:
                return False
            self.event = self.pool.streams.copy(dst, self.staged, Direction.H2D, on=stream, after=self.event)
            return True


class HostTransfer:
    """A device-to-host copy through the pool, piece by piece (`StagingPool.to_host`)."""

    __slots__ = ("pieces", "event")

    def __init__(self, pieces: list[tuple[_StagedCopy | None, int, int]], event: DeviceEvent | None) -> None:
        self.pieces = pieces
        """(copy in flight or None once done, offset, numel) per piece."""
        self.event = event
        """The last piece's copy (the whole transfer: one stream runs them in order); None when done."""

    def finish(self) -> None:
        """Wait for every piece and land it on the host (the buffers come back)."""
        for copy, _, _ in self.pieces:
            if copy is not None:
                copy.finish()


class StagingPool:
    """`num_buffers` reused buffers of `buffer_bytes`, pinned with `pin_hook` (cudaHostRegister) on
    CUDA ([Note: staged host copies]). `acquire`/`release` lend a whole buffer (training-checkpoint saves);
    `to_device`/`to_host` stage a copy through them."""

    def __init__(self, shape: PinnedPoolShape, pin_hook=None, streams: Streams | None = None) -> None:  # noqa: ANN001
        """`pin_hook`: a runtime.nvme.PinHook; `streams`: the layer the staged copies run on (None:
        copies are done in the call)."""
        self.streams = streams
        self.buffer_bytes = shape.buffer_bytes
        self.buffers = BufferPool(buffer_bytes=shape.buffer_bytes, num_buffers=shape.num_buffers, pin_hook=pin_hook)
        """The pooled memory (`total_bytes` is what the ledger charges; `pinned` on CUDA)."""
        self._lock = threading.Lock()
        self._in_flight: deque[_StagedCopy] = deque()
        self.num_leases = 0
        """Buffers handed out so far (each lease of a staged piece or a whole buffer counts once)."""
        self.peak_leased = 0
        """Most buffers out at once: never above `num_buffers`."""
        # Unpin before the memory goes back to the kernel, however the pool ends: a later pool's
        # buffer at the same address could not be registered again.
        self._finalizer = weakref.finalize(self, self.buffers.close)

    @property
    def num_leased(self) -> int:
        return self.buffers.num_buffers - self.buffers.num_free

    def acquire(self) -> AlignedBuffer:
        """A free buffer; with none free, finish the oldest copy in flight (or wait for a return)."""
        while True:
            with self._lock:
                self._reap()
                if self.buffers.num_free:
                    buffer = self.buffers.acquire(timeout_s=0)
                    self.num_leases += 1
                    self.peak_leased = max(self.peak_leased, self.num_leased)
                    return buffer
                oldest = self._in_flight.popleft() if self._in_flight else None
            if oldest is not None:  # the pool is full: its consumer is behind
                oldest.finish(WaitKind.BACKPRESSURE)
            else:  # every buffer is lent whole (another thread's training-checkpoint chunk): wait for it
                self.buffers.release(self.buffers.acquire())

    def release(self, buffer: AlignedBuffer) -> None:
        self.buffers.release(buffer)

    def _reap(self) -> None:
        """Return the buffers of the copies that finished, oldest first (lock held)."""
        while self._in_flight and self._in_flight[0].copied():
            self._in_flight.popleft().finish()

    def _track(self, copy: _StagedCopy) -> None:
        with self._lock:
            self._in_flight.append(copy)

    def drain(self) -> None:
        """Finish every copy in flight (their buffers come back)."""
        while True:
            with self._lock:
                oldest = self._in_flight.popleft() if self._in_flight else None
            if oldest is None:
                return
            oldest.finish()

    def _pieces(self, numel: int, dtype: torch.dtype) -> range:
        return range(0, numel, max(1, self.buffer_bytes // dtype.itemsize))

    def _staged(self, buffer: AlignedBuffer, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.frombuffer(buffer.view, dtype=dtype, count=numel) if numel else torch.empty(0, dtype=dtype)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, stream: Role | None,
                  after: DeviceEvent | None = None) -> DeviceEvent | None:
        """Queue `dst = src` (flat, same numel) from pageable host memory on `stream` (None: copy
        now) after `after`; returns the event of the last piece (the whole copy: one stream runs
        them in order)."""
        event = None
        step = max(1, self.buffer_bytes // src.element_size())
        for start in self._pieces(src.numel(), src.dtype):
            piece = src[start : start + step]
            buffer = self.acquire()
            staged = self._staged(buffer, src.dtype, piece.numel())
            staged.copy_(piece)
            if stream is None:
                dst[start : start + piece.numel()].copy_(staged)
                self.release(buffer)
                continue
            event = self.streams.copy(dst[start : start + piece.numel()], staged, Direction.H2D, on=stream,
                                      after=after if event is None else None)
            self._track(_StagedCopy(self, buffer, event, None))
        return event

    def to_host(self, src: torch.Tensor, land: Callable[[torch.Tensor, int], None],
                stream: Role | None, after: DeviceEvent | None = None) -> HostTransfer:
        """Queue copying the flat device tensor `src` off the device on `stream` (None: now) after
        `after`, piece by piece; `land(staged, offset)` puts each piece where it belongs on the host
        (a copy or an add), after its copy finished."""
        pieces: list[tuple[_StagedCopy | None, int, int]] = []
        event = None
        step = max(1, self.buffer_bytes // src.element_size())
        for start in self._pieces(src.numel(), src.dtype):
            numel = min(step, src.numel() - start)
            buffer = self.acquire()
            staged = self._staged(buffer, src.dtype, numel)
            if stream is None:
                staged.copy_(src[start : start + numel])
            else:
                event = self.streams.copy(staged, src[start : start + numel], Direction.D2H, on=stream,
                                          after=after if event is None else None)
            copy = _StagedCopy(self, buffer, event, lambda staged=staged, start=start: land(staged, start), staged)
            if stream is None:
                copy.finish()
            else:
                self._track(copy)
            pieces.append((None if stream is None else copy, start, numel))
        return HostTransfer(pieces, event)

    def back_to_device(self, transfer: HostTransfer, dst: torch.Tensor, host: torch.Tensor,
                       stream: Role | None) -> DeviceEvent | None:
        """Queue `dst = host` (flat) where `host` is the destination of `transfer`: a piece still in
        its buffer goes from there, after its device-to-host copy on the same stream, so the host
        never waits for it to land; a landed piece is staged again from `host`. Returns the event
        of the last piece (the whole copy)."""
        event = None
        for copy, start, numel in transfer.pieces:
            piece = dst[start : start + numel]
            if stream is not None and copy is not None and copy.reissue(piece, stream):
                event = copy.event
            else:  # landed (finishing it does not wait)
                if copy is not None:
                    copy.finish()
                event = self.to_device(piece, host[start : start + numel], stream) or event
        return event

    def close(self) -> None:
        self.drain()
        self._finalizer()


def staging_pool_for(plan, copier, ledger) -> StagingPool | None:  # noqa: ANN001 - Plan, CopyEngine, MemoryLedger
    """The rank's pool, sized by the plan (the bill's `pinned_staging_pool`, one source of truth),
    charged to `ledger`; None where no host-tier state crosses to the device (the CPU machine, or
    every state on the device or NVMe)."""
    from planner.cost.memory import host_state_crosses_link, pinned_staging_pool
    from planner.specs.memory_terms import MemoryTerm

    if not copier.separate_memory or not host_state_crosses_link(plan):
        return None
    streams = copier.streams
    pool = StagingPool(pinned_staging_pool(plan), streams.pin_hook(MemoryTerm.PINNED_STAGING_POOL), streams)
    ledger.add("cpu", MemoryTerm.PINNED_STAGING_POOL, pool.buffers.total_bytes)
    return pool
