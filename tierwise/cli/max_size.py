"""`planner max-size --strategy S --gpus N`: the largest model a strategy can train."""

from __future__ import annotations

from typing import Annotated

import typer

from tierwise.cli import options as o


def max_size_command(
    strategy: Annotated[str, typer.Option("--strategy", help="dp, zero2, zero-offload, zero3, zero-inf-cpu, zero-inf-nvme, 3d")],
    gpus: o.GpusOpt = 1,
    hardware: o.HardwareOpt = None,
    seq: Annotated[int, typer.Option("--seq", help="sequence length")] = 1024,
    precision: o.PrecisionOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Largest model a strategy can train on the hardware (shapes by the documented shape rule)."""
    from planner.output import report
    from planner.search.max_size import max_size
    from planner.specs.plan import strategy_named
    from planner.specs.specio import number

    strategy_named(strategy)
    number(gpus, "--gpus", minimum=1, maximum=1_000_000, integer=True)
    number(seq, "--seq", minimum=1, maximum=100_000_000, integer=True)
    node = o.node(hardware)
    result = max_size(strategy, node, gpus, seq_len=seq, precision=o.precision(node, precision))
    if as_json:
        o.print_json(
            {
                "strategy": strategy,
                "num_gpus": gpus,
                "hardware": node.name,
                "max_params": result.max_params,
                "model": result.model.to_dict() if result.model else None,
                "plan": result.plan.to_dict() if result.plan else None,
            }
        )
        return
    con = report.console()
    if result.plan is None:
        con.print(f"{strategy} cannot train even a {10**7 / 1e6:.0f} M-parameter model on {gpus} GPU(s) of {node.name}")
        return
    con.print(f"[bold]{strategy}[/bold] on {gpus} GPU(s) of {node.name}: up to [bold]{result.max_params / 1e9:,.1f} B[/bold] parameters")
    con.print(f"[bold]Model[/bold]  {report.model_line(result.plan)}")
    con.print(f"[bold]Plan[/bold]   {report.plan_line(result.plan)}")
    con.print(f"[bold]Optimizer step[/bold]  {report.schedule_line(result.plan)}")
    con.print(report.memory_table(result.plan))


def register(app: typer.Typer) -> None:
    app.command("max-size")(max_size_command)
