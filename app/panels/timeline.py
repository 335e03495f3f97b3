"""Where the iteration's time goes: the discrete-event simulation of the chosen plan (Gantt chart
of every resource with the memory curves, per-resource utilisation) beside the analytic estimate."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

from planner import report
from planner.plan import Plan, Prediction


@st.cache_data(max_entries=32, show_spinner="Simulating the iteration...")
def simulated(plan_json: str) -> tuple[dict, bytes]:
    """The simulated prediction block and the timeline PNG (planner.sim; cached on the plan)."""
    from planner.sim import simulate
    from planner.sim.timeline import draw

    result = simulate(Plan.from_dict(json.loads(plan_json)))
    with tempfile.TemporaryDirectory() as folder:
        png = draw(result, Path(folder) / "timeline.png").read_bytes()
    return result.prediction.to_dict(), png


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


def render(plan: Plan) -> None:
    analytic = plan.prediction
    assert analytic is not None
    if not analytic.feasible:
        st.info("Nothing fits, so there is no iteration to simulate.")
        return
    sim_doc, png = simulated(json.dumps(plan.to_dict()))
    sim = Prediction.from_dict(sim_doc)
    left, right = st.columns([2, 3])
    with left:
        st.markdown("**Simulated vs analytic**")
        st.dataframe(comparison_frame(analytic, sim), hide_index=True, key="sim_comparison")
    with right:
        st.markdown("**Per-resource utilisation** (simulated)")
        st.altair_chart(utilisation_chart(utilisation_frame(sim)), key="utilisation_chart")
    st.image(png, caption="Simulated timeline (planner.sim): every resource's busy fraction over the iteration, a zoom "
             "on one checkpoint segment, and GPU/CPU memory over time.")
