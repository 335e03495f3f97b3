"""The one listener a sharded model tells about its units' progress (the optimizer's schedule).

[Note: schedules as types]
The plan's `optimizer_step` (after_backward, in_backward) and where the optimizer states live
(memory, NVMe) change what happens to a gradient and when the optimizer works, in four
combinations. Each fact is a type, chosen once when the model is sharded or the optimizer
created, and no code outside these types asks which one it has:

- where a unit's gradient goes is its `GradientSink` (runtime/units/gradients.py): `StoredGradients`
  into the gradient store, or `HandedGradients`, kept as produced and handed to the in-backward
  update where the plan stores no gradient (`planner.cost.memory.stores_gradients`: in backward with
  the states on NVMe). Once final, a gradient is a `FinalGradient`: the stored shard, or the
  handed parts (`UnitGradient`), which the optimizer updates from, or leaves (`unclaimed`: a
  handed gradient with no optimizer to take it is refused);
- how the optimizer updates a unit is its `AdamWEngine` (runtime/optim/optimizer_engine.py):
  `ResidentAdamW` runs torch's AdamW over the fp32 masters in memory, `StreamedAdamW`
  (runtime/optim/streamed_optimizer.py) streams the masters and Adam states from NVMe through a pool
  of chunk buffers. Both update every unit at once (`step`) or one unit (`update_unit`);
- when is the schedule, a `UnitListener` (runtime/optim/step_schedule.py): `AfterBackward` steps at
  `optimizer.step()` and meanwhile lets the engine read the step's first states during backward
  (`OverlappedAfterBackward`, with the states on NVMe on the CPU, hands the step's per-unit updates
  to a worker that overlaps them with the next forward);
  `InBackward` hands each unit's update, at its `gradient_final` event, to its optimizer worker
  thread (runtime/optim/optimizer_worker.py) and lets the engine read states ahead from the forward's tail.

"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from runtime.units.gradients import FinalGradient
    from runtime.units.group import ParamUnit

# The sharded model knows one listener (a plain `UnitListener`, which does nothing, until an
# optimizer attaches its schedule) and tells it three things: the forward has submitted its last
# parameter read (`forward_tail`), the backward began (`backward_begin`), a unit's gradient is final
# (`gradient_final`: its last parameter's gradient arrived on one rank, its reduce-scatter finished
# on several). The public `runtime.AdamW` composes an engine and a schedule and is torch's
# optimizer interface over them. Adding a schedule is one listener class; a new optimizer tier
# one engine class.
class UnitListener:
    """What the sharded model tells about its units; this base does nothing (no optimizer attached)."""

    replaceable: ClassVar[bool] = True
    """Another listener may take this one's place (a second optimizer on the model)."""

    def forward_begin(self) -> None:
        """A forward began (before its first gather)."""

    def forward_tail(self) -> None:
        """A training forward has submitted every parameter read it will make (once per forward, and
        only once the forward's order is recorded)."""

    def backward_begin(self) -> None:
        """A backward began."""

    def gradient_final(self, unit: ParamUnit, gradient: FinalGradient) -> None:  # noqa: ARG002
        """`unit`'s gradient for this backward is complete."""
        gradient.unclaimed()

    def drain(self) -> None:  # noqa: B027 - a no-op unless overridden
        """Wait for the optimizer work in flight (an overlapped step), so the stores hold its results."""

    def close(self) -> None:  # noqa: B027 - a no-op unless overridden
        """The optimizer is closed: stop what the listener runs (the in-backward worker thread)."""
