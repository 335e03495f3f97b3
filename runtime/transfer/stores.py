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
from runtime.transfer.host_worker import HostWorker, TransferWorker, drain_together
from runtime.transfer.mixed_add import add_into
from runtime.transfer.pinned_pool import HostTransfer, StagingPool
from runtime.transfer.streams import DeviceEvent, make_streams
from runtime.transfer.trace import Role


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
    """A tensor that becomes valid after `wait()` (a finished copy, or a device event on a copy stream)."""

    __slots__ = ("_tensor", "_event", "_after", "_done", "fresh", "_to_host")

    def __init__(self, tensor: torch.Tensor, event: DeviceEvent | None = None, after=None, *,  # noqa: ANN001
                 done=None, fresh: bool = False, to_host: bool = False) -> None:  # noqa: ANN001
        self._tensor = tensor
        self._event = event
        self._after = after
        """Callable run once the copy finished (e.g. add a staged gradient into its host shard)."""
        self._done = done
        """Callable telling, without blocking, whether the transfer `after` waits for has finished."""
        self.fresh = fresh
        """True when the tensor is a new buffer (a staged copy), False when it is the shard itself."""
        self._to_host = to_host
        """The tensor is in host memory (a copy off the device): the host waits for `event`, not a stream."""

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
            self._event.layer.host_wait(self._event, "a transfer's end")

    @property
    def in_flight(self) -> bool:
        """A transfer is still to be waited for (a copy's event, or work to run after it)."""
        return self._event is not None or self._after is not None

    @property
    def on_copy_stream(self) -> bool:
        """The tensor comes from the copy stream (the host-to-device copy of a host or NVMe shard):
        a consumer on another stream orders itself after the copy's event, not after the compute."""
        return self._event is not None and not self._to_host

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            layer = self._event.layer
            if not self._to_host:
                consumer = layer.current_role()
                layer.wait(consumer, self._event)
                layer.keep(self._tensor, consumer)  # it may have been allocated on the copy stream
            elif not self._event.query():
                layer.host_wait(self._event, "a copy off the device")  # the host needs the bytes now
            self._event = None
        if self._after is not None:
            after, self._after = self._after, None
            after()
        return self._tensor


class CopyEngine:
    """The rank's transfers between host and device: the stream layer (`streams`), the staging pool
    for pageable host memory (`pool`, [Note: staged host copies]), the host worker that lands what
    comes off the device (`worker`, [Note: the host worker]) and the link-byte counters."""

    separate_memory_on_cpu: ClassVar[bool] = False
    """Run, on a CPU, the data path of a device with memory of its own (`EmulatedStreams`): host-tier
    shards cross a link as on CUDA (copies complete when issued). Tests set it to exercise the
    device's path and its bounds without a GPU; False keeps [Note: the CPU machine]."""

    def __init__(self, device: torch.device, link_bytes: dict[str, int], pool: StagingPool | None = None) -> None:
        self.device = device
        self.link_bytes = link_bytes
        self.streams = make_streams(device, separate_memory_on_cpu=self.separate_memory_on_cpu)
        self.separate_memory = self.streams.separate_memory
        """Host and compute memory are two memories: host-tier state crosses a link to be used."""
        self.pool = pool
        """The rank's staging pool (None where the plan moves no pageable host state)."""
        if pool is not None and pool.streams is None:
            pool.streams = self.streams
        self.worker = TransferWorker(self.streams, "tierwise-transfer")
        """Lands what comes off the device in host shards (and on NVMe), off the autograd thread."""
        self.reduce_worker = TransferWorker(self.streams, "tierwise-reduce")
        """Finishes the reduce-scatters (several ranks), off the autograd thread and apart from the
        landings, so that waiting for the last one never waits behind a host add."""

    @property
    def stream(self) -> Role | None:
        """The stream a prefetch is issued on (None without separate memory: copies are done when issued)."""
        return Role.H2D if self.separate_memory else None

    def staging(self) -> StagingPool:
        if self.pool is None:
            raise RuntimeError("a host<->device copy of pageable host state needs the rank's staging pool; "
                               "build the CopyEngine with one (planner.cost.memory.pinned_staging_pool)")
        return self.pool

    def _count(self, link: str, tensor: torch.Tensor) -> None:
        self.link_bytes[link] = self.link_bytes.get(link, 0) + nbytes(tensor)

    def produced(self) -> DeviceEvent:
        """The event of tensors the current stream has produced so far (what a copy of them waits for)."""
        return self.streams.record(self.streams.current_role())

    def to_device(self, src: torch.Tensor, link: str = "h2d", *,
                  after: DeviceEvent | None = None) -> tuple[torch.Tensor, DeviceEvent]:
        """Start copying the pinned host tensor `src` (an NVMe read slot, a pinned shard) into a new
        device tensor on the host-to-device stream, after `after` (a copy off the device into `src`;
        nothing else on the device writes host memory); the consumer waits on the event
        (`Pending.wait`)."""
        assert self.separate_memory and src.device.type == "cpu"
        self._count(link, src)
        dst = self.streams.empty(src.shape, src.dtype, Role.H2D)
        return dst, self.streams.h2d(dst, src, after=after)

    def stage_to_device(self, src: torch.Tensor, link: str = "h2d") -> tuple[torch.Tensor, DeviceEvent | None]:
        """`to_device` for pageable host memory: through the pool's pinned buffers ([Note: staged
        host copies])."""
        assert self.separate_memory and src.device.type == "cpu"
        self._count(link, src)
        dst = self.streams.empty(src.shape, src.dtype, Role.H2D)
        return dst, self.staging().to_device(dst.view(-1), src.reshape(-1), Role.H2D)

    def to_host(self, src: torch.Tensor, land: Callable[[torch.Tensor, int], None], link: str = "d2h") -> HostTransfer:
        """Start copying the flat device tensor `src` off the device through the pool, on the
        device-to-host stream after the event of `src` (`produced`); `land(piece, offset)` puts each
        staged piece in pageable host memory once it arrived (`finish()`, a later lease of the pool,
        or the host worker)."""
        assert self.separate_memory
        self._count(link, src)
        return self.staging().to_host(src, land, Role.D2H, after=self.produced())

    def back_to_device(self, host: torch.Tensor, transfer: HostTransfer,
                       link: str = "h2d") -> tuple[torch.Tensor, DeviceEvent | None]:
        """`stage_to_device(host)` where `host` is the destination of the device-to-host `transfer`:
        the pieces not landed yet go from their pinned buffers, without a host wait."""
        self._count(link, host)
        dst = self.streams.empty(host.shape, host.dtype, Role.H2D)
        return dst, self.staging().back_to_device(transfer, dst.view(-1), host.reshape(-1), Role.H2D)

    def into_device(self, dst: torch.Tensor, src: torch.Tensor, link: str = "h2d") -> DeviceEvent | None:
        """Start `dst = src` for a flat device tensor `dst` and a pageable host tensor `src`, through
        the pool, after the work queued on the current stream so far, which may still read `dst`."""
        self._count(link, src)
        return self.staging().to_device(dst, src, Role.H2D, after=self.produced())

    def from_device(self, dst: torch.Tensor, src: torch.Tensor, link: str = "d2h") -> DeviceEvent:
        """Start `dst = src` from the device into pinned host memory `dst` on the device-to-host
        stream, after the event of `src`; the host reads `dst` once the returned event is reached."""
        self._count(link, src)
        return self.streams.d2h(dst, src, after=self.produced())

    def wait_transfers(self, *also: HostWorker) -> None:
        """The host's wait for every reduce-scatter finished and every copy off the device landed (and
        for the jobs of `also`, first), noted as one."""
        drain_together([*also, self.reduce_worker, self.worker], "the transfers of the backward")

    def close(self) -> None:
        """Let the transfers in flight land and stop the workers."""
        try:
            self.reduce_worker.close()
            self.worker.close()
        finally:
            if self.pool is not None:
                self.pool.drain()


