"""A Hugging Face config.json through the `planner` commands a user runs (fit, memory, simulate)."""

import json
import os
import subprocess
import sys
from pathlib import Path

PUBLISHED = {m["hf_repo"]: m["config"] for m in
             json.loads((Path(__file__).parent / "data" / "hf_configs.json").read_text())["models"]}


def planner(*args):
    # A wide terminal, so the long temporary paths in the model's name are not folded across lines.
    env = {**os.environ, "COLUMNS": "400"}
    proc = subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, timeout=300, env=env)
    return proc.returncode, proc.stdout, proc.stderr


def test_fit_memory_and_simulate_take_a_config_json(tmp_path):
    config = tmp_path / "Qwen2.5-7B" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(PUBLISHED["Qwen/Qwen2.5-7B"]))
    plan_path = tmp_path / "plan.json"
    code, out, err = planner("fit", str(config), "--gpus", "8", "--seq", "4096", "--out", str(plan_path))
    assert code == 0, err
    assert "Qwen2.5-7B/config.json (qwen2)" in out and "7.62 B params" in out and "planned at" not in out
    assert "assumed seq" not in err  # --seq given
    plan = json.loads(plan_path.read_text())
    # Transformers builds 7,615,616,512 parameters from this config (tests/test_planner_hf.py).
    assert plan["model"]["num_params"] == 7_615_616_512 and plan["model"]["seq_len"] == 4096
    assert plan["model"]["qkv_bias"] is True and plan["model"]["norm"] == "rmsnorm"
    code, out, err = planner("simulate", str(plan_path), "--json")
    assert code == 0, err
    assert json.loads(out)["model"] == plan["model"]
    code, out, err = planner("memory", str(config), "--gpus", "8", "--json")
    assert code == 0, err
    assert f"model file {config} (qwen2): assumed seq 8192: the config's context is 131072 tokens" in err
    assert json.loads(out)["model"]["num_params"] == 7_615_616_512


def test_a_size_says_which_published_model_it_plans():
    code, out, err = planner("memory", "70B", "--gpus", "8")
    assert code == 0, err
    assert "llama-3.1-70b (nearest published model to 70B): 80 layers x hidden 8192" in out
    assert "70.55 B params" in out


def test_a_tiny_model_prints_its_count_in_a_fitting_unit():
    code, out, err = planner("memory", "--layers", "2", "--hidden", "256", "--heads", "2", "--gpus", "1")
    assert code == 0, err
    assert "1.57 M params" in out and "0.00 B" not in out


def test_models_lists_the_published_presets_with_their_sources():
    code, out, err = planner("models")
    assert code == 0, err
    for name in ("llama-3.1-405b", "qwen2.5-72b", "mistral-7b-v0.3", "paper-1t", "gpt3-175b"):
        assert name in out
    assert "125.23 M" in out  # gpt3-125m, was "0.12 B"


def test_an_unsupported_config_is_one_line(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "num_hidden_layers": 2}))
    code, out, err = planner("fit", str(path))
    assert code == 1 and err.count("\n") == 1 and "model_type 'mixtral' is not supported" in err
