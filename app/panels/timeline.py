"""Where the iteration's time goes: the analytic phase and component times, and the simulated
timeline (Gantt chart of every resource with memory curves) and per-resource utilisation."""

from __future__ import annotations

import altair as alt
import pandas as pd
import streamlit as st

from planner.plan import Plan


def phases_frame(plan: Plan) -> pd.DataFrame:
    """The analytic estimate: each phase's time, and what each kind of work needs on its own."""
    pred = plan.prediction
    assert pred is not None and pred.feasible
    rows = [{"kind": "phase", "what": phase, "seconds": seconds} for phase, seconds in pred.phase_time_s.items()]
    rows += [
        {"kind": "component (alone)", "what": name, "seconds": seconds}
        for name, seconds in pred.details.get("component_time_s", {}).items()
    ]
    return pd.DataFrame(rows)


def phases_chart(frame: pd.DataFrame) -> alt.Chart:
    return alt.Chart(frame).mark_bar().encode(
        x=alt.X("seconds:Q"), y=alt.Y("what:N", sort=None, title=None), color=alt.Color("kind:N"),
        tooltip=["kind", "what", alt.Tooltip("seconds:Q", format=",.3f")],
    ).properties(height=28 * max(1, len(frame)))


def render(plan: Plan) -> None:
    pred = plan.prediction
    assert pred is not None
    if not pred.feasible:
        st.info("Nothing fits, so there is no iteration to time.")
        return
    st.markdown("**Analytic estimate** (paper §4): forward and backward overlap traffic with compute when the "
                "prefetch depth is at least 1; the optimizer step is not overlapped.")
    st.altair_chart(phases_chart(phases_frame(plan)), key="phases_chart")
    st.info("The discrete-event simulator (`planner.sim`, issue 3) is not part of this build, so the simulated "
            "timeline and per-resource utilisation are not shown.")
