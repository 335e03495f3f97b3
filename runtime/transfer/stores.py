"""Where a shard lives: one interface, one type per memory tier (the Infinity offload engine).

A plan's placement picks a store *type* per state (`DeviceStore` for `gpu`, `HostStore` for `cpu`,
`runtime.transfer.nvme_store.NvmeStore` for `nvme`; runtime/transfer/tiers.py maps each tier to its type). Callers never check a placement flag:
they `read` a shard to the compute device, `accumulate` a device tensor into a shard, `write` one
back, and get a `Pending` they `wait()` on when they need the data.

[Note: the CPU machine]
Without CUDA the compute device *is* host memory: `gpu` means "tensors the compute uses directly"
and `cpu` means "the host store". Reading a host shard to a CPU device is then the shard itself (no
copy is made and no link bytes are counted), which is exactly what would happen on real hardware
whose host memory is the device memory. On CUDA the host store is ordinary pageable memory and
every transfer goes through the rank's pinned staging pool ([Note: staged host copies] in
runtime/transfer/pinned_pool.py) on a dedicated copy stream, so it overlaps the compute stream; consumers
wait on an event.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch

from runtime.ledger import MemoryLedger, nbytes
from runtime.transfer.mixed_add import add_into
from runtime.transfer.pinned_pool import HostTransfer, StagingPool


class UnitKey(NamedTuple):
    """The shards of one unit (a module's own parameters) in the param and gradient stores.

    `str()` is the name these shards have always had ("3:blocks.0.attn"): training checkpoints
    store tensors under it, so checkpoints written before the key was typed still resume."""

    index: int
    """The unit's position in forward order (construction order)."""
    module: str
    """The qualified name of the module that owns the parameters ("" for the root)."""

    def __str__(self) -> str:
        return f"{self.index}:{self.module}"


class StateKey(NamedTuple):
    """One optimizer state of a unit in the optimizer store: `str()` is "master:3:blocks.0.attn"."""

    state: str
    """`master` (the fp32 master shard when it is not the parameter shard), `exp_avg` or `exp_avg_sq`."""
    unit: UnitKey

    def __str__(self) -> str:
        return f"{self.state}:{self.unit}"


ShardKey = UnitKey | StateKey
"""Where a shard sits in its store. Checkpoints and ordering use `str(key)` (see `UnitKey`)."""


class Pending:
    """A tensor that becomes valid after `wait()` (a finished copy, or a CUDA event on a copy stream)."""

    __slots__ = ("_tensor", "_event", "_after", "_done", "fresh")

    def __init__(self, tensor: torch.Tensor, event: torch.cuda.Event | None = None, after=None, *,  # noqa: ANN001
                 done=None, fresh: bool = False) -> None:  # noqa: ANN001
        self._tensor = tensor
        self._event = event
        self._after = after
        """Callable run once the copy finished (e.g. add a staged gradient into its host shard)."""
        self._done = done
        """Callable telling, without blocking, whether the transfer `after` waits for has finished."""
        self.fresh = fresh
        """True when the tensor is a new buffer (a staged copy), False when it is the shard itself."""

    def ready(self) -> bool:
        """False while a transfer `wait()` would block on is known to be in flight (a copy with an event,
        or an NVMe read); True otherwise."""
        if self._event is not None and not self._event.query():
            return False
        return self._done is None or self._after is None or bool(self._done())

    def synchronize(self) -> None:
        """Block the host until the transfer ended, without consuming it (`wait` still runs `after`):
        transfers queued in order on one stream are all over once the last one is."""
        if self._event is not None:
            self._event.synchronize()

    @property
    def on_copy_stream(self) -> bool:
        """The tensor comes from the copy stream (the host-to-device copy of a host or NVMe shard):
        a consumer on another stream orders itself after the copy's event, not after the compute."""
        return self._event is not None and self._tensor.device.type == "cuda"

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            if self._tensor.device.type == "cuda":
                consumer = torch.cuda.current_stream(self._tensor.device)
                consumer.wait_event(self._event)
                self._tensor.record_stream(consumer)  # it may have been allocated on the copy stream
            elif not self._event.query():
                self._event.synchronize()  # the host needs the bytes now
            self._event = None
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return self._tensor


class CopyEngine:
    """Host<->device copies on a side stream on CUDA; plain copies on CPU. Counts link bytes.
    Copies between pageable host memory and the device go through `pool` ([Note: staged host copies])."""

    separate_memory_on_cpu: ClassVar[bool] = False
    """Run, on a CPU, the data path of a device with memory of its own: host-tier shards are staged
    through the pool into fresh tensors as on CUDA (copies complete in the call). Tests set it to
    exercise the staged path and its bounds without a GPU; False keeps [Note: the CPU machine]."""

    def __init__(self, device: torch.device, link_bytes: dict[str, int], pool: StagingPool | None = None) -> None:
        self.device = device
        self.link_bytes = link_bytes
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.separate_memory = device.type == "cuda" or self.separate_memory_on_cpu
        """Host and compute memory are two memories: host-tier state crosses a link to be used."""
        self.pool = pool
        """The rank's staging pool (None where the plan moves no host-tier state)."""

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The copy stream (None on the CPU: copies are done when `copy` returns)."""
        return self._stream

    def staging(self) -> StagingPool:
        if self.pool is None:
            raise RuntimeError("a host<->device copy of host-tier state needs the rank's staging pool; "
                               "build the CopyEngine with one (planner.cost.memory.pinned_staging_pool)")
        return self.pool

    def _count(self, link: str, tensor: torch.Tensor) -> None:
        self.link_bytes[link] = self.link_bytes.get(link, 0) + nbytes(tensor)

    def _device_tensor_like(self, src: torch.Tensor) -> torch.Tensor:
        """A new device tensor of `src`'s shape and dtype, allocated on the copy stream (so the
        allocator cannot hand it memory that kernels on the compute stream still use)."""
        if self._stream is None:
            return torch.empty(src.shape, dtype=src.dtype, device=self.device)
        with torch.cuda.stream(self._stream):
            return torch.empty(src.shape, dtype=src.dtype, device=self.device)

    def to_device(self, src: torch.Tensor, link: str = "h2d") -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying the host tensor `src`, already pinned (an NVMe read buffer), into a new
        device tensor (CUDA only).

        The new tensor is allocated on the copy stream (`_device_tensor_like`), and the copy need not
        wait for the compute stream (which does not write host shards): it starts as soon as the copy
        stream is free. The
        consumer waits on the event (`Pending.wait`, which records the tensor on its stream)."""
        assert self._stream is not None and src.device.type == "cpu"
        self._count(link, src)
        dst = self._device_tensor_like(src)
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        return dst, event

    def stage_to_device(self, src: torch.Tensor, link: str = "h2d") -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`to_device` for pageable host memory (host-tier state): through the pool's pinned buffers
        ([Note: staged host copies]). On a CPU (`separate_memory_on_cpu`) the copy is done on return
        and the event is None."""
        assert self.separate_memory and src.device.type == "cpu"
        self._count(link, src)
        dst = self._device_tensor_like(src)
        return dst, self.staging().to_device(dst.view(-1), src.reshape(-1), self._stream)

    def to_host(self, src: torch.Tensor, land: Callable[[torch.Tensor, int], None], link: str = "d2h") -> HostTransfer:
        """Start copying the flat device tensor `src` off the device through the pool; `land(piece,
        offset)` puts each staged piece in pageable host memory once it arrived (`finish()`, or a
        later lease of the pool, does it)."""
        assert self.separate_memory
        self._count(link, src)
        if self._stream is None:
            return self.staging().to_host(src, land, None)
        # The copy must not start before the compute stream produced `src`.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        src.record_stream(self._stream)
        return self.staging().to_host(src, land, self._stream)

    def back_to_device(self, host: torch.Tensor, transfer: HostTransfer,
                       link: str = "h2d") -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """`stage_to_device(host)` where `host` is the destination of the device-to-host `transfer`:
        the pieces not landed yet go from their pinned buffers, without a host wait."""
        self._count(link, host)
        dst = self._device_tensor_like(host)
        return dst, self.staging().back_to_device(transfer, dst.view(-1), host.reshape(-1), self._stream)

    def into_device(self, dst: torch.Tensor, src: torch.Tensor, link: str = "h2d") -> torch.cuda.Event | None:
        """Start `dst = src` for a flat device tensor `dst` and a pageable host tensor `src`, through
        the pool, after the compute stream's work queued so far (it may still read `dst`)."""
        self._count(link, src)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.staging().to_device(dst, src, self._stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, link: str) -> torch.cuda.Event | None:
        """Start `dst.copy_(src)`; returns the event marking its end on CUDA (None when done)."""
        if dst.device != src.device:
            self._count(link, src)
        if self._stream is None:
            dst.copy_(src)
            return None
        # The copy must not start before the compute stream produced `src` (or stopped reading `dst`).
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            # Keep both alive until the copy stream is done with them (caching-allocator reuse).
            for t in (dst, src):
                if t.device.type == "cuda":
                    t.record_stream(self._stream)
            event = torch.cuda.Event()
            event.record(self._stream)
        return event


