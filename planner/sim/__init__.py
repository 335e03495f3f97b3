"""Discrete-event simulator (SimPy) of one offloaded training iteration (issue 3).

`simulate(plan)` runs the schedule in `engine.py` over the links in `resources.py` and returns the
DESIGN.md `prediction` block with method `simulated`; `refine` re-ranks the analytic search's best
candidates by simulated time; `timeline.draw` renders the Gantt chart.
"""

from planner.sim.report import SimResult, simulate

__all__ = ["SimResult", "simulate"]
