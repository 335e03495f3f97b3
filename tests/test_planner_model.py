"""Model specs: the paper's shapes resolve exactly, shorthands mean their size (catalog notes)."""

import json

import pytest

from planner.specs.catalog import (
    SIZE_TOLERANCE,
    model_presets,
    parse_param_count,
    published_presets,
    resolve_model,
    shape_for_params,
)
from planner.specs.errors import PlannerError
from planner.specs.model import ModelSpec, format_param_count

K = 1024

# docs/method.md §5: memory-requirement configs and the strategy/experiment configs (layers, hd, heads).
PAPER_SHAPES = {
    "0.1T": (80, 10 * K, 128),
    "0.5T": (100, 20 * K, 160),
    "1T": (128, 25 * K, 256),
    "10T": (195, 64 * K, 512),
    "100T": (315, 160 * K, 1024),
    "paper-1.4b": (40, 1536, 16),
    "10B": (50, 4 * K, 16),
    "13b": (64, 4 * K, 16),
    "20B": (98, 4 * K, 32),
    "paper-70b": (125, 8 * K, 32),
    "1000B": (128, 25600, 256),
    "50B": (62, 8 * K, 64),
    "100B": (125, 8 * K, 64),
    "5T": (174, 48 * K, 384),
    "20T": (205, 88 * K, 704),
}


@pytest.mark.parametrize("size,shape", PAPER_SHAPES.items())
def test_paper_sizes_resolve_to_the_papers_shapes(size, shape):
    spec = resolve_model(size)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == shape
    assert spec.seq_len == 1024
    # Embeddings are ignored as in eq. 1, so the parameter count is exactly 12 nl hd^2.
    assert spec.num_params == spec.num_params_eq1 == 12 * shape[0] * shape[1] ** 2


def test_experiment_variants_are_presets():
    assert (resolve_model("paper-0.5t-exp").num_layers, resolve_model("paper-0.5t-exp").hidden_size) == (124, 18 * K)
    assert (resolve_model("paper-10t-exp").num_layers, resolve_model("paper-10t-exp").hidden_size) == (200, 64 * K)


def test_eq1_counts_the_four_block_linears():
    spec = ModelSpec(num_layers=2, hidden_size=64, num_heads=4)
    assert [op.num_params for op in spec.block_operators()] == [64 * 192, 64 * 64, 64 * 256, 256 * 64]
    assert spec.num_params == 12 * 2 * 64**2
    assert spec.largest_operator_params == 4 * 64**2


def test_published_preset_sizes():
    # GPT-3 175B (Brown et al. Table 2.1) on GPT-2's architecture: 96 blocks of 12 hd^2 weights plus
    # 13 hd of biases and LayerNorms, a 50257-token tied embedding, 2048 learned positions, final norm.
    hd = 12288
    assert resolve_model("175B").num_params == 96 * (12 * hd**2 + 13 * hd) + (50257 + 2048 + 2) * hd == 174_604_259_328
    # Llama 2 7B and Llama 3 8B as transformers builds them (RMSNorm weights included): 6.74 B, 8.03 B.
    assert resolve_model("llama-2-7b").num_params == 6_738_415_616
    assert resolve_model("llama-3-8b").num_params == 8_030_261_248
    assert round(resolve_model("llama-3-405b").num_params / 1e9, 1) == 405.9
    assert len(model_presets()) >= 38


def test_shorthand_parsing():
    assert parse_param_count("1T") == 10**12
    assert parse_param_count("0.5T") == 5 * 10**11
    assert parse_param_count("13b") == 13 * 10**9
    assert parse_param_count("1.4B") == 1_400_000_000
    assert parse_param_count("1Q") is None
    assert parse_param_count("T") is None


def test_shape_rule_for_other_sizes():
    spec = resolve_model("3B")
    # hd = (128 * 3e9 / 12)^(1/3) = 3174.8 -> 3072 (512s below 4096); nl = round(3e9 / (12 * 3072^2)) = 26
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.vocab_size) == (26, 3072, 24, 0)
    assert "shape rule" in spec.name and "3B" in spec.name
    big = shape_for_params(2 * 10**12, label="2T")
    assert big.hidden_size % 1024 == 0
    assert abs(big.num_params / 2e12 - 1) < 0.05


