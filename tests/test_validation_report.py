"""`planner.validation.validate`: every row predicted or given a reason, under the configuration it states."""

import dataclasses

import pytest

from planner.specs.catalog import hardware_presets
from planner.specs.errors import PlannerError
from planner.validation.configure import RowPlan, preset_for_name, row_plan
from planner.validation.corpus import load_corpus
from planner.validation.docs import BEGIN, END, write_docs
from planner.validation.flash_kernels import FlashKernel
from planner.validation.flops import flops_per_token, from_tokens_per_s
from planner.validation.render import markdown, scatter
from planner.validation.report import ROW_KEYS, predict_row, predicted_tokens_per_s_per_gpu, validate

GROUP_KEYS = {"rows", "predicted", "misses", "refused_by_memory_bill", "median_abs_error", "p90_abs_error", "median_error"}


@pytest.fixture(scope="module")
def report():
    return validate()


@pytest.fixture(scope="module")
def rows():
    return {r.row_id: r for r in load_corpus()}


def test_json_has_exactly_the_contract_keys(report):
    doc = report.to_json()
    assert set(doc) == {"rows", "summary"}
    assert len(doc["rows"]) == 274
    for row in doc["rows"]:
        assert tuple(row) == ROW_KEYS
    summary = doc["summary"]
    assert {"by_gpu_type", "by_source", "offload_checks", "all"} <= set(summary)
    for group in [summary["all"], summary["offload_checks"], *summary["by_gpu_type"].values(), *summary["by_source"].values()]:
        assert set(group) == GROUP_KEYS
        assert group["rows"] == group["predicted"] + group["misses"]


def test_no_row_dropped_and_every_miss_has_a_reason(report, rows):
    assert [r.row.row_id for r in report.results] == list(rows)
    for r in report.results:
        assert (r.error is None) == (r.predicted is None)
        if r.error is None:
            assert r.reason, r.row.row_id
    summary = report.summary()
    calibration = [r for r in report.results if not r.offload]
    assert summary["all"]["rows"] == len(calibration) == 270
    assert summary["offload_checks"]["rows"] == 4
    assert sum(g["rows"] for g in summary["by_gpu_type"].values()) == 270


def test_error_is_predicted_over_measured_minus_one_whatever_the_metric(report):
    predicted = [r for r in report.results if r.error is not None]
    assert len(predicted) > 150
    for r in predicted:
        assert r.error == pytest.approx(r.predicted / r.measured - 1, rel=1e-12)
        tokens_predicted, tokens_measured = r.tokens_per_s_per_gpu
        assert r.error == pytest.approx(tokens_predicted / tokens_measured - 1, rel=1e-9)
    assert {r.metric for r in predicted} == {"tokens_per_s_per_gpu", "tflops_per_gpu"}


def test_predicted_tflops_use_the_rows_own_accounting(report):
    p001 = next(r for r in report.results if r.row.row_id == "p001")
    assert p001.metric == "tflops_per_gpu" and p001.measured == 39
    # Megatron hardware FLOPs (recompute included): 96 l h^2 (1 + s/6h + V/16lh) per token
    nl, h, s, v = 40, 1536, 1024, 51200
    per_token = 96 * nl * h**2 * (1 + s / (6 * h) + v / (16 * nl * h))
    tokens = p001.tokens_per_s_per_gpu[0]
    assert p001.predicted == pytest.approx(from_tokens_per_s(tokens, "tflops_per_gpu", flops_per_token_=per_token,
                                                             peak_flops_per_s=1.0))


