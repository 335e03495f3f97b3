"""Real faults: ranks SIGKILLed mid-step and mid-checkpoint, a filesystem that fills up, an I/O
error from the NVMe engine, swap directories left by crashed runs. Nothing is mocked: the kills are
SIGKILLs at named points (runtime/faults.py), the full disk is a size-limited tmpfs (mounted in a
user namespace) or RLIMIT_FSIZE, the I/O error comes from the kernel (/dev/full under the swap file's
descriptors). In every case the run either continues bit for bit or stops with one line, and the
last complete checkpoint stays valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_support import (
    ALL_NVME,
    ROOT,
    in_small_tmpfs,
    launch_process,
    manifest_files,
    profile_losses,
    worker_env,
    write_plan,
)
from runtime_support import ALL_CPU, batches, build_model, plan_doc

from runtime.ckpt.manifest import fingerprint, verify


@pytest.mark.slow
@pytest.mark.parametrize("placement", [ALL_CPU, ALL_NVME], ids=["cpu", "nvme"])
def test_a_rank_killed_mid_step_is_restarted_by_torchrun_and_resumes_bitwise(tmp_path: Path,
                                                                           placement: dict[str, str]) -> None:
    plan = write_plan(tmp_path, placement, world_size=2)
    common = ("--steps", "6", "--save-every", "2")
    ref = launch_process(plan, *common, "--checkpoint-dir", str(tmp_path / "ref"), "--profile-out",
                         str(tmp_path / "ref.json"), nproc=2)
    assert ref.returncode == 0, ref.stderr[-2000:]
    markers = tmp_path / "markers"
    markers.mkdir()
    env = worker_env(TIERWISE_FAULT="train.step@5:1", TIERWISE_FAULT_ONCE=str(markers))
    run = launch_process(plan, *common, "--checkpoint-dir", str(tmp_path / "ck"), "--profile-out",
                         str(tmp_path / "run.json"), nproc=2, torchrun=("--max-restarts", "1"), env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert [p.name for p in markers.iterdir()] == ["train.step@5:1"]  # the kill happened
    assert "Signals.SIGKILL" in run.stderr or "exitcode: -9" in run.stderr
    assert 'TIERWISE_EVENT {"resumed_from_step": 4}' in run.stdout
    assert profile_losses(tmp_path / "run.json") == profile_losses(tmp_path / "ref.json")[4:]
    assert manifest_files(tmp_path / "ck", 6) == manifest_files(tmp_path / "ref", 6)
    if placement is ALL_NVME:
        assert list((tmp_path / "swap").iterdir()) == []  # the killed ranks' swap dirs were cleaned


@pytest.mark.parametrize(("point", "placement"), [("checkpoint.rank_file", ALL_NVME), ("checkpoint.manifest", ALL_CPU)],
                         ids=["mid-file-nvme", "before-manifest-cpu"])
def test_a_kill_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path: Path, point: str,
                                                                        placement: dict[str, str]) -> None:
    plan = write_plan(tmp_path, placement)
    args = ("--steps", "5", "--save-every", "2")
    # Every run in its own process with the same thread count (the float sums of a matmul depend on it).
    ref = launch_process(plan, *args, "--checkpoint-dir", str(tmp_path / "ref"), "--profile-out", str(tmp_path / "ref.json"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    ck = tmp_path / "ck"
    killed = launch_process(plan, *args, "--checkpoint-dir", str(ck), env=worker_env(TIERWISE_FAULT=f"{point}@4"))
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in ck.iterdir()) == [".step-000000004.partial", "step-000000002"]
    from planner.specs.plan import Plan

    verify(ck / "step-000000002", world_size=1, fingerprint_=fingerprint(Plan.from_dict(json.loads(plan.read_text())),
                                                                          seed=0))
    if placement is ALL_NVME:
        (stale,) = (tmp_path / "swap").iterdir()  # the SIGKILLed run could not remove its swap files
        assert stale.name.startswith("tierwise-swap-r0-")
    resumed = launch_process(plan, *args, "--checkpoint-dir", str(ck), "--resume", "--profile-out",
                             str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert profile_losses(tmp_path / "resumed.json") == profile_losses(tmp_path / "ref.json")[2:]
    assert manifest_files(ck, 5) == manifest_files(tmp_path / "ref", 5)
    assert sorted(p.name for p in ck.iterdir()) == ["step-000000004", "step-000000005"]
    if placement is ALL_NVME:
        assert f"removed stale swap directory {stale}" in resumed.stderr
        assert list((tmp_path / "swap").iterdir()) == []


def test_the_nvme_path_filling_up_stops_with_one_line_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    """Swap files and checkpoints share a small tmpfs. At step 3 the filesystem is filled (a real
    full disk: runtime/faults.py writes a file until ENOSPC). Training goes on (the swap files were
    preallocated, so a full disk cannot hit them); the step-4 checkpoint hits ENOSPC and stops the
    run with one line; the step-2 checkpoint stays valid and nothing half-written is left."""
    plan = write_plan(tmp_path, ALL_NVME)
    ref = launch_process(plan, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ref"),
                         "--profile-out", str(tmp_path / "ref.json"))
    assert ref.returncode == 0, ref.stderr[-2000:]
    mount = tmp_path / "small"
    doc = json.loads(plan.read_text())
    doc["nvme_path"] = str(mount)
    small_plan = tmp_path / "small-plan.json"
    small_plan.write_text(json.dumps(doc))
    done = in_small_tmpfs(mount, 16 << 20, f"""
        import json, os
        os.environ["TIERWISE_FAULT"] = "train.step@3=fill:{mount}"
        from runtime import launch
        code = launch.main([{str(small_plan)!r}, "--steps", "4", "--save-every", "2",
                            "--checkpoint-dir", {str(mount / "ck")!r}])
        from planner.specs.plan import load_plan
        from runtime.ckpt.manifest import fingerprint, verify
        verify({str(mount / "ck" / "step-000000002")!r}, world_size=1,
               fingerprint_=fingerprint(load_plan({str(small_plan)!r}), seed=0))
        print("RESULT", json.dumps({{"code": code, "ck": sorted(os.listdir({str(mount / "ck")!r})),
                                    "mount": sorted(os.listdir({str(mount)!r}))}}))
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    result = json.loads(next(line for line in lines if line.startswith("RESULT"))[len("RESULT "):])
    assert result["code"] == 4 and result["ck"] == ["step-000000002"]
    assert [name.split("-")[:2] for name in result["mount"]] == [["ck"], ["tierwise", "fill"]]  # swap dir removed
    events = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("TIERWISE_EVENT")]
    events = [e for e in events if "loss" in e]  # the steps (the others say a stage: runtime/launch.py `stage`)
    assert [e["loss"] for e in events] == profile_losses(tmp_path / "ref.json")  # all 4 steps, on a full disk
    (error,) = [line for line in lines if line.startswith("TIERWISE_ERROR")]
    assert error == (f"TIERWISE_ERROR rank 0: cannot write checkpoint file {mount / 'ck' / '.step-000000004.partial'}"
                     "/rank-00000.safetensors: No space left on device; free space or choose another --checkpoint-dir "
                     "(earlier checkpoints are intact)")


