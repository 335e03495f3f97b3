"""The NVMe tier: async direct I/O engine, aligned buffer pool and per-rank swap stores.

Importing this package needs numpy but not torch (torch tensors are accepted where buffers are).
`runtime.transfer.nvme_store` (`NvmeSpace`, `NvmeStore`: the tier behind the runtime's `ShardStore`
interface) needs torch and is imported on its own, not from here. See docs/nvme.md.
"""

from runtime.nvme.buffers import AlignedBuffer, BufferPool, BufferRecycler, PinHook
from runtime.nvme.config import EngineConfig
from runtime.nvme.directory import SwapDirectory, find_stale_swap_dirs, remove_stale_swap_dirs
from runtime.nvme.engine import Handle, IOEngine, extension_available, io_uring_available
from runtime.nvme.errors import NvmeConfigError, NvmeError, SwapPathError
from runtime.nvme.extents import Extent, ExtentAllocator, SwapFullError
from runtime.nvme.files import DirectIOFallbackWarning, IOFile, open_io_file
from runtime.nvme.swap_store import SwapStore

__all__ = [
    "AlignedBuffer",
    "BufferPool",
    "BufferRecycler",
    "DirectIOFallbackWarning",
    "EngineConfig",
    "Extent",
    "ExtentAllocator",
    "Handle",
    "IOEngine",
    "IOFile",
    "NvmeConfigError",
    "NvmeError",
    "PinHook",
    "SwapDirectory",
    "SwapFullError",
    "SwapPathError",
    "SwapStore",
    "extension_available",
    "find_stale_swap_dirs",
    "io_uring_available",
    "open_io_file",
    "remove_stale_swap_dirs",
]
