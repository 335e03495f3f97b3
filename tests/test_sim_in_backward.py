"""The simulated optimizer step in backward (planner/sim/in_backward.py [Note: the optimizer step in
backward, simulated]): exact timelines on tiny plans, bytes, phases, periodic extrapolation,
calibration and compare."""

import json

import pytest
import typer
from test_sim_timelines import CPU_OFFLOAD, ONE_LAYER, rounded, tiny_node
from typer.testing import CliRunner

from planner.calibration.calibrate import calibrate, phase_features
from planner.calibration.compare import compare
from planner.cost.throughput import estimate
from planner.sim import simulate
from planner.sim.fast import predict
from planner.sim.periodic import simulate_periodic
from planner.sim.workload import optimizer_params_per_rank
from planner.specs.catalog import hardware_presets, resolve_hardware, resolve_model
from planner.specs.model import ModelSpec
from planner.specs.plan import HostPinning, Placement, Plan
from planner.specs.profile import Profile
from tierwise.cli.simulate import register

STATES_ON_NVME = Placement(params="cpu", gradients="cpu", optimizer_states="nvme", recompute_inputs="gpu")
ALL_ON_NVME = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")


def nvme_node(**overrides):
    """NVMe at 12 B/s each way: one parameter's fp32 master, momentum and variance take 1 s."""
    return tiny_node(host_memory_bytes_per_s=1024.0, nvme_read_bytes_per_s=12.0, nvme_write_bytes_per_s=12.0,
                     **overrides)


COPY_S = 18 / 1024
"""Per parameter, the streamed step's host copies in STATES_ON_NVME (bf16): the gradient from host
memory (8 B), the master's cast to bf16 (4 + 2 B) and the copy into the parameters' host shard (2 + 2 B)
at 1024 B/s, timed with CPU Adam (planner/cost/host_work.py [Note: the step's host copies])."""


def one_layer(node, placement, step="in_backward"):
    return Plan(model=ONE_LAYER, node=node, num_gpus=1, placement=placement, recompute_interval=0, prefetch_depth=0,
                optimizer_step=step)


# -- exact timelines -------------------------------------------------------------------------------
def test_resident_cpu_optimizer_updates_each_operator_after_its_gradient_lands():
    # test_sim_timelines' one-layer plan (forward 0-26 s, every backward step fetch -> compute ->
    # offload in turn): each operator's CPU Adam (4 params/s) runs as soon as its gradient is on the
    # CPU, beside the next operator's fetch, instead of 12 params in one step at the end (81 s).
    result = simulate(one_layer(tiny_node(), CPU_OFFLOAD))
    log = [e for e in rounded(result.simulation.log(), {"d2h", "cpu_optimizer"}) if e[1] >= 26]
    assert log == [
        ("d2h", 38, 42, "backward"), ("cpu_optimizer", 42, 43, "optimizer"),       # mlp_down: 4 params
        ("d2h", 54, 58, "backward"), ("cpu_optimizer", 58, 59, "optimizer"),       # mlp_up
        ("d2h", 65, 66, "backward"), ("cpu_optimizer", 66, 66.25, "optimizer"),    # attn_out: 1 param
        ("d2h", 75, 78, "backward"), ("cpu_optimizer", 78, 78.75, "optimizer"),    # qkv: 3 params
    ]
    p = result.prediction
    assert p.phase_time_s == pytest.approx({"forward": 26.0, "backward": 52.75, "optimizer": 0.0})
    assert p.iteration_time_s == pytest.approx(78.75)


