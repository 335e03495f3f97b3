"""Context parallelism (planner/cost/context_parallel.py [Note: context parallelism]): per-GPU tokens, the
ring's KV bytes and exposed seconds, its memory term, the estimate and the simulator on the same
seconds, the plan's JSON, and the runtime's refusal."""

from __future__ import annotations

import pytest

from planner.cost.context_parallel import exposed_per_layer_s, kv_block_bytes, ring_bytes_per_s, ring_passes_s
from planner.cost.feasibility import check_plan
from planner.cost.kernels import block_cost
from planner.cost.memory import memory_bill
from planner.cost.throughput import estimate
from planner.sim.fast import predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.errors import PlannerError
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import STRATEGY_TABLE, Plan
from planner.specs.stack import KvExchange
from runtime.plan_check import executable_problem

NODE = resolve_hardware("dgx-h100")
MODEL = resolve_model("llama-3-8b").replace(seq_len=8192)  # GQA: 8 KV heads of 128 -> KV width 1024


def _plan(cp: int = 4, tp: int = 2, gpus: int = 64, replica_batch: int = 2, **changes) -> Plan:
    return Plan(model=MODEL, node=NODE, num_gpus=gpus, strategy="3d", placement=STRATEGY_TABLE["3d"].placement,
                micro_batch_per_gpu=replica_batch / (tp * cp), recompute_interval=0, model_parallel_degree=tp,
                context_parallel_degree=cp, **changes)


def test_each_gpu_holds_seq_over_cp_tokens_and_gradients_reduce_over_dp_x_cp():
    plan = _plan()
    assert plan.gpus_per_replica == 8 and plan.data_parallel_degree == 32  # 8 replicas x 4 CP ranks
    assert plan.micro_batch_per_gpu * MODEL.seq_len == 2 * 8192 / (2 * 4)  # the replica's tokens / (tp x cp)
    assert plan.tokens_per_iteration == 8 * 2 * 8192  # 8 replicas x 2 sequences
    # the distributed optimizer: fp32 gradient copy (4 bytes, whole) and master + Adam (12) / (dp x cp)
    states = memory_bill(plan).terms["gpu"][MemoryTerm.OPTIMIZER_STATES]
    assert states == pytest.approx(MODEL.num_params / 2 * (4 + 12 / 32), rel=1e-6, abs=4096)


def test_kv_block_and_ring_buffers_in_the_bill():
    plan = _plan()
    # 2048 tokens per GPU (over tp) x K and V x 1024 wide x 2 bytes
    assert kv_block_bytes(plan) == 2048 * 2 * 1024 * 2 == 8 * 2**20
    gpu = memory_bill(plan).terms["gpu"]
    assert gpu[MemoryTerm.RING_ATTENTION_BUFFERS] == 4 * 8 * 2**20
    assert MemoryTerm.RING_ATTENTION_BUFFERS not in memory_bill(_plan(cp=1, gpus=16)).terms["gpu"]
    # Twice the CP ranks for the same replica batch: half the tokens, half the activations, per GPU.
    assert memory_bill(_plan(cp=8)).terms["gpu"][MemoryTerm.AWM] == pytest.approx(gpu[MemoryTerm.AWM] / 2, rel=1e-6)


def test_exposed_ring_seconds_are_the_sends_beyond_the_attention_they_overlap():
    slow = _plan().replace(node=NODE.replace(gpu_gpu_intra_node_bytes_per_s=5e9))
    send_s = kv_block_bytes(slow) / 5e9
    cost = block_cost(slow)
    attn_fwd_s = cost.fused_forward_flops / NODE.flash_attention_flops_per_s
    attn_bwd_s = cost.fused_backward_flops / NODE.flash_attention_flops_per_s
    forward, backward = exposed_per_layer_s(slow)
    assert forward == pytest.approx(3 * (send_s - attn_fwd_s / 4))
    assert backward == pytest.approx(3 * (2 * send_s - attn_bwd_s / 4))
    assert ring_passes_s(slow) == pytest.approx((32 * forward, 32 * backward))
    assert exposed_per_layer_s(_plan()) == (0.0, 0.0)  # NVLink: every send hides behind the attention
    assert exposed_per_layer_s(_plan(cp=1, gpus=16)) == (0.0, 0.0)
    # tp x cp = 16 spans two nodes: the GPU's share of the node's network
    assert ring_bytes_per_s(_plan(cp=8, tp=2, gpus=64)) == NODE.inter_node_bytes_per_s / 8


