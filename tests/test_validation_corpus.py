"""The published-runs corpus: bundled, read strictly, no row dropped, bad files refused in one line."""

import csv
from pathlib import Path

import pytest

from planner.specs.errors import PlannerError
from planner.validation.corpus import (
    COLUMNS,
    MEASURED,
    OPTIONAL_COLUMNS,
    default_corpus_path,
    gpu_family,
    load_corpus,
)

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "data" / "validation" / "published_runs.csv"


def _raw_rows():
    with BUNDLED.open(encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_bundled_corpus_loads_every_row_in_order():
    rows = load_corpus()
    raw = _raw_rows()
    assert len(rows) == len(raw) == 274
    assert [r.row_id for r in rows] == [r["row_id"] for r in raw]
    assert len({r.row_id for r in rows}) == 274


def test_every_measured_value_is_read_unchanged():
    for row, raw in zip(load_corpus(), _raw_rows(), strict=True):
        for column in MEASURED:
            expected = float(raw[column]) if raw[column] else None
            assert getattr(row, column) == expected, (row.row_id, column)
        assert any(getattr(row, c) is not None for c in MEASURED)
        assert row.citation == raw["citation"] and row.source_id == raw["source_id"]


def test_typed_fields_and_families():
    rows = {r.row_id: r for r in load_corpus()}
    p001 = rows["p001"]
    assert (p001.num_layers, p001.hidden_size, p001.seq_len, p001.num_gpus) == (40, 1536, 1024, 1)
    assert p001.ffn_hidden_size is None and p001.measured_mfu == 0.3 and p001.gpu_family == "V100"
    assert rows["p036"].gpu_family == "H100" and rows["p036"].sharding == "fsdp"
    assert rows["p262"].gpu_family == "RTX 4090" and rows["p262"].is_offload
    assert sum(r.is_offload for r in rows.values()) == 4


def test_the_installed_package_finds_the_corpus():
    assert Path(str(default_corpus_path())).resolve() == BUNDLED.resolve()
    setup = (ROOT / "setup.py").read_text()
    assert '"*.csv"' in setup  # data/validation ships as planner._data.validation


def _write(tmp_path, rows, header=None):
    path = tmp_path / "runs.csv"
    header = header or list(COLUMNS)
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=header, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def _refused(path, *fragments):
    with pytest.raises(PlannerError) as err:
        load_corpus(path)
    message = str(err.value)
    assert "\n" not in message
    for fragment in (str(path), *fragments):
        assert fragment in message, message
    return message


def test_missing_column_is_refused(tmp_path):
    header = [c for c in COLUMNS if c != "micro_batch"]
    _refused(_write(tmp_path, _raw_rows()[:3], header), "missing column", "micro_batch")


@pytest.mark.parametrize("row, column, value", [
    (1, "measured_tflops_per_gpu", "37,05"),  # a number
    (2, "num_gpus", "4.5"),  # a count
    (0, "gpu_type", "MI300X"),  # a GPU type
])
def test_bad_value_is_refused(tmp_path, row, column, value):
    rows = _raw_rows()[:3]
    rows[row][column] = value
    _refused(_write(tmp_path, rows), f"row p00{row + 1}", column, repr(value))


def test_unknown_choice_and_missing_measurement_are_refused(tmp_path):
    rows = _raw_rows()[:2]
    rows[0]["sharding"] = "zero4"
    _refused(_write(tmp_path, rows), "row p001", "sharding", "'zero4'")
    rows = _raw_rows()[:2]
    for column in MEASURED:
        rows[1][column] = ""
    _refused(_write(tmp_path, rows), "row p002", "measured")


def test_duplicate_row_and_fraction_over_one_are_refused(tmp_path):
    rows = _raw_rows()[:2]
    rows[1]["row_id"] = "p001"
    _refused(_write(tmp_path, rows), "row p001", "appears twice")
    rows = _raw_rows()[:2]
    rows[0]["measured_mfu"] = "30"
    _refused(_write(tmp_path, rows), "row p001", "measured_mfu", "fraction")


def test_unreadable_file_is_refused(tmp_path):
    _refused(tmp_path / "absent.csv", "cannot read corpus")


def test_gpu_family_parsing():
    assert gpu_family("H100 (SXM, HBM2e ~94-95GB, lower TDP)") == "H100"
    assert gpu_family("A100") == "A100"
    with pytest.raises(PlannerError, match="A1000"):
        gpu_family("A1000")


def test_any_unique_row_id_is_accepted(tmp_path):
    rows = _raw_rows()[:3]
    for row, row_id in zip(rows, ("h001", "run 7/b", "Llama-70B@512"), strict=True):
        row["row_id"] = row_id
    assert [r.row_id for r in load_corpus(_write(tmp_path, rows))] == ["h001", "run 7/b", "Llama-70B@512"]
    rows[2]["row_id"] = "h001"
    _refused(_write(tmp_path, rows), "row h001", "appears twice")
    rows[2]["row_id"] = " "
    _refused(_write(tmp_path, rows), "row_id", "empty")


def test_attention_is_a_column_of_the_row(tmp_path):
    rows = {r.row_id: r for r in load_corpus()}
    # One source measured the same model with and without FlashAttention-2 (Dao 2023, Table 1).
    assert [rows[f"p{n}"].attention for n in range(266, 274)] == ["eager", "flash2"] * 4
    assert rows["p274"].attention == "eager" and rows["p036"].attention == "flash"
    assert {r.attention for r in rows.values()} == {"", "eager", "flash", "flash2"}
    raw = _raw_rows()[:2]
    raw[0]["attention"] = "flash3"
    _refused(_write(tmp_path, raw), "row p001", "attention", "'flash3'")


def test_a_corpus_without_the_optional_columns_still_loads(tmp_path):
    assert set(OPTIONAL_COLUMNS) == {"attention", "shard_collectives", "recompute_block_period"}
    header = [c for c in COLUMNS if c not in OPTIONAL_COLUMNS]
    rows = load_corpus(_write(tmp_path, _raw_rows()[:3], header))
    assert [r.attention for r in rows] == ["", "", ""]
    assert [r.shard_collectives for r in rows] == ["", "", ""]
    assert [r.recompute_block_period for r in rows] == [None, None, None]


def test_torchtitan_rows_name_their_checkpointing_policy(tmp_path):
    """torchtitan's "selective layer" rows recompute every 2nd block, its "selective op" rows are op-level;
    a period is stated exactly with every_nth_block."""
    rows = {r.row_id: r for r in load_corpus(BUNDLED)}
    kinds = {r.row_id: (r.activation_recompute, r.recompute_block_period) for r in rows.values()
             if r.activation_recompute in ("every_nth_block", "op_level")}
    assert kinds == {"p211": ("every_nth_block", 2), "p215": ("every_nth_block", 2), **{
        row: ("op_level", None) for row in ("p209", "p210", "p212", "p216", "p217")}}
    raw = _raw_rows()[:2]
    raw[0]["activation_recompute"] = "every_nth_block"
    _refused(_write(tmp_path, raw), "row p001", "recompute_block_period")
    raw[0]["recompute_block_period"] = "3"
    assert load_corpus(_write(tmp_path, raw))[0].recompute_block_period == 3
    raw[1]["recompute_block_period"] = "3"
    _refused(_write(tmp_path, raw), "row p002", "recompute_block_period")


def test_the_shard_collectives_column():
    """DeepSpeed's 2021 ZeRO-3 rows gather per parameter; every FSDP row gathers flat units; rows that
    shard no parameters leave it empty."""
    rows = {r.row_id: r for r in load_corpus(BUNDLED)}
    per_parameter = {r.row_id for r in rows.values() if r.shard_collectives == "per_parameter"}
    assert per_parameter == {f"p0{n}" for n in range(21, 27)}
    assert all(r.shard_collectives == "flat" for r in rows.values() if r.sharding == "fsdp")
    assert all(r.shard_collectives == "" for r in rows.values() if r.sharding not in ("zero3", "fsdp"))


def test_an_unknown_shard_collectives_value_is_refused(tmp_path):
    raw = _raw_rows()[:2]
    raw[0]["shard_collectives"] = "per_bucket"
    _refused(_write(tmp_path, raw), "row p001", "shard_collectives", "'per_bucket'")
