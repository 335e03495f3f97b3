"""One rank's share of a training checkpoint: its shards, optimizer tensors, RNG states and scalars.

`rank-NNNNN.safetensors` holds the tensors (a safetensors file: runtime/ckpt/safetensors_io.py);
`rank-NNNNN.json` carries the scalars (step, Python RNG state, loss scaler) and, on rank 0, the
model's layout and Hugging Face config for `planner export` (runtime/ckpt/model_layout.py). Nothing
is pickled, so loading a checkpoint can never run code. Checkpoints of the first format
(`rank-NNNNN.bin`: raw bytes back to back, indexed by the JSON's `tensors`) still resume.

Shards are streamed through one chunk buffer of the plan's `optimizer_chunk_bytes` (borrowed from
the streamed optimizer's pool when the states are on NVMe), whatever the store: a state on NVMe is
read chunk by chunk from its swap file into the checkpoint file and back, so host memory stays
within the plan's budget however large the model. The safetensors header depends only on the
tensors' names, dtypes and sizes, so it is written first and the data streamed after it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.specs.specio import check_keys, number, string
from runtime.ckpt.errors import CheckpointError
from runtime.ckpt.files import FileDigest, atomic_file
from runtime.ckpt.manifest import rank_file
from runtime.ckpt.model_layout import describe
from runtime.ckpt.safetensors_io import DTYPE_CODES, DTYPE_NAMES, encode_header, read_header
from runtime.faults import fault_point
from runtime.nvme import AlignedBuffer
from runtime.transfer.stores import Pending, ShardKey, ShardStore, StateKey

RANK_FORMAT = "tierwise.checkpoint-rank/2"
"""The rank JSON of a checkpoint whose tensors are in `rank-NNNNN.safetensors`."""
RANK_FORMAT_V1 = "tierwise.checkpoint-rank/1"
"""The first format: tensors in `rank-NNNNN.bin`, indexed by the JSON's `tensors` (read, not written)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8,
          "float64": torch.float64, "int64": torch.int64}
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class _Entry:
    """A tensor to save or load, read and written in chunks (`read(out, offset)` / `write(src, offset)`)."""

    name: str
    numel: int
    dtype: torch.dtype
    read: Callable[[torch.Tensor, int], Pending]
    write: Callable[[torch.Tensor, int], Pending]


def _store_entry(prefix: str, store: ShardStore, key: ShardKey, stored: ShardKey | None = None) -> _Entry:
    """`prefix/key`, held in `store` under `stored` (`key` where not given)."""
    stored = key if stored is None else stored
    numel, dtype = store.shard_info(stored)
    return _Entry(f"{prefix}/{key}", numel, dtype, lambda out, o: store.read_into(stored, out, o),
                  lambda src, o: store.write_from(stored, src, o))


def _tensor_entry(name: str, tensor: torch.Tensor) -> _Entry:
    flat = tensor.view(-1)

    def read(out: torch.Tensor, offset: int) -> Pending:
        out.copy_(flat[offset : offset + out.numel()])
        return Pending(out)

    def write(src: torch.Tensor, offset: int) -> Pending:
        flat[offset : offset + src.numel()].copy_(src)
        return Pending(src)

    return _Entry(name, flat.numel(), tensor.dtype, read, write)


def _store_entries(state: Any) -> list[_Entry]:
    entries = []
    for store in (state.param_store, state.optimizer_store):
        store.drain()
    for prefix, store, key, stored in _stored_shards(state):
        if store is None:  # the master's 16-bit copy, which this model does not keep
            entries.append(_compute_copy_entry(state, key))
        else:
            entries.append(_store_entry(prefix, store, key, stored))
    return entries


def _stored_shards(state: Any) -> list[tuple[str, ShardStore | None, ShardKey, ShardKey]]:
    """(prefix, store, key, the key it is stored under in `store`) of each shard a checkpoint holds, by
    the key's string within each prefix (the order checkpoints have always had: files stay
    byte-identical).

    [Note: one checkpoint for both host parameter shards] A mixed-precision model whose parameter
    shard is the fp32 master (`host_param_shard: master`) writes the tensors a model with a 16-bit
    copy writes: `params/K` (the master cast to the compute precision: the copy's value, bit for
    bit) and `optimizer_states/master:K` (the master itself; `store` is then the parameter store).
    Either model resumes the other's checkpoint; the one without the copy reads the master and
    skips the copy (`store` None)."""
    params, states = state.param_store, state.optimizer_store
    param_keys, state_keys = params.keys(), states.keys()
    out: list[tuple[str, ShardStore | None, ShardKey, ShardKey]] = [("params", params, k, k) for k in param_keys]
    shared = []
    if state.config.master_shares_param_shard and state.config.compute_dtype != torch.float32:
        shared = [("optimizer_states", params, StateKey("master", k), k) for k in param_keys]
        out = [("params", None, k, k) for k in param_keys]
    out.sort(key=lambda e: str(e[2]))
    rest = [("optimizer_states", states, k, k) for k in state_keys] + shared
    return out + sorted(rest, key=lambda e: str(e[2]))


