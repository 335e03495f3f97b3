"""The `planner` CLI as a user runs it: real processes, real exit codes, one-line errors."""

import json
import subprocess
import sys

import pytest

from planner.specs.catalog import resolve_hardware


def planner(*args, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "tierwise", *args], capture_output=True, text=True, cwd=cwd, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def test_fit_1t_on_16_gpus_prints_a_plan():
    code, out, err = planner("fit", "1T", "--gpus", "16")
    assert code == 0, err
    for text in ("Verdict: fits", "dgx-h100", "Memory per tier", "TFLOPS per GPU", "bottleneck", "Runner-up plans",
                 "8 x tokens x params"):
        assert text in out


@pytest.fixture(scope="module")
def papers_fit(tmp_path_factory):
    """`planner fit 1T --gpus 16 --hardware dgx2-v100 --json` (the paper's configuration, one of the longest
    searches), also writing the plan and the DeepSpeed config: run once per test process for the tests
    that read its document, since writing the files does not change what is printed."""
    directory = tmp_path_factory.mktemp("papers-fit")
    out_path, ds_path = directory / "plan.json", directory / "ds.json"
    code, out, err = planner("fit", "1T", "--gpus", "16", "--hardware", "dgx2-v100", "--json",
                             "--out", str(out_path), "--deepspeed-config", str(ds_path))
    return code, out, err, out_path, ds_path


def test_fit_json_follows_the_contract(papers_fit):
    code, out, err, out_path, ds_path = papers_fit
    assert code == 0, err
    doc = json.loads(out)
    assert doc == json.loads(out_path.read_text())
    assert doc["model"]["num_params"] == 12 * 128 * 25600**2
    assert set(doc["placement"]) == {"params", "gradients", "optimizer_states", "recompute_inputs"}
    assert doc["num_gpus"] == 16 and doc["num_nodes"] == 1
    pred = doc["prediction"]
    assert pred["feasible"] is True
    for key in ("iteration_time_s", "tflops_per_gpu", "tokens_per_s", "bottleneck"):
        assert key in pred
    assert set(pred["peak_bytes"]) == {"gpu", "cpu", "nvme"}
    assert set(pred["phase_time_s"]) == {"forward", "backward", "optimizer"}
    assert set(pred["link_bytes"]) == {"nvme_read", "nvme_write", "h2d", "d2h", "all_gather", "reduce_scatter"}
    assert json.loads(ds_path.read_text())["zero_optimization"]["stage"] == 3


def test_fit_that_does_not_fit_is_a_successful_answer():
    code, out, err = planner("fit", "100T", "--gpus", "1", "--hardware", "h200-x1", "--json")
    assert code == 0, err
    assert json.loads(out)["prediction"]["feasible"] is False
    code, out, _ = planner("fit", "100T", "--gpus", "1", "--hardware", "h200-x1")
    assert code == 0 and "does not fit" in out


