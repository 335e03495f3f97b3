"""Memory tiers as types: one object per tier a placement can put a state in, and their one registry.

[Note: tiers as types]
A tier is an instance of a `Tier` subclass, registered in `TIERS`. The object *is* its JSON name
(`Tier` subclasses `str`, as `MemoryTerm` does): a plan's `placement.params` reads and writes
`"gpu"`, `"cpu"` or `"nvme"` unchanged, prediction tables are keyed by it, and the runtime's store
registry (runtime/transfer/tiers.py) looks its store class up by it. Nothing outside this module
compares a tier with a name (tests/test_architecture.py greps for it); code asks the tier:
- what it holds and where: `capacity_bytes(node)`, `per_gpu` (the bill's units: the GPU's own
  memory per GPU, the others per node);
- how bytes reach it: `via` is the next tier toward the GPU (host memory for NVMe, the GPU for host
  memory) and `read_link` / `write_link` name the link between them, the keys of
  `prediction.link_bytes`; `link_share` is what one GPU's traffic gets of it (the analytic
  estimate), and `staged` tiers bring links of their own that the simulator builds per node from
  `link_rates` and routes through host memory (planner/sim/resources.py);
- what it adds to the bill and the schedule: a `staged` tier's states cross pinned host buffers
  (the swap buffers, the streamed optimizer step's chunk buffers: planner/cost/memory.py), host
  memory's cross the pinned staging pool and the host link, and `is_compute_memory(node)` says
  where the compute uses a state where it lies (the GPU, or host memory where the host is the device);
- which placements are valid: an optimizer steps in `optimizer_memory`, so its gradients lie in
  `gradient_tiers`; the search tries recompute inputs on the tiers that say `recompute_inputs_searched`.
The layers above read this data and keep their own mechanics: the cost models price the links a
tier names, the simulator builds and routes them, the search enumerates `TIERS`. A new tier is one
subclass registered with `TIERS.register` (tests/test_tier_types.py plans with a CXL tier that way);
the runtime adds one store class for it (runtime/transfer/tiers.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from planner.specs.specio import string

if TYPE_CHECKING:
    from planner.specs.hardware import NodeSpec


class LinkRates(NamedTuple):
    """Bytes per second over a tier's link, each way: toward the GPU (`read_link`) and back (`write_link`)."""

    read_bytes_per_s: float
    write_bytes_per_s: float


UNBOUNDED = LinkRates(float("inf"), float("inf"))
"""The rates of the link the GPU's own memory does not have."""


