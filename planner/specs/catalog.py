"""Presets and name resolution: turn what a user types (`1T`, `gpt3-175b`, `my.json`) into specs.

Resolution order for a MODEL argument (documented in README "Model sizes"):
1. an existing file path -> the model document in it: the planner's own form, or a Hugging Face
   `config.json` (planner/specs/hf_config.py), told apart by their keys;
2. a preset name (case-insensitive) or a preset's alias (`1T` is the paper's 1T configuration);
3. a size shorthand (`70B`, `2.5T`) -> a model of about that size ([Note: size shorthands], above
   `resolve_model`; [Note: shape rule], above `shape_for_params`).
"""

from __future__ import annotations

import json
import math
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from planner.specs import hf_config
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.specio import check_keys, load_document
from planner.specs.units import PARAM_SUFFIXES

DEFAULT_HARDWARE = "dgx-h100"
_SHORTHAND = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmbtKMBT])\s*$")
SHAPE_RULE_ASPECT = 128  # hidden / layers, see [Note: shape rule]
SHAPE_RULE_HEAD_DIM = 128
# (step, from, below): 4 heads of 128 below 4096 wide, 8 heads from there, see [Note: shape rule]
SHAPE_RULE_WIDTH_GRIDS = ((512, 1024, 4096), (1024, 4096, math.inf))
SIZE_TOLERANCE = 0.10  # see [Note: size shorthands]
_PUBLISHED_KEYS = {"name", "aliases", "source", "provenance", "hf_config"}


def _data_root() -> Any:
    """data/ beside the package in a checkout (editable install), `planner/_data` in a wheel."""
    checkout = Path(__file__).resolve().parent.parent.parent / "data"
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
            spec = _preset_spec(doc)
            presets[spec.name.lower()] = (spec, tuple(doc.get("aliases", ())))
    return presets


def _preset_spec(doc: dict[str, Any]) -> ModelSpec:
    """A preset in the planner's form, or a published model as its config.json (`hf_config`)."""
    where = f"preset {doc.get('name')}"
    if "hf_config" not in doc:
        return ModelSpec.from_dict(doc, where)
    check_keys(doc, _PUBLISHED_KEYS, where)
    return hf_config.spec_from_hf_config(doc["hf_config"], name=doc["name"], where=where, source=doc["source"])


@cache
def published_presets() -> tuple[ModelSpec, ...]:
    """Presets made from a publisher's config.json: the candidates a size shorthand may land on."""
    published = []
    for path in _data_files("models"):
        published += [model_presets()[d["name"].lower()][0] for d in json.loads(path.read_text())["models"]
                      if "hf_config" in d]
    return tuple(published)


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


