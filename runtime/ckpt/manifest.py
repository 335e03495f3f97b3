"""The checkpoint directory: one `step-NNNNNNNNN/` per checkpoint, complete only with a verified manifest.

    CHECKPOINT_DIR/
      step-000000006/            a complete checkpoint: MANIFEST.json + its files, checksums match
        rank-00000.safetensors   this rank's tensors, a safetensors file (no pickle)
        rank-00000.json          its scalars (step, RNG, ...); rank 0's also the model's layout and HF config
        MANIFEST.json            written last: every file's size and SHA-256, step, world size, fingerprint
      .step-000000008.partial/   a checkpoint being written (or abandoned by a crash): never read

[Note: checkpoint completeness]
Ranks write their files into the `.partial` directory; rank 0 gathers their digests, writes the
manifest last and renames the directory to `step-N` (an atomic rename). So a `step-N` directory
without a readable manifest cannot come from this writer; and a manifest whose files do not match
their checksums (bit rot, a truncated copy, a hand edit) is skipped on resume with a warning, the
next older complete checkpoint being used instead. Torch-free, so the CLI and the fuzz tests read
manifests without starting torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.specs.plan import OLD_PLACEMENT_KEYS
from planner.specs.specio import check_keys, number, string
from runtime.ckpt.errors import CheckpointError, CheckpointMismatch
from runtime.ckpt.files import FileDigest, atomic_file, file_digest, fsync_dir

FORMAT = "tierwise.checkpoint/1"
MANIFEST = "MANIFEST.json"
STEP_DIR = re.compile(r"step-(\d{9})")
RANK_FILE = re.compile(r"rank-\d{5}\.(safetensors|bin|json)")
TENSOR_SUFFIXES = ("safetensors", "bin")
"""The rank tensor file of the current format, and of the first one (raw bytes + JSON index), still read."""
MAX_MANIFEST_BYTES = 16 << 20
MAX_STEP = 10**9 - 1


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def partial_dir(root: Path, step: int) -> Path:
    return root / f".step-{step:09d}.partial"


def rank_file(rank: int, suffix: str) -> str:
    return f"rank-{rank:05d}.{suffix}"


def fingerprint(plan: Any, *, seed: int) -> str:
    """What a checkpoint's state layout and data order depend on: resuming under another plan (model,
    ranks, precision, placement, tiling, batch) or seed would load shards into the wrong places."""
    doc = plan.to_dict()
    keys = ("model", "num_gpus", "precision", "placement", "tiling_factor", "micro_batch_per_gpu")
    picked = {k: doc[k] for k in keys}
    # Hashed under the placement's old key names ([Note: old spellings] in planner/specs/plan.py), so
    # the fingerprint, and with it every checkpoint written before the rename, stays the same.
    old_name = {new: old for old, new in OLD_PLACEMENT_KEYS.items()}
    picked["placement"] = {old_name.get(k, k): v for k, v in picked["placement"].items()}
    picked["seed"] = seed
    return hashlib.sha256(json.dumps(picked, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, kw_only=True, slots=True)
class Manifest:
    step: int
    world_size: int
    fingerprint: str
    files: tuple[FileDigest, ...]
    run_id: str = ""
    """torchrun's run id of the invocation that wrote it (a restart resumes only its own checkpoints)."""

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "world_size": self.world_size, "fingerprint": self.fingerprint,
                "run_id": self.run_id, "files": [{"name": f.name, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in self.files]}

    @classmethod
    def from_dict(cls, doc: Any, where: str = "manifest") -> Manifest:
        check_keys(doc, {"format", "step", "world_size", "fingerprint", "files", "run_id"}, where)
        for key in ("format", "step", "world_size", "fingerprint", "files"):
            if key not in doc:
                raise CheckpointError(f"{where}: missing required key {key!r}")
        if doc["format"] != FORMAT:
            raise CheckpointError(f"{where}.format must be {FORMAT!r}, got {doc['format']!r}")
        step = int(number(doc["step"], f"{where}.step", minimum=1, maximum=MAX_STEP, integer=True))
        world_size = int(number(doc["world_size"], f"{where}.world_size", minimum=1, maximum=1 << 20, integer=True))
        fp = string(doc["fingerprint"], f"{where}.fingerprint", max_len=64)
        run_id = string(doc.get("run_id", ""), f"{where}.run_id", max_len=256)
        if not isinstance(doc["files"], list) or len(doc["files"]) != 2 * world_size:
            raise CheckpointError(f"{where}.files must list 2 files per rank ({2 * world_size})")
        files = []
        for i, entry in enumerate(doc["files"]):
            at = f"{where}.files[{i}]"
            check_keys(entry, {"name", "size_bytes", "sha256"}, at)
            if set(entry) != {"name", "size_bytes", "sha256"}:
                raise CheckpointError(f"{at} needs name, size_bytes and sha256")
            name = string(entry["name"], f"{at}.name", max_len=64)
            if not RANK_FILE.fullmatch(name):  # names are joined to the directory: no paths, no traversal
                raise CheckpointError(f"{at}.name {name!r} is not a rank file name (rank-NNNNN.safetensors, .bin or .json)")
            size = int(number(entry["size_bytes"], f"{at}.size_bytes", minimum=0, maximum=1 << 60, integer=True))
            digest = string(entry["sha256"], f"{at}.sha256", max_len=64)
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise CheckpointError(f"{at}.sha256 must be 64 lowercase hex digits")
            files.append(FileDigest(name, size, digest))
        names = sorted(f.name for f in files)
        if all(names != sorted(rank_file(r, s) for r in range(world_size) for s in (tensors, "json"))
               for tensors in TENSOR_SUFFIXES):
            raise CheckpointError(f"{where}.files must be exactly the rank files of {world_size} rank(s)")
        return cls(step=step, world_size=world_size, fingerprint=fp, files=tuple(files), run_id=run_id)


