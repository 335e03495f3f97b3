"""Training checkpoints are safetensors files: each rank's tensors load with `safetensors` itself, the
header is written first and the data streamed after it, and checkpoints of the first format (raw
bytes + a JSON index) still resume bit for bit."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from export_support import plan, train_and_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import launch_in_process, manifest_files, write_plan
from runtime_support import ALL_CPU

from runtime.ckpt import CheckpointError
from runtime.ckpt.export import export
from runtime.ckpt.files import file_digest
from runtime.ckpt.manifest import FORMAT, Manifest
from runtime.ckpt.rank_state import RANK_FORMAT, RANK_FORMAT_V1
from runtime.ckpt.safetensors_io import DTYPE_NAMES, encode_header, read_header_of

safetensors = pytest.importorskip("safetensors")


def test_rank_files_load_with_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    train_and_checkpoint(plan(ALL_CPU, world_size=1, precision="bf16"), str(tmp_path / "ck"))
    path = tmp_path / "ck" / "step-000000002" / "rank-00000.safetensors"
    tensors = load_file(path)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "tierwise": RANK_FORMAT}
        assert f.get_slice("params/0:model.embed_tokens")[10:20].shape == (10,)
    names = list(read_header_of(path).tensors)  # in the order of their bytes
    assert sorted(tensors) == sorted(names) and names[0] == "params/0:model.embed_tokens"
    assert tensors["params/0:model.embed_tokens"].dtype == torch.bfloat16
    master = tensors["optimizer_states/master:0:model.embed_tokens"]
    assert master.dtype == torch.float32 and master.shape == (128 * 64,)
    # The bf16 parameter shard is the fp32 master cast after the step: the bytes are where the header says.
    assert torch.equal(tensors["params/0:model.embed_tokens"], master.to(torch.bfloat16))
    assert tensors["rng/torch_cpu"].dtype == torch.uint8
    assert {n.split("/")[0] for n in names} == {"params", "optimizer_states", "adam", "rng"}
    doc = json.loads(path.with_suffix(".json").read_text())
    assert doc["format"] == RANK_FORMAT and "tensors" not in doc
    assert doc["model"]["units"][0]["master"] == "optimizer_states/master:0:model.embed_tokens"
    assert doc["model"]["hf_config"]["num_key_value_heads"] == 2
    assert doc["model"]["tensors"][0] == {"name": "model.embed_tokens.weight", "shape": [128, 64], "dtype": "bfloat16",
                                          "segments": [[0, 0, 128 * 64]]}


def to_first_format(step_dir: Path) -> None:
    """Rewrite a checkpoint as the first format wrote it: the tensors' bytes back to back in
    `rank-00000.bin`, indexed by the rank JSON (no model layout), the manifest's digests redone."""
    tensors_file = step_dir / "rank-00000.safetensors"
    header = read_header_of(tensors_file)
    (step_dir / "rank-00000.bin").write_bytes(tensors_file.read_bytes()[header.data_start_bytes:])
    tensors_file.unlink()
    doc = json.loads((step_dir / "rank-00000.json").read_text())
    doc.pop("model")
    doc.update(format=RANK_FORMAT_V1, tensors=[{"name": t.name, "dtype": DTYPE_NAMES[t.dtype], "numel": t.numel,
                                                "offset_bytes": t.begin_bytes} for t in header.tensors.values()])
    (step_dir / "rank-00000.json").write_text(json.dumps(doc))
    manifest = json.loads((step_dir / "MANIFEST.json").read_text())
    manifest["files"] = [{"name": d.name, "size_bytes": d.size_bytes, "sha256": d.sha256}
                         for d in (file_digest(step_dir / n) for n in ("rank-00000.bin", "rank-00000.json"))]
    (step_dir / "MANIFEST.json").write_text(json.dumps(manifest))


