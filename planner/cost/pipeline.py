"""Pipeline parallelism and the optimizer step of several micro-batches (docs/planner.md
"Pipeline parallelism and the step of m micro-batches").

The analytic estimate and the simulator time one micro-batch of the heaviest stage (`stage_plan`)
and compose the 1F1B step here from it: the bubble, the point-to-point sends, the data-parallel
reductions once per step or per micro-batch, the optimizer step once ([Note: the 1F1B step], above
`compose_step`). With one stage and one micro-batch every function here is the identity.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from planner.cost.collectives import NCCL_BASE_LATENCY_S, NETWORK_STEP_S, intra_node_step_s
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan
from planner.specs.units import COMPUTE_BYTES

REDUCES_ONCE_PER_STEP = frozenset({"dp", "3d"})
"""Strategies whose gradients are all-reduced once per optimizer step (Megatron's data parallel and
distributed optimizer, DDP's `no_sync`); the sharded ones reduce every micro-batch."""


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of the 1F1B schedule relative to its useful work: `(p - 1) / m`, and
    `(p - 1) / (v m)` interleaved with `v` model chunks per GPU (Narayanan et al. 2021, §2.2.2)."""
    return (stages - 1) / (virtual_stages * micro_batches)


def is_composed(plan: Plan) -> bool:
    """Whether the step is composed from a stage's micro-batch (pipelined, or accumulating)."""
    return plan.pipeline_parallel_degree > 1 or plan.micro_batches_per_step > 1


def stage_layers(plan: Plan) -> int:
    """Blocks on the heaviest stage."""
    return math.ceil(plan.model.num_layers / plan.pipeline_parallel_degree)


def stage_model(plan: Plan) -> ModelSpec:
    """The heaviest stage as a model: `ceil(L / p)` blocks and one vocabulary matrix (the first
    stage's embedding or the last stage's output layer, never both)."""
    model = plan.model
    if plan.pipeline_parallel_degree == 1:
        return model
    return model.replace(name=f"{model.name} (stage of {stage_layers(plan)} layers)", num_layers=stage_layers(plan),
                         tied_embeddings=True)


def stage_plan(plan: Plan) -> Plan:
    """One stage's work on one micro-batch: the stage's model on its `num_gpus / p` GPUs."""
    if not is_composed(plan):
        return plan
    pp = plan.pipeline_parallel_degree
    return plan.replace(model=stage_model(plan), num_gpus=plan.num_gpus // pp, pipeline_parallel_degree=1,
                        recompute_interval=min(plan.recompute_interval, stage_layers(plan)),
                        pipeline_virtual_stages=1, micro_batches_per_step=1, micro_batch_per_gpu=plan.micro_batch_per_gpu * pp, prediction=None)


def quiet_plan(stage: Plan) -> Plan:
    """`stage` on one tensor-parallel group: the same micro-batch with no data-parallel traffic.
    With context parallelism the group is the stage's `tp x cp` GPUs, whose CP ranks still reduce
    their gradients among themselves: the planner has no plan without a gradient group, so a
    quiet micro-batch of a CP plan is charged that reduction (overlapped with its backward)."""
    return stage.replace(num_gpus=stage.model_parallel_degree * stage.context_parallel_degree)


def reduces_once(plan: Plan) -> bool:
    return plan.strategy in REDUCES_ONCE_PER_STEP and plan.data_parallel_degree > 1


def quiet_micro_batches(plan: Plan) -> int:
    """Micro-batches of a step that move no data-parallel traffic (all but the last when the
    strategy reduces once per step)."""
    return plan.micro_batches_per_step - 1 if reduces_once(plan) else 0


def in_flight_micro_batches(plan: Plan) -> int:
    """Micro-batches whose activations the first stage holds at once under 1F1B."""
    return min(plan.pipeline_parallel_degree, plan.micro_batches_per_step)


def p2p_bytes_per_gpu(plan: Plan) -> float:
    """Bytes one GPU sends to the next stage per micro-batch (and receives back as gradients):
    the replica's `b s h` activations in the compute precision over the tensor-parallel group."""
    if plan.pipeline_parallel_degree == 1:
        return 0.0
    m, tp = plan.model, plan.model_parallel_degree
    replica_batch = plan.micro_batch_per_gpu * tp * plan.pipeline_parallel_degree
    return replica_batch * m.seq_len * m.hidden_size * COMPUTE_BYTES[plan.precision] / tp


def p2p_bytes_per_s(plan: Plan) -> float:
    """Per-GPU bandwidth of a stage boundary: NVLink when the whole pipeline is in one node, else
    the GPU's share of the node's network (every GPU of a boundary sends at once)."""
    node = plan.node
    if plan.num_nodes == 1:
        return node.gpu_gpu_intra_node_bytes_per_s or node.gpu_hbm_bytes_per_s
    return node.inter_node_bytes_per_s / plan.cluster.gpus_per_node


def p2p_s(plan: Plan) -> float:
    """Seconds one GPU spends per micro-batch on its boundary sends: activations forward, their
    gradients backward, once per model chunk it holds."""
    nbytes = p2p_bytes_per_gpu(plan)
    if nbytes == 0:
        return 0.0
    rate = p2p_bytes_per_s(plan)
    return 2 * plan.pipeline_virtual_stages * (nbytes / rate + p2p_latency_s(plan)) if rate > 0 else math.inf


def p2p_latency_s(plan: Plan) -> float:
    """One send's latency: NCCL's base plus one step over NVLink, or over the network when the
    stages sit in different nodes (planner/cost/collectives.py [Note: the alpha-beta collective])."""
    return NCCL_BASE_LATENCY_S + (NETWORK_STEP_S if plan.num_nodes > 1 else intra_node_step_s(plan.node))


class StepTimes(NamedTuple):
    """The composed optimizer step: phase seconds and how many micro-batch slots of each kind."""

    forward_s: float
    backward_s: float
    optimizer_s: float
    slots: float
    """`m + (p - 1) / v` micro-batch slots on the critical path."""
    quiet_slots: float
    """Slots timed without data-parallel traffic (reduce once per step)."""
    p2p_s: float
    """Boundary sends per micro-batch (forward + backward)."""


# [Note: the 1F1B step] A plan with `p = pipeline_parallel_degree` stages and `m =
# micro_batches_per_step` micro-batches per model replica runs Megatron's 1F1B schedule (Narayanan
# et al. 2021, §2.2.1): every stage does one forward and one backward per micro-batch, and the
# pipeline fills and drains once per step, so with equal stages of `t` seconds per micro-batch the
# step's forward and backward take `(m + p - 1) t` instead of `m t`: a bubble of `(p - 1) / m`
# (`(p - 1) / (v m)` with `v` interleaved model chunks per GPU, each micro-batch then crossing `v`
# times as many boundaries). Every
# stage is billed as the heaviest one, `ceil(L / p)` blocks plus one vocabulary matrix (the embedding
# on the first stage, the output layer on the last; `stage_plan`), so the analytic estimate and the
# simulator time one stage's micro-batch (`stage_plan`) and compose the step here from it:
# - each micro-batch sends its activations to the next stage and their gradients back: `b s h`
#   elements of the replica's micro-batch, split over the tensor-parallel group (Megatron's
#   scatter/gather of pipeline tensors), on NVLink inside a node and at the GPU's share of the node's
#   network across nodes (`p2p_s`), not overlapped (1F1B waits for them);
# - data-parallel gradients: Megatron (strategies `dp` and `3d`, REDUCES_ONCE_PER_STEP) reduces once
#   per step, after the last micro-batch, so the other `m + p - 2` micro-batch slots are timed without
#   any data-parallel traffic (`quiet_plan`); FSDP / ZeRO-2 / ZeRO-3 gather and reduce in every
#   micro-batch, so every slot is the stage's full micro-batch;
# - the optimizer step once, on the stage's share of the parameters;
# - memory (planner.cost.memory.memory_bill): the stage's weights, and on the first stage the activations
#   of `min(p, m)` micro-batches in flight (1F1B starts at most `p` forwards before the first
#   backward), which is what the bill multiplies (`in_flight_micro_batches`).
# With `p = 1` and `m = 1` every function here is the identity: plans without pipelining or
# accumulation are priced exactly as before.
def compose_step(plan: Plan, full: tuple[float, float, float], quiet: tuple[float, float] | None) -> StepTimes:
    """The step of `plan` from one stage micro-batch's (forward, backward, optimizer) seconds with
    its data-parallel traffic (`full`) and without it (`quiet`, None to use `full`): [Note: the 1F1B step]."""
    m = plan.micro_batches_per_step
    slots = m * (1 + bubble_fraction(plan.pipeline_parallel_degree, m, plan.pipeline_virtual_stages))
    quiet_slots = slots - 1 if quiet is not None and reduces_once(plan) else 0.0
    f_full, b_full, opt = full
    f_quiet, b_quiet = quiet if quiet_slots else (f_full, b_full)
    send = p2p_s(plan)
    forward = (slots - quiet_slots) * f_full + quiet_slots * f_quiet + slots * send / 2
    backward = (slots - quiet_slots) * b_full + quiet_slots * b_quiet + slots * send / 2
    return StepTimes(forward, backward, opt, slots, quiet_slots, send)


def step_details(plan: Plan, step: StepTimes) -> dict[str, float | int]:
    """What a prediction's `details.pipeline` says about the composed step."""
    return {
        "stages": plan.pipeline_parallel_degree,
        "virtual_stages": plan.pipeline_virtual_stages,
        "micro_batches_per_step": plan.micro_batches_per_step,
        "stage_layers": stage_layers(plan),
        "bubble_fraction": bubble_fraction(plan.pipeline_parallel_degree, plan.micro_batches_per_step,
                                           plan.pipeline_virtual_stages),
        "micro_batch_slots": step.slots,
        "slots_without_data_parallel_traffic": step.quiet_slots,
        "p2p_bytes_per_micro_batch": round(p2p_bytes_per_gpu(plan)),
        "p2p_s_per_micro_batch": step.p2p_s,
    }
