"""Compute precisions: what a plan computes in, and how fast a device computes in each.

A GPU runs bf16 and fp16 at its tensor cores' rate and fp32 far slower; a CPU runs fp32 at its
vector units' rate and, without bf16/fp16 instructions (AVX-512 BF16, AMX), emulates the 16-bit
types far slower still (docs/notes/2026-11-28-local-hardware-precisions.md). So a hardware spec
measured by `planner probe` holds a compute rate per precision (`PrecisionRates`), and a plan is
priced at the rates of its own precision ([Note: a plan's precision prices its compute] in
planner/specs/hardware.py). Presets state one rate, the published one, for every precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from planner.specs.errors import PlannerError
from planner.specs.specio import MAX_MAGNITUDE, check_keys, number
from planner.specs.units import TFLOP

PRECISIONS: tuple[str, ...] = ("bf16", "fp16", "fp32")
"""The compute precisions a plan may use (`Plan.precision`)."""
DEFAULT_PRECISION = "bf16"
"""What a plan computes in unless the user or the hardware says otherwise (mixed precision, the
paper's setting)."""
REFERENCE_PRECISION = "fp32"
"""The precision every device runs natively: emulation is judged against it."""
EMULATED_BELOW = 0.5
"""A 16-bit precision whose training rate is below this share of fp32's is emulated: no hardware
that runs it natively is slower than fp32 at it, while an emulating CPU is several times slower
(measurements: docs/notes/2026-11-28-local-hardware-precisions.md)."""

_DOC_KEYS: tuple[tuple[str, str], ...] = (
    ("matmul_flops_per_s", "matmul_tflops"),
    ("backward_matmul_flops_per_s", "backward_matmul_tflops"),
)


@dataclass(frozen=True, slots=True)
class PrecisionRates:
    """A device's measured matmul rates in one precision (flop/s): a block's four linears forward,
    and their backward (input and weight gradients, twice the forward's flops)."""

    matmul_flops_per_s: float
    backward_matmul_flops_per_s: float

    def __post_init__(self) -> None:
        for attr, key in _DOC_KEYS:
            number(getattr(self, attr) / TFLOP, key, exclusive_minimum=0, maximum=MAX_MAGNITUDE)

    @property
    def training_flops_per_s(self) -> float:
        """The rate of a training step's matmuls: one forward flop for every two backward flops."""
        return 3 / (1 / self.matmul_flops_per_s + 2 / self.backward_matmul_flops_per_s)

    def to_dict(self) -> dict[str, float]:
        return {key: getattr(self, attr) / TFLOP for attr, key in _DOC_KEYS}

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> PrecisionRates:
        check_keys(doc, {key for _, key in _DOC_KEYS}, where)
        missing = [key for _, key in _DOC_KEYS if key not in doc]
        if missing:
            raise PlannerError(f"{where}: missing key(s) {', '.join(missing)}")
        return cls(**{attr: number(doc[key], f"{where}.{key}", exclusive_minimum=0, maximum=MAX_MAGNITUDE) * TFLOP
                      for attr, key in _DOC_KEYS})


def emulation_slowdown(rates: dict[str, PrecisionRates], precision: str) -> float:
    """How many times slower than fp32 `precision` trains where it is emulated ([Note: emulated
    precisions]); 0 where it is not, or where `rates` do not say (presets)."""
    if precision == REFERENCE_PRECISION or precision not in rates or REFERENCE_PRECISION not in rates:
        return 0.0
    ratio = rates[precision].training_flops_per_s / rates[REFERENCE_PRECISION].training_flops_per_s
    return 1 / ratio if ratio < EMULATED_BELOW else 0.0


@dataclass(frozen=True, slots=True)
class PrecisionChoice:
    """The precision a plan is made in, and the one line that says why when the hardware decided."""

    precision: str
    note: str = ""


# [Note: emulated precisions]
# A precision the hardware emulates is never what the user meant by leaving the precision to the
# planner: a plan in it would train many times slower than the same plan in fp32 (bf16 on a CPU
# without AVX-512 BF16: docs/notes/2026-11-28-local-hardware-precisions.md). So where the user did not pin
# one, a plan whose default precision is emulated is made in fp32, and the line says so; a pinned
# emulated precision is kept and priced at its measured rate, and the line proposes fp32.
def choose_precision(rates: dict[str, PrecisionRates], hardware: str, pinned: str | None) -> PrecisionChoice:
    """The plan's precision: `pinned` if given, else the default unless the hardware emulates it."""
    precision = pinned or DEFAULT_PRECISION
    slowdown = emulation_slowdown(rates, precision)
    if not slowdown:
        return PrecisionChoice(precision)
    said = f"{precision} is emulated on {hardware} (its matmuls train {slowdown:.0f}x slower than in fp32)"
    if pinned:
        return PrecisionChoice(precision, f"note: {said}; --precision fp32 trains faster")
    return PrecisionChoice(REFERENCE_PRECISION, f"note: {said}: planning in fp32 (--precision {precision} keeps it)")
