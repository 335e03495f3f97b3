"""`planner probe` calibrates on reference runs of the runtime where the CPU is the compute device
(planner/calibration/probe_reference.py [Note: probe reference runs]).

The end-to-end flow (probe with calibration, fit, run, compare) is tests/test_calibrate_loop.py;
whether the calibrated spec predicts well is the sweep benchmark's business (benchmarks/sweep.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.calibration import probe_reference
from planner.calibration.calibrate import FEATURES, phase_features
from planner.calibration.probe_reference import REFERENCE_RUNS, calibrate_on_reference_runs, reference_plan
from planner.specs.catalog import hardware_presets
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from tierwise.cli import app
from tierwise.cli import probe as probe_cli


def _cpu_node():
    """A spec shaped like a probe's on a CPU-only machine (host_is_device)."""
    doc = hardware_presets()["dgx-h100"].to_dict()
    doc.update(name="probed-test", num_gpus_per_node=1, host_is_device=True, gpu_peak_tflops=0.5,
               gpu_hbm_gb_per_s=10.0, host_memory_gb_per_s=10.0, host_to_gpu_gb_per_s=10.0,
               gpu_to_host_gb_per_s=10.0, cpu_adam_gparams_per_s=2.0, nvme_read_gb_per_s=2.0,
               nvme_write_gb_per_s=4.0, gpu_memory_gib=24.0, cpu_memory_gib=24.0)
    doc.pop("gpu_max_alloc_gib", None)
    return NodeSpec.from_dict(doc)


def test_reference_runs_identify_every_fitted_term(tmp_path: Path) -> None:
    # Each of calibrate's terms is asked for by some reference run, and no term is a combination of
    # the others over the runs' phases (full column rank), so the fit can tell them apart: in
    # particular the per-operator cost from the compute rate (the tiled run).
    import numpy as np

    node = _cpu_node()
    rows = []
    for ref in REFERENCE_RUNS:
        plan = reference_plan(ref, node, str(tmp_path))
        assert plan.num_gpus == 1 and plan.precision == "bf16" and plan.tiling_factor == ref.tiling_factor
        assert (plan.nvme_path is not None) == ("nvme" in plan.placement.to_dict().values())
        rows += [[phases[f] for f in FEATURES] for phases in phase_features(plan, node).values()]
    matrix = np.asarray(rows)
    assert all(matrix[:, j].sum() > 0 for j in range(len(FEATURES)))
    scaled = matrix / matrix.max(axis=0)
    assert np.linalg.matrix_rank(scaled, tol=1e-3) == len(FEATURES)


