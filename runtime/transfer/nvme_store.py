"""Shards on NVMe (`nvme` placement): `NvmeStore`, behind the same interface as the in-memory stores.

Each rank owns one `NvmeSpace`: its private swap directory under the plan's `nvme_path` (created,
and preflighted against the node's total, before any unit is built, so a too-small `nvme_path` is
refused before training) and the async I/O engine. Each model state placed on NVMe gets one
preallocated swap file in it (`params.swap`, `gradients.swap`, `optimizer_states.swap`) carved
into 4 KiB-aligned extents, one per shard (docs/nvme.md). Above `NvmeStore`: [Note: one lock per
swap space] (two threads use the stores) and [Note: NVMe reads to the device].

[Note: ordering of NVMe transfers]
Writes are fire-and-forget for the caller: `write` copies the data into a staging buffer, submits it
and returns, so gradient shards stream out while backward goes on (docs/method.md §4.3 overlap). The
store orders its own traffic: a read (or read-modify-write) of a range of a shard first waits for
the writes in flight that overlap it, and so does a write (two writes of one range in flight at
once would land in either order; writes of disjoint chunks of a shard, as the optimizer's, do not
wait for each other), and write staging is a few reused page-aligned buffers of the
largest shard (two; the gradient store has the memory model's `gradient_write_buffers`, four at
prefetch depth 3 with parameters on NVMe, [Note: gradient write buffers] in planner/cost/memory.py): a
write takes a free one, or waits for the oldest write in flight. Reusing them (instead of a fresh
buffer per write) spares the kernel zeroing new pages for every gradient byte; `drain` gives them
back, so host memory stays within the plan's bill between steps too (the gradient store keeps its
buffers from step to step: the bill holds them throughout, and fresh ones cost page faults every
step, see [Note: recycled read buffers]).
Reads return a `Pending` that waits for the I/O; the store also keeps every read handle until it
finished, because a prefetch nobody waited for must not land in freed memory.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import threading
from collections.abc import Callable
from typing import ClassVar, TypeVar

import torch

from planner.cost.memory import WRITE_STAGING_BUFFERS
from planner.specs.memory_terms import MemoryTerm
from planner.specs.units import round_up_4kib
from runtime.ledger import MemoryLedger, nbytes
from runtime.nvme import (
    AlignedBuffer,
    BufferRecycler,
    EngineConfig,
    Handle,
    IOEngine,
    SwapDirectory,
    SwapStore,
    find_stale_swap_dirs,
)
from runtime.nvme.extents import Extent
from runtime.transfer.mixed_add import add_into
from runtime.transfer.read_slots import ReadSlots
from runtime.transfer.stores import CopyEngine, Pending, ShardKey, ShardStore
from runtime.transfer.streams import DeviceEvent
from runtime.transfer.trace import WaitKind
from runtime.transfer.write_staging import WriteStaging

STAGING_TERMS = {"params": MemoryTerm.PARAM_SWAP_BUFFERS, "gradients": MemoryTerm.GRADIENT_SWAP_BUFFERS,
                 "optimizer_states": MemoryTerm.OPTIMIZER_SWAP_BUFFERS}
"""Host-tier ledger term of each state's write staging (the memory model's names)."""

def aligned_empty(numel: int, dtype: torch.dtype, recycler: BufferRecycler | None = None) -> torch.Tensor:
    """A host tensor on page-aligned memory (huge pages where granted), so direct I/O takes it whole;
    from `recycler` when given ([Note: recycled read buffers] in runtime/nvme/buffers.py)."""
    if not numel:
        return torch.empty(0, dtype=dtype)
    size = numel * dtype.itemsize
    if recycler is not None:
        # from_numpy keeps the array, and through it the lease, alive as long as any view.
        return torch.from_numpy(recycler.lease(size)).view(dtype)
    buffer = AlignedBuffer(size)
    # frombuffer keeps `buffer.view` (and through it the mapping) alive as long as the tensor.
    return torch.frombuffer(buffer.view, dtype=dtype, count=numel)

class NvmeSpace:
    """This rank's swap directory, engine and the capacity of each state's swap file."""

    def __init__(self, nvme_path: str, *, rank: int, capacity_bytes: dict[str, int], node_needed_bytes: int,
                 block_size_bytes: int, read_buffers: int = 2,
                 gradient_write_buffers: int = WRITE_STAGING_BUFFERS, read_slots: ReadSlots | None = None,
                 largest_shard_numel: int = 0) -> None:
        self.capacity_bytes = {name: round_up_4kib(b) for name, b in capacity_bytes.items()}
        _remove_stale(nvme_path)
        self.directory = SwapDirectory(nvme_path, rank=rank, needed_bytes=node_needed_bytes)
        self.engine = IOEngine(EngineConfig(block_size_bytes=block_size_bytes))
        self._files: dict[str, SwapStore] = {}
        self.read_buffers = read_buffers
        """How many shard reads the memory bill holds in host memory at once: the host swap buffers
        (2), or, where the host is the compute device, every unit from the one in use to the
        deepest prefetch (depth + 1)."""
        self.write_buffers = {"gradients": gradient_write_buffers}
        """Write staging buffers per state (WRITE_STAGING_BUFFERS where not named; [Note: ordering of
        NVMe transfers])."""
        self.lock = threading.RLock()
        """Taken by every store of the space around each call ([Note: one lock per swap space])."""
        self.recycler = BufferRecycler(max_held_bytes=0)
        """Host buffers that shard reads land in, reused once freed ([Note: recycled read buffers]),
        up to `read_buffers` of the largest shard (`hold_reads_of`)."""
        self.read_slots = read_slots
        """With a device of its own: the pinned slots shard reads for it land in ([Note: pinned read
        slots] in runtime/transfer/read_slots.py)."""
        self.largest_shard_numel = largest_shard_numel
        """Elements of the largest shard any store of the space will hold (sized before any exists)."""

    def hold_reads_of(self, shard_bytes: int) -> None:
        """A shard of `shard_bytes` exists: let the recycler keep `read_buffers` of it."""
        self.recycler.max_held_bytes = max(self.recycler.max_held_bytes, self.read_buffers * round_up_4kib(shard_bytes))

    def swap_file(self, name: str) -> SwapStore:
        if name not in self._files:
            self._files[name] = SwapStore(self.directory, name, capacity_bytes=self.capacity_bytes[name],
                                          engine=self.engine)
        return self._files[name]

    def close(self) -> None:
        """Close the files and remove the directory (also done at interpreter exit)."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        self.recycler.close()
        if self.read_slots is not None:
            self.read_slots.close()
        self.directory.close()

