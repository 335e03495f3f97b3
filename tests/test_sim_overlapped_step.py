"""The after-backward NVMe step overlapping the next forward on the CPU machine (planner/sim/
overlapped_step.py [Note: the overlapped step, simulated]; the runtime's [Note: the step overlaps
the next forward] in runtime/step_schedule.py): an exact timeline, the iteration against the serial
schedule and the busy resources, the profile's phase accounting, the analytic estimate beside it,
and the plans it leaves alone."""

import pytest
from test_sim_timelines import ONE_LAYER, rounded, tiny_node

import planner.sim.engine as engine
from planner.catalog import resolve_hardware
from planner.memory import hands_updated_shards, step_overlaps_next_forward
from planner.model import ModelSpec
from planner.phases import Phase
from planner.plan import Placement, Plan
from planner.sim import simulate
from planner.sim.fast import predict
from planner.sim.optimizer import chunked_step
from planner.sim.workload import build_workload
from planner.throughput import estimate

ALL_ON_NVME = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", activation_checkpoints="gpu")
STATES_ON_NVME = Placement(params="cpu", gradients="cpu", optimizer_states="nvme", activation_checkpoints="gpu")


def cpu_machine(**overrides):
    """The CPU is the compute device; NVMe at 12 B/s each way: one fp32 parameter's states take 1 s."""
    return tiny_node(host_memory_bytes_per_s=1024.0, nvme_read_bytes_per_s=12.0, nvme_write_bytes_per_s=12.0,
                     host_is_device=True, **overrides)


def one_layer(placement=ALL_ON_NVME, *, node=None, depth=0, precision="fp32", step="after_backward"):
    return Plan(model=ONE_LAYER, node=node or cpu_machine(), num_gpus=1, placement=placement, checkpoint_interval=0,
                prefetch_depth=depth, precision=precision, optimizer_step=step)


def serial(plan, monkeypatch):
    """The same plan with the step after the backward, as the simulator priced it before the overlap."""
    with monkeypatch.context() as patch:
        patch.setattr(engine, "step_overlaps_next_forward", lambda _plan: False)
        return simulate(plan)


def test_the_step_runs_beside_the_next_forward_unit_by_unit():
    # One fp32 block on NVMe (units qkv 3, attn_out 1, mlp_up 4, mlp_down 4 params, one chunk each;
    # forward 2 flops/param at 2 flop/s, attn_out 4 more). Each chunk reads 16 B/param (states and
    # gradient, 12 B/s), Adam runs 4 params/s on the cores the forward computes on, its writes take
    # 12 B/param. qkv's update ends at 4.75 and hands its shard to the forward (nothing read back);
    # every later update waits for the cores until the operator before it is done, and each use
    # waits for its update: 4.75 + 0.25 + 1 + 1 = 7 s of the host's waits.
    result = simulate(one_layer())
    log = [e for e in rounded(result.simulation.log(), {"nvme_read", "nvme_write", "gpu_compute", "cpu_optimizer"})
           if e[2] <= 21]
    assert log == [
        ("nvme_read", 0, 4, "optimizer"), ("cpu_optimizer", 4, 4.75, "optimizer"),
        ("nvme_read", 4, 5.333333333, "optimizer"), ("nvme_write", 4.75, 7.75, "optimizer"),
        ("gpu_compute", 4.75, 7.75, "forward"),                                                # qkv, handed
        ("nvme_read", 5.333333333, 10.666666667, "optimizer"), ("cpu_optimizer", 7.75, 8, "optimizer"),
        ("nvme_write", 8, 9, "optimizer"), ("gpu_compute", 8, 11, "forward"),                  # attn_out
        ("nvme_read", 10.666666667, 16, "optimizer"), ("cpu_optimizer", 11, 12, "optimizer"),
        ("nvme_write", 12, 16, "optimizer"), ("gpu_compute", 12, 16, "forward"),               # mlp_up
        ("cpu_optimizer", 16, 17, "optimizer"), ("nvme_write", 17, 21, "optimizer"),
        ("gpu_compute", 17, 21, "forward"),                                                    # mlp_down
    ]
    assert result.simulation.step_wait_s == pytest.approx({Phase.FORWARD: 7.0, Phase.BACKWARD: 0.0})
    p = result.prediction
    # The profile's phases: the forward's own 14 s, the host's 7 s of waits in the optimizer phase,
    # nothing after the backward; they add up to the iteration.
    assert p.phase_time_s == pytest.approx({"forward": 14.0, "backward": 36.0, "optimizer": 7.0})
    assert p.iteration_time_s == pytest.approx(57.0)
    # Every forward read was handed over: the step's 12 x 16 B and the backward's 12 x 4 B are read.
    assert p.link_bytes["nvme_read"] == 12 * 16 + 12 * 4
    assert p.link_bytes["nvme_write"] == 12 * 12 + 12 * 4


