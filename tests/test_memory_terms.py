"""One memory vocabulary and one phase vocabulary: the bill, the simulator and the runtime name the
same terms (planner/specs/memory_terms.py [Note: adding a memory buffer]), and every phase is a `Phase`."""

from __future__ import annotations

import json

import pytest

from planner.cost.memory import memory_bill, runtime_buffer_peak_bytes
from planner.cost.throughput import estimate
from planner.sim.engine import Simulation
from planner.sim.report import simulate
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.memory_terms import MemoryTerm, describe
from planner.specs.model import ModelSpec
from planner.specs.phases import PHASES, Phase
from planner.specs.plan import TIERS, Placement, Plan

SMALL = ModelSpec(name="small", num_layers=4, hidden_size=256, num_heads=4, seq_len=64, vocab_size=512)
ALL_CPU = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")
ALL_NVME = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="nvme")


def _plans() -> dict[str, Plan]:
    """Between them, plans that bill every term (a new term needs a plan here that bills it)."""
    node = resolve_hardware("dgx-h100")
    return {
        # bf16 on 8 GPUs, states and recompute inputs on the host, depth 2: the GPU's staging and working terms.
        "bf16-cpu-depth2": Plan(model=resolve_model("gpt3-1.3b"), node=node, num_gpus=8, strategy="custom",
                                placement=ALL_CPU, prefetch_depth=2),
        # The same with its host shards pinned once: the gradients' landing buffers.
        "bf16-cpu-pinned-shards": Plan(model=resolve_model("gpt3-1.3b"), node=node, num_gpus=8, strategy="custom",
                                       placement=ALL_CPU, prefetch_depth=2, host_pinning="shards"),
        # fp32 on NVMe, depth 3: the fp32 gradient shard and every host swap buffer.
        "fp32-nvme-depth3": Plan(model=resolve_model("gpt3-1.3b"), node=node, num_gpus=8, strategy="custom",
                                 placement=ALL_NVME, precision="fp32", prefetch_depth=3),
        # The small model, for the simulator: every transient buffer it schedules.
        "small-cpu": Plan(model=SMALL, node=node, num_gpus=8, strategy="custom", placement=ALL_CPU, prefetch_depth=2),
        "small-nvme": Plan(model=SMALL, node=node, num_gpus=8, strategy="custom", placement=ALL_NVME, prefetch_depth=3),
        "small-nvme-in-backward": Plan(model=SMALL, node=node, num_gpus=8, strategy="custom", placement=ALL_NVME,
                                       prefetch_depth=3, optimizer_step="in_backward"),
        # Context parallel: the ring attention's KV blocks (planner/cost/context_parallel.py).
        "cp2-flash": Plan(model=resolve_model("llama-3-8b"), node=node, num_gpus=8, strategy="3d",
                          placement=Placement(), micro_batch_per_gpu=0.5, recompute_interval=0,
                          context_parallel_degree=2),
        "small-cpu-machine": Plan(model=SMALL, node=resolve_hardware("cpu-dev-2core"), num_gpus=1, strategy="custom",
                                  placement=ALL_NVME, prefetch_depth=2),
    }


PLANS = _plans()


def test_the_bills_terms_are_the_vocabulary():
    billed: set[str] = set()
    for plan in PLANS.values():
        for tier, terms in memory_bill(plan).terms.items():
            for term in terms:
                assert isinstance(term, MemoryTerm), (tier, term)
                assert tier in term.tiers, (tier, term)
                billed.add(term)
    assert billed == set(MemoryTerm)


def test_bill_json_keys_are_the_values():
    bill = memory_bill(PLANS["fp32-nvme-depth3"])
    assert json.loads(json.dumps(bill.terms)) == {tier: {t.value: v for t, v in terms.items()}
                                                  for tier, terms in bill.terms.items()}
    assert f"{MemoryTerm.MSWM}" == str(MemoryTerm.MSWM) == "mswm"


SIMULATED = {MemoryTerm.PARAMS, MemoryTerm.OPTIMIZER_STATES, MemoryTerm.RECOMPUTE_INPUTS, MemoryTerm.AWM,
             MemoryTerm.MSWM, MemoryTerm.PREFETCH_SHARD_STAGING, MemoryTerm.REDUCE_SCATTER_BUFFER,
             MemoryTerm.GRADIENT_OFFLOAD_STAGING, MemoryTerm.PARAM_SWAP_BUFFERS, MemoryTerm.OPTIMIZER_SWAP_BUFFERS,
             MemoryTerm.GRADIENT_SWAP_BUFFERS, MemoryTerm.LOGITS, MemoryTerm.ALLOCATOR_SLACK,
             MemoryTerm.RUNTIME_BOOKKEEPING, MemoryTerm.PINNED_STAGING_POOL}
