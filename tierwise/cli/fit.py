"""`planner fit MODEL --gpus N`: the fastest placement that fits, and why (docs/conventions.md)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from planner.specs.errors import PlannerError
from tierwise.cli import options as o


def fit(
    model: o.ModelArg = None,
    gpus: o.GpusOpt = 1,
    hardware: o.HardwareOpt = None,
    layers: o.LayersOpt = None,
    hidden: o.HiddenOpt = None,
    heads: o.HeadsOpt = None,
    seq: o.SeqOpt = None,
    vocab: o.VocabOpt = None,
    batch_per_gpu: o.BatchOpt = None,
    placement: o.PlacementOpt = None,
    strategy: o.StrategyOpt = None,
    recompute_interval: o.RecomputeIntervalOpt = None,
    tiling_factor: o.TilingOpt = None,
    prefetch_depth: o.PrefetchOpt = None,
    model_parallel: o.ModelParallelOpt = None,
    pipeline_parallel: o.PipelineParallelOpt = None,
    micro_batches: o.MicroBatchesOpt = None,
    max_alloc_gib: o.MaxAllocOpt = None,
    max_batch_per_gpu: Annotated[int, typer.Option("--max-batch-per-gpu", help="largest batch/GPU the search tries")] = 32,
    precision: o.PrecisionOpt = None,
    optimizer_step: o.SearchedOptimizerStepOpt = None,
    clip_grad_norm: o.ClipGradNormOpt = False,
    locked_memory: o.LockedMemoryOpt = None,
    nvme_path: Annotated[str | None, typer.Option("--nvme-path", help="swap directory for NVMe placements")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write the plan JSON here", click_type=o.PATH)] = None,
    deepspeed_out: Annotated[Path | None, typer.Option("--deepspeed-config", help="write a DeepSpeed config for this plan here", click_type=o.PATH)] = None,
    accelerate_out: Annotated[Path | None, typer.Option(
        "--accelerate-config", help="write an accelerate (FSDP2) config for this plan here, for `accelerate launch "
                              "--config_file`", click_type=o.PATH)] = None,
    fsdp2_out: Annotated[Path | None, typer.Option(
        "--fsdp2-snippet", help="write a Python snippet applying this plan with FSDP2 fully_shard here", click_type=o.PATH)] = None,
    as_json: o.JsonOpt = False,
) -> None:
    """Find the fastest placement that fits MODEL on the hardware, and say why."""
    from planner.search.pins import optimizer_step_pin, parallel_degrees
    from planner.search.refine import refine
    from planner.search.search import SearchRequest, search
    from planner.specs.plan import parse_placement_pins
    from planner.specs.specio import number, write_text_atomic
    from planner.specs.training_loop import TrainingLoop

    training = TrainingLoop(optimizer_step=optimizer_step_pin(optimizer_step), clips_grad_norm=clip_grad_norm)
    number(gpus, "--gpus", minimum=1, maximum=1_000_000, integer=True)
    number(max_batch_per_gpu, "--max-batch-per-gpu", minimum=1, maximum=1_000_000, integer=True)
    if micro_batches is not None:
        number(micro_batches, "--micro-batches", minimum=1, maximum=1_000_000, integer=True)
    # Not given: 1, except for `3d`, whose point is to search tensor and pipeline degrees (the dashboard's rule too).
    degrees = parallel_degrees(strategy, o.degree_given(model_parallel, "--model-parallel"),
                               o.degree_given(pipeline_parallel, "--pipeline-parallel"))
    node = o.node(hardware, max_alloc_gib)
    request = SearchRequest(
        model=o.model(model, layers, hidden, heads, seq, vocab),
        node=node,
        num_gpus=gpus,
        strategy=strategy,
        placement_pins=parse_placement_pins(placement),
        micro_batch_per_gpu=batch_per_gpu,
        recompute_interval=recompute_interval,
        tiling_factor=tiling_factor,
        prefetch_depth=prefetch_depth,
        model_parallel_degree=degrees[0],
        pipeline_parallel_degree=degrees[1],
        micro_batches_per_step=micro_batches,
        precision=o.precision(node, precision),
        nvme_path=nvme_path,
        max_micro_batch_per_gpu=max_batch_per_gpu,
        training=training,
        locked_memory_bytes=o.locked_memory_bytes(locked_memory, hardware),
    )
    result = refine(search(request), runners_ahead=not as_json)  # the verdict shows the runner-ups simulated
    chosen = result.best or (result.rejected[0] if result.rejected else None)
    if chosen is None:
        raise PlannerError("no candidate plan could be formed; check the pinned options")
    configs = _framework_configs(chosen, accelerate_out, fsdp2_out)  # refused before anything is written
    _write(chosen, out, deepspeed_out)
    for path, (text, what) in configs.items():
        write_text_atomic(path, text, what)
    _answer(result, chosen, gpus, out, deepspeed_out, configs, as_json=as_json)


def _answer(result, chosen, gpus: int, out: Path | None, deepspeed_out: Path | None,  # noqa: ANN001
            configs: dict[Path, tuple[str, str]], *, as_json: bool) -> None:
    """The plan as JSON, or the verdict; then the line on the host shards' pinning, if any, and the
    configs written."""
    pinning = _pinning_line(chosen, result.request.locked_memory_bytes)
    if as_json:
        o.print_json(chosen.to_dict())
        if pinning:  # stderr: --json keeps stdout a document
            sys.stderr.write(f"note: {pinning}\n")
        return
    _print_verdict(result, out, deepspeed_out)
    if pinning:
        typer.echo(pinning)
    for path, (_, what) in configs.items():
        typer.echo(f"{what} written to {path}")


def _pinning_line(chosen, locked_memory_bytes: float) -> str:  # noqa: ANN001
    """One line where the chosen plan stages its host shards because the locked-memory limit or
    host memory forbade pinning them (planner/cost/host_link.py `choose_host_pinning`); '' otherwise."""
    from planner.cost.host_link import choose_host_pinning

    if chosen.prediction is None or not chosen.prediction.feasible:
        return ""
    _, line = choose_host_pinning(chosen, locked_memory_bytes)
    return line


def _framework_configs(chosen, accelerate_out: Path | None, fsdp2_out: Path | None) -> dict[Path, tuple[str, str]]:  # noqa: ANN001
    """Path -> (text, what) for the FSDP2 framework configs asked for; a plan they cannot express is
    refused here."""
    if accelerate_out is None and fsdp2_out is None:
        return {}
    from planner.output.framework_configs import accelerate_yaml, fsdp2_snippet  # YAML, for these only

    configs = {}
    if accelerate_out is not None:
        configs[accelerate_out] = (accelerate_yaml(chosen), "accelerate config")
    if fsdp2_out is not None:
        configs[fsdp2_out] = (fsdp2_snippet(chosen), "FSDP2 snippet")
    return configs


def _write(chosen, out: Path | None, deepspeed_out: Path | None) -> None:  # noqa: ANN001
    if out is not None:
        chosen.save(out)
        if chosen.placement.model_states_on_nvme and not chosen.nvme_path:  # stderr: --json keeps stdout a document
            from planner.cost.swap import default_swap_path

            sys.stderr.write(f"note: the plan puts states on NVMe and names no --nvme-path: planner run and "
                             f"runtime.shard swap to {default_swap_path()} (pass --nvme-path DIR for a directory "
                             "on an NVMe drive)\n")
    if deepspeed_out is not None:
        from planner.output.deepspeed_config import deepspeed_config
        from planner.specs.specio import write_json_atomic

        write_json_atomic(deepspeed_out, deepspeed_config(chosen), "DeepSpeed config")
        if chosen.optimizer_step == "in_backward":  # stderr: --json keeps stdout a document
            sys.stderr.write("note: DeepSpeed steps the optimizer after backward; the DeepSpeed config runs the "
                             "plan's placement with DeepSpeed's own after-backward step\n")


def _print_verdict(result, out: Path | None, deepspeed_out: Path | None) -> None:  # noqa: ANN001
    from planner.output import report
    from planner.output.verdict import searcher, verdict

    shown = verdict(result, searcher(result.request))  # the dashboard's verdict ([Note: one verdict])
    chosen = shown.plan
    con = report.console()
    con.print(f"[bold]Model[/bold]  {report.model_line(chosen)}")
    if shown.share_note:  # part of a node: say what it bills (planner/specs/hardware.py [Note: part of a node])
        con.print(shown.share_note)
    if not shown.fits:
        con.print(f"[bold red]Verdict: {shown.headline()}[/bold red]")
        con.print(report.rejected_table(result.rejected))
        return
    con.print(f"[bold green]Verdict: {shown.headline()}[/bold green]")
    con.print(f"[bold]Plan[/bold]   {report.plan_line(chosen)}")
    con.print(f"[bold]Optimizer step[/bold]  {report.schedule_line(chosen)}")
    con.print(report.memory_table(chosen))
    con.print(report.prediction_table(chosen, shown.path.bottleneck))
    con.print(f"[bold]Bottleneck[/bold] {shown.path.sentence()}")
    for alternative in shown.cheaper:
        con.print(f"  cheaper: {alternative.line(f'--optimizer-step {alternative.optimizer_step}')}")
    if shown.runners:
        con.print(report.candidates_table(shown.runners, "Runner-up plans (best of other placements)", con.width,
                                          winner=chosen, bottlenecks=shown.runner_bottlenecks))
    if out is not None:
        con.print(f"plan written to {out}")
    if deepspeed_out is not None:
        con.print(f"DeepSpeed config written to {deepspeed_out}")


def register(app: typer.Typer) -> None:
    app.command("fit", cls=o.RenamedFlags)(fit)
