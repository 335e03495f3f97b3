"""Discrete-event simulator (SimPy) of one offloaded training iteration.

`simulate(plan)` runs the schedule in `engine.py` over the links in `resources.py` and returns the
plan's `prediction` block (docs/plan-format.md) with method `simulated`; `fast.predict` extrapolates it over identical
blocks for ranking. The search re-ranks by it (planner/search/refine.py) and planner/output/timeline.py
draws its Gantt chart.
"""

from planner.sim.report import SimResult, simulate

__all__ = ["SimResult", "simulate"]
