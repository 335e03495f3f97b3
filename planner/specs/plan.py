"""The plan document: what to run (model, hardware, placement, knobs) and what we predict.

Key names are a contract (docs/plan-format.md, every key with its unit): other tools read `placement.params`,
`prediction.iteration_time_s`, ... Extend rather than rename; a renamed key keeps its old spelling
readable ([Note: old spellings]). A profile written by the runtime carries the same
`prediction`-shaped block under `measured`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Literal

from planner.specs.errors import PlannerError
from planner.specs.hardware import Cluster, NodeSpec
from planner.specs.memory_terms import SUBTRACTED_TERMS
from planner.specs.model import ModelSpec
from planner.specs.phases import PHASES
from planner.specs.precision import PRECISIONS
from planner.specs.specio import check_keys, load_document, number, renamed_keys, string, write_json_atomic
from planner.specs.stack import Fp8Recipe, KvExchange, ShardCollectives
from planner.specs.tiers import GPU, NVME, TIERS, Tier

SCHEMA = "tierwise.plan/1"

STATES: tuple[str, ...] = ("params", "gradients", "optimizer_states", "recompute_inputs")
MODEL_STATES: tuple[str, ...] = ("params", "gradients", "optimizer_states")
Precision = Literal["fp32", "bf16", "fp16"]
STRATEGIES: tuple[str, ...] = ("dp", "zero2", "zero-offload", "zero3", "zero-inf-cpu", "zero-inf-nvme", "3d", "custom")
COLLECTIVE_LINKS: tuple[str, ...] = ("all_gather", "reduce_scatter")


class _LinkNames(Sequence[str]):
    """`prediction.link_bytes` keys: every tier's links (`TIERS.link_names`: nvme_read, nvme_write, h2d,
    d2h), then the data-parallel collectives; read at use, so a registered tier's links are among them."""

    _tier_links: tuple[str, ...] = ()
    _all: tuple[str, ...] = COLLECTIVE_LINKS

    def _names(self) -> tuple[str, ...]:
        if TIERS.link_names is not self._tier_links:  # a tier was registered since: read them again
            self._tier_links, self._all = TIERS.link_names, (*TIERS.link_names, *COLLECTIVE_LINKS)
        return self._all

    def __getitem__(self, index):  # noqa: ANN001, ANN204 (Sequence's int-or-slice signature)
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


LINKS: Sequence[str] = _LinkNames()
OptimizerStep = Literal["after_backward", "in_backward"]
OPTIMIZER_STEPS: tuple[str, ...] = ("after_backward", "in_backward")
ATTENTION_KERNELS: tuple[str, ...] = ("flash", "eager")
"""What each costs: planner/cost/kernels.py [Note: attention kernels]."""
RECOMPUTES: tuple[str, ...] = ("none", "full", "selective", "every_nth_block", "op_level")
"""What each recomputes: planner/cost/kernels.py [Note: recompute]."""
SEGMENTLESS_RECOMPUTES: tuple[str, ...] = ("none", "selective", "every_nth_block", "op_level")
"""The kinds without recompute segments (`recompute_interval` 0): each block keeps what its kind
stores, and whatever it recomputes runs inside that block's own backward."""

# [Note: old spellings]
# Activation checkpoints are called recompute inputs, and their interval the recompute interval
# (docs/architecture.md, Conventions): "checkpoint" means a training checkpoint only. Documents
# written before the rename (plans, the profiles' `plan` and `measured` blocks, run histories) still
# load: each old spelling below is read as its new one, and a document giving both is refused.
# Documents are written with the new spellings only.
OLD_PLAN_KEYS = {"checkpoint_interval": "recompute_interval"}
OLD_PLACEMENT_KEYS = {"activation_checkpoints": "recompute_inputs"}
OLD_MEMORY_TERMS = {"activation_checkpoints": "recompute_inputs",
                    "checkpoint_offload_staging": "recompute_input_offload_staging"}
"""`prediction.memory_terms` keys (`planner.specs.memory_terms.MemoryTerm` values)."""
OLD_BOTTLENECKS = {f"checkpoints ({tier})": f"recompute inputs ({tier})" for tier in TIERS}
"""`prediction.bottleneck` values of the analytic estimate (planner/cost/throughput.py's work names)."""


class HostPinning(str, Enum):
    """How host-memory shards cross to a device with memory of its own (runtime/transfer/stores.py).

    `shards`: the shards that cross the link (compute-precision parameters, gradient landing
    buffers, recompute inputs) are page-locked once and copied straight from and to; `staged`:
    they stay pageable and every copy goes through a small pool of pinned buffers, for a host that
    cannot lock that much memory. fp32 masters and Adam states stay pageable either way. Plans
    written before the key existed are `staged`."""

    SHARDS = "shards"
    STAGED = "staged"

    __str__ = str.__str__
    __format__ = str.__format__


class HostParamShard(str, Enum):
    """What the host-memory parameter shard of a mixed-precision plan is, where the parameters and the
    optimizer states both live in host memory (`master_is_param_shard`).

    `compute_copy`: a 16-bit shard of its own beside the fp32 master; each update casts the master
    into it on the optimizer's thread, and reads to the device move 16 bits per element. `master`:
    the fp32 master itself (as FSDP2's CPU offload keeps it): the update is in place and nothing is
    cast on the host; reads move 32 bits per element and are cast on the device; host memory holds
    2 bytes per parameter less. Bit for bit the same training: both casts round to nearest even.
    Plans written before the key existed are `compute_copy`."""

    COMPUTE_COPY = "compute_copy"
    MASTER = "master"

    __str__ = str.__str__
    __format__ = str.__format__

