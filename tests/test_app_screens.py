"""Every number on the screen means one thing: the CLI and the dashboard report the same verdict for
the same inputs ([Note: one verdict] in planner/output/verdict.py), the bottleneck is the exposed
critical path ([Note: exposed critical path] in planner/output/critical_path.py), and no panel shows a
raw key, a placeholder or a CLI flag."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from search_support import refined, searched
from streamlit.testing.v1 import AppTest

from app.dashboard import TABS
from app.panels.memory import memory_frame
from app.state import Inputs, search_request
from app.words import in_words
from planner.output import report
from planner.output.critical_path import analytic_path
from planner.output.verdict import searcher, verdict
from planner.search.search import SearchRequest, predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.history import RunHistory
from planner.specs.training_loop import TrainingLoop

SCRIPT = str(Path(__file__).resolve().parent.parent / "app" / "dashboard.py")
FORBIDDEN = re.compile(r"peak_bytes\.|\bNone\b|\bnan\b|\bNaN\b|(?<![\w-])--[a-z]")
"""Raw history keys, placeholders, and CLI flag names: none belongs on the page."""


def planner_fit(*args: str) -> str:
    env = {**os.environ, "COLUMNS": "250"}  # one line per sentence, as the page shows it
    proc = subprocess.run([sys.executable, "-m", "tierwise", "fit", *args], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def request(model: str, gpus: int, hardware: str = "dgx-h100", optimizer_step: str | None = None,
            **kw) -> SearchRequest:
    return SearchRequest(model=resolve_model(model), node=resolve_hardware(hardware), num_gpus=gpus,
                         training=TrainingLoop(optimizer_step=optimizer_step), **kw)


def dashboard(monkeypatch, tmp_path, **widgets) -> AppTest:
    monkeypatch.setenv("TIERWISE_HISTORY", str(tmp_path / "history.sqlite"))
    at = AppTest.from_file(SCRIPT, default_timeout=300)
    at.run()
    for key, value in widgets.items():
        widget = {"model": at.sidebar.text_input, "gpus": at.sidebar.number_input, "hardware": at.sidebar.selectbox,
                  "strategy": at.sidebar.selectbox, "seq": at.sidebar.number_input,
                  "optimizer_step": at.sidebar.selectbox}[key](key=key)
        widget.set_value(value)
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


# -- one source: the same inputs, the same words -------------------------------------------------


def test_cli_and_dashboard_count_the_same_plans(monkeypatch, tmp_path):
    # The page's request (app/state.py) and the CLI's apply one rule for the degrees not given
    # (planner.search.pins.parallel_degrees): the page used to search 3d pipelines the CLI does not.
    shown = verdict(refined(search_request(Inputs(model="7B", num_gpus=16))), lambda step: None)
    # Each layout priced with both optimizer-step schedules (the page said 814 of 926 layouts before one rule).
    assert shown.counts == "1116 feasible plans of 1340 evaluated"
    assert f"Verdict: {shown.headline()}" in planner_fit("7B", "--gpus", "16")
    at = dashboard(monkeypatch, tmp_path, model="7B")
    assert at.success[0].value == f"**Verdict:** {shown.headline()}"


def test_cli_and_dashboard_bill_the_same_node_share(monkeypatch, tmp_path):
    shown = verdict(refined(request("1T", 1)), lambda step: None)
    assert not shown.fits and shown.where == "1 GPU(s) of dgx-h100 (1 node(s) of 8)"  # the request's node
    assert shown.share_note.startswith("8-GPU node, using 1 GPU: 1/8 of its DRAM")
    out = planner_fit("1T", "--gpus", "1")
    assert f"Verdict: {shown.headline()}" in out and shown.share_note in out
    at = dashboard(monkeypatch, tmp_path, gpus=1)
    assert at.warning[0].value.startswith(f"**Verdict:** {shown.headline()}.")
    assert shown.share_note in [c.value for c in at.caption]


def test_the_exposed_optimizer_step_is_the_bottleneck_and_the_cheaper_schedule_is_named(monkeypatch, tmp_path):
    req = request("1T", 16, optimizer_step="after_backward")
    shown = verdict(refined(req), searcher(req))
    path = shown.path
    # The step after the backward, pinned: the GPU idles through it.
    assert path.bottleneck == "optimizer step"
    assert path.step_s == pytest.approx(shown.plan.prediction.phase_time_s["optimizer"], rel=1e-3)
    assert path.compute_s + path.waits_s + path.step_s == pytest.approx(path.iteration_s, rel=1e-9)
    assert next(iter(path.step_by)) == "NVMe"
    [cheaper] = shown.cheaper
    in_backward = refined(request("1T", 16, optimizer_step="in_backward")).best
    assert cheaper.optimizer_step == "in_backward"
    assert cheaper.plan.prediction.iteration_time_s == in_backward.prediction.iteration_time_s
    out = planner_fit("1T", "--gpus", "16", "--optimizer-step", "after_backward")
    assert f"Bottleneck {path.sentence()}" in out
    assert cheaper.line("--optimizer-step in_backward") in out
    assert "the optimizer step is exposed: 376.77 s of 855.25 s" in out
    assert "--optimizer-step in_backward predicts 480.18 s per iteration" in out
    at = dashboard(monkeypatch, tmp_path, optimizer_step="after_backward")
    assert {m.label: m.value for m in at.metric}["Bottleneck"] == path.bottleneck
    assert f"**Bottleneck:** {path.sentence()}" in [m.value for m in at.markdown]


def test_a_compute_bound_plan_names_compute():
    shown = verdict(refined(request("1T", 16, optimizer_step="in_backward")), lambda step: None)
    best = shown.plan
    assert shown.path.bottleneck == "GPU compute" and shown.cheaper == []
    # The analytic estimate gives the same split from its phases: its step overlaps the backward too.
    analytic = analytic_path(predict(best.replace(prediction=None)))
    assert analytic.bottleneck == "GPU compute" and analytic.step_s == 0.0


@pytest.mark.slow  # `planner fit 1T` in a subprocess, with the runner-ups simulated
def test_runner_ups_at_80_columns_show_simulated_times_and_the_batch():
    env = {**os.environ, "COLUMNS": "80"}
    out = subprocess.run([sys.executable, "-m", "tierwise", "fit", "1T", "--gpus", "16"], capture_output=True,
                         text=True, timeout=300, env=env).stdout
    table = out[out.index("Runner-up plans"):]
    assert ">=" not in table and "<=" not in table  # simulated like the winner, not analytic bounds
    assert "micro-batch" in table.splitlines()[2] and "15/GPU" in table


def test_a_3d_plan_says_its_micro_batch_per_replica():
    plan = searched(request("70B", 16, strategy="3d", model_parallel_degree=None, pipeline_parallel_degree=None)).best
    assert plan is not None and plan.gpus_per_replica > 1 and plan.micro_batch_per_gpu < 1
    words = report.batch_words(plan)
    assert words == f"{plan.micro_batch_per_gpu * plan.gpus_per_replica:g}/replica of {plan.gpus_per_replica} GPUs"
    assert f"micro-batch {words}" in report.plan_line(plan)


def test_flags_become_field_names():
    assert in_words("--gpus must be at least 1, got 0") == "Number of GPUs must be at least 1, got 0"
    assert in_words("use --no-calibrate") == "use no calibrate"
    assert in_words("a long-winded text") == "a long-winded text"


def test_memory_colours_are_a_hue_per_tier():
    import colorsys

    plan = refined(request("1T", 16)).best
    frame = memory_frame(plan)
    for tier, rows in frame.groupby("tier"):
        hues = {round(colorsys.rgb_to_hls(*(int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)))[0], 2) for c in rows["colour"]}
        assert len(hues) == 1, (tier, hues)
        assert list(rows["kind"]) == sorted(rows["kind"], key=["model state", "working memory", "runtime buffer",
                                                                 "allocator slack"].index)
    assert frame["colour"].is_unique


def test_a_cpu_only_machine_names_no_gpu_tier():
    plan = refined(request("gpt3-125m", 1, "cpu-dev-2core")).best
    names = [report.tier_name(t, plan.node) for t in plan.prediction.peak_bytes]
    assert not any(name.startswith("GPU") for name in names)
    assert report.device_word(plan.node) == "device"
    assert report.fmt_tflops(plan.prediction.tflops_per_gpu) != "0.0"


# -- every panel, as text: no raw key, placeholder or flag -----------------------------------------


def visible_text(at: AppTest) -> list[str]:
    """What a reader sees: every message, markdown, caption, metric, table cell and header."""
    texts = [e.value for kind in ("markdown", "caption", "success", "warning", "info", "error", "subheader", "header")
             for e in at.get(kind)]
    texts += [f"{m.label} {m.value}" for m in at.metric]
    for kind in ("dataframe", "table"):
        for frame in at.get(kind):
            value = frame.value
            texts += [str(c) for c in value.columns] + [str(i) for i in value.index if not isinstance(i, int)]
            texts += [str(cell) for cell in value.to_numpy().ravel()]
    for chart in at.get("vega_lite_chart"):
        texts += re.findall(r'"title": "([^"]*)"', chart.proto.spec)
    return texts


@pytest.mark.slow  # four dashboards, every panel: about a minute on 2 cores
@pytest.mark.parametrize("widgets", [
    {},  # 1T on 16 GPUs of a DGX H100: fits
    {"gpus": 1},  # does not fit, part of a node
    {"hardware": "cpu-dev-2core", "model": "gpt3-125m", "gpus": 1, "seq": 256},  # a CPU-only machine
    {"model": "70B", "strategy": "3d"},  # tensor and pipeline parallel: 1/replica of 16 GPUs
], ids=["1t-16", "1t-1", "cpu-only", "3d"])
def test_every_panel_shows_no_raw_key_placeholder_or_flag(monkeypatch, tmp_path, widgets):
    plan = refined(request("gpt3-125m", 1, "cpu-dev-2core", micro_batch_per_gpu=1)).best
    RunHistory(tmp_path / "history.sqlite").append(plan, {"measured": {
        "iteration_time_s": 0.5, "tflops_per_gpu": 0.05, "peak_bytes": {"gpu": 3473818, "cpu": 1900, "nvme": 0}}})
    at = dashboard(monkeypatch, tmp_path, **widgets)
    for label in TABS:
        at.session_state["panel"] = label
        at.run()
        assert not at.exception, (label, [e.value for e in at.exception])
        bad = sorted({text for text in visible_text(at) if FORBIDDEN.search(text)})
        assert not bad, (label, bad)
        if widgets.get("hardware") == "cpu-dev-2core" and label != "Predicted vs measured":
            assert not any("GPU tier" in t or t.startswith("GPU (") or "TFLOPS per GPU 0.0" in t
                           for t in visible_text(at)), label
