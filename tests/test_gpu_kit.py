"""The GPU kit (benchmarks/gpu/) is complete and right without a GPU: `run.sh --check` passes; the
checks it rests on catch what they are there to catch (an import no wheel covers, a gathered folder
that does not match the lists, a wheel whose needs are missing); the one call runs its stages in
order under the caller's budget, merges each into OUT as it ends and names what it skipped; the
build fails by name; the NVMe stage refuses to run without DeepSpeed or on the Python I/O engine;
the must-shows are read off the results as met / not met."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))
import build_ops  # noqa: E402
import call  # noqa: E402
import kit  # noqa: E402
import report  # noqa: E402


def test_run_sh_check_passes_and_lists_the_stages() -> None:
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/gpu/run.sh"), "--check"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["ok"] and doc["missing"] == {} and doc["parse_errors"] == []
    # The offload tiers first, then the checks, the planner chains and the traces.
    assert doc["stages"] == ["install", "build", "offload", "nvme", "pytest", "parity", "device", "planner", "staged"]
    # What the project imports that the GPU image lacks travels as a wheel; the rest is in the image.
    assert {"simpy", "platformdirs", "deepspeed", "streamlit"} <= set(doc["from_wheels"])
    assert {"torch", "transformers", "pytest", "typer", "rich", "yaml"} <= set(doc["from_image"])
    assert set(doc["from_wheels"]) | set(doc["from_image"]) | set(doc["optional"]) == set(doc["imports"])
    assert "deepspeed==0.19.8" in doc["wheels"] and doc["debs"] == ["libaio1", "libaio-dev"]
    assert {"benchmarks/gpu/run.sh", "benchmarks/gpu/bench_llama.py", "benchmarks/gpu/call.py",
            "benchmarks/gpu/gather_wheels.sh"} <= set(doc["scripts"])
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
    (folder / "src").mkdir()
    for name, version in kit.BUILT_WHEELS.items():
        (folder / "src" / f"{name}-{version}.tar.gz").write_bytes(b"!")


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


def test_verify_wants_the_sdist_and_built_files_for_the_gpus_python(tmp_path: Path) -> None:
    _gathered(tmp_path)
    (tmp_path / "src" / "deepspeed-0.19.8.tar.gz").unlink()
    (tmp_path / "ops").mkdir()
    (tmp_path / "ops" / "_aio_ext.cpython-311-x86_64-linux-gnu.so").write_bytes(b"!")
    problems = kit.verify(tmp_path)["problems"]
    assert any(p.startswith("deepspeed: no sdist src/deepspeed-0.19.8.tar.gz") for p in problems)
    assert "ops/_aio_ext.cpython-311-x86_64-linux-gnu.so: built for another Python than the GPU's cp312" in problems


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


@pytest.mark.slow
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
    # Six copy rates, and the landing add beside CPU AdamW; AdamW's own rate alone and beside it.
    assert len(rates) == 7 and all(v > 0 for v in rates.values())
    assert doc["micro"]["CPU AdamW alone G params/s"] > 0
    assert doc["micro"]["CPU AdamW beside the landing add G params/s (completed steps)"] >= 0
    sampled = doc["sampled"]
    assert sampled["placement"]["params"] == "cpu" and len(sampled["phase_time_s"]) == 2
    assert sampled["samples"] > 0 and {"MainThread in forward", "MainThread in backward"} <= set(sampled["threads"])
    text = report.markdown({"env": {"gpu": "NVIDIA H200"}, "staged": doc})
    assert "| stage_to_device beside CPU Adam |" in text and "- MainThread in forward: `" in text


def test_ci_runs_the_check_after_the_test_command() -> None:
    lines = (ROOT / ".ci/run").read_text().splitlines()
    check = lines.index("bash benchmarks/gpu/run.sh --check >/dev/null")
    readme_command = next(i for i, line in enumerate(lines) if "python -m pytest -q" in line and "-m slow" not in line)
    assert check > readme_command


FAKE_STAGE = """
import json, os, pathlib, sys, time
stage = sys.argv[1]
work, out = pathlib.Path(os.environ["GPUKIT_WORK"]), pathlib.Path(os.environ["GPUKIT_OUT"])
merged = json.loads((out / "gpu-results.json").read_text()) if (out / "gpu-results.json").exists() else {}
with (work / "order.txt").open("a") as f:
    f.write(json.dumps([stage, sorted(k for k in merged if k != "kit"), os.environ["GPUKIT_DEADLINE"]]) + "\\n")
