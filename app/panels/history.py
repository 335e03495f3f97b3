"""Predicted vs measured, from the run history `planner run` records (when there is one).

The history's metric keys (`iteration_time_s`, `peak_bytes.gpu`) and raw values (bytes) stay in the
data; the page shows each metric's name and unit (`METRIC_LABELS`), values in that unit.
"""

from __future__ import annotations

import math
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from app.history import History, default_history_path, read_history
from planner.specs.profile import ERROR_DEFINITION
from planner.specs.tiers import TIERS
from planner.specs.units import GIB

METRIC_LABELS: dict[str, tuple[str, str, float]] = {
    "iteration_time_s": ("iteration time", "s", 1.0),
    "tflops_per_gpu": ("TFLOPS per GPU", "TFLOPS", 1.0),
    **{f"peak_bytes.{t}": (f"peak memory, {t.label} ({t.scope})", "GiB", GIB) for t in TIERS},
}
"""History metric -> (name, unit, raw units per shown unit)."""


@st.cache_data(max_entries=8, show_spinner=False)
def _cached_history(path: str, mtime_ns: int) -> History:
    return read_history(Path(path))


def load(path: Path) -> History:
    mtime = path.stat().st_mtime_ns if path.is_file() else 0  # re-read when `planner run` appends
    return _cached_history(str(path), mtime)


def metric_label(metric: str) -> str:
    name, unit, _ = METRIC_LABELS[metric]
    return f"{name} ({unit})"


def in_units(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs with `predicted` and `measured` in each metric's unit and the metric's name."""
    scale = runs["metric"].map(lambda m: METRIC_LABELS[m][2])
    return runs.assign(predicted=runs["predicted"] / scale, measured=runs["measured"] / scale,
                       shown=runs["metric"].map(metric_label))


def table(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs as people read them: named metrics, values with their unit, the error in percent."""
    shown = in_units(runs)
    return pd.DataFrame({
        "metric": shown["shown"], "predicted": [f"{v:,.4g}" for v in shown["predicted"]],
        "measured": [f"{v:,.4g}" for v in shown["measured"]],
        "error": [f"{e:+.1%}" if math.isfinite(e) else "n/a (measured 0)" for e in shown["error"]],
        "run": shown["run"], "model": shown["model"], "hardware": shown["hardware"], "GPUs": shown["num_gpus"],
        "strategy": shown["strategy"], "placement": shown["placement"], "predicted by": shown["method"],
        "recorded at": shown["recorded_at"],
    })


def chart(runs: pd.DataFrame, metric: str) -> alt.LayerChart:
    data = in_units(runs[runs["metric"] == metric]).drop(columns=["metric"])
    label = metric_label(metric)
    top = float(max(data["predicted"].max(), data["measured"].max()))
    diagonal = alt.Chart(pd.DataFrame({"predicted": [0.0, top], "measured": [0.0, top]})).mark_line(
        strokeDash=[4, 3], color="gray").encode(x="predicted:Q", y="measured:Q")
    dots = alt.Chart(data).mark_point(size=80, filled=True).encode(
        x=alt.X("predicted:Q", title=f"predicted {label}"), y=alt.Y("measured:Q", title=f"measured {label}"),
        color="strategy:N",
        tooltip=[alt.Tooltip("run:Q", title="run"), alt.Tooltip("recorded_at:N", title="recorded at"), "model",
                 "hardware", alt.Tooltip("num_gpus:Q", title="GPUs"), "placement",
                 alt.Tooltip("method:N", title="predicted by"), alt.Tooltip("predicted:Q", format=",.4g"),
                 alt.Tooltip("measured:Q", format=",.4g"), alt.Tooltip("error:Q", format="+.1%")],
    )
    return alt.layer(diagonal, dots).properties(height=360)


def render() -> None:
    path = Path(st.text_input("Run history (SQLite)", value=str(default_history_path()), key="history_path"))
    history = load(path)
    if history.runs.empty:
        st.info(history.message)
        return
    metrics = list(dict.fromkeys(history.runs["metric"]))
    metric = st.selectbox("Metric", metrics, key="history_metric", format_func=metric_label)
    st.altair_chart(chart(history.runs, metric), key="history_chart")
    st.caption(f"Dashed: measured = predicted. Table: {ERROR_DEFINITION}.")
    st.dataframe(table(history.runs), hide_index=True, key="history_table")
