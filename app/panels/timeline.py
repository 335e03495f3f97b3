"""Where the iteration's time goes: the discrete-event simulation of the chosen plan (per-resource
utilisation, the Gantt chart of every resource, memory over time) beside the analytic estimate."""

from __future__ import annotations

import json

import altair as alt
import pandas as pd
import streamlit as st

from planner.output import report
from planner.output.critical_path import CriticalPath, analytic_path
from planner.output.timeline import PHASE_COLORS, busy_bins, zoom_caption, zoom_spans
from planner.output.verdict import critical_path
from planner.sim import SimResult
from planner.sim.periodic import simulate_periodic
from planner.specs.plan import Plan, Prediction
from planner.specs.tiers import TIERS
from planner.specs.units import GIB

GANTT_BINS = 300
"""Bins of the full-iteration chart: finer than the chart's width in pixels is not readable."""


@st.cache_resource(max_entries=8, show_spinner="Simulating the iteration...")
def simulation(plan_json: str) -> SimResult:
    """One simulated iteration of the plan with its whole timelines, for a deep model extrapolated from
    three short simulations ([Note: periodic timelines] in planner/sim/periodic.py); never mutated."""
    return simulate_periodic(Plan.from_dict(json.loads(plan_json)))


def utilisation_frame(sim: Prediction, path: CriticalPath | None = None) -> pd.DataFrame:
    """Busy fraction of every simulated resource (rank 0's own links and the node's shared ones), by
    its display name, with the seconds it is busy while the GPU computes nothing (`path`)."""
    labels = report.resource_labels()
    exposed = {} if path is None else {k: path.waits_by.get(k, 0.0) + path.step_by.get(k, 0.0)
                                       for k in {*path.waits_by, *path.step_by}}
    rows = [
        {"resource": labels.get(name, name), "scope": r["scope"], "busy": r["busy_fraction"], "busy (s)": r["busy_s"],
         "exposed (s)": exposed.get(labels.get(name, name), 0.0), "moved": r["amount"], "unit": r["unit"]}
        for name, r in sim.details["resources"].items()
    ]
    return pd.DataFrame(rows).sort_values("busy", ascending=False, ignore_index=True)


def comparison_frame(analytic: Prediction, sim: Prediction, bottlenecks: tuple[str, str] | None = None) -> pd.DataFrame:
    """Analytic beside simulated; `bottlenecks`: each one's exposed critical path (planner/output/critical_path.py)."""
    rows = [("iteration time", analytic.iteration_time_s, sim.iteration_time_s, report.fmt_seconds),
            ("TFLOPS per GPU", analytic.tflops_per_gpu, sim.tflops_per_gpu, lambda v: f"{v:,.1f}"),
            ("tokens per second", analytic.tokens_per_s, sim.tokens_per_s, lambda v: f"{v:,.0f}")]
    rows += [(f"  {phase}", analytic.phase_time_s[phase], sim.phase_time_s[phase], report.fmt_seconds)
             for phase in analytic.phase_time_s]
    table = [{"": name, "analytic": fmt(a), "simulated": fmt(s)} for name, a, s, fmt in rows]
    analytic_label, sim_label = bottlenecks or (report.bottleneck_label(analytic.bottleneck),
                                                report.bottleneck_label(sim.bottleneck))
    table.append({"": "bottleneck", "analytic": analytic_label, "simulated": sim_label})
    return pd.DataFrame(table)


def utilisation_chart(frame: pd.DataFrame) -> alt.Chart:
    return alt.Chart(frame).mark_bar().encode(
        x=alt.X("busy:Q", scale=alt.Scale(domain=[0, 1]), axis=alt.Axis(format="%"), title="busy fraction of the iteration"),
        y=alt.Y("resource:N", sort=None, title=None, axis=alt.Axis(labelOverlap=False)), color=alt.Color("scope:N"),
        tooltip=["resource", "scope", alt.Tooltip("busy:Q", format=".1%"), alt.Tooltip("busy (s):Q", format=",.3f"),
                 alt.Tooltip("exposed (s):Q", format=",.3f", title="busy while the GPU computes nothing (s)"),
                 alt.Tooltip("moved:Q", format=",.4g"), "unit"],
    ).properties(height=36 * max(1, len(frame)))


