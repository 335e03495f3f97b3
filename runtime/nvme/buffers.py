"""Aligned host buffers for direct I/O, and a fixed pool of them that can be pinned for CUDA.

Buffers are anonymous `mmap`s: page-aligned (so O_DIRECT accepts them), zero-filled, and exporting
the buffer protocol, so numpy (`np.frombuffer`) and torch (`torch.frombuffer`) view them without a
copy. The extension has no CUDA, so pinning is a hook: the runtime passes a `PinHook` whose `pin`
calls `torch.cuda.cudart().cudaHostRegister(address, nbytes, 0)` and whose `unpin` calls
`cudaHostUnregister(address)`; the pool pins every buffer once at creation and unpins at close.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Protocol

import numpy as np

from planner.specs.units import round_up_4kib
from runtime.nvme.config import DIRECT_ALIGNMENT_BYTES


def buffer_address(buffer: object) -> int:
    """Address of the first byte of a buffer-protocol object (read-only ones included)."""
    view = memoryview(buffer).cast("B")
    if len(view) == 0:
        return 0
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def as_byte_buffer(obj: object) -> object:
    """A buffer-protocol view of `obj`'s bytes: buffer objects pass through; a contiguous CPU torch
    tensor (any dtype, bf16 included) becomes a uint8 numpy view of its storage, with no copy and
    without this module importing torch."""
    if hasattr(obj, "data_ptr") and hasattr(obj, "is_contiguous"):
        if obj.device.type != "cpu":  # type: ignore[attr-defined]
            raise ValueError(f"NVMe I/O needs a CPU tensor, got one on {obj.device}")  # type: ignore[attr-defined]
        if not obj.is_contiguous():  # type: ignore[attr-defined]
            raise ValueError("NVMe I/O needs a contiguous tensor; call .contiguous() first")
        import torch  # only reached when the caller already has torch tensors

        return obj.detach().reshape(-1).view(torch.uint8).numpy()  # type: ignore[attr-defined]
    return obj


class PinHook(Protocol):
    """Page-locks host memory for fast device copies (implemented by the runtime with torch)."""

    def pin(self, address: int, nbytes: int) -> None: ...

    def unpin(self, address: int) -> None: ...


HUGE_PAGE_BYTES = 2 * 1024**2

# [Note: huge-page buffers]
# A direct I/O is built from the physical pages of its buffer, and the block device caps the
# number of segments per request (virtio-blk: max_segments 254). A 1 MiB block on scattered
# 4 KiB pages needs 256 segments, so the kernel splits it and merges nothing; on 2 MiB pages it
# is one segment, and adjacent blocks merge up to max_sectors_kb: fewer, larger device requests
# (docs/notes/2026-11-22-nvme-engine-buffers.md). Transparent huge pages are commonly in
# `madvise` mode, so buffers ask for them explicitly.


class AlignedBuffer:
    """`nbytes` of page-aligned host memory (capacity rounded up to 4 KiB), on transparent huge
    pages where the kernel grants them ([Note: huge-page buffers])."""

    __slots__ = ("_map", "nbytes", "view", "address")

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"buffer size must be positive, got {nbytes}")
        capacity = round_up_4kib(nbytes)
        self._map = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if capacity >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # THP disabled ("never"): 4 KiB pages still work
                self._map.madvise(mmap.MADV_HUGEPAGE)
        self.nbytes = nbytes
        self.view = memoryview(self._map)[:nbytes]
        self.address = buffer_address(self._map)
        assert self.address % DIRECT_ALIGNMENT_BYTES == 0, "mmap returned unaligned memory"

    @property
    def capacity_bytes(self) -> int:
        return len(self._map)

    def close(self) -> None:
        self.view.release()
        self._map.close()


class _Lease:
    """The base object of an array over a recycled buffer (numpy takes the memory from its
    `__array_interface__`, without a buffer export): freed with the last array viewing it, it gives
    `buffer` back to `recycler`."""

    __slots__ = ("buffer", "recycler", "__array_interface__")

    def __init__(self, buffer: AlignedBuffer, recycler: BufferRecycler, nbytes: int) -> None:
        self.buffer, self.recycler = buffer, recycler
        self.__array_interface__ = {"data": (buffer.address, False), "shape": (nbytes,), "typestr": "|u1",
                                    "version": 3}

    def __del__(self) -> None:
        self.recycler.give_back(self.buffer)


class BufferRecycler:
    """Aligned buffers handed out as arrays and reused once nothing views them any more.

    [Note: recycled read buffers]
    A shard read from NVMe into fresh memory costs the kernel a page fault, a zeroed (and on a
    fragmented host, compacted) huge page per 2 MiB inside the direct I/O's page pinning, which
    slows the read several-fold against a reused buffer (docs/notes/2026-11-22-nvme-engine-buffers.md).
    Parameter shards are read ahead into fresh host tensors
    that the compute then holds for as long as it needs (autograd may keep views of them), so the
    store cannot say when a buffer is free; the buffer's lifetime can: `lease` returns a numpy
    array (torch.from_numpy keeps it alive as long as any tensor storage uses it) whose lease gives
    the buffer back when the array is freed. A freed buffer is kept only while the buffers leased
    and kept add up to at most `max_held_bytes` (the rest are unmapped), and a buffer is reused
    only for a request of its own size, so a recycled buffer never holds more memory than a fresh
    one would and the recycler never holds more than the memory bill sets aside for these reads.
    A lease that needs a fresh buffer first unmaps kept ones of other sizes beyond the bound, and
    a read's contents copied into memory of its own (a recompute's copy, runtime/units/group.py
    `own_buffer`) count against the bound while they live (`hold_outside`); without both rules kept
    buffers sat beside them and host memory went over the bill
    (docs/notes/2026-11-22-nvme-engine-buffers.md).
    """

    def __init__(self, max_held_bytes: int, pin_hook: PinHook | None = None) -> None:
        self.max_held_bytes = max_held_bytes
        self.pin_hook = pin_hook
        """Page-locks every fresh buffer (and unlocks it before unmapping) when set: on CUDA a read
        then copies to the device asynchronously; reuse pays the pinning once per buffer."""
        self._pinned: dict[int, int] = {}
        """Address -> capacity of every pinned buffer alive (leased or kept)."""
        self._free: dict[int, list[AlignedBuffer]] = {}
        self._free_bytes = 0
        self._leased_bytes = 0
        self._outside_bytes = 0
        """Bytes held elsewhere that stand in for leased buffers (`hold_outside`)."""
        self._lock = threading.Lock()  # a tensor may be freed on another thread (autograd's)
        self._closed = False
        self.num_reused = 0

    @property
    def free_bytes(self) -> int:
        return self._free_bytes

    @property
    def leased_bytes(self) -> int:
        """Bytes of the buffers handed out and not freed yet."""
        return self._leased_bytes

    def lease(self, nbytes: int) -> np.ndarray:
        """A zero-copy uint8 array of `nbytes` on page-aligned memory, reused when one is free."""
        capacity = round_up_4kib(nbytes)
        with self._lock:
            free = self._free.get(capacity)
            buffer = free.pop() if free else None
            if buffer is not None:
                self._free_bytes -= capacity
                self.num_reused += 1
            self._leased_bytes += capacity
            evicted = self._evict_over_cap() if buffer is None else []
        for old in evicted:  # a fresh buffer is coming: free ones of other sizes go first
            self._unmap(old)
        if buffer is None:
            buffer = AlignedBuffer(capacity)
            if self.pin_hook is not None:
                self.pin_hook.pin(buffer.address, buffer.capacity_bytes)
                with self._lock:
                    self._pinned[buffer.address] = buffer.capacity_bytes
        return np.asarray(_Lease(buffer, self, nbytes))

    def hold_outside(self, nbytes: int) -> None:
        """`nbytes` of other memory now stand in for a leased buffer (a read's contents copied into a
        torch allocation): they count against the bound until `release_outside`, and kept buffers
        beyond it are unmapped."""
        with self._lock:
            self._outside_bytes += nbytes
            evicted = self._evict_over_cap()
        for old in evicted:
            self._unmap(old)

    def release_outside(self, nbytes: int) -> None:
        with self._lock:
            self._outside_bytes -= nbytes

    def _evict_over_cap(self) -> list[AlignedBuffer]:
        """Free buffers to unmap so that leased + held outside + kept is back within `max_held_bytes`
        (lock held)."""
        evicted = []
        for buffers in self._free.values():
            while buffers and self._leased_bytes + self._outside_bytes + self._free_bytes > self.max_held_bytes:
                old = buffers.pop()
                self._free_bytes -= old.capacity_bytes
                evicted.append(old)
        return evicted

    def give_back(self, buffer: AlignedBuffer) -> None:
        with self._lock:
            self._leased_bytes -= buffer.capacity_bytes
            held = self._leased_bytes + self._outside_bytes + self._free_bytes + buffer.capacity_bytes
            keep = not self._closed and held <= self.max_held_bytes
            if keep:
                self._free.setdefault(buffer.capacity_bytes, []).append(buffer)
                self._free_bytes += buffer.capacity_bytes
        if not keep:
            self._unmap(buffer)

    def _unmap(self, buffer: AlignedBuffer) -> None:
        with self._lock:
            pinned = self._pinned.pop(buffer.address, None) is not None
        if pinned:
            self.pin_hook.unpin(buffer.address)
        buffer.close()

    @property
    def pinned_bytes(self) -> int:
        """Bytes of the buffers page-locked now (leased or kept)."""
        with self._lock:
            return sum(self._pinned.values())

    def close(self) -> None:
        """Unmap the free buffers; buffers still leased are unmapped when their arrays are freed."""
        with self._lock:
            self._closed = True
            free, self._free, self._free_bytes = self._free, {}, 0
        for buffers in free.values():
            for buffer in buffers:
                self._unmap(buffer)


class BufferPool:
    """`num_buffers` aligned buffers of `buffer_bytes`, handed out and returned; pinned once via
    `pin_hook` if given. `acquire` blocks while every buffer is in use, which is what bounds the
    pinned memory of a streaming pipeline (docs/method.md §4.1: a small reused pool moves far larger
    states)."""

    def __init__(self, *, buffer_bytes: int, num_buffers: int, pin_hook: PinHook | None = None) -> None:
        if num_buffers <= 0:
            raise ValueError(f"num_buffers must be positive, got {num_buffers}")
        self.buffer_bytes = buffer_bytes
        self._buffers = [AlignedBuffer(buffer_bytes) for _ in range(num_buffers)]
        self._free = list(reversed(self._buffers))
        self._available = threading.Condition()
        self._pin_hook = pin_hook
        if pin_hook is not None:
            for buffer in self._buffers:
                pin_hook.pin(buffer.address, buffer.capacity_bytes)

    @property
    def num_buffers(self) -> int:
        return len(self._buffers)

    @property
    def num_free(self) -> int:
        """Buffers not handed out right now (an `acquire` would not block)."""
        with self._available:
            return len(self._free)

    @property
    def pinned(self) -> bool:
        return self._pin_hook is not None

    @property
    def total_bytes(self) -> int:
        return sum(buffer.capacity_bytes for buffer in self._buffers)

    def acquire(self, timeout_s: float | None = None) -> AlignedBuffer:
        with self._available:
            if not self._available.wait_for(lambda: bool(self._free), timeout=timeout_s):
                raise TimeoutError(f"no free buffer in the pool of {self.num_buffers} after {timeout_s} s")
            return self._free.pop()

    def release(self, buffer: AlignedBuffer) -> None:
        with self._available:
            assert buffer in self._buffers and buffer not in self._free, "buffer released twice or foreign"
            self._free.append(buffer)
            self._available.notify()

    def close(self) -> None:
        for buffer in self._buffers:
            if self._pin_hook is not None:
                self._pin_hook.unpin(buffer.address)
            buffer.close()
        self._buffers.clear()
        self._free.clear()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
