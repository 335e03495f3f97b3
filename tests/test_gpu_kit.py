"""The GPU kit (benchmarks/gpu/) is complete without a GPU: `run.sh --check` passes, and the checks
it rests on catch what they are there to catch (an import no wheel covers, a gathered folder that
does not match the lists, a wheel whose needs are missing)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import kit  # noqa: E402
import report  # noqa: E402


def test_run_sh_check_passes_and_lists_the_stages() -> None:
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--check"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["missing"] == {} and doc["parse_errors"] == []
    assert doc["stages"] == ["install", "build", "pytest", "parity", "device", "offload", "nvme", "planner", "staged",
                             "report"]
    # What the project imports that the GPU image lacks travels as a wheel; the rest is in the image.
    assert {"simpy", "platformdirs", "deepspeed", "streamlit"} <= set(doc["from_wheels"])
    assert {"torch", "transformers", "pytest", "typer", "rich", "yaml"} <= set(doc["from_image"])
    assert set(doc["from_wheels"]) | set(doc["from_image"]) | set(doc["optional"]) == set(doc["imports"])
    assert "deepspeed==0.19.8" in doc["wheels"] and doc["debs"] == ["libaio1", "libaio-dev"]
    assert {"benchmarks/gpu/run.sh", "benchmarks/gpu/bench_gpu.py", "benchmarks/gpu/gather_wheels.sh"} <= set(doc["scripts"])
    assert "gpu kit check: ok" in proc.stderr


def test_check_names_an_import_that_no_wheel_covers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kit, "WHEELS", {k: v for k, v in kit.WHEELS.items() if k != "simpy"})
    doc = kit.check()
    assert not doc["ok"]
    assert list(doc["missing"]) == ["simpy"]
    assert "planner/sim/engine.py" in doc["missing"]["simpy"]


def test_import_names_map_to_their_distributions() -> None:
    assert kit.distribution("yaml") == "pyyaml"
    assert kit.distribution("pydantic_core") == "pydantic-core"
    assert kit.distribution("typing_extensions") == "typing-extensions"
    assert kit.distribution("torch") == "torch"


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> None:
    dist = f"{name.replace('-', '_')}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as whl:
        meta = [f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
        whl.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")


def _gathered(folder: Path) -> None:
    for name, version in {**kit.WHEELS, **kit.BUILT_WHEELS}.items():
        _wheel(folder, name, version, [])
    (folder / "deb").mkdir()
    for deb in kit.DEBS:
        (folder / "deb" / f"{deb}_0.3.113-4_amd64.deb").write_bytes(b"!")


def test_verify_accepts_the_listed_folder(tmp_path: Path) -> None:
    _gathered(tmp_path)
    doc = kit.verify(tmp_path)
    assert doc["ok"], doc["problems"]
    assert doc["wheels"] == len(kit.WHEELS) + len(kit.BUILT_WHEELS)


def test_verify_flags_a_second_version_an_unlisted_wheel_and_an_uncovered_need(tmp_path: Path) -> None:
    _gathered(tmp_path)
    _wheel(tmp_path, "simpy", "4.0.0", [])
    _wheel(tmp_path, "stray", "1.0", ["torch", "nothere>=1", "colorama; sys_platform == 'win32'",
                                       "pytest; extra == 'test'"])
    problems = kit.verify(tmp_path)["problems"]
    assert any(p.startswith("simpy:") for p in problems)
    assert any(p.startswith("stray:") for p in problems)
    # Markers are read for the GPU machine: the Windows-only and extra-only needs are not needs there.
    uncovered = [p for p in problems if "needs" in p]
    assert uncovered == ["stray-1.0-py3-none-any.whl needs nothere: neither in the image nor gathered"]


def test_junit_summary_counts_and_names_failures(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.a" name="ok"/>'
                   '<testcase classname="tests.a" name="bad"><failure/></testcase>'
                   '<testcase classname="tests.b" name="skip"><skipped/></testcase></testsuite></testsuites>')
    doc = report.junit(xml)
    assert (doc["passed"], doc["failed"], doc["skipped"], doc["errors"]) == (1, 1, 1, 0)
    assert doc["failures"] == ["tests.a::bad"] and not doc["ok"]


def test_markdown_names_the_gpu_and_restates_the_ratios() -> None:
    timing = {"ok": True, "model": "m", "rounds": 2, "steps_per_round": 3, "warmup_steps": 1,
              "summary": {"ours-device": {"median_step_time_s": 0.11, "min_step_time_s": 0.1, "optimizer": "a"},
                          "plain": {"median_step_time_s": 0.1, "min_step_time_s": 0.1, "optimizer": "b"}},
              "ratios": {"ours-device/plain step time (median of paired ratios)": 1.1}}
    text = report.markdown({"env": {"gpu": "NVIDIA H100 80GB HBM3", "nvidia_smi": "NVIDIA H100 80GB HBM3, 580.159.04",
                                    "torch": "2.11.0+cu130", "cuda": "13.0"}, "device": timing})
    assert "NVIDIA H100 80GB HBM3" in text and "580.159.04" in text and "2.11.0+cu130" in text
    assert "| ours-device/plain step time (median of paired ratios) | 1.100 |" in text


def test_the_staged_stage_times_every_piece_and_samples_the_runtime_threads(tmp_path: Path) -> None:
    """staged_path.py on the CPU: the pool's data path emulated (`separate_memory_on_cpu`), a small
    host-tier plan trained under the sampler; its numbers mean nothing here, its shape is the
    contract the GPU run fills and report.py renders."""
    plan, out = tmp_path / "plan.json", tmp_path / "staged.json"
    fit = subprocess.run([sys.executable, "-m", "tierwise", "fit", "--layers", "2", "--hidden", "256", "--heads", "4",
                          "--seq", "64", "--vocab", "512", "--batch-per-gpu", "2", "--gpus", "1", "--hardware",
                          "cpu-dev-2core", "--strategy", "zero-inf-cpu", "--precision", "bf16", "--out", str(plan)],
                         cwd=ROOT, capture_output=True, text=True)
    assert fit.returncode == 0, fit.stderr
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/staged_path.py"), "--plan", str(plan),
                          "--unit-numel", str(1 << 16), "--units", "3", "--steps", "3", "--sampled-steps", "2",
                          "--out", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads(out.read_text())
    rates = {k: v for k, v in doc["micro"].items() if k.endswith("GB/s")}
    assert len(rates) == 6 and all(v > 0 for v in rates.values())
    sampled = doc["sampled"]
    assert sampled["placement"]["params"] == "cpu" and len(sampled["phase_time_s"]) == 2
    assert sampled["samples"] > 0 and {"MainThread in forward", "MainThread in backward"} <= set(sampled["threads"])
    text = report.markdown({"env": {"gpu": "NVIDIA H200"}, "staged": doc})
    assert "| stage_to_device beside CPU Adam |" in text and "- MainThread in forward: `" in text


def test_ci_runs_the_check_after_the_test_command() -> None:
    lines = (ROOT / ".ci/run").read_text().splitlines()
    check = lines.index("bash benchmarks/gpu/run.sh --check >/dev/null")
    assert check > next(i for i, line in enumerate(lines) if line.endswith("python -m pytest -q"))
