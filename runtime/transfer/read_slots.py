"""Pinned host slots that NVMe shard reads land in on their way to a device: taken once, reused.

[Note: pinned read slots]
With a device of its own, a parameter shard read from NVMe lands in host memory and is copied to
the device from there (runtime/transfer/nvme_store.py, [Note: NVMe reads to the device]). The host
buffer must be page-locked for that copy to run asynchronously, and it is busy from the read's
submission until its copy has completed. A prefetch keeps the reads of up to `min(depth, 3)`
operators ahead in flight, and at a phase start it submits the operator in use's read with them:
`planner.cost.memory.param_read_slots(plan)` slots, each the largest unit's shard in the compute
precision. They are all pinned at the first read and kept, the bill's `param_swap_buffers` and
what the ledger charges for them, whatever the sizes of the shards read: a read takes any free slot
and a view of its size. Pinning per read size instead (the recycler of the CPU path) pinned and
unpinned buffers at every phase start and for every change of shard size.
A slot comes back when the last view of it is freed (the store drops a read's buffer once its copy
to the device has completed). A read that finds none free is told so (`lease` returns None): the
store then waits for the oldest copy in flight, back-pressure that only a changed order can cause.
"""

from __future__ import annotations

import threading

import numpy as np

from planner.specs.units import round_up_4kib
from runtime.ledger import MemoryLedger
from runtime.nvme.buffers import AlignedBuffer
from runtime.transfer.streams import Streams


class _SlotLease:
    """The base object of an array over a slot: freed with the last array viewing it, it gives the slot back."""

    __slots__ = ("slot", "slots", "__array_interface__")

    def __init__(self, slot: AlignedBuffer, slots: ReadSlots, nbytes: int) -> None:
        self.slot, self.slots = slot, slots
        self.__array_interface__ = {"data": (slot.address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}

    def __del__(self) -> None:
        self.slots.give_back(self.slot)


class ReadSlots:
    """`count` pinned slots of the largest shard read ([Note: pinned read slots]), charged to `term`."""

    def __init__(self, streams: Streams, ledger: MemoryLedger, term: str, count: int) -> None:
        self.streams, self.ledger, self.term, self.count = streams, ledger, term, count
        self.slot_bytes = 0
        """Bytes of a slot: the largest shard that may be read (`hold_reads_of`), 4 KiB-rounded."""
        self._slots: list[AlignedBuffer] = []
        self._free: list[AlignedBuffer] = []
        self._lock = threading.Lock()  # a view may be freed on another thread (autograd's)
        self._closed = False

    def hold_reads_of(self, shard_bytes: int) -> None:
        """A shard of `shard_bytes` exists (before the first read)."""
        assert not self._slots, "slots are sized before the first read"
        self.slot_bytes = max(self.slot_bytes, round_up_4kib(shard_bytes))

    @property
    def total_bytes(self) -> int:
        return self.count * self.slot_bytes

    def lease(self, nbytes: int) -> np.ndarray | None:
        """A uint8 array of `nbytes` on a free slot, or None when every slot is out."""
        assert nbytes <= self.slot_bytes, (nbytes, self.slot_bytes)
        with self._lock:
            if not self._slots:
                self._slots = [self.streams.pinned_buffer(self.slot_bytes, self.term) for _ in range(self.count)]
                self._free = list(reversed(self._slots))
                self.ledger.add("cpu", self.term, self.total_bytes)
            if not self._free:
                return None
            slot = self._free.pop()
        return np.asarray(_SlotLease(slot, self, nbytes))

    def give_back(self, slot: AlignedBuffer) -> None:
        with self._lock:
            if not self._closed:
                self._free.append(slot)
                return
        self.streams.release_pinned(slot, self.term)

    @property
    def num_free(self) -> int:
        with self._lock:
            return len(self._free)

    def close(self) -> None:
        """Unpin the free slots (a slot still viewed is unpinned when its last view goes)."""
        with self._lock:
            self._closed = True
            free, self._free = self._free, []
            if self._slots:
                self.ledger.sub("cpu", self.term, self.total_bytes)
            self._slots = []
        for slot in free:
            self.streams.release_pinned(slot, self.term)
