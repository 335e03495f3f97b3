"""`planner simulate` (tierwise/cli/simulate.py, planner/search/pins.py) and the hardware efficiency-curve spec it reads."""

import json

import pytest
import typer
from typer.testing import CliRunner

from planner.search.pins import apply_pins
from planner.specs.catalog import hardware_presets, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.hardware import EfficiencyCurve, NodeSpec
from planner.specs.plan import Placement, Plan
from tierwise.cli.simulate import register

app = typer.Typer()
register(app)
app.command("noop")(lambda: None)  # keep typer in multi-command mode, as in `planner`
runner = CliRunner()


@pytest.fixture
def plan_file(tmp_path):
    model = resolve_model("paper-1.4b")
    plan = Plan(model=model, node=hardware_presets()["dgx2-v100"], num_gpus=16, strategy="zero-inf-cpu",
                placement=Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu"))
    path = tmp_path / "plan.json"
    plan.save(path)
    return path


def test_simulate_json_carries_a_simulated_prediction(plan_file):
    result = runner.invoke(app, ["simulate", str(plan_file), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    p = doc["prediction"]
    assert p["method"] == "simulated" and p["feasible"] is True
    assert p["iteration_time_s"] == pytest.approx(sum(p["phase_time_s"].values()))
    assert set(p["link_bytes"]) == {"nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter"}
    assert {"gpu_compute", "h2d", "host_memory", "cpu_optimizer"} <= set(p["details"]["resources"])
    assert set(p["details"]["memory_timeline"]) == {"gpu", "cpu", "nvme"}
    Plan.from_dict(doc)  # the output is a valid plan document


def test_simulate_pins_override_the_plan(plan_file, tmp_path):
    args = ["simulate", str(plan_file), "--json", "--placement", "params=nvme,optimizer=nvme", "--batch-per-gpu", "2",
            "--recompute-interval", "2", "--tiling-factor", "2", "--prefetch-depth", "1", "--model-parallel", "2",
            "--max-alloc-gib", "1.5"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert doc["placement"]["params"] == "nvme" and doc["placement"]["optimizer_states"] == "nvme"
    assert doc["strategy"] == "custom"
    assert (doc["micro_batch_per_gpu"], doc["recompute_interval"], doc["tiling_factor"], doc["prefetch_depth"],
            doc["model_parallel_degree"]) == (2, 2, 2, 1, 2)
    assert doc["hardware"]["gpu_max_alloc_gib"] == 1.5
    assert doc["prediction"]["details"]["tensor_parallel_bytes"] > 0


def test_simulate_writes_a_timeline_png(plan_file, tmp_path):
    out = tmp_path / "t.png"
    result = runner.invoke(app, ["simulate", str(plan_file), "--timeline", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bottleneck" in result.output


def test_simulate_user_errors_are_one_line_exit_1(plan_file, tmp_path):
    result = runner.invoke(app, ["simulate", str(tmp_path / "missing.json")])
    assert result.exit_code == 1 and "cannot read plan file" in result.output and "Traceback" not in result.output
    result = runner.invoke(app, ["simulate", str(plan_file), "--placement", "params=tape"])
    assert result.exit_code == 1 and "--placement item" in result.output
    result = runner.invoke(app, ["simulate", str(plan_file), "--model-parallel", "3"])
    assert result.exit_code == 1 and "model_parallel_degree 3" in result.output


def test_simulate_model_parallel_is_a_number_or_auto(plan_file):
    from planner.search.search import best_model_parallel
    from planner.specs.plan import load_plan

    result = runner.invoke(app, ["simulate", str(plan_file), "--json", "--model-parallel", "auto"])
    assert result.exit_code == 0, result.output
    expected = best_model_parallel(load_plan(plan_file)).model_parallel_degree
    assert json.loads(result.output)["model_parallel_degree"] == expected
    result = runner.invoke(app, ["simulate", str(plan_file), "--model-parallel", "two"])
    assert result.exit_code == 1 and "--model-parallel must be a whole number or 'auto', got 'two'" in result.output


def test_apply_pins_rejects_bad_max_alloc(plan_file):
    from planner.specs.plan import load_plan

    with pytest.raises(PlannerError, match="--max-alloc-gib"):
        apply_pins(load_plan(plan_file), max_alloc_gib=0)


def test_tiling_shrinks_the_largest_allocation_below_the_contiguous_limit(plan_file):
    from planner.sim import simulate
    from planner.specs.plan import load_plan

    # 1.4B: the 1536 x 6144 MLP weight is 18 MiB in bf16; the largest activation 12 MiB.
    plan = apply_pins(load_plan(plan_file), max_alloc_gib=0.015)
    untiled = simulate(plan).prediction
    assert not untiled.feasible and "largest free block" in untiled.reason
    tiled = simulate(apply_pins(plan, tiling_factor=4)).prediction
    assert tiled.feasible, tiled.reason
    key = "simulated_largest_gpu_allocation_bytes"
    assert tiled.details[key] * 4 == pytest.approx(untiled.details[key], rel=1e-6)


# -- hardware spec: efficiency curves --------------------------------------------------------------
def test_efficiency_curve_interpolates_in_log_size_and_clamps():
    curve = EfficiencyCurve(((1.0, 0.25), (100.0, 0.75)))
    assert curve.at(0.5) == 0.25 and curve.at(1000) == 0.75
    assert curve.at(10.0) == pytest.approx(0.5)  # halfway in log10
    assert EfficiencyCurve().at(123.0) == 1.0


@pytest.mark.parametrize("name", sorted(hardware_presets()))
def test_presets_round_trip_with_curves(name):
    node = hardware_presets()[name]
    # Presets that cite every number (docs/hardware.md) have no curves: no public per-size curve exists for them.
    # Fitted presets (planner/validation/fit.py) have curves and cite their fitted numbers' rows.
    fitted = node.provenance("efficiency").startswith("fitted: published_runs")
    assert bool(node.transfer_efficiency.points and node.matmul_efficiency.points) == (not node.citations or fitted)
    again = NodeSpec.from_dict(json.loads(json.dumps(node.to_dict())))
    assert again == node and again.transfer_efficiency == node.transfer_efficiency


@pytest.mark.parametrize(("efficiency", "message"), [
    ({"transfer": [{"size_mib": 2, "efficiency": 0.5}, {"size_mib": 1, "efficiency": 0.9}]}, "strictly increasing"),
    ({"transfer": [{"size_mib": 1, "efficiency": 1.5}]}, "at most 1"),
    ({"matmul": [{"gflop": 1}]}, "needs both"),
    ({"disk": []}, "unknown key"),
    ({"matmul": [{"size_mib": 1, "efficiency": 0.5}]}, "unknown key"),
])
def test_bad_curves_are_user_errors(efficiency, message):
    doc = hardware_presets()["dgx2-v100"].to_dict()
    doc["efficiency"] = efficiency
    with pytest.raises(PlannerError, match=message):
        NodeSpec.from_dict(doc)


def test_nvme_read_write_mode_is_validated():
    doc = hardware_presets()["dgx2-v100"].to_dict()
    doc["nvme_read_write"] = "duplex"
    with pytest.raises(PlannerError, match="nvme_read_write"):
        NodeSpec.from_dict(doc)
