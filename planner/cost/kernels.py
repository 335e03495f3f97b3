"""What one transformer block costs a GPU besides its linears: the attention core's matmuls and the
memory-bound kernels, forward, backward and recompute (docs/planner.md, "Per-block compute").

Both the analytic estimate (planner/cost/throughput.py) and the simulator's operator trace
(planner/sim/workload.py) take their block costs from here, so they agree on every term. The
reasoning is in the notes beside the code: [Note: attention kernels] and [Note: recompute] above
`attention_flops`, [Note: memory-bound kernels] above `kernel_bytes`, [Note: the fused kernel's rate
by sequence length] above `fused_attention_flops_per_s`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner.cost.fp8 import cast_bytes
from planner.specs.units import COMPUTE_BYTES

if TYPE_CHECKING:
    from planner.specs.hardware import NodeSpec
    from planner.specs.plan import Plan

HBM_ACHIEVABLE_FRACTION = 0.83
"""Share of the datasheet HBM bandwidth a streaming kernel reaches: the published 750 of 900 GB/s of
a V100 (Jia, Maggioni, Staiger, Scarpazza, "Dissecting the NVIDIA Volta GPU Architecture via
Microbenchmarking", arXiv:1804.06826, 2018, global-memory throughput). A device copy on an H200
reaches a larger share (the measurement in data/hardware/h200-x1.json's notes), so 0.83 is the
conservative end of what STREAM-like copies reach. Not fitted to any training run."""
DROPOUT_MASK_BYTES = 1
LOSS_FORWARD_FP32_BYTES = 8
"""fp32 bytes per logit the loss moves forward beyond reading the e-byte logits: writes the fp32
copy (4) and reads it (4)."""
LOSS_BACKWARD_FP32_BYTES = 8
"""fp32 bytes per logit backward: writes the fp32 gradient (4) and reads it (4), then writes e."""
EAGER_PRODUCT_SCORE_PASSES_FORWARD = 2
"""seq^2 passes of eager attention's products forward: `QK^T` writes the scores, `P V` reads P."""
EAGER_PRODUCT_SCORE_PASSES_BACKWARD = 4
"""seq^2 passes backward: dP written (`dO V^T`), P read (`P^T dO`), dS read twice (`dS K`, `dS^T Q`)."""
FLASH_BACKWARD_FACTOR = 2.5
"""FlashAttention-2's backward over its forward: 5 matmuls of 2 (it recomputes `QK^T`)."""
FLASH_STATS_BYTES_PER_HEAD = 4
"""One fp32 log-sum-exp per head and token, what a flash forward keeps for its backward."""


def achievable_hbm_bytes_per_s(node: NodeSpec) -> float:
    """The rate memory-bound kernels stream at: the preset's HBM bandwidth x its fitted
    `hbm_achievable_fraction`, or HBM_ACHIEVABLE_FRACTION where it has none."""
    return node.gpu_hbm_bytes_per_s * (node.hbm_achievable_fraction or HBM_ACHIEVABLE_FRACTION)


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockCost:
    """One block's work on one GPU for one micro-batch: matmul flops (linears and attention core) and
    memory-bound kernel bytes, per pass."""

    linear_flops: float
    """Forward flops of the block's linears (`2 x tokens x weights`, the GPU's tensor-parallel slice)."""
    attention_forward_flops: float
    attention_backward_flops: float
    """The attention core's backward (and, with selective recompute under eager, its forward again)."""
    kernel_forward_bytes: dict[str, float]
    kernel_backward_bytes: dict[str, float]
    """Per kernel ([Note: memory-bound kernels]); the backward's include a selective recompute's, and
    an `every_nth_block` or `op_level` recompute's as the kernel "recompute"."""
    recompute_linear_flops: float = 0.0
    """Forward flops of the linears an `every_nth_block` or `op_level` recompute runs again inside the
    block's backward ([Note: recompute]), averaged over the blocks."""

    fused_attention: bool
    """The attention core is one fused kernel (flash), timed at its own rate, not at the matmul rate."""

    @property
    def matmul_forward_flops(self) -> float:
        """Flops timed at the matmul rate: the linears, and eager attention's two products."""
        return self.linear_flops + (0.0 if self.fused_attention else self.attention_forward_flops)

    @property
    def matmul_backward_flops(self) -> float:
        """Input and weight gradients of every linear (twice its forward), the linears a recompute runs
        again inside the backward, and eager attention's."""
        return (2 * self.linear_flops + self.recompute_linear_flops
                + (0.0 if self.fused_attention else self.attention_backward_flops))

    @property
    def fused_forward_flops(self) -> float:
        """Flops timed at the fused attention kernel's rate (`NodeSpec.flash_attention_flops_per_s`)."""
        return self.attention_forward_flops if self.fused_attention else 0.0

    @property
    def fused_backward_flops(self) -> float:
        return self.attention_backward_flops if self.fused_attention else 0.0

    @property
    def forward_bytes(self) -> float:
        return sum(self.kernel_forward_bytes.values())

    @property
    def backward_bytes(self) -> float:
        return sum(self.kernel_backward_bytes.values())


# [Note: the fused kernel's rate by sequence length] A causal fused kernel walks the key sequence in
# blocks and computes the block the diagonal cuts through whole, masking the part above it: the flops
# counted here (half the square) are a smaller share of what it computes when the sequence is short.
# FlashAttention-2's own measurements rise with the sequence the same way (Dao 2023, Fig. 4-7: causal
# forward and backward at 512 tokens well below those at 4K-16K). torch's CPU flash kernel computes
# key blocks of up to 512, so up to 512 tokens a causal call costs a non-causal one and beyond it
# less (runtime/probe.py [Note: the CPU's fused attention]). The spec's
# `attention_efficiency` curve, keyed by the query length of one kernel call, scales the kernel's
# rate (`fused_attention_flops_per_s`); the probe measures it, the GPU presets have none (no public
# curve for the fitted rate: flat).
def fused_attention_flops_per_s(plan: Plan) -> float:
    """The fused attention kernel's rate for `plan`'s kernel calls ([Note: the fused kernel's rate by
    sequence length]): each covers `seq / context_parallel_degree` queries (ring attention's blocks)."""
    node = plan.node
    return node.flash_attention_flops_per_s * node.attention_efficiency.at(
        plan.model.seq_len / plan.context_parallel_degree)


def block_cost(plan: Plan) -> BlockCost:
    """The block costs of `plan` ([Note: attention kernels], [Note: memory-bound kernels])."""
    m = plan.model
    tokens = plan.micro_batch_per_gpu * m.seq_len
    linear = 2 * tokens * sum(op.num_params for op in m.block_operators())  # bsz/GPU x all weights = replica's / mp
    attn_fwd, attn_bwd = attention_flops(plan)
    fwd, bwd = kernel_bytes(plan)
    return BlockCost(linear_flops=linear, attention_forward_flops=attn_fwd, attention_backward_flops=attn_bwd,
                     kernel_forward_bytes=fwd, kernel_backward_bytes=bwd, fused_attention=plan.attention == "flash",
                     recompute_linear_flops=recomputed_linear_share(plan) * linear)


# [Note: attention kernels] `attention: eager` is the paper's and Megatron-LM's attention: the
# scores `QK^T` (bsz x heads x seq x seq) are written to memory, softmaxed (and dropped out) by
# memory-bound kernels, stored for the backward (eq. 5's `2 heads seq` bytes per token) and
# multiplied by V; both matmuls cover the whole seq x seq square, the causal mask only zeroes half.
# `attention: flash` (FlashAttention-2, Dao 2023, arXiv:2307.08691) fuses scores, mask, softmax,
# dropout and the product with V in one kernel that keeps the scores on chip: no seq^2 bytes move or
# stay, it skips the masked half of a causal square, and its backward recomputes the scores
# (5 matmuls of the forward's 2: 2.5 x the forward's flops, Sec. 3.1.2 of that paper). Only the
# softmax statistics (one fp32 log-sum-exp per head and token) are kept for the backward. The fused
# kernel runs at its own published rate (`NodeSpec.flash_attention_flops_per_s`), not the matmul
# rate: FlashAttention-2 reaches 50-73 % of the A100's 312 TFLOPS (Dao 2023, abstract; the presets
# take the low end, 156 TFLOPS, since its backward, the larger part of the training flops, is the
# slower pass) and only 35 % of the H100's 989 on Hopper (Shah et al. 2024, FlashAttention-3,
# arXiv:2407.08608, abstract: 346 TFLOPS, and the same on the H200, whose SMs and clocks are the
# H100's); the presets' rate is FlashAttention-2's, fitted from that prior, and a published run on
# the first FlashAttention runs at half of it (planner/validation/flash_kernels.py [Note:
# FlashAttention generations]). Eager attention's two products are batched matmuls at the matmul rate.
#
# [Note: recompute] `recompute: full` (recompute_interval >= 1) runs each block's forward again in
# backward: its flops and kernel bytes once more. `recompute: selective` (Korthikanti et al. 2022,
# arXiv:2205.05198 Sec. 5) stores every activation but the attention core's seq^2 tensors and
# recomputes the core in backward: "the QK^T matrix multiply, softmax, softmax dropout, and attention
# over V operations" (Megatron-LM checkpoints its `CoreAttention` module whole, so its backward first
# runs that module's forward again), i.e. under eager both products, the softmax and the attention
# dropout run twice; under flash nothing is added (its backward recomputes the scores anyway, and
# it stores none), so selective recompute is no recompute there.
# Two more kinds are torchtitan's activation checkpointing (`apply_ac` in
# torchtitan/models/llama*/parallelize*.py; its `activation_checkpoint` config's `mode = "selective"`):
# - `every_nth_block` ("selective layer", `selective_ac_option` = N): torchtitan wraps block k (counting
#   from 1) in full checkpointing when k is a multiple of N, so `floor(L / N)` of the `L` blocks keep only
#   their input and run their whole forward again inside their own backward (its flops, fused attention
#   and kernel bytes once more), while the others keep every activation. Priced per block as the
#   average over the blocks (`recomputed_block_share`), so every block of the trace costs the same.
# - `op_level` ("selective op"): each block is checkpointed with a policy that saves the outputs of
#   the attention kernel and of every other matmul (the 1st, 3rd, ... `mm` of the block; the 2nd, 4th,
#   ... are recomputed) and recomputes everything else. In a Llama block's order (wq, wk, wv, wo, w1,
#   w3, w2) that recomputes wk, wo and w3 and every elementwise kernel (norms, rotary, activation,
#   residual adds), and keeps the block input, the outputs of wq, wv, w1 and w2 and the attention
#   output (`op_level_matmuls`). The attention core itself is not run again.
# Both recompute inside the block's backward (no recompute segments: `recompute_interval` 0), and a
# fully sharded run gathers the block's parameters once for both (the recompute runs after the
# backward's gather).
def recomputed_block_share(plan: Plan) -> float:
    """`every_nth_block`: the share of blocks recomputed whole (`floor(L / N) / L`); 0 otherwise."""
    if plan.recompute != "every_nth_block":
        return 0.0
    layers = plan.model.num_layers
    return (layers // plan.recompute_block_period) / layers


def op_level_matmuls(plan: Plan) -> tuple[tuple[int, int, bool], ...]:
    """One block's matmuls in torchtitan's execution order, unfused (wq, wk, wv, wo, w1, [w3], w2):
    (weights, output width, saved by `op_level`: the 1st, 3rd, ... [Note: recompute])."""
    m = plan.model
    hd, q, kv, ffn = m.hidden_size, m.q_size, m.kv_size, m.ffn_hidden_size
    shapes = [(hd * q, q), (hd * kv, kv), (hd * kv, kv), (q * hd, hd), (hd * ffn, ffn)]
    shapes += [(hd * ffn, ffn)] if m.gated_mlp else []
    shapes += [(ffn * hd, hd)]
    return tuple((weights, width, index % 2 == 0) for index, (weights, width) in enumerate(shapes))


def recomputed_linear_share(plan: Plan) -> float:
    """The share of a block's linear flops its backward runs again ([Note: recompute]): 1 of each
    recomputed block under `every_nth_block`, the unsaved matmuls' under `op_level`; 0 otherwise
    (`full` recomputes in a pass of its own)."""
    if plan.recompute == "op_level":
        matmuls = op_level_matmuls(plan)
        return sum(w for w, _, saved in matmuls if not saved) / sum(w for w, _, _ in matmuls)
    return recomputed_block_share(plan)


def attention_flops(plan: Plan) -> tuple[float, float]:
    """(forward, backward) flops of one block's `QK^T` and `softmax(.) V` on one GPU.

    Eager: `4 bsz seq^2 q` forward (two seq x seq x q products, the whole square), twice that
    backward, plus the forward again with selective recompute ([Note: recompute]). Flash (causal): half
    the square forward, 2.5 x that backward. `q` is the query width (heads x head_dim)."""
    m = plan.model
    square = 4 * plan.micro_batch_per_gpu * m.seq_len**2 * m.q_size  # bsz/GPU x full q = the replica's / mp
    again = recomputed_block_share(plan)  # every_nth_block's recomputed blocks run the core again
    if plan.attention == "flash":
        forward = square / 2
        return forward, (FLASH_BACKWARD_FACTOR + again) * forward
    backward = 2 * square + (square if plan.recompute == "selective" else again * square)
    return square, backward


# [Note: memory-bound kernels] Each kernel reads its inputs and writes its outputs once from HBM
# (per token, in the compute precision `e`; a mask is 1 byte per element):
# - norms (`norms_per_block` of them): forward reads x, writes y (2 hd e); backward reads x and dy,
#   writes dx (3 hd e);
# - residual adds (2): read two hd-vectors, write one (3 hd e), forward; the backward adds the two
#   gradient branches (3 hd e);
# - activation: GeLU reads and writes the ffn-wide hidden (2 ffn e; backward reads x and dy, writes
#   dx: 3 ffn e); SwiGLU reads gate and up, writes their product (3 ffn e; backward reads gate, up
#   and dy, writes both gradients: 5 ffn e);
# - rotary (`rotary`): rotates queries and keys in place (2 (q + kv) e, forward and backward);
# - dropout (`dropout`): the two hidden dropouts read x, write y and the mask ((2 e + 1) hd each;
#   backward reads dy and the mask, writes dx: the same);
# - eager attention only: the fused scale-mask-softmax reads the scores and writes the probabilities
#   (2 heads seq e; backward reads probabilities and their gradient, writes the scores' gradient:
#   3 heads seq e), and with `dropout` the attention dropout ((2 e + 1) heads seq both ways);
# - eager attention only, the part of the two products' seq^2 traffic their flops do not cover
#   ("score_products"; [Note: eager products on the roofline] above
#   `score_products_memory_bound_share`).
# Under tensor parallelism (Megatron, no sequence parallelism) the kernels on the hd-wide residual
# stream (norms, residual adds, hidden dropout) run on every rank over the whole replica batch, while
# the ffn-, head- and query-wide ones are split `1 / mp`. With `sequence_parallel` (Korthikanti et al.
# 2022, arXiv:2205.05198 Sec. 4.2.2) each rank runs them on `1 / mp` of the sequence: the
# tensor-parallel all-reduce becomes a reduce-scatter into the sequence-split region and an
# all-gather out of it, the same bytes (an all-reduce is a reduce-scatter and an all-gather), so only
# these kernels' bytes change. Their time is bytes over the achievable
# HBM bandwidth (`achievable_hbm_bytes_per_s`). The loss reads the vocabulary-wide logits: forward
# it upcasts them to fp32 and reads that copy (e + 4 + 4 bytes per logit), backward writes the fp32
# gradient, reads it and writes its downcast (4 + 4 + e), as `F.cross_entropy(logits.float())` does
# (the memory bill's `logits` term holds the same two tensors). With fp8 matmuls, the casts that make
# the linears' fp8 operands are one more kernel ("fp8_casts", [Note: fp8 casts] in planner/cost/fp8.py).
def kernel_bytes(plan: Plan) -> tuple[dict[str, float], dict[str, float]]:
    """(forward, backward) bytes per memory-bound kernel of one block on one GPU ([Note:
    memory-bound kernels]); kernels the block does not run are left out."""
    m, mp = plan.model, plan.model_parallel_degree
    e = COMPUTE_BYTES[plan.precision]
    tokens = plan.micro_batch_per_gpu * m.seq_len
    stream = tokens * (1 if plan.sequence_parallel else mp) * m.hidden_size  # whole on every rank without SP
    ffn = tokens * m.ffn_hidden_size  # the replica's ffn-wide hidden / mp
    fwd = {"norms": m.norms_per_block * 2 * e * stream, "residual": 2 * 3 * e * stream,
           "activation": (3 if m.gated_mlp else 2) * e * ffn}
    bwd = {"norms": m.norms_per_block * 3 * e * stream, "residual": 2 * 3 * e * stream,
           "activation": (5 if m.gated_mlp else 3) * e * ffn}
    if m.rotary:
        fwd["rotary"] = bwd["rotary"] = 2 * e * tokens * (m.q_size + m.kv_size)
    if m.dropout:
        fwd["dropout"] = bwd["dropout"] = 2 * (2 * e + DROPOUT_MASK_BYTES) * stream
    if plan.attention == "eager":
        scores = tokens * m.num_heads * m.seq_len  # the replica's scores / mp
        fwd["softmax"], bwd["softmax"] = 2 * e * scores, 3 * e * scores
        bound = score_products_memory_bound_share(plan)
        if bound > 0:
            fwd["score_products"] = EAGER_PRODUCT_SCORE_PASSES_FORWARD * e * scores * bound
            bwd["score_products"] = EAGER_PRODUCT_SCORE_PASSES_BACKWARD * e * scores * bound
        if m.dropout:
            fwd["attention_dropout"] = bwd["attention_dropout"] = (2 * e + DROPOUT_MASK_BYTES) * scores
        if plan.recompute == "selective":  # the core's forward runs again before its backward
            bwd["softmax"] += fwd["softmax"]
            if bound > 0:
                bwd["score_products"] += fwd["score_products"]  # QK^T writes the scores again, P V reads P
            if m.dropout:
                bwd["attention_dropout"] += fwd["attention_dropout"]
    if plan.fp8_matmuls:
        fwd["fp8_casts"], bwd["fp8_casts"] = cast_bytes(plan)
    again = _recomputed_kernel_bytes(plan, fwd)
    if again > 0:
        bwd["recompute"] = again
    return fwd, bwd


_ATTENTION_CORE_KERNELS = frozenset({"softmax", "score_products", "attention_dropout"})
"""The eager attention core's kernels: `op_level` keeps the core's output and does not run them again."""


def _recomputed_kernel_bytes(plan: Plan, forward: dict[str, float]) -> float:
    """Forward kernel bytes an `every_nth_block` or `op_level` backward runs again ([Note: recompute]):
    the recomputed blocks' share of all of them, or every elementwise kernel outside the attention core
    and the casts of the recomputed linears' inputs."""
    if plan.recompute == "op_level":
        casts = forward.get("fp8_casts", 0.0) * recomputed_linear_share(plan)
        return casts + sum(v for k, v in forward.items() if k not in _ATTENTION_CORE_KERNELS and k != "fp8_casts")
    return recomputed_block_share(plan) * sum(forward.values())


# [Note: eager products on the roofline] Eager attention's products move a seq^2 operand per head:
# forward `QK^T` writes the scores and `P V` reads the probabilities (2 heads seq e bytes per token);
# backward `dP = dO V^T` writes dP, `dV = P^T dO` reads P, `dQ = dS K` and `dK = dS^T Q` each read dS
# (4 heads seq e); selective recompute's second forward writes and reads them again (2). Each such element
# carries `2 head_dim` flops (a dot product of head_dim pairs), so a product's arithmetic intensity is
# `2 head_dim / e` flops per byte: 64-128 for 2-byte head_dim 64-128, below the GPUs' ridge (the
# matmul rate over the achievable HBM bandwidth: about 180 on the fitted A100, 340 on the H100).
# A kernel's time is the larger of its flops time and its bytes time (the roofline; its tiles overlap
# loads, math and stores). The flops are timed at the matmul rate ([Note: attention kernels]), so the
# bytes this charges are those beyond what that time already streams: `B x (1 - I x W / R)` for
# intensity `I`, achievable bandwidth `W` and matmul rate `R`, and none where the products are
# compute-bound (the paper's V100 and its 1T heads of 160; a CPU's low matmul rate). This is the same
# traffic FlashAttention removes (Dao et al. 2022, arXiv:2205.14135, Sec. 3.2: standard attention's
# `Theta(N d + N^2)` HBM accesses against flash's `Theta(N^2 d^2 / M)`).
def score_products_memory_bound_share(plan: Plan) -> float:
    """The share of eager attention's seq^2 product traffic its flops time does not cover ([Note:
    eager products on the roofline]): 0 where the products are compute-bound."""
    node, m = plan.node, plan.model
    intensity = 2 * m.head_dim / COMPUTE_BYTES[plan.precision]  # flops per byte of a seq^2 element
    return max(0.0, 1.0 - intensity * achievable_hbm_bytes_per_s(node) / node.gpu_flops_per_s)


def loss_bytes(plan: Plan) -> tuple[float, float]:
    """(forward, backward) bytes of the loss over the vocabulary-wide logits on one GPU (0 without
    embeddings); the vocabulary is split `1 / mp` (Megatron's vocab-parallel cross-entropy)."""
    m = plan.model
    logits = plan.micro_batch_per_gpu * m.seq_len * m.vocab_size
    e = COMPUTE_BYTES[plan.precision]
    return (e + LOSS_FORWARD_FP32_BYTES) * logits, (LOSS_BACKWARD_FP32_BYTES + e) * logits


def stored_score_bytes_per_token(plan: Plan) -> int:
    """What one block keeps of its attention core per token for the backward, in eq. 5's units:
    the eager scores (`2 heads seq`), or flash's softmax statistics (`4 heads`); nothing seq^2-wide
    under selective recompute (the scores are made again in backward)."""
    m = plan.model
    if plan.attention == "flash":
        return FLASH_STATS_BYTES_PER_HEAD * m.num_heads
    return 0 if plan.recompute == "selective" else 2 * m.num_heads * m.seq_len


def recomputed_score_bytes(plan: Plan) -> float:
    """Selective recompute under eager: one block's scores, made again for its backward and freed
    after it (eq. 5's seq^2 term for a single block)."""
    if plan.recompute != "selective" or plan.attention != "eager":
        return 0.0
    m = plan.model
    return plan.micro_batch_per_gpu * m.seq_len * 2 * m.num_heads * m.seq_len
