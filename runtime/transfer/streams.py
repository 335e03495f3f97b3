"""The rank's device streams, events, waits and page-locked host memory, behind one interface.

Every stream, event, wait and pin of the runtime goes through a `Streams`: `CudaStreams` on a GPU
(high-priority host-to-device and device-to-host streams beside the compute stream),
`EmulatedStreams` on the CPU, where streams and events are objects whose work is done when issued.
Both note what they do in the active trace (runtime/transfer/trace.py), so the tests read the same
records off a CPU run as off a GPU run.

[Note: the transfer path as a GPU program]
A host thread that waits for the device stops issuing work to it. The path keeps these rules:
- a copy runs on the stream of its direction (`Role.H2D`, `Role.D2H`) and waits, on the device,
  for the event of the tensor it moves (`after`), never for all the work queued on another stream;
- host memory a copy reads or writes is page-locked (`pinned_buffer`): a copy to or from pageable
  memory blocks the host until the device caught up (noted as a `WaitKind.DEVICE` wait);
- no runtime hook waits on the host (`host_wait`, `join` of a host-side collective); the host
  waits where it needs the bytes, on the rank's host worker (runtime/transfer/host_worker.py), or
  once before the optimizer step that reads them;
- page-locked memory is taken once and kept: every pinned byte belongs to a ledger term (`term`).
On the emulated device a collective stands for NCCL's (its completion a device event: `join`
notes a stream wait even though gloo blocks the calling thread), and events are done when
recorded unless `EmulatedStreams.events_complete_at_once` is False, which makes every poll
(`DeviceEvent.query`) see a copy still in flight until a host wait.
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import torch

from runtime.nvme.buffers import AlignedBuffer
from runtime.transfer.trace import (
    Copy,
    Direction,
    HostWait,
    Pin,
    Role,
    StreamWait,
    WaitKind,
    current_hook,
    note,
    thread_name,
)

T = TypeVar("T")


class DeviceEvent:
    """A point on one stream: reached once the work queued there before it is done."""

    __slots__ = ("role", "native", "layer", "_done")

    def __init__(self, role: Role, native: Any, layer: Streams, done: bool = False) -> None:
        self.role = role
        self.native = native
        """The torch.cuda.Event (None on the emulated device)."""
        self.layer = layer
        """The `Streams` that recorded it (waits on it go through it)."""
        self._done = done

    def query(self) -> bool:
        """Whether the event was reached (never blocks)."""
        if self.native is not None:
            return bool(self.native.query())
        return self._done


class _PinRecorder:
    """The `PinHook` the stores and pools get: pins through the device's own hook (cudaHostRegister)
    and counts the bytes against ledger term `term` (runtime.nvme.PinHook)."""

    def __init__(self, streams: Streams, term: str) -> None:
        self.streams, self.term = streams, term

    def pin(self, address: int, nbytes: int) -> None:
        self.streams._pin(address, nbytes, self.term)

    def unpin(self, address: int) -> None:
        self.streams._unpin(address, self.term)


class Streams(ABC):
    """The rank's streams and page-locked memory ([Note: the transfer path as a GPU program])."""

    separate_memory: bool
    """Host and device memory are two memories: host-tier state crosses a link to be used."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._pinned: dict[int, tuple[int, str]] = {}
        """Address -> (bytes, ledger term) of every page-locked range alive."""
        self._starts: list[int] = []
        self._local = threading.local()

    # -- ordering -------------------------------------------------------------------------------
    def record(self, role: Role) -> DeviceEvent:
        """An event after the work queued on `role`'s stream so far."""
        assert not (role is Role.COMPUTE and self._side()), "COMPUTE inside `on(...)` is the side stream"
        return self._record(role)

    def wait(self, role: Role, event: DeviceEvent | None) -> None:
        """Stream `role` waits, on the device, for `event` (None: nothing to wait for)."""
        if event is None:
            return
        note(StreamWait(role, event.role, False, current_hook()))
        self._wait(role, event)

    def wait_stream(self, role: Role, other: Role) -> None:
        """Stream `role` waits for everything queued on `other` so far (a coarser `wait`)."""
        note(StreamWait(role, other, True, current_hook()))
        self._wait(role, self._record(other))

    def host_wait(self, event: DeviceEvent | None, why: str, kind: WaitKind = WaitKind.EVENT) -> None:
        """The calling thread blocks until `event` was reached (`kind`: why it must, for the trace)."""
        if event is None:
            return
        note(HostWait(kind, why, current_hook(), thread_name()))
        self._host_wait(event)

    def join(self, role: Role, wait: Callable[[], T], *, device_side: bool, why: str) -> T:
        """Run `wait` (a collective's `wait()`) so that `role`'s stream follows the collective: on the
        device where the backend's collectives are device work (NCCL), else on the host."""
        if device_side or not self.separate_memory or self._emulates_device_collectives:
            note(StreamWait(role, None, False, current_hook()))
            with self.on(role):
                return wait()
        note(HostWait(WaitKind.COLLECTIVE, why, current_hook(), thread_name()))
        return wait()

    def blocked(self, kind: WaitKind, why: str) -> None:
        """Note a host wait the caller is about to make outside this layer (a worker drain, a full
        bounded buffer)."""
        note(HostWait(kind, why, current_hook(), thread_name()))

    # -- work on a stream -----------------------------------------------------------------------
    @contextlib.contextmanager
    def on(self, role: Role) -> Iterator[None]:
        """Kernels launched inside run on `role`'s stream."""
        stack = self._local.__dict__.setdefault("roles", [])
        stack.append(role)
        try:
            with self._on(role):
                yield
        finally:
            stack.pop()

    def copy(self, dst: torch.Tensor, src: torch.Tensor, direction: Direction, *, on: Role,
             after: DeviceEvent | None = None) -> DeviceEvent:
        """`dst.copy_(src)` on `on`'s stream after `after`; the event marks its end."""
        self.wait(on, after)
        host = src if direction is Direction.H2D else dst
        if self.separate_memory and not self.is_pinned(host):
            note(HostWait(WaitKind.DEVICE, f"{direction.value} copy of pageable memory", current_hook(),
                          thread_name()))
        note(Copy(direction, on, dst.numel() * dst.element_size(), current_hook()))
        return self._copy(dst, src, on)

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, after: DeviceEvent | None = None) -> DeviceEvent:
        return self.copy(dst, src, Direction.H2D, on=Role.H2D, after=after)

    def d2h(self, dst: torch.Tensor, src: torch.Tensor, *, after: DeviceEvent | None = None) -> DeviceEvent:
        return self.copy(dst, src, Direction.D2H, on=Role.D2H, after=after)

    @abstractmethod
    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, role: Role) -> torch.Tensor:
        """A device tensor allocated for use on `role`'s stream."""

    @abstractmethod
    def keep(self, tensor: torch.Tensor, role: Role) -> None:
        """Keep `tensor`'s memory from reuse until `role`'s stream is done with it."""

    # -- page-locked host memory ----------------------------------------------------------------
    def pin_hook(self, term: str) -> _PinRecorder | None:
        """The pin hook of buffers charged to ledger term `term` (None: nothing is pinned here)."""
        return _PinRecorder(self, term) if self.separate_memory else None

    def pinned_buffer(self, nbytes: int, term: str) -> AlignedBuffer:
        """Page-aligned host memory, page-locked on a separate-memory device, for ledger term `term`."""
        buffer = AlignedBuffer(nbytes)
        hook = self.pin_hook(term)
        if hook is not None:
            hook.pin(buffer.address, buffer.capacity_bytes)
        return buffer

    def release_pinned(self, buffer: AlignedBuffer, term: str) -> None:
        hook = self.pin_hook(term)
        if hook is not None:
            hook.unpin(buffer.address)
        buffer.close()

    def pinned_tensor(self, nbytes: int, term: str) -> torch.Tensor:
        """`nbytes` of page-locked memory from torch's caching host allocator (which rounds the
        request up and keeps the block pinned after it is freed), for ledger term `term`."""
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        with self._lock:
            self._pinned[tensor.data_ptr()] = (nbytes, term)
            bisect.insort(self._starts, tensor.data_ptr())
        note(Pin(nbytes, term, True))
        return tensor

    def pinned_bytes(self, term: str | None = None) -> int:
        """Bytes page-locked now (of ledger term `term`, or all)."""
        with self._lock:
            return sum(n for n, t in self._pinned.values() if term is None or t == term)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s memory lies in a page-locked range of this layer."""
        if tensor.numel() == 0:
            return True
        address = tensor.data_ptr()
        with self._lock:
            i = bisect.bisect_right(self._starts, address) - 1
            if i < 0:
                return False
            start = self._starts[i]
            return address + tensor.numel() * tensor.element_size() <= start + self._pinned[start][0]

    def _pin(self, address: int, nbytes: int, term: str) -> None:
        self._pin_native(address, nbytes)
        with self._lock:
            self._pinned[address] = (nbytes, term)
            bisect.insort(self._starts, address)
        note(Pin(nbytes, term, True))

    def _unpin(self, address: int, term: str) -> None:
        with self._lock:
            nbytes, _ = self._pinned.pop(address)
            self._starts.remove(address)
        self._unpin_native(address)
        note(Pin(nbytes, term, False))

    # -- the device's side ----------------------------------------------------------------------
    _emulates_device_collectives: ClassVar[bool] = False

    def _side(self) -> bool:
        return any(r is not Role.COMPUTE for r in self._local.__dict__.get("roles", ()))

    def cuda_stream(self, role: Role) -> torch.cuda.Stream:
        """The torch.cuda.Stream behind `role`, for code outside the runtime that orders or times work
        of its own against the runtime's copies with torch's own events (the GPU tests); the
        runtime itself orders work through `record`, `wait` and `on`. A TypeError on a device
        without CUDA streams (the emulated device's streams are not torch objects)."""
        raise TypeError(f"{type(self).__name__} on {self.device} has no CUDA streams")

    def current_role(self) -> Role:
        """The stream kernels launched now run on (`Role.COMPUTE` outside every `on`)."""
        roles = self._local.__dict__.get("roles")
        return roles[-1] if roles else Role.COMPUTE

    @abstractmethod
    def _record(self, role: Role) -> DeviceEvent: ...

    @abstractmethod
    def _wait(self, role: Role, event: DeviceEvent) -> None: ...

    @abstractmethod
    def _host_wait(self, event: DeviceEvent) -> None: ...

    @abstractmethod
    def _on(self, role: Role) -> contextlib.AbstractContextManager: ...

    @abstractmethod
    def _copy(self, dst: torch.Tensor, src: torch.Tensor, role: Role) -> DeviceEvent: ...

    @abstractmethod
    def _pin_native(self, address: int, nbytes: int) -> None: ...

    @abstractmethod
    def _unpin_native(self, address: int) -> None: ...


class CudaStreams(Streams):
    """A CUDA device: the compute stream (the launching thread's current one) and two high-priority
    copy streams, one per direction; events are torch.cuda.Events; pinning is cudaHostRegister."""

    separate_memory = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        low, high = torch.cuda.Stream.priority_range()
        del low
        self._streams = {Role.H2D: torch.cuda.Stream(device, priority=high),
                         Role.D2H: torch.cuda.Stream(device, priority=high)}
        from runtime.nvme.pinning import TorchCudaPinHook

        self._cuda_pin = TorchCudaPinHook()

    def stream(self, role: Role) -> torch.cuda.Stream:
        return self._streams[role] if role in self._streams else torch.cuda.current_stream(self.device)

    def cuda_stream(self, role: Role) -> torch.cuda.Stream:
        return self.stream(role)

    def _record(self, role: Role) -> DeviceEvent:
        event = torch.cuda.Event()
        event.record(self.stream(role))
        return DeviceEvent(role, event, self)

    def _wait(self, role: Role, event: DeviceEvent) -> None:
        self.stream(role).wait_event(event.native)

    def _host_wait(self, event: DeviceEvent) -> None:
        event.native.synchronize()

    def _on(self, role: Role) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(self.stream(role))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, role: Role) -> DeviceEvent:
        stream = self.stream(role)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(stream)
        return self._record(role)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, role: Role) -> torch.Tensor:
        with torch.cuda.stream(self.stream(role)):
            return torch.empty(shape, dtype=dtype, device=self.device)

    def keep(self, tensor: torch.Tensor, role: Role) -> None:
        if tensor.is_cuda:
            tensor.record_stream(self.stream(role))

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda or tensor.numel() == 0 or tensor.is_pinned()

    def _pin_native(self, address: int, nbytes: int) -> None:
        self._cuda_pin.pin(address, nbytes)

    def _unpin_native(self, address: int) -> None:
        self._cuda_pin.unpin(address)


