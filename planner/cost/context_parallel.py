"""Context parallelism: one sequence split across GPUs, ring attention (Megatron-Core's, PyTorch's).

Each GPU of a replica holds `seq / cp` tokens of every sequence, so everything the planner counts
per token of a GPU is its share with no other change; keys and values travel around the CP ring,
overlapping the attention core, and only what the overlap does not hide is added ([Note: context
parallelism], above `kv_block_bytes`). The runtime does not run CP (runtime/plan_check.py).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from planner.cost.kernels import block_cost, fused_attention_flops_per_s
from planner.specs.errors import PlannerError
from planner.specs.stack import KvExchange
from planner.specs.units import COMPUTE_BYTES

if TYPE_CHECKING:
    from planner.specs.plan import Plan

RING_BUFFER_BLOCKS = 4
"""KV blocks the ring holds besides the GPU's own: two KV (one received while one is used) and, in
backward, two dKV."""


def check_context_parallel(plan: Plan) -> None:
    """A CP plan: whole replicas of `tp x cp x pp` GPUs, a sequence that splits into `2 cp` chunks,
    a fused attention kernel."""
    cp, replica = plan.context_parallel_degree, plan.gpus_per_replica
    if plan.num_gpus % replica:
        raise PlannerError(f"context_parallel_degree {cp}: replicas of model_parallel_degree x context_parallel_degree "
                           f"x pipeline_parallel_degree = {replica} GPUs do not divide num_gpus {plan.num_gpus}")
    if plan.model.seq_len % (2 * cp):
        raise PlannerError(f"context_parallel_degree {cp} splits a sequence into {2 * cp} load-balanced chunks; "
                           f"seq_len {plan.model.seq_len} is not a multiple of {2 * cp}")
    if plan.attention != "flash":
        raise PlannerError(f"context_parallel_degree {cp} runs ring attention on a fused kernel; attention "
                           f"{plan.attention} cannot: use attention flash on a GPU that has it")


# [Note: context parallelism] With `cp = Plan.context_parallel_degree`, each GPU of a model replica
# holds `seq / cp` tokens of every sequence, and a replica spans `tp x cp x pp` GPUs (Megatron's order:
# tensor, context, data, pipeline). The plan's `micro_batch_per_gpu` is the replica's micro-batch over
# `tp x cp x pp`, so whatever the planner counts per token of a GPU (`micro_batch_per_gpu x seq`: the
# linears, memory-bound kernels, activations, recompute inputs, logits, tensor-parallel all-reduces and
# pipeline sends) is the GPU's `seq / cp` share with no other change. The attention core: every local
# query attends to the keys of the whole sequence; under the causal mask Megatron cuts the sequence
# into `2 cp` chunks and gives GPU i chunks i and `2 cp - 1 - i`, so every GPU does `1 / cp` of the
# causal work, again `micro_batch_per_gpu x seq^2` per GPU.
#
# Keys and values travel around the CP ring (`kv_block_bytes`: the GPU's `seq / cp` tokens x keys and
# values x the KV width over the tensor-parallel group). Per layer, the forward sends the GPU's KV block
# `cp - 1` times; the backward sends KV and returns their gradients dKV (twice the bytes); a full
# recompute repeats the forward. Each send overlaps the attention core of the block the GPU already
# holds, `1 / cp` of the layer's attention time, so per layer only `(cp - 1) x max(0, send - attention
# / cp)` shows (`exposed_per_layer_s`). That is Megatron-Core's exchange (`KvExchange.RING`:
# Transformer Engine's `AttnFuncWithCPAndKVP2P`, point-to-point sends per step). PyTorch's
# context_parallel, which torchtitan uses, defaults to gathering instead (`KvExchange.ALL_GATHER`;
# torch/distributed/tensor/experimental/_context_parallel/_attention.py: `rotate_method` ALL_GATHER,
# `_AllGatherRotater` "only one communication will be done", load balancing on by default): the
# forward all-gathers every block at once, and the gather, `(cp - 1) x send` on the same links,
# overlaps only the first step's attention, `max(0, (cp - 1) send - attention / cp)`; the backward
# gathers KV again the same way and passes dKV around the ring point to point (`dkv_rotater`, an
# all-to-all rotation), each send overlapping the next step: `(cp - 1) x max(0, send - attention
# / cp)` more. The gather holds the `cp - 1` other blocks at once (`ring_buffer_bytes`). Either
# exchange runs on NVLink while `tp x cp` fits in a node, else at the GPU's share of the node's
# network (every GPU sends at once). Both the analytic estimate
# (planner/cost/throughput.py) and the simulator (planner/sim/engine.py) add exactly these seconds.
#
# Gradients are reduced, and partitioned states shared, over data parallel x cp
# (`Plan.data_parallel_degree`). Memory: the KV block being received while the held one is used, in
# forward two KV blocks and in backward two KV and two dKV blocks (`ring_buffer_bytes`, the bill's
# `ring_attention_buffers`). Megatron runs ring attention on a fused kernel (Transformer Engine), so
# a CP plan's attention is flash. The runtime does not run CP (runtime/plan_check.py).
def kv_block_bytes(plan: Plan) -> float:
    """One GPU's keys and values of one layer: its tokens (`micro_batch_per_gpu x seq`, the `seq / cp`
    share over the tensor-parallel group) x keys and values x the KV width."""
    m = plan.model
    return plan.micro_batch_per_gpu * m.seq_len * 2 * m.kv_size * COMPUTE_BYTES[plan.precision]


def ring_bytes_per_s(plan: Plan) -> float:
    """Per-GPU rate of a ring step: NVLink when the tensor x context group fits in a node."""
    node = plan.node
    if plan.model_parallel_degree * plan.context_parallel_degree <= node.num_gpus_per_node:
        return node.gpu_gpu_intra_node_bytes_per_s or node.gpu_hbm_bytes_per_s
    return node.inter_node_bytes_per_s / node.num_gpus_per_node


def exposed_per_layer_s(plan: Plan) -> tuple[float, float]:
    """(forward, backward) seconds per layer that the ring's sends add beyond the attention core
    they overlap; (0, 0) without context parallelism. A recompute's forward is a forward."""
    cp = plan.context_parallel_degree
    if cp == 1:
        return 0.0, 0.0
    rate = ring_bytes_per_s(plan)
    send_s = kv_block_bytes(plan) / rate if rate > 0 else math.inf
    cost, fused_rate = block_cost(plan), fused_attention_flops_per_s(plan)
    step_fwd_s, step_bwd_s = cost.fused_forward_flops / fused_rate / cp, cost.fused_backward_flops / fused_rate / cp
    if plan.kv_exchange is KvExchange.ALL_GATHER:
        gather_fwd = max(0.0, (cp - 1) * send_s - step_fwd_s)
        gather_bwd = max(0.0, (cp - 1) * send_s - step_bwd_s)
        return gather_fwd, gather_bwd + (cp - 1) * max(0.0, send_s - step_bwd_s)
    return (cp - 1) * max(0.0, send_s - step_fwd_s), (cp - 1) * max(0.0, 2 * send_s - step_bwd_s)


def ring_passes_s(plan: Plan) -> tuple[float, float]:
    """(forward, backward) seconds of the whole model's exposed ring traffic (the backward includes a
    full recompute's forward exchange)."""
    forward, backward = exposed_per_layer_s(plan)
    again = 1 if plan.recompute == "full" else 0
    layers = plan.model.num_layers
    return layers * forward, layers * (backward + again * forward)


def ring_buffer_bytes(plan: Plan) -> float:
    """GPU bytes of the exchanged KV and dKV blocks held at once (0 without context parallelism): the
    ring's RING_BUFFER_BLOCKS, or the all-gather's `cp - 1` gathered blocks and two dKV blocks."""
    cp = plan.context_parallel_degree
    if cp == 1:
        return 0.0
    blocks = cp - 1 + 2 if plan.kv_exchange is KvExchange.ALL_GATHER else RING_BUFFER_BLOCKS
    return blocks * kv_block_bytes(plan)
