"""`planner history`: the runs `planner run` recorded, predicted vs measured."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from tierwise.cli import options as o


def history(
    store: o.StoreOpt = None,
    last: Annotated[int, typer.Option("--last", help="show the newest N runs")] = 20,
    as_json: o.JsonOpt = False,
) -> None:
    """Runs recorded by `planner run`: predicted vs measured, newest last."""
    from rich.table import Table

    from planner import report
    from planner.history import RunHistory

    runs = RunHistory(store)
    frame = runs.to_frame().tail(max(0, last))
    if as_json:
        o.print_json(json.loads(frame.drop(columns=["plan_json", "profile_json"]).to_json(orient="records")))
        return
    con = report.console()
    if frame.empty:
        con.print(f"no runs recorded yet in {runs.path}")
        return
    table = Table(title=f"Run history ({runs.path})", title_justify="left")
    for col in ("id", "when", "model", "hardware", "GPUs", "placement P/G/O/A", "batch", "predicted", "measured", "error"):
        table.add_column(col)
    for row in frame.itertuples():
        pred, meas = row.predicted_iteration_time_s, row.measured_iteration_time_s
        error = f"{(pred - meas) / meas:+.1%}" if pred and meas else "-"
        table.add_row(
            str(row.id), row.recorded_at, row.model_name, row.hardware_name, str(row.num_gpus),
            "/".join((row.params_tier, row.gradients_tier, row.optimizer_states_tier, row.activation_checkpoints_tier)),
            f"{row.micro_batch_per_gpu:g}", report.fmt_seconds(pred) if pred else "-",
            report.fmt_seconds(meas) if meas else "-", error,
        )
    con.print(table)


def register(app: typer.Typer) -> None:
    app.command("history")(history)
