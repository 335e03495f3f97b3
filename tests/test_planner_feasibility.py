"""The plan only describes; planner/cost/feasibility.py judges it, wherever a plan enters: a plan file
(`planner simulate`, `planner run`, `planner compare`), the user's pins, a profile's plan
(`planner calibrate`), a corpus row and the runtime's plan reader refuse it with the same one line."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from planner.cost.feasibility import check_plan
from planner.search.pins import apply_pins
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.plan import STRATEGY_TABLE, Plan, load_plan
from tierwise.cli import calibrate, compare, run, simulate

H100, V100 = resolve_hardware("dgx-h100"), resolve_hardware("dgx2-v100")
MODEL = resolve_model("llama-3-8b").replace(seq_len=8192)
FP8_ON_V100 = ("fp8_matmuls: hardware 'dgx2-v100' has no fp8 matmul rate in the planner (known: dgx-h100, h200-x1, "
               "hgx-h200); use fp8_matmuls false")
CP_EAGER = ("context_parallel_degree 2 runs ring attention on a fused kernel; attention eager cannot: use attention "
            "flash on a GPU that has it")

app = typer.Typer()
for command in (simulate, run, compare, calibrate):
    command.register(app)
runner = CliRunner()


def _plan(**changes) -> Plan:
    fields = dict(model=MODEL, node=H100, num_gpus=8, strategy="zero3", placement=STRATEGY_TABLE["zero3"].placement,
                  micro_batch_per_gpu=0.5, context_parallel_degree=2)
    return Plan(**{**fields, **changes})


def test_a_plan_describes_and_check_plan_judges():
    fp8, eager = _plan(node=V100, context_parallel_degree=1, micro_batch_per_gpu=1, fp8_matmuls=True), _plan(attention="eager")
    # Both are well-formed documents: they load and save without a cost model.
    assert Plan.from_dict(fp8.to_dict()) == fp8 and Plan.from_dict(eager.to_dict()) == eager
    for plan, message in ((fp8, FP8_ON_V100), (eager, CP_EAGER)):
        with pytest.raises(PlannerError) as err:
            check_plan(plan)
        assert str(err.value) == message
    good = _plan()
    assert check_plan(good) is good


def test_every_cli_reader_refuses_with_the_same_line(tmp_path):
    path = tmp_path / "plan.json"
    _plan(attention="eager").save(path)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({
        "schema": "tierwise.profile/1", "measured": {"feasible": True, "iteration_time_s": 1.0}, "losses": [1.0],
        "samples": [{"step": 1, "step_time_s": 1.0, "loss": 1.0, "phase_time_s": {}, "link_bytes": {},
                     "peak_bytes": {}}], "plan": load_plan(path).to_dict()}))
    for args in (["simulate", str(path)], ["run", str(path), "--no-history"], ["compare", str(path), str(profile)],
                 ["calibrate", str(profile)]):
        result = runner.invoke(app, args)
        assert result.exit_code == 1 and result.output.strip() == f"error: {CP_EAGER}", (args, result.output)


def test_pins_are_checked_as_the_plan_they_make():
    plan = _plan()
    assert apply_pins(plan, model_parallel=4).model_parallel_degree == 4
    with pytest.raises(PlannerError, match="replicas of .* = 16 GPUs do not divide num_gpus 8"):
        apply_pins(plan, model_parallel=8)


def test_the_runtime_plan_reader_refuses_the_same_line(tmp_path):
    from runtime.plan_io import resolve_plan

    doc = _plan(attention="eager").to_dict()
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(doc))
    for given in (doc, path, str(path), Plan.from_dict(doc)):
        with pytest.raises(PlannerError) as err:
            resolve_plan(given)
        assert str(err.value) == CP_EAGER
