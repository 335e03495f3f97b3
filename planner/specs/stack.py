"""The training code's own choices that change what fp8 and context parallelism cost.

Two stacks train the runs the planner prices with fp8 linears or context parallelism, and they do
the same arithmetic with different extra work: Megatron-Core/NeMo with Transformer Engine, and
PyTorch-native training (torchtitan: FSDP2, torchao's Float8Linear, PyTorch's context_parallel).
A plan names what its stack does as two types; their costs are in planner/cost/fp8.py ([Note: fp8
casts]) and planner/cost/context_parallel.py ([Note: context parallelism]). A third type says how
its ZeRO-3 groups parameters into collectives (planner/cost/collectives.py [Note: per-parameter
collectives]).
"""

from __future__ import annotations

from enum import Enum


class Fp8Recipe(str, Enum):
    """How a plan with `fp8_matmuls` makes the fp8 operands of its linears (planner/cost/fp8.py)."""

    TE_DELAYED = "te_delayed"
    """Transformer Engine's delayed scaling: the scale comes from earlier iterations' amax history, the
    cast is fused into the kernel before the matmul (the layernorm of a LayerNormLinear) or is one
    cast-transpose pass, and fp8 weights are cast once per optimizer step."""
    TE_CURRENT = "te_current"
    """Transformer Engine's per-tensor current scaling (Megatron-Bridge's `FP8-CS`): an amax pass over
    each tensor before its cast-transpose, and the layernorm writes 16-bit output first."""
    TORCHAO_TENSORWISE = "torchao_tensorwise"
    """torchao Float8Linear, dynamic per-tensor scaling (torchtitan's default `float8`): an amax pass and
    a cast pass per operand, forward and again in backward."""
    TORCHAO_ROWWISE = "torchao_rowwise"
    """torchao Float8Linear, dynamic per-row scaling (torchtitan's `rowwise` recipe): the backward casts
    each operand along the other axis too."""

    __str__ = str.__str__
    __format__ = str.__format__


class KvExchange(str, Enum):
    """How a context-parallel plan brings every GPU the keys and values of the whole sequence
    (planner/cost/context_parallel.py [Note: context parallelism])."""

    RING = "ring"
    """Megatron-Core / Transformer Engine: point-to-point sends around the CP ring, one KV block per
    step, each overlapping the attention of the block already held."""
    ALL_GATHER = "all_gather"
    """PyTorch's context_parallel (torchtitan), its default rotate method: one all-gather of every KV
    block overlapping the first step's attention only; the backward gathers KV again and passes dKV
    around the ring point to point."""

    __str__ = str.__str__
    __format__ = str.__format__


class ShardCollectives(str, Enum):
    """How a plan's ZeRO-3 implementation groups the sharded parameters into collectives
    (planner/cost/collectives.py [Note: per-parameter collectives])."""

    FLAT = "flat"
    """One all-gather and one reduce-scatter per traced operator's flat parameters, prefetched ahead
    of the compute: the runtime's own plans, FSDP's flat units, DeepSpeed's coalesced gathers."""
    PER_PARAMETER = "per_parameter"
    """One all-gather and one reduce-scatter per `nn.Parameter` (each weight, bias and norm tensor),
    each gather issued after a device-wide synchronize, so no collective overlaps compute:
    DeepSpeed's ZeRO-3 from its first release through 2021 (v0.3.13-v0.5.x,
    `Init._allgather_param` and `_reduce_scatter_gradient` in runtime/zero/partition_parameters.py).
    A plan with it has `prefetch_depth` 0."""

    __str__ = str.__str__
    __format__ = str.__format__
