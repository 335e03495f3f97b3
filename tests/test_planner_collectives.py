"""NCCL's alpha-beta cost of a ring collective (planner/cost/collectives.py [Note: the alpha-beta collective]) and
ZeRO-3's per-parameter collectives ([Note: per-parameter collectives])."""

from __future__ import annotations

import pytest

from planner.cost.collectives import (
    NCCL_BASE_LATENCY_S,
    NETWORK_STEP_S,
    NVLINK_STEP_S,
    PCIE_STEP_S,
    Ring,
    bus_bytes_per_s,
    collective_s,
    collectives_per_operator,
    data_parallel_ring,
    data_parallel_rings_per_node,
    latency_s,
    tensor_parallel_ring,
)
from planner.cost.throughput import collectives_per_pass, estimate
from planner.sim.fast import predict
from planner.specs.catalog import hardware_presets
from planner.specs.errors import PlannerError
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.stack import ShardCollectives

GB = 1e9
H100 = hardware_presets()["dgx-h100"]  # NVLink 360 GB/s per GPU, 400 GB/s of network per node
MODEL = ModelSpec(name="m", num_layers=4, hidden_size=1024, num_heads=8, seq_len=512, vocab_size=0)


def test_ring_steps_split_into_nvlink_and_network_hops():
    # 64 ranks on 8 nodes: an all-gather is 63 steps, 7 of them across the network; an all-reduce twice.
    ring = Ring(64, 8)
    assert ring.nodes == 8
    assert ring.steps("all_gather") == (56, 7)
    assert ring.steps("reduce_scatter") == (56, 7)
    assert ring.steps("all_reduce") == (112, 14)
    assert Ring(8, 8).steps("all_reduce") == (14, 0)
    assert Ring(1, 1).steps("all_gather") == (0, 0)


def test_ring_all_gather_time_is_the_alpha_beta_formula():
    # 1 GiB over 64 H100s on 8 nodes, tp 1: each rank receives 63/64 GiB at min(360, 400 / 1) GB/s,
    # after 8.4 us + 56 x 3.4 us + 7 x 14 us of latency.
    ring, nbytes = Ring(64, 8), 2**30
    expected = 8.4e-6 + 56 * 3.4e-6 + 7 * 14e-6 + nbytes * 63 / 64 / (360 * GB)
    assert collective_s(ring, "all_gather", nbytes, H100) == pytest.approx(expected, rel=1e-12)
    assert latency_s(ring, "all_gather", H100) == pytest.approx(NCCL_BASE_LATENCY_S + 56 * NVLINK_STEP_S + 7 * NETWORK_STEP_S)


def test_all_reduce_moves_twice_the_bytes_and_pays_twice_the_steps():
    # Tensor-parallel all-reduce of 32 MiB over 8 GPUs of one node: 2 x 7/8 of it over NVLink, 14 steps.
    ring, nbytes = Ring(8, 8), 32 * 2**20
    expected = 8.4e-6 + 14 * 3.4e-6 + 2 * 7 / 8 * nbytes / (360 * GB)
    assert collective_s(ring, "all_reduce", nbytes, H100) == pytest.approx(expected, rel=1e-12)


def test_the_node_network_is_shared_by_the_tensor_parallel_rings_crossing_it():
    # Across nodes the ring's rate is NVLink capped by the node's network over its mp rings.
    ring = Ring(16, 1)
    assert bus_bytes_per_s(ring, H100, rings_per_node=1) == 360 * GB  # 400 GB/s of network: NVLink binds
    assert bus_bytes_per_s(ring, H100, rings_per_node=8) == 50 * GB  # one NIC's share per ring
    assert bus_bytes_per_s(Ring(8, 8), H100, rings_per_node=8) == 360 * GB  # one node: no network


def test_pcie_nodes_pay_nccls_pci_step():
    # GPU-GPU no faster than the host link: the ring's hops are PCIe (L40S, A100 PCIe, H100 NVL past a pair).
    for name in ("aws-g6e-48xlarge", "h100-nvl-server-8x"):
        assert latency_s(Ring(8, 8), "all_gather", hardware_presets()[name]) == pytest.approx(
            NCCL_BASE_LATENCY_S + 7 * PCIE_STEP_S)
    assert latency_s(Ring(8, 8), "all_gather", H100) == pytest.approx(NCCL_BASE_LATENCY_S + 7 * NVLINK_STEP_S)


