"""Human-readable rendering of planner results (rich tables). No numbers are computed here."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from planner.memory_terms import describe
from planner.model import format_param_count
from planner.plan import TIERS, Plan
from planner.units import GIB, TIB

TIER_UNIT = {"gpu": "per GPU", "cpu": "per node", "nvme": "per node"}


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


def plan_line(plan: Plan) -> str:
    p = plan.placement
    # Said only when pinned away from the paper's schedule, so the default line stays as it was.
    step = " | optimizer step in backward" if plan.optimizer_step == "in_backward" else ""
    return (
        f"strategy {plan.strategy}: params={p.params} gradients={p.gradients} optimizer={p.optimizer_states} "
        f"checkpoints={p.activation_checkpoints} | batch/GPU {plan.micro_batch_per_gpu:g} | checkpoint interval "
        f"{plan.checkpoint_interval} | tiling {plan.tiling_factor} | prefetch depth {plan.prefetch_depth} | "
        f"model parallel {plan.model_parallel_degree} | {plan.precision}{step}"
    )


def memory_table(plan: Plan, title: str = "Memory per tier") -> Table:
    pred = plan.prediction
    assert pred is not None
    table = Table(title=title, title_justify="left")
    for col in ("tier", "needs", "capacity", "use", "largest terms"):
        table.add_column(col, justify="right" if col in ("needs", "capacity", "use") else "left")
    for tier in TIERS:
        need, cap = pred.peak_bytes[tier], pred.capacity_bytes[tier]
        terms = sorted(pred.memory_terms.get(tier, {}).items(), key=lambda kv: -kv[1])[:4]
        use = f"{need / cap:.0%}" if cap else ("-" if not need else "no capacity")
        style = "red" if need > cap else ""
        table.add_row(
            f"{tier} ({TIER_UNIT[tier]})",
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
        table.add_column(col, justify="right" if col == "bytes" else "left")
    for tier in TIERS:
        for name, nbytes in pred.memory_terms.get(tier, {}).items():
            table.add_row(f"{tier} ({TIER_UNIT[tier]})", name, f"{nbytes:,}", describe(name))
    return table


def prediction_table(plan: Plan) -> Table:
    pred = plan.prediction
    assert pred is not None and pred.feasible
    flops_rule = "8 x tokens x params" if plan.checkpoint_interval else "6 x tokens x params"
    table = Table(title=f"Predicted ({pred.method})", title_justify="left", show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("iteration time", fmt_seconds(pred.iteration_time_s))
    table.add_row("TFLOPS per GPU", f"{pred.tflops_per_gpu:,.1f}  (paper accounting, eq. 7: {flops_rule})")
    table.add_row("tokens per second", f"{pred.tokens_per_s:,.0f}")
    table.add_row("bottleneck", pred.bottleneck)
    for phase, seconds in pred.phase_time_s.items():
        table.add_row(f"  {phase}", fmt_seconds(seconds))
    return table


def candidates_table(plans: list[Plan], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("strategy", "params", "grads", "optimizer", "ckpts", "batch/GPU", "ci", "tiling", "prefetch",
                "TFLOPS/GPU", "iteration", "bottleneck", "predicted by"):
        table.add_column(col)
    for plan in plans:
        pred = plan.prediction
        assert pred is not None
        p = plan.placement
        table.add_row(
            plan.strategy, p.params, p.gradients, p.optimizer_states, p.activation_checkpoints,
            f"{plan.micro_batch_per_gpu:g}", str(plan.checkpoint_interval), str(plan.tiling_factor),
            str(plan.prefetch_depth), f"{pred.tflops_per_gpu:,.1f}", fmt_seconds(pred.iteration_time_s), pred.bottleneck,
            pred.method,
        )
    return table


def rejected_table(plans: list[Plan], title: str = "Why nothing fits (best try per placement)") -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("strategy", "placement", "reason"):
        table.add_column(col)
    for plan in plans:
        assert plan.prediction is not None
        table.add_row(plan.strategy, plan.placement.label(), plan.prediction.reason)
    return table


def console() -> Console:
    import shutil

    # Wide enough for the tables when piped (rich would otherwise assume 80 columns).
    return Console(width=max(160, shutil.get_terminal_size((160, 40)).columns), soft_wrap=False)
