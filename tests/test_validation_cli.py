"""`planner validate` as a user runs it: a thin adapter over planner.validation."""

import json
import os
import subprocess
import sys

import pytest

from planner.validation.report import ROW_KEYS


def planner(*args):
    env = {**os.environ, "COLUMNS": "200"}  # wide enough that group titles are not folded
    proc = subprocess.run([sys.executable, "-m", "tierwise", "validate", *args], capture_output=True, text=True,
                          timeout=180, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def test_json_for_one_source_and_a_markdown_report(tmp_path):
    out = tmp_path / "report.md"
    code, stdout, err = planner("--source", "torchtitan_perfmd_2408", "--json", "--out", str(out))
    assert code == 0, err
    doc = json.loads(stdout)
    assert set(doc) == {"rows", "summary"} and len(doc["rows"]) == 11
    assert all(tuple(row) == ROW_KEYS for row in doc["rows"])
    assert doc["summary"]["filters"] == {"source": "torchtitan_perfmd_2408"}
    for row in doc["rows"]:
        assert (row["error"] is None) == (row["predicted"] is None)
        if row["error"] is not None:
            assert row["error"] == pytest.approx(row["predicted"] / row["measured"] - 1)
    text = out.read_text()
    assert "### Per GPU type" in text and "p213" in text


def test_tables_for_one_gpu_type():
    code, stdout, err = planner("--gpu", "v100")
    assert code == 0, err
    assert "Per GPU type" in stdout and "V100 / megatron2019" in stdout and "A100" not in stdout


@pytest.mark.parametrize("args, needle", [
    (("--source", "mlperf"), "unknown --source 'mlperf'"),
    (("--gpu", "MI300X"), "unknown --gpu 'MI300X'"),
])
def test_unknown_filters_are_refused_in_one_line(args, needle):
    code, stdout, err = planner(*args)
    assert code == 1 and stdout == ""
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1


def test_a_malformed_corpus_is_refused_in_one_line(tmp_path):
    bad = tmp_path / "runs.csv"
    bad.write_text("row_id,source_id\np001,x\n")
    code, _, err = planner("--corpus", str(bad))
    assert code == 1 and "missing column" in err and str(bad) in err and err.count("\n") == 1
