"""Library functions the dashboard needs: the fast feasibility test behind `max_size`, the best plan
per strategy, and the paper's arithmetic intensities (eq. 9-11) and per-state bandwidths."""

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.cost.throughput import arithmetic_intensity, efficiency, estimate, state_bandwidths
from planner.search.max_size import MAX_PARAMS, MIN_PARAMS, RELATIVE_PRECISION, _request, max_size
from planner.search.search import SearchRequest, any_fits, best_by_strategy, search
from planner.specs.catalog import resolve_hardware, resolve_model, shape_for_params
from planner.specs.errors import PlannerError
from planner.specs.plan import STRATEGY_TABLE, HostPinning, Plan
from planner.specs.units import GB, GIB


def request(model="1T", hardware="dgx2-v100", gpus=16, **kw):
    return SearchRequest(model=resolve_model(model), node=resolve_hardware(hardware), num_gpus=gpus, **kw)


@pytest.mark.parametrize(
    "model, hardware, gpus, kw",
    [
        ("1T", "dgx2-v100", 16, {}),
        ("1T", "dgx2-v100", 16, {"strategy": "zero3"}),
        ("1T", "dgx2-v100", 16, {"strategy": "zero-inf-nvme"}),
        ("100T", "h200-x1", 1, {}),
        ("paper-70b", "dgx-h100", 8, {"placement_pins": {"params": "cpu"}, "prefetch_depth": 2}),
        ("paper-70b", "dgx-h100", 8, {"strategy": "dp"}),
        ("13B", "cpu-dev-2core", 1, {"micro_batch_per_gpu": 4}),
        ("175B", "dgx-a100-80g", 16, {"model_parallel_degree": None}),
        ("paper-10t", "dgx2-v100", 16, {"tiling_factor": 1}),
    ],
)
def test_any_fits_agrees_with_search(model, hardware, gpus, kw):
    req = request(model, hardware, gpus, **kw)
    assert any_fits(req) == (search(req).best is not None)


@settings(max_examples=40, deadline=None)
@given(
    log_params=st.floats(min_value=math.log(2e8), max_value=math.log(2e14)),
    strategy=st.sampled_from(list(STRATEGY_TABLE)),
    hardware=st.sampled_from(["dgx2-v100", "dgx-h100", "h200-x1"]),
    nodes=st.sampled_from([1, 2]),
    max_alloc_gib=st.sampled_from([None, 0.5, 2.0]),
)
def test_any_fits_agrees_with_search_on_random_cases(log_params, strategy, hardware, nodes, max_alloc_gib):
    node = resolve_hardware(hardware)
    if max_alloc_gib is not None:
        node = node.replace(gpu_max_alloc_bytes=max_alloc_gib * GIB)
    model = shape_for_params(round(math.exp(log_params)))
    req = SearchRequest(model=model, node=node, num_gpus=nodes * node.num_gpus_per_node, strategy=strategy,
                        micro_batch_per_gpu=1)
    if nodes > 1 and not node.inter_node_bytes_per_s:  # no network between nodes: both refuse alike
        for check in (any_fits, search):
            with pytest.raises(PlannerError, match="states no network between nodes"):
                check(req)
        return
    assert any_fits(req) == (search(req).best is not None)


def _reference_max_params(strategy, node, gpus):
    """The bisection as first written: a full search at every step."""
    def best(count):  # max_size's own request: batch 1 per GPU, or one sample per replica for `3d`
        return search(_request(count, strategy, node, gpus, 1024)).best

    found = best(MIN_PARAMS)
    if found is None:
        return 0
    lo, hi = math.log(MIN_PARAMS), math.log(MAX_PARAMS)
    while hi - lo > math.log1p(RELATIVE_PRECISION):
        mid = (lo + hi) / 2
        plan = best(round(math.exp(mid)))
        if plan is None:
            hi = mid
        else:
            lo, found = mid, plan
    return found.model.num_params


@pytest.mark.parametrize("strategy", list(STRATEGY_TABLE))
@pytest.mark.parametrize("hardware, gpus", [("dgx-h100", 16), ("dgx2-v100", 1)])
def test_max_size_matches_the_full_search_bisection(strategy, hardware, gpus):
    node = resolve_hardware(hardware)
    expected = _reference_max_params(strategy, node, gpus)
    result = max_size(strategy, node, gpus)
    assert result.max_params == expected
    assert max_size(strategy, node, gpus, with_plan=False).max_params == expected
    if expected:
        assert result.plan is not None and result.plan.prediction.feasible
        assert result.plan.model == result.model


