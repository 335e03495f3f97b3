"""First-fit extent allocator over one preallocated swap file.

Extents are aligned to 4 KiB so every swap transfer is a direct, page-cache-free I/O. Freed
extents coalesce with their neighbours, so a steady allocate/free cycle of equal sizes reuses the
same space instead of growing the file.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from runtime.nvme.config import DIRECT_ALIGNMENT_BYTES
from runtime.nvme.errors import NvmeError


class SwapFullError(NvmeError):
    """The swap file has no free extent large enough."""


@dataclass(frozen=True, slots=True)
class Extent:
    """A byte range of a swap file: `nbytes` asked for, `reserved_bytes` (>= nbytes, 4 KiB-aligned) held."""

    offset_bytes: int
    nbytes: int
    reserved_bytes: int

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.reserved_bytes


class ExtentAllocator:
    """Hands out aligned extents of `[0, capacity_bytes)` and takes them back."""

    def __init__(self, capacity_bytes: int, *, alignment_bytes: int = DIRECT_ALIGNMENT_BYTES) -> None:
        assert capacity_bytes % alignment_bytes == 0, "capacity must be a multiple of the alignment"
        self.capacity_bytes = capacity_bytes
        self.alignment_bytes = alignment_bytes
        # Free holes as parallel sorted lists of starts and sizes (disjoint, never adjacent).
        self._hole_starts: list[int] = [0] if capacity_bytes else []
        self._hole_sizes: list[int] = [capacity_bytes] if capacity_bytes else []
        self._live: dict[int, Extent] = {}

    @property
    def used_bytes(self) -> int:
        return self.capacity_bytes - sum(self._hole_sizes)

    @property
    def num_extents(self) -> int:
        return len(self._live)

    def largest_free_bytes(self) -> int:
        return max(self._hole_sizes, default=0)

    def allocate(self, nbytes: int) -> Extent:
        if nbytes <= 0:
            raise ValueError(f"extent size must be positive, got {nbytes}")
        reserved = -(-nbytes // self.alignment_bytes) * self.alignment_bytes
        for index, size in enumerate(self._hole_sizes):
            if size >= reserved:
                start = self._hole_starts[index]
                if size == reserved:
                    del self._hole_starts[index], self._hole_sizes[index]
                else:
                    self._hole_starts[index] = start + reserved
                    self._hole_sizes[index] = size - reserved
                extent = Extent(offset_bytes=start, nbytes=nbytes, reserved_bytes=reserved)
                self._live[start] = extent
                return extent
        raise SwapFullError(
            f"swap file full: {nbytes} bytes requested, largest free extent {self.largest_free_bytes()} of "
            f"{self.capacity_bytes} bytes; raise the swap capacity the store is created with"
        )

    def free(self, extent: Extent) -> None:
        assert self._live.get(extent.offset_bytes) == extent, f"{extent} is not allocated here"
        del self._live[extent.offset_bytes]
        start, size = extent.offset_bytes, extent.reserved_bytes
        index = bisect.bisect_left(self._hole_starts, start)
        # Merge with the hole after, then with the hole before.
        if index < len(self._hole_starts) and self._hole_starts[index] == start + size:
            size += self._hole_sizes[index]
            del self._hole_starts[index], self._hole_sizes[index]
        if index > 0 and self._hole_starts[index - 1] + self._hole_sizes[index - 1] == start:
            self._hole_sizes[index - 1] += size
        else:
            self._hole_starts.insert(index, start)
            self._hole_sizes.insert(index, size)