class Tier(str):
    """A memory tier (module docstring, [Note: tiers as types]). Subclasses set the class attributes
    and the node-dependent methods; an instance is the tier's name."""

    label: ClassVar[str]
    """How people name it in tables and messages ("GPU", "CPU", "NVMe")."""
    per_gpu: ClassVar[bool] = False
    """The bill counts it per GPU (each GPU's own memory), else per node (shared by the node's GPUs)."""
    on_device: ClassVar[bool] = False
    """The GPU's own memory: a state here needs no copy on a CUDA machine."""
    host_memory: ClassVar[bool] = False
    """The node's DRAM, which the CPU reads and writes directly. Where the host is the device (a
    machine without CUDA), the GPU's memory and host memory are one."""
    staged: ClassVar[bool] = False
    """Behind host memory: every byte to or from it is staged in pinned host buffers and crosses the
    tier's own per-node links (`read_link`, `write_link`) as well as the host link."""
    read_link: ClassVar[str] = ""
    """The link bytes take out of this tier toward `via` (a `prediction.link_bytes` key); "" for the GPU."""
    write_link: ClassVar[str] = ""
    """The link bytes take from `via` into this tier."""
    recompute_inputs_searched: ClassVar[bool] = True
    """The search places recompute inputs here without being asked (the runtime can hold them here)."""

    __slots__ = ()

    def __reduce__(self) -> tuple:  # an unpickled tier is the registered one
        return _registered, (str(self),)

    def __copy__(self) -> Tier:
        return self

    def __deepcopy__(self, memo: dict) -> Tier:
        return self

    @property
    def scope(self) -> str:
        """The bill's unit for this tier, as tables print it."""
        return "per GPU" if self.per_gpu else "per node"

    @property
    def via(self) -> Tier | None:
        """The next tier toward the GPU: bytes between this tier and the GPU cross it."""
        return None

    @property
    def hops_to_gpu(self) -> int:
        """Links between this tier and the GPU's memory (0 for the GPU, 1 host memory, 2 NVMe)."""
        return 0 if self.via is None else 1 + self.via.hops_to_gpu

    @property
    def optimizer_memory(self) -> Tier:
        """The memory an optimizer whose states lie here updates them in (the GPU's, or host memory)."""
        return self

    @property
    def gradient_tiers(self) -> tuple[Tier, ...]:
        """Where the gradients may lie when the optimizer states lie here: where the optimizer steps,
        or beside the states."""
        return tuple(t for t in TIERS if t in (self.optimizer_memory, self))

    def capacity_bytes(self, node: NodeSpec) -> float:
        """Bytes of this tier training may use, in the bill's units (`per_gpu`)."""
        raise NotImplementedError

    def is_compute_memory(self, node: NodeSpec) -> bool:
        """Whether the compute uses a state here where it lies (no copy, no staging buffer)."""
        return self.on_device or (self.host_memory and node.host_is_device)

    def in_host_memory(self, node: NodeSpec) -> bool:
        """Whether a state here lies in memory the CPU reads and writes directly."""
        return self.host_memory or (self.on_device and node.host_is_device)

    def route(self, node: NodeSpec) -> tuple[Tier, ...]:
        """The tiers whose links a state here crosses on its way to the memory the compute uses, from
        this one on (empty for a state the compute uses where it lies)."""
        hops: list[Tier] = []
        tier: Tier | None = self
        while tier is not None and not tier.is_compute_memory(node):
            hops.append(tier)
            tier = tier.via
        return tuple(hops)

    def link_rates(self, node: NodeSpec) -> LinkRates:
        """The rates of its link, as the node's spec gives them: per GPU for the host link, per node
        for a staged tier's own (what the simulator builds its links from)."""
        return UNBOUNDED

    def link_share(self, node: NodeSpec, gpus: int) -> LinkRates:
        """What one of the node's `gpus` GPUs gets of its link when all of them transfer (what the
        analytic estimate divides bytes by)."""
        return UNBOUNDED

    def shares_read_write_budget(self, node: NodeSpec) -> bool:
        """Whether reads and writes split one device budget (a byte read costs 1/read rate of it, a
        byte written 1/write rate) instead of each reaching its own rate (staged tiers)."""
        return False


class DeviceMemory(Tier):
    """`gpu`: the GPU's own memory (on a machine without CUDA, the memory the compute device uses)."""

    label = "GPU"
    per_gpu = True
    on_device = True
    __slots__ = ()

    def capacity_bytes(self, node: NodeSpec) -> float:
        return node.gpu_memory_bytes


class HostMemory(Tier):
    """`cpu`: the node's DRAM, across each GPU's host link (PCIe: `h2d` / `d2h`), whose traffic also
    shares the node's host-memory bandwidth; where the CPU optimizer steps."""

    label = "CPU"
    host_memory = True
    read_link = "h2d"
    write_link = "d2h"
    __slots__ = ()

    @property
    def via(self) -> Tier:
        return GPU

    def capacity_bytes(self, node: NodeSpec) -> float:
        return node.cpu_memory_bytes

    def link_rates(self, node: NodeSpec) -> LinkRates:
        return LinkRates(node.host_to_gpu_bytes_per_s, node.gpu_to_host_bytes_per_s)

    def link_share(self, node: NodeSpec, gpus: int) -> LinkRates:
        # Each GPU's own link, capped by its share of the node's host-memory bandwidth.
        host_share = node.host_memory_bytes_per_s / gpus
        rates = self.link_rates(node)
        return LinkRates(min(rates.read_bytes_per_s, host_share), min(rates.write_bytes_per_s, host_share))


