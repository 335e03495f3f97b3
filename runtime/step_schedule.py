"""When the optimizer updates: one listener class per `optimizer_step` of the plan.

Each is the sharded model's `UnitListener` while its optimizer lives, and drives an `AdamWEngine`
([Note: schedules as types] in runtime/events.py).
"""

from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import ClassVar

import torch

from runtime.events import UnitListener
from runtime.gradients import FinalGradient, UnitGradient
from runtime.group import ParamUnit
from runtime.optimizer_engine import AdamWEngine
from runtime.optimizer_worker import GradientStaging, OptimizerWorker


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
    ([Note: the optimizer step in backward] in runtime/streamed_optimizer.py), on the optimizer
    worker while the backward goes on ([Note: the optimizer worker] in runtime/optimizer_worker.py);
    the end of the backward waits for the updates, and `optimizer.step()` finishes what is left."""

    replaceable: ClassVar[bool] = False
    """Two optimizers would both update each unit."""

    def __init__(self, engine: AdamWEngine, units: list[ParamUnit]) -> None:  # noqa: ARG002
        self.engine = engine
        self._updated: set[str] = set()
        """Units updated in this step's backward."""
        self.worker = OptimizerWorker()
        self._device: torch.device = engine.model.config.device
        self._updates_done: torch.cuda.Event | None = None
        """CUDA: marks the end of the kernels the last update queued (on the worker's stream)."""
        self._staging = GradientStaging(engine.model.ledger)
        # Joined when the optimizer is dropped without close() too (not at interpreter exit: see the note).
        weakref.finalize(self, self.worker.close)

    def forward_tail(self) -> None:
        self._drain()  # the engine is the main thread's between backwards
        self.engine.begin_updates()

    def backward_begin(self) -> None:
        self._drain()
        self.engine.backward_begin()
        # Runs after the model's own end of backward, which may still make gradients final.
        torch.autograd.Variable._execution_engine.queue_callback(self._drain)

    @torch.no_grad()
    def gradient_final(self, unit: ParamUnit, gradient: FinalGradient) -> None:
        key = unit.key
        if key in self._updated:
            raise RuntimeError(
                f"unit {key} got a second gradient before optimizer.step(): the plan's optimizer_step is in_backward, "
                "which updates each unit once per backward and cannot accumulate gradients over several; call "
                "optimizer.step() after every backward, or set optimizer_step to after_backward")
        self._updated.add(key)
        release = produced = None
        if gradient.device.type == "cuda" and self.engine.chunk_pool is not None:  # the update runs on the host
            assert isinstance(gradient, UnitGradient), type(gradient)
            nbytes = gradient.numel * gradient.element_size
            buffer = self._staging.acquire(nbytes)
            host = buffer[:nbytes].view(gradient.parts[0][1].dtype)
            gradient = gradient.staged(host, self.engine.model.copier)
            release = partial(self._staging.release, buffer)
        elif self._device.type == "cuda":  # the worker's kernels follow those that produced the gradient
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self._device))
        self.worker.submit(partial(self._update, unit, gradient, produced), release)

    @torch.no_grad()
    def _update(self, unit: ParamUnit, gradient: FinalGradient, produced: torch.cuda.Event | None) -> None:
        """On the worker."""
        if self._device.type != "cuda":
            gradient.wait()
            self.engine.update_unit(unit, gradient)
            return
        with torch.cuda.device(self._device):  # the worker thread's current device is not the rank's
            stream = torch.cuda.current_stream()
            if produced is not None:
                stream.wait_event(produced)
            gradient.wait()
            self.engine.update_unit(unit, gradient)
            done = torch.cuda.Event()
            done.record(stream)
            self._updates_done = done

    def _drain(self) -> None:
        """Wait for the worker; on CUDA the compute stream then follows the kernels the updates queued
        (device stores written by an update), before any later gather reads their shards."""
        self.worker.drain()
        if self._updates_done is not None:
            torch.cuda.current_stream(self._device).wait_event(self._updates_done)

    def step(self) -> bool:
        """Every unit with a gradient was updated in backward: what is left are writes."""
        try:
            self._drain()
        except BaseException:
            self._updated.clear()
            with contextlib.suppress(Exception):  # the worker's error is the one to report
                self.engine.end_updates()
            raise
        self._updated.clear()
        self.engine.end_updates()
        return True

    def close(self) -> None:
        self.worker.close()
        self._staging.close()


SCHEDULES: dict[str, type[AfterBackward | InBackward]] = {"after_backward": AfterBackward, "in_backward": InBackward}
"""The plan's `optimizer_step` -> its schedule."""
