"""`planner simulate PLAN.json [--timeline out.png] [--json]`: the discrete-event simulator's CLI.

A thin adapter: pins override the plan file's choices, `planner.sim.simulate` does the work, rich
prints the prediction (or `--json` the plan document with the simulated `prediction` block).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from planner.errors import PlannerError
from planner.plan import OPTIMIZER_STEPS, Placement, Plan, load_plan, parse_placement_pins
from planner.specio import string
from planner.units import GIB

PlacementOpt = Annotated[str | None, typer.Option("--placement", help="Pin states to tiers: params=nvme,optimizer_states=nvme,...")]
BatchOpt = Annotated[float | None, typer.Option("--batch-per-gpu", help="Global batch / number of GPUs (paper's batch/GPU).")]
CheckpointOpt = Annotated[int | None, typer.Option("--checkpoint-interval", help="Blocks between activation checkpoints; 0 = none.")]
TilingOpt = Annotated[int | None, typer.Option("--tiling-factor", help="Tiles per large linear, gathered one at a time.")]
PrefetchOpt = Annotated[int | None, typer.Option("--prefetch-depth", help="Operators fetched ahead (0 = no overlap).")]
ModelParallelOpt = Annotated[int | None, typer.Option("--model-parallel", help="Tensor-parallel degree inside a node.")]
MaxAllocOpt = Annotated[float | None, typer.Option("--max-alloc-gib", help="Largest contiguous GPU allocation (GiB).")]
OptimizerStepOpt = Annotated[str | None, typer.Option(
    "--optimizer-step", help="after_backward (default: the paper's step) or in_backward (each unit updated as soon as "
                             "its gradient is final; no gradient accumulation or clipping)")]


def optimizer_step_pin(text: str | None) -> str | None:
    """`--optimizer-step`, checked (None: not pinned; the search never picks it on its own)."""
    return None if text is None else string(text, "--optimizer-step", choices=OPTIMIZER_STEPS)


def apply_pins(
    plan: Plan,
    *,
    placement: str | None = None,
    batch_per_gpu: float | None = None,
    checkpoint_interval: int | None = None,
    tiling_factor: int | None = None,
    prefetch_depth: int | None = None,
    model_parallel: int | None = None,
    max_alloc_gib: float | None = None,
    optimizer_step: str | None = None,
) -> Plan:
    """The plan with the user's pinned choices; any stale prediction is dropped."""
    changes: dict[str, object] = {"prediction": None}
    pins = parse_placement_pins(placement)
    if pins:
        new_placement = Placement(**{**plan.placement.to_dict(), **pins})
        if new_placement != plan.placement:
            changes.update(placement=new_placement, strategy="custom")
    for key, value in (("micro_batch_per_gpu", batch_per_gpu), ("checkpoint_interval", checkpoint_interval),
                       ("tiling_factor", tiling_factor), ("prefetch_depth", prefetch_depth),
                       ("model_parallel_degree", model_parallel)):
        if value is not None:
            changes[key] = value
    if optimizer_step is not None:
        changes["optimizer_step"] = optimizer_step_pin(optimizer_step)
    if max_alloc_gib is not None:
        changes["node"] = plan.node.with_max_alloc_gib(max_alloc_gib)
    return plan.replace(**changes)


def simulate_command(
    plan_file: Annotated[Path, typer.Argument(help="Plan document (from `planner fit --out`).")],
    timeline: Annotated[Path | None, typer.Option("--timeline", help="Write a Gantt chart PNG of the iteration.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plan document with the simulated prediction.")] = False,
    placement: PlacementOpt = None,
    batch_per_gpu: BatchOpt = None,
    checkpoint_interval: CheckpointOpt = None,
    tiling_factor: TilingOpt = None,
    prefetch_depth: PrefetchOpt = None,
    model_parallel: ModelParallelOpt = None,
    max_alloc_gib: MaxAllocOpt = None,
    optimizer_step: OptimizerStepOpt = None,
) -> None:
    """Simulate one training iteration of a plan (discrete-event, SimPy) and print the prediction."""
    from planner.sim import simulate

    try:
        plan = apply_pins(load_plan(plan_file), placement=placement, batch_per_gpu=batch_per_gpu,
                          checkpoint_interval=checkpoint_interval, tiling_factor=tiling_factor,
                          prefetch_depth=prefetch_depth, model_parallel=model_parallel, max_alloc_gib=max_alloc_gib,
                          optimizer_step=optimizer_step)
        result = simulate(plan)
        if timeline is not None:
            from planner.sim.timeline import draw

            draw(result, timeline)
    except PlannerError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    simulated = plan.replace(prediction=result.prediction)
    if as_json:
        typer.echo(json.dumps(simulated.to_dict(), indent=2))
        return
    print_prediction(simulated)
    if timeline is not None:
        typer.echo(f"timeline written to {timeline}")


def print_prediction(plan: Plan) -> None:
    from rich.table import Table

    from planner.report import console as wide_console

    p = plan.prediction
    assert p is not None
    console = wide_console()
    verdict = "[green]fits[/]" if p.feasible else f"[red]does not fit[/]: {p.reason}"
    step = ", optimizer step in backward" if plan.optimizer_step == "in_backward" else ""
    console.print(f"[bold]{plan.model.name}[/] on {plan.num_gpus} x {plan.node.name} GPUs, {plan.placement.label()}{step}: "
                  f"{verdict}")
    console.print(f"simulated iteration {p.iteration_time_s:.4g} s  |  {p.tflops_per_gpu:.3g} TFLOPS/GPU "
                  f"({p.details['flops_accounting']})  |  {p.tokens_per_s:,.0f} tokens/s  |  bottleneck [bold]{p.bottleneck}[/]")
    console.print("phases: " + ", ".join(f"{k} {v:.4g} s" for k, v in p.phase_time_s.items()))
    resources = Table("resource", "scope", "busy", "moved", title="resources")
    for name, r in sorted(p.details["resources"].items(), key=lambda kv: -kv[1]["busy_fraction"]):
        moved = f"{r['amount'] / GIB:,.1f} GiB" if r["unit"] == "bytes" else f"{r['amount']:.4g} {r['unit']}"
        resources.add_row(name, r["scope"], f"{r['busy_fraction']:.0%}", moved)
    console.print(resources)
    memory = Table("tier", "bill", "simulated peak", "capacity", "in use at the simulated peak (GiB)",
                   title="memory (the bill decides the verdict; the simulation shows what is live when)")
    simulated, simulated_terms = p.details["simulated_peak_bytes"], p.details["simulated_memory_terms"]
    for tier, peak in p.peak_bytes.items():
        terms = ", ".join(f"{k} {v / GIB:.1f}" for k, v in sorted(simulated_terms.get(tier, {}).items(), key=lambda kv: -kv[1]))
        scope = p.details["memory_scope"][tier]
        memory.add_row(f"{tier} ({scope})", f"{peak / GIB:,.1f} GiB", f"{simulated[tier] / GIB:,.1f} GiB",
                       f"{p.capacity_bytes[tier] / GIB:,.1f} GiB", terms)
    console.print(memory)


def register(app: typer.Typer) -> None:
    app.command("simulate")(simulate_command)


if __name__ == "__main__":
    _app = typer.Typer(add_completion=False)
    register(_app)
    _app()
