"""Training checkpoints: sharded per rank, atomic, verified, resumable bit for bit.

(Not to be confused with `runtime/units/recompute.py`: *activation* checkpoints and their recompute.)

    ckpt = Checkpointer(root, plan=plan, seed=seed, rank=rank, world_size=world_size, keep=2)
    start = ckpt.restore(state, optimizer)          # collective; the scalars of the newest complete one, or None
    ...
    ckpt.save(step, state, optimizer, scalars={...})  # collective; every rank writes its own files

Layout and completeness: runtime/ckpt/manifest.py ([Note: checkpoint completeness]); durability:
runtime/ckpt/files.py ([Note: atomic checkpoint files]); what a rank saves: runtime/ckpt/rank_state.py
(safetensors files: runtime/ckpt/safetensors_io.py); a checkpoint as a Hugging Face folder
(`planner export`): runtime/ckpt/export.py, from the layout runtime/ckpt/model_layout.py records.
The checkpoint directory must be one shared directory for all ranks of a multi-node run.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runtime.ckpt.errors import CheckpointError, CheckpointMismatch
from runtime.ckpt.files import fsync_dir
from runtime.ckpt.manifest import (
    Manifest,
    check_same_run,
    checkpoint_steps,
    fingerprint,
    newest_complete,
    partial_dir,
    prune,
    publish,
    read_manifest,
    step_dir,
)
from runtime.faults import fault_point

__all__ = ["CheckpointError", "CheckpointMismatch", "Checkpointer", "check_checkpoint_dir"]


def check_checkpoint_dir(path: str | os.PathLike[str]) -> Path:
    """The checkpoint directory (created if missing, inside an existing parent), or a one-line CheckpointError."""
    text = os.fspath(path)
    if not text or "\0" in text:
        raise CheckpointError(f"--checkpoint-dir {text!r} is not a usable path")
    root = Path(text).expanduser().resolve()
    if not root.parent.is_dir():  # a typo should not grow a tree of directories
        raise CheckpointError(f"--checkpoint-dir {root}: its parent {root.parent} is not an existing directory")
    try:
        root.mkdir(exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create --checkpoint-dir {root}: {exc.strerror or exc}") from None
    if not root.is_dir():
        raise CheckpointError(f"--checkpoint-dir {root} is not a directory")
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"--checkpoint-dir {root} is not writable by this user")
    return root


def _run_id(directory: Path) -> str | None:
    try:
        return read_manifest(directory).run_id
    except CheckpointError:
        return None


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """Saves and restores the checkpoints of one run under `root` (one object per rank)."""

    def __init__(self, root: str | os.PathLike[str], *, plan: Any, seed: int, rank: int, world_size: int,
                 resume: bool, keep: int = 2, warn: Callable[[str], None] = _warn,
                 restarted: bool = False, run_id: str = "") -> None:
        """`resume`: the user asked to continue from the checkpoints there. `restarted`: torchrun
        restarted this worker (`run_id` is its invocation); it continues from its own checkpoints only."""
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1 checkpoint, got {keep}")
        self.root = check_checkpoint_dir(root)
        self.fingerprint = fingerprint(plan, seed=seed)
        self.rank, self.world_size, self.keep, self.warn = rank, world_size, keep, warn
        self.run_id = run_id
        steps = checkpoint_steps(self.root)
        if steps and not resume and restarted:
            # A restart resumes what this invocation wrote, never checkpoints its first attempt refused.
            steps = [s for s in steps if _run_id(step_dir(self.root, s)) != run_id]
        if steps and not resume:
            # Starting over would interleave two runs' checkpoints, and pruning would delete the old ones.
            raise CheckpointError(f"--checkpoint-dir {self.root} already holds checkpoints (newest: step {steps[0]}); "
                                  "pass --resume to continue from them, or choose an empty directory")
        for step in steps:  # refuse another run's checkpoints before training, not when resuming
            try:
                manifest = read_manifest(step_dir(self.root, step))
            except CheckpointError:
                continue  # incomplete or corrupt: skipped with a warning by restore
            check_same_run(manifest, step_dir(self.root, step), world_size=world_size, fingerprint_=self.fingerprint)

    # -- collectives (no-ops on one rank) ---------------------------------------------------------
    def _barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def _all_gather(self, value: Any) -> list[Any]:
        if self.world_size == 1:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def _broadcast(self, value: Any) -> Any:
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -- save / restore ---------------------------------------------------------------------------
    def save(self, step: int, state: Any, optimizer: Any, *, scalars: dict[str, Any]) -> Path:
        """Write the checkpoint of `step` (after its optimizer step); every rank must call it."""
        from runtime.ckpt.rank_state import save_rank

        partial = partial_dir(self.root, step)
        prepared = [True]
        if self.rank == 0:
            # A crash during an earlier attempt at this step left a partial directory: start afresh.
            shutil.rmtree(partial, ignore_errors=True)
            try:
                partial.mkdir()
                fsync_dir(self.root)
            except OSError as exc:
                prepared = [f"cannot create {partial}: {exc.strerror or exc}"]
        self._barrier()
        prepared = self._broadcast(prepared)  # every rank stops alike instead of waiting on a dead rank 0
        try:
            if prepared != [True]:
                raise CheckpointError(prepared[0])
            result: Any = save_rank(partial, rank=self.rank, step=step, state=state, optimizer=optimizer,
                                    scalars=scalars)
        except CheckpointError as exc:
            result = str(exc)
        results = self._all_gather(result)
        errors = [r for r in results if isinstance(r, str)]
        if errors:  # every rank stops with the same line; earlier checkpoints are untouched
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise CheckpointError(errors[0])
        fault_point("checkpoint.manifest", step=step, rank=self.rank)
        final = step_dir(self.root, step)
        if self.rank == 0:
            files = tuple(d for digests in results for d in digests)
            publish(self.root, step, Manifest(step=step, world_size=self.world_size, fingerprint=self.fingerprint,
                                              files=files, run_id=self.run_id))
            prune(self.root, self.keep)
        self._barrier()  # nobody trains on (and may crash) before the checkpoint is complete
        return final

    def preflight(self, state: Any, optimizer: Any) -> None:
        """Refuse before training when the directory cannot hold the checkpoints this run keeps, plus the
        one being written (`keep + 1` of them, less those already there), for every rank."""
        from runtime.ckpt.rank_state import rank_bytes

        existing = min(self.keep, len(checkpoint_steps(self.root)))
        size = rank_bytes(state, optimizer) * self.world_size
        needed = (self.keep + 1 - existing) * size
        stat = os.statvfs(self.root)
        free = stat.f_bavail * stat.f_frsize
        if needed > free and stat.f_blocks:
            raise CheckpointError(f"--checkpoint-dir {self.root} has {free / 2**20:.1f} MiB free but {self.keep + 1 - existing} "
                                  f"more checkpoint(s) of {size / 2**20:.1f} MiB need {needed / 2**20:.1f} MiB; free "
                                  "space, lower --keep-checkpoints or choose another directory")

    def restore(self, state: Any, optimizer: Any) -> dict[str, Any] | None:
        """Load the newest complete checkpoint into `state` and `optimizer` (skipping incomplete or
        corrupt ones with a warning); returns its scalars, or None when there is none."""
        from runtime.ckpt.rank_state import load_rank

        step = None
        if self.rank == 0:
            manifest = newest_complete(self.root, world_size=self.world_size, fingerprint_=self.fingerprint,
                                       warn=self.warn)
            step = manifest.step if manifest is not None else None
        step = self._broadcast(step)
        if step is None:
            return None
        return load_rank(step_dir(self.root, step), rank=self.rank, step=step, state=state, optimizer=optimizer)
