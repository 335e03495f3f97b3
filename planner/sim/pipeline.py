"""The simulated step of a pipelined or accumulating plan, composed from one stage's simulated
micro-batch ([Note: the 1F1B step] in planner/cost/pipeline.py; the analytic estimate composes its own
stage estimate with the same `compose_step`, so the two differ only in how they time the stage)."""

from __future__ import annotations

from collections.abc import Callable

from planner.cost.memory import memory_bill
from planner.cost.pipeline import (
    compose_step,
    quiet_plan,
    reduces_once,
    stage_plan,
    step_details,
)
from planner.cost.throughput import composed_link_bytes
from planner.sim.report import simulated_prediction
from planner.spec.plan import Plan, Prediction


def composed_prediction(plan: Plan, predict_stage: Callable[[Plan], Prediction]) -> Prediction:
    """`plan`'s prediction from `predict_stage` (the fast or the full simulation) of its stage."""
    stage = stage_plan(plan)
    full = predict_stage(stage)
    quiet = predict_stage(quiet_plan(stage)) if reduces_once(plan) else None
    fp = full.phase_time_s
    step = compose_step(plan, (fp["forward"], fp["backward"], fp["optimizer"]),
                        None if quiet is None else (quiet.phase_time_s["forward"], quiet.phase_time_s["backward"]))
    total_s = step.forward_s + step.backward_s + step.optimizer_s
    recompute = plan.checkpoint_interval > 0
    flops = (8 if recompute else 6) * plan.tokens_per_iteration * plan.model.num_params
    links = composed_link_bytes(plan, stage, {k: float(v) for k, v in full.link_bytes.items()},
                                None if quiet is None else {k: float(v) for k, v in quiet.link_bytes.items()})
    bill = memory_bill(plan)
    details = dict(full.details, pipeline=step_details(plan, step), stage_iteration_time_s=full.iteration_time_s)
    return simulated_prediction(plan, bill, total_s, flops, bottleneck=full.bottleneck, details=details, link_bytes=links,
                                phase_time_s={"forward": step.forward_s, "backward": step.backward_s,
                                              "optimizer": step.optimizer_s})
