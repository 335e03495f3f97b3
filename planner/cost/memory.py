"""Memory model: bytes per tier for a plan, as a sum of named terms (paper eq. 1-5 plus buffers).

Units: each tier's `scope` (planner/specs/tiers.py): the GPU's memory per GPU, host memory and NVMe
per node (what one node must hold), all in bytes. The terms are `planner.specs.memory_terms.MemoryTerm`, each with a one-line formula that `planner
memory` prints; [Note: adding a memory buffer] there says how to add one.

[Note: what the runtime holds beyond the paper]
The paper's quantities (eq. 2-5) are the *states* and the *working memory* of one operator and one
recompute interval. A real ZeRO-3 runtime also holds, at the worst moment of the iteration:
- the next operator's gathered parameters, fetched while the current one computes (prefetch depth
  >= 1), and the one after that's shard staged on the GPU (depth >= 2);
- one operator's full gradients being reduce-scattered while the previous operator's backward runs;
- pinned host staging: NVMe->CPU read buffers for the parameter shards fetched ahead (depth >= 3
  reads i+3 while i+2 crosses PCIe), the streamed optimizer's chunk buffers, and double buffers for
  gradient shards on their way to NVMe and for recompute inputs on their way to CPU;
- the loss's logits (vocab-sized) and their gradient, when the model has embeddings;
- allocator slack: the caching allocator rounds and fragments; we charge a fixed fraction of the
  transient GPU bytes (`ALLOCATOR_SLACK_FRACTION`, the terms marked `transient`).
Tiling divides every per-operator buffer by the tiling factor (each tile is gathered alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from planner.cost.coexisting import MOMENT_TERMS, SEGMENT_TERMS, Window, buffer_maxima, worst_moment_bytes
from planner.cost.context_parallel import ring_buffer_bytes
from planner.cost.kernels import (
    op_level_matmuls,
    recomputed_block_share,
    recomputed_score_bytes,
    stored_score_bytes_per_token,
)
from planner.cost.pipeline import in_flight_micro_batches, stage_plan
from planner.specs.memory_terms import ALLOCATOR_SLACK_FRACTION, MemoryTerm
from planner.specs.plan import HostPinning, Plan, master_is_param_shard
from planner.specs.tiers import GPU, HOST, TIERS, Tier
from planner.specs.units import COMPUTE_BYTES, GIB, round_up_4kib

# bytes per parameter of each model state as eq. 2 writes them (2 + 2 + 16 = 20 for mixed precision,
# where the optimizer's 16 are the fp32 master weights, momentum, variance and the fp32 gradient
# copy). `paper_quantities` reports these; the bill counts what the runtime holds (below).
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "bf16": {"params": 2, "gradients": 2, "optimizer_states": 16},
    "fp16": {"params": 2, "gradients": 2, "optimizer_states": 16},
    # fp32 end to end: the parameter is its own compute copy; the optimizer keeps a master copy where
    # it steps (it may be another tier), momentum and variance.
    "fp32": {"params": 4, "gradients": 4, "optimizer_states": 12},
}
STORED_GRADIENT_BYTES = 4
"""Bytes per element of a stored gradient shard in every precision: 16-bit gradients are added
straight into an fp32 shard ([Note: runtime bytes per parameter]), which is what goes to NVMe."""
ACTIVATION_BYTES = 2  # eq. 3 and 5 count fp16 activations (the paper quantities; the bill uses COMPUTE_BYTES)
LOGIT_GRAD_BYTES = 4  # the loss upcasts logits to fp32 and backpropagates through that copy
NORMS_PER_LAYER = 2
"""Runtime units per transformer layer besides its linears (the two layer norms)."""
BOOKKEEPING_BYTES_PER_OPERATOR = 64 * 1024
"""Host memory each operator costs whatever its size: its module and parameter objects, hooks,
autograd nodes, swap extents and the runtime's per-unit state: live objects, independent of the
operator's size and not heap fragmentation. The measured cost per operator (tests/nvme_memory_probe.py;
docs/runtime.md, Limits), rounded up."""

@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBill:
    """Bytes per tier for one plan; `terms[tier][name]`, in `peak_bytes` units."""

    terms: dict[Tier, dict[MemoryTerm, int]]
    capacity_bytes: dict[Tier, int]
    largest_alloc_bytes: int
    """Largest single GPU allocation (one gathered operator, or the largest activation tensor)."""
    max_alloc_bytes: int
    over: dict[Tier, int] = field(default_factory=dict)
    """tier -> bytes over capacity (only tiers that do not fit)."""

    @property
    def peak_bytes(self) -> dict[Tier, int]:
        return {tier: sum(self.terms[tier].values()) for tier in TIERS}

    @property
    def fits(self) -> bool:
        return not self.over and self.largest_alloc_bytes <= self.max_alloc_bytes

    def reason(self) -> str:
        """One line saying what does not fit, or ''."""
        problems = [
            f"{tier.upper()} needs {self.peak_bytes[tier] / GIB:,.1f} GiB of {self.capacity_bytes[tier] / GIB:,.1f} GiB "
            + tier.scope
            for tier in TIERS
            if tier in self.over
        ]
        if self.largest_alloc_bytes > self.max_alloc_bytes:
            problems.append(
                f"a {self.largest_alloc_bytes / GIB:,.2f} GiB allocation exceeds the largest free block "
                f"({self.max_alloc_bytes / GIB:,.2f} GiB); raise the tiling factor or lower the batch"
            )
        return "; ".join(problems)


def resident_state_terms(plan: Plan) -> list[tuple[Tier, MemoryTerm, int]]:
    """(tier, term, bytes per GPU) of the model states as the runtime holds them.

    [Note: runtime bytes per parameter] Where eq. 2 and the runtime differ, the bill follows the
    runtime (`tests/test_runtime_memory.py` checks it; `paper_quantities` keeps eq. 2):
    - mixed precision: no 16-bit gradient shard exists; arriving 16-bit gradients are added straight
      into the fp32 gradient copy, which eq. 2 counts among the optimizer states. That copy lives
      where the gradients are placed (4 bytes/param, term `optimizer_states` in the gradients'
      tier); the master, momentum and variance (12) where the optimizer states are: 18, not 20.
    - fp32 with params and optimizer states in one tier, or mixed precision with `host_param_shard:
      master`: the parameter shard is the master (4 bytes/param), so the optimizer holds momentum and
      variance only (8 bytes/param, not 12); mixed precision then holds 16, not 18.
    - `optimizer_step: in_backward` with the optimizer states on NVMe: no gradient shard at all
      (`stores_gradients`).
    """
    per_gpu = plan.model.num_params / plan.model_parallel_degree
    dp = plan.data_parallel_degree
    place = plan.placement

    def share(state: str, nbytes: int) -> int:
        return math.ceil(per_gpu * nbytes / (dp if state in plan.partitioned else 1))

    shares_master = master_is_param_shard(plan)
    param_bytes = 4 if shares_master else COMPUTE_BYTES[plan.precision]
    terms = [(place.params, MemoryTerm.PARAMS, share("params", param_bytes))]
    if stores_gradients(plan):
        grad_term = MemoryTerm.GRADIENTS if plan.precision == "fp32" else MemoryTerm.OPTIMIZER_STATES
        terms.append((place.gradients, grad_term, share("gradients", STORED_GRADIENT_BYTES)))
    master = 0 if shares_master else 4
    terms.append((place.optimizer_states, MemoryTerm.OPTIMIZER_STATES, share("optimizer_states", master + 8)))
    return terms


def stores_gradients(plan: Plan) -> bool:
    """Whether gradient shards are kept in the gradients' tier until the optimizer reads them. Not
    with `optimizer_step: in_backward` and the optimizer states on NVMe: each unit's gradient goes
    from its reduce-scatter (or, on one rank, from autograd) straight into the streamed update's
    chunk buffers, so no gradient shard, gradient swap file or gradient staging exists (the same
    for any `staged` tier: its states are streamed)
    ([Note: the optimizer step in backward] in runtime/optim/streamed_optimizer.py). With the states in
    memory an in-backward step reads the gradient shard where it lies, as after backward."""
    return not (plan.optimizer_step == "in_backward" and plan.placement.optimizer_states.staged)


def params_on_compute_device(plan: Plan) -> bool:
    """Whether the compute uses the parameter shard where it lies (no copy, no fresh buffer): not an
    fp32 master shard of a mixed-precision plan, which is cast into a fresh buffer (`host_param_shard:
    master`)."""
    cast = plan.precision != "fp32" and master_is_param_shard(plan)
    return plan.placement.params.is_compute_memory(plan.node) and not cast


def gathers_params(plan: Plan) -> bool:
    """Whether the runtime materialises a full operator in a buffer of its own: an all-gather
    (dp > 1), or a copy from a tier the compute cannot use directly."""
    return "params" in plan.partitioned and (plan.data_parallel_degree > 1 or not params_on_compute_device(plan))


def operator_params_per_gpu(plan: Plan) -> float:
    """Largest operator's weight elements on one GPU at once: split by mp and by tiling."""
    return plan.model.largest_operator_params / (plan.model_parallel_degree * plan.tiling_factor)


