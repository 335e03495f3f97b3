"""Is this model the one its plan was made for? `runtime.shard` and `planner run --model` ask.

[Note: model vs plan]
A plan's bills (states per tier, the operators a unit gathers, activations) are made for the
model its spec describes; applied to another model they are confident wrong answers. So a model
is compared with its plan's spec before anything is allocated:

- the parameter count, for every `nn.Module` (the one number every model has), counted the way
  the spec counts ([Note: what a spec counts]) and refused beyond COUNT_TOLERANCE;
- layers, width, heads and vocabulary where the model states them: a Hugging Face model's
  `config` (its `num_hidden_layers`, `hidden_size`, `num_attention_heads`, `vocab_size`; GPT-2's
  own names map to these) or the reference GPT's `cfg`. Any module without them is compared by
  count alone: a stack of Linears has no discoverable "layers".

[Note: what a spec counts]
A spec made from a Hugging Face config (norms set) counts every parameter transformers builds
(tests/test_planner_hf.py). A spec in the paper's accounting (no norms, no biases) counts the
weights of the block linears and the token embeddings only (none with `vocab_size` 0), never
learned positions (`position_embeddings` 0). The model's count leaves out the same: its vectors
(1-D parameters: norms, biases), and its embedding tables other than the token table (every
table with vocabulary 0). Counted that way the reference GPT and transformers' GPT-2 equal their
paper-style spec exactly, and a model made from the config a plan came from equals it exactly.

This module imports no torch: the CLI compares a Hugging Face config's spec with the plan before
starting any process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.model import NORM_PARAMS_PER_ELEMENT, ModelSpec, format_param_count

COUNT_TOLERANCE = 0.01
"""Counted the same way, a model and its own spec agree exactly ([Note: what a spec counts]); 1%
lets through a few vectors a spec's flags cannot say (an extra bias, a learned scale), while any
other shape is further off: one layer more or less in 32, a width or a vocabulary of another size."""

PLAN_HINT = "make a plan for this model with `planner fit CONFIG.json` (its Hugging Face config) or a model JSON of its shape"


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What is known of a model's shape; None where the model does not say."""

    num_params: int
    """Counted as its plan's spec counts ([Note: what a spec counts])."""
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None

    @classmethod
    def of_spec(cls, spec: ModelSpec) -> ModelShape:
        return cls(num_params=spec.num_params, num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                   num_heads=spec.num_heads, vocab_size=spec.vocab_size or None)


    @classmethod
    def of_model_spec(cls, spec: ModelSpec, plan_spec: ModelSpec) -> ModelShape:
        """A model that `spec` describes exactly (one made from its Hugging Face config), counted as
        `plan_spec` counts ([Note: what a spec counts]): what `shape_of` gives for that model."""
        count = spec.num_params
        if not spec_counts_vectors(plan_spec):
            final_norm = NORM_PARAMS_PER_ELEMENT[spec.norm] * spec.hidden_size
            count -= spec.num_layers * spec.num_vector_params_per_block + final_norm
        if not plan_spec.vocab_size:  # the token table (an untied output projection is a Linear: counted)
            count -= (spec.vocab_size + spec.position_embeddings) * spec.hidden_size
        elif not plan_spec.position_embeddings:
            count -= spec.position_embeddings * spec.hidden_size
        return cls(num_params=count, num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                   num_heads=spec.num_heads, vocab_size=spec.vocab_size or None)


def spec_counts_vectors(spec: ModelSpec) -> bool:
    """True for a spec that counts norms and biases ([Note: what a spec counts])."""
    return spec.norm != "none" or spec.qkv_bias or spec.attn_out_bias or spec.mlp_bias


def counted_params(model: Any, spec: ModelSpec) -> int:
    """`model`'s parameters as `spec` counts them, tied ones once ([Note: what a spec counts])."""
    from torch import nn

    skipped: set[int] = set()
    token_table = None  # the first vocabulary-sized table: a position table may have as many rows (seq == vocab)
    for module in model.modules():
        if not isinstance(module, nn.Embedding) or spec.position_embeddings:
            continue
        if token_table is None and spec.vocab_size and module.num_embeddings == spec.vocab_size:
            token_table = module.weight
        elif module.weight is not token_table:
            skipped.add(id(module.weight))
    vectors = spec_counts_vectors(spec)
    return sum(_numel(p) for p in model.parameters() if id(p) not in skipped and (vectors or len(p.shape) >= 2))


def _numel(p: Any) -> int:
    out = 1
    for n in p.shape:
        out *= n
    return out


def shape_of(model: Any, spec: ModelSpec) -> ModelShape:
    """The model's count and, where its config states them, layers, width, heads and vocabulary."""
    config = getattr(model, "config", None)
    names = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
    if config is None:
        config = getattr(model, "cfg", None)  # the reference GPT (runtime/gpt.py)
        names = ("num_layers", "hidden_size", "num_heads", "vocab_size")

    def stated(name: str) -> int | None:
        value = getattr(config, name, None)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    layers, hidden, heads, vocab = (stated(n) for n in names)
    return ModelShape(num_params=counted_params(model, spec), num_layers=layers, hidden_size=hidden,
                      num_heads=heads, vocab_size=vocab)


def mismatch(spec: ModelSpec, model: ModelShape, *, hint: str = PLAN_HINT) -> str | None:
    """One line saying how `model` differs from the plan's `spec`, or None when it is that model."""
    plan = ModelShape.of_spec(spec)
    fields = [f for f in ("num_layers", "hidden_size", "num_heads", "vocab_size")
              if getattr(model, f) is not None and getattr(plan, f) is not None and getattr(model, f) != getattr(plan, f)]
    off = abs(model.num_params - plan.num_params) > COUNT_TOLERANCE * plan.num_params
    if not fields and not off:
        return None
    shown = {"num_layers", "hidden_size"} | set(fields)
    return f"plan is for {_describe(plan, shown, 'params')}; model has {_describe(model, shown, '')}: {hint}"


def _describe(shape: ModelShape, shown: set[str], unit: str) -> str:
    parts = []
    if shape.num_layers is not None and "num_layers" in shown:
        parts.append(f"{shape.num_layers} layers")
    if shape.hidden_size is not None and "hidden_size" in shown:
        parts.append(f"hidden {shape.hidden_size}")
    text = " x ".join(parts)
    extras = [f"{value} {label}" if label == "heads" else f"{label} {value}"
              for key, label in (("num_heads", "heads"), ("vocab_size", "vocab"))
              if key in shown and (value := getattr(shape, key)) is not None]
    text = ", ".join(p for p in (text, *extras) if p)
    count = f"{format_param_count(shape.num_params)}{' ' + unit if unit else ''}"
    if not text:
        return f"{count} params" if not unit else count
    return f"{text} ({count})"


class ModelMismatch(PlannerError):
    """The model is not the one the plan was made for; the message says what differs."""


def check_model(model: Any, spec: ModelSpec, *, hint: str = PLAN_HINT) -> None:
    """Refuse `model` when it is not the model `spec` describes ([Note: model vs plan])."""
    problem = mismatch(spec, shape_of(model, spec), hint=hint)
    if problem is not None:
        raise ModelMismatch(problem)
