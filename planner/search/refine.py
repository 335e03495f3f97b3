"""Second stage of `planner fit`: re-rank the analytic search's best candidates by simulation.

The analytic estimate (planner.cost.throughput, paper §4) ranks thousands of candidates in milliseconds;
the simulator sees what it cannot (fair sharing of the host fabric and the NVMe array, prefetch
stalls, the chunked optimizer's pipeline, small-transfer and small-matmul efficiency). We simulate
the best plan of each of the `top` best placements and optimizer-step schedules (fast.predict, [Note: periodic layers]) and sort
them by simulated throughput. Plans the simulator cannot time keep their analytic prediction.
"""

from __future__ import annotations

from dataclasses import replace

from planner.search.search import SearchResult, explain_schedules, rank_key
from planner.sim import ahead
from planner.sim.fast import predict
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan

DEFAULT_TOP = 8


def refine(result: SearchResult, *, top: int = DEFAULT_TOP, runners_ahead: bool = False) -> SearchResult:
    """`result` with its best distinct placements simulated and ranked first. With `runners_ahead`
    (the caller will show the runner-ups simulated, as `planner fit`'s verdict does) a forked worker
    simulates the plans the runner-ups can be while this process refines ([Note: simulated ahead]
    in planner/sim/ahead.py); the answer is the same.

    [Note: analytic bound] The analytic estimate assumes perfect overlap and peak efficiency, so its
    tokens/s bounds the simulated tokens/s from above (tests/test_sim_refine.py checks this on every
    preset). Candidates are simulated in analytic order, and once the best simulated rate reaches
    the next candidate's analytic rate no later candidate can win: we stop there. The answer is the
    one simulating all `top` would give, usually for one or two simulations instead of eight.
    """
    if runners_ahead:
        ahead.start(runners_ahead_of(result), predict)
    chosen, seen = [], set()
    for plan in result.ranked:
        key = (plan.strategy, plan.placement, plan.model_parallel_degree, plan.optimizer_step)
        if key not in seen:
            seen.add(key)
            chosen.append(plan)
            if len(chosen) == top:
                break
    refined: list[Plan] = []
    for plan in chosen:
        best_simulated = max((p.prediction.tokens_per_s for p in refined), default=0.0)
        if best_simulated >= plan.prediction.tokens_per_s:
            break
        refined.append(_simulated(plan))
    refined.sort(key=rank_key)
    chosen = chosen[: len(refined)]
    ids = {id(plan) for plan in chosen}
    rest = [plan for plan in result.ranked if id(plan) not in ids]
    return replace(result, ranked=explain_schedules(refined + rest, result.request.training))


def runners_ahead_of(result: SearchResult) -> list[Plan]:
    """The plans a refined `result`'s runner-ups can be that are simulated for them, the most distant first.

    The refined plans are the heads of the first placements in analytic order (each placement's
    first plan is the first `refine` meets of it), so whichever of them wins, a runner-up
    (`SearchResult.runners_up`: the best plan of each of the next placements) is a refined plan or
    the head of a placement among the first `1 + count` after the top one: the analytic result's
    own runner-ups. Those `refine` does not reach are simulated for the verdict
    (planner/output/verdict.py `simulated_like`); those it reaches, for `refine`: all are simulated
    (where the winner is), and the worker takes them from the end while `refine` starts at the top."""
    return [plan for plan in reversed(result.runners_up())
            if plan.prediction is not None and plan.prediction.feasible and plan.prediction.method == "analytic"]


def _simulated(plan: Plan) -> Plan:
    analytic = plan.prediction
    assert analytic is not None
    try:
        simulated = predict(plan)
    except PlannerError:
        return plan  # e.g. hardware lacking a rate only the simulator needs: keep the first stage's answer
    simulated.details["analytic"] = {
        "iteration_time_s": analytic.iteration_time_s,
        "tflops_per_gpu": analytic.tflops_per_gpu,
        "bottleneck": analytic.bottleneck,
    }
    return plan.replace(prediction=simulated)
