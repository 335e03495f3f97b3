"""The Transformer being planned: its shape, parameter counts and operators.

Counts follow docs/method.md §2: eq. 1 counts the four block linears only (`12 * nl * hd^2` for a GPT
block: hd x 3hd, hd x hd, hd x 4hd, 4hd x hd); `num_params` adds the embeddings (and grouped-query
attention and gated MLPs, for Llama-like models). The paper's configurations ship with
`vocab_size = 0` because the paper ignores embeddings; their `num_params` is then exactly eq. 1.

[Note: exact counts] Published architectures also train biases, norm weights and learned position
embeddings. The fields that add them (`qkv_bias`, `attn_out_bias`, `mlp_bias`, `norm`,
`norms_per_block`, `qk_norm`, `position_embeddings`, and `head_dim` where heads x head_dim is not the
width) default to "none", so a spec that does not set them counts exactly as before; a spec made from
a Hugging Face config sets them and then counts what transformers builds (tests/test_planner_hf.py).
Operators stay the weights of the block linears: biases and norms are vectors, counted in
`num_params` but never the largest allocation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.specio import check_keys, number, string

MAX_LAYERS = 100_000
MAX_HIDDEN = 10_000_000
MAX_SEQ = 100_000_000
NORMS = ("none", "rmsnorm", "layernorm")
NORM_PARAMS_PER_ELEMENT = {"none": 0, "rmsnorm": 1, "layernorm": 2}
"""Trained values per normalised element: RMSNorm a weight, LayerNorm a weight and a bias."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Operator:
    """One linear of the model as the runtime gathers it: its weight is `in_features x out_features`."""

    name: str
    """Where it sits in a block (`qkv`, `attn_out`, `mlp_up`, `mlp_gate`, `mlp_down`) or `embedding`."""
    num_params: int
    """Weight elements (biases ignored, as in eq. 1)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A GPT- or Llama-like decoder. Every count is derived from these fields."""

    name: str = "custom"
    """Preset name or a description of how the shape was chosen."""
    num_layers: int
    """Transformer blocks (`nl`)."""
    hidden_size: int
    """Model width (`hd`)."""
    num_heads: int
    """Attention heads (`heads`, eq. 5)."""
    seq_len: int = 1024
    """Sequence length in tokens (`seq`); the paper uses 1024."""
    vocab_size: int = 0
    """Embedding rows; 0 ignores embeddings, as the paper's equations do."""
    ffn_hidden_size: int = 0
    """MLP inner width; 0 means the GPT default `4 * hidden_size`."""
    num_kv_heads: int = 0
    """Key/value heads for grouped-query attention; 0 means `num_heads` (plain multi-head)."""
    gated_mlp: bool = False
    """SwiGLU-style MLP with separate gate and up projections (Llama)."""
    tied_embeddings: bool = True
    """Input embedding and output projection share one matrix."""
    head_dim: int = 0
    """Width of one attention head; 0 means `hidden_size / num_heads` (Gemma sets it apart)."""
    qkv_bias: bool = False
    """Query, key and value projections have biases (GPT-2, GPT-NeoX, Qwen2)."""
    attn_out_bias: bool = False
    """The attention output projection has a bias (GPT-2, GPT-NeoX)."""
    mlp_bias: bool = False
    """Every MLP linear has a bias (GPT-2, GPT-NeoX)."""
    norm: str = "none"
    """`rmsnorm`, `layernorm` (weight and bias) or `none` (the paper's count, no norm weights)."""
    norms_per_block: int = 2
    """Norms over the width in one block (Gemma 2 has 4); plus one final norm, when `norm` is set."""
    qk_norm: bool = False
    """RMSNorm over the whole query and key projections (OLMo 2)."""
    position_embeddings: int = 0
    """Rows of a learned position embedding (GPT-2's `n_positions`); 0 for rotary or none."""
    rotary: bool = False
    """Rotary position embeddings rotate queries and keys in every block (Llama): a memory-bound
    kernel (planner/cost/kernels.py), no weights."""
    dropout: bool = False
    """The blocks train with dropout (hidden and attention, p > 0, as GPT-2 and Megatron-LM's
    defaults): memory-bound kernels and their masks (planner/cost/kernels.py); LLM pre-training
    recipes (Llama, MPT) set it to 0."""
    attention: str = ""
    """The attention kernel the model's source trained with, pinning the plan's (`eager` for the
    paper's configurations, whose eq. 5 bills the stored scores); empty leaves the plan's default,
    flash where the GPU has it (planner/specs/plan.py `Plan.attention`)."""
    source: str = field(default="", compare=False)
    """Citation for presets (where the shape comes from)."""

    def __post_init__(self) -> None:
        where = f"model {self.name!r}"
        number(self.num_layers, f"{where} num_layers", minimum=1, maximum=MAX_LAYERS, integer=True)
        number(self.hidden_size, f"{where} hidden_size", minimum=1, maximum=MAX_HIDDEN, integer=True)
        number(self.num_heads, f"{where} num_heads", minimum=1, maximum=MAX_HIDDEN, integer=True)
        number(self.seq_len, f"{where} seq_len", minimum=1, maximum=MAX_SEQ, integer=True)
        number(self.vocab_size, f"{where} vocab_size", minimum=0, maximum=MAX_SEQ, integer=True)
        number(self.ffn_hidden_size, f"{where} ffn_hidden_size", minimum=0, maximum=4 * MAX_HIDDEN, integer=True)
        number(self.num_kv_heads, f"{where} num_kv_heads", minimum=0, maximum=MAX_HIDDEN, integer=True)
        number(self.head_dim, f"{where} head_dim", minimum=0, maximum=MAX_HIDDEN, integer=True)
        number(self.norms_per_block, f"{where} norms_per_block", minimum=0, maximum=16, integer=True)
        number(self.position_embeddings, f"{where} position_embeddings", minimum=0, maximum=MAX_SEQ, integer=True)
        string(self.norm, f"{where} norm", choices=NORMS)
        string(self.attention, f"{where} attention", choices=("", "flash", "eager"))
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise PlannerError(
                f"{where}: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise PlannerError(f"{where}: num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        for flag in ("gated_mlp", "tied_embeddings", "qkv_bias", "attn_out_bias", "mlp_bias", "qk_norm", "rotary",
                     "dropout"):
            if not isinstance(getattr(self, flag), bool):
                raise PlannerError(f"{where} {flag} must be true or false, got {getattr(self, flag)!r}")
        # Normalise the "0 means default" fields once so every consumer sees real numbers.
        for key, value in _derived_defaults(self).items():
            if getattr(self, key) == 0:
                object.__setattr__(self, key, value)

    # -- derived counts ----------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        """Width of the query projection (and the attention output's input): `hidden_size` unless `head_dim` is set apart."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    def block_operators(self) -> tuple[Operator, ...]:
        """The linears of one block in execution order (forward)."""
        return _block_operators(self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size, self.gated_mlp)

    @property
    def num_vector_params_per_block(self) -> int:
        """Biases and norm weights of one block ([Note: exact counts]); 0 for the paper's shapes."""
        hd, ffn = self.hidden_size, self.ffn_hidden_size
        biases = (self.q_size + 2 * self.kv_size) * self.qkv_bias + hd * self.attn_out_bias
        biases += ((2 if self.gated_mlp else 1) * ffn + hd) * self.mlp_bias
        norm_width = self.norms_per_block * hd + (self.q_size + self.kv_size) * self.qk_norm
        return biases + NORM_PARAMS_PER_ELEMENT[self.norm] * norm_width

    @property
    def parameter_tensors_per_block(self) -> int:
        """The block's trained tensors as a framework holds them, one parameter each: every linear's
        weight and the biases the spec sets (QKV fused into one linear, as Megatron-LM builds it),
        and each norm's weight and, for LayerNorm, its bias ([Note: exact counts]). What a ZeRO-3
        that gathers per parameter issues collectives for (planner/cost/collectives.py [Note:
        per-parameter collectives])."""
        mlp_linears = 3 if self.gated_mlp else 2
        biases = self.qkv_bias + self.attn_out_bias + mlp_linears * self.mlp_bias
        norms = NORM_PARAMS_PER_ELEMENT[self.norm] * self.norms_per_block + 2 * self.qk_norm
        return len(self.block_operators()) + biases + norms

    @property
    def num_params_per_block(self) -> int:
        return sum(op.num_params for op in self.block_operators()) + self.num_vector_params_per_block

    @property
    def num_embedding_params(self) -> int:
        """Token embedding, the output projection when untied, and learned positions."""
        tokens = self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)
        return tokens + self.position_embeddings * self.hidden_size

    @property
    def num_params(self) -> int:
        """All trained weights: blocks, embeddings and the final norm."""
        final_norm = NORM_PARAMS_PER_ELEMENT[self.norm] * self.hidden_size
        return self.num_layers * self.num_params_per_block + self.num_embedding_params + final_norm

    @property
    def num_params_eq1(self) -> int:
        """Eq. 1: `12 * nl * hd^2`, the paper's parameter count."""
        return 12 * self.num_layers * self.hidden_size**2

    @property
    def largest_block_operator_params(self) -> int:
        """The largest linear of one block (the MLP's up or down projection)."""
        return _largest_block_operator_params(self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size,
                                              self.gated_mlp)

    @property
    def largest_operator_params(self) -> int:
        """The weight that sets the model-state working memory (eq. 4) and the tiling need."""
        return max(self.largest_block_operator_params, self.vocab_size * self.hidden_size)

    # -- documents ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        doc = {
            "name": self.name,
            "num_params": self.num_params,
            "num_params_eq1": self.num_params_eq1,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_heads": self.num_heads,
            "seq_len": self.seq_len,
            "vocab_size": self.vocab_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_kv_heads": self.num_kv_heads,
            "gated_mlp": self.gated_mlp,
            "tied_embeddings": self.tied_embeddings,
        }
        # Extras appear only when set, so documents of the paper's and older specs stay byte-identical.
        defaults = _derived_defaults(self)
        for key in _EXTRA_FIELDS:
            if getattr(self, key) != defaults.get(key, ModelSpec.__dataclass_fields__[key].default):
                doc[key] = getattr(self, key)
        if self.source:
            doc["source"] = self.source
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "model") -> ModelSpec:
        derived = {"num_params", "num_params_eq1"}
        inputs = {f for f in cls.__dataclass_fields__}
        check_keys(doc, inputs | derived | {"aliases"}, where)
        for key in ("num_layers", "hidden_size", "num_heads"):
            if key not in doc:
                raise PlannerError(f"{where}: missing required key {key!r}")
        if "name" in doc:
            string(doc["name"], f"{where} name", max_len=200)
        kwargs = {k: v for k, v in doc.items() if k in inputs}
        spec = cls(**kwargs)
        for key in derived:
            if key in doc and doc[key] != getattr(spec, key):
                raise PlannerError(
                    f"{where}: {key} {doc[key]!r} does not match the shape, which gives {getattr(spec, key)}; "
                    "drop the key or fix the shape"
                )
        return spec

    def replace(self, **changes: Any) -> ModelSpec:
        """A copy with `changes`; a width that was derived (`head_dim`, `ffn_hidden_size`, `num_kv_heads`
        at their defaults) is derived again from the new shape rather than kept from the old one."""
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for key, value in _derived_defaults(self).items():
            if doc[key] == value and key not in changes:
                doc[key] = 0
        doc.update(changes)
        return ModelSpec(**doc)


