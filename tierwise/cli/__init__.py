"""`planner` command line, the composition root: each verb a module of this package, a thin adapter
over the pure library (`planner`), the runtime (`runtime`, imported by the verbs that train) and the
dashboard (`app`, started as a Streamlit process). Shared option types are in `options`.

Exit codes: 0 success (an infeasible model is a successful answer), 1 user error with a one-line
message, 2 usage error (typer/click).
"""

from __future__ import annotations

import sys

import typer

from planner.specs.errors import PlannerError
from tierwise.cli import (
    calibrate,
    compare,
    dashboard,
    export,
    fit,
    hardware,
    history,
    max_size,
    memory,
    models,
    probe,
    run,
    simulate,
    validate,
)
from tierwise.cli.options import one_line_error

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Tierwise: plan, simulate and run heterogeneous-memory ZeRO-3 (ZeRO-Infinity) training.",
)

VERBS = (fit, memory, max_size, models, hardware, history, dashboard, simulate, probe, run, export, compare, calibrate,
         validate)
"""In the order `planner --help` lists them."""

for verb in VERBS:
    verb.register(app)


def main() -> None:
    try:
        app()
    except PlannerError as exc:
        sys.stderr.write(one_line_error(exc))
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
