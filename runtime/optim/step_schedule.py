"""When the optimizer updates: one listener class per `optimizer_step` of the plan.

Each is the sharded model's `UnitListener` while its optimizer lives, and drives an `AdamWEngine`
([Note: schedules as types] in runtime/units/events.py). After backward with the states on NVMe
on the CPU, the step overlaps the next forward unit by unit ([Note: the step overlaps the next
forward], above `OverlappedAfterBackward`).
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from functools import partial
from typing import ClassVar

import torch

from runtime.optim.optimizer_engine import AdamWEngine
from runtime.optim.optimizer_worker import GradientStaging, OptimizerWorker
from runtime.optim.streamed_optimizer import StreamedAdamW
from runtime.transfer.nvme_store import aligned_empty
from runtime.transfer.stores import Pending
from runtime.transfer.streams import DeviceEvent, Streams
from runtime.transfer.trace import Role
from runtime.units.events import UnitListener
from runtime.units.gradients import FinalGradient
from runtime.units.group import ParamUnit


class AfterBackward(UnitListener):
    """`optimizer_step: after_backward`: `optimizer.step()` updates every unit that got a gradient
    from the gradient store; meanwhile the engine may read the step's first states."""

    def __init__(self, engine: AdamWEngine, units: list[ParamUnit]) -> None:
        self.engine = engine
        self.units = units

    def gradient_final(self, unit: ParamUnit, gradient: FinalGradient) -> None:  # noqa: ARG002
        self.engine.prefetch_for_step()

    def step(self) -> bool:
        self.engine.model.wait_transfers()  # the host's one wait of the step: the gradients landed
        return self.engine.step([u for u in self.units if u.grads.received])

MAX_HANDED_SHARDS = 2
"""Updated shards the overlapped step holds for the forward before it takes them; a unit updated
beyond is read back from the drive. Each stands for the read of that shard that the forward's
prefetch would otherwise have in flight (the host's param swap buffers, at least two)."""

