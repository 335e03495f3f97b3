"""`planner validate`: predict published GPU training runs and compare with what they measured."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from planner.specs.errors import PlannerError
from tierwise.cli import options as o


def validate(
    corpus: Annotated[Path | None, typer.Option("--corpus", help="published-runs CSV (default: the bundled corpus)", click_type=o.PATH)] = None,
    source: Annotated[str | None, typer.Option("--source", help="only this source_id")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="only this GPU type (V100, A100, H100, H200)")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write a markdown report here", click_type=o.PATH)] = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Predict published training runs and compare with what they measured (planner.validation)."""
    from planner.output import report as views
    from planner.validation import validate as run_validation
    from planner.validation.render import markdown, rich_tables
    from tierwise.cli.counted import Counted

    result = run_validation(corpus, source=source, gpu=gpu,
                            on_rows=lambda total: Counted(total, "predicting published runs").done)
    if out is not None:
        try:
            out.write_text(markdown(result))
        except OSError as exc:
            raise PlannerError(f"cannot write report {out}: {exc.strerror or exc}") from None
    if as_json:
        o.print_json(result.to_json())
        return
    con = views.console()
    for table in rich_tables(result):
        con.print(table)
    if out is not None:
        con.print(f"report written to {out}")


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
