"""docs/plan-format.md documents every key the plan and profile writers emit.

Each document below is written the way the product writes it (`Plan.to_dict` with every optional
key set, the analytic, simulated, extrapolated, pipelined and refined predictions, a profile from
the runtime's `build_profile`); every dotted key path of it must head a row of one of the page's tables.
Children that are data rather than schema (a tier, a memory term, a simulator resource, a
hardware key in `sources`) are written as a placeholder (`<tier>`) and their names must appear in
the page too. A renamed or added key fails here until the page says what it means."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.search.refine import refine
from planner.search.search import SearchRequest, predict, search
from planner.sim import simulate
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.hardware import EfficiencyCurve
from planner.specs.memory_terms import MemoryTerm
from planner.specs.model import ModelSpec
from planner.specs.plan import STRATEGY_TABLE, HostPinning, Placement, Plan

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "plan-format.md").read_text()
ROWS = set(re.findall(r"^\| `([^`]+)` \|", PAGE, re.M))
"""The keys the page's tables document: the first cell of a row."""

# (pattern of a dotted path, its documented form, the group whose name must appear in the page)
PLACEHOLDERS: tuple[tuple[str, str, int | None], ...] = (
    (r"^hardware\.(sources|citations)\.[^.]+$", r"hardware.\1", None),
    (r"^hardware\.precision_rates\.(bf16|fp16|fp32)\.([^.]+)$", r"hardware.precision_rates.<precision>.\2", None),
    (r"^prediction\.memory_terms\.(gpu|cpu|nvme)\.([^.]+)$", r"prediction.memory_terms.<tier>.<term>", 2),
    (r"^prediction\.details\.resources\.([^.]+)\.([^.]+)$", r"prediction.details.resources.<resource>.\2", 1),
    (r"^prediction\.details\.simulated_memory_terms\.(gpu|cpu|nvme)\.[^.]+$",
     r"prediction.details.simulated_memory_terms.<tier>.<label>", None),
    (r"^prediction\.details\.(simulated_peak_bytes|memory_scope|memory_timeline|memory_peak_time_s)\.(gpu|cpu|nvme)$",
     r"prediction.details.\1.<tier>", None),
    (r"^prediction\.details\.(component_time_s|efficiency_no_overlap|pipeline|analytic)\.(.+)$",
     r"prediction.details.\1", 2),
    (r"^samples\[\]\.phase_time_s\.[^.]+$", r"samples[].phase_time_s.<phase>", None),
    (r"^samples\[\]\.link_bytes\.[^.]+$", r"samples[].link_bytes.<link>", None),
    (r"^samples\[\]\.peak_bytes\.[^.]+$", r"samples[].peak_bytes.<tier>", None),
)
LEAVES = {"hardware.efficiency.transfer", "hardware.efficiency.matmul", "hardware.efficiency.attention", "plan"}
"""Lists of points and the profile's embedded plan, documented as a whole."""


def _paths(doc: dict[str, Any], prefix: str = "") -> list[str]:
    """Every leaf's dotted path (an object's keys below it; `[]` for the items of a list of objects)."""
    paths = []
    for key, value in doc.items():
        path = f"{prefix}{key}"
        if path not in LEAVES and isinstance(value, dict):  # an empty object has no key to document
            paths += _paths(value, f"{path}.")
        elif path not in LEAVES and isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                paths += _paths(item, f"{path}[].")
        else:
            paths.append(path)
    return paths


def _undocumented(paths: list[str]) -> set[str]:
    missing = set()
    for path in paths:
        documented, name = path, None
        for pattern, form, group in PLACEHOLDERS:
            match = re.match(pattern, path)
            if match:
                documented = match.expand(form)
                name = match.group(group) if group else None
                break
        if documented not in ROWS:
            missing.add(documented)
        if name is not None and not _named(name):
            missing.add(f"{documented}: {name}")
    return missing


def _named(name: str) -> bool:
    """A data key's name is in the page: as itself, or with its tier as `<tier>` (`params (<tier>)`)."""
    generic = re.sub(r"\((gpu|cpu|nvme)\)", "(<tier>)", name)
    return f"`{name}`" in PAGE or f"`{generic}`" in PAGE


def _every_model_key() -> ModelSpec:
    """A model with every optional shape key set away from its default."""
    return ModelSpec(name="every key", num_layers=4, hidden_size=256, num_heads=4, seq_len=128, vocab_size=1000,
                     head_dim=32, qkv_bias=True, attn_out_bias=True, mlp_bias=True, norm="layernorm",
                     norms_per_block=3, qk_norm=True, position_embeddings=128, rotary=True, dropout=True,
                     attention="eager", source="tests/test_plan_format.py")


def _every_hardware_key():  # noqa: ANN202
    """dgx-h100 with every optional key set."""
    node = resolve_hardware("dgx-h100")
    from planner.specs.precision import PrecisionRates

    return replace(node, host_is_device=True, backward_matmul_flops_per_s=5e14, whole_node_gpus=16,
                   host_memcpy_bytes_per_s=2e10,
                   attention_efficiency=EfficiencyCurve(((1024.0, 0.5), (8192.0, 0.9))), compute_precision="bf16",
                   precision_rates=(("bf16", PrecisionRates(6e14, 5e14)), ("fp32", PrecisionRates(5e13, 5e13))))