# [Note: the step overlaps the next forward]
# After backward with the states on NVMe (on the CPU), the step is NVMe I/O plus Adam that overlapped
# nothing, while the next forward's first units need only their own updated shards. So
# `optimizer.step()` does on the main thread what needs every gradient or the caller's state (the
# sharded model's end of backward, settling the gradients, taking the hyperparameters, resuming the
# read-ahead), then submits one job per unit, in the units' order (the order the forward gathers
# them, and the order the synchronous step updates them), and a last job whose release lets the
# step's writes land; it returns at once. The invariant: nothing reads what a unit's update writes
# before that update has run.
#
# - Parameters: each stepped unit carries `await_update` until its update ran; the unit's first read
#   of its shard (`stage`, `start_gather`) asks it. At a use it waits for that unit's job only, so
#   the forward of unit k overlaps the updates of units k+1...; a prefetch on one rank skips the read
#   until the update is done (a collective prefetch on several ranks waits, keeping the ranks'
#   all-gathers in one order).
# - Hand-off: where the updated fp32 master is the shard the forward would read back (fp32 params
#   on NVMe, their own master, on the CPU: `StreamedAdamW.hands_updated_shard`) the worker copies it
#   out of the chunk buffer into a read buffer and hands it over; the forward takes it instead of a
#   read. Reading it back was a read queued behind the step's state I/O, at the use (the prefetch had
#   skipped it: not updated yet), with nothing to compute meanwhile (benchmarks/RESULTS.md, the
#   full-NVMe step's hand-kept lines). At most `MAX_HANDED_SHARDS` wait untaken; a later read of the
#   unit from the drive (a second use) still waits for its writes.
# - Profile: the main thread's waits for the step (a use waiting for an update, the drain at the next
#   backward) count to the `optimizer` phase of the sample they fall in, not to the forward or the
#   backward (`Profiler.waited`): phases still add up to the step, and the optimizer phase is what
#   the step cost the main thread. Its bytes count to that sample too (counted when submitted), so
#   a sample holds the previous step's optimizer traffic and time; in steady state per-step totals
#   are the synchronous step's bytes. Where the CPU is the compute device the forward shares its
#   cores with Adam (torch's fused kernel on the worker), so the overlapped step costs about
#   max(forward + Adam's CPU time, the step's I/O) instead of forward + step. A unit counts as
#   updated once its writes landed too: the
#   worker waits for them (in the next unit's job, so they overlap that update; for the last unit
#   the step's end), as their one consumer. The main thread's read must not rely on the store
#   ordering it after a write in flight that the worker may be waiting for at the same moment (a
#   handle has one consumer, [Note: one lock per swap space] in runtime/transfer/nvme_store.py).
# - The engine (read-ahead, pool, step counts) belongs to the worker until `drain`: the next
#   backward (its state read-ahead), `optimizer.step()`, the optimizer's checkpoint, state-dict and
#   pool accessors, `close` and `ShardedModel.wait_io` (benchmarks end their timed block there) drain
#   first. `zero_grad` only resets flags, the gradient store's bytes are read by the step's jobs and
#   are written again only by the next backward, which drains first. The hyperparameters are taken
#   at `step()`: an LR schedule may change `param_groups` meanwhile.
# - Bitwise: the same chunks in the same order through the same kernel, one thread at a time on the
#   engine; only when the main thread waits changes.
# - Failure: a failed job skips the later ones (the step's writes still land) and the first wait
#   (a unit's read in the next forward, or any drain) raises it in one line; the optimizer stays failed.
# - On CUDA the compute stream would have to follow the worker's device writes (as `InBackward`
#   does): not done, so there the step stays synchronous (`StreamedAdamW.overlaps_forward`).
class OverlappedAfterBackward(AfterBackward):
    """`optimizer_step: after_backward` with the states on NVMe, on the CPU: `optimizer.step()` begins
    the step and hands each unit's update to the optimizer worker, and the next forward's read of a
    unit's shard waits for that unit's update only ([Note: the step overlaps the next forward])."""

    def __init__(self, engine: StreamedAdamW, units: list[ParamUnit]) -> None:
        super().__init__(engine, units)
        self.engine: StreamedAdamW = engine
        # Unbounded: a job holds no memory of its own (the gradients are in the gradient store).
        self.worker = OptimizerWorker("tierwise-optimizer-step", max_queued=0)
        self._awaited: list[ParamUnit] = []
        """Units whose update of the step in progress a read of their shards must wait for."""
        self._writes: list[Pending] = []
        """On the worker: the writes of the unit updated last."""
        self._handed: dict[str, torch.Tensor] = {}
        """Updated shards handed to the forward and not taken yet (guarded by `_handing`)."""
        self._handing = threading.Lock()
        self._profiler = engine.model.profiler
        weakref.finalize(self, self.worker.close)

    def drain(self) -> None:
        """Wait for the step in progress (every unit's update and its writes landed)."""
        began = time.perf_counter()
        try:
            self.worker.drain()
        finally:
            self._profiler.waited("optimizer", time.perf_counter() - began)
        self._forget()

    def _forget(self) -> None:
        for unit in self._awaited:
            unit.await_update = None
        self._awaited = []
        with self._handing:
            self._handed.clear()  # unused (a unit the forward did not read): its bytes are on the drive

    def backward_begin(self) -> None:
        self.drain()  # the backward's state read-ahead uses the engine

    def step(self) -> bool:
        self.drain()
        self.engine.model.wait_transfers()
        units = [u for u in self.units if u.grads.received]
        self.engine.begin_step(units)
        self._writes = []
        tickets = [self.worker.submit(partial(self._update, unit)) for unit in units]
        # `release` runs after a failed update too: the step's writes land whatever happened.
        tickets.append(self.worker.submit(_nothing, self.engine.end_step))
        for unit, landed in zip(units, tickets[1:], strict=True):
            unit.await_update = partial(self._await, unit, landed)
        self._awaited = units
        return True

    def _update(self, unit: ParamUnit) -> None:
        """On the worker: update `unit` (handing the forward a copy of its updated shard where that is
        what it would read back), then wait for the previous unit's writes, which its read in the
        forward must not overtake (the worker consumes them, so they land before the job ends; one
        unit late, so that they overlap this update)."""
        updated = None
        if self.engine.hands_updated_shard(unit):
            with self._handing:
                room = len(self._handed) < MAX_HANDED_SHARDS
            if room:
                store = self.engine.model.param_store
                updated = aligned_empty(unit.layout.shard_numel, torch.float32, store.recycler)
        writes = self.engine.step_unit(unit, updated)
        if updated is not None:
            with self._handing:
                self._handed[unit.key] = updated
            self.worker.notify()
        for pending in self._writes:
            pending.wait()
        self._writes = writes

    def _take(self, unit: ParamUnit) -> torch.Tensor | None:
        with self._handing:
            return self._handed.pop(unit.key, None)

    def _await(self, unit: ParamUnit, ticket: int, block: bool) -> bool | Pending:  # noqa: FBT001
        """Whether `unit`'s update is done and its writes landed (waiting for it if `block`), or its
        updated shard, handed over before; an update that failed fails here."""
        began = time.perf_counter()
        try:
            handed = self.worker.wait_for(partial(self._take, unit), ticket, block=block)
            if handed is not None:  # a later read of the unit from the drive still waits for the writes
                return Pending(handed, fresh=True)
            if not block and not self.worker.finished(ticket):
                return False
            try:
                self.worker.wait(ticket)
            except Exception as error:
                first = (str(error).splitlines() or [""])[0]
                raise RuntimeError(f"the optimizer step overlapping this forward failed (reading {unit.key}): "
                                   f"{type(error).__name__}: {first}") from error
            unit.await_update = None
            return True
        finally:
            if block:  # the forward (or whatever reads) waited for the step: that is the step's time
                self._profiler.waited("optimizer", time.perf_counter() - began)

    def close(self) -> None:
        self.worker.close()  # lets the queued updates finish or be skipped, then joins
        self._forget()

def _nothing() -> None:
    pass