def _compute_copy_entry(state: Any, key: ShardKey) -> _Entry:
    """`params/K` of a model whose parameter shard is the fp32 master: written as the master cast to
    the compute precision, skipped on load (the master is read from `optimizer_states/master:K`)."""
    store, dtype = state.param_store, state.config.compute_dtype
    numel, _ = store.shard_info(key)

    def read(out: torch.Tensor, offset: int) -> Pending:
        master = torch.empty(out.numel(), dtype=torch.float32)
        store.read_into(key, master, offset).wait()
        out.copy_(master)
        return Pending(out)

    return _Entry(f"params/{key}", numel, dtype, read, lambda src, o: Pending(src))


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"rng/torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["rng/torch_cuda"] = torch.cuda.get_rng_state()
    return out


def rank_bytes(state: Any, optimizer: Any) -> int:
    """Size of this rank's checkpoint files, within a MiB (RNG states and the index are small)."""
    total = optimizer.checkpoint_bytes()
    for _, store, _, stored in _stored_shards(state):
        if store is None:  # the master's 16-bit copy, written at the compute precision
            numel, dtype = state.param_store.shard_info(stored)[0], state.config.compute_dtype
        else:
            numel, dtype = store.shard_info(stored)
        total += numel * dtype.itemsize
    return total + (1 << 20)


class ChunkBuffer:
    """The one host buffer checkpoint traffic goes through: leased from the optimizer's chunk pool or
    the rank's pinned staging pool (runtime/transfer/pinned_pool.py) where there is one, else allocated."""

    def __init__(self, optimizer: Any, chunk_bytes: int, staging: Any = None) -> None:
        self._pool = optimizer.chunk_pool if optimizer.chunk_pool is not None else staging
        self.buffer = self._pool.acquire() if self._pool is not None else AlignedBuffer(chunk_bytes)
        self.nbytes = self.buffer.nbytes

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.frombuffer(self.buffer.view, dtype=dtype, count=numel)

    def release(self) -> None:
        if self._pool is not None:
            self._pool.release(self.buffer)

    def chunks(self, entry: _Entry) -> Iterator[tuple[int, int]]:
        per_chunk = max(1, self.nbytes // entry.dtype.itemsize)
        for start in range(0, entry.numel, per_chunk):
            yield start, min(per_chunk, entry.numel - start)


def save_rank(directory: Path, *, rank: int, step: int, state: Any, optimizer: Any,
              scalars: dict[str, Any]) -> list[FileDigest]:
    """Write this rank's files into `directory` (atomically each); returns their digests."""
    entries = _store_entries(state)
    entries += [_tensor_entry(n, t) for n, t in sorted(optimizer.checkpoint_tensors().items())]
    entries += [_tensor_entry(n, t) for n, t in _rng_tensors().items()]
    header, _ = encode_header([(e.name, DTYPE_CODES[_dtype_name(e.dtype)], (e.numel,)) for e in entries],
                              {"format": "pt", "tierwise": RANK_FORMAT})
    buffer = ChunkBuffer(optimizer, state.plan.optimizer_chunk_bytes, state.copier.pool)
    try:
        with atomic_file(directory / rank_file(rank, "safetensors")) as out:
            out.write(header)
            for i, entry in enumerate(entries):
                for start, numel in buffer.chunks(entry):
                    view = buffer.view(entry.dtype, numel)
                    entry.read(view, start).wait()
                    out.write(buffer.buffer.view[: numel * entry.dtype.itemsize])
                if i == 0:
                    fault_point("checkpoint.rank_file", step=step, rank=rank)
            tensors_digest = out.digest()
    finally:
        buffer.release()
    doc = {"format": RANK_FORMAT, "rank": rank, "step": step, "python_rng": _python_rng_to_json(random.getstate()),
           **scalars}
    if rank == 0:
        doc["model"] = describe(state)
    with atomic_file(directory / rank_file(rank, "json")) as out:
        out.write(json.dumps(doc).encode())
        json_digest = out.digest()
    return [tensors_digest, json_digest]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_rank(directory: Path, *, rank: int, step: int, state: Any, optimizer: Any) -> dict[str, Any]:
    """Load this rank's files from a verified checkpoint (either format); returns the scalars (RNG
    states restored)."""
    doc, index = read_rank_index(directory / rank_file(rank, "json"), rank=rank, step=step)
    path = directory / rank_file(rank, "bin" if doc["format"] == RANK_FORMAT_V1 else "safetensors")
    if doc["format"] != RANK_FORMAT_V1:
        index = _safetensors_index(path)
    names = [e["name"] for e in index]
    targets = {e.name: e for e in _store_entries(state)}
    targets.update({n: _tensor_entry(n, t) for n, t in optimizer.checkpoint_tensors_for_load(names).items()})
    rng = {n: torch.empty(0, dtype=torch.uint8) for n in names if n.startswith("rng/")}
    expected = set(targets) | {n for n in names if n.startswith("rng/")}
    if set(names) - expected or set(targets) - set(names):
        missing = sorted(set(targets) - set(names))[:3]
        extra = sorted(set(names) - expected)[:3]
        raise CheckpointError(f"checkpoint {directory} does not match this model (missing {missing}, unknown {extra}); "
                              "resume with the plan it was written for")
    buffer = ChunkBuffer(optimizer, state.plan.optimizer_chunk_bytes, state.copier.pool)
    try:
        with open(path, "rb") as f:
            for e in index:
                dtype = DTYPES[e["dtype"]]
                if e["name"] in rng:
                    raw = torch.empty(e["numel"], dtype=dtype)
                    f.seek(e["offset_bytes"])
                    f.readinto(memoryview(raw.numpy()).cast("B"))
                    rng[e["name"]] = raw
                    continue
                target = targets[e["name"]]
                if (target.numel, target.dtype) != (e["numel"], dtype):
                    raise CheckpointError(f"checkpoint tensor {e['name']} is {e['numel']} x {e['dtype']}, the model "
                                          f"has {target.numel} x {_dtype_name(target.dtype)}")
                f.seek(e["offset_bytes"])
                for start, numel in buffer.chunks(target):
                    nbytes = numel * dtype.itemsize
                    if f.readinto(buffer.buffer.view[:nbytes]) != nbytes:
                        raise CheckpointError(f"{path} ends inside tensor {e['name']} (truncated)")
                    target.write(buffer.view(dtype, numel), start).wait()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc.strerror or exc}") from None
    finally:
        buffer.release()
    for store in (state.param_store, state.optimizer_store):
        store.drain()
    torch.set_rng_state(rng["rng/torch_cpu"])
    if "rng/torch_cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["rng/torch_cuda"])
    random.setstate(_python_rng_from_json(doc["python_rng"]))
    return doc


