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

import queue
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

from planner.cost.memory import IN_BACKWARD_QUEUED_UPDATES, IN_BACKWARD_STAGED_GRADIENTS
from planner.specs.memory_terms import MemoryTerm
from runtime.ledger import MemoryLedger

MAX_QUEUED_UPDATES = IN_BACKWARD_QUEUED_UPDATES  # planner/cost/memory.py bills the staging this bounds
"""Updates waiting beyond the one running: enough for unit k's update to overlap the backward of
unit k-1, and the gradients held for the worker stay at two units'."""

IDLE_POLL_S = 0.2
"""How often an idle worker checks that the main thread still runs (see the note's lifetime)."""

T = TypeVar("T")

WorkerJob = tuple[Callable[[], None], Callable[[], None] | None]
"""(run, release): `release` runs after `run`, also when `run` failed or was skipped."""


class OptimizerWorker:
    """One thread running submitted jobs in order ([Note: the optimizer worker])."""

    def __init__(self, name: str = "tierwise-optimizer", max_queued: int = MAX_QUEUED_UPDATES) -> None:
        """`max_queued`: jobs waiting beyond the one running before `submit` blocks (0: unbounded, for
        jobs that hold no memory of their own, as the overlapped after-backward step's)."""
        self.name = name
        self._jobs: queue.Queue[WorkerJob | None] = queue.Queue(maxsize=max_queued)
        self._done = threading.Condition()
        self._unfinished = 0
        """Jobs submitted and not finished (guarded by `_done`)."""
        self._submitted = 0
        self._finished = 0
        """Jobs submitted and finished since the start (guarded by `_done`): job n (its `submit`'s
        ticket) has finished once `_finished >= n`, the queue being FIFO."""
        self._error: BaseException | None = None
        """The first job's exception; sticky (guarded by `_done`)."""
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, run: Callable[[], None], release: Callable[[], None] | None = None) -> int:
        """Queue `run` after every job submitted before it (blocks while the queue is full); returns
        its ticket for `wait`. After a job failed it is skipped, not refused: the next drain (or wait)
        reports the error."""
        if self._closed:
            if release is not None:
                release()
            raise RuntimeError("the optimizer was closed: create a new runtime.AdamW to train on")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=False)
            self._thread.start()
        with self._done:
            self._unfinished += 1
            self._submitted += 1
            ticket = self._submitted
        self._jobs.put((run, release))
        return ticket

    def drain(self) -> None:
        """Wait until every submitted job has finished; raise the first job's exception, if any."""
        self.wait(None)

    def wait(self, ticket: int | None) -> None:
        """Wait until the job of `ticket` (every job: None) and those before it finished; raise the
        first job's exception, if any (also one after `ticket`'s that already failed)."""
        with self._done:
            while not self._reached(ticket) and self._thread is not None and self._thread.is_alive():
                self._done.wait(timeout=IDLE_POLL_S)
            if not self._reached(ticket):  # the thread is gone with jobs left (interpreter exit)
                raise RuntimeError(f"the optimizer worker {self.name} stopped with {self._unfinished} updates left")
        self._raise_error()

    def wait_for(self, take: Callable[[], T | None], ticket: int, *, block: bool) -> T | None:
        """What `take()` gives once it gives something (not None), else None once the job of `ticket`
        finished (at once without `block`). `take` runs under the worker's lock; a job that makes it
        give something calls `notify`."""
        with self._done:
            while True:
                got = take()
                if got is not None or not block or self._reached(ticket):
                    return got
                if self._thread is None or not self._thread.is_alive():
                    return None  # `wait` reports the thread gone
                self._done.wait(timeout=IDLE_POLL_S)

    def notify(self) -> None:
        """Wake a `wait_for` (a job gave what it waits for)."""
        with self._done:
            self._done.notify_all()

    def finished(self, ticket: int) -> bool:
        """Whether the job of `ticket` has finished (successfully or not)."""
        with self._done:
            return self._reached(ticket)

    def _reached(self, ticket: int | None) -> bool:
        return not self._unfinished if ticket is None else self._finished >= ticket

    @property
    def idle(self) -> bool:
        with self._done:
            return not self._unfinished

    def close(self) -> None:
        """Let the queued jobs finish (or be skipped after a failure) and join the thread; idempotent,
        raises nothing (a job's error was, or will be, raised by `drain`)."""
        if self._closed:
            return
        self._closed = True
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread.is_alive():
            self._jobs.put(None)
        if thread is not threading.current_thread():
            thread.join()

    # -- the thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                if not threading.main_thread().is_alive():
                    return  # interpreter exit without close(): nothing more can be submitted
                continue
            if job is None:
                return
            self._run(*job)
            del job  # the job refers to its schedule, which must be collectable while the thread idles

    def _run(self, run: Callable[[], None], release: Callable[[], None] | None) -> None:
        try:
            with self._done:
                failed = self._error is not None
            if not failed:
                run()
        except BaseException as error:  # noqa: BLE001 - kept and raised on the main thread
            with self._done:
                if self._error is None:
                    self._error = error
        finally:
            try:
                if release is not None:
                    release()
            except BaseException as error:  # noqa: BLE001
                with self._done:
                    if self._error is None:
                        self._error = error
            with self._done:
                self._unfinished -= 1
                self._finished += 1
                self._done.notify_all()

    def _raise_error(self) -> None:
        with self._done:
            error = self._error
        if error is not None:
            raise error


class GradientStaging:
    """Pinned host buffers that the in-backward hook copies device gradients into (CUDA), reused: one
    per update the worker may hold (running or queued) and one being filled, each the size of the
    largest gradient staged so far. Charged to the host's `gradient_swap_buffers`, which the plan's
    bill holds for these too (planner.cost.memory.staged_in_backward)."""

    def __init__(self, ledger: MemoryLedger, count: int = IN_BACKWARD_STAGED_GRADIENTS) -> None:
        self.ledger = ledger
        self.count = count
        self._free: list[torch.Tensor] = []
        self._allocated = 0
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> torch.Tensor:
        """A free pinned uint8 buffer of at least `nbytes` (waits while `count` are in use)."""
        with self._cond:
            while not self._free and self._allocated >= self.count:
                self._cond.wait()
            buffer = self._free.pop() if self._free else None
            if buffer is None or buffer.numel() < nbytes:
                if buffer is not None:
                    self.ledger.sub("cpu", MemoryTerm.GRADIENT_SWAP_BUFFERS, buffer.numel())
                else:
                    self._allocated += 1
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.ledger.add("cpu", MemoryTerm.GRADIENT_SWAP_BUFFERS, nbytes)
            return buffer

    def release(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    def close(self) -> None:
        """Free the buffers (every one must have been released: the worker is closed)."""
        with self._cond:
            for buffer in self._free:
                self.ledger.sub("cpu", MemoryTerm.GRADIENT_SWAP_BUFFERS, buffer.numel())
            self._allocated -= len(self._free)
            self._free.clear()