def test_explicit_shape_overrides():
    spec = resolve_model(None, layers=4, hidden=256, heads=8, seq=128)
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.seq_len) == (4, 256, 8, 128)
    widened = resolve_model("1T", seq=2048)
    assert widened.seq_len == 2048 and widened.hidden_size == 25 * K


def test_model_json_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps({"name": "mine", "num_layers": 2, "hidden_size": 128, "num_heads": 2, "vocab_size": 1000}))
    spec = resolve_model(str(path))
    assert spec.num_params == 2 * 12 * 128**2 + 1000 * 128


@pytest.mark.parametrize(
    "doc,message",
    [
        ({"num_layers": -2, "hidden_size": 128, "num_heads": 2}, "num_layers must be at least 1"),
        ({"num_layers": 2, "hidden_size": 100, "num_heads": 3}, "not divisible"),
        ({"num_layers": 2, "hidden_size": 128, "num_heads": 2, "hiden": 4}, "unknown key"),
        ({"num_layers": "two", "hidden_size": 128, "num_heads": 2}, "must be a number"),
        ({"num_layers": 2.5, "hidden_size": 128, "num_heads": 2}, "whole number"),
        ({"num_layers": 2, "hidden_size": 1e300, "num_heads": 2}, "too large"),
        ({"hidden_size": 128, "num_heads": 2}, "missing required key"),
        ({"num_layers": 2, "hidden_size": 128, "num_heads": 2, "num_params": 5}, "does not match"),
        ({"num_layers": 2, "hidden_size": 128, "num_heads": 2, "norm": "batchnorm"}, "norm must be one of"),
        ({"num_layers": 2, "hidden_size": 128, "num_heads": 2, "qkv_bias": 1}, "true or false"),
        ({"num_layers": 2, "hidden_size": 128, "num_heads": 2, "head_dim": -4}, "head_dim must be at least 0"),
    ],
)
def test_bad_model_documents(doc, message):
    with pytest.raises(PlannerError, match=message):
        ModelSpec.from_dict(doc)


def test_unknown_model_name():
    with pytest.raises(PlannerError, match="unknown model '1Q'"):
        resolve_model("1Q")
    with pytest.raises(PlannerError, match="does not exist"):
        resolve_model("missing.json")


# -- size shorthands mean that size ([Note: size shorthands]) ---------------------------------------


@pytest.mark.parametrize("name", sorted(model_presets()))
def test_every_alias_is_about_its_presets_size(name):
    spec, aliases = model_presets()[name]
    for alias in aliases:
        count = parse_param_count(alias)
        if count is not None:
            assert abs(spec.num_params / count - 1) <= SIZE_TOLERANCE, (alias, name, spec.num_params)


@pytest.mark.parametrize(
    "size,preset",
    [("70B", "llama-3.1-70b"), ("8B", "llama-3.1-8b"), ("405B", "llama-3.1-405b"), ("7B", "mistral-7b-v0.3"),
     ("14B", "qwen2.5-14b"), ("32B", "qwen2.5-32b"), ("72b", "qwen2.5-72b")],
)
def test_a_size_near_a_published_model_is_that_model_and_says_so(size, preset):
    spec = resolve_model(size)
    assert spec.name == f"{preset} (nearest published model to {size})"
    assert spec.num_params == model_presets()[preset][0].num_params
    assert abs(spec.num_params / parse_param_count(size) - 1) <= SIZE_TOLERANCE


@pytest.mark.parametrize(
    "size,preset,layers",
    [("1T", "paper-1t", 128), ("0.5T", "paper-0.5t", 100), ("13b", "paper-13b", 64), ("175B", "gpt3-175b", 96)],
)
def test_sizes_the_paper_and_gpt3_name_keep_their_configuration(size, preset, layers):
    # Unchanged by the nearest-model rule: each alias is its configuration's own label and within 10%.
    spec = resolve_model(size)
    assert (spec.name, spec.num_layers) == (preset, layers)


def test_the_papers_mislabelled_sizes_mean_their_size_now():
    # The paper's "70B" and "1.4B" shapes have 100.7 B and 1.13 B parameters: reachable by name only.
    assert resolve_model("paper-70b").num_params == 100_663_296_000
    assert resolve_model("paper-1.4b").num_params == 1_132_462_080
    small = resolve_model("1.4B")
    assert "shape rule" in small.name and abs(small.num_params / 1.4e9 - 1) < 0.02
    for size in ("70B", "1.4B", "3B", "7B", "65B", "2T", "125M"):
        assert abs(resolve_model(size).num_params / parse_param_count(size) - 1) <= SIZE_TOLERANCE, size


