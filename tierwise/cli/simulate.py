"""`planner simulate PLAN.json [--timeline out.png] [--json]`: the discrete-event simulator's CLI.

A thin adapter: pins override the plan file's choices (planner/search/pins.py), `planner.sim.simulate` does the work, rich
prints the prediction (or `--json` the plan document with the simulated `prediction` block).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from planner.specs.plan import Plan, load_plan
from planner.specs.units import GIB
from tierwise.cli import options as o


def simulate_command(
    plan_file: Annotated[Path, typer.Argument(help="Plan document (from `planner fit --out`).", click_type=o.PATH)],
    timeline: Annotated[Path | None, typer.Option("--timeline", help="Write a Gantt chart PNG of the iteration.", click_type=o.PATH)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan document with the simulated prediction.")] = False,
    placement: o.PlacementOpt = None,
    batch_per_gpu: o.BatchOpt = None,
    recompute_interval: o.RecomputeIntervalOpt = None,
    tiling_factor: o.TilingOpt = None,
    prefetch_depth: o.PrefetchOpt = None,
    model_parallel: o.ModelParallelOpt = None,
    max_alloc_gib: o.MaxAllocOpt = None,
    optimizer_step: o.OptimizerStepOpt = None,
    hardware: Annotated[str | None, typer.Option(
        "--hardware", help="simulate the plan on this hardware instead of its own: a preset, JSON file, or 'local' "
                           "(this machine, probed once and cached)")] = None,
) -> None:
    """Simulate one training iteration of a plan (discrete-event, SimPy) and print the prediction."""

    def go() -> None:
        from planner.cost.feasibility import check_plan
        from planner.search.pins import apply_pins
        from planner.search.search import best_model_parallel
        from planner.sim.periodic import simulate_periodic

        plan = load_plan(plan_file)
        if hardware is not None:
            plan = plan.replace(node=o.node(hardware), prediction=None)
            o.precision(plan.node, plan.precision)  # the note, where the new hardware emulates the plan's precision
        plan = apply_pins(check_plan(plan), placement=placement, batch_per_gpu=batch_per_gpu,
                          recompute_interval=recompute_interval, tiling_factor=tiling_factor,
                          prefetch_depth=prefetch_depth, model_parallel=o.model_parallel(model_parallel),
                          max_alloc_gib=max_alloc_gib, optimizer_step=optimizer_step)
        if o.is_auto(model_parallel):
            plan = best_model_parallel(plan).replace(prediction=None)
        # Extrapolated over identical blocks where that reproduces the whole simulation (periodic.py);
        # the busy intervals only when a Gantt chart is drawn.
        result = simulate_periodic(plan, intervals=timeline is not None)
        if timeline is not None:
            from planner.output.timeline import draw

            draw(result, timeline)
        simulated = plan.replace(prediction=result.prediction)
        if as_json:
            typer.echo(json.dumps(simulated.to_dict(), indent=2))
            return
        print_prediction(simulated, result.timelines)
        if timeline is not None:
            typer.echo(f"timeline written to {timeline}")

    o.exit_on_error(go)


def print_prediction(plan: Plan, timelines=None) -> None:  # noqa: ANN001
    from rich.table import Table

    from planner.output import report
    from planner.output.verdict import cheaper_schedules, critical_path, same_plan

    p = plan.prediction
    assert p is not None
    console = report.console()
    verdict = "[green]fits[/]" if p.feasible else f"[red]does not fit[/]: {p.reason}"
    step = ", optimizer step in backward" if plan.optimizer_step == "in_backward" else ""
    console.print(f"[bold]{plan.model.name}[/] on {plan.num_gpus} x {plan.node.name} GPUs, {plan.placement.label()}{step}: "
                  f"{verdict}")
    if plan.node.share_line():  # part of a node: say what it bills (planner/specs/hardware.py [Note: part of a node])
        console.print(plan.node.share_line())
    path = critical_path(plan, timelines) if p.feasible else None  # [Note: exposed critical path]
    bottleneck = path.bottleneck if path else report.bottleneck_label(p.bottleneck)
    console.print(f"simulated iteration {p.iteration_time_s:.4g} s  |  {p.tflops_per_gpu:.3g} TFLOPS/GPU "
                  f"({p.details['flops_accounting']})  |  {p.tokens_per_s:,.0f} tokens/s  |  bottleneck [bold]{bottleneck}[/]")
    if path is not None:
        console.print(f"bottleneck: {path.sentence()}")
        for alternative in cheaper_schedules(plan, path, same_plan(plan)):
            console.print(f"  cheaper: {alternative.line(f'--optimizer-step {alternative.optimizer_step}')}")
    console.print("phases: " + ", ".join(f"{k} {v:.4g} s" for k, v in p.phase_time_s.items()))
    resources = Table("resource", "scope", "busy", "moved", title="resources")
    for column in resources.columns:
        column.overflow = "fold"
    for name, r in sorted(p.details["resources"].items(), key=lambda kv: -kv[1]["busy_fraction"]):
        moved = f"{r['amount'] / GIB:,.1f} GiB" if r["unit"] == "bytes" else f"{r['amount']:.4g} {r['unit']}"
        resources.add_row(report.bottleneck_label(name), r["scope"], f"{r['busy_fraction']:.0%}", moved)
    console.print(resources)
    memory = Table("tier", "bill", "simulated peak", "capacity", "in use at the simulated peak (GiB)",
                   title="memory (the bill decides the verdict; the simulation shows what is live when)")
    for column in memory.columns:
        column.overflow = "fold"
    simulated, simulated_terms = p.details["simulated_peak_bytes"], p.details["simulated_memory_terms"]
    for tier, peak in p.peak_bytes.items():
        terms = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(simulated_terms.get(tier, {}).items(), key=lambda kv: -kv[1]))
        scope = p.details["memory_scope"][tier]
        memory.add_row(f"{tier} ({scope})", f"{peak / GIB:,.1f} GiB", f"{simulated[tier] / GIB:,.1f} GiB",
                       f"{p.capacity_bytes[tier] / GIB:,.1f} GiB", terms)
    console.print(memory)


def register(app: typer.Typer) -> None:
    app.command("simulate", cls=o.RenamedFlags)(simulate_command)

