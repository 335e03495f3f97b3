"""What `planner run` says while it runs (tierwise/cli/run_progress.py), and the real CLI saying it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from tierwise.cli.run_progress import (
    EVERY_LOSS_STEPS,
    WIDTH,
    RunProgress,
    format_duration,
    loss_curve,
    sparkline,
)

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _progress(steps: int, predicted: float | None, plan_step: float | None = None) -> tuple[RunProgress, io.StringIO, Clock]:
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, width=WIDTH, force_terminal=False)
    progress = RunProgress(console=console, steps=steps, predicted_step_s=predicted,
                           plan_step_s=predicted if plan_step is None else plan_step, hardware=" for dgx-h100",
                           replan_hint="Plan for this machine: planner fit MODEL --hardware local.", clock=clock)
    return progress, out, clock


def test_stages_then_steps_with_the_time_left_from_the_plan_then_from_the_steps():
    progress, out, clock = _progress(steps=4, predicted=0.5)
    progress.started(2)
    clock.now += 3
    progress.stage("building the model on the meta device")
    progress.training(1)
    progress.step(1, 5.5, 0.6)
    progress.step(2, 5.0, 0.4)
    progress.step(3, 4.5, 0.5)
    progress.step(4, 4.0, 0.5)
    progress.finished()
    lines = out.getvalue().splitlines()
    assert lines[0] == "starting 2 worker process(es) with torchrun (each imports torch, then builds the model)"
    assert lines[1] == "  building the model on the meta device  [3.0 s since start]"
    assert lines[2] == "  training steps 1-4; about 2.0 s at the plan's 0.5 s per step  [3.0 s since start]"
    assert lines[3] == "step 1/4  loss 5.5000  0.6 s/step  1.8 s left"  # from the first step alone
    assert lines[4] == "step 2/4  loss 5.0000  0.4 s/step  0.8 s left"  # the first step left out from here on
    assert lines[-1] == "loss by step: 5.5 5 4.5 4"
    assert not any("warning" in line for line in lines)


def test_a_first_step_far_slower_than_the_plan_says_so_once_with_both_numbers():
    progress, out, _ = _progress(steps=10, predicted=None, plan_step=0.04)
    progress.started(1)
    progress.training(1)
    progress.step(1, 5.5, 12.0)
    progress.step(2, 5.4, 12.0)
    text = out.getvalue()
    assert "training steps 1-10  [" in text  # a plan for other hardware gives no estimate before a step
    warning = [line for line in text.splitlines() if line.startswith("warning:")]
    assert warning == ["warning: the first step took 12 s, 300x the 0.04 s per step the plan predicts for dgx-h100; "
                       "the run will take about 1:48 min more. Plan for this machine: planner fit MODEL --hardware "
                       "local."]


def test_long_runs_print_a_bounded_number_of_step_lines_and_a_fitting_sparkline():
    progress, out, clock = _progress(steps=1000, predicted=0.01)
    progress.started(1)
    progress.training(1)
    for step in range(1, 1001):
        clock.now += 0.01
        progress.step(step, 10.0 / step, 0.01)
    progress.finished()
    step_lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert 20 <= len(step_lines) <= 45 and step_lines[-1].startswith("step 1000/1000")
    curve = out.getvalue().splitlines()[-1]
    assert curve.startswith("loss ▁") is False and curve.startswith("loss █")  # falling loss: high first
    assert len(curve) <= WIDTH and curve.endswith("min 0.01 max 10 last 0.01")


def test_a_quiet_slow_run_still_prints_a_line_every_few_seconds():
    progress, out, clock = _progress(steps=1000, predicted=None)
    progress.started(1)
    progress.training(1)
    progress.step(1, 5.0, 20.0)
    clock.now += 20
    progress.step(2, 5.0, 20.0)  # not a 40th step, but 20 s since the last line
    assert "step 2/1000" in out.getvalue()


def test_loss_curve_and_durations():
    assert loss_curve([3.0, 2.0]) == "loss by step: 3 2"
    long = [float(v) for v in range(EVERY_LOSS_STEPS + 1, 0, -1)]
    assert loss_curve(long).startswith("loss █") and loss_curve(long).endswith("min 1 max 11 last 1")
    assert sparkline([1.0, 1.0], 10) == "▁▁" and sparkline([0.0, 1.0, 2.0, 3.0], 2) == "▁█"
    assert [format_duration(s) for s in (0.25, 42.0, 125.0, 3725.0)] == ["0.2 s", "42 s", "2:05 min", "1:02:05"]


@pytest.mark.slow
def test_planner_run_says_each_stage_and_step_and_the_loss_curve(tmp_path):
    """The real CLI: the first line comes before torch is imported, then the workers' stages, a line per
    step with its loss and the time left, and every step's loss at the end."""
    from runtime_support import ALL_CPU, plan_doc

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plan_doc(placement=ALL_CPU)))
    proc = subprocess.Popen([sys.executable, "-m", "tierwise", "run", str(plan), "--steps", "3", "--no-history"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    lines = [line for line in err.splitlines() if not line.startswith("warning: this machine")]
    assert lines[0] == f"planner run {plan}: 3 step(s); checking the plan against this machine"
    assert any(line.startswith("starting 1 worker process(es) with torchrun") for line in lines)
    assert any(line.startswith("  building the model on the meta device  [") for line in lines)
    assert any(line.startswith("  materialising the model unit by unit (") for line in lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(" s/step  " in line and line.endswith(" left") for line in steps)
    curve = next(line for line in lines if line.startswith("loss by step: "))
    assert len(curve.split()) == 3 + 3


def test_counted_progress_says_the_total_and_the_time_left():
    from tierwise.cli.counted import LINES, Counted

    out, clock = io.StringIO(), Clock()
    counted = Counted(100, "predicting published runs", stream=out, clock=clock)
    for i in range(100):
        clock.now += 0.5
        counted.done(f"p{i:03d}")
    lines = out.getvalue().splitlines()
    assert lines[0] == "predicting published runs: 100 to do"
    assert lines[1] == "  5/100 p004  [2.5 s so far, 48 s left]"
    assert lines[-1] == "  100/100 p099  [50 s so far, 0.0 s left]" and len(lines) == 1 + LINES


def test_planner_validate_shows_its_progress_on_stderr_with_a_total():
    done = subprocess.run([sys.executable, "-m", "tierwise", "validate", "--gpu", "H200", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)  # stdout stays one JSON document
    lines = done.stderr.splitlines()
    total = int(lines[0].split(": ")[1].split()[0])
    assert lines[0] == f"predicting published runs: {total} to do"
    assert lines[-1].startswith(f"  {total}/{total} ") and lines[-1].endswith(" left]")


def test_a_long_silent_stage_gets_a_still_line():
    from tierwise.cli.run_progress import HEARTBEAT_S

    progress, out, clock = _progress(steps=2, predicted=None)
    progress.started(1)
    progress.stage("materialising the model unit by unit (24 layers)")
    clock.now += HEARTBEAT_S - 1
    progress.heartbeat()
    assert "still" not in out.getvalue()
    clock.now += 1
    progress.heartbeat()
    assert out.getvalue().splitlines()[-1] == ("  still materialising the model unit by unit (24 layers)  "
                                               f"[{HEARTBEAT_S:.0f} s since start]")
    progress.training(1)
    progress.step(1, 5.0, 40.0)
    clock.now += HEARTBEAT_S
    progress.heartbeat()
    assert out.getvalue().splitlines()[-1].startswith("  still on step 2 of 2  [")
