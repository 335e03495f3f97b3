"""Plan vs machine: what `planner run` can tell, before any worker starts, about a plan made for
other hardware than this machine: without it a `dgx-h100` plan would run on a CPU-only machine
without a word, and then be refused with "offload less", the wrong advice.

The workers still check free memory themselves (runtime/plan_io.py); this is the cheap first look,
in the CLI process, whose torch import `planner run` pays anyway.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.specs.tiers import GPU, HOST
from planner.specs.units import GIB

RUNTIME_MODULES = ("torch", "numpy", "psutil")
INSTALL_RUNTIME = ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu (first, or pip picks a "
                   "CUDA build on a CPU-only machine), then pip install 'tierwise[runtime]'")


def require_runtime(verb: str) -> None:
    """A one-line error naming the extra to install when the runtime's modules are missing."""
    missing = [name for name in RUNTIME_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise PlannerError(f"planner {verb} needs the runtime extra ({', '.join(missing)} not installed): "
                           f"{INSTALL_RUNTIME}")


@dataclass(frozen=True, slots=True)
class Machine:
    cuda_devices: int
    host_memory_bytes: int


def this_machine() -> Machine:
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Machine(cuda_devices=cuda, host_memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def hardware_line(plan: Plan) -> str:
    node = plan.node
    if node.host_is_device:
        return f"{node.name} (CPU as the compute device, {node.cpu_memory_bytes / GIB:,.0f} GiB host memory)"
    return (f"{node.name} ({plan.cluster.gpus_per_node} GPU(s) per node of {node.gpu_memory_bytes / GIB:,.0f} GiB, "
            f"{node.cpu_memory_bytes / GIB:,.0f} GiB host memory)")


def mismatches(plan: Plan, machine: Machine, nproc: int) -> list[str]:
    """How this machine falls short of the plan's hardware, one phrase each."""
    node, out = plan.node, []
    if not node.host_is_device and machine.cuda_devices == 0:
        out.append("this machine has no CUDA device")
    elif not node.host_is_device and machine.cuda_devices < nproc:
        out.append(f"this machine has {machine.cuda_devices} CUDA device(s) for {nproc} process(es)")
    if machine.host_memory_bytes < node.cpu_memory_bytes:
        out.append(f"it has {machine.host_memory_bytes / GIB:,.1f} GiB of host memory")
    return out


def check(plan: Plan, machine: Machine, nproc: int) -> str | None:
    """A one-line warning when the plan's hardware is not this machine (None when it is), or a
    PlannerError naming the real cause when the plan cannot run here at all: a GPU plan without
    CUDA whose GPU tier, kept in host memory instead, does not fit."""
    problems = mismatches(plan, machine, nproc)
    if not problems:
        return None
    said = f"{'; '.join(problems)}; the plan is for {hardware_line(plan)}"
    if not plan.node.host_is_device and machine.cuda_devices == 0:
        from planner.cost.memory import memory_bill

        peak = memory_bill(plan).peak_bytes
        host_need = peak[HOST] + peak[GPU] * nproc  # without CUDA every rank's GPU tier is host memory
        if host_need > machine.host_memory_bytes:
            raise PlannerError(f"{said}: here its GPU tier would live in host memory, {host_need / GIB:,.1f} GiB in all; "
                               "run it on that hardware, or plan for this machine (planner fit --hardware local)")
    return f"warning: {said}; the measurements will not be that hardware's"
