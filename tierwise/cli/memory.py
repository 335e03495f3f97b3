"""`planner memory MODEL`: the memory bill of one plan, per tier and term."""

from __future__ import annotations

from typing import Annotated

import typer

from planner.specs.errors import PlannerError
from tierwise.cli import options as o

PAPER_EQUATIONS = {"model_states": "eq. 2 (whole model)", "recompute_inputs_per_gpu": "eq. 3",
                   "activations_per_gpu": "eq. 3 + eq. 5", "mswm_per_gpu": "eq. 4 (untiled)", "awm_per_gpu": "eq. 5"}


def memory(
    model: o.ModelArg = None,
    layers: o.LayersOpt = None,
    hidden: o.HiddenOpt = None,
    heads: o.HeadsOpt = None,
    seq: o.SeqOpt = None,
    vocab: o.VocabOpt = None,
    batch_per_gpu: o.BatchOpt = 1,
    recompute_interval: o.RecomputeIntervalOpt = 1,
    gpus: o.GpusOpt = 1,
    hardware: o.HardwareOpt = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help="strategy whose placement to bill (default zero3)")] = None,
    placement: Annotated[str | None, typer.Option("--placement", help="free placement, e.g. params=cpu,gradients=cpu,optimizer_states=cpu")] = None,
    tiling_factor: o.TilingOpt = 1,
    prefetch_depth: o.PrefetchOpt = 3,
    model_parallel: o.ModelParallelOpt = "1",
    precision: o.PrecisionOpt = None,
    optimizer_step: o.OptimizerStepOpt = None,
    as_json: o.JsonOpt = False,
) -> None:
    """The memory bill: the paper's section-3 quantities and every runtime buffer, per tier."""
    from planner.cost.feasibility import check_plan
    from planner.cost.memory import paper_quantities
    from planner.search.pins import optimizer_step_pin
    from planner.search.search import best_model_parallel, predict
    from planner.specs.plan import Plan

    chosen_strategy, place = _placement(strategy, placement)
    degree = o.model_parallel(model_parallel)
    node = o.node(hardware)
    described = Plan(
        model=o.model(model, layers, hidden, heads, seq, vocab),
        node=node,
        num_gpus=gpus,
        strategy=chosen_strategy,
        placement=place,
        micro_batch_per_gpu=batch_per_gpu,
        recompute_interval=recompute_interval,
        tiling_factor=tiling_factor,
        prefetch_depth=prefetch_depth,
        model_parallel_degree=degree or 1,
        precision=o.precision(node, precision),
        optimizer_step=optimizer_step_pin(optimizer_step) or "after_backward",
    )
    plan = predict(check_plan(described))
    if degree is None:
        plan = best_model_parallel(plan)
    quantities = paper_quantities(plan)
    if as_json:
        o.print_json(_document(plan, quantities))
    else:
        _print_bill(plan, quantities)


def _placement(strategy: str | None, placement: str | None):  # noqa: ANN202
    """(strategy name, placement) to bill: a named strategy's, or a free one ("custom")."""
    from planner.specs.plan import Placement, parse_placement_pins, strategy_named

    if strategy is not None and placement is not None:
        raise PlannerError("give --strategy or --placement, not both")
    if placement is not None:
        return "custom", Placement(**parse_placement_pins(placement))
    chosen = strategy or "zero3"
    return chosen, strategy_named(chosen).placement


def _document(plan, quantities: dict) -> dict:  # noqa: ANN001
    pred = plan.prediction
    return {
        "model": plan.model.to_dict(),
        "bytes": {k: v for k, v in quantities.items() if not k.startswith("num_")},
        "peak_bytes": pred.peak_bytes,
        "capacity_bytes": pred.capacity_bytes,
        "terms": pred.memory_terms,
        "feasible": pred.feasible,
        "reason": pred.reason,
        "plan": plan.to_dict(),
    }


def _print_bill(plan, quantities: dict) -> None:  # noqa: ANN001
    from rich.table import Table

    from planner.output import report

    con = report.console()
    con.print(f"[bold]Model[/bold]  {report.model_line(plan)}")
    if plan.node.share_line():  # part of a node: say what it bills (planner/specs/hardware.py [Note: part of a node])
        con.print(plan.node.share_line())
    table = Table(title="Paper quantities (docs/method.md §2)", title_justify="left")
    for col in ("quantity", "bytes", "", "equation"):
        table.add_column(col, justify="right" if col in ("bytes", "") else "left", overflow="fold")
    for key, eq in PAPER_EQUATIONS.items():
        table.add_row(key, f"{quantities[key]:,}", report.fmt_bytes(quantities[key]), eq)
    con.print(table)
    con.print(f"[bold]Placement[/bold] {report.plan_line(plan)} on {plan.num_gpus} GPU(s) of {plan.node.name}")
    con.print(report.terms_table(plan))
    con.print(report.memory_table(plan))
    pred = plan.prediction
    con.print("fits" if pred.feasible else f"[red]does not fit[/red]: {pred.reason}")


def register(app: typer.Typer) -> None:
    app.command("memory", cls=o.RenamedFlags)(memory)
