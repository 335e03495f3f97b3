"""Memory per tier as stacked bars of every state and buffer, against the tier's capacity."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from planner.output.report import fmt_bytes
from planner.specs.memory_terms import describe
from planner.specs.plan import Plan
from planner.specs.tiers import TIERS, Tier
from planner.specs.units import GIB


def tier_label(tier: Tier) -> str:
    return f"{tier.upper()} ({tier.scope})"


def memory_frame(plan: Plan) -> pd.DataFrame:
    """One row per (tier, named term) of the plan's memory bill, in bytes and GiB."""
    pred = plan.prediction
    assert pred is not None
    rows = [
        {
            "tier": tier_label(tier),
            "term": term,
            "bytes": nbytes,
            "GiB": nbytes / GIB,
            "capacity GiB": pred.capacity_bytes[tier] / GIB,
            "formula": describe(term),
        }
        for tier in TIERS
        for term, nbytes in pred.memory_terms.get(tier, {}).items()
        if nbytes
    ]
    return pd.DataFrame(rows, columns=["tier", "term", "bytes", "GiB", "capacity GiB", "formula"])


def tiers_frame(plan: Plan) -> pd.DataFrame:
    pred = plan.prediction
    assert pred is not None
    return pd.DataFrame([
        {
            "tier": tier_label(tier),
            "needs": fmt_bytes(pred.peak_bytes[tier]),
            "capacity": fmt_bytes(pred.capacity_bytes[tier]),
            "fits": pred.peak_bytes[tier] <= pred.capacity_bytes[tier],
            "needs (bytes)": pred.peak_bytes[tier],
            "capacity (bytes)": pred.capacity_bytes[tier],
        }
        for tier in TIERS
    ])


def chart(frame: pd.DataFrame) -> alt.FacetChart:
    """One row per tier (its own scale: GiB per GPU beside TiB per node); the black tick is capacity."""
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("sum(GiB):Q", title="GiB"),
        color=alt.Color("term:N", scale=alt.Scale(scheme="category20"), legend=alt.Legend(title="state or buffer", labelLimit=320)),
        order=alt.Order("bytes:Q", sort="descending"),
        tooltip=["term", alt.Tooltip("GiB:Q", format=",.2f"), "formula"],
    )
    capacity = alt.Chart().mark_tick(color="black", thickness=3, size=34).encode(
        x=alt.X("max(capacity GiB):Q"), tooltip=[alt.Tooltip("max(capacity GiB):Q", title="capacity GiB", format=",.1f")],
    )
    return (
        alt.layer(bars, capacity, data=frame)
        .properties(height=40, width=560)
        .facet(row=alt.Row("tier:N", title=None, sort=[tier_label(t) for t in TIERS], header=alt.Header(labelAngle=0, labelAlign="left")))
        .resolve_scale(x="independent")
    )


def render(plan: Plan) -> None:
    frame = memory_frame(plan)
    st.altair_chart(chart(frame), key="memory_chart")
    st.caption("Bars: every state and runtime buffer of the memory bill (docs/planner.md); black tick: capacity. "
               "GPU is per GPU, CPU and NVMe per node.")
    st.dataframe(tiers_frame(plan).drop(columns=["needs (bytes)", "capacity (bytes)"]), hide_index=True, key="tiers_table")
    with st.expander("Every term and its formula"):
        st.dataframe(frame, hide_index=True, key="terms_table")
