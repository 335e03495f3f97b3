"""The sidebar: model, hardware (preset plus an override for every capacity and bandwidth), GPUs,
sequence, batch and placement. Widgets only; they produce one `Inputs` value.

Number inputs carry no bounds of their own: the library validates every value (`PlannerError`),
so the page shows the same one-line message the CLI would, never a traceback (docs/dashboard.md).
"""

from __future__ import annotations

import streamlit as st

from app.state import (
    CHOICE_KEYS,
    DEFAULT_GPUS,
    DEFAULT_MODEL,
    Inputs,
    overridable_keys,
    pins_from,
    preset_document,
)
from planner.specs.catalog import DEFAULT_HARDWARE, hardware_presets, known_model_names
from planner.specs.plan import PRECISIONS, STATES, STRATEGY_TABLE
from planner.specs.tiers import TIERS

AUTO = "auto"
MODEL_MODES = ("size or preset", "explicit shape")
NOT_GIVEN = "default"
MODEL_PARALLEL_CHOICES = (NOT_GIVEN, "1", "2", "4", "8", AUTO)
"""`default` is 1, searched for the `3d` strategy, as `planner fit` without `--model-parallel`."""
_UNIT_LABELS = (("_gparams_per_s", " (G params/s)"), ("_gb_per_s", " (GB/s)"), ("_gib", " (GiB)"), ("_tflops", " (TFLOPS)"))


def override_label(key: str) -> str:
    """`nvme_read_gb_per_s` -> `nvme read (GB/s)`: the document key with its unit spelled out."""
    for suffix, unit in _UNIT_LABELS:
        if key.endswith(suffix):
            return key[: -len(suffix)].replace("_", " ") + unit
    return key.replace("_", " ")


def read_sidebar() -> Inputs:
    bar = st.sidebar
    bar.header("Model")
    mode = bar.radio("Model given as", MODEL_MODES, key="model_mode", horizontal=True)
    local = served_locally()
    model_document = None
    if mode == MODEL_MODES[0]:
        model = bar.text_input(
            "Size, preset or JSON file" if local else "Size or preset", value=DEFAULT_MODEL, key="model",
            help=f"A size like 1T, 175B or 1.4B, or a preset: {known_model_names()}"
                 + ("" if local else ". Served beyond localhost, the page reads no server files: upload one below."),
        ).strip()
        model_document = _upload(bar, "...or upload a model JSON or Hugging Face config.json", "model_upload")
        layers = hidden = heads = None
    else:
        model = ""
        layers = bar.number_input("Layers", value=128, step=1, key="layers")
        hidden = bar.number_input("Hidden size", value=25600, step=128, key="hidden")
        heads = bar.number_input("Attention heads", value=256, step=1, key="heads")
    seq = bar.number_input("Sequence length", value=None, step=256, key="seq", placeholder="the model's own")

    bar.header("Hardware")
    presets = list(hardware_presets())
    hardware = bar.selectbox("Node preset", presets, index=presets.index(DEFAULT_HARDWARE), key="hardware")
    hardware_document = _upload(bar, "...or upload a hardware JSON (`planner probe --out`)", "hardware_upload")
    # An uploaded spec is edited in its file; the overrides start from a preset's own numbers.
    overrides = _hardware_overrides(bar, hardware) if hardware_document is None else []
    gpus = bar.number_input("Number of GPUs", value=DEFAULT_GPUS, step=1, key="gpus")

    bar.header("Training")
    batch = bar.number_input(
        "Batch per GPU (global batch / GPUs)", value=None, step=1.0, key="batch", placeholder="largest that fits",
    )
    precision = bar.selectbox("Precision", PRECISIONS, key="precision")
    in_backward = bar.toggle(
        "Optimizer step in backward", key="in_backward", value=False,
        help="Update each unit as soon as its gradient is final, overlapping the optimizer with the backward "
             "(the plan's optimizer step `in_backward`): no gradient accumulation or clipping, not with fp16.",
    )
    mp = bar.selectbox("Model-parallel degree", MODEL_PARALLEL_CHOICES, key="model_parallel",
                       format_func=lambda c: "1 (searched for 3d)" if c == NOT_GIVEN else c)
    refine = bar.toggle(
        "Rank the top plans by simulation", key="refine", value=True,  # on, as docs/dashboard.md says
        help="As `planner fit` does (so the page and the CLI agree): the best plan of each of the 8 best placements "
             "is simulated (discrete-event) and re-ranked. Off, the faster analytic estimate ranks.",
    )

    bar.header("Placement")
    strategy = bar.selectbox("Strategy", (AUTO, *STRATEGY_TABLE), key="strategy",
                             help="Pin a named strategy, or leave it to the search")
    pins = {state: bar.selectbox(state.replace("_", " "), (AUTO, *map(str, TIERS)), key=f"pin:{state}") for state in STATES}
    return Inputs(
        model=model or None,  # an empty field is "no model named": the library says what to give
        num_layers=_whole(layers),
        hidden_size=_whole(hidden),
        num_heads=_whole(heads),
        seq_len=_whole(seq),
        hardware=hardware,
        overrides=tuple(overrides),
        num_gpus=_whole(gpus),
        micro_batch_per_gpu=batch,
        strategy=None if strategy == AUTO else strategy,
        placement_pins=pins_from(pins),
        model_parallel_degree=None if mp == NOT_GIVEN else (AUTO if mp == AUTO else int(mp)),
        precision=precision,
        optimizer_step="in_backward" if in_backward else "after_backward",
        refine=refine,
        model_document=model_document if mode == MODEL_MODES[0] else None,
        hardware_document=hardware_document,
        server_files=local,
    )


LOCAL_ADDRESSES = ("127.0.0.1", "localhost", "::1")


def served_locally() -> bool:
    """True when the server listens on the loopback interface only (`planner dashboard` without
    `--address`); a bare `streamlit run` binds every interface, so it counts as served beyond."""
    return (st.get_option("server.address") or "") in LOCAL_ADDRESSES


def _upload(bar, label: str, key: str) -> str | None:  # noqa: ANN001
    upload = bar.file_uploader(label, type=["json"], key=key)
    return None if upload is None else upload.getvalue().decode("utf-8", errors="replace")


def _hardware_overrides(bar, hardware: str) -> list[tuple[str, float | str]]:  # noqa: ANN001
    overrides: list[tuple[str, float | str]] = []
    with bar.expander("Overrides: every capacity and bandwidth"):
        doc = preset_document(hardware)
        for key in overridable_keys(hardware):
            # Keyed by preset, so switching presets starts from that preset's own numbers.
            if key in CHOICE_KEYS:
                choices = CHOICE_KEYS[key]
                value = st.selectbox(override_label(key), choices, index=choices.index(doc[key]), key=f"hw:{hardware}:{key}")
            else:
                integer = isinstance(doc[key], int)
                value = st.number_input(
                    override_label(key), value=doc[key] if integer else float(doc[key]),
                    step=1 if integer else None, format=None if integer else "%g", key=f"hw:{hardware}:{key}",
                )
            if value != doc[key]:
                overrides.append((key, value))
    return overrides


def _whole(value: float | int | None) -> int | float | None:
    """Integer-valued inputs come back as int; anything else is left for the library to reject."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value