def test_a_plans_rings():
    # 32 GPUs, tp 4: 8 data-parallel ranks, two per 8-GPU node, four rings per node.
    plan = Plan(model=MODEL, node=H100, num_gpus=32, strategy="zero3", model_parallel_degree=4, micro_batch_per_gpu=1)
    assert data_parallel_ring(plan) == Ring(8, 2)
    assert data_parallel_rings_per_node(plan) == 4
    assert tensor_parallel_ring(plan) == Ring(4, 4)
    single = Plan(model=MODEL, node=H100, num_gpus=4, strategy="zero3", micro_batch_per_gpu=1)
    assert data_parallel_ring(single) == Ring(4, 4) and data_parallel_ring(single).nodes == 1


# -- [Note: per-parameter collectives] ---------------------------------------------------------------
MEGATRON_GPT = ModelSpec(name="megatron-gpt", num_layers=4, hidden_size=1024, num_heads=8, seq_len=512, vocab_size=0,
                         qkv_bias=True, attn_out_bias=True, mlp_bias=True, norm="layernorm")
A100 = hardware_presets()["dgx-a100-80g"]


def _zero3(model=MEGATRON_GPT, *, gpus=64, **fields):
    return Plan(model=model, node=A100, num_gpus=gpus, strategy="zero3", micro_batch_per_gpu=1, **fields)


def test_a_blocks_parameter_tensors_are_what_the_framework_holds():
    # Megatron's GPT block: two LayerNorms (weight, bias) and four linears (weight, bias).
    assert MEGATRON_GPT.parameter_tensors_per_block == 12
    assert MODEL.parameter_tensors_per_block == 4  # the paper's shape: the linears' weights only
    llama = ModelSpec(name="l", num_layers=2, hidden_size=1024, num_heads=8, gated_mlp=True, norm="rmsnorm")
    assert llama.parameter_tensors_per_block == 5 + 2


def test_per_parameter_gathers_pay_a_latency_per_tensor():
    flat = _zero3(prefetch_depth=0)
    per_parameter = _zero3(prefetch_depth=0, shard_collectives=ShardCollectives.PER_PARAMETER)
    assert collectives_per_operator(flat) == 1.0
    assert collectives_per_operator(per_parameter) == 12 / 4
    assert collectives_per_pass(per_parameter) == 4 * 12  # no vocabulary: the blocks only
    assert collectives_per_pass(flat) == 4 * 4


def test_per_parameter_step_adds_the_latency_of_every_extra_collective():
    # Nothing overlaps at prefetch depth 0: the step grows by each extra gather (forward, recompute,
    # backward) and each extra reduce-scatter at the ring's latency, 64 ranks over 8 nodes.
    flat = _zero3(prefetch_depth=0)
    per_parameter = flat.replace(shard_collectives=ShardCollectives.PER_PARAMETER)
    extra = (collectives_per_pass(per_parameter) - collectives_per_pass(flat)) * (3 + 1)
    gather_latency_s = latency_s(Ring(64, 8), "all_gather", A100)
    assert gather_latency_s == latency_s(Ring(64, 8), "reduce_scatter", A100)
    grown = estimate(per_parameter).iteration_time_s - estimate(flat).iteration_time_s
    assert grown == pytest.approx(extra * gather_latency_s, rel=1e-9)
    simulated = predict(per_parameter).iteration_time_s - predict(flat).iteration_time_s
    assert simulated == pytest.approx(grown, rel=0.1)


def test_per_parameter_gathers_fetch_nothing_ahead():
    with pytest.raises(PlannerError, match="prefetch_depth 0, not 3"):
        _zero3(shard_collectives="per_parameter")
    plan = _zero3(prefetch_depth=0, shard_collectives="per_parameter")
    assert plan.shard_collectives is ShardCollectives.PER_PARAMETER
    with pytest.raises(PlannerError, match="prefetch_depth 0, not 2"):
        plan.replace(prefetch_depth=2)
    with pytest.raises(PlannerError, match="shard_collectives"):
        _zero3(prefetch_depth=0, shard_collectives="per_bucket")


def test_a_plan_writes_its_grouping_only_when_it_gathers_per_parameter():
    flat = _zero3()
    assert "shard_collectives" not in flat.to_dict()
    plan = _zero3(prefetch_depth=0, shard_collectives="per_parameter")
    assert plan.to_dict()["shard_collectives"] == "per_parameter"
    assert Plan.from_dict(plan.to_dict()) == plan
