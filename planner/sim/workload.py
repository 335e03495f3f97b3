"""What one rank does in one iteration: the operator trace and the per-rank size of every transfer.

The trace is the order the runtime's prefetcher records on its first iteration (docs/method.md §4.3):
the embedding (when the model has one), every block's linears in execution order
(`ModelSpec.block_operators()`), the output head; then, per recompute segment from the last to the
first, the segment's recompute (forward again) and its backward in reverse. Every step gathers its
operator's parameters again, which is why eq. 9 reads parameters three times.

[Note: rank shares] With `N` GPUs, model-parallel degree `mp` (Megatron tensor parallel inside a
node) and data-parallel degree `dp = N / mp`:
- a linear of `P` weights is split into `mp` column/row slices of `P / mp`; each slice is
  partitioned over its `dp` group, so a rank owns `P / N` weights and gathers `P / mp`;
- a model replica (one tensor-parallel group) processes `batch_per_gpu * mp` samples, and each of
  its GPUs does `1 / mp` of the replica's matmul flops: `2 * batch_per_gpu * seq * P` per linear
  forward (eq. 7), twice that backward;
- the Megatron all-reduces (after the attention output and the MLP down projection, forward and
  backward) carry the replica's `batch_per_gpu * mp * seq * hd` activations;
- recompute inputs are partitioned over the tensor-parallel group (DeepSpeed's
  `partition_activations`), so a GPU holds eq. 3 with its own `batch_per_gpu`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from planner.cost.kernels import block_cost, loss_bytes
from planner.cost.memory import (
    ACTIVATION_BYTES,
    BYTES_PER_PARAM,
    block_activation_bytes,
    recompute_working_bytes,
)
from planner.specs.phases import Phase
from planner.specs.plan import Plan

_TP_ALL_REDUCE_AFTER = frozenset({"attn_out", "mlp_down"})


@dataclass(frozen=True, slots=True)
class OpShape:
    """One operator (or one tile of it) as a rank sees it."""

    name: str
    num_params: int
    """Weights of the whole operator tile (all ranks, all tensor-parallel slices)."""
    flops_per_gpu: float
    """Forward matmul flops one GPU executes for it."""
    tp_all_reduce: bool
    """A Megatron all-reduce follows it (last tile of attn_out / mlp_down, mp > 1)."""
    has_grads: bool = True
    """False for a tied output head: its gradient lands in the embedding's and is reduced there."""
    elementwise_bytes: float = 0.0
    """Bytes its share of the block's memory-bound kernels (norms, activation function, residual
    adds, rotary, dropout, the eager softmax; the loss for the head) reads and writes in the forward
    pass (and a recompute), per GPU: timed at the achievable HBM bandwidth ([Note: elementwise work])."""
    backward_elementwise_bytes: float = 0.0
    """The same kernels' bytes in the backward pass."""
    extra_backward_flops: float = 0.0
    """Backward matmul flops beyond twice the forward's (selective recompute redoes eager's QK^T;
    `every_nth_block` and `op_level` redo linears inside the backward), on attn_out's first tile."""
    fused_flops: float = 0.0
    """Flops of the fused (flash) attention kernel, timed at its own rate, on attn_out's first tile."""
    fused_backward_flops: float = 0.0
    """The fused attention kernel's backward (2.5 x its forward: it recomputes the scores)."""


@dataclass(slots=True)
class Step:
    """One entry of the trace (not frozen: a 1T trace has ~10^5 of them and frozen init is slow)."""

    index: int
    phase: Phase
    op: OpShape
    block: int
    """Transformer block, -1 for the embedding, num_layers for the head."""
    segment: int
    """Recompute segment of the block; -1 outside the recomputed blocks."""


def step_elementwise_bytes(step: Step) -> float:
    """Memory-bound bytes a trace step moves: its operator's share of the forward's kernels, or of
    the backward's ([Note: elementwise work])."""
    return step.op.backward_elementwise_bytes if step.phase is Phase.BACKWARD else step.op.elementwise_bytes


def step_fused_flops(step: Step) -> float:
    """Fused attention flops a trace step executes (planner/cost/kernels.py [Note: attention kernels])."""
    return step.op.fused_backward_flops if step.phase is Phase.BACKWARD else step.op.fused_flops


def step_flops(step: Step) -> float:
    """Matmul flops a trace step executes: the forward's (again in a recompute), or in backward the
    input and weight gradients, each a forward-sized matmul, plus the attention core's extra."""
    if step.phase is Phase.BACKWARD:
        return 2 * step.op.flops_per_gpu + step.op.extra_backward_flops
    return step.op.flops_per_gpu


