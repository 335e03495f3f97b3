"""Memory per tier as stacked bars of every state and buffer, against the tier's capacity.

Colours are grouped: one hue per tier, and within a tier the terms of one kind (model state, working
memory, runtime buffer, allocator slack) are neighbouring shades, so a bar reads tier by tier and
kind by kind instead of as a row of unrelated pastels.
"""

from __future__ import annotations

import colorsys

import altair as alt
import pandas as pd
import streamlit as st

from planner.output.report import fmt_bytes, tier_name
from planner.specs.memory_terms import MemoryTerm, describe
from planner.specs.plan import Plan
from planner.specs.tiers import TIERS
from planner.specs.units import GIB

KINDS = ("model state", "working memory", "runtime buffer", "allocator slack")
TIER_HUES = (0.58, 0.08, 0.78, 0.33, 0.95)
"""Hue of each tier in `TIERS` order (GPU blue, CPU orange, NVMe purple, then green and red)."""
KIND_SATURATION = {"model state": 0.75, "working memory": 0.55, "runtime buffer": 0.4, "allocator slack": 0.15}


def term_kind(term: str) -> str:
    """What a memory term is: a model state the placement puts in a tier, GPU working memory that comes
    and goes, a runtime buffer, or the allocator's slack."""
    member = MemoryTerm(term)
    if member is MemoryTerm.ALLOCATOR_SLACK:
        return "allocator slack"
    if tuple(member.tiers) == tuple(TIERS):
        return "model state"
    return "working memory" if member.transient else "runtime buffer"


def memory_frame(plan: Plan) -> pd.DataFrame:
    """One row per (tier, named term) of the plan's memory bill, in bytes and GiB, with its colour."""
    pred = plan.prediction
    assert pred is not None
    rows = [
        {
            "tier": tier_name(tier, plan.node),
            "term": term,
            "kind": term_kind(term),
            "shown as": f"{_short(tier, plan)}: {MemoryTerm(term).label} ({term_kind(term)})",
            "bytes": nbytes,
            "GiB": nbytes / GIB,
            "capacity GiB": pred.capacity_bytes[tier] / GIB,
            "formula": describe(term),
        }
        for tier in TIERS
        for term, nbytes in sorted(pred.memory_terms.get(tier, {}).items(),
                                   key=lambda kv: (KINDS.index(term_kind(kv[0])), -kv[1]))
        if nbytes
    ]
    columns = ["tier", "term", "kind", "shown as", "bytes", "GiB", "capacity GiB", "formula"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["colour"] = _colours(frame)
    return frame


def _short(tier, plan: Plan) -> str:  # noqa: ANN001
    return "device" if plan.node.host_is_device and tier.on_device else tier.label


def _colours(frame: pd.DataFrame) -> list[str]:
    """A hue per tier, a saturation per kind, and lightness stepping through the tier's terms."""
    out = []
    tiers = list(dict.fromkeys(frame["tier"]))
    for _, row in frame.iterrows():
        hue = TIER_HUES[tiers.index(row["tier"]) % len(TIER_HUES)]
        siblings = frame[frame["tier"] == row["tier"]]
        position = list(siblings.index).index(row.name) / max(1, len(siblings) - 1)
        r, g, b = colorsys.hls_to_rgb(hue, 0.32 + 0.45 * position, KIND_SATURATION[row["kind"]])
        out.append(f"#{round(r * 255):02x}{round(g * 255):02x}{round(b * 255):02x}")
    return out


def tiers_frame(plan: Plan) -> pd.DataFrame:
    pred = plan.prediction
    assert pred is not None
    return pd.DataFrame([
        {
            "tier": tier_name(tier, plan.node),
            "needs": fmt_bytes(pred.peak_bytes[tier]),
            "capacity": fmt_bytes(pred.capacity_bytes[tier]),
            "fits": "yes" if pred.peak_bytes[tier] <= pred.capacity_bytes[tier] else "no",
        }
        for tier in TIERS
    ])


def chart(frame: pd.DataFrame, plan: Plan) -> alt.FacetChart:
    """One row per tier (its own scale: GiB per GPU beside TiB per node); the black tick is capacity."""
    bars = alt.Chart().mark_bar().encode(
        x=alt.X("sum(GiB):Q", title="GiB"),
        color=alt.Color("shown as:N", scale=alt.Scale(domain=list(frame["shown as"]), range=list(frame["colour"])),
                        sort=list(frame["shown as"]), legend=alt.Legend(title="state or buffer (kind)", labelLimit=360, orient="bottom", columns=2)),
        order=alt.Order("order:Q"),
        tooltip=["term", "kind", alt.Tooltip("GiB:Q", format=",.2f"), "formula"],
    )
    capacity = alt.Chart().mark_tick(color="black", thickness=3, size=34).encode(
        x=alt.X("max(capacity GiB):Q"), tooltip=[alt.Tooltip("max(capacity GiB):Q", title="capacity GiB", format=",.1f")],
    )
    data = frame.assign(order=range(len(frame)))
    data = data[data["bytes"] > 0]  # `not_at_once` takes back what the bars' worst cases never hold together
    rows = [tier_name(t, plan.node) for t in TIERS]
    return (
        alt.layer(bars, capacity, data=data)
        .properties(height=40, width=560)
        .facet(row=alt.Row("tier:N", title=None, sort=rows, header=alt.Header(labelAngle=0, labelAlign="left")))
        .resolve_scale(x="independent")
    )


def render(plan: Plan) -> None:
    frame = memory_frame(plan)
    st.altair_chart(chart(frame, plan), key="memory_chart")
    scopes = ", ".join(tier_name(t, plan.node) for t in TIERS)
    apart = frame[frame["bytes"] < 0]
    taken_back = "".join(f" On {row['tier']} the bar adds each working term's worst case; the worst moment holds "
                         f"{fmt_bytes(-row['bytes'])} less (not at once)." for _, row in apart.iterrows())
    st.caption(f"Bars: every state and runtime buffer of the memory bill (docs/planner.md), one hue per tier and "
               f"neighbouring shades per kind; black tick: capacity. Tiers: {scopes}.{taken_back}")
    st.dataframe(tiers_frame(plan), hide_index=True, key="tiers_table")
    with st.expander("Every term and its formula"):
        terms = frame[["tier", "term", "kind", "bytes", "formula"]].assign(size=[fmt_bytes(b) for b in frame["bytes"]])
        st.dataframe(terms[["tier", "term", "kind", "size", "bytes", "formula"]], hide_index=True, key="terms_table")
