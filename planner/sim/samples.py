"""Sample simulations of a plan with fewer blocks, as data, kept for the plans simulated last.

The fast prediction (fast.py) and the dashboard's timelines (periodic.py) both simulate a deep
plan as two shallower samples and extrapolate ([Note: periodic timelines] in periodic.py).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

from planner.sim.engine import Simulation
from planner.sim.optimizer import chunked_step
from planner.sim.report import SimResult, Summary, Timelines, simulate, summarize, timelines_of
from planner.sim.workload import build_workload, optimizer_params_per_rank
from planner.specs.plan import Plan


@dataclass(frozen=True, slots=True)
class Sample:
    """One simulated sample of a plan (the plan with fewer blocks), kept as data."""

    plan: Plan
    summary: Summary
    """Without memory curves (see `timelines`)."""
    timelines: Timelines
    unit_start_s: dict[tuple[str, int], float]
    events: int = 0
    """SimPy events its simulation scheduled (the shared optimizer step's in the first sample only)."""


KEPT_PLANS = 8
"""[Note: shared samples] The dashboard's Timeline panel shows the plan `refine` has just ranked
first, from the same two samples `fast.predict` simulated for it. The samples of the last
`KEPT_PLANS` plans are kept, as data (summary, timelines, unit marks), so that the panel costs one
stretch instead of two more simulations. Keyed by the whole plan (its prediction aside); samples
are never changed after they are made."""
_kept: OrderedDict[str, dict[int, Sample]] = OrderedDict()
_kept_lock = threading.Lock()


def sample_key(plan: Plan) -> str:
    """What a plan's simulation depends on: the whole plan but its prediction and the words saying
    why it has its optimizer-step schedule (`Plan.optimizer_step_reason`, set once plans are ranked:
    the plan `refine` simulated and the same plan with its reason are one simulation)."""
    return json.dumps(plan.replace(prediction=None, optimizer_step_reason="").to_dict(), sort_keys=True)


def forget_samples() -> None:
    """Drop every kept sample and whole simulation (benchmarks timing a first visit)."""
    with _kept_lock:
        _kept.clear()
        _whole.clear()


def simulate_samples(plan: Plan, counts: list[int]) -> list[Sample]:
    """The samples of `plan` with `counts` blocks, each with the real model's optimizer step."""
    key = sample_key(plan)
    with _kept_lock:
        samples = dict(_kept.get(key, {}))
    missing = [layers for layers in counts if layers not in samples]
    params, optimizer = optimizer_params_per_rank(plan), None
    for layers in missing:
        small = plan.replace(model=plan.model.replace(num_layers=layers))
        work = dataclasses.replace(build_workload(small), params_per_rank=params,
                                   step_model_params=plan.model.num_params)
        if optimizer is None and not plan.placement.optimizer_states.on_device and plan.optimizer_step == "after_backward":
            # The step starts on an idle network (optimizer.py): the real one is simulated once,
            # with the busy intervals periodic.py draws. An in-backward step updates each unit in
            # its own backward (in_backward.py): it is part of the backward window that repeats.
            optimizer = chunked_step(plan, work, 1)
        sim = Simulation(small, workload=work, optimizer=optimizer).run()
        shared = optimizer.events if optimizer is not None and layers != missing[0] else 0
        samples[layers] = Sample(plan=small, summary=summarize(sim, timelines=False), timelines=timelines_of(sim),
                                 unit_start_s=dict(sim.unit_start_s), events=sim.events - shared)
    if missing:
        with _kept_lock:
            _kept[key] = samples
            _kept.move_to_end(key)
            while len(_kept) > KEPT_PLANS:
                _kept.popitem(last=False)
    return [samples[layers] for layers in counts]


KEPT_WHOLE = 4
"""Whole-model simulations kept ([Note: shared samples]): a plan whose samples are not periodic is
simulated whole, once for its prediction (fast.py) and once more for its timelines (periodic.py)
unless kept, as `planner fit` asks of its runner-ups (planner/output/verdict.py)."""
_whole: OrderedDict[str, SimResult] = OrderedDict()


def kept_whole(plan: Plan) -> SimResult | None:
    """The kept whole simulation of `plan`, if any: a plan is simulated whole only once its samples
    failed the periodic check, so a kept one also says the check need not run again."""
    key = sample_key(plan)
    with _kept_lock:
        kept = _whole.get(key)
    return None if kept is None else dataclasses.replace(kept, plan=plan)


def simulate_whole(plan: Plan) -> SimResult:
    """`simulate(plan)` for a plan that cannot be extrapolated, kept for the last `KEPT_WHOLE` plans
    by the same key as the samples (the plan, its prediction aside)."""
    kept = kept_whole(plan)
    if kept is not None:
        return kept
    key = sample_key(plan)
    result = simulate(plan)
    with _kept_lock:
        _whole[key] = result
        _whole.move_to_end(key)
        while len(_whole) > KEPT_WHOLE:
            _whole.popitem(last=False)
    return result


@dataclass(frozen=True, slots=True)
class KeptSimulations:
    """What this process keeps ([Note: shared samples]), as data another process can take: samples by
    plan key and layer count, whole simulations by plan key (without their `simulation`, whose SimPy
    state only the process that ran it holds; its prediction, timelines and events are kept)."""

    samples: dict[str, dict[int, Sample]]
    whole: dict[str, SimResult]


def kept_now() -> KeptSimulations:
    """A copy of what is kept now, to tell later what was added (`kept_since`)."""
    with _kept_lock:
        return KeptSimulations({key: dict(kept) for key, kept in _kept.items()}, dict(_whole))


def kept_since(before: KeptSimulations) -> KeptSimulations:
    """What was simulated and kept after `before` was taken: the new samples and whole simulations."""
    with _kept_lock:
        new_samples = {key: {layers: s for layers, s in kept.items() if layers not in before.samples.get(key, {})}
                       for key, kept in _kept.items()}
        whole = {key: dataclasses.replace(result, simulation=None) for key, result in _whole.items()
                 if key not in before.whole}
    return KeptSimulations({key: kept for key, kept in new_samples.items() if kept}, whole)


def keep(kept: KeptSimulations) -> None:
    """Keep simulations another process made (`kept_since`) as if made here: the plans they are for
    then cost no simulation."""
    with _kept_lock:
        for key, samples in kept.samples.items():
            _kept[key] = {**_kept.get(key, {}), **samples}
            _kept.move_to_end(key)
        for key, result in kept.whole.items():
            _whole[key] = result
            _whole.move_to_end(key)
        while len(_kept) > KEPT_PLANS:
            _kept.popitem(last=False)
        while len(_whole) > KEPT_WHOLE:
            _whole.popitem(last=False)