@dataclass(frozen=True, slots=True)
class Workload:
    plan: Plan
    steps: tuple[Step, ...]
    num_segments: int
    param_bytes: int
    """Bytes per half-precision (or fp32) parameter and gradient element (memory.BYTES_PER_PARAM)."""
    optimizer_state_bytes: int
    """Optimizer-state bytes per parameter: 16 in mixed precision (eq. 2; read and written once, eq. 10)."""
    tokens_per_gpu: float
    recompute_input_bytes: float
    """One recompute input (one block input), per GPU (eq. 3 per recompute segment)."""
    block_activation_bytes: float
    """Activations of one block while it runs with gradients (eq. 5 with ci = 1, the attention core
    as the plan keeps it: memory.block_activation_bytes), per GPU."""
    recompute_working_bytes: float
    """What a block makes again for its backward and frees after it (selective recompute's eager
    scores, what `every_nth_block` or `op_level` recomputes: memory.recompute_working_bytes), per GPU."""
    tp_all_reduce_bytes: float
    """Activation tensor of one Megatron all-reduce (whole replica batch)."""
    params_per_rank: float
    """Parameters whose optimizer state one rank updates."""
    step_model_params: int
    """The model's parameters the step updates: what ZeRO-1/2 gathers back after it. A sample of a
    deeper model (planner/sim/samples.py) keeps the real model's, as it keeps `params_per_rank`."""