print("fake stage", stage, flush=True)
time.sleep(float(os.environ.get("FAKE_SLEEP_" + stage, "0")))
(work / f"{stage}.json").write_text(json.dumps({"ok": stage != os.environ.get("FAKE_FAIL"), "stage": stage}))
"""


def _fake_call(tmp_path: Path, stages: list[str], budget: float, **env: str) -> tuple[dict, list, Path]:
    script = tmp_path / "stage.py"
    script.write_text(FAKE_STAGE)
    work, out = tmp_path / "work", tmp_path / "out"
    environ = {**os.environ, "GPUKIT_WORK": str(work), "GPUKIT_OUT": str(out), **env}
    record = call.run_call(stages, budget, work, out, [sys.executable, str(script)], environ)
    order = [json.loads(line) for line in (work / "order.txt").read_text().splitlines()] if (work / "order.txt").exists() else []
    return record, order, out


def test_the_call_runs_its_stages_in_order_and_merges_each_into_out_as_it_ends(tmp_path: Path) -> None:
    stages = list(kit.STAGES)
    record, order, out = _fake_call(tmp_path, stages, budget=3600, FAKE_FAIL="nvme")
    assert [o[0] for o in order] == stages
    # When each stage starts, OUT already holds every stage before it (and the kit's record).
    for i, (stage, merged, _) in enumerate(order):
        assert merged == sorted(stages[:i]), stage
    results = json.loads((out / "gpu-results.json").read_text())
    assert {s: results[s]["stage"] for s in stages} == {s: s for s in stages}
    assert record["ran"]["nvme"]["status"] == "failed" and record["ran"]["offload"]["status"] == "ok"
    assert results["kit"]["ran"] == record["ran"] and record["skipped"] == []
    log = (out / "run.log").read_text()
    assert "fake stage install" in log and "== stage device: ok (exit 0)" in log
    assert log.splitlines()[-1].startswith("run.sh: 9 stage(s) ran") and "failed: nvme" in log
    assert "## On a GPU" in (out / "gpu-results.md").read_text()


def _planned_stages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, seconds: dict[str, float] | None = None) -> tuple:
    """call.run_stage replaced by a simulated clock: each stage takes its planned H200 seconds (or
    `seconds`, capped at the limit it was given, as a stage stopped at its limit would)."""
    now = [0.0]
    limits: dict[str, float] = {}

    def fake_stage(cmd: list[str], limit_s: float, env: dict, log: call.Log) -> tuple[int | None, float]:
        stage = cmd[-1]
        limits[stage] = limit_s
        wanted = (seconds or {}).get(stage, kit.STAGES[stage].h200_s)
        now[0] += min(wanted, limit_s)
        (tmp_path / f"{stage}.json").write_text(json.dumps({"ok": True}))
        return (None if wanted > limit_s else 0), min(wanted, limit_s)

    monkeypatch.setattr(call, "run_stage", fake_stage)
    return now, limits


def test_the_budget_comes_from_the_caller_and_stages_that_no_longer_fit_are_skipped_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stage taking its planned H200 seconds (a simulated clock): a fresh call runs install,
    build, offload and nvme (390 s); the checks no longer fit and are skipped and named with the
    command of the call that runs them."""
    assert call.call_budget_s({}) == kit.CALL_BUDGET_S == 420
    assert call.call_budget_s({"CALL_BUDGET_S": "300"}) == 300
    with pytest.raises(SystemExit, match="CALL_BUDGET_S='7 min' is not a number of seconds"):
        call.call_budget_s({"CALL_BUDGET_S": "7 min"})
    now, limits = _planned_stages(monkeypatch, tmp_path)
    budget = call.call_budget_s({"CALL_BUDGET_S": "420"})
    record = call.run_call(list(kit.STAGES), budget, tmp_path, tmp_path / "out", ["stage"], {}, clock=lambda: now[0])
    assert list(record["ran"]) == ["install", "build", "offload", "nvme"]
    assert record["skipped"] == ["pytest", "parity", "device", "planner", "staged"]
    # The build runs in what offload and nvme leave it: 420 - 10 - 30 (install) - 240.
    assert limits["install"] == kit.STAGES["install"].cap_s and limits["build"] == 140
    log = (tmp_path / "out" / "run.log").read_text()
    assert "== stage build: " in log and "limit 140 s (240 s kept for offload nvme)" in log
    assert "== stage pytest: skipped, 20 s left of the call and it needs 85 s" in log
    assert ("skipped, the call's budget of 420 s was spent: pytest parity device planner staged "
            "(another call: bash benchmarks/gpu/run.sh install pytest parity device planner staged)") in log
    assert json.loads((tmp_path / "out" / "gpu-results.json").read_text())["kit"]["skipped"] == record["skipped"]
    # The second call, on the same machine (install done in seconds) or a fresh one, runs them all in 380 s.
    now[0] = 0.0
    second = ["install", "pytest", "parity", "device", "planner", "staged"]
    record = call.run_call(second, 380, tmp_path, tmp_path / "out2", ["stage"], {}, clock=lambda: now[0])
    assert list(record["ran"]) == second and record["skipped"] == []
    # The budget counts from run.sh's start: what went before call.py is spent.
    record = call.run_call(["install"], budget, tmp_path, tmp_path / "out3", ["stage"], {}, clock=lambda: 0.0, spent_s=400)
    assert record["skipped"] == ["install"]


