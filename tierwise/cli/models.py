"""`planner models`: the model presets."""

from __future__ import annotations

import typer


def models() -> None:
    """List the model presets and their aliases."""
    from rich.table import Table

    from planner import report
    from planner.catalog import model_presets
    from planner.model import format_param_count

    table = Table(title="Model presets", title_justify="left")
    for col in ("name", "aliases", "layers", "hidden", "heads", "seq", "vocab", "params", "source"):
        table.add_column(col)
    for name, (spec, aliases) in model_presets().items():
        table.add_row(name, ", ".join(aliases), str(spec.num_layers), str(spec.hidden_size), str(spec.num_heads),
                      str(spec.seq_len), str(spec.vocab_size), format_param_count(spec.num_params), spec.source)
    report.console().print(table)


def register(app: typer.Typer) -> None:
    app.command("models")(models)
