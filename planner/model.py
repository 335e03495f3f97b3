"""The Transformer being planned: its shape, parameter counts and operators.

Counts follow METHOD.md §2: eq. 1 counts the four block linears only (`12 * nl * hd^2` for a GPT
block: hd x 3hd, hd x hd, hd x 4hd, 4hd x hd); `num_params` adds the embeddings (and grouped-query
attention and gated MLPs, for Llama-like models). The paper's configurations ship with
`vocab_size = 0` because the paper ignores embeddings; their `num_params` is then exactly eq. 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from planner.errors import PlannerError
from planner.specio import check_keys, number, string

MAX_LAYERS = 100_000
MAX_HIDDEN = 10_000_000
MAX_SEQ = 100_000_000


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
        if self.hidden_size % self.num_heads:
            raise PlannerError(
                f"{where}: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_kv_heads and self.num_heads % self.num_kv_heads:
            raise PlannerError(f"{where}: num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}")
        for flag in ("gated_mlp", "tied_embeddings"):
            if not isinstance(getattr(self, flag), bool):
                raise PlannerError(f"{where} {flag} must be true or false, got {getattr(self, flag)!r}")
        # Normalise the "0 means default" fields once so every consumer sees real numbers.
        if self.ffn_hidden_size == 0:
            object.__setattr__(self, "ffn_hidden_size", 4 * self.hidden_size)
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)

    # -- derived counts ----------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_size(self) -> int:
        """Width of the key (and of the value) projection."""
        return self.num_kv_heads * self.head_dim

    def block_operators(self) -> tuple[Operator, ...]:
        """The linears of one block in execution order (forward)."""
        return _block_operators(self.hidden_size, self.ffn_hidden_size, self.kv_size, self.gated_mlp)

    @property
    def num_params_per_block(self) -> int:
        return sum(op.num_params for op in self.block_operators())

    @property
    def num_embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2)

    @property
    def num_params(self) -> int:
        """All trained weights: blocks plus embeddings."""
        return self.num_layers * self.num_params_per_block + self.num_embedding_params

    @property
    def num_params_eq1(self) -> int:
        """Eq. 1: `12 * nl * hd^2`, the paper's parameter count."""
        return 12 * self.num_layers * self.hidden_size**2

    @property
    def largest_operator_params(self) -> int:
        """The weight that sets the model-state working memory (eq. 4) and the tiling need."""
        largest = max(op.num_params for op in self.block_operators())
        return max(largest, self.vocab_size * self.hidden_size)

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
        doc = {k: getattr(self, k) for k in self.__dataclass_fields__}
        doc.update(changes)
        return ModelSpec(**doc)


@cache
def _block_operators(hd: int, ffn: int, kv_size: int, gated_mlp: bool) -> tuple[Operator, ...]:
    ops = [Operator(name="qkv", num_params=hd * (hd + 2 * kv_size)), Operator(name="attn_out", num_params=hd * hd)]
    if gated_mlp:
        ops.append(Operator(name="mlp_gate", num_params=hd * ffn))
    ops += [Operator(name="mlp_up", num_params=hd * ffn), Operator(name="mlp_down", num_params=ffn * hd)]
    return tuple(ops)
