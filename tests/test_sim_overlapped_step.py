"""The after-backward step that overlaps the next forward (planner/sim/overlapped.py, [Note: the
overlapped step, simulated]): priced where the runtime runs it so (optimizer states on NVMe, the CPU
computes: runtime/optim/step_schedule.py), searched beside the in-backward step, and said in the plan."""

from __future__ import annotations

import pytest

import planner.sim.engine as engine
from planner.cost.host_work import step_cpu_params_per_param
from planner.cost.throughput import estimate
from planner.search.search import SearchRequest, search
from planner.sim import simulate
from planner.sim.workload import optimizer_params_per_rank
from planner.specs.catalog import resolve_hardware
from planner.specs.model import ModelSpec
from planner.specs.plan import Placement, Plan
from planner.specs.training_loop import OVERLAPPED, TrainingLoop, step_overlaps_forward

ALL_NVME = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")
MODEL = ModelSpec(name="small", num_layers=8, hidden_size=512, num_heads=8, seq_len=256, vocab_size=4096)
CPU = resolve_hardware("cpu-dev-2core")


def _plan(**kw) -> Plan:
    return Plan(model=MODEL, node=CPU, num_gpus=1, strategy="custom", placement=ALL_NVME, prefetch_depth=2, **kw)


@pytest.fixture(scope="module")
def both():
    plan = _plan()
    overlapped = simulate(plan).prediction
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine, "step_overlaps_forward", lambda _plan: False)
        synchronous = simulate(plan).prediction
    return plan, overlapped, synchronous


def test_the_runtime_overlaps_only_on_the_cpu_with_states_on_nvme():
    assert step_overlaps_forward(_plan())
    assert not step_overlaps_forward(_plan(optimizer_step="in_backward"))
    assert not step_overlaps_forward(_plan().replace(placement=Placement(params="nvme", gradients="cpu",
                                                                         optimizer_states="cpu")))
    gpu = _plan().replace(node=resolve_hardware("dgx-h100"), nvme_path="/tmp")
    assert not step_overlaps_forward(gpu)
    assert simulate(gpu).prediction.phase_time_s["optimizer"] > 0


def test_the_step_runs_in_the_next_forward(both):
    plan, overlapped, synchronous = both
    # Nothing of the step is left after the backward: it runs in the forward, its Adam on the cores
    # the forward computes on (every update inline, so the forward grows by at least Adam's time).
    assert overlapped.phase_time_s["optimizer"] == 0.0
    adam_s = optimizer_params_per_rank(plan) * step_cpu_params_per_param(plan) / plan.node.cpu_adam_params_per_s
    assert overlapped.phase_time_s["forward"] >= synchronous.phase_time_s["forward"] + adam_s * (1 - 1e-9)
    assert overlapped.phase_time_s["backward"] == pytest.approx(synchronous.phase_time_s["backward"], rel=1e-9)
    # Its I/O hides under the forward's compute: faster than forward + step, never faster than without a step.
    assert overlapped.iteration_time_s < synchronous.iteration_time_s
    assert overlapped.iteration_time_s > synchronous.iteration_time_s - synchronous.phase_time_s["optimizer"]
    # The same bytes per iteration on every link, and the analytic estimate stays a lower bound.
    assert overlapped.link_bytes == pytest.approx(synchronous.link_bytes, rel=1e-9)
    assert estimate(plan).iteration_time_s <= overlapped.iteration_time_s
    assert estimate(plan).phase_time_s["optimizer"] == 0.0


def test_the_search_compares_it_with_the_step_in_backward_and_says_why():
    request = SearchRequest(model=MODEL, node=CPU, num_gpus=1, placement_pins={"optimizer_states": ALL_NVME.optimizer_states})
    ranked = search(request).ranked
    steps = {plan.optimizer_step for plan in ranked}
    assert steps == {"after_backward", "in_backward"}
    after = next(plan for plan in ranked if plan.optimizer_step == "after_backward")
    assert after.optimizer_step_reason.startswith(OVERLAPPED + "; ")
    assert " than in_backward on this placement" in after.optimizer_step_reason or "as fast as" in after.optimizer_step_reason
    clipped = search(SearchRequest(model=MODEL, node=CPU, num_gpus=1, placement_pins=request.placement_pins,
                                   training=TrainingLoop(clips_grad_norm=True))).best
    assert clipped.optimizer_step == "after_backward"
    assert clipped.optimizer_step_reason == f"{OVERLAPPED}; global-norm gradient clipping needs every gradient before any update"
