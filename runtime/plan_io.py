"""From a plan (path, dict or `planner.specs.plan.Plan`) to the runtime's own frozen config.

Everything the runtime cannot execute is rejected here, before any training starts, with a
one-line reason: a plan the runtime cannot execute is rejected with the reason (docs/plan-format.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from planner.cost.feasibility import check_plan
from planner.cost.memory import stores_gradients
from planner.cost.swap import with_default_swap
from planner.specs.errors import PlannerError
from planner.specs.plan import Placement, Plan, load_plan, master_is_param_shard
from planner.specs.units import GIB
from runtime.plan_check import executable_problem

COMPUTE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class PlanNotExecutable(PlannerError):
    """The plan is valid but this runtime (or this machine) cannot run it; the message says why."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """What the runtime reads from a plan, resolved for this process."""

    placement: Placement
    precision: str
    """`fp32` (end to end), `bf16` or `fp16` (16-bit compute copies, fp32 master and Adam states)."""
    recompute_interval: int
    """Blocks per recompute segment; 0: no block is recomputed."""
    tiling_factor: int
    """Tiles per large Linear (1: no tiling)."""
    prefetch_depth: int
    device: torch.device
    """The compute device: `cuda:LOCAL_RANK` when CUDA is present, else the CPU."""
    optimizer_step: str = "after_backward"
    """`after_backward` or `in_backward` (`planner.specs.plan.Plan.optimizer_step`)."""
    stores_gradients: bool = True
    """False when each unit's gradient goes straight into the in-backward update and is never stored
    (`planner.cost.memory.stores_gradients`)."""

    master_shares_param_shard: bool = False
    """The parameter shard is the fp32 master (`planner.specs.plan.master_is_param_shard`): fp32
    params in the optimizer's tier, or `host_param_shard: master`; no separate master exists, the
    update is in place and a read of the shard is cast to the compute precision where it lands."""

    @property
    def compute_dtype(self) -> torch.dtype:
        return COMPUTE_DTYPES[self.precision]

    @property
    def param_shard_dtype(self) -> torch.dtype:
        """The dtype the parameter shards are stored in: the master's where the shard is the master."""
        return torch.float32 if self.master_shares_param_shard else self.compute_dtype


def resolve_plan(plan: str | Path | dict[str, Any] | Plan) -> Plan:
    """The plan, checked; NVMe states without an `nvme_path` swap to the default folder
    (planner/cost/swap.py)."""
    if isinstance(plan, Plan):
        return with_default_swap(check_plan(plan))
    if isinstance(plan, dict):
        return with_default_swap(check_plan(Plan.from_dict(plan)))
    if isinstance(plan, str | Path):
        return with_default_swap(check_plan(load_plan(plan)))
    raise PlannerError(f"plan must be a path, a dict or a planner Plan, not {type(plan).__name__}")


def check_executable(plan: Plan, *, world_size: int) -> None:
    """Raise `PlanNotExecutable` for what this runtime does not run."""
    problem = executable_problem(plan, world_size=world_size)
    if problem is not None:
        raise PlanNotExecutable(problem)
    if plan.precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise PlanNotExecutable("precision bf16 is not supported by this GPU; use fp16 or fp32")


def runtime_config(plan: Plan, *, world_size: int) -> RuntimeConfig:
    check_executable(plan, world_size=world_size)
    check_memory(plan)
    return RuntimeConfig(
        placement=plan.placement,
        precision=plan.precision,
        recompute_interval=plan.recompute_interval,
        tiling_factor=plan.tiling_factor,
        prefetch_depth=plan.prefetch_depth,
        device=compute_device(),
        optimizer_step=plan.optimizer_step,
        stores_gradients=stores_gradients(plan),
        master_shares_param_shard=master_is_param_shard(plan),
    )


