"""Unit constants: the one place where gigabytes and friends are defined.

The paper's tables use binary units (K = 1024, GB = 2^30, TB = 2^40, docs/method.md §2); bandwidths are
decimal (GB/s = 1e9 bytes/s), as vendors and fio report them. Names say which one is meant.
"""

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

GB = 10**9
TB = 10**12

TFLOP = 10**12

COMPUTE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes per element of parameters, activations and recompute inputs in the plan's compute precision
(the memory bill's and the kernels' one table)."""

PAGE_BYTES = 4 * KIB
"""Direct I/O's alignment: O_DIRECT needs file offsets, sizes and memory addresses aligned to the
logical block size, and 4 KiB covers every current NVMe/ext4/xfs setup (512-byte devices accept it
too). Swap extents, staging buffers and the bill's NVMe staging are whole multiples of it."""


def round_up_4kib(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of 4 KiB pages (`PAGE_BYTES`)."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES

# Decimal suffixes of parameter counts in size shorthands ("1T", "175B", "1.4B").
PARAM_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
