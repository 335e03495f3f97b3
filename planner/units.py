"""Unit constants: the one place where gigabytes and friends are defined.

The paper's tables use binary units (K = 1024, GB = 2^30, TB = 2^40, METHOD.md §2); bandwidths are
decimal (GB/s = 1e9 bytes/s), as vendors and fio report them. Names say which one is meant.
"""

KIB = 1024
MIB = 1024**2
GIB = 1024**3
TIB = 1024**4

GB = 10**9
TB = 10**12

TFLOP = 10**12

# Decimal suffixes of parameter counts in size shorthands ("1T", "175B", "1.4B").
PARAM_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
