"""Building a sharded model's units: construction-time partitioning (docs/method.md §4.6).

A model built on the meta device (`with torch.device("meta")`) is materialised one unit at a time:
the unit's parameters are allocated, initialised, cut into this rank's shard and dropped, so no
more than one operator's full parameters exist at once. The NVMe swap space is sized before any
shard exists, from the shards the model will have.

The builder returns what it made (`BuiltUnits`: the rank's stores, the units and their masters);
`runtime.sharding.ShardedModel` takes it and drives the units with hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from planner.cost.memory import BOOKKEEPING_BYTES_PER_OPERATOR, gradient_write_buffers, param_read_slots
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import Plan
from planner.specs.units import round_up_4kib
from runtime.ledger import MemoryLedger
from runtime.plan_io import RuntimeConfig, local_world_size
from runtime.profiler import Profiler
from runtime.transfer.collectives import Comm
from runtime.transfer.crossings import host_crossing
from runtime.transfer.nvme_store import NvmeSpace
from runtime.transfer.pinned_pool import staging_pool_for
from runtime.transfer.read_slots import ReadSlots
from runtime.transfer.stores import CopyEngine, ShardKey, ShardStore, StateKey, UnitKey
from runtime.transfer.streams import Streams
from runtime.transfer.tiers import make_store
from runtime.units.flat_param import FlatLayout, flatten_shard
from runtime.units.gradients import GradientSink
from runtime.units.group import ParamUnit
from runtime.units.unit_charges import UnitCharges


@dataclass(frozen=True)
class RankStores:
    """Where this rank's shards live: one store per model state, over one copy engine."""

    copier: CopyEngine
    swap: NvmeSpace | None
    """The rank's NVMe space when any state is on NVMe (`nvme_space`)."""
    params: ShardStore
    gradients: ShardStore | None
    """None when each unit's gradient goes straight into the in-backward update (`HandedGradients`)."""
    optimizer_states: ShardStore


@dataclass(frozen=True)
class BuiltUnits:
    """What the builder made of a model, handed whole to the `ShardedModel` that drives it."""

    stores: RankStores
    units: list[ParamUnit] = field(default_factory=list)
    """One per module that owns parameters, in `model.modules()` order: a unit's index is its key's."""
    module_units: list[tuple[nn.Module, list[int]]] = field(default_factory=list)
    """(module, indices of the units whose parameters it uses) for every module that uses any: where
    the hooks go."""
    masters: dict[UnitKey, torch.Tensor | None] = field(default_factory=dict)
    """fp32 master shard per unit when it is resident in memory (the param shard itself when it can be)."""
    master_at: dict[UnitKey, tuple[ShardStore, ShardKey]] = field(default_factory=dict)
    """(store, key) of each unit's fp32 master shard, wherever it lives."""
    transient_buffers: dict[int, ParamUnit] = field(default_factory=dict)
    """Storage address -> unit gathered into it, for transient gathered buffers (filled as units
    gather, read by the sharded model's saved-tensor hooks)."""


def open_stores(module: nn.Module, config: RuntimeConfig, comm: Comm, plan: Plan, profiler: Profiler) -> RankStores:
    """The rank's copy engine (with the plan's staging pool), NVMe space and one store per state,
    charged to the profiler's ledger."""
    ledger = profiler.ledger
    copier = CopyEngine(config.device, profiler.link_bytes)
    copier.pool = staging_pool_for(plan, copier, ledger)
    place = config.placement
    numels = unit_shard_numels(module, comm.world_size)
    swap = nvme_space(config, comm, plan, numels, streams=copier.streams, ledger=ledger)

    def store(tier: str, term: MemoryTerm, name: str) -> ShardStore:
        dtype = config.param_shard_dtype if name == "params" else config.compute_dtype
        crossing = host_crossing(name, plan, copier, ledger, numel=sum(numels), dtype=dtype)
        return make_store(tier, term=term, ledger=ledger, copier=copier, name=name, swap=swap, crossing=crossing)

    params = store(place.params, MemoryTerm.PARAMS, "params")
    # Mixed precision: gradients arrive in 16 bits and are accumulated straight into the fp32
    # gradient copy that the paper counts among the optimizer states (eq. 2).
    mixed = config.precision != "fp32"
    gradients = (store(place.gradients, MemoryTerm.OPTIMIZER_STATES if mixed else MemoryTerm.GRADIENTS, "gradients")
                 if config.stores_gradients else None)
    optimizer_states = store(place.optimizer_states, MemoryTerm.OPTIMIZER_STATES, "optimizer_states")
    return RankStores(copier, swap, params, gradients, optimizer_states)


def build_units(model: nn.Module, config: RuntimeConfig, comm: Comm, profiler: Profiler, stores: RankStores,
                init_fn: Callable[[nn.Module], None]) -> BuiltUnits:
    """One unit per module that owns parameters, each with its shard in `stores`."""
    built = BuiltUnits(stores)
    owner: dict[int, int] = {}
    references: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                references.setdefault(id(p), []).append((module, name))
    names = {m: n for n, m in model.named_modules()}
    for module in model.modules():
        own = [(n, p) for n, p in module._parameters.items() if p is not None and id(p) not in owner]
        if own:
            if any(p.device.type == "meta" for _, p in own):
                own = materialise(module, own, references, config.device, init_fn)
            params = [p for _, p in own]
            unit = make_unit(names[module] or "<root>", params, built, config, comm, profiler)
            for p in params:
                owner[id(p)] = len(built.units)
            built.units.append(unit)
        used = sorted({owner[id(p)] for p in module._parameters.values() if p is not None})
        if used:
            built.module_units.append((module, used))
    return built


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


