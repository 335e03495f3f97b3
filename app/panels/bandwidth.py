"""The paper's efficiency-vs-bandwidth curves (docs/method.md §3, eq. 6 with eq. 9-11), for the chosen
plan's batch, sequence and width, with this hardware's per-GPU bandwidths marked."""

from __future__ import annotations

import math

import altair as alt
import pandas as pd
import streamlit as st

from planner.cost.throughput import (
    EFFICIENCY_STATES,
    arithmetic_intensity,
    bandwidths,
    efficiency,
    state_bandwidths,
)
from planner.specs.plan import Plan
from planner.specs.tiers import TIERS
from planner.specs.units import GB

CURVE_POINTS = 61
MIN_GB_PER_S, MAX_GB_PER_S = 0.1, 1000.0
STATE_LABELS = {
    "params_and_gradients": "parameters and gradients (eq. 9)",
    "optimizer_states": "optimizer states (eq. 10)",
    "recompute_inputs": "recompute inputs (eq. 11)",
}


def curves_frame(plan: Plan) -> pd.DataFrame:
    """Eq. 6 efficiency of each kind of traffic over a log-spaced grid of per-GPU bandwidths."""
    ait, peak = arithmetic_intensity(plan), plan.node.gpu_flops_per_s
    step = math.log10(MAX_GB_PER_S / MIN_GB_PER_S) / (CURVE_POINTS - 1)
    grid = [MIN_GB_PER_S * 10 ** (i * step) for i in range(CURVE_POINTS)]
    return pd.DataFrame([
        {"traffic": STATE_LABELS[state], "GB/s per GPU": gbps, "efficiency": efficiency(ait[state], gbps * GB, peak)}
        for state in EFFICIENCY_STATES
        for gbps in grid
    ])


def hardware_frame(plan: Plan) -> pd.DataFrame:
    """The per-GPU bandwidths this plan's traffic can use on this hardware (vertical rules)."""
    bw = bandwidths(plan)
    links = {"CPU -> GPU (PCIe share)": bw.h2d}
    for tier in TIERS:
        if tier.staged:  # a tier behind host memory: its share of the node's links (NVMe's)
            links.update({f"{tier.label} read share": bw.reads[tier], f"{tier.label} write share": bw.writes[tier]})
    return pd.DataFrame([{"link": k, "GB/s per GPU": v / GB} for k, v in links.items() if v > 0])


def points_frame(plan: Plan) -> pd.DataFrame:
    """Where the chosen placement puts each off-GPU state (GPU-resident states move nothing)."""
    pred = plan.prediction
    assert pred is not None
    eff = pred.details.get("efficiency_no_overlap", {}) if pred.feasible else {}
    state_bw = state_bandwidths(plan)
    return pd.DataFrame([
        {"traffic": STATE_LABELS[state], "GB/s per GPU": state_bw[state] / GB, "efficiency": eff[state]}
        for state in EFFICIENCY_STATES
        if state in eff and math.isfinite(state_bw[state]) and state_bw[state] > 0
    ], columns=["traffic", "GB/s per GPU", "efficiency"])


def chart(curves: pd.DataFrame, hardware: pd.DataFrame, points: pd.DataFrame) -> alt.LayerChart:
    x = alt.X("GB/s per GPU:Q", scale=alt.Scale(type="log", domain=[MIN_GB_PER_S, MAX_GB_PER_S]))
    lines = alt.Chart(curves).mark_line().encode(
        x=x, y=alt.Y("efficiency:Q", scale=alt.Scale(domain=[0, 1]), title="efficiency without overlap (eq. 6)"),
        color=alt.Color("traffic:N", legend=alt.Legend(orient="bottom", columns=3, labelLimit=400, title=None)),
    )
    rules = alt.Chart(hardware).mark_rule(strokeDash=[4, 3], color="gray").encode(x=x, tooltip=["link", "GB/s per GPU"])
    rule_labels = alt.Chart(hardware).mark_text(angle=270, align="right", baseline="bottom", dx=-6, dy=-4, color="gray").encode(
        x=x, y=alt.value(0), text="link:N")
    layers = [lines, rules, rule_labels]
    if not points.empty:  # nothing off the GPU (or nothing fits): no dots
        layers.append(alt.Chart(points).mark_point(size=120, filled=True).encode(
            x=x, y="efficiency:Q", color="traffic:N", tooltip=["traffic", alt.Tooltip("efficiency:Q", format=".3f")]))
    return alt.layer(*layers).properties(height=380)


def render(plan: Plan) -> None:
    ait = arithmetic_intensity(plan)
    curves, hardware, points = curves_frame(plan), hardware_frame(plan), points_frame(plan)
    st.altair_chart(chart(curves, hardware, points), key="bandwidth_chart")
    st.caption(
        f"Arithmetic intensity at batch {plan.micro_batch_per_gpu:g}, seq {plan.model.seq_len}, hidden "
        f"{plan.model.hidden_size}, recompute interval {plan.recompute_interval}: "
        + ", ".join(f"{STATE_LABELS[s]} {ait[s]:,.0f} flops/byte" for s in EFFICIENCY_STATES)
        + f"; achievable peak {plan.node.gpu_flops_per_s / 1e12:,.0f} TFLOPS. Dashed: this hardware's per-GPU "
        "bandwidths; dots: where the chosen placement puts each off-GPU state."
    )
