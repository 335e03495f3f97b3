"""The async I/O engine the NVMe tier uses: the C++ extension when built, else the Python reference.

    engine = IOEngine(EngineConfig())
    with open_io_file(path, create=True) as f:
        handle = engine.write_async(f, offset=0, buffer=buf)   # returns at once
        ...                                                     # overlap compute here
        handle.wait()                                           # raises OSError on failure
"""

from __future__ import annotations

from typing import Any

from runtime.nvme.buffers import as_byte_buffer
from runtime.nvme.config import EngineConfig
from runtime.nvme.errors import NvmeConfigError
from runtime.nvme.files import IOFile
from runtime.nvme.pyengine import PyAioHandle

try:
    from runtime import _aio_ext
except ImportError:  # extension not built: the pure-Python engine takes over
    _aio_ext = None


def extension_available() -> bool:
    return _aio_ext is not None


def io_uring_available() -> bool:
    return _aio_ext is not None and bool(_aio_ext.io_uring_available()[0])


def make_aio_handle(config: EngineConfig) -> Any:
    """The low-level handle (`_aio_ext.AioHandle` or `PyAioHandle`) that `config.backend` asks for."""
    sizes = {"block_size": config.block_size_bytes, "queue_depth": config.queue_depth, "num_threads": config.num_threads}
    if config.backend == "python" or (config.backend == "auto" and _aio_ext is None):
        return PyAioHandle(**sizes)
    if _aio_ext is None:
        raise NvmeConfigError(
            f"backend {config.backend!r} needs the C++ extension runtime._aio_ext, which is not built; "
            "run `pip install -e .` with a C++17 compiler, or use backend 'python'"
        )
    if config.backend == "io_uring":
        available, why = _aio_ext.io_uring_available()
        if not available:
            raise NvmeConfigError(f"backend 'io_uring' is unavailable on this kernel ({why}); use 'threads'")
    return _aio_ext.AioHandle(backend=config.backend, **sizes)


class Handle:
    """One submitted read or write. Keeps its buffer alive until `wait` returns."""

    __slots__ = ("_aio", "_request", "_buffer", "nbytes", "_finished")

    def __init__(self, aio: Any, request: int, buffer: object, nbytes: int) -> None:
        self._aio = aio
        self._request = request
        self._buffer = buffer
        self.nbytes = nbytes
        self._finished = False

    def done(self) -> bool:
        """Whether the transfer finished (`wait` is still needed to collect errors)."""
        return self._finished or bool(self._aio.done(self._request))

    def wait(self) -> None:
        """Block until the transfer finished (the GIL is released meanwhile); raise OSError with the
        path, offset, size and errno of the failed block nearest the start. Waiting again is a no-op."""
        if self._finished:
            return
        self._finished = True
        try:
            self._aio.wait(self._request)
        finally:
            self._buffer = None


class IOEngine:
    """Submits reads and writes of whole buffers at file offsets; see EngineConfig for the knobs."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._aio = make_aio_handle(self.config)

    @property
    def backend(self) -> str:
        return str(self._aio.backend)

    def read_async(self, file: IOFile, *, offset: int, buffer: object) -> Handle:
        """Fill `buffer` (writable, contiguous) from `file` at byte `offset`."""
        data = as_byte_buffer(buffer)
        request = self._aio.submit_read(
            buffer=data, fd=file.direct_fd, offset=offset, path=file.path, buffered_fd=file.buffered_fd
        )
        return Handle(self._aio, request, data, memoryview(data).nbytes)

    def write_async(self, file: IOFile, *, offset: int, buffer: object) -> Handle:
        """Write all of `buffer` to `file` at byte `offset`."""
        data = as_byte_buffer(buffer)
        request = self._aio.submit_write(
            buffer=data, fd=file.direct_fd, offset=offset, path=file.path, buffered_fd=file.buffered_fd
        )
        return Handle(self._aio, request, data, memoryview(data).nbytes)

    def read(self, file: IOFile, *, offset: int, buffer: object) -> None:
        self.read_async(file, offset=offset, buffer=buffer).wait()

    def write(self, file: IOFile, *, offset: int, buffer: object) -> None:
        self.write_async(file, offset=offset, buffer=buffer).wait()