def compute_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def local_world_size() -> int:
    """Ranks on this node (torchrun's `LOCAL_WORLD_SIZE`; 1 when run without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def check_memory(plan: Plan) -> None:
    """Refuse a plan whose memory bill does not fit what this machine has free right now: GPU memory,
    and host memory within every limit that would otherwise end the run halfway (see
    [Note: host memory limits])."""
    try:
        from planner.cost.memory import memory_bill
    except ImportError:  # the memory model is not part of this build
        return
    local_ranks = local_world_size()
    bill = memory_bill(plan)
    peak = bill.peak_bytes
    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if peak["gpu"] > free:
            raise PlanNotExecutable(f"the plan needs {peak['gpu'] / GIB:.2f} GiB per GPU but {free / GIB:.2f} GiB is free")
        host_need = peak["cpu"]
    else:
        # Without CUDA the compute device is host memory: every rank's `gpu` tier lives there too.
        host_need = peak["cpu"] + peak["gpu"] * local_ranks
    for limit in host_memory_limits(local_ranks):
        if host_need > limit.bytes_:
            raise PlanNotExecutable(
                f"the plan needs {host_need / GIB:.2f} GiB of host memory on this node but {limit.what} allows "
                f"{limit.bytes_ / GIB:.2f} GiB; offload less, add nodes or shrink the model"
            )


@dataclass(frozen=True, slots=True)
class HostLimit:
    bytes_: int
    """Host memory the node's ranks may still take under this limit (node total)."""
    what: str


def host_memory_limits(local_world_size: int, *, cgroup_root: Path = Path("/sys/fs/cgroup")) -> list[HostLimit]:
    """[Note: host memory limits]
    A plan must fit every one of these, or the run is killed (OOM killer, cgroup OOM) or fails an
    allocation (RLIMIT_AS/RLIMIT_DATA) in the middle of training instead of being refused up front:
    - the memory the kernel reports available (psutil; excludes swap, which pinned memory cannot use);
    - a cgroup v2 `memory.max` (containers: the host's free memory says nothing about the container's);
    - RLIMIT_AS and RLIMIT_DATA of this process, times the ranks on this node (each has its own).
    RLIMIT_MEMLOCK is not among them: the runtime locks no memory itself (no mlock, no io_uring
    registered buffers); CUDA's pinned memory is page-locked by the NVIDIA driver, which does not
    charge RLIMIT_MEMLOCK."""
    import resource

    import psutil

    limits = [HostLimit(psutil.virtual_memory().available, "the memory available on this node")]
    cgroup = cgroup_headroom_bytes(cgroup_root)
    if cgroup is not None:
        limits.append(HostLimit(cgroup, f"the cgroup memory limit ({cgroup_root}/memory.max)"))
    used = psutil.Process().memory_info().vms
    for name in ("RLIMIT_AS", "RLIMIT_DATA"):
        soft, _ = resource.getrlimit(getattr(resource, name))
        if soft != resource.RLIM_INFINITY:
            limits.append(HostLimit(max(0, soft - used) * local_world_size, f"{name} ({soft / GIB:.2f} GiB per process)"))
    return limits


def cgroup_headroom_bytes(root: Path) -> int | None:
    """Limit minus usage of this process's memory cgroup (v2 `memory.max`, or v1
    `memory.limit_in_bytes` at the container's mount), or None where there is no limit."""
    try:
        line = Path("/proc/self/cgroup").read_text().splitlines()[0]
        relative = line.split("::", 1)[1].lstrip("/") if line.startswith("0::") else ""
    except (OSError, IndexError):
        relative = ""
    candidates = [(root / relative / "memory.max", root / relative / "memory.current"),
                  (root / "memory.max", root / "memory.current"),
                  (root / "memory" / "memory.limit_in_bytes", root / "memory" / "memory.usage_in_bytes")]
    for limit_file, usage_file in candidates:
        try:
            limit = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if not limit.isdigit() or int(limit) >= 1 << 62:  # "max", or v1's "unlimited" (page-rounded 2^63)
            return None
        return max(0, int(limit) - usage)
    return None