# [Note: shape rule] The shape the paper's configurations and GPT-3 follow: width grows with depth at
# `hidden / layers ~= 128` (GPT-3 175B: 12288/96 = 128; paper 0.1T: 10240/80 = 128). From eq. 1
# (`P = 12 * nl * hd^2`) with `nl = hd / 128`: `hd = (128 * P / 12)^(1/3)`, taken to the nearest (in
# ratio) of 128, 256, 512, a multiple of 512 below 4096 or a multiple of 1024 from 4096 up. Heads are
# `hd / 128` (head dim 128), so 1, 2, 4, a multiple of 4 below 4096 wide and of 8 from there: the
# search only tries tensor-parallel degrees that divide the heads, and 2 and 4 always do, 8 (a node)
# from 4096 wide (about 7 B) up. The old rule (any multiple of 128) gave 7B 33 heads, which allow none.
# Then `nl = round(P / (12 * hd^2))`, `seq = 1024`, embeddings ignored (vocab 0). The result's eq. 1
# count is within a few percent of the request; `name` records the request and shape.
def shape_for_params(num_params: int, *, seq_len: int = 1024, label: str | None = None) -> ModelSpec:
    """The [Note: shape rule] shape for a requested parameter count."""
    if num_params < 12 * 128**2:
        raise PlannerError(f"model size {label or num_params} is too small for the shape rule; give --layers/--hidden/--heads")
    ideal = (SHAPE_RULE_ASPECT * num_params / 12) ** (1 / 3)
    hidden = min(_shape_rule_widths(ideal), key=lambda width: abs(math.log(width / ideal)))
    layers = max(1, round(num_params / (12 * hidden**2)))
    heads = max(1, hidden // SHAPE_RULE_HEAD_DIM)
    name = f"{label or num_params} (shape rule: {layers} layers x hidden {hidden}, {heads} heads)"
    return ModelSpec(name=name, num_layers=layers, hidden_size=hidden, num_heads=heads, seq_len=seq_len, vocab_size=0)


def _shape_rule_widths(ideal: float) -> list[int]:
    """The widths around `ideal` the shape rule may take ([Note: shape rule])."""
    widths = [128, 256, 512]
    for step, start, stop in SHAPE_RULE_WIDTH_GRIDS:
        widths += [k * step for k in (math.floor(ideal / step), math.ceil(ideal / step)) if start <= k * step < stop]
    return widths


def known_model_names() -> str:
    presets = model_presets()
    return ", ".join(sorted(presets))


# [Note: size shorthands] A size means a model of about that size. An alias is the label a source gives
# its configuration (the paper's `1T`, `0.5T`, `13B`; GPT-3's `175B`) and is kept only where the
# configuration has that many parameters within SIZE_TOLERANCE, 10% (tests/test_planner_model.py checks
# each); the paper's `70B` (100.7 B) and `1.4B` (1.13 B) configurations are reachable by their preset
# names only. Any other size goes to the published model (a preset made from its config.json) nearest
# in parameter count, if one is within 10% (`70B` -> llama-3.1-70b, 70.55 B), and the spec's name says
# so; 10% because publishers round their labels that far (Qwen2.5 14B has 14.77 B). Otherwise the
# shape rule below sizes a model to the request.
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
    shape = {k: v for k, v in overrides.items() if k != "seq_len"}  # the sequence has a column of its own
    name = f"{spec.name} (with {', '.join(f'{k}={v}' for k, v in shape.items())})" if shape else spec.name
    return spec.replace(name=name, **overrides) if overrides else spec


def model_notes(arg: str | None, *, seq_given: bool = False) -> tuple[str, ...]:
    """What reading MODEL assumed or ignored, one line each: for a Hugging Face config file, its
    unknown keys and the plan-relevant defaults it does not state (hf_config.notes); else nothing."""
    if arg is None or not Path(arg).is_file():
        return ()
    doc = load_document(Path(arg), "model")
    if not hf_config.is_hf_config(doc):
        return ()
    return hf_config.notes(doc, f"model file {arg}", seq_given=seq_given).lines()


def _resolve_named(arg: str) -> ModelSpec:
    if not isinstance(arg, str) or not arg.strip():
        raise PlannerError("MODEL is empty; use a size like 1T, a preset name or a JSON file")
    path = Path(arg)
    if arg.lower().endswith((".json", ".yaml", ".yml")) or path.is_file():
        if not path.is_file():
            raise PlannerError(f"model file {arg} does not exist")
        return _model_file(arg, path)
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
            f"(see `planner models`), or a JSON file (ours or a Hugging Face config.json)"
        )
    nearest = nearest_published(count)
    if nearest is not None:
        return nearest.replace(name=f"{nearest.name} (nearest published model to {arg.strip()})")
    return shape_for_params(count, label=arg.strip())


def nearest_published(num_params: int) -> ModelSpec | None:
    """The published preset nearest `num_params`, if within SIZE_TOLERANCE ([Note: size shorthands])."""
    if not published_presets():
        return None
    best = min(published_presets(), key=lambda spec: abs(spec.num_params / num_params - 1))
    return best if abs(best.num_params / num_params - 1) <= SIZE_TOLERANCE else None


def _model_file(arg: str, path: Path) -> ModelSpec:
    doc = load_document(path, "model")
    where = f"model file {arg}"
    if hf_config.is_hf_config(doc):
        return hf_config.spec_from_hf_config(doc, name=hf_config.describe(arg, doc, where), where=where)
    return ModelSpec.from_dict(doc, where)


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


def published_hf_config(name: str) -> dict[str, Any] | None:
    """The Hugging Face config.json of a published preset (by name or alias), as its publisher wrote it;
    None for a preset in the planner's own form or an unknown name (`planner run --model PRESET`)."""
    key = name.strip().lower()
    key = _aliases().get(key, key)
    for path in _data_files("models"):
        for doc in json.loads(path.read_text())["models"]:
            if doc["name"].lower() == key and "hf_config" in doc:
                return dict(doc["hf_config"])
    return None
