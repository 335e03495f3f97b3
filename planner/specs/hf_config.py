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
vision) are refused by name rather than counted wrongly. Unknown keys: [Note: strict keys].
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.hf_known_keys import GENERIC_KEYS, KNOWN_KEYS, LEGACY_KEYS
from planner.specs.model import ModelSpec
from planner.specs.specio import number

# [Note: planned sequence] A config states the longest context the model serves
# (`max_position_embeddings`; for a long-context extension its `rope_scaling` keeps the pre-training
# length as `original_max_position_embeddings`), not the length one trains at. Planning at 128K tokens
# would make activations dwarf everything, so `seq_len` is that context capped at HF_MAX_SEQ_LEN, 8192
# (Llama 3's pre-training length); `--seq` overrides, and `notes` says which length was assumed.
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
_LLAMA_PLAN_KEYS = frozenset({"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                              "head_dim", "intermediate_size", "vocab_size", "tie_word_embeddings", "attention_bias",
                              "mlp_bias", "max_position_embeddings", "rope_scaling"})
PLAN_KEYS: dict[str, frozenset[str]] = {
    **dict.fromkeys(_LLAMA_LIKE, _LLAMA_PLAN_KEYS),
    "gpt2": frozenset({"n_layer", "n_embd", "n_head", "n_inner", "vocab_size", "tie_word_embeddings", "n_positions",
                       "add_cross_attention"}),
    "gpt_neox": frozenset({"num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size",
                           "tie_word_embeddings", "attention_bias", "max_position_embeddings", "rope_scaling"}),
}
"""The keys each family's spec reads ([Note: strict keys]): a misspelling of one of them is an error."""
# [Note: strict keys] A key transformers does not know for the config's model_type
# (planner/specs/hf_known_keys.py) is reported with the nearest known key. It is an error when that
# nearest key is one the plan reads (PLAN_KEYS: the count and the sequence) and the config lacks it:
# `tie_word_embedding` would otherwise plan with the family's default for `tie_word_embeddings`, a
# different parameter count, without a word. Any other unknown key is a warning (`notes`), since
# transformers keeps unknown keys as attributes and real configs carry some. `notes` also says which
# plan-relevant defaults were assumed because the config does not state them.
SIMILARITY = 0.8
"""difflib's ratio from which an unknown key is taken for a misspelling of a known one."""


@dataclass(frozen=True, slots=True)
class ConfigNotes:
    """What reading a config said beside its spec: unknown keys ignored, plan defaults assumed."""

    warnings: tuple[str, ...] = ()
    assumed: tuple[str, ...] = ()

    def lines(self) -> tuple[str, ...]:
        return (*(f"warning: {w}" for w in self.warnings), *self.assumed)


def is_hf_config(doc: Mapping[str, Any]) -> bool:
    """True for a Hugging Face config (its own keys), False for the planner's model document."""
    return isinstance(doc, Mapping) and "num_layers" not in doc and any(k in doc for k in _HF_MARKERS)


def spec_from_hf_config(cfg: Mapping[str, Any], *, name: str, where: str, source: str = "") -> ModelSpec:
    """The spec whose `num_params` is what transformers builds from `cfg`."""
    model_type = cfg.get("model_type")
    _supported(model_type, where)
    unknown_key_warnings(cfg, model_type, where)  # a misspelled plan key stops here, named
    if model_type == "gpt2":
        fields = _gpt2_fields(cfg, where)
    elif model_type == "gpt_neox":
        fields = _neox_fields(cfg, where)
    else:
        fields = _llama_like_fields(cfg, model_type, where)
    seq_len = min(context_len(cfg, where), HF_MAX_SEQ_LEN)
    return ModelSpec(name=name, seq_len=seq_len, source=source, **fields)


def _supported(model_type: Any, where: str) -> None:
    if not isinstance(model_type, str):
        raise PlannerError(f"{where}: a Hugging Face config needs 'model_type' (e.g. llama, qwen2, gpt2); it has none")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise PlannerError(
            f"{where}: model_type {model_type!r} is not supported; dense decoders only: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def describe(label: str, cfg: Mapping[str, Any], where: str) -> str:
    """The name a config file's spec carries: the file and its family (the planned sequence is the
    spec's own `seq_len`, said by `notes` and shown in a column of its own, not in the name)."""
    return f"{label} ({cfg.get('model_type')})"


def known_keys(model_type: str) -> frozenset[str]:
    """Every key transformers knows for `model_type`, the planner's own keys included."""
    return KNOWN_KEYS[model_type] | GENERIC_KEYS | LEGACY_KEYS | PLAN_KEYS[model_type]


def unknown_key_warnings(cfg: Mapping[str, Any], model_type: str, where: str) -> list[str]:
    """One warning per key transformers does not know for `model_type`, with the nearest known key;
    a PlannerError for a misspelled key the plan reads ([Note: strict keys])."""
    known = known_keys(model_type)
    out = []
    for key in cfg:
        if key in known:
            continue
        match = difflib.get_close_matches(key, sorted(known), n=1, cutoff=SIMILARITY)
        said = f"unknown key {key!r} in {where} ({model_type})"
        if match and match[0] in PLAN_KEYS[model_type] and match[0] not in cfg:
            raise PlannerError(f"{said}: did you mean {match[0]!r}? It sets the plan (the parameter count or the "
                               f"sequence); fix the key, or the planner would assume {model_type}'s default")
        out.append(f"{said}: did you mean {match[0]!r}? Ignored" if match else f"{said} ignored")
    return out


def notes(cfg: Mapping[str, Any], where: str, *, seq_given: bool = False) -> ConfigNotes:
    """The unknown keys a config carries and the plan-relevant defaults it leaves to the family
    (tied embeddings, kv heads, head width, the sequence unless `seq_given`): what `planner fit`
    prints to stderr beside the plan. Raises as `spec_from_hf_config` does."""
    model_type = cfg.get("model_type")
    _supported(model_type, where)
    warnings = unknown_key_warnings(cfg, model_type, where)
    defaults = _LLAMA_LIKE[model_type][0] if model_type in _LLAMA_LIKE else {"tie_word_embeddings": model_type == "gpt2"}
    assumed = [f"{where} ({model_type}): assumed {key}={_shown(value)} ({model_type}'s default; the config does not "
               "state it)" for key, value in defaults.items()
               if key in ("tie_word_embeddings", "head_dim", "num_key_value_heads") and cfg.get(key) is None]
    if model_type in _LLAMA_LIKE and "num_key_value_heads" not in defaults and cfg.get("num_key_value_heads") is None:
        assumed.append(f"{where} ({model_type}): assumed num_key_value_heads = num_attention_heads "
                       f"({model_type}'s default; the config does not state it)")
    if not seq_given:
        assumed.append(f"{where} ({model_type}): {_sequence_note(cfg, where)}; --seq S plans another length")
    return ConfigNotes(warnings=tuple(warnings), assumed=tuple(assumed))


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _sequence_note(cfg: Mapping[str, Any], where: str) -> str:
    key = "n_positions" if cfg.get("model_type") == "gpt2" else "max_position_embeddings"
    context = context_len(cfg, where)
    if cfg.get(key) is None and not isinstance(cfg.get("rope_scaling"), Mapping):
        return f"assumed seq {context} (the config states no {key})"
    if context > HF_MAX_SEQ_LEN:
        return f"assumed seq {HF_MAX_SEQ_LEN}: the config's context is {context} tokens, planned at most at {HF_MAX_SEQ_LEN}"
    return f"assumed seq {context} (the config's context)"


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
