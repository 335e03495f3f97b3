"""The verdict and the chosen plan, with the plan JSON and DeepSpeed config to download.

Every number and sentence comes from `planner.output.verdict.Verdict`, the one `planner fit` prints
([Note: one verdict]); this panel lays it out.
"""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from app.words import in_words
from planner.output import report
from planner.output.deepspeed_config import deepspeed_config
from planner.output.verdict import SCHEDULE_WORDS, Verdict
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan

METHOD_CAPTIONS = {
    "analytic": "Predicted by the analytic estimate (paper §4). Turn on *Rank the top plans by simulation* in the "
                "sidebar for the simulator's numbers, as `planner fit` reports them.",
    "simulated": "Predicted by the discrete-event simulator: the best plan of each of the top placements was "
                 "simulated and re-ranked, as `planner fit` does.",
}
SIDEBAR_SCHEDULES = {"in_backward": "choose *in_backward* as the sidebar's *Optimizer step*",
                     "after_backward": "choose *after_backward* as the sidebar's *Optimizer step*"}
"""How the sidebar asks for each optimizer-step schedule."""


def columns_frame(columns: list[tuple[str, list[str]]]) -> pd.DataFrame:
    """A table of display strings (`planner.output.report`'s columns): the CLI's cells, no placeholders."""
    return pd.DataFrame({header: cells for header, cells in columns})


def candidates_frame(verdict: Verdict) -> pd.DataFrame:
    return columns_frame(report.candidate_columns(verdict.runners, winner=verdict.plan,
                                                  bottlenecks=verdict.runner_bottlenecks))


def rejected_frame(plans: list[Plan]) -> pd.DataFrame:
    return columns_frame(report.rejected_columns(plans))


def render(verdict: Verdict) -> Plan | None:
    plan = verdict.plan
    assert plan is not None and plan.prediction is not None
    st.caption(f"**Model** {report.model_line(plan)}")
    if verdict.share_note:
        st.caption(verdict.share_note)
    if not verdict.fits:
        st.warning(f"**Verdict:** {verdict.headline()}. Best try per placement below.")
        st.table(rejected_frame(verdict.result.rejected))  # a static table wraps the reasons instead of cutting them
        return plan
    st.success(f"**Verdict:** {verdict.headline()}")
    st.markdown(f"**Plan** {report.plan_line(plan)}")
    _metrics(verdict, plan)
    _downloads(plan)
    if verdict.runners:
        with st.expander("Runner-up plans (best of other placements)"):
            st.dataframe(candidates_frame(verdict), hide_index=True, key="runners_table")
            if any(report.is_bound(p, plan) for p in verdict.runners):
                st.caption(report.bound_note(verdict.runners, plan).replace("<= / >=: a", "Rows marked <= / >=: a"))
    return plan


def _metrics(verdict: Verdict, plan: Plan) -> None:
    pred, path = plan.prediction, verdict.path
    assert pred is not None and path is not None
    cols = st.columns([1, 1, 1, 1.4])
    flops_rule = "8 x tokens x params" if plan.recompute_interval else "6 x tokens x params"
    cols[0].metric("Iteration time", report.fmt_seconds(pred.iteration_time_s))
    cols[1].metric(f"TFLOPS per {report.device_word(plan.node)}", report.fmt_tflops(pred.tflops_per_gpu),
                   help=f"paper accounting, eq. 7: {flops_rule}")
    cols[2].metric("Tokens per second", f"{pred.tokens_per_s:,.0f}")
    cols[3].metric("Bottleneck", path.bottleneck, help="The exposed critical path: what the GPU waits on (docs/planner.md)")
    st.markdown(f"**Bottleneck:** {path.sentence()}")
    for alternative in verdict.cheaper:
        step = alternative.optimizer_step
        st.markdown(alternative.line(f"**Cheaper:** {SCHEDULE_WORDS[step]} ({SIDEBAR_SCHEDULES[step]})"))
    st.caption(METHOD_CAPTIONS[pred.method])
    st.caption(f"**Optimizer step** {report.schedule_line(plan)}")


def _downloads(plan: Plan) -> None:
    downloads = st.columns(2)
    downloads[0].download_button(
        "Download plan JSON", json.dumps(plan.to_dict(), indent=2) + "\n", file_name="plan.json",
        mime="application/json", key="download_plan",
    )
    try:
        ds_config = json.dumps(deepspeed_config(plan), indent=2) + "\n"
    except PlannerError as exc:
        downloads[1].info(f"No DeepSpeed config: {in_words(str(exc))}")
    else:
        downloads[1].download_button(
            "Download DeepSpeed config", ds_config, file_name="deepspeed_config.json", mime="application/json",
            key="download_deepspeed",
        )
        if plan.optimizer_step == "in_backward":
            downloads[1].caption("DeepSpeed steps the optimizer after backward: the config runs this placement "
                                 "with DeepSpeed's own step.")
