"""glibc malloc settings for a training rank: freed host buffers stay mapped for the next step.

[Note: glibc's mmap threshold]
glibc serves an allocation of at least M_MMAP_THRESHOLD bytes (128 KiB at start) with its own mmap
and gives it back with munmap when freed, so the next allocation of that size page-faults every
page in again. Its dynamic threshold rises to the size of each mmapped chunk freed, and the trim
threshold to twice that, one size at a time: a rank whose steps allocate and free buffers of many
sizes (gathered parameters, activations, gradient shards, optimizer chunks) keeps paying those page
faults for several steps. With the thresholds fixed from the start (32 MiB, glibc's largest, and
a 256 MiB trim threshold) the steps reach their steady time by the second or third step at the
same peak RSS (docs/notes/2026-11-22-runtime-source-measurements.md), so a profile that leaves out
two warm-up steps measures the steady state that the simulator predicts instead of the
allocator's warm-up.

Fixing the thresholds also turns off their dynamic adjustment (mallopt(3)). Buffers larger than
32 MiB still get their own mapping; their page faults are the same every step, so the simulator's
memory-bandwidth term covers them."""

from __future__ import annotations

import ctypes
import os

from planner.specs.units import MIB

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt(3) parameter numbers (glibc's malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 * MIB
"""glibc's largest allowed M_MMAP_THRESHOLD on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX = 4 MiB * sizeof(long))."""

TRIM_THRESHOLD_BYTES = 256 * MIB
"""Free memory at the top of the heap kept mapped, rather than returned with each free: above a
step's largest transient working set in the reference runs, so the next step reuses it without
faulting it in."""

ENV_MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
ENV_TRIM_THRESHOLD = "MALLOC_TRIM_THRESHOLD_"
"""glibc's own tunables: a user who sets them keeps their values."""


def keep_freed_memory_mapped() -> bool:
    """Fix glibc's mmap and trim thresholds for this process ([Note: glibc's mmap threshold]).

    Returns whether both were set: False off glibc (musl, macOS) or where the user set either
    threshold through glibc's environment variables."""
    if ENV_MMAP_THRESHOLD in os.environ or ENV_TRIM_THRESHOLD in os.environ:
        return False
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; a glibc that rejects a value leaves its default in place.
    mmap_ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    trim_ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    return mmap_ok and trim_ok


def _glibc() -> ctypes.CDLL | None:
    """The C library this process runs on, if it is glibc (other C libraries have other mallopt
    parameters, or none)."""
    if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
        return None
    return ctypes.CDLL(None)  # the process's own symbols: the libc already loaded, no search
