"""Largest trainable model for a strategy on a cluster (paper Fig. 1 / Fig. 5 "model scale")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.catalog import shape_for_params
from planner.hardware import NodeSpec
from planner.model import ModelSpec
from planner.plan import Plan
from planner.search import SearchRequest, search

MIN_PARAMS = 10**7
MAX_PARAMS = 10**17
RELATIVE_PRECISION = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class MaxSize:
    strategy: str
    max_params: int
    model: ModelSpec | None
    plan: Plan | None
    """The best plan for that model (batch 1 per GPU), or None when even the smallest does not fit."""


def _size_label(num_params: int) -> str:
    return f"{num_params / 1e12:.3g}T" if num_params >= 10**12 else f"{num_params / 1e9:.3g}B"


def _best_plan(num_params: int, strategy: str, node: NodeSpec, num_gpus: int, seq_len: int) -> Plan | None:
    model = shape_for_params(num_params, seq_len=seq_len, label=_size_label(num_params))
    request = SearchRequest(model=model, node=node, num_gpus=num_gpus, strategy=strategy, micro_batch_per_gpu=1)
    return search(request).best


def max_size(strategy: str, node: NodeSpec, num_gpus: int, *, seq_len: int = 1024) -> MaxSize:
    """Bisect on the parameter count (shapes by the catalog's shape rule) to 1% precision."""
    lo_plan = _best_plan(MIN_PARAMS, strategy, node, num_gpus, seq_len)
    if lo_plan is None:
        return MaxSize(strategy=strategy, max_params=0, model=None, plan=None)
    lo, hi = math.log(MIN_PARAMS), math.log(MAX_PARAMS)
    best = lo_plan
    while hi - lo > math.log1p(RELATIVE_PRECISION):
        mid = (lo + hi) / 2
        plan = _best_plan(round(math.exp(mid)), strategy, node, num_gpus, seq_len)
        if plan is None:
            hi = mid
        else:
            lo, best = mid, plan
    return MaxSize(strategy=strategy, max_params=best.model.num_params, model=best.model, plan=best)
