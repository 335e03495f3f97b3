"""Memory model: bytes per tier for a plan, as a sum of named terms (paper eq. 1-5 plus buffers).

Units: the `gpu` tier is per GPU, `cpu` and `nvme` are per node (what one node must hold), all in
bytes. Every term is listed with a one-line formula in `TERM_DOCS`; `planner memory` prints them.

[Note: what the runtime holds beyond the paper]
The paper's quantities (eq. 2-5) are the *states* and the *working memory* of one operator and one
checkpoint interval. A real ZeRO-3 runtime also holds, at the worst moment of the iteration:
- the next operator's gathered parameters, fetched while the current one computes (prefetch depth
  >= 1), and the one after that's shard staged on the GPU (depth >= 2);
- one operator's full gradients being reduce-scattered while the previous operator's backward runs;
- pinned host staging: NVMe->CPU read buffers for the parameter shards fetched ahead (depth >= 3
  reads i+3 while i+2 crosses PCIe), the streamed optimizer's chunk buffers, and double buffers for
  gradient shards on their way to NVMe and for checkpoints on their way to CPU;
- the loss's logits (vocab-sized) and their gradient, when the model has embeddings;
- allocator slack: the caching allocator rounds and fragments; we charge a fixed fraction of the
  transient GPU bytes (`ALLOCATOR_SLACK_FRACTION`).
Tiling divides every per-operator buffer by the tiling factor (each tile is gathered alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.plan import MODEL_STATES, TIERS, Plan

# bytes per parameter of each model state (eq. 2: 2 + 2 + 16 = 20 for mixed precision, where the
# optimizer's 16 are the fp32 master weights, momentum, variance and the fp32 gradient copy).
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "bf16": {"params": 2, "gradients": 2, "optimizer_states": 16},
    "fp16": {"params": 2, "gradients": 2, "optimizer_states": 16},
    # fp32 end to end: the parameter is its own compute copy; the optimizer keeps a master copy where
    # it steps (it may be another tier), momentum and variance.
    "fp32": {"params": 4, "gradients": 4, "optimizer_states": 12},
}
ACTIVATION_BYTES = 2  # eq. 3 and 5 count fp16 activations
LOGIT_GRAD_BYTES = 4  # the loss upcasts logits to fp32 and backpropagates through that copy
ALLOCATOR_SLACK_FRACTION = 0.10
OPERATORS_PER_LAYER = 6
"""Runtime units per transformer layer: eq. 1's four linears (qkv, out, up, down) and two norms."""
BOOKKEEPING_BYTES_PER_OPERATOR = 64 * 1024
"""Host memory each operator costs whatever its size: its module and parameter objects, hooks,
autograd nodes, swap extents and the runtime's per-unit state. Measured 43-49 KB per operator on the
project VM (tests/nvme_memory_probe.py, 8 vs 48 layers: 261 KB per layer at h=256 and 293 KB at
h=128, so independent of the sizes; unchanged by glibc's mmap threshold (4-64 KiB) and by
malloc_trim, so live objects, not heap fragmentation), rounded up."""