def make_unit(name: str, params: list[nn.Parameter], built: BuiltUnits, config: RuntimeConfig, comm: Comm,
              profiler: Profiler) -> ParamUnit:
    """The next unit of `built`: its shard and fp32 master written to the stores, the full
    parameters dropped."""
    stores, ledger = built.stores, profiler.ledger
    layout = FlatLayout.of(params, comm.world_size)
    key = UnitKey(len(built.units), name)
    shard = stores.params.create(key, layout.shard_numel, config.param_shard_dtype)
    with torch.no_grad():
        if config.master_shares_param_shard:
            master_store, master_key, master = stores.params, key, shard
        else:
            master_store, master_key = stores.optimizer_states, StateKey("master", key)
            master = master_store.create(master_key, layout.shard_numel, torch.float32)
        # Stores that keep shards in memory return them from `create`; an NVMe store is written to.
        values = master if master is not None else torch.zeros(layout.shard_numel, dtype=torch.float32,
                                                                device=params[0].device)
        flatten_shard(params, layout, comm.rank, values)
        if master is None:
            master_store.write_host(master_key, values.cpu()).wait()
        if master_key != key:
            if shard is not None:
                shard.copy_(values)
            else:
                stores.params.write_host(key, values.to("cpu", config.compute_dtype)).wait()
        built.masters[key] = master
        built.master_at[key] = (master_store, master_key)
        empty = torch.empty(0, dtype=config.compute_dtype, device=config.device)
        for p in params:
            p.data = empty  # drop the full parameter: only the shard remains
    links = profiler.link_bytes
    grads = GradientSink.factory(stores.gradients)(key=key, layout=layout, num_grad_params=sum(p.requires_grad for p in params),
                                                   comm=comm, ledger=ledger, link_bytes=links,
                                                   streams=stores.copier.streams, worker=stores.copier.worker,
                                                   reduce_worker=stores.copier.reduce_worker)
    unit = ParamUnit(name=key, params=params, layout=layout, comm=comm, param_store=stores.params, grads=grads,
                     compute_dtype=config.compute_dtype, charges=UnitCharges(ledger), link_bytes=links,
                     transient_buffers=built.transient_buffers)
    # Not an allocation the runtime makes but what each operator's objects cost (the memory model's
    # constant, measured by runtime/memory_probe.py), so that the host tier compares with the bill.
    ledger.add("cpu", MemoryTerm.RUNTIME_BOOKKEEPING, BOOKKEEPING_BYTES_PER_OPERATOR)
    return unit


def unit_shard_numels(module: nn.Module, world_size: int) -> list[int]:
    """Elements of each unit's shard on this rank, before any exists (the units `build_units` makes)."""
    numels, seen = [], set()
    for m in module.modules():
        own = [p for p in m._parameters.values() if p is not None and id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            numels.append(FlatLayout.of(own, world_size).shard_numel)
    return numels


def nvme_space(config: RuntimeConfig, comm: Comm, plan: Plan, numels: list[int], *, streams: Streams,
               ledger: MemoryLedger) -> NvmeSpace | None:
    """The rank's `NvmeSpace` when any state is on NVMe, sized before any shard exists (None otherwise).

    Swap files are preallocated, so their sizes come from the shards this model will have (`numels`):
    one per unit (a module's own parameters), rounded to 4 KiB extents. The preflight checks the
    node's total (every local rank's files), so a too-small `nvme_path` is refused before training."""
    place = config.placement
    if not place.model_states_on_nvme:
        return None

    def shards(element_bytes: int, copies: int) -> int:
        return copies * sum(round_up_4kib(n * element_bytes) for n in numels)

    compute_bytes = torch.empty(0, dtype=config.compute_dtype).element_size()
    optimizer_copies = 2 + (0 if config.master_shares_param_shard else 1)  # Adam momentum and variance, the fp32 master
    capacity = {}
    if place.params == "nvme":
        capacity["params"] = shards(compute_bytes, 1)
    if place.gradients == "nvme" and config.stores_gradients:
        capacity["gradients"] = shards(4, 1)
    if place.optimizer_states == "nvme":
        capacity["optimizer_states"] = shards(4, optimizer_copies)
    assert plan.nvme_path is not None  # refused in plan_io
    # Reads land in host memory; where that is the compute device they stay there until reshard.
    separate_memory = streams.separate_memory
    read_buffers = 2 if separate_memory else config.prefetch_depth + 1
    slots = ReadSlots(streams, ledger, MemoryTerm.PARAM_SWAP_BUFFERS, param_read_slots(plan)) if separate_memory else None
    return NvmeSpace(plan.nvme_path, rank=comm.rank, capacity_bytes=capacity,
                     node_needed_bytes=sum(capacity.values()) * local_world_size(),
                     block_size_bytes=plan.nvme_block_bytes, read_buffers=max(2, read_buffers),
                     gradient_write_buffers=gradient_write_buffers(config.prefetch_depth,
                                                                   params_on_nvme=place.params == "nvme"),
                     read_slots=slots, largest_shard_numel=max(numels, default=0))


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
