"""How an optimizer updates a sharded model's shards: one interface, one class per state tier.

`ResidentAdamW` (runtime/optim/resident_optimizer.py) steps torch's AdamW over fp32 masters in memory;
`StreamedAdamW` (runtime/optim/streamed_optimizer.py) streams masters and Adam states from NVMe in chunks.
A schedule (runtime/optim/step_schedule.py) drives either: after backward it calls `step`, in backward
`update_unit` per unit; the read-ahead hooks let an engine whose states are streamed start reading
before the update needs them, and are no-ops otherwise ([Note: schedules as types] in
runtime/units/events.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from runtime.nvme import BufferPool
    from runtime.units.gradients import FinalGradient
    from runtime.units.group import ParamUnit


class AdamWEngine(ABC):
    """AdamW over the shards of a sharded model's units (`torch.optim.AdamW` semantics per unit)."""

    param_groups: list[dict[str, Any]]
    model: Any
    """The sharded model (`runtime.sharding.ShardedModel`) whose units it updates."""

    @abstractmethod
    def step(self, units: list[ParamUnit]) -> bool:
        """Update `units` (those that got a gradient) from their stored gradients; False when an fp16
        overflow made the step be skipped."""

    @abstractmethod
    def update_unit(self, unit: ParamUnit, gradient: FinalGradient) -> None:
        """Update one unit in backward, from its final gradient."""

    def prefetch_for_step(self) -> None:  # noqa: B027 - a no-op unless overridden
        """After backward: a unit's gradient is final while the backward goes on."""

    def begin_updates(self) -> None:  # noqa: B027 - a no-op unless overridden
        """In backward: the forward has submitted its last parameter read; updates follow."""

    def backward_begin(self) -> None:  # noqa: B027 - a no-op unless overridden
        """In backward: the backward began (updates follow)."""

    def end_updates(self) -> None:  # noqa: B027 - a no-op unless overridden
        """In backward: at `optimizer.step()`, every update of this backward is submitted."""

    @property
    def chunk_pool(self) -> BufferPool | None:
        """The pool whose chunk buffers the engine streams states through (None: states in memory)."""
        return None

    @abstractmethod
    def state_dict(self) -> dict[str, Any]: ...

    @abstractmethod
    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    @abstractmethod
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's tensors that are not shards of the model's stores, by stable name."""

    @abstractmethod
    def checkpoint_bytes(self) -> int:
        """Bytes of `checkpoint_tensors()` once every unit has stepped."""

    @abstractmethod
    def checkpoint_tensors_for_load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors to load the named checkpoint tensors into."""

    def close(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Free what the engine holds beyond the stores."""