def num_operators(plan: Plan) -> int:
    """Runtime units of the model: per layer its norms and its linears, each linear one unit per
    tile (runtime/units/tiling.py makes every tile its own unit), plus the token and position embeddings
    and the final norm."""
    linears = len(plan.model.block_operators()) * plan.tiling_factor
    return plan.model.num_layers * (NORMS_PER_LAYER + linears) + 3


def recompute_input_bytes(plan: Plan, element_bytes: int | None = None) -> int:
    """Eq. 3 per GPU: one block input per recompute segment, in the compute precision (eq. 3 writes
    fp16: `element_bytes=ACTIVATION_BYTES`; an fp32 run holds 4-byte recompute inputs). 0 without
    recompute segments."""
    m, ci = plan.model, plan.recompute_interval
    if ci == 0:
        return 0
    element = COMPUTE_BYTES[plan.precision] if element_bytes is None else element_bytes
    num_recompute_inputs = math.ceil(m.num_layers / ci)
    return math.ceil(element * plan.micro_batch_per_gpu * m.seq_len * m.hidden_size * num_recompute_inputs)


def activation_working_bytes(plan: Plan) -> int:
    """Eq. 5: memory to recompute (or, without recompute, to keep) `ci` blocks' activations.

    Eq. 5 bills the eager attention scores (`2 heads seq` bytes per token and block); with
    `attention: flash` they are never stored (flash keeps `4 heads` bytes of softmax statistics
    instead), and with selective recompute only the block in backward holds them again
    (planner/cost/kernels.py [Note: attention kernels], [Note: recompute]). Eager and no selective
    recompute is eq. 5 to the byte. `every_nth_block` and `op_level` keep less per block and hold
    what a block recomputes while its backward runs (`recompute_working_bytes`)."""
    m = plan.model
    blocks = plan.recompute_interval or m.num_layers
    return math.ceil(plan.micro_batch_per_gpu * m.seq_len * blocks * _activation_bytes_per_token(plan)
                     + recompute_working_bytes(plan))


