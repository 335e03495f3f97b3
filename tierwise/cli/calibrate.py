"""`planner calibrate PROFILE... --hardware H --out H2.json`: fit a hardware spec to measured runs.

Each profile carries the plan it ran (`planner run` writes it); the fit is
planner/calibration/calibrate.py [Note: the calibration model]. `planner compare PLAN PROFILE --hardware H2`
then shows every metric's error before and after calibration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.specs.specio import write_json_atomic
from tierwise.cli import options as o


def calibrate_command(profiles: list[Path], hardware: str | None, out: Path | None) -> dict:
    from planner.calibration.calibrate import calibrate
    from planner.cost.feasibility import check_plan
    from planner.specs.catalog import resolve_hardware
    from planner.specs.profile import load_profile

    runs = []
    for path in profiles:
        profile = load_profile(path)
        if not profile.plan:
            raise PlannerError(f"profile {path} does not carry its plan; re-run it with `planner run`")
        runs.append((check_plan(Plan.from_dict(profile.plan, f"profile {path}.plan")), profile))
    node = resolve_hardware(hardware) if hardware else runs[0][0].node
    result = calibrate(runs, node)
    if out is not None:
        write_json_atomic(out, result.node.to_dict(), "hardware")
    return {"profiles": [str(p) for p in profiles], **result.to_dict(), "out": str(out) if out else None}


def register(app: typer.Typer) -> None:
    @app.command("calibrate")
    def calibrate_cmd(
        profiles: Annotated[list[Path], typer.Argument(help="profile JSON files written by `planner run`", click_type=o.PATH)],
        hardware: Annotated[str | None, typer.Option(help="base hardware preset or JSON (default: the first profile's plan's)")] = None,
        out: Annotated[Path | None, typer.Option("--out", help="write the calibrated hardware JSON here", click_type=o.PATH)] = None,
        as_json: o.JsonOpt = False,
    ) -> None:
        """Fit the hardware spec's compute, per-operator, CPU Adam and NVMe efficiency to profiles
        (non-negative least squares on per-phase times) and report the residual."""
        o.exit_on_error(lambda: _report(calibrate_command(profiles, hardware, out), len(profiles), out, as_json))


def _report(doc: dict, num_profiles: int, out: Path | None, as_json: bool) -> None:
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    table = Table(title=f"calibration on {num_profiles} profile(s), {doc['num_rows']} phase rows")
    table.add_column("factor")
    table.add_column("theta", justify="right")
    table.add_column("standard error", justify="right")
    for name, value in doc["factors"].items():
        se = doc["standard_errors"].get(name)
        table.add_row(name, f"{value:.4g}", "" if se is None else f"{se:.2g}")
    console = Console()
    console.print(table)
    console.print(f"residual (relative RMS of the fit): {doc['residual']:.1%}")
    if doc["loose_factors"]:
        console.print(f"loosely determined by these profiles: {', '.join(doc['loose_factors'])} (standard error "
                      "over half the value); add runs that vary them on their own (a tiled plan for operators, "
                      "a long-sequence one for memory_s)")
    if out is not None:
        console.print(f"calibrated hardware written to {out}")