# Runtime defaults a plan carries explicitly so that the simulator and the runtime share them.
DEFAULT_OPTIMIZER_CHUNK_BYTES = 256 * 1024**2
DEFAULT_NUM_OPTIMIZER_BUFFERS = 3  # read k+1, update k, write k-1 (docs/method.md §4.3)
DEFAULT_NVME_BLOCK_BYTES = 1024**2
MAX_TILING_FACTOR = 4096


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Which memory tier holds each partitioned state (the Infinity offload engine's map)."""

    params: Tier = GPU
    """fp16/bf16 parameter shards (fp32 when precision is fp32)."""
    gradients: Tier = GPU
    """Gradient shards after reduce-scatter."""
    optimizer_states: Tier = GPU
    """fp32 master weights, Adam momentum and variance (and the fp32 gradient copy)."""
    recompute_inputs: Tier = GPU
    """The input of each recompute segment (the block input kept in forward and recomputed from in
    backward; the paper's activation checkpoints)."""

    def __post_init__(self) -> None:
        # A tier's name (a document's, a test's) becomes the tier ([Note: tiers as types]).
        for state in STATES:
            object.__setattr__(self, state, TIERS.named(getattr(self, state), f"placement.{state}"))
        # Where the optimizer steps decides where its gradients must land.
        opt, grads = self.optimizer_states, self.gradients
        if grads not in opt.gradient_tiers:
            raise PlannerError(f"placement: optimizer_states={opt} steps on the {opt.optimizer_memory.label}, so "
                               f"gradients must be {' or '.join(opt.gradient_tiers)}, not {grads}")

    def to_dict(self) -> dict[str, Tier]:
        return {state: getattr(self, state) for state in STATES}

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "placement") -> Placement:
        doc = renamed_keys(doc, OLD_PLACEMENT_KEYS, where)
        check_keys(doc, set(STATES), where)
        return cls(**{k: TIERS.named(v, f"{where}.{k}") for k, v in doc.items()})

    @property
    def uses_nvme(self) -> bool:
        """Whether any state, recompute inputs included, lies on NVMe: the plan then needs
        `nvme_path`, the directory of its swap files."""
        return NVME in (self.params, self.gradients, self.optimizer_states, self.recompute_inputs)

    @property
    def model_states_on_nvme(self) -> bool:
        """Whether parameters, gradients or optimizer states lie on NVMe: the swap files the runtime
        opens (it keeps recompute inputs on the GPU or in host memory, and refuses them on NVMe)."""
        return NVME in (self.params, self.gradients, self.optimizer_states)

    def label(self) -> str:
        return " ".join(f"{short}={getattr(self, state)}" for short, state in zip(("P", "G", "O", "A"), STATES, strict=True))


def parse_placement_pins(text: str | None) -> dict[str, Tier]:
    """`"params=nvme,optimizer_states=nvme"` -> {"params": "nvme", ...}; partial pins are allowed."""
    if not text:
        return {}
    aliases = {"optimizer": "optimizer_states", "grads": "gradients", "checkpoints": "recompute_inputs",
               "activations": "recompute_inputs", "param": "params", **OLD_PLACEMENT_KEYS}
    pins: dict[str, Tier] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip().lower(), value.strip().lower()
        key = aliases.get(key, key)
        if not sep or key not in STATES or value not in TIERS:
            raise PlannerError(
                f"--placement item {item.strip()!r} is not STATE=TIER; states: {', '.join(STATES)}; tiers: {', '.join(TIERS)}"
            )
        pins[key] = TIERS.named(value)
    return pins


@dataclass(frozen=True, kw_only=True, slots=True)
class Strategy:
    """A named point of the design space (paper Fig. 5): where states live and which are partitioned."""

    name: str
    placement: Placement
    partitioned: frozenset[str]
    """Model states split across the data-parallel ranks (the rest are replicated)."""
    description: str


_ALL = frozenset(MODEL_STATES)
STRATEGY_TABLE: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(name="dp", placement=Placement(), partitioned=frozenset(),
                 description="data parallel: everything replicated on every GPU"),
        Strategy(name="zero2", placement=Placement(), partitioned=frozenset({"gradients", "optimizer_states"}),
                 description="ZeRO-2: gradients and optimizer states partitioned on the GPUs"),
        Strategy(name="zero-offload", placement=Placement(gradients="cpu", optimizer_states="cpu"),
                 partitioned=frozenset({"gradients", "optimizer_states"}),
                 description="ZeRO-Offload: gradients and optimizer states partitioned in CPU memory"),
        Strategy(name="zero3", placement=Placement(), partitioned=_ALL,
                 description="ZeRO-3: all model states partitioned on the GPUs"),
        Strategy(name="zero-inf-cpu", placement=Placement(params="cpu", gradients="cpu", optimizer_states="cpu",
                                                          recompute_inputs="cpu"), partitioned=_ALL,
                 description="ZeRO-Infinity: all model states partitioned in CPU memory"),
        Strategy(name="zero-inf-nvme", placement=Placement(params="nvme", gradients="nvme", optimizer_states="nvme",
                                                           recompute_inputs="cpu"), partitioned=_ALL,
                 description="ZeRO-Infinity: parameters and optimizer states partitioned on NVMe"),
        # The paper's baseline (Megatron-LM, Narayanan et al. 2021): tensor x pipeline x data parallel,
        # everything on the GPUs, the optimizer states partitioned over data parallel (ZeRO-1, Megatron's
        # distributed optimizer); gradients are reduced once per step (planner/cost/pipeline.py).
        Strategy(name="3d", placement=Placement(), partitioned=frozenset({"optimizer_states"}),
                 description="3D parallelism: tensor x pipeline x data parallel, optimizer states partitioned (ZeRO-1)"),
    )
}


