"""Run history: every `planner run` appends its plan, prediction and measured profile to SQLite.

One row per run, with the headline numbers in columns (for pandas and the dashboard) and the full
plan and profile documents as JSON text (nothing is ever unpickled). The default store lives in the
user's cache directory; `--store` chooses another file.
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.specs.tiers import TIERS

SCHEMA_VERSION = 3
"""2: the columns of OLD_COLUMNS renamed ([Note: old spellings] in planner/specs/plan.py). 3: the
sequence in a column of its own (`seq_len`), out of the model's name (OLD_NAME_PARTS)."""
_PEAK_TIERS = tuple(TIERS)
"""The tiers whose peaks have columns: those defined with the planner (a tier a test registers later
is in the JSON columns only)."""
_COLUMNS: tuple[tuple[str, str], ...] = (
    ("recorded_at", "TEXT NOT NULL"),
    ("model_name", "TEXT"),
    ("num_params", "INTEGER"),
    ("seq_len", "INTEGER"),
    ("hardware_name", "TEXT"),
    ("num_gpus", "INTEGER"),
    ("strategy", "TEXT"),
    ("params_tier", "TEXT"),
    ("gradients_tier", "TEXT"),
    ("optimizer_states_tier", "TEXT"),
    ("recompute_inputs_tier", "TEXT"),
    ("micro_batch_per_gpu", "REAL"),
    ("recompute_interval", "INTEGER"),
    ("tiling_factor", "INTEGER"),
    ("prefetch_depth", "INTEGER"),
    ("precision", "TEXT"),
    ("prediction_method", "TEXT"),
    ("predicted_iteration_time_s", "REAL"),
    ("measured_iteration_time_s", "REAL"),
    ("predicted_tflops_per_gpu", "REAL"),
    ("measured_tflops_per_gpu", "REAL"),
    *((f"predicted_peak_{tier}_bytes", "INTEGER") for tier in _PEAK_TIERS),
    *((f"measured_peak_{tier}_bytes", "INTEGER") for tier in _PEAK_TIERS),
    ("plan_json", "TEXT NOT NULL"),
    ("profile_json", "TEXT NOT NULL"),
)
COLUMN_NAMES: tuple[str, ...] = tuple(name for name, _ in _COLUMNS)
OLD_COLUMNS = {"activation_checkpoints_tier": "recompute_inputs_tier", "checkpoint_interval": "recompute_interval"}
"""Columns of a history of schema version 1, renamed in place when it is opened."""


OLD_NAME_PARTS = (re.compile(r"; context \d+, planned at seq \d+"), re.compile(r" \(with seq_len=\d+\)"),
                  re.compile(r"(?<=\(with )seq_len=\d+, |, seq_len=\d+(?=[,)])"))
"""What a model name of schema version 2 or older said about the sequence, now the `seq_len` column."""


def short_model_name(name: str) -> str:
    """A model name without the sequence older versions wrote into it (OLD_NAME_PARTS)."""
    for part in OLD_NAME_PARTS:
        name = part.sub("", name)
    return name


def _move_old_sequences(con: sqlite3.Connection) -> None:
    """Rows written before the `seq_len` column take it from their plan, and lose it from their name."""
    rows = con.execute("SELECT id, model_name, plan_json FROM runs WHERE seq_len IS NULL").fetchall()
    for run_id, name, plan_json in rows:
        try:
            seq_len = json.loads(plan_json)["model"]["seq_len"]
        except (ValueError, KeyError, TypeError):
            seq_len = None
        con.execute("UPDATE runs SET seq_len = ?, model_name = ? WHERE id = ?",
                    (seq_len, short_model_name(name or ""), run_id))


def _rename_old_columns(con: sqlite3.Connection) -> None:
    """A history written before the recompute renames keeps its rows; its columns take the new names."""
    have = {row[1] for row in con.execute("PRAGMA table_info(runs)")}
    for old, new in OLD_COLUMNS.items():
        if old in have and new not in have:
            con.execute(f"ALTER TABLE runs RENAME COLUMN {old} TO {new}")


def default_cache_dir() -> Path:
    """The user's cache directory for tierwise (the run history, the local hardware's probe)."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("tierwise"))


def default_store_path() -> Path:
    return default_cache_dir() / "history.sqlite"


class RunHistory:
    """A SQLite file of runs. Opening it creates the table if needed."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_store_path()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as con:
                columns = ", ".join(f"{name} {kind}" for name, kind in _COLUMNS)
                con.execute(f"CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT, {columns})")
                _rename_old_columns(con)
                # A file written before a tier was added lacks its peak columns: add them (empty for old runs).
                present = {row[1] for row in con.execute("PRAGMA table_info(runs)")}
                for name, kind in _COLUMNS:
                    if name not in present:
                        con.execute(f"ALTER TABLE runs ADD COLUMN {name} {kind}")
                _move_old_sequences(con)
                con.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except (OSError, sqlite3.Error) as exc:
            raise PlannerError(f"cannot open run history {self.path}: {exc}") from None

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.path, timeout=30)

    def append(self, plan: Plan, profile: Mapping[str, Any]) -> int:
        """Record one run; `profile` is the profile document (its `measured` block is read)."""
        measured = profile.get("measured", {}) if isinstance(profile, Mapping) else {}
        pred = plan.prediction
        row: dict[str, Any] = {
            "recorded_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model_name": plan.model.name,
            "num_params": plan.model.num_params,
            "seq_len": plan.model.seq_len,
            "hardware_name": plan.node.name,
            "num_gpus": plan.num_gpus,
            "strategy": plan.strategy,
            **{f"{state}_tier": tier for state, tier in plan.placement.to_dict().items()},
            "micro_batch_per_gpu": plan.micro_batch_per_gpu,
            "recompute_interval": plan.recompute_interval,
            "tiling_factor": plan.tiling_factor,
            "prefetch_depth": plan.prefetch_depth,
            "precision": plan.precision,
            "prediction_method": pred.method if pred else None,
            "predicted_iteration_time_s": pred.iteration_time_s if pred else None,
            "measured_iteration_time_s": measured.get("iteration_time_s"),
            "predicted_tflops_per_gpu": pred.tflops_per_gpu if pred else None,
            "measured_tflops_per_gpu": measured.get("tflops_per_gpu"),
            "plan_json": json.dumps(plan.to_dict()),
            "profile_json": json.dumps(dict(profile)),
        }
        for tier in _PEAK_TIERS:
            row[f"predicted_peak_{tier}_bytes"] = pred.peak_bytes.get(tier) if pred else None
            row[f"measured_peak_{tier}_bytes"] = (measured.get("peak_bytes") or {}).get(tier)
        names = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        try:
            with self._connect() as con:
                cursor = con.execute(f"INSERT INTO runs ({names}) VALUES ({marks})", tuple(row.values()))
                return int(cursor.lastrowid)
        except sqlite3.Error as exc:
            raise PlannerError(f"cannot record the run in {self.path}: {exc}") from None

    def to_frame(self):
        """All runs as a pandas DataFrame (JSON columns left as text), oldest first."""
        import pandas as pd

        with self._connect() as con:
            # Named columns: a file from before a column was added has it last, the frame never does.
            return pd.read_sql_query(f"SELECT id, {', '.join(COLUMN_NAMES)} FROM runs ORDER BY id", con)