def test_plans_take_exactly_what_the_row_states(rows):
    p014 = row_plan(rows["p014"])  # GPT 18.4B, TP 8 on 256 A100s, global batch 1024, no micro-batch stated
    plan = p014.plan
    assert plan.model_parallel_degree == 8 and plan.data_parallel_degree == 32
    assert plan.micro_batch_per_gpu == 32 / 8 and p014.grad_accumulation == 1
    assert plan.recompute_interval == 1 and plan.precision == "fp16" and plan.strategy == "dp"
    assert plan.node.name == "dgx-a100-80g" and any("micro_batch" in a for a in p014.assumptions)
    p162 = row_plan(rows["p162"])  # MPT-7b on 8 A100-40GB, FSDP, micro 12, global 384
    # llm-foundry ran the first FlashAttention: the node names the kernel whose rate it carries.
    assert p162.plan.node.name == "dgx-a100-40g (FlashAttention)" and p162.plan.strategy == "zero3"
    assert p162.grad_accumulation == 4 and p162.plan.micro_batch_per_gpu == 12
    assert p162.plan.model.ffn_hidden_size == 4 * 4096 and p162.plan.model.tied_embeddings
    p218 = row_plan(rows["p218"]).plan  # Llama 2 70B: GQA and SwiGLU from the published config
    assert (p218.model.num_kv_heads, p218.model.gated_mlp, p218.model.tied_embeddings) == (8, True, False)
    assert p218.model.seq_len == 4096 and p218.model.vocab_size == 32000


def test_rows_state_their_recompute_and_attention_kernel(rows):
    # torchtitan p211 states its "selective layer" checkpointing (every 2nd block), p212 its "selective op";
    # both are planned as such (no recompute segments).
    p211, p212 = row_plan(rows["p211"]).plan, row_plan(rows["p212"]).plan
    assert (p211.recompute, p211.recompute_block_period, p211.recompute_interval, p211.attention) == (
        "every_nth_block", 2, 0, "flash")
    assert (p212.recompute, p212.recompute_interval) == ("op_level", 0)
    assert p211.model.rotary  # a Llama: rotary position embeddings
    # Narayanan et al. 2021 on A100 predates fused attention: its rows say eager in their column.
    p011 = row_plan(rows["p011"])
    assert (p011.plan.attention, p011.plan.recompute, p011.plan.model.dropout) == ("eager", "full", True)
    assert rows["p011"].attention == "eager" and not any(a.startswith("attention") for a in p011.assumptions)
    assert row_plan(rows["p162"]).plan.attention == "flash"  # llm-foundry on A100: its notes say flash attn


def test_the_attention_kernel_is_the_rows_not_the_sources(rows):
    # FlashAttention-2's Table 1: the same model, GPUs and code, with and without the fused kernel.
    eager, flash = row_plan(rows["p266"]).plan, row_plan(rows["p267"]).plan
    assert (eager.attention, flash.attention) == ("eager", "flash")
    assert eager.model.num_params == flash.model.num_params
    # `flash2` runs at the preset's fused-attention rate, which is FlashAttention-2's.
    preset = hardware_presets()["dgx-a100-80g"].flash_attention_flops_per_s
    assert flash.node.flash_attention_flops_per_s == pytest.approx(preset)
    assert row_plan(rows["p267"]).flash_kernel is FlashKernel.FLASH_ATTENTION_2
    assert row_plan(rows["p266"]).flash_kernel is None  # eager: no fused kernel
    assert row_plan(dataclasses.replace(rows["p267"], gpu_type="V100", gpu_family="V100")).reasons[-1] == \
        "no FlashAttention-2 rate for V100"
    # An empty cell falls back to the source's default (SOURCE_ATTENTION), then to the GPU's.
    p011 = dataclasses.replace(rows["p011"], attention="")
    planned = row_plan(p011)
    assert planned.plan.attention == "eager" and any(a.startswith("attention = eager") for a in planned.assumptions)
    assert row_plan(dataclasses.replace(rows["p162"], attention="")).plan.attention == "flash"
    assert row_plan(dataclasses.replace(rows["p162"], attention="eager")).plan.attention == "eager"