def test_estimate_and_simulator_add_the_same_ring_seconds():
    def plan(node):
        return Plan(model=MODEL, node=node, num_gpus=2, strategy="dp", placement=STRATEGY_TABLE["dp"].placement,
                    micro_batch_per_gpu=0.5, recompute_interval=0, context_parallel_degree=2)

    fast, slow = plan(NODE), plan(NODE.replace(gpu_gpu_intra_node_bytes_per_s=2e9))
    ring_fwd_s = ring_passes_s(slow)[0]
    assert ring_fwd_s > 0 and ring_passes_s(fast) == (0.0, 0.0)
    assert estimate(slow).component_time_s["context parallel"] == pytest.approx(sum(ring_passes_s(slow)))
    simulated = predict(slow).phase_time_s["forward"] - predict(fast).phase_time_s["forward"]
    analytic = estimate(slow).phase_time_s["forward"] - estimate(fast).phase_time_s["forward"]
    assert simulated == pytest.approx(ring_fwd_s, rel=1e-6) and analytic == pytest.approx(ring_fwd_s, rel=1e-6)


def test_plan_json_extends_and_old_plans_load():
    plan = _plan()
    doc = plan.to_dict()
    assert doc["context_parallel_degree"] == 4 and Plan.from_dict(doc).context_parallel_degree == 4
    flat = _plan(cp=1, gpus=16).to_dict()
    assert "context_parallel_degree" not in flat and Plan.from_dict(flat).context_parallel_degree == 1


@pytest.mark.parametrize("changes, fragment", [
    ({"cp": 3, "gpus": 48}, "seq_len 8192 is not a multiple of 6"),
    ({"tp": 1, "gpus": 6}, "= 4 GPUs do not divide num_gpus 6"),
    ({"attention": "eager"}, "runs ring attention on a fused kernel"),
])
def test_refusals_are_one_line(changes, fragment):
    attention = changes.pop("attention", "")
    plan = _plan(**changes, attention=attention)  # the plan only describes: the cost models judge it
    with pytest.raises(PlannerError) as err:
        check_plan(plan)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_the_runtime_refuses_context_parallel_in_one_line():
    plan = Plan(model=MODEL, node=NODE, num_gpus=2, strategy="zero3", placement=STRATEGY_TABLE["zero3"].placement,
                micro_batch_per_gpu=0.5, context_parallel_degree=2)
    problem = executable_problem(plan, world_size=2)
    assert problem is not None and "context_parallel_degree 2" in problem and "\n" not in problem


def test_pytorch_all_gather_exposes_the_gather_beyond_the_first_step():
    """KvExchange.ALL_GATHER (PyTorch's context_parallel): forward, one gather of the 3 other blocks
    overlapping one step's attention; backward, the gather again and the dKV ring's 3 sends."""
    ring = _plan().replace(node=NODE.replace(gpu_gpu_intra_node_bytes_per_s=5e9))
    gather = ring.replace(kv_exchange=KvExchange.ALL_GATHER)
    send_s = 8 * 2**20 / 5e9  # one 8 MiB KV block
    cost = block_cost(gather)
    step_fwd_s = cost.fused_forward_flops / NODE.flash_attention_flops_per_s / 4
    step_bwd_s = cost.fused_backward_flops / NODE.flash_attention_flops_per_s / 4
    forward, backward = exposed_per_layer_s(gather)
    assert forward == pytest.approx(3 * send_s - step_fwd_s)
    assert backward == pytest.approx(3 * send_s - step_bwd_s + 3 * max(0.0, send_s - step_bwd_s))
    assert forward > exposed_per_layer_s(ring)[0]  # the gather hides behind one step, the ring's sends behind three
    # It holds the three other blocks and two dKV blocks: 5 x 8 MiB against the ring's 4.
    assert memory_bill(gather).terms["gpu"][MemoryTerm.RING_ATTENTION_BUFFERS] == 5 * 8 * 2**20
    assert Plan.from_dict(gather.to_dict()).kv_exchange is KvExchange.ALL_GATHER
    assert "kv_exchange" not in ring.to_dict()  # ring plans are written as before
