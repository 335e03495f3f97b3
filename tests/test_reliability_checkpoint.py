"""Checkpoint and resume: a run of N steps equals k steps + resume to N, bit for bit.

Every case compares the losses (as floats, exactly) and the final checkpoints' SHA-256s, which
cover every parameter shard, master weight, Adam state, step count and RNG state of the rank: equal
digests mean the resumed run ends in exactly the state of the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reliability_support import ALL_NVME, OPTIMIZER_NVME, launch_in_process, manifest_files, write_plan
from runtime_support import ALL_CPU

from runtime.ckpt import CheckpointError
from runtime.ckpt.manifest import read_manifest

CASES = [(ALL_CPU, "fp32", "after_backward"), (ALL_CPU, "bf16", "after_backward"), (ALL_NVME, "fp32", "after_backward"),
         (OPTIMIZER_NVME, "bf16", "after_backward"), (ALL_NVME, "fp32", "in_backward")]


@pytest.mark.parametrize(("placement", "precision", "optimizer_step"), CASES,
                         ids=["cpu-fp32", "cpu-bf16", "nvme-fp32", "optnvme-bf16", "nvme-fp32-in-backward"])
def test_resume_is_bitwise_an_uninterrupted_run(tmp_path: Path, placement: dict[str, str], precision: str,
                                                optimizer_step: str) -> None:
    plan = write_plan(tmp_path, placement, precision=precision, optimizer_step=optimizer_step)
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    code, full = launch_in_process(plan, "--steps", "5", "--save-every", "2", "--checkpoint-dir", str(full_dir))
    assert code == 0
    code, first = launch_in_process(plan, "--steps", "3", "--save-every", "2", "--checkpoint-dir", str(part_dir))
    assert code == 0
    code, rest = launch_in_process(plan, "--steps", "5", "--save-every", "2", "--checkpoint-dir", str(part_dir),
                                   "--resume")
    assert code == 0
    assert first + rest == full
    assert len(rest) == 2
    assert manifest_files(part_dir, 5) == manifest_files(full_dir, 5)
    # Keep the last 2: step 4 and step 5 (final) in the uninterrupted run.
    assert sorted(p.name for p in full_dir.iterdir()) == ["step-000000004", "step-000000005"]
    if "nvme" in placement.values():
        assert list((tmp_path / "swap").iterdir()) == []


def test_a_corrupt_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path, ALL_CPU)
    ref_dir, ck = tmp_path / "ref", tmp_path / "ck"
    _, full = launch_in_process(plan, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(ref_dir))
    launch_in_process(plan, "--steps", "3", "--save-every", "2", "--checkpoint-dir", str(ck))
    data = ck / "step-000000003" / "rank-00000.safetensors"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # one flipped bit
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    code, rest = launch_in_process(plan, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(ck), "--resume")
    err = capsys.readouterr().err
    assert code == 0
    assert f"warning: skipping checkpoint {ck / 'step-000000003'}: {data} does not match its SHA-256" in err
    assert rest == full[2:]
    assert manifest_files(ck, 4) == manifest_files(ref_dir, 4)


def test_resume_without_a_checkpoint_starts_at_step_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path, ALL_CPU)
    _, ref = launch_in_process(plan, "--steps", "2")
    code, losses = launch_in_process(plan, "--steps", "2", "--checkpoint-dir", str(tmp_path / "none"), "--resume")
    assert code == 0 and losses == ref
    assert "no complete checkpoint in" in capsys.readouterr().err


def test_a_checkpoint_of_another_plan_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path, ALL_CPU)
    ck = tmp_path / "ck"
    launch_in_process(plan, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(ck))
    capsys.readouterr()
    code, _ = launch_in_process(plan, "--steps", "3", "--checkpoint-dir", str(ck), "--resume", "--seed", "1")
    assert code == 3
    assert capsys.readouterr().out.strip() == (
        f"TIERWISE_ERROR {ck / 'step-000000002'} was written for another plan or seed (model, ranks, precision, "
        "placement, tiling, batch and seed must match); choose another --checkpoint-dir")
    assert sorted(p.name for p in ck.iterdir()) == ["step-000000002"]  # untouched


def test_a_fresh_run_into_a_used_checkpoint_dir_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = write_plan(tmp_path, ALL_CPU)
    ck = tmp_path / "ck"
    launch_in_process(plan, "--steps", "2", "--save-every", "1", "--checkpoint-dir", str(ck))
    capsys.readouterr()
    code, _ = launch_in_process(plan, "--steps", "3", "--save-every", "1", "--checkpoint-dir", str(ck))
    assert code == 3
    assert "already holds checkpoints (newest: step 2); pass --resume" in capsys.readouterr().out


def test_manifest_names_cannot_escape_the_checkpoint(tmp_path: Path) -> None:
    step = tmp_path / "step-000000001"
    step.mkdir()
    doc = {"format": "tierwise.checkpoint/1", "step": 1, "world_size": 1, "fingerprint": "x",
           "files": [{"name": "../../etc/passwd", "size_bytes": 1, "sha256": "0" * 64},
                     {"name": "rank-00000.json", "size_bytes": 1, "sha256": "0" * 64}]}
    (step / "MANIFEST.json").write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"is not a rank file name"):
        read_manifest(step)


def test_tensor_names_are_the_shard_keys_strings_in_string_order(tmp_path: Path) -> None:
    """Shard keys are typed (`UnitKey`, `StateKey`) but a rank file names each shard by the key's
    string, in the string order it always had, so checkpoints written before keys were typed resume."""
    from runtime.ckpt.safetensors_io import read_header_of
    from runtime.transfer.stores import StateKey, UnitKey

    assert str(UnitKey(10, "blocks.1.attn.proj")) == "10:blocks.1.attn.proj"
    assert str(StateKey("exp_avg_sq", UnitKey(0, "wte"))) == "exp_avg_sq:0:wte"
    plan = write_plan(tmp_path, OPTIMIZER_NVME, precision="bf16")
    code, _ = launch_in_process(plan, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(tmp_path / "ck"))
    assert code == 0
    names = list(read_header_of(tmp_path / "ck" / "step-000000002" / "rank-00000.safetensors").tensors)
    assert names[:3] == ["params/0:wte", "params/10:blocks.1.attn.proj", "params/11:blocks.1.ln_2"]
    states = [n for n in names if n.startswith("optimizer_states/")]
    assert states[:2] == ["optimizer_states/exp_avg:0:wte", "optimizer_states/exp_avg:10:blocks.1.attn.proj"]
    assert states[-1] == "optimizer_states/master:9:blocks.1.attn.qkv"
    assert states == sorted(states) and len(states) == 3 * 15
    assert "streamed/14:ln_f/step" in names


def test_planner_run_passes_checkpoint_options_and_restarts_to_torchrun(tmp_path: Path) -> None:
    from tierwise.cli.run import CheckpointOptions, torchrun_command

    plan = tmp_path / "plan.json"
    ck = CheckpointOptions(save_every=5, checkpoint_dir=tmp_path / "ck", keep=3, resume=True)
    cmd = torchrun_command(plan, steps=10, nproc=2, data=None, profile_out=None, torchrun_args=[], checkpoints=ck)
    i = cmd.index("--max-restarts")
    assert cmd[i + 1] == "3"
    assert cmd[cmd.index(str(plan)):] == [str(plan), "--steps", "10", "--save-every", "5", "--checkpoint-dir",
                                          str(tmp_path / "ck"), "--keep-checkpoints", "3", "--resume"]
    plain = torchrun_command(plan, steps=10, nproc=2, data=None, profile_out=None, torchrun_args=[])
    assert plain[plain.index("--max-restarts") + 1] == "0"
    own = torchrun_command(plan, steps=10, nproc=2, data=None, profile_out=None, checkpoints=ck,
                           torchrun_args=["--nnodes", "1", "--max-restarts=7"])
    assert [a for a in own if a.startswith("--max-restarts")] == ["--max-restarts=7"]


@pytest.mark.slow  # two `planner run` trainings, about 30 s on 2 cores: CI runs it (`-m slow`)
def test_planner_run_saves_and_resumes_through_the_cli(tmp_path: Path) -> None:
    import subprocess
    import sys

    from reliability_support import ROOT, profile_losses, worker_env

    plan = write_plan(tmp_path, ALL_CPU)

    def planner_run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tierwise", "run", str(plan), "--no-history", *args], cwd=ROOT,
                              env=worker_env(), capture_output=True, text=True, timeout=300)

    ck = str(tmp_path / "ck")
    first = planner_run("--steps", "2", "--save-every", "2", "--checkpoint-dir", ck, "--profile-out",
                        str(tmp_path / "a.json"))
    assert first.returncode == 0, first.stderr[-2000:]
    again = planner_run("--steps", "3", "--save-every", "2", "--checkpoint-dir", ck)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: the runtime refused the plan: --checkpoint-dir {ck} already holds checkpoints (newest: step 2); "
        "pass --resume to continue from them, or choose an empty directory")
    resumed = planner_run("--steps", "3", "--save-every", "2", "--checkpoint-dir", ck, "--resume", "--profile-out",
                          str(tmp_path / "b.json"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    doc = json.loads((tmp_path / "b.json").read_text())
    assert [s["step"] for s in doc["samples"]] == [3]
    assert len(profile_losses(tmp_path / "a.json") + doc["losses"]) == 3
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-000000002", "step-000000003"]
