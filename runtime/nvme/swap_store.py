"""One tier's swap file: preallocated once, carved into extents, read and written asynchronously.

    with SwapDirectory(plan.nvme_path, rank=rank, needed_bytes=total) as directory:
        store = SwapStore(directory, "optimizer_states", capacity_bytes=nbytes)
        extent = store.allocate(shard_bytes)
        store.write_async(extent, pool_buffer).wait()
        store.read_async(extent, pool_buffer).wait()
        store.free(extent)

Transfers of pool buffers (page-aligned, whole 4 KiB multiples) are direct I/O end to end; other
buffers work too (the engine routes unaligned bytes through the page cache, see
[Note: request splitting and direct I/O] in csrc/aio_engine.h).
"""

from __future__ import annotations

from planner.specs.units import round_up_4kib
from runtime.nvme.buffers import as_byte_buffer
from runtime.nvme.directory import SwapDirectory
from runtime.nvme.engine import Handle, IOEngine
from runtime.nvme.extents import Extent, ExtentAllocator
from runtime.nvme.files import IOFile, open_io_file


class SwapStore:
    """The swap file of tier `name` in `directory`, with its extent allocator."""

    def __init__(
        self, directory: SwapDirectory, name: str, *, capacity_bytes: int, engine: IOEngine | None = None
    ) -> None:
        capacity = round_up_4kib(capacity_bytes)
        self.name = name
        self.path = directory.create_file(name, capacity)
        self.file: IOFile = open_io_file(self.path)
        self.engine = engine or IOEngine()
        self.allocator = ExtentAllocator(capacity)

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.capacity_bytes

    @property
    def direct(self) -> bool:
        """False where the filesystem refused O_DIRECT (see [Note: O_DIRECT refusal])."""
        return self.file.direct

    def allocate(self, nbytes: int) -> Extent:
        return self.allocator.allocate(nbytes)

    def free(self, extent: Extent) -> None:
        self.allocator.free(extent)

    def write_async(self, extent: Extent, buffer: object) -> Handle:
        """Write `buffer` (at most `extent.reserved_bytes`) to the start of `extent`."""
        data = as_byte_buffer(buffer)
        self._check_fits(extent, memoryview(data).nbytes)
        return self.engine.write_async(self.file, offset=extent.offset_bytes, buffer=data)

    def read_async(self, extent: Extent, buffer: object) -> Handle:
        """Fill `buffer` (at most `extent.reserved_bytes`) from the start of `extent`."""
        data = as_byte_buffer(buffer)
        self._check_fits(extent, memoryview(data).nbytes)
        return self.engine.read_async(self.file, offset=extent.offset_bytes, buffer=data)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> SwapStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _check_fits(extent: Extent, nbytes: int) -> None:
        if nbytes > extent.reserved_bytes:
            raise ValueError(f"buffer of {nbytes} bytes does not fit extent {extent}")
