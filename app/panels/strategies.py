"""Every strategy side by side: does it fit, how fast, and what limits it (one unpinned search)."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from planner.output import report
from planner.search.search import SearchResult, best_by_strategy
from planner.specs.plan import STRATEGY_TABLE, Plan

DOES_NOT_FIT = "does not fit"


def strategies_frame(plans: SearchResult | dict[str, tuple[Plan, str]]) -> pd.DataFrame:
    """One row per strategy, in numbers (the chart's data; a zero rate where it does not fit): from a
    search, or from `app.compute.strategy_plans` (strategy -> (plan, its exposed-path bottleneck))."""
    if isinstance(plans, SearchResult):
        plans = {name: (plan, "") for name, plan in best_by_strategy(plans).items()}
    rows = []
    for name, (plan, bottleneck) in plans.items():
        pred = plan.prediction
        assert pred is not None
        rows.append({
            "strategy": name,
            "what": STRATEGY_TABLE[name].description if name in STRATEGY_TABLE else "free placement (ZeRO-3)",
            "fits": pred.feasible,
            "placement": plan.placement.label(),
            "batch/GPU": plan.micro_batch_per_gpu if pred.feasible else None,
            "micro-batch": report.batch_words(plan) if pred.feasible else "",
            "TFLOPS/GPU": pred.tflops_per_gpu if pred.feasible else 0.0,
            "tokens/s": pred.tokens_per_s if pred.feasible else 0.0,
            "iteration (s)": pred.iteration_time_s if pred.feasible else None,
            "bottleneck": (bottleneck or report.bottleneck_label(pred.bottleneck)) if pred.feasible else DOES_NOT_FIT,
            "predicted by": pred.method,
            "why not": "" if pred.feasible else pred.reason,
        })
    return pd.DataFrame(rows)


def display_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """The table as people read it: formatted numbers where the strategy fits, blank where it does not
    (the reason says why), never None or 0.0."""
    def cell(row: pd.Series, column: str, fmt: str) -> str:
        return format(row[column], fmt) if row["fits"] else ""

    return pd.DataFrame({
        "strategy": frame["strategy"],
        "fits": ["yes" if fits else "no" for fits in frame["fits"]],
        "placement": frame["placement"],
        "micro-batch": frame["micro-batch"],
        "iteration": [report.fmt_seconds(r["iteration (s)"]) if r["fits"] else "" for _, r in frame.iterrows()],
        "TFLOPS/GPU": [report.fmt_tflops(r["TFLOPS/GPU"]) if r["fits"] else "" for _, r in frame.iterrows()],
        "tokens/s": [cell(r, "tokens/s", ",.0f") for _, r in frame.iterrows()],
        "bottleneck": frame["bottleneck"],
        "predicted by": [r["predicted by"] if r["fits"] else "" for _, r in frame.iterrows()],
        "why not": frame["why not"],
        "what": frame["what"],
    })


def chart(frame: pd.DataFrame) -> alt.LayerChart:
    base = alt.Chart(frame).encode(y=alt.Y("strategy:N", sort=list(frame["strategy"]), title=None))
    bars = base.mark_bar().encode(
        x=alt.X("TFLOPS/GPU:Q", title="TFLOPS per GPU (paper accounting, eq. 7)"),
        color=alt.Color("bottleneck:N", legend=alt.Legend(title="bottleneck", labelLimit=320)),
        tooltip=["strategy", "placement", "micro-batch", alt.Tooltip("TFLOPS/GPU:Q", format=",.1f"),
                 alt.Tooltip("tokens/s:Q", format=",.0f"), "bottleneck", "why not"],
    )
    labels = base.mark_text(align="left", dx=4).encode(
        x="TFLOPS/GPU:Q", text=alt.condition(alt.datum.fits, alt.value(""), alt.value(DOES_NOT_FIT)),
    )
    return alt.layer(bars, labels).properties(height=34 * max(1, len(frame)))


def render(plans: dict[str, tuple[Plan, str]]) -> None:
    frame = strategies_frame(plans)
    if frame.empty:
        st.info("The search formed no candidate for any strategy.")
        return
    st.altair_chart(chart(frame), key="strategies_chart")
    st.caption("Each strategy at its best batch, recompute interval, tiling and prefetch depth, predicted as the "
               "verdict's plan is; `custom` is the best free placement. Placement pins in the sidebar do not apply here.")
    shown = display_frame(frame)
    fitting = shown[shown["fits"] == "yes"].drop(columns=["fits", "why not"])
    if not fitting.empty:
        st.dataframe(fitting, hide_index=True, key="strategies_table")
    failing = shown[shown["fits"] == "no"][["strategy", "placement", "why not"]]
    if not failing.empty:
        st.markdown("**Strategies that do not fit**, and why")
        st.table(failing.rename(columns={"why not": "why it does not fit"}).set_index("strategy"))
