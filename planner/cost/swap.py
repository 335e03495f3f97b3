"""Where a plan's NVMe states go when the plan names no directory: a `tierwise-swap` folder in the
user's cache (platformdirs: $XDG_CACHE_HOME or ~/.cache on Linux), so a plan that places states on
NVMe always runs, with `planner run` and with `runtime.shard`, and `--nvme-path` / `nvme_path`
choose a faster drive.

The free space is checked before anything starts: one line naming the bytes the plan puts on NVMe
and the bytes free there. (The runtime checks again per node, with every rank's files, before it
writes one: runtime/nvme/directory.py.)
"""

from __future__ import annotations

import shutil
from pathlib import Path

from planner.specs.errors import PlannerError
from planner.specs.plan import Plan

SWAP_FOLDER = "tierwise-swap"


def default_swap_path() -> Path:
    """`<user cache>/tierwise-swap` (not created here)."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir()) / SWAP_FOLDER


def with_default_swap(plan: Plan) -> Plan:
    """The plan with the default swap folder (created) when it places states on NVMe and names none."""
    if not plan.placement.model_states_on_nvme or plan.nvme_path:
        return plan
    path = default_swap_path()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PlannerError(f"cannot create the default swap folder {path}: {exc.strerror or exc}; pass --nvme-path DIR "
                           "(a directory on an NVMe drive)") from None
    return plan.replace(nvme_path=str(path))


def swap_space_problem(plan: Plan) -> str | None:
    """One line when the plan's swap directory has less free space than the plan puts on NVMe."""
    if not plan.placement.model_states_on_nvme or not plan.nvme_path:
        return None
    from planner.cost.memory import memory_bill
    from planner.specs.tiers import NVME

    needed = memory_bill(plan).peak_bytes[NVME]
    free = shutil.disk_usage(plan.nvme_path).free
    if needed <= free:
        return None
    return (f"the swap directory {plan.nvme_path} has {free:,} bytes free but the plan puts {needed:,} bytes on NVMe; "
            "free space there or pass --nvme-path DIR (a directory with room, on an NVMe drive)")
