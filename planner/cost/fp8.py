"""fp8 matmuls (Transformer Engine, torchao Float8 linears): the linears' rate on GPUs that have one,
and the casts that make their fp8 operands.

[Note: fp8 matmuls] A plan with `fp8_matmuls` runs every block linear's matmul (forward and both
backward matmuls) in fp8 at the GPU's fp8 tensor-core rate; everything else keeps the plan's
`precision`: the output head (Megatron-Core's `output_layer` is not a Transformer Engine module;
torchtitan's float8 converter skips `output`, its `filter_fqns` default), the attention core (QK^T
and softmax V, bf16 in the flash kernels these runs use), the memory-bound kernels, the stored
weights, gradients, activations and every transfer. The achievable
fp8 rate is the spec's `fp8_matmul_tflops` where it states one (the fitted H100/H200 presets: the
share of the fp8 datasheet peak the published fp8 runs sustain, fitted like the bf16 plateau,
planner/validation/fit.py), else the achievable bf16 rate times the datasheet's fp8 / bf16 ratio;
the efficiency curve keeps its shape (no public source gives a separate fp8 curve). Only GPUs
listed here, or specs that state an fp8 rate, have one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.stack import Fp8Recipe

if TYPE_CHECKING:
    from planner.specs.plan import Plan

FP8_DENSE_TFLOPS: dict[str, tuple[float, float, str]] = {
    "dgx-h100": (1979.0, 989.0, "NVIDIA H100 Tensor Core GPU datasheet, H100 SXM: FP8 3,958 and BF16 1,979 "
                                "teraFLOPS with sparsity, half of each dense"),
    "h200-x1": (1979.0, 989.0, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: FP8 3,958 and BF16 1,979 "
                               "teraFLOPS with sparsity, half of each dense"),
    "hgx-h200": (1979.0, 989.0, "NVIDIA H200 Tensor Core GPU datasheet, H200 SXM: FP8 3,958 and BF16 1,979 "
                                "teraFLOPS with sparsity, half of each dense"),
}
"""Hardware preset -> (dense fp8 TFLOPS, dense bf16 TFLOPS, source) per GPU."""


def _preset_of(node: NodeSpec) -> str:
    """The preset a node came from (a row's variant keeps the preset's name before ' (')."""
    return node.name.split(" (")[0]


def fp8_speedup(node: NodeSpec) -> float:
    """How much faster a linear's matmul runs in fp8 than in bf16 on `node`: its sustained fp8 rate
    over its bf16 one where the spec states it (`fp8_matmul_flops_per_s`), else the datasheet ratio."""
    if node.fp8_matmul_flops_per_s:
        return node.fp8_matmul_flops_per_s / node.gpu_flops_per_s
    entry = FP8_DENSE_TFLOPS.get(_preset_of(node))
    if entry is None:
        raise PlannerError(f"fp8_matmuls: hardware {node.name!r} has no fp8 matmul rate in the planner "
                           f"(known: {', '.join(FP8_DENSE_TFLOPS)}); use fp8_matmuls false")
    fp8, bf16, _ = entry
    return fp8 / bf16


def linear_speedup(fp8_matmuls: bool, node: NodeSpec) -> float:
    """1 without fp8, else `fp8_speedup(node)`."""
    return fp8_speedup(node) if fp8_matmuls else 1.0


# [Note: fp8 casts] An fp8 matmul needs its operands in fp8 with a scale, in the layout the tensor
# cores read (H100's fp8 GEMM takes A row-major and B column-major, so the weight-gradient and
# input-gradient matmuls need transposed copies). Making them is memory-bound work at the achievable
# HBM bandwidth, priced per element of each operand of a block's linears (`CastBytes`; `e` = 2 bytes
# of the 16-bit tensor, 1 byte per fp8 element written):
# - Transformer Engine, delayed scaling (`TE_DELAYED`; Micikevicius et al. 2022, "FP8 Formats for
#   Deep Learning", arXiv:2209.05433; Transformer Engine's `DelayedScaling` recipe): the scale comes
#   from the amax history, and the kernel that writes a tensor records its amax, so no tensor is read
#   for its amax. The layernorm of a LayerNormLinear (Megatron-Core's qkv and fc1) writes fp8 instead
#   of 16-bit, and the weight-gradient matmul's transposed copy is one fp8 read and write: net +1 byte
#   per element of those inputs. Every other input (the attention output into the projection, the
#   activation into fc2) and every output gradient goes through one cast-transpose kernel: read e,
#   write the fp8 tensor and its transpose (e + 2 = 4). Weights are cast-transposed once per
#   optimizer step (4 per element over the step's micro-batches: `is_first_microbatch` keeps the fp8
#   copy for the others).
# - Transformer Engine, current scaling (`TE_CURRENT`, `Float8CurrentScaling`): the scale is the
#   tensor's own amax, so every cast first reads its tensor for the amax (e) and then cast-transposes
#   it (e + 2): 6 per element of every input, output gradient and (once per step) weight; the
#   layernorm writes 16-bit output, which it does without fp8.
# - torchao Float8Linear, dynamic tensorwise scaling (`TORCHAO_TENSORWISE`, torchao/float8/
#   float8_linear.py `matmul_with_hp_or_float8_args`, as torchtitan's `float8` converter uses it):
#   each cast is an amax pass (read e) and a cast pass (read e, write 1): 5 per element. The forward
#   casts the input and the weight; the autograd function saves the 16-bit input and weight and
#   casts both again in backward (5 + 5 each), in the layout its matmul needs; the output gradient is
#   cast once with both layouts written (e + e + 2 = 6). torch.compile's common-subexpression pass
#   merges the identical casts of one input shared by several linears (wq/wk/wv, w1/w3), so each
#   distinct input is cast once. Weights are cast every micro-batch.
# - torchao rowwise scaling (`TORCHAO_ROWWISE`): a scale per row along the contracted axis, so the
#   backward casts the output gradient along each axis (5 + 5) as it does the input and the weight.
# The elements, per GPU and micro-batch, follow [Note: memory-bound kernels] in
# planner/cost/kernels.py, per GPU and micro-batch: the output gradients of the row-parallel linears
# (projection, down) are the residual stream, whole on every tensor-parallel rank; the inputs of the
# column-parallel ones (qkv, the MLP's up and gate) are cast on the GPU's 1 / mp share of the tokens
# before the sequence-parallel all-gather, which then moves fp8 (Transformer Engine's LayerNormLinear
# with `sequence_parallel`; torchtitan's `PrepareFloat8ModuleInput`); the other inputs and outputs
# are split 1 / mp; weights are the GPU's 1 / mp slice.
# A full recompute repeats the forward's casts.
#
# Casting before the sequence-parallel gather makes that gather fp8: a forward tensor-parallel
# all-reduce (a reduce-scatter of the row-parallel output, 16-bit, then the all-gather of the next
# column-parallel input) moves `(e + 1) / 2e` = 3/4 of its 16-bit bytes (`tensor_parallel_byte_share`).
# The backward's collectives move 16-bit gradients (the gathered output gradient is cast after the
# gather). Not priced: FSDP2's fp8 weight all-gather (torchtitan's `enable_fsdp_float8_all_gather`,
# which casts the shard before the gather and halves the gather's bytes), and any difference in the
# fp8 GEMM's own speed between per-tensor and per-row scales.
@dataclass(frozen=True, kw_only=True, slots=True)
class CastBytes:
    """HBM bytes per element that a recipe's casts move for one micro-batch ([Note: fp8 casts])."""

    normed_input: float
    """Forward, per element of an input a layernorm produces (qkv's, the MLP's)."""
    other_input: float
    """Forward, per element of the other inputs (the projection's, the down projection's)."""
    input_backward: float
    """Backward, per element of every distinct input (a recast from the saved 16-bit tensor)."""
    grad_output: float
    """Backward, per element of every linear's output gradient."""
    weight_forward: float
    """Per weight element, forward."""
    weight_backward: float
    """Per weight element, backward (a recast from the saved 16-bit weight)."""
    weight_once_per_step: bool
    """The fp8 weight is kept over the step's micro-batches (cast once per optimizer step)."""