class StaleSwapWarning(UserWarning):
    """Swap directories of crashed runs were found under nvme_path and removed."""

def _remove_stale(nvme_path: str) -> None:
    """Remove the swap directories that crashed runs on this host left behind (their owner pid is
    gone, so nothing can use them again) before the preflight counts free space: a run restarted
    after a SIGKILL or an OOM kill gets the space back instead of a refusal."""
    import warnings

    with contextlib.suppress(OSError):
        for entry in find_stale_swap_dirs(nvme_path):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not entry.path.exists():
                warnings.warn(f"removed stale swap directory {entry.path} ({entry.nbytes} bytes) of a crashed run "
                              f"(owner pid {entry.pid} is gone)", StaleSwapWarning, stacklevel=3)

Method = TypeVar("Method", bound=Callable)

def _locked(method: Method) -> Method:
    """Run the store method under its swap space's lock ([Note: one lock per swap space])."""

    @functools.wraps(method)
    def locked(self: NvmeStore, *args: object, **kwargs: object) -> object:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]

# [Note: one lock per swap space]
# With the optimizer step in backward two threads use the stores at once: the autograd thread reads
# parameter shards for the backward's gathers while the optimizer worker reads and writes the states
# and writes the updated parameter shards ([Note: the optimizer worker] in
# runtime/optim/optimizer_worker.py). A store's requests in flight (`_writes`, `_staged_writes`,
# `_free_staging`, `_reads`, `_landing`, `_copies`), its write count and the model's link-byte
# counters are read-modify-write Python structures, and the parameter store is used by both threads;
# the counters are shared by every store of the space, so a lock per store would not cover them.
# So every store of a swap space takes the space's one (re-entrant) lock around each call and
# around issuing a landed read's device copy. The engine, the read recycler and the ledger lock
# themselves. Each call only submits requests and waits, at most, for a write of the same range or
# for the oldest staging buffer's write, so the other thread waits for a submission, never for a
# whole update. Waiting for a `Pending` happens outside the lock: a handle has one consumer.
#
# [Note: NVMe reads to the device]
# On CUDA a shard read for the compute lands in one of the rank's pinned read slots (taken once:
# [Note: pinned read slots] in runtime/transfer/read_slots.py), and its copy is issued on the
# host-to-device stream as soon as the store sees the read landed: any later `read` of the
# store, the prefetcher's `ready()` poll, or at the latest the consumer's `wait()`. The consumer's
# stream waits on the copy's event, never the host (which only ever waits for the read itself). A
# pinned buffer under an asynchronous copy must not be reused before the copy ends: the store keeps
# each host buffer until its copy's event has completed (`_copies`), and `drain` waits for them.
class NvmeStore(ShardStore):
    """Shards in one swap file on NVMe; read into fresh host buffers ahead of use, written from staging."""

    tier = "nvme"
    resident_states: ClassVar[bool] = False

    def __init__(self, *, term: str, ledger: MemoryLedger, copier: CopyEngine, name: str = "",
                 swap: NvmeSpace | None = None) -> None:
        super().__init__(term=term, ledger=ledger, copier=copier, name=name)
        assert swap is not None, "the nvme tier needs the rank's NvmeSpace"
        self.file = swap.swap_file(self.name)
        self._lock = swap.lock
        self.engine = swap.engine
        self.recycler = swap.recycler
        self._slots = swap.read_slots if copier.separate_memory else None
        self._hold_reads_of = swap.hold_reads_of
        self._extents: dict[ShardKey, tuple[Extent, torch.dtype, int]] = {}
        self._writes: dict[ShardKey, list[tuple[Handle, int, int]]] = {}
        """Writes in flight per shard, with the element range [start, end) each writes."""
        pinned = copier.separate_memory and self.name == "gradients"  # a device's gradients are copied in
        self.staging = WriteStaging(
            count=swap.write_buffers.get(self.name, WRITE_STAGING_BUFFERS), ledger=ledger, term=STAGING_TERMS[self.name],
            lock=self._lock, streams=copier.streams if pinned else None,
            fixed_bytes=swap.largest_shard_numel * 4 if pinned else 0)
        self._reads: list[Handle] = []
        self._landing: list[_ThenPending] = []
        """Reads for the device whose host-to-device copy is not issued yet ([Note: NVMe reads to the device])."""
        self._copies: list[tuple[DeviceEvent, torch.Tensor]] = []
        """Host-to-device copies in flight with the pinned host buffer each reads from."""
        self.num_writes = 0
        """Writes submitted so far (any key): lets a reader tell that nothing was written since it
        read ahead (the streamed optimizer's next-step prefetch)."""

    # -- lifetime ---------------------------------------------------------------------------
    @_locked
    def create(self, key: ShardKey, numel: int, dtype: torch.dtype) -> None:
        """Reserve the shard's extent. Preallocated swap space reads as zeros, so it starts zeroed."""
        assert key not in self._extents, f"shard {key} already exists in the nvme store"
        size = numel * dtype.itemsize
        self._extents[key] = (self.file.allocate(size), dtype, numel)
        self.staging.grow(size)
        self._hold_reads_of(size)
        if self._slots is not None and self.name == "params":
            self._slots.hold_reads_of(size)
        self.ledger.add(self.tier, self.term, size)
        return None

    @_locked
    def free(self, key: ShardKey) -> None:
        self._wait_writes(key)
        extent, dtype, numel = self._extents.pop(key)
        self.file.free(extent)
        self.ledger.sub(self.tier, self.term, numel * dtype.itemsize)

    @_locked
    def keys(self) -> list[ShardKey]:
        return list(self._extents)

    @_locked
    def shard_info(self, key: ShardKey) -> tuple[int, torch.dtype]:
        _, dtype, numel = self._extents[key]
        return numel, dtype

    def resident(self, key: ShardKey) -> torch.Tensor:
        raise AssertionError(f"shard {key} lives on NVMe: stream it with read_into/write_from")

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raise AssertionError("NvmeStore.create reserves extents; nothing is allocated in memory")

    # -- traffic ----------------------------------------------------------------------------
    @_locked
    def read(self, key: ShardKey, dtype: torch.dtype) -> Pending:
        _, stored, numel = self._extents[key]
        if not self.copier.separate_memory:
            host = aligned_empty(numel, stored, self.recycler)
            handle = self._submit_read(key, host, 0)
            if dtype == stored:
                return _pending_on(handle, host, fresh=True)
            return _ThenPending(handle, host, self.compute_device, dtype, self.copier, self._copies, self._lock)
        host = self._slot(numel, stored)
        pending = _ThenPending(self._submit_read(key, host, 0), host, self.compute_device, dtype, self.copier,
                               self._copies, self._lock)
        self._landing = [p for p in self._landing if not p.issue_if_landed()]
        self._landing.append(pending)
        return pending

    def _slot(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A pinned read slot for a shard of `numel` ([Note: pinned read slots]); with none free, the
        oldest copy to the device in flight is waited for (back-pressure), else the oldest read."""
        assert self._slots is not None
        while True:
            self._copies[:] = [(e, h) for e, h in self._copies if not e.query()]
            array = self._slots.lease(numel * dtype.itemsize)
            if array is not None:
                return torch.from_numpy(array).view(dtype)[:numel]
            if self._copies:
                event, _ = self._copies.pop(0)
                self.copier.streams.host_wait(event, "a pinned read slot", WaitKind.BACKPRESSURE)
            elif self._landing:
                self.copier.streams.blocked(WaitKind.BACKPRESSURE, "a pinned read slot")
                self._landing.pop(0).issue()
            else:
                raise RuntimeError(f"every one of the {self._slots.count} pinned NVMe read slots is in use; "
                                   "lower prefetch_depth or report this")

    # Into and from the caller's own buffers: no staging copy either way.
    @_locked
    def read_into(self, key: ShardKey, out: torch.Tensor, offset: int = 0) -> Pending:
        return _pending_on(self._submit_read(key, out, offset), out)

    @_locked
    def write_from(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        return _pending_on(self._submit_write(key, src, offset), src)

    @_locked
    def write(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        if self.copier.separate_memory:
            return self._from_device(key, src, offset, add=False)
        return self.write_host(key, src, offset)

    @_locked
    def write_host(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        _, stored, _ = self._extents[key]
        # Sized in the stored dtype: a bf16 gradient is written into its fp32 shard.
        buffer = self.staging.acquire(src.numel() * stored.itemsize)
        staging = torch.frombuffer(buffer.view, dtype=stored, count=src.numel())
        staging.copy_(src.reshape(-1))
        self.staging.submitted(self._submit_write(key, staging, offset), buffer)
        return Pending(src)

    @_locked
    def accumulate(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        if self.copier.separate_memory:
            return self._from_device(key, src, offset, add=True)
        _, stored, _ = self._extents[key]
        current = aligned_empty(src.numel(), stored, self.recycler)
        self.read_into(key, current, offset).wait()
        add_into(current, src.reshape(-1))
        return self.write_host(key, current, offset)

    def _from_device(self, key: ShardKey, src: torch.Tensor, offset: int, *, add: bool) -> Pending:
        """[Note: NVMe gradient writes from the device]
        A gradient on a device of its own is copied (and cast to the stored fp32 on the way) into a
        pinned staging buffer on the device-to-host stream, after the event of the work that produced
        it; the returned `Pending`, waited for by the rank's transfer worker, submits the write once
        the copy landed (or reads the range, adds and writes it back, for a gradient accumulated).
        The autograd thread neither waits for the copy nor touches pageable memory."""
        _, stored, _ = self._extents[key]
        buffer = self.staging.acquire(src.numel() * stored.itemsize)
        staging = torch.frombuffer(buffer.view, dtype=stored, count=src.numel())
        event = self.copier.from_device(staging, src.reshape(-1))
        return Pending(src, event, after=functools.partial(self._land, key, staging, buffer, offset, add), to_host=True)

    @_locked
    def _land(self, key: ShardKey, staging: torch.Tensor, buffer: AlignedBuffer, offset: int, add: bool) -> None:
        """On the transfer worker, once `staging` holds the gradient: write it out."""
        if not add:
            self.staging.submitted(self._submit_write(key, staging, offset), buffer)
            return
        current = aligned_empty(staging.numel(), staging.dtype)
        self.read_into(key, current, offset).wait()
        add_into(current, staging)
        self.staging.release(buffer)
        self._submit_write(key, current, offset)  # the write's handle keeps `current` until it landed

    @_locked
    def zero(self, key: ShardKey, offset: int, numel: int) -> None:
        _, stored, _ = self._extents[key]
        self.write_host(key, torch.zeros(numel, dtype=stored), offset)

    @_locked
    def drain(self, *, keep_staging: bool = False) -> None:
        """Wait for the writes and reads in flight. Copies to the device from read slots are not
        waited for: a slot is reused only once its copy completed (`_slot`)."""
        self.staging.drain(keep=keep_staging)
        for key in list(self._writes):
            self._wait_writes(key)
        reads, self._reads = self._reads, []
        for handle in reads:
            handle.wait()
        self._landing.clear()  # every read landed; a copy nobody asked for is not issued

    def close(self) -> None:
        self.drain()
        with self._lock:
            copies, self._copies[:] = list(self._copies), []
        for event, _host in copies:  # the slots are unpinned next: no copy may still read them
            event.layer.host_wait(event, "an NVMe read's copy to the device")

    # -- internals --------------------------------------------------------------------------
    def _byte_range(self, key: ShardKey, offset: int, tensor: torch.Tensor) -> int:
        extent, stored, numel = self._extents[key]
        assert tensor.dtype == stored and tensor.device.type == "cpu", (tensor.dtype, stored, tensor.device)
        assert offset >= 0 and offset + tensor.numel() <= numel, (key, offset, tensor.numel(), numel)
        return extent.offset_bytes + offset * tensor.element_size()

    def _submit_read(self, key: ShardKey, out: torch.Tensor, offset: int) -> Handle:
        self._wait_writes(key, offset, offset + out.numel())
        self._reads = _reap(self._reads)
        handle = self.engine.read_async(self.file.file, offset=self._byte_range(key, offset, out), buffer=out)
        self._reads.append(handle)
        self.copier.link_bytes["nvme_read"] = self.copier.link_bytes.get("nvme_read", 0) + nbytes(out)
        return handle

    def _submit_write(self, key: ShardKey, src: torch.Tensor, offset: int) -> Handle:
        end = offset + src.numel()
        self._wait_writes(key, offset, end)
        handle = self.engine.write_async(self.file.file, offset=self._byte_range(key, offset, src), buffer=src)
        self.num_writes += 1
        self._writes.setdefault(key, []).append((handle, offset, end))
        self.copier.link_bytes["nvme_write"] = self.copier.link_bytes.get("nvme_write", 0) + nbytes(src)
        return handle

    def _wait_writes(self, key: ShardKey, start: int = 0, end: int | None = None) -> None:
        """Wait for the writes of `key` in flight that overlap elements [start, end) (all of them by
        default); finished ones are waited on too, which collects their errors (as `_reap`)."""
        running = []
        for handle, lo, hi in self._writes.pop(key, []):
            if handle.done() or (start < hi and (end is None or lo < end)):
                handle.wait()
            else:
                running.append((handle, lo, hi))
        if running:
            self._writes[key] = running

def _pending_on(handle: Handle, tensor: torch.Tensor, *, fresh: bool = False) -> Pending:
    """`tensor`, ready once the I/O `handle` finished (`wait` collects the I/O's errors)."""
    return Pending(tensor, after=handle.wait, done=handle.done, fresh=fresh)

def _reap(handles: list[Handle]) -> list[Handle]:
    """The handles still in flight; finished ones are waited on, which raises their errors and lets
    the engine drop its reference to their buffers (it keeps it until `wait`)."""
    running = []
    for handle in handles:
        if handle.done():
            handle.wait()
        else:
            running.append(handle)
    return running

class _ThenPending(Pending):
    """An NVMe read into host memory, then a cast and/or copy to the compute device ([Note: NVMe
    reads to the device] on CUDA)."""

    __slots__ = ("_handle", "_host", "_device", "_dtype", "_copier", "_copies", "_lock", "_staged", "_copied")

    def __init__(self, handle: Handle, host: torch.Tensor, device: torch.device, dtype: torch.dtype,
                 copier: CopyEngine, copies: list, lock: threading.RLock) -> None:  # noqa: ANN001
        super().__init__(torch.empty(0), fresh=True)
        self._handle, self._host, self._device, self._dtype, self._copier = handle, host, device, dtype, copier
        self._copies = copies
        self._lock = lock
        self._staged: torch.Tensor | None = None
        self._copied: DeviceEvent | None = None

    def issue_if_landed(self) -> bool:
        """Issue the host-to-device copy if the read has landed (never blocks); True once issued."""
        if self._staged is None and self._handle.done():
            self.issue()
        return self._staged is not None

    def issue(self) -> None:
        """Wait for the read (the host's only wait: the bytes are not in memory before) and issue the
        copy to the device; the host buffer is the store's (`_copies`) until the copy completed."""
        if self._staged is not None:
            return
        self._handle.wait()
        with self._lock:  # the store's `_copies` and the link counters ([Note: one lock per swap space])
            self._staged, self._copied = self._copier.to_device(self._host)
            self._copies.append((self._copied, self._host))
            self._host = None

    @property
    def on_copy_stream(self) -> bool:
        return self._copier.separate_memory

    def ready(self) -> bool:
        if not self._copier.separate_memory:
            return self._handle.done()
        return self.issue_if_landed() and self._copied.query()

    def wait(self) -> torch.Tensor:
        if not self._copier.separate_memory:
            self._handle.wait()
            return self._host.to(self._dtype)
        self.issue()
        return Pending(self._staged, self._copied).wait().to(self._dtype)
