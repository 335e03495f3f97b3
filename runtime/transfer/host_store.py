"""Shards in host memory (`cpu` placement): `HostStore`, which crosses to and from the device as its
`Crossing` says (runtime/transfer/crossings.py: through the staging pool, or from pinned shards, or
landing in pinned buffers; nothing on the CPU machine).
"""

from __future__ import annotations

from typing import Any

import torch

from runtime.transfer.crossings import Crossing, SameMemory, Staged
from runtime.transfer.stores import Pending, ShardKey, ShardStore


class HostStore(ShardStore):
    """Shards in host memory; `crossing` is how they reach the device and come back (by default: the
    staging pool with a device of its own, nothing to cross on the CPU machine)."""

    tier = "cpu"

    def __init__(self, *, crossing: Crossing | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.crossing = crossing if crossing is not None else (
            Staged(self.copier) if self.copier.separate_memory else SameMemory(self.copier))

    def create(self, key: ShardKey, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
        if self.crossing.charges_shards:
            return super().create(key, numel, dtype)
        assert key not in self._shards, f"shard {key} already exists in HostStore"
        self._shards[key] = shard = self._allocate(numel, dtype)  # its crossing's arena is charged whole
        return shard

    def free(self, key: ShardKey) -> None:
        if self.crossing.charges_shards:
            super().free(key)
        else:
            self._shards.pop(key)

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.crossing.allocate(numel, dtype)

    def resident(self, key: ShardKey) -> torch.Tensor:
        self.crossing.landed(key)
        return self._shards[key]

    def read_into(self, key: ShardKey, out: torch.Tensor, offset: int = 0) -> Pending:
        self.crossing.landed(key)
        return super().read_into(key, out, offset)

    def read(self, key: ShardKey, dtype: torch.dtype) -> Pending:
        return self.crossing.to_device(key, self._shards[key], dtype)

    def accumulate(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        return self.crossing.from_device(key, self._shards[key], offset, src, add=True)

    def write(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        return self.crossing.from_device(key, self._shards[key], offset, src, add=False)

    def write_host(self, key: ShardKey, src: torch.Tensor, offset: int = 0) -> Pending:
        # A host source (an update's result, also on the optimizer worker) needs no copy stream: one
        # would make the worker wait for the compute queued on the device.
        self.crossing.landed(key)
        shard = self._shards[key]
        shard[offset : offset + src.numel()].copy_(src.reshape(-1))
        return Pending(shard)

    def close(self) -> None:
        self.crossing.close()
