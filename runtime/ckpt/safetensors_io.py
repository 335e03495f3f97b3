"""The safetensors file format, written and read in a streaming way (https://huggingface.co/docs/safetensors).

    8 bytes     N, the header's length (unsigned little-endian 64-bit)
    N bytes     a JSON object: name -> {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]},
                plus an optional "__metadata__" of string -> string; padded with spaces
    the rest    the tensors' bytes, back to back, in `data_offsets` order (offsets from the end of the header)

The header depends only on the tensors' names, dtypes and shapes, so it is written before any data:
a writer then streams each tensor chunk by chunk (`rank_state.save_rank` from the stores through one
chunk buffer, `export` from the rank files), and a reader seeks to byte ranges of a tensor without
loading it. Torch-free, so the CLI and fuzz tests parse headers without starting torch. Files written
here load with `safetensors.torch.load_file` / `safe_open` (tests/test_ckpt_safetensors.py).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from runtime.ckpt.errors import CheckpointError

DTYPE_CODES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "uint8": "U8", "float64": "F64",
               "int64": "I64"}
"""torch dtype name (without `torch.`) -> safetensors' dtype code."""
DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
ITEM_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "F64": 8, "I64": 8}
MAX_HEADER_BYTES = 100 << 20
"""safetensors' own limit on a header."""
HEADER_ALIGN_BYTES = 8


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a safetensors file: where its bytes are, relative to the data section."""

    name: str
    dtype: str
    """safetensors' code: F32, BF16, ..."""
    shape: tuple[int, ...]
    begin_bytes: int
    end_bytes: int

    @property
    def numel(self) -> int:
        return _numel(self.shape)

    @property
    def item_bytes(self) -> int:
        return ITEM_BYTES[self.dtype]


def _numel(shape: tuple[int, ...] | list[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def encode_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, list[TensorInfo]]:
    """The header bytes (length prefix included) for tensors (name, dtype code, shape) stored in
    this order, and where each one's bytes go."""
    infos, offset = [], 0
    doc: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    for name, dtype, shape in tensors:
        end = offset + _numel(shape) * ITEM_BYTES[dtype]
        info = TensorInfo(name, dtype, tuple(shape), offset, end)
        doc[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        infos.append(info)
        offset = end
    text = json.dumps(doc, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN_BYTES)  # aligned data, as safetensors writes it
    return struct.pack("<Q", len(text)) + text, infos


@dataclass(frozen=True, slots=True)
class Header:
    tensors: dict[str, TensorInfo]
    """In the order of their bytes."""
    metadata: dict[str, str]
    data_start_bytes: int
    """Where the data section begins in the file."""


def read_header(handle: BinaryIO, path: Path, file_bytes: int) -> Header:
    """The header of an open safetensors file, strictly checked (a one-line CheckpointError otherwise):
    offsets must tile the data section exactly, as safetensors itself requires."""
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise CheckpointError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(MAX_HEADER_BYTES, file_bytes - 8):
        raise CheckpointError(f"{path} is not a safetensors file (header length {length} is past its end)")
    try:
        doc = json.loads(handle.read(length))
    except ValueError as exc:
        raise CheckpointError(f"{path} has no valid safetensors header ({str(exc).splitlines()[0]})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path} has no valid safetensors header (not a JSON object)")
    metadata = doc.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: safetensors __metadata__ must map strings to strings")
    infos = sorted((_tensor_info(path, name, entry) for name, entry in doc.items()), key=lambda t: t.begin_bytes)
    offset = 0
    for info in infos:
        if info.begin_bytes != offset:
            raise CheckpointError(f"{path}: tensor {info.name} begins at {info.begin_bytes}, expected {offset} "
                                  "(safetensors data has no holes or overlaps)")
        offset = info.end_bytes
    if 8 + length + offset != file_bytes:
        raise CheckpointError(f"{path} has {file_bytes} bytes, its header describes {8 + length + offset} (truncated?)")
    return Header({t.name: t for t in infos}, metadata, 8 + length)


def _tensor_info(path: Path, name: Any, entry: Any) -> TensorInfo:
    where = f"{path}: tensor {str(name)[:100]!r}"
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(f"{where} needs exactly dtype, shape and data_offsets")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in ITEM_BYTES:
        raise CheckpointError(f"{where} has dtype {dtype!r}; expected one of {', '.join(ITEM_BYTES)}")
    if not (isinstance(shape, list) and all(type(n) is int and 0 <= n < 1 << 50 for n in shape)):
        raise CheckpointError(f"{where}: shape must be a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int and n >= 0 for n in offsets)):
        raise CheckpointError(f"{where}: data_offsets must be [begin, end] in bytes")
    info = TensorInfo(str(name), dtype, tuple(shape), offsets[0], offsets[1])
    if info.end_bytes - info.begin_bytes != info.numel * info.item_bytes:
        raise CheckpointError(f"{where}: data_offsets span {info.end_bytes - info.begin_bytes} bytes, "
                              f"its shape and dtype need {info.numel * info.item_bytes}")
    return info


def read_header_of(path: Path) -> Header:
    try:
        with open(path, "rb") as handle:
            return read_header(handle, path, path.stat().st_size)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
