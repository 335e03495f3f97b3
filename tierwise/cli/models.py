"""`planner models`: the model presets."""

from __future__ import annotations

import typer


def models() -> None:
    """List the model presets and their aliases."""
    from planner.output import report
    from planner.specs.catalog import model_presets
    from planner.specs.model import format_param_count

    presets = list(model_presets().items())
    columns = [
        ("name", [name for name, _ in presets]),
        ("params", [format_param_count(spec.num_params) for _, (spec, _) in presets]),
        ("aliases", [", ".join(aliases) for _, (_, aliases) in presets]),
        *((col, [str(getattr(spec, attr)) for _, (spec, _) in presets]) for col, attr in (
            ("layers", "num_layers"), ("hidden", "hidden_size"), ("heads", "num_heads"), ("seq", "seq_len"),
            ("vocab", "vocab_size"))),
        ("source", [spec.source for _, (spec, _) in presets]),
    ]
    con = report.console()
    table = report.fitted_table("Model presets", columns, con.width, wrap=("aliases", "source"))
    con.print(table)


def register(app: typer.Typer) -> None:
    app.command("models")(models)
