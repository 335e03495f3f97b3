"""Model specs: the paper's shapes resolve exactly, shorthands follow the documented rule."""

import json

import pytest

from planner.catalog import model_presets, parse_param_count, resolve_model, shape_for_params
from planner.errors import PlannerError
from planner.model import ModelSpec

K = 1024

# METHOD.md §5: memory-requirement configs and the strategy/experiment configs (layers, hd, heads).
PAPER_SHAPES = {
    "0.1T": (80, 10 * K, 128),
    "0.5T": (100, 20 * K, 160),
    "1T": (128, 25 * K, 256),
    "10T": (195, 64 * K, 512),
    "100T": (315, 160 * K, 1024),
    "1.4B": (40, 1536, 16),
    "10B": (50, 4 * K, 16),
    "13b": (64, 4 * K, 16),
    "20B": (98, 4 * K, 32),
    "70B": (125, 8 * K, 32),
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
    # GPT-3 175B (Brown et al. Table 2.1): 96 x 12288 + 50257-token tied embedding.
    assert resolve_model("175B").num_params == 96 * 12 * 12288**2 + 50257 * 12288 == 174_563_733_504
    # Llama 2 7B and Llama 3 8B parameter counts as released (6.74 B, 8.03 B).
    assert resolve_model("llama-2-7b").num_params == 6_738_149_376
    assert resolve_model("llama-3-8b").num_params == 8_029_995_008
    assert round(resolve_model("llama-3-405b").num_params / 1e9, 1) == 405.8
    assert len(model_presets()) >= 30


def test_shorthand_parsing():
    assert parse_param_count("1T") == 10**12
    assert parse_param_count("0.5T") == 5 * 10**11
    assert parse_param_count("13b") == 13 * 10**9
    assert parse_param_count("1.4B") == 1_400_000_000
    assert parse_param_count("1Q") is None
    assert parse_param_count("T") is None


def test_shape_rule_for_other_sizes():
    spec = resolve_model("3B")
    # hd = (128 * 3e9 / 12)^(1/3) = 3174.8 -> 3200; nl = round(3e9 / (12 * 3200^2)) = 24; heads = 25
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.vocab_size) == (24, 3200, 25, 0)
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
