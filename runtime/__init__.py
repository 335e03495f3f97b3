"""Tierwise runtime: ZeRO-3 on torch.distributed with CPU offload, executing a planner plan.

    import runtime
    model = runtime.shard(model, plan)                   # plan: path, dict or planner Plan
    optimizer = runtime.AdamW(model, lr=3e-4, weight_decay=0.1)
    loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()

The public names are imported on first use, so that torch-free parts (`runtime.nvme`, the probe's
I/O side) can be imported without paying for torch.
"""

from __future__ import annotations

from typing import Any

_PUBLIC = {
    "AdamW": "runtime.optimizer",
    "PlanNotExecutable": "runtime.plan_io",
    "shard": "runtime.sharding",
    "state_of": "runtime.sharding",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'runtime' has no attribute {name!r}")
