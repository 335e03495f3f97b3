"""Opening files for the engine: an O_DIRECT descriptor plus a buffered one on the same file.

[Note: O_DIRECT refusal]
Some filesystems refuse O_DIRECT at open time with EINVAL (ramfs, some overlay and FUSE mounts;
tmpfs did before Linux 6.6). There the file is opened buffered only, and one warning per
filesystem tells the user that the page cache is in play (measured bandwidths then describe
memory, not the drive). The engine sees `direct_fd == buffered_fd` and sends every block through
the page cache.
"""

from __future__ import annotations

import errno
import os
import threading
import warnings
from dataclasses import dataclass

_warned_devices: set[int] = set()
_warned_lock = threading.Lock()


class DirectIOFallbackWarning(RuntimeWarning):
    """The filesystem refused O_DIRECT; I/O goes through the page cache."""


@dataclass(frozen=True, slots=True)
class IOFile:
    """An open file as the engine needs it. `direct` is False where O_DIRECT was refused."""

    path: str
    direct_fd: int
    buffered_fd: int
    direct: bool

    def close(self) -> None:
        os.close(self.direct_fd)
        if self.buffered_fd != self.direct_fd:
            os.close(self.buffered_fd)

    def __enter__(self) -> IOFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_io_file(path: str | os.PathLike[str], *, create: bool = False, mode: int = 0o600) -> IOFile:
    """Open `path` read-write for the engine (creating it with `mode` if `create`)."""
    path = os.fspath(path)
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    buffered_fd = os.open(path, flags, mode)
    try:
        direct_fd = os.open(path, flags | os.O_DIRECT, mode)
    except OSError as error:
        if error.errno != errno.EINVAL:
            os.close(buffered_fd)
            raise
        _warn_once(path, buffered_fd)
        return IOFile(path=path, direct_fd=buffered_fd, buffered_fd=buffered_fd, direct=False)
    return IOFile(path=path, direct_fd=direct_fd, buffered_fd=buffered_fd, direct=True)


def _warn_once(path: str, fd: int) -> None:
    device = os.fstat(fd).st_dev
    with _warned_lock:
        if device in _warned_devices:
            return
        _warned_devices.add(device)
    warnings.warn(
        f"{os.path.dirname(path) or '.'} refuses O_DIRECT; NVMe swap falls back to buffered I/O through "
        "the page cache there (put nvme_path on a filesystem with direct I/O for drive-speed transfers)",
        DirectIOFallbackWarning,
        stacklevel=3,
    )