def test_the_fit_recovers_a_known_spec_from_its_own_predictions(tmp_path: Path) -> None:
    # Profiles whose phase times are the simulator's under a known spec (a 1.5 ms per-operator cost,
    # slower compute, memory, CPU Adam and NVMe than the base, and backward matmuls slower than the
    # forward's) are fitted back to that spec, the NVMe run included: the features are what each
    # phase's simulated time owes each rate, so the NVMe reads the simulator hides behind compute
    # are not priced as if they added up, and the reference run without recompute tells the
    # backward's matmul rate from the forward's.
    import dataclasses

    from planner.calibration.calibrate import calibrate, loose_factors
    from planner.sim.report import simulate
    from planner.specs.hardware import EfficiencyCurve
    from planner.specs.profile import Profile

    base = _cpu_node()
    truth = base.replace(gpu_flops_per_s=base.gpu_flops_per_s * 0.7, gpu_hbm_bytes_per_s=base.gpu_hbm_bytes_per_s * 0.4,
                         cpu_adam_params_per_s=base.cpu_adam_params_per_s * 0.8, operator_overhead_s=1.5e-3,
                         nvme_read_bytes_per_s=base.nvme_read_bytes_per_s * 0.8,
                         nvme_write_bytes_per_s=base.nvme_write_bytes_per_s * 0.8,
                         backward_matmul_flops_per_s=base.gpu_flops_per_s * 0.6,
                         matmul_efficiency=EfficiencyCurve())  # the fitted spec has no curve either
    runs = []
    for ref in REFERENCE_RUNS:
        plan = reference_plan(ref, base, str(tmp_path))
        measured = simulate(plan.replace(node=truth)).prediction
        runs.append((plan, Profile(measured=measured, samples=(), warmup_steps=0)))
    fitted = calibrate(runs, base)
    assert fitted.node.operator_overhead_s == pytest.approx(1.5e-3, rel=0.02)
    assert fitted.node.gpu_flops_per_s == pytest.approx(truth.gpu_flops_per_s, rel=0.02)
    assert fitted.node.backward_matmul_flops_per_s == pytest.approx(truth.backward_matmul_flops_per_s, rel=0.02)
    assert fitted.node.sources["backward_matmul_tflops"] == "measured"
    assert fitted.node.gpu_hbm_bytes_per_s == pytest.approx(truth.gpu_hbm_bytes_per_s, rel=0.02)
    assert fitted.node.cpu_adam_params_per_s == pytest.approx(truth.cpu_adam_params_per_s, rel=0.02)
    assert fitted.node.nvme_read_bytes_per_s == pytest.approx(truth.nvme_read_bytes_per_s, rel=0.02)
    assert fitted.node.nvme_write_bytes_per_s == pytest.approx(truth.nvme_write_bytes_per_s, rel=0.02)
    assert fitted.residual < 0.01
    # Exact data pins every factor down: standard errors are a tiny share of the values.
    assert fitted.standard_errors["operators"] < 0.01 * 1.5e-3
    assert all(fitted.standard_errors[k] < 0.01 * fitted.factors[k] for k in fitted.standard_errors)
    assert loose_factors(fitted) == []
    # A factor whose standard error is over half its value is named loose (t < 2); NaN (no degrees
    # of freedom) is not judged.
    judged = dataclasses.replace(fitted, standard_errors={"compute_s": 0.1 * fitted.factors["compute_s"],
                                                          "operators": 0.6 * fitted.factors["operators"],
                                                          "memory_s": float("nan")})
    assert loose_factors(judged) == ["operators"]


def test_the_fit_scales_a_cpu_fused_attention_rate_with_the_compute_rate(tmp_path: Path) -> None:
    # A probed CPU times its fused attention kernel (runtime/probe.py [Note: the CPU's fused
    # attention]) at a fifth of its matmul rate; that kernel's busy time is part of the compute
    # feature, so a machine whose compute runs at 0.7 of the probe's runs both at 0.7 and the fit says so.
    from planner.calibration.calibrate import calibrate
    from planner.sim.report import simulate
    from planner.specs.hardware import EfficiencyCurve
    from planner.specs.profile import Profile

    base = _cpu_node().replace(flash_attention_flops_per_s=0.1e12, matmul_efficiency=EfficiencyCurve())
    truth = base.replace(gpu_flops_per_s=base.gpu_flops_per_s * 0.7, flash_attention_flops_per_s=0.07e12)
    runs = []
    for ref in REFERENCE_RUNS:
        if ref.params == "nvme":
            continue
        plan = reference_plan(ref, base, str(tmp_path))
        assert plan.attention == "flash"
        runs.append((plan, Profile(measured=simulate(plan.replace(node=truth)).prediction, samples=(), warmup_steps=0)))
    fitted = calibrate(runs, base)
    assert fitted.factors["compute_s"] == pytest.approx(1 / 0.7, rel=0.02)
    assert fitted.node.flash_attention_flops_per_s == pytest.approx(0.07e12, rel=0.02)
    assert fitted.node.sources["flash_attention_tflops"] == "measured"


