"""Memory-centric tiling (docs/method.md §4.4): a large Linear becomes `t` Linears over slices of its
output features, each gathered and released on its own, so the working memory of the operator
(eq. 4) and its largest single allocation shrink by `t`.

The tiled layer computes exactly the same numbers: output feature j is the same dot product of the
same row of the weight with the input, in the same order; only which matmul call produces it
changes. The tiles' outputs are concatenated along the feature dimension.
"""

from __future__ import annotations

import torch
from torch import nn


class TiledLinear(nn.Module):
    """`Linear(in, out)` as `tiling_factor` Linears of `~out / t` output features each."""

    def __init__(self, linear: nn.Linear, tiling_factor: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        sizes = [len(c) for c in torch.arange(linear.out_features).chunk(tiling_factor)]
        self.tiles = nn.ModuleList()
        start = 0
        for size in sizes:
            tile = nn.Linear(linear.in_features, size, bias=linear.bias is not None,
                             device=linear.weight.device, dtype=linear.weight.dtype)
            with torch.no_grad():
                if linear.weight.device.type != "meta":
                    tile.weight.copy_(linear.weight[start : start + size])
                    if linear.bias is not None:
                        tile.bias.copy_(linear.bias[start : start + size])
            tile.weight.requires_grad_(linear.weight.requires_grad)
            if tile.bias is not None and linear.bias is not None:
                tile.bias.requires_grad_(linear.bias.requires_grad)
            self.tiles.append(tile)
            start += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (..., in) -> t x (..., out_i) -> (..., out)
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={len(self.tiles)}"


def apply_tiling(root: nn.Module, tiling_factor: int) -> int:
    """Replace every `nn.Linear` under `root` with at least `tiling_factor` outputs by a `TiledLinear`.
    Returns how many were replaced. Tied weights are left alone (the tie must survive)."""
    if tiling_factor <= 1:
        return 0
    counts: dict[int, int] = {}
    for _, p in root.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    replaced = 0
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if (isinstance(child, nn.Linear) and child.out_features >= tiling_factor
                    and counts.get(id(child.weight), 0) == 1):
                setattr(parent, name, TiledLinear(child, tiling_factor))
                replaced += 1
    return replaced
