"""Largest trainable model vs number of GPUs for each strategy (paper Fig. 1 / Fig. 5 "model scale")."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from app import compute
from app.state import Inputs
from planner.specs.hardware import NodeSpec
from planner.specs.plan import STRATEGY_TABLE

MIN_LARGEST_COUNT = 128
"""The curves reach at least this many GPUs (and four times the GPUs asked for)."""


def gpu_counts(node: NodeSpec, num_gpus: int) -> list[int]:
    """Powers of two within a node, whole nodes beyond it (when the hardware states a network between
    nodes: without one a plan cannot span two), plus the count being planned."""
    per_node = node.num_gpus_per_node
    largest = max(MIN_LARGEST_COUNT, 4 * num_gpus) if node.inter_node_bytes_per_s else per_node
    counts = {n for n in (2**k for k in range(32)) if n < per_node}
    n = per_node
    while n <= largest:
        counts.add(n)
        n *= 2
    counts.add(num_gpus)
    return sorted(counts)


def scale_frame(inputs: Inputs, node: NodeSpec, seq_len: int) -> pd.DataFrame:
    rows = [
        {"strategy": strategy, "GPUs": gpus,
         "max params (B)": compute.max_params(strategy, inputs.hardware_key(), gpus, seq_len) / 1e9}
        for strategy in STRATEGY_TABLE
        for gpus in gpu_counts(node, inputs.num_gpus)
    ]
    return pd.DataFrame(rows)


def chart(frame: pd.DataFrame, num_gpus: int, model_params_b: float) -> alt.LayerChart:
    fits = frame[frame["max params (B)"] > 0]
    x = alt.X("GPUs:Q", scale=alt.Scale(type="log", base=2), title="number of GPUs")
    y = alt.Y("max params (B):Q", scale=alt.Scale(type="log"), title="largest trainable model (B params)")
    lines = alt.Chart(fits).mark_line(point=True).encode(
        x=x, y=y, color=alt.Color("strategy:N", sort=list(STRATEGY_TABLE)),
        tooltip=["strategy", "GPUs", alt.Tooltip("max params (B):Q", format=",.1f")],
    )
    here = pd.DataFrame([{"GPUs": num_gpus, "max params (B)": model_params_b, "what": "your model and GPUs"}])
    gpus_rule = alt.Chart(here).mark_rule(strokeDash=[4, 3], color="gray").encode(x="GPUs:Q")
    model_rule = alt.Chart(here).mark_rule(strokeDash=[4, 3], color="gray").encode(y="max params (B):Q")
    marker = alt.Chart(here).mark_point(shape="cross", size=200, color="black").encode(x=x, y=y, tooltip=["what"])
    return alt.layer(lines, gpus_rule, model_rule, marker).properties(height=380)


def render(inputs: Inputs, node: NodeSpec, seq_len: int, model_params: int) -> None:
    frame = scale_frame(inputs, node, seq_len)
    st.altair_chart(chart(frame, inputs.num_gpus, model_params / 1e9), key="scale_chart")
    st.caption(
        f"Batch 1 per GPU, sequence {seq_len}, shapes by the shape rule (docs/planner.md), 1% precision, on "
        f"{node.name}. The cross is the model and GPU count in the sidebar: strategies above it can train it."
    )
    table = frame.pivot(index="GPUs", columns="strategy", values="max params (B)")[list(STRATEGY_TABLE)]
    st.dataframe(table.round(1), key="scale_table")