def test_a_build_past_its_limit_leaves_offload_and_nvme_their_planned_seconds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    now, limits = _planned_stages(monkeypatch, tmp_path, {"install": 26, "build": 1000})
    record = call.run_call(list(kit.STAGES), 420, tmp_path, tmp_path / "out", ["stage"], {}, clock=lambda: now[0])
    assert record["ran"]["build"]["status"] == "stopped at its limit" and limits["build"] == 420 - 10 - 26 - 240
    assert limits["offload"] == 240 and limits["nvme"] == 120
    assert record["ran"]["offload"]["status"] == record["ran"]["nvme"]["status"] == "ok"
    # With the built ops carried (a build of seconds) pytest and parity fit in the first call too.
    now[0] = 0.0
    now, limits = _planned_stages(monkeypatch, tmp_path, {"build": 5})
    record = call.run_call(list(kit.STAGES), 420, tmp_path, tmp_path / "out2", ["stage"], {}, clock=lambda: now[0])
    assert list(record["ran"]) == ["install", "build", "offload", "nvme", "pytest", "parity"]
    # Only a stage that is not reserved gives way: offload itself may run into nvme's time.
    assert not kit.STAGES["build"].reserved and all(kit.STAGES[s].reserved for s in ("install", "offload", "nvme"))


def test_a_dry_run_gives_the_build_its_cpu_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limits: dict[str, float] = {}

    def fake_stage(cmd: list[str], limit_s: float, env: dict, log: call.Log) -> tuple[int, float]:
        limits[cmd[-1]] = limit_s
        return 0, 1.0

    monkeypatch.setattr(call, "run_stage", fake_stage)
    call.run_call(["build"], 2400, tmp_path, tmp_path / "out", ["stage"], {}, clock=lambda: 0.0)
    assert kit.STAGES["build"].dry_cap_s > 2400 > kit.STAGES["build"].cap_s
    assert limits["build"] == kit.STAGES["build"].cap_s  # the second call, on the GPU: its cap
    call.run_call(["build"], 2400, tmp_path, tmp_path / "out", ["stage"], {"GPUKIT_DRY_RUN": "1"}, clock=lambda: 0.0)
    assert limits["build"] == 2400 - kit.FINISH_MARGIN_S  # the dry run: what is left of its budget


def test_a_stage_past_its_limit_is_stopped_and_what_it_published_is_kept(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(kit.STAGES, "offload", kit.Stage("sleeps", 1, 0, 1))
    record, order, out = _fake_call(tmp_path, ["offload", "parity"], budget=3600, FAKE_SLEEP_offload="30")
    assert record["ran"]["offload"]["status"] == "stopped at its limit" and record["ran"]["offload"]["seconds"] < 15
    assert record["ran"]["parity"]["status"] == "ok"
    # The deadline the stage was told is its limit from its start.
    assert abs(float(order[0][2]) - time.time()) < 60
    results = json.loads((out / "gpu-results.json").read_text())
    assert results["offload"]["ok"] is False and "stopped at its limit" in results["offload"]["error"]


def test_the_build_fails_by_name_when_an_op_would_jit_or_the_extension_does_not_build(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DeepSpeed's setup.py leaves an op it cannot build out with a warning only: installed_ops says so.
    probe = {"deepspeed": "/site/deepspeed/__init__.py", "accelerator": "cuda", "built_for": "cuda",
             "ops": {"cpu_adam": {"in_wheel": True, "ok": True}, "async_io": {"in_wheel": False, "ok": False},
                     "pin_memory": {"in_wheel": True, "ok": False, "error": "OSError: libaio.so.1"}}}
    problems = build_ops.missing_ops(probe)
    assert problems == ["async_io: not prebuilt in /site/deepspeed/__init__.py (installed_ops), so DeepSpeed would JIT-build it",
                        "pin_memory: prebuilt but does not load: OSError: libaio.so.1"]
    ready = {**probe, "ops": dict.fromkeys(build_ops.DEEPSPEED_OPS, {"in_wheel": True, "ok": True})}
    assert build_ops.missing_ops(ready) == []
    assert build_ops.missing_ops({**ready, "built_for": "cpu"}) == ["ops built for accelerator 'cpu', running on 'cuda'"]

    def failing(cmd: list[str], env=None, cwd=None):  # noqa: ANN001, ANN202 - the compiler is missing
        return subprocess.CompletedProcess(cmd, 1, "", "error: command 'g++' failed: No such file or directory")

    monkeypatch.setattr(build_ops, "run", failing)
    doc = build_ops.aio_extension(tmp_path)
    assert not doc["ok"] and doc["error"].startswith("runtime._aio_ext failed to build or import: error: command 'g++'")


def test_the_build_stage_exits_non_zero_naming_the_ops_it_could_not_prebuild(tmp_path: Path) -> None:
    """Here DeepSpeed is installed without prebuilt ops and no sdist is carried: the stage names both."""
    work, out = tmp_path / "work", tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/build_ops.py"), "--wheels", str(tmp_path / "none"),
                           "--work", str(work), "--out", str(out), "--site", str(tmp_path / "site"),
                           "--json", str(tmp_path / "build.json")], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(ROOT)}, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads((tmp_path / "build.json").read_text())
    assert doc["aio_ext"]["ok"] and not doc["ok"]
    assert "build: FAILED: deepspeed cpu_adam: not prebuilt" in proc.stderr
    assert "build: FAILED: deepspeed async_io: not prebuilt" in proc.stderr
    assert f"no DeepSpeed sdist in {tmp_path / 'none' / 'src'}" in proc.stderr


