"""Every strategy side by side: does it fit, how fast, and what limits it (one unpinned search)."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from planner.output import report
from planner.search.search import SearchResult, best_by_strategy
from planner.specs.plan import STRATEGY_TABLE

DOES_NOT_FIT = "does not fit"
NUMBER_FORMATS = {
    "TFLOPS/GPU": st.column_config.NumberColumn(format="%.1f"),
    "tokens/s": st.column_config.NumberColumn(format="%,.0f"),
    "iteration (s)": st.column_config.NumberColumn(format="%.3g"),
    "batch/GPU": st.column_config.NumberColumn(format="%g"),
}


def strategies_frame(result: SearchResult) -> pd.DataFrame:
    rows = []
    for name, plan in best_by_strategy(result).items():
        pred = plan.prediction
        assert pred is not None
        rows.append({
            "strategy": name,
            "what": STRATEGY_TABLE[name].description if name in STRATEGY_TABLE else "free placement (ZeRO-3)",
            "fits": pred.feasible,
            "placement": plan.placement.label(),
            "batch/GPU": plan.micro_batch_per_gpu if pred.feasible else None,
            "TFLOPS/GPU": pred.tflops_per_gpu if pred.feasible else 0.0,
            "tokens/s": pred.tokens_per_s if pred.feasible else 0.0,
            "iteration (s)": pred.iteration_time_s if pred.feasible else None,
            "bottleneck": report.bottleneck_label(pred.bottleneck) if pred.feasible else DOES_NOT_FIT,
            "predicted by": pred.method,
            "why not": "" if pred.feasible else pred.reason,
        })
    return pd.DataFrame(rows)


def chart(frame: pd.DataFrame) -> alt.LayerChart:
    base = alt.Chart(frame).encode(y=alt.Y("strategy:N", sort=list(frame["strategy"]), title=None))
    bars = base.mark_bar().encode(
        x=alt.X("TFLOPS/GPU:Q", title="TFLOPS per GPU (paper accounting, eq. 7)"),
        color=alt.Color("bottleneck:N", legend=alt.Legend(title="bottleneck")),
        tooltip=["strategy", "placement", "batch/GPU", alt.Tooltip("TFLOPS/GPU:Q", format=",.1f"),
                 alt.Tooltip("tokens/s:Q", format=",.0f"), "bottleneck", "why not"],
    )
    labels = base.mark_text(align="left", dx=4).encode(
        x="TFLOPS/GPU:Q", text=alt.condition(alt.datum.fits, alt.value(""), alt.value(DOES_NOT_FIT)),
    )
    return alt.layer(bars, labels).properties(height=34 * max(1, len(frame)))


def render(result: SearchResult) -> None:
    frame = strategies_frame(result)
    if frame.empty:
        st.info("The search formed no candidate for any strategy.")
        return
    st.altair_chart(chart(frame), key="strategies_chart")
    st.caption("Each strategy at its best batch, recompute interval, tiling and prefetch depth; `custom` is the best "
               "free placement. Placement pins in the sidebar do not apply here.")
    st.dataframe(frame, hide_index=True, key="strategies_table", column_config=NUMBER_FORMATS)
