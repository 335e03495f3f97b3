"""Fitted presets (docs/planner.md, Fitted presets): the fitter recovers known numbers, leave-one-source-out never
sees its held-out source, every fitted number says where it came from, and fitting is deterministic."""

import dataclasses
import json
import math
import statistics

import pytest

from planner.specs.catalog import hardware_presets
from planner.specs.errors import PlannerError
from planner.specs.hardware import FITTED_PROVENANCE, NodeSpec
from planner.validation import fit as fitting
from planner.validation.corpus import load_corpus
from planner.validation.report import measured_metric, predict_row

TRUTH = {"plateau": 0.52, "half_gflop": 4.0, "flash": 0.3, "hbm": 0.7}
FITTED_KEYS = ("gpu_peak_tflops", "hbm_achievable_fraction", "efficiency")


@pytest.fixture(scope="module")
def a100_rows():
    """A spread of A100 rows: small and large widths, short and long sequences, eager and flash."""
    rows = fitting.fit_rows("A100", load_corpus())
    by_source: dict[str, list] = {}
    for r in rows:
        by_source.setdefault(r.row.source_id, []).append(r)
    return [r for members in by_source.values() for r in members[:: max(1, len(members) // 6)]]


def synthetic(rows, params):
    """The rows with their measured value replaced by the planner's own prediction under `params`."""
    out = []
    for r in rows:
        plan = r.planned.plan.replace(node=fitting.apply(r.planned.plan.node, params, r.planned.flash_kernel))
        result = predict_row(r.row, planned=dataclasses.replace(r.planned, plan=plan))
        metric, _ = measured_metric(r.row)
        column = "measured_mfu" if metric == "mfu" else f"measured_{metric}"
        out.append(fitting.FitRow(dataclasses.replace(r.row, **{column: result.predicted}), r.planned))
    return out


@pytest.mark.slow  # a fit of the A100 rows, about 45 s on 2 cores: CI runs it (`-m slow`)
def test_fitter_recovers_the_parameters_that_generated_the_rows(a100_rows, monkeypatch):
    monkeypatch.setattr(fitting, "MAX_EVALUATIONS", 400)  # to convergence: the truth is far from the prior
    rows = synthetic(a100_rows, TRUTH)
    assert len({r.row.source_id for r in rows}) >= 3 and len(rows) >= 15
    params, _ = fitting.fit(rows, fitting.PRIOR["A100"])
    errors = fitting.errors(rows, params)
    assert max(abs(e) for e in errors.values()) < 0.03  # the finest step is 3 % in log space
    for name in ("plateau", "flash"):
        assert params[name] == pytest.approx(TRUTH[name], rel=0.06), name
    assert params["hbm"] == pytest.approx(TRUTH["hbm"], rel=0.15)  # memory-bound kernels: a small share of the time
    # The rows' matmuls are tens of GFLOP and up, where the curve is near its plateau: the half size is
    # not identified by itself, the rate it gives those matmuls is.
    for gflop in (100.0, 1000.0):
        rate = params["plateau"] * fitting.matmul_curve(params["half_gflop"]).at(gflop * 1e9)
        true = TRUTH["plateau"] * fitting.matmul_curve(TRUTH["half_gflop"]).at(gflop * 1e9)
        assert rate == pytest.approx(true, rel=0.06), gflop


def test_t_quantile_matches_students_table():
    # Two-sided 95 % critical values from any table of Student's t.
    for dof, value in ((1, 12.706), (2, 4.303), (4, 2.776), (10, 2.228), (30, 2.042), (120, 1.980)):
        assert fitting.t_quantile(0.975, dof) == pytest.approx(value, abs=2e-3), dof


def scattered(rows, params, spread=0.05):
    """`synthetic` rows with a +-`spread` scatter that follows no feature (alternating by row)."""
    out = []
    for i, r in enumerate(synthetic(rows, params)):
        metric, _ = measured_metric(r.row)
        column = "measured_mfu" if metric == "mfu" else f"measured_{metric}"
        value = getattr(r.row, column) * (1 + spread * (-1) ** i)
        out.append(fitting.FitRow(dataclasses.replace(r.row, **{column: value}), r.planned))
    return out


def test_rows_free_only_the_parameters_they_pin_down(a100_rows, monkeypatch):
    """[Note: which parameters the rows free]: three rows of one source, whose predictions scale with
    every parameter alike, move the plateau only; a spread of widths and sequences frees more."""
    monkeypatch.setattr(fitting, "MAX_EVALUATIONS", 60)
    few = [r for r in a100_rows if r.row.source_id == "torchtitan_perfmd_2408"][:3]
    assert len(few) == 3
    params, _ = fitting.fit(scattered(few, TRUTH), fitting.PRIOR["A100"])
    assert params["plateau"] != fitting.PRIOR["A100"]["plateau"]
    assert {k: v for k, v in params.items() if k != "plateau"} == \
        {k: v for k, v in fitting.PRIOR["A100"].items() if k != "plateau"}
    params, _ = fitting.fit(scattered(a100_rows, TRUTH), fitting.PRIOR["A100"])
    assert params["plateau"] != fitting.PRIOR["A100"]["plateau"] and params["flash"] != fitting.PRIOR["A100"]["flash"]


def test_a_parameter_without_information_is_never_freed(a100_rows):
    eager = [r for r in a100_rows if r.planned.plan.attention != "flash"][:6]
    rows = scattered(eager, TRUTH)
    chosen, _ = fitting.significant_parameter(rows, fitting.PRIOR["A100"], ["plateau"], ["flash"])
    assert chosen is None  # eager attention never runs the flash kernel: its column is zero


def test_fitting_is_deterministic(a100_rows, monkeypatch):
    monkeypatch.setattr(fitting, "MAX_EVALUATIONS", 25)
    rows = a100_rows[:8]
    assert fitting.fit(rows, fitting.PRIOR["A100"]) == fitting.fit(rows, fitting.PRIOR["A100"])


def test_leave_one_source_out_never_fits_on_the_held_out_source(a100_rows, monkeypatch):
    small = [r for i, r in enumerate(a100_rows) if i % 3 == 0]  # a few rows per source keep it quick
    monkeypatch.setattr(fitting, "MAX_EVALUATIONS", 12)
    real_fit, calls = fitting.fit, []

    def recording_fit(rows, start, seen=None):
        seen_ids: set[str] = set()
        params = real_fit(rows, start, seen_ids.add)
        calls.append(({r.row.source_id for r in rows}, set(seen_ids)))
        return params

    monkeypatch.setattr(fitting, "fit", recording_fit)
    result = fitting.leave_one_source_out(small, fitting.PRIOR["A100"])
    sources = sorted({r.row.source_id for r in small})
    source_of = {r.row.row_id: r.row.source_id for r in small}
    assert list(result["by_source"]) == sources and len(calls) == len(sources)
    for held, (given, seen_ids) in zip(sources, calls, strict=True):
        assert given == set(sources) - {held}
        assert seen_ids and held not in {source_of[i] for i in seen_ids}  # every row the fit predicted
    assert result["summary"]["rows"] == sum(s["rows"] for s in result["by_source"].values())
    for source in sources:  # held-out rows are predicted with the fit that never saw them
        held = result["by_source"][source]
        rows = [r for r in small if r.row.source_id == source]
        again = fitting.errors(rows, held["params"])  # params as recorded (6 decimals)
        assert held["errors"] == pytest.approx({k: round(v, 6) for k, v in again.items()}, abs=1e-5)


def test_a_single_source_has_no_leave_one_source_out_error(a100_rows, monkeypatch):
    one = [r for r in a100_rows if r.row.source_id == "narayanan2021_t1"]

    def no_fit(rows, start, seen=None):
        raise AssertionError("nothing is left to fit on")

    monkeypatch.setattr(fitting, "fit", no_fit)
    result = fitting.leave_one_source_out(one, fitting.PRIOR["A100"])
    assert result["summary"] is None and result["by_source"] == {}
    assert "not defined: one source (narayanan2021_t1)" in result["not_defined"]
    tasks = []
    monkeypatch.setattr(fitting, "fit_task", lambda task: tasks.append(task) or ({}, 0))
    assert fitting.all_fits(["V100"], load_corpus(), loso=True, jobs=1) == {"V100": {None: ({}, 0)}}
    assert tasks == [("V100", None)]  # V100 has one source (Megatron-LM 2019): only the in-sample fit


@pytest.mark.parametrize("generation", sorted(fitting.GENERATIONS))
def test_every_fitted_number_names_its_rows_and_keeps_the_value_it_replaced(generation):
    record = json.loads(fitting.FIT_JSON.read_text())[generation]
    rows = fitting.row_ranges(record["rows"])
    for name in fitting.GENERATIONS[generation][1]:
        doc = json.loads((fitting.HARDWARE_DIR / f"{name}.json").read_text())
        keys = [*FITTED_KEYS, *(["flash_attention_tflops"] if "flash_attention_tflops" in doc else []),
                *(["fp8_matmul_tflops"] if "fp8_matmul_tflops" in doc else []),
                *(["operator_overhead_ms"] if "overhead_us" in record["params"] else [])]
        for key in keys:
            assert doc["sources"][key] == f"fitted: published_runs (rows {rows})", (name, key)
            assert FITTED_PROVENANCE.fullmatch(doc["sources"][key])
            assert "before fitting: " in doc["citations"][key] or key == "efficiency", (name, key)
        assert fitting.preset_document(doc, generation, record) == doc, "the presets are what --write writes"
        node = hardware_presets()[name]
        nominal = node.gpu_nominal_flops_per_s
        assert node.gpu_flops_per_s == pytest.approx(record["params"]["plateau"] * nominal, abs=0.05e12)
        assert node.hbm_achievable_fraction == pytest.approx(record["params"]["hbm"], abs=1e-4)


def test_fitted_presets_predict_what_the_fit_recorded():
    record = json.loads(fitting.FIT_JSON.read_text())["V100"]
    rows = fitting.fit_rows("V100", load_corpus())
    from_presets = {r.row.row_id: predict_row(r.row).error for r in rows}
    in_sample = statistics.median(abs(e) for e in from_presets.values())  # as the record's (8 rows: a mean of two)
    assert in_sample == pytest.approx(record["in_sample"]["median_abs_error"], abs=0.01)


def test_provenance_accepts_fitted_rows_and_refuses_anything_else():
    doc = hardware_presets()["dgx-a100-80g"].to_dict()
    ok = NodeSpec.from_dict(doc | {"sources": {"gpu_peak_tflops": "fitted: published_runs (rows p001-p003, p007)"}})
    assert ok.provenance("gpu_peak_tflops").startswith("fitted")
    for bad in ("fitted: a hunch", "fitted: published_runs ()", "guessed"):
        with pytest.raises(PlannerError, match="must be one of"):
            NodeSpec.from_dict(doc | {"sources": {"gpu_peak_tflops": bad}})


def test_row_ranges_compress_consecutive_ids():
    assert fitting.row_ranges(["p010", "p002", "p003", "p001", "p007"]) == "p001-p003, p007, p010"


def test_validate_reports_in_sample_beside_leave_one_source_out():
    from planner.validation import validate

    fitted = validate(source="megatron2019").summary()["fitted"]
    assert set(fitted) == set(fitting.GENERATIONS)
    for group in fitted.values():
        assert {"in_sample", "leave_one_source_out", "leave_one_source_out_by_source", "params"} <= set(group)
        assert not math.isnan(group["in_sample"]["median_abs_error"])


def test_writing_one_generation_keeps_the_other_generations_records(tmp_path):
    """`fit --gpu H100 --write` rewrites H100's presets and record and leaves A100's as they are."""
    record = json.loads(fitting.FIT_JSON.read_text())
    for name in fitting.GENERATIONS["H100"][1]:
        (tmp_path / f"{name}.json").write_text((fitting.HARDWARE_DIR / f"{name}.json").read_text())
    fit_json = tmp_path / "fit.json"
    fit_json.write_text(json.dumps({"A100": record["A100"], "H100": {"stale": True}}))
    fitting.write({"H100": record["H100"]}, hardware_dir=tmp_path, fit_json=fit_json)
    assert json.loads(fit_json.read_text()) == {"A100": record["A100"], "H100": record["H100"]}


def test_fp8_rows_fit_their_own_plateau_and_only_where_there_are_fp8_rows():
    """[Note: what is fitted] `fp8`: a large fp8 matmul's share of the fp8 datasheet peak, fitted on
    the rows with fp8 linears, so they do not move the bf16 plateau; generations without fp8 keep none."""
    from planner.cost.fp8 import fp8_speedup

    node = hardware_presets()["dgx-h100"]
    params = {"plateau": 0.6, "half_gflop": 20.0, "flash": 0.35, "hbm": 0.6, "fp8": 0.45}
    fitted = fitting.apply(node, params)
    assert fitted.fp8_matmul_flops_per_s == pytest.approx(0.45 * 1979e12)
    # The linears' fp8 speed-up is the two sustained rates' ratio, not the datasheet's 2x.
    assert fp8_speedup(fitted) == pytest.approx(0.45 * 1979 / (0.6 * 989))
    assert fp8_speedup(node.replace(fp8_matmul_flops_per_s=0.0)) == pytest.approx(1979 / 989)
    # A100 has no fp8 rate: no fp8 number, whatever the params say.
    assert not fitting.apply(hardware_presets()["dgx-a100-80g"], params).fp8_matmul_flops_per_s
    assert fitting.PRIOR["A100"]["fp8"] == fitting.PRIOR["V100"]["fp8"] == 0.0
    assert fitting.PRIOR["H100"]["fp8"] == fitting.PRIOR["H100"]["plateau"]
    h100 = fitting.fit_rows("H100", load_corpus())
    assert any(r.planned.plan.fp8_matmuls for r in h100)
    record = json.loads(fitting.FIT_JSON.read_text())["H100"]
    for name in fitting.GENERATIONS["H100"][1]:
        preset = hardware_presets()[name]
        assert preset.fp8_matmul_flops_per_s == pytest.approx(record["params"]["fp8"] * 1979e12, abs=0.05e12), name
