"""The FlashAttention generation of a published run: the first kernel at its published share of
FlashAttention-2's rate (planner/validation/flash_kernels.py [Note: FlashAttention generations])."""

import dataclasses

import pytest

from planner.cost.kernels import fused_attention_flops_per_s
from planner.specs.catalog import hardware_presets
from planner.validation.configure import row_plan
from planner.validation.corpus import load_corpus
from planner.validation.fit import apply
from planner.validation.flash_kernels import FLASH_ATTENTION_1_VS_2, FlashKernel, row_flash_kernel


@pytest.fixture(scope="module")
def rows():
    return {r.row_id: r for r in load_corpus()}


def test_flash_attention_1_runs_at_half_flash_attention_2s_rate():
    # Dao 2023, abstract: FlashAttention-2 is "around 2x" faster than FlashAttention.
    assert FLASH_ATTENTION_1_VS_2 == 0.5
    assert FlashKernel.FLASH_ATTENTION_1.rate_vs_flash_attention_2 == 0.5
    assert FlashKernel.FLASH_ATTENTION_2.rate_vs_flash_attention_2 == 1.0


def test_a_rows_kernel_is_its_column_else_its_sources_stack():
    assert row_flash_kernel("flash1", "torchtitan_perfmd_2408") is FlashKernel.FLASH_ATTENTION_1
    assert row_flash_kernel("flash2", "llmfoundry_bench") is FlashKernel.FLASH_ATTENTION_2
    assert row_flash_kernel("flash", "llmfoundry_bench") is FlashKernel.FLASH_ATTENTION_1  # flash-attn 1.x pinned
    assert row_flash_kernel("flash", "torchtitan_perfmd_2408") is FlashKernel.FLASH_ATTENTION_2  # PyTorch SDPA
    assert row_flash_kernel("flash", "nemo_2407") is FlashKernel.FLASH_ATTENTION_2  # the preset's kernel


def test_llm_foundry_rows_time_their_attention_at_half_the_presets_rate(rows):
    preset = hardware_presets()["dgx-a100-80g"]
    foundry = row_plan(rows["p162"])  # llm-foundry, A100 80 GB, `flash`
    titan = row_plan(rows["p211"])  # torchtitan, A100 80 GB, `flash`
    assert foundry.flash_kernel is FlashKernel.FLASH_ATTENTION_1
    assert any(a.startswith("fused attention = FlashAttention (") for a in foundry.assumptions)
    assert foundry.plan.node.flash_attention_flops_per_s == pytest.approx(0.5 * preset.flash_attention_flops_per_s)
    assert titan.flash_kernel is FlashKernel.FLASH_ATTENTION_2
    assert titan.plan.node.flash_attention_flops_per_s == pytest.approx(preset.flash_attention_flops_per_s)
    # The GPU presets have no sequence-length curve: the plan's kernel rate is the node's.
    assert fused_attention_flops_per_s(foundry.plan) == pytest.approx(0.5 * preset.flash_attention_flops_per_s)
    # A row that names its generation overrides its source's stack.
    stated = row_plan(dataclasses.replace(rows["p162"], attention="flash2"))
    assert stated.plan.node.flash_attention_flops_per_s == pytest.approx(preset.flash_attention_flops_per_s)


def test_the_fitted_flash_rate_is_flash_attention_2s_and_the_first_kernel_gets_its_share():
    node = hardware_presets()["dgx-a100-80g"]
    params = {"plateau": 0.7, "half_gflop": 20.0, "flash": 0.6, "hbm": 0.6}
    # 0.6 x 312 TFLOPS = 187.2 TFLOPS for FlashAttention-2; half of it, 93.6, for FlashAttention (v1).
    assert apply(node, params, FlashKernel.FLASH_ATTENTION_2).flash_attention_flops_per_s == pytest.approx(187.2e12)
    assert apply(node, params, FlashKernel.FLASH_ATTENTION_1).flash_attention_flops_per_s == pytest.approx(93.6e12)
    assert apply(node, params).flash_attention_flops_per_s == pytest.approx(187.2e12)