def test_overlapped_iteration_is_below_the_serial_sum_and_above_each_resource(monkeypatch):
    for plan in (one_layer(), one_layer(depth=2), one_layer(STATES_ON_NVME, precision="bf16")):
        result, before = simulate(plan), serial(plan, monkeypatch)
        p, s = result.prediction, before.prediction
        assert p.iteration_time_s < s.iteration_time_s
        busy = {link.name: link.busy_s for link in result.simulation.links()}
        # The drive serves the step and the passes' reads and writes; the cores the forward, Adam and the backward.
        floor = max(busy["nvme_read"], busy["nvme_write"], busy["gpu_compute"] + busy["cpu_optimizer"])
        assert p.iteration_time_s >= floor - 1e-9
        assert p.iteration_time_s == pytest.approx(sum(p.phase_time_s.values()), rel=1e-12)
        assert p.phase_time_s["backward"] == pytest.approx(s.phase_time_s["backward"])


def _bench_plan(batch, tokens):
    """benchmarks/bench_nvme_step.py's full-NVMe plan on the CPU machine's preset (the DESIGN.md MLP)."""
    model = ModelSpec(name="design-md-mlp", num_layers=8, hidden_size=1024, num_heads=1, head_dim=1, seq_len=tokens,
                      vocab_size=0, ffn_hidden_size=4096)
    placement = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", activation_checkpoints="cpu")
    return Plan(model=model, node=resolve_hardware("cpu-dev-2core"), num_gpus=1, precision="fp32",
                checkpoint_interval=0, prefetch_depth=3, placement=placement, micro_batch_per_gpu=batch,
                optimizer_chunk_bytes=72 * 2**20, num_optimizer_buffers=6)


@pytest.mark.parametrize(("batch", "tokens", "iteration", "optimizer"), [
    (1, 16, 1.4917, 1.1336),   # io-bound: the step's I/O outlasts the forward
    (4, 128, 2.7221, 0.4483),  # design: the forward's compute hides part of it
])
def test_an_io_bound_step_hides_behind_the_forward_as_far_as_the_drive_allows(batch, tokens, iteration, optimizer,
                                                                            monkeypatch):
    plan = _bench_plan(batch, tokens)
    assert step_overlaps_next_forward(plan) and hands_updated_shards(plan)
    result, before = simulate(plan), serial(plan, monkeypatch)
    p, s = result.prediction, before.prediction
    assert p.iteration_time_s == pytest.approx(iteration, abs=1e-4)
    assert p.phase_time_s["optimizer"] == pytest.approx(optimizer, abs=1e-4)
    assert p.iteration_time_s < s.iteration_time_s
    busy = {link.name: link.busy_s for link in result.simulation.links()}
    # One shared NVMe budget (device-seconds) and the cores: the iteration is at least each.
    assert p.iteration_time_s >= max(busy["nvme"], busy["gpu_compute"] + busy["cpu_optimizer"])
    # The forward reads no parameter shard back (each is handed over): P fewer bytes read.
    shard = plan.model.num_params * 4
    assert s.link_bytes["nvme_read"] - p.link_bytes["nvme_read"] == pytest.approx(shard, rel=1e-3)
    assert p.link_bytes["nvme_write"] == s.link_bytes["nvme_write"]
    # Not extrapolated from shallower samples (their forward would overlap the whole model's step).
    fast = predict(plan)
    assert fast.iteration_time_s == pytest.approx(p.iteration_time_s, rel=1e-12)
    assert "extrapolated_from_layers" not in fast.details