def recompute_working_bytes(plan: Plan) -> float:
    """What one block holds beyond its stored activations while it recomputes for its backward, freed
    after it: selective recompute's eager scores; under `every_nth_block` a recomputed block's
    activations beyond its input, under `op_level` a block's beyond what the policy saves
    (planner/cost/kernels.py [Note: recompute]). 0 for the other kinds."""
    tokens = plan.micro_batch_per_gpu * plan.model.seq_len
    if plan.recompute == "every_nth_block" and recomputed_block_share(plan) > 0:
        return tokens * (_whole_block_bytes_per_token(plan) - _input_bytes_per_token(plan))
    if plan.recompute == "op_level":
        return tokens * (_whole_block_bytes_per_token(plan) - _activation_bytes_per_token(plan))
    return recomputed_score_bytes(plan)


def eq5_activation_bytes(plan: Plan) -> int:
    """Eq. 5 as the paper writes it (eager scores stored), whatever the plan's attention kernel:
    the paper quantity `planner memory` reports."""
    m = plan.model
    blocks = plan.recompute_interval or m.num_layers
    return math.ceil(plan.micro_batch_per_gpu * m.seq_len * blocks * (16 * m.hidden_size + 2 * m.num_heads * m.seq_len))


def block_activation_bytes(plan: Plan) -> float:
    """One block's stored activations on one GPU (eq. 5 with ci = 1, the attention core as the plan
    keeps it)."""
    return plan.micro_batch_per_gpu * plan.model.seq_len * _activation_bytes_per_token(plan)


def _activation_bytes_per_token(plan: Plan) -> float:
    """Eq. 5 per token and block, the attention core as the plan keeps it; under `every_nth_block`
    the average over the blocks (the recomputed ones keep only their input), under `op_level` the
    block input and the outputs the policy saves, never more than the whole block's
    (planner/cost/kernels.py [Note: recompute])."""
    whole = _whole_block_bytes_per_token(plan)
    if plan.recompute == "every_nth_block":
        share = recomputed_block_share(plan)
        return (1 - share) * whole + share * _input_bytes_per_token(plan)
    if plan.recompute == "op_level":
        saved_width = plan.model.hidden_size + plan.model.q_size  # the block input and the attention output
        saved_width += sum(width for _, width, saved in op_level_matmuls(plan) if saved)
        return min(whole, COMPUTE_BYTES[plan.precision] * saved_width + stored_score_bytes_per_token(plan))
    return whole


def _whole_block_bytes_per_token(plan: Plan) -> int:
    """Eq. 5 per token and block (`16 hd` and the attention core as the plan keeps it)."""
    return 16 * plan.model.hidden_size + stored_score_bytes_per_token(plan)


def _input_bytes_per_token(plan: Plan) -> int:
    """A block input per token, in the compute precision (what a recomputed block keeps)."""
    return COMPUTE_BYTES[plan.precision] * plan.model.hidden_size


def largest_unit_params(plan: Plan) -> float:
    """Elements of the largest parameter unit the runtime gathers at once, on one GPU: the largest
    operator's weight tile plus its bias tile (the MLP up projection: `4 hd^2 + 4 hd` untiled)."""
    m = plan.model
    op = operator_params_per_gpu(plan)
    bias = m.ffn_hidden_size / (plan.model_parallel_degree * plan.tiling_factor)
    return op + (0 if _embedding_is_largest(plan) else bias)