def test_a_first_format_checkpoint_resumes_bit_for_bit(tmp_path: Path) -> None:
    plan_path = write_plan(tmp_path, ALL_CPU)
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    code, full = launch_in_process(plan_path, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(full_dir))
    assert code == 0
    code, first = launch_in_process(plan_path, "--steps", "2", "--save-every", "2", "--checkpoint-dir", str(part_dir))
    assert code == 0
    to_first_format(part_dir / "step-000000002")
    with pytest.raises(CheckpointError, match="is a checkpoint of the first format .* resume the run with --resume"):
        export(part_dir, tmp_path / "out")
    code, rest = launch_in_process(plan_path, "--steps", "4", "--save-every", "2", "--checkpoint-dir", str(part_dir),
                                   "--resume")
    assert code == 0
    assert first + rest == full
    assert manifest_files(part_dir, 4) == manifest_files(full_dir, 4)  # the new checkpoint is in the new format
    assert (part_dir / "step-000000004" / "rank-00000.safetensors").is_file()


def test_the_manifest_lists_one_format_per_checkpoint() -> None:
    def doc(*names: str) -> dict:
        return {"format": FORMAT, "step": 4, "world_size": 1, "fingerprint": "ab" * 32,
                "files": [{"name": n, "size_bytes": 1, "sha256": "0" * 64} for n in names]}

    assert Manifest.from_dict(doc("rank-00000.safetensors", "rank-00000.json")).step == 4
    assert Manifest.from_dict(doc("rank-00000.bin", "rank-00000.json")).step == 4
    with pytest.raises(CheckpointError, match="must be exactly the rank files of 1 rank"):
        Manifest.from_dict(doc("rank-00000.safetensors", "rank-00000.bin"))


def write(path: Path, header: bytes, data: bytes) -> Path:
    path.write_bytes(header + data)
    return path


def test_headers_are_read_strictly(tmp_path: Path) -> None:
    header, infos = encode_header([("a", "F32", (2, 3)), ("b", "BF16", (5,)), ("c", "U8", ())], {"k": "v"})
    assert len(header) % 8 == 0 and [(i.begin_bytes, i.end_bytes) for i in infos] == [(0, 24), (24, 34), (34, 35)]
    good = write(tmp_path / "good.safetensors", header, bytes(35))
    parsed = read_header_of(good)
    assert list(parsed.tensors) == ["a", "b", "c"] and parsed.metadata == {"k": "v"}
    from safetensors.torch import load_file

    assert {k: tuple(v.shape) for k, v in load_file(good).items()} == {"a": (2, 3), "b": (5,), "c": ()}

    def hand_made(doc: dict) -> bytes:
        text = json.dumps(doc).encode()
        return struct.pack("<Q", len(text)) + text

    cases = [(header, bytes(34), "its header describes"),
             (struct.pack("<Q", 1 << 40), b"{}", "header length .* is past its end"),
             (hand_made({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), bytes(8), "begins at 4, expected 0"),
             (hand_made({"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 4]}}), bytes(4), "has dtype 'Q4'"),
             (hand_made({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}), bytes(4), "span 4 bytes"),
             (b"\x05\x00\x00\x00\x00\x00\x00\x00[1,2]", b"", "not a JSON object"),
             (b"\x01\x00", b"", "shorter than its 8-byte header length")]
    for i, (head, data, message) in enumerate(cases):
        with pytest.raises(CheckpointError, match=message) as refused:
            read_header_of(write(tmp_path / f"bad{i}.safetensors", head, data))
        assert "\n" not in str(refused.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.integers(min_value=0, max_value=200), flips=st.lists(st.tuples(st.integers(0, 199), st.integers(1, 255)),
                                                                    max_size=4))
def test_damaged_headers_are_one_line_errors(tmp_path: Path, cut: int, flips: list[tuple[int, int]]) -> None:
    header, _ = encode_header([("params/0:wte", "F32", (8,)), ("rng/torch_cpu", "U8", (16,))], {"format": "pt"})
    raw = bytearray(header + bytes(48))
    for at, bits in flips:
        raw[at % len(raw)] ^= bits
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(bytes(raw[: len(raw) - cut % len(raw)]))
    try:
        read_header_of(path)
    except CheckpointError as exc:
        assert str(exc) and "\n" not in str(exc)