@pytest.mark.parametrize(("batch", "tokens"), [(1, 16), (4, 128)])
def test_the_analytic_estimate_bounds_and_tracks_the_simulated_overlap(batch, tokens):
    plan = _bench_plan(batch, tokens)
    est, sim = estimate(plan), simulate(plan).prediction
    # [Note: analytic bound] in planner/sim/refine.py ...
    assert est.iteration_time_s <= sim.iteration_time_s
    # ... and the forward beside the step (forward + optimizer phases) within 3% of the simulation's.
    # (The backward differs more: the estimate overlaps its parameter reads with its gradient writes
    # on the one shared drive, the simulation adds them.)
    window, sim_window = (x.phase_time_s["forward"] + x.phase_time_s["optimizer"] for x in (est, sim))
    assert window <= sim_window
    assert window == pytest.approx(sim_window, rel=0.03)
    assert est.iteration_time_s == pytest.approx(sum(est.phase_time_s.values()), rel=1e-12)
    assert est.link_bytes["nvme_read"] == pytest.approx(sim.link_bytes["nvme_read"], rel=1e-6)
    # The step's work is the overlapped window's: the optimizer phase is what exceeds the forward alone.
    serial_step = est.component_time_s["optimizer (nvme)"]
    assert 0 < est.phase_time_s["optimizer"] < serial_step


def test_the_estimate_of_an_io_bound_step_is_its_drive_time_beyond_the_forward():
    plan = _bench_plan(1, 16)
    est = estimate(plan)
    # The forward reads nothing (handed), so the window is the step's NVMe time: 4P read at 1.5 GB/s,
    # 3P written at 1.9 GB/s, P = 4 bytes x parameters.
    p = plan.model.num_params * 4
    drive = 4 * p / 1.5e9 + 3 * p / 1.9e9
    assert est.phase_time_s["forward"] + est.phase_time_s["optimizer"] == pytest.approx(drive, rel=1e-9)


@pytest.mark.parametrize("plan", [
    one_layer(Placement(params="nvme", gradients="cpu", optimizer_states="cpu", activation_checkpoints="gpu")),
    one_layer(Placement()),
    one_layer(node=cpu_machine().replace(host_is_device=False)),
])
def test_steps_in_memory_or_beside_a_separate_device_stay_after_the_backward(plan):
    assert not step_overlaps_next_forward(plan)
    result = simulate(plan)
    assert result.simulation.step_wait_s == {}
    p = result.prediction
    end = result.simulation.phase_end_s
    assert p.phase_time_s["optimizer"] == pytest.approx(end[Phase.OPTIMIZER] - end[Phase.BACKWARD])
    if plan.placement.optimizer_states == "nvme":  # the chunked step's own duration, after the backward
        work = build_workload(plan)
        assert p.phase_time_s["optimizer"] == pytest.approx(chunked_step(plan, work, 1).duration_s)


def test_a_step_in_backward_on_the_cpu_machine_is_not_the_overlapped_one():
    plan = one_layer(STATES_ON_NVME, step="in_backward", precision="bf16")
    assert not step_overlaps_next_forward(plan)
    # tests/test_sim_in_backward.py's timeline of this plan: the updates take turns with compute.
    assert simulate(plan).prediction.phase_time_s == pytest.approx({"forward": 14.0, "backward": 31.0,
                                                                     "optimizer": 3.0})
