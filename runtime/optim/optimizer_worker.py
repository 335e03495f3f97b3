"""The rank's optimizer worker: one thread that runs the in-backward updates, in submission order.

[Note: the optimizer worker]
With `optimizer_step: in_backward` the hook that makes a unit's gradient final only hands the
update over: it submits a job to this worker, one thread per optimizer, and returns; the backward
of the units before goes on while the worker waits for the gradient (landed, or reduce-scattered,
by the rank's transfer workers; on a device of its own a host update copies it off the device into
`GradientStaging` first) and updates. It is a `HostWorker` ([Note: the host worker] in
runtime/transfer/host_worker.py: FIFO order, so bitwise the results of updating in place; a failed
job skips the later ones and the next wait raises its error, the optimizer staying failed).
- Who touches what: while a backward runs the engine (read-ahead, chunk pool, step counts, torch's
  optimizer) belongs to the worker; the main thread gathers parameters and files gradients. The
  engine's other calls (`begin_updates` at the forward's tail, `backward_begin`, `end_updates` at
  `optimizer.step()`) run on the main thread after a `drain`. Both threads touch the stores, never
  one key at once (below); the NVMe stores of a swap space take its lock around each call ([Note:
  one lock per swap space] in runtime/transfer/nvme_store.py).
- Same key: a unit is updated after its gradient is final, when the backward is done with it, and
  its updated parameters are read again only by the next forward. `optimizer.step()` waits for
  every update (the host's one wait of the step, with the transfers'), and the next forward and
  backward drain first, so no gather reads a shard before its update wrote it; an update's error is
  raised by `step()`.
- Bounded: at most `MAX_QUEUED_UPDATES` updates wait (the hook blocks beyond), so the gradients
  held for the worker, and the pinned staging on a device, stay bounded whatever the CPU's speed.
- After backward with the states on NVMe the step runs on a worker too, one unbounded job per unit,
  overlapping the next forward ([Note: the step overlaps the next forward] in step_schedule.py).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from planner.cost.memory import IN_BACKWARD_QUEUED_UPDATES, IN_BACKWARD_STAGED_GRADIENTS
from planner.specs.memory_terms import MemoryTerm
from planner.specs.units import round_up_4kib
from runtime.ledger import MemoryLedger
from runtime.transfer.host_worker import HostWorker
from runtime.transfer.streams import Streams
from runtime.transfer.trace import WaitKind

MAX_QUEUED_UPDATES = IN_BACKWARD_QUEUED_UPDATES  # planner/cost/memory.py bills the staging this bounds
"""Updates waiting beyond the one running: enough for unit k's update to overlap the backward of
unit k-1, and the gradients held for the worker stay at two units'."""


class OptimizerWorker(HostWorker):
    """The optimizer's host worker ([Note: the optimizer worker]; [Note: the host worker] in
    runtime/transfer/host_worker.py)."""

    def __init__(self, name: str = "tierwise-optimizer", max_queued: int = MAX_QUEUED_UPDATES) -> None:
        super().__init__(name, max_queued)


class GradientStaging:
    """Pinned host buffers an in-backward update copies its device gradient into before updating on
    the host: `count` of them, each the largest unit's gradient shard rounded to 4 KiB (what the
    plan's bill holds as `gradient_swap_buffers`, planner.cost.memory.staged_in_backward), pinned once
    when the optimizer is made and charged to the ledger until it is closed."""

    def __init__(self, model: Any, streams: Streams, count: int = IN_BACKWARD_STAGED_GRADIENTS) -> None:
        self.ledger: MemoryLedger = model.ledger
        self.streams = streams
        element = torch.empty(0, dtype=model.config.compute_dtype).element_size()
        size = round_up_4kib(max((u.layout.shard_numel for u in model.units), default=1) * element)
        self._buffers = [streams.pinned_buffer(size, MemoryTerm.GRADIENT_SWAP_BUFFERS) for _ in range(count)]
        self.ledger.add("cpu", MemoryTerm.GRADIENT_SWAP_BUFFERS, sum(b.capacity_bytes for b in self._buffers))
        self._free = list(self._buffers)
        self._cond = threading.Condition()

    def acquire(self) -> torch.Tensor:
        """A free buffer as a uint8 tensor (waits while every one is in use)."""
        with self._cond:
            if not self._free:
                self.streams.blocked(WaitKind.BACKPRESSURE, "a gradient staging buffer")
            while not self._free:
                self._cond.wait()
            return torch.frombuffer(self._free.pop().view, dtype=torch.uint8)

    def release(self, tensor: torch.Tensor) -> None:
        with self._cond:
            self._free.append(next(b for b in self._buffers if b.address == tensor.data_ptr()))
            self._cond.notify()

    def close(self) -> None:
        """Unpin and free the buffers (every one must have been released: the worker is closed)."""
        with self._cond:
            buffers, self._buffers, self._free = self._buffers, [], []
        self.ledger.sub("cpu", MemoryTerm.GRADIENT_SWAP_BUFFERS, sum(b.capacity_bytes for b in buffers))
        for buffer in buffers:
            self.streams.release_pinned(buffer, MemoryTerm.GRADIENT_SWAP_BUFFERS)
