"""Profile documents (strict reading, round trip), compare, and the `planner run` CLI."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_support import ALL_CPU, plan_doc

from planner.calibration.compare import compare
from planner.search.search import predict
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan, Prediction
from planner.specs.profile import Profile, StepSample, load_profile

ROOT = Path(__file__).resolve().parents[1]


def _sample(step: int, loss: float) -> StepSample:
    return StepSample(step=step, step_time_s=0.5, loss=loss, phase_time_s={"forward": 0.1, "backward": 0.3, "optimizer": 0.1},
                      link_bytes={"all_gather": 10}, peak_bytes={"gpu": 100, "cpu": 200, "nvme": 0})


def _profile() -> Profile:
    measured = Prediction(feasible=True, iteration_time_s=0.5, tflops_per_gpu=1.0, tokens_per_s=64.0,
                          peak_bytes={"gpu": 100, "cpu": 200, "nvme": 0}, method="measured")
    return Profile(measured=measured, samples=(_sample(1, 4.0), _sample(2, math.nan)), warmup_steps=1)


def test_round_trip_keeps_everything_and_nan_loss_becomes_null(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    _profile().save(path)
    doc = json.loads(path.read_text())
    assert doc["losses"] == [4.0, None]
    back = load_profile(path)
    assert back.measured == _profile().measured
    assert back.samples[0] == _sample(1, 4.0)
    assert math.isnan(back.losses[1])


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda d: d.update(extra=1), "unknown key(s) 'extra'"),
    (lambda d: d.update(losses=[4.0]), "one loss per sample"),
    (lambda d: d["samples"][0].update(step_time_s=-1), "step_time_s must be at least 0"),
    (lambda d: d["measured"]["peak_bytes"].update(hbm=1), "unknown key(s) 'hbm'"),
    (lambda d: d.update(schema="other/1"), "schema"),
])
def test_strict_reading(mutate, message: str) -> None:  # noqa: ANN001
    doc = _profile().to_dict()
    mutate(doc)
    with pytest.raises(PlannerError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Profile.from_dict(doc)


def test_compare_reports_relative_error_per_metric() -> None:
    plan = predict(Plan.from_dict(plan_doc(placement=ALL_CPU)))
    rows = {r.metric: r for r in compare(plan, _profile())}
    row = rows["iteration_time_s"]
    assert row.measured == 0.5
    # One definition everywhere (compare, history, dashboard): (predicted - measured) / measured.
    assert row.relative_error == pytest.approx((plan.prediction.iteration_time_s - 0.5) / 0.5)
    assert rows["peak_bytes.nvme"].relative_error is None  # nothing measured


def _planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.parametrize(("knobs", "message"), [
    ({"placement": {**ALL_CPU, "recompute_inputs": "nvme"}, "nvme_path": "/tmp"},
     "recompute_inputs=nvme is not supported"),
    ({"num_gpus": 2}, "--nproc 1 x 1 node(s) starts 1 process(es)"),
])
def test_run_refuses_what_the_runtime_cannot_execute(tmp_path: Path, knobs: dict, message: str) -> None:
    doc = plan_doc(placement=ALL_CPU)
    doc.update(knobs)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    out = _planner("run", str(plan), "--steps", "1", "--nproc", "1", "--no-history")
    assert out.returncode == 1
    assert message in " ".join(out.stderr.split()) and "Traceback" not in out.stderr


@pytest.mark.slow
def test_run_two_processes_writes_a_profile_and_compare_reads_it(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    doc = plan_doc(world_size=2, placement=ALL_CPU, recompute_interval=1, micro_batch_per_gpu=2)
    doc["model"]["vocab_size"] = 0  # byte-level text: the reference GPT uses 256 tokens
    plan.write_text(json.dumps(doc))
    text = tmp_path / "data.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    profile = tmp_path / "profile.json"
    out = _planner("run", str(plan), "--steps", "3", "--data", str(text), "--profile-out", str(profile),
                   "--store", str(tmp_path / "runs.db"))
    assert out.returncode == 0, out.stderr[-2000:]
    prof = load_profile(profile)
    assert len(prof.losses) == 3 and all(math.isfinite(v) for v in prof.losses)
    assert prof.details["world_size"] == 2
    assert prof.measured.link_bytes["all_gather"] > 0 and prof.measured.link_bytes["reduce_scatter"] > 0
    assert prof.measured.memory_terms["cpu"]["params"] > 0
    cmp = _planner("compare", str(plan), str(profile), "--json")
    assert cmp.returncode == 0, cmp.stderr
    metrics = {m["metric"]: m for m in json.loads(cmp.stdout)["metrics"]}
    assert metrics["peak_bytes.cpu"]["measured"] == prof.measured.peak_bytes["cpu"]
