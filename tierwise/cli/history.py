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
    from planner.output import report
    from planner.specs.history import RunHistory
    from planner.specs.profile import ERROR_DEFINITION, relative_error

    runs = RunHistory(store)
    frame = runs.to_frame().tail(max(0, last))
    if as_json:
        o.print_json(json.loads(frame.drop(columns=["plan_json", "profile_json"]).to_json(orient="records")))
        return
    con = report.console()
    if frame.empty:
        con.print(f"no runs recorded yet in {runs.path}")
        return
    rows = list(frame.itertuples())
    pred = [row.predicted_iteration_time_s for row in rows]
    meas = [row.measured_iteration_time_s for row in rows]
    errors = [relative_error(p, m) if p and m else None for p, m in zip(pred, meas, strict=True)]
    columns = [
        ("id", [str(row.id) for row in rows]),
        ("model", [row.model_name for row in rows]),
        ("seq", [str(int(row.seq_len)) if row.seq_len == row.seq_len and row.seq_len else "-" for row in rows]),
        ("predicted", [report.fmt_seconds(p) if p else "-" for p in pred]),
        ("measured", [report.fmt_seconds(m) if m else "-" for m in meas]),
        ("error", ["-" if e is None else f"{e:+.1%}" for e in errors]),
        ("hardware", [row.hardware_name for row in rows]),
        ("GPUs", [str(row.num_gpus) for row in rows]),
        ("placement P/G/O/A", ["/".join((row.params_tier, row.gradients_tier, row.optimizer_states_tier,
                                         row.recompute_inputs_tier)) for row in rows]),
        ("batch", [f"{row.micro_batch_per_gpu:g}" for row in rows]),
        ("when", [row.recorded_at for row in rows]),
    ]
    table = report.fitted_table(f"Run history ({runs.path})", columns, con.width, wrap=("model",),
                                note=f"iteration time; {ERROR_DEFINITION}")
    con.print(table)


def register(app: typer.Typer) -> None:
    app.command("history")(history)
