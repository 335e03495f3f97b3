"""The machine being planned for: one node's capacities and bandwidths, times a node count.

Documents use human units in their keys (`gpu_memory_gib`, `nvme_read_gb_per_s`, `gpu_peak_tflops`)
and are converted to base units (bytes, bytes/s, flop/s) exactly once, here (Calculon's rule).
Binary for capacities (GiB = 2^30, as the paper's tables), decimal for rates (GB/s = 1e9 B/s).

Every number carries its provenance in `sources`: `nominal` (datasheet), `paper` (docs/method.md §5),
`measured` (by `planner probe` or a benchmark), `estimate` (our reasoned guess, documented in the
preset's `notes`), or `fitted: published_runs (rows p001, ...)` (fitted on those rows of the published-runs
corpus by `python -m planner.validation.fit --write`; the datasheet value stays in `citations`).
Anything not listed is `nominal`.

Two optional simulator inputs sit beside the rates: `nvme_read_write` (do a node's NVMe reads and
writes share one device budget or run independently) and `efficiency` (size-keyed curves: small
transfers and small matmuls run below the peak rates above; see `EfficiencyCurve`).
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from planner.specs.errors import PlannerError
from planner.specs.precision import PRECISIONS, PrecisionRates
from planner.specs.specio import MAX_MAGNITUDE, check_keys, number, string
from planner.specs.units import GB, GIB, MIB, TFLOP

Provenance = str
PROVENANCES: tuple[str, ...] = ("nominal", "paper", "measured", "estimate")
FITTED_PROVENANCE = re.compile(r"fitted: published_runs \(rows [\w\-, ]+\)")
"""A number fitted on the corpus rows it names (planner/validation/fit.py)."""


def provenance(value: Any, where: str) -> str:
    """One of PROVENANCES, or `fitted: published_runs (rows ...)`."""
    if isinstance(value, str) and FITTED_PROVENANCE.fullmatch(value):
        return value
    return string(value, where, choices=PROVENANCES)

MIN_GPU_ALLOC_BYTES = MIB
"""The smallest largest-free-block a node may state. The CUDA caching allocator hands out large
allocations in 2 MiB blocks, so less describes no GPU; it also keeps an operator's tile count (its bytes
over this block) a finite number."""

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
    ("operator_overhead_s", "operator_overhead_ms", 1e-3, 0, False),
)
NvmeReadWrite = Literal["independent", "shared"]
NVME_READ_WRITE: tuple[str, ...] = ("independent", "shared")
# Curve name -> (document key of the size, scale to base units, base unit).
_CURVES: dict[str, tuple[str, float, str]] = {
    "transfer": ("size_mib", MIB, "bytes"),
    "matmul": ("gflop", 1e9, "flop"),
    "attention": ("seq_len", 1.0, "tokens"),
}
# (field, document key, scale to base units, minimum, maximum) for the numeric fields a document
# carries only where they are set (0 means "not stated": documents of other nodes stay as they were).
_OPTIONAL_NUMERIC_FIELDS: tuple[tuple[str, str, float, float, float], ...] = (
    ("flash_attention_flops_per_s", "flash_attention_tflops", TFLOP, 0, MAX_MAGNITUDE),
    ("fp8_matmul_flops_per_s", "fp8_matmul_tflops", TFLOP, 0, MAX_MAGNITUDE),
    ("hbm_achievable_fraction", "hbm_achievable_fraction", 1, 0, 1),
    ("backward_matmul_flops_per_s", "backward_matmul_tflops", TFLOP, 0, MAX_MAGNITUDE),
    ("host_memcpy_bytes_per_s", "host_memcpy_gb_per_s", GB, 0, MAX_MAGNITUDE),
)
_EXTRA_KEYS = {"nvme_read_write", "efficiency", "host_is_device", "whole_node_gpus", "citations", "compute_precision",
               "precision_rates",
               *(key for _, key, *_ in _OPTIONAL_NUMERIC_FIELDS)}


def document_key(attr: str) -> str:
    """The hardware document's key for NodeSpec field `attr`, which its `sources` entry is named by
    (every efficiency curve is under `efficiency`)."""
    for field_, key, *_ in (*_NUMERIC_FIELDS, *_OPTIONAL_NUMERIC_FIELDS):
        if field_ == attr:
            return key
    if attr.endswith("_efficiency") and attr.removesuffix("_efficiency") in _CURVES:
        return "efficiency"
    raise KeyError(attr)
# The node's resources its GPUs share: part of a node gets its GPUs' share of each ([Note: part of a node]).
SHARED_BY_GPUS: tuple[str, ...] = (
    "cpu_memory_bytes",
    "nvme_capacity_bytes",
    "nvme_read_bytes_per_s",
    "nvme_write_bytes_per_s",
    "host_memory_bytes_per_s",
    "cpu_adam_params_per_s",
)


@dataclass(frozen=True, slots=True)
class EfficiencyCurve:
    """Fraction of the peak rate reached by one operation of a given size (Calculon's "small is slow").

    Points are (size in base units: bytes for transfers, flop for matmuls, efficiency in (0, 1]),
    interpolated linearly in log(size) and held flat beyond the first and last point. No points
    means every size runs at the peak rate.
    """

    points: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        sizes = [size for size, _ in self.points]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
            raise PlannerError(f"efficiency curve sizes must be strictly increasing, got {sizes}")
        for size, eff in self.points:
            if size <= 0 or not 0 < eff <= 1:
                raise PlannerError(f"efficiency curve point ({size:g}, {eff:g}) needs size > 0 and 0 < efficiency <= 1")

    def at(self, size: float) -> float:
        points = self.points
        if not points or size >= points[-1][0]:
            return points[-1][1] if points else 1.0
        if size <= points[0][0]:
            return points[0][1]
        i = bisect.bisect_right([s for s, _ in points], size)
        (s0, e0), (s1, e1) = points[i - 1], points[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return e0 + w * (e1 - e0)


def _curve_from_doc(doc: Any, kind: str, where: str) -> EfficiencyCurve:
    size_key, scale, _ = _CURVES[kind]
    if not isinstance(doc, list):
        raise PlannerError(f"{where} must be a list of {{{size_key}, efficiency}} points")
    points = []
    for i, point in enumerate(doc):
        check_keys(point, {size_key, "efficiency"}, f"{where}[{i}]")
        if size_key not in point or "efficiency" not in point:
            raise PlannerError(f"{where}[{i}] needs both {size_key} and efficiency")
        size = number(point[size_key], f"{where}[{i}].{size_key}", exclusive_minimum=0)
        eff = number(point["efficiency"], f"{where}[{i}].efficiency", exclusive_minimum=0, maximum=1)
        points.append((size * scale, eff))
    return EfficiencyCurve(tuple(points))


def _curve_to_doc(curve: EfficiencyCurve, kind: str) -> list[dict[str, float]]:
    size_key, scale, _ = _CURVES[kind]
    return [{size_key: size / scale, "efficiency": eff} for size, eff in curve.points]


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
    nvme_read_write: NvmeReadWrite = "independent"
    """`independent`: reads and writes each reach their own rate at once (separate drives or a
    duplex-friendly array); `shared`: they split one device budget, a byte read costing
    1/read rate and a byte written 1/write rate of it."""
    operator_overhead_s: float = 0.0
    """Fixed time the runtime spends per operator beyond its matmuls and memory-bound work: the
    unit's gather, hooks and release, and the framework's dispatch of a smaller matmul. Nominal 0
    (on a GPU node the host queues work ahead of the stream, so it shows only for tiny operators,
    which no GPU preset states); `planner probe` fits it where the CPU is the device
    (planner/calibration/calibrate.py [Note: the calibration model]), and it is what tiling costs there."""
    host_is_device: bool = False
    """The compute device *is* the host (a CPU-only machine, as `planner probe` finds without CUDA):
    the `gpu` and `cpu` tiers are the same memory, so a state placed on `cpu` is used where it lies,
    with no host<->device copy and no staging buffer (runtime/transfer/stores.py [Note: the CPU machine])."""
    flash_attention_flops_per_s: float = 0.0
    """Rate of the GPU's fused attention kernel (FlashAttention-2: the seq^2 scores stay on chip;
    Ampere, sm80, or newer), timing the attention core of `attention: flash` plans; 0 when the GPU
    has none (V100), and plans default to `attention: eager` there. A published kernel measurement,
    not the matmul rate: FlashAttention-2 runs Ampere's instructions on Hopper too
    (planner/cost/kernels.py [Note: attention kernels])."""
    fp8_matmul_flops_per_s: float = 0.0
    """The rate a large fp8 matmul sustains in training (the fp8 counterpart of `gpu_flops_per_s`,
    the same efficiency curve scaling it); 0 means the datasheet's fp8 / bf16 ratio times
    `gpu_flops_per_s` (planner/cost/fp8.py [Note: fp8 matmuls]). The fitted H100/H200 presets set it
    (planner/validation/fit.py)."""
    backward_matmul_flops_per_s: float = 0.0
    """Rate of the backward pass's matmuls (the input and weight gradients) where it is not the
    forward's; 0 means `gpu_flops_per_s` (every GPU preset). Fitted by calibration on profiles of
    the device itself (planner/calibration/calibrate.py [Note: the backward's own matmul rate])."""
    host_memcpy_bytes_per_s: float = 0.0
    """Bytes one host thread copies per second from pageable into pinned memory, beyond the CPU's
    caches: the staged copy of `host_pinning: staged` (planner/cost/host_link.py [Note: staged and
    pinned host copies]). `planner probe` measures it; 0 means not stated, and the pricing takes
    the GPU's share of `host_memory_bytes_per_s` (a copy reads and writes each byte)."""
    hbm_achievable_fraction: float = 0.0
    """Share of `gpu_hbm_bytes_per_s` memory-bound kernels stream at; 0 means planner/cost/kernels.py's
    HBM_ACHIEVABLE_FRACTION (fitted presets set their own: planner/validation/fit.py)."""
    transfer_efficiency: EfficiencyCurve = EfficiencyCurve()
    """Fraction of a link's rate one transfer of a given size reaches (PCIe, NVMe, collectives)."""
    matmul_efficiency: EfficiencyCurve = EfficiencyCurve()
    """Fraction of `gpu_flops_per_s` one matmul of a given flop count reaches."""
    attention_efficiency: EfficiencyCurve = EfficiencyCurve()
    """Fraction of `flash_attention_flops_per_s` the fused attention kernel reaches at a given query
    length (the sequence one kernel call covers): a causal kernel works in key blocks, and the block
    on the diagonal is computed whole, so short sequences waste a larger share of it
    (planner/cost/kernels.py [Note: the fused kernel's rate by sequence length])."""
    compute_precision: str = ""
    """The precision the compute rates above (`gpu_flops_per_s`, `backward_matmul_flops_per_s`,
    `flash_attention_flops_per_s`) are for, where `precision_rates` says what the others run at;
    empty for a spec that states one rate for every precision (every preset)."""
    precision_rates: tuple[tuple[str, PrecisionRates], ...] = ()
    """(precision, measured matmul rates) for each precision `planner probe` timed, sorted by name:
    what scales the compute rates above to a plan's precision ([Note: a plan's precision prices its
    compute])."""
    whole_node_gpus: int = 0
    """Nonzero when this spec is the share of a bigger node that `num_gpus_per_node` of its
    `whole_node_gpus` GPUs get ([Note: part of a node]); 0 for a whole node."""
    sources: dict[str, Provenance] = field(default_factory=dict, compare=False)
    """Provenance per document key; unlisted keys are nominal."""
    citations: dict[str, str] = field(default_factory=dict, compare=False)
    """Public source per document key (datasheet or instance page URL; for a derived number, the rule
    and its source). Presets for machines people own cite every number (tests/test_planner_presets.py)."""
    notes: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = f"hardware {self.name!r}"
        for attr, key, _, minimum, integer in _NUMERIC_FIELDS:
            value = number(getattr(self, attr), f"{where} {key}", minimum=minimum, integer=integer)
            if attr in _POSITIVE and value <= 0:
                raise PlannerError(f"{where} {key} must be greater than 0, got {value!r}")
        if self.gpu_max_alloc_bytes == 0:
            object.__setattr__(self, "gpu_max_alloc_bytes", self.gpu_memory_bytes)
        if self.gpu_max_alloc_bytes < MIN_GPU_ALLOC_BYTES:
            raise PlannerError(f"{where} gpu_max_alloc_gib ({self.gpu_max_alloc_bytes / GIB:g}) is below 1 MiB "
                               f"({MIN_GPU_ALLOC_BYTES / GIB:g} GiB): state the largest block the GPU can allocate")
        if self.gpu_max_alloc_bytes > self.gpu_memory_bytes:
            raise PlannerError(
                f"{where} gpu_max_alloc_gib ({self.gpu_max_alloc_bytes / GIB:g}) exceeds gpu_memory_gib "
                f"({self.gpu_memory_bytes / GIB:g})"
            )
        string(self.nvme_read_write, f"{where} nvme_read_write", choices=NVME_READ_WRITE)
        for attr, key, scale, minimum, maximum in _OPTIONAL_NUMERIC_FIELDS:
            number(getattr(self, attr) / scale, f"{where} {key}", minimum=minimum, maximum=maximum)
        if not isinstance(self.host_is_device, bool):
            raise PlannerError(f"{where} host_is_device must be true or false, got {self.host_is_device!r}")
        for curve in (self.transfer_efficiency, self.matmul_efficiency, self.attention_efficiency):
            if not isinstance(curve, EfficiencyCurve):
                raise PlannerError(f"{where}: efficiency curves must be EfficiencyCurve, got {type(curve).__name__}")
        if self.num_gpus_per_node > 1 and self.gpu_gpu_intra_node_bytes_per_s <= 0:
            raise PlannerError(f"{where} has {self.num_gpus_per_node} GPUs per node but no gpu_gpu_intra_node_gb_per_s")
        for key, value in self.sources.items():
            provenance(value, f"{where} sources.{key}")
        number(self.whole_node_gpus, f"{where} whole_node_gpus", minimum=0, integer=True)
        self._check_precisions(where)
        if self.whole_node_gpus and self.whole_node_gpus <= self.num_gpus_per_node:
            raise PlannerError(f"{where} whole_node_gpus ({self.whole_node_gpus}) must exceed num_gpus_per_node "
                               f"({self.num_gpus_per_node}), or be 0 for a whole node")

    def _check_precisions(self, where: str) -> None:
        rates = dict(self.precision_rates)
        for precision, entry in self.precision_rates:
            string(precision, f"{where} precision_rates key", choices=PRECISIONS)
            if not isinstance(entry, PrecisionRates):
                raise PlannerError(f"{where} precision_rates.{precision} must be PrecisionRates, got {type(entry).__name__}")
        if self.compute_precision or rates:
            string(self.compute_precision, f"{where} compute_precision", choices=tuple(rates) or PRECISIONS)
        if len(rates) != len(self.precision_rates) or list(rates) != sorted(rates):
            raise PlannerError(f"{where} precision_rates must name each precision once, sorted")

    # -- documents ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"name": self.name}
        if self.description:
            doc["description"] = self.description
        for attr, key, scale, _, integer in _NUMERIC_FIELDS:
            value = getattr(self, attr)
            doc[key] = int(value) if integer else value / scale
        doc["nvme_read_write"] = self.nvme_read_write
        if self.host_is_device:
            doc["host_is_device"] = True
        for attr, key, scale, *_ in _OPTIONAL_NUMERIC_FIELDS:
            if getattr(self, attr):
                doc[key] = getattr(self, attr) / scale
        curves = {"transfer": self.transfer_efficiency, "matmul": self.matmul_efficiency,
                  "attention": self.attention_efficiency}
        if any(curve.points for curve in curves.values()):
            doc["efficiency"] = {kind: _curve_to_doc(curve, kind) for kind, curve in curves.items() if curve.points}
        if self.whole_node_gpus:
            doc["whole_node_gpus"] = self.whole_node_gpus
        if self.compute_precision:
            doc["compute_precision"] = self.compute_precision
        if self.precision_rates:
            doc["precision_rates"] = {precision: rates.to_dict() for precision, rates in self.precision_rates}
        doc["sources"] = dict(self.sources)
        if self.citations:
            doc["citations"] = dict(self.citations)
        if self.notes:
            doc["notes"] = self.notes
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "hardware") -> NodeSpec:
        keys = {key for _, key, *_ in _NUMERIC_FIELDS}
        check_keys(doc, keys | _EXTRA_KEYS | {"name", "description", "sources", "notes"}, where)
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
        if "nvme_read_write" in doc:
            kwargs["nvme_read_write"] = string(doc["nvme_read_write"], f"{where} nvme_read_write", choices=NVME_READ_WRITE)
        if "host_is_device" in doc:
            if not isinstance(doc["host_is_device"], bool):
                raise PlannerError(f"{where} host_is_device must be true or false, got {doc['host_is_device']!r}")
            kwargs["host_is_device"] = doc["host_is_device"]
        for attr, key, scale, minimum, maximum in _OPTIONAL_NUMERIC_FIELDS:
            if key in doc:
                kwargs[attr] = number(doc[key], f"{where} {key}", minimum=minimum, maximum=maximum) * scale
        if "efficiency" in doc:
            check_keys(doc["efficiency"], set(_CURVES), f"{where} efficiency")
            for kind, curve_doc in doc["efficiency"].items():
                kwargs[f"{kind}_efficiency"] = _curve_from_doc(curve_doc, kind, f"{where} efficiency.{kind}")
        sources = doc.get("sources", {})
        check_keys(sources, keys | _EXTRA_KEYS, f"{where} sources")
        kwargs["sources"] = {k: provenance(v, f"{where} sources.{k}") for k, v in sources.items()}
        citations = doc.get("citations", {})
        check_keys(citations, keys | _EXTRA_KEYS | {"description"}, f"{where} citations")
        kwargs["citations"] = {k: string(v, f"{where} citations.{k}", max_len=2_000) for k, v in citations.items()}
        if "whole_node_gpus" in doc:
            kwargs["whole_node_gpus"] = number(doc["whole_node_gpus"], f"{where} whole_node_gpus", minimum=0, integer=True)
        for text_key in ("description", "notes"):
            if text_key in doc:
                kwargs[text_key] = string(doc[text_key], f"{where} {text_key}", max_len=20_000)
        if "compute_precision" in doc:
            kwargs["compute_precision"] = string(doc["compute_precision"], f"{where} compute_precision", choices=PRECISIONS)
        if "precision_rates" in doc:
            check_keys(doc["precision_rates"], set(PRECISIONS), f"{where} precision_rates")
            kwargs["precision_rates"] = tuple(sorted(
                (precision, PrecisionRates.from_dict(entry, f"{where} precision_rates.{precision}"))
                for precision, entry in doc["precision_rates"].items()))
        return cls(**kwargs)

    def with_max_alloc_gib(self, gib: float) -> NodeSpec:
        """This node with its largest contiguous GPU allocation pinned (`--max-alloc-gib`)."""
        number(gib, "--max-alloc-gib", exclusive_minimum=0)
        if gib * GIB < MIN_GPU_ALLOC_BYTES:
            raise PlannerError(f"--max-alloc-gib {gib!r} is below 1 MiB ({MIN_GPU_ALLOC_BYTES / GIB:g} GiB): "
                               f"give the largest block the GPU can allocate, in GiB")
        return self.replace(gpu_max_alloc_bytes=gib * GIB)

    def for_gpus(self, num_gpus: int) -> NodeSpec:
        """What `num_gpus` GPUs get of this node: the whole node from its size up, else their share
        ([Note: part of a node]). Idempotent: a share asked for its own GPU count is itself."""
        whole = self.whole_node_gpus or self.num_gpus_per_node
        used = min(num_gpus, whole)
        if used == self.num_gpus_per_node:
            return self
        scale = used / self.num_gpus_per_node
        shared = {attr: getattr(self, attr) * scale for attr in SHARED_BY_GPUS}
        return self.replace(num_gpus_per_node=used, whole_node_gpus=0 if used == whole else whole, **shared)

    def share_line(self) -> str:
        """One line saying what part of a node this spec bills; empty for a whole node."""
        if not self.whole_node_gpus:
            return ""
        used, whole = self.num_gpus_per_node, self.whole_node_gpus
        nvme = ""
        if self.nvme_capacity_bytes:
            nvme = (f", NVMe ({self.nvme_capacity_bytes / GIB:,.0f} GiB, {self.nvme_read_bytes_per_s / GB:.3g}/"
                    f"{self.nvme_write_bytes_per_s / GB:.3g} GB/s read/write)")
        return (f"{whole}-GPU node, using {used} GPU{'s' if used > 1 else ''}: {used}/{whole} of its DRAM "
                f"({self.cpu_memory_bytes / GIB:,.0f} GiB){nvme}, host memory bandwidth "
                f"({self.host_memory_bytes_per_s / GB:.3g} GB/s) and CPU optimizer "
                f"({self.cpu_adam_params_per_s / 1e9:.3g} G params/s)")

    def provenance(self, key: str) -> str:
        return self.sources.get(key, "nominal")

    @property
    def host_memory_is_measured(self) -> bool:
        """Whether `host_memory_bytes_per_s` is the host memory's own rate, a copy in host memory timed
        by `planner probe`, rather than a published figure for the GPUs' host traffic together (the
        presets': PCIe switch uplinks on dgx-h100, 16 GPUs reading at once on dgx2-v100; their notes).
        Only the former also carries the CPU's own passes over host memory (CPU Adam, a landing's reads
        and writes of its fp32 shard: planner/sim/resources.py [Note: CPU Adam shares the host memory])."""
        return self.provenance("host_memory_gb_per_s") == "measured"

    @property
    def backward_matmul_rate(self) -> float:
        """Flops per second of the backward's matmuls: their own rate where set, else the forward's."""
        return self.backward_matmul_flops_per_s or self.gpu_flops_per_s

    @property
    def backward_matmul_slowdown(self) -> float:
        """How many times as long a backward matmul takes as a forward one of the same flops (1
        without a backward rate of its own): what the simulator and the estimate scale it by."""
        return self.gpu_flops_per_s / self.backward_matmul_rate

    def in_precision(self, precision: str) -> NodeSpec:
        """This node's compute rates for a plan in `precision` ([Note: a plan's precision prices its
        compute]); itself where it states one rate for every precision, or already is in `precision`."""
        rates = dict(self.precision_rates)
        if precision == self.compute_precision or precision not in rates or self.compute_precision not in rates:
            return self
        have, want = rates[self.compute_precision], rates[precision]
        forward = want.matmul_flops_per_s / have.matmul_flops_per_s
        training = want.training_flops_per_s / have.training_flops_per_s
        return self.replace(
            compute_precision=precision,
            gpu_flops_per_s=self.gpu_flops_per_s * forward,
            backward_matmul_flops_per_s=self.backward_matmul_rate
            * want.backward_matmul_flops_per_s / have.backward_matmul_flops_per_s,
            flash_attention_flops_per_s=self.flash_attention_flops_per_s * training,
        )

    def replace(self, **changes: Any) -> NodeSpec:
        doc = {f.name: getattr(self, f.name) for f in fields(self)}
        doc.update(changes)
        return NodeSpec(**doc)


# [Note: a plan's precision prices its compute]
# A spec measured by `planner probe` states its compute rates (the matmuls forward and backward, the
# fused attention) in one precision, `compute_precision`, and what the probe measured the device's
# matmuls at in every precision, `precision_rates`. A plan in another precision is priced at the
# stated rates scaled by the measured ratio: the forward's matmuls by the forward ratio, the
# backward's by the backward ratio, the fused attention (forward and backward) by the ratio of a
# training step's matmuls. Ratios, not the measured rates themselves, so that a calibrated spec
# (whose stated rates are fitted to the runtime's steps, planner/calibration/calibrate.py) carries
# its fit into every precision. Applied once, where a plan meets its node (Plan.__post_init__,
# beside [Note: part of a node]); the plan's node then is in its precision, which makes the step
# idempotent. A preset states no per-precision rates: its published rate holds for every precision.


# [Note: part of a node]
# A node's numbers are for all its GPUs busy (NodeSpec's docstring). Planning fewer GPUs than a node
# has bills what those GPUs get when the rest of the node is someone else's: a share of the host DRAM,
# NVMe capacity and rates, host memory bandwidth and CPU optimizer throughput (the cores) in
# proportion to the GPUs used (SHARED_BY_GPUS); per-GPU numbers (GPU memory, FLOPS, HBM, the GPU's
# own host link, NVLink) are unchanged. Proportional because that is how clouds cut a node: Azure's
# NC A100 v4 sizes give 1, 2 and 4 A100s 220, 440 and 880 GiB and 1, 2 and 4 NVMe disks
# (https://learn.microsoft.com/azure/virtual-machines/sizes/gpu-accelerated/nca100v4-series), and
# batch schedulers allot CPUs and memory per GPU. It keeps the per-GPU share of every shared link
# what it is on the full node. A machine you own with idle GPUs gets more: describe it with a
# hardware file whose num_gpus_per_node is the GPUs you use. Applied once, where a plan meets its
# GPU count (Plan.__post_init__); a plan's document then carries the share and `whole_node_gpus`.


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

    def check_network(self) -> None:
        """A plan across nodes needs the network between them: without it every collective would take
        forever (an infinite prediction, and a plan file JSON cannot hold)."""
        if self.num_nodes > 1 and not self.node.inter_node_bytes_per_s:
            raise PlannerError(
                f"--gpus {self.num_gpus} spans {self.num_nodes} {self.node.name} nodes, but the hardware states no "
                f"network between nodes (inter_node_gb_per_s is 0): use at most {self.node.num_gpus_per_node} "
                "GPU(s), or a hardware file with inter_node_gb_per_s"
            )

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.node.num_gpus_per_node)

    @property
    def gpus_per_node(self) -> int:
        """GPUs in use on each node (fewer than the node has when planning part of one node)."""
        return min(self.num_gpus, self.node.num_gpus_per_node)
