"""Human-readable rendering of planner results (rich tables). No numbers are computed here."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from planner.specs.hardware import NodeSpec
from planner.specs.memory_terms import describe
from planner.specs.model import format_param_count
from planner.specs.plan import HostParamShard, HostPinning, Plan
from planner.specs.tiers import TIERS, Tier
from planner.specs.training_loop import step_overlaps_forward
from planner.specs.units import GIB, TIB


# [Note: bottleneck labels] The analytic estimate names the work that takes longest
# (`prediction.bottleneck` "optimizer (nvme)", "compute"...); the simulator names the busiest resource
# ("nvme", "gpu_compute"...). Both JSON vocabularies are a contract; people read one: the resource,
# then (when the analytic estimate says it) whose traffic.
def resource_labels() -> dict[str, str]:
    """Simulator resource -> label; a staged tier's links are named after the tier (NVMe's: `nvme`
    when reads and writes share one budget, else `nvme_read` and `nvme_write`)."""
    stores = {name: f"{tier.label}{suffix}" for tier in TIERS if tier.staged
              for name, suffix in ((str(tier), ""), (tier.read_link, " read"), (tier.write_link, " write"))}
    return {"gpu_compute": "GPU compute", "gpu_gpu": "GPU-GPU link", "h2d": "PCIe host->GPU", "d2h": "PCIe GPU->host",
            "host_memory": "host memory", **stores, "cpu_optimizer": "CPU optimizer", "inter_node": "network"}


def work_labels() -> dict[str, str]:
    """The analytic estimate's work -> label: the resource it waits on, then whose traffic it is."""
    work = ("params", "gradients", "recompute inputs", "optimizer")
    stores = {f"{kind} ({tier})": f"{tier.label} ({kind})" for tier in TIERS if tier.staged for kind in work}
    return {
        "compute": "GPU compute", "tensor parallel": "GPU-GPU link (tensor parallel)",
        "params (gpu)": "GPU-GPU link (params)", "params (cpu)": "PCIe host->GPU (params)",
        "gradients (gpu)": "GPU-GPU link (gradients)", "gradients (cpu)": "PCIe GPU->host (gradients)",
        "recompute inputs (gpu)": "GPU compute", "recompute inputs (cpu)": "PCIe (recompute inputs)",
        "optimizer (gpu)": "GPU compute (optimizer)", "optimizer (cpu)": "CPU optimizer", **stores,
    }


RESOURCE_LABELS = resource_labels()
"""The built-in tiers' resource labels (`resource_labels()` reads a registered tier's too)."""
WORK_LABELS = work_labels()


def bottleneck_label(bottleneck: str) -> str:
    """The display label of a `prediction.bottleneck` value, analytic or simulated (unknown: as is)."""
    return resource_labels().get(bottleneck) or work_labels().get(bottleneck) or bottleneck


def tier_name(tier: Tier, node: NodeSpec) -> str:
    """A tier as people read it, for this hardware: `GPU (per GPU)`, `CPU (per node)`, `NVMe (per
    node)`; where the host is the device (a CPU-only machine) the `gpu` tier is the compute
    device's share of host memory, so no "GPU" is named."""
    if node.host_is_device and tier.on_device:
        return "device (host memory, per device)"
    return f"{tier.label} ({tier.scope})"


def device_word(node: NodeSpec) -> str:
    """What computes: `GPU`, or `device` on a machine whose host is the device."""
    return "device" if node.host_is_device else "GPU"


def fmt_tflops(tflops: float) -> str:
    """One decimal where that is readable; three significant digits below 1 (a CPU's 0.0123)."""
    return f"{tflops:,.1f}" if tflops >= 1 else f"{tflops:.3g}"


def fmt_bytes(nbytes: float) -> str:
    if nbytes >= TIB:
        return f"{nbytes / TIB:,.2f} TiB"
    if nbytes >= GIB:
        return f"{nbytes / GIB:,.1f} GiB"
    return f"{nbytes / 1024**2:,.1f} MiB"


def fmt_seconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def model_line(plan: Plan) -> str:
    m = plan.model
    return (
        f"{m.name}: {m.num_layers} layers x hidden {m.hidden_size}, {m.num_heads} heads, seq {m.seq_len}"
        f" -> {format_param_count(m.num_params)} params"
    )


def _pipeline_label(plan: Plan) -> str:
    """Pipeline stages and micro-batches per step, where the plan has them."""
    label = f" | pipeline {plan.pipeline_parallel_degree}" if plan.pipeline_parallel_degree > 1 else ""
    if plan.pipeline_virtual_stages > 1:
        label += f" (interleaved x{plan.pipeline_virtual_stages})"
    return label + (f" | {plan.micro_batches_per_step} micro-batches/step" if plan.micro_batches_per_step > 1 else "")


