"""The dashboard's view of the run history (planner/specs/history.py): read, never created or invented."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from app.history import default_history_path, read_history
from planner.search.search import predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.history import RunHistory, default_store_path
from planner.specs.plan import STRATEGY_TABLE, Plan

SCRIPT = str(Path(__file__).resolve().parent.parent / "app" / "dashboard.py")
PROFILE = {"measured": {"iteration_time_s": 2.2, "tflops_per_gpu": 0.45, "peak_bytes": {"gpu": 1100, "cpu": 1900, "nvme": 0}}}


def _plan():
    return predict(Plan(model=resolve_model("1.4B"), node=resolve_hardware("dgx-h100"), num_gpus=8,
                        strategy="zero-inf-cpu", placement=STRATEGY_TABLE["zero-inf-cpu"].placement))


def test_default_path_is_the_run_history_store_unless_overridden(monkeypatch, tmp_path):
    monkeypatch.delenv("TIERWISE_HISTORY", raising=False)
    assert default_history_path() == default_store_path()
    monkeypatch.setenv("TIERWISE_HISTORY", str(tmp_path / "h.sqlite"))
    assert default_history_path() == tmp_path / "h.sqlite"


def test_no_file_is_not_created(tmp_path):
    history = read_history(tmp_path / "missing.sqlite")
    assert history.runs.empty and history.message.startswith("No runs recorded yet (no run history at")
    assert not (tmp_path / "missing.sqlite").exists()


def test_empty_store_and_runs_without_measurements(tmp_path):
    path = tmp_path / "h.sqlite"
    RunHistory(path)
    assert read_history(path).message == f"No runs recorded yet (the run history at {path} is empty)."
    RunHistory(path).append(_plan(), {"measured": {}})
    assert read_history(path).message == f"The 1 run(s) in {path} have no measured numbers to compare."


def test_not_a_database(tmp_path):
    path = tmp_path / "h.sqlite"
    path.write_text("not a database")
    assert read_history(path).message.startswith(f"Cannot read run history {path}:")


def test_reads_the_pairs_each_run_recorded(tmp_path):
    path = tmp_path / "h.sqlite"
    plan = _plan()
    RunHistory(path).append(plan, PROFILE)
    RunHistory(path).append(plan, {"measured": {"iteration_time_s": 2.5}})
    history = read_history(path)
    assert history.message == ""
    runs = history.runs
    first = runs[runs["run"] == 1].set_index("metric")
    pred = plan.prediction
    assert list(first.index) == ["iteration_time_s", "tflops_per_gpu", "peak_bytes.gpu", "peak_bytes.cpu", "peak_bytes.nvme"]
    assert first.loc["iteration_time_s", ["predicted", "measured"]].tolist() == [pred.iteration_time_s, 2.2]
    assert first.loc["peak_bytes.cpu", ["predicted", "measured"]].tolist() == [pred.peak_bytes["cpu"], 1900.0]
    assert first.loc["iteration_time_s", "placement"] == "cpu/cpu/cpu/cpu"
    second = runs[runs["run"] == 2]
    assert second["metric"].tolist() == ["iteration_time_s"]  # nothing else was measured


def test_dashboard_panel_plots_the_history(monkeypatch, tmp_path):
    path = tmp_path / "h.sqlite"
    plan = _plan()
    RunHistory(path).append(plan, PROFILE)
    monkeypatch.setenv("TIERWISE_HISTORY", str(path))
    at = AppTest.from_file(SCRIPT, default_timeout=120)
    at.session_state["panel"] = "Predicted vs measured"
    at.run()
    assert not at.exception and not at.error
    panel = next(t for t in at.tabs if t.label == "Predicted vs measured")
    assert len(panel.get("vega_lite_chart")) == 1
    table = panel.dataframe[0].value
    assert table.loc[table["metric"] == "iteration time (s)", ["predicted", "measured"]].values.tolist() == [
        [f"{plan.prediction.iteration_time_s:,.4g}", "2.2"]]
    gpu_peak = table.loc[table["metric"] == "peak memory, GPU (per GPU) (GiB)", "measured"].item()
    assert gpu_peak == f"{1100 / 2**30:,.4g}"  # bytes shown in GiB, under the metric's name
    panel.selectbox(key="history_metric").set_value("peak_bytes.gpu").run()
    spec = json.dumps(json.loads(next(t for t in at.tabs if t.label == "Predicted vs measured")
                                 .get("vega_lite_chart")[0].proto.spec))
    assert "measured peak memory, GPU (per GPU) (GiB)" in spec and "peak_bytes" not in spec


@pytest.mark.parametrize("content", ["not a database"])
def test_dashboard_panel_reports_an_unreadable_history_in_one_line(monkeypatch, tmp_path, content):
    path = tmp_path / "h.sqlite"
    path.write_text(content)
    monkeypatch.setenv("TIERWISE_HISTORY", str(path))
    at = AppTest.from_file(SCRIPT, default_timeout=120)
    at.session_state["panel"] = "Predicted vs measured"
    at.run()
    assert not at.exception
    assert at.info[0].value.startswith(f"Cannot read run history {path}:") and "\n" not in at.info[0].value


def test_sqlite_is_only_read(tmp_path):
    path = tmp_path / "h.sqlite"
    RunHistory(path).append(_plan(), PROFILE)
    before = path.read_bytes()
    read_history(path)
    assert path.read_bytes() == before
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)


def test_a_table_without_the_store_columns_is_named(tmp_path):
    path = tmp_path / "h.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE runs (id INTEGER, plan TEXT)")
    message = read_history(path).message
    assert message.startswith(f"Cannot read run history {path}: its runs table lacks recorded_at, model_name")
