"""`planner run` meets the machine: --nvme-path, the missing runtime extra, plan vs machine (tierwise/cli/machine.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from planner.search.search import predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.plan import STRATEGY_TABLE, Plan
from planner.specs.tiers import NVME
from planner.specs.units import GIB
from tierwise.cli import app, machine
from tierwise.cli.run import with_swap_directory

ROOT = Path(__file__).resolve().parents[1]


def _plan(hardware: str = "dgx-h100", num_gpus: int = 8, strategy: str = "zero3", model: str = "paper-1.4b",
          **knobs) -> Plan:
    return predict(Plan(model=resolve_model(model), node=resolve_hardware(hardware), num_gpus=num_gpus,
                        strategy=strategy, placement=STRATEGY_TABLE[strategy].placement, **knobs))


def _planner(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, cwd=ROOT, timeout=300)


def test_nvme_path_overrides_the_plan_and_is_created_when_its_parent_exists(tmp_path):
    plan = _plan(strategy="zero-inf-nvme", nvme_path="/somewhere/else")
    swap = tmp_path / "swap"
    out = with_swap_directory(plan, swap)
    assert out.nvme_path == str(swap) and swap.is_dir()


def test_nvme_path_whose_parent_is_missing_is_one_line_naming_it(tmp_path):
    path = tmp_path / "plan.json"
    _plan(strategy="zero-inf-nvme").save(path)
    missing = tmp_path / "no" / "swap"
    out = _planner("run", str(path), "--nvme-path", str(missing), "--no-history")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1 and f"its parent {missing.parent} is not an existing directory" in out.stderr
    assert not missing.parent.exists()


def test_nvme_plan_without_a_path_swaps_to_the_cache_folder_or_says_it_lacks_room(tmp_path, monkeypatch):
    from planner.cost import swap

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    plan = _plan(strategy="zero-inf-nvme")
    ran = with_swap_directory(plan, None)
    assert ran.nvme_path == str(tmp_path / "cache" / "tierwise-swap") and Path(ran.nvme_path).is_dir()
    assert with_swap_directory(_plan(strategy="zero3"), None).nvme_path is None  # nothing on NVMe, no folder
    monkeypatch.setattr(swap.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    from planner.cost.memory import memory_bill

    needed = memory_bill(ran).peak_bytes[NVME]
    assert swap.swap_space_problem(ran) == (
        f"the swap directory {ran.nvme_path} has 1,000 bytes free but the plan puts {needed:,} bytes on NVMe; free "
        "space there or pass --nvme-path DIR (a directory with room, on an NVMe drive)")


@pytest.mark.parametrize("verb", ["run", "probe"])
def test_missing_torch_names_the_extra(monkeypatch, tmp_path, verb):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    path = tmp_path / "plan.json"
    _plan(hardware="cpu-dev-2core", num_gpus=1, strategy="zero-inf-cpu").save(path)
    args = ["run", str(path), "--no-history"] if verb == "run" else ["probe"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1
    # run prints the one line itself; probe's PlannerError is printed by `main` (tierwise.cli) as one line
    message = result.output.strip() or " ".join(str(result.exception).split())
    assert message.count("\n") == 0 and f"planner {verb} needs the runtime extra (torch not installed)" in message
    assert "pip install torch==" in message and "pip install 'tierwise[runtime]'" in message


def test_a_gpu_plan_on_a_cpu_only_machine_is_refused_with_the_real_cause():
    cpu_only = machine.Machine(cuda_devices=0, host_memory_bytes=24 * GIB)
    with pytest.raises(PlannerError, match="this machine has no CUDA device; .* the plan is for dgx-h100 \\(8 GPU") as err:
        machine.check(_plan(model="gpt3-13b"), cpu_only, nproc=8)
    assert "offload less" not in str(err.value) and "planner fit --hardware local" in str(err.value)


def test_plan_vs_machine_warnings():
    big_host = 4096 * GIB
    assert machine.check(_plan(), machine.Machine(8, big_host), 8) is None
    warning = machine.check(_plan(), machine.Machine(0, big_host), 8)  # fits in host memory: runs, warned
    assert warning.startswith("warning: this machine has no CUDA device; the plan is for dgx-h100")
    assert "4 CUDA device(s) for 8 process(es)" in machine.check(_plan(), machine.Machine(4, big_host), 8)
    assert "GiB of host memory" in machine.check(_plan(), machine.Machine(8, 64 * GIB), 8)
    cpu_plan = _plan(hardware="cpu-dev-2core", num_gpus=1, strategy="zero-inf-cpu")
    assert machine.check(cpu_plan, machine.Machine(0, big_host), 1) is None


def test_run_cli_refuses_an_8_gpu_plan_here_before_any_worker(tmp_path):
    if machine.this_machine().cuda_devices:
        pytest.skip("this machine has CUDA devices")
    path = tmp_path / "plan.json"
    _plan(model="gpt3-13b").save(path)
    out = _planner("run", str(path), "--no-history")
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert "error: this machine has no CUDA device" in out.stderr and "offload less" not in out.stderr
    assert json.loads(path.read_text())["hardware"]["name"] == "dgx-h100"


@pytest.mark.slow
def test_run_with_nvme_path_trains_with_the_created_directory(tmp_path):
    from runtime_support import ALL_CPU, plan_doc

    doc = plan_doc(placement={**ALL_CPU, "params": "nvme", "optimizer_states": "nvme"})  # no nvme_path
    doc["model"]["vocab_size"] = 0
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(doc))
    swap, profile = tmp_path / "swap", tmp_path / "profile.json"
    out = _planner("run", str(plan), "--steps", "2", "--nvme-path", str(swap), "--no-history",
                   "--profile-out", str(profile))
    assert out.returncode == 0, out.stderr[-2000:]
    assert swap.is_dir()
    assert json.loads(profile.read_text())["plan"]["nvme_path"] == str(swap)  # the workers ran the plan as given
    assert "nvme_path" not in json.loads(plan.read_text())  # the user's plan file is left as it was


def test_fit_says_where_an_nvme_plan_without_a_path_will_swap(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "tierwise", "fit", "13b", "--gpus", "1", "--placement",
                           "params=nvme,optimizer_states=nvme", "--out", str(tmp_path / "plan.json"), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert (f"note: the plan puts states on NVMe and names no --nvme-path: planner run and runtime.shard swap to "
            f"{tmp_path / 'cache' / 'tierwise-swap'} (pass --nvme-path DIR for a directory on an NVMe drive)"
            in done.stderr)
    assert json.loads(done.stdout)["nvme_path"] is None  # the plan itself stays portable
