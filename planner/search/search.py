"""Placement search: enumerate plans, keep what fits, rank by estimated throughput.

Dimensions: placement (the named strategies and every valid free placement) x recompute interval x
optimizer-step schedule (those the training allows: planner/specs/training_loop.py) x tiling factor
x prefetch depth, each at the largest micro-batch that fits (throughput only grows
with the batch in this model, so the largest feasible batch is the best one for a given shape of
plan). Any dimension can be pinned. Infeasible candidates are returned with their reason. Each
feasible candidate pins its host shards where host memory and the locked-memory limit allow
(planner/cost/host_link.py, `choose_host_pinning`), and a mixed-precision plan with its parameters
and optimizer states in host memory reads its fp32 master as its parameter shard where that is
faster (`choose_host_param_shard`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from planner.cost.feasibility import check_plan
from planner.cost.host_link import choose_host_pinning_billed
from planner.cost.memory import (
    BatchBills,
    MemoryBill,
    memory_bill,
    min_tiling_factor,
    resident_states_fit,
    schedule_changes_bill,
)
from planner.cost.throughput import estimate
from planner.specs.errors import PlannerError
from planner.specs.hardware import Cluster, NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import (
    MAX_TILING_FACTOR,
    OPTIMIZER_STEPS,
    STATES,
    STRATEGIES,
    STRATEGY_TABLE,
    HostParamShard,
    Placement,
    Plan,
    Prediction,
    master_may_be_param_shard,
    strategy_named,
)
from planner.specs.tiers import TIERS, Tier
from planner.specs.training_loop import TrainingLoop, comparison_reason, schedule_reason

RECOMPUTE_INTERVALS = (1, 2, 4, 0)
PREFETCH_DEPTHS = (3, 2, 1, 0)
MAX_TILING_DOUBLINGS = 6
DEFAULT_MAX_MICRO_BATCH = 32
PIPELINED_STRATEGIES = frozenset({"3d"})
DEFAULT_MICRO_BATCHES_PER_STAGE = 4
"""m = 4 p micro-batches per step keeps the 1F1B bubble (p - 1) / m under 25 % (planner/cost/pipeline.py)."""


def _optimizer_gradient_tiers() -> list[tuple[Tier, Tier]]:
    """Valid (optimizer_states, gradients) pairs: gradients land where the optimizer steps, or beside
    its states (`Tier.gradient_tiers`, which `Placement` checks)."""
    return [(opt, grads) for opt in TIERS for grads in opt.gradient_tiers]


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchRequest:
    model: ModelSpec
    node: NodeSpec
    num_gpus: int
    strategy: str | None = None
    """Pin a named strategy (placement and partitioning)."""
    placement_pins: dict[str, Tier] = field(default_factory=dict)
    micro_batch_per_gpu: float | None = None
    recompute_interval: int | None = None
    tiling_factor: int | None = None
    prefetch_depth: int | None = None
    model_parallel_degree: int | None = 1
    """Tensor-parallel degree; None searches the powers of two that divide the heads, within a node."""
    pipeline_parallel_degree: int | None = None
    """Pipeline stages; None searches them for the `3d` strategy (PIPELINED_STRATEGIES) and means 1
    for the others."""
    micro_batches_per_step: int | None = None
    """Micro-batches per optimizer step; None: DEFAULT_MICRO_BATCHES_PER_STAGE per stage when
    pipelined, else 1."""
    precision: str = "bf16"
    nvme_path: str | None = None
    max_micro_batch_per_gpu: int = DEFAULT_MAX_MICRO_BATCH
    training: TrainingLoop = TrainingLoop()
    """What the user's loop allows of the optimizer step's schedule: pinned, or every schedule it
    allows searched like any other knob (planner/specs/training_loop.py)."""
    locked_memory_bytes: float = float("inf")
    """Page-locked bytes one training process may hold (RLIMIT_MEMLOCK where the plan runs): each
    candidate pins its host shards only where they fit it (`choose_host_pinning`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SearchResult:
    request: SearchRequest
    ranked: list[Plan]
    """Feasible plans, best first, each with an analytic `prediction`."""
    rejected: list[Plan]
    """One infeasible plan per placement that nothing could fit, with `prediction.reason`."""
    num_evaluated: int

    @property
    def best(self) -> Plan | None:
        return self.ranked[0] if self.ranked else None

    def runners_up(self, count: int = 4) -> list[Plan]:
        """The best plan of each other placement, so the alternatives are really different."""
        seen, out = set(), []
        for plan in self.ranked[1:]:
            key = (plan.strategy, plan.placement)
            if key in seen or key == (self.ranked[0].strategy, self.ranked[0].placement):
                continue
            seen.add(key)
            out.append(plan)
            if len(out) == count:
                break
        return out


def candidate_placements(strategy: str | None, pins: dict[str, Tier]) -> list[tuple[str, Placement]]:
    """(strategy name, placement) pairs consistent with the pins; free placements are ZeRO-3."""
    if strategy is not None:
        placement = strategy_named(strategy).placement
        clash = {k: v for k, v in pins.items() if getattr(placement, k) != v}
        if clash:
            raise PlannerError(f"strategy {strategy} places {placement.label()}, which contradicts --placement {clash}")
        return [(strategy, placement)]
    by_placement = {s.placement: name for name, s in STRATEGY_TABLE.items() if s.partitioned == frozenset(("params", "gradients", "optimizer_states"))}
    out: list[tuple[str, Placement]] = [
        (name, s.placement) for name, s in STRATEGY_TABLE.items() if name in ("dp", "zero2", "zero-offload", "3d")
    ]
    # Recompute inputs go where the runtime can hold them, or where they are pinned.
    recompute_input_tiers = [t for t in TIERS if t.recompute_inputs_searched or pins.get("recompute_inputs") == t]
    for params, (opt, grads), inputs in itertools.product(TIERS, _optimizer_gradient_tiers(), recompute_input_tiers):
        placement = Placement(params=params, gradients=grads, optimizer_states=opt, recompute_inputs=inputs)
        out.append((by_placement.get(placement, "custom"), placement))
    kept = [(name, p) for name, p in out if all(getattr(p, k) == v for k, v in pins.items())]
    if not kept:
        raise PlannerError(f"--placement {','.join(f'{k}={v}' for k, v in pins.items())} allows no valid placement")
    return kept


def _with_prediction(plan: Plan, bill: MemoryBill | None = None) -> Plan:
    """`plan` with its analytic prediction, from `bill` where the caller has the plan's own bill."""
    bill = bill if bill is not None else memory_bill(plan)
    pred = Prediction(
        feasible=bill.fits,
        reason=bill.reason(),
        peak_bytes=bill.peak_bytes,
        capacity_bytes=bill.capacity_bytes,
        memory_terms=bill.terms,
        method="analytic",
    )
    if bill.fits:
        est = estimate(plan)
        pred.iteration_time_s = est.iteration_time_s
        pred.tflops_per_gpu = est.tflops_per_gpu
        pred.tokens_per_s = est.tokens_per_s
        pred.bottleneck = est.bottleneck
        pred.phase_time_s = est.phase_time_s
        pred.link_bytes = est.link_bytes
        pred.details = {"component_time_s": est.component_time_s, "efficiency_no_overlap": est.efficiency_no_overlap}
    return plan.replace(prediction=pred)


def predict(plan: Plan) -> Plan:
    """The plan with its analytic prediction (memory bill and, if it fits, throughput)."""
    return _with_prediction(plan)


def largest_batch(base: Plan, cap: int) -> Plan | None:
    """Largest micro-batch in [unit, cap] that fits, using the bill's linearity in the batch."""
    sized = _largest_batch_billed(base, cap)
    return sized[0] if sized else None


def _largest_batch_billed(base: Plan, cap: int, unit_bill: MemoryBill | None = None) -> tuple[Plan, MemoryBill] | None:
    """`largest_batch` with the sized plan's bill (`unit_bill`: the bill at one sample per replica,
    where the caller has it)."""
    unit = 1 / base.gpus_per_replica  # one sample per model replica
    bills = BatchBills(base)
    a = unit_bill or bills.at(unit)[1]
    if not a.fits:
        return None
    # Every term is affine in the batch, so two points give the exact line for each tier.
    b = bills.at(2 * unit)[1]
    peak_a, peak_b = a.peak_bytes, b.peak_bytes
    limit = cap / unit
    for tier, capacity in a.capacity_bytes.items():
        slope = peak_b[tier] - peak_a[tier]
        if slope > 0:
            limit = min(limit, 1 + (capacity - peak_a[tier]) / slope)
    slope = b.largest_alloc_bytes - a.largest_alloc_bytes
    if slope > 0:
        limit = min(limit, 1 + (a.max_alloc_bytes - a.largest_alloc_bytes) / slope)
    steps = max(1, math.floor(limit + 1e-9))
    while steps > 1:
        sized, bill = bills.at(steps * unit)
        if bill.fits:
            return sized, bill
        steps -= 1  # rounding at the boundary
    return base.replace(micro_batch_per_gpu=unit), a


def search(request: SearchRequest) -> SearchResult:
    cluster = Cluster(node=request.node, num_gpus=request.num_gpus)  # validates --gpus early
    cluster.check_network()
    placements = candidate_placements(request.strategy, request.placement_pins)
    ranked: list[Plan] = []
    rejected: list[Plan] = []
    evaluated = 0
    for (strategy, placement), (mp, pp) in _layouts(request, cluster, placements):
        best_for_placement: list[Plan] = []
        first_failure: Plan | None = None
        for ci in _recompute_intervals(request):
            first, *others = _scheduled_bases(request, _base_plan(request, cluster, strategy, placement, mp, ci, pp))
            tried, found, failure = _sized_candidates(request, strategy, first)
            evaluated += tried
            best_for_placement += found
            first_failure = first_failure or failure
            for base in others:
                if schedule_changes_bill(first):
                    tried, found, failure = _sized_candidates(request, strategy, base)
                else:  # the same plans fit: price them at this schedule too
                    found = [_rescheduled(request, p, base.optimizer_step) for p in found]
                evaluated += tried
                best_for_placement += found
                first_failure = first_failure or failure
        if best_for_placement:
            ranked.extend(best_for_placement)
        elif first_failure is not None:
            rejected.append(predict(first_failure))
    ranked.sort(key=rank_key)
    return SearchResult(request=request, ranked=explain_schedules(ranked, request.training), rejected=rejected, num_evaluated=evaluated)


def _scheduled_bases(request: SearchRequest, base: Plan) -> list[Plan]:
    """`base` at every optimizer-step schedule the user's training allows, each with its reason
    when the training allows only one (else `explain_schedules` gives it once they are ranked)."""
    steps, reason = request.training.schedules(precision=base.precision, micro_batches_per_step=base.micro_batches_per_step)
    plans = [base.replace(optimizer_step=step) for step in steps]
    return [p.replace(optimizer_step_reason=schedule_reason(p, reason)) for p in plans]


def _sized_candidates(request: SearchRequest, strategy: str, base: Plan) -> tuple[int, list[Plan], Plan | None]:
    """(candidates evaluated, the predicted plans that fit at their largest batch, the first that did
    not) over prefetch depth and tiling for one base plan."""
    if not resident_states_fit(base):  # nothing below fits: every candidate evaluated fails, the first first
        depths, tilings = tuple(_prefetch_depths(request, strategy)), tuple(_tilings(request, base))
        return len(depths) * len(tilings), [], base.replace(prefetch_depth=depths[0], tiling_factor=tilings[0])
    evaluated, found_plans, first_failure = 0, [], None
    tilings = tuple(_tilings(request, base))
    for depth in _prefetch_depths(request, strategy):
        found = False
        for i, tiling in enumerate(tilings):
            plan = base.replace(prefetch_depth=depth, tiling_factor=tiling)
            evaluated += 1
            sized = _sized(request, plan)
            if sized is None:
                first_failure = first_failure or plan
                if i == 0 and _no_tiling_fits(request, plan, tilings):
                    evaluated += len(tilings) - 1  # counted as the loop would have
                    break
                continue
            found = True
            chosen, _, bill = choose_host_pinning_billed(sized[0], request.locked_memory_bytes, sized[1])
            chosen, bill = choose_host_param_shard(chosen, bill, request.locked_memory_bytes)
            found_plans.append(_with_prediction(chosen, bill))
            if chosen.micro_batch_per_gpu >= request.max_micro_batch_per_gpu:
                break  # more tiling cannot buy a larger batch
        if found and request.prefetch_depth is None:
            break  # deeper prefetch fits; shallower only overlaps less
    return evaluated, found_plans, first_failure


def choose_host_param_shard(plan: Plan, bill: MemoryBill | None,
                            locked_memory_bytes: float) -> tuple[Plan, MemoryBill | None]:
    """`plan` with `host_param_shard: master` where it may have it (`master_may_be_param_shard`), that
    plan's bill fits (its pinning chosen again: the pinned shard is then the fp32 master) and the
    analytic estimate times its iteration shorter: wider reads over the host link against no cast on
    the optimizer's thread (planner/cost/host_work.py [Note: the resident step's cast]); else `plan`
    with `bill`. A tie keeps the 16-bit copy."""
    if plan.host_param_shard is HostParamShard.MASTER or not master_may_be_param_shard(plan):
        return plan, bill
    master, _, master_bill = choose_host_pinning_billed(plan.replace(host_param_shard=HostParamShard.MASTER),
                                                        locked_memory_bytes)
    master_bill = master_bill if master_bill is not None else memory_bill(master)
    if not master_bill.fits or estimate(master).iteration_time_s >= estimate(plan).iteration_time_s:
        return plan, bill
    return master, master_bill


def _rescheduled(request: SearchRequest, plan: Plan, step: str) -> Plan:
    """`plan` (sized and billed at another schedule, which does not change its bill) at schedule `step`,
    its pinning and host parameter shard chosen again for it (the cast they trade weighs differently
    in and after the backward), with its prediction."""
    plan = plan.replace(optimizer_step=step, prediction=None)
    if not master_may_be_param_shard(plan):
        return predict(plan)
    copy = plan.replace(host_param_shard=HostParamShard.COMPUTE_COPY)
    chosen, _, bill = choose_host_pinning_billed(copy, request.locked_memory_bytes)
    chosen, bill = choose_host_param_shard(chosen, bill, request.locked_memory_bytes)
    return _with_prediction(chosen, bill)


def _no_tiling_fits(request: SearchRequest, plan: Plan, tilings: tuple[int, ...]) -> bool:
    """Whether `plan`, which does not fit at the smallest of `tilings`, fits at none: the largest
    does not ([Note: least-memory candidate]: every term is non-increasing in the tiling)."""
    return len(tilings) > 1 and _sized(request, plan.replace(tiling_factor=tilings[-1]), probe=True) is None


def _sized(request: SearchRequest, plan: Plan, *, probe: bool = False) -> tuple[Plan, MemoryBill] | None:
    """`plan` at the requested batch, or at its largest that fits, with its bill; None where nothing
    fits. `probe`: only whether it fits at its smallest batch (the bill of its unit batch)."""
    if request.micro_batch_per_gpu is not None:
        bill = memory_bill(plan)
        return (plan, bill) if bill.fits else None
    if probe:
        bill = memory_bill(plan.replace(micro_batch_per_gpu=1 / plan.gpus_per_replica))
        return (plan, bill) if bill.fits else None
    return _largest_batch_billed(plan, request.max_micro_batch_per_gpu)


def explain_schedules(ranked: list[Plan], training: TrainingLoop) -> list[Plan]:
    """`ranked` (best first) with each plan whose schedule the search chose among several saying why:
    its time against the best plan of the other schedule on the same layout (an analytic bound
    where that one was not simulated)."""
    best: dict[tuple, Plan] = {}
    for plan in ranked:
        best.setdefault((_layout_key(plan), plan.optimizer_step), plan)
    out = []
    for plan in ranked:
        steps, _ = training.schedules(precision=plan.precision, micro_batches_per_step=plan.micro_batches_per_step)
        if len(steps) == 1:
            out.append(plan)
            continue
        other = next((p for (key, step), p in best.items() if key == _layout_key(plan) and step != plan.optimizer_step),
                     None)
        pred = plan.prediction
        assert pred is not None
        other_pred = other.prediction if other is not None else None
        reason = comparison_reason(other.optimizer_step if other is not None else None, pred.iteration_time_s,
                                   other_pred.iteration_time_s if other_pred is not None else None,
                                   other_bound=other_pred is not None and other_pred.method == "analytic"
                                   and pred.method != "analytic")
        out.append(plan.replace(optimizer_step_reason=schedule_reason(plan, reason)))
    return out


def _layout_key(plan: Plan) -> tuple:
    return (plan.strategy, plan.placement, plan.model_parallel_degree, plan.pipeline_parallel_degree)


def any_fits(request: SearchRequest) -> bool:
    """Whether `search(request)` finds any feasible plan, at a small fraction of its cost.

    [Note: least-memory candidate]
    Every memory term, and the largest single allocation, is non-decreasing in the prefetch depth
    and in the micro-batch, and non-increasing in the tiling factor (each per-operator buffer is
    divided by it). So a (placement, model-parallel degree, recompute interval) fits at some depth,
    tiling and batch the search tries exactly when it fits at the shallowest depth, the largest
    tiling and the smallest batch, at one of the optimizer-step schedules the training allows (a
    schedule changes which gradient buffers exist, in either direction). `max_size` bisects on this;
    tests/test_app_library.py checks the equivalence with `search`.
    """
    cluster = Cluster(node=request.node, num_gpus=request.num_gpus)
    cluster.check_network()
    placements = candidate_placements(request.strategy, request.placement_pins)
    shallowest = min(_prefetch_depths(request))
    for (strategy, placement), (mp, pp) in _layouts(request, cluster, placements):
        for ci in _recompute_intervals(request):
            first = _base_plan(request, cluster, strategy, placement, mp, ci, pp).replace(prefetch_depth=shallowest)
            for base in _scheduled_bases(request, first):
                if memory_bill(base.replace(tiling_factor=max(_tilings(request, base)))).fits:
                    return True
    return False


def best_by_strategy(result: SearchResult) -> dict[str, Plan]:
    """Strategy name -> its fastest feasible plan, or its rejected plan (with the reason) if none fits.

    Free placements are grouped under `custom`. Strategies the search did not consider are absent.
    """
    best: dict[str, Plan] = {}
    for plan in result.ranked:  # best first
        best.setdefault(plan.strategy, plan)
    for plan in result.rejected:
        best.setdefault(plan.strategy, plan)
    return {name: best[name] for name in STRATEGIES if name in best}


def _base_plan(request: SearchRequest, cluster: Cluster, strategy: str, placement: Placement, mp: int, ci: int,
               pp: int = 1) -> Plan:
    """The candidate before batch, tiling and prefetch depth are chosen (one sample per replica)."""
    default_m = DEFAULT_MICRO_BATCHES_PER_STAGE * pp if pp > 1 else 1
    plan = Plan(
        model=request.model,
        node=cluster.node,
        num_gpus=request.num_gpus,
        strategy=strategy,
        placement=placement,
        micro_batch_per_gpu=request.micro_batch_per_gpu or 1 / (mp * pp),
        recompute_interval=ci,
        model_parallel_degree=mp,
        pipeline_parallel_degree=pp,
        micro_batches_per_step=request.micro_batches_per_step or default_m,
        precision=request.precision,
        nvme_path=request.nvme_path if placement.uses_nvme else None,
    )
    return check_plan(plan)


def rank_key(plan: Plan) -> tuple[float, ...]:
    """Highest throughput first; on ties prefer fewer slow tiers, less tiling, deeper prefetch, and
    the step after backward (it asks nothing of the training loop)."""
    pred = plan.prediction
    assert pred is not None
    off_gpu = sum(not getattr(plan.placement, s).on_device for s in STATES)
    return (-round(pred.tokens_per_s, 6), off_gpu, plan.tiling_factor, -plan.prefetch_depth,
            OPTIMIZER_STEPS.index(plan.optimizer_step))


def _layouts(request: SearchRequest, cluster: Cluster,
             placements: list[tuple[str, Placement]]) -> list[tuple[tuple[str, Placement], tuple[int, int]]]:
    """((strategy, placement), (tensor, pipeline degree)) candidates: pipelines only for PIPELINED_STRATEGIES
    unless pinned."""
    out = []
    for named, mp in itertools.product(placements, _model_parallel_degrees(request, cluster)):
        out += [(named, (mp, pp)) for pp in _pipeline_degrees(request, cluster, named[0], mp)]
    return out


def _pipeline_degrees(request: SearchRequest, cluster: Cluster, strategy: str, mp: int) -> tuple[int, ...]:
    """Stage counts that divide the GPUs into whole-node stages (or stages within one node), at most
    one block per stage; pinned, or 1 for strategies that do not pipeline."""
    if request.pipeline_parallel_degree is not None:
        return (request.pipeline_parallel_degree,)
    if strategy not in PIPELINED_STRATEGIES or request.training.optimizer_step == "in_backward":
        return (1,)  # a pipeline accumulates micro-batches, which an in-backward step cannot
    replicas, per_node = cluster.num_gpus // mp, cluster.gpus_per_node
    return tuple(pp for pp in range(1, min(replicas, request.model.num_layers) + 1)
                 if replicas % pp == 0 and (cluster.num_gpus // pp <= per_node or (cluster.num_gpus // pp) % per_node == 0))


def _model_parallel_degrees(request: SearchRequest, cluster: Cluster) -> Iterable[int]:
    if request.model_parallel_degree is not None:
        return (request.model_parallel_degree,)
    degrees, mp = [], 1
    while mp <= cluster.gpus_per_node and cluster.num_gpus % mp == 0 and request.model.num_heads % mp == 0:
        degrees.append(mp)
        mp *= 2
    return tuple(degrees)


def best_model_parallel(plan: Plan) -> Plan:
    """`plan`, predicted, at the model-parallel degree the search ranks first with every other choice
    as the plan has it (`--model-parallel auto` on one plan); at the first degree tried if none fits,
    as `search` reports its first rejected candidate."""
    request = SearchRequest(model=plan.model, node=plan.node, num_gpus=plan.num_gpus, model_parallel_degree=None)
    cluster = Cluster(node=plan.node, num_gpus=plan.num_gpus)
    tried = [predict(plan.replace(model_parallel_degree=mp)) for mp in _model_parallel_degrees(request, cluster)]
    feasible = [p for p in tried if p.prediction is not None and p.prediction.feasible]
    return min(feasible, key=rank_key) if feasible else tried[0]


def _recompute_intervals(request: SearchRequest) -> Iterable[int]:
    if request.recompute_interval is not None:
        return (request.recompute_interval,)
    nl = request.model.num_layers
    return tuple(ci for ci in RECOMPUTE_INTERVALS if ci <= nl)


def _prefetch_depths(request: SearchRequest, strategy: str | None = None) -> Iterable[int]:
    """Pinned, or every depth; one for strategies that pipeline (`3d` gathers no parameters, so the
    depth changes neither its memory nor its time)."""
    if request.prefetch_depth is not None:
        return (request.prefetch_depth,)
    return PREFETCH_DEPTHS[:1] if strategy in PIPELINED_STRATEGIES else PREFETCH_DEPTHS


def _tilings(request: SearchRequest, base: Plan) -> Iterable[int]:
    if request.tiling_factor is not None:
        return (request.tiling_factor,)
    start = min_tiling_factor(base)
    # A model too wide for the largest free block even at the most tiles a plan allows is tried at
    # that many, so it comes back rejected with the allocation as its reason instead of an error.
    return tuple(sorted({min(start * 2**k, MAX_TILING_FACTOR) for k in range(MAX_TILING_DOUBLINGS + 1)}))
