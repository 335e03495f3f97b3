"""Tierwise what-if dashboard: `planner dashboard` or `streamlit run app/dashboard.py`.

A thin page over the `planner` library (DESIGN.md principle 9): the sidebar produces one `Inputs`
value, cached library calls answer it (app/compute.py), and each panel draws one result.
"""

from __future__ import annotations

import streamlit as st

from app import compute
from app.panels import bandwidth, history, memory, scale, strategies, timeline, verdict
from app.sidebar import read_sidebar
from app.state import model_spec, node_spec
from planner.errors import PlannerError

TABS = ("Memory per tier", "Strategies", "Timeline", "Bandwidth (eq. 6)", "Largest model", "Predicted vs measured")


def main() -> None:
    st.set_page_config(page_title="Tierwise what-if", layout="wide")
    st.title("Tierwise: what fits, where, and how fast")
    inputs = read_sidebar()
    try:
        model, node = model_spec(inputs), node_spec(inputs.hardware, inputs.overrides)
        result = compute.search_result(inputs.to_json())
        everything = compute.search_result(inputs.unpinned().to_json())
    except PlannerError as exc:
        st.error(str(exc))  # one line naming the value, as the CLI prints it; never a traceback
        return
    plan = verdict.render(result)
    tabs = st.tabs(TABS)
    with tabs[0]:
        if plan is not None:
            memory.render(plan)
    with tabs[1]:
        strategies.render(everything)
    with tabs[2]:
        if plan is not None:
            timeline.render(plan)
    with tabs[3]:
        if plan is not None:
            bandwidth.render(plan)
    with tabs[4]:
        try:
            scale.render(inputs, node, model.seq_len, model.num_params)
        except PlannerError as exc:
            st.error(str(exc))
    with tabs[5]:
        history.render()


if __name__ == "__main__":  # `streamlit run` and AppTest run the file as __main__
    main()
