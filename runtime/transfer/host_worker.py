"""The rank's host workers: a thread that runs submitted jobs in order, off the threads that issue
device work.

[Note: the host worker]
What the host must do after the device (or the network, or the drive) delivered bytes, the runtime's
hooks hand to a `HostWorker` instead of waiting for them: the autograd thread goes on issuing the
backward while the worker waits and does the host work ([Note: the transfer path as a GPU program]
in runtime/transfer/streams.py). Each rank has one for transfers (`CopyEngine.worker`: gradients
landing in host shards, reduce-scatters finished), and an in-backward optimizer has one for its
updates (runtime/optim/optimizer_worker.py).
- Order: one thread and a FIFO queue, so jobs run in the order they were submitted: the same
  kernels on the same bytes in the same order as running them in place, bitwise the same results.
- Failure: an exception in a job is kept, the jobs after it are skipped (their `release` still
  runs), and the next `drain` or `wait` raises it on the caller's thread; the worker stays failed
  (every later wait raises the same error), never a hang.
- Bounds: the queue is unbounded unless `max_queued` says otherwise; callers that hold memory per
  job bound themselves, and a wait for a job to come free is noted as back-pressure.
- Lifetime: the thread is started by the first job, is not a daemon, and is joined by `close`; one
  never closed leaves at interpreter exit, when it finds the main thread gone, before the
  interpreter tears down what a job would use.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from runtime.transfer.streams import DeviceEvent, Streams
from runtime.transfer.trace import HostWait, Role, WaitKind, current_hook, note, thread_name

IDLE_POLL_S = 0.2
"""How often an idle worker checks that the main thread still runs (see the note's lifetime)."""

T = TypeVar("T")

WorkerJob = tuple[Callable[[], None], Callable[[], None] | None]
"""(run, release): `release` runs after `run`, also when `run` failed or was skipped."""


class HostWorker:
    """One thread running submitted jobs in order ([Note: the host worker])."""

    def __init__(self, name: str, max_queued: int = 0) -> None:
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
            raise RuntimeError(f"the {self.name} thread was closed: create a new runtime.AdamW (or shard the model "
                               "again) to train on")
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=False)
            self._thread.start()
        with self._done:
            self._unfinished += 1
            self._submitted += 1
            ticket = self._submitted
        if self._jobs.maxsize and self._jobs.full():
            note(HostWait(WaitKind.BACKPRESSURE, f"a place in the {self.name} queue", current_hook(), thread_name()))
        self._jobs.put((run, release))
        return ticket

    def drain(self) -> None:
        """Wait until every submitted job has finished; raise the first job's exception, if any."""
        self.wait(None)



    def wait(self, ticket: int | None, *, kind: WaitKind | None = WaitKind.WORKER) -> None:
        """Wait until the job of `ticket` (every job: None) and those before it finished; raise the
        first job's exception, if any (also one after `ticket`'s that already failed). A wait that
        blocks is noted as `kind` (runtime/transfer/trace.py)."""
        with self._done:
            if not self._reached(ticket) and kind is not None:
                note(HostWait(kind, f"the {self.name} thread", current_hook(), thread_name()))
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


class TransferWorker(HostWorker):
    """The rank's transfer worker ([Note: the host worker]): its jobs launch their device work on the
    device-to-host stream (a reduce-scatter's division, its gradient's copy off the device), and a
    drain orders the caller's stream after that work."""

    def __init__(self, streams: Streams, name: str) -> None:
        super().__init__(name)
        self.streams = streams
        self.device_done: DeviceEvent | None = None
        """After the device work of the last job that ran (read by other threads' streams)."""

    def submit(self, run: Callable[[], None], release: Callable[[], None] | None = None) -> int:
        return super().submit(partial(self._on_d2h, run), release)

    def _on_d2h(self, run: Callable[[], None]) -> None:
        with self.streams.on(Role.D2H):
            run()
        self.device_done = self.streams.record(Role.D2H)

    def drain(self) -> None:
        """Wait for every job; the calling thread's stream then follows their device work."""
        super().drain()
        self.streams.wait(self.streams.current_role(), self.device_done)


def drain_together(workers: list[HostWorker], why: str) -> None:
    """Drain `workers` in order, noted as one host wait (for `why`) if any has a job left; the
    calling thread's stream then follows the device work of the transfer workers among them."""
    if not all(w.idle for w in workers):
        note(HostWait(WaitKind.WORKER, why, current_hook(), thread_name()))
    for worker in workers:
        worker.wait(None, kind=None)
    for worker in workers:
        if isinstance(worker, TransferWorker):
            worker.streams.wait(worker.streams.current_role(), worker.device_done)
