"""What of a valid plan this runtime cannot execute, checked without torch: the CLI refuses it before
starting a process and `runtime.plan_io` refuses it in every rank, with the same one-line reason."""

from __future__ import annotations

from typing import Any

from runtime.nvme.placement import nvme_placement_problem

ZERO3_PARTITIONED = frozenset({"params", "gradients", "optimizer_states"})


def executable_problem(plan: Any, *, world_size: int) -> str | None:
    """A one-line reason why this runtime cannot run `plan` on `world_size` processes, or None.

    `plan` is a `planner.specs.plan.Plan` (duck-typed, as in `runtime.nvme.placement`)."""
    if plan.model_parallel_degree != 1:
        return (f"model_parallel_degree {plan.model_parallel_degree} is not supported: this runtime is data parallel "
                "(ZeRO-3) only; set model_parallel_degree to 1")
    if getattr(plan, "context_parallel_degree", 1) != 1:
        return (f"context_parallel_degree {plan.context_parallel_degree} is planned, not run: this runtime keeps "
                "whole sequences on every GPU; set context_parallel_degree to 1")
    if plan.pipeline_parallel_degree != 1 or plan.micro_batches_per_step != 1 or plan.fp8_matmuls:
        return ("pipeline stages, several micro-batches per step and fp8 matmuls are planned, not run: set "
                "pipeline_parallel_degree 1, micro_batches_per_step 1, fp8_matmuls false")
    nvme_problem = nvme_placement_problem(plan)
    if nvme_problem is not None:
        return nvme_problem
    # With one data-parallel rank nothing is split, so every strategy is the same execution.
    if plan.partitioned != ZERO3_PARTITIONED and plan.data_parallel_degree > 1:
        return (f"strategy {plan.strategy} keeps some model states replicated; this runtime partitions all of them "
                "(ZeRO-3): use strategy zero3, zero-inf-cpu or custom")
    if world_size != plan.num_gpus:
        return (f"the plan is for num_gpus {plan.num_gpus} but {world_size} process(es) were started; "
                f"launch {plan.num_gpus} (planner run --nproc) or re-plan for {world_size}")
    return None