def test_deepspeed_2021_zero3_rows_gather_per_parameter(rows, report):
    # Narayanan et al. 2021 Table 2's ZeRO-3 rows ran DeepSpeed's 2021 ZeRO-3 (planner/cost/collectives.py
    # [Note: per-parameter collectives]): one collective per parameter of Megatron's GPT block, nothing
    # fetched ahead. Their Table 1 rows (no ZeRO) keep flat collectives.
    p023 = row_plan(rows["p023"])
    plan = p023.plan
    assert (plan.shard_collectives, plan.prefetch_depth) == ("per_parameter", 0)
    assert plan.model.parameter_tensors_per_block == 12
    assert rows["p023"].shard_collectives == "per_parameter"
    assert row_plan(rows["p015"]).plan.shard_collectives == "flat"
    # An empty cell takes the source's default (SOURCE_SHARD_COLLECTIVES), named among the assumptions.
    unstated = row_plan(dataclasses.replace(rows["p023"], shard_collectives=""))
    assert unstated.plan == plan and any(a.startswith("shard_collectives = per_parameter") for a in unstated.assumptions)
    # At a fixed global batch of 1,536 the paper measured the same step time on 768 and 1,536 GPUs
    # (88 and 44 TFLOPS per GPU): the micro-batch halves while every collective's latency doubles.
    result = {r.row.row_id: r for r in report.results}
    step_ratio = (result["p022"].predicted / result["p023"].predicted) / 2  # time at 1,536 over time at 768
    assert 0.9 < step_ratio < 1.15, step_ratio
    flat = row_plan(dataclasses.replace(rows["p023"], shard_collectives="flat")).plan
    assert flat.prefetch_depth > 0 and _error_under(rows["p023"], flat) > 2 * result["p023"].error


def _error_under(row, plan):
    return predict_row(row, planned=RowPlan(plan=plan)).error


def test_flash_attention_2_table_1_with_and_without_the_fused_kernel(report):
    # Dao 2023, Table 1: GPT-3 1.3B / 2.7B on 8 A100s at 2K and 8K tokens, eager and FlashAttention-2.
    result = {r.row.row_id: r for r in report.results}
    for short, long in (("p267", "p269"), ("p271", "p273"), ("p270", "p272")):  # flash2 1.3B, 2.7B; eager 2.7B
        a, b = result[short], result[long]
        assert abs(a.error) < 0.15 and abs(b.error) < 0.15, (short, long)
        ratio = (b.predicted / a.predicted) / (b.measured / a.measured)
        assert abs(ratio - 1) < 0.10, (short, long, ratio)
    # The eager 1.3B at 8K (p268) is predicted 54 % fast: docs/validation.md says what is known.
    assert 0.4 < result["p268"].error < 0.7 and abs(result["p266"].error) < 0.15


def test_a_row_of_any_name_that_states_its_shape_is_predicted(rows):
    row = dataclasses.replace(rows["p001"], row_id="h1", model_name="Falcon-style 1.2B (ours)")
    plan = row_plan(row).plan
    assert plan is not None
    assert (plan.model.num_layers, plan.model.hidden_size, plan.model.num_heads) == (40, 1536, 16)
    assert plan.model.num_params == row_plan(rows["p001"]).plan.model.num_params
    unshaped = dataclasses.replace(row, num_layers=None)
    assert row_plan(unshaped).reasons == ("model shape not stated: 'Falcon-style 1.2B (ours)' has no preset in "
                                          "data/models and no num_layers",)


@pytest.mark.parametrize("name, preset", [
    ("BLOOM-176B", "bloom-176b"), ("MT-NLG 530B", "mt-nlg-530b"), ("Llama 2 34B", "llama-2-34b"),
    ("Nemotron-4 15B", "nemotron-4-15b"), ("Nemotron-8B", "nemotron-8b"), ("Nemotron-22B", "nemotron-22b"),
    ("Nemotron-340B", "nemotron-4-340b"),
])
def test_named_models_have_cited_presets(name, preset):
    spec = preset_for_name(name)
    assert spec is not None and spec.name == preset and spec.source


