"""Building a sharded model's units: construction-time partitioning (docs/method.md §4.6).

A model built on the meta device (`with torch.device("meta")`) is materialised one unit at a time:
the unit's parameters are allocated, initialised, cut into this rank's shard and dropped, so no
more than one operator's full parameters exist at once. The NVMe swap space is sized before any
shard exists, from the shards the model will have.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from planner.cost.memory import BOOKKEEPING_BYTES_PER_OPERATOR, gradient_write_buffers
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import Plan
from planner.specs.units import round_up_4kib
from runtime.collectives import Comm
from runtime.flat_param import FlatLayout, flatten_shard
from runtime.gradients import GradientSink
from runtime.group import ParamUnit
from runtime.plan_io import RuntimeConfig, local_world_size
from runtime.stores import StateKey, UnitKey
from runtime.unit_charges import UnitCharges

if TYPE_CHECKING:
    from runtime.sharding import ShardedModel


def build_units(model: nn.Module, state: ShardedModel, init_fn: Callable[[nn.Module], None]) -> list[tuple[nn.Module, list[int]]]:
    """One unit per module that owns parameters; returns (module, units it uses) for hooking."""
    config = state.config
    owner: dict[int, int] = {}
    references: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                references.setdefault(id(p), []).append((module, name))
    module_units: list[tuple[nn.Module, list[int]]] = []
    names = {m: n for n, m in model.named_modules()}
    for module in model.modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None and id(p) not in owner]
        if own:
            if any(p.device.type == "meta" for _, p in own):
                own = materialise(module, own, references, config.device, init_fn)
            params = [p for _, p in own]
            unit = make_unit(names[module] or "<root>", params, state)
            for p in params:
                owner[id(p)] = len(state.units)
            state.units.append(unit)
        used = sorted({owner[id(p)] for p in module._parameters.values() if p is not None})
        if used:
            module_units.append((module, used))
    return module_units


def materialise(module: nn.Module, own: list[tuple[str, nn.Parameter]], references: dict[int, list[tuple[nn.Module, str]]],
                 device: torch.device, init_fn: Callable[[nn.Module], None]) -> list[tuple[str, nn.Parameter]]:
    """Allocate and initialise one module's meta parameters (every module referencing one sees it)."""
    out = []
    for name, p in own:
        if p.device.type == "meta":
            new = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=p.requires_grad)
            for holder, attr in references[id(p)]:
                holder._parameters[attr] = new
            references[id(new)] = references.pop(id(p))
            p = new
        out.append((name, p))
    with torch.no_grad():
        init_fn(module)
    return [(name, module._parameters[name]) for name, _ in out]


def make_unit(name: str, params: list[nn.Parameter], state: ShardedModel) -> ParamUnit:
    config, comm = state.config, state.comm
    layout = FlatLayout.of(params, comm.world_size)
    key = UnitKey(len(state.units), name)
    shard = state.param_store.create(key, layout.shard_numel, config.compute_dtype)
    with torch.no_grad():
        if state.master_shares_param_shard:
            master_store, master_key, master = state.param_store, key, shard
        else:
            master_store, master_key = state.optimizer_store, StateKey("master", key)
            master = master_store.create(master_key, layout.shard_numel, torch.float32)
        # Stores that keep shards in memory return them from `create`; an NVMe store is written to.
        values = master if master is not None else torch.zeros(layout.shard_numel, dtype=torch.float32,
                                                                device=params[0].device)
        flatten_shard(params, layout, comm.rank, values)
        if master is None:
            master_store.write(master_key, values.cpu()).wait()
        if master_key != key:
            if shard is not None:
                shard.copy_(values)
            else:
                state.param_store.write(key, values.to("cpu", config.compute_dtype)).wait()
        state.masters[key] = master
        state.master_at[key] = (master_store, master_key)
        empty = torch.empty(0, dtype=config.compute_dtype, device=config.device)
        for p in params:
            p.data = empty  # drop the full parameter: only the shard remains
    links = state.profiler.link_bytes
    grads = GradientSink.factory(state.grad_store)(key=key, layout=layout, num_grad_params=sum(p.requires_grad for p in params),
                                                   comm=comm, ledger=state.ledger, link_bytes=links)
    unit = ParamUnit(name=key, params=params, layout=layout, comm=comm, param_store=state.param_store, grads=grads,
                     compute_dtype=config.compute_dtype, charges=UnitCharges(state.ledger), link_bytes=links,
                     transient_buffers=state.transient_buffers)
    # Not an allocation the runtime makes but what each operator's objects cost (the memory model's
    # constant, measured by runtime/memory_probe.py), so that the host tier compares with the bill.
    state.ledger.add("cpu", MemoryTerm.RUNTIME_BOOKKEEPING, BOOKKEEPING_BYTES_PER_OPERATOR)
    return unit


def nvme_space(module: nn.Module, config: RuntimeConfig, comm: Comm, plan: Plan, master_shared: bool) -> Any:
    """The rank's `NvmeSpace` when any state is on NVMe, sized before any shard exists (None otherwise).

    Swap files are preallocated, so their sizes come from the shards this model will have: one per
    unit (a module's own parameters), rounded to 4 KiB extents. The preflight checks the node's
    total (every local rank's files), so a too-small `nvme_path` is refused before training."""
    place = config.placement
    if "nvme" not in (place.params, place.gradients, place.optimizer_states):
        return None
    from runtime.nvme.store import NvmeSpace

    numels, seen = [], set()
    for m in module.modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            numels.append(FlatLayout.of(own, comm.world_size).shard_numel)

    def shards(element_bytes: int, copies: int) -> int:
        return copies * sum(round_up_4kib(n * element_bytes) for n in numels)

    compute_bytes = torch.empty(0, dtype=config.compute_dtype).element_size()
    optimizer_copies = 2 + (0 if master_shared else 1)  # Adam momentum and variance, the fp32 master
    capacity = {}
    if place.params == "nvme":
        capacity["params"] = shards(compute_bytes, 1)
    if place.gradients == "nvme" and config.stores_gradients:
        capacity["gradients"] = shards(4, 1)
    if place.optimizer_states == "nvme":
        capacity["optimizer_states"] = shards(4, optimizer_copies)
    assert plan.nvme_path is not None  # refused in plan_io
    # Reads land in host memory; where that is the compute device they stay there until reshard.
    read_buffers = config.prefetch_depth + 1 if config.device.type == "cpu" else 2
    return NvmeSpace(plan.nvme_path, rank=comm.rank, capacity_bytes=capacity,
                     node_needed_bytes=sum(capacity.values()) * local_world_size(),
                     block_size_bytes=plan.nvme_block_bytes, read_buffers=max(2, read_buffers),
                     gradient_write_buffers=gradient_write_buffers(config.prefetch_depth,
                                                                   params_on_nvme=place.params == "nvme"))


def default_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    hf_init = getattr(model, "_init_weights", None)

    def init(module: nn.Module) -> None:
        if hf_init is not None:
            hf_init(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()
        else:
            raise ValueError(
                f"cannot initialise the meta parameters of {type(module).__name__}: it has no reset_parameters(); "
                "pass param_init_fn to runtime.shard"
            )

    return init