"""What the simulator charges of the small plans (bf16: no `gradients`). It charges every gathered
operator to `mswm` (prefetched or in use), a recompute input's GPU copy to `recompute_inputs`, the
logits from the head's forward to the end of its backward, the allocator's slack on the most transient
bytes in use at once, and the host buffers the runtime holds all iteration at the bill's size."""


def test_simulator_terms_are_in_the_vocabulary():
    held: set[MemoryTerm] = set()
    for name in (name for name in PLANS if name.startswith("small")):
        sim = Simulation(PLANS[name]).run()
        for tracker in sim.trackers.values():
            for term in set(tracker.by_term) | {t for _, terms in tracker.windows for t in terms}:
                assert isinstance(term, MemoryTerm), (name, tracker.name, term)
                assert tracker.name in term.tiers, (name, tracker.name, term)
                held.add(term)
        reported = simulate(PLANS[name]).prediction.details["simulated_memory_terms"]
        for tier, terms in reported.items():
            assert set(terms) <= {t.label for t in MemoryTerm if tier in t.tiers}, (name, tier, terms)
    assert held == SIMULATED


def test_simulator_labels_name_one_term_per_tier():
    for tier in TIERS:
        labels = [t.label for t in MemoryTerm if tier in t.tiers]
        assert len(labels) == len(set(labels)), (tier, labels)


def test_runtime_ledger_terms_are_in_the_vocabulary():
    """The runtime's staging tables name bill terms; the ledger refuses any other name."""
    pytest.importorskip("torch")
    from runtime.ledger import MemoryLedger
    from runtime.transfer.nvme_store import STAGING_TERMS
    from runtime.units.group import STAGE_TERMS

    for tier, term in STAGE_TERMS.values():
        assert term in set(MemoryTerm) and tier in MemoryTerm(term).tiers, (tier, term)
    assert set(STAGING_TERMS) <= set(MemoryTerm) and set(STAGING_TERMS.values()) <= set(MemoryTerm)
    ledger = MemoryLedger()
    ledger.add("gpu", MemoryTerm.MSWM, 10)
    ledger.add("cpu", "param_swap_buffers", 10)
    with pytest.raises(AssertionError, match="not a memory term"):
        ledger.add("cpu", "nvme_staging", 10)


def test_flags_drive_slack_and_runtime_peaks():
    bill = memory_bill(PLANS["bf16-cpu-depth2"])
    gpu = bill.terms["gpu"]
    transient = sum(v for t, v in gpu.items() if t.transient)
    assert gpu[MemoryTerm.ALLOCATOR_SLACK] == pytest.approx(0.1 * transient, abs=8)
    untracked = {t for t in MemoryTerm if not t.ledgered}
    assert untracked == {MemoryTerm.AWM, MemoryTerm.LOGITS, MemoryTerm.NOT_AT_ONCE, MemoryTerm.ALLOCATOR_SLACK}
    assert runtime_buffer_peak_bytes(bill)["gpu"] == sum(v for t, v in gpu.items() if t not in untracked)


def test_describe_is_the_members_formula():
    assert describe("awm") == MemoryTerm.AWM.doc and "[eq. 5]" in describe("awm")
    assert describe("a term from another version") == ""


def test_phases_are_one_vocabulary():
    assert [p.value for p in PHASES] == ["forward", "backward", "optimizer"]
    assert {label: label.timed for label in Phase} == {Phase.FORWARD: Phase.FORWARD, Phase.RECOMPUTE: Phase.BACKWARD,
                                                        Phase.BACKWARD: Phase.BACKWARD, Phase.OPTIMIZER: Phase.OPTIMIZER}
    plan = PLANS["small-cpu"]
    assert list(estimate(plan).phase_time_s) == list(PHASES)
    sim = Simulation(plan).run()
    assert list(sim.phase_end_s) == list(PHASES)
    assert {s.phase for s in sim.work.steps} == {Phase.FORWARD, Phase.RECOMPUTE, Phase.BACKWARD}
    labels = {label for link in sim.links() for _, _, label in link.intervals}
    assert labels <= set(Phase) and all(isinstance(label, Phase) for label in labels), labels
    assert json.dumps(dict.fromkeys(PHASES, 0)) == '{"forward": 0, "backward": 0, "optimizer": 0}'