TERM_DOCS: dict[str, str] = {
    "params": "parameter shards: P/mp x bytes / dp (replicated: / 1) [eq. 2]",
    "gradients": "gradient shards: P/mp x bytes / dp (replicated: / 1) [eq. 2]",
    "optimizer_states": "fp32 master, momentum, variance, fp32 grad: P/mp x 16 / dp [eq. 2]",
    "activation_checkpoints": "2 x bsz x seq x hd x ceil(nl / ci) [eq. 3]",
    "awm": "activation working memory: bsz x seq x ci x (16 hd + 2 heads seq) [eq. 5]",
    "mswm": "model-state working memory: largest operator's params + grads / (mp x tiling) [eq. 4]",
    "prefetch_gathered_params": "next operator's gathered params, all-gathered ahead (depth >= 1)",
    "prefetch_shard_staging": "operator i+2's shard staged on the GPU (depth >= 2, params off GPU)",
    "reduce_scatter_buffer": "one operator's full gradients in flight to reduce-scatter",
    "gradient_offload_staging": "double buffer of gradient shards on their way off the GPU",
    "checkpoint_offload_staging": "double buffer of one checkpoint on its way to the CPU",
    "logits": "bsz x seq x vocab logits and their fp32 gradient",
    "allocator_slack": f"{ALLOCATOR_SLACK_FRACTION:.0%} of the transient GPU terms (caching allocator)",
    "param_swap_buffers": "pinned NVMe->CPU buffers for parameter shards fetched ahead (depth >= 3: i+2, i+3)",
    "optimizer_swap_buffers": "pinned chunk buffers of the streamed NVMe optimizer step",
    "gradient_swap_buffers": "pinned double buffer of gradient shards on their way to NVMe",
    "runtime_bookkeeping": "per-operator objects of the model and the runtime: (6 nl + 3) x 64 KiB per rank",
}
_TRANSIENT_GPU_TERMS = (
    "awm", "mswm", "prefetch_gathered_params", "prefetch_shard_staging", "reduce_scatter_buffer",
    "gradient_offload_staging", "checkpoint_offload_staging", "logits",
)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBill:
    """Bytes per tier for one plan; `terms[tier][name]`, in `peak_bytes` units."""

    terms: dict[str, dict[str, int]]
    capacity_bytes: dict[str, int]
    largest_alloc_bytes: int
    """Largest single GPU allocation (one gathered operator, or the largest activation tensor)."""
    max_alloc_bytes: int
    over: dict[str, int] = field(default_factory=dict)
    """tier -> bytes over capacity (only tiers that do not fit)."""

    @property
    def peak_bytes(self) -> dict[str, int]:
        return {tier: sum(self.terms[tier].values()) for tier in TIERS}

    @property
    def fits(self) -> bool:
        return not self.over and self.largest_alloc_bytes <= self.max_alloc_bytes

    def reason(self) -> str:
        """One line saying what does not fit, or ''."""
        from planner.units import GIB

        problems = [
            f"{tier.upper()} needs {self.peak_bytes[tier] / GIB:,.1f} GiB of {self.capacity_bytes[tier] / GIB:,.1f} GiB"
            + (" per GPU" if tier == "gpu" else " per node")
            for tier in TIERS
            if tier in self.over
        ]
        if self.largest_alloc_bytes > self.max_alloc_bytes:
            problems.append(
                f"a {self.largest_alloc_bytes / GIB:,.2f} GiB allocation exceeds the largest free block "
                f"({self.max_alloc_bytes / GIB:,.2f} GiB); raise the tiling factor or lower the batch"
            )
        return "; ".join(problems)


def model_state_bytes(plan: Plan) -> dict[str, int]:
    """Per-GPU bytes of each model state where it lives (eq. 2 split by partitioning)."""
    per_param = BYTES_PER_PARAM[plan.precision]
    params_per_gpu = plan.model.num_params / plan.model_parallel_degree
    dp = plan.data_parallel_degree
    return {
        state: math.ceil(params_per_gpu * per_param[state] / (dp if state in plan.partitioned else 1))
        for state in MODEL_STATES
    }


def operator_params_per_gpu(plan: Plan) -> float:
    """Largest operator's weight elements on one GPU at once: split by mp and by tiling."""
    return plan.model.largest_operator_params / (plan.model_parallel_degree * plan.tiling_factor)


def num_operators(plan: Plan) -> int:
    """Runtime units of the model: OPERATORS_PER_LAYER per layer, plus the token and position
    embeddings and the final norm."""
    return plan.model.num_layers * OPERATORS_PER_LAYER + 3


def checkpoint_bytes(plan: Plan) -> int:
    """Eq. 3 per GPU; one fp16 block input per checkpoint. 0 when checkpointing is off."""
    m, ci = plan.model, plan.checkpoint_interval
    if ci == 0:
        return 0
    num_checkpoints = math.ceil(m.num_layers / ci)
    return math.ceil(ACTIVATION_BYTES * plan.micro_batch_per_gpu * m.seq_len * m.hidden_size * num_checkpoints)


def activation_working_bytes(plan: Plan) -> int:
    """Eq. 5: memory to recompute (or, without checkpointing, to keep) `ci` blocks' activations."""
    m = plan.model
    blocks = plan.checkpoint_interval or m.num_layers
    return math.ceil(plan.micro_batch_per_gpu * m.seq_len * blocks * (16 * m.hidden_size + 2 * m.num_heads * m.seq_len))


