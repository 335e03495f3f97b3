"""A Hugging Face `config.json` -> the planner's ModelSpec, for dense decoder models.

The count must be the one transformers builds (`AutoModelForCausalLM.from_config`, summed numel with
tied weights once; tests/test_planner_hf.py builds every supported family on the meta device). So
each family reads the keys its transformers modeling file reads, with the defaults its config class
applies when a key is absent (transformers 4.4x-5.x agree on these):

| model_type | attention biases | MLP biases | norms per block | tied by default | absent head_dim | absent kv heads |
|---|---|---|---|---|---|---|
| llama | q,k,v,o if `attention_bias` | if `mlp_bias` | 2 RMSNorm | no | hidden/heads | heads |
| mistral | none | none | 2 RMSNorm | no | hidden/heads | 8 |
| qwen2 | q,k,v always | none | 2 RMSNorm | no | hidden/heads | 32 |
| gemma | q,k,v,o if `attention_bias` | none | 2 RMSNorm | yes | 256 | 16 |
| gemma2 | q,k,v,o if `attention_bias` | none | 4 RMSNorm | yes | 256 | 4 |
| phi3 | none (fused qkv) | none (fused gate/up) | 2 RMSNorm | no | hidden/heads | heads |
| olmo2 | q,k,v,o if `attention_bias`; RMSNorm over q and k | none | 2 RMSNorm | no | hidden/heads | heads |
| gpt2 | all (Conv1D) | all | 2 LayerNorm, learned positions | yes | - | - |
| gpt_neox | qkv,dense if `attention_bias` (default on) | all | 2 LayerNorm | no | - | - |

Every family adds one final norm. Keys that do not change the count (rope, dropout, sliding window,
`rotary_pct`, token ids) are ignored. Other model types (mixture-of-experts, encoder-decoder,
vision) are refused by name rather than counted wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.model import ModelSpec
from planner.specs.specio import number

# [Note: planned sequence] A config states the longest context the model serves
# (`max_position_embeddings`; for a long-context extension its `rope_scaling` keeps the pre-training
# length as `original_max_position_embeddings`), not the length one trains at. Planning at 128K tokens
# would make activations dwarf everything, so `seq_len` is that context capped at HF_MAX_SEQ_LEN, 8192
# (Llama 3's pre-training length); `--seq` overrides, and the spec's name says when the cap applied.
# A config without the key plans at the planner's default, 1024.
HF_MAX_SEQ_LEN = 8192
"""The longest sequence a Hugging Face config is planned at ([Note: planned sequence])."""

# model_type -> (defaults transformers' config class applies to count-relevant keys, fixed traits).
_LLAMA_LIKE: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "llama": ({"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}, {}),
    "mistral": ({"num_key_value_heads": 8, "tie_word_embeddings": False}, {"attention_bias": False}),
    "qwen2": ({"num_key_value_heads": 32, "tie_word_embeddings": False}, {"qkv_bias": True, "attention_bias": False}),
    "gemma": ({"attention_bias": False, "tie_word_embeddings": True, "head_dim": 256, "num_key_value_heads": 16}, {}),
    "gemma2": ({"attention_bias": False, "tie_word_embeddings": True, "head_dim": 256, "num_key_value_heads": 4},
               {"norms_per_block": 4}),
    "phi3": ({"tie_word_embeddings": False}, {"attention_bias": False}),
    "olmo2": ({"attention_bias": False, "tie_word_embeddings": False}, {"qk_norm": True}),
}
SUPPORTED_MODEL_TYPES = (*_LLAMA_LIKE, "gpt2", "gpt_neox")
_HF_MARKERS = ("model_type", "architectures", "num_hidden_layers", "n_layer", "n_embd")


def is_hf_config(doc: Mapping[str, Any]) -> bool:
    """True for a Hugging Face config (its own keys), False for the planner's model document."""
    return isinstance(doc, Mapping) and "num_layers" not in doc and any(k in doc for k in _HF_MARKERS)


def spec_from_hf_config(cfg: Mapping[str, Any], *, name: str, where: str, source: str = "") -> ModelSpec:
    """The spec whose `num_params` is what transformers builds from `cfg`."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str):
        raise PlannerError(f"{where}: a Hugging Face config needs 'model_type' (e.g. llama, qwen2, gpt2); it has none")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PlannerError(
            f"{where}: model_type {model_type!r} is not supported; dense decoders only: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type == "gpt2":
        fields = _gpt2_fields(cfg, where)
    elif model_type == "gpt_neox":
        fields = _neox_fields(cfg, where)
    else:
        fields = _llama_like_fields(cfg, model_type, where)
    seq_len = min(context_len(cfg, where), HF_MAX_SEQ_LEN)
    return ModelSpec(name=name, seq_len=seq_len, source=source, **fields)


def describe(label: str, cfg: Mapping[str, Any], where: str) -> str:
    """The name a config file's spec carries: the file, its family and, when capped, the planned length."""
    context = context_len(cfg, where)
    capped = f"; context {context}, planned at seq {HF_MAX_SEQ_LEN}" if context > HF_MAX_SEQ_LEN else ""
    return f"{label} ({cfg.get('model_type')}{capped})"


