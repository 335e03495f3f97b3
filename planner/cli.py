"""`planner` command line: a thin adapter over the library (DESIGN.md "CLI").

Exit codes: 0 success (an infeasible model is a successful answer), 1 user error with a one-line
message, 2 usage error (typer/click).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from planner.cli_sim import OptimizerStepOpt, optimizer_step_pin
from planner.errors import PlannerError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Tierwise: plan, simulate and run heterogeneous-memory ZeRO-3 (ZeRO-Infinity) training.",
)

# -- options shared by every command that takes a model ---------------------------------------
ModelArg = Annotated[str | None, typer.Argument(help="size shorthand (1T, 175B, 13b), preset name or model JSON file")]
LayersOpt = Annotated[int | None, typer.Option("--layers", help="transformer blocks")]
HiddenOpt = Annotated[int | None, typer.Option("--hidden", help="hidden size")]
HeadsOpt = Annotated[int | None, typer.Option("--heads", help="attention heads")]
SeqOpt = Annotated[int | None, typer.Option("--seq", help="sequence length")]
VocabOpt = Annotated[int | None, typer.Option("--vocab", help="vocabulary size (0 ignores embeddings)")]
HardwareOpt = Annotated[str | None, typer.Option("--hardware", help="hardware preset or JSON file (default dgx-h100)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the JSON document instead of tables")]


def _model(model, layers, hidden, heads, seq, vocab):
    from planner.catalog import resolve_model

    return resolve_model(model, layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)


def _node(hardware: str | None, max_alloc_gib: float | None = None):
    from planner.catalog import resolve_hardware

    node = resolve_hardware(hardware)
    return node if max_alloc_gib is None else node.with_max_alloc_gib(max_alloc_gib)


def _model_parallel(text: str) -> int | None:
    """`auto` searches the degree; otherwise a positive whole number."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise PlannerError(f"--model-parallel must be a whole number or 'auto', got {text!r}") from None
    if value < 1:
        raise PlannerError(f"--model-parallel must be at least 1, got {value}")
    return value


def _print_json(doc) -> None:
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


