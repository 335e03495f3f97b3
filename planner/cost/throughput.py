"""Analytic throughput estimate (paper §4): the fast first stage of the search.

Per-GPU traffic of each state per iteration, divided by the bandwidth it can use, set against the
compute time; overlapped (prefetch depth >= 1) or serial (depth 0). The discrete-event simulator
(`planner.sim`) refines the top candidates at operator and link resolution.

[Note: bandwidth-centric partitioning]
Each of the `dp` ranks brings 1/dp of every parameter over its own host link (or its share of the
node's NVMe), and the all-gather assembles the rest over GPU-GPU links (paper §5.1). Bringing the
full operator to every GPU therefore takes `max(bytes / dp / slow_bw, bytes * (dp-1)/dp / ag_bw)`:
the effective bandwidth is `min(dp * slow_bw, gpu_gpu_bw)` as the paper's rule of thumb says.
Per-GPU slow bandwidth is the GPU's own link capped by its share of the node's aggregate
(host-memory bandwidth or NVMe bandwidth divided by the GPUs in use on the node).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import planner.cost.pipeline as pipeline
from planner.cost.collectives import (
    bus_bytes_per_s,
    collectives_per_operator,
    data_parallel_ring,
    data_parallel_rings_per_node,
    latency_s,
    tensor_parallel_ring,
)
from planner.cost.context_parallel import ring_passes_s
from planner.cost.fp8 import linear_speedup, tensor_parallel_byte_share
from planner.cost.host_link import (
    host_memcpy_bytes_per_s,
    landing_bytes_per_s,
    landing_host_bytes_per_byte,
    stages_host_shards,
)
from planner.cost.host_work import host_param_read_bytes, step_cpu_params_per_param
from planner.cost.kernels import (
    BlockCost,
    achievable_hbm_bytes_per_s,
    block_cost,
    fused_attention_flops_per_s,
    loss_bytes,
    recomputed_linear_share,
)
from planner.cost.memory import (
    BYTES_PER_PARAM,
    STORED_GRADIENT_BYTES,
    recompute_input_bytes,
    stores_gradients,
)
from planner.specs.phases import PHASES
from planner.specs.plan import LINKS, Plan
from planner.specs.tiers import HOST, TIERS, Tier
from planner.specs.training_loop import step_overlaps_forward

# A GPU Adam step streams params, grads and 12 bytes of optimizer state in and out: ~36 bytes/param.
GPU_ADAM_BYTES_PER_PARAM = 36
ACTIVATION_ALLREDUCE_BYTES = 2  # tensor-parallel all-reduces move fp16 activations


@dataclass(frozen=True, kw_only=True, slots=True)
class Bandwidths:
    """Per-GPU bandwidths (bytes/s) that one plan's traffic can use."""

    h2d: float
    """The GPU's share of its host link, host to device (capped by its share of host memory)."""
    d2h: float
    reads: dict[Tier, float]
    """Per tier: the bandwidth one GPU's reads from it reach, the slowest share on its way to the GPU
    (host memory: `h2d`; NVMe: its share of the drives, capped by `h2d`; the GPU's own: infinite)."""
    writes: dict[Tier, float]
    """Per tier: the same for writes into it."""
    all_gather: float
    """Per-GPU data-parallel collective bandwidth: NVLink, capped across nodes by the ring's share of
    the node's network (planner/cost/collectives.py [Note: the alpha-beta collective])."""
    tensor_parallel: float
    all_gather_latency_s: float = 0.0
    """One data-parallel all-gather's (or reduce-scatter's) latency over its ring."""
    all_reduce_latency_s: float = 0.0
    """One data-parallel gradient all-reduce's latency (plain data parallel)."""
    tensor_parallel_latency_s: float = 0.0
    """One Megatron all-reduce's latency over the tensor-parallel group."""
    host_memcpy: float = float("inf")
    """One host thread's pageable<->pinned memcpy: what a copy through the staging pool also runs at
    (planner/cost/host_link.py [Note: staged and pinned host copies]); unbounded where the host is the device."""
    landing: float = float("inf")
    """Gradient bytes per second the transfer worker adds into fp32 host shards as they land."""


