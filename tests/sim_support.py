"""Small models and the placements the simulator's tests share.

A model of a few blocks at width 2,048 simulates in milliseconds and still has every term of a
block (attention, MLP, the partitioned gathers); the placements are the tiers the periodic and
same-timeline tests compare paths on.
"""

from __future__ import annotations

from planner.specs.model import ModelSpec
from planner.specs.plan import Placement

NVME_PARAMS = Placement(params="nvme", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")
ALL_NVME = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")
ALL_CPU = Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="gpu")
GPU_OPTIMIZER = Placement(params="cpu", gradients="gpu", optimizer_states="gpu", recompute_inputs="gpu")


def small(num_layers: int, **kw) -> ModelSpec:
    return ModelSpec(name=f"{num_layers}-layer", num_layers=num_layers, hidden_size=2048, num_heads=16, seq_len=1024, **kw)
