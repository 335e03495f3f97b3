"""A unit's gradient filing: where each backward's gradients go, one class per destination.

A unit's parameters get their gradients one by one as autograd produces them. The unit's
`GradientSink` files each (`file`), tells when the unit's last one arrived, reduce-scatters them
with several ranks (`reduce`, `finish_reduce`), and hands over the unit's final gradient for this
backward (`final`) as a `FinalGradient`, which the optimizer's schedule updates from or leaves:

- `StoredGradients`: into the gradient store (write, then accumulate; [Note: lazy gradient
  zeroing]), where `optimizer.step()` or the resident in-backward update reads it;
- `HandedGradients`: kept as autograd (or the reduce-scatter) produced them until the unit's
  gradient is final, then handed to the in-backward update: the plan stores no gradient
  (`planner.cost.memory.stores_gradients`; [Note: the optimizer step in backward] in
  runtime/optim/streamed_optimizer.py).

See [Note: schedules as types] in runtime/units/events.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from planner.specs.memory_terms import MemoryTerm
from runtime.ledger import MemoryLedger, nbytes
from runtime.transfer.collectives import Comm, Reduced, reduce_scatter_flat
from runtime.transfer.host_worker import TransferWorker
from runtime.transfer.stores import CopyEngine, Pending, ShardStore, UnitKey
from runtime.transfer.streams import DeviceEvent, Streams
from runtime.transfer.trace import Role
from runtime.units.flat_param import FlatLayout


class FinalGradient(ABC):
    """A unit's gradient shard, complete for this backward, as fp32 elements of its flat shard."""

    @abstractmethod
    def flat(self) -> torch.Tensor:
        """The whole shard as one fp32 tensor."""

    @abstractmethod
    def chunk(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:
        """Elements [start, start + numel) as fp32 on `out`'s device (a view where they already are)."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @property
    @abstractmethod
    def element_size(self) -> int:
        """Bytes per element as produced (what a copy off the compute device moves)."""

    def wait(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Block until `flat` and `chunk` can read it (a staged copy off the device has landed): the
        optimizer worker calls it, never the autograd thread ([Note: the optimizer worker] in
        runtime/optim/optimizer_worker.py)."""

    def spent(self) -> None:  # noqa: B027 - a no-op unless overridden
        """The optimizer updated the unit with it."""

    def unclaimed(self) -> None:  # noqa: B027 - a no-op unless overridden
        """No optimizer took it (none is attached to the model)."""


class StoredGradient(FinalGradient):
    """The gradient in the gradient store (exact once settled)."""

    __slots__ = ("_sink",)

    def __init__(self, sink: StoredGradients) -> None:
        self._sink = sink

    def wait(self) -> None:
        self._sink.await_landing()

    def flat(self) -> torch.Tensor:
        return self._sink.shard()

    def chunk(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        return self.flat()[start : start + numel]

    @property
    def device(self) -> torch.device:
        return self.flat().device

    @property
    def element_size(self) -> int:
        return self.flat().element_size()

    def spent(self) -> None:
        self._sink.zero_grad()  # the next backward overwrites it, whatever the loop does


class UnitGradient(FinalGradient):
    """A unit's final gradient shard for this backward, handed to the optimizer's in-backward update
    instead of being stored ([Note: the optimizer step in backward] in runtime/optim/streamed_optimizer.py).

    `parts` are (element offset in the flat shard, flat tensor): on one rank each parameter's
    gradient as autograd produced it, with several ranks the reduce-scattered shard. Elements no
    part covers (padding, parameters that got no gradient) are zeros, as `settle` makes them."""

    __slots__ = ("parts", "_numel")

    def __init__(self, parts: list[tuple[int, torch.Tensor]], numel: int) -> None:
        self.parts = parts
        self._numel = numel

    @property
    def device(self) -> torch.device:
        return self.parts[0][1].device if self.parts else torch.device("cpu")

    @property
    def element_size(self) -> int:
        return self.parts[0][1].element_size() if self.parts else 4

    def flat(self) -> torch.Tensor:
        return self.chunk(0, self._numel, torch.empty(self._numel, dtype=torch.float32, device=self.device))

    def chunk(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:
        """A view of a part when one part holds them all in fp32 on `out`'s device (no copy), else
        copied (and cast) into `out[:numel]`."""
        end = start + numel
        for offset, flat in self.parts:
            if offset <= start and end <= offset + flat.numel() and flat.dtype == torch.float32 \
                    and flat.device == out.device:
                return flat[start - offset : end - offset]
        dst = out[:numel]
        covered = 0
        for offset, flat in sorted(self.parts, key=lambda p: p[0]):
            lo, hi = max(start, offset), min(end, offset + flat.numel())
            if lo >= hi:
                continue
            if lo - start > covered:
                dst[covered : lo - start].zero_()
            dst[lo - start : hi - start].copy_(flat[lo - offset : hi - offset])
            covered = hi - start
        if covered < numel:
            dst[covered:].zero_()
        return dst

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0][1].dtype if self.parts else torch.float32

    def staged(self, host: torch.Tensor, copier: CopyEngine, after: list[DeviceEvent | None]) -> StagedGradient:
        """Start copying the device parts into `host` (pinned, at least `numel` elements of their
        dtype) on the device-to-host stream, after the events of the work that produced them; the
        host does not wait for it here."""
        streams = copier.streams
        for event in after:
            streams.wait(Role.D2H, event)
        event = None
        parts = []
        for offset, flat in self.parts:
            dst = host[offset : offset + flat.numel()]
            copier.link_bytes["d2h"] = copier.link_bytes.get("d2h", 0) + nbytes(flat)
            event = streams.d2h(dst, flat)
            parts.append((offset, dst))
        return StagedGradient(UnitGradient(parts, self._numel), event)

    def unclaimed(self) -> None:
        _refuse_unclaimed()


class ReducedGradient(FinalGradient):
    """Several ranks, a unit's gradient handed over when its reduce-scatter is issued: the averaged
    slice the rank's transfer worker files once the reduce-scatter finished (`wait`, on the
    optimizer worker, waits for that job), as a `UnitGradient`."""

    __slots__ = ("_sink", "_got")

    def __init__(self, sink: HandedGradients) -> None:
        self._sink = sink
        self._got: UnitGradient | None = None

    def wait(self) -> None:
        self._sink.await_landing()

    def _gradient(self) -> UnitGradient:
        if self._got is None:
            self.wait()
            self._got = self._sink.take_reduced()
        return self._got

    def flat(self) -> torch.Tensor:
        return self._gradient().flat()

    def chunk(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:
        return self._gradient().chunk(start, numel, out)

    def staged(self, host: torch.Tensor, copier: CopyEngine, after: list[DeviceEvent | None]) -> StagedGradient:
        return self._gradient().staged(host, copier, after)

    @property
    def numel(self) -> int:
        return self._sink.layout.shard_numel

    @property
    def dtype(self) -> torch.dtype:
        return self._gradient().dtype

    @property
    def device(self) -> torch.device:
        return self._gradient().device

    @property
    def element_size(self) -> int:
        return self._gradient().element_size

    def unclaimed(self) -> None:
        _refuse_unclaimed()


class StagedGradient(FinalGradient):
    """A device `UnitGradient` on its way into pinned host memory on the copy stream (CUDA): the
    in-backward hook issues the copy, the optimizer worker `wait`s for its event and updates from
    the host copy ([Note: the optimizer worker] in runtime/optim/optimizer_worker.py)."""

    __slots__ = ("_host", "_event")

    def __init__(self, host: UnitGradient, event: DeviceEvent | None) -> None:
        self._host = host
        self._event = event

    def wait(self) -> None:
        if self._event is not None:
            self._event.layer.host_wait(self._event, "a staged gradient")
            self._event = None

    def flat(self) -> torch.Tensor:
        self.wait()
        return self._host.flat()

    def chunk(self, start: int, numel: int, out: torch.Tensor) -> torch.Tensor:
        self.wait()
        return self._host.chunk(start, numel, out)

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def element_size(self) -> int:
        return self._host.element_size


@dataclass(eq=False, kw_only=True)
class GradientSink(ABC):
    """One unit's gradients through a backward: filed as they arrive, reduce-scattered with several
    ranks, handed over once final. Subclasses say where they go."""

    key: UnitKey
    layout: FlatLayout
    num_grad_params: int
    comm: Comm
    ledger: MemoryLedger
    link_bytes: dict[str, int]
    streams: Streams
    worker: TransferWorker
    """The rank's transfer worker: lands this unit's gradients where they live."""
    reduce_worker: TransferWorker
    """The rank's reduce worker: finishes this unit's reduce-scatters (several ranks)."""
    _pending: int = field(init=False)
    """Gradients still to arrive in this backward."""
    _flat: torch.Tensor | None = field(init=False, default=None)
    """With several ranks: the unit's full flat gradient, collected for its reduce-scatter."""
    _landed: int | None = field(init=False, default=None)
    """The transfer worker's ticket of the job that lands this backward's gradient."""
    _reduced_by: int | None = field(init=False, default=None)
    """The reduce worker's ticket of the job that finishes this backward's reduce-scatter."""

    def __post_init__(self) -> None:
        self._pending = self.num_grad_params

    def file(self, index: int, grad: torch.Tensor) -> bool:
        """File parameter `index`'s gradient, complete for this backward. True when it was the unit's
        last, i.e. the unit's backward is over: reduce its gradients and reshard it."""
        self._pending -= 1
        if self.comm.world_size == 1:
            self._file_local(index, grad)
        else:
            self._before_collect()
            if self._flat is None:
                self._flat = torch.zeros(self.layout.padded_numel, dtype=grad.dtype, device=grad.device)
                self.ledger.add("gpu", MemoryTerm.MSWM, nbytes(self._flat))
            self._flat[self.layout.param_slice(index)].copy_(grad.reshape(-1))
        return self._pending == 0

    def reduce(self) -> Reduced | None:
        """Start the reduce-scatter of whatever gradients arrived (all of them, normally)."""
        self._pending = self.num_grad_params
        flat, self._flat = self._flat, None
        if flat is None:
            return None
        self.ledger.sub("gpu", MemoryTerm.MSWM, nbytes(flat))
        self.ledger.add("gpu", MemoryTerm.REDUCE_SCATTER_BUFFER, nbytes(flat))
        return reduce_scatter_flat(self.comm, flat, self.link_bytes)

    def hand_over_reduce(self, reduced: Reduced) -> int:
        """Let the rank's reduce worker wait for the reduce-scatter, average its slice and file it
        ([Note: a reduce-scatter finishes on the reduce worker] in runtime/sharding.py); returns the
        job's ticket."""
        self._reduced_by = self.reduce_worker.submit(partial(self.finish_reduce, reduced))
        return self._reduced_by

    def finish_reduce(self, reduced: Reduced) -> None:
        """Wait for the reduce-scatter (the current stream follows it), average the slice and file
        it; a copy off the device lands on the transfer worker."""
        out = reduced.wait() if not reduced.works else self.streams.join(
            self.streams.current_role(), reduced.wait, device_side=self.comm.device_side, why="a reduce-scatter")
        self.ledger.sub("gpu", MemoryTerm.REDUCE_SCATTER_BUFFER, self.layout.padded_numel * out.element_size())
        self.streams.keep(out, self.streams.current_role())  # allocated on the compute stream, used on this one
        out.div_(self.comm.world_size)
        pending = self._file_reduced(out)
        if pending.in_flight:
            self._landed = self.worker.submit(pending.wait)
        else:
            pending.wait()

    def await_landing(self) -> None:
        """Block until the workers finished and landed what this unit filed so far (no-op once they did)."""
        if self._reduced_by is not None:
            self.reduce_worker.wait(self._reduced_by)
        if self._landed is not None:
            self.worker.wait(self._landed)

    @property
    def partial(self) -> bool:
        """Some but not all of the unit's gradients arrived in this backward (so far)."""
        return 0 < self.num_grad_params - self._pending < self.num_grad_params

    @abstractmethod
    def _file_local(self, index: int, grad: torch.Tensor) -> None:
        """One rank: file parameter `index`'s gradient (the flat vector is the shard)."""

    def _before_collect(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Several ranks: before a gradient joins the flat buffer."""

    @abstractmethod
    def _file_reduced(self, shard: torch.Tensor) -> Pending:
        """Several ranks: file this rank's averaged slice."""

    @property
    @abstractmethod
    def received(self) -> bool:
        """Whether any gradient arrived since `zero_grad` (torch's optimizers skip a parameter whose
        `.grad` is None: no decay, no momentum step; the optimizer does the same per unit)."""

    @abstractmethod
    def final(self) -> FinalGradient | None:
        """The unit's gradient for this backward, now final (None: nothing to hand over)."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    def settle(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Make what was filed exact before an update reads it."""

    @staticmethod
    def factory(store: ShardStore | None) -> Callable[..., GradientSink]:
        """The sink of every unit: `StoredGradients` into `store`, or `HandedGradients` where the plan
        stores no gradient (`store` None)."""
        return HandedGradients if store is None else partial(StoredGradients, store)


class StoredGradients(GradientSink):
    """Gradients written (then accumulated) into the gradient store."""

    def __init__(self, store: ShardStore, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.store = store
        self._has_shard = False
        self._written = [False] * len(self.layout.shapes)
        """Per parameter: its slice of the gradient shard holds this step's gradient (see
        [Note: lazy gradient zeroing])."""

    def _file_local(self, index: int, grad: torch.Tensor) -> None:
        """[Note: gradients land on the transfer worker]
        With a device of its own a gradient is copied off it on the device-to-host stream as it
        arrives, and the copy is handed to the rank's transfer worker, which waits for it and adds
        (or copies) it into the shard, in arrival order: the autograd thread never waits, and the
        consumers of the shard (`settle`, the optimizer's update) wait for that job. Every other
        store completes the transfer in the call (the CPU machine: the same operations in the same
        order)."""
        self._ensure_shard()
        offset = self.layout.offsets[index]
        if self._written[index]:
            pending = self.store.accumulate(self.key, grad, offset)
        else:
            pending = self.store.write(self.key, grad, offset)
            self._written[index] = True
        if pending.in_flight:  # a copy off the device (its staging may be needed by the next one)
            self._landed = self.worker.submit(pending.wait)
        else:
            pending.wait()

    def _before_collect(self) -> None:
        self._ensure_shard()

    def _file_reduced(self, shard: torch.Tensor) -> Pending:
        if all(self._written):
            return self.store.accumulate(self.key, shard)
        pending = self.store.write(self.key, shard)
        self._written = [True] * len(self._written)
        return pending

    def _ensure_shard(self) -> None:
        """Gradient shards are created by the first backward, not at construction: a model is built
        holding its parameter shards only (construction-time partitioning, docs/method.md §4.6)."""
        if not self._has_shard:
            self.store.create(self.key, self.layout.shard_numel, torch.float32)
            self._has_shard = True

    @property
    def received(self) -> bool:
        return any(self._written)

    def final(self) -> StoredGradient:
        return StoredGradient(self)

    def shard(self) -> torch.Tensor:
        """The exact gradient shard where it lives (zeros for parameters that got no gradient)."""
        self._ensure_shard()
        self.settle()
        return self.store.resident(self.key)

    def zero_grad(self) -> None:
        """[Note: lazy gradient zeroing] Zeroing is a promise, not a memset: the next gradient to
        arrive overwrites its slice instead of adding to it, which saves two passes over the
        gradient shards per step. Slices nobody wrote are zeroed by `settle` before use."""
        self.await_landing()
        self._written = [False] * len(self._written)

    def settle(self) -> None:
        """Make the gradient shard exact: zero the slices that received nothing since `zero_grad`."""
        self.await_landing()
        if all(self._written) or not self._has_shard:
            return
        if self.comm.world_size == 1:
            for index, written in enumerate(self._written):
                if not written:
                    part = self.layout.param_slice(index)
                    self.store.zero(self.key, part.start, part.stop - part.start)
        else:
            self.store.zero(self.key, 0, self.layout.shard_numel)
        self._written = [True] * len(self._written)


class HandedGradients(GradientSink):
    """Gradients kept as produced until final, then handed over once (never stored)."""

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._arrived: dict[int, torch.Tensor] = {}
        """One rank: this backward's gradients by parameter index, until the unit's last one arrives."""
        self._reduced: torch.Tensor | None = None
        """Several ranks: the averaged slice `finish_reduce` produced."""

    def _file_local(self, index: int, grad: torch.Tensor) -> None:
        assert index not in self._arrived, f"unit {self.key}: a second gradient for parameter {index}"
        self._arrived[index] = grad

    def _file_reduced(self, shard: torch.Tensor) -> Pending:
        self._reduced = shard
        return Pending(shard)

    @property
    def received(self) -> bool:
        return bool(self._arrived) or self._reduced is not None

    def take_reduced(self) -> UnitGradient:
        """Several ranks: the averaged slice the transfer worker filed (after `await_landing`)."""
        out, self._reduced = self._reduced, None
        assert out is not None, f"unit {self.key}: no reduce-scatter was filed"
        return UnitGradient([(0, out.reshape(-1))], self.layout.shard_numel)

    def final(self) -> FinalGradient | None:
        numel = self.layout.shard_numel
        if self.comm.world_size > 1:
            return ReducedGradient(self)
        if not self._arrived:
            return None
        arrived, self._arrived = self._arrived, {}
        self._pending = self.num_grad_params
        return UnitGradient([(self.layout.offsets[i], g.reshape(-1)) for i, g in arrived.items()], numel)

    def zero_grad(self) -> None:
        """Nothing is kept past its hand-over."""


def _refuse_unclaimed() -> None:
    raise RuntimeError("the plan's optimizer_step is in_backward, so each gradient goes straight into the "
                       "optimizer: create runtime.AdamW(model, ...) before the first backward")
