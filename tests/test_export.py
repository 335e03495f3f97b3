"""`planner export`: a checkpoint of a sharded Hugging Face model becomes a folder that
`AutoModelForCausalLM.from_pretrained` loads with empty loading info and whose logits are the runtime
model's (a tiny Llama with GQA, fp32, built on the meta device, trained 2 steps on 1 and 2 gloo ranks,
its states on cpu and on NVMe)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from export_support import fixed_batch, plan, train_and_checkpoint
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reliability_support import ALL_NVME
from runtime_support import ALL_CPU, run_distributed
from test_planner_fuzz import json_values
from test_reliability_fuzz import invoke
from typer.testing import CliRunner

from planner.specs.errors import PlannerError
from runtime.ckpt import CheckpointError
from runtime.ckpt.export import export, parse_size
from runtime.ckpt.files import file_digest
from runtime.ckpt.model_layout import LAYOUT_FORMAT, parse_layout
from runtime.ckpt.safetensors_io import read_header_of

transformers = pytest.importorskip("transformers")
CHUNK_BYTES = 4096
"""Smaller than most parameters: every parameter is streamed in several chunks."""


def load(folder: Path) -> tuple[torch.nn.Module, dict[str, list]]:
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return model, {k: sorted(v) for k, v in info.items()}


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=fixed_batch()).logits


EMPTY_INFO = {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}


def check_export(checkpoint_dir: Path, out: Path, runtime_logits: list, **kwargs) -> dict:  # noqa: ANN003
    result = export(checkpoint_dir, out, chunk_bytes=CHUNK_BYTES, **kwargs)
    model, info = load(out)
    assert info == EMPTY_INFO
    torch.testing.assert_close(logits_of(model), torch.tensor(runtime_logits), rtol=0, atol=1e-5)
    sizes = [t.numel * 4 for t in (read_header_of(out / f).tensors.values() for f in result.files) for t in t]
    assert result.peak_host_bytes <= max(sizes) + CHUNK_BYTES  # one chunk at a time, never a whole model
    return {"result": result, "model": model}


def test_one_rank_export_loads_with_the_runtime_logits(tmp_path: Path) -> None:
    logits = train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"))
    done = check_export(tmp_path / "ck", tmp_path / "out", logits)
    result = done["result"]
    assert (result.step, result.dtype, result.files, result.tensors) == (2, "fp32", ["model.safetensors"], 21)
    assert result.peak_host_bytes == CHUNK_BYTES  # fp32 to fp32: the read buffer, no cast copy
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert not (tmp_path / "out.partial").exists()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["num_key_value_heads"], config["dtype"]) == ("llama", 2, "float32")
    assert config["architectures"] == ["LlamaForCausalLM"]
    from export_support import llama_config

    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM(llama_config())
    assert not torch.equal(fresh.model.embed_tokens.weight, done["model"].model.embed_tokens.weight)


def test_tied_embeddings_are_stored_once_as_transformers_expects(tmp_path: Path) -> None:
    logits = train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"), True)
    done = check_export(tmp_path / "ck", tmp_path / "out", logits)
    names = list(read_header_of(tmp_path / "out" / "model.safetensors").tensors)
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    model = done["model"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.slow
def test_two_ranks_on_cpu_and_on_nvme_export_the_gathered_model(tmp_path: Path) -> None:
    """Units split across both ranks' shards (attention biases: a weight across both, the bias in
    rank 1's), with the master weights in the host store and in NVMe swap files."""
    swap = tmp_path / "swap"
    swap.mkdir()
    cases = [(plan(ALL_CPU, world_size=2), str(tmp_path / "ck-cpu"), False, True),
             (plan(ALL_NVME, world_size=2, nvme_path=str(swap)), str(tmp_path / "ck-nvme"), False, False)]
    cpu_logits, nvme_logits = run_distributed("train_and_checkpoint", cases, tmp_path, module="export_support")
    doc = json.loads((tmp_path / "ck-cpu" / "step-000000002" / "rank-00000.json").read_text())["model"]
    q_proj = [t for t in doc["tensors"] if t["name"].startswith("model.layers.0.self_attn.q_proj.")]
    assert [(t["name"], t["segments"]) for t in q_proj] == [("model.layers.0.self_attn.q_proj.weight", [[1, 0, 4096]]),
                                                            ("model.layers.0.self_attn.q_proj.bias", [[1, 4096, 64]])]
    assert doc["units"][1]["shard_numel"] == 2080 and doc["world_size"] == 2
    check_export(tmp_path / "ck-cpu", tmp_path / "out-cpu", cpu_logits)
    check_export(tmp_path / "ck-nvme", tmp_path / "out-nvme", nvme_logits)
    masters = {u["master"].split("/")[0] for u in json.loads(
        (tmp_path / "ck-nvme" / "step-000000002" / "rank-00000.json").read_text())["model"]["units"]}
    assert masters == {"params"}  # fp32, params and optimizer states on NVMe: the param shard is the master


