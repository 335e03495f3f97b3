"""The runtime's own accounting per tier and term against the planner's memory bill, same plan.

The bill follows the runtime where eq. 2-3 and the runtime differ (planner/cost/memory.py [Note: runtime
bytes per parameter]; `planner memory` still reports the paper's quantities as written):
- mixed precision: no 16-bit gradient shard; the fp32 gradient copy (4 B/param, term
  `optimizer_states`, in the gradients' tier) plus master, momentum, variance (12 B/param);
- fp32 with params and optimizer states in one tier, or bf16 with `host_param_shard: master`: 8 B/param
  of optimizer states (the parameter shard is the master);
- recompute inputs in the compute precision (4 bytes/element in fp32);
- `mswm` on 2+ ranks: the largest unit's weight *and bias*, its flat gradient buffer, and the tied
  embedding (kept gathered through backward until its gradient is complete).
Compared exactly (to padding): the resident states and recompute inputs per tier, the host tier's whole
peak, and on two ranks every gathering term. Not compared: the terms not `MemoryTerm.ledgered`
(`awm`, `logits`, `allocator_slack`: autograd's tensors and allocator behaviour, not runtime buffers;
on CUDA the profile records the allocator's peak next to the ledger) and the host<->device staging terms (a CPU device makes no
copies: the bill leaves them out when the hardware says `host_is_device`).
"""

from __future__ import annotations

import pytest
import torch
from runtime_support import HARDWARE, run_distributed

import runtime
from planner.cost.memory import memory_bill, runtime_buffer_peak_bytes
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import HostParamShard, Plan
from runtime.gpt import GPT, GPTConfig

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, BATCH = 2, 256, 4, 32, 256, 2


