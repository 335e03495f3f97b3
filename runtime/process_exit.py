"""How a rank's process ends once its run is over: exit handlers, then `os._exit`.

[Note: a rank leaves with os._exit]
torch's gloo backend runs collectives on its own threads (`pt_gloo_runloop`), and such a thread
drops its reference to a finished collective a moment after the caller's `wait()` returned. When
that reference is the last one to a tensor with a Python object (a barrier's tensor is one), the
drop takes the GIL. A process group's threads stop only when the group object is freed, and torch
keeps the default group alive for the life of the process as soon as `torch.distributed.nn` is
imported (ten of its functions take `group=group.WORLD` as a default argument; building the first
`torch.optim` optimizer imports it), so they are still running when the interpreter finalizes. A
thread that asks for the GIL then is ended by CPython with a forced unwind, which passes through
the collective's noexcept destructor: `terminate called without an active exception`, SIGABRT,
after the run itself had finished and written everything. The window is the few microseconds
between the collective's completion and the thread's drop, so it shows on loaded hosts: 3 aborts
in 74 runs of the two-rank parity test (two copies running at once on two cores), the core dump
showing `~AsyncBarrierWork` on a gloo thread in `take_gil` during `Py_FinalizeEx`; none in 60
runs the same way since ranks leave like this.

A finished rank (collectives done, process groups destroyed, files written) therefore runs the
interpreter's exit handlers itself (`atexit`: the NVMe swap directory's removal, `weakref.finalize`
callbacks, logging), flushes its streams and leaves with `os._exit`, which does not finalize the
interpreter and so asks no thread to unwind. Nothing is lost: what finalization would do after the
exit handlers is free memory the kernel reclaims anyway. Only a rank of a run with process groups
leaves this way: one process alone has no gloo threads and exits normally, so a tool that writes
after the program returns (`python -m cProfile -m runtime.launch ...`) still gets to.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def leave(code: int) -> NoReturn:
    """End this process with exit status `code` ([Note: a rank leaves with os._exit])."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
