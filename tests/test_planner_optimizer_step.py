"""`optimizer_step: in_backward` in the planner: the plan field, the memory bill, the analytic
estimate, the search pin and the CLI (`--optimizer-step`)."""

import json
import subprocess
import sys

import pytest

from planner.cost.memory import (
    IN_BACKWARD_STAGED_GRADIENTS,
    largest_unit_params,
    memory_bill,
    stores_gradients,
)
from planner.cost.throughput import estimate
from planner.output.deepspeed_config import deepspeed_config
from planner.search.search import SearchRequest, search
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.plan import Placement, Plan
from planner.specs.training_loop import PINNED_REASON, TrainingLoop

NVME = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")
CPU = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")


def plan_1t(placement: Placement = NVME, **changes) -> Plan:
    doc = dict(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=16, placement=placement,
               micro_batch_per_gpu=32, recompute_interval=1)
    doc.update(changes)
    return Plan(**doc)


def planner(*args):
    proc = subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


# -- the plan field ---------------------------------------------------------------------------
def test_plan_round_trips_the_field_and_defaults_to_the_papers_step():
    assert plan_1t().optimizer_step == "after_backward"
    plan = plan_1t(optimizer_step="in_backward")
    doc = json.loads(json.dumps(plan.to_dict()))
    assert doc["optimizer_step"] == "in_backward"
    assert Plan.from_dict(doc) == plan
    legacy = {k: v for k, v in plan_1t().to_dict().items() if k != "optimizer_step"}  # plans written before the field
    assert Plan.from_dict(legacy).optimizer_step == "after_backward"


def test_fp16_and_unknown_steps_are_refused():
    with pytest.raises(PlannerError, match="fp16"):
        plan_1t(optimizer_step="in_backward", precision="fp16")
    with pytest.raises(PlannerError, match="optimizer_step must be one of after_backward, in_backward"):
        plan_1t(optimizer_step="during_forward")
    plan_1t(optimizer_step="after_backward", precision="fp16")  # the paper's step takes any precision