def _plan(precision: str, placement: dict[str, str], recompute_interval: int, **knobs: str) -> Plan:
    return Plan.from_dict({
        "model": {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": HEADS, "seq_len": SEQ, "vocab_size": VOCAB},
        "hardware": HARDWARE, "num_gpus": 1, "precision": precision, "micro_batch_per_gpu": BATCH,
        "recompute_interval": recompute_interval, "placement": placement, **knobs,
    })


def _trained(plan: Plan, steps: int):  # noqa: ANN202 - the sharded model
    """The reference GPT sharded by `plan`, after `steps` training steps on random tokens."""
    torch.manual_seed(0)
    model = runtime.shard(GPT(GPTConfig.from_model_spec(plan.model)), plan)
    opt = runtime.AdamW(model, lr=1e-3)
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _measure(plan: Plan) -> dict[str, dict[str, int]]:
    model = _trained(plan, 2)
    sample = runtime.state_of(model).profiler.samples[-1]
    ledger = runtime.state_of(model).ledger
    # Each term's own peak over the last step (persistent states are constant; recompute inputs peak
    # at the end of forward).
    return {tier: ledger.usage(tier).term_peaks for tier in sample.peak_bytes}


CASES = {
    # ZeRO-Infinity on CPU, mixed precision, one block per recompute segment, offloaded recompute inputs.
    "bf16-all-cpu": (_plan("bf16", dict.fromkeys(("params", "gradients", "optimizer_states", "recompute_inputs"),
                                                 "cpu"), 1),
                     {"cpu": (MemoryTerm.PARAMS, MemoryTerm.OPTIMIZER_STATES, MemoryTerm.RECOMPUTE_INPUTS)}),
    # The same with the fp32 master as the parameter shard: params 4 B/param, optimizer states 8 + 4
    # (the fp32 gradient), and the cast of the shard read 3 ahead held as a host read is.
    "bf16-all-cpu-master": (_plan("bf16", dict.fromkeys(("params", "gradients", "optimizer_states", "recompute_inputs"),
                                                        "cpu"), 1, host_param_shard="master"),
                            {"cpu": (MemoryTerm.PARAMS, MemoryTerm.OPTIMIZER_STATES, MemoryTerm.RECOMPUTE_INPUTS,
                                     MemoryTerm.PARAM_SWAP_BUFFERS),
                             "gpu": (MemoryTerm.MSWM, MemoryTerm.PREFETCH_GATHERED_PARAMS,
                                     MemoryTerm.PREFETCH_SHARD_STAGING)}),
    # ZeRO-Offload-like fp32: parameters on the device, gradients and optimizer on the host.
    "fp32-params-device": (_plan("fp32", {"params": "gpu", "gradients": "cpu", "optimizer_states": "cpu",
                                          "recompute_inputs": "gpu"}, 0),
                           {"gpu": (MemoryTerm.PARAMS,), "cpu": (MemoryTerm.GRADIENTS, MemoryTerm.OPTIMIZER_STATES)}),
    # bf16 with gradients and optimizer states on the device, parameters on the host.
    "bf16-params-host": (_plan("bf16", {"params": "cpu", "gradients": "gpu", "optimizer_states": "gpu",
                                        "recompute_inputs": "gpu"}, 1),
                         {"gpu": (MemoryTerm.OPTIMIZER_STATES, MemoryTerm.RECOMPUTE_INPUTS), "cpu": (MemoryTerm.PARAMS,)}),
    # fp32, everything in one tier: the parameter shard is the master (8 B/param of optimizer states);
    # fp32 recompute inputs are 4 bytes per element.
    "fp32-all-cpu": (_plan("fp32", dict.fromkeys(("params", "gradients", "optimizer_states", "recompute_inputs"),
                                                 "cpu"), 1),
                     {"cpu": (MemoryTerm.PARAMS, MemoryTerm.GRADIENTS, MemoryTerm.OPTIMIZER_STATES,
                              MemoryTerm.RECOMPUTE_INPUTS)}),
}
# Parameters the bill's model leaves out (biases, LayerNorms, position embeddings): ~1.7% here.
TOLERANCE = 0.025


@pytest.mark.parametrize("case", list(CASES))
def test_resident_terms_match_the_memory_bill(case: str) -> None:
    plan, compared = CASES[case]
    bill = memory_bill(plan).terms
    measured = _measure(plan)
    for tier, terms in compared.items():
        for term in terms:
            assert measured[tier].get(term, 0) == pytest.approx(bill[tier][term], rel=TOLERANCE), (tier, term, measured, bill)
        assert MemoryTerm.GRADIENTS not in measured[tier] or plan.precision == "fp32"
        assert set(measured[tier]) <= set(bill[tier]), (tier, measured, bill)
    # The ledger records bill terms only, and only those the runtime owns.
    assert all(MemoryTerm(t).ledgered for terms in measured.values() for t in terms), measured


@pytest.mark.parametrize("case", list(CASES))
def test_host_tier_peak_matches_the_memory_bill(case: str) -> None:
    """The `cpu` tier holds only buffers the runtime owns (no activations), so its whole measured
    peak is the bill's whole `cpu` peak."""
    plan, _ = CASES[case]
    model = _trained(plan, 2)
    samples = runtime.state_of(model).profiler.samples[-1].peak_bytes
    buffers = runtime_buffer_peak_bytes(memory_bill(plan))
    assert samples["cpu"] == pytest.approx(buffers["cpu"], rel=TOLERANCE)
    if plan.host_param_shard is HostParamShard.COMPUTE_COPY:  # resident states only: no copies
        assert samples["gpu"] == pytest.approx(buffers["gpu"], rel=TOLERANCE)
    else:  # the casts of the master shards: each gpu term its own worst case (compared term by term above)
        assert samples["gpu"] <= buffers["gpu"]


def gpu_term_peaks(tiling: int, depth: int, rank: int = 0, world_size: int = 1) -> dict:
    plan = Plan.from_dict({
        "model": {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": HEADS, "seq_len": SEQ, "vocab_size": VOCAB},
        "hardware": HARDWARE, "num_gpus": world_size, "precision": "fp32", "micro_batch_per_gpu": BATCH,
        "recompute_interval": 0, "tiling_factor": tiling, "prefetch_depth": depth,
        "placement": {"params": "gpu", "gradients": "cpu", "optimizer_states": "cpu", "recompute_inputs": "gpu"},
    })
    model = _trained(plan, 3)
    return {"measured": runtime.state_of(model).ledger.usage("gpu").term_peaks, "bill": memory_bill(plan).terms["gpu"]}


@pytest.mark.slow
def test_gathering_buffers_on_two_ranks_match_the_memory_bill(tmp_path) -> None:  # noqa: ANN001
    """2 ranks: the per-operator buffers the bill names (eq. 4 and the runtime's own) against the
    ledger's peak of each term, `mswm` included (the unit's bias, its gradient buffer and the tied
    embedding are billed: planner/cost/memory.py [Note: gathered working memory])."""
    cases = [(1, 1), (2, 1), (1, 2)]
    results = run_distributed("gpu_term_peaks", cases, tmp_path, world_size=2, module="test_runtime_memory")
    for (tiling, _), r in zip(cases, results, strict=True):
        m, b = r["measured"], r["bill"]
        for term in (MemoryTerm.PARAMS, MemoryTerm.PREFETCH_GATHERED_PARAMS, MemoryTerm.REDUCE_SCATTER_BUFFER):
            assert m[term] == pytest.approx(b[term], rel=0.01), (term, tiling, m, b)
        assert m[MemoryTerm.MSWM] == pytest.approx(b[MemoryTerm.MSWM], rel=0.001), (tiling, m, b)


@pytest.mark.parametrize("depth", [2, 3])
def test_recompute_holds_one_operator_with_params_on_nvme(depth: int, tmp_path) -> None:  # noqa: ANN001
    """One block per recompute segment, parameters read from NVMe (transient gathered buffers): the operator
    in use (`mswm`) and the one gathered ahead are all the device holds, as billed. The segment's
    last operator is gathered by its recompute, not when its output's gradient arrives ([Note:
    recompute releases parameters]); that held it through the whole recompute, a second operator."""
    nvme = {"params": "nvme", "gradients": "cpu", "optimizer_states": "cpu", "recompute_inputs": "cpu"}
    plan = Plan.from_dict({
        "model": {"num_layers": LAYERS, "hidden_size": HIDDEN, "num_heads": HEADS, "seq_len": SEQ, "vocab_size": VOCAB},
        "hardware": HARDWARE, "num_gpus": 1, "precision": "fp32", "micro_batch_per_gpu": BATCH,
        "recompute_interval": 1, "prefetch_depth": depth, "placement": nvme, "nvme_path": str(tmp_path),
    })
    model = _trained(plan, 3)
    state = runtime.state_of(model)
    measured, bill = state.ledger.usage("gpu").term_peaks, memory_bill(plan).terms["gpu"]
    state.close()
    assert measured[MemoryTerm.MSWM] == pytest.approx(bill[MemoryTerm.MSWM], rel=0.01), (measured, bill)
    assert measured[MemoryTerm.PREFETCH_GATHERED_PARAMS] == pytest.approx(bill[MemoryTerm.PREFETCH_GATHERED_PARAMS],
                                                                        rel=0.01)
