"""Resource guards: a run that cannot fit is refused with one line before any unit is built, never
killed halfway. Limits are lowered for real (RLIMIT_AS in a child, size-limited tmpfs mounts in a
user namespace), not faked.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

from reliability_support import ALL_NVME, ROOT, in_small_tmpfs, worker_env, write_plan
from runtime_support import ALL_CPU

from planner.cost.memory import memory_bill
from planner.specs.plan import load_plan
from planner.specs.units import GIB
from runtime.plan_io import cgroup_headroom_bytes


def big_plan(tmp_path: Path, layers: int, hidden: int) -> Path:
    path = write_plan(tmp_path, ALL_CPU)
    doc = json.loads(path.read_text())
    doc["model"].update(num_layers=layers, hidden_size=hidden, num_heads=16)
    path.write_text(json.dumps(doc))
    return path


def launch_with_rlimit_as(plan: Path, limit_bytes: int) -> subprocess.CompletedProcess[str]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

    return subprocess.run([sys.executable, "-m", "runtime.launch", str(plan), "--steps", "1"], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=120, preexec_fn=lower)


def host_need_gib(plan: Path) -> float:
    peak = memory_bill(load_plan(plan)).peak_bytes
    return (peak["cpu"] + peak["gpu"]) / GIB  # a CPU machine: the `gpu` tier is host memory too


def test_rlimit_as_below_the_plans_host_memory_is_refused_before_training(tmp_path: Path) -> None:
    plan = big_plan(tmp_path, layers=4, hidden=2048)  # ~200 M params: several GiB of host memory
    need = host_need_gib(plan)
    assert need > 3
    done = launch_with_rlimit_as(plan, 3 * GIB)
    assert done.returncode == 3, done.stderr[-2000:]
    line = done.stdout.strip()
    assert line.startswith(f"TIERWISE_ERROR the plan needs {need:.2f} GiB of host memory on this node but "
                           "RLIMIT_AS (3.00 GiB per process) allows ")
    assert line.endswith(" GiB; offload less, add nodes or shrink the model")


def test_a_plan_larger_than_the_machine_is_refused_before_training(tmp_path: Path) -> None:
    plan = big_plan(tmp_path, layers=16, hidden=8192)  # ~13 B params: hundreds of GiB
    done = subprocess.run([sys.executable, "-m", "runtime.launch", str(plan), "--steps", "1"], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert f"the plan needs {host_need_gib(plan):.2f} GiB of host memory" in done.stdout
    assert "but the memory available on this node allows" in done.stdout


def test_cgroup_limits_are_read_for_v2_and_v1(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1073741824\n")
    (v2 / "memory.current").write_text("73741824\n")
    assert cgroup_headroom_bytes(v2) == 1_000_000_000
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_headroom_bytes(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    assert cgroup_headroom_bytes(tmp_path / "v1") is None
    (v1 / "memory.limit_in_bytes").write_text("2048\n")
    assert cgroup_headroom_bytes(tmp_path / "v1") == 2043
    assert cgroup_headroom_bytes(tmp_path / "none") is None


def test_a_checkpoint_dir_too_small_for_the_kept_checkpoints_is_refused_before_training(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, ALL_CPU)
    mount = tmp_path / "small"
    done = in_small_tmpfs(mount, 2 << 20, f"""
        from runtime import launch
        code = launch.main([{str(plan)!r}, "--steps", "2", "--save-every", "1", "--checkpoint-dir", {str(mount)!r}])
        print("RESULT", code)
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "RESULT 4" in lines
    assert not any(line.startswith('TIERWISE_EVENT {"step"') for line in lines)  # no step ran
    (error,) = [line for line in lines if line.startswith("TIERWISE_ERROR")]
    assert error.startswith(f"TIERWISE_ERROR rank 0: --checkpoint-dir {mount} has 2.0 MiB free but 3 more checkpoint(s) "
                            "of 1.3 MiB need 4.0 MiB; free space, lower --keep-checkpoints or choose another directory")


def test_an_nvme_path_too_small_for_the_swap_files_is_refused_before_training(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, ALL_NVME)
    mount = tmp_path / "small"
    doc = json.loads(plan.read_text())
    doc["nvme_path"] = str(mount)
    plan.write_text(json.dumps(doc))
    done = in_small_tmpfs(mount, 256 << 10, f"""
        import os
        from runtime import launch
        code = launch.main([{str(plan)!r}, "--steps", "2"])
        print("RESULT", code, os.listdir({str(mount)!r}))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "RESULT 4 []" in lines
    assert not any(line.startswith('TIERWISE_EVENT {"step"') for line in lines)  # no step ran
    (error,) = [line for line in lines if line.startswith("TIERWISE_ERROR")]
    assert error.startswith(f"TIERWISE_ERROR rank 0: nvme_path {mount} has 256.00 KiB free but the swap files need ")
    assert error.endswith("; free space there or choose another nvme_path")
