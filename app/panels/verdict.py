"""The verdict and the chosen plan, with the plan JSON and DeepSpeed config to download."""

from __future__ import annotations

import json

import pandas as pd
import streamlit as st

from planner.output import report
from planner.output.deepspeed_config import deepspeed_config
from planner.search.search import SearchResult
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan

METHOD_CAPTIONS = {
    "analytic": "Predicted by the analytic estimate (paper §4). Turn on *Rank the top plans by simulation* in the "
                "sidebar for the simulator's numbers, as `planner fit` reports them.",
    "simulated": "Predicted by the discrete-event simulator: the best plan of each of the top placements was "
                 "simulated and re-ranked, as `planner fit` does.",
}
NUMBER_FORMATS = {
    "TFLOPS/GPU": st.column_config.NumberColumn(format="%.1f"),
    "iteration (s)": st.column_config.NumberColumn(format="%.3g"),
    "batch/GPU": st.column_config.NumberColumn(format="%g"),
    "tokens/s": st.column_config.NumberColumn(format="%.0f"),
}


def chosen_plan(result: SearchResult) -> Plan | None:
    """The best feasible plan, or the best try when nothing fits (it carries the reason)."""
    return result.best or (result.rejected[0] if result.rejected else None)


def candidates_frame(plans: list[Plan], winner: Plan | None = None) -> pd.DataFrame:
    rows = []
    for plan in plans:
        pred = plan.prediction
        assert pred is not None
        bound = report.is_bound(plan, winner)  # [Note: runner-up bounds] in planner/output/report.py
        rows.append({
            "strategy": plan.strategy,
            "placement": plan.placement.label(),
            "batch/GPU": plan.micro_batch_per_gpu,
            "recompute interval": plan.recompute_interval,
            "tiling": plan.tiling_factor,
            "prefetch": plan.prefetch_depth,
            "model parallel": plan.model_parallel_degree,
            "TFLOPS/GPU": pred.tflops_per_gpu if pred.feasible else None,
            "iteration (s)": pred.iteration_time_s if pred.feasible else None,
            "tokens/s": pred.tokens_per_s if pred.feasible else None,
            "bound": "analytic: at most this fast" if bound else "",
            "bottleneck": report.bottleneck_label(pred.bottleneck),
            "why not": pred.reason if not pred.feasible else "",
        })
    return pd.DataFrame(rows)


def where(plan: Plan) -> str:
    node = plan.node
    return f"{plan.num_gpus} GPU(s) of {node.name} ({plan.num_nodes} node(s) of {node.num_gpus_per_node})"


def render(result: SearchResult) -> Plan | None:
    plan = chosen_plan(result)
    if plan is None:
        st.error("No candidate plan could be formed; check the pinned options.")
        return None
    pred = plan.prediction
    assert pred is not None
    st.caption(f"**Model** {report.model_line(plan)}")
    if result.best is None:
        st.warning(f"**Does not fit** on {where(plan)}. Best try per placement below.")
        st.dataframe(candidates_frame(result.rejected), hide_index=True, key="rejected_table")
        return plan
    st.success(
        f"**Fits** on {where(plan)}: {len(result.ranked)} feasible plans of {result.num_evaluated} evaluated."
    )
    st.markdown(f"**Plan** {report.plan_line(plan)}")
    cols = st.columns(4)
    flops_rule = "8 x tokens x params" if plan.recompute_interval else "6 x tokens x params"
    cols[0].metric("Iteration time", report.fmt_seconds(pred.iteration_time_s))
    cols[1].metric("TFLOPS per GPU", f"{pred.tflops_per_gpu:,.1f}", help=f"paper accounting, eq. 7: {flops_rule}")
    cols[2].metric("Tokens per second", f"{pred.tokens_per_s:,.0f}")
    cols[3].metric("Bottleneck", report.bottleneck_label(pred.bottleneck))
    st.caption(METHOD_CAPTIONS[pred.method])
    st.caption(f"**Optimizer step** {report.schedule_line(plan)}")
    downloads = st.columns(2)
    downloads[0].download_button(
        "Download plan JSON", json.dumps(plan.to_dict(), indent=2) + "\n", file_name="plan.json",
        mime="application/json", key="download_plan",
    )
    try:
        ds_config = json.dumps(deepspeed_config(plan), indent=2) + "\n"
    except PlannerError as exc:
        downloads[1].info(f"No DeepSpeed config: {exc}")
    else:
        downloads[1].download_button(
            "Download DeepSpeed config", ds_config, file_name="deepspeed_config.json", mime="application/json",
            key="download_deepspeed",
        )
        if plan.optimizer_step == "in_backward":
            downloads[1].caption("DeepSpeed steps the optimizer after backward: the config runs this placement "
                                 "with DeepSpeed's own step.")
    runners = result.runners_up()
    if runners:
        with st.expander("Runner-up plans (best of other placements)"):
            frame = candidates_frame(runners, plan)
            st.dataframe(frame, hide_index=True, key="runners_table", column_config=NUMBER_FORMATS)
            if frame["bound"].any():
                st.caption(report.bound_note(runners, plan).replace("<= / >=: a", "Rows marked *bound*: a"))
    return plan
