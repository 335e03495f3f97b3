"""The profile document the runtime writes: what one training run measured, in the plan's vocabulary.

`measured` has exactly the shape of a plan's `prediction` block (docs/plan-format.md), so that
`planner compare` can put the two side by side metric by metric; `samples` keeps every step and
`losses` one loss per step. Reading is strict, like `planner.specs.plan`: unknown keys and wrong types
are one-line `PlannerError`s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.plan import LINKS, PHASES, Prediction
from planner.specs.specio import check_keys, load_document, number, write_json_atomic
from planner.specs.tiers import TIERS

SCHEMA = "tierwise.profile/1"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepSample:
    """One training step as measured on rank 0 (peaks: max over ranks for gpu, sum per node for cpu)."""

    step: int
    step_time_s: float
    loss: float
    phase_time_s: dict[str, float]
    link_bytes: dict[str, int]
    peak_bytes: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "step_time_s": self.step_time_s, "loss": _loss_json(self.loss),
                "phase_time_s": dict(self.phase_time_s), "link_bytes": dict(self.link_bytes),
                "peak_bytes": dict(self.peak_bytes)}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str) -> StepSample:
        check_keys(doc, {"step", "step_time_s", "loss", "phase_time_s", "link_bytes", "peak_bytes"}, where)
        for key in ("step", "step_time_s", "loss", "phase_time_s", "link_bytes", "peak_bytes"):
            if key not in doc:
                raise PlannerError(f"{where}: missing required key {key!r}")
        return cls(
            step=number(doc["step"], f"{where}.step", minimum=1, integer=True),
            step_time_s=number(doc["step_time_s"], f"{where}.step_time_s", minimum=0),
            loss=_loss(doc["loss"], f"{where}.loss"),
            phase_time_s=_table(doc["phase_time_s"], PHASES, f"{where}.phase_time_s", integer=False),
            link_bytes=_table(doc["link_bytes"], LINKS, f"{where}.link_bytes", integer=True),
            peak_bytes=_table(doc["peak_bytes"], TIERS, f"{where}.peak_bytes", integer=True),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Profile:
    """A training run: `measured` (prediction-shaped), its steps and losses, and run facts."""

    measured: Prediction
    samples: tuple[StepSample, ...]
    warmup_steps: int
    """Leading steps left out of `measured` (the first one records the operator order, pays allocation)."""
    plan: dict[str, Any] = field(default_factory=dict)
    """The plan that was run (its document)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Run facts: world size, device, process peak RSS, allocator peak, prefetch order changes..."""

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.samples]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "measured": self.measured.to_dict(), "losses": [_loss_json(v) for v in self.losses],
                "samples": [s.to_dict() for s in self.samples], "warmup_steps": self.warmup_steps,
                "plan": self.plan, "details": self.details}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "profile") -> Profile:
        check_keys(doc, {"schema", "measured", "losses", "samples", "warmup_steps", "plan", "details"}, where)
        if doc.get("schema") != SCHEMA:
            raise PlannerError(f"{where}: schema {doc.get('schema')!r} is not {SCHEMA!r}")
        for key in ("measured", "samples", "losses"):
            if key not in doc:
                raise PlannerError(f"{where}: missing required key {key!r}")
        if not isinstance(doc["samples"], list) or not isinstance(doc["losses"], list):
            raise PlannerError(f"{where}: samples and losses must be lists")
        samples = tuple(StepSample.from_dict(s, f"{where}.samples[{i}]") for i, s in enumerate(doc["samples"]))
        losses = [_loss(v, f"{where}.losses[{i}]") for i, v in enumerate(doc["losses"])]
        if len(losses) != len(samples) or any(
            not (a == b or (math.isnan(a) and math.isnan(b))) for a, b in zip(losses, (s.loss for s in samples), strict=True)
        ):
            raise PlannerError(f"{where}: losses must hold one loss per sample, equal to the samples' losses")
        for key in ("plan", "details"):
            if not isinstance(doc.get(key, {}), dict):
                raise PlannerError(f"{where}.{key} must be an object")
        return cls(
            measured=Prediction.from_dict(doc["measured"], f"{where}.measured"),
            samples=samples,
            warmup_steps=number(doc.get("warmup_steps", 0), f"{where}.warmup_steps", minimum=0, integer=True),
            plan=doc.get("plan", {}),
            details=doc.get("details", {}),
        )

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_dict(), "profile")


def load_profile(path: str | Path) -> Profile:
    return Profile.from_dict(load_document(path, "profile"), f"profile {path}")


def _loss(value: Any, where: str) -> float:
    # A diverged run is a legitimate measurement: NaN/inf losses are kept, as JSON null.
    if value is None:
        return math.nan
    return float(number(value, where, minimum=-1e30))


def _finite(value: float) -> float | None:
    """JSON has no infinity: an unbounded prediction (a missing link) is written as null."""
    return value if math.isfinite(value) else None


def _loss_json(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _table(doc: Any, names: tuple[str, ...], where: str, *, integer: bool) -> dict[str, Any]:
    check_keys(doc, set(names), where)
    return {k: number(v, f"{where}.{k}", minimum=0, integer=integer) for k, v in doc.items()}


# -- compare ---------------------------------------------------------------------------------
ERROR_DEFINITION = "error = (predicted - measured) / measured"
"""The one definition of a prediction's error (compare, history, the dashboard): positive when the
planner over-predicts, in units of what was measured."""


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured; None when either is missing or infinite, or nothing was measured."""
    if predicted is None or measured is None or not math.isfinite(predicted) or not math.isfinite(measured):
        return None
    return None if measured == 0 else (predicted - measured) / measured


@dataclass(frozen=True, kw_only=True, slots=True)
class MetricComparison:
    metric: str
    """Dotted key of the prediction block (`iteration_time_s`, `peak_bytes.gpu`, ...)."""
    predicted: float
    measured: float
    not_compared: str = ""
    """Why the two numbers are shown but not compared (they split the same seconds at different
    points); empty for a compared metric."""

    @property
    def relative_error(self) -> float | None:
        """See `ERROR_DEFINITION`; None for a metric shown but not compared."""
        return None if self.not_compared else relative_error(self.predicted, self.measured)

    def to_dict(self) -> dict[str, Any]:
        out = {"metric": self.metric, "predicted": _finite(self.predicted), "measured": _finite(self.measured),
               "relative_error": self.relative_error}
        if self.not_compared:
            out["not_compared"] = self.not_compared
        return out
