"""The pure-Python I/O engine: the reference the C++ engine is tested against, and the fallback
when the extension is not built.

Same API and behaviour as `runtime._aio_ext.AioHandle`: requests are split exactly as
[Note: request splitting and direct I/O] in csrc/aio_engine.h describes, each block is moved by
`os.preadv`/`os.pwrite` (which release the GIL) on a thread pool of `num_threads` workers, short
transfers are resumed, and the failure at the lowest offset is raised by `wait` as OSError(errno, message, path)
with `offset` and `nbytes`.
"""

from __future__ import annotations

import errno
import itertools
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from runtime.nvme.buffers import buffer_address
from runtime.nvme.config import DIRECT_ALIGNMENT_BYTES


@dataclass(frozen=True, slots=True)
class _Block:
    fd: int
    view: memoryview
    offset: int
    direct: bool


class _BlockError(Exception):
    def __init__(self, error_number: int, offset: int, nbytes: int) -> None:
        super().__init__(error_number, offset, nbytes)
        self.error_number = error_number
        self.offset = offset
        self.nbytes = nbytes


@dataclass(slots=True)
class _Request:
    is_read: bool
    path: str
    view: memoryview
    futures: list[Future[None]]


class PyAioHandle:
    """Reference engine with the extension's `AioHandle` interface."""

    backend = "python"

    def __init__(self, *, block_size: int, queue_depth: int, num_threads: int, backend: str = "python") -> None:
        if block_size <= 0 or block_size % DIRECT_ALIGNMENT_BYTES or block_size > 1 << 30:
            raise ValueError(f"block_size must be a positive multiple of 4096 bytes up to 1 GiB, got {block_size}")
        if not 1 <= queue_depth <= 4096:
            raise ValueError(f"queue_depth must be between 1 and 4096, got {queue_depth}")
        if not 1 <= num_threads <= 256:
            raise ValueError(f"num_threads must be between 1 and 256, got {num_threads}")
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.num_threads = num_threads
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="tierwise-pyaio")
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def submit_read(self, *, buffer: object, fd: int, offset: int, path: str, buffered_fd: int = -1) -> int:
        view = memoryview(buffer).cast("B")
        if view.readonly:
            raise TypeError("submit_read needs a writable buffer")
        return self._submit(True, view, fd, offset, path, buffered_fd)

    def submit_write(self, *, buffer: object, fd: int, offset: int, path: str, buffered_fd: int = -1) -> int:
        return self._submit(False, memoryview(buffer).cast("B"), fd, offset, path, buffered_fd)

    def wait(self, request: int) -> None:
        with self._lock:
            if request not in self._requests:
                raise ValueError(f"unknown request {request} (never submitted or already waited)")
            entry = self._requests.pop(request)
        failure: _BlockError | None = None
        for future in entry.futures:
            try:
                future.result()
            except _BlockError as error:
                if failure is None or error.offset < failure.offset:  # the failure nearest the start
                    failure = error
        if failure is not None:
            kind = "read" if entry.is_read else "write"
            exception = OSError(
                failure.error_number,
                f"{os.strerror(failure.error_number)} ({kind} of {failure.nbytes} bytes at offset {failure.offset})",
                entry.path,
            )
            exception.offset = failure.offset
            exception.nbytes = failure.nbytes
            raise exception

    def done(self, request: int) -> bool:
        with self._lock:
            if request not in self._requests:
                raise ValueError(f"unknown request {request} (never submitted or already waited)")
            return all(future.done() for future in self._requests[request].futures)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=True)

    # -- internals -------------------------------------------------------------------------------
    def _submit(self, is_read: bool, view: memoryview, fd: int, offset: int, path: str, buffered_fd: int) -> int:
        if fd < 0:
            raise ValueError(f"fd must be a valid file descriptor, got {fd}")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        blocks = self._split(view, fd, buffered_fd, offset)
        futures = [self._pool.submit(self._transfer, is_read, block) for block in blocks]
        with self._lock:
            request = next(self._ids)
            self._requests[request] = _Request(is_read, path, view, futures)
        return request

    def _split(self, view: memoryview, fd: int, buffered_fd: int, offset: int) -> list[_Block]:
        align = DIRECT_ALIGNMENT_BYTES
        end = offset + len(view)
        body_begin = -(-offset // align) * align
        body_end = end // align * align
        direct = buffered_fd >= 0 and buffered_fd != fd
        memory_aligned = (buffer_address(view) + body_begin - offset) % align == 0
        if direct and body_end > body_begin and memory_aligned:
            pieces = [
                (buffered_fd, False, offset, body_begin),
                (fd, True, body_begin, body_end),
                (buffered_fd, False, body_end, end),
            ]
        else:
            pieces = [(buffered_fd if direct else fd, False, offset, end)]
        blocks = []
        for piece_fd, piece_direct, begin, stop in pieces:
            for start in range(begin, stop, self.block_size):
                size = min(self.block_size, stop - start)
                blocks.append(_Block(piece_fd, view[start - offset : start - offset + size], start, piece_direct))
        return blocks

    @staticmethod
    def _transfer(is_read: bool, block: _Block) -> None:
        moved = 0
        total = len(block.view)
        while moved < total:
            rest = block.view[moved:]
            position = block.offset + moved
            try:
                count = os.preadv(block.fd, [rest], position) if is_read else os.pwrite(block.fd, rest, position)
            except InterruptedError:
                continue
            except OSError as error:
                raise _BlockError(error.errno or errno.EIO, position, total - moved) from None
            if count == 0:
                raise _BlockError(errno.ENODATA if is_read else errno.EIO, position, total - moved)
            moved += count
            # A direct read that stopped at an unaligned position hit the end of the file.
            if moved < total and is_read and block.direct and (block.offset + moved) % DIRECT_ALIGNMENT_BYTES:
                raise _BlockError(errno.ENODATA, block.offset + moved, total - moved)
