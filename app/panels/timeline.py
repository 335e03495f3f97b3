"""Where the iteration's time goes: the discrete-event simulation of the chosen plan (per-resource
utilisation, memory over time, and the simulator's Gantt chart of every resource) beside the
analytic estimate."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from planner import report
from planner.plan import TIERS, Plan, Prediction
from planner.sim import SimResult, simulate
from planner.units import GIB

GANTT_TOGGLE = "Draw the Gantt chart of every resource (matplotlib; takes about a second)"


@st.cache_resource(max_entries=8, show_spinner="Simulating the iteration...")
def simulation(plan_json: str) -> SimResult:
    """One simulated iteration of the plan (planner.sim), kept whole for the Gantt chart; never mutated."""
    return simulate(Plan.from_dict(json.loads(plan_json)))


@st.cache_data(max_entries=16, show_spinner="Drawing the Gantt chart...")
def gantt_png(plan_json: str) -> bytes:
    """planner.sim.timeline's picture: busy fraction of every resource, a zoom, memory curves."""
    from planner.sim.timeline import draw

    with tempfile.TemporaryDirectory() as folder:
        return draw(simulation(plan_json), Path(folder) / "timeline.png").read_bytes()


def utilisation_frame(sim: Prediction) -> pd.DataFrame:
    """Busy fraction of every simulated resource (rank 0's own links and the node's shared ones)."""
    rows = [
        {"resource": name, "scope": r["scope"], "busy": r["busy_fraction"], "busy (s)": r["busy_s"],
         "moved": r["amount"], "unit": r["unit"]}
        for name, r in sim.details["resources"].items()
    ]
    return pd.DataFrame(rows).sort_values("busy", ascending=False, ignore_index=True)


def comparison_frame(analytic: Prediction, sim: Prediction) -> pd.DataFrame:
    rows = [("iteration time", analytic.iteration_time_s, sim.iteration_time_s, report.fmt_seconds),
            ("TFLOPS per GPU", analytic.tflops_per_gpu, sim.tflops_per_gpu, lambda v: f"{v:,.1f}"),
            ("tokens per second", analytic.tokens_per_s, sim.tokens_per_s, lambda v: f"{v:,.0f}")]
    rows += [(f"  {phase}", analytic.phase_time_s[phase], sim.phase_time_s[phase], report.fmt_seconds)
             for phase in analytic.phase_time_s]
    table = [{"": name, "analytic": fmt(a), "simulated": fmt(s)} for name, a, s, fmt in rows]
    table.append({"": "bottleneck", "analytic": analytic.bottleneck, "simulated": sim.bottleneck})
    return pd.DataFrame(table)


def utilisation_chart(frame: pd.DataFrame) -> alt.Chart:
    return alt.Chart(frame).mark_bar().encode(
        x=alt.X("busy:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"), title="busy fraction of the iteration"),
        y=alt.Y("resource:N", sort=None, title=None, axis=alt.Axis(labelOverlap=False)), color=alt.Color("scope:N"),
        tooltip=["resource", "scope", alt.Tooltip("busy:Q", format=".1%"), alt.Tooltip("busy (s):Q", format=",.3f"),
                 alt.Tooltip("moved:Q", format=",.4g"), "unit"],
    ).properties(height=36 * max(1, len(frame)))


def memory_frame(sim: Prediction) -> pd.DataFrame:
    """Bytes in use over the simulated iteration per tier (the simulator's own view, downsampled)."""
    timeline, scope = sim.details.get("memory_timeline") or {}, sim.details.get("memory_scope", {})
    return pd.DataFrame([
        {"tier": f"{tier.upper()} ({scope.get(tier, '')})", "seconds": t, "GiB": nbytes / GIB,
         "capacity GiB": sim.capacity_bytes[tier] / GIB}
        for tier in TIERS
        for t, nbytes in timeline.get(tier, [])
    ], columns=["tier", "seconds", "GiB", "capacity GiB"])


def memory_chart(frame: pd.DataFrame) -> alt.FacetChart:
    used = alt.Chart().mark_area(interpolate="step-after", opacity=0.6).encode(
        x=alt.X("seconds:Q", title="seconds into the iteration"), y=alt.Y("GiB:Q", title="GiB in use"),
        tooltip=[alt.Tooltip("seconds:Q", format=",.3f"), alt.Tooltip("GiB:Q", format=",.1f")])
    capacity = alt.Chart().mark_rule(color="#C44E52", strokeDash=[4, 3]).encode(y="max(capacity GiB):Q")
    return (alt.layer(used, capacity, data=frame).properties(height=110, width=760)
            .facet(row=alt.Row("tier:N", title=None, sort=list(dict.fromkeys(frame["tier"]))))
            .resolve_scale(y="independent"))


def render(plan: Plan) -> None:
    analytic = plan.prediction
    assert analytic is not None
    if not analytic.feasible:
        st.info("Nothing fits, so there is no iteration to simulate.")
        return
    plan_json = json.dumps(plan.to_dict())
    sim = simulation(plan_json).prediction
    left, right = st.columns([2, 3])
    with left:
        st.markdown("**Simulated vs analytic**")
        st.dataframe(comparison_frame(analytic, sim), hide_index=True, key="sim_comparison")
    with right:
        st.markdown("**Per-resource utilisation** (simulated)")
        st.altair_chart(utilisation_chart(utilisation_frame(sim)), key="utilisation_chart")
    st.markdown("**Memory over the iteration** (simulated; dashed: capacity)")
    st.altair_chart(memory_chart(memory_frame(sim)), key="sim_memory_chart")
    # The picture costs more to draw than the whole rest of the page, so it is drawn on request and
    # cached per plan; everything above answers within the page's time budget (issue 7).
    if st.toggle(GANTT_TOGGLE, key="gantt"):
        st.image(gantt_png(plan_json), caption="Simulated timeline (planner.sim.timeline): every resource's busy "
                 "fraction over the iteration, a zoom on one checkpoint segment, and memory over time.")
