"""`target += src` where a 16-bit gradient meets an fp32 shard in host memory.

[Note: a mixed-precision add on the CPU]
Gradients are added into fp32 shards on the host wherever a 16-bit backward meets host-memory
gradient shards more than once a step (gradient accumulation, tied weights: every gradient of a
parameter after its first, `StoredGradients`, [Note: lazy gradient zeroing] in
runtime/units/gradients.py) and wherever a gradient lands off a device into its fp32 shard
(runtime/transfer/crossings.py). torch's CPU `fp32.add_(bf16)` first casts the whole bf16 operand
into a new fp32 temporary. From 8 Mi elements that temporary is 32 MiB, the rank's mmap threshold
([Note: glibc's mmap threshold] in runtime/host_malloc.py), so each add maps fresh pages and faults
every one of them in, as slow as the cast alone into a new tensor. A Linear of 2048 x 8192 has
16 Mi weights; a GPT's embedding tens of Mi. So a large add goes through a reused fp32 scratch of
CHUNK_ELEMENTS: cast a chunk into it, add it. Smaller chunks pay torch's cost per call, larger ones
leave the cache. An add of at most CHUNK_ELEMENTS stays torch's own (its temporary is below the
threshold). Same result to the bit: casting bf16 or fp16 to fp32 is exact and the add is in fp32
either way. Measurements: benchmarks/bench_host_add.py, benchmarks/RESULTS.md,
docs/notes/2026-11-28-runtime-source-notes-moved.md.

The scratch is a transient of CHUNK_ELEMENTS fp32 elements (4 MiB) per call, below the mmap
threshold, so it is reused heap memory like any other temporary of the host's torch ops, and 8x
smaller than the temporary torch's own add would take from 8 Mi elements on.
"""

from __future__ import annotations

import torch

CHUNK_ELEMENTS = 1 << 20
"""Elements cast and added at a time: 4 MiB of fp32 scratch, which stays in the last-level cache."""


def add_into(target: torch.Tensor, src: torch.Tensor) -> None:
    """`target.add_(src)` for flat tensors of equal length; chunked through an fp32 scratch where a
    lower-precision `src` meets an fp32 `target` in host memory ([Note: a mixed-precision add on
    the CPU]), a plain `add_` everywhere else (same dtypes, a small add, or on a GPU, whose kernels
    cast as they read)."""
    if src.device != target.device:
        src = src.to(target.device)
    numel = src.numel()
    if (target.device.type != "cpu" or src.dtype == target.dtype or target.dtype != torch.float32
            or numel <= CHUNK_ELEMENTS):
        target.add_(src)
        return
    scratch = torch.empty(CHUNK_ELEMENTS, dtype=torch.float32)
    for start in range(0, numel, CHUNK_ELEMENTS):
        end = min(numel, start + CHUNK_ELEMENTS)
        part = scratch[: end - start]
        part.copy_(src[start:end])
        target[start:end].add_(part)
