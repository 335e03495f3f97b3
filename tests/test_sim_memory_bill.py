"""The simulated memory curve carries the bill's terms (planner/sim/engine.py, planner/sim/tiers.py).

The bill (planner/cost/memory.py) charges every term at its own worst moment, then takes back what
those worst cases never hold at once (`not_at_once`, planner/cost/coexisting.py [Note: terms that
never meet]): the largest unit is not gathered, gathered ahead and reduce-scattered at once, and with
recompute the logits never meet a segment's activations. The simulation charges each term when it
is live: the loss's logits from the head's forward to the end of its backward, the allocator's slack
on the most transient bytes in use at once, and the host buffers the runtime pins once (optimizer
chunk pool, swap buffers, staging pool, bookkeeping) all iteration. On the README's and the docs'
example models, for the best plan of every placement the search finds, the simulated peak of every
tier is within 2 % of the bill.
"""

from __future__ import annotations

import json

import pytest

from planner.search.search import SearchRequest, best_by_strategy, search
from planner.sim import fast, simulate
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.memory_terms import MemoryTerm
from planner.specs.model import ModelSpec
from planner.specs.plan import HostPinning

QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
              "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
              "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
              "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "hidden_act": "silu"}
"""Qwen2.5-0.5B's published config.json (the README's `planner fit config.json --gpus 8`)."""

TOLERANCE = 0.02


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> ModelSpec:
    path = tmp_path_factory.mktemp("qwen") / "config.json"
    path.write_text(json.dumps(QWEN25_05B))
    return resolve_model(str(path))  # as `planner fit config.json` reads it


def test_qwen_on_8_h100_simulates_the_logits_the_bill_charges(qwen):
    plan = search(SearchRequest(model=qwen, node=resolve_hardware("dgx-h100"), num_gpus=8)).best
    p = simulate(plan).prediction
    terms = p.details["simulated_memory_terms"]["gpu"]
    bill = p.memory_terms["gpu"]
    assert terms["logits"] == pytest.approx(bill["logits"], rel=1e-9) and bill["logits"] > 40 * 2**30
    assert "allocator slack" in terms
    for tier, peak in p.peak_bytes.items():
        assert p.details["simulated_peak_bytes"][tier] == pytest.approx(peak, rel=TOLERANCE, abs=1), tier


EXAMPLES = [("1T", "dgx-h100", 16), ("1T", "dgx2-v100", 16), ("7B", "dgx-h100", 8), ("13b", "dgx-h100", 1)]
"""README's and docs' example models (docs/quickstart and `planner fit` examples), with Qwen2.5-0.5B above."""


@pytest.mark.parametrize("model, hardware, gpus", [*EXAMPLES, ("qwen", "dgx-h100", 8), ("gpt3-1.3b", "dgx-h100", 1),
                                                   ("gpt3-125m", "cpu-dev-2core", 1)])
def test_simulated_peaks_follow_the_bill_for_every_placement(model, hardware, gpus, qwen):
    """The best plan the search finds for every placement (every tier of `TIERS` for each state
    that fits), not only the winner of each strategy."""
    spec = qwen if model == "qwen" else resolve_model(model)
    result = search(SearchRequest(model=spec, node=resolve_hardware(hardware), num_gpus=gpus))
    best = {}
    for plan in result.ranked:
        if plan.prediction.feasible:
            best.setdefault((plan.strategy, plan.placement), plan)
    winners = [plan for plan in best_by_strategy(result).values() if plan.prediction.feasible]
    assert all(any(plan is other for other in best.values()) for plan in winners)
    for (strategy, placement), plan in best.items():
        p = fast.predict(plan)
        simulated = p.details["simulated_peak_bytes"]
        for tier, bill in p.peak_bytes.items():
            assert simulated[tier] == pytest.approx(bill, rel=TOLERANCE, abs=1), (strategy, placement, tier,
                                                                                 simulated[tier], bill)
    assert len(best) >= 4


def test_host_buffers_are_held_at_the_bills_size_all_iteration():
    plan = search(SearchRequest(model=resolve_model("13b"), node=resolve_hardware("dgx-h100"), num_gpus=1,
                                strategy="zero-inf-nvme")).best
    terms = (MemoryTerm.OPTIMIZER_SWAP_BUFFERS, MemoryTerm.RUNTIME_BOOKKEEPING, MemoryTerm.PINNED_STAGING_POOL)
    for pinning in HostPinning:  # pinned host shards leave only the fp32 write-backs' pool, if any
        p = simulate(plan.replace(host_pinning=pinning, prediction=None)).prediction
        held = p.details["simulated_memory_terms"]["cpu"]
        billed = [term for term in terms if p.memory_terms["cpu"].get(term.value)]
        if pinning is HostPinning.STAGED:
            assert billed == list(terms)
        for term in billed:
            assert held[term.label] == pytest.approx(p.memory_terms["cpu"][term.value], rel=1e-6), (pinning, term)


def test_the_zoom_says_what_the_plan_recomputes(qwen):
    from planner.output.timeline import zoom_caption

    plan = search(SearchRequest(model=qwen, node=resolve_hardware("dgx-h100"), num_gpus=8, recompute_interval=0)).best
    assert plan.recompute_interval == 0
    assert zoom_caption(simulate(plan)) == "about one block of the backward pass (no recompute: backward only)"
    segments = simulate(plan.replace(recompute_interval=2, prediction=None))
    assert zoom_caption(segments) == "one recompute segment (2 blocks) of the backward pass: recompute, then backward"


def test_a_plan_with_terms_that_never_meet_reads_back(tmp_path):
    """`not_at_once` is negative in the plan file, and the file reads back as written."""
    from planner.specs.plan import load_plan

    plan = search(SearchRequest(model=resolve_model("1T"), node=resolve_hardware("dgx2-v100"), num_gpus=16)).best
    assert plan.prediction.memory_terms["gpu"][MemoryTerm.NOT_AT_ONCE] < 0
    assert plan.prediction.peak_bytes["gpu"] == sum(plan.prediction.memory_terms["gpu"].values())
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert load_plan(str(path)).prediction.memory_terms == plan.prediction.memory_terms
