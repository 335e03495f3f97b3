"""Durable files for training checkpoints: write to a temporary name, fsync, rename, fsync the directory.

[Note: atomic checkpoint files]
A crash (SIGKILL, power loss, a full disk) at any instant must leave either the old file or the new
one, never a torn mix: data goes to `.<name>.tmp`, is fsynced, renamed over `<name>` (atomic on
POSIX filesystems) and the directory is fsynced so that the rename itself is durable. Every file
is hashed (SHA-256) while it is written, so the manifest can record its checksum without reading
it back. Torch-free: the manifest and the CLI's checks use it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from runtime.ckpt.errors import CheckpointError

HASH_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What the manifest records per file: its name in the checkpoint, size and SHA-256."""

    name: str
    size_bytes: int
    sha256: str


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class HashingWriter:
    """A binary file being written under a temporary name; hashes what passes through."""

    def __init__(self, handle: BinaryIO, name: str) -> None:
        self._handle = handle
        self._hash = hashlib.sha256()
        self.name = name
        self.size_bytes = 0

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._hash.update(view)
        self._handle.write(view)
        self.size_bytes += view.nbytes

    def digest(self) -> FileDigest:
        return FileDigest(self.name, self.size_bytes, self._hash.hexdigest())


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[HashingWriter]:
    """Yield a writer for `path`; on success the file is fsynced and renamed into place (see
    [Note: atomic checkpoint files]). On any error the temporary file is removed and an OSError
    becomes a one-line `CheckpointError` naming the file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as handle:
            writer = HashingWriter(handle, path.name)
            yield writer
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise CheckpointError(f"cannot write checkpoint file {exc.filename or path}: {exc.strerror or exc}; "
                              "free space or choose another --checkpoint-dir (earlier checkpoints are intact)") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def file_digest(path: Path) -> FileDigest:
    """Size and SHA-256 of an existing file (streamed, so memory stays small)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(HASH_CHUNK_BYTES):
            h.update(chunk)
            size += len(chunk)
    return FileDigest(path.name, size, h.hexdigest())
