"""A plan with the user's pinned choices laid over it (`planner simulate PLAN --tiling-factor 4`)."""

from __future__ import annotations

from planner.cost.feasibility import check_plan
from planner.specs.plan import OPTIMIZER_STEPS, Placement, Plan, parse_placement_pins
from planner.specs.specio import string

AUTO = "auto"
"""A parallel degree the user asked the search to choose."""
SEARCHED_BY_DEFAULT = frozenset({"3d"})
"""Strategies whose point is to search the tensor and pipeline degrees when the user gives none."""


def parallel_degrees(strategy: str | None, model_parallel: int | str | None = None,
                     pipeline_parallel: int | str | None = None) -> tuple[int | None, int | None]:
    """`SearchRequest`'s (tensor, pipeline) degrees from what the user gave each: a whole number,
    `AUTO` (searched: None), or None for not given: 1, except for the `3d` strategy, which searches
    both. The one rule `planner fit` and the dashboard share, so the same inputs search the same plans."""

    def degree(given: int | str | None) -> int | None:
        if given is None:
            return None if strategy in SEARCHED_BY_DEFAULT else 1
        return None if given == AUTO else int(given)

    return degree(model_parallel), degree(pipeline_parallel)


def optimizer_step_pin(text: str | None) -> str | None:
    """`--optimizer-step`, checked (None: not pinned; the search chooses among the schedules the training allows)."""
    return None if text is None else string(text, "--optimizer-step", choices=OPTIMIZER_STEPS)


def apply_pins(
    plan: Plan,
    *,
    placement: str | None = None,
    batch_per_gpu: float | None = None,
    recompute_interval: int | None = None,
    tiling_factor: int | None = None,
    prefetch_depth: int | None = None,
    model_parallel: int | None = None,
    max_alloc_gib: float | None = None,
    optimizer_step: str | None = None,
) -> Plan:
    """The plan with the user's pinned choices, checked (`check_plan`); any stale prediction is dropped."""
    changes: dict[str, object] = {"prediction": None}
    pins = parse_placement_pins(placement)
    if pins:
        new_placement = Placement(**{**plan.placement.to_dict(), **pins})
        if new_placement != plan.placement:
            changes.update(placement=new_placement, strategy="custom")
    for key, value in (("micro_batch_per_gpu", batch_per_gpu), ("recompute_interval", recompute_interval),
                       ("tiling_factor", tiling_factor), ("prefetch_depth", prefetch_depth),
                       ("model_parallel_degree", model_parallel)):
        if value is not None:
            changes[key] = value
    if optimizer_step is not None:
        changes["optimizer_step"] = optimizer_step_pin(optimizer_step)
    if max_alloc_gib is not None:
        changes["node"] = plan.node.with_max_alloc_gib(max_alloc_gib)
    return check_plan(plan.replace(**changes))