def _embedding_is_largest(plan: Plan) -> bool:
    m = plan.model
    return m.vocab_size * m.hidden_size > m.largest_block_operator_params


def memory_bill(plan: Plan) -> MemoryBill:
    """Bytes per tier and term of `plan` at the iteration's worst moment (module docstring)."""
    if plan.pipeline_parallel_degree > 1:
        return _pipeline_stage_bill(plan)
    return _bill(plan, _LayoutTerms.of(plan))


class BatchBills:
    """`memory_bill` of one plan at several micro-batches (the search sizes each candidate's batch):
    the terms that do not depend on the batch (`_LayoutTerms`) are worked out once; each bill is
    `memory_bill`'s to the byte."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self._layout = None if plan.pipeline_parallel_degree > 1 else _LayoutTerms.of(plan)

    def at(self, micro_batch_per_gpu: float) -> tuple[Plan, MemoryBill]:
        """The plan at this micro-batch and its bill."""
        plan = self.plan.replace(micro_batch_per_gpu=micro_batch_per_gpu)
        return plan, memory_bill(plan) if self._layout is None else _bill(plan, self._layout)


@dataclass(frozen=True, slots=True)
class _LayoutTerms:
    """What a plan's bill holds whatever its micro-batch: the resident states, the per-operator GPU
    buffers, the host buffers and the tiers' capacities."""

    states: list[tuple[Tier, MemoryTerm, int]]
    operator_buffers: dict[MemoryTerm, float]
    maxima: tuple[float, float]
    """`operator_maxima` of the per-operator buffers."""
    host: dict[MemoryTerm, float]
    capacity: dict[Tier, int]

    @classmethod
    def of(cls, plan: Plan) -> _LayoutTerms:
        operator_buffers = _operator_buffers(plan)
        return cls(resident_state_terms(plan), operator_buffers, operator_maxima(plan, operator_buffers),
                   host_buffers(plan), {tier: int(tier.capacity_bytes(plan.node)) for tier in TIERS})


def _bill(plan: Plan, layout: _LayoutTerms) -> MemoryBill:
    """`memory_bill` of a plan that is not pipelined, with its batch-independent terms given."""
    node = plan.node
    per_node = plan.cluster.gpus_per_node  # host and NVMe tiers are shared by the node's GPUs
    terms = {tier: {term: math.ceil(v) * (1 if tier.per_gpu else per_node) for term, v in per_gpu.items()}
             for tier, per_gpu in _per_gpu_terms(plan, layout).items()}
    capacity = dict(layout.capacity)
    peak = {tier: sum(t.values()) for tier, t in terms.items()}
    return MemoryBill(
        terms=terms,
        capacity_bytes=capacity,
        largest_alloc_bytes=largest_alloc_bytes(plan),
        max_alloc_bytes=int(node.gpu_max_alloc_bytes),
        over=_over_capacity(peak, capacity, host_is_device=node.host_is_device),
    )


def resident_states_fit(plan: Plan) -> bool:
    """Whether the resident states and the recompute inputs alone fit every tier, as the bill counts
    them. The bill's other terms add up to no less than 0 on every tier (on the GPU the moment terms
    less `not_at_once` are the worst moment's bytes), and neither the prefetch depth nor the tiling
    changes these, nor a larger micro-batch lowers them: a plan whose states do not fit fits at no
    depth, tiling or larger batch. Pipelined plans are billed per stage: True (not decided here)."""
    if plan.pipeline_parallel_degree > 1:
        return True
    per_node = plan.cluster.gpus_per_node
    peak = {tier: 0 for tier in TIERS}
    for tier, _, nbytes in resident_state_terms(plan):
        peak[tier] += math.ceil(nbytes) * (1 if tier.per_gpu else per_node)
    tier = plan.placement.recompute_inputs
    peak[tier] += math.ceil(recompute_input_bytes(plan)) * (1 if tier.per_gpu else per_node)
    capacity = {tier: int(tier.capacity_bytes(plan.node)) for tier in TIERS}
    return not _over_capacity(peak, capacity, host_is_device=plan.node.host_is_device)


