"""Fault injection at named points of the runtime, for the reliability tests (docs/reliability.md).

    TIERWISE_FAULT="checkpoint.rank_file@4:1,train.step@7"   kill rank 1 while it writes its step-4
                                                            checkpoint file, and any rank mid-step 7
    TIERWISE_FAULT="train.step@3=fill:/mnt/nvme"             at step 3, fill the filesystem of /mnt/nvme
    TIERWISE_FAULT_ONCE=DIR                                  fire each fault once (a marker file in DIR
                                                            remembers it), so a restarted run gets past

A fault is a real SIGKILL of the process (no cleanup handlers, no flushing), the harshest thing
that can happen to a rank, or (`=fill:DIR`) a real full disk: a file in DIR written until the
filesystem refuses more, as another process filling the drive would. Points: `train.step` (after backward, before the optimizer step),
`checkpoint.rank_file` (a rank's data file half written), `checkpoint.manifest` (every rank's files
written, the manifest not yet). With the variable unset a point costs one environment lookup.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

POINTS = ("train.step", "checkpoint.rank_file", "checkpoint.manifest")


def fault_point(point: str, *, step: int, rank: int) -> None:
    spec = os.environ.get("TIERWISE_FAULT")
    if not spec:
        return
    assert point in POINTS, point
    for item in spec.split(","):
        item, _, action = item.partition("=")
        name, _, where = item.strip().partition("@")
        at_step, _, at_rank = where.partition(":")
        if name != point or int(at_step) != step or (at_rank and int(at_rank) != rank):
            continue
        once = os.environ.get("TIERWISE_FAULT_ONCE")
        if once:
            marker = Path(once, f"{point}@{step}:{rank}")
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            except FileExistsError:
                continue  # fired before this restart
        if action.startswith("fill:"):
            fill(Path(action[len("fill:"):]))
            continue
        os.kill(os.getpid(), signal.SIGKILL)


def fill(directory: Path) -> int:
    """Write zeros into `directory/tierwise-fill-PID` until the filesystem is full; returns the bytes."""
    chunk = bytes(1 << 16)
    written = 0
    with open(directory / f"tierwise-fill-{os.getpid()}", "wb", buffering=0) as handle:
        try:
            while True:
                written += handle.write(chunk)
        except OSError:  # ENOSPC (or EFBIG): full
            pass
    return written
