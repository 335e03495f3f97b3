"""When the optimizer updates: one listener class per `optimizer_step` of the plan.

Each is the sharded model's `UnitListener` while its optimizer lives, and drives an `AdamWEngine`
([Note: schedules as types] in runtime/events.py).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from runtime.events import UnitListener
from runtime.gradients import FinalGradient
from runtime.group import ParamUnit
from runtime.optimizer_engine import AdamWEngine


class AfterBackward(UnitListener):
    """`optimizer_step: after_backward`: `optimizer.step()` updates every unit that got a gradient
    from the gradient store; meanwhile the engine may read the step's first states."""

    def __init__(self, engine: AdamWEngine, units: list[ParamUnit]) -> None:
        self.engine = engine
        self.units = units

    def gradient_final(self, unit: ParamUnit, gradient: FinalGradient) -> None:  # noqa: ARG002
        self.engine.prefetch_for_step()

    def step(self) -> bool:
        return self.engine.step([u for u in self.units if u.grads.received])


class InBackward(UnitListener):
    """`optimizer_step: in_backward`: each unit is updated as soon as its gradient is final
    ([Note: the optimizer step in backward] in runtime/streamed_optimizer.py); `optimizer.step()`
    finishes what is left."""

    replaceable: ClassVar[bool] = False
    """Two optimizers would both update each unit."""

    def __init__(self, engine: AdamWEngine, units: list[ParamUnit]) -> None:  # noqa: ARG002
        self.engine = engine
        self._updated: set[str] = set()
        """Units updated in this step's backward."""

    def forward_tail(self) -> None:
        self.engine.begin_updates()

    def backward_begin(self) -> None:
        self.engine.backward_begin()

    @torch.no_grad()
    def gradient_final(self, unit: ParamUnit, gradient: FinalGradient) -> None:
        key = unit.key
        if key in self._updated:
            raise RuntimeError(
                f"unit {key} got a second gradient before optimizer.step(): the plan's optimizer_step is in_backward, "
                "which updates each unit once per backward and cannot accumulate gradients over several; call "
                "optimizer.step() after every backward, or set optimizer_step to after_backward")
        self._updated.add(key)
        self.engine.update_unit(unit, gradient)

    def step(self) -> bool:
        """Every unit with a gradient was updated in backward: what is left are writes."""
        self._updated.clear()
        self.engine.end_updates()
        return True


SCHEDULES: dict[str, type[AfterBackward | InBackward]] = {"after_backward": AfterBackward, "in_backward": InBackward}
"""The plan's `optimizer_step` -> its schedule."""