def _pipeline_stage_bill(plan: Plan) -> MemoryBill:
    """A pipelined plan's bill: its heaviest stage's (planner/cost/pipeline.py stage_plan: `L / p` of the
    weights), with the first stage's 1F1B activations of `min(p, m)` micro-batches in flight: their
    recompute inputs with recompute, their whole activations without ([Note: the 1F1B step])."""
    bill = memory_bill(stage_plan(plan))
    extra = in_flight_micro_batches(plan) - 1
    held = MemoryTerm.RECOMPUTE_INPUTS if plan.recompute_interval else MemoryTerm.AWM
    gpu = dict(bill.terms[GPU])
    if extra and held in gpu:
        gpu[held] += extra * gpu[held]
    terms = {**bill.terms, GPU: gpu}
    peak = {tier: sum(t.values()) for tier, t in terms.items()}
    return MemoryBill(terms=terms, capacity_bytes=bill.capacity_bytes, largest_alloc_bytes=bill.largest_alloc_bytes,
                      max_alloc_bytes=bill.max_alloc_bytes,
                      over=_over_capacity(peak, bill.capacity_bytes, host_is_device=plan.node.host_is_device))


def _per_gpu_terms(plan: Plan, layout: _LayoutTerms) -> dict[Tier, dict[MemoryTerm, float]]:
    """tier -> term -> bytes for one GPU (what the bill scales to per node for the per-node tiers):
    the resident states where the placement puts them, every buffer in its term's tier."""
    tiers: dict[Tier, dict[MemoryTerm, float]] = {tier: {} for tier in TIERS}
    # -- resident states (eq. 2 as the runtime holds them, eq. 3) ------------------------------
    for tier, term, nbytes in layout.states:
        tiers[tier][term] = tiers[tier].get(term, 0) + nbytes
    tiers[plan.placement.recompute_inputs][MemoryTerm.RECOMPUTE_INPUTS] = recompute_input_bytes(plan)
    # -- working memory (eq. 4, eq. 5) and the runtime's buffers ------------------------------
    for term, nbytes in (*_gpu_buffers(plan, layout).items(), *layout.host.items()):
        (tier,) = term.tiers
        tiers[tier][term] = nbytes
    return tiers


def _gpu_buffers(plan: Plan, layout: _LayoutTerms) -> dict[MemoryTerm, float]:
    """The transient GPU terms of one GPU (the activations, the layout's per-operator buffers, then
    the terms that grow with the batch), then the allocator's slack on them."""
    m, place = plan.model, plan.placement
    compute = COMPUTE_BYTES[plan.precision]
    copies = not plan.node.host_is_device  # host <-> device copies need staging (runtime/transfer/stores.py)
    gpu: dict[MemoryTerm, float] = {MemoryTerm.AWM: activation_working_bytes(plan), **layout.operator_buffers}
    if copies and not place.recompute_inputs.on_device and plan.recompute_interval:
        gpu[MemoryTerm.RECOMPUTE_INPUT_OFFLOAD_STAGING] = 2 * compute * plan.micro_batch_per_gpu * m.seq_len * m.hidden_size
    if plan.context_parallel_degree > 1:
        gpu[MemoryTerm.RING_ATTENTION_BUFFERS] = ring_buffer_bytes(plan)
    if m.vocab_size:
        gpu[MemoryTerm.LOGITS] = logits_bytes(plan)
    apart = not_at_once_bytes(plan, gpu, layout.maxima)
    if apart:
        gpu[MemoryTerm.NOT_AT_ONCE] = -apart
    gpu[MemoryTerm.ALLOCATOR_SLACK] = ALLOCATOR_SLACK_FRACTION * sum(v for term, v in gpu.items() if term.transient)
    return gpu


def _operator_buffers(plan: Plan) -> dict[MemoryTerm, float]:
    """The GPU's per-operator buffers (gathered, prefetched, reduce-scattered, offloaded): none
    depends on the micro-batch.

    [Note: gathered working memory] The runtime gathers a unit (weights + bias) into a buffer of
    its own only when it must (`gathers_params`); with 2+ ranks the unit's 16-bit gradients are
    collected in a flat buffer too, and the tied embedding stays gathered from its use as the
    output head until its gradient is complete. Each term is its own worst case; the runtime's
    units of different sizes rarely reach all of them at one instant (docs/calibration.md)."""
    m, place = plan.model, plan.placement
    dp, depth = plan.data_parallel_degree, plan.prefetch_depth
    compute = COMPUTE_BYTES[plan.precision]
    unit_param_bytes = largest_unit_params(plan) * compute
    copies = not plan.node.host_is_device  # host <-> device copies need staging (runtime/transfer/stores.py)
    gpu: dict[MemoryTerm, float] = {}
    if gathers_params(plan):
        op_working = unit_param_bytes
        if dp > 1:
            op_working += unit_param_bytes  # the flat gradient buffer
        if m.vocab_size and m.tied_embeddings and not _embedding_is_largest(plan):
            op_working += m.vocab_size * m.hidden_size / plan.model_parallel_degree * compute
        gpu[MemoryTerm.MSWM] = op_working
        if depth >= 1:
            gpu[MemoryTerm.PREFETCH_GATHERED_PARAMS] = unit_param_bytes
        if depth >= 2 and not params_on_compute_device(plan) and not place.params.staged:
            # A shard read from a staged tier (NVMe) waits in a host swap buffer instead, until its all-gather.
            gpu[MemoryTerm.PREFETCH_SHARD_STAGING] = unit_param_bytes / dp
    if ("gradients" in plan.partitioned and dp > 1) or (dp == 1 and gathers_params(plan)):
        # On one rank nothing is reduce-scattered, but a gathered unit's gradient is made on the
        # GPU before it is copied off or added into the shard: one unit's worth, as the bucket.
        gpu[MemoryTerm.REDUCE_SCATTER_BUFFER] = unit_param_bytes
    if copies and not place.gradients.on_device and stores_gradients(plan):
        gpu[MemoryTerm.GRADIENT_OFFLOAD_STAGING] = 2 * unit_param_bytes / dp
    return gpu


