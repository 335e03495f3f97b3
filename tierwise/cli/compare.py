"""`planner compare PLAN PROFILE [--hardware CALIBRATED]`: predicted vs measured, per metric."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from planner.specs.plan import load_plan
from tierwise.cli import options as o

TORCH_CPU_DEVICE = "cpu"
"""torch's device type of a run on the host CPU (`measured_device` "cpu"; a CUDA run's is "cuda:N")."""


def comparison_rows(plan_path: Path, profile_path: Path, hardware: str | None = None) -> list[dict]:
    """Predicted vs measured per metric; with `hardware` (a calibrated spec) the plan is simulated
    again on it and every row also carries the prediction and error after calibration."""
    from planner.calibration.compare import compare
    from planner.cost.feasibility import check_plan
    from planner.specs.profile import load_profile

    plan = check_plan(load_plan(plan_path))
    if plan.prediction is None:  # a hand-written plan: compare with the analytic prediction
        from planner.search.search import predict

        plan = predict(plan)
    profile = load_profile(profile_path)
    rows = [r.to_dict() for r in compare(plan, profile)]
    if hardware is not None:
        from planner.sim import simulate
        from planner.specs.catalog import resolve_hardware

        calibrated = check_plan(plan.replace(node=resolve_hardware(hardware), prediction=None))
        after = {r.metric: r.to_dict() for r in compare(calibrated.replace(prediction=simulate(calibrated).prediction),
                                                         profile)}
        for r in rows:
            a = after.get(r["metric"], {})
            r["calibrated_predicted"], r["calibrated_relative_error"] = a.get("predicted"), a.get("relative_error")
    return rows


def hardware_used(plan_path: Path, profile_path: Path, hardware: str | None = None) -> dict[str, str]:
    """The hardware spec each prediction was made for (the plan's, and the calibrated one if given)
    and the device the run measured on, when the profile says."""
    from planner.specs.catalog import resolve_hardware
    from planner.specs.profile import load_profile

    out = {"predicted": load_plan(plan_path).node.name}
    if hardware is not None:
        out["calibrated"] = resolve_hardware(hardware).name
    device = load_profile(profile_path).details.get("device")
    if isinstance(device, str):
        out["measured_device"] = device
    return out


def hardware_caption(plan_path: Path, used: dict[str, str]) -> str:
    from planner.specs.profile import ERROR_DEFINITION

    said = [f"{which} for hardware {name}" for which, name in used.items() if which != "measured_device"]
    if "measured_device" in used:
        said.append(f"measured on device {used['measured_device']}")
    lines = [", ".join(said)]
    if used.get("measured_device", "").startswith(TORCH_CPU_DEVICE) and not load_plan(plan_path).node.host_is_device:
        lines.append(f"the run used the CPU but the prediction is for {used['predicted']}'s GPUs: "
                     "the errors compare different machines")
    from planner.calibration.compare import IN_BACKWARD_SPLIT

    if load_plan(plan_path).optimizer_step == "in_backward":
        lines.append(f"phase_time_s.backward and .optimizer are not scored: {IN_BACKWARD_SPLIT}")
    return "\n".join([*lines, ERROR_DEFINITION])


def comparison_table(plan_path: Path, rows: list[dict], calibrated: bool, used: dict[str, str] | None = None) -> Table:
    from planner.specs.profile import ERROR_DEFINITION

    caption = hardware_caption(plan_path, used) if used else ERROR_DEFINITION
    table = Table(title=f"{plan_path.name}: predicted vs measured", caption=caption, caption_justify="left")
    cols = ["metric", "predicted", "measured", "error"]
    if calibrated:
        cols += ["calibrated", "error after"]
    for col in cols:
        table.add_column(col, justify="left" if col == "metric" else "right")
    for r in rows:
        cells = [r["metric"], _fmt(r["predicted"]), _fmt(r["measured"]), _pct(r["relative_error"])]
        if calibrated:
            cells += [_fmt(r["calibrated_predicted"]), _pct(r["calibrated_relative_error"])]
        table.add_row(*cells)
    return table


def _pct(err: float | None) -> str:
    return "-" if err is None else f"{err:+.1%}"


def _fmt(value: float | None) -> str:
    return "unbounded" if value is None else f"{value:.4g}"


def compare_command(
    plan: Annotated[Path, typer.Argument(help="plan JSON with a prediction block", click_type=o.PATH)],
    profile: Annotated[Path, typer.Argument(help="profile JSON written by `planner run`", click_type=o.PATH)],
    hardware: Annotated[str | None, typer.Option(help="calibrated hardware (`planner calibrate --out`): "
                                                      "also show predictions and errors after calibration")] = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Predicted vs measured, per metric, with the relative error (before and after calibration)."""

    def go() -> None:
        rows = comparison_rows(plan, profile, hardware)
        used = hardware_used(plan, profile, hardware)
        if as_json:
            print(json.dumps({"plan": str(plan), "profile": str(profile), "hardware": used, "metrics": rows}, indent=2))
        else:
            Console().print(comparison_table(plan, rows, hardware is not None, used))

    o.exit_on_error(go)


def register(app: typer.Typer) -> None:
    app.command("compare")(compare_command)