def test_max_size_without_plan_has_the_model_only():
    result = max_size("zero3", resolve_hardware("dgx-h100"), 16, with_plan=False)
    assert result.plan is None
    # 18 bytes/param as the runtime holds them (planner/cost/memory.py [Note: runtime bytes per parameter]),
    # beside the GPU's worst moment (planner/cost/coexisting.py)
    assert result.model.num_params == result.max_params == 75_421_974_528


def test_best_by_strategy_groups_the_ranked_and_rejected_plans():
    result = search(request())
    best = best_by_strategy(result)
    assert list(best) == ["dp", "zero2", "zero-offload", "zero3", "zero-inf-cpu", "zero-inf-nvme", "3d", "custom"]
    # 1T on one DGX-2: only NVMe holds the 18 TiB of optimizer states (test_planner_search.py)
    for name in ("dp", "zero2", "zero-offload", "zero3", "zero-inf-cpu", "3d"):
        assert not best[name].prediction.feasible and best[name].prediction.reason
    assert best["zero-inf-nvme"].prediction.feasible
    first = {}
    for plan in result.ranked:
        first.setdefault(plan.strategy, plan)
    assert best["zero-inf-nvme"] is first["zero-inf-nvme"] and best["custom"] is first["custom"]


def test_best_by_strategy_of_a_pinned_search_has_that_strategy_only():
    assert list(best_by_strategy(search(request(strategy="zero-inf-nvme")))) == ["zero-inf-nvme"]


def _plan(strategy="zero-inf-nvme", hardware="dgx-h100", gpus=16, batch=7, ci=1):
    return Plan(model=resolve_model("1T"), node=resolve_hardware(hardware), num_gpus=gpus, strategy=strategy,
                placement=STRATEGY_TABLE[strategy].placement, micro_batch_per_gpu=batch, recompute_interval=ci)


def test_arithmetic_intensity_is_eq_9_to_11():
    ait = arithmetic_intensity(_plan(batch=7, ci=2))
    assert ait == {
        "params_and_gradients": 7 * 1024,  # eq. 9: seq x bsz
        "optimizer_states": 7 * 1024 / 4,  # eq. 10
        "recompute_inputs": 24 * 25600 * 2,  # eq. 11: 24 hd ci
    }
    assert arithmetic_intensity(_plan(ci=0))["recompute_inputs"] == 24 * 25600


def test_state_bandwidths_follow_the_placement():
    # dgx-h100: PCIe 50 GB/s per GPU capped by 200/8 = 25 host share; NVMe 50/8 read, 28/8 write per GPU
    nvme = state_bandwidths(_plan("zero-inf-nvme"))
    assert nvme["params_and_gradients"] == pytest.approx(3.5 * GB)
    assert nvme["optimizer_states"] == pytest.approx(3.5 * GB)
    # staged recompute inputs also pass one host thread's memcpy (no measured rate: 25 / 2 per GPU);
    # pinned they cross at the host share (planner/cost/host_link.py)
    assert nvme["recompute_inputs"] == pytest.approx(12.5 * GB)
    pinned = state_bandwidths(_plan("zero-inf-nvme").replace(host_pinning=HostPinning.SHARDS))
    assert pinned["recompute_inputs"] == pytest.approx(25 * GB)
    assert state_bandwidths(_plan("zero3")) == dict.fromkeys(nvme, math.inf)


def test_estimate_efficiencies_use_the_same_intensities_and_bandwidths():
    plan = _plan("zero-inf-nvme")
    ait, bw = arithmetic_intensity(plan), state_bandwidths(plan)
    eff = estimate(plan).efficiency_no_overlap
    assert eff == {k: efficiency(ait[k], bw[k], plan.node.gpu_flops_per_s) for k in ait}
    peak = plan.node.gpu_flops_per_s  # the preset's achievable rate (fitted: data/validation/fit.json)
    assert eff["params_and_gradients"] == pytest.approx(7168 * 3.5e9 / (7168 * 3.5e9 + peak))


def test_a_model_too_wide_for_the_most_tiles_is_rejected_with_its_reason():
    # 64K hidden on a 1 MiB largest free block needs 16 Ki tiles; plans allow 4096 (planner.specs.plan.MAX_TILING_FACTOR)
    node = resolve_hardware("dgx2-v100").replace(gpu_max_alloc_bytes=1024**2)
    req = SearchRequest(model=resolve_model("10T"), node=node, num_gpus=16, strategy="zero-inf-nvme", micro_batch_per_gpu=1)
    result = search(req)
    assert result.best is None and not any_fits(req)
    assert result.rejected[0].tiling_factor == 4096
    assert "exceeds the largest free block" in result.rejected[0].prediction.reason
