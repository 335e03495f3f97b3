"""The flat layout of one unit's parameters and the slice of it a rank owns.

A unit's parameters (one module's own weights: a Linear's weight and bias, a LayerNorm's scale and
shift) are laid end to end in one flat vector, padded to a multiple of the world size, and split
into equal contiguous shards, rank r owning `[r * shard_numel, (r + 1) * shard_numel)`. All-gather
of the shards in rank order rebuilds the padded flat vector; each parameter is a view into it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class FlatLayout:
    """Shapes and offsets of a unit's parameters inside its flat vector."""

    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    numel: int
    """Elements of all parameters together (no padding)."""
    world_size: int

    @staticmethod
    def of(params: list[torch.Tensor], world_size: int) -> FlatLayout:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        return FlatLayout(tuple(p.shape for p in params), tuple(offsets), total, world_size)

    @property
    def padded_numel(self) -> int:
        return -(-self.numel // self.world_size) * self.world_size

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter as a view of the (gathered, padded) flat vector."""
        return [flat[o : o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes, strict=True)]

    def param_slice(self, index: int) -> slice:
        return slice(self.offsets[index], self.offsets[index] + self.shapes[index].numel())


def flatten_shard(params: list[torch.Tensor], layout: FlatLayout, rank: int, out: torch.Tensor) -> None:
    """Copy this rank's slice of the flat vector of `params` into `out` (padding stays zero).

    Only the overlap of each parameter with the shard is touched, so no full flat copy is built:
    construction-time partitioning needs at most one unit's full parameters at a time.
    """
    start, end = layout.shard_range(rank)
    for p, offset in zip(params, layout.offsets, strict=True):
        lo, hi = max(start, offset), min(end, offset + p.numel())
        if lo < hi:
            out[lo - start : hi - start].copy_(p.detach().reshape(-1)[lo - offset : hi - offset])