def write_manifest(directory: Path, manifest: Manifest) -> None:
    with atomic_file(directory / MANIFEST) as out:
        out.write((json.dumps(manifest.to_dict(), indent=1) + "\n").encode())


def read_manifest(directory: Path) -> Manifest:
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        if path.stat().st_size > MAX_MANIFEST_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes; not a manifest")
        doc = json.loads(path.read_bytes(), parse_constant=_reject_constant)
    except OSError as exc:
        raise CheckpointError(f"no readable manifest {path} ({exc.strerror}): the checkpoint is incomplete") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON ({str(exc).splitlines()[0]})") from None
    manifest = Manifest.from_dict(doc, str(path))
    if step_dir(directory.parent, manifest.step).name != directory.name:
        raise CheckpointError(f"{path} is for step {manifest.step} but lies in {directory.name}")
    return manifest


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid in a manifest")


def check_same_run(manifest: Manifest, directory: Path, *, world_size: int, fingerprint_: str) -> None:
    """Refuse (CheckpointMismatch, never skipped) a checkpoint of another run: resuming past it would
    let the new run's checkpoints replace the other run's."""
    if manifest.world_size != world_size:
        raise CheckpointMismatch(f"{directory} was written by {manifest.world_size} rank(s), this run has {world_size}; "
                                 "resume with the same plan or choose another --checkpoint-dir")
    if manifest.fingerprint != fingerprint_:
        raise CheckpointMismatch(f"{directory} was written for another plan or seed (model, ranks, precision, "
                                 "placement, tiling, batch and seed must match); choose another --checkpoint-dir")


def verify(directory: Path, *, world_size: int, fingerprint_: str) -> Manifest:
    """The manifest of a complete checkpoint usable by this run; a one-line CheckpointError otherwise."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_same_run(manifest, directory, world_size=world_size, fingerprint_=fingerprint_)
    check_files(directory, manifest)
    return manifest


def check_files(directory: Path, manifest: Manifest) -> None:
    """Every file of the manifest has its recorded size and SHA-256; a one-line CheckpointError otherwise."""
    for expected in manifest.files:
        path = directory / expected.name
        try:
            actual = file_digest(path)
        except OSError as exc:
            raise CheckpointError(f"{path} is unreadable ({exc.strerror})") from None
        if actual.size_bytes != expected.size_bytes:
            raise CheckpointError(f"{path} has {actual.size_bytes} bytes, the manifest says {expected.size_bytes}")
        if actual.sha256 != expected.sha256:
            raise CheckpointError(f"{path} does not match its SHA-256 in the manifest (corrupt)")


def checkpoint_steps(root: Path) -> list[int]:
    """Steps of the `step-N` directories under `root`, newest first (complete or not)."""
    if not root.is_dir():
        return []
    steps = [int(m.group(1)) for p in root.iterdir() if (m := STEP_DIR.fullmatch(p.name)) and p.is_dir()]
    return sorted(steps, reverse=True)


def newest_complete(root: Path, *, world_size: int, fingerprint_: str,
                    warn: Callable[[str], None]) -> Manifest | None:
    """The newest checkpoint that verifies, warning about each newer one skipped (see
    [Note: checkpoint completeness]); None when there is none."""
    for step in checkpoint_steps(root):
        try:
            return verify(step_dir(root, step), world_size=world_size, fingerprint_=fingerprint_)
        except CheckpointMismatch:
            raise
        except CheckpointError as exc:
            warn(f"skipping checkpoint {step_dir(root, step)}: {exc}")
    return None


def publish(root: Path, step: int, manifest: Manifest) -> Path:
    """Write the manifest into the partial directory and rename it to `step-N` (rank 0, after every
    rank's files are durable)."""
    partial, final = partial_dir(root, step), step_dir(root, step)
    write_manifest(partial, manifest)
    try:
        if final.exists():  # a corrupt or older attempt at this step: the new one replaces it
            shutil.rmtree(final)
        partial.rename(final)
        fsync_dir(root)
    except OSError as exc:
        raise CheckpointError(f"cannot publish checkpoint {final}: {exc.strerror or exc}") from None
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest `keep` checkpoints with a manifest, and abandoned partial directories."""
    removed = []
    kept = 0
    for step in checkpoint_steps(root):
        path = step_dir(root, step)
        has_manifest = (path / MANIFEST).is_file()
        if has_manifest and kept < keep:
            kept += 1
            continue
        if kept >= keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    for path in root.glob(".step-*.partial"):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    with contextlib.suppress(OSError):
        fsync_dir(root)
    return removed