def _safetensors_index(path: Path) -> list[dict[str, Any]]:
    """A rank file's tensors as the first format's index (name, dtype, numel, absolute byte offset)."""
    try:
        with open(path, "rb") as f:
            header = read_header(f, path, path.stat().st_size)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc.strerror or exc}") from None
    if header.metadata.get("tierwise") != RANK_FORMAT:
        raise CheckpointError(f"{path} is a safetensors file but not a {RANK_FORMAT} rank file")
    return [{"name": t.name, "dtype": DTYPE_NAMES[t.dtype], "numel": t.numel, "offset_bytes": header.data_start_bytes + t.begin_bytes}
            for t in header.tensors.values()]


def read_rank_index(path: Path, *, rank: int, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The rank file's JSON, strictly checked (it is input like any other file), and, for the first
    format, its tensor index (the current format's is the safetensors header: `_safetensors_index`)."""
    try:
        if path.stat().st_size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{path} is larger than {MAX_INDEX_BYTES} bytes; not a checkpoint index")
        doc = json.loads(path.read_bytes())
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint index {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise CheckpointError(f"checkpoint index {path} is not valid JSON ({str(exc).splitlines()[0]})") from None
    where = str(path)
    if not isinstance(doc, dict) or doc.get("format") not in (RANK_FORMAT, RANK_FORMAT_V1):
        raise CheckpointError(f"{where} is not a {RANK_FORMAT} (or {RANK_FORMAT_V1}) document")
    if doc.get("rank") != rank or doc.get("step") != step:
        raise CheckpointError(f"{where} is for rank {doc.get('rank')!r} step {doc.get('step')!r}, expected {rank} {step}")
    if doc["format"] == RANK_FORMAT:
        if "tensors" in doc:
            raise CheckpointError(f"{where}: a {RANK_FORMAT} document indexes no tensors (they are in the safetensors file)")
        return doc, []
    if not isinstance(doc.get("tensors"), list):
        raise CheckpointError(f"{where}.tensors must be a list")
    index, offset = [], 0
    for i, e in enumerate(doc["tensors"]):
        at = f"{where}.tensors[{i}]"
        check_keys(e, {"name", "dtype", "numel", "offset_bytes"}, at)
        name = string(e.get("name"), f"{at}.name", max_len=1000)
        dtype = string(e.get("dtype"), f"{at}.dtype", choices=tuple(DTYPES))
        numel = int(number(e.get("numel"), f"{at}.numel", minimum=0, maximum=1 << 50, integer=True))
        if e.get("offset_bytes") != offset:
            raise CheckpointError(f"{at}.offset_bytes must be {offset} (tensors are stored back to back)")
        index.append({"name": name, "dtype": dtype, "numel": numel, "offset_bytes": offset})
        offset += numel * DTYPES[dtype].itemsize
    return doc, index


def _python_rng_to_json(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _python_rng_from_json(doc: Any) -> tuple:
    if not (isinstance(doc, list) and len(doc) == 3 and isinstance(doc[1], list)):
        raise CheckpointError("checkpoint python_rng must be [version, [ints], gauss_next]")
    return (doc[0], tuple(doc[1]), doc[2])