def batch_words(plan: Plan) -> str:
    """The micro-batch as the plan means it: per GPU where each GPU holds a whole model replica, else
    per replica of `gpus_per_replica` GPUs (a tensor- or pipeline-parallel replica runs one
    micro-batch across its GPUs; `micro_batch_per_gpu` is then a fraction such as 0.0625)."""
    if plan.gpus_per_replica == 1:
        return f"{plan.micro_batch_per_gpu:g}/GPU"
    per_replica = plan.micro_batch_per_gpu * plan.gpus_per_replica
    return f"{per_replica:g}/replica of {plan.gpus_per_replica} GPUs"


def plan_line(plan: Plan) -> str:
    p = plan.placement
    # Said only when pinned away from the paper's schedule, so the default line stays as it was.
    step = " | optimizer step in backward" if plan.optimizer_step == "in_backward" else ""
    step += " | optimizer step overlaps the next forward" if step_overlaps_forward(plan) else ""
    step += " | host shards pinned" if plan.host_pinning is HostPinning.SHARDS else ""
    step += " | host params are the fp32 master" if plan.host_param_shard is HostParamShard.MASTER else ""
    return (
        f"strategy {plan.strategy}: params={p.params} gradients={p.gradients} optimizer={p.optimizer_states} "
        f"recompute_inputs={p.recompute_inputs} | micro-batch {batch_words(plan)} | recompute interval "
        f"{plan.recompute_interval} | tiling {plan.tiling_factor} | prefetch depth {plan.prefetch_depth} | "
        f"model parallel {plan.model_parallel_degree}{_pipeline_label(plan)} | {plan.precision}"
        f"{f' + fp8 matmuls ({plan.fp8_recipe})' if plan.fp8_matmuls else ''}{step}"
    )


def schedule_line(plan: Plan) -> str:
    """The optimizer step's schedule and why the plan has it (`Plan.optimizer_step_reason`)."""
    return f"{plan.optimizer_step}: {plan.optimizer_step_reason}" if plan.optimizer_step_reason else plan.optimizer_step


def memory_table(plan: Plan, title: str = "Memory per tier") -> Table:
    pred = plan.prediction
    assert pred is not None
    table = Table(title=title, title_justify="left")
    for col in ("tier", "needs", "capacity", "use", "largest terms"):
        table.add_column(col, justify="right" if col in ("needs", "capacity", "use") else "left", overflow="fold")
    for tier in TIERS:
        need, cap = pred.peak_bytes[tier], pred.capacity_bytes[tier]
        terms = sorted(pred.memory_terms.get(tier, {}).items(), key=lambda kv: -kv[1])[:4]
        use = f"{need / cap:.0%}" if cap else ("-" if not need else "no capacity")
        style = "red" if need > cap else ""
        table.add_row(
            tier_name(tier, plan.node),
            fmt_bytes(need),
            fmt_bytes(cap),
            use,
            ", ".join(f"{k} {fmt_bytes(v)}" for k, v in terms if v) or "-",
            style=style,
        )
    return table


def terms_table(plan: Plan) -> Table:
    pred = plan.prediction
    assert pred is not None
    table = Table(title="Memory bill (every term)", title_justify="left")
    for col in ("tier", "term", "bytes", "formula"):
        table.add_column(col, justify="right" if col == "bytes" else "left", overflow="fold")
    for tier in TIERS:
        for name, nbytes in pred.memory_terms.get(tier, {}).items():
            table.add_row(tier_name(tier, plan.node), name, f"{nbytes:,}", describe(name))
    return table


def prediction_table(plan: Plan, bottleneck: str | None = None) -> Table:
    """The prediction's numbers; `bottleneck` is the critical path's label (planner/output/critical_path.py)."""
    pred = plan.prediction
    assert pred is not None and pred.feasible
    flops_rule = "8 x tokens x params" if plan.recompute_interval else "6 x tokens x params"
    table = Table(title=f"Predicted ({pred.method})", title_justify="left", show_header=False)
    table.add_column("metric", overflow="fold")
    table.add_column("value", justify="right", overflow="fold")
    table.add_row("iteration time", fmt_seconds(pred.iteration_time_s))
    table.add_row(f"TFLOPS per {device_word(plan.node)}", f"{fmt_tflops(pred.tflops_per_gpu)}  (paper accounting, eq. 7: {flops_rule})")
    table.add_row("tokens per second", f"{pred.tokens_per_s:,.0f}")
    table.add_row("bottleneck", bottleneck or bottleneck_label(pred.bottleneck))
    for phase, seconds in pred.phase_time_s.items():
        table.add_row(f"  {phase}", fmt_seconds(seconds))
    return table


def bound_note(plans: list[Plan], winner: Plan) -> str:
    """What the bounds of `candidates_table` mean, and whether the winner beats them all."""
    bounds = [p for p in plans if is_bound(p, winner)]
    beaten = all(_pred(p).tokens_per_s <= _pred(winner).tokens_per_s for p in bounds)
    return ("<= / >=: analytic bounds (perfect overlap, peak efficiency), which simulation only lowers; "
            + ("the simulated winner's tokens/s is above every bound" if beaten else
               "a bound above the winner's simulated tokens/s may still be slower: planner simulate it to compare"))


