"""Tiers as types (planner/specs/tiers.py [Note: tiers as types]): the three built-in tiers answer
for themselves, there is one `uses_nvme`, and a new tier is one class: a CXL memory expander defined
here, registered, and planned with (bill, estimate, simulator, search, plan files) without a line of
the planner knowing its name."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from planner.cost.memory import memory_bill
from planner.cost.throughput import estimate
from planner.output.deepspeed_config import deepspeed_config
from planner.output.framework_configs import fsdp2_refusal
from planner.search.search import SearchRequest, candidate_placements, predict, search
from planner.sim.report import simulate
from planner.specs import history
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.memory_terms import MemoryTerm
from planner.specs.model import ModelSpec
from planner.specs.plan import (
    LINKS,
    STRATEGY_TABLE,
    Placement,
    Plan,
    Prediction,
    load_plan,
    parse_placement_pins,
)
from planner.specs.tiers import GPU, HOST, NVME, TIERS, LinkRates, StagedTier
from planner.specs.units import GB, GIB

ROOT = Path(__file__).resolve().parent.parent
CXL_CAPACITY_BYTES = 512 * GIB
CXL_READ_BYTES_PER_S = 20 * GB  # a x16 CXL 1.1 expander: below the 50 GB/s host link, above NVMe
CXL_WRITE_BYTES_PER_S = 16 * GB


class CxlMemory(StagedTier):
    """Memory on a CXL expander: behind host memory, with a capacity and a link of its own."""

    label, read_link, write_link = "CXL", "cxl_read", "cxl_write"
    __slots__ = ()

    def capacity_bytes(self, node: NodeSpec) -> float:
        return CXL_CAPACITY_BYTES

    def link_rates(self, node: NodeSpec) -> LinkRates:
        return LinkRates(CXL_READ_BYTES_PER_S, CXL_WRITE_BYTES_PER_S)


@pytest.fixture
def cxl():
    tier = TIERS.register(CxlMemory("cxl"))
    yield tier
    TIERS.unregister(tier)


SMALL = ModelSpec(name="small", num_layers=4, hidden_size=1024, num_heads=16, seq_len=512, vocab_size=1000)


def _plan(tier: str, node: NodeSpec, model: ModelSpec = SMALL) -> Plan:
    """ZeRO-Infinity's placement with `tier` where it puts NVMe: parameters, gradients and optimizer states."""
    placement = Placement(params=tier, gradients=tier, optimizer_states=tier, recompute_inputs="cpu")
    return Plan(model=model, node=node, num_gpus=1, placement=placement, nvme_path="/tmp/swap")


def _nvme_as_fast_as_cxl() -> NodeSpec:
    """A one-GPU node whose NVMe has the CXL expander's capacity and rates."""
    return resolve_hardware("h200-x1").replace(
        nvme_capacity_bytes=CXL_CAPACITY_BYTES, nvme_read_bytes_per_s=CXL_READ_BYTES_PER_S,
        nvme_write_bytes_per_s=CXL_WRITE_BYTES_PER_S, nvme_read_write="independent")


def _as_nvme(on_cxl: dict[str, float], on_nvme: dict[str, float], cxl: str) -> tuple[dict, dict]:
    """The two plans' tables with the cxl plan's tier keys named as NVMe's, and each without the
    other tier's (idle) keys."""
    names = {str(cxl): str(NVME), cxl.read_link: NVME.read_link, cxl.write_link: NVME.write_link}
    renamed = {names.get(k, k): v for k, v in on_cxl.items() if k not in names.values()}
    return renamed, {k: v for k, v in on_nvme.items() if k not in names}


# -- the built-in tiers -----------------------------------------------------------------------------
def test_the_builtin_tiers_are_the_plan_vocabulary():
    assert list(TIERS) == ["gpu", "cpu", "nvme"] and tuple(TIERS) == (GPU, HOST, NVME)
    assert [t.hops_to_gpu for t in TIERS] == [0, 1, 2]
    assert [t.scope for t in TIERS] == ["per GPU", "per node", "per node"]
    assert list(LINKS) == ["nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter"]
    node = resolve_hardware("dgx-h100")
    assert [t.capacity_bytes(node) for t in TIERS] == [node.gpu_memory_bytes, node.cpu_memory_bytes,
                                                       node.nvme_capacity_bytes]
    assert NVME.route(node) == (NVME, HOST) and HOST.route(node) == (HOST,) and GPU.route(node) == ()
    cpu_machine = resolve_hardware("cpu-dev-2core")  # the host is the device: host memory is the compute's
    assert NVME.route(cpu_machine) == (NVME,) and HOST.route(cpu_machine) == ()