def test_nemotron_presets_reproduce_nemos_own_flop_counts(rows):
    # NeMo 24.07 prints TFLOPS and tokens/s per GPU: their ratio is its FLOPs per token, which the
    # preset's shape must give under NeMo's accounting (planner/validation/flops.py).
    for row_id in ("p229", "p230"):
        row, planned = rows[row_id], row_plan(rows[row_id])
        stated = row.measured_tflops_per_gpu * 1e12 / row.measured_tokens_per_s_per_gpu
        assert flops_per_token(planned.plan.model, "nemo", full_recompute=False) == pytest.approx(stated, rel=0.002)


def test_gradient_accumulation_is_the_plans_step(rows):
    # The plan carries the row's 4 micro-batches; its phases are the whole optimizer step.
    planned = row_plan(rows["p162"])
    phases = {"forward": 1.0, "backward": 2.0, "optimizer": 0.5}
    plan = planned.plan
    assert plan.micro_batches_per_step == planned.grad_accumulation == 4
    assert plan.tokens_per_iteration == 4 * plan.micro_batch_per_gpu * plan.num_gpus * plan.model.seq_len
    expected = plan.tokens_per_iteration / 3.5 / plan.num_gpus
    assert predicted_tokens_per_s_per_gpu(planned, phases) == pytest.approx(expected)


@pytest.mark.parametrize("row_id, fragment", [
    ("p262", "no hardware preset for RTX 4090"), ("p033", "sequence length not stated"),
    ("p035", "model shape not stated"), ("p035", "no preset in data/models and no num_layers, hidden_size, num_heads"),
])
def test_rows_the_planner_cannot_express_name_the_missing_feature(report, row_id, fragment):
    r = next(r for r in report.results if r.row.row_id == row_id)
    assert r.error is None and r.predicted is None and fragment in r.reason


def test_filters_and_unknown_filters(report):
    a100 = validate(gpu="a100")
    assert {r.row.gpu_family for r in a100.results} == {"A100"} and a100.summary()["filters"] == {"gpu": "A100"}
    titan = validate(source="torchtitan_perfmd_2408", method="analytic")
    assert {r.row.source_id for r in titan.results} == {"torchtitan_perfmd_2408"} and len(titan.results) == 11
    for kwargs, fragment in (({"source": "mlperf"}, "unknown --source 'mlperf'"), ({"gpu": "MI300X"}, "unknown --gpu 'MI300X'"),
                             ({"source": "megatron2019", "gpu": "A100"}, "unknown --gpu 'A100'"),
                             ({"method": "exact"}, "unknown prediction method 'exact'")):
        with pytest.raises(PlannerError) as err:
            validate(**kwargs)
        assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow  # the scatter chart drawn, about 20 s on 2 cores: CI runs it (`-m slow`)
def test_markdown_scatter_and_docs_section(report, tmp_path):
    text = markdown(report, scatter="s.png")
    assert "### Per GPU type" in text and "### Worst 10 predicted rows" in text and "![" in text
    assert text.count("| p0") + text.count("| p1") + text.count("| p2") >= 274
    png = scatter(report, tmp_path / "s.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    docs = tmp_path / "validation.md"
    docs.write_text("# paper part\n\n" + BEGIN + "\nold\n" + END + "\n\n## Diagnosis by hand\n")
    write_docs(docs, tmp_path / "validation-scatter.png")
    text = docs.read_text()
    assert text.startswith("# paper part\n") and text.endswith("## Diagnosis by hand\n") and "\nold\n" not in text
    assert text.count(BEGIN) == 1 and "## Published training runs" in text
    docs.write_text("# paper part only, as planner.sim.validation writes it\n")
    write_docs(docs, tmp_path / "validation-scatter.png")
    assert docs.read_text().count(END) == 1