def memory_frame(sim: Prediction, plan: Plan) -> pd.DataFrame:
    """Bytes in use over the simulated iteration per tier (the simulator's own view, downsampled)."""
    timeline = sim.details.get("memory_timeline") or {}
    return pd.DataFrame([
        {"tier": report.tier_name(tier, plan.node), "seconds": t, "GiB": nbytes / GIB,
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


def gantt_frames(result: SimResult) -> tuple[pd.DataFrame, tuple[float, float], pd.DataFrame]:
    """planner.output.timeline's data: busy fraction per resource and time bin, and one recompute
    segment of the backward pass span by span."""
    window, spans = zoom_spans(result)
    return pd.DataFrame(busy_bins(result, GANTT_BINS)), window, pd.DataFrame(spans)


_PHASE_SCALE = alt.Scale(domain=list(PHASE_COLORS), range=list(PHASE_COLORS.values()))


def gantt_chart(bins: pd.DataFrame, spans: pd.DataFrame, window: tuple[float, float], caption: str) -> alt.VConcatChart:
    """Full iteration (opacity: busy share of each bin, colour: its main phase) over a zoom where
    single operators are visible. Drawn by the browser (Vega-Lite), so a new plan costs no more
    than its data; `planner simulate PLAN --timeline out.png` writes the matplotlib picture."""
    rows = alt.Y("label:N", sort=list(dict.fromkeys(bins["label"])), title=None, axis=alt.Axis(labelLimit=320))
    full = alt.Chart(bins).mark_rect().encode(
        x=alt.X("start_s:Q", title="seconds into the iteration"), x2="end_s:Q", y=rows,
        color=alt.Color("phase:N", scale=_PHASE_SCALE, title="phase"),
        opacity=alt.Opacity("busy:Q", scale=alt.Scale(domain=[0, 1]), legend=None),
        tooltip=["label", alt.Tooltip("start_s:Q", format=",.4g"), alt.Tooltip("busy:Q", format=".0%"), "phase"],
    ).properties(height=28 * bins["label"].nunique(), width=760, title="whole iteration (opacity: busy share of the bin)")
    lo, hi = window
    zoom = alt.Chart(spans).mark_bar().encode(
        x=alt.X("start_s:Q", title="seconds", scale=alt.Scale(domain=[lo, hi])), x2="end_s:Q", y=rows,
        color=alt.Color("phase:N", scale=_PHASE_SCALE, title="phase"),
        tooltip=["label", "phase", alt.Tooltip("start_s:Q", format=",.5g"), alt.Tooltip("end_s:Q", format=",.5g")],
    ).properties(height=28 * max(1, spans["label"].nunique()), width=760,
                 title=f"zoom {lo:.4g}-{hi:.4g} s: {caption}")
    return alt.vconcat(full, zoom)


def render(plan: Plan) -> None:
    analytic = plan.prediction
    assert analytic is not None
    if not analytic.feasible:
        st.info("Nothing fits, so there is no iteration to simulate.")
        return
    plan_json = json.dumps(plan.to_dict())
    result = simulation(plan_json)
    sim = result.prediction
    simulated = plan.replace(prediction=sim)
    path = critical_path(simulated, result.timelines)
    left, right = st.columns([2, 3])
    with left:
        st.markdown("**Simulated vs analytic**")
        bottlenecks = (analytic_path(plan).bottleneck, path.bottleneck)
        st.dataframe(comparison_frame(analytic, sim, bottlenecks), hide_index=True, key="sim_comparison")
    with right:
        st.markdown("**Per-resource utilisation** (simulated)")
        st.altair_chart(utilisation_chart(utilisation_frame(sim, path)), key="utilisation_chart")
    st.markdown(f"**Bottleneck** (simulated): {path.sentence()}")
    st.markdown("**Gantt chart** (simulated, rank 0's links and the node's shared ones)")
    bins, window, spans = gantt_frames(result)
    st.altair_chart(gantt_chart(bins, spans, window, zoom_caption(result)), key="gantt_chart")
    st.markdown("**Memory over the iteration** (simulated; dashed: capacity)")
    st.altair_chart(memory_chart(memory_frame(sim, plan)), key="sim_memory_chart")
