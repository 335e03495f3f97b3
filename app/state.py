"""What the user asked (the sidebar) as one frozen, hashable value, and the specs it resolves to.

[Note: dashboard caching keys]
Streamlit reruns the whole script on every interaction. The expensive library calls (the search,
the largest-model curves, the simulation) are cached on the *inputs*, not on the specs: `Inputs` is
made of strings, numbers and tuples only, so its JSON is a stable cache key, and the specs are
rebuilt from it inside the cached function (by the library's own resolvers and validators). A bad
value therefore raises `PlannerError` inside the cached call, is not cached, and the page shows its
one-line message.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from planner.search.pins import parallel_degrees
from planner.search.search import SearchRequest
from planner.specs import hf_config
from planner.specs.catalog import DEFAULT_HARDWARE, hardware_presets, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.hardware import NVME_READ_WRITE, NodeSpec
from planner.specs.model import ModelSpec
from planner.specs.plan import STATES
from planner.specs.training_loop import TrainingLoop

DEFAULT_MODEL = "1T"
DEFAULT_GPUS = 16
CHOICE_KEYS: dict[str, tuple[str, ...]] = {"nvme_read_write": NVME_READ_WRITE}
"""Hardware document keys that take one of a few words rather than a number."""


@dataclass(frozen=True, kw_only=True)
class Inputs:
    """Everything the sidebar sets. None means "search it" (or "the model's own" for `seq_len`)."""

    model: str | None = DEFAULT_MODEL
    """Size shorthand, preset name or file; None when the shape is given explicitly."""
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    seq_len: int | None = None
    hardware: str = DEFAULT_HARDWARE
    overrides: tuple[tuple[str, float | str], ...] = ()
    """Hardware document keys (`nvme_read_gb_per_s`, ...) whose value differs from the preset."""
    num_gpus: int = DEFAULT_GPUS
    micro_batch_per_gpu: float | None = None
    strategy: str | None = None
    placement_pins: tuple[tuple[str, str], ...] = field(default=())
    model_parallel_degree: int | str | None = None
    """A whole number, `auto` (searched), or None: not given, 1 except for the `3d` strategy
    (`planner.search.pins.parallel_degrees`, the rule `planner fit` applies)."""
    precision: str = "bf16"
    optimizer_step: str | None = None
    """`Plan.optimizer_step` pinned, or None: searched among the schedules the training allows."""
    clips_grad_norm: bool = False
    """The training clips gradients by their global norm (only the after-backward step)."""
    refine: bool = False
    """Re-rank the top placements by simulation, as `planner fit` does (the sidebar sets it on; see
    docs/dashboard.md)."""
    model_document: str | None = None
    """An uploaded model JSON or Hugging Face config.json (its text): the model, instead of `model`."""
    hardware_document: str | None = None
    """An uploaded hardware JSON (its text): the node, instead of the `hardware` preset."""
    server_files: bool = False
    """Whether the model field may name a file on the server: only when the dashboard is served on
    localhost (a file's values come back in error messages, so nobody else may choose the file)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Inputs:
        doc: dict[str, Any] = json.loads(text)
        doc["overrides"] = tuple((k, v) for k, v in doc["overrides"])
        doc["placement_pins"] = tuple((k, v) for k, v in doc["placement_pins"])
        return cls(**doc)

    def unpinned(self) -> Inputs:
        """The same question with placement left to the search: every strategy gets considered."""
        return replace(self, strategy=None, placement_pins=())

    def hardware_key(self) -> str:
        return json.dumps([self.hardware, list(self.overrides), self.hardware_document])


def model_spec(inputs: Inputs) -> ModelSpec:
    if inputs.model_document is not None:
        spec = model_from_upload(inputs.model_document)
        return spec.replace(seq_len=inputs.seq_len) if inputs.seq_len is not None else spec
    if inputs.model is not None and not inputs.server_files and names_a_file(inputs.model):
        raise PlannerError("the model field takes a size or a preset name when the dashboard is served beyond "
                           "localhost (it reads no files on the server); upload the model JSON or config.json instead")
    return resolve_model(
        inputs.model, layers=inputs.num_layers, hidden=inputs.hidden_size, heads=inputs.num_heads, seq=inputs.seq_len
    )


def names_a_file(text: str) -> bool:
    """What `planner.specs.catalog` would read as a file: a document suffix, a path, or an existing file."""
    text = text.strip()
    return text.lower().endswith((".json", ".yaml", ".yml")) or "/" in text or os.sep in text or Path(text).exists()


def uploaded_document(text: str, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"the uploaded {what} file is not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(doc, dict):
        raise PlannerError(f"the uploaded {what} file must hold a JSON object")
    return doc


def model_from_upload(text: str) -> ModelSpec:
    doc, where = uploaded_document(text, "model"), "uploaded model file"
    if hf_config.is_hf_config(doc):
        return hf_config.spec_from_hf_config(doc, name=hf_config.describe("uploaded config.json", doc, where), where=where)
    return ModelSpec.from_dict(doc, where)


def preset_document(hardware: str) -> dict[str, Any]:
    return hardware_presets()[hardware.lower()].to_dict()


def node_spec(hardware: str, overrides: tuple[tuple[str, float | str], ...], document: str | None = None) -> NodeSpec:
    """The preset (or the uploaded hardware document) with the overridden document keys; the library
    validates and converts units."""
    if document is not None:
        preset = NodeSpec.from_dict(uploaded_document(document, "hardware"), "uploaded hardware file")
    else:
        preset = hardware_presets()[hardware.lower()]
    if not overrides:
        return preset
    doc = preset.to_dict()
    doc.update(dict(overrides))
    doc["name"] = f"{preset.name} (modified: {', '.join(k for k, _ in overrides)})"
    return NodeSpec.from_dict(doc, "hardware overrides")


def search_request(inputs: Inputs) -> SearchRequest:
    mp, pp = parallel_degrees(inputs.strategy, inputs.model_parallel_degree)
    return SearchRequest(
        model=model_spec(inputs),
        node=node_spec(inputs.hardware, inputs.overrides, inputs.hardware_document),
        num_gpus=inputs.num_gpus,
        strategy=inputs.strategy,
        placement_pins=dict(inputs.placement_pins),
        micro_batch_per_gpu=inputs.micro_batch_per_gpu,
        model_parallel_degree=mp,
        pipeline_parallel_degree=pp,
        precision=inputs.precision,
        training=TrainingLoop(optimizer_step=inputs.optimizer_step, clips_grad_norm=inputs.clips_grad_norm),
    )


def overridable_keys(hardware: str) -> list[str]:
    """Every number of the hardware document, and its choices (NVMe read/write sharing)."""
    doc = preset_document(hardware)
    return [
        k for k, v in doc.items()
        if k in CHOICE_KEYS or (isinstance(v, int | float) and not isinstance(v, bool))
    ]


def pins_from(choices: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """Sidebar placement choices (`auto` or a tier per state) -> the search's pins."""
    return tuple((state, choices[state]) for state in STATES if choices.get(state, "auto") != "auto")
