"""Tierwise runtime: ZeRO-3 on torch.distributed with CPU offload, executing a planner plan.

    import runtime
    model = runtime.shard(model, plan)                   # plan: path, dict or planner Plan
    optimizer = runtime.AdamW(model, lr=3e-4, weight_decay=0.1)
    loss = model(**batch).loss; loss.backward(); optimizer.step(); optimizer.zero_grad()
"""

from runtime.optimizer import AdamW
from runtime.plan_io import PlanNotExecutable
from runtime.sharding import shard, state_of

__all__ = ["AdamW", "PlanNotExecutable", "shard", "state_of"]
