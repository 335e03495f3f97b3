"""What of an `nvme` placement the runtime cannot run, checked without torch (the CLI's precheck
and the runtime's `plan_io` share it)."""

from __future__ import annotations

from typing import Any


def nvme_placement_problem(plan: Any) -> str | None:
    """A one-line reason why the runtime cannot run this plan's NVMe placement, or None.

    `plan` is a `planner.specs.plan.Plan` (duck-typed: this package imports only the planner's leaf
    modules, `errors` and `units`)."""
    place = plan.placement
    if place.recompute_inputs == "nvme":
        return "placement recompute_inputs=nvme is not supported by the runtime; use gpu or cpu"
    if place.model_states_on_nvme and not plan.nvme_path:
        return "the plan places states on nvme but sets no nvme_path; set nvme_path to a directory on an NVMe drive"
    if place.optimizer_states == "nvme" and plan.precision == "fp16":
        return ("precision fp16 with optimizer_states=nvme is not supported (the streamed optimizer step has no "
                "overflow check); use bf16 or fp32, or optimizer_states=cpu")
    return None