def test_memory_json_keys():
    code, out, err = planner("memory", "1T", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["bytes"]["model_states"] == 240 * 128 * 25600**2
    for key in ("recompute_inputs_per_gpu", "activations_per_gpu", "mswm_per_gpu", "awm_per_gpu"):
        assert key in doc["bytes"]
    assert doc["model"]["num_layers"] == 128


def test_memory_with_explicit_shape_and_placement():
    code, out, err = planner("memory", "--layers", "2", "--hidden", "256", "--heads", "4", "--seq", "128",
                             "--placement", "params=cpu,gradients=cpu,optimizer_states=cpu")
    assert code == 0, err
    assert "model_states" in out and "optimizer_states" in out


def test_max_size_json():
    code, out, err = planner("max-size", "--strategy", "zero-inf-nvme", "--gpus", "16", "--hardware", "dgx2-v100", "--json")
    assert code == 0, err
    doc = json.loads(out)
    # ZeRO-Infinity's headline: more than a trillion parameters on one DGX-2 node.
    assert doc["max_params"] > 10**12
    code, out, _ = planner("max-size", "--strategy", "zero3", "--gpus", "16", "--hardware", "dgx2-v100", "--json")
    assert code == 0 and 10**10 < json.loads(out)["max_params"] < 10**11


def _hardware_file(tmp_path, **changes):
    doc = resolve_hardware("dgx-h100").to_dict()
    doc.update(changes)
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.mark.parametrize(
    "args,needle",
    [
        (("fit", "1Q", "--gpus", "16"), "unknown model '1Q'"),
        (("fit", "1T", "--gpus", "0"), "--gpus must be at least 1, got 0"),
        (("fit", "1T", "--gpus", "16", "--hardware", "nosuch"), "unknown hardware 'nosuch'"),
        (("fit", "1T", "--gpus", "12"), "not a whole number of dgx-h100 nodes"),
        (("fit", "1T", "--placement", "params=disk"), "is not STATE=TIER"),
        (("fit", "1T", "--strategy", "zero9"), "unknown strategy 'zero9'"),
        (("fit", "1T", "--precision", "fp8"), "--precision must be one of"),
        (("memory", "1T", "--recompute-interval", "-1"), "recompute_interval must be at least 0"),
        (("max-size", "--strategy", "nope"), "unknown strategy 'nope'"),
        (("memory", "1T", "--strategy", "nope"), "unknown strategy 'nope'"),
        (("fit", "1T", "--model-parallel", "two"), "--model-parallel must be a whole number or 'auto', got 'two'"),
        (("memory", "1T", "--model-parallel", "two"), "--model-parallel must be a whole number or 'auto', got 'two'"),
        (("memory", "1T", "--model-parallel", "0"), "--model-parallel must be at least 1, got 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_1(args, needle):
    code, out, err = planner(*args)
    assert code == 1
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_memory_model_parallel_auto_bills_the_degree_the_search_ranks_first():
    # 1T on NVMe at batch 14 on one DGX-2: tensor parallel 1 does not fit the V100s' 32 GB, the larger
    # degrees do, so auto is the feasible one with the most tokens/s. (At batch 4 on DGX H100s every
    # degree fits and 1 wins: with hierarchical rings, planner/cost/collectives.py, tensor parallelism only
    # adds all-reduces there.)
    args = ("memory", "1T", "--gpus", "16", "--hardware", "dgx2-v100", "--strategy", "zero-inf-nvme", "--batch-per-gpu",
            "14", "--json")
    by_degree = {}
    for degree in ("1", "2", "4", "8"):
        code, out, err = planner(*args, "--model-parallel", degree)
        assert code == 0, err
        by_degree[int(degree)] = json.loads(out)["plan"]["prediction"]["tokens_per_s"]
    code, out, err = planner(*args, "--model-parallel", "auto")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["plan"]["model_parallel_degree"] == max(by_degree, key=by_degree.get) != 1
    assert doc["feasible"] is True


def test_malformed_model_json(tmp_path):
    bad = tmp_path / "model.json"
    bad.write_text('{"num_layers": 2, "hidden_size": ')
    code, _, err = planner("fit", str(bad), "--gpus", "1")
    assert code == 1 and "is not valid json" in err and len(err.strip().splitlines()) == 1


def test_negative_bandwidth_in_hardware_file(tmp_path):
    path = _hardware_file(tmp_path, nvme_read_gb_per_s=-3)
    code, _, err = planner("fit", "1T", "--gpus", "16", "--hardware", path)
    assert code == 1 and "nvme_read_gb_per_s must be at least 0, got -3" in err


def test_unwritable_output_path(tmp_path):
    code, _, err = planner("fit", "1.4B", "--gpus", "1", "--hardware", "h200-x1", "--out", str(tmp_path / "no" / "p.json"))
    assert code == 1 and "cannot write plan" in err


def test_usage_errors_exit_2():
    code, _, _ = planner("fit", "1T", "--gpus", "many")
    assert code == 2


def test_lists():
    code, out, _ = planner("models")
    assert code == 0 and "paper-1t" in out and "llama-3-70b" in out
    code, out, _ = planner("hardware", "dgx2-v100")
    assert code == 0 and "paper" in out and "estimate" in out


def test_fit_json_of_the_papers_configuration_gains_only_the_pipeline_and_fp8_fields(papers_fit):
    code, out, err, _, _ = papers_fit
    assert code == 0, err
    doc = json.loads(out)
    assert (doc["pipeline_parallel_degree"], doc["pipeline_virtual_stages"], doc["micro_batches_per_step"],
            doc["fp8_matmuls"]) == (1, 1, 1, False)
    assert doc["strategy"] != "3d" and "pipeline" not in doc["prediction"]["details"]


def test_fit_strategy_3d_searches_tensor_and_pipeline_degrees():
    code, out, err = planner("fit", "llama-3-70b", "--gpus", "64", "--strategy", "3d", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["strategy"] == "3d" and doc["prediction"]["feasible"] is True
    assert set(doc["placement"].values()) == {"gpu"}
    tp, pp, m = doc["model_parallel_degree"], doc["pipeline_parallel_degree"], doc["micro_batches_per_step"]
    assert 64 % (tp * pp) == 0 and pp > 1 and m == 4 * pp
    pipeline = doc["prediction"]["details"]["pipeline"]
    assert pipeline["stages"] == pp and pipeline["bubble_fraction"] == pytest.approx((pp - 1) / m)
    code, out, err = planner("fit", "llama-3-70b", "--gpus", "64", "--strategy", "3d", "--model-parallel", "8",
                             "--pipeline-parallel", "4", "--micro-batches", "32")
    assert code == 0, err
    assert "model parallel 8 | pipeline 4 | 32 micro-batches/step" in " ".join(out.split())
    code, out, err = planner("fit", "llama-3-70b", "--gpus", "64", "--strategy", "3d", "--pipeline-parallel", "two")
    assert code == 1 and "--pipeline-parallel must be a whole number or 'auto', got 'two'" in err


def test_max_size_3d():
    code, out, err = planner("max-size", "--strategy", "3d", "--gpus", "16", "--hardware", "dgx2-v100", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["max_params"] > 10**10 and doc["plan"]["strategy"] == "3d"


def test_each_verb_module_registers_the_command_named_as_it_is():
    import typer.main

    from tierwise.cli import VERBS, build_app

    for verb in VERBS:
        assert list(typer.main.get_command(build_app((verb,))).commands) == [verb.replace("_", "-")]
    assert list(typer.main.get_command(build_app()).commands) == [verb.replace("_", "-") for verb in VERBS]


def test_a_command_imports_its_own_verb_only():
    # `planner fit` starts without the other verbs' modules, the calibration code, YAML or pydantic
    # (typer below 0.29 reads the options: pyproject.toml).
    code = ("import sys; sys.argv = ['planner', 'fit', '1T', '--gpus', '0']\n"
            "from tierwise.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in sys.modules if m.startswith('tierwise.cli.')),"
            " 'planner.calibration.probe_reference' in sys.modules, 'yaml' in sys.modules, 'pydantic' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "['tierwise.cli.fit', 'tierwise.cli.options'] False False False"
    assert done.stderr == "error: --gpus must be at least 1, got 0\n"


def test_a_path_with_a_nul_byte_is_a_usage_error_naming_it():
    # A command line cannot carry a NUL byte to a process; a caller in Python (or a test) can.
    from typer.testing import CliRunner

    from tierwise.cli import build_app

    for verb, args in (("fit", ["1T", "--gpus", "16", "--out", "./a\x00b"]), ("simulate", ["./a\x00b"]),
                       ("probe", ["--nvme-path", "./a\x00b"])):
        result = CliRunner().invoke(build_app((verb,)), [verb, *args])
        assert result.exit_code == 2, result.output
        words = " ".join(result.output.replace("│", " ").split())  # typer's error box wraps its lines
        assert "'./a\\x00b' holds a NUL byte, which no path can" in words
