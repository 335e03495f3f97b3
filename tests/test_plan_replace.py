"""`Plan.replace` of the fields the search varies runs only their own checks, and gives the plan a
full construction gives, or the same refusal."""

from __future__ import annotations

import pytest

from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.plan import _OWN_CHECKS, HostPinning, Placement, Plan, Prediction, _plan_fields


def plan(**kw) -> Plan:
    placement = Placement(params="cpu", gradients="cpu", optimizer_states="nvme", recompute_inputs="cpu")
    return Plan(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=16, placement=placement,
                recompute_interval=1, **kw)


def constructed(base: Plan, **changes) -> Plan:
    """What `replace` gave before it knew which checks a field has: every field checked again."""
    doc = {name: getattr(base, name) for name in _plan_fields()}
    doc.update(changes)
    return Plan(**doc)


CHANGES = [{"micro_batch_per_gpu": 7}, {"tiling_factor": 16, "prefetch_depth": 0}, {"host_pinning": "shards"},
           {"host_pinning": HostPinning.STAGED}, {"prediction": Prediction(feasible=True)},
           {"micro_batch_per_gpu": 2.5, "prediction": None}, {"optimizer_step_reason": "faster than after_backward"}]


@pytest.mark.parametrize("changes", CHANGES, ids=lambda c: ",".join(c))
def test_replacing_fields_with_their_own_checks_equals_a_full_construction(changes):
    for base in (plan(), plan(model_parallel_degree=2, micro_batch_per_gpu=0.5)):
        if base.model_parallel_degree == 1 and changes.get("micro_batch_per_gpu") == 2.5:
            continue
        fast = base.replace(**changes)
        assert fast == constructed(base, **changes)
        assert isinstance(fast.host_pinning, HostPinning)
    assert changes.keys() <= _OWN_CHECKS.keys()


@pytest.mark.parametrize(("changes", "message"), [
    ({"micro_batch_per_gpu": 0.5}, "micro_batch_per_gpu 0.5 x model_parallel_degree 1 must be a whole number of samples"),
    ({"micro_batch_per_gpu": 0}, "micro_batch_per_gpu"),
    ({"tiling_factor": 0}, "tiling_factor"),
    ({"tiling_factor": 2.5}, "tiling_factor"),
    ({"prefetch_depth": -1}, "prefetch_depth"),
    ({"host_pinning": "everything"}, "host_pinning"),
    ({"optimizer_step_reason": "x" * 1025}, "optimizer_step_reason"),
])
def test_replacing_a_field_with_a_bad_value_is_refused_as_a_construction_refuses_it(changes, message):
    base = plan()
    with pytest.raises(PlannerError, match=message) as fast:
        base.replace(**changes)
    with pytest.raises(PlannerError) as full:
        constructed(base, **changes)
    assert str(fast.value) == str(full.value)


def test_other_changes_still_derive_what_depends_on_them():
    base = plan(micro_batch_per_gpu=4)
    assert base.replace(optimizer_step_reason="why").replace(optimizer_step="in_backward").optimizer_step_reason == ""
    assert base.replace(recompute_interval=0).recompute == "none"
    assert base.replace(node=resolve_hardware("dgx2-v100")).attention == "eager"