def test_a_small_max_shard_size_splits_the_weights_with_an_index(tmp_path: Path) -> None:
    logits = train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"))
    result = check_export(tmp_path / "ck", tmp_path / "out", logits, max_shard_bytes=parse_size("40KB"))["result"]
    assert len(result.files) > 2
    assert result.files[0] == f"model-00001-of-{len(result.files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.total_bytes == 361728
    assert sorted(set(index["weight_map"].values())) == result.files
    for name in result.files:
        header = read_header_of(tmp_path / "out" / name)
        size = sum(t.end_bytes - t.begin_bytes for t in header.tensors.values())
        assert size <= 40_000 or len(header.tensors) == 1  # a larger tensor alone in its file
        assert all(index["weight_map"][t] == name for t in header.tensors)


def test_bf16_export_is_the_master_weights_cast(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"))
    fp32 = export(tmp_path / "ck", tmp_path / "fp32", chunk_bytes=CHUNK_BYTES)
    bf16 = export(tmp_path / "ck", tmp_path / "bf16", dtype="bf16", chunk_bytes=CHUNK_BYTES)
    assert bf16.peak_host_bytes == CHUNK_BYTES + CHUNK_BYTES // 2  # the read buffer and one cast chunk
    assert (fp32.total_bytes, bf16.total_bytes) == (361728, 361728 // 2)
    full, half = load_file(tmp_path / "fp32" / "model.safetensors"), load_file(tmp_path / "bf16" / "model.safetensors")
    assert all(torch.equal(full[k].to(torch.bfloat16), half[k]) for k in full)
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    model, info = load(tmp_path / "bf16")
    assert info == EMPTY_INFO and model.dtype == torch.bfloat16


def test_refusals_are_one_line(tmp_path: Path) -> None:
    from runtime_support import build_model, plan_doc

    import runtime
    from runtime.ckpt import Checkpointer
    from runtime.plan_io import resolve_plan

    gpt = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_CPU))
    optimizer = runtime.AdamW(gpt)
    Checkpointer(tmp_path / "gpt", plan=resolve_plan(plan_doc(placement=ALL_CPU)), seed=0, rank=0, world_size=1,
                 resume=False).save(1, runtime.state_of(gpt), optimizer, scalars={})
    with pytest.raises(CheckpointError) as refused:
        export(tmp_path / "gpt", tmp_path / "out")
    assert str(refused.value) == (
        f"{tmp_path / 'gpt' / 'step-000000001'}: this checkpoint is of the built-in GPT model (GPT), not of a Hugging "
        "Face architecture; export needs a run of a Hugging Face architecture: planner run --model CONFIG")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()

    train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("mine")
    cases = [((tmp_path / "ck", tmp_path / "full"), {}, "already exists and is not an empty directory"),
             ((tmp_path / "none", tmp_path / "o"), {}, "does not exist; pass the --checkpoint-dir of a run"),
             ((tmp_path / "ck", tmp_path / "o"), {"step": 7}, "--step 7: "),
             ((tmp_path / "ck", tmp_path / "o"), {"dtype": "int8"}, "--dtype 'int8' is not one of fp32, bf16, fp16"),
             ((tmp_path / "ck", tmp_path / "no" / "o"), {}, "is not an existing directory")]
    for args, kwargs, message in cases:
        with pytest.raises(CheckpointError, match=message) as refused:
            export(*args, **kwargs)
        assert "\n" not in str(refused.value)
    assert (tmp_path / "full" / "x").read_text() == "mine"
    with pytest.raises(CheckpointError, match="'5 potatoes' is not a size"):
        parse_size("5 potatoes")
    assert (parse_size("5GB"), parse_size("2MiB"), parse_size("1000")) == (5 * 10**9, 2 << 20, 1000)


def test_a_corrupt_checkpoint_is_never_exported(tmp_path: Path) -> None:
    """Checksums are verified first: the newest checkpoint corrupt, the previous one is exported
    (with a warning); asked for by --step, it is refused."""
    train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"), save_at=(1, 2))
    newest = tmp_path / "ck" / "step-000000002" / "rank-00000.safetensors"
    raw = bytearray(newest.read_bytes())
    raw[-100] ^= 1
    newest.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="does not match its SHA-256 in the manifest"):
        export(tmp_path / "ck", tmp_path / "out", step=2)
    assert not (tmp_path / "out").exists()
    warnings: list[str] = []
    assert export(tmp_path / "ck", tmp_path / "out", warn=warnings.append).step == 1
    assert warnings == [f"skipping checkpoint {newest.parent}: {newest} does not match its SHA-256 in the manifest "
                        "(corrupt)"]
    assert load(tmp_path / "out")[1] == EMPTY_INFO


