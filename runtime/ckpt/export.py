"""`planner export`: a training checkpoint of a Hugging Face architecture as a `from_pretrained` folder.

    export(CHECKPOINT_DIR, OUT)   ->  OUT/config.json
                                      OUT/model.safetensors                       (up to max_shard_bytes)
                                      OUT/model-0000i-of-0000n.safetensors + model.safetensors.index.json

[Note: streaming export]
Host memory holds one chunk (`chunk_bytes`) of one parameter at a time, however large the model:
the output's safetensors headers depend only on the parameters' names, shapes and the output dtype
(all in the checkpoint's layout, runtime/ckpt/model_layout.py), so each file's header is written
first and each parameter then streamed into it a chunk at a time, every chunk read from the rank
file that holds that range of the unit's flat vector ([Note: a parameter's place in the rank
files]), cast and written. The weights are the fp32 master copy (the optimizer's), cast to the
config's dtype unless `dtype` says otherwise. The folder is written as `OUT.partial` and renamed into
place once complete, so `OUT` is either absent or a whole export; the checkpoint's checksums are
verified first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch

from runtime.ckpt.errors import CheckpointError
from runtime.ckpt.files import fsync_dir
from runtime.ckpt.manifest import Manifest, check_files, checkpoint_steps, rank_file, read_manifest, step_dir
from runtime.ckpt.model_layout import ExportTensor, Layout, parse_layout
from runtime.ckpt.rank_state import RANK_FORMAT_V1, read_rank_index
from runtime.ckpt.safetensors_io import DTYPE_CODES, DTYPE_NAMES, Header, encode_header, read_header

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CONFIG_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
DEFAULT_CHUNK_BYTES = 64 << 20
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}
"""As transformers' `max_shard_size`: 5GB is 5 * 10^9 bytes, 5GiB 5 * 2^30."""


def parse_size(text: str, what: str = "--max-shard-size") -> int:
    """Bytes of a size like `5GB`, `500MiB` or `1048576`; a one-line CheckpointError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in SIZE_UNITS or float(m.group(1)) * SIZE_UNITS[unit] < 1:
        raise CheckpointError(f"{what} {text!r} is not a size; write it like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * SIZE_UNITS[unit])


@dataclass
class ExportResult:
    out: Path
    step: int
    dtype: str
    files: list[str]
    tensors: int
    total_bytes: int
    peak_host_bytes: int = 0
    """The most bytes of parameter data the exporter held at once (its read buffer and a cast chunk)."""


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def export(checkpoint_dir: str | os.PathLike[str], out: str | os.PathLike[str], *, step: int | None = None,
           dtype: str | None = None, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
           chunk_bytes: int = DEFAULT_CHUNK_BYTES, warn: Callable[[str], None] = _warn) -> ExportResult:
    """Write the newest complete checkpoint under `checkpoint_dir` (or that of `step`) to the folder
    `out` (see the module docstring); a one-line CheckpointError for anything it cannot do."""
    root = Path(checkpoint_dir).expanduser()
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist; pass the --checkpoint-dir of a run")
    target, partial = _output_dirs(Path(out).expanduser())
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    directory, manifest = _pick_checkpoint(root, step, warn)
    layout = _read_layout(directory, manifest)
    readers = RankFiles(directory, manifest.world_size, max(chunk_bytes, 8))  # at least one element of any dtype
    chosen = dtype or CONFIG_DTYPES.get(_config_dtype(layout.hf_config), "fp32")
    try:
        sources = readers.sources(layout)
        shutil.rmtree(partial, ignore_errors=True)  # an export that crashed: ours to replace
        partial.mkdir()
        files, total = _write_folder(partial, layout, sources, readers, DTYPES[chosen], max_shard_bytes)
        _write_json(partial / "config.json", _exported_config(layout.hf_config, chosen))
        fsync_dir(partial)
        partial.rename(target)
        fsync_dir(target.parent)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(f"cannot write the export {exc.filename or partial}: {exc.strerror or exc}; free space "
                              "or choose another --out") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        readers.close()
    return ExportResult(target, manifest.step, chosen, files, len(layout.tensors), total, readers.peak_bytes)


def _output_dirs(out: Path) -> tuple[Path, Path]:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--out {out} already exists and is not an empty directory; choose a new folder")
    if not out.parent.is_dir():
        raise CheckpointError(f"--out {out}: its parent {out.parent} is not an existing directory")
    return out, out.with_name(f"{out.name}.partial")


def _pick_checkpoint(root: Path, step: int | None, warn: Callable[[str], None]) -> tuple[Path, Manifest]:
    """The given step's checkpoint, or the newest whose checksums verify (warning about newer ones)."""
    steps = checkpoint_steps(root)
    if step is not None:
        if step not in steps:
            have = ", ".join(map(str, steps[:5])) or "none"
            raise CheckpointError(f"--step {step}: {root} has no checkpoint of that step (newest: {have})")
        steps = [step]
    for s in steps:
        directory = step_dir(root, s)
        try:
            manifest = read_manifest(directory)
            check_files(directory, manifest)
            return directory, manifest
        except CheckpointError as exc:
            if step is not None:
                raise
            warn(f"skipping checkpoint {directory}: {exc}")
    raise CheckpointError(f"{root} holds no complete checkpoint; pass the --checkpoint-dir of a run that saved one")