def not_at_once_bytes(plan: Plan, gpu: dict[MemoryTerm, float], maxima: tuple[float, float] | None = None) -> float:
    """What the GPU's working terms, each its own worst case, add beyond the worst moment the runtime
    reaches (planner/cost/coexisting.py [Note: terms that never meet]); never negative. `maxima`: the
    plan's `operator_maxima`, where the caller has it."""
    peaks = {term: gpu[term] for term in MOMENT_TERMS if gpu.get(term)}
    maxima = maxima if maxima is not None else operator_maxima(plan, gpu)
    return max(0.0, sum(peaks.values()) - worst_moment_bytes(plan, peaks, maxima))


def operator_maxima(plan: Plan, gpu: dict[MemoryTerm, float]) -> tuple[float, float]:
    """`buffer_maxima` of the per-operator terms `gpu` has (none grows with the batch: the same for
    the plan at every micro-batch)."""
    operator_terms = frozenset(term for term in MOMENT_TERMS if gpu.get(term)).difference(SEGMENT_TERMS)
    m = plan.model
    tied = bool(m.vocab_size and m.tied_embeddings and not _embedding_is_largest(plan) and MemoryTerm.MSWM in operator_terms)
    compute = COMPUTE_BYTES[plan.precision]
    return buffer_maxima(Window.of(plan, operator_terms, compute,
                                   m.vocab_size * m.hidden_size / plan.model_parallel_degree * compute if tied else 0.0,
                                   largest_unit_params(plan) - operator_params_per_gpu(plan)))


def host_buffers(plan: Plan) -> dict[MemoryTerm, float]:
    """One GPU's share of the host buffers: the staging of the largest shard per state on a staged
    tier (NVMe: runtime/transfer/nvme_store.py) and the runtime's per-operator objects. The runtime
    allocates each once and holds it all iteration (the simulator places them at time 0 too)."""
    place, depth = plan.placement, plan.prefetch_depth
    unit_shard = largest_unit_params(plan) / plan.data_parallel_degree
    cpu: dict[MemoryTerm, float] = {}
    if place.params.staged and "params" in plan.partitioned and not plan.node.host_is_device:
        # Every read in flight to the device holds a pinned slot (runtime/transfer/read_slots.py).
        cpu[MemoryTerm.PARAM_SWAP_BUFFERS] = param_read_slots(plan) * _aligned(unit_shard * COMPUTE_BYTES[plan.precision])
    elif place.params.staged and "params" in plan.partitioned and depth >= 2:
        # Shards read ahead of operator i+1 (i+2, and i+3 at depth 3) wait here (runtime/units/group.py).
        cpu[MemoryTerm.PARAM_SWAP_BUFFERS] = (min(depth, 3) - 1) * _aligned(unit_shard * COMPUTE_BYTES[plan.precision])
    elif plan.node.host_is_device and not params_on_compute_device(plan) and depth >= 3:
        # The cast of an fp32 master shard read 3 operators ahead, held as a host read is
        # (runtime/units/group.py `stage_term`).
        cpu[MemoryTerm.PARAM_SWAP_BUFFERS] = unit_shard * COMPUTE_BYTES[plan.precision]
    if place.optimizer_states.staged:
        cpu[MemoryTerm.OPTIMIZER_SWAP_BUFFERS] = plan.num_optimizer_buffers * optimizer_chunk_buffer_bytes(plan)
    if place.gradients.staged and stores_gradients(plan):
        # The gradients' writes queue behind the parameter reads when both use the one drive.
        buffers = gradient_write_buffers(depth, params_on_nvme=place.params == place.gradients)
        cpu[MemoryTerm.GRADIENT_SWAP_BUFFERS] = buffers * _aligned(unit_shard * STORED_GRADIENT_BYTES)
    elif staged_in_backward(plan):
        cpu[MemoryTerm.GRADIENT_SWAP_BUFFERS] = IN_BACKWARD_STAGED_GRADIENTS * _aligned(
            unit_shard * COMPUTE_BYTES[plan.precision])
    cpu[MemoryTerm.RUNTIME_BOOKKEEPING] = num_operators(plan) * BOOKKEEPING_BYTES_PER_OPERATOR
    if not plan.node.host_is_device and host_state_crosses_link(plan):
        pool = pinned_staging_pool(plan)
        cpu[MemoryTerm.PINNED_STAGING_POOL] = pool.num_buffers * pool.buffer_bytes
    if lands_gradients_pinned(plan):
        cpu[MemoryTerm.GRADIENT_LANDING_BUFFERS] = math.ceil(
            plan.model.num_params / plan.model_parallel_degree * COMPUTE_BYTES[plan.precision]
            / (plan.data_parallel_degree if "gradients" in plan.partitioned else 1))
    return cpu


