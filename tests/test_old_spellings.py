"""Documents and command lines written before the recompute renames still work (planner/specs/plan.py
[Note: old spellings]): plans written by `planner fit --out` before the rename
(tests/data/plans_before_recompute/) load as the same plan with only the renamed keys changed, a run
history of schema 1 opens with its rows, `--checkpoint-interval` still pins the recompute interval,
and a training checkpoint's fingerprint is the one it had."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from planner.output.report import bottleneck_label
from planner.specs.errors import PlannerError
from planner.specs.history import COLUMN_NAMES, SCHEMA_VERSION, RunHistory
from planner.specs.memory_terms import MemoryTerm, describe
from planner.specs.plan import Placement, Plan, Prediction, load_plan, parse_placement_pins
from tierwise.cli.options import new_flag_spellings

OLD = Path(__file__).parent / "data" / "plans_before_recompute"
OLD_PLANS = sorted(OLD.glob("*.json"))


def _renamed(doc: dict) -> dict:
    """An old plan document as today's writer spells it: the renamed keys, nothing else."""
    doc = json.loads(json.dumps(doc))
    doc["recompute_interval"] = doc.pop("checkpoint_interval")
    doc["placement"]["recompute_inputs"] = doc["placement"].pop("activation_checkpoints")
    terms = doc["prediction"]["memory_terms"]
    for tier, by_name in terms.items():
        terms[tier] = {{"activation_checkpoints": "recompute_inputs",
                        "checkpoint_offload_staging": "recompute_input_offload_staging"}.get(k, k): v
                       for k, v in by_name.items()}
    return doc


def test_the_fixtures_are_in_the_old_format() -> None:
    names = {p.stem for p in OLD_PLANS}
    assert {"nvme_13b", "pipelined_175b_3d", "host_7b_ci2", "small_cpu"} <= names
    for path in OLD_PLANS:
        doc = json.loads(path.read_text())
        assert "checkpoint_interval" in doc and "recompute_interval" not in doc
        assert "activation_checkpoints" in doc["placement"]


@pytest.mark.parametrize("path", OLD_PLANS, ids=[p.stem for p in OLD_PLANS])
def test_a_plan_written_before_loads_with_only_the_renamed_keys_changed(path: Path) -> None:
    old = json.loads(path.read_text())
    plan = load_plan(path)
    assert plan.recompute_interval == old["checkpoint_interval"]
    assert plan.placement.recompute_inputs == old["placement"]["activation_checkpoints"]
    assert plan.to_dict() == _renamed(old)
    # Written again and read back: the new spelling only, and the same plan.
    again = plan.to_dict()
    assert "checkpoint_interval" not in again and "activation_checkpoints" not in json.dumps(again["placement"])
    assert Plan.from_dict(again) == plan


def test_the_pipelined_and_the_nvme_plan_keep_what_they_say() -> None:
    pipelined, nvme = load_plan(OLD / "pipelined_175b_3d.json"), load_plan(OLD / "nvme_13b.json")
    assert pipelined.pipeline_parallel_degree == 32 and pipelined.recompute_interval == 0
    assert pipelined.recompute == "none"
    assert nvme.uses_nvme and nvme.placement.params == "nvme" and nvme.recompute_interval == 1
    assert nvme.prediction.memory_terms["gpu"][MemoryTerm.RECOMPUTE_INPUTS] == 17179869184
    host = load_plan(OLD / "host_7b_ci2.json")
    cpu_terms = host.prediction.memory_terms["cpu"]
    assert cpu_terms["recompute_inputs"] == 231928233984 and "activation_checkpoints" not in cpu_terms
    assert host.prediction.memory_terms["gpu"]["recompute_input_offload_staging"] == 3623878656
    assert describe("recompute_input_offload_staging") == MemoryTerm.RECOMPUTE_INPUT_OFFLOAD_STAGING.doc


def test_an_old_plan_simulates_through_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "tierwise", "simulate", str(OLD / "small_cpu.json"), "--json"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["recompute_interval"] == 0 and doc["placement"]["recompute_inputs"] == "gpu"
    assert doc["prediction"]["feasible"] is True