def test_a_cpu_whose_kernel_rates_were_measured_is_fitted_one_factor_for_all(tmp_path: Path) -> None:
    # [Note: one factor for the CPU's kernels]: the probe measured the memory-bound kernels' rate
    # (hbm_achievable_fraction, measured) next to the matmuls', so a machine running both at 0.6 of
    # the probe's rates is fitted with compute factor 1/0.6 and no memory factor, and the calibrated
    # spec scales the matmul, fused attention and memory-bound rates alike.
    from planner.calibration.calibrate import calibrate, shares_cores
    from planner.cost.kernels import achievable_hbm_bytes_per_s
    from planner.sim.report import simulate
    from planner.specs.hardware import EfficiencyCurve
    from planner.specs.profile import Profile

    node = _cpu_node().replace(flash_attention_flops_per_s=0.1e12, matmul_efficiency=EfficiencyCurve(),
                               hbm_achievable_fraction=0.03)
    assert not shares_cores(node)  # a fraction not measured here (a preset's) keeps the two factors
    base = node.replace(sources={**node.sources, "hbm_achievable_fraction": "measured"})
    assert shares_cores(base)
    truth = base.replace(gpu_flops_per_s=base.gpu_flops_per_s * 0.6, flash_attention_flops_per_s=0.06e12,
                         gpu_hbm_bytes_per_s=base.gpu_hbm_bytes_per_s * 0.6)
    runs = []
    for ref in REFERENCE_RUNS:
        if ref.params == "nvme":
            continue
        plan = reference_plan(ref, base, str(tmp_path))
        runs.append((plan, Profile(measured=simulate(plan.replace(node=truth)).prediction, samples=(), warmup_steps=0)))
    fitted = calibrate(runs, base)
    assert fitted.factors["compute_s"] == pytest.approx(1 / 0.6, rel=0.02) and fitted.factors["memory_s"] == 0.0
    assert achievable_hbm_bytes_per_s(fitted.node) == pytest.approx(0.6 * achievable_hbm_bytes_per_s(base), rel=0.02)
    assert fitted.node.flash_attention_flops_per_s == pytest.approx(0.06e12, rel=0.02)


def test_a_failing_reference_run_is_one_line_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvme_only = tuple(r for r in REFERENCE_RUNS if r.params == "nvme")
    monkeypatch.setattr(probe_reference, "REFERENCE_RUNS", nvme_only)
    with pytest.raises(PlannerError) as error:
        # A swap directory whose parent is missing: `planner run` creates a missing swap directory only
        # inside an existing parent, so this run fails before training.
        calibrate_on_reference_runs(_cpu_node(), str(tmp_path / "no-such-parent" / "swap"),
                                    train=probe_cli.train_reference_run)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"probe reference run {nvme_only[0].name} failed (")
    assert "without --calibrate" in message


