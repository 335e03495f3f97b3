"""fp8 casts (planner/cost/fp8.py [Note: fp8 casts]): each recipe's bytes against a hand count, the
kernel they join, the output head kept 16-bit, and the recipe a validation row takes from its stack."""

from __future__ import annotations

import pytest

from planner.cost.fp8 import cast_bytes, tensor_parallel_byte_share
from planner.cost.kernels import kernel_bytes
from planner.sim.fast import predict
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.plan import STRATEGY_TABLE, Plan
from planner.specs.stack import Fp8Recipe, KvExchange
from planner.validation.configure import row_plan
from planner.validation.corpus import load_corpus

NODE = resolve_hardware("dgx-h100")
MODEL = resolve_model("llama-3-8b").replace(seq_len=2048)  # hd 4096, q 4096, KV 1024, SwiGLU ffn 14336
TOKENS = 2048
NORMED = 2 * TOKENS * 4096  # qkv's input and the MLP's: 16,777,216 elements
OTHER = TOKENS * (4096 + 14336)  # the projection's and down's inputs: 37,748,736
GRAD_OUTPUTS = TOKENS * (4096 + 2 * 1024 + 2 * 14336) + 2 * TOKENS * 4096  # 88,080,384
WEIGHTS = 4096 * 6144 + 4096 * 4096 + 3 * 4096 * 14336  # 218,103,808 per block


def _plan(**changes) -> Plan:
    return Plan(model=MODEL, node=NODE, num_gpus=8, strategy="zero3", placement=STRATEGY_TABLE["zero3"].placement,
                micro_batch_per_gpu=1, recompute_interval=0, fp8_matmuls=True, **changes)


def test_hand_counts_of_the_element_groups():
    assert (NORMED, OTHER, GRAD_OUTPUTS, WEIGHTS) == (16_777_216, 37_748_736, 88_080_384, 218_103_808)
    assert sum(op.num_params for op in MODEL.block_operators()) == WEIGHTS


def test_torchao_tensorwise_amax_and_cast_every_operand_forward_and_again_backward():
    forward, backward = cast_bytes(_plan(fp8_recipe=Fp8Recipe.TORCHAO_TENSORWISE))
    # amax (read 2) + cast (read 2, write 1) = 5 per input and weight element; backward recasts both
    # (5) and casts the output gradient once with both layouts (2 + 2 + 1 + 1 = 6)
    assert forward == 5 * (16_777_216 + 37_748_736 + 218_103_808) == 1_363_148_800
    assert backward == 5 * (16_777_216 + 37_748_736) + 6 * 88_080_384 + 5 * 218_103_808 == 1_891_631_104


def test_torchao_rowwise_casts_the_output_gradient_along_both_axes():
    forward, backward = cast_bytes(_plan(fp8_recipe=Fp8Recipe.TORCHAO_ROWWISE))
    assert forward == 1_363_148_800
    assert backward == 1_891_631_104 + 4 * 88_080_384


def test_transformer_engine_delayed_scaling_fuses_casts_and_keeps_fp8_weights_over_the_step():
    forward, backward = cast_bytes(_plan(micro_batches_per_step=4))  # TE_DELAYED is the default recipe
    # layernorm writes fp8 (+1 net with the transpose), cast-transpose 4 elsewhere, weights once per 4 micro-batches
    assert forward == 16_777_216 + 4 * 37_748_736 + 4 * 218_103_808 / 4 == 385_875_968
    assert backward == 4 * 88_080_384 == 352_321_536
    current_fwd, current_bwd = cast_bytes(_plan(micro_batches_per_step=4, fp8_recipe=Fp8Recipe.TE_CURRENT))
    assert (current_fwd, current_bwd) == (6 * (16_777_216 + 37_748_736) + 6 * 218_103_808 / 4, 6 * 88_080_384)


def test_casts_are_a_memory_bound_kernel_only_with_fp8():
    forward, backward = kernel_bytes(_plan(fp8_recipe=Fp8Recipe.TORCHAO_TENSORWISE))
    assert (forward["fp8_casts"], backward["fp8_casts"]) == (1_363_148_800, 1_891_631_104)
    assert "fp8_casts" not in kernel_bytes(_plan().replace(fp8_matmuls=False))[0]
    # Tensor parallelism: inputs cast on the GPU's share before the gather, the row-parallel output
    # gradients whole on every rank, the rest 1 / mp.
    tp = _plan(fp8_recipe=Fp8Recipe.TORCHAO_TENSORWISE).replace(model_parallel_degree=2, micro_batch_per_gpu=0.5)
    grad_outputs = 1024 * (4096 + 2 * 1024 + 2 * 14336) + 2 * 2048 * 4096
    assert cast_bytes(tp)[1] == 5 * (NORMED + OTHER) / 2 + 6 * grad_outputs + 5 * WEIGHTS / 2


def test_the_output_head_stays_16_bit():
    model = MODEL.replace(vocab_size=128256)
    bf16 = Plan(model=model, node=NODE, num_gpus=1, strategy="dp", placement=STRATEGY_TABLE["dp"].placement,
                micro_batch_per_gpu=1, recompute_interval=0)
    one_block = bf16.replace(model=model.replace(num_layers=1))
    one_block_fp8 = predict(one_block.replace(fp8_matmuls=True)).details["resources"]["gpu_compute"]["busy_s"]
    one_block_s = predict(one_block).details["resources"]["gpu_compute"]["busy_s"]
    # One block's linears speed up and its casts cost; what is left of the difference is the block's alone:
    # with the head at the fp8 rate the saving would exceed the whole block's linear time.
    saved = one_block_s - one_block_fp8
    block_linear_s = 3 * 2 * TOKENS * WEIGHTS / NODE.gpu_flops_per_s
    assert 0 < saved < block_linear_s


@pytest.mark.parametrize("row_id, recipe, exchange", [
    ("p209", Fp8Recipe.TORCHAO_TENSORWISE, KvExchange.ALL_GATHER),  # torchtitan float8
    ("p249", Fp8Recipe.TE_CURRENT, KvExchange.RING),  # Megatron-Bridge FP8-CS
    ("p226", Fp8Recipe.TE_DELAYED, KvExchange.RING),  # NeMo fp8
])
def test_validation_rows_take_the_recipe_from_their_stack(row_id, recipe, exchange):
    row = next(r for r in load_corpus() if r.row_id == row_id)
    plan = row_plan(row).plan
    assert plan.fp8_matmuls and plan.fp8_recipe is recipe and plan.kv_exchange is exchange
    assert any(note.startswith(f"fp8_recipe = {recipe.value}") for note in row_plan(row).assumptions)


def test_fp8_gathers_the_forward_tensor_parallel_inputs_in_fp8():
    bf16 = _plan().replace(fp8_matmuls=False, model_parallel_degree=2, micro_batch_per_gpu=0.5)
    fp8 = bf16.replace(fp8_matmuls=True)
    # forward all-reduces: a 16-bit reduce-scatter and an fp8 all-gather, (2 + 1) / 4 of the bytes;
    # backward: 16-bit; no recompute here, so the step moves (3/4 + 1) / 2 = 7/8 of the bf16 bytes
    assert tensor_parallel_byte_share(fp8, backward=False) == 0.75
    assert tensor_parallel_byte_share(fp8, backward=True) == tensor_parallel_byte_share(bf16, backward=False) == 1.0
    moved = predict(fp8).details["tensor_parallel_bytes"]
    assert moved == pytest.approx(7 / 8 * predict(bf16).details["tensor_parallel_bytes"], rel=1e-9)
