"""`planner hardware [NAME]`: the hardware presets, or one spec with its provenance."""

from __future__ import annotations

from typing import Annotated

import typer

from tierwise.cli import options as o


def hardware_command(
    name: Annotated[str | None, typer.Argument(help="preset name or file; omit to list presets")] = None,
    as_json: o.JsonOpt = False,
) -> None:
    """List hardware presets, or show one with the provenance of every number."""
    from rich.table import Table

    from planner.output import report
    from planner.specs.catalog import hardware_presets

    if name is None:
        table = Table(title="Hardware presets", title_justify="left")
        for col in ("name", "GPUs/node", "GPU GiB", "TFLOPS", "description"):
            table.add_column(col, no_wrap=col == "name", overflow="fold")
        for spec in hardware_presets().values():
            doc = spec.to_dict()
            table.add_row(spec.name, str(spec.num_gpus_per_node), f"{doc['gpu_memory_gib']:g}", f"{doc['gpu_peak_tflops']:g}", spec.description)
        report.console().print(table)
        return
    spec = o.node(name)
    doc = spec.to_dict()
    if as_json:
        o.print_json(doc)
        return
    table = Table(title=f"{spec.name}: {spec.description}", title_justify="left")
    columns = ("key", "value", "provenance", "source") if spec.citations else ("key", "value", "provenance")
    for col in columns:
        table.add_column(col, no_wrap=col == "key", overflow="fold")
    for key, value in doc.items():
        if key in ("name", "description", "sources", "citations", "notes"):
            continue
        row = [key, f"{value:g}" if isinstance(value, float) else str(value), spec.provenance(key)]
        if spec.citations:
            row.append(spec.citations.get(key, ""))
        table.add_row(*row)
    report.console().print(table)
    if spec.notes:
        report.console().print(spec.notes)


def register(app: typer.Typer) -> None:
    app.command("hardware")(hardware_command)