def _read_layout(directory: Path, manifest: Manifest) -> Layout:
    path = directory / rank_file(0, "json")
    doc, _ = read_rank_index(path, rank=0, step=manifest.step)
    if doc["format"] == RANK_FORMAT_V1 or "model" not in doc:
        raise CheckpointError(f"{directory} is a checkpoint of the first format (raw rank-NNNNN.bin files), which does not "
                              "record the model's layout; resume the run with --resume for one step to save it anew, "
                              "then export that checkpoint")
    layout = parse_layout(doc["model"], f"{path}.model")
    if layout.hf_config is None:
        model = ("the built-in GPT model (GPT)" if layout.architecture == "GPT" else
                 f"{layout.architecture}, a model without a Hugging Face config")
        raise CheckpointError(f"{directory}: this checkpoint is of {model}, not of a Hugging Face architecture; "
                              "export needs a run of a Hugging Face architecture: planner run --model CONFIG")
    if layout.persistent_buffers:
        raise CheckpointError(f"{directory}: the model has persistent buffers ({', '.join(layout.persistent_buffers[:3])}) "
                              "that training checkpoints do not hold; export supports models whose state dict is their "
                              "parameters (Llama, Mistral, Qwen2, Gemma, GPT-NeoX, ...)")
    if layout.world_size != manifest.world_size:
        raise CheckpointError(f"{path}.model is for {layout.world_size} rank(s), the manifest for {manifest.world_size}")
    return layout


def _config_dtype(config: dict[str, Any] | None) -> str | None:
    config = config or {}
    value = config.get("dtype") or config.get("torch_dtype")
    return value if isinstance(value, str) else None


def _exported_config(config: dict[str, Any] | None, chosen: str) -> dict[str, Any]:
    out = dict(config or {})
    name = str(DTYPES[chosen]).removeprefix("torch.")
    out["dtype"] = name  # transformers 5's key; earlier versions read torch_dtype
    if "use_cache" in out:  # runtime.shard turns the KV cache off for recompute; inference wants it
        out["use_cache"] = True
    if "torch_dtype" in out:
        out["torch_dtype"] = name
    return out


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "w") as handle:
        json.dump(doc, handle, indent=2, sort_keys=True)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())


