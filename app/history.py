"""Predicted vs measured pairs from the run history that `planner run` records (planner/specs/history.py).

The dashboard only reads (a read-only SQLite connection to the store's `runs` table): a missing
file is "no runs recorded yet" (it is not created), and an unreadable one is reported in one line. Nothing measured is ever made up: a metric appears only
for runs that recorded both its prediction and its measurement.
"""

from __future__ import annotations

import os
import sqlite3
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from planner.specs.history import COLUMN_NAMES, default_store_path
from planner.specs.profile import relative_error
from planner.specs.tiers import TIERS

HISTORY_ENV = "TIERWISE_HISTORY"
"""Overrides the default store (the user's cache directory), like `planner history --store`."""
METRICS: dict[str, tuple[str, str]] = {
    "iteration_time_s": ("predicted_iteration_time_s", "measured_iteration_time_s"),
    "tflops_per_gpu": ("predicted_tflops_per_gpu", "measured_tflops_per_gpu"),
    **{f"peak_bytes.{t}": (f"predicted_peak_{t}_bytes", f"measured_peak_{t}_bytes") for t in TIERS},
}
COLUMNS = ["run", "recorded_at", "model", "hardware", "num_gpus", "strategy", "placement", "method", "metric",
           "predicted", "measured", "error"]


def default_history_path() -> Path:
    return Path(os.environ[HISTORY_ENV]) if os.environ.get(HISTORY_ENV) else default_store_path()


@dataclass(frozen=True, slots=True)
class History:
    runs: pd.DataFrame
    """Long format: one row per (run, metric) with its `predicted` and `measured` values."""
    message: str
    """Why there is nothing to show; empty when there is."""


def read_history(path: Path) -> History:
    empty = pd.DataFrame(columns=COLUMNS)
    if not path.is_file():
        return History(empty, f"No runs recorded yet (no run history at {path}).")
    try:
        # Read-only: `RunHistory(path)` would create the table and bump the file while `planner run` writes.
        with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
            frame = pd.read_sql_query("SELECT * FROM runs ORDER BY id", con)
    except (sqlite3.Error, pd.errors.DatabaseError) as exc:
        return History(empty, f"Cannot read run history {path}: {exc}")
    missing = [c for c in ("id", *COLUMN_NAMES) if c not in frame.columns]
    if missing:
        return History(empty, f"Cannot read run history {path}: its runs table lacks {', '.join(missing)}.")
    if frame.empty:
        return History(empty, f"No runs recorded yet (the run history at {path} is empty).")
    rows = []
    for run in frame.itertuples(index=False):
        common = {
            "run": run.id, "recorded_at": run.recorded_at, "model": run.model_name, "hardware": run.hardware_name,
            "num_gpus": run.num_gpus, "strategy": run.strategy, "method": run.prediction_method,
            "placement": "/".join((run.params_tier, run.gradients_tier, run.optimizer_states_tier,
                                   run.recompute_inputs_tier)),
        }
        for metric, (predicted, measured) in METRICS.items():
            p, m = getattr(run, predicted), getattr(run, measured)
            if pd.notna(p) and pd.notna(m):
                rows.append({**common, "metric": metric, "predicted": float(p), "measured": float(m),
                             "error": relative_error(float(p), float(m))})
    if not rows:
        return History(empty, f"The {len(frame)} run(s) in {path} have no measured numbers to compare.")
    return History(pd.DataFrame(rows, columns=COLUMNS), "")
