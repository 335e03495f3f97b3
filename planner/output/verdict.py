"""What `planner fit` prints and the dashboard's verdict shows, computed once for both.

[Note: one verdict] The CLI and the page draw the same `Verdict`: where the plan runs (the
request's node, with the share of it a partial node bills), how many plans fit of how many were
evaluated, the chosen plan's bottleneck as the exposed critical path (critical_path.py), the cheaper
optimizer-step schedule when the step is what is exposed, and the runner-up plans simulated like the
winner, so every time in the table is a prediction of the same kind. Only the markup differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from planner.cost.pipeline import is_composed
from planner.output.critical_path import CriticalPath, analytic_path, simulated_path, two_stream_path
from planner.output.report import batch_words, fmt_seconds
from planner.search.search import SearchRequest, SearchResult, predict
from planner.sim.report import Timelines
from planner.specs.errors import PlannerError
from planner.specs.plan import OPTIMIZER_STEPS, Plan

SCHEDULE_WORDS = {
    "after_backward": "the optimizer step after the backward",
    "in_backward": "the optimizer step in the backward (each unit updated as soon as its gradient is final)",
}
"""`Plan.optimizer_step` values as the page says them (the CLI names the flag)."""


@dataclass(frozen=True, slots=True)
class Alternative:
    """The best plan of the same request with another optimizer-step schedule."""

    optimizer_step: str
    plan: Plan

    def line(self, how: str) -> str:
        """`how` says how to ask for it (a flag, or the sidebar's words)."""
        pred = self.plan.prediction
        assert pred is not None
        return (f"{how} predicts {fmt_seconds(pred.iteration_time_s)} per iteration ({pred.tokens_per_s:,.0f} tokens/s, "
                f"micro-batch {batch_words(self.plan)})")


@dataclass(frozen=True, slots=True)
class Verdict:
    result: SearchResult
    plan: Plan | None
    """The best feasible plan, or the best try when nothing fits (it carries the reason)."""
    where: str
    """`16 GPU(s) of dgx-h100 (2 node(s) of 8)`: the request's node, not the plan's share of it."""
    share_note: str
    """What part of a node the plan bills ([Note: part of a node] in planner/specs/hardware.py); "" for whole nodes."""
    path: CriticalPath | None = None
    cheaper: list[Alternative] = field(default_factory=list)
    runners: list[Plan] = field(default_factory=list)
    runner_bottlenecks: list[str] = field(default_factory=list)
    """Each runner-up's critical-path bottleneck, in `runners` order."""

    @property
    def fits(self) -> bool:
        return self.result.best is not None

    @property
    def counts(self) -> str:
        return f"{len(self.result.ranked)} feasible plans of {self.result.num_evaluated} evaluated"

    def headline(self) -> str:
        return f"fits on {self.where}; {self.counts}" if self.fits else f"does not fit on {self.where}"


def where(result: SearchResult, plan: Plan) -> str:
    node = result.request.node
    device = "CPU device(s)" if node.host_is_device else "GPU(s)"
    return f"{result.request.num_gpus} {device} of {node.name} ({plan.num_nodes} node(s) of {node.num_gpus_per_node})"


def critical_path(plan: Plan, timelines: Timelines | None = None) -> CriticalPath:
    """The plan's exposed critical path, measured on its simulated iteration (`timelines`, else
    simulated) when its prediction is simulated; a pipelined or accumulating plan's, whose
    timelines are one stage's micro-batch, from the analytic estimate of its step."""
    pred = plan.prediction
    assert pred is not None and pred.feasible
    if pred.method == "simulated" and not is_composed(plan):
        counts = pred.details.get("two_streams_from_layers")
        path = two_stream_path(plan, counts) if counts and timelines is None else None
        if path is not None:
            return path
        if timelines is None:
            from planner.sim.periodic import simulate_periodic  # usually a stretch of refine's kept samples

            timelines = simulate_periodic(plan).timelines
        return simulated_path(plan, timelines)
    return analytic_path(plan if pred.method == "analytic" else predict(plan.replace(prediction=None)))


def cheaper_schedules(plan: Plan, path: CriticalPath, best_with_step: Callable[[str], Plan | None]) -> list[Alternative]:
    """Other optimizer-step schedules whose best plan (`best_with_step(step)`, predicted) is faster,
    asked only when the step is exposed."""
    if not path.step_exposed:
        return []
    pred = plan.prediction
    assert pred is not None
    out = []
    for step in OPTIMIZER_STEPS:
        if step == plan.optimizer_step:
            continue
        try:
            best = best_with_step(step)
        except PlannerError:  # e.g. fp16, or a pipeline: the schedule cannot run this request
            continue
        if best is not None and best.prediction is not None and best.prediction.tokens_per_s > pred.tokens_per_s:
            out.append(Alternative(step, best))
    return out


def simulated_runners_up(result: SearchResult) -> list[Plan]:
    """The runner-up plans (best of other placements), simulated where the winner is, best first."""
    return sorted(simulated_like(result.runners_up(), result.best), key=lambda p: -p.prediction.tokens_per_s)


def simulated_like(plans: list[Plan], winner: Plan | None) -> list[Plan]:
    """`plans` predicted as `winner` is: simulated beside a simulated winner (the analytic ones are
    simulated now), as they are otherwise. [Note: runner-up bounds] in report.py: a plan the
    simulator cannot time keeps its analytic bound."""
    from planner.sim.fast import predict as simulate

    if winner is None or winner.prediction is None or winner.prediction.method != "simulated":
        return list(plans)

    def like_winner(plan: Plan) -> Plan:
        if plan.prediction is None or not plan.prediction.feasible or plan.prediction.method != "analytic":
            return plan
        try:
            return plan.replace(prediction=simulate(plan))
        except PlannerError:
            return plan

    return [like_winner(plan) for plan in plans]


def verdict(result: SearchResult, best_with_step: Callable[[str], Plan | None]) -> Verdict:
    """Everything the verdict shows for `result`; `best_with_step(step)` is the best plan of the same
    request with another optimizer-step schedule (`searcher`; the page asks its cache)."""
    plan = result.best or (result.rejected[0] if result.rejected else None)
    if plan is None:
        raise PlannerError("no candidate plan could be formed; check the pinned options")
    base = Verdict(result=result, plan=plan, where=where(result, plan), share_note=plan.node.share_line())
    if result.best is None:
        return base
    path, runners = critical_path(plan), simulated_runners_up(result)
    return dataclasses.replace(base, path=path, cheaper=cheaper_schedules(plan, path, best_with_step), runners=runners,
                               runner_bottlenecks=[critical_path(p).bottleneck for p in runners])


def searcher(request: SearchRequest) -> Callable[[str], Plan | None]:
    """`best_with_step` for `verdict`: the same request with another schedule pinned, refined as `planner fit`
    ranks (a schedule the training loop forbids, e.g. in backward under global-norm clipping, raises)."""
    from planner.search.refine import refine
    from planner.search.search import search

    return lambda step: refine(search(dataclasses.replace(
        request, training=dataclasses.replace(request.training, optimizer_step=step)))).best


def same_plan(plan: Plan) -> Callable[[str], Plan | None]:
    """`best_with_step` for one plan (`planner simulate`): the plan itself with another schedule, simulated."""
    from planner.cost.feasibility import check_plan
    from planner.sim.fast import predict as simulate

    def best(step: str) -> Plan | None:
        other = check_plan(plan.replace(optimizer_step=step, prediction=None))
        return other.replace(prediction=simulate(other))

    return best