CAST_BYTES: dict[Fp8Recipe, CastBytes] = {
    Fp8Recipe.TE_DELAYED: CastBytes(normed_input=1, other_input=4, input_backward=0, grad_output=4, weight_forward=4,
                                    weight_backward=0, weight_once_per_step=True),
    Fp8Recipe.TE_CURRENT: CastBytes(normed_input=6, other_input=6, input_backward=0, grad_output=6, weight_forward=6,
                                    weight_backward=0, weight_once_per_step=True),
    Fp8Recipe.TORCHAO_TENSORWISE: CastBytes(normed_input=5, other_input=5, input_backward=5, grad_output=6,
                                            weight_forward=5, weight_backward=5, weight_once_per_step=False),
    Fp8Recipe.TORCHAO_ROWWISE: CastBytes(normed_input=5, other_input=5, input_backward=5, grad_output=10,
                                         weight_forward=5, weight_backward=5, weight_once_per_step=False),
}
"""Each recipe's cast traffic ([Note: fp8 casts]); the derivation of every number is in the note."""


def cast_bytes(plan: Plan) -> tuple[float, float]:
    """(forward, backward) HBM bytes of one block's fp8 casts on one GPU for one micro-batch ([Note:
    fp8 casts]); (0, 0) without fp8 matmuls."""
    if not plan.fp8_matmuls:
        return 0.0, 0.0
    cost, m, mp = CAST_BYTES[plan.fp8_recipe], plan.model, plan.model_parallel_degree
    tokens = plan.micro_batch_per_gpu * m.seq_len
    stream = tokens * mp * m.hidden_size  # whole on every tensor-parallel rank
    normed = 2 * tokens * m.hidden_size  # qkv's input and the MLP's (shared by up and gate), cast before the gather
    other = tokens * (m.q_size + m.ffn_hidden_size)  # the projection's and down's inputs, 1 / mp
    column_outputs = tokens * (m.q_size + 2 * m.kv_size + (2 if m.gated_mlp else 1) * m.ffn_hidden_size)
    grad_outputs = column_outputs + 2 * stream  # + the projection's and down's, whole per rank
    weights = sum(op.num_params for op in m.block_operators()) / mp
    if cost.weight_once_per_step:
        weights /= plan.micro_batches_per_step
    forward = cost.normed_input * normed + cost.other_input * other + cost.weight_forward * weights
    backward = cost.input_backward * (normed + other) + cost.grad_output * grad_outputs + cost.weight_backward * weights
    return forward, backward


FP8_GATHERED_ALL_REDUCE_SHARE = (2 + 1) / (2 * 2)
"""A forward tensor-parallel all-reduce's bytes with its all-gather half in fp8 (1 byte) and its
reduce-scatter half 16-bit (2 bytes), over both halves 16-bit ([Note: fp8 casts])."""


def tensor_parallel_byte_share(plan: Plan, backward: bool) -> float:
    """The share of a tensor-parallel all-reduce's 16-bit bytes that `plan` moves: 3/4 in a forward
    (or recompute) pass with fp8 matmuls, else 1 ([Note: fp8 casts])."""
    return FP8_GATHERED_ALL_REDUCE_SHARE if plan.fp8_matmuls and not backward else 1.0
