"""The corpus of published training runs (data/validation/published_runs.csv), read strictly.

Every column is parsed and checked; a malformed file is refused with one `PlannerError` line naming
the file, the row, the column and the value. No row is dropped: a row the planner cannot express is
still a row (planner/validation/configure.py gives it a reason). The file's README (beside it)
defines the columns; the field names below keep the CSV's names, which already carry their units
(`gpu_memory_gb`, `params_b` in billions, `measured_tokens_per_s_per_gpu`, `measured_mfu` a fraction).
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.stack import ShardCollectives
from planner.specs.tiers import TIERS, Tier

CORPUS_FILE = "published_runs.csv"
SHARDINGS: tuple[str, ...] = ("", "none", "zero1", "zero2", "zero3", "fsdp")
NO_OFFLOAD = "none"
OFFLOADS: tuple[str, ...] = (NO_OFFLOAD, "cpu", "nvme")
"""The `offload` column: none, or the tier the optimizer states (and maybe the parameters) went to."""
RECOMPUTES: tuple[str, ...] = ("", "none", "full", "selective", "every_nth_block", "op_level")
"""The `activation_recompute` column: a plan's recompute kind (planner/cost/kernels.py [Note: recompute]),
empty when unstated; `every_nth_block` rows state their `recompute_block_period`."""
ATTENTIONS: tuple[str, ...] = ("", "eager", "flash", "flash2")
"""The `attention` column: the attention kernel the run used (eager: the scores materialised in HBM;
flash: a fused kernel that never stores them; flash2: the row states FlashAttention-2's kernel),
empty when the source does not say."""
SHARD_COLLECTIVES: tuple[str, ...] = ("", *(grouping.value for grouping in ShardCollectives))
"""The `shard_collectives` column: how the run's ZeRO-3 grouped parameters into collectives (flat units,
or one per parameter: planner/cost/collectives.py [Note: per-parameter collectives]), empty when the
row does not say (planner/validation/configure.py gives its source's default)."""
OPTIONAL_COLUMNS: dict[str, str] = {"attention": "", "shard_collectives": "", "recompute_block_period": ""}
"""Columns a corpus may leave out of its header (the value every row then gets): a corpus written
before the column existed still loads."""
GPU_TYPES: tuple[str, ...] = ("V100", "A100", "H100", "H200", "RTX 4090")
"""Families the free-text `gpu_type` must start with ("H100 (SXM, DGX-H100)" is an H100)."""
_MAX_COUNT = 10_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class CorpusRow:
    """One measured configuration; None where the source does not state the value."""

    row_id: str
    source_id: str
    citation: str
    model_name: str
    num_layers: int | None
    hidden_size: int | None
    num_heads: int | None
    ffn_hidden_size: int | None
    seq_len: int | None
    """Tokens per sequence."""
    vocab_size: int | None
    params_b: float | None
    """Parameters in billions, as the source counts them."""
    gpu_type: str
    """Free text as the source names the part; `gpu_family` is its parsed family."""
    gpu_family: str
    gpu_memory_gb: float | None
    num_gpus: int
    gpus_per_node: int | None
    tensor_parallel: int | None
    pipeline_parallel: int | None
    data_parallel: int | None
    sharding: str
    """One of SHARDINGS; empty when unstated."""
    offload: str
    params_on: str
    optimizer_on: str
    micro_batch: int | None
    """Sequences per model replica per micro-step."""
    global_batch: int | None
    """Sequences per optimizer step."""
    activation_recompute: str
    recompute_block_period: int | None
    """`N` of an `every_nth_block` row (torchtitan's `selective_ac_option`); None for the other kinds."""
    attention: str
    """One of ATTENTIONS; empty when unstated (planner/validation/configure.py gives the default)."""
    shard_collectives: str
    """One of SHARD_COLLECTIVES; empty when unstated (planner/validation/configure.py gives the default)."""
    precision: str
    measured_tflops_per_gpu: float | None
    measured_mfu: float | None
    """Fraction of the peak (0.43 = 43 %)."""
    measured_tokens_per_s_per_gpu: float | None
    flops_accounting_note: str
    notes: str

    @property
    def is_offload(self) -> bool:
        """CPU/NVMe offload rows are checks, not calibration (docs/validation.md)."""
        return self.offload != NO_OFFLOAD

    @property
    def offload_tier(self) -> Tier | None:
        """The tier the row offloads to (`offload`), None without offload."""
        return TIERS.named(self.offload, f"row {self.row_id} offload") if self.is_offload else None

    @property
    def params_offloaded(self) -> bool:
        """The free-text `params_on` names a tier off the GPU ("cpu", "nvme (ZeRO-Infinity)")."""
        return self.params_on.startswith(tuple(tier for tier in TIERS if not tier.on_device))


_INT_COLUMNS = ("num_layers", "hidden_size", "num_heads", "ffn_hidden_size", "seq_len", "vocab_size", "num_gpus",
                "gpus_per_node", "tensor_parallel", "pipeline_parallel", "data_parallel", "micro_batch", "global_batch",
                "recompute_block_period")
_FLOAT_COLUMNS = ("params_b", "gpu_memory_gb", "measured_tflops_per_gpu", "measured_mfu", "measured_tokens_per_s_per_gpu")
_CHOICES = {"sharding": SHARDINGS, "offload": OFFLOADS, "activation_recompute": RECOMPUTES, "attention": ATTENTIONS,
            "shard_collectives": SHARD_COLLECTIVES}
_REQUIRED = ("row_id", "source_id", "gpu_type", "num_gpus", "offload")
MEASURED = ("measured_tflops_per_gpu", "measured_mfu", "measured_tokens_per_s_per_gpu")
COLUMNS: tuple[str, ...] = tuple(f.name for f in fields(CorpusRow) if f.name != "gpu_family")


def default_corpus_path() -> Any:
    """The bundled corpus: data/validation/ in a checkout, planner/_data/validation in a wheel."""
    from planner.specs.catalog import _data_root

    return _data_root() / "validation" / CORPUS_FILE


def load_corpus(path: str | Path | None = None) -> tuple[CorpusRow, ...]:
    """Every row of the corpus at `path` (default: the bundled one), in file order."""
    source = default_corpus_path() if path is None else Path(path)
    try:
        text = source.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"cannot read corpus {source}: {exc}; give a CSV file with --corpus") from None
    reader = csv.DictReader(text.splitlines())
    header = reader.fieldnames or []
    missing = [c for c in COLUMNS if c not in header and c not in OPTIONAL_COLUMNS]
    if missing:
        raise PlannerError(f"corpus {source}: missing column(s) {', '.join(missing)}; see data/validation/README.md")
    rows, seen = [], set()
    for line, raw in enumerate(reader, start=2):
        if None in raw or any(v is None for v in raw.values()):  # more cells, or fewer, than the header
            raise PlannerError(f"corpus {source}: line {line} has {len(header)} columns expected, not the header's count")
        row = _parse_row(raw, f"corpus {source}: row {raw.get('row_id') or f'at line {line}'}")
        if row.row_id in seen:
            raise PlannerError(f"corpus {source}: row {row.row_id} column row_id: {row.row_id!r} appears twice")
        seen.add(row.row_id)
        rows.append(row)
    if not rows:
        raise PlannerError(f"corpus {source} holds no rows")
    return tuple(rows)