def bandwidths(plan: Plan) -> Bandwidths:
    node, cluster = plan.node, plan.cluster
    gpus = cluster.gpus_per_node
    host_share = node.host_memory_bytes_per_s / gpus
    ring = data_parallel_ring(plan)
    collective = bus_bytes_per_s(ring, node, data_parallel_rings_per_node(plan))
    h2d = min(node.host_to_gpu_bytes_per_s, host_share)
    d2h = min(node.gpu_to_host_bytes_per_s, host_share)
    reads: dict[Tier, float] = {}
    writes: dict[Tier, float] = {}
    for tier in TIERS:  # each tier after the one it is reached through (`Tier.via`)
        share, via = tier.link_share(node, gpus), tier.via
        reads[tier] = min(share.read_bytes_per_s, reads[via] if via is not None else float("inf"))
        writes[tier] = min(share.write_bytes_per_s, writes[via] if via is not None else float("inf"))
    memcpy = landing = float("inf")
    if not node.host_is_device:
        memcpy, landing = host_memcpy_bytes_per_s(node), landing_bytes_per_s(plan)
        # A landing also moves its bytes read and written through the GPU's share of the host memory
        # (where that rate is the memory's own: `NodeSpec.host_memory_is_measured`).
        if node.host_memory_is_measured:
            landing = min(landing, host_share / landing_host_bytes_per_byte(plan))
    if stages_host_shards(plan):  # host shards reach the GPU through the pool (NVMe reads land pinned)
        reads[HOST] = min(reads[HOST], memcpy)
    return Bandwidths(
        h2d=h2d,
        d2h=d2h,
        reads=reads,
        writes=writes,
        all_gather=collective,
        tensor_parallel=node.gpu_gpu_intra_node_bytes_per_s or node.gpu_hbm_bytes_per_s,
        all_gather_latency_s=latency_s(ring, "all_gather", node),
        all_reduce_latency_s=latency_s(ring, "all_reduce", node),
        tensor_parallel_latency_s=latency_s(tensor_parallel_ring(plan), "all_reduce", node),
        host_memcpy=memcpy,
        landing=landing,
    )


def _divide(nbytes: float, rate: float) -> float:
    if nbytes <= 0:
        return 0.0
    return nbytes / rate if rate > 0 else float("inf")


def paper_flops_per_gpu(plan: Plan) -> float:
    """Eq. 7/8: 8 x tokens x params with recompute, 6 x tokens x params without; per GPU."""
    factor = 8 if plan.recompute_interval else 6
    return factor * plan.micro_batch_per_gpu * plan.model.seq_len * plan.model.num_params * plan.micro_batches_per_step