def test_planner_export_on_the_command_line(tmp_path: Path) -> None:
    from tierwise.cli import app

    logits = train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"))
    done = CliRunner().invoke(app, ["export", str(tmp_path / "ck"), "--out", str(tmp_path / "out"),
                                    "--max-shard-size", "100KB", "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert (doc["step"], doc["dtype"], len(doc["files"]), doc["tensors"]) == (2, "fp32", 4, 21)
    model, info = load(tmp_path / "out")
    assert info == EMPTY_INFO
    torch.testing.assert_close(logits_of(model), torch.tensor(logits), rtol=0, atol=1e-5)
    again = CliRunner().invoke(app, ["export", str(tmp_path / "ck"), "--out", str(tmp_path / "out")])
    assert again.exit_code != 0
    assert "already exists and is not an empty directory; choose a new folder" in str(again.exception or again.output)


def test_tiled_and_recomputed_blocks_export_under_their_own_names(tmp_path: Path) -> None:
    """Tiling splits each Linear into row blocks (`.tiles.i`) and recomputation wraps each block
    (`.block`): the export concatenates the tiles and drops the wrappers' names."""
    logits = train_and_checkpoint(plan(ALL_CPU, world_size=1, tiling_factor=2, recompute_interval=1),
                                  str(tmp_path / "ck"))
    doc = json.loads((tmp_path / "ck" / "step-000000002" / "rank-00000.json").read_text())["model"]
    (k_proj,) = [t for t in doc["tensors"] if t["name"] == "model.layers.1.self_attn.k_proj.weight"]
    assert k_proj["shape"] == [32, 64] and [s[1:] for s in k_proj["segments"]] == [[0, 1024], [0, 1024]]
    assert len(doc["units"]) > len(doc["tensors"])  # a unit per tile
    assert doc["hf_config"]["use_cache"] is False  # turned off for the recompute, on again in the export
    check_export(tmp_path / "ck", tmp_path / "out", logits)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True


LAYOUT_DOC = {"format": LAYOUT_FORMAT, "hf_config": {"model_type": "llama"}, "architecture": "LlamaForCausalLM",
              "world_size": 2, "units": [{"shard_numel": 44, "master": "optimizer_states/master:0:a", "params": "params/0:a"}],
              "tensors": [{"name": "a.weight", "shape": [8, 10], "dtype": "bfloat16", "segments": [[0, 0, 80]]},
                          {"name": "a.bias", "shape": [8], "dtype": "bfloat16", "segments": [[0, 80, 8]]}], "persistent_buffers": []}


def test_the_valid_layout_parses() -> None:
    layout = parse_layout(LAYOUT_DOC, "layout")
    assert [(t.name, t.shape, t.numel) for t in layout.tensors] == [("a.weight", (8, 10), 80), ("a.bias", (8,), 8)]
    outside = {**LAYOUT_DOC, "tensors": [{"name": "a.bias", "shape": [8], "dtype": "bfloat16", "segments": [[0, 81, 8]]}]}
    with pytest.raises(CheckpointError, match=r"layout.tensors\[0\].segments must be \[unit, offset, numel\] ranges"):
        parse_layout(outside, "layout")  # past the 2 x 44 padded elements of unit 0


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_damaged_layouts_are_one_line_errors(data: st.DataObject) -> None:
    doc = json.loads(json.dumps(LAYOUT_DOC))
    where = data.draw(st.sampled_from(["top", "units", "tensors"]))
    target = doc if where == "top" else doc[where][0]
    key = data.draw(st.sampled_from([*target, "extra"]))
    if data.draw(st.booleans()) and key in target:
        del target[key]
    else:
        target[key] = data.draw(json_values)
    try:
        parse_layout(doc, "layout")
    except PlannerError as exc:  # CheckpointError is one
        assert "\n" not in str(exc)


def test_a_model_with_persistent_buffers_is_refused(tmp_path: Path) -> None:
    """Checkpoints hold parameters; a state dict with buffers besides them cannot be exported whole."""
    train_and_checkpoint(plan(ALL_CPU, world_size=1), str(tmp_path / "ck"))
    step = tmp_path / "ck" / "step-000000002"
    doc = json.loads((step / "rank-00000.json").read_text())
    doc["model"]["persistent_buffers"] = ["model.norm.running_mean"]
    (step / "rank-00000.json").write_text(json.dumps(doc))
    manifest = json.loads((step / "MANIFEST.json").read_text())
    digest = file_digest(step / "rank-00000.json")
    manifest["files"] = [f if f["name"] != digest.name else {**f, "size_bytes": digest.size_bytes, "sha256": digest.sha256}
                         for f in manifest["files"]]
    (step / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"the model has persistent buffers \(model.norm.running_mean\) that "
                                              "training checkpoints do not hold"):
        export(tmp_path / "ck", tmp_path / "out")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("export")
    train_and_checkpoint(plan(ALL_CPU, world_size=1), str(root / "ck"))
    return root / "ck"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.one_of(st.text(max_size=12), st.sampled_from(["1", "0", "0.5KB", "3 GiB", "1e9", "-5GB", "5gb", "10XB"])),
       dtype=st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["fp32", "bf16", "fp16", "FP32"])),
       step=st.one_of(st.none(), st.integers(-3, 4)))
def test_planner_export_options_are_answered_or_refused_in_one_line(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory,
                                                                   size: str, dtype: str | None, step: int | None) -> None:
    out = tmp_path_factory.mktemp("out") / "model"
    args = ["export", str(checkpoint), "--out", str(out), "--max-shard-size", size]
    args += ["--dtype", dtype] if dtype is not None else []
    args += ["--step", str(step)] if step is not None else []
    invoke(args)
    assert not out.with_name("model.partial").exists()