def _parse_row(raw: dict[str, str], where: str) -> CorpusRow:
    values: dict[str, Any] = {c: raw.get(c, OPTIONAL_COLUMNS.get(c, "")).strip() for c in COLUMNS}
    for column in _REQUIRED:
        if not values[column]:
            raise PlannerError(f"{where} column {column}: empty; every row needs it")
    for column in _INT_COLUMNS:
        values[column] = _integer(values[column], f"{where} column {column}")
    for column in _FLOAT_COLUMNS:
        values[column] = _positive(values[column], f"{where} column {column}")
    for column, choices in _CHOICES.items():
        if values[column] not in choices:
            raise PlannerError(f"{where} column {column}: {values[column]!r} is not one of {', '.join(c or '(empty)' for c in choices)}")
    if (values["recompute_block_period"] is None) == (values["activation_recompute"] == "every_nth_block"):
        raise PlannerError(f"{where} column recompute_block_period: {values['recompute_block_period']!r}; state it "
                           "(N: every N-th block recomputed) exactly when activation_recompute is every_nth_block")
    if values["measured_mfu"] is not None and values["measured_mfu"] > 1:
        raise PlannerError(f"{where} column measured_mfu: {values['measured_mfu']!r} is a fraction, at most 1")
    if all(values[m] is None for m in MEASURED):
        raise PlannerError(f"{where} column {MEASURED[0]}: every measured column is empty; a row needs one")
    values["gpu_family"] = gpu_family(values["gpu_type"], f"{where} column gpu_type")
    return CorpusRow(**values)


def gpu_family(text: str, where: str = "gpu type") -> str:
    """`"H100 (SXM, DGX-H100)"` -> "H100"; an unknown part is refused."""
    for family in GPU_TYPES:
        if text == family or text.startswith(family + " "):
            return family
    raise PlannerError(f"{where}: {text!r} is not a known GPU type; start it with one of {', '.join(GPU_TYPES)}")


def _integer(text: str, where: str) -> int | None:
    return _number(text, where, integer=True)


def _positive(text: str, where: str) -> float | None:
    return _number(text, where, integer=False)


def _number(text: str, where: str, *, integer: bool) -> float | None:
    """An empty cell is None; a count is a whole number from 1 to _MAX_COUNT, a measurement finite and > 0."""
    if not text:
        return None
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise PlannerError(f"{where}: {text!r} is not a {'whole number' if integer else 'number'}") from None
    if integer and not 1 <= value <= _MAX_COUNT:
        raise PlannerError(f"{where}: {text!r} must be between 1 and {_MAX_COUNT:,}")
    if not integer and (not math.isfinite(value) or value <= 0):
        raise PlannerError(f"{where}: {text!r} must be a finite number greater than 0")
    return value
