"""What the user's training loop allows of the optimizer step's schedule (`Plan.optimizer_step`).

The schedule is a knob like the placement: the search prices every schedule the loop allows and
keeps the fastest. Some loops allow only the step after the whole backward:
- global-norm gradient clipping scales every gradient by the norm of all of them, so no unit may
  be updated before the last gradient exists;
- fp16's loss scaler checks every gradient for overflow before any update;
- accumulating several micro-batches per step (a pipeline's `m`) updates after the last of them.
Otherwise the in-backward step (each unit updated as soon as its gradient is final) computes the
same update, and the search compares the two (`planner/search/search.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.specs.errors import PlannerError
from planner.specs.plan import OPTIMIZER_STEPS, OptimizerStep, Plan
from planner.specs.specio import string

AFTER_BACKWARD: OptimizerStep = "after_backward"
PINNED_REASON = "pinned by the user (--optimizer-step)"


@dataclass(frozen=True, slots=True)
class TrainingLoop:
    """The user's loop, as far as the optimizer step's schedule goes."""

    optimizer_step: OptimizerStep | None = None
    """The schedule the user pinned; None lets the search choose among those the loop allows."""
    clips_grad_norm: bool = False
    """The loop clips gradients by their global norm (`torch.nn.utils.clip_grad_norm_` over all parameters)."""

    def __post_init__(self) -> None:
        if self.optimizer_step is not None:
            string(self.optimizer_step, "--optimizer-step", choices=OPTIMIZER_STEPS)
        if self.clips_grad_norm and self.optimizer_step not in (None, AFTER_BACKWARD):
            raise PlannerError(f"--optimizer-step {self.optimizer_step} cannot run with --clip-grad-norm: clipping by the "
                               "global norm needs every gradient before any update; drop one of the two")

    def schedules(self, *, precision: str, micro_batches_per_step: int) -> tuple[tuple[OptimizerStep, ...], str]:
        """The schedules a plan of this precision and accumulation may run, and why only those
        when the loop allows just one ("" when the search chooses among several)."""
        if self.optimizer_step is not None:
            return (self.optimizer_step,), PINNED_REASON
        if self.clips_grad_norm:
            return (AFTER_BACKWARD,), "global-norm gradient clipping needs every gradient before any update"
        if precision == "fp16":
            return (AFTER_BACKWARD,), "fp16's loss scaler checks every gradient for overflow before any update"
        if micro_batches_per_step > 1:
            return (AFTER_BACKWARD,), f"{micro_batches_per_step} micro-batches accumulate before each step"
        return tuple(OPTIMIZER_STEPS), ""


def comparison_reason(other: OptimizerStep | None, chosen_s: float, other_s: float | None, *, other_bound: bool) -> str:
    """Why the search kept a plan's schedule among several: how it compares with the best plan of the
    `other` schedule on the same layout (`other_bound`: that one's time is the analytic bound, which
    the simulator only lengthens), or that the other does not fit it. On a tie the search prefers
    the step after backward, which asks nothing of the training loop."""
    if other is None or other_s is None:
        return "the only schedule the training allows that fits this placement"
    times = f"{chosen_s:.4g} s vs {'>= ' if other_bound else ''}{other_s:.4g} s per iteration"
    if abs(chosen_s - other_s) <= TIE * max(chosen_s, other_s):
        return f"as fast as {other} on this placement ({times}); on a tie the step after backward is kept"
    return f"{'faster' if chosen_s < other_s else 'slower'} than {other} on this placement: {times}"


TIE = 1e-6
"""Relative difference under which two iteration times are one (the rank's resolution)."""


def step_overlaps_forward(plan: Plan) -> bool:
    """Whether the runtime runs `plan`'s after-backward step during the next forward, unit by unit
    (runtime/optim/step_schedule.py [Note: the step overlaps the next forward]): with the optimizer
    states on NVMe where the CPU is the compute device (`StreamedAdamW.overlaps_forward`). On a GPU
    the step stays synchronous. The plan's `optimizer_step` stays `after_backward`: the runtime picks
    the overlapped schedule itself (runtime/optimizer.py)."""
    return (plan.optimizer_step == AFTER_BACKWARD and plan.placement.optimizer_states.staged
            and plan.node.host_is_device)


OVERLAPPED = "overlapped with the next forward unit by unit (optimizer states on NVMe, the CPU computes)"
"""What the plan says beside `after_backward` where the runtime overlaps it (`step_overlaps_forward`)."""


def schedule_reason(plan: Plan, reason: str) -> str:
    """`reason` for `plan`'s schedule, saying first that its after-backward step overlaps the next
    forward where the runtime runs it so."""
    if not step_overlaps_forward(plan):
        return reason
    return f"{OVERLAPPED}; {reason}" if reason else OVERLAPPED
