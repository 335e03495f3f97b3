"""Fast simulated prediction for ranking many candidates: extrapolate over identical blocks.

[Note: periodic layers] A model's blocks are identical, so once the prefetch pipeline is full the
forward pass repeats block after block with a fixed period, and the backward pass repeats segment
after segment (recompute then backward of `checkpoint_interval` blocks). Whatever the simulation
measures (phase end times, busy time and bytes of every link, each phase's memory peak and its
terms) is then affine in the number of whole segments. We simulate the same plan with m, m+1 and
m+2 segments (keeping a partial top segment if the real model has one, and the real model's
optimizer partition, so the optimizer step is the real one), check that both differences agree for
every quantity (to 1e-7 relative), and extrapolate to the real segment count. When any quantity is
not affine, or the model is too shallow to gain anything, the full model is simulated instead. The
timelines (busy intervals, memory over time) are extrapolated by periodic.py ([Note: periodic
timelines]), for the dashboard.
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from planner.plan import Plan, Prediction
from planner.sim.engine import Simulation
from planner.sim.optimizer import chunked_step
from planner.sim.report import Summary, Timelines, prediction_from, simulate, summarize, timelines_of
from planner.sim.workload import build_workload, optimizer_params_per_rank

_RELATIVE = 1e-7
_ABSOLUTE = 1e-6
MIN_SEGMENTS = 2
MIN_BLOCKS = 4


class NotAffine(Exception):
    pass


def sample_layer_counts(plan: Plan) -> tuple[list[int], int] | None:
    """Layer counts of the three sampled models and how many segments to extrapolate beyond the last."""
    layers, ci = plan.model.num_layers, plan.checkpoint_interval
    unit = ci or 1
    whole, partial = divmod(layers, unit)
    first = max(MIN_SEGMENTS, math.ceil(MIN_BLOCKS / unit))
    if whole < first + 2 + 2:
        return None
    return [unit * (first + x) + partial for x in range(3)], whole - (first + 2)


def predict(plan: Plan) -> Prediction:
    """The simulated prediction of `plan`, by [Note: periodic layers] where it applies."""
    sample = sample_layer_counts(plan)
    if sample is None:
        return simulate(plan).prediction
    counts, repeats = sample
    try:
        summary = extrapolate([s.summary for s in simulate_samples(plan, counts)], repeats)
    except NotAffine:
        return simulate(plan).prediction
    return prediction_from(plan, summary, notes={"extrapolated_from_layers": counts})


@dataclass(frozen=True, slots=True)
class Sample:
    """One simulated sample of a plan (the plan with fewer blocks), kept as data."""

    plan: Plan
    summary: Summary
    """Without memory curves (see `timelines`)."""
    timelines: Timelines
    unit_start_s: dict[tuple[str, int], float]
    num_segments: int


KEPT_PLANS = 8
"""[Note: shared samples] The dashboard's Timeline panel shows the plan `refine` has just ranked
first, and periodic.py stretches two of the three samples `predict` simulated for it (3 and 4
units; predict's are 2, 3, 4, or 4, 5, 6 for single-block units). The samples of the last
`KEPT_PLANS` plans are kept, as data (summary, timelines, unit marks), so that the panel costs one
stretch instead of two more simulations. Keyed by the whole plan (its prediction aside); samples
are never changed after they are made."""
_kept: OrderedDict[str, dict[int, Sample]] = OrderedDict()
_kept_lock = threading.Lock()


def forget_samples() -> None:
    """Drop every kept sample (benchmarks timing a first visit)."""
    with _kept_lock:
        _kept.clear()


def simulate_samples(plan: Plan, counts: list[int]) -> list[Sample]:
    """The samples of `plan` with `counts` blocks, each with the real model's optimizer step."""
    key = json.dumps(plan.replace(prediction=None).to_dict(), sort_keys=True)
    with _kept_lock:
        samples = dict(_kept.get(key, {}))
    missing = [layers for layers in counts if layers not in samples]
    params, optimizer = optimizer_params_per_rank(plan), None
    for layers in missing:
        small = plan.replace(model=plan.model.replace(num_layers=layers))
        work = dataclasses.replace(build_workload(small), params_per_rank=params)
        if optimizer is None and plan.placement.optimizer_states != "gpu":
            # The step starts on an idle network (optimizer.py): the real one is simulated once,
            # with the busy intervals periodic.py draws.
            optimizer = chunked_step(plan, work, 1)
        sim = Simulation(small, workload=work, optimizer=optimizer).run()
        samples[layers] = Sample(plan=small, summary=summarize(sim, timelines=False), timelines=timelines_of(sim),
                                 unit_start_s=dict(sim.unit_start_s), num_segments=sim.work.num_segments)
    if missing:
        with _kept_lock:
            _kept[key] = samples
            _kept.move_to_end(key)
            while len(_kept) > KEPT_PLANS:
                _kept.popitem(last=False)
    return [samples[layers] for layers in counts]


def extrapolate(s: list[Summary], repeats: int) -> Summary:
    a, b, c = s
    if a.largest_gpu_allocation_bytes != c.largest_gpu_allocation_bytes or b.scope != c.scope:
        raise NotAffine
    windows = {}
    for tier in c.windows:
        if not len(a.windows[tier]) == len(b.windows[tier]) == len(c.windows[tier]):
            raise NotAffine
        windows[tier] = [
            (_affine(wa[0], wb[0], wc[0], repeats), _affine_dict(wa[1], wb[1], wc[1], repeats))
            for wa, wb, wc in zip(a.windows[tier], b.windows[tier], c.windows[tier], strict=True)
        ]
    resources = {}
    for name, rc in c.resources.items():
        ra, rb = a.resources[name], b.resources[name]
        resources[name] = {**rc, "busy_s": _affine(ra["busy_s"], rb["busy_s"], rc["busy_s"], repeats),
                           "amount": _affine(ra["amount"], rb["amount"], rc["amount"], repeats)}
    return Summary(
        phase_end_s=_affine_dict(a.phase_end_s, b.phase_end_s, c.phase_end_s, repeats),
        resources=resources,
        link_bytes=_affine_dict(a.link_bytes, b.link_bytes, c.link_bytes, repeats),
        windows=windows,
        capacity_bytes=dict(c.capacity_bytes),
        scope=dict(c.scope),
        largest_gpu_allocation_bytes=c.largest_gpu_allocation_bytes,
        simulated_ranks=c.simulated_ranks,
    )


def _affine(a: float, b: float, c: float, repeats: int) -> float:
    step = c - b
    if abs((b - a) - step) > _RELATIVE * max(abs(a), abs(b), abs(c)) + _ABSOLUTE:
        raise NotAffine
    return c + repeats * step


def _affine_dict(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any], repeats: int) -> dict[str, float]:
    keys = set(a) | set(b) | set(c)
    return {k: _affine(a.get(k, 0.0), b.get(k, 0.0), c.get(k, 0.0), repeats) for k in sorted(keys)}