def test_a_placement_holds_tiers_and_writes_their_names():
    placement = Placement.from_dict({"params": "nvme", "gradients": "cpu", "optimizer_states": "nvme"})
    assert placement.params is NVME and placement.gradients is HOST and placement.recompute_inputs is GPU
    assert placement.to_dict() == {"params": "nvme", "gradients": "cpu", "optimizer_states": "nvme",
                                   "recompute_inputs": "gpu"}
    assert parse_placement_pins("params=nvme") == {"params": NVME}
    with pytest.raises(PlannerError, match="placement.params must be one of gpu, cpu, nvme, got 'tape'"):
        Placement.from_dict({"params": "tape"})


def test_one_uses_nvme_counts_recompute_inputs():
    node = resolve_hardware("dgx-h100")
    checkpoints_only = Placement(recompute_inputs="nvme")
    assert checkpoints_only.uses_nvme and not checkpoints_only.model_states_on_nvme
    states = STRATEGY_TABLE["zero-inf-nvme"].placement
    assert states.uses_nvme and states.model_states_on_nvme
    assert not STRATEGY_TABLE["zero-inf-cpu"].placement.uses_nvme
    plan = Plan(model=SMALL, node=node, num_gpus=8, placement=checkpoints_only)
    assert plan.uses_nvme


