"""Read-only view of the run history that `planner run` will record (issue 6, "Close the loop").

The writer does not exist yet, so this reader is defensive and says exactly what it expects:

- an SQLite file, by default `<user cache dir>/tierwise/history.sqlite` (platformdirs), or the path in
  `$TIERWISE_HISTORY`;
- a table `runs` with one row per run and at least two TEXT columns holding JSON documents:
  `plan` (or `plan_json`): the plan document with its `prediction` block (DESIGN.md JSON keys), and
  `profile` (or `profile_json`): the runtime's profile with its `measured` block;
- optionally `created_at` (any text) and `run_id`.

Anything else (no file, no table, missing columns, a row that is not JSON) is reported, never
guessed at, and no measured number is ever made up.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

HISTORY_ENV = "TIERWISE_HISTORY"
TABLE = "runs"
PLAN_COLUMNS = ("plan", "plan_json")
PROFILE_COLUMNS = ("profile", "profile_json")
METRICS = ("iteration_time_s", "tflops_per_gpu", "tokens_per_s")
TIERS = ("gpu", "cpu", "nvme")
COLUMNS = ["run", "created_at", "model", "num_gpus", "strategy", "placement", "metric", "predicted", "measured"]


def default_history_path() -> Path:
    if os.environ.get(HISTORY_ENV):
        return Path(os.environ[HISTORY_ENV])
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierwise")) / "history.sqlite"


@dataclass(frozen=True, slots=True)
class History:
    runs: pd.DataFrame
    """Long format: one row per (run, metric) with `predicted` and `measured` values."""
    message: str
    """Why there is nothing to show, or what was skipped; empty when every row was read."""


def _empty(message: str) -> History:
    return History(runs=pd.DataFrame(columns=COLUMNS), message=message)


def read_history(path: Path) -> History:
    if not path.is_file():
        return _empty(f"No runs recorded yet (no run history at {path}).")
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if TABLE not in tables:
                return _empty(f"No runs recorded yet ({path} has no `{TABLE}` table).")
            columns = [row[1] for row in db.execute(f"PRAGMA table_info({TABLE})")]
            plan_col = next((c for c in PLAN_COLUMNS if c in columns), None)
            profile_col = next((c for c in PROFILE_COLUMNS if c in columns), None)
            if plan_col is None or profile_col is None:
                return _empty(
                    f"Run history {path}: table `{TABLE}` has columns {', '.join(columns)}; expected "
                    f"`{PLAN_COLUMNS[0]}` and `{PROFILE_COLUMNS[0]}` (JSON text)."
                )
            created = "created_at" if "created_at" in columns else "NULL"
            ident = "run_id" if "run_id" in columns else "rowid"
            rows = db.execute(f"SELECT {ident}, {created}, {plan_col}, {profile_col} FROM {TABLE} ORDER BY rowid").fetchall()
    except sqlite3.Error as exc:
        return _empty(f"Cannot read run history {path}: {exc}")
    records: list[dict[str, Any]] = []
    skipped = []
    for run, created_at, plan_text, profile_text in rows:
        try:
            records += _records(run, created_at, json.loads(plan_text), json.loads(profile_text))
        except (TypeError, ValueError, KeyError, AttributeError):
            skipped.append(str(run))
    if not rows:
        return _empty(f"No runs recorded yet (table `{TABLE}` in {path} is empty).")
    message = f"Skipped {len(skipped)} unreadable run(s): {', '.join(skipped[:10])}." if skipped else ""
    return History(runs=pd.DataFrame(records, columns=COLUMNS), message=message)


def _records(run: Any, created_at: Any, plan: dict[str, Any], profile: dict[str, Any]) -> list[dict[str, Any]]:
    predicted, measured = plan["prediction"], profile["measured"]
    placement = plan.get("placement", {})
    common = {
        "run": str(run),
        "created_at": created_at,
        "model": plan["model"].get("name", ""),
        "num_gpus": plan.get("num_gpus"),
        "strategy": plan.get("strategy", ""),
        "placement": " ".join(f"{k}={v}" for k, v in placement.items()),
    }
    out = []
    pairs = [(m, predicted.get(m), measured.get(m)) for m in METRICS]
    pairs += [(f"peak_bytes.{t}", predicted.get("peak_bytes", {}).get(t), measured.get("peak_bytes", {}).get(t))
              for t in TIERS]
    for metric, pred_value, meas_value in pairs:
        if isinstance(pred_value, int | float) and isinstance(meas_value, int | float):
            out.append({**common, "metric": metric, "predicted": float(pred_value), "measured": float(meas_value)})
    return out
