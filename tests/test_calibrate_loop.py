"""The closed loop as a new user walks it: probe, fit a pinned tiny model, run, compare, calibrate,
compare again. Timing accuracy is the sweep benchmark's business (benchmarks/sweep.py); here the
comparison must be complete and finite, and the runtime's buffers must match the memory bill
(deterministic, so asserted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.calibration.calibrate import _nnls, calibrate
from planner.specs.plan import load_plan
from planner.specs.profile import load_profile
from tierwise.cli import app

runner = CliRunner()
MODEL = ["--layers", "2", "--hidden", "128", "--heads", "4", "--seq", "32", "--vocab", "256"]


def _cli(*args: str) -> str:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_nnls_is_exact_and_non_negative() -> None:
    # y = 2 a + 0 b exactly; an unconstrained fit of the noisy column would go negative.
    rows = [[1.0, 1.0], [2.0, 0.5], [3.0, 2.0]]
    theta, err = _nnls(rows, [2.0, 4.0, 6.0])
    assert theta == pytest.approx([2.0, 0.0]) and err == pytest.approx(0.0, abs=1e-12)
    theta, _ = _nnls([[1.0, -1.0], [1.0, -2.0]], [1.0, 0.5])
    assert min(theta) >= 0


@pytest.mark.slow
def test_new_user_probe_fit_run_compare_calibrate(tmp_path: Path) -> None:
    hw, plan_path, profile_path = tmp_path / "hw.json", tmp_path / "plan.json", tmp_path / "run.json"
    # One training per reference run: the loop is under test here, the median's spread in test_calibrate_probe.py.
    _cli("probe", "--calibrate", "--repeats", "1", "--out", str(hw), "--nvme-test-gib", "0.0625",
         "--nvme-path", str(tmp_path))
    probed = json.loads(hw.read_text())
    assert probed["host_is_device"] is True  # no CUDA here, so the probe calibrated on its reference runs
    assert "Calibrated on 4 reference runs of the runtime" in probed["notes"]
    assert "one training each" in probed["notes"]
    _cli("fit", *MODEL, "--hardware", str(hw), "--batch-per-gpu", "2", "--recompute-interval", "1",
         "--placement", "params=cpu,gradients=cpu,optimizer_states=cpu,recompute_inputs=cpu",
         "--tiling-factor", "1", "--prefetch-depth", "2", "--out", str(plan_path))
    _cli("run", str(plan_path), "--steps", "3", "--profile-out", str(profile_path), "--store", str(tmp_path / "h.sqlite"))

    rows = json.loads(_cli("compare", str(plan_path), str(profile_path), "--json"))["metrics"]
    by_metric = {r["metric"]: r for r in rows}
    for metric in ("iteration_time_s", "phase_time_s.forward", "phase_time_s.backward", "phase_time_s.optimizer"):
        err = by_metric[metric]["relative_error"]
        assert err is not None and math.isfinite(err), metric
    # The host store holds exactly what the bill says the runtime holds (model states as the
    # runtime keeps them, recompute inputs); the device tier holds no runtime buffer on one CPU rank.
    assert by_metric["runtime_buffer_peak_bytes.cpu"]["relative_error"] == pytest.approx(0, abs=0.03)
    assert by_metric["runtime_buffer_peak_bytes.gpu"]["predicted"] == by_metric["runtime_buffer_peak_bytes.gpu"]["measured"] == 0
    assert by_metric["link_bytes.h2d"]["predicted"] == by_metric["link_bytes.h2d"]["measured"] == 0

    calibrated = tmp_path / "hw-calibrated.json"
    out = json.loads(_cli("calibrate", str(profile_path), "--hardware", str(hw), "--out", str(calibrated), "--json"))
    assert out["num_rows"] == 3 and math.isfinite(out["residual"])
    # One profile's three phases leave no degrees of freedom for errors: null, never NaN in the JSON.
    assert set(out["standard_errors"]) <= set(out["factors"])
    assert all(se is None or (math.isfinite(se) and se >= 0) for se in out["standard_errors"].values())
    assert out["loose_factors"] == []  # nothing is judged without degrees of freedom
    after = json.loads(_cli("compare", str(plan_path), str(profile_path), "--hardware", str(calibrated), "--json"))
    err = {r["metric"]: r for r in after["metrics"]}["iteration_time_s"]["calibrated_relative_error"]
    assert err is not None and math.isfinite(err)

    # The fit on its own run reproduces that run's phases as well as the linear model allows.
    result = calibrate([(load_plan(plan_path), load_profile(profile_path))], load_plan(plan_path).node)
    assert result.residual == pytest.approx(out["residual"])
    history = _cli("history", "--store", str(tmp_path / "h.sqlite"))
    assert "1" in history
