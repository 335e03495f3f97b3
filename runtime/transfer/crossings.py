"""How a host store's shards cross to and from the device: one type per way (`HostStore.crossing`).

- `SameMemory`: the CPU machine, where the host is the device ([Note: the CPU machine] in
  runtime/transfer/stores.py): nothing crosses.
- `Staged`: pageable shards, every copy through the rank's pinned staging pool ([Note: staged host
  copies] in runtime/transfer/pinned_pool.py): `host_pinning: staged`.
- `Pinned`: the shards themselves in a pinned arena, copied straight from and into
  ([Note: pinned host shards] in runtime/transfer/pinned_arena.py): the compute-precision
  parameters with `host_pinning: shards`.
- `Landed`: pageable fp32 shards that gradients land in off the device through a pinned landing
  buffer of their own, added on the host once landed: the gradients with `host_pinning: shards`.
A copy off the device returns a `Pending` whose `wait()` (the rank's transfer worker's, never the
autograd thread's) lands it; a copy to the device waits only on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from planner.cost.memory import lands_gradients_pinned
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import HostPinning, Plan
from runtime.ledger import MemoryLedger
from runtime.transfer.mixed_add import add_into
from runtime.transfer.pinned_arena import PinnedArena
from runtime.transfer.stores import CastPending, CopyEngine, Pending, ShardKey
from runtime.transfer.streams import DeviceEvent


def _landed(target: torch.Tensor, add: bool) -> Callable[[torch.Tensor, int], None]:
    """Puts a piece that arrived at `offset` into `target`: added (accumulated) or copied (written)."""
    if add:
        return lambda piece, at: add_into(target[at : at + piece.numel()], piece)
    return lambda piece, at: target[at : at + piece.numel()].copy_(piece)


class Crossing(ABC):
    """How one host store's shards reach the device and come back."""

    charges_shards: bool = True
    """The store charges each shard's bytes to the ledger (not one arena for all)."""

    def __init__(self, copier: CopyEngine) -> None:
        self.copier = copier

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    @abstractmethod
    def to_device(self, key: ShardKey, shard: torch.Tensor, dtype: torch.dtype) -> Pending:
        """The shard on the compute device in `dtype` (cast on the device: the link carries the stored width)."""

    @abstractmethod
    def from_device(self, key: ShardKey, shard: torch.Tensor, offset: int, src: torch.Tensor, *, add: bool) -> Pending:
        """`shard[offset:offset + src.numel()] += src` (`add`) or `= src`, for a device tensor `src`."""

    def landed(self, key: ShardKey) -> None:  # noqa: B027 - a no-op unless overridden
        """Before the host reads or writes `key`'s shard: a copy off the device into it has landed."""

    def close(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Give back what the crossing pinned."""


class SameMemory(Crossing):
    def to_device(self, key: ShardKey, shard: torch.Tensor, dtype: torch.dtype) -> Pending:  # noqa: ARG002
        return Pending(shard) if shard.dtype == dtype else Pending(shard.to(dtype), fresh=True)

    def from_device(self, key: ShardKey, shard: torch.Tensor, offset: int, src: torch.Tensor, *,  # noqa: ARG002
                    add: bool) -> Pending:
        _landed(shard, add)(src.reshape(-1), offset)
        return Pending(shard)


class Staged(Crossing):
    def to_device(self, key: ShardKey, shard: torch.Tensor, dtype: torch.dtype) -> Pending:  # noqa: ARG002
        staged, event = self.copier.stage_to_device(shard)
        return Pending(staged, event, fresh=True) if dtype == shard.dtype else CastPending(Pending(staged, event), dtype)

    def from_device(self, key: ShardKey, shard: torch.Tensor, offset: int, src: torch.Tensor, *,  # noqa: ARG002
                    add: bool) -> Pending:
        transfer = self.copier.to_host(src.reshape(-1), _landed(shard[offset : offset + src.numel()], add))
        return Pending(shard, transfer.event, after=transfer.finish, to_host=True)


class Pinned(Crossing):
    """Shards carved from one pinned arena; a copy off the device lands in the shard itself and the
    next copy of it to the device waits, on the device, for that one."""

    charges_shards = False

    def __init__(self, copier: CopyEngine, arena: PinnedArena) -> None:
        super().__init__(copier)
        self.arena = arena
        self._written: dict[ShardKey, DeviceEvent] = {}
        """Copies off the device into a shard, for the next copy of it to the device to follow."""

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        assert dtype == self.arena.dtype, (dtype, self.arena.dtype)
        return self.arena.take(numel)

    def to_device(self, key: ShardKey, shard: torch.Tensor, dtype: torch.dtype) -> Pending:
        staged, event = self.copier.to_device(shard, after=self._written.pop(key, None))
        return Pending(staged, event, fresh=True) if dtype == shard.dtype else CastPending(Pending(staged, event), dtype)

    def from_device(self, key: ShardKey, shard: torch.Tensor, offset: int, src: torch.Tensor, *,
                    add: bool) -> Pending:
        assert not add, "a pinned parameter shard is written, never accumulated into"
        target = shard[offset : offset + src.numel()]
        self._written[key] = event = self.copier.from_device(target, src.reshape(-1))
        return Pending(shard, event, to_host=True)

    def landed(self, key: ShardKey) -> None:
        event = self._written.pop(key, None)
        if event is not None:
            event.layer.host_wait(event, "a pinned shard written from the device")

    def close(self) -> None:
        self.arena.close()


class Landed(Crossing):
    """Pageable shards; each shard's gradient lands off the device in its own region of a pinned
    landing arena (taken at the first landing), and is added into (or copied to) the shard on the
    host once it landed (`Pending.wait`, on the rank's transfer worker). A region is reused by the
    next backward only once its landing was waited for (the step's, or the next backward's, drain)."""

    def __init__(self, copier: CopyEngine, make_arena: Callable[[], PinnedArena]) -> None:
        super().__init__(copier)
        self._make_arena = make_arena
        self.arena: PinnedArena | None = None
        self._regions: dict[ShardKey, torch.Tensor] = {}

    def to_device(self, key: ShardKey, shard: torch.Tensor, dtype: torch.dtype) -> Pending:
        raise AssertionError(f"gradient shard {key} is read on the host, never copied to the device")

    def from_device(self, key: ShardKey, shard: torch.Tensor, offset: int, src: torch.Tensor, *,
                    add: bool) -> Pending:
        if self.arena is None:
            self.arena = self._make_arena()
        if key not in self._regions:
            self._regions[key] = self.arena.take(shard.numel())
        landing = self._regions[key][offset : offset + src.numel()]
        event = self.copier.from_device(landing, src.reshape(-1))
        land = _landed(shard, add)
        return Pending(shard, event, after=lambda: land(landing, offset), to_host=True)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()


def host_crossing(state: str, plan: Plan, copier: CopyEngine, ledger: MemoryLedger, *, numel: int,
                  dtype: torch.dtype) -> Crossing | None:
    """How the host store of model state `state` crosses the link under `plan` (None: the store's
    default, the staging pool or nothing to cross): with `host_pinning: shards` on a device of its
    own, the parameters from a pinned arena of `numel` elements of `dtype` (every shard of the rank),
    the gradients through a pinned landing arena of the same size, taken at the first landing."""
    if not copier.separate_memory or plan.host_pinning is not HostPinning.SHARDS:
        return None
    streams = copier.streams

    def arena(term: MemoryTerm) -> PinnedArena:
        return PinnedArena(streams, ledger, numel=numel, dtype=dtype, tier="cpu", term=term)

    if state == "params" and plan.placement.params.host_memory:
        return Pinned(copier, arena(MemoryTerm.PARAMS))
    if state == "gradients" and lands_gradients_pinned(plan):
        return Landed(copier, lambda: arena(MemoryTerm.GRADIENT_LANDING_BUFFERS))
    return None
