"""Tierwise what-if dashboard: `planner dashboard` or `streamlit run app/dashboard.py`.

A thin page over the `planner` library (docs/conventions.md, "The command line"): the sidebar produces one `Inputs`
value, cached library calls answer it (app/compute.py), and each panel draws one result.
"""

from __future__ import annotations

import streamlit as st

from app import compute
from app.panels import bandwidth, history, memory, scale, strategies, timeline, verdict
from app.sidebar import read_sidebar
from app.state import Inputs, model_spec, node_spec
from app.words import in_words
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan

TABS = ("Memory per tier", "Strategies", "Timeline", "Bandwidth (eq. 6)", "Largest model", "Predicted vs measured")


def main() -> None:
    st.set_page_config(page_title="Tierwise what-if", layout="wide")
    st.title("Tierwise: what fits, where, and how fast")
    inputs = read_sidebar()
    try:
        model, node = model_spec(inputs), node_spec(inputs.hardware, inputs.overrides, inputs.hardware_document)
        shown = compute.verdict(inputs.to_json())
    except PlannerError as exc:
        st.error(in_words(str(exc)))  # one line naming the value in the page's words; never a traceback
        return
    plan = verdict.render(shown)
    # Lazy tabs: only the open panel runs, so an interaction pays for what is on screen.
    tabs = dict(zip(TABS, st.tabs(TABS, key="panel", on_change="rerun"), strict=True))
    for label, tab in tabs.items():
        if tab.open is False:
            continue
        with tab:
            try:
                _render_panel(label, inputs, plan, model, node)
            except PlannerError as exc:
                st.error(in_words(str(exc)))


def _render_panel(label: str, inputs: Inputs, plan: Plan | None, model: ModelSpec, node: NodeSpec) -> None:
    if label == "Strategies":  # every strategy: the same question with the placement left free
        strategies.render(compute.strategy_plans(inputs.unpinned().to_json()))
    elif label == "Largest model":
        scale.render(inputs, node, model.seq_len, model.num_params)
    elif label == "Predicted vs measured":
        history.render()
    elif plan is None:
        return
    elif label == "Memory per tier":
        memory.render(plan)
    elif label == "Timeline":
        timeline.render(compute.analytic(plan))
    elif label == "Bandwidth (eq. 6)":
        bandwidth.render(compute.analytic(plan))

if __name__ == "__main__":  # `streamlit run` and AppTest run the file as __main__
    main()
