"""FLOP accountings and metric conversions, checked against the formulas and against the corpus's own
rows (a source that prints two metrics fixes its FLOPs per token)."""

import pytest

from planner.specs.errors import PlannerError
from planner.specs.model import ModelSpec
from planner.validation.configure import preset_for_name
from planner.validation.corpus import load_corpus
from planner.validation.flops import accounting_for, flops_per_token, from_tokens_per_s, to_tokens_per_s

GPT = ModelSpec(num_layers=96, hidden_size=12288, num_heads=96, seq_len=2048, vocab_size=51200)


def test_megatron_hardware_flops_are_narayanan_eq3():
    nl, h, s, v = 96, 12288, 2048, 51200
    per_iteration = 96 * 1 * s * nl * h**2 * (1 + s / (6 * h) + v / (16 * nl * h))  # B = 1 sequence
    assert flops_per_token(GPT, "megatron", full_recompute=True) == pytest.approx(per_iteration / s, rel=1e-12)


def test_model_flops_drop_the_recompute_pass():
    nl, h, s, v = 96, 12288, 2048, 51200
    model_per_token = 72 * nl * h**2 * (1 + s / (6 * h) + v / (12 * nl * h))
    assert flops_per_token(GPT, "megatron", full_recompute=False) == pytest.approx(model_per_token, rel=1e-12)
    assert flops_per_token(GPT, "nemo", full_recompute=True) == pytest.approx(model_per_token, rel=1e-12)
    hardware = flops_per_token(GPT, "megatron", full_recompute=True)
    # the recompute pass adds one forward: 2 N_blocks + 4 l h s per token
    assert hardware - model_per_token == pytest.approx(2 * 12 * nl * h**2 + 4 * nl * h * s, rel=1e-12)


def test_bridge_counts_causal_attention_and_6n_counts_every_parameter():
    nl, h, s = 96, 12288, 2048
    nemo = flops_per_token(GPT, "nemo", full_recompute=False)
    assert nemo - flops_per_token(GPT, "bridge", full_recompute=False) == pytest.approx(3 * 2 * nl * h * s)
    assert flops_per_token(GPT, "6n", full_recompute=True) == 6 * GPT.num_params + 12 * nl * h * s
    assert flops_per_token(GPT, "6n", full_recompute=True, num_params=1e9) == 6e9 + 12 * nl * h * s
    with pytest.raises(PlannerError, match="unknown FLOP accounting 'hfu'"):
        flops_per_token(GPT, "hfu", full_recompute=True)


def test_metric_conversions_round_trip():
    per_token, peak = 4.0e11, 989e12
    assert from_tokens_per_s(1000.0, "tokens_per_s_per_gpu", flops_per_token_=per_token, peak_flops_per_s=peak) == 1000.0
    assert from_tokens_per_s(1000.0, "tflops_per_gpu", flops_per_token_=per_token, peak_flops_per_s=peak) == pytest.approx(400.0)
    assert from_tokens_per_s(1000.0, "mfu", flops_per_token_=per_token, peak_flops_per_s=peak) == pytest.approx(400 / 989)
    for metric in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu"):
        value = from_tokens_per_s(1234.0, metric, flops_per_token_=per_token, peak_flops_per_s=peak)
        assert to_tokens_per_s(value, metric, flops_per_token_=per_token, peak_flops_per_s=peak) == pytest.approx(1234.0)
    with pytest.raises(PlannerError, match="unknown metric 'hfu'"):
        from_tokens_per_s(1.0, "hfu", flops_per_token_=1.0, peak_flops_per_s=1.0)


def _row_model(row):
    preset = preset_for_name(row.model_name)
    if row.num_layers is None:
        return preset.replace(seq_len=row.seq_len)
    extra = {} if preset is None else {"num_kv_heads": preset.num_kv_heads, "gated_mlp": preset.gated_mlp,
                                       "tied_embeddings": preset.tied_embeddings}
    return ModelSpec(num_layers=row.num_layers, hidden_size=row.hidden_size, num_heads=row.num_heads,
                     seq_len=row.seq_len, vocab_size=row.vocab_size, ffn_hidden_size=row.ffn_hidden_size or 0, **extra)


@pytest.mark.parametrize("source, rows, rel", [
    ("llmfoundry_bench", None, 0.01),  # every row: TFLOPS / tokens/s is 6N (their params_b) + attention
    ("nemo_2407", ("p224", "p225", "p226", "p227", "p228", "p232", "p233"), 0.002),
    ("megatron_bridge_archive", ("p246", "p247", "p248", "p252", "p253", "p259"), 0.002),
])
def test_accountings_reproduce_the_sources_own_tflops(source, rows, rel):
    checked = 0
    for row in load_corpus():
        if row.source_id != source or (rows and row.row_id not in rows):
            continue
        params = row.params_b * 1e9 if source == "llmfoundry_bench" else None
        per_token = flops_per_token(_row_model(row), accounting_for(source), full_recompute=False, num_params=params)
        implied = row.measured_tflops_per_gpu * 1e12 / row.measured_tokens_per_s_per_gpu
        assert per_token == pytest.approx(implied, rel=rel), row.row_id
        checked += 1
    assert checked == (len(rows) if rows else 173)


def test_torchtitan_mfu_is_6n_against_the_bf16_peak():
    for row in load_corpus():
        if row.source_id == "torchtitan_perfmd_2408" and "float8" not in row.precision:
            per_token = flops_per_token(_row_model(row), "6n", full_recompute=False)
            peak = 989e12 if row.gpu_family == "H100" else 312e12
            mfu = from_tokens_per_s(row.measured_tokens_per_s_per_gpu, "mfu", flops_per_token_=per_token, peak_flops_per_s=peak)
            assert mfu == pytest.approx(row.measured_mfu, rel=0.015), row.row_id
