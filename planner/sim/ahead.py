"""Predictions simulated ahead, in a forked worker on a second core, while this process goes on.

[Note: simulated ahead] `planner fit` simulates the plans `refine` ranks, one after another, then
the runner-ups its verdict shows (planner/output/verdict.py): independent simulations, in one
process, while a second core idles. Which plans the runner-ups can be is known before `refine`
starts (planner/search/refine.py `runners_ahead_of`), so a worker forked once the search is done
simulates those, the most distant first, while this process refines from the top. Each plan is one
task, simulated by one process only: a process takes a task by creating its claim file (O_CREAT |
O_EXCL: atomic), so the first to reach it simulates it and the other never does. The worker writes
what its simulation kept ([Note: shared samples] in samples.py: the samples, or the whole
simulation) to a file per task and names the task on a pipe. `fast.predict` calls `wait_for(plan)`
before it simulates: a plan the worker took is waited for and its kept simulations adopted, and the
prediction is then made here from those samples with the same arithmetic: the same numbers, bit for
bit, as in one process. A task this process takes first is simulated here as before; if the worker
dies, its tasks are simulated here too (`_Worker.result` reads None).

A worker is forked only where it is safe and can help: `os.fork` exists, this process may run on
two cores or more (`os.sched_getaffinity`, Linux's; one process where the platform gives no
affinity) of which one is idle now (`can_fork`), it runs one thread (a fork copies only the calling thread: a lock another thread held
would stay held in the child; the dashboard runs threads, and simulates in one process), and a
temporary directory, a pipe and a process can be had. The worker exits with `os._exit`, running
none of this process's exit handlers and flushing none of its buffers.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from planner.sim.network import collector_paused
from planner.sim.samples import KeptSimulations, keep, kept_now, kept_since, sample_key
from planner.specs.plan import Plan


def usable_cores() -> int:
    """Cores this process may run on: its affinity mask (Linux); 1 where the platform does not say."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def other_runnable_tasks() -> int:
    """Tasks other than this process that run or wait for a core now: the kernel's count of runnable
    tasks (Linux's /proc/loadavg, which counts this process) less one; 0 where it cannot be read."""
    try:
        runnable = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    return max(0, runnable - 1)


def can_fork() -> bool:
    """Whether a worker can run beside this process and gain: fork exists, one thread runs, and a
    usable core is idle now (two usable cores, no other task runnable on a two-core machine). On a
    busy machine the two processes share the CPU this one alone would get where the scheduler shares
    it among process groups (Linux's autogroup): a worker gains nothing there and adds its costs
    (docs/notes/2026-11-28-fit-path-speed.md)."""
    return (hasattr(os, "fork") and threading.active_count() == 1
            and usable_cores() - other_runnable_tasks() >= 2)


@dataclass(eq=False)
class _Worker:
    """The forked worker as this process sees it: its tasks (plan key -> index), the tasks whose
    files it announced, and the pipe it announces them on."""

    pid: int
    directory: Path
    announcements: int
    """The read end of the pipe: one line, `index\\n`, per finished task; end of file when it exits."""
    tasks: dict[str, int]
    announced: set[int] = field(default_factory=set)
    settled: set[int] = field(default_factory=set)
    """Tasks this process has taken, or adopted from the worker: asked about again, they are not waited for."""
    pending: bytes = b""
    exited: bool = False

    def take(self, index: int) -> bool:
        """Claim task `index` for this process; False where the worker claimed it first."""
        return _claim(self.directory, index)

    def result(self, index: int) -> KeptSimulations | None:
        """The worker's kept simulations of task `index`, waiting for them; None where the worker
        failed at it or is gone (this process then simulates it)."""
        while index not in self.announced and not self.exited:
            chunk = os.read(self.announcements, 4096)
            if not chunk:
                self.exited = True
                break
            lines = (self.pending + chunk).split(b"\n")
            self.pending = lines.pop()
            self.announced.update(int(line) for line in lines)
        if index not in self.announced:
            return None
        with collector_paused(), open(self.directory / f"{index}.pickle", "rb") as file:
            return pickle.load(file)

    def stop(self) -> None:
        """End the worker (it may still be simulating a task nobody needs), reap it, remove its files."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        os.close(self.announcements)
        shutil.rmtree(self.directory, ignore_errors=True)


_worker: _Worker | None = None
_stop_registered = False


def _claim(directory: Path, index: int) -> bool:
    try:
        os.close(os.open(directory / f"{index}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def start(plans: list[Plan], predict: Callable[[Plan], object]) -> bool:
    """Fork a worker that runs `predict` on each of `plans` it claims first, in the order given;
    False (nothing started) where `can_fork` says no. A worker still running from before (its tasks
    were for an earlier request) is stopped first."""
    global _worker, _stop_registered
    stop()
    if not plans or not can_fork():
        return False
    directory = read_end = write_end = None
    try:
        directory = Path(tempfile.mkdtemp(prefix="tierwise-ahead-"))
        read_end, write_end = os.pipe()
        pid = os.fork()
    except OSError:  # no temporary directory, no pipe or no process to be had: simulate in this one
        for end in (read_end, write_end):
            if end is not None:
                os.close(end)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)
        return False
    if pid == 0:  # the worker
        os.close(read_end)
        _work(plans, predict, directory, write_end)  # never returns
    os.close(write_end)
    _worker = _Worker(pid, directory, read_end, {sample_key(plan): i for i, plan in enumerate(plans)})
    if not _stop_registered:
        atexit.register(stop)
        _stop_registered = True
    return True


def _work(plans: list[Plan], predict: Callable[[Plan], object], directory: Path, announce: int) -> None:
    """The worker's life: each plan it claims simulated, its kept simulations written, then `os._exit`."""
    status = 0
    try:
        # It prints nothing; holding the caller's terminal or pipes would keep a reader of this
        # process's output waiting should this process be killed while the worker runs.
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        for index, plan in enumerate(plans):
            if not _claim(directory, index):
                continue
            before = kept_now()
            try:
                predict(plan)
                kept: KeptSimulations | None = kept_since(before)
            except Exception:  # noqa: BLE001 - the parent simulates it and meets the error itself
                kept = None
            path = directory / f"{index}.pickle"
            with open(path.with_suffix(".part"), "wb") as file:
                pickle.dump(kept, file, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(path.with_suffix(".part"), path)
            os.write(announce, f"{index}\n".encode())
    except BaseException:  # noqa: BLE001 - e.g. interrupted with the parent: exit all the same
        status = 1
    finally:
        os._exit(status)


def wait_for(plan: Plan) -> None:
    """Before simulating `plan` here: where the worker has it as a task, take the task, or wait for
    the worker's simulations of it and keep them ([Note: simulated ahead]). Nothing otherwise."""
    worker = _worker
    if worker is None:
        return
    index = worker.tasks.get(sample_key(plan))
    if index is None or index in worker.settled:
        return  # not a task, or simulated here or adopted before (kept, unless pushed out since)
    worker.settled.add(index)
    if not worker.take(index):
        kept = worker.result(index)
        if kept is not None:
            keep(kept)
    if len(worker.settled) == len(worker.tasks):
        stop()  # every task is done or being done here: the worker has exited, or is exiting


def stop() -> None:
    """End the worker, if one runs (at exit, or once its tasks are no longer needed)."""
    global _worker
    worker, _worker = _worker, None
    if worker is not None:
        worker.stop()
