"""Hugging Face models under `runtime.shard`: built on the meta device, initialised or loaded unit by unit.

    import runtime
    from runtime import hf_model

    model = hf_model.build_model(config_dict)                  # parameters on meta, no memory
    init = hf_model.from_safetensors(model, "Llama-folder")   # or None: transformers' own init
    model = runtime.shard(model, plan, param_init_fn=init)     # one unit's tensors at a time

`build_model` makes the architecture with `AutoModelForCausalLM.from_config` in fp32 (the runtime
keeps fp32 masters and casts to the plan's precision itself), parameters on the meta device and
buffers real ([Note: meta buffers], above `materialise_buffers`). `from_safetensors` is a
`param_init_fn` that copies each parameter from a Hugging Face folder (`model.safetensors`, or
shards named by `model.safetensors.index.json`) as its unit is materialised: `safe_open` reads one
tensor at a time, so the whole model is never in host memory. Keys are checked before any unit is built:
a missing or unexpected key, or a shape that differs, is one line naming it. A tied output
projection absent from the files is fine (transformers does not save it either).

The model stays the transformers module itself (no wrapper), so its parameter names are the
state-dict keys and its `config` travels with it (a checkpoint records it, for `planner export`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from planner.specs.errors import PlannerError
from planner.specs.specio import load_document

INSTALL_HF = "pip install 'tierwise[hf]'"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def require_transformers() -> None:
    """A one-line error naming the extra when transformers or safetensors is missing."""
    import importlib.util

    missing = [name for name in ("transformers", "safetensors") if importlib.util.find_spec(name) is None]
    if missing:
        raise PlannerError(f"a Hugging Face model needs the hf extra ({', '.join(missing)} not installed): {INSTALL_HF}")


def read_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face `config.json` as a dict; an unreadable one is one line (the CLI's reader)."""
    doc = load_document(path, "model config")
    if not isinstance(doc.get("model_type"), str):
        raise PlannerError(f"model config {path} is not a Hugging Face config.json (it has no 'model_type')")
    return doc


def build_model(config: Mapping[str, Any]) -> nn.Module:
    """The `AutoModelForCausalLM` of `config`, fp32, parameters on the meta device ([Note: meta buffers])."""
    require_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version")}
    try:
        hf_config = AutoConfig.for_model(config["model_type"], **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise PlannerError(f"transformers cannot build model_type {config.get('model_type')!r}: {exc}") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    materialise_buffers(model)
    return model


# [Note: meta buffers] Under `torch.device("meta")` the buffers transformers computes at construction
# (rotary `inv_freq`, Gemma's `embed_scale`) are meta too, and `runtime.shard` materialises parameters
# only. They are small and replicated, so `build_model` allocates them on the host and has transformers'
# `_init_weights` (5.x recomputes rotary and scale buffers there) fill them; one it leaves unfilled
# is refused by name rather than trained on as garbage.
def materialise_buffers(model: nn.Module) -> None:
    """Host buffers in place of meta ones, filled by transformers' `_init_weights` ([Note: meta buffers])."""
    init = getattr(model, "_init_weights", None)
    with torch.no_grad():
        for name, module in model.named_modules():
            meta = [n for n, b in module._buffers.items() if b is not None and b.device.type == "meta"]
            for n in meta:
                old = module._buffers[n]
                module._buffers[n] = torch.full(old.shape, float("nan"), dtype=old.dtype)
            if meta and init is not None:
                init(module)
            for n in meta:
                if module._buffers[n].is_floating_point() and module._buffers[n].isnan().any():
                    raise PlannerError(f"buffer {name}.{n} of {type(module).__name__} cannot be computed on the meta "
                                       f"device by this transformers version; {INSTALL_HF} (transformers 5 or newer)")


def causal_lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of a (B, T + 1) window: logits of tokens[:, :-1] vs tokens[:, 1:].

    The reference GPT's own loss (runtime/gpt.py), not transformers' `labels=input_ids` loss, so that
    runs of either model report the same quantity: T predictions per sample on a forward of T
    tokens, the plan's `seq_len`. transformers shifts inside, so its loss on those T tokens scores
    T - 1 predictions (the window's last target unused), and scoring all T would need a forward of
    T + 1 tokens, longer than the sequence the plan bills."""
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits  # (B, T, V)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def weight_files(folder: str | Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    folder = Path(folder)
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PlannerError(f"{index} is not a safetensors index (a 'weight_map' of tensor -> file): {exc}") from None
        files = {name: folder / file for name, file in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise PlannerError(f"{index} names {path.name}, which is not in {folder}")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise PlannerError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}: save the model with "
                           "save_pretrained(DIR) (safetensors, the default)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class SafetensorsInit:
    """A `param_init_fn` that loads each module's parameters from a Hugging Face folder.

    Made from the model before `runtime.shard` (names and shapes are read from its meta parameters);
    each call copies the module's own parameters from the files, one tensor at a time."""

    def __init__(self, model: nn.Module, folder: str | Path) -> None:
        from safetensors import safe_open

        self.folder = Path(folder)
        self.files = weight_files(self.folder)
        self._open: dict[Path, Any] = {path: safe_open(path, framework="pt") for path in set(self.files.values())}
        self.prefix = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
        self.shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        names_of: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names_of.setdefault(id(p), []).append(name)
        self.key_of: dict[str, str] = {}
        """Parameter name (any of a tied parameter's) -> the file key it is loaded from."""
        for names in names_of.values():
            key = next((n for n in names if n in self.files), None)
            if key is None:
                raise PlannerError(f"{self.folder}: parameter {names[0]} is not in the safetensors files (a folder "
                                   "of another model? its config.json must be this model's)")
            self.key_of.update(dict.fromkeys(names, key))
        self._check_keys(model)
        with torch.no_grad():  # persistent buffers are host tensors already ([Note: meta buffers])
            for name, buf in model.named_buffers():
                if name in self.files:
                    buf.copy_(self._open[self.files[name]].get_tensor(name))

    def _check_keys(self, model: nn.Module) -> None:
        buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        for key in sorted(self.files):
            if key not in self.shapes and key not in buffers and not any(p.search(key) for p in ignored):
                raise PlannerError(f"{self.folder}: {key} in the safetensors files is no parameter of the model "
                                   f"({type(model).__name__}); is config.json this model's?")
        for name, key in sorted(self.key_of.items()):
            shape = tuple(self._open[self.files[key]].get_slice(key).get_shape())
            if shape != self.shapes[name]:
                raise PlannerError(f"{self.folder}: {key} has shape {list(shape)} in the files but the model's "
                                   f"{name} has {list(self.shapes[name])}")

    def __call__(self, module: nn.Module) -> None:
        prefix = self.prefix[id(module)]
        for attr, p in module._parameters.items():
            name = f"{prefix}.{attr}" if prefix else attr
            # A tied parameter another unit already owns is a 0-element shard here: nothing to load.
            if p is None or tuple(p.shape) != self.shapes[name]:
                continue
            key = self.key_of[name]
            p.copy_(self._open[self.files[key]].get_tensor(key))


def from_safetensors(model: nn.Module, folder: str | Path) -> SafetensorsInit:
    """`runtime.shard(model, plan, param_init_fn=from_safetensors(model, folder))` loads `folder`'s weights."""
    require_transformers()
    return SafetensorsInit(model, folder)
