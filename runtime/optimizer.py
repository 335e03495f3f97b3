"""AdamW over the fp32 master shards, stepping where the optimizer states live.

Each rank updates only its shards (ZeRO-3): master weights, momentum and variance sit in the
optimizer store (device or host memory, or NVMe), the gradients were reduce-scattered into the
gradient store of the same tier (placement rules in `planner.specs.plan.Placement`), or go straight into
the update in backward, and the updated master is written back into the parameter store (cast to
the compute precision) when it is a separate copy. `AdamW` is torch's optimizer interface over an
engine (`ResidentAdamW`, `StreamedAdamW`) and a schedule (`AfterBackward`, `InBackward`): see
[Note: schedules as types] in runtime/units/events.py. The update itself is torch's fused AdamW, the fastest
Adam torch has on the CPU (its foreach and per-parameter loops are several times slower:
docs/notes/2026-11-22-reference-measurements.md) and faster than anything we would hand-write.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from runtime.nvme import BufferPool
from runtime.optim.loss_scaling import DynamicLossScaler
from runtime.optim.optimizer_engine import AdamWEngine
from runtime.optim.resident_optimizer import ResidentAdamW
from runtime.optim.step_schedule import SCHEDULES, AfterBackward, OverlappedAfterBackward
from runtime.optim.streamed_optimizer import StreamedAdamW
from runtime.sharding import ShardedModel, state_of

__all__ = ["AdamW", "DynamicLossScaler"]


class AdamW:
    """`torch.optim.AdamW` semantics on a sharded model: `step()`, `zero_grad()`, `param_groups`.

    Unlike torch's optimizers it has no per-parameter `.state`: its states are shards of the
    model's stores (`sharded_model`), and `checkpoint_tensors()` names what it keeps besides."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        fused: bool | None = None,
    ) -> None:
        self.sharded_model: ShardedModel = state_of(model)
        sharded = self.sharded_model
        sharded.check_attachable()
        self._units = [u for u in sharded.units if u.num_grad_params]
        self.num_skipped_steps = 0
        # States that do not fit in memory are streamed through a few chunk buffers.
        engine_type = ResidentAdamW if sharded.optimizer_store.resident_states else StreamedAdamW
        self.engine: AdamWEngine = engine_type(sharded, self._units, lr=lr, betas=betas, eps=eps,
                                               weight_decay=weight_decay, fused=fused)
        schedule_type = SCHEDULES[sharded.config.optimizer_step]
        if schedule_type is AfterBackward and isinstance(self.engine, StreamedAdamW) and self.engine.overlaps_forward:
            schedule_type = OverlappedAfterBackward
        self.schedule = schedule_type(self.engine, self._units)
        sharded.attach(self.schedule)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.engine.param_groups

    def state_dict(self) -> dict[str, Any]:
        self.schedule.drain()
        return self.engine.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.schedule.drain()
        self.engine.load_state_dict(state_dict)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The optimizer's tensors that are not shards of the model's stores, by stable name, for
        training checkpoints (runtime/ckpt): per-unit step counts, and Adam's momentum and variance
        where torch keeps them (in-memory states; streamed states live in the optimizer store)."""
        self.schedule.drain()  # an overlapped step's updates, and its stores' writes, land first
        return self.engine.checkpoint_tensors()

    def checkpoint_bytes(self) -> int:
        """Bytes of `checkpoint_tensors()` once every unit has stepped (Adam's states appear lazily)."""
        self.schedule.drain()
        return self.engine.checkpoint_bytes()

    def checkpoint_tensors_for_load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Tensors to load the named checkpoint tensors into, creating Adam states that a fresh
        optimizer has not allocated yet (torch creates them lazily on the first step)."""
        self.schedule.drain()
        return self.engine.checkpoint_tensors_for_load(names)

    @property
    def chunk_pool(self) -> BufferPool | None:
        """The streamed states' chunk buffers, which checkpoint traffic borrows (None: in memory)."""
        self.schedule.drain()  # the overlapped step's updates use them
        return self.engine.chunk_pool

    def close(self) -> None:
        """Free the streamed step's chunk buffers (no-op for in-memory states)."""
        self.sharded_model.detach(self.schedule)
        self.schedule.close()  # joins the in-backward worker before the engine's buffers go
        self.engine.close()

    @torch.no_grad()
    def step(self) -> bool:
        """Update the shards; returns False when an fp16 overflow made the step be skipped."""
        sharded = self.sharded_model
        sharded.finish_pending()
        sharded.profiler.begin("optimizer")
        applied = self.schedule.step()
        if not applied:
            self.num_skipped_steps += 1
        sharded.profiler.end("optimizer")
        sharded.profiler.end_step()
        return applied

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: ARG002 - shards are always kept
        for unit in self._units:
            unit.grads.zero_grad()
