"""The run-history reader: what it reads, and what it says when there is nothing (yet) to read."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.history import default_history_path, read_history

SCRIPT = str(Path(__file__).resolve().parent.parent / "app" / "dashboard.py")

PLAN = {
    "model": {"name": "tiny"}, "num_gpus": 1, "strategy": "zero-inf-nvme",
    "placement": {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "activation_checkpoints": "cpu"},
    "prediction": {"feasible": True, "iteration_time_s": 2.0, "tflops_per_gpu": 0.5, "tokens_per_s": 100.0,
                   "peak_bytes": {"gpu": 1000, "cpu": 2000, "nvme": 3000}},
}
PROFILE = {"measured": {"feasible": True, "iteration_time_s": 2.2, "tflops_per_gpu": 0.45, "tokens_per_s": 91.0,
                        "peak_bytes": {"gpu": 1100, "cpu": 1900, "nvme": 3000}}}


def make_db(path, rows, columns=("run_id", "created_at", "plan", "profile")):
    with sqlite3.connect(path) as db:
        db.execute(f"CREATE TABLE runs ({', '.join(c + ' TEXT' for c in columns)})")
        db.executemany(f"INSERT INTO runs VALUES ({', '.join('?' for _ in columns)})", rows)


def test_default_path_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERWISE_HISTORY", str(tmp_path / "h.sqlite"))
    assert default_history_path() == tmp_path / "h.sqlite"
    monkeypatch.delenv("TIERWISE_HISTORY")
    assert default_history_path().name == "history.sqlite"


def test_no_file(tmp_path):
    history = read_history(tmp_path / "missing.sqlite")
    assert history.runs.empty and history.message.startswith("No runs recorded yet (no run history at")


def test_no_runs_table_and_an_empty_table(tmp_path):
    path = tmp_path / "h.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE other (x)")
    assert "has no `runs` table" in read_history(path).message
    path2 = tmp_path / "h2.sqlite"
    make_db(path2, [])
    assert read_history(path2).message == f"No runs recorded yet (table `runs` in {path2} is empty)."


def test_wrong_columns_are_named(tmp_path):
    path = tmp_path / "h.sqlite"
    make_db(path, [], columns=("id", "stuff"))
    message = read_history(path).message
    assert "has columns id, stuff; expected `plan` and `profile`" in message


def test_not_sqlite(tmp_path):
    path = tmp_path / "h.sqlite"
    path.write_text("not a database")
    assert read_history(path).message.startswith(f"Cannot read run history {path}:")


def test_reads_predicted_and_measured_pairs(tmp_path):
    path = tmp_path / "h.sqlite"
    make_db(path, [("r1", "2026-11-22T01:00", json.dumps(PLAN), json.dumps(PROFILE)),
                   ("r2", "2026-11-22T01:05", "{not json", json.dumps(PROFILE))])
    history = read_history(path)
    assert history.message == "Skipped 1 unreadable run(s): r2."
    runs = history.runs.set_index("metric")
    assert list(runs.index) == ["iteration_time_s", "tflops_per_gpu", "tokens_per_s", "peak_bytes.gpu",
                                "peak_bytes.cpu", "peak_bytes.nvme"]
    assert runs.loc["iteration_time_s", ["predicted", "measured"]].tolist() == [2.0, 2.2]
    assert runs.loc["peak_bytes.cpu", ["predicted", "measured"]].tolist() == [2000.0, 1900.0]
    assert set(runs["run"]) == {"r1"} and set(runs["strategy"]) == {"zero-inf-nvme"}


@pytest.mark.parametrize("columns", [("plan_json", "profile_json"), ("plan", "profile")])
def test_dashboard_panel_plots_the_history(monkeypatch, tmp_path, columns):
    path = tmp_path / "h.sqlite"
    make_db(path, [(json.dumps(PLAN), json.dumps(PROFILE))], columns=columns)
    monkeypatch.setenv("TIERWISE_HISTORY", str(path))
    at = AppTest.from_file(SCRIPT, default_timeout=120)
    at.session_state["panel"] = "Predicted vs measured"
    at.run()
    assert not at.exception and not at.error
    panel = next(t for t in at.tabs if t.label == "Predicted vs measured")
    assert len(panel.get("vega_lite_chart")) == 1
    table = panel.dataframe[0].value
    assert table.loc[table["metric"] == "iteration_time_s", ["predicted", "measured"]].values.tolist() == [[2.0, 2.2]]
    panel.selectbox(key="history_metric").set_value("peak_bytes.gpu").run()
    spec = json.loads(next(t for t in at.tabs if t.label == "Predicted vs measured").get("vega_lite_chart")[0].proto.spec)
    assert "peak_bytes.gpu" in json.dumps(spec)
