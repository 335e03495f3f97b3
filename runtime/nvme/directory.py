"""The per-rank private swap directory under the plan's `nvme_path`.

Layout: `<nvme_path>/tierwise-swap-r<rank>-<random>/` (mode 0700) holding `owner.json` (pid, rank,
host, creation time) and one preallocated 0600 file per tier (`params.swap`,
`optimizer_states.swap`, ...). The directory is removed on `close()`, on leaving its `with` block,
and at interpreter exit; a run that crashed leaves it behind, and `find_stale_swap_dirs` recognises
it by an owner pid that no longer runs on this host.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import os
import re
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from runtime.nvme.errors import SwapPathError

GIB = 1024**3
DIR_PREFIX = "tierwise-swap-"
OWNER_FILE = "owner.json"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True, slots=True)
class StaleSwapDir:
    """A swap directory whose owning process is gone."""

    path: Path
    pid: int
    rank: int
    nbytes: int


def check_swap_path(nvme_path: str | os.PathLike[str]) -> Path:
    """The resolved `nvme_path`, or a one-line SwapPathError saying why it cannot hold swap files."""
    text = os.fspath(nvme_path)
    if not text or "\0" in text:
        raise SwapPathError(f"nvme_path {text!r} is not a usable path; give an existing directory on an NVMe drive")
    path = Path(text).expanduser().resolve()
    if not path.exists():
        raise SwapPathError(f"nvme_path {shown(path)} does not exist; create it or choose another directory")
    if not path.is_dir():
        raise SwapPathError(f"nvme_path {shown(path)} is not a directory; give a directory on an NVMe drive")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SwapPathError(f"nvme_path {shown(path)} is not writable by this user; fix its permissions or choose another")
    return path


def shown(path: Path) -> str:
    """`path` as an error message prints it: as is, or quoted with escapes where it holds a newline or
    another unprintable character, so the message stays one line."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def human_bytes(nbytes: float) -> str:
    for unit, scale in (("TiB", 1024**4), ("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{int(nbytes)} bytes"


def preflight(path: Path, needed_bytes: int) -> None:
    """Raise before any training starts when `path` lacks `needed_bytes` of free space.

    Filesystems without a size (ramfs reports zero blocks) cannot be checked and pass."""
    stat = os.statvfs(path)
    available = stat.f_bavail * stat.f_frsize
    if needed_bytes <= available or stat.f_blocks == 0:
        return
    stale = find_stale_swap_dirs(path)
    hint = ""
    if stale:
        held = sum(entry.nbytes for entry in stale)
        hint = f" ({len(stale)} stale swap dir(s) from crashed runs hold {human_bytes(held)}: remove_stale_swap_dirs)"
    raise SwapPathError(
        f"nvme_path {shown(path)} has {human_bytes(available)} free but the swap files need {human_bytes(needed_bytes)}; "
        f"free space there or choose another nvme_path{hint}"
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def _tree_bytes(path: Path) -> int:
    total = 0
    for entry in path.iterdir():
        with contextlib.suppress(OSError):
            total += entry.stat().st_blocks * 512
    return total


def find_stale_swap_dirs(nvme_path: str | os.PathLike[str]) -> list[StaleSwapDir]:
    """Swap directories under `nvme_path` left by processes of this host that no longer run."""
    stale = []
    host = socket.gethostname()
    for entry in sorted(Path(nvme_path).glob(DIR_PREFIX + "*")):
        try:
            owner = json.loads((entry / OWNER_FILE).read_text())
            pid, rank = int(owner["pid"]), int(owner["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not ours, or being created right now
        if owner.get("host") == host and not _pid_alive(pid):
            stale.append(StaleSwapDir(path=entry, pid=pid, rank=rank, nbytes=_tree_bytes(entry)))
    return stale


def remove_stale_swap_dirs(nvme_path: str | os.PathLike[str]) -> list[Path]:
    removed = []
    for entry in find_stale_swap_dirs(nvme_path):
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


class SwapDirectory:
    """This rank's private directory of swap files; see the module docstring."""

    def __init__(self, nvme_path: str | os.PathLike[str], *, rank: int = 0, needed_bytes: int = 0) -> None:
        root = check_swap_path(nvme_path)
        preflight(root, needed_bytes)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}r{rank}-", dir=root))  # mode 0700
        except PermissionError as error:
            raise SwapPathError(f"nvme_path {root} is not writable ({error.strerror}); choose another") from None
        self.rank = rank
        owner = {"pid": os.getpid(), "rank": rank, "host": socket.gethostname(), "created_unix_s": time.time()}
        self._write_private(OWNER_FILE, json.dumps(owner).encode())
        self._closed = False
        atexit.register(self.close)

    def file_path(self, name: str) -> Path:
        """Path of the swap file for tier `name` (a plain file name: no separators, no `..`)."""
        if not _NAME.fullmatch(name) or name == OWNER_FILE:
            raise SwapPathError(f"swap file name {name!r} must be letters, digits, '_', '-' or '.' (not a path)")
        return self.path / f"{name}.swap"

    def create_file(self, name: str, capacity_bytes: int) -> Path:
        """Create and preallocate the 0600 swap file for tier `name`."""
        path = self.file_path(name)
        preflight(self.path, capacity_bytes)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            if capacity_bytes:
                os.posix_fallocate(fd, 0, capacity_bytes)
        except OSError as error:
            os.close(fd)
            path.unlink()
            if error.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise SwapPathError(
                    f"cannot preallocate {human_bytes(capacity_bytes)} for {shown(path)} ({error.strerror}); "
                    "free space under nvme_path or choose another"
                ) from None
            raise
        os.close(fd)
        return path

    def close(self) -> None:
        """Remove the directory and every swap file in it (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        # owner.json goes last: a removal cut short (SIGTERM during atexit) leaves a directory that
        # find_stale_swap_dirs still recognises, so the next run reclaims its space.
        for entry in self.path.iterdir() if self.path.is_dir() else ():
            if entry.name != OWNER_FILE:
                with contextlib.suppress(OSError):
                    entry.unlink()
        shutil.rmtree(self.path, ignore_errors=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> SwapDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_private(self, name: str, data: bytes) -> None:
        fd = os.open(self.path / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