# -- the memory bill --------------------------------------------------------------------------
def test_in_backward_with_optimizer_on_nvme_stores_no_gradient():
    before, after = plan_1t(), plan_1t(optimizer_step="in_backward")
    assert stores_gradients(before) and not stores_gradients(after)
    a, b = memory_bill(before).terms, memory_bill(after).terms
    # The fp32 gradient shard (4 bytes/param in the gradients' tier, per node) and its GPU offload
    # staging are gone; its NVMe write buffers become the host update's pinned staging (two shards
    # in the compute precision, planner.cost.memory.staged_in_backward); nothing else changes.
    shard_per_node = 4 * before.model.num_params // 16 * 8
    assert a["nvme"]["optimizer_states"] - b["nvme"]["optimizer_states"] == pytest.approx(shard_per_node, abs=8)
    unit_shard = largest_unit_params(after) / after.data_parallel_degree
    staging = IN_BACKWARD_STAGED_GRADIENTS * -(-int(unit_shard * 2) // 4096) * 4096 * 8  # 8 GPUs per node
    assert b["cpu"]["gradient_swap_buffers"] == pytest.approx(staging, abs=4096 * 8)
    assert b["cpu"]["gradient_swap_buffers"] < a["cpu"]["gradient_swap_buffers"]
    assert "gradient_offload_staging" in a["gpu"] and "gradient_offload_staging" not in b["gpu"]
    for tier in ("gpu", "cpu"):
        dropped = {"gradient_swap_buffers", "gradient_offload_staging", "not_at_once", "allocator_slack"}
        assert {k: v for k, v in a[tier].items() if k not in dropped} == \
            {k: v for k, v in b[tier].items() if k not in dropped}


@pytest.mark.parametrize("placement", [CPU, Placement(), Placement(params="nvme", gradients="cpu",
                                                                     optimizer_states="cpu")])
def test_in_backward_with_resident_optimizer_bills_the_same(placement):
    # The update reads the stored gradient shard where it lies, only earlier.
    before, after = plan_1t(placement), plan_1t(placement, optimizer_step="in_backward")
    assert stores_gradients(after)
    assert memory_bill(before).terms == memory_bill(after).terms


# -- the analytic estimate --------------------------------------------------------------------
def test_estimate_overlaps_the_optimizer_with_backward_and_skips_the_gradient_round_trip():
    before, after = estimate(plan_1t()), estimate(plan_1t(optimizer_step="in_backward"))
    shard = plan_1t().model.num_params / 16
    # The fp32 gradient shard (bf16 gradients are added into it): written in backward, read in the step.
    assert before.link_bytes["nvme_read"] - after.link_bytes["nvme_read"] == pytest.approx(4 * shard, abs=2)
    assert before.link_bytes["nvme_write"] - after.link_bytes["nvme_write"] == pytest.approx(4 * shard, abs=2)
    assert after.link_bytes["d2h"] == before.link_bytes["d2h"]  # the shard still reaches the host's buffer
    assert after.phase_time_s["optimizer"] == 0.0
    assert after.phase_time_s["forward"] == before.phase_time_s["forward"]
    # Overlapped: at least each of backward and the optimizer's work, less than their sum.
    work = after.component_time_s["optimizer (nvme)"]
    assert max(before.phase_time_s["backward"], work) <= after.phase_time_s["backward"]
    assert after.iteration_time_s < before.iteration_time_s


def test_fp32_parameters_beside_their_states_on_nvme_are_written_once():
    # fp32 parameters on NVMe with the optimizer states there are their own master: the step writes
    # the master with the states and no separate compute copy (runtime/optim/streamed_optimizer.py `_write`),
    # as the simulator prices it; a bf16 plan writes its 2-byte compute copy besides.
    from planner.sim.report import simulate

    fp32 = plan_1t(precision="fp32", micro_batch_per_gpu=4)
    bf16 = plan_1t(micro_batch_per_gpu=4)
    shard = fp32.model.num_params / 16
    for p in (fp32, bf16):
        est, sim = estimate(p).link_bytes, simulate(p).prediction.link_bytes
        assert est["nvme_write"] == pytest.approx(sim["nvme_write"], rel=1e-6)
    assert estimate(bf16).link_bytes["nvme_write"] - estimate(fp32).link_bytes["nvme_write"] == pytest.approx(
        2 * shard, rel=1e-6)


def test_estimate_on_the_compute_device_adds_the_update_to_compute():
    # A GPU optimizer runs on the compute stream: the updates take turns with backward compute.
    before, after = estimate(plan_1t(Placement())), estimate(plan_1t(Placement(), optimizer_step="in_backward"))
    assert after.iteration_time_s == pytest.approx(before.iteration_time_s)
    assert after.phase_time_s["optimizer"] == 0.0


# -- the search and the CLI -------------------------------------------------------------------
def test_search_compares_the_schedules_the_training_allows():
    request = dict(model=resolve_model("1.4B"), node=resolve_hardware("dgx-h100"), num_gpus=8,
                   placement_pins={"optimizer_states": "nvme"})
    searched = search(SearchRequest(**request))
    assert {p.optimizer_step for p in searched.ranked} == {"after_backward", "in_backward"}
    pinned = search(SearchRequest(**request, training=TrainingLoop(optimizer_step="in_backward")))
    assert {p.optimizer_step for p in pinned.ranked} == {"in_backward"}
    assert {p.optimizer_step_reason for p in pinned.ranked} == {PINNED_REASON}
    clipped = search(SearchRequest(**request, training=TrainingLoop(clips_grad_norm=True)))
    assert {p.optimizer_step for p in clipped.ranked} == {"after_backward"}
    assert clipped.best.optimizer_step_reason == "global-norm gradient clipping needs every gradient before any update"
    # Stepping in backward overlaps the NVMe optimizer's traffic with the backward: faster, so chosen.
    assert pinned.best.prediction.tokens_per_s > clipped.best.prediction.tokens_per_s
    assert searched.best.optimizer_step == "in_backward"
    assert searched.best.prediction.tokens_per_s == pinned.best.prediction.tokens_per_s
    other = clipped.best.prediction.iteration_time_s
    assert searched.best.optimizer_step_reason == (
        f"faster than after_backward on this placement: {searched.best.prediction.iteration_time_s:.4g} s vs "
        f"{other:.4g} s per iteration")


@pytest.mark.parametrize("changes, reason", [
    (dict(precision="fp16"), "fp16's loss scaler checks every gradient for overflow before any update"),
    (dict(micro_batches_per_step=4), "4 micro-batches accumulate before each step"),
])
def test_search_keeps_the_step_after_backward_where_the_training_needs_it(changes, reason):
    request = SearchRequest(model=resolve_model("1.4B"), node=resolve_hardware("dgx-h100"), num_gpus=8,
                            placement_pins={"optimizer_states": "nvme"}, **changes)
    result = search(request)
    assert {p.optimizer_step for p in result.ranked} == {"after_backward"}
    assert {p.optimizer_step_reason for p in result.ranked} == {reason}


def test_clipping_and_a_pinned_in_backward_step_are_refused_together():
    with pytest.raises(PlannerError, match="--optimizer-step in_backward cannot run with --clip-grad-norm"):
        TrainingLoop(optimizer_step="in_backward", clips_grad_norm=True)


def test_fit_1t_picks_the_faster_schedule_unless_the_run_clips():
    code, out, err = planner("fit", "1T", "--gpus", "16", "--json")
    assert code == 0, err
    searched = json.loads(out)
    assert searched["optimizer_step"] == "in_backward"
    assert searched["optimizer_step_reason"].startswith("faster than after_backward on this placement")
    code, out, err = planner("fit", "1T", "--gpus", "16", "--json", "--clip-grad-norm")
    assert code == 0, err
    clipped = json.loads(out)
    assert clipped["optimizer_step"] == "after_backward"
    assert clipped["optimizer_step_reason"] == "global-norm gradient clipping needs every gradient before any update"
    assert searched["prediction"]["iteration_time_s"] < 0.7 * clipped["prediction"]["iteration_time_s"]


def test_fit_pin_shows_the_step_and_notes_deepspeed(tmp_path):
    ds = tmp_path / "ds.json"
    args = ("fit", "1.4B", "--gpus", "8", "--placement", "optimizer=nvme", "--optimizer-step", "in_backward")
    code, out, err = planner(*args, "--deepspeed-config", str(ds))
    assert code == 0, err
    assert "optimizer step in backward" in " ".join(out.split())  # the plan line folds at the terminal's width
    note = [line for line in (out + err).splitlines() if "DeepSpeed steps the optimizer after backward" in line]
    assert len(note) == 1
    assert json.loads(ds.read_text())["tierwise"]["optimizer_step"] == "in_backward"
    code, out, err = planner(*args, "--json")
    assert code == 0, err
    assert json.loads(out)["optimizer_step"] == "in_backward"
    code, out, err = planner("fit", "1.4B", "--gpus", "8", "--clip-grad-norm")
    assert code == 0 and "optimizer step in backward" not in " ".join(out.split())  # the paper's step goes unsaid


def test_memory_pin_drops_the_gradient_terms():
    args = ("memory", "1T", "--gpus", "16", "--strategy", "zero-inf-nvme", "--json")
    code, out, err = planner(*args, "--optimizer-step", "in_backward")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["optimizer_step"] == "in_backward"
    staged = doc["terms"]["cpu"]["gradient_swap_buffers"]  # the in-backward update's pinned staging
    code, out, _ = planner(*args)
    assert json.loads(out)["terms"]["cpu"]["gradient_swap_buffers"] > staged  # the NVMe write buffers


@pytest.mark.parametrize(("args", "needle"), [
    (("fit", "1.4B", "--optimizer-step", "sometimes"), "--optimizer-step must be one of after_backward, in_backward"),
    (("memory", "1.4B", "--optimizer-step", "x"), "--optimizer-step must be one of"),
    (("fit", "1.4B", "--precision", "fp16", "--optimizer-step", "in_backward"), "cannot run with precision fp16"),
])
def test_bad_optimizer_step_is_one_line_exit_1(args, needle):
    code, out, err = planner(*args)
    assert code == 1
    assert needle in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_deepspeed_config_of_the_papers_step_is_unchanged():
    assert "optimizer_step" not in deepspeed_config(plan_1t())["tierwise"]


@pytest.mark.parametrize("precision, placement, host_is_device, expected", [
    ("bf16", Placement(params="nvme", gradients="cpu", optimizer_states="nvme"), True, 8 + 6 + 4),
    ("bf16", Placement(params="gpu", gradients="cpu", optimizer_states="nvme"), False, 8 + 6),
    ("bf16", Placement(params="cpu", gradients="nvme", optimizer_states="nvme"), False, 6 + 4),
    ("fp32", Placement(params="nvme", gradients="nvme", optimizer_states="nvme"), True, 0),
    ("fp32", Placement(params="nvme", gradients="cpu", optimizer_states="nvme"), True, 8),
    ("bf16", Placement(params="cpu", gradients="cpu", optimizer_states="cpu"), True, 6),
    ("bf16", Placement(params="cpu", gradients="cpu", optimizer_states="cpu"), False, 6),
    ("fp32", Placement(params="cpu", gradients="cpu", optimizer_states="cpu"), False, 0),
    ("bf16", Placement(params="gpu", gradients="cpu", optimizer_states="cpu"), False, 0),
    ("bf16", Placement(params="gpu", gradients="gpu", optimizer_states="gpu"), False, 0),
])
def test_the_cpu_steps_host_copies(precision, placement, host_is_device, expected):
    # [Note: the step's host copies]: streamed from NVMe, the gradient from host memory into the
    # chunk buffer (8), the cast of the fp32 master to the compute copy (4 + e) and that copy staged
    # for the drive or copied into a host shard (2 e); states resident in host memory, the cast
    # written straight into a host-memory parameter shard (4 + e); nothing where the parameters are
    # the master (fp32, one tier), cross to a GPU through the pool, or the GPU steps.
    from planner.cost.host_work import step_host_copy_bytes_per_param

    node = resolve_hardware("dgx-h100").replace(host_is_device=host_is_device)
    p = Plan(model=resolve_model("1T"), node=node, num_gpus=16, placement=placement, precision=precision)
    assert step_host_copy_bytes_per_param(p) == expected


def test_the_step_times_its_host_copies_with_adam_in_estimate_and_simulator():
    # A CPU device with states on NVMe and drives far faster than the CPU: the step is the CPU's,
    # Adam's parameters at its rate plus 18 bytes of copies per parameter at the host's memory
    # bandwidth, in the estimate exactly and in the simulator's chunk pipeline alike (the runtime
    # runs this step during the next forward: the pipeline is the synchronous step's).
    from planner.sim.optimizer import chunked_step
    from planner.sim.workload import build_workload
    from planner.specs.units import GB

    node = resolve_hardware("dgx-h100").replace(
        num_gpus_per_node=1, host_is_device=True, cpu_adam_params_per_s=1e9, host_memory_bytes_per_s=9 * GB,
        nvme_read_bytes_per_s=1e15, nvme_write_bytes_per_s=1e15)
    p = Plan(model=resolve_model("1.3B"), node=node, num_gpus=1, micro_batch_per_gpu=1, recompute_interval=1,
             placement=Placement(params="nvme", gradients="cpu", optimizer_states="nvme", recompute_inputs="cpu"),
             nvme_path="/tmp")
    params = p.model.num_params
    expected = params / 1e9 + params * 18 / (9 * GB)
    est = estimate(p)
    assert est.component_time_s["optimizer (nvme)"] == pytest.approx(expected, rel=1e-6)
    # The runtime runs this step during the next forward, on the cores the forward computes on.
    assert est.phase_time_s["optimizer"] == 0.0
    assert est.phase_time_s["forward"] >= expected
    assert chunked_step(p, build_workload(p), 1).duration_s == pytest.approx(expected, rel=0.02)