def logits_bytes(plan: Plan) -> float:
    """The loss's logits and their fp32 gradient on one GPU: live from the output head's forward to
    the end of its backward."""
    m = plan.model
    return plan.micro_batch_per_gpu * m.seq_len * m.vocab_size * (ACTIVATION_BYTES + LOGIT_GRAD_BYTES)


def _over_capacity(peak: dict[Tier, int], capacity: dict[Tier, int], *, host_is_device: bool) -> dict[Tier, int]:
    """tier -> bytes over capacity, for the tiers that do not fit. Where the host is the device, the
    GPU's memory and host memory are one: each is charged the bytes of both."""
    need = dict(peak)
    if host_is_device:
        need[GPU] = need[HOST] = peak[GPU] + peak[HOST]
    return {tier: nbytes - capacity[tier] for tier, nbytes in need.items() if nbytes > capacity[tier]}


def largest_alloc_bytes(plan: Plan) -> int:
    """Largest single GPU allocation: one gathered operator (a whole one without ZeRO-3), or the
    largest activation tensor (the MLP's hidden activations)."""
    m, compute = plan.model, COMPUTE_BYTES[plan.precision]
    largest_activation = plan.micro_batch_per_gpu * m.seq_len * m.ffn_hidden_size * compute / plan.model_parallel_degree
    zero3 = "params" in plan.partitioned
    largest_weight = operator_params_per_gpu(plan) * compute if zero3 else (
        m.largest_operator_params / plan.model_parallel_degree) * compute
    return math.ceil(max(largest_weight, largest_activation))


def runtime_buffer_peak_bytes(bill: MemoryBill) -> dict[Tier, int]:
    """The bill's peak per tier over the terms the runtime's own ledger tracks (`MemoryTerm.ledgered`:
    what a profile's `peak_bytes` measures; on CUDA the allocator's peak is recorded beside it)."""
    return {tier: sum(v for term, v in terms.items() if MemoryTerm(term).ledgered) for tier, terms in bill.terms.items()}


@dataclass(frozen=True, slots=True)
class PinnedPoolShape:
    """The rank's pinned staging pool (runtime/transfer/pinned_pool.py): `num_buffers` of `buffer_bytes`."""

    buffer_bytes: int
    num_buffers: int


def host_state_crosses_link(plan: Plan) -> bool:
    """Whether some pageable host state is copied between host and device memory in a step (on
    hardware whose host is not the device), through the pinned staging pool: parameters read for
    the compute, gradients written off the device, recompute inputs offloaded, or master weights
    written back to device parameters. With `host_pinning: shards` only the masters written back
    are: the rest cross from and to pinned memory of their own (`HostPinning`)."""
    place = plan.placement
    masters_written_back = place.optimizer_states.host_memory and place.params.on_device
    if plan.host_pinning is HostPinning.SHARDS:
        return masters_written_back
    return (place.params == HOST or place.optimizer_states == HOST
            or (place.gradients == HOST and stores_gradients(plan))
            or (place.recompute_inputs == HOST and plan.recompute_interval > 0))


def lands_gradients_pinned(plan: Plan) -> bool:
    """Whether each unit's gradient shard lands off the device in a pinned buffer of its own before
    the host adds it into the fp32 shard (`host_pinning: shards`, gradients stored in host memory,
    on hardware whose host is not the device): the bill's `gradient_landing_buffers`."""
    return (plan.host_pinning is HostPinning.SHARDS and not plan.node.host_is_device
            and plan.placement.gradients.host_memory and stores_gradients(plan))


def param_read_slots(plan: Plan) -> int:
    """Pinned host slots a rank's parameter reads from NVMe land in on their way to a device
    (runtime/transfer/read_slots.py, [Note: pinned read slots]): at a phase start the operator in
    use and the `min(depth, 3)` operators ahead are read at once."""
    return min(plan.prefetch_depth, 3) + 1