def _plan(**changes: Any) -> Plan:
    fields: dict[str, Any] = {"model": ModelSpec(num_layers=4, hidden_size=1024, num_heads=16, seq_len=512),
                              "node": resolve_hardware("dgx-h100"), "num_gpus": 16,
                              "placement": Placement(params="nvme", gradients="cpu", optimizer_states="nvme",
                                                     recompute_inputs="cpu"), "nvme_path": "/tmp/swap"}
    return Plan(**(fields | changes))


def test_every_plan_key_is_documented():
    tp, cp = 2, 2
    context_parallel = Plan(model=resolve_model("llama-3-8b"), node=resolve_hardware("dgx-h100"), num_gpus=16,
                            strategy="3d", placement=STRATEGY_TABLE["3d"].placement, recompute_interval=0,
                            micro_batch_per_gpu=2 / (tp * cp), model_parallel_degree=tp, context_parallel_degree=cp,
                            optimizer_step_reason="pinned by the user (--optimizer-step)", host_pinning=HostPinning.SHARDS)
    documents = [context_parallel.to_dict(), {"model": _every_model_key().to_dict()},
                 {"hardware": _every_hardware_key().to_dict()}]
    assert {"context_parallel_degree", "optimizer_step_reason", "host_pinning"} <= set(documents[0])
    assert "head_dim" in documents[1]["model"]
    assert {"host_is_device", "whole_node_gpus", "backward_matmul_tflops", "compute_precision",
            "precision_rates", "host_memcpy_gb_per_s"} <= set(documents[2]["hardware"])
    missing = set().union(*(_undocumented(_paths(doc)) for doc in documents))
    assert not missing, f"keys the plan writes that docs/plan-format.md does not document: {sorted(missing)}"


def test_every_prediction_key_is_documented():
    independent = _plan(node=replace(resolve_hardware("dgx-h100"), nvme_read_write="independent"))
    pipelined = _plan(strategy="3d", placement=STRATEGY_TABLE["3d"].placement, pipeline_parallel_degree=2,
                      micro_batches_per_step=4, nvme_path=None, recompute_interval=1)
    # `planner fit`'s answer: simulated by extrapolation over identical blocks, the analytic estimate beside
    request = SearchRequest(model=resolve_model("gpt3-13b"), node=resolve_hardware("dgx-h100"), num_gpus=8)
    refined = refine(search(request)).best
    predictions = {
        "analytic": predict(_plan()).prediction,
        "simulated": simulate(_plan()).prediction,
        "independent NVMe": simulate(independent).prediction,
        "pipelined": simulate(pipelined).prediction,
        "refined": refined.prediction,
    }
    details = {name: set(p.details) for name, p in predictions.items()}
    assert {"memory_timeline", "resources"} <= details["simulated"] and "component_time_s" in details["analytic"]
    assert {"analytic", "extrapolated_from_layers"} <= details["refined"] and "pipeline" in details["pipelined"]
    missing = set().union(*(_undocumented(_paths({"prediction": p.to_dict()})) for p in predictions.values()))
    assert not missing, f"prediction keys that docs/plan-format.md does not document: {sorted(missing)}"


def test_every_profile_key_is_documented():
    from runtime.launch import build_profile

    plan = _plan(placement=Placement(), nvme_path=None, num_gpus=1, model=ModelSpec(num_layers=2, hidden_size=64,
                                                                                     num_heads=4, seq_len=32))
    step = {"step_time_s": 0.5, "phase_time_s": {"forward": 0.1, "backward": 0.3, "optimizer": 0.1},
            "link_bytes": dict.fromkeys(("nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter"), 0),
            "peak_bytes": {"gpu": 1 << 20, "cpu": 1 << 20, "nvme": 0}, "terms_at_peak": {"gpu": {"params": 1 << 10}},
            "cuda_max_allocated_bytes": 0}
    profile = build_profile(plan, [([step, step, step], {"peak_rss_bytes": 1 << 30, "order_changes": 0})],
                            [2.0, 1.9, 1.8], 2, device="cpu", num_params_run=plan.model.num_params)
    doc = profile.to_dict()
    measured = doc.pop("measured")
    assert set(measured) == set(predict(plan).prediction.to_dict())  # the prediction's shape, documented once
    missing = _undocumented(_paths(doc) + [f"measured.details.{k}" for k in measured["details"]])
    assert not missing, f"profile keys that docs/plan-format.md does not document: {sorted(missing)}"


def test_every_memory_term_is_documented():
    assert not {term.value for term in MemoryTerm} - ROWS


def test_the_paths_walk_every_level():
    """The walk itself: nested objects, lists of objects and data children all reach the check."""
    paths = _paths({"prediction": {"memory_terms": {"gpu": {"awm": 1}}, "details": {"resources": {
        "nvme": {"busy_s": 1.0}}}}, "samples": [{"step": 1, "phase_time_s": {"forward": 0.1}}]})
    assert "prediction.memory_terms.gpu.awm" in paths and "samples[].phase_time_s.forward" in paths
    assert _undocumented(["prediction.memory_terms.gpu.awm", "prediction.details.resources.nvme.busy_s"]) == set()
    assert _undocumented(["prediction.no_such_key"]) == {"prediction.no_such_key"}
    assert _undocumented(["prediction.memory_terms.gpu.no_such_term"]) == {
        "prediction.memory_terms.<tier>.<term>: no_such_term"}
