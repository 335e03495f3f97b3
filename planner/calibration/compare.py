"""Predicted vs measured: a plan's prediction block against a profile's `measured`, metric by metric
(`planner compare`), in the error of `planner.specs.profile.ERROR_DEFINITION`. The runtime's memory
peaks are compared with the bill's runtime buffers (`runtime_buffer_peak_bytes`), the terms its
ledger tracks.
"""

from __future__ import annotations

from planner.cost.memory import memory_bill, runtime_buffer_peak_bytes
from planner.specs.errors import PlannerError
from planner.specs.plan import LINKS, PHASES, Plan, Prediction
from planner.specs.profile import MetricComparison, Profile
from planner.specs.tiers import TIERS

IN_BACKWARD_STEP_PHASES = "phase_time_s.backward_and_optimizer"
"""The metric an in-backward step's backward and optimizer phases are compared as (their sum)."""
IN_BACKWARD_SPLIT = ("in-backward step: the runtime's backward ends once its last update is handed to the optimizer "
                     "worker and its optimizer phase waits for the updates still queued, the simulator's backward "
                     f"ends once the last update is computed; compared as their sum, {IN_BACKWARD_STEP_PHASES}")


# [Note: the phases of an in-backward step] With `optimizer_step: in_backward` the updates run on the
# optimizer worker beside the backward (runtime/optim/step_schedule.py `InBackward`). The runtime's
# profile closes the backward when autograd returns, i.e. once the hook of the last unit has handed
# its update to the worker (the bounded queue, runtime/optim/optimizer_worker.py, lets it return when
# the update two before it is done), and its optimizer phase is `optimizer.step()` waiting for the
# updates still queued. The simulator ends the backward when the last update has been computed and
# calls only the writes still in flight the optimizer phase (planner/sim/in_backward.py). Both count
# the same seconds from the backward's start to the last update; they cut them at different points,
# so a predicted 0 s against a measured drain of one or two units' updates is not an error of the
# model. `compare` shows the two phases unscored and scores their sum.
def _phases(p: Prediction, m: Prediction, plan: Plan) -> list[MetricComparison]:
    pt, mt = p.phase_time_s, m.phase_time_s
    split = IN_BACKWARD_SPLIT if plan.optimizer_step == "in_backward" else ""
    rows = [MetricComparison(metric=f"phase_time_s.{k}", predicted=float(pt.get(k, 0)), measured=float(mt.get(k, 0)),
                             not_compared=split if k in ("backward", "optimizer") else "") for k in PHASES]
    if split:
        rows.append(MetricComparison(metric=IN_BACKWARD_STEP_PHASES,
                                     predicted=float(pt.get("backward", 0)) + float(pt.get("optimizer", 0)),
                                     measured=float(mt.get("backward", 0)) + float(mt.get("optimizer", 0))))
    return rows


def compare(plan: Plan, profile: Profile) -> list[MetricComparison]:
    """Predicted vs measured for every metric both documents carry."""
    if plan.prediction is None:
        raise PlannerError("the plan has no prediction block to compare with; create it with `planner fit --out`")
    p, m = plan.prediction, profile.measured
    rows = [MetricComparison(metric=k, predicted=float(getattr(p, k)), measured=float(getattr(m, k)))
            for k in ("iteration_time_s", "tflops_per_gpu", "tokens_per_s")]
    rows += _phases(p, m, plan)
    for table, names in (("peak_bytes", TIERS), ("link_bytes", LINKS)):
        pt, mt = getattr(p, table), getattr(m, table)
        rows += [MetricComparison(metric=f"{table}.{k}", predicted=float(pt.get(k, 0)), measured=float(mt.get(k, 0)))
                 for k in names]
    # A profile's peaks are the runtime's own ledger, which does not see autograd's activations:
    # the like-for-like prediction is the bill over the terms the ledger tracks.
    buffers = runtime_buffer_peak_bytes(memory_bill(plan))
    rows += [MetricComparison(metric=f"runtime_buffer_peak_bytes.{k}", predicted=float(buffers[k]),
                              measured=float(m.peak_bytes.get(k, 0))) for k in TIERS]
    for tier in TIERS:
        pterms, mterms = p.memory_terms.get(tier, {}), m.memory_terms.get(tier, {})
        rows += [MetricComparison(metric=f"memory_terms.{tier}.{k}", predicted=float(pterms.get(k, 0)),
                                  measured=float(mterms.get(k, 0))) for k in sorted(set(pterms) | set(mterms))]
    return rows