@app.command()
def fit(
    model: ModelArg = None,
    gpus: Annotated[int, typer.Option("--gpus", help="number of GPUs")] = 1,
    hardware: HardwareOpt = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    batch_per_gpu: Annotated[float | None, typer.Option("--batch-per-gpu", help="pin global batch / GPUs")] = None,
    placement: Annotated[str | None, typer.Option("--placement", help="pin tiers, e.g. params=nvme,optimizer_states=nvme")] = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help="pin a strategy: dp, zero2, zero-offload, zero3, zero-inf-cpu, zero-inf-nvme")] = None,
    checkpoint_interval: Annotated[int | None, typer.Option("--checkpoint-interval", help="pin blocks per activation checkpoint (0: none)")] = None,
    tiling_factor: Annotated[int | None, typer.Option("--tiling-factor", help="pin the tiling factor")] = None,
    prefetch_depth: Annotated[int | None, typer.Option("--prefetch-depth", help="pin the prefetch depth")] = None,
    model_parallel: Annotated[str, typer.Option("--model-parallel", help="tensor-parallel degree within a node, or 'auto' to search it")] = "1",
    max_alloc_gib: Annotated[float | None, typer.Option("--max-alloc-gib", help="largest contiguous GPU allocation")] = None,
    max_batch_per_gpu: Annotated[int, typer.Option("--max-batch-per-gpu", help="largest batch/GPU the search tries")] = 32,
    precision: Annotated[str, typer.Option("--precision", help="bf16, fp16 or fp32")] = "bf16",
    optimizer_step: OptimizerStepOpt = None,
    nvme_path: Annotated[str | None, typer.Option("--nvme-path", help="swap directory for NVMe placements")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write the plan JSON here")] = None,
    deepspeed_out: Annotated[Path | None, typer.Option("--deepspeed-config", help="write a DeepSpeed config here")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Find the fastest placement that fits MODEL on the hardware, and say why."""
    from planner import report
    from planner.plan import parse_placement_pins
    from planner.search import SearchRequest, search
    from planner.sim.refine import refine
    from planner.specio import number, string

    string(precision, "--precision", choices=("bf16", "fp16", "fp32"))
    step = optimizer_step_pin(optimizer_step) or "after_backward"
    number(gpus, "--gpus", minimum=1, maximum=1_000_000, integer=True)
    number(max_batch_per_gpu, "--max-batch-per-gpu", minimum=1, maximum=1_000_000, integer=True)
    request = SearchRequest(
        model=_model(model, layers, hidden, heads, seq, vocab),
        node=_node(hardware, max_alloc_gib),
        num_gpus=gpus,
        strategy=strategy,
        placement_pins=parse_placement_pins(placement),
        micro_batch_per_gpu=batch_per_gpu,
        checkpoint_interval=checkpoint_interval,
        tiling_factor=tiling_factor,
        prefetch_depth=prefetch_depth,
        model_parallel_degree=_model_parallel(model_parallel),
        precision=precision,
        nvme_path=nvme_path,
        max_micro_batch_per_gpu=max_batch_per_gpu,
        optimizer_step=step,
    )
    result = refine(search(request))
    chosen = result.best or (result.rejected[0] if result.rejected else None)
    if chosen is None:
        raise PlannerError("no candidate plan could be formed; check the pinned options")
    if out is not None:
        chosen.save(out)
    if deepspeed_out is not None:
        from planner.deepspeed_config import deepspeed_config
        from planner.specio import write_json_atomic

        write_json_atomic(deepspeed_out, deepspeed_config(chosen), "DeepSpeed config")
        if chosen.optimizer_step == "in_backward":  # stderr: --json keeps stdout a document
            sys.stderr.write("note: DeepSpeed steps the optimizer after backward; the exported config runs the "
                             "plan's placement with DeepSpeed's own after-backward step\n")
    if as_json:
        _print_json(chosen.to_dict())
        return
    con = report.console()
    node = request.node
    where = f"{gpus} GPU(s) of {node.name} ({chosen.num_nodes} node(s) of {node.num_gpus_per_node})"
    con.print(f"[bold]Model[/bold]  {report.model_line(chosen)}")
    if result.best is None:
        con.print(f"[bold red]Verdict: does not fit[/bold red] on {where}")
        con.print(report.rejected_table(result.rejected))
        return
    con.print(f"[bold green]Verdict: fits[/bold green] on {where}; {len(result.ranked)} feasible plans of {result.num_evaluated} evaluated")
    con.print(f"[bold]Plan[/bold]   {report.plan_line(chosen)}")
    con.print(report.memory_table(chosen))
    con.print(report.prediction_table(chosen))
    runners = result.runners_up()
    if runners:
        con.print(report.candidates_table(runners, "Runner-up plans (best of other placements)"))
    if out is not None:
        con.print(f"plan written to {out}")
    if deepspeed_out is not None:
        con.print(f"DeepSpeed config written to {deepspeed_out}")


@app.command()
def memory(
    model: ModelArg = None,
    layers: LayersOpt = None,
    hidden: HiddenOpt = None,
    heads: HeadsOpt = None,
    seq: SeqOpt = None,
    vocab: VocabOpt = None,
    batch_per_gpu: Annotated[float, typer.Option("--batch-per-gpu")] = 1,
    checkpoint_interval: Annotated[int, typer.Option("--checkpoint-interval")] = 1,
    gpus: Annotated[int, typer.Option("--gpus")] = 1,
    hardware: HardwareOpt = None,
    strategy: Annotated[str | None, typer.Option("--strategy", help="strategy whose placement to bill (default zero3)")] = None,
    placement: Annotated[str | None, typer.Option("--placement", help="free placement, e.g. params=cpu,gradients=cpu,optimizer_states=cpu")] = None,
    tiling_factor: Annotated[int, typer.Option("--tiling-factor")] = 1,
    prefetch_depth: Annotated[int, typer.Option("--prefetch-depth")] = 3,
    model_parallel: Annotated[int, typer.Option("--model-parallel")] = 1,
    precision: Annotated[str, typer.Option("--precision")] = "bf16",
    optimizer_step: OptimizerStepOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """The memory bill: the paper's section-3 quantities and every runtime buffer, per tier."""
    from planner import report
    from planner.memory import paper_quantities
    from planner.plan import STRATEGY_TABLE, Placement, Plan, parse_placement_pins
    from planner.search import predict

    if strategy is not None and placement is not None:
        raise PlannerError("give --strategy or --placement, not both")
    if placement is not None:
        chosen_strategy, place = "custom", Placement(**parse_placement_pins(placement))
    else:
        chosen_strategy = strategy or "zero3"
        if chosen_strategy not in STRATEGY_TABLE:
            raise PlannerError(f"unknown strategy {chosen_strategy!r}; use one of {', '.join(STRATEGY_TABLE)}")
        place = STRATEGY_TABLE[chosen_strategy].placement
    plan = predict(
        Plan(
            model=_model(model, layers, hidden, heads, seq, vocab),
            node=_node(hardware),
            num_gpus=gpus,
            strategy=chosen_strategy,
            placement=place,
            micro_batch_per_gpu=batch_per_gpu,
            checkpoint_interval=checkpoint_interval,
            tiling_factor=tiling_factor,
            prefetch_depth=prefetch_depth,
            model_parallel_degree=model_parallel,
            precision=precision,
            optimizer_step=optimizer_step_pin(optimizer_step) or "after_backward",
        )
    )
    quantities = paper_quantities(plan)
    pred = plan.prediction
    assert pred is not None
    if as_json:
        _print_json(
            {
                "model": plan.model.to_dict(),
                "bytes": {k: v for k, v in quantities.items() if not k.startswith("num_")},
                "peak_bytes": pred.peak_bytes,
                "capacity_bytes": pred.capacity_bytes,
                "terms": pred.memory_terms,
                "feasible": pred.feasible,
                "reason": pred.reason,
                "plan": plan.to_dict(),
            }
        )
        return
    con = report.console()
    con.print(f"[bold]Model[/bold]  {report.model_line(plan)}")
    from rich.table import Table

    table = Table(title="Paper quantities (METHOD.md §2)", title_justify="left")
    for col in ("quantity", "bytes", "", "equation"):
        table.add_column(col, justify="right" if col in ("bytes", "") else "left")
    eqs = {"model_states": "eq. 2 (whole model)", "activation_checkpoints_per_gpu": "eq. 3",
           "activations_per_gpu": "eq. 3 + eq. 5", "mswm_per_gpu": "eq. 4 (untiled)", "awm_per_gpu": "eq. 5"}
    for key, eq in eqs.items():
        table.add_row(key, f"{quantities[key]:,}", report.fmt_bytes(quantities[key]), eq)
    con.print(table)
    con.print(f"[bold]Placement[/bold] {report.plan_line(plan)} on {gpus} GPU(s) of {plan.node.name}")
    con.print(report.terms_table(plan))
    con.print(report.memory_table(plan))
    con.print("fits" if pred.feasible else f"[red]does not fit[/red]: {pred.reason}")


@app.command("max-size")
def max_size_command(
    strategy: Annotated[str, typer.Option("--strategy", help="dp, zero2, zero-offload, zero3, zero-inf-cpu, zero-inf-nvme")],
    gpus: Annotated[int, typer.Option("--gpus")] = 1,
    hardware: HardwareOpt = None,
    seq: Annotated[int, typer.Option("--seq")] = 1024,
    as_json: JsonOpt = False,
) -> None:
    """Largest model a strategy can train on the hardware (shapes by the documented shape rule)."""
    from planner import report
    from planner.max_size import max_size
    from planner.plan import STRATEGY_TABLE
    from planner.specio import number

    if strategy not in STRATEGY_TABLE:
        raise PlannerError(f"unknown strategy {strategy!r}; use one of {', '.join(STRATEGY_TABLE)}")
    number(gpus, "--gpus", minimum=1, maximum=1_000_000, integer=True)
    number(seq, "--seq", minimum=1, maximum=100_000_000, integer=True)
    node = _node(hardware)
    result = max_size(strategy, node, gpus, seq_len=seq)
    if as_json:
        _print_json(
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
    con.print(report.memory_table(result.plan))


@app.command()
def models() -> None:
    """List the model presets and their aliases."""
    from rich.table import Table

    from planner import report
    from planner.catalog import model_presets

    table = Table(title="Model presets", title_justify="left")
    for col in ("name", "aliases", "layers", "hidden", "heads", "seq", "vocab", "params", "source"):
        table.add_column(col)
    for name, (spec, aliases) in model_presets().items():
        table.add_row(name, ", ".join(aliases), str(spec.num_layers), str(spec.hidden_size), str(spec.num_heads),
                      str(spec.seq_len), str(spec.vocab_size), f"{spec.num_params / 1e9:,.2f} B", spec.source)
    report.console().print(table)


@app.command("hardware")
def hardware_command(
    name: Annotated[str | None, typer.Argument(help="preset name or file; omit to list presets")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List hardware presets, or show one with the provenance of every number."""
    from rich.table import Table

    from planner import report
    from planner.catalog import hardware_presets

    if name is None:
        table = Table(title="Hardware presets", title_justify="left")
        for col in ("name", "GPUs/node", "GPU GiB", "TFLOPS", "description"):
            table.add_column(col)
        for spec in hardware_presets().values():
            doc = spec.to_dict()
            table.add_row(spec.name, str(spec.num_gpus_per_node), f"{doc['gpu_memory_gib']:g}", f"{doc['gpu_peak_tflops']:g}", spec.description)
        report.console().print(table)
        return
    spec = _node(name)
    doc = spec.to_dict()
    if as_json:
        _print_json(doc)
        return
    table = Table(title=f"{spec.name}: {spec.description}", title_justify="left")
    for col in ("key", "value", "provenance"):
        table.add_column(col)
    for key, value in doc.items():
        if key in ("name", "description", "sources", "notes"):
            continue
        table.add_row(key, f"{value:g}" if isinstance(value, float) else str(value), spec.provenance(key))
    report.console().print(table)
    if spec.notes:
        report.console().print(spec.notes)


@app.command()
def history(
    store: Annotated[Path | None, typer.Option("--store", help="run-history SQLite file (default: user cache dir)")] = None,
    last: Annotated[int, typer.Option("--last", help="show the newest N runs")] = 20,
    as_json: JsonOpt = False,
) -> None:
    """Runs recorded by `planner run`: predicted vs measured, newest last."""
    from rich.table import Table

    from planner import report
    from planner.history import RunHistory

    runs = RunHistory(store)
    frame = runs.to_frame().tail(max(0, last))
    if as_json:
        _print_json(json.loads(frame.drop(columns=["plan_json", "profile_json"]).to_json(orient="records")))
        return
    con = report.console()
    if frame.empty:
        con.print(f"no runs recorded yet in {runs.path}")
        return
    table = Table(title=f"Run history ({runs.path})", title_justify="left")
    for col in ("id", "when", "model", "hardware", "GPUs", "placement P/G/O/A", "batch", "predicted", "measured", "error"):
        table.add_column(col)
    for row in frame.itertuples():
        pred, meas = row.predicted_iteration_time_s, row.measured_iteration_time_s
        error = f"{(pred - meas) / meas:+.1%}" if pred and meas else "-"
        table.add_row(
            str(row.id), row.recorded_at, row.model_name, row.hardware_name, str(row.num_gpus),
            "/".join((row.params_tier, row.gradients_tier, row.optimizer_states_tier, row.activation_checkpoints_tier)),
            f"{row.micro_batch_per_gpu:g}", report.fmt_seconds(pred) if pred else "-",
            report.fmt_seconds(meas) if meas else "-", error,
        )
    con.print(table)


@app.command()
def validate(
    corpus: Annotated[Path | None, typer.Option("--corpus", help="published-runs CSV (default: the bundled corpus)")] = None,
    source: Annotated[str | None, typer.Option("--source", help="only this source_id")] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help="only this GPU type (V100, A100, H100, H200)")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="write a markdown report here")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Predict published training runs and compare with what they measured (planner.validation)."""
    from planner import report as views
    from planner.validation import validate as run_validation
    from planner.validation.render import markdown, rich_tables

    result = run_validation(corpus, source=source, gpu=gpu)
    if out is not None:
        try:
            out.write_text(markdown(result))
        except OSError as exc:
            raise PlannerError(f"cannot write report {out}: {exc.strerror or exc}") from None
    if as_json:
        _print_json(result.to_json())
        return
    con = views.console()
    for table in rich_tables(result):
        con.print(table)
    if out is not None:
        con.print(f"report written to {out}")


# -- command modules --
from planner import cli_app, cli_calibrate, cli_probe, cli_run, cli_sim  # noqa: E402

cli_app.register(app)
cli_sim.register(app)
cli_probe.register(app)
cli_run.register(app)
cli_calibrate.register(app)


def main() -> None:
    try:
        app()
    except PlannerError as exc:
        # One line, whatever the offending value contained.
        sys.stderr.write("error: " + " ".join(str(exc).split()) + "\n")
        sys.exit(1)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)


if __name__ == "__main__":
    main()
