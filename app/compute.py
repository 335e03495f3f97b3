"""Cached calls into the planner library ([Note: dashboard caching keys] in app/state.py).

Nothing here computes a number of its own: each function rebuilds specs from its hashable key and
calls the library.
"""

from __future__ import annotations

import json
from dataclasses import replace

import streamlit as st

from app.state import Inputs, node_spec, search_request
from planner.output.verdict import Verdict, critical_path, simulated_like
from planner.output.verdict import verdict as build_verdict
from planner.search.max_size import max_size
from planner.search.search import SearchResult, best_by_strategy, predict, search
from planner.specs.plan import Plan

CACHE_ENTRIES = 64


@st.cache_data(max_entries=CACHE_ENTRIES, show_spinner="Searching placements...")
def search_result(inputs_json: str) -> SearchResult:
    """The analytic search (paper §4), or with `refine` its top placements re-ranked by the simulator
    exactly as `planner fit` reports them."""
    inputs = Inputs.from_json(inputs_json)
    result = search(search_request(inputs))
    if inputs.refine:
        from planner.search.refine import refine

        result = refine(result)
    return result


@st.cache_data(max_entries=CACHE_ENTRIES, show_spinner="Simulating the plan's critical path and the runner-ups...")
def verdict(inputs_json: str) -> Verdict:
    """What `planner fit` prints for the same inputs ([Note: one verdict] in planner/output/verdict.py);
    another optimizer-step schedule is asked of the cached search."""
    inputs = Inputs.from_json(inputs_json)
    return build_verdict(search_result(inputs_json),
                         lambda step: search_result(replace(inputs, optimizer_step=step).to_json()).best)


@st.cache_data(max_entries=CACHE_ENTRIES, show_spinner="Simulating each strategy's best plan...")
def strategy_plans(inputs_json: str) -> dict[str, tuple[Plan, str]]:
    """Strategy -> (its best plan, predicted as the verdict's winner is, and that plan's bottleneck:
    the exposed critical path; "" where nothing fits), for the Strategies panel."""
    result = search_result(inputs_json)
    best = best_by_strategy(result)
    plans = dict(zip(best, simulated_like(list(best.values()), result.best), strict=True))
    return {name: (plan, critical_path(plan).bottleneck if plan.prediction.feasible else "")
            for name, plan in plans.items()}


def analytic(plan: Plan) -> Plan:
    """The plan with its analytic prediction (memory bill, eq. 6 efficiencies), whichever method ranked it."""
    assert plan.prediction is not None
    return plan if plan.prediction.method == "analytic" else predict(plan.replace(prediction=None))


@st.cache_data(max_entries=16 * CACHE_ENTRIES, show_spinner=False)  # one int per curve point
def max_params(strategy: str, hardware_key: str, num_gpus: int, seq_len: int) -> int:
    """Largest trainable parameter count (0: not even the smallest model fits)."""
    hardware, overrides, document = json.loads(hardware_key)
    node = node_spec(hardware, tuple((k, v) for k, v in overrides), document)
    return max_size(strategy, node, num_gpus, seq_len=seq_len, with_plan=False).max_params
