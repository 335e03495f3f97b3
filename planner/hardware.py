"""The machine being planned for: one node's capacities and bandwidths, times a node count.

Documents use human units in their keys (`gpu_memory_gib`, `nvme_read_gb_per_s`, `gpu_peak_tflops`)
and are converted to base units (bytes, bytes/s, flop/s) exactly once, here (Calculon's rule).
Binary for capacities (GiB = 2^30, as the paper's tables), decimal for rates (GB/s = 1e9 B/s).

Every number carries its provenance in `sources`: `nominal` (datasheet), `paper` (METHOD.md §5),
`measured` (by `planner probe` or a benchmark), or `estimate` (our reasoned guess, documented in the
preset's `notes`). Anything not listed is `nominal`.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from planner.errors import PlannerError
from planner.specio import check_keys, number, string
from planner.units import GB, GIB, TFLOP

Provenance = Literal["nominal", "paper", "measured", "estimate"]
PROVENANCES: tuple[str, ...] = ("nominal", "paper", "measured", "estimate")

# (field, document key, scale to base units, minimum, integer?) for every numeric field.
# This table is the single source of truth for units: to_dict/from_dict both read it.
_NUMERIC_FIELDS: tuple[tuple[str, str, float, float, bool], ...] = (
    ("num_gpus_per_node", "num_gpus_per_node", 1, 1, True),
    ("gpu_memory_bytes", "gpu_memory_gib", GIB, 0, False),
    ("gpu_max_alloc_bytes", "gpu_max_alloc_gib", GIB, 0, False),
    ("gpu_flops_per_s", "gpu_peak_tflops", TFLOP, 0, False),
    ("gpu_nominal_flops_per_s", "gpu_nominal_tflops", TFLOP, 0, False),
    ("gpu_hbm_bytes_per_s", "gpu_hbm_gb_per_s", GB, 0, False),
    ("cpu_memory_bytes", "cpu_memory_gib", GIB, 0, False),
    ("nvme_capacity_bytes", "nvme_capacity_gib", GIB, 0, False),
    ("host_to_gpu_bytes_per_s", "host_to_gpu_gb_per_s", GB, 0, False),
    ("gpu_to_host_bytes_per_s", "gpu_to_host_gb_per_s", GB, 0, False),
    ("host_memory_bytes_per_s", "host_memory_gb_per_s", GB, 0, False),
    ("nvme_read_bytes_per_s", "nvme_read_gb_per_s", GB, 0, False),
    ("nvme_write_bytes_per_s", "nvme_write_gb_per_s", GB, 0, False),
    ("gpu_gpu_intra_node_bytes_per_s", "gpu_gpu_intra_node_gb_per_s", GB, 0, False),
    ("inter_node_bytes_per_s", "inter_node_gb_per_s", GB, 0, False),
    ("cpu_adam_params_per_s", "cpu_adam_gparams_per_s", 1e9, 0, False),
)
_POSITIVE = {
    "gpu_memory_bytes",
    "gpu_flops_per_s",
    "host_to_gpu_bytes_per_s",
    "gpu_to_host_bytes_per_s",
    "host_memory_bytes_per_s",
    "cpu_adam_params_per_s",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeSpec:
    """One node. Per-GPU numbers hold when every GPU of the node is busy unless a name says otherwise."""

    name: str
    """Preset name, or the file it came from."""
    description: str = ""
    num_gpus_per_node: int
    gpu_memory_bytes: float
    """Usable device memory per GPU."""
    gpu_max_alloc_bytes: float = 0.0
    """Largest single contiguous allocation the GPU allows (fragmentation); 0 means `gpu_memory_bytes`."""
    gpu_flops_per_s: float
    """Achievable dense half-precision matmul throughput per GPU (the paper's `peak_tp`)."""
    gpu_nominal_flops_per_s: float = 0.0
    """Datasheet dense half-precision peak per GPU (reported, not used for timing)."""
    gpu_hbm_bytes_per_s: float = 0.0
    cpu_memory_bytes: float
    """Host DRAM per node available to training."""
    nvme_capacity_bytes: float = 0.0
    """NVMe space per node available to swap files."""
    host_to_gpu_bytes_per_s: float
    """One GPU's host link, host to device, when it alone transfers (PCIe)."""
    gpu_to_host_bytes_per_s: float
    """One GPU's host link, device to host, when it alone transfers."""
    host_memory_bytes_per_s: float
    """Aggregate host-memory/PCIe bandwidth of the node shared by all GPUs' host traffic."""
    nvme_read_bytes_per_s: float = 0.0
    """Aggregate NVMe read bandwidth of the node (all drives, direct I/O)."""
    nvme_write_bytes_per_s: float = 0.0
    """Aggregate NVMe write bandwidth of the node."""
    gpu_gpu_intra_node_bytes_per_s: float = 0.0
    """Per-GPU collective bandwidth inside a node (NVLink/NVSwitch); 0 for a single-GPU node."""
    inter_node_bytes_per_s: float = 0.0
    """Per-node network bandwidth for collectives across nodes."""
    cpu_adam_params_per_s: float
    """CPU optimizer throughput per node (Adam parameter updates per second, all cores)."""
    sources: dict[str, Provenance] = field(default_factory=dict, compare=False)
    """Provenance per document key; unlisted keys are nominal."""
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"hardware {self.name!r}"
        for attr, key, _, minimum, integer in _NUMERIC_FIELDS:
            value = number(getattr(self, attr), f"{where} {key}", minimum=minimum, integer=integer)
            if attr in _POSITIVE and value <= 0:
                raise PlannerError(f"{where} {key} must be greater than 0, got {value!r}")
        if self.gpu_max_alloc_bytes == 0:
            object.__setattr__(self, "gpu_max_alloc_bytes", self.gpu_memory_bytes)
        if self.gpu_max_alloc_bytes > self.gpu_memory_bytes:
            raise PlannerError(
                f"{where} gpu_max_alloc_gib ({self.gpu_max_alloc_bytes / GIB:g}) exceeds gpu_memory_gib "
                f"({self.gpu_memory_bytes / GIB:g})"
            )
        if self.num_gpus_per_node > 1 and self.gpu_gpu_intra_node_bytes_per_s <= 0:
            raise PlannerError(f"{where} has {self.num_gpus_per_node} GPUs per node but no gpu_gpu_intra_node_gb_per_s")
        for key, provenance in self.sources.items():
            string(provenance, f"{where} sources.{key}", choices=PROVENANCES)

    # -- documents ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name}
        if self.description:
            doc["description"] = self.description
        for attr, key, scale, _, integer in _NUMERIC_FIELDS:
            value = getattr(self, attr)
            doc[key] = int(value) if integer else value / scale
        doc["sources"] = dict(self.sources)
        if self.notes:
            doc["notes"] = self.notes
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "hardware") -> NodeSpec:
        keys = {key for _, key, *_ in _NUMERIC_FIELDS}
        check_keys(doc, keys | {"name", "description", "sources", "notes"}, where)
        required = [key for attr, key, *_ in _NUMERIC_FIELDS if _is_required(attr)]
        missing = [key for key in required if key not in doc]
        if missing:
            raise PlannerError(f"{where}: missing required key(s) {', '.join(missing)}")
        name = string(doc.get("name", where), f"{where} name", max_len=200)
        kwargs: dict[str, Any] = {"name": name}
        for attr, key, scale, minimum, integer in _NUMERIC_FIELDS:
            if key in doc:
                value = number(doc[key], f"{where} {key}", minimum=minimum, integer=integer)
                kwargs[attr] = value if integer else value * scale
        sources = doc.get("sources", {})
        check_keys(sources, keys, f"{where} sources")
        kwargs["sources"] = {k: string(v, f"{where} sources.{k}", choices=PROVENANCES) for k, v in sources.items()}
        for text_key in ("description", "notes"):
            if text_key in doc:
                kwargs[text_key] = string(doc[text_key], f"{where} {text_key}", max_len=20_000)
        return cls(**kwargs)

    def provenance(self, key: str) -> str:
        return self.sources.get(key, "nominal")

    def replace(self, **changes: Any) -> NodeSpec:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc.update(changes)
        return NodeSpec(**doc)


def _is_required(attr: str) -> bool:
    return NodeSpec.__dataclass_fields__[attr].default is MISSING


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """`num_gpus` GPUs of identical nodes: full nodes, or part of one node."""

    node: NodeSpec
    num_gpus: int

    def __post_init__(self) -> None:
        number(self.num_gpus, "--gpus", minimum=1, maximum=1_000_000, integer=True)
        per_node = self.node.num_gpus_per_node
        if self.num_gpus > per_node and self.num_gpus % per_node:
            raise PlannerError(
                f"--gpus {self.num_gpus} is not a whole number of {self.node.name} nodes "
                f"({per_node} GPUs each); use at most {per_node} or a multiple of it"
            )

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.node.num_gpus_per_node)

    @property
    def gpus_per_node(self) -> int:
        """GPUs in use on each node (fewer than the node has when planning part of one node)."""
        return min(self.num_gpus, self.node.num_gpus_per_node)