def memory_bill(plan: Plan) -> MemoryBill:
    m, node, place = plan.model, plan.node, plan.placement
    per_param = BYTES_PER_PARAM[plan.precision]
    dp = plan.data_parallel_degree
    gpus_per_node = plan.cluster.gpus_per_node
    zero3 = "params" in plan.partitioned
    op_params = operator_params_per_gpu(plan)
    op_param_bytes = op_params * per_param["params"]
    op_grad_bytes = op_params * per_param["gradients"]
    depth = plan.prefetch_depth

    gpu: dict[str, float] = {}
    cpu: dict[str, float] = {}
    nvme: dict[str, float] = {}
    per_gpu_tiers = {"gpu": gpu, "cpu": cpu, "nvme": nvme}

    # -- resident states (eq. 2, eq. 3) ------------------------------------------------------
    for state, nbytes in model_state_bytes(plan).items():
        per_gpu_tiers[getattr(place, state)][state] = nbytes
    per_gpu_tiers[place.activation_checkpoints]["activation_checkpoints"] = checkpoint_bytes(plan)

    # -- working memory (eq. 4, eq. 5) and the runtime's buffers ------------------------------
    gpu["awm"] = activation_working_bytes(plan)
    if zero3:
        gpu["mswm"] = op_param_bytes + op_grad_bytes  # eq. 4: 16 hd^2 for the hd x 4hd linear
        if depth >= 1:
            gpu["prefetch_gathered_params"] = op_param_bytes
        if depth >= 2 and place.params != "gpu":
            gpu["prefetch_shard_staging"] = op_param_bytes / dp
    if "gradients" in plan.partitioned:
        gpu["reduce_scatter_buffer"] = op_grad_bytes
    if place.gradients != "gpu":
        gpu["gradient_offload_staging"] = 2 * op_grad_bytes / dp
    if place.activation_checkpoints != "gpu" and plan.checkpoint_interval:
        gpu["checkpoint_offload_staging"] = 2 * ACTIVATION_BYTES * plan.micro_batch_per_gpu * m.seq_len * m.hidden_size
    if m.vocab_size:
        logit_elems = plan.micro_batch_per_gpu * m.seq_len * m.vocab_size
        gpu["logits"] = logit_elems * (ACTIVATION_BYTES + LOGIT_GRAD_BYTES)
    gpu["allocator_slack"] = ALLOCATOR_SLACK_FRACTION * sum(gpu.get(t, 0) for t in _TRANSIENT_GPU_TERMS)

    if place.params == "nvme" and zero3:
        cpu["param_swap_buffers"] = max(0, min(depth, 3) - 1) * op_param_bytes / dp
    if place.optimizer_states == "nvme":
        shard = model_state_bytes(plan)["optimizer_states"]
        cpu["optimizer_swap_buffers"] = min(shard, plan.num_optimizer_buffers * plan.optimizer_chunk_bytes)
    if place.gradients == "nvme":
        cpu["gradient_swap_buffers"] = 2 * op_grad_bytes / dp
    cpu["runtime_bookkeeping"] = num_operators(plan) * BOOKKEEPING_BYTES_PER_OPERATOR

    # Host and NVMe tiers are shared by the node's GPUs: scale per-GPU amounts to per node.
    terms = {
        "gpu": {k: math.ceil(v) for k, v in gpu.items()},
        "cpu": {k: math.ceil(v) * gpus_per_node for k, v in cpu.items()},
        "nvme": {k: math.ceil(v) * gpus_per_node for k, v in nvme.items()},
    }
    capacity = {
        "gpu": int(node.gpu_memory_bytes),
        "cpu": int(node.cpu_memory_bytes),
        "nvme": int(node.nvme_capacity_bytes),
    }
    peak = {tier: sum(t.values()) for tier, t in terms.items()}
    over = {tier: peak[tier] - capacity[tier] for tier in TIERS if peak[tier] > capacity[tier]}
    largest_activation = plan.micro_batch_per_gpu * m.seq_len * m.ffn_hidden_size * ACTIVATION_BYTES / plan.model_parallel_degree
    largest_weight = op_param_bytes if zero3 else (m.largest_operator_params / plan.model_parallel_degree) * per_param["params"]
    return MemoryBill(
        terms=terms,
        capacity_bytes=capacity,
        largest_alloc_bytes=math.ceil(max(largest_weight, largest_activation)),
        max_alloc_bytes=int(node.gpu_max_alloc_bytes),
        over=over,
    )


def min_tiling_factor(plan: Plan) -> int:
    """Smallest tiling factor whose gathered operator fits the largest free block (paper §4.4)."""
    per_param = BYTES_PER_PARAM[plan.precision]["params"]
    op_bytes = plan.model.largest_operator_params / plan.model_parallel_degree * per_param
    return max(1, math.ceil(op_bytes / plan.node.gpu_max_alloc_bytes))


def paper_quantities(plan: Plan) -> dict[str, int]:
    """The paper's section-3 quantities for this plan's model, exactly as the equations write them.

    `model_states` is eq. 2 over all parameters (20 bytes each in mixed precision, so
    `240 * nl * hd^2` for the paper's configurations), unpartitioned: the whole model.
    """
    m = plan.model
    per_param = BYTES_PER_PARAM[plan.precision]
    return {
        "num_params": m.num_params,
        "num_params_eq1": m.num_params_eq1,
        "model_states": m.num_params * sum(per_param.values()),
        "activation_checkpoints_per_gpu": checkpoint_bytes(plan),
        "activations_per_gpu": checkpoint_bytes(plan) + activation_working_bytes(plan),
        "mswm_per_gpu": math.ceil(m.largest_operator_params * (per_param["params"] + per_param["gradients"])),
        "awm_per_gpu": activation_working_bytes(plan),
    }
