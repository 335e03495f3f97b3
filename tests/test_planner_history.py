"""Run history: append runs, read them back with pandas, exactly."""

import json

import pytest

from planner.search.search import predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.history import COLUMN_NAMES, RunHistory
from planner.specs.plan import STRATEGY_TABLE, Plan


def _plan():
    return predict(Plan(model=resolve_model("paper-1.4b"), node=resolve_hardware("dgx-h100"), num_gpus=8,
                        strategy="zero-inf-cpu", placement=STRATEGY_TABLE["zero-inf-cpu"].placement))


def test_append_and_read_back(tmp_path):
    store = RunHistory(tmp_path / "h.sqlite")
    plan = _plan()
    profile = {"measured": {"iteration_time_s": 1.5, "tflops_per_gpu": 12.0, "peak_bytes": {"gpu": 10, "cpu": 20, "nvme": 0}},
               "losses": [3.0, 2.5]}
    first = store.append(plan, profile)
    second = store.append(plan, {"measured": {"iteration_time_s": 1.25}})
    assert (first, second) == (1, 2)
    frame = RunHistory(tmp_path / "h.sqlite").to_frame()
    assert list(frame.columns) == ["id", *COLUMN_NAMES]
    assert frame["measured_iteration_time_s"].tolist() == [1.5, 1.25]
    assert frame["predicted_iteration_time_s"].tolist() == [plan.prediction.iteration_time_s] * 2
    assert frame.loc[0, "measured_peak_cpu_bytes"] == 20
    assert frame.loc[0, "optimizer_states_tier"] == "cpu"
    assert Plan.from_dict(json.loads(frame.loc[0, "plan_json"])) == plan
    assert json.loads(frame.loc[0, "profile_json"])["losses"] == [3.0, 2.5]


def test_unusable_store_path_is_a_user_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PlannerError, match="cannot open run history"):
        RunHistory(blocker / "h.sqlite")


def test_history_command(tmp_path):
    import subprocess
    import sys

    store = tmp_path / "h.sqlite"
    cmd = [sys.executable, "-m", "tierwise", "history", "--store", str(store)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "no runs recorded yet" in out
    RunHistory(store).append(_plan(), {"measured": {"iteration_time_s": 2.0}})
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "paper-1.4b" in out and "dgx-h100" in out
    rows = json.loads(subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout)
    assert rows[0]["measured_iteration_time_s"] == 2.0


def test_compare_history_and_dashboard_share_one_error_definition(tmp_path):
    """One run, three views, one number: (predicted - measured) / measured, said in the output."""
    import subprocess
    import sys

    from app.history import read_history
    from planner.specs.plan import Prediction
    from planner.specs.profile import Profile

    plan = _plan()
    measured = plan.prediction.iteration_time_s * 4  # the planner predicted a quarter: -75.0%
    profile = Profile(measured=Prediction(feasible=True, iteration_time_s=measured, tflops_per_gpu=1.0,
                                          tokens_per_s=1.0, method="measured"), samples=(), warmup_steps=0,
                      details={"device": "cpu"})
    plan.save(tmp_path / "plan.json")
    profile.save(tmp_path / "profile.json")
    store = tmp_path / "h.sqlite"
    RunHistory(store).append(plan, profile.to_dict())
    env_cmd = [sys.executable, "-m", "tierwise"]
    compare_out = subprocess.run(env_cmd + ["compare", str(tmp_path / "plan.json"), str(tmp_path / "profile.json")],
                                 capture_output=True, text=True, check=True).stdout
    history_out = subprocess.run(env_cmd + ["history", "--store", str(store)], capture_output=True, text=True,
                                 check=True).stdout
    for out in (compare_out, history_out):
        assert "-75.0%" in out and "(predicted - measured) / measured" in out
    assert "predicted for hardware dgx-h100, measured on device cpu" in compare_out  # which spec, which device
    assert "the run used the CPU but the prediction is for dgx-h100's GPUs" in " ".join(compare_out.split())
    compare_doc = json.loads(subprocess.run(
        env_cmd + ["compare", str(tmp_path / "plan.json"), str(tmp_path / "profile.json"), "--json"],
        capture_output=True, text=True, check=True).stdout)
    assert compare_doc["hardware"] == {"predicted": "dgx-h100", "measured_device": "cpu"}
    row = {r["metric"]: r for r in compare_doc["metrics"]}["iteration_time_s"]
    assert row["relative_error"] == pytest.approx(-0.75)
    runs = read_history(store).runs.set_index("metric")
    assert runs.loc["iteration_time_s", "error"] == pytest.approx(-0.75)


def test_the_sequence_has_its_own_column_and_older_names_lose_it(tmp_path):
    """A history written when the sequence was part of the model's name (schema version 2) reads
    with the name short and the sequence in `seq_len`, taken from the run's plan."""
    import sqlite3

    from planner.specs.history import SCHEMA_VERSION, short_model_name

    store = tmp_path / "h.sqlite"
    plan = _plan()
    RunHistory(store).append(plan, {"measured": {"iteration_time_s": 2.0}})
    old_name = "config.json (qwen2; context 32768, planned at seq 8192) (with seq_len=256)"
    with sqlite3.connect(store) as con:  # as version 2 wrote it: no seq_len, the sequence in the name
        con.execute("UPDATE runs SET seq_len = NULL, model_name = ?", (old_name,))
        con.execute("PRAGMA user_version = 2")
    frame = RunHistory(store).to_frame()
    assert frame.loc[0, "model_name"] == "config.json (qwen2)"
    assert frame.loc[0, "seq_len"] == plan.model.seq_len
    with sqlite3.connect(store) as con:
        assert con.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    assert short_model_name("llama (with num_layers=4, seq_len=256)") == "llama (with num_layers=4)"
    assert short_model_name("llama (with seq_len=256, num_layers=4)") == "llama (with num_layers=4)"
    out = subprocess_history(store)
    assert "seq" in out and str(plan.model.seq_len) in out and "planned at seq" not in out


def subprocess_history(store):
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tierwise", "history", "--store", str(store)], capture_output=True,
                          text=True, check=True, env=env).stdout