def test_both_spellings_of_one_key_are_refused_in_one_line() -> None:
    doc = json.loads((OLD / "small_cpu.json").read_text())
    doc["recompute_interval"] = 1
    with pytest.raises(PlannerError) as info:
        Plan.from_dict(doc)
    assert str(info.value) == "plan: give recompute_interval or its old spelling checkpoint_interval, not both"
    with pytest.raises(PlannerError, match="give recompute_inputs or its old spelling activation_checkpoints"):
        Placement.from_dict({"recompute_inputs": "cpu", "activation_checkpoints": "cpu"})


def test_old_placement_pins_and_bottlenecks_read_as_the_new_ones() -> None:
    assert parse_placement_pins("activation_checkpoints=cpu,params=nvme") == {"recompute_inputs": "cpu", "params": "nvme"}
    assert parse_placement_pins("checkpoints=cpu") == {"recompute_inputs": "cpu"}
    pred = Prediction.from_dict({"feasible": True, "bottleneck": "checkpoints (cpu)",
                                 "memory_terms": {"gpu": {"checkpoint_offload_staging": 5}, "cpu": {}, "nvme": {}}})
    assert pred.bottleneck == "recompute inputs (cpu)" and bottleneck_label(pred.bottleneck) == "PCIe (recompute inputs)"
    assert pred.memory_terms["gpu"] == {"recompute_input_offload_staging": 5}


def test_a_run_history_of_schema_1_opens_with_its_rows_under_the_new_columns(tmp_path: Path) -> None:
    store = tmp_path / "history.sqlite"
    with sqlite3.connect(store) as con:  # written by `planner run` before the rename
        con.executescript((OLD / "history_schema1.sql").read_text())
    history = RunHistory(store)
    history.append(load_plan(OLD / "nvme_13b.json"), {"measured": {"iteration_time_s": 3.0}})
    frame = history.to_frame()
    assert list(frame.columns) == ["id", *COLUMN_NAMES]
    assert list(frame["recompute_inputs_tier"]) == ["cpu", "gpu"]
    assert list(frame["recompute_interval"]) == [2, 1]
    assert list(frame["measured_iteration_time_s"]) == [40.0, 3.0]
    assert Plan.from_dict(json.loads(frame["plan_json"][0])) == load_plan(OLD / "host_7b_ci2.json")
    with sqlite3.connect(store) as con:
        assert con.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    assert list(frame["seq_len"]) == [load_plan(OLD / "host_7b_ci2.json").model.seq_len,
                                      load_plan(OLD / "nvme_13b.json").model.seq_len]
    RunHistory(store)  # opening it again changes nothing
    assert list(RunHistory(store).to_frame().columns) == ["id", *COLUMN_NAMES]


def _planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, timeout=300)


def test_the_old_flag_still_pins_the_recompute_interval_and_the_help_shows_the_new_one() -> None:
    shape = ("memory", "70B", "--batch-per-gpu", "4", "--gpus", "8", "--json")
    new = _planner(*shape, "--recompute-interval", "2")
    old = _planner(*shape, "--checkpoint-interval", "2")
    old_eq = _planner(*shape, "--checkpoint-interval=2")
    assert new.returncode == old.returncode == old_eq.returncode == 0, (new.stderr, old.stderr, old_eq.stderr)
    assert json.loads(new.stdout)["plan"]["recompute_interval"] == 2
    assert new.stdout == old.stdout == old_eq.stdout
    for verb in ("fit", "memory", "simulate"):
        help_text = _planner(verb, "--help").stdout
        assert "--recompute-interval" in help_text and "--checkpoint-interval" not in help_text, verb
    assert new_flag_spellings(["--checkpoint-interval", "1", "--", "--checkpoint-interval"]) == [
        "--recompute-interval", "1", "--", "--checkpoint-interval"]


def test_a_training_checkpoint_fingerprint_is_the_one_written_before_the_rename() -> None:
    from runtime.ckpt.manifest import fingerprint

    # Computed by runtime/ckpt/manifest.py before the rename, from these very plans.
    before = {"host_7b_ci2": "31ce05583e5d23c4984c3a923509d2a5ec3cef20c53e1586e8e2562f33727f19",
              "nvme_13b": "8a9001496d51c63e31edbbfb64b117025a7fa305cb3048e3da7810a85b95634b",
              "small_cpu": "95ad8a02ab9b607b7eaccf4717799c6a7f9382c9a2b5082446c2e3e3c0e668df"}
    for name, digest in before.items():
        assert fingerprint(load_plan(OLD / f"{name}.json"), seed=0) == digest, name