class ShardStore(ABC):
    """Shards of one model state (`params`, `gradients` or `optimizer_states`) in one tier."""

    tier: ClassVar[str]
    resident_states: ClassVar[bool] = True
    """Shards live in memory (`resident` works); False for stores whose shards are streamed."""
    recycler: Any = None
    """The `BufferRecycler` that streamed reads lease their host buffers from (None: no reads)."""

    def __init__(self, *, term: str, ledger: MemoryLedger, copier: CopyEngine, name: str = "", swap=None) -> None:  # noqa: ANN001, ARG002
        self.term = term
        self.name = name or term
        """The model state this store holds (`params`, `gradients`, `optimizer_states`)."""
        self.ledger = ledger
        self.copier = copier
        self._shards: dict[ShardKey, torch.Tensor] = {}

    @property
    def compute_device(self) -> torch.device:
        return self.copier.device

    # -- lifetime ---------------------------------------------------------------------------
    def create(self, key: ShardKey, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Allocate a zeroed shard; returns it when resident in memory (every in-memory store)."""
        assert key not in self._shards, f"shard {key} already exists in {type(self).__name__}"
        shard = self._allocate(numel, dtype)
        self._shards[key] = shard
        self.ledger.add(self.tier, self.term, nbytes(shard))
        return shard

    def free(self, key: ShardKey) -> None:
        shard = self._shards.pop(key)
        self.ledger.sub(self.tier, self.term, nbytes(shard))

    def keys(self) -> list[ShardKey]:
        return list(self._shards)

    def shard_info(self, key: ShardKey) -> tuple[int, torch.dtype]:
        """(numel, dtype) of a shard, wherever it lives (checkpoints stream shards by this)."""
        shard = self._shards[key]
        return shard.numel(), shard.dtype

    def resident(self, key: ShardKey) -> torch.Tensor:
        """The in-memory shard, for in-place updates where it lives (the optimizer step)."""
        return self._shards[key]

    def zero(self, key: ShardKey, offset: int, numel: int) -> None:
        """`shard[offset:offset + numel] = 0` (gradient slices nobody wrote since `zero_grad`)."""
        self._shards[key][offset : offset + numel].zero_()

    # -- streamed traffic (the chunked optimizer step) ----------------------------------------
    def read_into(self, key: ShardKey, out: torch.Tensor, offset: int = 0) -> Pending:
        """Fill the host tensor `out` from `shard[offset:offset + out.numel()]`; valid after `wait()`."""
        out.copy_(self._shards[key][offset : offset + out.numel()])
        return Pending(out)

    def write_from(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        """`shard[offset:...] = src` from a host buffer the caller may reuse only after `wait()`."""
        self._shards[key][offset : offset + src.numel()].copy_(src)
        return Pending(src)

    def drain(self, *, keep_staging: bool = False) -> None:  # noqa: ARG002
        """Wait for every transfer this store started (a no-op for in-memory stores), and give back
        the write staging unless `keep_staging`."""
        return

    def close(self) -> None:
        """Release what the store holds outside the process (swap files)."""
        return

    # -- traffic ----------------------------------------------------------------------------
    @abstractmethod
    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    @abstractmethod
    def read(self, key: ShardKey, dtype: torch.dtype) -> Pending:
        """The shard on the compute device in `dtype` (a view of the shard itself when it already is)."""

    @abstractmethod
    def accumulate(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        """`shard[offset:offset + src.numel()] += src` for a compute-device tensor (arriving gradients)."""

    @abstractmethod
    def write(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        """`shard[offset:offset + src.numel()] = src` (updated parameters, a step's first gradient)."""


class DeviceStore(ShardStore):
    """Shards in compute-device memory (`gpu` placement)."""

    tier = "gpu"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.compute_device)

    def read(self, key: ShardKey, dtype: torch.dtype) -> Pending:
        shard = self._shards[key]
        return Pending(shard) if shard.dtype == dtype else Pending(shard.to(dtype), fresh=True)

    def accumulate(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        shard = self._shards[key]
        add_into(shard[offset : offset + src.numel()], src.reshape(-1))
        return Pending(shard)

    def write(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        target = self._shards[key][offset : offset + src.numel()]
        if src.device != target.device and self.copier.pool is not None:  # host-tier masters written back
            return Pending(self._shards[key], self.copier.into_device(target, src.reshape(-1)))
        target.copy_(src.reshape(-1))
        return Pending(self._shards[key])


class HostStore(ShardStore):
    """Shards in pageable host memory (`cpu` placement); copies to and from the device go through the
    rank's pinned staging pool, so they run asynchronously without pinning the shards themselves."""

    tier = "cpu"

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def _on_host_device(self) -> bool:
        return not self.copier.separate_memory

    def _in_host_memory(self, src: torch.Tensor) -> bool:
        """`src` needs no link to reach the shard: the CPU machine, or a host tensor on CUDA (master
        weights the CPU-tier optimizer updated)."""
        return self._on_host_device() or (src.device.type == "cpu" and self.compute_device.type != "cpu")

    def read(self, key: ShardKey, dtype: torch.dtype) -> Pending:
        shard = self._shards[key]
        if self._on_host_device():  # see [Note: the CPU machine]
            return Pending(shard) if shard.dtype == dtype else Pending(shard.to(dtype), fresh=True)
        # Cast on the device after the copy: the link carries the stored width.
        staged, event = self.copier.stage_to_device(shard)
        if dtype == shard.dtype:
            return Pending(staged, event, fresh=True)
        return _CastPending(Pending(staged, event), dtype)

    def accumulate(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        target = self._shards[key][offset : offset + src.numel()]
        if self._in_host_memory(src):
            add_into(target, src.reshape(-1))
            return Pending(self._shards[key])
        transfer = self.copier.to_host(src.reshape(-1), lambda piece, at: add_into(target[at : at + piece.numel()], piece))
        return Pending(self._shards[key], transfer.event, after=transfer.finish)

    def write(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        shard = self._shards[key]
        target = shard[offset : offset + src.numel()]
        # A host source (an update's result, also on the optimizer worker) needs no copy stream: one
        # would make the worker wait for the compute queued on the device.
        if self._in_host_memory(src):
            target.copy_(src.reshape(-1))
            return Pending(shard)
        transfer = self.copier.to_host(src.reshape(-1), lambda piece, at: target[at : at + piece.numel()].copy_(piece))
        return Pending(shard, transfer.event, after=transfer.finish)


class _CastPending(Pending):
    """A staged copy followed by a cast on the compute device."""

    __slots__ = ("_inner", "_dtype")

    def __init__(self, inner: Pending, dtype: torch.dtype) -> None:
        super().__init__(torch.empty(0), fresh=True)
        self._inner = inner
        self._dtype = dtype

    @property
    def on_copy_stream(self) -> bool:
        return self._inner.on_copy_stream

    def wait(self) -> torch.Tensor:
        return self._inner.wait().to(self._dtype)
