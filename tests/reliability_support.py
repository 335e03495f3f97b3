"""Shared pieces of the reliability tests: plans on disk and `runtime.launch` runs (in-process or not)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from runtime_support import ALL_CPU, plan_doc

ROOT = Path(__file__).resolve().parents[1]
ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"}
OPTIMIZER_NVME = {**ALL_CPU, "optimizer_states": "nvme"}
SMALL_CHUNKS = {"optimizer_chunk_bytes": 16 * 1024, "num_optimizer_buffers": 3}
"""1024-element chunks: the test model's larger units span several (streamed step and checkpoint I/O)."""


def write_plan(tmp: Path, placement: dict[str, str], *, world_size: int = 1, **knobs: Any) -> Path:
    nvme = None
    if "nvme" in placement.values():
        nvme = tmp / "swap"
        nvme.mkdir(exist_ok=True)
    doc = plan_doc(world_size=world_size, placement=placement, micro_batch_per_gpu=2, nvme_path=str(nvme) if nvme else None,
                   **SMALL_CHUNKS, **knobs)
    path = tmp / f"plan-{world_size}.json"
    path.write_text(json.dumps(doc))
    return path


def launch_in_process(plan: Path, *args: str) -> tuple[int, list[float]]:
    """`runtime.launch` on one rank in this process; returns (exit code, the profile's losses)."""
    from runtime import launch

    out = plan.parent / f"profile-{os.urandom(4).hex()}.json"
    code = launch.main([str(plan), "--profile-out", str(out), *args])
    losses = json.loads(out.read_text())["losses"] if out.exists() else []
    return code, losses


def worker_env(**extra: str) -> dict[str, str]:
    # PYTHONFAULTHANDLER: a rank that dies of a signal prints its threads' Python stacks.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1", **extra}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def launch_process(plan: Path, *args: str, nproc: int = 1, torchrun: tuple[str, ...] = (),
                   env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """`runtime.launch` in fresh processes: plain python for one rank, torchrun for more (or when
    `torchrun` arguments are given)."""
    if nproc == 1 and not torchrun:
        cmd = [sys.executable, "-m", "runtime.launch", str(plan), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--standalone",
               "--nnodes", "1", *torchrun, "-m", "runtime.launch", str(plan), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env or worker_env(), capture_output=True, text=True, timeout=timeout_s)


def profile_losses(path: Path) -> list[float]:
    return json.loads(path.read_text())["losses"]


def manifest_files(checkpoint_dir: Path, step: int) -> list[dict[str, Any]]:
    """The manifest's file list of a checkpoint: equal lists mean bitwise-equal training state."""
    return json.loads((checkpoint_dir / f"step-{step:09d}" / "MANIFEST.json").read_text())["files"]


def in_small_tmpfs(mount: Path, size_bytes: int, body: str) -> subprocess.CompletedProcess[str]:
    """Run `body` (Python) in a private mount namespace with a tmpfs of `size_bytes` at `mount`."""
    script = (f"import subprocess\nsubprocess.run(['mount', '-t', 'tmpfs', '-o', 'size={size_bytes}', 'none', "
              f"{str(mount)!r}], check=True)\n" + textwrap.dedent(body))
    mount.mkdir(exist_ok=True)
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", sys.executable, "-c", script], cwd=ROOT,
                          env=worker_env(), capture_output=True, text=True, timeout=300)