class ShardStore(ABC):
    """Shards of one model state (`params`, `gradients` or `optimizer_states`) in one tier."""

    tier: ClassVar[str]
    on_device: ClassVar[bool] = False
    """Shards live in compute-device memory (the optimizer's updates there are device tensors)."""
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

    @property
    def written_event(self) -> DeviceEvent | None:
        """After the device work that last wrote a shard (None: nothing on the device writes them)."""
        return None

    def mark_updated(self) -> None:  # noqa: B027 - a no-op unless overridden
        """The shards were updated in place by work queued on the current stream (the optimizer)."""

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
        """`shard[offset:offset + src.numel()] = src` for a compute-device tensor (a step's first
        gradient, parameters updated on the device)."""

    @abstractmethod
    def write_host(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        """`shard[offset:offset + src.numel()] = src` for a host tensor (parameters updated on the host,
        a model's first shards)."""


class DeviceStore(ShardStore):
    """Shards in compute-device memory (`gpu` placement)."""

    tier = "gpu"
    on_device: ClassVar[bool] = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._written: DeviceEvent | None = None

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, device=self.compute_device)

    def read(self, key: ShardKey, dtype: torch.dtype) -> Pending:
        """The shard, cast on the consumer's stream where `dtype` differs (a prefetch casts on its own)."""
        shard = self._shards[key]
        return Pending(shard) if shard.dtype == dtype else CastPending(Pending(shard), dtype)

    def accumulate(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        shard = self._shards[key]
        add_into(shard[offset : offset + src.numel()], src.reshape(-1))
        self.mark_updated()
        return Pending(shard)

    def write(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        self._shards[key][offset : offset + src.numel()].copy_(src.reshape(-1))
        self.mark_updated()
        return Pending(self._shards[key])

    def write_host(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        target = self._shards[key][offset : offset + src.numel()]
        if self.copier.separate_memory and self.copier.pool is not None:  # host-tier masters written back
            self._written = self.copier.into_device(target, src.reshape(-1))
            return Pending(self._shards[key], self._written)
        target.copy_(src.reshape(-1))
        self.mark_updated()
        return Pending(self._shards[key])

    @property
    def written_event(self) -> DeviceEvent | None:
        return self._written

    def mark_updated(self) -> None:
        self._written = self.copier.produced() if self.copier.separate_memory else None


class CastPending(Pending):
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
