"""Terminal-width tables and the one bottleneck vocabulary (planner/output/report.py [Note: bottleneck labels])."""

import functools
import os
import subprocess
import sys

import pytest

from planner.output.report import RESOURCE_LABELS, WORK_LABELS, bottleneck_label
from planner.output.timeline import ROW_ORDER


@functools.cache  # `planner fit` is deterministic: tests asking for the same width read one run's output
def fit_output(columns: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns is not None:
        env["COLUMNS"] = columns
    proc = subprocess.run([sys.executable, "-m", "tierwise", "fit", "1T", "--gpus", "16"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.parametrize("columns", ["80", "100"])
def test_tables_fit_the_width_columns_asks_for(columns):
    out = fit_output(columns)
    assert max(len(line) for line in out.splitlines()) <= int(columns)
    assert "Runner-up plans" in out and "not shown at this width" in out


def test_piped_output_is_80_columns_without_columns_set():
    out = fit_output(None)
    assert max(len(line) for line in out.splitlines()) <= 80


def test_wide_terminal_shows_every_runner_up_column():
    out = fit_output("200")
    assert "predicted by" in out and "ci/tiling/prefetch" in out and "not shown" not in out
    assert max(len(line) for line in out.splitlines()) > 160  # not cut at 160 either


def test_one_bottleneck_vocabulary_for_analytic_and_simulated_names():
    assert bottleneck_label("compute") == bottleneck_label("gpu_compute") == "GPU compute"
    assert bottleneck_label("optimizer (nvme)").startswith(bottleneck_label("nvme"))
    assert bottleneck_label("optimizer (cpu)") == bottleneck_label("cpu_optimizer")
    assert set(ROW_ORDER) <= set(RESOURCE_LABELS)
    resources = set(RESOURCE_LABELS.values()) | {"PCIe"}
    for label in WORK_LABELS.values():
        assert label.split(" (")[0] in resources, label
    assert bottleneck_label("something new") == "something new"


def test_fit_tables_show_display_labels_not_json_values():
    out = fit_output("200")
    for raw in ("gpu_compute", "optimizer (nvme)", "│ compute "):
        assert raw not in out
    assert "NVMe" in out


@pytest.mark.parametrize(("model", "hardware", "gpus"), [("1.4B", "h200-x1", 1), ("1T", "dgx-h100", 16)])
def test_timeline_titles_and_legends_cover_no_ticks_or_bars(monkeypatch, tmp_path, model, hardware, gpus):
    import matplotlib.pyplot as plt

    from planner.output.timeline import draw
    from planner.search.search import SearchRequest, search
    from planner.sim import simulate
    from planner.specs.catalog import resolve_hardware, resolve_model

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to measure it
    plan = search(SearchRequest(model=resolve_model(model), node=resolve_hardware(hardware), num_gpus=gpus)).best
    draw(simulate(plan), tmp_path / "t.png")
    fig = figures[0]
    renderer = fig.canvas.get_renderer()
    full, zoom, gpu_ax, cpu_ax = fig.axes
    plots = [ax.get_window_extent(renderer) for ax in fig.axes]
    assert not zoom.title.get_window_extent(renderer).overlaps(full.xaxis.get_tightbbox(renderer))
    for ax in (zoom, gpu_ax, cpu_ax):
        legend = ax.get_legend().get_window_extent(renderer)
        assert not any(legend.overlaps(plot) for plot in plots)
        assert not legend.overlaps(zoom.title.get_window_extent(renderer))
    for upper, lower in zip(fig.axes, fig.axes[1:], strict=False):  # each chart's tick labels clear the next one's legend
        assert not upper.xaxis.get_tightbbox(renderer).overlaps(lower.get_legend().get_window_extent(renderer))
    plt.close(fig)


def test_analytic_runner_ups_are_bounds_beside_a_simulated_winner():
    from planner.output.report import bound_note, candidates_table, is_bound
    from planner.search.refine import refine
    from planner.search.search import SearchRequest, search
    from planner.specs.catalog import resolve_hardware, resolve_model

    result = refine(search(SearchRequest(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=16)))
    winner, runners = result.best, result.runners_up()
    assert winner.prediction.method == "simulated"
    assert [is_bound(p, winner) for p in runners] == [p.prediction.method == "analytic" for p in runners]
    assert any(is_bound(p, winner) for p in runners)
    assert bound_note(runners, winner).endswith("the simulated winner's tokens/s is above every bound")
    bound = next(p for p in runners if p.prediction.method == "analytic")
    faster = bound.replace(prediction=bound.prediction.__class__.from_dict(
        {**bound.prediction.to_dict(), "tokens_per_s": winner.prediction.tokens_per_s * 2}, "test"))
    assert "may still be slower: planner simulate it to compare" in bound_note([faster], winner)
    analytic_winner = winner.replace(prediction=bound.prediction)  # nothing simulated: nothing is a bound
    assert not any(is_bound(p, analytic_winner) for p in runners)
    assert candidates_table(runners, "t", 200, winner=analytic_winner).caption is None


def test_fit_simulates_runner_ups_like_its_winner():
    out = fit_output("200")
    # Numbers of the 1T plan on dgx-h100 (eager attention, the paper preset's; memory-bound kernels timed;
    # the preset's compute rates fitted on the published runs (docs/planner.md, Fitted presets), with NCCL's ring costs; the
    # fit frees only the numbers the rows pin down: plateau 0.583 of 989 TFLOPS, HBM share 0.866; eager attention's
    # products memory-bound at head_dim 160: planner/cost/kernels.py [Note: eager products on the roofline]). The
    # search steps the optimizer in backward (planner/specs/training_loop.py): 480.18 s simulated.
    # The runner-ups are simulated like the winner ([Note: runner-up bounds]): no analytic bound beside
    # it (zero-inf-nvme's bound was ">= 535.87 s"), and every row's iteration is beside its micro-batch.
    assert "Predicted (simulated)" in out and "480.18 s" in out
    table = out[out.index("Runner-up plans"):]
    assert "<=" not in table and ">=" not in table and "535.45 s" in table and "32/GPU" in table
    assert "analytic" not in table


@pytest.mark.parametrize("args", [["fit", "1T", "--gpus", "16"], ["memory", "1T"], ["models"], ["hardware", "dgx-h100"],
                                  ["simulate", "PLAN"]])
def test_no_table_cuts_a_word_at_80_columns(tmp_path, args):
    if args[-1] == "PLAN":
        plan = tmp_path / "plan.json"
        subprocess.run([sys.executable, "-m", "tierwise", "fit", "1.4B", "--gpus", "1", "--hardware", "h200-x1", "--out",
                        str(plan)], check=True, capture_output=True, timeout=120)
        args = [*args[:-1], str(plan)]
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout and max(len(line) for line in proc.stdout.splitlines()) <= 80
    if args[0] == "simulate":
        assert "GPU compute" in proc.stdout and "gpu_compute" not in proc.stdout  # the one vocabulary
