"""The dashboard through Streamlit's AppTest: every panel renders the library's numbers, widget
changes change the answer, and bad values show a one-line message (never a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from search_support import refined, searched
from streamlit.runtime.memory_media_file_storage import MemoryMediaFileStorage
from streamlit.testing.v1 import AppTest
from streamlit.testing.v1 import app_test as app_test_module

from app.dashboard import TABS
from app.panels import timeline
from app.panels.strategies import strategies_frame
from planner.output import report
from planner.output.deepspeed_config import deepspeed_config
from planner.output.verdict import critical_path
from planner.search.max_size import max_size
from planner.search.search import SearchRequest, predict
from planner.specs.catalog import resolve_hardware, resolve_model

SCRIPT = str(Path(__file__).resolve().parent.parent / "app" / "dashboard.py")
DOWNLOADS: dict[str, bytes] = {}


class _RecordingStorage(MemoryMediaFileStorage):
    """Keeps what download buttons serve, so the test can read the plan JSON a user would get."""

    def load_and_get_id(self, path_or_data, mimetype, kind, filename=None):
        file_id = super().load_and_get_id(path_or_data, mimetype, kind, filename)
        DOWNLOADS[file_id] = self.get_file(file_id).content
        return file_id


@pytest.fixture
def app(monkeypatch, tmp_path):
    monkeypatch.setenv("TIERWISE_HISTORY", str(tmp_path / "history.sqlite"))
    monkeypatch.setattr(app_test_module, "MemoryMediaFileStorage", _RecordingStorage)
    # A hang guard, not a speed check: the Largest model tab of a 1T preset runs 56 max-size searches
    # (about a minute of CPU), and with one test process per core it shares the machine (as test_app_screens).
    return AppTest.from_file(SCRIPT, default_timeout=300).run()


def expected_best(model="1T", hardware="dgx-h100", gpus=16, node=None, **kw):
    node = node or resolve_hardware(hardware)
    # The page ranks by simulation by default, as `planner fit` does.
    return refined(SearchRequest(model=resolve_model(model), node=node, num_gpus=gpus, **kw)).best


def metrics(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def no_errors(at) -> None:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]


def tab(at, label):
    """Open the tab (tabs are lazy: only the open one runs) and return it."""
    at.session_state["panel"] = label
    at.run()
    no_errors(at)
    return next(t for t in at.tabs if t.label == label)


def test_default_view_is_the_library_answer_for_1t_on_16_gpus(app):
    no_errors(app)
    best = expected_best()
    pred = best.prediction
    assert app.success[0].value.startswith("**Verdict:** fits on 16 GPU(s) of dgx-h100 (2 node(s) of 8)")
    assert metrics(app) == {
        "Iteration time": report.fmt_seconds(pred.iteration_time_s),
        "TFLOPS per GPU": f"{pred.tflops_per_gpu:,.1f}",
        "Tokens per second": f"{pred.tokens_per_s:,.0f}",
        # The search steps 1T's optimizer in backward, under the backward's compute: the GPU waits on nothing
        # but itself (with the step after backward, the exposed step is the bottleneck: test_planner_critical_path).
        "Bottleneck": "GPU compute",
    }
    assert critical_path(best).bottleneck == "GPU compute"
    assert not any(m.value.startswith("**Cheaper:**") for m in app.markdown)  # the search chose the cheaper one
    assert app.markdown[0].value == f"**Plan** {report.plan_line(best)}"
    assert [t.label for t in app.tabs] == list(TABS)


def test_download_buttons_serve_the_plan_and_its_deepspeed_config(app):
    best = expected_best()
    buttons = {b.proto.label: b.proto.url for b in app.download_button}
    assert set(buttons) == {"Download plan JSON", "Download DeepSpeed config"}

    def served(url):
        return json.loads(DOWNLOADS[url.rsplit("/", 1)[1].split(".")[0]])

    assert served(buttons["Download plan JSON"]) == json.loads(json.dumps(best.to_dict()))
    assert served(buttons["Download DeepSpeed config"]) == json.loads(json.dumps(deepspeed_config(best)))


def test_memory_panel_stacks_every_term_against_capacity(app):
    panel = tab(app, "Memory per tier")
    assert len(panel.get("vega_lite_chart")) == 1
    spec = json.loads(panel.get("vega_lite_chart")[0].proto.spec)
    assert spec["facet"]["row"]["field"] == "tier"
    tiers, terms = panel.dataframe[0].value, panel.dataframe[1].value
    pred = expected_best().prediction
    assert list(tiers["tier"]) == ["GPU (per GPU)", "CPU (per node)", "NVMe (per node)"]
    assert list(tiers["fits"]) == ["yes", "yes", "yes"]
    expected = {(t, name): nbytes for t, named in pred.memory_terms.items() for name, nbytes in named.items() if nbytes}
    got = {(row.tier.split(" ")[0].lower(), row.term): row.bytes for row in terms.itertuples()}
    assert all(row.size == report.fmt_bytes(row.bytes) for row in terms.itertuples())
    assert got == expected


def test_strategies_panel_shows_every_strategy(app):
    panel = tab(app, "Strategies")
    assert len(panel.get("vega_lite_chart")) == 1
    fitting, failing = panel.dataframe[0].value, panel.table[0].value
    node = resolve_hardware("dgx-h100")
    from planner.output.verdict import simulated_like
    from planner.search.search import best_by_strategy

    result = refined(SearchRequest(model=resolve_model("1T"), node=node, num_gpus=16))
    best = best_by_strategy(result)  # each strategy predicted as the winner is: simulated
    expected = strategies_frame({name: (plan, "") for name, plan in
                                 zip(best, simulated_like(list(best.values()), result.best), strict=True)})
    assert set(expected.loc[expected["fits"], "predicted by"]) == {"simulated"}
    shown = list(fitting["strategy"]) + list(failing.index)
    assert sorted(shown) == sorted(["dp", "zero2", "zero-offload", "zero3", "zero-inf-cpu", "zero-inf-nvme", "3d", "custom"])
    assert list(fitting["strategy"]) == list(expected.loc[expected["fits"], "strategy"])
    assert list(fitting["TFLOPS/GPU"]) == [report.fmt_tflops(v) for v in expected.loc[expected["fits"], "TFLOPS/GPU"]]
    assert "GPU needs" in failing.loc["dp", "why it does not fit"]  # the whole reason, in a table that wraps


def test_timeline_panel_shows_the_simulation(app):
    from planner.sim import simulate

    panel = tab(app, "Timeline")
    best = expected_best()
    sim = simulate(best).prediction
    comparison = panel.dataframe[0].value.set_index("")
    analytic = predict(best.replace(prediction=None)).prediction
    assert comparison.loc["iteration time", "analytic"] == report.fmt_seconds(analytic.iteration_time_s)
    assert comparison.loc["iteration time", "simulated"] == report.fmt_seconds(sim.iteration_time_s)
    assert comparison.loc["bottleneck", "simulated"] == critical_path(best).bottleneck == "GPU compute"
    utilisation, gantt, memory_over_time = (json.loads(c.proto.spec) for c in panel.get("vega_lite_chart"))
    assert utilisation["encoding"]["x"]["field"] == "busy"
    assert memory_over_time["facet"]["row"]["field"] == "tier"
    # The Gantt chart is planner.output.timeline's data, drawn by the browser: the whole iteration binned,
    # then one recompute segment span by span.
    full, zoom = gantt["vconcat"]
    assert (full["mark"]["type"], zoom["mark"]["type"]) == ("rect", "bar")
    assert full["encoding"]["opacity"]["field"] == "busy"


def test_gantt_chart_data_is_the_simulators(app):
    from planner.output.timeline import ROW_LABELS, busy_bins, zoom_spans

    tab(app, "Timeline")
    result = timeline.simulation(json.dumps(expected_best().to_dict()))
    # 1T's 128 blocks: the panel's timelines are extrapolated from short simulations (planner/sim/periodic.py).
    assert result.simulation is None and "extrapolated_from_layers" in result.prediction.details
    bins, window, spans = timeline.gantt_frames(result)
    assert bins.to_dict("records") == busy_bins(result, timeline.GANTT_BINS)
    assert spans.to_dict("records") == zoom_spans(result)[1]
    # Every busy second of every resource is in the bins (to rounding), and no bin is over-full.
    total = result.timelines.iteration_time_s
    width = total / timeline.GANTT_BINS
    for name, resource in result.prediction.details["resources"].items():
        if result.timelines.intervals[name]:
            mine = bins[bins["label"] == ROW_LABELS[name]]
            assert (mine["busy"] * width).sum() == pytest.approx(resource["busy_s"], rel=1e-7)
    assert bins["busy"].between(0, 1).all()
    lo, hi = window
    assert 0 <= lo < hi <= total
    assert {"recompute", "backward"} <= set(spans["phase"])
    assert spans["start_s"].between(lo, hi).all()


def test_only_the_open_tab_runs(app):
    assert len(app.get("vega_lite_chart")) == 1  # the memory chart; the other panels did not run
    tab(app, "Strategies")
    assert len(app.get("vega_lite_chart")) == 1 and app.tabs[1].dataframe


def test_bandwidth_panel_draws_eq6_for_the_chosen_plan(app):
    panel = tab(app, "Bandwidth (eq. 6)")
    assert len(panel.get("vega_lite_chart")) == 1
    best = expected_best()
    caption = panel.caption[0].value
    assert f"batch {best.micro_batch_per_gpu:g}, seq 1024, hidden 25600" in caption
    assert f"parameters and gradients (eq. 9) {best.micro_batch_per_gpu * 1024:,.0f} flops/byte" in caption


def test_largest_model_panel_has_every_strategy_per_gpu_count(app):
    panel = tab(app, "Largest model")
    assert len(panel.get("vega_lite_chart")) == 1
    table = panel.dataframe[0].value
    assert list(table.columns) == ["dp", "zero2", "zero-offload", "zero3", "zero-inf-cpu", "zero-inf-nvme", "3d"]
    assert list(table.index) == [1, 2, 4, 8, 16, 32, 64, 128]
    node = resolve_hardware("dgx-h100")
    assert table.loc[16, "zero3"] == round(max_size("zero3", node, 16).max_params / 1e9, 1)
    assert table.loc[1, "zero-inf-nvme"] == round(max_size("zero-inf-nvme", node, 1).max_params / 1e9, 1)


def test_history_panel_says_no_runs_without_a_database(app):
    panel = tab(app, "Predicted vs measured")
    assert panel.info[0].value.startswith("No runs recorded yet (no run history at ")


def test_more_gpus_changes_the_answer(app):
    app.sidebar.number_input(key="gpus").set_value(32).run()
    no_errors(app)
    pred = expected_best(gpus=32).prediction
    assert app.success[0].value.startswith("**Verdict:** fits on 32 GPU(s) of dgx-h100 (4 node(s) of 8)")
    assert metrics(app)["TFLOPS per GPU"] == f"{pred.tflops_per_gpu:,.1f}"
    assert metrics(app)["TFLOPS per GPU"] != f"{expected_best().prediction.tflops_per_gpu:,.1f}"


def test_twice_the_nvme_write_bandwidth_changes_the_answer(app):
    app.sidebar.expander[0].number_input(key="hw:dgx-h100:nvme_write_gb_per_s").set_value(56.0).run()
    no_errors(app)
    node = resolve_hardware("dgx-h100").replace(nvme_write_bytes_per_s=56e9)
    pred = expected_best(node=node).prediction
    assert "modified: nvme_write_gb_per_s" in app.success[0].value
    assert metrics(app)["Iteration time"] == report.fmt_seconds(pred.iteration_time_s)
    assert pred.iteration_time_s < expected_best().prediction.iteration_time_s


def test_ranking_by_simulation_reports_what_planner_fit_reports(app):
    # Default: ranked by simulation, as `planner fit`; switched off, the analytic estimate ranks.
    app.sidebar.toggle(key="refine").set_value(False).run()
    no_errors(app)
    analytic_best = searched(SearchRequest(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=16)).best
    assert "analytic estimate" in app.caption[1].value
    assert metrics(app)["Iteration time"] == report.fmt_seconds(analytic_best.prediction.iteration_time_s)
    app.sidebar.toggle(key="refine").set_value(True).run()
    no_errors(app)
    node = resolve_hardware("dgx-h100")
    best = refined(SearchRequest(model=resolve_model("1T"), node=node, num_gpus=16)).best
    assert best.prediction.method == "simulated"
    assert metrics(app) == {
        "Iteration time": report.fmt_seconds(best.prediction.iteration_time_s),
        "TFLOPS per GPU": f"{best.prediction.tflops_per_gpu:,.1f}",
        "Tokens per second": f"{best.prediction.tokens_per_s:,.0f}",
        "Bottleneck": critical_path(best).bottleneck,
    }
    assert "discrete-event simulator" in app.caption[1].value
    comparison = tab(app, "Timeline").dataframe[0].value.set_index("")
    analytic = predict(best.replace(prediction=None)).prediction  # shown beside the simulation
    assert comparison.loc["iteration time", "analytic"] == report.fmt_seconds(analytic.iteration_time_s)
    assert "simulated" in set(tab(app, "Strategies").dataframe[0].value["predicted by"])


def test_a_bigger_model_and_a_pinned_strategy(app):
    app.sidebar.text_input(key="model").set_value("10T").run()
    no_errors(app)
    assert "paper-10t" in app.caption[0].value
    app.sidebar.selectbox(key="strategy").set_value("zero3").run()
    no_errors(app)
    assert app.warning[0].value.startswith("**Verdict:** does not fit on 16 GPU(s) of dgx-h100")
    rejected = app.main.table[0].value
    assert list(rejected["strategy"]) == ["zero3"] and "GPU needs" in rejected["why it does not fit"][0]


@pytest.mark.slow  # two searches of the dashboard, about 35 s on 2 cores: CI runs it (`-m slow`)
def test_explicit_shape_and_sequence_length(app):
    app.sidebar.radio(key="model_mode").set_value("explicit shape").run()
    app.sidebar.number_input(key="layers").set_value(40)
    app.sidebar.number_input(key="hidden").set_value(5120)
    app.sidebar.number_input(key="heads").set_value(40)
    app.sidebar.number_input(key="seq").set_value(2048).run()
    no_errors(app)
    assert "custom (40 layers x hidden 5120): 40 layers x hidden 5120, 40 heads, seq 2048" in app.caption[0].value
    model = resolve_model(None, layers=40, hidden=5120, heads=40, seq=2048)
    best = refined(SearchRequest(model=model, node=resolve_hardware("dgx-h100"), num_gpus=16)).best
    assert metrics(app)["TFLOPS per GPU"] == f"{best.prediction.tflops_per_gpu:,.1f}"


def test_pinned_batch_and_placement(app):
    app.sidebar.number_input(key="batch").set_value(2.0)
    app.sidebar.selectbox(key="pin:params").set_value("nvme").run()
    no_errors(app)
    best = expected_best(micro_batch_per_gpu=2, placement_pins={"params": "nvme"})
    assert "micro-batch 2/GPU |" in app.markdown[0].value and "params=nvme" in app.markdown[0].value
    assert metrics(app)["Iteration time"] == report.fmt_seconds(best.prediction.iteration_time_s)


def test_optimizer_step_is_searched_pinned_or_forced_by_clipping(app):
    from planner.specs.training_loop import TrainingLoop

    # Left to the search: the faster schedule, and the page says why (1T/16: in backward).
    no_errors(app)
    searched = expected_best()
    assert searched.optimizer_step == "in_backward"
    assert any(c.value == f"**Optimizer step** {report.schedule_line(searched)}" for c in app.caption)
    app.sidebar.selectbox(key="optimizer_step").set_value("in_backward").run()
    no_errors(app)
    best = expected_best(training=TrainingLoop(optimizer_step="in_backward"))
    assert app.markdown[0].value == f"**Plan** {report.plan_line(best)}"
    assert "optimizer step in backward" in app.markdown[0].value
    assert metrics(app)["Iteration time"] == report.fmt_seconds(best.prediction.iteration_time_s)
    assert any("DeepSpeed steps the optimizer after backward" in c.value for c in app.caption)
    app.sidebar.selectbox(key="optimizer_step").set_value("auto")
    app.sidebar.toggle(key="clip_grad_norm").set_value(True).run()
    no_errors(app)
    clipped = expected_best(training=TrainingLoop(clips_grad_norm=True))
    assert clipped.optimizer_step == "after_backward"
    assert metrics(app)["Iteration time"] == report.fmt_seconds(clipped.prediction.iteration_time_s)
    assert any("global-norm gradient clipping" in c.value for c in app.caption)


@pytest.mark.parametrize(
    "widget, key, value, message",
    [
        ("number_input", "hw:dgx-h100:nvme_read_gb_per_s", -5.0, "nvme_read_gb_per_s must be at least 0, got -5.0"),
        ("number_input", "hw:dgx-h100:gpu_max_alloc_gib", 100.0, "gpu_max_alloc_gib (100) exceeds gpu_memory_gib (80)"),
        ("number_input", "hw:dgx-h100:num_gpus_per_node", 0, "num_gpus_per_node must be at least 1, got 0"),
        ("number_input", "gpus", 12, "Number of GPUs 12 is not a whole number of dgx-h100 nodes (8 GPUs each)"),
        ("number_input", "gpus", 0, "Number of GPUs must be at least 1, got 0"),  # the field's name, not the flag
        ("text_input", "model", "bogus", "unknown model 'bogus'"),
        ("text_input", "model", "", "no MODEL given; name one (e.g. 1T, gpt3-175b)"),
        ("selectbox", "pin:gradients", "gpu", "contradicts"),
    ],
)
def test_bad_values_show_one_line_and_no_traceback(app, widget, key, value, message):
    if widget == "selectbox":  # zero-inf-nvme puts gradients on NVMe: pinning them to the GPU contradicts it
        app.sidebar.selectbox(key="strategy").set_value("zero-inf-nvme")
    getattr(app.sidebar, widget)(key=key).set_value(value).run()
    assert not app.exception
    assert len(app.error) == 1
    text = app.error[0].value
    assert message in text and "\n" not in text and "Traceback" not in text and "--" not in text
    assert not app.tabs  # no panel is drawn from a question the library rejected


@pytest.mark.parametrize(
    "hardware, model, gpus",
    [("cpu-dev-2core", "1.4B", 1), ("h200-x1", "13B", 1), ("dgx2-v100", "1T", 16), ("dgx-a100-80g", "gpt3-175b", 8),
     ("dgx-h100", "100T", 8), ("dgx-h100", "llama-3-70b", 8)],
)
def test_every_panel_renders_on_every_preset(app, hardware, model, gpus):
    app.sidebar.selectbox(key="hardware").set_value(hardware)
    app.sidebar.text_input(key="model").set_value(model)
    app.sidebar.number_input(key="gpus").set_value(gpus).run()
    no_errors(app)
    best = expected_best(model, hardware, gpus)
    cpu_only = resolve_hardware(hardware).host_is_device
    if best is None:
        device = "CPU device(s)" if cpu_only else "GPU(s)"
        assert app.warning[0].value.startswith(f"**Verdict:** does not fit on {gpus} {device} of {hardware}")
    else:  # a CPU-only machine names no GPU
        assert metrics(app)["TFLOPS per device" if cpu_only else "TFLOPS per GPU"] == report.fmt_tflops(
            best.prediction.tflops_per_gpu)
    for label in TABS:
        panel = tab(app, label)
        assert len(panel.children) > 0
