"""Settings of the async I/O engine (block size, queue depth, threads, backend)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from planner.specs.units import MIB, PAGE_BYTES
from runtime.nvme.errors import NvmeConfigError

Backend = Literal["auto", "io_uring", "threads", "python"]
BACKENDS: tuple[str, ...] = ("auto", "io_uring", "threads", "python")

DIRECT_ALIGNMENT_BYTES = PAGE_BYTES
"""O_DIRECT's alignment of file offsets, sizes and memory addresses (planner.specs.units.PAGE_BYTES)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class EngineConfig:
    """How the engine moves bytes. The defaults are the fastest settings `benchmarks/aio_vs_fio.py
    --sweep` measured (benchmarks/RESULTS.md); the engine matches or beats fio at them."""

    block_size_bytes: int = 1 * MIB
    """Large requests are cut into blocks of this size, each one I/O to the kernel."""
    queue_depth: int = 128
    """Blocks kept in flight at once by the io_uring backend. Deep, because a drive (a virtual one
    above all) moves bytes at (bytes in flight) / latency until it saturates; 128 is where a virtio
    disk stopped getting faster (docs/notes/2026-11-22-nvme-engine-buffers.md). Costs no memory:
    requests fill their callers' buffers. The price is order: requests submitted together are served
    together, so the first of several lands later than at a shallow depth (docs/nvme.md)."""
    num_threads: int = 4
    """Workers of the thread-pool backends (the C++ one and the pure-Python reference)."""
    backend: Backend = "auto"
    """`auto`: the C++ extension with io_uring, else its thread pool, else the pure-Python engine.
    `io_uring` / `threads`: that C++ backend (error if unavailable). `python`: the reference engine."""

    def __post_init__(self) -> None:
        size = self.block_size_bytes
        if not isinstance(size, int) or size <= 0 or size % DIRECT_ALIGNMENT_BYTES or size > 1024 * MIB:
            raise NvmeConfigError(
                f"block_size_bytes must be a positive multiple of {DIRECT_ALIGNMENT_BYTES} up to 1 GiB, got {size!r}"
            )
        if not isinstance(self.queue_depth, int) or not 1 <= self.queue_depth <= 4096:
            raise NvmeConfigError(f"queue_depth must be an integer from 1 to 4096, got {self.queue_depth!r}")
        if not isinstance(self.num_threads, int) or not 1 <= self.num_threads <= 256:
            raise NvmeConfigError(f"num_threads must be an integer from 1 to 256, got {self.num_threads!r}")
        if self.backend not in BACKENDS:
            raise NvmeConfigError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
