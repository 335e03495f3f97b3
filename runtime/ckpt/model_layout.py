"""What an exporter needs to rebuild full parameters from a checkpoint's rank files.

Rank 0's `rank-00000.json` carries it under `"model"`:

    {"format": "tierwise.model-layout/1",
     "hf_config": {...} | null,          the model's Hugging Face config (`config.to_dict()`), if it has one
     "architecture": "LlamaForCausalLM", "world_size": 2,
     "units":   [{"shard_numel": 2080, "master": "optimizer_states/master:0:model.embed_tokens",
                  "params": "params/0:model.embed_tokens"}, ...],
     "tensors": [{"name": "model.embed_tokens.weight", "shape": [128, 64], "dtype": "bfloat16",
                  "segments": [[0, 0, 8192]]}, ...],
     "persistent_buffers": []}           buffers in the state dict (checkpoints hold none: export refuses them)

[Note: a parameter's place in the rank files]
A unit's parameters lie end to end in one flat vector padded to a multiple of the world size, rank r
holding elements `[r * shard_numel, (r + 1) * shard_numel)` of it (runtime/units/flat_param.py). A tensor
of the exported state dict is the concatenation of its `segments` `[unit, offset, numel]`: flat
ranges of unit vectors. Most tensors are one segment; a tiled Linear (runtime/units/tiling.py) is one per
tile, its tiles being consecutive row blocks. Names are `model.named_parameters()`'s (the Hugging
Face state-dict keys) with the runtime's wrappers taken out (a recomputed block's `.block`, a tiled
Linear's `.tiles.i`), tied parameters under their first name only, as `named_parameters()` gives them.
`master` names the fp32 master shard in the rank files (`params/...` when the fp32 parameter shard is
the master), `params` the shard in the compute dtype; a tensor's `dtype` is the one it trains in.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from planner.specs.specio import check_keys, number, string
from runtime.ckpt.errors import CheckpointError
from runtime.ckpt.safetensors_io import DTYPE_CODES
from runtime.transfer.stores import StateKey

LAYOUT_FORMAT = "tierwise.model-layout/1"
MAX_NAME_CHARS = 1000


def hf_config_dict(model: Any) -> dict[str, Any] | None:
    """The model's Hugging Face config as JSON (None for a model without one, e.g. the built-in GPT)."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return None
    doc = json.loads(config.to_json_string(use_diff=False))
    if not doc.get("architectures"):  # save_pretrained records the class the same way
        doc["architectures"] = [type(model).__name__]
    return doc


def describe(state: Any) -> dict[str, Any]:
    """The layout document of a sharded model (`ShardedModel`): see the module docstring."""
    model = state.module_ref()
    place = {}
    units = []
    for index, unit in enumerate(state.units):
        for j, p in enumerate(unit.params):
            place.setdefault(id(p), (index, j))
        store, key = state.master_at[unit.name]
        prefix = "params" if store is state.param_store else "optimizer_states"
        if prefix == "params" and state.config.compute_dtype != torch.float32:
            # [Note: one checkpoint for both host parameter shards] in runtime/ckpt/rank_state.py
            prefix, key = "optimizer_states", StateKey("master", key)
        units.append({"shard_numel": unit.layout.shard_numel, "master": f"{prefix}/{key}", "params": f"params/{unit.name}"})
    tensors = []
    for name, params, shape in _export_params(model, "", set()):
        segments = []
        for p in params:
            unit, j = place[id(p)]
            layout = state.units[unit].layout
            segments.append([unit, layout.offsets[j], layout.shapes[j].numel()])
            if shape is None:  # the parameter itself is empty between uses: its shape is the layout's
                shape = tuple(layout.shapes[j])
        tensors.append({"name": name, "shape": list(shape), "dtype": str(params[0].dtype).removeprefix("torch."),
                        "segments": segments})
    return {"format": LAYOUT_FORMAT, "hf_config": hf_config_dict(model), "architecture": type(model).__name__,
            "world_size": state.comm.world_size, "units": units, "tensors": tensors,
            "persistent_buffers": persistent_buffers(model)}


def _export_params(module: Any, prefix: str, seen: set[int]) -> Iterator[tuple[str, list[Any], tuple[int, ...] | None]]:
    """(state-dict name, the parameters whose concatenation it is, its shape when not the one
    parameter's), in `named_parameters()` order."""
    from runtime.units.tiling import TiledLinear

    if isinstance(module, TiledLinear):
        tiles = list(module.tiles)
        yield f"{prefix}weight", [t.weight for t in tiles], (module.out_features, module.in_features)
        if tiles[0].bias is not None:
            yield f"{prefix}bias", [t.bias for t in tiles], (module.out_features,)
        return
    for name, p in module._parameters.items():
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            yield f"{prefix}{name}", [p], None
    for name, child in module._modules.items():
        if child is not None:
            yield from _export_params(child, _child_prefix(module, name, prefix), seen)


