"""`validate`: predict every corpus row with the planner and compare with what it measured.

Each row's plan (configure.row_plan) is predicted by the fast simulator (`planner.sim.fast.predict`),
the stage whose number `planner fit` reports for a pinned plan. The plan carries the row's gradient
accumulation (`micro_batches_per_step`), so its prediction is one optimizer step: the pipeline bubble,
and one gradient reduction per step for plain data parallel, every micro-step for FSDP / ZeRO
(planner/cost/pipeline.py [Note: the 1F1B step]).

`error = predicted / measured - 1` in the row's own metric (flops.py [Note: FLOP accountings]);
`error` is null, with a `reason`, for a row the planner cannot express. Offload rows (CPU/NVMe) are
checks, not calibration: they are summarised apart (`summary.offload_checks`).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.cost.throughput import estimate
from planner.sim.fast import predict
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.validation.configure import RowPlan, node_for_row, row_plan
from planner.validation.corpus import GPU_TYPES, CorpusRow, load_corpus
from planner.validation.flops import accounting_for, flops_per_token, from_tokens_per_s

METHODS: dict[str, str] = {
    "simulated": "simulated (planner.sim.fast.predict, the number `planner fit` reports for a pinned plan)",
    "analytic": "analytic (planner.cost.throughput.estimate, the search's first stage)",
}
PARAMS_AS_STATED = frozenset({"llmfoundry_bench"})
"""Sources whose `params_b` is their exact 6N count (llm-foundry's includes learned position
embeddings, which the planner's model lacks); elsewhere it is a rounded size and N is the model's."""
BUNDLED = "bundled data/validation/published_runs.csv"
GPU_TYPE_FILTER = "gpu"
"""The `filters` key of `--gpu` (a GPU type such as H100, not a memory tier)."""
FIT_JSON = Path(__file__).resolve().parent.parent.parent / "data" / "validation" / "fit.json"
"""The fit's record (`python -m planner.validation.fit --write`), summarised under `summary.fitted`."""
ROW_KEYS: tuple[str, ...] = ("row_id", "source_id", "gpu_type", "metric", "measured", "predicted", "error", "reason",
                             "assumptions")
"""`assumptions`: what was filled or searched for the row (configure.py [Note: what a row states])."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RowResult:
    row: CorpusRow
    metric: str
    """Which measured column is compared: tokens/s per GPU where the row has it (no FLOP
    convention needed), else TFLOPS per GPU, else MFU."""
    measured: float
    predicted: float | None = None
    error: float | None = None
    reason: str | None = None
    """Why there is no prediction, or (with one) what the memory bill says against the run."""
    fits: bool | None = None
    """The memory bill's verdict on a run that trained (None when not predicted)."""
    bottleneck: str = ""
    assumptions: tuple[str, ...] = ()
    tokens_per_s_per_gpu: tuple[float, float] | None = None
    """(predicted, measured) in tokens/s per GPU: the scatter's common unit."""

    @property
    def offload(self) -> bool:
        return self.row.is_offload

    def to_json(self) -> dict[str, Any]:
        return {"row_id": self.row.row_id, "source_id": self.row.source_id, "gpu_type": self.row.gpu_family,
                "metric": self.metric, "measured": self.measured, "predicted": self.predicted, "error": self.error,
                "reason": self.reason, "assumptions": list(self.assumptions)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ValidationReport:
    corpus: str
    results: tuple[RowResult, ...]
    method: str = "simulated"
    filters: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        calibration = [r for r in self.results if not r.offload]
        return {
            "method": METHODS[self.method],
            "corpus": self.corpus,
            "filters": dict(self.filters),
            "all": group_summary(calibration),
            "by_gpu_type": _grouped(calibration, lambda r: r.row.gpu_family),
            "by_source": _grouped(calibration, lambda r: r.row.source_id),
            "offload_checks": group_summary([r for r in self.results if r.offload]),
            "fitted": self._fitted(fitted_summary() if self.corpus == BUNDLED else {}),
        }

    def to_json(self) -> dict[str, Any]:
        return {"rows": [r.to_json() for r in self.results], "summary": self.summary()}

    def _fitted(self, fitted: dict[str, Any]) -> dict[str, Any]:
        """The fit's record, for the filtered GPU type's generation only (H200 shares H100's)."""
        if GPU_TYPE_FILTER not in self.filters:
            return fitted
        gpu_type = self.filters[GPU_TYPE_FILTER]
        generation = "H100" if gpu_type == "H200" else gpu_type
        return {g: v for g, v in fitted.items() if g == generation}


def validate(corpus_path: str | Path | None = None, *, source: str | None = None, gpu: str | None = None,
             method: str = "simulated", on_rows: Callable[[int], Callable[[str], None]] | None = None) -> ValidationReport:
    """Predict the corpus's rows (all, or one source / one GPU type) and compare. `on_rows(N)`, when
    given, is told the number of rows and returns what to call with each row's id once it is done."""
    if method not in METHODS:
        raise PlannerError(f"unknown prediction method {method!r}; use one of {', '.join(METHODS)}")
    rows = load_corpus(corpus_path)
    filters: dict[str, str] = {}
    if source is not None:
        known = sorted({r.source_id for r in rows})
        if source not in known:
            raise PlannerError(f"unknown --source {source!r}; the corpus has {', '.join(known)}")
        rows, filters["source"] = tuple(r for r in rows if r.source_id == source), source
    if gpu is not None:
        family = next((g for g in GPU_TYPES if g.lower() == gpu.strip().lower()), None)
        present = sorted({r.gpu_family for r in rows})
        if family is None or family not in present:
            raise PlannerError(f"unknown --gpu {gpu!r}; the rows have GPU types {', '.join(present)}")
        rows, filters[GPU_TYPE_FILTER] = tuple(r for r in rows if r.gpu_family == family), family
    name = str(corpus_path) if corpus_path is not None else BUNDLED
    row_done = on_rows(len(rows)) if on_rows is not None else None
    results = []
    for row in rows:
        results.append(predict_row(row, method=method))
        if row_done is not None:
            row_done(row.row_id)
    return ValidationReport(corpus=name, results=tuple(results), method=method, filters=filters)


def measured_metric(row: CorpusRow) -> tuple[str, float]:
    for metric in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"):
        value = getattr(row, "measured_mfu" if metric == "mfu" else f"measured_{metric}")
        if value is not None:
            return metric, value
    raise AssertionError(f"{row.row_id}: the loader guarantees a measured value")


def predict_row(row: CorpusRow, *, method: str = "simulated", planned: RowPlan | None = None) -> RowResult:
    """`row` predicted under its plan (`planned`: row_plan(row), or that plan on other hardware
    numbers, as the fitter passes it: planner/validation/fit.py)."""
    metric, measured = measured_metric(row)
    planned = row_plan(row) if planned is None else planned
    if planned.plan is None:
        return RowResult(row=row, metric=metric, measured=measured, reason="; ".join(planned.reasons),
                         assumptions=planned.assumptions)
    phase_time_s, fits, why, bottleneck = _predicted(planned.plan, method)
    tokens = predicted_tokens_per_s_per_gpu(planned, phase_time_s)
    per_token, peak = _conversion(row, planned)
    predicted = from_tokens_per_s(tokens, metric, flops_per_token_=per_token, peak_flops_per_s=peak)
    measured_tokens = measured / from_tokens_per_s(1.0, metric, flops_per_token_=per_token, peak_flops_per_s=peak)
    memory = None if fits else f"the memory bill refuses this run that trained: {why}"
    return RowResult(row=row, metric=metric, measured=measured, predicted=predicted, error=predicted / measured - 1,
                     reason=memory, fits=fits, bottleneck=bottleneck,
                     assumptions=planned.assumptions, tokens_per_s_per_gpu=(tokens, measured_tokens))


def _predicted(plan: Plan, method: str) -> tuple[dict[str, float], bool, str, str]:
    """(phase times, fits, the bill's reason, bottleneck); timed whether or not the bill fits."""
    if method == "simulated":
        p = predict(plan)
        return p.phase_time_s, p.feasible, p.reason, p.bottleneck
    from planner.cost.memory import memory_bill

    bill, est = memory_bill(plan), estimate(plan)
    return est.phase_time_s, bill.fits, bill.reason(), est.bottleneck


def predicted_tokens_per_s_per_gpu(planned: RowPlan, phase_time_s: dict[str, float]) -> float:
    """One optimizer step: the plan carries its `ga` micro-batches (`micro_batches_per_step`)."""
    plan = planned.plan
    assert plan is not None and plan.micro_batches_per_step == planned.grad_accumulation
    step_s = phase_time_s["forward"] + phase_time_s["backward"] + phase_time_s["optimizer"]
    return plan.tokens_per_iteration / step_s / plan.num_gpus


def _conversion(row: CorpusRow, planned: RowPlan) -> tuple[float, float]:
    """(FLOPs per token, peak FLOP/s) under the row's own accounting and the GPU's datasheet peak."""
    plan = planned.plan
    assert plan is not None
    accounting = accounting_for(row.source_id)
    params = row.params_b * 1e9 if row.source_id in PARAMS_AS_STATED and row.params_b is not None else None
    per_token = flops_per_token(plan.model, accounting, full_recompute=plan.recompute_interval > 0, num_params=params)
    node = node_for_row(row)
    assert not isinstance(node, str)
    return per_token, node.gpu_nominal_flops_per_s or node.gpu_flops_per_s


def group_summary(results: list[RowResult]) -> dict[str, Any]:
    """Rows, predicted, misses and |error| median / p90 (plus the signed median) of one group."""
    errors = [r.error for r in results if r.error is not None]
    absolute = sorted(abs(e) for e in errors)
    return {
        "rows": len(results),
        "predicted": len(errors),
        "misses": len(results) - len(errors),
        "refused_by_memory_bill": sum(1 for r in results if r.fits is False),
        "median_abs_error": statistics.median(absolute) if absolute else None,
        "p90_abs_error": percentile(absolute, 0.9) if absolute else None,
        "median_error": statistics.median(errors) if errors else None,
    }


def fitted_summary(fit_json: Path = FIT_JSON) -> dict[str, Any]:
    """Per generation, from the last `--write`: the fitted parameters, the in-sample error (fitted
    rows, labelled so) and the leave-one-source-out error, pooled and per held-out source."""
    if not fit_json.exists():
        return {}
    out = {}
    for generation, result in json.loads(fit_json.read_text()).items():
        loso = result.get("leave_one_source_out", {})
        out[generation] = {
            "params": result["params"], "fitted_rows": len(result["rows"]), "prior_in_sample": result["prior_in_sample"],
            "in_sample": result["in_sample"], "leave_one_source_out": loso.get("summary"),
            "leave_one_source_out_not_defined": loso.get("not_defined"),
            "leave_one_source_out_by_source": {source: {k: v for k, v in held.items() if k not in ("errors", "params")}
                                               for source, held in loso.get("by_source", {}).items()},
        }
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted values."""
    if len(sorted_values) == 1:
        return sorted_values[0]
    position = q * (len(sorted_values) - 1)
    low = int(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (position - low) * (sorted_values[high] - sorted_values[low])


def _grouped(results: list[RowResult], key) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RowResult]] = {}
    for result in results:
        groups.setdefault(key(result), []).append(result)
    return {name: group_summary(members) for name, members in sorted(groups.items())}