def is_bound(plan: Plan, winner: Plan | None) -> bool:
    """[Note: runner-up bounds] Beside a refined (simulated) winner the runner-ups are simulated too
    before they are shown (planner/output/verdict.py `simulated_runners_up`), so the table compares
    like with like. One the simulator cannot time keeps its analytic prediction; the analytic rate
    bounds the simulated one from above ([Note: analytic bound] in planner/search/refine.py), so it
    is shown as a bound, never ranked against the winner as equal."""
    return winner is not None and _pred(winner).method == "simulated" and _pred(plan).method == "analytic"


def candidates_table(plans: list[Plan], title: str, width: int | None = None, *, winner: Plan | None = None,
                     bottlenecks: list[str] | None = None) -> Table:
    """One row per plan; on a terminal narrower than the table the least useful columns go first
    (named in the caption), and what is left wraps."""
    columns = candidate_columns(plans, winner=winner, bottlenecks=bottlenecks)
    return fitted_table(title, columns, width, note=bound_note(plans, winner) if winner and any(
        is_bound(p, winner) for p in plans) else None)


def candidate_columns(plans: list[Plan], *, winner: Plan | None = None,
                      bottlenecks: list[str] | None = None) -> list[tuple[str, list[str]]]:
    """The runner-up table's (header, cells), most useful first: what the CLI and the dashboard show.
    The iteration time sits beside the batch it is for (plans differ in batch, so a shorter
    iteration may still be fewer tokens/s). Beside a simulated `winner`, analytic rows are bounds
    (see `is_bound`). `bottlenecks`: each plan's bottleneck label (planner/output/critical_path.py),
    else its prediction's."""
    at_most = ["<= " if is_bound(p, winner) else "" for p in plans]
    at_least = [">= " if m else "" for m in at_most]
    columns: list[tuple[str, list[str]]] = [
        ("strategy", [p.strategy for p in plans]),
        ("placement P/G/O/A", [_placement_cell(p) for p in plans]),
        ("iteration", [f"{m}{fmt_seconds(_pred(p).iteration_time_s)}" for m, p in zip(at_least, plans, strict=True)]),
        ("micro-batch", [batch_words(p) for p in plans]),
        ("tokens/s", [f"{m}{_pred(p).tokens_per_s:,.0f}" for m, p in zip(at_most, plans, strict=True)]),
        ("TFLOPS/GPU", [f"{m}{_pred(p).tflops_per_gpu:,.1f}" for m, p in zip(at_most, plans, strict=True)]),
        ("bottleneck", bottlenecks or [bottleneck_label(_pred(p).bottleneck) for p in plans]),
        ("ci/tiling/prefetch", [f"{p.recompute_interval}/{p.tiling_factor}/{p.prefetch_depth}" for p in plans]),
        ("predicted by", [_pred(p).method for p in plans]),
    ]
    return columns


def fitted_table(title: str, columns: list[tuple[str, list[str]]], width: int | None, *,
                 wrap: tuple[str, ...] = (), note: str | None = None) -> Table:
    """A table of `columns` (most useful first) for a terminal `width` columns wide: the last columns
    go (named in the caption) until the rest fits, counting the `wrap` columns at their narrowest
    readable width; the cells left wrap rather than being cut."""
    columns, dropped = list(columns), []

    def needed(header: str, cells: list[str]) -> int:
        widest = max(map(len, [header, *cells]))
        return 3 + (min(widest, 16) if header in wrap else widest)  # 3: border and padding

    while width is not None and len(columns) > 2 and 1 + sum(needed(h, c) for h, c in columns) > width:
        dropped.append(columns.pop()[0])
    shown = f"not shown at this width: {', '.join(reversed(dropped))}" if dropped else None
    caption = "\n".join(line for line in (note, shown) if line) or None
    table = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for header, _ in columns:
        table.add_column(header, overflow="fold", no_wrap=header not in wrap)
    for row in zip(*(cells for _, cells in columns), strict=True):
        table.add_row(*row)
    return table


def _pred(plan: Plan):  # noqa: ANN202
    assert plan.prediction is not None
    return plan.prediction


def _placement_cell(plan: Plan) -> str:
    p = plan.placement
    return "/".join((p.params, p.gradients, p.optimizer_states, p.recompute_inputs))


def rejected_table(plans: list[Plan], title: str = "Why nothing fits (best try per placement)") -> Table:
    table = Table(title=title, title_justify="left")
    columns = rejected_columns(plans)
    for header, _ in columns:
        table.add_column(header, overflow="fold")
    for row in zip(*(cells for _, cells in columns), strict=True):
        table.add_row(*row)
    return table


def rejected_columns(plans: list[Plan]) -> list[tuple[str, list[str]]]:
    """The "does not fit" table's (header, cells): the CLI's and the dashboard's."""
    return [("strategy", [p.strategy for p in plans]), ("placement", [p.placement.label() for p in plans]),
            ("why it does not fit", [_pred(p).reason for p in plans])]


def console() -> Console:
    """Rich's own width: the terminal's; when piped, `COLUMNS` or 80. Tables wrap their cells to fit."""
    return Console(soft_wrap=False)