@dataclass
class RankFiles:
    """The rank files of one checkpoint, read in bounded slices: one reusable buffer of `chunk_bytes`."""

    directory: Path
    world_size: int
    chunk_bytes: int
    handles: list[BinaryIO] = field(default_factory=list)
    headers: list[Header] = field(default_factory=list)
    held_bytes: int = 0
    peak_bytes: int = 0

    def __post_init__(self) -> None:
        try:
            for rank in range(self.world_size):
                path = self.directory / rank_file(rank, "safetensors")
                handle = open(path, "rb")  # noqa: SIM115 - closed by close()
                self.handles.append(handle)
                self.headers.append(read_header(handle, path, path.stat().st_size))
        except OSError as exc:
            self.close()
            raise CheckpointError(f"cannot read checkpoint file {exc.filename}: {exc.strerror or exc}") from None
        self.buffer = bytearray(self.chunk_bytes)
        self._hold(self.chunk_bytes)

    def _hold(self, nbytes: int) -> None:
        self.held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def close(self) -> None:
        for handle in self.handles:
            handle.close()
        self.handles = []

    def sources(self, layout: Layout) -> list[str]:
        """Per unit, the rank files' tensor its weights come from: the fp32 master, else the parameters."""
        out = []
        for i, unit in enumerate(layout.units):
            name = unit["master"] if unit["master"] in self.headers[0].tensors else unit["params"]
            for rank, header in enumerate(self.headers):
                info = header.tensors.get(name)
                if info is None or info.numel != unit["shard_numel"]:
                    raise CheckpointError(f"{self.directory / rank_file(rank, 'safetensors')} has no {unit['shard_numel']}-"
                                          f"element tensor {name} (unit {i} of the model's layout)")
            out.append(name)
        return out

    def copy(self, handle: BinaryIO, rank: int, name: str, start: int, numel: int, dtype: torch.dtype) -> None:
        """Write elements `[start, start + numel)` of a rank's tensor (numel fitting the buffer) to
        `handle` in `dtype`: read into the buffer, cast (a chunk-sized copy, dropped here), written."""
        header = self.headers[rank]
        info = header.tensors[name]
        nbytes = numel * info.item_bytes
        assert nbytes <= self.chunk_bytes
        source = self.handles[rank]
        source.seek(header.data_start_bytes + info.begin_bytes + start * info.item_bytes)
        if source.readinto(memoryview(self.buffer)[:nbytes]) != nbytes:
            raise CheckpointError(f"{source.name} ends inside tensor {name} (truncated)")
        chunk = torch.frombuffer(self.buffer, dtype=getattr(torch, DTYPE_NAMES[info.dtype]), count=numel)
        cast_bytes = 0 if chunk.dtype == dtype else numel * dtype.itemsize
        if cast_bytes:
            chunk = chunk.to(dtype)
            self._hold(cast_bytes)
        handle.write(memoryview(chunk.view(torch.uint8).numpy()))
        del chunk
        self.held_bytes -= cast_bytes

    def item_bytes(self, name: str) -> int:
        return self.headers[0].tensors[name].item_bytes


def _shard_files(tensors: tuple[ExportTensor, ...], item_bytes: int, max_shard_bytes: int) -> list[list[ExportTensor]]:
    """Tensors split in order into files of at most `max_shard_bytes` (a larger tensor alone in its
    file), as transformers' `save_pretrained` splits them."""
    files: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        nbytes = t.numel * item_bytes
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(t)
        size += nbytes
    return files


def _write_folder(folder: Path, layout: Layout, sources: list[str], readers: RankFiles, dtype: torch.dtype,
                  max_shard_bytes: int) -> tuple[list[str], int]:
    """The safetensors file(s) and, when there are several, their index; returns (file names, bytes)."""
    code = DTYPE_CODES[str(dtype).removeprefix("torch.")]
    groups = _shard_files(layout.tensors, dtype.itemsize, max_shard_bytes)
    names = (["model.safetensors"] if len(groups) == 1 else
             [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))])
    total = 0
    for name, group in zip(names, groups, strict=True):
        header, _ = encode_header([(t.name, code, t.shape) for t in group], {"format": "pt"})
        with open(folder / name, "wb") as handle:
            handle.write(header)
            for t in group:
                total += _stream_tensor(handle, t, layout, sources, readers, dtype)
            handle.flush()
            os.fsync(handle.fileno())
    if len(names) > 1:
        weight_map = {t.name: name for name, group in zip(names, groups, strict=True) for t in group}
        _write_json(folder / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})
    return names, total


def _stream_tensor(handle: BinaryIO, t: ExportTensor, layout: Layout, sources: list[str], readers: RankFiles,
                   dtype: torch.dtype) -> int:
    """Write one tensor chunk by chunk, each chunk from the rank holding that range of its unit's flat
    vector ([Note: a parameter's place in the rank files]); returns the bytes written."""
    written = 0
    for unit, offset, numel in t.segments:
        shard = layout.units[unit]["shard_numel"]
        per_chunk = max(1, readers.chunk_bytes // readers.item_bytes(sources[unit]))
        position, end = offset, offset + numel
        while position < end:
            rank, local = divmod(position, shard)
            count = min(end - position, shard - local, per_chunk)
            readers.copy(handle, rank, sources[unit], local, count, dtype)
            written += count * dtype.itemsize
            position += count
    return written