def pinned_staging_pool(plan: Plan) -> PinnedPoolShape:
    """[Note: the pinned staging pool] Every host<->device copy of CPU-tier state goes through a few
    reused pinned buffers instead of pinning the state itself (pinned memory the size of the model
    is what runs the host out of memory). A buffer holds the largest unit's shard at the widest
    element a step moves (fp32 gradients and masters), so a unit's transfer is one lease; larger
    transfers (recompute inputs) go through it in pieces. Buffers: one per parameter read in flight ahead
    (the prefetch depth, at least 1) plus a double buffer for the device-to-host direction. The
    runtime sizes its pool with this function, and the bill charges `num_buffers x buffer_bytes`."""
    unit_shard = largest_unit_params(plan) / plan.data_parallel_degree
    return PinnedPoolShape(buffer_bytes=_aligned(unit_shard * STORED_GRADIENT_BYTES),
                           num_buffers=max(plan.prefetch_depth, 1) + WRITE_STAGING_BUFFERS)


WRITE_STAGING_BUFFERS = 2
"""Write staging buffers an NVMe store keeps by default (runtime/transfer/nvme_store.py): a double buffer."""


IN_BACKWARD_QUEUED_UPDATES = 1
"""Updates that wait for the optimizer worker behind the running one (runtime/optim/optimizer_worker.py):
past that the in-backward hook blocks, which bounds the gradients held on the host."""
IN_BACKWARD_STAGED_GRADIENTS = IN_BACKWARD_QUEUED_UPDATES + 1
"""Pinned buffers the in-backward hook copies device gradient shards into when the update runs on the
host (`GradientStaging`): the worker's update(s) and the one being filled; the hook waits for one."""


def schedule_changes_bill(plan: Plan) -> bool:
    """Whether `plan`'s bill depends on its `optimizer_step`: only with the optimizer states on a
    staged tier (NVMe), where stepping in backward stores no gradient (`stores_gradients`) and
    stages each one on the host instead (`staged_in_backward`)."""
    return plan.placement.optimizer_states.staged


def staged_in_backward(plan: Plan) -> bool:
    """In-backward updates on the host from a separate device: each unit's gradient shard is copied
    device-to-host into pinned staging (runtime/optim/step_schedule.py, the streamed NVMe optimizer)."""
    return (plan.optimizer_step == "in_backward" and plan.placement.optimizer_states.staged
            and not plan.node.host_is_device)


def gradient_write_buffers(prefetch_depth: int, *, params_on_nvme: bool) -> int:
    """How many gradient shards a rank stages on their way to NVMe at once (`gradient_swap_buffers`;
    runtime/transfer/nvme_store.py). [Note: gradient write buffers] A gradient's write queues on the drive
    behind the parameter reads submitted before it, which with parameters on NVMe are those of up
    to min(depth, 3) operators ahead; with fewer buffers than those plus the one being filled,
    backward waits for a buffer while the drive is busy and the drive then idles while backward
    computes. More buffers than that buy nothing for their memory
    (docs/notes/2026-11-23-nvme-queue-depth.md, "Kept: four gradient write buffers")."""
    return max(WRITE_STAGING_BUFFERS, min(prefetch_depth, 3) + 1) if params_on_nvme else WRITE_STAGING_BUFFERS


OPTIMIZER_CHUNK_REGIONS = 4
"""fp32 regions of a streamed optimizer chunk buffer: master, exp_avg, exp_avg_sq, gradient."""
CHUNK_ALIGN_NUMEL = 1024
"""fp32 elements per 4 KiB: chunk boundaries at multiples of this keep direct I/O aligned."""


def optimizer_chunk_numel(chunk_bytes: int) -> int:
    """Elements per streamed optimizer chunk: the four fp32 regions fit one buffer of `chunk_bytes`,
    a multiple of 1024 (4 KiB alignment) where it is at least that."""
    numel = chunk_bytes // (OPTIMIZER_CHUNK_REGIONS * 4)
    if numel >= CHUNK_ALIGN_NUMEL:
        numel -= numel % CHUNK_ALIGN_NUMEL
    return numel


def optimizer_chunk_buffer_bytes(plan: Plan) -> int:
    """One buffer of the streamed optimizer: four fp32 regions (master, momentum, variance,
    gradient) of `optimizer_chunk_numel` elements each."""
    return OPTIMIZER_CHUNK_REGIONS * 4 * optimizer_chunk_numel(plan.optimizer_chunk_bytes)


def _aligned(nbytes: float) -> int:
    """Direct I/O rounds every staged write up to 4 KiB."""
    return round_up_4kib(math.ceil(nbytes))


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
        "recompute_inputs_per_gpu": recompute_input_bytes(plan, ACTIVATION_BYTES),
        "activations_per_gpu": recompute_input_bytes(plan, ACTIVATION_BYTES) + eq5_activation_bytes(plan),
        "mswm_per_gpu": math.ceil(m.largest_operator_params * (per_param["params"] + per_param["gradients"])),
        "awm_per_gpu": eq5_activation_bytes(plan),
    }