def test_nvme_states_are_read_ahead_from_backward_start_and_the_gradient_never_touches_nvme():
    # Optimizer states on NVMe, 3 chunk buffers, one chunk per operator. From the backward's start
    # (26 s) the reader fills the buffers with mlp_down's, mlp_up's and attn_out's states (4, 4 and
    # 1 params: 4 + 4 + 1 s); qkv's wait for the first buffer to be written back. When an operator's
    # gradient is final (its compute ends), its chunk takes the 16-bit gradient over PCIe (2 B/s),
    # is updated (4 params/s, plus COPY_S per param of host copies) and written back (12 B/param);
    # the next update waits for the CPU only.
    result = simulate(one_layer(nvme_node(), STATES_ON_NVME))
    log = rounded(result.simulation.log(), {"nvme_read", "nvme_write", "d2h", "cpu_optimizer"})
    c4, c3 = 4 * COPY_S, 3 * COPY_S
    assert log == [  # dyadic fractions: exact
        ("nvme_read", 26, 30, "optimizer"), ("nvme_read", 30, 34, "optimizer"), ("nvme_read", 34, 35, "optimizer"),
        ("d2h", 38, 42, "optimizer"), ("cpu_optimizer", 42, 43 + c4, "optimizer"),          # mlp_down, final at 38
        ("nvme_write", 43 + c4, 47 + c4, "optimizer"), ("nvme_read", 47 + c4, 50 + c4, "optimizer"),  # -> qkv's read
        ("d2h", 50, 54, "optimizer"), ("cpu_optimizer", 54, 55 + c4, "optimizer"),          # mlp_up, final at 50
        ("nvme_write", 55 + c4, 59 + c4, "optimizer"),
        ("d2h", 57, 58, "optimizer"), ("cpu_optimizer", 58, 58.25 + COPY_S, "optimizer"),   # attn_out, final at 57
        ("nvme_write", 59 + c4, 60 + c4, "optimizer"),
        ("d2h", 66, 69, "optimizer"), ("cpu_optimizer", 69, 69.75 + c3, "optimizer"),       # qkv, final at 66
        ("nvme_write", 69.75 + c3, 72.75 + c3, "optimizer"),                                # the step's write tail
    ]
    p = result.prediction
    # Backward ends with the last update computed; `optimizer.step()` waits for the last write.
    assert p.phase_time_s == pytest.approx({"forward": 26.0, "backward": 43.75 + c3, "optimizer": 3.0})
    assert p.iteration_time_s == pytest.approx(sum(p.phase_time_s.values()))
    assert p.link_bytes == {"nvme_read": 144, "nvme_write": 144, "h2d": 48, "d2h": 24, "all_gather": 0,
                            "reduce_scatter": 0}
    # After backward: every gradient offloaded in backward (52 s), then 12 params read, updated, written.
    after = simulate(one_layer(nvme_node(), STATES_ON_NVME, "after_backward")).prediction
    assert after.phase_time_s == pytest.approx({"forward": 26.0, "backward": 52.0, "optimizer": 27.0 + 12 * COPY_S})
    # The chunk buffers are the runtime's pool, pinned once and held all iteration (the bill's term).
    assert p.details["simulated_memory_terms"]["cpu"]["optimizer chunk buffers"] == p.memory_terms["cpu"]["optimizer_swap_buffers"]


def test_on_the_cpu_machine_the_update_takes_turns_with_compute():
    # host_is_device: the runtime's backward hook updates on the compute thread. Each update (after
    # its read, 1 s per 4 params of CPU Adam and COPY_S per param of host copies) delays the next
    # operator's compute.
    result = simulate(one_layer(nvme_node(host_is_device=True), STATES_ON_NVME))
    compute = [e for e in rounded(result.simulation.log(), {"gpu_compute", "cpu_optimizer"}) if e[1] >= 22]
    c4, c8, c9 = 4 * COPY_S, 8 * COPY_S, 9 * COPY_S
    assert compute == [  # dyadic fractions: exact
        ("cpu_optimizer", 22, 23 + c4, "optimizer"), ("gpu_compute", 23 + c4, 31 + c4, "backward"),  # mlp_down, mlp_up
        ("cpu_optimizer", 31 + c4, 32 + c8, "optimizer"), ("gpu_compute", 32 + c8, 38 + c8, "backward"),
        ("cpu_optimizer", 38 + c8, 38.25 + c9, "optimizer"), ("gpu_compute", 38.25 + c9, 44.25 + c9, "backward"),
        ("cpu_optimizer", 44.25 + c9, 45 + 12 * COPY_S, "optimizer"),
    ]
    p = result.prediction
    assert p.link_bytes["d2h"] == 0  # the gradient is where the update runs
    assert p.phase_time_s == pytest.approx({"forward": 14.0, "backward": 31.0 + 12 * COPY_S, "optimizer": 3.0})


def test_a_gpu_optimizer_runs_on_the_compute_stream():
    # HBM-bound Adam (36 B/param at 36 B/s: 1 s per param) between the backward operators: the
    # iteration is as long as after backward, the optimizer phase is gone.
    node = tiny_node(gpu_hbm_bytes_per_s=36.0)
    before = simulate(one_layer(node, Placement(), "after_backward")).prediction
    result = simulate(one_layer(node, Placement()))
    updates = [e for e in rounded(result.simulation.log(), {"gpu_compute"}) if e[3] == "optimizer"]
    assert [round(b - a, 9) for _, a, b, _ in updates] == [4, 4, 1, 3]
    assert result.prediction.phase_time_s["optimizer"] == 0.0
    assert result.prediction.iteration_time_s == pytest.approx(before.iteration_time_s)


