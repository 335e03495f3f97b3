"""Predicted vs measured: a plan's prediction block against a profile's `measured`, metric by metric
(`planner compare`), in the error of `planner.specs.profile.ERROR_DEFINITION`. The runtime's memory
peaks are compared with the bill's runtime buffers (`runtime_buffer_peak_bytes`), the terms its
ledger tracks.
"""

from __future__ import annotations

from planner.cost.memory import memory_bill, runtime_buffer_peak_bytes
from planner.specs.errors import PlannerError
from planner.specs.plan import LINKS, PHASES, Plan
from planner.specs.profile import MetricComparison, Profile
from planner.specs.tiers import TIERS


def compare(plan: Plan, profile: Profile) -> list[MetricComparison]:
    """Predicted vs measured for every metric both documents carry."""
    if plan.prediction is None:
        raise PlannerError("the plan has no prediction block to compare with; create it with `planner fit --out`")
    p, m = plan.prediction, profile.measured
    rows = [MetricComparison(metric=k, predicted=float(getattr(p, k)), measured=float(getattr(m, k)))
            for k in ("iteration_time_s", "tflops_per_gpu", "tokens_per_s")]
    for table, names in (("phase_time_s", PHASES), ("peak_bytes", TIERS), ("link_bytes", LINKS)):
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
