"""The project's own recorded GPU run is a fit row of its generation (planner/validation/own_runs.py [Note: the
project's own runs in the fit]): predicted from the plan it ran, with the kernel that ran and the probe's links,
as `planner probe` would price it, and a source of its own that leave-one-source-out holds out."""

import json

import pytest

from planner.sim.report import simulate
from planner.specs.catalog import hardware_presets
from planner.validation import fit as fitting
from planner.validation.corpus import load_corpus
from planner.validation.flash_kernels import FlashKernel
from planner.validation.own_runs import OWN_RUNS, own_run_rows


def test_the_h200_run_is_an_h100_generation_row_of_its_own_source():
    (row, planned), = own_run_rows(fitting.GENERATIONS["H100"][0])
    run = OWN_RUNS[0]
    assert (row.row_id, row.source_id, row.gpu_family) == (run.row_id, run.source_id, "H200")
    assert row.source_id not in {r.source_id for r in load_corpus()}
    recorded = json.loads(run.path.read_text())["planner"]["chains"][run.chain]["profile"]
    assert row.measured_tokens_per_s_per_gpu == pytest.approx(recorded["measured"]["tokens_per_s"])
    plan = planned.plan
    # The recorded plan as it ran: 24 blocks of width 2,048 at 1,024 tokens, batch 4, all on one GPU, bf16 ...
    assert (plan.model.num_layers, plan.model.hidden_size, plan.model.seq_len) == (24, 2048, 1024)
    assert (plan.num_gpus, plan.micro_batch_per_gpu, plan.precision) == (1, 4.0, "bf16")
    assert recorded["plan"]["attention"] == "eager"
    # ... with the kernel that ran: the runtime's SDPA, FlashAttention-2 on CUDA.
    assert plan.attention == "flash" and planned.flash_kernel is FlashKernel.FLASH_ATTENTION_2
    # The probe's links, the preset's datasheet numbers, which the fitted fractions multiply.
    preset = hardware_presets()[run.preset]
    assert plan.node.host_to_gpu_bytes_per_s == pytest.approx(recorded["plan"]["hardware"]["host_to_gpu_gb_per_s"] * 1e9)
    assert plan.node.gpu_nominal_flops_per_s == preset.gpu_nominal_flops_per_s
    assert plan.node.gpu_hbm_bytes_per_s == preset.gpu_hbm_bytes_per_s


def test_the_fit_prices_the_run_as_the_probe_would():
    """Under the preset's fitted numbers the row's error is the recorded step's, time for time
    (tests/test_fitted_gpus.py checks the probe's path)."""
    rows = fitting.fit_rows("H100", load_corpus())
    own = [r for r in rows if r.row.source_id == OWN_RUNS[0].source_id]
    assert len(own) == 1 and rows[-1] is own[0]
    params = json.loads(fitting.FIT_JSON.read_text())["H100"]["params"]
    plan = own[0].planned.plan
    predicted_s = simulate(plan.replace(node=fitting.apply(plan.node, params, FlashKernel.FLASH_ATTENTION_2))).prediction.iteration_time_s
    recorded = json.loads(OWN_RUNS[0].path.read_text())["planner"]["chains"][OWN_RUNS[0].chain]["profile"]["measured"]
    error = fitting.errors(own, params)[OWN_RUNS[0].row_id]
    assert error == pytest.approx(recorded["iteration_time_s"] / predicted_s - 1, rel=1e-6)
    # Other generations have no recorded run, and a fit can leave the project's runs out.
    assert not any(r.row.source_id == OWN_RUNS[0].source_id for r in fitting.fit_rows("A100", load_corpus()))
    assert len(fitting.fit_rows("H100", load_corpus(), own_runs=False)) == len(rows) - 1


def test_leave_one_source_out_holds_the_run_out_and_reports_it():
    record = json.loads(fitting.FIT_JSON.read_text())["H100"]
    assert OWN_RUNS[0].row_id in record["rows"]
    held = record["leave_one_source_out"]["by_source"][OWN_RUNS[0].source_id]
    assert list(held["errors"]) == [OWN_RUNS[0].row_id]
    assert held["fitted_on_rows"] == len(record["rows"]) - 1