# -- bytes and phases on a real plan -------------------------------------------------------------
def _a100_plan(placement, step, *, precision="bf16", batch=16):
    model = ModelSpec(name="deep", num_layers=24, hidden_size=2048, num_heads=16, seq_len=2048, vocab_size=1000)
    return Plan(model=model, node=hardware_presets()["dgx-a100-80g"], num_gpus=8, placement=placement,
                micro_batch_per_gpu=batch, recompute_interval=1, optimizer_chunk_bytes=2**22, precision=precision,
                optimizer_step=step)


def test_in_backward_moves_exactly_the_gradients_fewer_nvme_bytes():
    # fp32, so the gradient is 4 bytes both ways: written in backward and read in the step after
    # backward, neither in backward's updates.
    before = simulate(_a100_plan(ALL_ON_NVME, "after_backward", precision="fp32")).prediction
    after = simulate(_a100_plan(ALL_ON_NVME, "in_backward", precision="fp32")).prediction
    shard = optimizer_params_per_rank(_a100_plan(ALL_ON_NVME, "in_backward", precision="fp32"))
    assert before.link_bytes["nvme_read"] - after.link_bytes["nvme_read"] == pytest.approx(4 * shard, abs=8)
    assert before.link_bytes["nvme_write"] - after.link_bytes["nvme_write"] == pytest.approx(4 * shard, abs=8)
    for link in ("h2d", "d2h", "all_gather", "reduce_scatter"):
        assert after.link_bytes[link] == before.link_bytes[link]


@pytest.mark.parametrize("placement", [ALL_ON_NVME, STATES_ON_NVME, CPU_OFFLOAD])
def test_a_long_backward_hides_the_update_and_leaves_the_write_tail(placement):
    before = simulate(_a100_plan(placement, "after_backward")).prediction
    after = simulate(_a100_plan(placement, "in_backward")).prediction
    assert after.iteration_time_s == pytest.approx(sum(after.phase_time_s.values()), rel=1e-12)
    assert after.iteration_time_s < before.iteration_time_s
    assert after.phase_time_s["forward"] == pytest.approx(before.phase_time_s["forward"])
    # Backward compute hides the update traffic: backward barely grows (< 2%) ...
    assert after.phase_time_s["backward"] < 1.02 * before.phase_time_s["backward"]
    # ... and the optimizer phase is only the last chunk's write tail (CPU states: nothing to write).
    assert after.phase_time_s["optimizer"] < 0.01 * before.phase_time_s["optimizer"]


@pytest.mark.parametrize(("hidden", "batch", "periodic"), [
    (2048, 16, True),   # the updates keep up with backward: the same period every unit
    (512, 2, False),    # they fall further behind each unit: not periodic, simulated whole
])
def test_periodic_extrapolation_matches_the_whole_simulation(hidden, batch, periodic):
    model = ModelSpec(name="deep", num_layers=24, hidden_size=hidden, num_heads=16, seq_len=2048, vocab_size=1000)
    # Recompute inputs pinned (what `fit` chooses here): staged, their offload through one thread's memcpy
    # falls further behind each unit, and the 2048-wide case is not periodic either.
    plan = _a100_plan(ALL_ON_NVME, "in_backward", batch=batch).replace(model=model, host_pinning=HostPinning.SHARDS)
    fast, full = predict(plan), simulate(plan)
    assert ("extrapolated_from_layers" in fast.details) == periodic
    assert fast.phase_time_s == pytest.approx(full.prediction.phase_time_s, rel=1e-9)
    assert fast.link_bytes == pytest.approx(full.prediction.link_bytes, rel=1e-9)
    timelines = simulate_periodic(plan).timelines
    assert timelines.phase_end_s == pytest.approx(full.timelines.phase_end_s, rel=1e-9)
    for name, spans in full.timelines.intervals.items():
        assert sum(b - a for a, b, _ in timelines.intervals[name]) == pytest.approx(sum(b - a for a, b, _ in spans),
                                                                                    rel=1e-9)


