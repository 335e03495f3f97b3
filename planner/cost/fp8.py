"""fp8 matmuls (Transformer Engine, torchao Float8 linears): the linears' rate on GPUs that have one.

[Note: fp8 matmuls] A plan with `fp8_matmuls` runs every linear layer's matmul (forward and both
backward matmuls) in fp8 at the GPU's fp8 tensor-core rate; everything else keeps the plan's
`precision`: the attention core (QK^T and softmax V, bf16 in the flash kernels these runs use), the
memory-bound kernels, the stored weights, gradients, activations and every transfer. The achievable
fp8 rate is the preset's achievable bf16 rate times the datasheet's fp8 / bf16 ratio, and the
efficiency curve keeps its shape (no public source gives a separate fp8 curve), so a matmul of a
given size reaches the same fraction of either peak. Only GPUs listed here have an fp8 rate.
"""

from __future__ import annotations

from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec

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
    """How much faster a linear's matmul runs in fp8 than in bf16 on `node` (datasheet ratio)."""
    entry = FP8_DENSE_TFLOPS.get(_preset_of(node))
    if entry is None:
        raise PlannerError(f"fp8_matmuls: hardware {node.name!r} has no fp8 matmul rate in the planner "
                           f"(known: {', '.join(FP8_DENSE_TFLOPS)}); use fp8_matmuls false")
    fp8, bf16, _ = entry
    return fp8 / bf16


def linear_speedup(fp8_matmuls: bool, node: NodeSpec) -> float:
    """1 without fp8, else `fp8_speedup(node)`."""
    return fp8_speedup(node) if fp8_matmuls else 1.0
