"""The search of a row's unstated settings (planner/validation/unstated.py [Note: unstated settings are searched])."""

from __future__ import annotations

import dataclasses

import pytest

from planner.cost.memory import memory_bill
from planner.sim.fast import predict
from planner.validation.configure import context_parallel, row_plan
from planner.validation.corpus import load_corpus
from planner.validation.report import predict_row


@pytest.fixture(scope="module")
def rows():
    return {r.row_id: r for r in load_corpus()}


def test_a_row_stating_everything_has_one_candidate_and_its_stated_plan(rows):
    row = rows["p162"]  # llm-foundry: shape, batch, sharding, recompute, precision all stated
    planned = row_plan(row)
    assert not any(a.startswith("searched") or "candidates" in a for a in planned.assumptions)
    plan = planned.plan
    assert plan.recompute == row.activation_recompute and plan.strategy == "zero3"
    assert plan.micro_batch_per_gpu == row.micro_batch and plan.micro_batches_per_step == 4


def test_unstated_recompute_is_the_planners_fastest_fitting_choice(rows):
    row = dataclasses.replace(rows["p162"], activation_recompute="")
    planned = row_plan(row)
    stated = {r: row_plan(dataclasses.replace(row, activation_recompute=r)).plan for r in ("none", "selective", "full")}
    fitting = {r: predict(p).tokens_per_s for r, p in stated.items() if memory_bill(p).fits}
    assert fitting and planned.plan.recompute == max(fitting, key=fitting.get)
    assert planned.plan == stated[planned.plan.recompute]
    assert f"searched activation_recompute over {{none, selective, full}}: {planned.plan.recompute}" in planned.assumptions
    assert "the searched choice is the planner's fastest that fits of 3 candidates" in planned.assumptions


def test_a_megatron_row_searches_ddp_and_the_distributed_optimizer_only(rows):
    planned = row_plan(rows["p226"])  # NeMo, 8 GPUs of one replica each: DP 8, sharding unstated
    assert planned.plan.strategy in ("dp", "3d")
    assert any(a.startswith("searched sharding over {none, zero1}: ") for a in planned.assumptions)
    single = row_plan(rows["p236"])  # TP 4 x PP 4 on 16 GPUs: one replica, nothing to shard
    assert single.plan.strategy == "dp" and not any("sharding" in a for a in single.assumptions)


def test_pipelined_micro_batch_is_searched_among_the_global_batchs_divisors(rows):
    row = rows["p015"]  # Narayanan et al. 2021 Table 1: TP 8 x PP 2 on 512 GPUs, global 1536, micro unstated
    planned = row_plan(row)
    plan, dp = planned.plan, 512 // 16
    micro = round(plan.micro_batch_per_gpu * 16)
    assert (1536 // dp) % micro == 0 and plan.micro_batches_per_step == 1536 // (micro * dp)
    assert any(a.startswith("searched micro_batch over {1, 2, 3, 4, 6, 8, 12, 16, 24}: ") for a in planned.assumptions)


def test_a_stated_model_parallel_size_is_split_by_the_search(rows):
    planned = row_plan(rows["p027"])  # Table 2: model-parallel size 96, TP x PP not given
    plan = planned.plan
    assert plan.model_parallel_degree * plan.pipeline_parallel_degree == 96
    assert any(a.startswith("searched tensor x pipeline over {1 x 96, 2 x 48, 4 x 24, 8 x 12}: ") for a in planned.assumptions)


def test_no_batch_at_all_takes_the_largest_that_fits_and_says_so(rows):
    planned = row_plan(rows["p009"])
    assert any("the largest that fits =" in a and "per replica" in a for a in planned.assumptions)
    result = predict_row(rows["p009"])
    assert result.error is not None and result.fits


def test_searched_rows_show_their_choices_in_the_json(rows):
    doc = predict_row(rows["p226"]).to_json()
    assert any(a.startswith("searched activation_recompute") for a in doc["assumptions"])


def test_context_parallel_degree_from_the_note_or_the_stated_degrees(rows):
    assert context_parallel(rows["p232"]) == 2 and context_parallel(rows["p244"]) == 16
    assert context_parallel(rows["p226"]) == 1 and context_parallel(rows["p162"]) == 1


def test_context_parallel_rows_are_predicted_with_their_degree(rows):
    planned = row_plan(rows["p244"])  # NeMo long-sequence: 512K tokens, TP 8 x CP 16 x DP 4 on 512 GPUs
    plan = planned.plan
    assert plan.context_parallel_degree == 16 and plan.gpus_per_replica == 128 and plan.data_parallel_degree == 64
    assert "context_parallel = 16 (the row's note or its stated degrees)" in planned.assumptions
    result = predict_row(rows["p244"])
    assert result.error is not None and result.fits


def test_an_interleaved_schedule_of_unstated_depth_is_searched_over_equal_chunks(rows):
    row = rows["p017"]  # Table 1, "interleaved 1F1B": 80 layers on PP 8, 10 blocks a stage, v unstated
    planned = row_plan(row)
    plan = planned.plan
    assert any(a.startswith("searched pipeline_virtual_stages over {2, 5, 10}: ") for a in planned.assumptions)
    assert plan.pipeline_virtual_stages in (2, 5, 10) and plan.micro_batches_per_step % 8 == 0
    only = row_plan(rows["p020"])  # 128 layers on PP 64: two blocks a stage, one split into 2 or more chunks
    assert only.plan.pipeline_virtual_stages == 2
    assert any(a.startswith("pipeline_virtual_stages = 2 (the note says") for a in only.assumptions)
    plain = row_plan(dataclasses.replace(row, notes="micro-batch not stated"))
    assert plain.plan.pipeline_virtual_stages == 1 and not any("virtual" in a for a in plain.assumptions)
    stated = row_plan(dataclasses.replace(row, notes="VP=5; micro-batch not stated"))
    assert stated.plan.pipeline_virtual_stages == 5
    assert row_plan(rows["p248"]).plan.pipeline_virtual_stages == 8  # stated VP=8: taken as stated, never refused


def test_interleaving_needs_equal_chunks_and_micro_batches_a_multiple_of_the_stages():
    from planner.validation.configure import interleaves

    assert interleaves(80, 8, 10, 24) and interleaves(80, 8, 5, None)
    assert not interleaves(80, 8, 3, None)  # 10 blocks a stage do not split into 3 equal chunks
    assert not interleaves(80, 8, 2, 12)  # 12 micro-batches are not a multiple of 8 stages
    assert not interleaves(80, 1, 2, 8)  # one stage: nothing to interleave


def test_a_note_stating_sequence_parallelism_splits_the_residual_streams_kernels(rows):
    row = dataclasses.replace(rows["p014"], notes="sequence parallelism; micro-batch not stated")  # TP 8, no PP
    sp, plain = row_plan(row).plan, row_plan(rows["p014"]).plan
    assert sp.sequence_parallel and not plain.sequence_parallel
    assert sp == plain.replace(sequence_parallel=True)
    assert predict(sp).tokens_per_s > predict(plain).tokens_per_s  # fewer bytes per rank, same collectives
    assert not row_plan(dataclasses.replace(row, notes="no sequence parallelism")).plan.sequence_parallel
