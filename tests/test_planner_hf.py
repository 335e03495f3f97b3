"""Hugging Face configs in: the planner's count is the one transformers builds (planner/specs/hf_config.py).

The reference is transformers itself: each config is built with `AutoModelForCausalLM.from_config`
on the meta device (no memory) and its parameters summed (tied weights once). The published configs
are tests/data/hf_configs.json, each with its `hf_repo` and the `source` it was read from.
"""

import copy
import json
from pathlib import Path

import pytest

from planner.specs import hf_known_keys
from planner.specs.catalog import model_notes, model_presets, published_presets, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.hf_config import HF_MAX_SEQ_LEN, is_hf_config, notes, spec_from_hf_config
from planner.specs.model import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PUBLISHED = json.loads((Path(__file__).parent / "data" / "hf_configs.json").read_text())["models"]
DATA_MODELS = Path(__file__).resolve().parent.parent / "data" / "models"


def transformers_count(cfg: dict) -> int:
    """Parameters of the model transformers builds from `cfg` (meta device: shapes only)."""
    # A deep copy: transformers rewrites nested values (rope_scaling) of the dict it is given.
    kwargs = {k: v for k, v in copy.deepcopy(cfg).items() if k != "model_type"}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **kwargs)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def planner_count(cfg: dict) -> int:
    return spec_from_hf_config(cfg, name="test", where="test").num_params


@pytest.mark.parametrize("entry", PUBLISHED, ids=[m["name"] for m in PUBLISHED])
def test_every_published_config_counts_what_transformers_builds(entry):
    assert planner_count(entry["config"]) == transformers_count(entry["config"])


def test_pythia_matches_its_model_card_exactly():
    # The only publisher figure that is exact, not rounded (Pythia model card: 6,857,302,016).
    pythia = next(m for m in PUBLISHED if m["hf_repo"] == "EleutherAI/pythia-6.9b")
    assert planner_count(pythia["config"]) == pythia["stated_params"] == 6_857_302_016


# Small configs that exercise each default and switch the published ones leave untouched.
TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": 100,
        "pad_token_id": 0}
