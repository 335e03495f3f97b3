"""A row's unstated settings, searched as `planner fit` searches what a user does not pin.

[Note: unstated settings are searched] A published benchmark table reports a tuned configuration, so a
knob the row leaves unstated is the one the planner would pick: every combination of the unstated
knobs' values (activation recompute none / selective / full; data-parallel sharding among those its
framework offers, SHARDINGS_OFFERED; the tensor x pipeline split of a stated model-parallel size; the
micro-batch of a pipelined row, among the divisors of its per-replica global batch; the micro-batch
of a row with no batch at all, the largest that fits as the search sizes it, planner/search/search.py
`largest_batch`) becomes a plan, the memory bill keeps those that fit, and the fastest is kept. Fastest
the way `planner fit` ranks (planner/search/refine.py [Note: analytic bound]): candidates are simulated in
the analytic estimate's order until the best simulated rate reaches the next candidate's analytic rate.
If none fits, the candidate that needs the least GPU memory is kept, so the memory bill's refusal is
reported. Stated values are never searched: a row that states every knob has exactly one candidate.
The row's `assumptions` name every searched knob, its options and the value chosen.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from planner.cost.memory import memory_bill
from planner.cost.throughput import estimate
from planner.search.search import DEFAULT_MAX_MICRO_BATCH, DEFAULT_MICRO_BATCHES_PER_STAGE, largest_batch
from planner.sim.fast import predict
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.specs.tiers import GPU

SEARCHED_RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")
MEGATRON_SOURCES = frozenset({"megatron2019", "narayanan2021_t1", "narayanan2021_t2", "megatron_lm_readme",
                              "nemo_2407", "nemo_longseq_2403", "megatron_bridge_archive"})
"""Sources that trained with Megatron-LM / Megatron-Core (NeMo and Megatron-Bridge build on it)."""
SHARDINGS_OFFERED: dict[str, tuple[str, ...]] = {
    source: ("none", "zero1") for source in MEGATRON_SOURCES
}
"""source_id -> the data-parallel shardings its framework offers when a row leaves it unstated: Megatron's
DDP and its distributed optimizer (ZeRO-1); a Megatron row that used FSDP says so (Megatron-Bridge's
`FSDP=` column). Any other source: DDP, ZeRO-1, ZeRO-2 and ZeRO-3 (SHARDINGS_ANY)."""
SHARDINGS_ANY: tuple[str, ...] = ("none", "zero1", "zero2", "zero3")


@dataclass(frozen=True, slots=True)
class Candidate:
    plan: Plan
    chosen: tuple[tuple[str, str], ...]
    """(knob, value) of every searched knob, as the assumptions report it."""


def default_micro_batches(pipeline_stages: int) -> int:
    """Micro-batches per step where the row states no batch: `planner fit`'s default (planner/search/search.py)."""
    return DEFAULT_MICRO_BATCHES_PER_STAGE * pipeline_stages if pipeline_stages > 1 else 1


def sized(plan: Plan) -> Plan | None:
    """`plan` at the largest micro-batch that fits (planner/search/search.py), None if one sample does not."""
    return largest_batch(plan, DEFAULT_MAX_MICRO_BATCH)


def fastest(candidates: Sequence[Candidate]) -> tuple[Candidate, bool]:
    """(the fastest candidate that fits, True), or (the one needing the least GPU memory, False)."""
    bills = [(c, memory_bill(c.plan)) for c in candidates]
    fitting = sorted(((estimate(c.plan).tokens_per_s, i, c) for i, (c, b) in enumerate(bills) if b.fits),
                     key=lambda t: (-t[0], t[1]))
    if not fitting:
        return min(bills, key=lambda cb: cb[1].peak_bytes[GPU])[0], False
    if len(fitting) == 1:
        return fitting[0][2], True
    best, best_rate = fitting[0][2], -1.0
    for analytic_rate, _, candidate in fitting:
        if best_rate >= analytic_rate:
            break  # the analytic rate bounds the simulated one: no later candidate can win
        rate = _simulated_rate(candidate.plan)
        if rate > best_rate:
            best, best_rate = candidate, rate
    return best, True


def _simulated_rate(plan: Plan) -> float:
    try:
        return predict(plan).tokens_per_s
    except PlannerError:
        return estimate(plan).tokens_per_s  # hardware lacking a rate only the simulator needs


def search_unstated(build: Callable[[dict[str, object]], Plan | None], options: dict[str, Sequence[object]],
                    searched: Sequence[str]) -> tuple[Plan | None, tuple[str, ...], str]:
    """(plan, assumptions, why none) over the product of `options`; `build` turns one choice per knob
    into a plan (None, or PlannerError, for a combination the planner refuses)."""
    candidates: list[Candidate] = []
    refusals: list[str] = []
    for choice in _product(options):
        try:
            plan = build(choice)
        except PlannerError as exc:
            refusals.append(str(exc))
            continue
        if plan is not None:
            candidates.append(Candidate(plan, tuple((k, _label(choice[k])) for k in searched)))
    if not candidates:
        return None, (), refusals[0] if refusals else "no candidate configuration"
    best, fits = fastest(candidates)
    if not searched:
        return best.plan, (), ""
    verdict = "fastest that fits" if fits else "none fits; the one needing the least GPU memory"
    notes = [f"searched {k} over {{{', '.join(_label(v) for v in options[k])}}}: {v}" for k, v in best.chosen]
    if "micro_batch" in searched and dict(best.chosen)["micro_batch"] == _label(None):
        replica = best.plan.micro_batch_per_gpu * best.plan.gpus_per_replica
        notes[searched.index("micro_batch")] += f" = {replica:g} per replica, {best.plan.micro_batches_per_step} per step"
    notes.append(f"the searched choice is the planner's {verdict} of {len(candidates)} candidates")
    return best.plan, tuple(notes), ""


def _label(value: object) -> str:
    if isinstance(value, tuple):
        return " x ".join(str(v) for v in value)
    return "the largest that fits" if value is None else str(value)


def _product(options: dict[str, Sequence[object]]) -> list[dict[str, object]]:
    return [dict(zip(options, values, strict=True)) for values in itertools.product(*options.values())]
