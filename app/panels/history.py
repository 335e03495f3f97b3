"""Predicted vs measured, from the run history `planner run` records (when there is one)."""

from __future__ import annotations

from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from app.history import History, default_history_path, read_history
from planner.specs.profile import ERROR_DEFINITION


@st.cache_data(max_entries=8, show_spinner=False)
def _cached_history(path: str, mtime_ns: int) -> History:
    return read_history(Path(path))


def load(path: Path) -> History:
    mtime = path.stat().st_mtime_ns if path.is_file() else 0  # re-read when `planner run` appends
    return _cached_history(str(path), mtime)


def chart(runs: pd.DataFrame, metric: str) -> alt.LayerChart:
    data = runs[runs["metric"] == metric]
    top = float(max(data["predicted"].max(), data["measured"].max()))
    diagonal = alt.Chart(pd.DataFrame({"predicted": [0.0, top], "measured": [0.0, top]})).mark_line(
        strokeDash=[4, 3], color="gray").encode(x="predicted:Q", y="measured:Q")
    dots = alt.Chart(data).mark_point(size=80, filled=True).encode(
        x=alt.X("predicted:Q", title=f"predicted {metric}"), y=alt.Y("measured:Q", title=f"measured {metric}"),
        color="strategy:N",
        tooltip=["run", "recorded_at", "model", "hardware", "num_gpus", "placement", "method", "predicted", "measured",
                 alt.Tooltip("error:Q", format="+.1%")],
    )
    return alt.layer(diagonal, dots).properties(height=360)


def render() -> None:
    path = Path(st.text_input("Run history (SQLite)", value=str(default_history_path()), key="history_path"))
    history = load(path)
    if history.runs.empty:
        st.info(history.message)
        return
    metrics = list(dict.fromkeys(history.runs["metric"]))
    metric = st.selectbox("Metric", metrics, key="history_metric")
    st.altair_chart(chart(history.runs, metric), key="history_chart")
    st.caption(f"Dashed: measured = predicted. Table: {ERROR_DEFINITION}.")
    st.dataframe(history.runs, hide_index=True, key="history_table",
                 column_config={"error": st.column_config.NumberColumn("error", format="percent")})