class InBackward(UnitListener):
    """`optimizer_step: in_backward`: each unit is updated as soon as its gradient is final
    ([Note: the optimizer step in backward] in runtime/optim/streamed_optimizer.py), on the optimizer
    worker while the backward goes on ([Note: the optimizer worker] in runtime/optim/optimizer_worker.py);
    `optimizer.step()` waits for the updates and finishes what is left."""

    replaceable: ClassVar[bool] = False
    """Two optimizers would both update each unit."""

    def __init__(self, engine: AdamWEngine, units: list[ParamUnit]) -> None:  # noqa: ARG002
        self.engine = engine
        self._updated: set[str] = set()
        """Units updated in this step's backward."""
        self.worker = OptimizerWorker()
        copier = engine.model.copier
        self._streams: Streams = copier.streams
        self._reduces = copier.reduce_worker
        self._updates_done: DeviceEvent | None = None
        """Marks the end of the kernels the last update queued (on the worker's stream)."""
        host_update = engine.chunk_pool is not None and self._streams.separate_memory
        self._staging = GradientStaging(engine.model, self._streams) if host_update else None
        # Joined when the optimizer is dropped without close() too (not at interpreter exit: see the note).
        weakref.finalize(self, self.worker.close)

    def forward_begin(self) -> None:
        self._drain()  # a forward with no step since the backward: its gathers read updated shards

    def forward_tail(self) -> None:
        self._drain()  # the engine is the main thread's between backwards
        self.engine.begin_updates()

    def backward_begin(self) -> None:
        self._drain()
        if self._updated:
            self._refuse_second_gradient(min(self._updated))
        self.engine.backward_begin()

    @staticmethod
    def _refuse_second_gradient(key: object) -> None:
        raise RuntimeError(
            f"unit {key} got a second gradient before optimizer.step(): the plan's optimizer_step is in_backward, "
            "which updates each unit once per backward and cannot accumulate gradients over several; call "
            "optimizer.step() after every backward, or set optimizer_step to after_backward")

    @torch.no_grad()
    def gradient_final(self, unit: ParamUnit, gradient: FinalGradient) -> None:
        if unit.key in self._updated:
            self._refuse_second_gradient(unit.key)
        self._updated.add(unit.key)
        # The worker's device work follows the kernels that produced the gradient.
        produced = self._streams.record(Role.COMPUTE) if self._streams.separate_memory else None
        self.worker.submit(partial(self._update, unit, gradient, produced))

    @torch.no_grad()
    def _update(self, unit: ParamUnit, gradient: FinalGradient, produced: DeviceEvent | None) -> None:
        """On the worker: once the gradient is where it lives (landed, or reduce-scattered, on the
        rank's transfer worker), update the unit; a host update from a gradient on the device copies
        it off the device first."""
        streams = self._streams
        gradient.wait()
        if not streams.separate_memory:
            self.engine.update_unit(unit, gradient)
            return
        after = [produced, self._reduces.device_done]  # a reduce-scatter's slice is made on its worker
        if self._staging is not None:
            self._update_on_the_host(unit, gradient, after)
            return
        with streams.on(Role.COMPUTE):  # the worker thread's current device is not the rank's
            for event in after:
                streams.wait(Role.COMPUTE, event)
            self.engine.update_unit(unit, gradient)
        self._updates_done = streams.record(Role.COMPUTE)

    def _update_on_the_host(self, unit: ParamUnit, gradient: FinalGradient, after: list[DeviceEvent | None]) -> None:
        """Copy the device gradient into pinned staging (device-to-host stream), wait for it, update."""
        assert self._staging is not None
        nbytes = gradient.numel * gradient.element_size  # type: ignore[attr-defined]
        buffer = self._staging.acquire()
        try:
            host = buffer[:nbytes].view(gradient.dtype)  # type: ignore[attr-defined]
            staged = gradient.staged(host, self.engine.model.copier, after)  # type: ignore[attr-defined]
            staged.wait()
            self.engine.update_unit(unit, staged)
        finally:
            self._staging.release(buffer)

    def drain(self) -> None:
        self._drain()

    def _drain(self) -> None:
        """Wait for the worker; the compute stream then follows the kernels the updates queued
        (device stores written by an update), before any later gather reads their shards."""
        self.worker.drain()
        self._streams.wait(Role.COMPUTE, self._updates_done)

    def step(self) -> bool:
        """Every unit with a gradient was updated in backward: wait for the updates (the host's one
        wait of the step); what is left are writes."""
        try:
            self.engine.model.wait_transfers(self.worker)
            self._streams.wait(Role.COMPUTE, self._updates_done)
        except BaseException:
            self._updated.clear()
            with contextlib.suppress(Exception):  # the worker's error is the one to report
                self.engine.end_updates()
            raise
        self._updated.clear()
        self.engine.end_updates()
        return True

    def close(self) -> None:
        self.worker.close()
        if self._staging is not None:
            self._staging.close()

SCHEDULES: dict[str, type[AfterBackward | InBackward]] = {"after_backward": AfterBackward, "in_backward": InBackward}
"""The plan's `optimizer_step` -> its schedule."""
