"""Fast simulated prediction for ranking many candidates: extrapolate over identical blocks.

[Note: periodic layers] A model's blocks are identical, so once the prefetch pipeline is full the
forward pass repeats block after block with a fixed period, and the backward pass repeats segment
after segment (recompute then backward of `recompute_interval` blocks). Whatever the simulation
measures (phase end times, busy time and bytes of every link, each phase's memory peak and its
terms) then grows by the same amount with every whole segment. We simulate the same plan with
s = 3 and s + 1 units (segments, or blocks without recompute; at least 4 blocks; keeping a
partial top segment if the real model has one, and the real model's optimizer partition, so the
optimizer step is the real one), check that stretching the shorter by one unit reproduces the
longer's every busy interval and memory step ([Note: periodic timelines] in periodic.py, to 1e-9),
and add what one unit adds for every missing unit. When the check fails, pairs of s + 1 and 2 s
units are tried (pipelines of small transfers take longer to settle); when those fail too, or the
model is too shallow to gain anything, the full model is simulated instead; a plan whose
in-backward updates fall behind the backward is predicted from three samples by [Note: two streams]
(streams.py) when its check holds.
"""

from __future__ import annotations

from planner.cost.pipeline import is_composed
from planner.sim.ahead import wait_for
from planner.sim.network import collector_paused
from planner.sim.periodic import FallsBehind, NotPeriodic, Verified, check_samples, extend
from planner.sim.report import composed_prediction, prediction_from
from planner.sim.samples import kept_whole, simulate_whole
from planner.sim.streams import falls_behind_early, two_stream_summary
from planner.specs.plan import Plan, Prediction


@collector_paused()  # the samples, the check and the summaries allocate ~10^5 short-lived objects
def predict(plan: Plan) -> Prediction:
    """The simulated prediction of `plan`, by [Note: periodic layers] where it applies; a pipelined
    or accumulating plan from its stage's micro-batch ([Note: the 1F1B step] in planner/cost/pipeline.py)."""
    wait_for(plan)  # [Note: simulated ahead] in ahead.py: a worker may be simulating it
    if is_composed(plan):
        return composed_prediction(plan, predict)
    kept = kept_whole(plan)  # its samples failed the check before ([Note: shared samples])
    if kept is not None:
        return kept.prediction
    checked = FallsBehind() if falls_behind_early(plan) else check_samples(plan)
    if isinstance(checked, FallsBehind):  # [Note: two streams] in streams.py
        try:
            streams, summary = two_stream_summary(plan)
        except NotPeriodic:
            return simulate_whole(plan).prediction
        return prediction_from(plan, summary, notes={"two_streams_from_layers": streams.layer_counts})
    if not isinstance(checked, Verified):
        return simulate_whole(plan).prediction
    try:
        summary = extend(checked.shorter.summary, checked.longer.summary, checked.pair.repeats)
    except NotPeriodic:
        return simulate_whole(plan).prediction
    return prediction_from(plan, summary, notes={"extrapolated_from_layers": checked.pair.layer_counts})