def test_nearest_published_model_needs_to_be_within_the_tolerance():
    # 50 B: Qwen2.5 32B and Llama 3.1 70B are both more than 10% away, so the shape rule sizes it.
    spec = resolve_model("50B")
    assert spec.name == "paper-50b"  # the paper's own 50B label (49.9 B) comes first
    spec = resolve_model("45B")
    assert "shape rule" in spec.name and abs(spec.num_params / 45e9 - 1) < 0.03
    assert all(abs(p.num_params / 45e9 - 1) > SIZE_TOLERANCE for p in published_presets())


@pytest.mark.parametrize("size", ["7B", "7b", "3B", "8.5B", "14.3B", "30B", "1B", "350M", "125M", "60M", "2T"])
def test_shape_rule_heads_divide_the_width_and_every_tensor_parallel_degree(size):
    count = parse_param_count(size)
    spec = shape_for_params(count, label=size)
    assert spec.hidden_size == 128 * spec.num_heads  # head dim 128
    degrees = (1, 2, 4, 8) if spec.hidden_size >= 4096 else (1, 2, 4) if spec.hidden_size >= 512 else (1,)
    assert all(spec.num_heads % mp == 0 for mp in degrees), (size, spec.num_heads)
    assert abs(spec.num_params / count - 1) < 0.05


def test_shape_rule_7b_is_32_heads_not_33():
    spec = shape_for_params(7 * 10**9, label="7b")
    assert (spec.num_layers, spec.hidden_size, spec.num_heads) == (35, 4096, 32)


# -- exact counts and their documents --------------------------------------------------------------


def test_extra_fields_default_to_the_papers_count():
    plain = ModelSpec(num_layers=2, hidden_size=64, num_heads=4, vocab_size=10)
    assert plain.num_vector_params_per_block == 0 and plain.num_params == 2 * 12 * 64**2 + 10 * 64
    assert set(plain.to_dict()) == {"name", "num_params", "num_params_eq1", "num_layers", "hidden_size", "num_heads",
                                    "seq_len", "vocab_size", "ffn_hidden_size", "num_kv_heads", "gated_mlp",
                                    "tied_embeddings"}


def test_biases_norms_positions_and_head_dim_are_counted():
    # GPT-2 small, by hand: 12 x (12 hd^2 + 13 hd) + (50257 + 1024) hd + 2 hd = 124,439,808 (transformers).
    gpt2 = ModelSpec(num_layers=12, hidden_size=768, num_heads=12, vocab_size=50257, qkv_bias=True,
                     attn_out_bias=True, mlp_bias=True, norm="layernorm", position_embeddings=1024)
    assert gpt2.num_params == 124_439_808
    # Gemma-style head_dim apart from hidden/heads: q is 4 x 32 = 128 wide on a 96-wide model.
    gemma = ModelSpec(num_layers=1, hidden_size=96, num_heads=4, num_kv_heads=2, head_dim=32, ffn_hidden_size=64,
                      gated_mlp=True, norm="rmsnorm", norms_per_block=4)
    assert [op.num_params for op in gemma.block_operators()] == [96 * (128 + 2 * 64), 128 * 96, 96 * 64, 96 * 64, 64 * 96]
    assert gemma.num_params == sum(op.num_params for op in gemma.block_operators()) + 4 * 96 + 96
    again = ModelSpec.from_dict(gemma.to_dict())
    assert again == gemma and again.to_dict()["head_dim"] == 32


def test_replace_derives_default_widths_again():
    spec = resolve_model("1T", hidden=1024, heads=8)
    assert (spec.ffn_hidden_size, spec.num_kv_heads, spec.head_dim) == (4096, 8, 128)
    gqa = resolve_model("llama-3-8b", layers=2)
    assert (gqa.ffn_hidden_size, gqa.num_kv_heads, gqa.norm) == (14336, 8, "rmsnorm")


@pytest.mark.parametrize(
    "count,text",
    [(0, "0"), (999, "999"), (196_608, "196.61 K"), (124_439_808, "124.44 M"), (1_132_462_080, "1.13 B"),
     (1_006_632_960_000, "1,006.63 B")],
)
def test_param_counts_print_with_a_fitting_unit(count, text):
    assert format_param_count(count) == text
