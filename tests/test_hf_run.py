"""Your Hugging Face model through `planner run`, and `--init-from` (README.md).

A tiny Llama config (GQA) goes through `fit` -> `run --model` and trains; `runtime.shard` and `run`
refuse a model that is not the plan's, in one line; `--init-from` a folder written by transformers'
`save_pretrained` (one file, sharded with an index, tied embeddings) gives the transformers model's
own logits, i.e. the weights were loaded exactly, through the Python API and through torchrun.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import runtime  # noqa: E402
from planner.specs.catalog import model_presets, published_hf_config  # noqa: E402
from planner.specs.errors import PlannerError  # noqa: E402
from planner.specs.plan import load_plan  # noqa: E402
from runtime import hf_model  # noqa: E402
from runtime.model_check import ModelMismatch, check_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SEQ, BATCH = 16, 2
TINY_LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 128,
              "max_position_embeddings": 64, "tie_word_embeddings": False, "torch_dtype": "float32"}
MISMATCH = r"plan is for 2 layers x hidden 64 \(90\.43 K params\); model has 8 layers x hidden 128 \(1\.21 M\)"


def _planner(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def _write_config(folder: Path, **changes: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps({**TINY_LLAMA, **changes}))
    return path


def _fit(config: Path, out: Path) -> Path:
    """`planner fit CONFIG` for the 2-core CPU preset (`cpu-dev-2core`), fp32, the run's batch and sequence."""
    done = _planner("fit", str(config), "--hardware", "cpu-dev-2core", "--gpus", "1", "--precision", "fp32",
                    "--seq", str(SEQ), "--batch-per-gpu", str(BATCH), "--out", str(out), "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["prediction"]["feasible"]
    return out


def _on_two_ranks(plan: Path) -> Path:
    """The plan for two processes (ZeRO-3). Not `fit --gpus 2`: the development preset has one
    "GPU" (its CPU) per node, so two are two nodes with no network figures, and fit's plan then
    predicts an infinite step, which `run` cannot read."""
    doc = json.loads(plan.read_text())
    for key in ("prediction", "num_nodes"):
        doc.pop(key, None)
    doc.update(num_gpus=2, strategy="zero3")
    out = plan.with_name("plan-2-ranks.json")
    out.write_text(json.dumps(doc))
    return out


def _transformers_model(config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def plan(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("plan")
    return _fit(_write_config(tmp / "tiny"), tmp / "plan.json")


def test_fit_plans_the_count_transformers_builds(plan: Path) -> None:
    model = _transformers_model(TINY_LLAMA)
    assert load_plan(plan).model.num_params == sum(p.numel() for p in model.parameters()) == 90_432


def test_run_model_trains_the_config_architecture(plan: Path, tmp_path: Path) -> None:
    text = tmp_path / "data.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)  # ASCII: within vocab 128
    profile = tmp_path / "profile.json"
    done = _planner("run", str(plan), "--model", str(_write_config(tmp_path / "cfg")), "--steps", "8", "--data",
                    str(text), "--profile-out", str(profile), "--no-history")
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(profile.read_text())
    losses = doc["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses
    assert doc["details"]["num_params_run"] == 90_432  # the transformers model's parameters, every one sharded


def test_run_refuses_a_model_the_plan_was_not_made_for(plan: Path, tmp_path: Path) -> None:
    other = _write_config(tmp_path / "big", num_hidden_layers=8, hidden_size=128, intermediate_size=256)
    done = _planner("run", str(plan), "--model", str(other), "--steps", "1", "--no-history")
    assert done.returncode == 1
    message = " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr
    assert re.search(MISMATCH, message), message
    assert f"planner fit {other}" in message


def test_shard_refuses_a_mismatched_model_in_one_line(plan: Path) -> None:
    big = hf_model.build_model({**TINY_LLAMA, "num_hidden_layers": 8, "hidden_size": 128, "intermediate_size": 256})
    with pytest.raises(ModelMismatch, match=MISMATCH) as info:
        runtime.shard(big, load_plan(plan))
    assert "\n" not in str(info.value)
    # A module that states no shape is compared by its count alone.
    with pytest.raises(ModelMismatch, match=r"plan is for 2 layers x hidden 64 \(90\.43 K params\); model has 4\.16 K "
                                             r"params: make a plan"):
        runtime.shard(torch.nn.Sequential(torch.nn.Linear(64, 64)), load_plan(plan))
    # Another vocabulary is named as what differs.
    with pytest.raises(ModelMismatch, match=r"vocab 128 .*; model has .*vocab 256"):
        runtime.shard(hf_model.build_model({**TINY_LLAMA, "vocab_size": 256}), load_plan(plan))


def test_run_model_preset_is_checked_against_the_plan(plan: Path) -> None:
    from tierwise.cli.run import check_hf_model, hf_model_of

    hf = hf_model_of("llama-3.1-8b", None)
    assert hf is not None and hf.config["num_hidden_layers"] == 32
    with pytest.raises(PlannerError, match=r"model has 32 layers x hidden 4096, 32 heads, vocab 128256 \(8\.03 B\): "
                                           r"make a plan for it with "
                                           r"`planner fit llama-3.1-8b`"):
        check_hf_model(hf, load_plan(plan))
    with pytest.raises(PlannerError, match="neither a config.json file nor a preset with a Hugging Face config"):
        hf_model_of("paper-0.1t", None)


def test_a_missing_hf_extra_is_named(plan: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from tierwise.cli.run import HfModel, check_hf_model

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else find_spec(name, *a))
    with pytest.raises(PlannerError, match=r"needs the hf extra \(transformers not installed\): pip install 'tierwise\[hf\]'"):
        check_hf_model(HfModel(config=TINY_LLAMA, label="tiny"), load_plan(plan))


def test_published_preset_on_the_meta_device_is_its_plans_model() -> None:
    """Llama 3.1 8B built by transformers with no memory: the shape check and the planner agree."""
    model = hf_model.build_model(published_hf_config("llama-3.1-8b"))
    assert all(p.device.type == "meta" for p in model.parameters())
    check_model(model, model_presets()["llama-3.1-8b"][0])


COUNTED = {  # transformers configs -> what the runtime counts of their models under two styles of plan
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 128, "n_positions": 32},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "intermediate_size": 128, "vocab_size": 128},
    "qwen2-tied": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128, "tie_word_embeddings": True},
    "llama": TINY_LLAMA,
}


@pytest.mark.parametrize("name", list(COUNTED))
def test_the_cli_and_runtime_count_a_model_as_its_plan_does(name: str) -> None:
    """[Note: what a spec counts]: a model from a config equals the spec made from that config; the CLI's
    count from the spec (`ModelShape.of_model_spec`) is the runtime's count of the model under a plan
    of the config's spec and under paper-style plans (no vectors; no embeddings with vocab 0)."""
    from planner.specs.hf_config import spec_from_hf_config
    from runtime.model_check import ModelShape, shape_of

    config = COUNTED[name]
    spec = spec_from_hf_config(config, name=name, where=name)
    model = hf_model.build_model(config)
    paper = spec.replace(norm="none", qkv_bias=False, attn_out_bias=False, mlp_bias=False, position_embeddings=0)
    assert shape_of(model, spec).num_params == spec.num_params == sum(p.numel() for p in model.parameters())
    for plan_spec in (spec, paper, paper.replace(vocab_size=0)):
        assert ModelShape.of_model_spec(spec, plan_spec).num_params == shape_of(model, plan_spec).num_params
    check_model(model, spec)


def test_the_reference_gpt_is_its_plans_model_with_and_without_embeddings() -> None:
    from planner.specs.model import ModelSpec
    from runtime.gpt import GPT, GPTConfig

    for vocab in (64, 0):  # vocab 0: the paper's accounting (the GPT then has 256 byte tokens, uncounted)
        spec = ModelSpec(num_layers=2, hidden_size=32, num_heads=4, seq_len=16, vocab_size=vocab)
        with torch.device("meta"):
            model = GPT(GPTConfig.from_model_spec(spec))
        check_model(model, spec)
        with pytest.raises(ModelMismatch, match=r"plan is for 3 layers x hidden 32 .*; model has 2 layers x hidden 32"):
            check_model(model, spec.replace(num_layers=3))


# -- --init-from -------------------------------------------------------------------------------

FOLDERS = {"one-file": ({}, None), "sharded-index": ({}, "100KB"), "tied": ({"tie_word_embeddings": True}, None)}


def _saved(tmp: Path, case: str) -> tuple[Path, torch.nn.Module]:
    """A folder written by `save_pretrained` (safetensors) and the transformers model that wrote it."""
    changes, shard_size = FOLDERS[case]
    model = _transformers_model({**TINY_LLAMA, **changes}, seed=7)
    folder = tmp / case
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    index = folder / hf_model.INDEX_FILE
    assert index.is_file() == (shard_size is not None)
    if shard_size:
        assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1
    return folder, model


def _batch() -> torch.Tensor:
    return torch.randint(0, TINY_LLAMA["vocab_size"], (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("case", list(FOLDERS))
def test_init_from_gives_the_transformers_models_logits(plan: Path, tmp_path: Path, case: str) -> None:
    folder, reference = _saved(tmp_path, case)
    model = hf_model.build_model(hf_model.read_config(folder / "config.json"))
    spec = load_plan(plan).model
    if case == "tied":  # the plan for the tied model: one vocab x hidden table fewer
        spec = spec.replace(tied_embeddings=True)
    model = runtime.shard(model, load_plan(plan).replace(model=spec),
                          param_init_fn=hf_model.from_safetensors(model, folder))
    tokens = _batch()
    device = runtime.state_of(model).config.device
    with torch.no_grad():
        got = model(input_ids=tokens[:, :-1].to(device), use_cache=False).logits.cpu()
        want = reference(input_ids=tokens[:, :-1], use_cache=False).logits
    assert torch.allclose(got, want, rtol=0, atol=1e-5), (got - want).abs().max()
    with torch.no_grad():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert torch.equal(loaded(input_ids=tokens[:, :-1]).logits, want)  # the folder is the reference model


def test_init_from_refuses_missing_unexpected_and_misshapen_keys(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder, _ = _saved(tmp_path, "one-file")
    weights = load_file(folder / hf_model.SINGLE_FILE)
    model = hf_model.build_model(TINY_LLAMA)

    def refused(tensors: dict[str, torch.Tensor], message: str) -> None:
        save_file(tensors, folder / hf_model.SINGLE_FILE, metadata={"format": "pt"})
        with pytest.raises(PlannerError, match=message) as info:
            hf_model.from_safetensors(model, folder)
        assert "\n" not in str(info.value)

    refused({k: v for k, v in weights.items() if k != "model.layers.1.mlp.up_proj.weight"},
            r"parameter model\.layers\.1\.mlp\.up_proj\.weight is not in the safetensors files")
    refused({**weights, "model.layers.2.mlp.up_proj.weight": weights["model.layers.1.mlp.up_proj.weight"].clone()},
            r"model\.layers\.2\.mlp\.up_proj\.weight in the safetensors files is no parameter of the model")
    refused({**weights, "model.norm.weight": torch.ones(32)},
            r"model\.norm\.weight has shape \[32\] in the files but the model's model\.norm\.weight has \[64\]")
    with pytest.raises(PlannerError, match=r"has neither model\.safetensors nor model\.safetensors\.index\.json"):
        hf_model.from_safetensors(model, tmp_path)


def _first_loss(folder: Path, plan_path: Path, world_size: int) -> float:
    """What `runtime.launch` reports as step 1's loss from `folder`'s weights: the mean over ranks of
    the loss on each rank's synthetic batch (launch.batch_for, seed 0), before any update."""
    from runtime.launch import batch_for

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    plan = load_plan(plan_path)
    with torch.no_grad():
        return sum(hf_model.causal_lm_loss(model, batch_for(1, rank, plan, TINY_LLAMA["vocab_size"], None, 0)).item()
                   for rank in range(world_size)) / world_size


@pytest.mark.slow
def test_run_init_from_a_sharded_folder_on_two_ranks_starts_from_its_weights(tmp_path: Path) -> None:
    folder, _ = _saved(tmp_path, "sharded-index")
    plan = _on_two_ranks(_fit(folder / "config.json", tmp_path / "plan.json"))
    profile = tmp_path / "profile.json"
    done = _planner("run", str(plan), "--init-from", str(folder), "--steps", "2", "--profile-out", str(profile),
                    "--no-history")
    assert done.returncode == 0, done.stderr[-3000:]
    losses = json.loads(profile.read_text())["losses"]
    assert losses[0] == pytest.approx(_first_loss(folder, plan, 2), rel=1e-5, abs=0)


def test_config_in_weights_out_through_the_cli(plan: Path, tmp_path: Path) -> None:
    """A Hugging Face user's path end to end: a config.json -> `fit` -> `run --model` (checkpointed) -> `export`
    -> `from_pretrained` loads it with empty loading info and gives the runtime's logits (the run's
    model restored from the same checkpoint) to 1e-5 in fp32; then `run --init-from` the exported
    folder starts from exactly those weights."""
    from runtime.ckpt import Checkpointer

    config = _write_config(tmp_path / "cfg")
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    done = _planner("run", str(plan), "--model", str(config), "--steps", "3", "--save-every", "3",
                    "--checkpoint-dir", str(ckpt), "--no-history")
    assert done.returncode == 0, done.stderr[-3000:]
    done = _planner("export", str(ckpt), "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}  # no missing, unexpected or mismatched key, no error

    model = runtime.shard(hf_model.build_model(json.loads(config.read_text())), load_plan(plan))
    optimizer = runtime.AdamW(model, lr=3e-4, weight_decay=0.1)
    restored = Checkpointer(ckpt, plan=load_plan(plan), seed=0, rank=0, world_size=1,
                            resume=True).restore(runtime.state_of(model), optimizer)
    assert restored is not None and restored["step"] == 3
    batch = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model(input_ids=batch).logits
        theirs = exported.eval()(input_ids=batch).logits
    optimizer.close()
    runtime.state_of(model).close()
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    fresh = _transformers_model(TINY_LLAMA)  # trained weights, not a fresh initialisation
    assert not torch.allclose(fresh(input_ids=batch).logits, theirs, atol=1e-3)

    # Weights in again: a run started from the export sees the same model at step 0.
    start = hf_model.build_model(json.loads((out / "config.json").read_text()))
    start = runtime.shard(start, load_plan(plan), param_init_fn=hf_model.from_safetensors(start, out))
    with torch.no_grad():
        torch.testing.assert_close(start(input_ids=batch).logits, theirs, rtol=0, atol=1e-5)
    runtime.state_of(start).close()


def test_a_position_table_as_long_as_the_vocabulary_is_not_the_token_table() -> None:
    """The reference GPT with seq_len == vocab_size (a probe's reference run) has two 256-row tables:
    only the first (the tokens') is what a paper-style spec counts."""
    from planner.specs.model import ModelSpec
    from runtime.gpt import GPT, GPTConfig

    spec = ModelSpec(name="seq-is-vocab", num_layers=3, hidden_size=448, num_heads=7, seq_len=256, vocab_size=256)
    with torch.device("meta"):
        model = GPT(GPTConfig.from_model_spec(spec))
    check_model(model, spec)  # 7.34 M either way; counting the position table too gave 7.45 M and a refusal