def efficiency(ait: float, bandwidth_bytes_per_s: float, peak_flops_per_s: float) -> float:
    """Eq. 6: fraction of peak reached when a state's traffic does not overlap compute."""
    if bandwidth_bytes_per_s == float("inf"):
        return 1.0  # the state is on the GPU: no slow-memory traffic
    return ait * bandwidth_bytes_per_s / (ait * bandwidth_bytes_per_s + peak_flops_per_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    iteration_time_s: float
    phase_time_s: dict[str, float]
    component_time_s: dict[str, float]
    """Time each kind of work needs on its own (compute, each state's traffic, the optimizer)."""
    link_bytes: dict[str, int]
    bottleneck: str
    tflops_per_gpu: float
    tokens_per_s: float
    efficiency_no_overlap: dict[str, float]
    """Eq. 6 per state at the bandwidth this plan gives it."""


class _Passes(NamedTuple):
    """Seconds one kind of work needs on its own in the forward and in the backward pass."""

    forward_s: float
    backward_s: float
    staged_tier: Tier | None = None
    """The staged tier (NVMe) the work reads from in backward, if any."""
    backward_staged_read_s: float = 0.0
    """The backward's own reads from `staged_tier` (an in-backward optimizer step shares its link with them)."""


class _OptimizerStep(NamedTuple):
    total_s: float
    """The step after the backward, ZeRO-2's all-gather of the updated parameters included."""
    update_compute_s: float
    """The update's own arithmetic (the CPU or HBM-bound Adam): the part of the step that is not I/O."""
    staged_s: dict[Tier, float]
    """Seconds of the step's traffic on each staged tier's links (NVMe: the states and the parameters written)."""
    gather_after_s: float
    on_compute_device: bool


def estimate(plan: Plan) -> Estimate:
    if pipeline.is_composed(plan):
        return _composed_estimate(plan)
    node = plan.node
    bw = bandwidths(plan)
    links = dict.fromkeys(LINKS, 0.0)
    # Each part adds its bytes to `links`, in this order (a link's sum is rounded as it grows).
    compute = _compute(plan)
    params = _param_fetch(plan, bw, links)
    grads_time = _gradient_traffic_s(plan, bw, links)
    inputs = _recompute_input_traffic(plan, bw, links)
    tp = _tensor_parallel(plan, bw)
    ring_fwd, ring_bwd = ring_passes_s(plan)  # context parallel: on the critical path, like tp's
    step = _optimizer_step(plan, bw, links)
    place = plan.placement
    components = {
        "compute": compute.forward_s + compute.backward_s,
        f"params ({place.params})": params.forward_s + params.backward_s,
        f"gradients ({place.gradients})": grads_time,
        f"recompute inputs ({place.recompute_inputs})": inputs.forward_s + inputs.backward_s,
        "tensor parallel": tp.forward_s + tp.backward_s,
        f"optimizer ({place.optimizer_states})": step.total_s,
    }
    if plan.context_parallel_degree > 1:
        components["context parallel"] = ring_fwd + ring_bwd
        tp = _Passes(tp.forward_s + ring_fwd, tp.backward_s + ring_bwd)
    forward, backward, optimizer = _phase_times(plan, compute, params, grads_time, inputs, tp, step)
    iteration = forward + backward + optimizer
    bottleneck = max(components, key=lambda k: components[k])
    ait, state_bw = arithmetic_intensity(plan), _state_bandwidths(plan, bw)
    eff = {state: efficiency(ait[state], state_bw[state], node.gpu_flops_per_s) for state in EFFICIENCY_STATES}
    return Estimate(
        iteration_time_s=iteration,
        phase_time_s=dict(zip(PHASES, (forward, backward, optimizer), strict=True)),
        component_time_s=components,
        link_bytes={k: int(v) for k, v in links.items()},
        bottleneck=bottleneck,
        tflops_per_gpu=paper_flops_per_gpu(plan) / iteration / 1e12,
        tokens_per_s=plan.tokens_per_iteration / iteration,
        efficiency_no_overlap=eff,
    )


def _compute(plan: Plan) -> _Passes:
    """Each pass's matmul flops at the GPU's peak, its fused attention at that kernel's rate and its
    memory-bound kernels at the achievable HBM bandwidth: the terms the simulator times operator by
    operator (model_compute)."""
    block = block_cost(plan)
    work = model_compute(plan, block)
    node = plan.node
    hbm, fused_rate = achievable_hbm_bytes_per_s(node), fused_attention_flops_per_s(plan)
    # fp8 runs the block linears' matmuls at the fp8 rate ([Note: fp8 matmuls] in planner/cost/fp8.py):
    # their time shrinks by the speed-up; the head, eager attention's products, the fused attention and
    # the memory-bound kernels stay in bf16.
    matmul_rate = node.gpu_flops_per_s
    fp8_saved = 1.0 - 1.0 / linear_speedup(plan.fp8_matmuls, node)

    def seconds(matmul_flops: float, linear_flops: float, fused_flops: float, nbytes: float) -> float:
        return ((matmul_flops - fp8_saved * linear_flops) / matmul_rate
                + (fused_flops / fused_rate if fused_flops else 0.0) + (nbytes / hbm if hbm > 0 else 0.0))

    # The backward's own matmuls at the backward's rate, where the spec has one; its recompute is a forward.
    linear = plan.model.num_layers * block.linear_flops
    again = 1 if plan.recompute == "full" else 0
    backward_only = work.backward_flops - work.recompute_flops - fp8_saved * 2 * linear
    slower_s = backward_only / matmul_rate * (node.backward_matmul_slowdown - 1)
    return _Passes(seconds(work.forward_flops, linear, work.forward_fused_flops, work.forward_bytes),
                   seconds(work.backward_flops, (2 + again + recomputed_linear_share(plan)) * linear,
                           work.backward_fused_flops, work.backward_bytes)
                   + slower_s)


class ModelCompute(NamedTuple):
    """One micro-batch's work on one GPU per pass: matmul flops, fused attention flops and
    memory-bound kernel bytes; the backward's include a full recompute's forward."""

    forward_flops: float
    backward_flops: float
    forward_fused_flops: float
    backward_fused_flops: float
    forward_bytes: float
    backward_bytes: float
    recompute_flops: float = 0.0
    """The matmul flops of `backward_flops` that are the recompute's forward."""


def model_compute(plan: Plan, block: BlockCost | None = None) -> ModelCompute:
    """Blocks (planner/cost/kernels.py: linears, attention core, memory-bound kernels; `block`: the
    plan's `block_cost`, where the caller has it), the output head's matmul and the loss; the
    embedding lookup moves rows and multiplies nothing. With `recompute: full` every block's forward
    runs again in backward."""
    m = plan.model
    block = block if block is not None else block_cost(plan)
    head = 2 * plan.micro_batch_per_gpu * m.seq_len * m.vocab_size * m.hidden_size
    loss_fwd, loss_bwd = loss_bytes(plan)
    again = 1 if plan.recompute == "full" else 0
    layers = m.num_layers
    return ModelCompute(
        forward_flops=layers * block.matmul_forward_flops + head,
        backward_flops=layers * (block.matmul_backward_flops + again * block.matmul_forward_flops) + 2 * head,
        forward_fused_flops=layers * block.fused_forward_flops,
        backward_fused_flops=layers * (block.fused_backward_flops + again * block.fused_forward_flops),
        forward_bytes=layers * block.forward_bytes + loss_fwd,
        backward_bytes=layers * (block.backward_bytes + again * block.forward_bytes) + loss_bwd,
        recompute_flops=layers * (again * block.matmul_forward_flops + block.recompute_linear_flops),
    )


def _param_fetch(plan: Plan, bw: Bandwidths, links: dict[str, float]) -> _Passes:
    """Parameters fetched once per pass over the model (twice in backward with recompute)."""
    if "params" not in plan.partitioned:
        return _Passes(0.0, 0.0)
    tier, dp = plan.placement.params, plan.data_parallel_degree
    param_bytes = _params_per_gpu(plan) * BYTES_PER_PARAM[plan.precision]["params"]
    passes_bwd = 2 if plan.recompute_interval > 0 else 1
    gather = param_bytes * (dp - 1) / dp
    # The shard crosses its links at its stored width, cast on the device before the all-gather
    # ([Note: the resident step's cast] in planner/cost/host_work.py).
    shard = _params_per_gpu(plan) * host_param_read_bytes(plan) / dp if not tier.on_device else 0.0
    gather_s = _divide(gather, bw.all_gather) + (collectives_per_pass(plan) * bw.all_gather_latency_s if dp > 1 else 0.0)
    per_pass = max(gather_s, _divide(shard, bw.reads[tier]))
    links["all_gather"] += (1 + passes_bwd) * gather
    hop: Tier | None = tier
    while hop is not None and hop.read_link:  # each link on the shard's way to the GPU
        links[hop.read_link] += (1 + passes_bwd) * shard
        hop = hop.via
    if tier.staged:
        return _Passes(per_pass, passes_bwd * per_pass, tier, _divide(passes_bwd * shard, bw.reads[tier]))
    return _Passes(per_pass, passes_bwd * per_pass)


def _gradient_traffic_s(plan: Plan, bw: Bandwidths, links: dict[str, float]) -> float:
    """Backward's gradient traffic: reduce-scatter (or all-reduce) and the offload of the shard."""
    place, dp = plan.placement, plan.data_parallel_degree
    grad_bytes = _params_per_gpu(plan) * BYTES_PER_PARAM[plan.precision]["gradients"]
    # A ring all-reduce moves twice a reduce-scatter's bytes; with partitioned optimizer states
    # (ZeRO-1, `3d`) each rank needs only its shard reduced, and gets the updated parameters back
    # by the all-gather after the step.
    rounds = 1 if plan.partitioned & {"gradients", "optimizer_states"} else 2
    reduce = rounds * grad_bytes * (dp - 1) / dp
    links["reduce_scatter"] += reduce
    latency = bw.all_gather_latency_s if rounds == 1 else bw.all_reduce_latency_s
    grads_time = _divide(reduce, bw.all_gather) + (collectives_per_pass(plan) * latency if dp > 1 else 0.0)
    tier = place.gradients
    if not tier.on_device:
        # Not stored (in-backward step, optimizer on NVMe): the shard still crosses to the host,
        # into the update's chunk buffer, but is never written to NVMe.
        out = grad_bytes / dp
        links["d2h"] += out
        # Stored in host memory: added into the fp32 shard as it lands ([Note: staged and pinned host copies]).
        landed = tier.host_memory and stores_gradients(plan)
        grads_time = max(grads_time, _divide(out, min(bw.d2h, bw.landing) if landed else bw.d2h))
        if tier.staged and stores_gradients(plan):  # the fp32 shard the step reads back
            written = _params_per_gpu(plan) * STORED_GRADIENT_BYTES / dp
            links[tier.write_link] += written
            grads_time = max(grads_time, _divide(written, bw.writes[tier]))
    return grads_time


def _recompute_input_traffic(plan: Plan, bw: Bandwidths, links: dict[str, float]) -> _Passes:
    """Recompute inputs written in forward and read back in backward (eq. 11)."""
    tier = plan.placement.recompute_inputs
    if tier.on_device or plan.recompute_interval == 0:
        return _Passes(0.0, 0.0)
    inputs = recompute_input_bytes(plan)
    links["d2h"] += inputs
    links["h2d"] += inputs
    pooled = stages_host_shards(plan)  # through the pool each way ([Note: staged and pinned host copies])
    inputs_fwd = _divide(inputs, min(bw.d2h, bw.host_memcpy) if pooled else bw.d2h)
    inputs_bwd = _divide(inputs, min(bw.h2d, bw.host_memcpy) if pooled else bw.h2d)
    if not tier.staged:
        return _Passes(inputs_fwd, inputs_bwd)
    links[tier.write_link] += inputs
    links[tier.read_link] += inputs
    return _Passes(max(inputs_fwd, _divide(inputs, bw.writes[tier])), max(inputs_bwd, _divide(inputs, bw.reads[tier])),
                   tier, _divide(inputs, bw.reads[tier]))


def _tensor_parallel(plan: Plan, bw: Bandwidths) -> _Passes:
    """Megatron's two all-reduces per block in each pass (and two more in a recompute)."""
    mp = plan.model_parallel_degree
    if mp <= 1:
        return _Passes(0.0, 0.0)
    m, tokens = plan.model, plan.micro_batch_per_gpu * plan.model.seq_len
    per_allreduce = 2 * (mp - 1) / mp * ACTIVATION_ALLREDUCE_BYTES * tokens * mp * m.hidden_size
    recompute = 2 if plan.recompute_interval > 0 else 0
    # fp8 gathers the forward's (and the recompute's) inputs in fp8 ([Note: fp8 casts] in planner/cost/fp8.py).
    forward = per_allreduce * tensor_parallel_byte_share(plan, backward=False) / bw.tensor_parallel
    backward = per_allreduce / bw.tensor_parallel
    latency = bw.tensor_parallel_latency_s
    return _Passes(2 * m.num_layers * (forward + latency),
                   2 * m.num_layers * (backward + latency) + recompute * m.num_layers * (forward + latency))


def _optimizer_step(plan: Plan, bw: Bandwidths, links: dict[str, float]) -> _OptimizerStep:
    """The optimizer step: not overlapped with forward/backward in the paper's design."""
    place, node, dp = plan.placement, plan.node, plan.data_parallel_degree
    states, params = place.optimizer_states, place.params
    shard_params = _params_per_gpu(plan) / dp
    on_compute_device = states.on_device or node.host_is_device
    staged_s: dict[Tier, float] = {}  # the step's time on each staged tier's links
    if states.on_device and not node.host_is_device:
        optimizer = update_compute = _divide(shard_params * GPU_ADAM_BYTES_PER_PARAM, node.gpu_hbm_bytes_per_s)
    else:
        # With the states on NVMe the worker's host copies take the CPU too ([Note: the step's host copies]).
        cpu_update = update_compute = _divide(shard_params * plan.cluster.gpus_per_node * step_cpu_params_per_param(plan),
                                              node.cpu_adam_params_per_s)
        io = 0.0
        if states.staged:
            # eq. 10 reads and writes 16 bytes/param once; the runtime's streamed step reads the
            # fp32 master, momentum, variance (12) and the fp32 gradient (4, from NVMe when the
            # gradients live there and are stored) and writes back only the 12
            # (runtime/optim/streamed_optimizer.py).
            read = shard_params * (12 + (4 if place.gradients.staged and stores_gradients(plan) else 0))
            written = shard_params * 12
            links[states.read_link] += read
            links[states.write_link] += written
            io = _divide(read, bw.reads[states]) + _divide(written, bw.writes[states])
            staged_s[states] = io
        # updated parameters go back to where the parameters live
        updated = shard_params * BYTES_PER_PARAM[plan.precision]["params"]
        if params.on_device:  # through the staging pool, whatever the pinning
            links["h2d"] += updated
            io = max(io, _divide(updated, min(bw.h2d, bw.host_memcpy)))
        elif params.staged and (plan.precision != "fp32" or params != states):
            # (fp32 parameters on NVMe beside the states are their own master: written with the states,
            # as the simulator and runtime/optim/streamed_optimizer.py do.)
            links[params.write_link] += updated
            io += _divide(updated, bw.writes[params])
            staged_s[params] = staged_s.get(params, 0.0) + _divide(updated, bw.writes[params])
        optimizer = max(cpu_update, io)
    gather_after = 0.0
    if "params" not in plan.partitioned and "optimizer_states" in plan.partitioned:
        # ZeRO-2 / ZeRO-Offload: each rank updated 1/dp of the parameters; all-gather them back
        gather = _params_per_gpu(plan) * BYTES_PER_PARAM[plan.precision]["params"] * (dp - 1) / dp
        links["all_gather"] += gather
        gather_after = _divide(gather, bw.all_gather) + (bw.all_gather_latency_s if dp > 1 else 0.0)
        optimizer += gather_after
    return _OptimizerStep(optimizer, update_compute, staged_s, gather_after, on_compute_device)


def _phase_times(plan: Plan, compute: _Passes, params: _Passes, grads_time: float, inputs: _Passes, tp: _Passes,
                 step: _OptimizerStep) -> tuple[float, float, float]:
    """Forward, backward and optimizer seconds: each pass's work overlapped (prefetch depth >= 1)
    or serial (depth 0); an in-backward step moves the update into the backward."""
    optimizer = step.total_s
    if plan.optimizer_step == "in_backward":
        backward = _in_backward_backward(
            plan, step.total_s - step.gather_after_s, step.update_compute_s, on_compute_device=step.on_compute_device,
            staged_s=_busiest_staged_tier_s(step.staged_s, params, inputs),
            compute_bwd=compute.backward_s, others=(params.backward_s, grads_time, inputs.backward_s,
                                                    _backward_host_memory_s(plan, step)),
            tp_bwd=tp.backward_s)
        optimizer = step.gather_after_s
    elif plan.prefetch_depth >= 1:
        backward = max(compute.backward_s, params.backward_s, grads_time, inputs.backward_s) + tp.backward_s
    else:
        backward = compute.backward_s + params.backward_s + grads_time + inputs.backward_s + tp.backward_s
    if plan.prefetch_depth >= 1 and step_overlaps_forward(plan):
        # The step runs during the next forward (planner/sim/overlapped.py [Note: the overlapped step,
        # simulated]): its Adam takes turns with the forward's compute on the cores, its state
        # traffic shares the drive with the forward's reads of the parameters.
        drive = sum(step.staged_s.values()) + (params.forward_s if params.staged_tier is not None else 0.0)
        forward = max(compute.forward_s + step.update_compute_s, step.total_s - step.gather_after_s, drive,
                      params.forward_s, inputs.forward_s) + tp.forward_s
        optimizer = step.gather_after_s
    elif plan.prefetch_depth >= 1:
        forward = max(compute.forward_s, params.forward_s, inputs.forward_s) + tp.forward_s
    else:
        forward = compute.forward_s + params.forward_s + inputs.forward_s + tp.forward_s
    return forward, backward, optimizer


def _backward_host_memory_s(plan: Plan, step: _OptimizerStep) -> float:
    """An in-backward step's CPU updates of states resident in host memory, beside a GPU: the seconds
    the node's host memory is busy in the backward, as the simulator shares it (planner/sim/resources.py
    [Note: CPU Adam shares the host memory]): CPU Adam and its host copies for their time alone, then
    the bytes the GPUs' host links move through it (parameter shards and recompute inputs fetched from
    host memory, the gradients off the GPU, each landing's reads and writes of its fp32 shard), one
    after another. States on NVMe: the drive's time instead (`staged_s`)."""
    node, place = plan.node, plan.placement
    if (step.on_compute_device or place.optimizer_states.staged or not node.host_memory_is_measured
            or node.host_memory_bytes_per_s <= 0):
        return 0.0
    dp = plan.data_parallel_degree
    nbytes = 0.0
    if place.params.host_memory and "params" in plan.partitioned:
        passes = 2 if plan.recompute_interval > 0 else 1
        nbytes += passes * _params_per_gpu(plan) * BYTES_PER_PARAM[plan.precision]["params"] / dp
    if not place.gradients.on_device:
        landed = place.gradients.host_memory and stores_gradients(plan)
        weight = landing_host_bytes_per_byte(plan) if landed else 1.0
        nbytes += weight * _params_per_gpu(plan) * BYTES_PER_PARAM[plan.precision]["gradients"] / dp
    if place.recompute_inputs.host_memory and plan.recompute_interval > 0:
        nbytes += recompute_input_bytes(plan)
    return step.update_compute_s + nbytes * plan.cluster.gpus_per_node / node.host_memory_bytes_per_s


def _busiest_staged_tier_s(step_s: dict[Tier, float], *passes: _Passes) -> float:
    """The most time any staged tier's links spend in an in-backward step: the step's traffic there
    and the backward's own reads from it (one drive array serves both)."""
    reads: dict[Tier, float] = {}
    for work in passes:
        if work.staged_tier is not None:
            reads[work.staged_tier] = reads.get(work.staged_tier, 0.0) + work.backward_staged_read_s
    return max((step_s.get(tier, 0.0) + reads.get(tier, 0.0) for tier in {**step_s, **reads}), default=0.0)


def collectives_per_pass(plan: Plan) -> int:
    """Data-parallel collectives per pass over the model: one per operator the simulator traces
    (every linear's tiles of every block, the embedding and the output head), times the parameters
    each stands for where ZeRO-3 gathers per parameter (planner/cost/collectives.py [Note:
    per-parameter collectives])."""
    m, tiles = plan.model, plan.tiling_factor
    per_block = sum(tiles if op.num_params >= tiles else 1 for op in m.block_operators())
    ends = (1 + (tiles if m.vocab_size * m.hidden_size >= tiles else 1)) if m.vocab_size > 0 else 0
    return round((m.num_layers * per_block + ends) * collectives_per_operator(plan))


def _params_per_gpu(plan: Plan) -> float:
    """One model replica's slice of the parameters on this GPU."""
    return plan.model.num_params / plan.model_parallel_degree


def _in_backward_backward(plan: Plan, update_s: float, update_compute_s: float, *, on_compute_device: bool,
                          staged_s: float, compute_bwd: float, others: tuple[float, ...], tp_bwd: float) -> float:
    """The backward with `optimizer_step: in_backward`: each unit is updated while the rest of the
    backward runs (planner/sim/in_backward.py), so the optimizer's work (`update_s`) overlaps the
    backward instead of following it. On the compute device (a GPU optimizer, or any optimizer when
    the host is the device) the updates take turns with compute; a CPU optimizer overlaps GPU
    compute. One NVMe array serves the backward's reads and the state traffic (`staged_s`, both
    together, on the busiest staged tier). The optimizer phase keeps only what must follow the backward (the caller's: the
    ZeRO-2 all-gather; the last unit's write tail is left out). `others` are the backward's other
    traffic times (parameters, gradients, recompute inputs); `update_compute_s` is the update's own
    arithmetic (the CPU or HBM-bound Adam), the part of `update_s` that is not I/O."""
    if plan.prefetch_depth == 0:  # nothing overlaps
        return compute_bwd + sum(others) + tp_bwd + update_s
    compute = compute_bwd + (update_compute_s if on_compute_device else 0.0)
    return max(compute, update_s, staged_s, *others) + tp_bwd


EFFICIENCY_STATES: tuple[str, ...] = ("params_and_gradients", "optimizer_states", "recompute_inputs")
"""The three kinds of traffic of paper §4 (Fig. 2 a-c), in the order the paper plots them."""
_TIER_OF = {"params_and_gradients": "params", "optimizer_states": "optimizer_states",
            "recompute_inputs": "recompute_inputs"}


def arithmetic_intensity(plan: Plan) -> dict[str, float]:
    """Flops per byte moved for each kind of traffic (paper §4, eq. 9-11), per GPU."""
    tokens = plan.micro_batch_per_gpu * plan.model.seq_len
    return {
        "params_and_gradients": tokens,  # eq. 9: seq x bsz
        "optimizer_states": tokens / 4,  # eq. 10: seq x bsz / 4
        "recompute_inputs": 24 * plan.model.hidden_size * max(1, plan.recompute_interval),  # eq. 11
    }


def state_bandwidths(plan: Plan) -> dict[str, float]:
    """Per-GPU bandwidth (bytes/s) each kind of traffic gets on the tier its state lives on (GPU: inf)."""
    return _state_bandwidths(plan, bandwidths(plan))


def _state_bandwidths(plan: Plan, bw: Bandwidths) -> dict[str, float]:
    return {state: _state_bandwidth(getattr(plan.placement, _TIER_OF[state]), bw) for state in EFFICIENCY_STATES}


def _state_bandwidth(tier: Tier, bw: Bandwidths) -> float:
    """Per-GPU bandwidth a state on `tier` is served at (GPU: HBM, effectively unbounded here)."""
    return min(bw.reads[tier], bw.writes[tier])


def optimizer_link_bytes(plan: Plan) -> dict[str, float]:
    """Bytes per GPU the optimizer step alone moves on each link (once per step, however many
    micro-batches the step has)."""
    links = dict.fromkeys(LINKS, 0.0)
    _optimizer_step(plan, bandwidths(plan), links)
    return links


def composed_link_bytes(plan: Plan, stage: Plan, full: dict[str, float], quiet: dict[str, float] | None) -> dict[str, int]:
    """Bytes per GPU per step: the optimizer's once, the stage micro-batch's once per micro-batch
    (`full`, or `quiet` for the micro-batches without data-parallel traffic: the stage on one
    tensor-parallel group, whose own optimizer bytes are taken out of it)."""
    quiet_count = pipeline.quiet_micro_batches(plan) if quiet is not None else 0
    full_count = plan.micro_batches_per_step - quiet_count
    step = optimizer_link_bytes(stage)
    quiet_step = optimizer_link_bytes(pipeline.quiet_plan(stage)) if quiet is not None else None
    out = {}
    for link in LINKS:
        per_quiet = quiet[link] - quiet_step[link] if quiet is not None and quiet_step is not None else 0.0
        out[link] = round(step[link] + full_count * (full[link] - step[link]) + quiet_count * per_quiet)
    return out


def _composed_estimate(plan: Plan) -> Estimate:
    """A pipelined or accumulating plan's step from one stage micro-batch ([Note: the 1F1B step] in
    planner/cost/pipeline.py)."""
    stage = pipeline.stage_plan(plan)
    full = estimate(stage)
    quiet = estimate(pipeline.quiet_plan(stage)) if pipeline.reduces_once(plan) else None
    step = pipeline.compose_step(plan, (full.phase_time_s["forward"], full.phase_time_s["backward"], full.phase_time_s["optimizer"]),
                        None if quiet is None else (quiet.phase_time_s["forward"], quiet.phase_time_s["backward"]))
    iteration = step.forward_s + step.backward_s + step.optimizer_s
    components = {k: v * plan.micro_batches_per_step for k, v in full.component_time_s.items()}
    micro_s = full.phase_time_s["forward"] + full.phase_time_s["backward"]
    components["pipeline bubble"] = (step.slots - plan.micro_batches_per_step) * micro_s
    components["pipeline sends"] = step.slots * step.p2p_s
    links = composed_link_bytes(plan, stage, full.link_bytes, None if quiet is None else quiet.link_bytes)
    return Estimate(
        iteration_time_s=iteration,
        phase_time_s=dict(zip(PHASES, (step.forward_s, step.backward_s, step.optimizer_s), strict=True)),
        component_time_s=components,
        link_bytes=links,
        bottleneck=max(components, key=lambda k: components[k]),
        tflops_per_gpu=paper_flops_per_gpu(plan) / iteration / 1e12,
        tokens_per_s=plan.tokens_per_iteration / iteration,
        efficiency_no_overlap=full.efficiency_no_overlap,
    )