def _child_prefix(module: Any, name: str, prefix: str) -> str:
    from runtime.units.recompute import RecomputedBlock

    return prefix if isinstance(module, RecomputedBlock) and name == "block" else f"{prefix}{name}."


def persistent_buffers(module: Any, prefix: str = "") -> list[str]:
    """State-dict names of the model's persistent buffers: checkpoints hold parameters only, so an
    export of a model with any is refused (the dense decoders' rotary tables are not persistent)."""
    out = [f"{prefix}{name}" for name, b in module._buffers.items()
           if b is not None and name not in module._non_persistent_buffers_set]
    for name, child in module._modules.items():
        if child is not None:
            out += persistent_buffers(child, _child_prefix(module, name, prefix))
    return out


@dataclass(frozen=True, slots=True)
class ExportTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    """The dtype the parameter trains in (the compute dtype); the rank files' master copy is fp32."""
    segments: tuple[tuple[int, int, int], ...]

    @property
    def numel(self) -> int:
        return sum(n for _, _, n in self.segments)


@dataclass(frozen=True, slots=True)
class Layout:
    hf_config: dict[str, Any] | None
    architecture: str
    world_size: int
    units: tuple[dict[str, Any], ...]
    tensors: tuple[ExportTensor, ...]
    persistent_buffers: tuple[str, ...]


def parse_layout(doc: Any, where: str) -> Layout:
    """The layout document, strictly checked: every segment inside its unit's padded flat vector."""
    check_keys(doc, {"format", "hf_config", "architecture", "world_size", "units", "tensors", "persistent_buffers"}, where)
    if doc.get("format") != LAYOUT_FORMAT:
        raise CheckpointError(f"{where}.format must be {LAYOUT_FORMAT!r}, got {doc.get('format')!r}")
    world = int(number(doc.get("world_size"), f"{where}.world_size", minimum=1, maximum=1 << 20, integer=True))
    architecture = string(doc.get("architecture"), f"{where}.architecture", max_len=MAX_NAME_CHARS)
    config = doc.get("hf_config")
    if config is not None and not isinstance(config, dict):
        raise CheckpointError(f"{where}.hf_config must be an object or null")
    units = []
    for i, u in enumerate(_list(doc, "units", where)):
        at = f"{where}.units[{i}]"
        check_keys(u, {"shard_numel", "master", "params"}, at)
        units.append({"shard_numel": int(number(u.get("shard_numel"), f"{at}.shard_numel", minimum=1,
                                                maximum=1 << 50, integer=True)),
                      "master": string(u.get("master"), f"{at}.master", max_len=MAX_NAME_CHARS),
                      "params": string(u.get("params"), f"{at}.params", max_len=MAX_NAME_CHARS)})
    tensors = [_parse_tensor(t, f"{where}.tensors[{i}]", units, world) for i, t in enumerate(_list(doc, "tensors", where))]
    buffers = tuple(string(b, f"{where}.persistent_buffers[{i}]", max_len=MAX_NAME_CHARS)
                    for i, b in enumerate(_list(doc, "persistent_buffers", where)))
    return Layout(config, architecture, world, tuple(units), tuple(tensors), buffers)


def _list(doc: dict[str, Any], key: str, where: str) -> list[Any]:
    if not isinstance(doc.get(key), list):
        raise CheckpointError(f"{where}.{key} must be a list")
    return doc[key]


def _parse_tensor(t: Any, at: str, units: list[dict[str, Any]], world: int) -> ExportTensor:
    check_keys(t, {"name", "shape", "dtype", "segments"}, at)
    name = string(t.get("name"), f"{at}.name", max_len=MAX_NAME_CHARS)
    dtype = string(t.get("dtype"), f"{at}.dtype", choices=tuple(DTYPE_CODES))
    shape = t.get("shape")
    if not (isinstance(shape, list) and all(type(n) is int and 0 <= n < 1 << 50 for n in shape)):
        raise CheckpointError(f"{at}.shape must be a list of non-negative integers")
    segments = []
    for seg in t.get("segments") if isinstance(t.get("segments"), list) else [None]:
        if not (isinstance(seg, list) and len(seg) == 3 and all(type(n) is int and n >= 0 for n in seg)
                and seg[0] < len(units) and seg[1] + seg[2] <= units[seg[0]]["shard_numel"] * world):
            raise CheckpointError(f"{at}.segments must be [unit, offset, numel] ranges inside the units")
        segments.append((seg[0], seg[1], seg[2]))
    out = ExportTensor(name, tuple(shape), dtype, tuple(segments))
    expected = 1
    for n in shape:
        expected *= n
    if out.numel != expected:
        raise CheckpointError(f"{at}: its segments hold {out.numel} elements, its shape {shape} needs {expected}")
    return out