class StagedTier(Tier):
    """A tier behind host memory with per-node links of its own (`staged`): a shard read from it
    waits in a pinned host swap buffer before it crosses the host link, a gradient is staged on its
    way in, and the optimizer streams its states through pinned chunk buffers and steps on the CPU.
    Subclasses name their links and read their capacity and rates from the node."""

    staged = True
    recompute_inputs_searched = False  # the simulator and the runtime keep recompute inputs on the GPU or in host memory
    __slots__ = ()

    @property
    def via(self) -> Tier:
        return HOST

    @property
    def optimizer_memory(self) -> Tier:
        return HOST

    def link_share(self, node: NodeSpec, gpus: int) -> LinkRates:
        rates = self.link_rates(node)  # one per node, shared by its GPUs
        return LinkRates(rates.read_bytes_per_s / gpus, rates.write_bytes_per_s / gpus)


class Nvme(StagedTier):
    """`nvme`: the node's NVMe array, swap files in `Plan.nvme_path` read and written with direct I/O."""

    label = "NVMe"
    read_link = "nvme_read"
    write_link = "nvme_write"
    __slots__ = ()

    def capacity_bytes(self, node: NodeSpec) -> float:
        return node.nvme_capacity_bytes

    def link_rates(self, node: NodeSpec) -> LinkRates:
        return LinkRates(node.nvme_read_bytes_per_s, node.nvme_write_bytes_per_s)

    def shares_read_write_budget(self, node: NodeSpec) -> bool:
        return node.nvme_read_write == "shared"


class TierRegistry(Sequence[Tier]):
    """The tiers a placement can name, in registration order (the order of every per-tier table), and
    the one reader of a tier's JSON name. It iterates, counts and tests membership as the tuple of
    its tiers does, so `dict.fromkeys(TIERS, 0)` and `choices=TIERS` read the tiers registered now."""

    def __init__(self) -> None:
        self._tiers: tuple[Tier, ...] = ()
        self._by_name: dict[str, Tier] = {}
        self._links: tuple[str, ...] = ()

    def register(self, tier: Tier) -> Tier:
        """Add `tier` after those registered; a name is registered once."""
        if not isinstance(tier, Tier) or str(tier) in self._by_name:
            raise ValueError(f"cannot register tier {tier!r}: not a Tier, or its name is taken")
        self._tiers += (tier,)
        self._by_name[str(tier)] = tier
        # Outermost tier's links first: nvme_read, nvme_write, h2d, d2h (the order of `prediction.link_bytes`).
        self._links = tuple(name for t in reversed(self._tiers) for name in (t.read_link, t.write_link) if name)
        return tier

    def unregister(self, tier: Tier) -> None:
        """Remove a tier a test registered."""
        self._tiers = tuple(t for t in self._tiers if t != tier)
        del self._by_name[str(tier)]
        self._links = tuple(name for t in reversed(self._tiers) for name in (t.read_link, t.write_link) if name)

    def named(self, name: str, where: str = "tier") -> Tier:
        """The tier called `name` (a JSON value or a CLI pin), or a one-line error naming `where`."""
        return self._by_name[string(name, where, choices=self)]

    @property
    def link_names(self) -> tuple[str, ...]:
        """Every tier's links, the outermost tier's first."""
        return self._links

    def __getitem__(self, index):  # noqa: ANN001, ANN204 (Sequence's int-or-slice signature)
        return self._tiers[index]

    def __len__(self) -> int:
        return len(self._tiers)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __repr__(self) -> str:
        return f"TierRegistry({', '.join(self._tiers)})"


def _registered(name: str) -> Tier:
    return TIERS.named(name)


TIERS = TierRegistry()
"""Every tier a placement can name; JSON values `gpu|cpu|nvme` in this order."""
GPU = TIERS.register(DeviceMemory("gpu"))
HOST = TIERS.register(HostMemory("cpu"))
NVME = TIERS.register(Nvme("nvme"))
