"""`planner probe`: measure this machine and write a hardware spec for `--hardware`.

The measuring code lives in `runtime.probe` (it needs torch); it is imported only when the command
runs, so `planner` itself starts without torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from planner.calibration import REFERENCE_REPEATS
from planner.specs.errors import PlannerError
from planner.specs.hardware import NodeSpec
from planner.specs.specio import number
from planner.specs.units import GIB
from tierwise.cli import options as o
from tierwise.cli.machine import INSTALL_RUNTIME, require_runtime

if TYPE_CHECKING:  # the calibration code is imported by `probe --calibrate` only, not by every command
    from planner.calibration.probe_reference import ReferenceRun
    from planner.specs.profile import Profile


def probe(
    out: Annotated[Path | None, typer.Option("--out", help="write the hardware JSON here (default: print it)", click_type=o.PATH)] = None,
    nvme_path: Annotated[
        Path | None, typer.Option("--nvme-path", help="directory on the drive to measure (default: the temp dir)", click_type=o.PATH)
    ] = None,
    nvme_test_gib: Annotated[float, typer.Option("--nvme-test-gib", help="bytes written and read per pass")] = 1.0,
    name: Annotated[str | None, typer.Option("--name", help="spec name (default probed-HOSTNAME)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the document even when writing --out")] = False,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate/--no-calibrate",
        help="also train four small reference runs of the runtime (each --repeats times) and fit the spec to them "
             "(several minutes on 2 cores; progress and time left are shown)",
    )] = False,
    repeats: Annotated[int, typer.Option(
        "--repeats", help="with --calibrate: trainings of each reference run; the fit takes the median one (3 narrows "
                          "the spread of a busy machine; 1 is three times faster on a quiet one)",
    )] = REFERENCE_REPEATS,
    keep_runs: Annotated[Path | None, typer.Option(
        "--keep-runs", hidden=True, help="save the bare spec and the reference runs' plans and profiles here", click_type=o.PATH)] = None,
) -> None:
    """Measure NVMe, memory, CPU Adam and compute (every precision) here; write a hardware spec.

    Under a minute on 2 cores; `--calibrate` adds reference runs of the runtime (several minutes).
    `--hardware local` runs the same measurements once and caches them."""
    number(nvme_test_gib, "--nvme-test-gib", exclusive_minimum=0, maximum=1024)
    number(repeats, "--repeats", minimum=1, maximum=9, integer=True)
    require_runtime("probe")
    try:
        from runtime.nvme.directory import check_swap_path

        directory = check_swap_path(nvme_path or Path(tempfile.gettempdir()))  # before importing torch
        from runtime.probe import probe_node
    except ModuleNotFoundError as error:
        raise PlannerError(
            f"planner probe needs the runtime extra ({error.name} is missing): {INSTALL_RUNTIME}"
        ) from None
    def log(message: str) -> None:
        sys.stderr.write(f"probe: {message}\n")

    busy = _busy_warning()
    if busy:
        log(f"warning: {busy}")
    doc, precision = probe_node(
        nvme_path=directory,
        nvme_test_bytes=max(64 * 1024**2, int(nvme_test_gib * GIB)),
        name=name,
        log=log,
    )
    if busy:
        doc["notes"] = f"{doc['notes']} Probed while busy: {busy}"
    spec = NodeSpec.from_dict(doc, "probed hardware")  # what --hardware will read back
    if calibrate:
        from planner.calibration.probe_reference import REFERENCE_RUNS, calibrate_on_reference_runs

        if keep_runs is not None:
            keep_runs.mkdir(parents=True, exist_ok=True)
            (keep_runs / "bare.json").write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
        fit = calibrate_on_reference_runs(spec, str(directory), train=train_reference_run, precision=precision,
                                          repeats=repeats, log=log, keep=keep_runs)
        factors = ", ".join(f"{k} {v:.4g}" for k, v in fit.factors.items())
        spec = fit.node.replace(name=spec.name, notes=(
            f"{spec.notes} Calibrated on {len(REFERENCE_RUNS)} reference runs of the runtime in {precision} (the "
            f"{_trainings_each(repeats)}; planner/calibration/probe_reference.py "
            f"[Note: probe reference runs]): factors {factors}, residual {fit.residual:.1%}. The measured bare-kernel "
            f"rates were {spec.gpu_flops_per_s / 1e12:.4g} TFLOPS and {spec.gpu_hbm_bytes_per_s / 1e9:.4g} GB/s "
            "memory-bound."))
    text = json.dumps(spec.to_dict(), indent=2) + "\n"
    if out is not None:
        try:
            out.write_text(text)
        except OSError as error:
            raise PlannerError(f"cannot write {out}: {error.strerror or error}") from None
        sys.stderr.write(f"wrote {out}\n")
    if out is None or as_json:
        sys.stdout.write(text)


def _trainings_each(repeats: int) -> str:
    return "one training each" if repeats == 1 else f"the median of {repeats} trainings each"


BUSY_LOAD_PER_CPU = 0.5
"""A one-minute load average above this share of the CPUs means other work competes with the probe."""


def _busy_warning() -> str:
    """Why the probe's numbers may be low, or "" (a probe measures the machine as it is now, other work
    included, and its reference runs slow down several-fold on a busy small machine)."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load <= BUSY_LOAD_PER_CPU * cpus:
        return ""
    return (f"load average {load:.2f} on {cpus} CPUs: other work is running, so the measured rates will be those of "
            "a shared machine; probe again when it is idle for a spec of the machine itself")


def train_reference_run(ref: ReferenceRun, work: Path, steps: int) -> Profile:
    """`planner run` of the plan saved as `work/<name>.plan.json`, in its own processes."""
    from planner.specs.profile import load_profile

    plan_path, profile_path = work / f"{ref.name}.plan.json", work / f"{ref.name}.profile.json"
    cmd = [sys.executable, "-m", "tierwise", "run", str(plan_path), "--steps", str(steps),
           "--profile-out", str(profile_path), "--no-history"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        last = next((line for line in reversed(done.stdout.splitlines()) if line.strip()), "no output")
        raise PlannerError(f"probe reference run {ref.name} failed ({last.strip()}); "
                           "run `planner probe` without --calibrate for the uncalibrated spec")
    return load_profile(profile_path)


def register(app: typer.Typer) -> None:
    app.command("probe")(probe)