# -- a new tier: one class --------------------------------------------------------------------------
def test_a_new_tier_is_named_nowhere_in_the_planner():
    # No string of the planner, the CLI or the dashboard names it (its docs may mention this test).
    for package in ("planner", "app", "tierwise"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert '"cxl' not in text and "'cxl" not in text, path


def test_a_registered_tier_joins_the_vocabulary(cxl):
    assert list(TIERS)[-1] == "cxl" and "cxl" in TIERS
    assert {"cxl_read", "cxl_write"} <= set(LINKS)
    assert Prediction(feasible=True).peak_bytes == {"gpu": 0, "cpu": 0, "nvme": 0, "cxl": 0}
    # Its optimizer steps on the CPU, as NVMe's: the gradients lie there or beside the states.
    assert cxl.gradient_tiers == (HOST, cxl)
    with pytest.raises(PlannerError, match="optimizer_states=cxl steps on the CPU, so gradients must be cpu or cxl, not gpu"):
        Placement(optimizer_states="cxl")


def test_a_plan_on_the_new_tier_round_trips_through_its_file(cxl, tmp_path):
    plan = _plan("cxl", resolve_hardware("h200-x1"))
    plan.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.placement.optimizer_states is cxl and loaded == plan
    assert not loaded.uses_nvme


def test_the_bill_puts_states_in_the_new_tier_as_it_would_on_nvme(cxl):
    # At NVMe's rates and capacity the new tier is NVMe by another name: the same bill, term by term.
    node = _nvme_as_fast_as_cxl()
    on_cxl, on_nvme = memory_bill(_plan("cxl", node)), memory_bill(_plan("nvme", node))
    assert on_cxl.capacity_bytes[cxl] == CXL_CAPACITY_BYTES
    assert on_cxl.terms[cxl] == on_nvme.terms[NVME] and MemoryTerm.OPTIMIZER_STATES in on_cxl.terms[cxl]
    assert on_cxl.terms[NVME] == {} and on_nvme.terms[cxl] == {}
    assert on_cxl.terms[GPU] == on_nvme.terms[GPU] and on_cxl.terms[HOST] == on_nvme.terms[HOST]
    assert MemoryTerm.OPTIMIZER_SWAP_BUFFERS in on_cxl.terms[HOST]  # staged through pinned host buffers


def test_the_estimate_prices_the_new_tiers_link(cxl):
    node = _nvme_as_fast_as_cxl()
    on_cxl, on_nvme = estimate(_plan("cxl", node)), estimate(_plan("nvme", node))
    assert on_cxl.link_bytes["cxl_read"] > 0 and on_cxl.link_bytes["nvme_read"] == 0
    mine, nvme = _as_nvme(on_cxl.link_bytes, on_nvme.link_bytes, cxl)
    assert mine == nvme
    assert on_cxl.phase_time_s == on_nvme.phase_time_s
    # Its own rate: a slower expander makes a slower step.
    class SlowCxl(CxlMemory):
        __slots__ = ()

        def link_rates(self, node: NodeSpec) -> LinkRates:
            return LinkRates(CXL_READ_BYTES_PER_S / 10, CXL_WRITE_BYTES_PER_S)

    TIERS.unregister(cxl)
    TIERS.register(SlowCxl("cxl"))
    try:
        slow = estimate(_plan("cxl", node))
    finally:
        TIERS.unregister(TIERS.named("cxl"))
        TIERS.register(cxl)
    assert slow.phase_time_s["optimizer"] > on_cxl.phase_time_s["optimizer"]


def test_the_simulator_routes_the_new_tiers_link(cxl):
    node = _nvme_as_fast_as_cxl()
    on_cxl, on_nvme = simulate(_plan("cxl", node)).prediction, simulate(_plan("nvme", node)).prediction
    assert on_cxl.details["resources"]["cxl_read"]["busy_s"] > 0
    assert on_cxl.details["resources"]["nvme_read"]["busy_s"] == 0
    assert on_cxl.iteration_time_s == on_nvme.iteration_time_s
    mine, nvme = _as_nvme(on_cxl.link_bytes, on_nvme.link_bytes, cxl)
    assert mine == nvme
    simulated = on_cxl.details["simulated_peak_bytes"]
    assert simulated["cxl"] == on_nvme.details["simulated_peak_bytes"]["nvme"] > 0
    assert on_cxl.details["memory_scope"]["cxl"] == "per node"


def test_the_search_can_choose_the_new_tier(cxl):
    # 30B needs ~560 GB of model states: more than one H200, its host memory and its 64 GiB of NVMe hold.
    request = SearchRequest(model=resolve_model("30B"), node=resolve_hardware("h200-x1"), num_gpus=1)
    best = search(request).best
    assert best is not None and best.prediction.feasible
    assert cxl in best.placement.to_dict().values()
    assert 0 < best.prediction.peak_bytes["cxl"] <= CXL_CAPACITY_BYTES
    assert any(p.params == cxl for _, p in candidate_placements(None, {}))
    # Activation checkpoints go there only when pinned, as on NVMe.
    assert not any(p.recompute_inputs == cxl for _, p in candidate_placements(None, {}))
    assert all(p.recompute_inputs == cxl
               for _, p in candidate_placements(None, {"recompute_inputs": cxl}))


def test_the_run_history_takes_a_tier_added_after_its_file_was_written(cxl, tmp_path):
    # A file written when the planner had no NVMe tier: its peak columns appear when it is opened.
    path = tmp_path / "history.sqlite"
    kept = [f"{name} {kind}" for name, kind in history._COLUMNS if "_peak_nvme_" not in name]
    with sqlite3.connect(path) as con:
        con.execute(f"CREATE TABLE runs (id INTEGER PRIMARY KEY AUTOINCREMENT, {', '.join(kept)})")
    store = history.RunHistory(path)
    plan = predict(_plan("cxl", resolve_hardware("h200-x1")))
    store.append(plan, {"measured": {"peak_bytes": {"gpu": 1, "cpu": 2, "nvme": 3, "cxl": 4}}})
    frame = store.to_frame()
    assert set(frame.columns) == {"id", *history.COLUMN_NAMES}  # the added ones last
    assert frame.loc[0, "measured_peak_nvme_bytes"] == 3 and frame.loc[0, "optimizer_states_tier"] == "cxl"
    assert json.loads(frame.loc[0, "profile_json"])["measured"]["peak_bytes"]["cxl"] == 4


def test_other_frameworks_exports_refuse_the_new_tier(cxl):
    plan = _plan("cxl", resolve_hardware("h200-x1"))
    with pytest.raises(PlannerError, match="DeepSpeed cannot place params on cxl: it offloads to cpu or nvme only"):
        deepspeed_config(plan)
    assert fsdp2_refusal(plan).startswith("CXL placement (params=cxl, gradients=cxl, optimizer_states=cxl): "
                                          "FSDP2 offloads to CPU memory only")