def strategy_named(name: str) -> Strategy:
    """The strategy called `name` (`--strategy`), or a one-line error listing the names."""
    if name not in STRATEGY_TABLE:
        raise PlannerError(f"unknown strategy {name!r}; use one of {', '.join(STRATEGY_TABLE)}")
    return STRATEGY_TABLE[name]


def partitioned_states(strategy: str) -> frozenset[str]:
    """Free placements ("custom") are ZeRO-3: every model state partitioned."""
    return STRATEGY_TABLE[strategy].partitioned if strategy in STRATEGY_TABLE else _ALL


@dataclass(kw_only=True, slots=True)
class Prediction:
    """What the planner expects one training iteration to cost (`prediction.*` in docs/plan-format.md)."""

    feasible: bool
    reason: str = ""
    """Why the plan does not fit, or what limits it; empty when nothing to say."""
    iteration_time_s: float = 0.0
    tflops_per_gpu: float = 0.0
    """Paper accounting (eq. 7): 8 * tokens * params with recompute, 6 * tokens * params without."""
    tokens_per_s: float = 0.0
    bottleneck: str = ""
    peak_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    """Per GPU for `gpu`, per node for `cpu` and `nvme`."""
    capacity_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    phase_time_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    link_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LINKS, 0))
    """Bytes per iteration per GPU on each link."""
    memory_terms: dict[str, dict[str, int]] = field(default_factory=dict)
    """tier -> named term -> bytes (same units as `peak_bytes`)."""
    method: str = "analytic"
    """`analytic` (paper §4 estimate) or `simulated` (discrete-event simulator)."""
    details: dict[str, Any] = field(default_factory=dict)
    """Method-specific extras (resource busy fractions, efficiencies, ...)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "prediction") -> Prediction:
        check_keys(doc, {f.name for f in fields(cls)}, where)
        doc = _with_new_names(doc, where)
        if "feasible" not in doc or not isinstance(doc["feasible"], bool):
            raise PlannerError(f"{where}.feasible must be true or false")
        kwargs: dict[str, Any] = {"feasible": doc["feasible"]}
        for key in ("iteration_time_s", "tflops_per_gpu", "tokens_per_s"):
            if key in doc:
                kwargs[key] = number(doc[key], f"{where}.{key}", minimum=0)
        for key in ("reason", "bottleneck", "method"):
            if key in doc:
                kwargs[key] = string(doc[key], f"{where}.{key}", max_len=20_000)
        for key, names, integer in (("peak_bytes", TIERS, True), ("capacity_bytes", TIERS, True),
                                    ("phase_time_s", PHASES, False), ("link_bytes", LINKS, True)):
            if key in doc:
                check_keys(doc[key], set(names), f"{where}.{key}")
                kwargs[key] = {k: number(v, f"{where}.{key}.{k}", minimum=0, integer=integer) for k, v in doc[key].items()}
        if "memory_terms" in doc:
            check_keys(doc["memory_terms"], set(TIERS), f"{where}.memory_terms")
            kwargs["memory_terms"] = {
                tier: {string(k, f"{where}.memory_terms.{tier} key", max_len=200):
                       number(v, f"{where}.memory_terms.{tier}.{k}", minimum=None if k in SUBTRACTED_TERMS else 0,
                              integer=True) for k, v in terms.items()}
                for tier, terms in doc["memory_terms"].items()
            }
        if "details" in doc:
            if not isinstance(doc["details"], dict):
                raise PlannerError(f"{where}.details must be an object")
            try:
                json.dumps(doc["details"], allow_nan=False)
            except ValueError:
                raise PlannerError(f"{where}.details must hold finite numbers (no NaN or infinity)") from None
            kwargs["details"] = doc["details"]
        return cls(**kwargs)


def _with_new_names(doc: dict[str, Any], where: str) -> dict[str, Any]:
    """A prediction-shaped block with the memory-term and bottleneck names of [Note: old spellings]."""
    doc = dict(doc)
    terms = doc.get("memory_terms")
    if isinstance(terms, dict):
        doc["memory_terms"] = {tier: renamed_keys(by_name, OLD_MEMORY_TERMS, f"{where}.memory_terms.{tier}")
                               if isinstance(by_name, dict) else by_name for tier, by_name in terms.items()}
    if isinstance(doc.get("bottleneck"), str) and doc["bottleneck"] in OLD_BOTTLENECKS:  # else refused below, in one line
        doc["bottleneck"] = OLD_BOTTLENECKS[doc["bottleneck"]]
    return doc


# No slots: `replace` copies the instance dict in one update for each candidate the search prices,
# and `cluster` is kept there once made (a cached property may read only fields that `_OWN_CHECKS`
# does not name: the fast path copies it unchanged).
@dataclass(frozen=True, kw_only=True)
class Plan:
    """One executable configuration. The simulator and the runtime read exactly these fields.

    A plan checks its own fields and nothing a cost model knows: `planner.cost.feasibility.check_plan`
    refuses what the cost models cannot price (fp8 without an fp8 rate, a context-parallel layout
    ring attention cannot run), and every reader of outside input calls it."""

    model: ModelSpec
    node: NodeSpec
    """Hardware of one node; the plan is self-contained so `simulate` and `run` need no preset lookup."""
    num_gpus: int
    strategy: str = "custom"
    placement: Placement = field(default_factory=Placement)
    micro_batch_per_gpu: float = 1
    """Global batch / number of GPUs (paper's batch/GPU); fractional only with model parallelism."""
    recompute_interval: int = 1
    """Blocks per recompute segment (the paper's `ci`): each segment keeps only its input and runs
    its blocks' forward again in backward; 0: no recompute segments (`recompute` none, selective,
    every_nth_block or op_level)."""
    tiling_factor: int = 1
    """Each large linear is split into this many tiles, gathered one at a time."""
    prefetch_depth: int = 3
    """Operators fetched ahead: 1 all-gathers i+1, 2 also copies i+2 to the GPU, 3 also reads i+3 from NVMe."""
    model_parallel_degree: int = 1
    """Tensor-parallel degree (Megatron), inside one node."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages (1F1B schedule, planner/cost/pipeline.py): each holds `num_layers / p` blocks; stages
    are the outermost dimension (Megatron's order: tensor, then data, then pipeline)."""
    pipeline_virtual_stages: int = 1
    """Model chunks per GPU in Megatron's interleaved 1F1B (`virtual_pipeline_model_parallel_size`):
    the bubble shrinks by this factor and every micro-batch crosses this many times more boundaries."""
    context_parallel_degree: int = 1
    """Context-parallel degree (Megatron-Core's CP, ring attention): each GPU of a replica holds
    `seq_len / cp` tokens of every sequence; one replica spans `model_parallel_degree x cp x
    pipeline_parallel_degree` GPUs (Megatron's order: tensor, context, data, pipeline).
    planner/cost/context_parallel.py [Note: context parallelism]."""
    micro_batches_per_step: int = 1
    """Micro-batches each model replica runs per optimizer step (gradient accumulation, and the
    pipeline's `m`): one iteration is one optimizer step of this many micro-batches."""
    precision: Precision = "bf16"
    fp8_matmuls: bool = False
    """Linear layers' matmuls in fp8 at the GPU's fp8 rate; all else in `precision` ([Note: fp8
    matmuls] in planner/cost/fp8.py)."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.TE_DELAYED
    """How the fp8 operands are made (`Fp8Recipe`), which sets the casts' memory traffic ([Note: fp8
    casts] in planner/cost/fp8.py); read only with `fp8_matmuls`."""
    kv_exchange: KvExchange = KvExchange.RING
    """How context parallelism exchanges keys and values (`KvExchange`, [Note: context parallelism] in
    planner/cost/context_parallel.py); read only with `context_parallel_degree` > 1."""
    shard_collectives: ShardCollectives = ShardCollectives.FLAT
    """How the sharded parameters are grouped into data-parallel collectives (`ShardCollectives`,
    planner/cost/collectives.py [Note: per-parameter collectives]); per parameter needs prefetch depth 0."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (Korthikanti et al. 2022, arXiv:2205.05198 Sec. 4.2.2): the
    residual stream's norms, residual adds and dropouts run on `1 / model_parallel_degree` of the
    sequence on each tensor-parallel rank instead of all of it on every rank (planner/cost/kernels.py
    [Note: memory-bound kernels]); its all-gather and reduce-scatter move the all-reduce's bytes."""
    nvme_path: str | None = None
    """Directory for swap files when any state is on NVMe."""
    optimizer_chunk_bytes: int = DEFAULT_OPTIMIZER_CHUNK_BYTES
    """Optimizer-state bytes per chunk of the streamed (NVMe) optimizer step."""
    num_optimizer_buffers: int = DEFAULT_NUM_OPTIMIZER_BUFFERS
    """Pinned chunk buffers of the streamed optimizer step (>= 3 to overlap read, update, write)."""
    nvme_block_bytes: int = DEFAULT_NVME_BLOCK_BYTES
    """Request size of the async I/O engine."""
    host_pinning: HostPinning = HostPinning.STAGED
    """`shards` or `staged` ([`HostPinning`]): whether host shards that cross the link are pinned once,
    or staged through the pinned pool; the bill charges what each pins."""
    host_param_shard: HostParamShard = HostParamShard.COMPUTE_COPY
    """`compute_copy` or `master` ([`HostParamShard`]): whether a mixed-precision plan whose parameters
    and optimizer states are in host memory keeps a 16-bit parameter shard beside the fp32 master, or
    reads the master itself (`master_is_param_shard`)."""
    optimizer_step: OptimizerStep = "after_backward"
    """When the optimizer updates a unit: `after_backward` (the paper's schedule: every unit at
    `optimizer.step()`, once the whole backward is over) or `in_backward` (each unit as soon as its
    gradient is final, overlapping the optimizer's work and its state traffic with the rest of the
    backward; with optimizer states on NVMe the gradient goes straight into the update and is never
    stored). `in_backward` is exact for a loop that steps after every backward with no gradient
    clipping; it refuses gradient accumulation at run time and fp16 (whose overflow check needs
    every gradient before any update) here. [Note: the optimizer step in backward] in
    runtime/optim/streamed_optimizer.py."""
    optimizer_step_reason: str = ""
    """Why the plan has this `optimizer_step`: pinned, the only schedule the training allows (and
    why), or the faster of those it allows (planner/specs/training_loop.py); empty when nobody chose."""
    attention: str = ""
    """`flash` (a fused kernel: the seq^2 scores are never stored, the backward recomputes them) or
    `eager` (the paper's equations: scores stored, eq. 5); empty means the model's own
    (`ModelSpec.attention`: the paper's presets pin eager), else flash where the GPU has it
    (`NodeSpec.flash_attention_flops_per_s`: A100, H100, H200), eager elsewhere (V100, the paper's DGX-2).
    planner/cost/kernels.py [Note: attention kernels]."""
    recompute: str = ""
    """`none`, `full` (every block's forward again from its segment's recompute input;
    `recompute_interval` >= 1), `selective` (only the attention core's seq^2 part, all else stored),
    `every_nth_block` (every `recompute_block_period`-th block keeps only its input and runs its
    forward again in its backward, the others keep everything: torchtitan's "selective layer"
    checkpointing) or `op_level` (every block keeps its input, the outputs of its odd-numbered
    matmuls and of the attention kernel, and recomputes the even-numbered matmuls and the
    elementwise kernels: torchtitan's "selective op" checkpointing); the last three with
    `recompute_interval` 0. Empty means what `recompute_interval` says: `full` with recompute
    segments, `none` without.
    planner/cost/kernels.py [Note: recompute]."""
    recompute_block_period: int = 2
    """`N` of `recompute: every_nth_block` (torchtitan's `selective_ac_option`): blocks N, 2N, ...
    are recomputed whole; read only with that kind."""
    prediction: Prediction | None = None

    def __post_init__(self) -> None:
        number(self.num_gpus, "num_gpus", minimum=1, maximum=1_000_000, integer=True)
        # Part of a node bills its GPUs' share of the node (planner/specs/hardware.py [Note: part of a node]).
        string(self.precision, "precision", choices=PRECISIONS)
        # ... and is priced in its own precision (planner/specs/hardware.py [Note: a plan's precision prices its compute]).
        object.__setattr__(self, "node", self.node.for_gpus(self.num_gpus).in_precision(self.precision))
        string(self.strategy, "strategy", choices=STRATEGIES)
        _check_step_name(self)
        _check_host_pinning(self)
        _check_host_param_shard(self)
        _check_step_precision(self)
        _check_batch_number(self)
        number(self.recompute_interval, "recompute_interval", minimum=0, maximum=self.model.num_layers, integer=True)
        _check_tiling_factor(self)
        _check_prefetch_depth(self)
        number(self.model_parallel_degree, "model_parallel_degree", minimum=1, maximum=1024, integer=True)
        number(self.context_parallel_degree, "context_parallel_degree", minimum=1, maximum=1024, integer=True)
        number(self.pipeline_parallel_degree, "pipeline_parallel_degree", minimum=1, maximum=self.model.num_layers,
               integer=True)
        number(self.pipeline_virtual_stages, "pipeline_virtual_stages", minimum=1,
               maximum=max(1, self.model.num_layers // self.pipeline_parallel_degree), integer=True)
        if self.pipeline_virtual_stages > 1 and self.pipeline_parallel_degree == 1:
            raise PlannerError(f"pipeline_virtual_stages {self.pipeline_virtual_stages} needs pipeline_parallel_degree > 1")
        number(self.micro_batches_per_step, "micro_batches_per_step", minimum=1, maximum=1_000_000, integer=True)
        _check_step_accumulation(self)
        number(self.optimizer_chunk_bytes, "optimizer_chunk_bytes", minimum=4096, maximum=2**40, integer=True)
        number(self.num_optimizer_buffers, "num_optimizer_buffers", minimum=1, maximum=64, integer=True)
        number(self.nvme_block_bytes, "nvme_block_bytes", minimum=4096, maximum=2**30, integer=True)
        if self.nvme_path is not None:
            string(self.nvme_path, "nvme_path", max_len=1024)
        _check_step_reason(self)
        _as_member(self, "fp8_recipe", Fp8Recipe)
        _as_member(self, "kv_exchange", KvExchange)
        _check_shard_collectives(self)
        if not isinstance(self.fp8_matmuls, bool):
            raise PlannerError(f"fp8_matmuls must be true or false, not {self.fp8_matmuls!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise PlannerError(f"sequence_parallel must be true or false, not {self.sequence_parallel!r}")
        mp = self.model_parallel_degree
        if self.num_gpus % mp:
            raise PlannerError(f"model_parallel_degree {mp} does not divide num_gpus {self.num_gpus}")
        if mp > self.node.num_gpus_per_node:
            raise PlannerError(f"model_parallel_degree {mp} exceeds the {self.node.num_gpus_per_node} GPUs of one node")
        if self.model.num_heads % mp:
            raise PlannerError(f"model_parallel_degree {mp} does not divide num_heads {self.model.num_heads}")
        pp = self.pipeline_parallel_degree
        if pp > 1:
            _check_pipeline(self)
        _check_whole_samples(self)
        self._resolve_kernels()
        if self.strategy in STRATEGY_TABLE and self.placement != STRATEGY_TABLE[self.strategy].placement:
            expected = STRATEGY_TABLE[self.strategy].placement.label()
            raise PlannerError(f"strategy {self.strategy} places states as {expected}, not {self.placement.label()}")
        Cluster(node=self.node, num_gpus=self.num_gpus)  # validates whole nodes

    def _resolve_kernels(self) -> None:
        """Fill `attention` and `recompute` when left empty, and refuse combinations no runtime has."""
        if not self.attention:
            default = "flash" if self.node.flash_attention_flops_per_s else "eager"
            object.__setattr__(self, "attention", self.model.attention or default)
        string(self.attention, "attention", choices=ATTENTION_KERNELS)
        if self.attention == "flash" and not self.node.flash_attention_flops_per_s:
            raise PlannerError(f"attention flash needs a GPU with a fused attention kernel (Ampere or newer); hardware "
                               f"{self.node.name!r} has none (no flash_attention_tflops): use attention eager")
        if not self.recompute:
            object.__setattr__(self, "recompute", "full" if self.recompute_interval else "none")
        string(self.recompute, "recompute", choices=RECOMPUTES)
        if (self.recompute == "full") != (self.recompute_interval > 0):
            raise PlannerError(f"recompute {self.recompute} needs recompute_interval "
                               f"{'>= 1' if self.recompute == 'full' else '0'}, got {self.recompute_interval}: "
                               "full recompute runs from each segment's recompute input, the other kinds keep "
                               "each block's own inputs")
        if self.recompute == "every_nth_block":  # read only with this kind
            number(self.recompute_block_period, "recompute_block_period", minimum=1, maximum=self.model.num_layers,
                   integer=True)

    # -- derived ---------------------------------------------------------------------------
    @cached_property
    def cluster(self) -> Cluster:
        """Made once per plan (a copy by `replace`'s fast path keeps it: it changes neither field read here)."""
        return Cluster(node=self.node, num_gpus=self.num_gpus)

    @property
    def num_nodes(self) -> int:
        return self.cluster.num_nodes

    @property
    def data_parallel_degree(self) -> int:
        """Ranks that reduce gradients and share partitioned states: the data-parallel replicas times
        the context-parallel ranks (each holds other tokens of the same weights' gradients: Megatron's
        data-parallel group with CP, torchtitan's FSDP mesh over dp x cp)."""
        return self.num_gpus // (self.model_parallel_degree * self.pipeline_parallel_degree)

    @property
    def gpus_per_replica(self) -> int:
        """GPUs of one model replica: tensor x context x pipeline degrees."""
        return self.model_parallel_degree * self.context_parallel_degree * self.pipeline_parallel_degree

    @property
    def partitioned(self) -> frozenset[str]:
        return partitioned_states(self.strategy)

    @property
    def uses_nvme(self) -> bool:
        """Any state on NVMe, recompute inputs included (`Placement.uses_nvme`)."""
        return self.placement.uses_nvme

    @property
    def tokens_per_iteration(self) -> float:
        return self.micro_batch_per_gpu * self.num_gpus * self.model.seq_len * self.micro_batches_per_step

    # -- documents -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "schema": SCHEMA,
            "model": self.model.to_dict(),
            "hardware": self.node.to_dict(),
            "num_gpus": self.num_gpus,
            "num_nodes": self.num_nodes,
            "strategy": self.strategy,
            "placement": self.placement.to_dict(),
            "micro_batch_per_gpu": self.micro_batch_per_gpu,
            "recompute_interval": self.recompute_interval,
            "tiling_factor": self.tiling_factor,
            "prefetch_depth": self.prefetch_depth,
            "model_parallel_degree": self.model_parallel_degree,
            "pipeline_parallel_degree": self.pipeline_parallel_degree,
            "pipeline_virtual_stages": self.pipeline_virtual_stages,
            "micro_batches_per_step": self.micro_batches_per_step,
            "precision": self.precision,
            "fp8_matmuls": self.fp8_matmuls,
            "nvme_path": self.nvme_path,
            "optimizer_chunk_bytes": self.optimizer_chunk_bytes,
            "num_optimizer_buffers": self.num_optimizer_buffers,
            "nvme_block_bytes": self.nvme_block_bytes,
            "optimizer_step": self.optimizer_step,
            "attention": self.attention,
            "recompute": self.recompute,
        }
        if self.recompute == "every_nth_block":  # the period is read only with this kind
            doc["recompute_block_period"] = self.recompute_block_period
        if self.context_parallel_degree > 1:  # plans without it are written as before
            doc["context_parallel_degree"] = self.context_parallel_degree
        if self.fp8_matmuls and self.fp8_recipe is not Fp8Recipe.TE_DELAYED:  # other plans are written as before
            doc["fp8_recipe"] = self.fp8_recipe.value
        if self.context_parallel_degree > 1 and self.kv_exchange is not KvExchange.RING:
            doc["kv_exchange"] = self.kv_exchange.value
        if self.shard_collectives is not ShardCollectives.FLAT:  # plans with flat gathers are written as before
            doc["shard_collectives"] = self.shard_collectives.value
        if self.sequence_parallel:  # plans without it are written as before
            doc["sequence_parallel"] = True
        if self.host_pinning is not HostPinning.STAGED:  # plans that stage are written as before
            doc["host_pinning"] = self.host_pinning.value
        if self.host_param_shard is not HostParamShard.COMPUTE_COPY:  # plans with a 16-bit copy are written as before
            doc["host_param_shard"] = self.host_param_shard.value
        if self.optimizer_step_reason:  # plans nobody chose a schedule for are written as before
            doc["optimizer_step_reason"] = self.optimizer_step_reason
        if self.prediction is not None:
            doc["prediction"] = self.prediction.to_dict()
        return doc

    @classmethod
    def from_dict(cls, doc: dict[str, Any], where: str = "plan") -> Plan:
        doc = renamed_keys(doc, OLD_PLAN_KEYS, where)
        scalar = {"num_gpus", "strategy", "micro_batch_per_gpu", "recompute_interval", "tiling_factor",
                  "prefetch_depth", "model_parallel_degree", "precision", "nvme_path", "optimizer_chunk_bytes",
                  "num_optimizer_buffers", "nvme_block_bytes", "optimizer_step", "pipeline_parallel_degree",
                  "pipeline_virtual_stages", "micro_batches_per_step", "fp8_matmuls", "attention", "recompute",
                  "context_parallel_degree", "host_pinning", "host_param_shard", "optimizer_step_reason", "fp8_recipe", "kv_exchange",
                  "sequence_parallel", "shard_collectives", "recompute_block_period"}
        check_keys(doc, scalar | {"schema", "model", "hardware", "placement", "num_nodes", "prediction"}, where)
        if doc.get("schema", SCHEMA) != SCHEMA:
            raise PlannerError(f"{where}: schema {doc.get('schema')!r} is not {SCHEMA!r}")
        for key in ("model", "hardware", "num_gpus"):
            if key not in doc:
                raise PlannerError(f"{where}: missing required key {key!r}")
        # Only nvme_path may be null; any other null reaches its validator and is refused there.
        kwargs: dict[str, Any] = {k: doc[k] for k in scalar if k in doc}
        for key in ("num_gpus", "recompute_interval", "tiling_factor", "prefetch_depth", "model_parallel_degree",
                    "optimizer_chunk_bytes", "num_optimizer_buffers", "nvme_block_bytes", "pipeline_parallel_degree",
                    "pipeline_virtual_stages", "micro_batches_per_step", "context_parallel_degree",
                    "recompute_block_period"):
            if key in kwargs:
                kwargs[key] = number(kwargs[key], f"{where}.{key}", minimum=0, integer=True)
        kwargs["model"] = ModelSpec.from_dict(doc["model"], f"{where}.model")
        kwargs["node"] = NodeSpec.from_dict(doc["hardware"], f"{where}.hardware")
        if "placement" in doc:
            kwargs["placement"] = Placement.from_dict(doc["placement"], f"{where}.placement")
        if doc.get("prediction") is not None:
            kwargs["prediction"] = Prediction.from_dict(doc["prediction"], f"{where}.prediction")
        plan = cls(**kwargs)
        if "num_nodes" in doc and doc["num_nodes"] != plan.num_nodes:
            raise PlannerError(f"{where}.num_nodes {doc['num_nodes']!r} does not match num_gpus, which gives {plan.num_nodes}")
        return plan

    def replace(self, **changes: Any) -> Plan:
        """A copy with `changes`; `recompute` is derived again from a new `recompute_interval`
        unless it stays 0 under a kind without segments or is changed too, and `attention` from a new node's kernel unless
        it is changed too or the new node has the same. Changes only to fields that no other field's
        check reads (`_OWN_CHECKS`: what the search varies per candidate) run just their own checks:
        the rest of the plan was checked when it was made and derives nothing from them."""
        if changes.keys() <= _OWN_CHECKS.keys():
            if changes.get("optimizer_step", self.optimizer_step) != self.optimizer_step:
                changes.setdefault("optimizer_step_reason", "")  # the reason was for the other schedule
            plan = object.__new__(Plan)
            vars(plan).update(vars(self), **changes)  # the fields, and `cluster` where made (it reads none of these)
            for name in changes:
                _OWN_CHECKS[name](plan)
            return plan
        doc = {name: getattr(self, name) for name in _plan_fields()}
        if "recompute_interval" in changes and "recompute" not in changes and not (
                self.recompute in SEGMENTLESS_RECOMPUTES and changes["recompute_interval"] == 0):
            doc["recompute"] = ""
        if "node" in changes and "attention" not in changes and bool(changes["node"].flash_attention_flops_per_s) != bool(
                self.node.flash_attention_flops_per_s):
            doc["attention"] = ""
        if changes.get("optimizer_step", self.optimizer_step) != self.optimizer_step and "optimizer_step_reason" not in changes:
            doc["optimizer_step_reason"] = ""  # the reason was for the other schedule
        doc.update(changes)
        return Plan(**doc)

    def save(self, path: str | Path) -> None:
        """Write atomically: a crash mid-write never leaves a half plan behind."""
        write_json_atomic(path, self.to_dict(), "plan")


def _check_batch_number(plan: Plan) -> None:
    number(plan.micro_batch_per_gpu, "micro_batch_per_gpu", exclusive_minimum=0, maximum=1_000_000)


def _check_whole_samples(plan: Plan) -> None:
    """The micro-batch is whole samples per model replica (the parallel degrees already checked)."""
    mp, cp, pp = plan.model_parallel_degree, plan.context_parallel_degree, plan.pipeline_parallel_degree
    per_replica_batch = plan.micro_batch_per_gpu * mp * cp * pp
    if abs(per_replica_batch - round(per_replica_batch)) > 1e-9:
        across = (f"model_parallel_degree {mp}" + (f" x context_parallel_degree {cp}" if cp > 1 else "")
                  + (f" x pipeline_parallel_degree {pp}" if pp > 1 else ""))
        raise PlannerError(
            f"micro_batch_per_gpu {plan.micro_batch_per_gpu} x {across} must be a whole number of "
            "samples per model replica"
        )


def _check_tiling_factor(plan: Plan) -> None:
    number(plan.tiling_factor, "tiling_factor", minimum=1, maximum=MAX_TILING_FACTOR, integer=True)


def _check_shard_collectives(plan: Plan) -> None:
    _as_member(plan, "shard_collectives", ShardCollectives)
    if plan.shard_collectives is ShardCollectives.PER_PARAMETER and plan.prefetch_depth != 0:
        raise PlannerError(f"shard_collectives per_parameter synchronizes the device before every gather, so nothing "
                           f"is fetched ahead: use prefetch_depth 0, not {plan.prefetch_depth}")


def _check_prefetch_depth(plan: Plan) -> None:
    number(plan.prefetch_depth, "prefetch_depth", minimum=0, maximum=64, integer=True)


def _check_step_name(plan: Plan) -> None:
    string(plan.optimizer_step, "optimizer_step", choices=OPTIMIZER_STEPS)


def _check_step_precision(plan: Plan) -> None:
    if plan.optimizer_step == "in_backward" and plan.precision == "fp16":
        raise PlannerError("optimizer_step in_backward cannot run with precision fp16: the loss scaler must see "
                           "every gradient before any update; use bf16 or fp32, or optimizer_step after_backward")


def _check_step_accumulation(plan: Plan) -> None:
    if plan.optimizer_step == "in_backward" and plan.micro_batches_per_step > 1:
        raise PlannerError(f"optimizer_step in_backward cannot accumulate {plan.micro_batches_per_step} micro-batches "
                           "per step: it updates each unit as soon as one backward has its gradient; use "
                           "micro_batches_per_step 1 or optimizer_step after_backward")


def _check_step_reason(plan: Plan) -> None:
    string(plan.optimizer_step_reason, "optimizer_step_reason", max_len=1024)


def _as_member(plan: Plan, name: str, kind: type[Enum]) -> None:
    """Field `name` of `plan` as a member of the enum `kind`, from its value (one of the members'
    values, else a PlannerError naming the field and the choices). A member is valid as it is: the
    search sets members on every candidate."""
    value = getattr(plan, name)
    if type(value) is not kind:
        object.__setattr__(plan, name, kind(string(value, name, choices=tuple(kind))))


def _check_host_pinning(plan: Plan) -> None:
    _as_member(plan, "host_pinning", HostPinning)


def _check_host_param_shard(plan: Plan) -> None:
    _as_member(plan, "host_param_shard", HostParamShard)
    if plan.host_param_shard is HostParamShard.MASTER and not master_may_be_param_shard(plan):
        raise PlannerError(f"host_param_shard master needs precision bf16 or fp16 with params and optimizer_states both "
                           f"in cpu memory, not precision {plan.precision} with {plan.placement.label()}; use "
                           "host_param_shard compute_copy")


def master_may_be_param_shard(plan: Plan) -> bool:
    """Whether `plan` may read its fp32 master as its parameter shard (`HostParamShard.MASTER`): mixed
    precision, parameters and optimizer states both in host memory."""
    place = plan.placement
    return plan.precision != "fp32" and place.params == place.optimizer_states and place.params.host_memory


def master_is_param_shard(plan: Plan) -> bool:
    """Whether the parameter shard is the fp32 master itself, so that no separate master exists and
    the update writes no copy: fp32 params and optimizer states in one tier, or a mixed-precision
    plan with `host_param_shard: master`."""
    place = plan.placement
    if plan.precision == "fp32":
        return place.params == place.optimizer_states
    return plan.host_param_shard is HostParamShard.MASTER


_OWN_CHECKS: dict[str, Callable[[Plan], None]] = {
    "micro_batch_per_gpu": lambda plan: (_check_batch_number(plan), _check_whole_samples(plan)),
    "tiling_factor": _check_tiling_factor,
    "prefetch_depth": lambda plan: (_check_prefetch_depth(plan), _check_shard_collectives(plan)),
    "host_pinning": _check_host_pinning,
    "host_param_shard": _check_host_param_shard,
    "optimizer_step_reason": _check_step_reason,
    "optimizer_step": lambda plan: (_check_step_name(plan), _check_step_precision(plan), _check_step_accumulation(plan)),
    "prediction": lambda plan: None,
}
"""Fields whose checks read no field but themselves and the fixed layout (the parallel degrees, the
precision, the micro-batches per step; prefetch depth's also reads `shard_collectives`, which no derived
field depends on), and which no check of another field, nor `__post_init__`'s derived fields (the node's
share and precision, the kernels), reads: `Plan.replace` changing only these runs only these."""


@cache
def _plan_fields() -> tuple[str, ...]:
    """`Plan`'s field names, once (`replace` runs for every candidate the search prices)."""
    return tuple(f.name for f in fields(Plan))


def _check_pipeline(plan: Plan) -> None:
    """A pipelined plan: whole stages of whole nodes (or within one), every state on the GPUs."""
    mp, pp, gpus = plan.model_parallel_degree, plan.pipeline_parallel_degree, plan.num_gpus
    if gpus % (mp * pp):
        raise PlannerError(f"model_parallel_degree {mp} x pipeline_parallel_degree {pp} does not divide num_gpus {gpus}")
    stage_gpus, per_node = gpus // pp, plan.node.num_gpus_per_node
    if stage_gpus > per_node and stage_gpus % per_node:
        raise PlannerError(f"pipeline stages of {stage_gpus} GPUs (num_gpus {gpus} / pipeline_parallel_degree {pp}) "
                           f"are not whole {per_node}-GPU nodes; choose a degree that gives whole nodes per stage")
    if plan.placement != Placement():
        raise PlannerError(f"pipeline_parallel_degree {pp} keeps every state on the GPUs (the planner pipelines no "
                           f"offload), not {plan.placement.label()}; use pipeline_parallel_degree 1 to offload")


def load_plan(path: str | Path) -> Plan:
    return Plan.from_dict(load_document(path, "plan"), f"plan {path}")