def test_a_file_size_limit_during_a_checkpoint_is_one_line_through_the_cli(tmp_path: Path) -> None:
    """RLIMIT_FSIZE (EFBIG) in the workers: `planner run` prints one line and exits 1."""
    plan = write_plan(tmp_path, ALL_CPU)
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (300_000, 300_000)); "
            "from tierwise.cli import main; sys.argv[0] = 'planner'; main()")
    done = subprocess.run([sys.executable, "-c", code, "run", str(plan), "--steps", "2", "--save-every", "1",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--no-history", "--max-restarts", "0"],
                          cwd=ROOT, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: the run stopped: rank 0: cannot write checkpoint file ")
    assert last.endswith("rank-00000.safetensors: File too large; free space or choose another --checkpoint-dir "
                         "(earlier checkpoints are intact)")
    assert list((tmp_path / "ck").iterdir()) == []


def test_an_io_error_from_the_engine_names_the_swap_file(tmp_path: Path) -> None:
    """The params swap file's descriptors are pointed at /dev/full: the kernel fails the next write
    with ENOSPC, the engine raises it with the file, offset and size, and the launcher makes it one line."""
    import runtime
    from runtime.launch import describe_io_error
    from runtime.sharding import state_of

    plan = plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path))
    model = runtime.shard(build_model("gpt"), plan)
    opt = runtime.AdamW(model, lr=1e-3)
    params = state_of(model).param_store.file
    full = os.open("/dev/full", os.O_RDWR)
    os.dup2(full, params.file.direct_fd)
    os.dup2(full, params.file.buffered_fd)
    os.close(full)
    tokens = batches(1)[0]
    with pytest.raises(OSError) as caught:
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        state_of(model).wait_io()  # the overlapped step's updates write on the optimizer worker
    error = caught.value
    assert (error.errno, error.filename) == (28, str(params.path))
    line = describe_io_error(error)
    assert line.startswith(f"I/O error on {params.path}: No space left on device (write of ")
    assert line.endswith("; free space there; checkpoints already written are intact")
    assert "\n" not in line
    opt.close()
    with contextlib.suppress(OSError):  # other writes in flight failed too
        state_of(model).close()
    assert list(tmp_path.iterdir()) == []  # the swap directory is removed all the same


def test_stale_swap_directories_of_a_killed_process_are_removed_by_the_next_run(tmp_path: Path) -> None:
    code = (f"import os, signal; from runtime.nvme import SwapDirectory; d = SwapDirectory({str(tmp_path)!r}); "
            "d.create_file('params', 1 << 20); os.kill(os.getpid(), signal.SIGKILL)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=worker_env())
    assert done.returncode == -signal.SIGKILL
    (stale,) = tmp_path.iterdir()
    import runtime
    from runtime.nvme import find_stale_swap_dirs
    from runtime.sharding import state_of

    assert [s.path for s in find_stale_swap_dirs(tmp_path)] == [stale]
    with pytest.warns(UserWarning, match=rf"removed stale swap directory {stale} \(1052672 bytes\) of a crashed run"):
        model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path)))
    (live,) = tmp_path.iterdir()
    assert live != stale and find_stale_swap_dirs(tmp_path) == []
    state_of(model).close()
