"""Presets and name resolution: turn what a user types (`1T`, `gpt3-175b`, `my.json`) into specs.

Resolution order for a MODEL argument (documented in README "Model sizes"):
1. an existing file path -> the model document in it;
2. a preset name (case-insensitive) or a preset's alias (`1T` is the paper's 1T configuration);
3. a size shorthand (`3B`, `2.5T`) -> the shape rule below, which says in `name` what it chose.

[Note: shape rule] For sizes no preset owns we pick the shape the paper's configurations and GPT-3
follow: width grows with depth at `hidden / layers ~= 128` (GPT-3 175B: 12288/96 = 128; paper 0.1T:
10240/80 = 128). From eq. 1 (`P = 12 * nl * hd^2`) with `nl = hd / 128`: `hd = (128 * P / 12)^(1/3)`,
rounded to a multiple of 128 (of 1024 from 8192 up, as the paper's K-sized widths), then
`nl = round(P / (12 * hd^2))`, `heads = hd / 128`, `seq = 1024`, embeddings ignored (vocab 0). The
result's eq. 1 count is within a few percent of the request; `name` records the request and shape.
"""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from planner.errors import PlannerError
from planner.hardware import NodeSpec
from planner.model import ModelSpec
from planner.specio import load_document
from planner.units import PARAM_SUFFIXES

DEFAULT_HARDWARE = "dgx-h100"
_SHORTHAND = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbtKMBT])\s*$")
SHAPE_RULE_ASPECT = 128  # hidden / layers, see [Note: shape rule]
SHAPE_RULE_HEAD_DIM = 128


def _data_root() -> Any:
    """data/ beside the package in a checkout (editable install), `planner/_data` in a wheel."""
    checkout = Path(__file__).resolve().parent.parent / "data"
    return checkout if checkout.is_dir() else resources.files("planner") / "_data"


def _data_files(folder: str) -> list[Any]:
    root = _data_root() / folder
    return sorted((f for f in root.iterdir() if f.name.endswith(".json")), key=lambda f: f.name)


@cache
def model_presets() -> dict[str, tuple[ModelSpec, tuple[str, ...]]]:
    """Preset name -> (spec, aliases), from data/models/*.json."""
    presets: dict[str, tuple[ModelSpec, tuple[str, ...]]] = {}
    for path in _data_files("models"):
        for doc in json.loads(path.read_text())["models"]:
            spec = ModelSpec.from_dict(doc, f"preset {doc.get('name')}")
            presets[spec.name.lower()] = (spec, tuple(doc.get("aliases", ())))
    return presets


@cache
def _aliases() -> dict[str, str]:
    return {alias.lower(): name for name, (_, aliases) in model_presets().items() for alias in aliases}


@cache
def hardware_presets() -> dict[str, NodeSpec]:
    presets = {}
    for path in _data_files("hardware"):
        spec = NodeSpec.from_dict(json.loads(path.read_text()), f"preset {path.name}")
        presets[spec.name.lower()] = spec
    return presets


def parse_param_count(text: str) -> int | None:
    """`"1.4B"` -> 1_400_000_000; None when `text` is not a size shorthand."""
    match = _SHORTHAND.match(text)
    if not match:
        return None
    return round(float(match.group(1)) * PARAM_SUFFIXES[match.group(2).lower()])


def shape_for_params(num_params: int, *, seq_len: int = 1024, label: str | None = None) -> ModelSpec:
    """The [Note: shape rule] shape for a requested parameter count."""
    if num_params < 12 * 128**2:
        raise PlannerError(f"model size {label or num_params} is too small for the shape rule; give --layers/--hidden/--heads")
    hidden = (SHAPE_RULE_ASPECT * num_params / 12) ** (1 / 3)
    step = 1024 if hidden >= 8192 else 128
    hidden = max(step, round(hidden / step) * step)
    layers = max(1, round(num_params / (12 * hidden**2)))
    heads = max(1, hidden // SHAPE_RULE_HEAD_DIM)
    name = f"{label or num_params} (shape rule: {layers} layers x hidden {hidden}, {heads} heads)"
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=seq_len, vocab_size=0)


def known_model_names() -> str:
    presets = model_presets()
    return ", ".join(sorted(presets))


def resolve_model(
    arg: str | None,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq: int | None = None,
    vocab: int | None = None,
) -> ModelSpec:
    """MODEL argument plus explicit shape options -> a validated ModelSpec.

    Explicit options override the corresponding field of MODEL; with no MODEL, `--layers`,
    `--hidden` and `--heads` are all required.
    """
    overrides = {
        k: v
        for k, v in {"num_layers": layers, "hidden_size": hidden, "num_heads": heads, "seq_len": seq, "vocab_size": vocab}.items()
        if v is not None
    }
    if arg is None:
        missing = [f"--{o}" for o, k in (("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_heads")) if k not in overrides]
        if missing:
            raise PlannerError(f"no MODEL given; name one (e.g. 1T, gpt3-175b) or give {', '.join(missing)}")
        spec = ModelSpec(name=f"custom ({overrides['num_layers']} layers x hidden {overrides['hidden_size']})", **overrides)
        return spec
    spec = _resolve_named(arg)
    if overrides:
        spec = spec.replace(name=f"{spec.name} (with {', '.join(f'{k}={v}' for k, v in overrides.items())})", **overrides)
    return spec


def _resolve_named(arg: str) -> ModelSpec:
    if not isinstance(arg, str) or not arg.strip():
        raise PlannerError("MODEL is empty; use a size like 1T, a preset name or a JSON file")
    path = Path(arg)
    if arg.lower().endswith((".json", ".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise PlannerError(f"model file {arg} does not exist")
        doc = load_document(path, "model")
        return ModelSpec.from_dict(doc, f"model file {arg}")
    key = arg.strip().lower()
    presets = model_presets()
    if key in presets:
        return presets[key][0]
    if key in _aliases():
        return presets[_aliases()[key]][0]
    count = parse_param_count(arg)
    if count is None:
        raise PlannerError(
            f"unknown model {arg!r}: use a size like 1T, 175B, 13b or 1.4B, a preset name "
            f"(see `planner models`), or a JSON file"
        )
    return shape_for_params(count, label=arg.strip())


def resolve_hardware(arg: str | None) -> NodeSpec:
    """Preset name or hardware JSON file -> NodeSpec (default: dgx-h100)."""
    arg = arg or DEFAULT_HARDWARE
    presets = hardware_presets()
    if arg.lower() in presets:
        return presets[arg.lower()]
    path = Path(arg)
    if arg.lower().endswith((".json", ".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise PlannerError(f"hardware file {arg} does not exist")
        return NodeSpec.from_dict(load_document(path, "hardware"), f"hardware file {arg}")
    raise PlannerError(f"unknown hardware {arg!r}: use one of {', '.join(sorted(presets))} or a hardware JSON file")