def _llama_like_fields(cfg: Mapping[str, Any], model_type: str, where: str) -> dict[str, Any]:
    defaults, traits = _LLAMA_LIKE[model_type]
    heads = _whole(cfg, "num_attention_heads", where)
    hidden = _whole(cfg, "hidden_size", where)
    attention_bias = traits.get("attention_bias", _flag(cfg, "attention_bias", defaults, where))
    return {
        "num_layers": _whole(cfg, "num_hidden_layers", where),
        "hidden_size": hidden,
        "num_heads": heads,
        "num_kv_heads": _whole(cfg, "num_key_value_heads", where, default=defaults.get("num_key_value_heads", heads)),
        "head_dim": _whole(cfg, "head_dim", where, default=defaults.get("head_dim", 0)),
        "ffn_hidden_size": _whole(cfg, "intermediate_size", where),
        "vocab_size": _whole(cfg, "vocab_size", where),
        "gated_mlp": True,
        "tied_embeddings": _flag(cfg, "tie_word_embeddings", defaults, where),
        "qkv_bias": traits.get("qkv_bias", attention_bias),
        "attn_out_bias": attention_bias,
        "mlp_bias": _flag(cfg, "mlp_bias", defaults, where) if "mlp_bias" in defaults else False,
        "norm": "rmsnorm",
        "norms_per_block": traits.get("norms_per_block", 2),
        "qk_norm": traits.get("qk_norm", False),
    }


def _gpt2_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    if cfg.get("add_cross_attention"):
        raise PlannerError(f"{where}: add_cross_attention is an encoder-decoder block; only decoder-only GPT-2 is supported")
    hidden = _whole(cfg, "n_embd", where)
    return {
        "num_layers": _whole(cfg, "n_layer", where),
        "hidden_size": hidden,
        "num_heads": _whole(cfg, "n_head", where),
        "ffn_hidden_size": _whole(cfg, "n_inner", where, default=4 * hidden),
        "vocab_size": _whole(cfg, "vocab_size", where),
        "tied_embeddings": _flag(cfg, "tie_word_embeddings", {"tie_word_embeddings": True}, where),
        "qkv_bias": True,
        "attn_out_bias": True,
        "mlp_bias": True,
        "norm": "layernorm",
        "position_embeddings": _whole(cfg, "n_positions", where, default=1024),
    }


def _neox_fields(cfg: Mapping[str, Any], where: str) -> dict[str, Any]:
    attention_bias = _flag(cfg, "attention_bias", {"attention_bias": True}, where)
    return {
        "num_layers": _whole(cfg, "num_hidden_layers", where),
        "hidden_size": _whole(cfg, "hidden_size", where),
        "num_heads": _whole(cfg, "num_attention_heads", where),
        "ffn_hidden_size": _whole(cfg, "intermediate_size", where),
        "vocab_size": _whole(cfg, "vocab_size", where),
        "tied_embeddings": _flag(cfg, "tie_word_embeddings", {"tie_word_embeddings": False}, where),
        "qkv_bias": attention_bias,
        "attn_out_bias": attention_bias,
        "mlp_bias": True,
        "norm": "layernorm",
    }


def context_len(cfg: Mapping[str, Any], where: str) -> int:
    """The context [Note: planned sequence] starts from."""
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, Mapping) and scaling.get("original_max_position_embeddings") is not None:
        return _whole(scaling, "original_max_position_embeddings", f"{where} rope_scaling")
    key = "n_positions" if cfg.get("model_type") == "gpt2" else "max_position_embeddings"
    return _whole(cfg, key, where, default=ModelSpec.__dataclass_fields__["seq_len"].default)


def _whole(cfg: Mapping[str, Any], key: str, where: str, *, default: int | None = None) -> int:
    """A positive whole number; `default` when the key is absent or null (as transformers treats None)."""
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise PlannerError(f"{where}: the config has no {key!r}, which sets the parameter count")
        return default
    return int(number(value, f"{where} {key}", minimum=1, maximum=10**9, integer=True))


def _flag(cfg: Mapping[str, Any], key: str, defaults: Mapping[str, Any], where: str) -> bool:
    value = cfg.get(key, defaults.get(key, False))
    if not isinstance(value, bool):
        raise PlannerError(f"{where} {key} must be true or false, got {value!r}")
    return value