def test_each_reference_run_is_trained_round_robin_and_fitted_on_its_median(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One slow training of a reference run (a slow minute of the machine) must not reach the fit.
    from planner.specs.plan import Prediction
    from planner.specs.profile import Profile

    times = {ref.name: iter([1.0, 5.0, 2.0]) for ref in REFERENCE_RUNS}  # median: 2.0
    trained, fitted = [], []

    def fake_train(ref, work, steps):  # noqa: ANN001, ANN202
        assert (work / f"{ref.name}.plan.json").is_file()
        trained.append(ref.name)
        t = next(times[ref.name])
        return Profile(measured=Prediction(feasible=True, iteration_time_s=t, method="measured"), samples=(),
                       warmup_steps=0, details={"t": t})

    monkeypatch.setattr(probe_reference, "calibrate", lambda runs, node: fitted.extend(runs) or "fit")
    assert calibrate_on_reference_runs(_cpu_node(), str(tmp_path), train=fake_train, repeats=3) == "fit"
    assert trained == [ref.name for ref in REFERENCE_RUNS] * 3
    assert [plan.model.name for plan, _ in fitted] == [f"probe-{ref.name}" for ref in REFERENCE_RUNS]
    assert [profile.details["t"] for _, profile in fitted] == [2.0] * len(REFERENCE_RUNS)


@pytest.mark.slow
def test_no_calibrate_keeps_the_bare_measurements(tmp_path: Path) -> None:
    out = tmp_path / "hw.json"
    result = CliRunner().invoke(app, ["probe", "--out", str(out), "--nvme-path", str(tmp_path),
                                      "--nvme-test-gib", "0.0625", "--no-calibrate"])
    assert result.exit_code == 0, result.output
    assert "reference runs" not in json.loads(out.read_text())["notes"]


def test_probe_warns_when_other_work_competes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_cli.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(probe_cli.os, "getloadavg", lambda: (0.4, 0.4, 0.4))
    assert probe_cli._busy_warning() == ""
    monkeypatch.setattr(probe_cli.os, "getloadavg", lambda: (1.8, 1.0, 0.5))
    assert probe_cli._busy_warning().startswith("load average 1.80 on 2 CPUs: other work is running")


def test_reference_runs_train_in_the_precision_the_probe_measured(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # [Note: reference runs in the probed precision]: where fp32 matmuls are the faster (a CPU that
    # emulates bf16), the spec's compute rate is fp32's and the reference runs train in fp32.
    from planner.specs.plan import PRECISIONS, load_plan
    from runtime import probe as runtime_probe

    assert set(runtime_probe.DTYPE_OF_PRECISION) == set(PRECISIONS)
    doc = _cpu_node().to_dict()
    monkeypatch.setattr(runtime_probe, "probe_node", lambda **kwargs: (dict(doc), "fp32"))
    trained: list[str] = []

    def fake_train(ref, work, steps):  # noqa: ANN001, ANN202
        from planner.specs.plan import Prediction
        from planner.specs.profile import Profile

        trained.append(load_plan(work / f"{ref.name}.plan.json").precision)
        return Profile(measured=Prediction(feasible=True, iteration_time_s=1.0, method="measured"), samples=(),
                       warmup_steps=0)

    monkeypatch.setattr(probe_cli, "train_reference_run", fake_train)

    class Fit:  # what the CLI reads of a fit; the fit itself is tested above
        node, factors, residual = _cpu_node(), {"compute_s": 1.0}, 0.0

    monkeypatch.setattr(probe_reference, "calibrate", lambda runs, node: Fit())
    out = tmp_path / "hw.json"
    result = CliRunner().invoke(app, ["probe", "--out", str(out), "--nvme-path", str(tmp_path), "--calibrate"])
    assert result.exit_code == 0, result.output
    assert trained == ["fp32"] * len(REFERENCE_RUNS) * probe_reference.REFERENCE_REPEATS
    assert "reference runs of the runtime in fp32" in json.loads(out.read_text())["notes"]
    assert reference_plan(REFERENCE_RUNS[0], _cpu_node(), str(tmp_path)).precision == "bf16"  # the default

    # --repeats sets the trainings per reference run, and the note says how many the fit saw.
    trained.clear()
    result = CliRunner().invoke(app, ["probe", "--out", str(out), "--nvme-path", str(tmp_path), "--calibrate",
                                      "--repeats", "2"])
    assert result.exit_code == 0, result.output
    assert trained == ["fp32"] * len(REFERENCE_RUNS) * 2
    assert "the median of 2 trainings each" in json.loads(out.read_text())["notes"]
    result = CliRunner().invoke(app, ["probe", "--nvme-path", str(tmp_path), "--calibrate", "--repeats", "0"])
    # A PlannerError is the CLI's one-line error (tierwise/cli main), raised before anything is measured.
    assert str(result.exception) == "--repeats must be at least 1, got 0"


def test_an_overlapped_step_is_fitted_with_the_forward_it_overlaps(tmp_path: Path) -> None:
    # [Note: the overlapped step is one row with the forward]: the NVMe reference run's after-backward
    # step runs during the next forward on a CPU device, and how much of its cost the profile shows as
    # the host's waits (`optimizer`) or as a slower forward depends on the contention. The fit is the
    # same wherever the profile puts it, and that run gives one row for the two phases.
    import dataclasses

    from planner.calibration.calibrate import calibrate, step_overlaps_forward
    from planner.sim.report import simulate
    from planner.specs.profile import Profile

    base = _cpu_node()
    truth = base.replace(gpu_flops_per_s=base.gpu_flops_per_s * 0.7, cpu_adam_params_per_s=base.cpu_adam_params_per_s * 0.8)
    plans = [reference_plan(ref, base, str(tmp_path)) for ref in REFERENCE_RUNS]
    assert [step_overlaps_forward(p) for p in plans] == [ref.optimizer_states == "nvme" for ref in REFERENCE_RUNS]
    assert not step_overlaps_forward(plans[2].replace(node=dataclasses.replace(base, host_is_device=False)))

    def runs(moved_share: float) -> list:
        out = []
        for plan in plans:
            measured = simulate(plan.replace(node=truth)).prediction
            if step_overlaps_forward(plan):
                t = dict(measured.phase_time_s)
                moved = moved_share * t["optimizer"]
                t["forward"], t["optimizer"] = t["forward"] + moved, t["optimizer"] - moved
                measured = dataclasses.replace(measured, phase_time_s=t)
            out.append((plan, Profile(measured=measured, samples=(), warmup_steps=0)))
        return out

    as_simulated, in_forward = calibrate(runs(0.0), base), calibrate(runs(0.97), base)
    assert as_simulated.num_rows == in_forward.num_rows == 3 * len(plans) - 1
    assert in_forward.factors == pytest.approx(as_simulated.factors, rel=1e-6, abs=1e-12)


def test_a_drive_the_probe_measured_is_fitted_no_faster_than_measured(tmp_path: Path) -> None:
    # [Note: a drive runs no faster than the probe measured it]: with the NVMe rates `measured`,
    # reference runs whose NVMe phases ran faster than the simulator prices them (overlap the
    # simulator does not model, here a drive 1.5x faster) keep the measured rates; runs on a slower
    # drive are fitted to it as before. Rates that are estimates are fitted either way.
    from planner.calibration.calibrate import calibrate, factor_floors
    from planner.sim.report import simulate
    from planner.specs.hardware import EfficiencyCurve
    from planner.specs.profile import Profile

    base = _cpu_node()
    measured = base.replace(sources={**base.sources, "nvme_read_gb_per_s": "measured", "nvme_write_gb_per_s": "measured"})
    assert factor_floors(base) == {} and factor_floors(measured) == {"nvme_s": 1.0}

    def fit(node, drive_speed: float):
        truth = node.replace(nvme_read_bytes_per_s=node.nvme_read_bytes_per_s * drive_speed,
                             nvme_write_bytes_per_s=node.nvme_write_bytes_per_s * drive_speed,
                             matmul_efficiency=EfficiencyCurve())  # the fitted spec has none
        runs = []
        for ref in REFERENCE_RUNS:
            plan = reference_plan(ref, node, str(tmp_path))
            runs.append((plan, Profile(measured=simulate(plan.replace(node=truth)).prediction, samples=(), warmup_steps=0)))
        return calibrate(runs, node)

    faster, slower, estimated = fit(measured, 1.5), fit(measured, 0.8), fit(base, 1.5)
    assert faster.factors["nvme_s"] == 1.0
    assert faster.node.nvme_read_bytes_per_s == measured.nvme_read_bytes_per_s
    assert slower.factors["nvme_s"] == pytest.approx(1 / 0.8, rel=0.02)
    assert estimated.factors["nvme_s"] == pytest.approx(1 / 1.5, rel=0.02)


def test_the_calibrating_probe_says_k_of_n_and_the_time_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # [Note: the calibrating probe's estimate]: first the bare spec's prediction of every training, then
    # rescaled by how long the trainings so far took against their estimates. The clock is given.
    from planner.specs.plan import Prediction
    from planner.specs.profile import Profile

    lines: list[str] = []
    now = [0.0]
    estimates = {ref.name: probe_reference.training_estimate_s(reference_plan(ref, _cpu_node(), str(tmp_path)),
                                                               probe_reference.REFERENCE_STEPS)
                 for ref in REFERENCE_RUNS}
    assert all(e > probe_reference.STARTUP_S for e in estimates.values())

    def train(ref, work, steps):  # noqa: ANN001, ANN202
        now[0] += 2 * estimates[ref.name]  # every training takes twice its estimate
        return Profile(measured=Prediction(feasible=True, iteration_time_s=1.0, method="measured"), samples=(),
                       warmup_steps=0)

    monkeypatch.setattr(probe_reference, "calibrate", lambda runs, node: "fit")  # the fit is tested above
    calibrate_on_reference_runs(_cpu_node(), str(tmp_path), train=train, repeats=2, log=lines.append,
                                clock=lambda: now[0])
    total = len(REFERENCE_RUNS) * 2
    assert [line.split(" ", 1)[0] for line in lines] == [f"{k}/{total}" for k in range(1, total + 1)]
    first_left = 2 * sum(estimates.values())
    second_left = 2 * (first_left - estimates[REFERENCE_RUNS[0].name])  # the first took twice its estimate
    assert lines[0].endswith(f"about {probe_reference._duration(first_left)} left")
    assert lines[1].endswith(f"about {probe_reference._duration(second_left)} left")
