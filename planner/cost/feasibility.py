"""Whether the cost models can price a plan: the checks a `Plan` does not make of itself.

A `Plan` (planner/specs/plan.py) only describes: it checks its own fields (types, choices, ranges,
whole nodes, the placement rules) and knows no cost model. Whether the hardware has the rate the plan
asks for and whether a context-parallel layout splits as ring attention needs are the cost models'
knowledge; `check_plan` applies it. Every place that builds a plan from outside input (a plan file, a
profile's plan, the user's pins, the search's request, a corpus row, another machine's spec laid over
a plan, the runtime's plan reader) calls it, so such a plan is refused with the same one-line message
wherever it enters.
"""

from __future__ import annotations

from planner.cost.context_parallel import check_context_parallel
from planner.cost.fp8 import fp8_speedup
from planner.specs.plan import Plan


def check_plan(plan: Plan) -> Plan:
    """`plan` itself, or a one-line `PlannerError`: fp8 matmuls on hardware without an fp8 rate
    ([Note: fp8 matmuls] in planner/cost/fp8.py), a context-parallel layout ring attention cannot run
    ([Note: context parallelism] in planner/cost/context_parallel.py)."""
    if plan.fp8_matmuls:
        fp8_speedup(plan.node)
    if plan.context_parallel_degree > 1:
        check_context_parallel(plan)
    return plan