def test_a_1t_plan_stepping_in_backward_simulates():
    plan = Plan(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=16, placement=ALL_ON_NVME,
                micro_batch_per_gpu=32, recompute_interval=1, optimizer_step="in_backward")
    p = simulate(plan).prediction
    before = estimate(plan.replace(optimizer_step="after_backward"))
    assert p.iteration_time_s == pytest.approx(sum(p.phase_time_s.values()), rel=1e-12)
    assert p.phase_time_s["optimizer"] < 0.01 * before.phase_time_s["optimizer"]
    # [Note: analytic bound] in planner/search/refine.py holds for the in-backward estimate too.
    assert estimate(plan).tokens_per_s >= p.tokens_per_s


# -- the CLI, calibration and compare ------------------------------------------------------------
def test_simulate_pin_and_bad_value(tmp_path):
    app = typer.Typer()
    register(app)
    app.command("noop")(lambda: None)
    path = tmp_path / "plan.json"
    one_layer(nvme_node(), STATES_ON_NVME, "after_backward").save(path)
    runner = CliRunner(env={"COLUMNS": "200"})  # one line per message: tables follow the terminal width
    result = runner.invoke(app, ["simulate", str(path), "--optimizer-step", "in_backward", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["optimizer_step"] == "in_backward"
    assert doc["prediction"]["phase_time_s"]["optimizer"] == pytest.approx(3.0)
    result = runner.invoke(app, ["simulate", str(path), "--optimizer-step", "in_backward"])
    assert result.exit_code == 0 and "optimizer step in backward" in result.output
    result = runner.invoke(app, ["simulate", str(path), "--optimizer-step", "later"])
    assert result.exit_code == 1 and "--optimizer-step must be one of" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_calibration_features_follow_the_phase_the_work_falls_in():
    # [Note: the calibration model] in planner/calibration/calibrate.py: a feature is what a phase's simulated
    # time owes a rate. In the NVMe test's timeline above the backward (26 - 69.75 s, as the
    # runtime's profile times it: it ends with the last update computed) waits for qkv's update
    # only (3 params at 4 params/s; the other updates and every read run beside later operators),
    # the optimizer phase is the write tail (3 s of NVMe), the forward waits for no update.
    plan = one_layer(nvme_node(), STATES_ON_NVME)
    features = phase_features(plan, plan.node)
    assert features["backward"]["cpu_adam_s"] == pytest.approx(0.75)
    assert features["backward"]["nvme_s"] == 0.0
    assert features["optimizer"] == pytest.approx({"compute_s": 0.0, "backward_matmul_s": 0.0, "memory_s": 0.0,
                                                   "cpu_adam_s": 0.0, "nvme_s": 3.0, "operators": 0.0, "fixed_s": 0.0},
                                                  abs=1e-9)
    assert features["forward"]["nvme_s"] == features["forward"]["cpu_adam_s"] == 0.0
    # What no fitted rate carries (the gradients' PCIe copies, the update's host copies) is fixed:
    # with every factor 1 the features give back the simulated phase times.
    phases = simulate(plan).prediction.phase_time_s
    for phase, f in features.items():
        assert f["fixed_s"] + sum(v for k, v in f.items() if k not in ("fixed_s", "operators")) == pytest.approx(phases[phase])


def test_a_profile_of_an_in_backward_run_compares_and_calibrates():
    plan = one_layer(nvme_node(), STATES_ON_NVME)
    predicted = simulate(plan).prediction
    plan = plan.replace(prediction=predicted)
    profile = Profile(measured=predicted, samples=(), warmup_steps=0, plan=plan.to_dict())
    rows = {row.metric: row for row in compare(plan, profile)}
    # [Note: the phases of an in-backward step] in planner/calibration/compare.py: the runtime and the
    # simulator cut backward and optimizer at different points, so their sum is what is scored.
    for metric in ("phase_time_s.forward", "phase_time_s.backward_and_optimizer"):
        assert rows[metric].relative_error == pytest.approx(0.0)
    for phase in ("backward", "optimizer"):
        row = rows[f"phase_time_s.{phase}"]
        assert row.relative_error is None and "in-backward step" in row.not_compared
        assert row.measured == predicted.phase_time_s[phase]
    assert rows["phase_time_s.backward_and_optimizer"].predicted == pytest.approx(
        predicted.phase_time_s["backward"] + predicted.phase_time_s["optimizer"])
    after = plan.replace(optimizer_step="after_backward")
    after_rows = {row.metric: row for row in compare(after, profile)}
    assert "phase_time_s.backward_and_optimizer" not in after_rows
    assert after_rows["phase_time_s.optimizer"].relative_error == pytest.approx(0.0)
    fitted = calibrate([(plan, profile)], plan.node)
    assert fitted.residual < 0.05