_EXTRA_FIELDS = ("head_dim", "qkv_bias", "attn_out_bias", "mlp_bias", "norm", "norms_per_block", "qk_norm",
                 "position_embeddings", "rotary", "dropout", "attention")


def _derived_defaults(spec: ModelSpec) -> dict[str, int]:
    """What each "0 means default" field means for this shape."""
    return {"ffn_hidden_size": 4 * spec.hidden_size, "num_kv_heads": spec.num_heads,
            "head_dim": spec.hidden_size // spec.num_heads}


def format_param_count(count: float) -> str:
    """`1_006_632_960_000` -> `1,006.63 B`, `124_439_808` -> `124.44 M`: a unit that fits, never `0.00 B`.

    From a billion up the unit stays B (no T), so every line the planner printed before for such
    models is unchanged."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:,.2f} {unit}"
    return f"{count:,.0f}"


@cache
def _largest_block_operator_params(hd: int, ffn: int, q_size: int, kv_size: int, gated_mlp: bool) -> int:
    return max(op.num_params for op in _block_operators(hd, ffn, q_size, kv_size, gated_mlp))


@cache
def _block_operators(hd: int, ffn: int, q_size: int, kv_size: int, gated_mlp: bool) -> tuple[Operator, ...]:
    ops = [Operator(name="qkv", num_params=hd * (q_size + 2 * kv_size)), Operator(name="attn_out", num_params=q_size * hd)]
    if gated_mlp:
        ops.append(Operator(name="mlp_gate", num_params=hd * ffn))
    ops += [Operator(name="mlp_up", num_params=hd * ffn), Operator(name="mlp_down", num_params=ffn * hd)]
    return tuple(ops)
