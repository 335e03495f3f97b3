"""Largest trainable model for a strategy on a cluster (paper Fig. 1 / Fig. 5 "model scale")."""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.search.search import PIPELINED_STRATEGIES, SearchRequest, any_fits, search
from planner.specs.catalog import shape_for_params
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.precision import DEFAULT_PRECISION

MIN_PARAMS = 10**7
MAX_PARAMS = 10**17
RELATIVE_PRECISION = 0.01


@dataclass(frozen=True, kw_only=True, slots=True)
class MaxSize:
    strategy: str
    max_params: int
    model: ModelSpec | None
    plan: Plan | None
    """The best plan for that model (batch 1 per GPU; `3d`: from one sample per replica); None when even the smallest does not fit, or
    when it was not asked for (`with_plan=False`)."""


def _size_label(num_params: int) -> str:
    return f"{num_params / 1e12:.3g}T" if num_params >= 10**12 else f"{num_params / 1e9:.3g}B"


def _request(num_params: int, strategy: str, node: NodeSpec, num_gpus: int, seq_len: int,
             precision: str = DEFAULT_PRECISION) -> SearchRequest:
    model = shape_for_params(num_params, seq_len=seq_len, label=_size_label(num_params))
    if strategy in PIPELINED_STRATEGIES:
        # 3D parallelism splits the model by tensor and pipeline degrees (both searched); its
        # smallest batch is one sample per model replica, not one per GPU.
        return SearchRequest(model=model, node=node, num_gpus=num_gpus, strategy=strategy, model_parallel_degree=None,
                             precision=precision)
    return SearchRequest(model=model, node=node, num_gpus=num_gpus, strategy=strategy, micro_batch_per_gpu=1,
                         precision=precision)


def max_size(strategy: str, node: NodeSpec, num_gpus: int, *, seq_len: int = 1024, with_plan: bool = True,
             precision: str = DEFAULT_PRECISION) -> MaxSize:
    """Bisect on the parameter count (shapes by the catalog's shape rule) to 1% precision.

    Each step asks only whether anything fits ([Note: least-memory candidate] in planner/search/search.py);
    the full search runs once, for the largest size found, unless `with_plan` is False (curves of
    many points, e.g. the dashboard's, need only the size).
    """
    if not any_fits(_request(MIN_PARAMS, strategy, node, num_gpus, seq_len, precision)):
        return MaxSize(strategy=strategy, max_params=0, model=None, plan=None)
    lo, hi = math.log(MIN_PARAMS), math.log(MAX_PARAMS)
    largest = MIN_PARAMS
    while hi - lo > math.log1p(RELATIVE_PRECISION):
        mid = (lo + hi) / 2
        count = round(math.exp(mid))
        if any_fits(_request(count, strategy, node, num_gpus, seq_len, precision)):
            lo, largest = mid, count
        else:
            hi = mid
    request = _request(largest, strategy, node, num_gpus, seq_len, precision)
    if not with_plan:
        return MaxSize(strategy=strategy, max_params=request.model.num_params, model=request.model, plan=None)
    best = search(request).best
    assert best is not None, "any_fits and search disagree"
    return MaxSize(strategy=strategy, max_params=best.model.num_params, model=best.model, plan=best)
