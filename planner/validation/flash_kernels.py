"""Which FlashAttention generation a published run's fused attention ran, and its rate beside the
preset's ([Note: FlashAttention generations]).

A hardware preset's `flash_attention_tflops` is FlashAttention-2's rate on that GPU (fitted on the
published runs, planner/validation/fit.py); a row whose stack ran an older kernel runs at that
kernel's published rate relative to FlashAttention-2, a property of the kernel shared by every row
that runs it, never a factor per row or per source.
"""

from __future__ import annotations

import enum

from planner.specs.hardware import NodeSpec


class FlashKernel(enum.Enum):
    """A FlashAttention generation (the corpus's `attention` column: `flash1`, `flash2`; plain `flash`
    takes its source's, SOURCE_FLASH_KERNEL, else FlashAttention-2)."""

    FLASH_ATTENTION_1 = "flash1"
    FLASH_ATTENTION_2 = "flash2"

    @property
    def rate_vs_flash_attention_2(self) -> float:
        """The kernel's training rate as a share of FlashAttention-2's on the same GPU."""
        return FLASH_ATTENTION_1_VS_2 if self is FlashKernel.FLASH_ATTENTION_1 else 1.0


FLASH_ATTENTION_1_VS_2 = 0.5
"""FlashAttention (v1)'s rate as a share of FlashAttention-2's: Dao 2023, arXiv:2307.08691, abstract
("around 2x speedup compared to FlashAttention"; FlashAttention reached 25-40 % of the A100's peak,
FlashAttention-2 50-73 %)."""

SOURCE_FLASH_KERNEL: dict[str, tuple[FlashKernel, str]] = {
    "llmfoundry_bench": (
        FlashKernel.FLASH_ATTENTION_1,
        "llm-foundry's `gpu` extra pins flash-attn 1.0.3.post0 (v0.2.0) and 1.0.9 (v0.3.0, v0.4.0), whose MPT "
        "`attn_impl: flash` calls; FlashAttention-2 is the opt-in `gpu-flash2` extra from v0.4.0 on, and its "
        "amp_fp8 instructions install flash-attn 1.0.7 (the package metadata on PyPI)"),
    **{source: (FlashKernel.FLASH_ATTENTION_2,
                "torchtitan attends through PyTorch's scaled_dot_product_attention, whose flash backend is "
                "FlashAttention-2 from PyTorch 2.2 on")
       for source in ("torchtitan_perfmd_2408", "torchtitan_h200_2506")},
}
"""source_id -> (the FlashAttention generation its `flash` rows ran, why). Any other `flash` row runs
the preset's kernel, FlashAttention-2."""


# [Note: FlashAttention generations] FlashAttention-2 (Dao 2023) reworked the first kernel's
# parallelism and work split and is "around 2x" faster (abstract: 50-73 % of the A100's peak against
# FlashAttention's 25-40 %). A preset's `flash_attention_tflops` is FlashAttention-2's rate on its GPU
# (fitted from the prior of its published rate, planner/validation/fit.py PRIOR); a run on the first
# kernel times its fused attention at FLASH_ATTENTION_1_VS_2 of that rate. Which kernel a run used is
# a fact about its software: the row's `attention` column (`flash1`, `flash2`), else its source's
# stack (SOURCE_FLASH_KERNEL: llm-foundry's pinned flash-attn 1.x, PyTorch's FlashAttention-2 backend).
# Without the distinction one fitted rate served both: llm-foundry's 173 rows pulled it to about
# half of FlashAttention-2's published rate, and a source held out of the fit was predicted with a
# rate no row of the others pinned (docs/validation.md, leave-one-source-out).
def row_flash_kernel(attention: str, source_id: str) -> FlashKernel:
    """The FlashAttention generation of a fused-attention row ([Note: FlashAttention generations])."""
    if attention in {k.value for k in FlashKernel}:
        return FlashKernel(attention)
    return SOURCE_FLASH_KERNEL.get(source_id, (FlashKernel.FLASH_ATTENTION_2, ""))[0]


def with_flash_kernel(node: NodeSpec, kernel: FlashKernel) -> NodeSpec:
    """`node` with its fused attention at `kernel`'s rate (the preset's rate is FlashAttention-2's)."""
    if kernel is FlashKernel.FLASH_ATTENTION_2:
        return node
    return node.replace(name=f"{node.name} ({kernel_name(kernel)})",
                        flash_attention_flops_per_s=node.flash_attention_flops_per_s * kernel.rate_vs_flash_attention_2)


def kernel_name(kernel: FlashKernel) -> str:
    return {FlashKernel.FLASH_ATTENTION_1: "FlashAttention", FlashKernel.FLASH_ATTENTION_2: "FlashAttention-2"}[kernel]
