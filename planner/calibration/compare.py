"""Predicted vs measured: a plan's prediction block against a profile's `measured`, metric by metric.

`planner compare` prints these rows, the run history and the dashboard use the same error
(`ERROR_DEFINITION`); the runtime's memory peaks are compared with the bill's runtime buffers
(`runtime_buffer_peak_bytes`), the terms its ledger tracks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from planner.cost.memory import memory_bill, runtime_buffer_peak_bytes
from planner.specs.errors import PlannerError
from planner.specs.plan import LINKS, PHASES, TIERS, Plan
from planner.specs.profile import Profile

ERROR_DEFINITION = "error = (predicted - measured) / measured"
"""The one definition of a prediction's error (compare, history, the dashboard): positive when the
planner over-predicts, in units of what was measured."""


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or infinite, or nothing was measured."""
    if predicted is None or measured is None or not math.isfinite(predicted) or not math.isfinite(measured):
        return None
    return None if measured == 0 else (predicted - measured) / measured


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unbounded prediction (a missing link) is written as null."""
    return value if math.isfinite(value) else None


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricComparison:
    metric: str
    """Dotted key of the prediction block (`iteration_time_s`, `peak_bytes.gpu`, ...)."""
    predicted: float
    measured: float

    @property
    def relative_error(self) -> float | None:
        """See `ERROR_DEFINITION`."""
        return relative_error(self.predicted, self.measured)

    def to_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "predicted": _finite(self.predicted), "measured": _finite(self.measured),
                "relative_error": self.relative_error}


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
