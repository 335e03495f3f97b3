"""Host shards pinned once: one page-locked arena per store, carved into the shards it holds.

[Note: pinned host shards]
With `host_pinning: shards` (planner.specs.plan.HostPinning) the host shards that cross the link every
step live in page-locked memory, so that a copy to or from the device runs asynchronously straight
from and into them, as FSDP2 keeps its offloaded shards: the compute-precision parameter shards
(read to the device by every gather) and the buffers gradients land in off the device before the
host adds them into the pageable fp32 gradient shards. Each store takes one arena for all its
shards, sized before the first (the model's units are known up front), pinned once and kept for the
run: one registration instead of one per shard, no rounding per shard, and the ledger charges the
arena, which is every pinned byte of it. The fp32 masters and the Adam states are not read by the
device and stay pageable.
"""

from __future__ import annotations

import torch

from runtime.ledger import MemoryLedger
from runtime.nvme.buffers import AlignedBuffer
from runtime.transfer.streams import Streams


class PinnedArena:
    """`numel` elements of `dtype` in one page-locked buffer, handed out as flat views in request
    order ([Note: pinned host shards]); charged to the ledger's `tier`/`term` for its capacity."""

    def __init__(self, streams: Streams, ledger: MemoryLedger, *, numel: int, dtype: torch.dtype, tier: str,
                 term: str) -> None:
        self.streams, self.ledger, self.tier, self.term = streams, ledger, tier, term
        self.dtype = dtype
        self.buffer: AlignedBuffer = streams.pinned_buffer(max(1, numel * dtype.itemsize), term)
        self.ledger.add(tier, term, self.buffer.capacity_bytes)
        self._flat: torch.Tensor | None = (torch.frombuffer(self.buffer.view, dtype=dtype, count=numel) if numel
                                           else torch.empty(0, dtype=dtype))
        self._next = 0

    @property
    def capacity_bytes(self) -> int:
        return self.buffer.capacity_bytes

    def take(self, numel: int) -> torch.Tensor:
        """The next `numel` elements, zeroed."""
        assert self._flat is not None, "the arena was closed"
        if self._next + numel > self._flat.numel():
            raise RuntimeError(f"the pinned arena of {self.term} holds {self._flat.numel()} elements and "
                               f"{self._next + numel} were asked for: the model changed after it was sharded")
        view = self._flat[self._next : self._next + numel]
        self._next += numel
        view.zero_()
        return view

    def close(self) -> None:
        """Unpin the arena (idempotent); its memory goes with the last view of it."""
        if self._flat is None:
            return
        self.ledger.sub(self.tier, self.term, self.buffer.capacity_bytes)
        self._flat = None
        hook = self.streams.pin_hook(self.term)
        if hook is not None:
            hook.unpin(self.buffer.address)