def test_the_nvme_stage_refuses_only_without_our_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench_llama

    from runtime.nvme import engine

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` raises ImportError: no reason to refuse
    assert bench_llama.nvme_refusal() is None
    monkeypatch.setattr(engine, "extension_available", lambda: False)
    refusal = bench_llama.nvme_refusal()
    assert "runtime._aio_ext is not built" in refusal and "runtime/nvme/pyengine.py" in refusal


def test_a_deepspeed_system_without_prebuilt_ops_is_left_out_by_name_and_ours_stay(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench_llama
    import deepspeed.git_version_info as info

    names = ["ours-nvme", "deepspeed-nvme"]
    monkeypatch.setattr(info, "installed_ops", {"cpu_adam": 1, "async_io": False, "pin_memory": 1})
    left = bench_llama.deepspeed_left_out(names, require_prebuilt=True)
    assert list(left) == ["deepspeed-nvme"] and "DeepSpeed's async_io op(s) are not prebuilt" in left["deepspeed-nvme"]
    assert left["deepspeed-nvme"].startswith("not measured: ")
    # DeepSpeedCPUAdam needs cpu_adam only; the dry run (no --require-prebuilt) lets DeepSpeed build what it needs.
    assert bench_llama.deepspeed_left_out(["ours-cpu", "deepspeed-cpu"], require_prebuilt=True) == {}
    assert bench_llama.deepspeed_left_out(names, require_prebuilt=False) == {}
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    gone = bench_llama.deepspeed_left_out(names + ["deepspeed-cpu"], require_prebuilt=False)
    assert list(gone) == ["deepspeed-nvme", "deepspeed-cpu"] and "DeepSpeed does not import" in gone["deepspeed-cpu"]


def test_no_stage_but_the_build_compiles_a_deepspeed_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import bench_llama
    from deepspeed.ops.op_builder.builder import OpBuilder
    from deepspeed.ops.op_builder.cpu.cpu_adam import CPUAdamBuilder

    monkeypatch.setattr(OpBuilder, "jit_load", OpBuilder.jit_load)  # put back after the test
    bench_llama.forbid_jit_builds()
    with pytest.raises(RuntimeError, match="DeepSpeed would JIT-build its cpu_adam op here: only the build stage"):
        CPUAdamBuilder().jit_load()


@pytest.mark.slow
def test_the_nvme_stage_without_deepspeed_measures_our_tier_and_names_the_baseline(tmp_path: Path) -> None:
    shadow = tmp_path / "shadow" / "deepspeed"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('DeepSpeed is not on this machine')\n")
    out = tmp_path / "nvme.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_llama.py"), "nvme", "--profile", "dry",
                           "--nvme-path", str(tmp_path / "nvme"), "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": f"{tmp_path / 'shadow'}:{ROOT}",
                                          "GPUKIT_WORK": str(tmp_path)}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["systems"] == ["ours-nvme"] and doc["ok"]
    assert doc["left_out"] == {"deepspeed-nvme": "not measured: DeepSpeed does not import (DeepSpeed is not on this "
                                                 "machine); the install stage installs it"}
    first = next(iter(doc["shapes"].values()))
    assert report.ROOFLINE in first and first["summary"]["ours-nvme"]["median_step_time_s"] > 0
    shows = {m.claim: m for m in report.must_shows({"nvme": doc})}
    assert shows["NVMe tier step vs its NVMe roofline"].met is not None
    assert shows["NVMe tier step vs DeepSpeed ZeRO-Infinity"].measured == "not measured: " + doc["left_out"][
        "deepspeed-nvme"].removeprefix("not measured: ")


def _shape(ratios: dict[str, float], seq: int = 4096, **extra: object) -> dict:
    return {"seq": seq, "batch": 4, "tokens_per_step": seq * 4, "ratios": ratios, **extra}


def test_the_must_shows_are_read_off_the_results_as_met_or_not_with_the_numbers() -> None:
    ratio = report.RATIO.format
    doc = {"offload": {"shapes": {"seq 4096 x batch 4": _shape({ratio("ours-cpu", "fsdp2-cpu"): 0.75,
                                                                 ratio("ours-cpu", "deepspeed-cpu"): 0.82,
                                                                 ratio("ours-cpu-master", "fsdp2-cpu"): 0.79,
                                                                 report.GPU_SHARE: 0.55}),
                                  "seq 2048 x batch 8": _shape({ratio("ours-cpu", "fsdp2-cpu"): 0.7,
                                                                report.GPU_SHARE: 0.3}, seq=2048)}},
           "nvme": {"shapes": {"seq 4096 x batch 1": _shape({ratio("ours-nvme", "deepspeed-nvme"): 0.5},
                                                            **{report.ROOFLINE: {"median": 1.25}})}},
           "planner": {"chains": {"cpu": {"compare": {"metrics": [
               {"metric": "phase_time_s.forward", "relative_error": -0.1, "measured": 0.2},
               {"metric": "phase_time_s.optimizer", "relative_error": 0.05, "measured": 0.3},
               {"metric": "iteration_time_s", "relative_error": 0.9, "measured": 1.0}]}}}},
           "pytest": {"passed": 31, "failed": 0, "errors": 0}}
    shows = {m.claim: m for m in report.must_shows(doc)}
    assert shows["host-memory tier step vs FSDP2 CPUOffloadPolicy"].met is True
    assert shows["host-memory tier step vs FSDP2 CPUOffloadPolicy"].measured == "0.750 at seq 4096 x batch 4; 0.700 at seq 2048 x batch 8"
    assert shows["host-memory tier step vs DeepSpeed ZeRO-3 CPU offload"].met is False
    master = "host-memory tier, fp32 master as the host shard, step vs "
    assert shows[master + "FSDP2 CPUOffloadPolicy"].measured == "0.790 at seq 4096 x batch 4"
    assert shows[master + "FSDP2 CPUOffloadPolicy"].met is True
    assert shows[master + "DeepSpeed ZeRO-3 CPU offload"].met is None  # no such ratio: not measured
    # Read at seq 4096 only (0.55), not at 2048 (0.3).
    assert shows["host-memory tier throughput vs all-on-GPU, seq 4096"].met is True
    assert shows["NVMe tier step vs DeepSpeed ZeRO-Infinity"].met is True
    assert shows["NVMe tier step vs its NVMe roofline"].met is False
    planner = shows["planner probe -> fit -> run -> compare, per phase"]
    assert planner.met is None and "nvme, device not measured" in planner.measured and "forward -10%" in planner.measured
    assert shows["pytest -m gpu"].met is True
    text = report.markdown(doc)
    assert "| NVMe tier step vs its NVMe roofline | <= 1.2x | 1.250 at seq 4096 x batch 1 | **not met** |" in text
    assert report.must_shows({})[0].met is None


def test_publish_merges_one_stage_at_a_time_and_rewrites_the_markdown(tmp_path: Path) -> None:
    report.publish(tmp_path, "env", {"gpu": "NVIDIA H100 80GB HBM3"})
    whole = report.publish(tmp_path, "pytest", {"passed": 3, "failed": 1, "errors": 0, "failures": ["t::x"]})
    assert set(whole) == {"env", "pytest"} == set(json.loads((tmp_path / "gpu-results.json").read_text()))
    md = (tmp_path / "gpu-results.md").read_text()
    assert "NVIDIA H100 80GB HBM3" in md and "`pytest -m gpu`: 3 passed, 1 failed" in md
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.slow
def test_the_offload_stage_on_the_cpu_measures_every_shape_and_publishes_after_each(tmp_path: Path) -> None:
    """bench_llama.py's dry profile (a few-thousand-parameter Llama, the emulated device) with ours
    on both tiers and plain torch: same weights (same first loss), both shapes, the ratios, and the
    document in OUT after the run."""
    out_dir, doc_path = tmp_path / "out", tmp_path / "offload.json"
    env = {**os.environ, "GPUKIT_WORK": str(tmp_path), "GPUKIT_OUT": str(out_dir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_llama.py"), "offload", "--profile", "dry",
                           "--systems", "ours-cpu,ours-gpu,plain", "--out", str(doc_path)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    doc = json.loads(doc_path.read_text())
    assert list(doc["shapes"]) == ["seq 128 x batch 2", "seq 64 x batch 4"] and doc["ok"]
    for shape in doc["shapes"].values():
        firsts = {round(s["first_losses"][0], 3) for s in shape["summary"].values()}
        assert len(firsts) == 1  # one starting model for every system
        assert report.GPU_SHARE in shape["ratios"] and report.RATIO.format("ours-cpu", "plain") in shape["ratios"]
    assert doc["plans"]["ours-cpu"]["placement"] == {"params": "cpu", "gradients": "cpu", "optimizer_states": "cpu",
                                                     "recompute_inputs": "cpu"}
    published = json.loads((out_dir / "gpu-results.json").read_text())["offload"]
    assert list(published["shapes"]) == list(doc["shapes"])


def test_a_system_whose_step_fails_is_dropped_by_name_and_the_others_are_measured() -> None:
    import bench_llama
    import torch

    calls = {"a": 0}

    def steady(tokens: torch.Tensor) -> float:
        return 1.0

    def breaks_in_the_second_measured_step(tokens: torch.Tensor) -> float:
        calls["a"] += 1
        if calls["a"] == 3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return 2.0

    sizing = bench_llama.Sizing({}, (bench_llama.Shape(8, 2),), warmup=1, steps=3, hardware="cpu-dev-2core")
    steps = {"ours-cpu": steady, "plain": breaks_in_the_second_measured_step, "fsdp2-cpu": steady}
    raw = bench_llama.measure_shape(steps, sizing.shapes[0], sizing, torch.device("cpu"), vocab=16)
    assert raw["failed"] == {"plain": "OutOfMemoryError: CUDA out of memory"}
    doc = bench_llama.summarise(raw, {})
    assert set(doc["summary"]) == {"ours-cpu", "fsdp2-cpu"} and len(doc["summary"]["ours-cpu"]["step_times_s"]) == 3
    assert list(doc["ratios"]) == [report.RATIO.format("ours-cpu", "fsdp2-cpu")]
    assert "`plain`: OutOfMemoryError" in report.markdown({"offload": {"model": "m", "warmup_steps": 1, "measured_steps": 3,
                                                                         "shapes": {"seq 8 x batch 2": doc}}})


CALLS = sorted((ROOT / "tests/data/gpu_calls").glob("2026-11-28-h200-call*.json"))
"""The three H200 calls kept as benchmarks/gpu/runs/2026-11-28-h200-call*.json, cut to what the report reads."""


def test_several_calls_merge_each_stage_from_the_last_call_that_ran_it_with_a_result() -> None:
    calls = [json.loads(p.read_text()) for p in CALLS]
    doc = report.merge(calls)
    assert len(doc["calls"]) == 3 and "kit" not in doc
    # Call 3's build was cut before writing a result: call 2's failed build is the result.
    assert doc["from_call"] == {"install": 1, "offload": 1, "planner": 1, "staged": 1, "parity": 1,
                                "pytest": 2, "device": 2, "build": 2, "nvme": 2}
    assert doc["build"]["deepspeed"]["seconds"] == 17.1  # call 2 (call 1: 13.6)
    assert report.merge([calls[2], calls[1]])["from_call"]["build"] == 2  # the order of the files is the calls' order
    text = report.markdown(doc)
    for line in ("1. (budget 420 s, 398 s used): install ok 26 s (planned 40), build failed 14 s (planned 150), "
                 "offload ok 162 s (planned 140)",
                 "skipped for time: pytest, device; results used from it: install, offload, planner, staged, parity.",
                 "2. (budget 330 s, 103 s used): pytest failed 49 s (planned 70)",
                 "3. (budget 290 s, 280 s used): build stopped at its limit 279 s (planned 150); skipped for time: "
                 "nvme; results used from it: none.",
                 "the build failed: ValueError: invalid literal for int() with base 10: '0a'",
                 "| host-memory tier step vs FSDP2 CPUOffloadPolicy | <= 0.8x | 1.112 at seq 4096 x batch 4; 1.198 at "
                 "seq 2048 x batch 8 | **not met** |",
                 "`pytest -m gpu`: 22 passed, 14 failed, 0 errors"):
        assert line in text, line
    nvme = {m.claim: m for m in report.must_shows(doc)}["NVMe tier step vs its NVMe roofline"]
    assert nvme.met is None and nvme.measured.startswith("not measured: nvme: DeepSpeed's async_io, cpu_adam, pin_memory")
    # One call's file reads as before: its budget line, no list.
    one = report.markdown(report.merge([calls[0]]))
    assert "**The call** (budget 420 s, 398 s used): install ok 26 s" in one and "**The calls**" not in one


def test_a_stage_cut_before_its_result_says_so_and_does_not_replace_an_earlier_result(tmp_path: Path) -> None:
    doc = call.stage_doc(tmp_path, "build", None, 279.2)
    assert doc["no_result"] and not report.has_result(doc) and doc["partial"]
    assert report.has_result({"ok": False, "error": "pip wheel failed"})
    merged = report.merge([{"build": {"ok": False, "error": "ValueError: x"}}, {"build": doc}])
    assert merged["build"]["error"] == "ValueError: x"


def test_the_architecture_list_is_one_deepspeeds_builder_parses() -> None:
    """The GPU image's TORCH_CUDA_ARCH_LIST=9.0a stops DeepSpeed 0.19.8's setup.py; the build passes it
    9.0, which its CUDA op builder turns into Hopper's -gencode flags."""
    from deepspeed.ops.op_builder.async_io import AsyncIOBuilder

    assert build_ops.deepspeed_arch_list("9.0a") == "9.0"
    assert build_ops.deepspeed_arch_list("8.0 9.0a;10.0f+PTX;9.0") == "8.0;9.0;10.0+PTX"
    assert build_ops.deepspeed_arch_list(None) == build_ops.deepspeed_arch_list("") == build_ops.GPU_ARCH_LIST
    with pytest.raises(ValueError, match="TORCH_CUDA_ARCH_LIST entry 'Hopper' is not MAJOR.MINOR"):
        build_ops.deepspeed_arch_list("Hopper")
    builder = AsyncIOBuilder()  # the CUDA accelerator's, a CUDAOpBuilder
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
        with pytest.raises(ValueError, match="invalid literal for int"):
            builder.compute_capability_args()
        mp.setenv("TORCH_CUDA_ARCH_LIST", build_ops.deepspeed_arch_list("9.0a"))
        assert builder.compute_capability_args() == ["-gencode=arch=compute_90,code=sm_90"]
    # ...and no op the kit builds compiles a CUDA source, so the suffix changes no code.
    assert build_ops.deepspeed_cuda_sources() == {"cpu_adam": [], "async_io": [], "pin_memory": []}


def test_the_build_environment_forces_the_parsable_list_and_ninja(monkeypatch: pytest.MonkeyPatch) -> None:
    env = build_ops.build_env({"TORCH_CUDA_ARCH_LIST": "9.0a", "PATH": ""}, 16)
    assert env["TORCH_CUDA_ARCH_LIST"] == "9.0" and env["MAX_JOBS"] == "16" and env["DS_ENABLE_NINJA"] == "1"
    assert {env[k] for k in ("DS_BUILD_CPU_ADAM", "DS_BUILD_AIO", "DS_BUILD_PIN_MEMORY")} == {"1"} and env["DS_BUILD_OPS"] == "0"
    assert "TORCH_CUDA_ARCH_LIST" not in build_ops.build_env({"PATH": ""}, 2)  # no nvcc, no list: a CPU build


def test_the_builds_timeline_gives_each_ops_seconds(tmp_path: Path) -> None:
    timeline = [[3.0, "building 'deepspeed.ops.adam.cpu_adam_op' extension"],
                [41.5, "building 'deepspeed.ops.aio.async_io_op' extension"],
                [70.0, "building 'deepspeed.ops.pin_memory.pin_memory_op' extension"], [88.2, "deepspeed build time = 85 secs"]]
    assert build_ops.op_seconds(timeline) == {"cpu_adam": 38.5, "async_io": 28.5, "pin_memory": 18.2}
    seen = []
    script = tmp_path / "b.py"
    script.write_text("print('compiling'); print(\"building 'deepspeed.ops.adam.cpu_adam_op' extension\"); "
                      "print('deepspeed build time = 1 secs'); raise SystemExit(3)")
    code, tail = build_ops.streamed([sys.executable, str(script)], dict(os.environ), lambda t, line: seen.append(line))
    assert code == 3 and tail.splitlines()[0] == "compiling"
    assert seen == ["building 'deepspeed.ops.adam.cpu_adam_op' extension", "deepspeed build time = 1 secs"]


def test_the_build_log_shows_each_file_ninja_finished_each_link_and_errors() -> None:
    ninja = ("[2/3] c++ -MMD -MF /tmp/pip-req-build-x/build/temp/csrc/pin_memory/page_alloc.o.d -O3 -Wall -fPIC "
             "-I/tmp/pip-req-build-x/csrc/pin_memory -c -c /tmp/pip-req-build-x/csrc/pin_memory/page_alloc.cpp "
             "-o /tmp/pip-req-build-x/build/temp/csrc/pin_memory/page_alloc.o -std=c++20")
    assert build_ops.brief(ninja) == "[2/3] compiled page_alloc.cpp"
    assert build_ops.brief("  x86_64-linux-gnu-g++ -shared -Wl,-O1 a.o -o build/lib/deepspeed/ops/adam/cpu_adam_op.so"
                           ) == "linked cpu_adam_op.so"
    assert build_ops.brief("  building 'deepspeed.ops.aio.async_io_op' extension") == (
        "building 'deepspeed.ops.aio.async_io_op' extension")
    assert build_ops.brief("  csrc/adam/cpu_adam_impl.cpp:12:3: error: 'x' was not declared") is not None
    assert build_ops.brief("  copying deepspeed/runtime/errors.py -> build/lib/deepspeed/runtime") is None


def test_a_stage_stopped_mid_build_does_not_leave_the_next_one_waiting_on_its_lock(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work"
    (work / "torch_extensions" / "deepspeed_shm_comm").mkdir(parents=True)
    (work / "torch_extensions" / "deepspeed_shm_comm" / "lock").write_text("")
    (work / "torch_extensions" / "deepspeed_shm_comm" / "build.ninja").write_text("")
    monkeypatch.setattr(call, "run_stage", lambda cmd, limit_s, env, log: (None, limit_s))
    call.run_call(["offload"], 600, work, tmp_path / "out", ["stage"], {}, clock=lambda: 0.0)
    assert not (work / "torch_extensions" / "deepspeed_shm_comm" / "lock").exists()
    assert (work / "torch_extensions" / "deepspeed_shm_comm" / "build.ninja").exists()
    assert "== stage offload: removed the lock its killed build left on deepspeed_shm_comm" in (
        tmp_path / "out" / "run.log").read_text()


# -- the parity stage ([Note: the parity bar] in benchmarks/gpu/bench_gpu.py) -------------------------


def _bench_gpu():  # noqa: ANN202
    sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
    import bench_gpu

    return bench_gpu


@pytest.mark.parametrize(("options", "within"), [
    ({}, True),
    ({"fused": False, "foreach": True}, True),  # other rounding, the same arithmetic: inside, not at 0
    ({"lr": 1.0001e-3}, False),  # the lr off by 0.01 %
    ({"eps": 1e-6}, False),
    ({"betas": (0.9, 0.99)}, False),
], ids=["same", "foreach", "lr", "eps", "beta2"])
def test_the_adamw_bound_admits_rounding_and_refuses_other_arithmetic(options: dict, within: bool) -> None:
    """The CPU-vs-device AdamW bound, checked on the CPU with other optimizers in the device's
    place: torch's foreach AdamW (the same arithmetic, rounded otherwise) stays inside it with room
    (not merely inside a bound too loose to matter: at most a tenth), a change of the arithmetic
    (lr, eps, beta2) leaves it."""
    bench_gpu = _bench_gpu()
    assert bench_gpu.LR == 1e-3
    check = bench_gpu.adam_rounding_check(100_000, "cpu", options=options)
    assert check["within_bound"] is within, check
    if options.get("foreach"):
        assert 0 < check["max_difference_over_bound"] < 0.1, check


def test_the_parity_dry_run_holds_each_tier_to_its_reference_and_the_adamw_bound(tmp_path: Path) -> None:
    """`run.sh --dry-run parity`'s document: the host tier against plain torch with the host's AdamW
    and the device tier against plain torch, bit for bit, and the AdamW bound, as on the GPU."""
    out = tmp_path / "parity.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu/bench_gpu.py"), "parity", "--device", "cpu",
                           "--size", "tiny", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {name: v["reference"] for name, v in doc["systems"].items()} == {"ours-device": "plain",
                                                                           "ours-cpu": "plain-host-adam"}
    assert all(v["bitwise_equal_to_reference"] for v in doc["systems"].values())
    assert doc["cpu_vs_device_adamw"]["within_bound"] and doc["cpu_vs_device_adamw"]["numel"] > 0
    assert doc["ok"] is True