VARIANTS = {
    "llama biases, tied, head_dim apart": {"model_type": "llama", **TINY, "num_key_value_heads": 2, "attention_bias": True,
                                           "mlp_bias": True, "tie_word_embeddings": True, "head_dim": 32},
    "llama without kv heads (MHA)": {"model_type": "llama", **TINY},
    "llama head_dim null": {"model_type": "llama", **TINY, "head_dim": None, "num_key_value_heads": None},
    "mistral default kv heads 8": {"model_type": "mistral", **TINY, "num_attention_heads": 8},
    "qwen2 q/k/v bias, tied": {"model_type": "qwen2", **TINY, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "gemma default head_dim 256, tied": {"model_type": "gemma", **TINY, "num_key_value_heads": 1},
    "gemma attention bias": {"model_type": "gemma", **TINY, "num_key_value_heads": 4, "attention_bias": True},
    "gemma2 four norms, default kv 4": {"model_type": "gemma2", **TINY, "head_dim": 16},
    "phi3 fused projections, GQA": {"model_type": "phi3", **TINY, "num_key_value_heads": 2},
    "olmo2 q/k norms, GQA, bias": {"model_type": "olmo2", **TINY, "num_key_value_heads": 2, "attention_bias": True},
    "gpt2 n_inner, untied": {"model_type": "gpt2", "n_embd": 64, "n_layer": 3, "n_head": 4, "n_inner": 80,
                             "n_positions": 128, "vocab_size": 100, "tie_word_embeddings": False},
    "gpt2 defaults": {"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 2, "vocab_size": 50},
    "neox no attention bias, tied": {"model_type": "gpt_neox", **TINY, "attention_bias": False,
                                     "tie_word_embeddings": True, "rotary_pct": 0.5},
    "neox defaults": {"model_type": "gpt_neox", **TINY},
}


@pytest.mark.parametrize("cfg", VARIANTS.values(), ids=VARIANTS.keys())
def test_defaults_and_switches_count_what_transformers_builds(cfg):
    assert planner_count(cfg) == transformers_count(cfg)


def _transformers_config_for(spec: ModelSpec) -> dict:
    """The transformers config of a preset in the planner's own form: Llama for gated MLPs, Nemotron for
    a rotary model with an ungated MLP and no biases, GPT-2 else."""
    if not spec.gated_mlp and spec.rotary and not spec.qkv_bias:
        return {"model_type": "nemotron", "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
                "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                "intermediate_size": spec.ffn_hidden_size, "vocab_size": spec.vocab_size,
                "tie_word_embeddings": spec.tied_embeddings, "head_dim": spec.hidden_size // spec.num_heads}
    if spec.gated_mlp:
        return {"model_type": "llama", "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
                "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
                "intermediate_size": spec.ffn_hidden_size, "vocab_size": spec.vocab_size,
                "tie_word_embeddings": spec.tied_embeddings, "head_dim": spec.head_dim}
    return {"model_type": "gpt2", "n_embd": spec.hidden_size, "n_layer": spec.num_layers, "n_head": spec.num_heads,
            "n_inner": spec.ffn_hidden_size, "vocab_size": spec.vocab_size, "n_positions": spec.position_embeddings,
            "tie_word_embeddings": spec.tied_embeddings}


def _preset_docs() -> dict[str, dict]:
    return {d["name"]: d for path in sorted(DATA_MODELS.glob("*.json")) for d in json.loads(path.read_text())["models"]}


@pytest.mark.parametrize("name", sorted(model_presets()))
def test_every_bundled_preset_counts_what_transformers_builds(name):
    spec = model_presets()[name][0]
    doc = _preset_docs()[spec.name]
    if "hf_config" in doc:
        assert spec.num_params == transformers_count(doc["hf_config"])
    elif spec.vocab_size == 0:
        # The paper's configurations: eq. 1 by definition (no embeddings, norms or biases to build).
        assert spec.num_params == spec.num_params_eq1 and spec.norm == "none"
    else:
        assert spec.num_params == transformers_count(_transformers_config_for(spec))


def test_published_presets_cite_their_config_and_keep_the_published_shape():
    names = {p.name for p in published_presets()}
    assert names == {"llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b",
                     "qwen2.5-72b", "mistral-7b-v0.3"}
    by_repo = {m["hf_repo"]: m["config"] for m in PUBLISHED}
    for name, doc in _preset_docs().items():
        if "hf_config" in doc:
            repo = doc["source"].removeprefix("https://huggingface.co/").removesuffix("/blob/main/config.json")
            assert doc["hf_config"] == by_repo[repo], name
    qwen = resolve_model("qwen2.5-7b")
    assert (qwen.num_layers, qwen.hidden_size, qwen.num_heads, qwen.num_kv_heads, qwen.ffn_hidden_size) == (
        28, 3584, 28, 4, 18944)
    assert qwen.qkv_bias and not qwen.attn_out_bias and qwen.seq_len == HF_MAX_SEQ_LEN


def _write(tmp_path: Path, cfg: dict, name: str = "config.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


def test_a_config_file_resolves_as_model(tmp_path):
    gpt2 = next(m["config"] for m in PUBLISHED if m["hf_repo"] == "openai-community/gpt2")
    spec = resolve_model(_write(tmp_path, gpt2))
    assert spec.num_params == 124_439_808 and spec.seq_len == 1024
    assert spec.name.endswith("config.json (gpt2)")
    llama = next(m["config"] for m in PUBLISHED if m["hf_repo"] == "meta-llama/Llama-3.1-8B")
    spec = resolve_model(_write(tmp_path, llama), seq=2048)
    assert spec.num_params == 8_030_261_248 and spec.seq_len == 2048
    qwen = next(m["config"] for m in PUBLISHED if m["hf_repo"] == "Qwen/Qwen2.5-72B")
    capped = resolve_model(_write(tmp_path, qwen), seq=256)
    assert capped.name.endswith("config.json (qwen2)") and capped.seq_len == 256  # the sequence is not in the name


def test_our_own_model_form_is_still_read(tmp_path):
    doc = {"name": "mine", "num_layers": 2, "hidden_size": 128, "num_heads": 2, "vocab_size": 1000}
    assert not is_hf_config(doc)
    assert resolve_model(_write(tmp_path, doc, "m.json")).num_params == 2 * 12 * 128**2 + 1000 * 128


@pytest.mark.parametrize(
    "cfg,message",
    [
        ({"model_type": "mixtral", **TINY}, "model_type 'mixtral' is not supported; dense decoders only"),
        ({"num_hidden_layers": 2, "hidden_size": 64}, "needs 'model_type'"),
        ({"model_type": "llama", **TINY, "intermediate_size": None}, "no 'intermediate_size'"),
        ({"model_type": "llama", **TINY, "hidden_size": "64"}, "hidden_size must be a number"),
        ({"model_type": "llama", **TINY, "num_hidden_layers": 0}, "num_hidden_layers must be at least 1"),
        ({"model_type": "llama", **TINY, "tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"model_type": "llama", **TINY, "num_key_value_heads": 3}, "not divisible by num_kv_heads 3"),
        ({"model_type": "gpt2", "n_embd": 64, "n_layer": 1, "n_head": 2, "vocab_size": 50, "add_cross_attention": True},
         "add_cross_attention"),
    ],
)
def test_bad_configs_are_one_line_errors(tmp_path, cfg, message):
    with pytest.raises(PlannerError, match=message):
        resolve_model(_write(tmp_path, cfg))


def test_the_bundled_known_keys_are_what_transformers_reports():
    own, generic = hf_known_keys.generate()
    assert frozenset(generic) == hf_known_keys.GENERIC_KEYS
    assert {model_type: frozenset(keys) for model_type, keys in own.items()} == hf_known_keys.KNOWN_KEYS


@pytest.mark.parametrize("entry", PUBLISHED, ids=[m["name"] for m in PUBLISHED])
def test_every_published_config_reads_without_a_warning(entry):
    assert notes(entry["config"], "config.json").warnings == ()


def test_every_bundled_preset_config_reads_without_a_warning():
    configs = [d["hf_config"] for d in _preset_docs().values() if "hf_config" in d]
    assert configs and all(notes(cfg, "config.json").warnings == () for cfg in configs)


QWEN_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
            "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
            "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rope_theta": 1000000.0,
            "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
            "transformers_version": "4.40.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936}


def _misspelled(cfg: dict, key: str, wrong: str) -> dict:
    return {(wrong if k == key else k): v for k, v in cfg.items()}


@pytest.mark.parametrize("key,wrong", [("tie_word_embeddings", "tie_word_embedding"),
                                       ("num_key_value_heads", "num_key_value_head"),
                                       ("intermediate_size", "intermediate_sizes")])
def test_a_misspelled_key_the_plan_reads_is_named(tmp_path, key, wrong):
    """Qwen2.5-0.5B's config: `tie_word_embedding` would plan 630 M params instead of 494 M, and
    `num_key_value_head` would fail on transformers' default of 32 kv heads, naming neither."""
    assert resolve_model(_write(tmp_path, QWEN_05B)).num_params == 494_032_768
    with pytest.raises(PlannerError) as error:
        resolve_model(_write(tmp_path, _misspelled(QWEN_05B, key, wrong)))
    assert f"unknown key {wrong!r} in model file" in str(error.value)
    assert f"(qwen2): did you mean {key!r}?" in str(error.value)
    assert "divisible" not in str(error.value)


def test_an_unknown_key_that_does_not_change_the_plan_is_a_warning(tmp_path):
    cfg = {**_misspelled(QWEN_05B, "rope_theta", "rope_thetta"), "my_own_note": "kept"}
    path = _write(tmp_path, cfg)
    assert resolve_model(path).num_params == 494_032_768
    lines = model_notes(path)
    assert f"warning: unknown key 'rope_thetta' in model file {path} (qwen2): did you mean 'rope_theta'? Ignored" in lines
    assert f"warning: unknown key 'my_own_note' in model file {path} (qwen2) ignored" in lines


def test_defaults_that_set_the_plan_are_said_as_assumed(tmp_path):
    bare = {k: v for k, v in QWEN_05B.items() if k not in ("tie_word_embeddings", "num_key_value_heads")}
    path = _write(tmp_path, bare)
    lines = model_notes(path)
    where = f"model file {path} (qwen2)"
    assert f"{where}: assumed tie_word_embeddings=false (qwen2's default; the config does not state it)" in lines
    assert f"{where}: assumed num_key_value_heads=32 (qwen2's default; the config does not state it)" in lines
    assert any(line.startswith(f"{where}: assumed seq 8192: the config's context is 32768 tokens") for line in lines)
    assert not any("assumed seq" in line for line in model_notes(path, seq_given=True))
    llama = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}
    lines = notes({"model_type": "llama", **llama}, "config.json").assumed
    assert "config.json (llama): assumed num_key_value_heads = num_attention_heads (llama's default; the config " \
           "does not state it)" in lines
    assert any("assumed seq 1024 (the config states no max_position_embeddings)" in line for line in lines)
