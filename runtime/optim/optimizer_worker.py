"""The rank's optimizer worker: one thread that runs the in-backward updates, in submission order.

[Note: the optimizer worker]
With `optimizer_step: in_backward` a unit's update (Adam over its shard, and with the states on
NVMe their chunked reads and writes) ran inside the autograd hook that made its gradient final, so
the backward stopped while the CPU updated. Now the hook only hands the update over: on CUDA it
issues the gradient's device-to-host copy on the copy stream into a pinned staging buffer
(`StagedGradient`), and in every case it submits a job to this worker, one thread per optimizer,
and returns; the backward of the units before goes on (on the GPU, and on the CPU's other core)
while the worker waits for the copy's event (never the autograd thread) and updates.

- Order: one thread and a FIFO queue, so the updates run in the order the gradients became final,
  the order the synchronous update had: the same kernels on the same bytes in the same order,
  bitwise the same results.
- Who touches what: while a backward runs, the engine (its read-ahead, chunk pool, step counts,
  torch's optimizer) belongs to the worker; the main (autograd) thread gathers parameters and files
  gradients. The engine's other calls (`begin_updates` at the forward's tail, `backward_begin`,
  `end_updates` at `optimizer.step()`) run on the main thread and first `drain` the worker, so the
  engine is never used by two threads at once and each hand-over is ordered by the queue and the
  drain. What both threads do touch is the stores: the parameter store (main reads shards for the
  backward's gathers, the worker writes updated shards) and, with NVMe, the rank's swap space
  (engine, read recycler, link counters) that all its stores share. In-memory stores share no
  bookkeeping, and the two threads never touch one key at once (below), so they need no lock;
  the NVMe stores keep per-store lists of requests in flight and count shared link bytes, so all
  stores of a swap space take the space's lock around each call ([Note: one lock per swap space]
  in runtime/transfer/nvme_store.py). Moving all store traffic onto the worker instead would queue the
  backward's parameter reads behind the updates, which is the serialisation this removes.
- Same key: the worker updates a unit after its gradient is final, when the backward is done with
  the unit (resharded, its parameters not used again in this backward), and a unit's updated
  parameters are read again only by the next forward. The end of every backward drains the worker
  (an autograd callback queued after the model's own end-of-backward work), so `loss.backward()`
  returns with every update applied, as before, and no later gather can read a shard before its
  update wrote it. `optimizer.step()` drains again (a no-op after a normal backward).
- Bounded: at most `MAX_QUEUED_UPDATES` updates wait (the hook blocks beyond), so gradients held
  for the worker, and the pinned staging on CUDA, stay bounded whatever the speed of the CPU.
- Failure: an exception in a job is kept, the jobs after it are skipped (their staging released),
  and the next `drain` raises it on the main thread: the one at the end of the backward, which
  runs after the model's own end-of-backward work, so `loss.backward()` fails with the worker's
  own error and leaves the model between steps, as a normal backward does (raising from a later
  hand-over instead would abort the backward mid-way, and `optimizer.step()` would then refuse to
  run "inside backward" instead of reporting the error). `optimizer.step()` raises it again, never
  a hang. The optimizer stays failed (its states are partly updated): every later drain (the next
  forward's tail or backward) raises the same error.
- After backward: with the states on NVMe the after-backward step runs on a worker too, one job per
  unit, overlapping the next forward; there the main thread waits for one unit's job (`wait` on
  its ticket) instead of the whole queue, and the queue is unbounded (the jobs hold no gradients).
  Its invariant is [Note: the step overlaps the next forward] in runtime/optim/step_schedule.py.
- Lifetime: the thread is started by the first job, is not a daemon, and is joined by `close`
  (`optimizer.close()`, or when the schedule is collected); one never closed leaves at interpreter
  exit, when it finds the main thread gone, before the interpreter tears down what a job would use.
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