def build_workload(plan: Plan) -> Workload:
    model, mp = plan.model, plan.model_parallel_degree
    b = BYTES_PER_PARAM[plan.precision]["params"]
    bsz, seq, hd = plan.micro_batch_per_gpu, model.seq_len, model.hidden_size
    tokens = bsz * seq
    tiles = plan.tiling_factor

    def linear(name: str, num_params: int, *, has_grads: bool = True) -> list[OpShape]:
        flops = 2 * tokens * num_params
        n = tiles if num_params >= tiles else 1
        return [OpShape(name=name if n == 1 else f"{name}[{t}]", num_params=num_params // n,
                        flops_per_gpu=flops / n,
                        tp_all_reduce=mp > 1 and name in _TP_ALL_REDUCE_AFTER and t == n - 1,
                        has_grads=has_grads)
                for t in range(n)]

    block_ops = _block_ops(plan, linear)

    embedding = head = ()
    if model.vocab_size > 0:
        rows = model.vocab_size * hd
        # An embedding lookup moves rows, it does not multiply: no matmul flops.
        embedding = (OpShape(name="embedding", num_params=rows, flops_per_gpu=0.0, tp_all_reduce=False),)
        loss_fwd, loss_bwd = loss_bytes(plan)
        head_tiles = linear("lm_head", rows, has_grads=not model.tied_embeddings)
        head = tuple(dataclasses.replace(op, elementwise_bytes=loss_fwd / len(head_tiles),
                                         backward_elementwise_bytes=loss_bwd / len(head_tiles)) for op in head_tiles)

    ci = plan.recompute_interval
    layers = model.num_layers
    segment_of = (lambda blk: blk // ci) if ci else (lambda blk: 0)
    num_segments = math.ceil(layers / ci) if ci else 1

    raw: list[tuple[Phase, OpShape, int]] = [(Phase.FORWARD, op, -1) for op in embedding]
    for blk in range(layers):
        raw += [(Phase.FORWARD, op, blk) for op in block_ops]
    raw += [(Phase.FORWARD, op, layers) for op in head]
    raw += [(Phase.BACKWARD, op, layers) for op in reversed(head)]
    for seg in reversed(range(num_segments)):
        blocks = [blk for blk in range(layers) if segment_of(blk) == seg]
        if ci:
            raw += [(Phase.RECOMPUTE, op, blk) for blk in blocks for op in block_ops]
        raw += [(Phase.BACKWARD, op, blk) for blk in reversed(blocks) for op in reversed(block_ops)]
    raw += [(Phase.BACKWARD, op, -1) for op in embedding]
    steps = tuple(Step(index=i, phase=phase, op=op, block=blk, segment=segment_of(blk) if 0 <= blk < layers else -1)
                  for i, (phase, op, blk) in enumerate(raw))

    return Workload(
        plan=plan,
        steps=steps,
        num_segments=num_segments,
        param_bytes=b,
        optimizer_state_bytes=BYTES_PER_PARAM[plan.precision]["optimizer_states"],
        tokens_per_gpu=tokens,
        recompute_input_bytes=ACTIVATION_BYTES * bsz * seq * hd,
        block_activation_bytes=block_activation_bytes(plan),
        recompute_working_bytes=recompute_working_bytes(plan),
        tp_all_reduce_bytes=b * bsz * mp * seq * hd,
        params_per_rank=optimizer_params_per_rank(plan),
        step_model_params=plan.model.num_params,
    )


def _block_ops(plan: Plan, linear: Callable[[str, int], list[OpShape]]) -> list[OpShape]:
    """One block's operators (each linear's tiles) with the block's other work attached."""
    # The attention core (QK^T, softmax(.)V) has no weights and runs between qkv and attn_out: its
    # flops are folded into attn_out's first tile. The block's memory-bound kernels are spread
    # evenly over its operators (planner/cost/kernels.py, [Note: elementwise work] below).
    cost = block_cost(plan)
    again = cost.recompute_linear_flops / cost.linear_flops if cost.linear_flops else 0.0
    block_ops: list[OpShape] = []
    for op in plan.model.block_operators():
        # A recompute inside the backward (every_nth_block, op_level) runs the linears again: spread
        # over every linear by its flops, so fp8 times them at its rate as the estimate does.
        shapes = [dataclasses.replace(s, extra_backward_flops=again * s.flops_per_gpu) if again else s
                  for s in linear(op.name, op.num_params)]
        if op.name == "attn_out":
            matmul_fwd = cost.matmul_forward_flops - cost.linear_flops
            matmul_bwd = cost.matmul_backward_flops - (2 * cost.linear_flops + cost.recompute_linear_flops)
            shapes[0] = dataclasses.replace(
                shapes[0], flops_per_gpu=shapes[0].flops_per_gpu + matmul_fwd,
                extra_backward_flops=shapes[0].extra_backward_flops + matmul_bwd - 2 * matmul_fwd,
                fused_flops=cost.fused_forward_flops, fused_backward_flops=cost.fused_backward_flops)
        block_ops += shapes
    # [Note: elementwise work] Besides its matmuls a block runs memory-bound kernels (norms, the
    # activation function, residual adds, rotary, dropout, the eager softmax): planner/cost/kernels.py
    # [Note: memory-bound kernels] counts their bytes per kernel and pass. On a GPU they are a few
    # percent of a large model's block time and a fifth of a small one's; on a CPU they run 20-50x
    # below copy bandwidth, and calibration finds their rate (planner/calibration/calibrate.py; `planner probe`
    # does on reference runs, planner/calibration/probe_reference.py).
    n = len(block_ops)
    block_ops = [dataclasses.replace(op, elementwise_bytes=cost.forward_bytes / n,
                                     backward_elementwise_bytes=cost.backward_bytes / n) for op in block_ops]
    return block_ops


def optimizer_params_per_rank(plan: Plan) -> float:
    """Parameters whose optimizer state one rank updates (its partition, or its tensor-parallel slice)."""
    share = plan.num_gpus if "optimizer_states" in plan.partitioned else plan.model_parallel_degree
    return plan.model.num_params / share


# [Note: the forward's tail stays gathered, simulated] The backward's first operators are the
# forward's last ones in reverse, and the runtime keeps a unit gathered from its last forward use to
# its backward use when it is `q` operators into the backward's first window (q <= the prefetch
# depth) and `r <= q` operators before the forward's end, unless a rider's use comes next in the
# forward (runtime/units/prefetch.py [Note: the forward's tail is the backward's head]). The trace
# has no riders (norms ride with the operator before them), but every model's final norm runs right
# after its last block, so the last block's last operator is resharded. Such a unit is neither
# released after its forward nor read again for its backward: on the recorded H200 runs the
# runtime read exactly the bytes this leaves (docs/notes/2026-11-28-offload-prediction-h200-second-lease.md).
def forward_tail_kept(steps: tuple[Step, ...], depth: int, num_layers: int) -> dict[int, int]:
    """The forward steps whose parameters stay gathered for the backward -> their backward step
    ([Note: the forward's tail stays gathered, simulated])."""
    forward = [s for s in steps if s.phase is Phase.FORWARD]
    after = steps[len(forward):]
    if depth <= 0 or not forward or not after:
        return {}
    blocks_end = max((s.index for s in forward if 0 <= s.block < num_layers), default=-1)
    window = {(id(s.op), s.block): s.index for s in after[: depth + 1] if s.phase is Phase.BACKWARD}
    kept: dict[int, int] = {}
    for r, step in enumerate(reversed(forward[-(depth + 1):])):  # r <= q <= depth
        backward = window.get((id(step.op), step.block))
        if backward is not None and r <= backward - after[0].index and step.index != blocks_end:
            kept[step.index] = backward
    return kept