class EmulatedStreams(Streams):
    """The CPU: the "device" is host memory, a copy is done when issued, an event is an object
    ([Note: the transfer path as a GPU program]). With `separate_memory` the runtime takes the data
    path of a device with memory of its own (`CopyEngine.separate_memory_on_cpu`); without, host and
    device are one memory and nothing is copied or pinned ([Note: the CPU machine] in
    runtime/transfer/stores.py)."""

    events_complete_at_once: ClassVar[bool] = True
    """False: an event polls as not reached until a host waits for it (a device infinitely slower
    than the host), which shows every wait a poll only skips on a fast device."""
    _emulates_device_collectives = True

    def __init__(self, device: torch.device, *, separate_memory: bool) -> None:
        super().__init__(device)
        self.separate_memory = separate_memory

    def _record(self, role: Role) -> DeviceEvent:
        return DeviceEvent(role, None, self, done=self.events_complete_at_once)

    def _wait(self, role: Role, event: DeviceEvent) -> None:
        return

    def _host_wait(self, event: DeviceEvent) -> None:
        event._done = True

    def _on(self, role: Role) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, role: Role) -> DeviceEvent:
        dst.copy_(src)
        return self._record(role)

    def empty(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, role: Role) -> torch.Tensor:  # noqa: ARG002
        return torch.empty(shape, dtype=dtype, device=self.device)

    def keep(self, tensor: torch.Tensor, role: Role) -> None:
        return

    def _pin_native(self, address: int, nbytes: int) -> None:
        return

    def _unpin_native(self, address: int) -> None:
        return


def make_streams(device: torch.device, *, separate_memory_on_cpu: bool) -> Streams:
    """The layer of the rank's compute device."""
    if device.type == "cuda":
        return CudaStreams(device)
    return EmulatedStreams(device, separate_memory=separate_memory_on_cpu)
