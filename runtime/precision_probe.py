"""The compute probe in every precision a plan may use: a transformer block's four linears, forward
and forward + backward, timed as the runtime runs them (`F.linear` on weights in the compute dtype,
runtime/gpt.py), on the device the plan trains on.

What is timed (`LinearPass`) is apart from how (`PassTimer`): `torch_pass_timer` times real passes,
a test hands in its own timer, and `measure_precisions` turns the seconds into rates
(`planner.specs.precision.PrecisionRates`) the same way for both.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from planner.specs.precision import PRECISIONS, REFERENCE_PRECISION, PrecisionRates


def block_matmul_shapes(hidden: int) -> list[tuple[int, int]]:
    """(in, out) of a transformer block's four linears (docs/method.md eq. 1: 12 hd^2 params)."""
    return [(hidden, 3 * hidden), (hidden, hidden), (hidden, 4 * hidden), (4 * hidden, hidden)]


@dataclass(frozen=True, slots=True)
class LinearPass:
    """One pass over a block's four linears at `rows` tokens, forward only or forward and backward."""

    precision: str
    hidden: int
    rows: int
    backward: bool

    @property
    def forward_flops(self) -> float:
        return sum(2 * self.rows * fan_in * fan_out for fan_in, fan_out in block_matmul_shapes(self.hidden))


PassTimer = Callable[[LinearPass], float]
"""Seconds one `LinearPass` takes (the median of a few, after a warm-up)."""

SCREEN_HIDDEN, SCREEN_ROWS = 256, 64
"""The screen's block ([Note: screening the precisions]): small enough that an emulated bf16
backward takes a quarter of a second on a 2-core CPU."""
SCREEN_DROP_BELOW = 0.25
"""A precision screened below this share of the best screened training rate is not measured in full."""
SCREEN_ROUNDS = 3


@dataclass(frozen=True, slots=True)
class PrecisionMeasurement:
    rates: dict[str, PrecisionRates]
    """Precision -> its rates, every precision asked for."""
    fastest: str
    """The precision whose training rate is the highest: the spec's `compute_precision`."""
    hidden: int
    rows: int
    screened_only: tuple[str, ...] = ()
    """Precisions whose rates are the screen's, scaled ([Note: screening the precisions])."""


FULL_ROUNDS = 3
"""Rounds of the full measurement: a forward pass then a forward + backward pass each; the rates are
the medians over rounds of the forward and of the difference, so that both halves of a round meet
the same load ([Note: screening the precisions])."""


def _rates(time_pass: PassTimer, precision: str, hidden: int, rows: int) -> PrecisionRates:
    forward, both = LinearPass(precision, hidden, rows, backward=False), LinearPass(precision, hidden, rows, backward=True)
    rounds = [(time_pass(forward), time_pass(both)) for _ in range(FULL_ROUNDS)]
    forward_s = statistics.median(f for f, _ in rounds)
    return _rates_of(forward, forward_s, forward_s + statistics.median(b - f for f, b in rounds))


def _rates_of(forward: LinearPass, forward_s: float, both_s: float) -> PrecisionRates:
    # The backward is the difference; on a noisy machine it is held to at most 4x the forward's rate.
    backward_s = max(both_s - forward_s, forward_s / 2)
    return PrecisionRates(forward.forward_flops / forward_s, 2 * forward.forward_flops / backward_s)


def _screen(time_pass: PassTimer, precisions: tuple[str, ...]) -> dict[str, PrecisionRates]:
    """Each precision at the screen's block: the fastest of `SCREEN_ROUNDS` rounds, the precisions
    taking turns within each ([Note: screening the precisions])."""
    best: dict[tuple[str, bool], float] = {}
    for _ in range(SCREEN_ROUNDS):
        for p in precisions:
            for backward in (False, True):
                seconds = time_pass(LinearPass(p, SCREEN_HIDDEN, SCREEN_ROWS, backward))
                best[p, backward] = min(seconds, best.get((p, backward), seconds))
    return {p: _rates_of(LinearPass(p, SCREEN_HIDDEN, SCREEN_ROWS, False), best[p, False], best[p, True])
            for p in precisions}


# [Note: screening the precisions]
# On a CPU each precision is first timed at the screen's small block (`SCREEN_HIDDEN`,
# `SCREEN_ROWS`), and only those within `SCREEN_DROP_BELOW` of the best are measured at full size.
# A CPU without bf16/fp16 instructions emulates them, a block's backward many times slower than
# fp32's, and measuring that at full size alone would take minutes of a probe meant to take seconds
# (docs/notes/2026-11-25-calibration-bf16-emulation.md). The screen takes each precision's fastest
# of a few rounds, the precisions taking turns: on a machine shared with other work a pass this
# small runs anywhere from its own speed to many times slower (every precision then screened alike,
# and the emulated ones went on to minutes of full measurement:
# docs/notes/2026-11-28-local-hardware-precisions.md), and the fastest of a few is what the
# precision itself runs at. On a CPU the screen runs on one thread:
# whether a type is emulated is a property of each core's instructions, and a pass this small on
# several threads waits at every barrier for the slowest, which on a busy machine made fp32 (whose
# kernels split across threads) screen slower than emulated bf16 (whose did not). A screened precision's rates are the
# screen's scaled by how much faster the best precision ran at full size than at the screen's size:
# the ratio to the best, not the small block's absolute rate, which is mostly per-call overhead.
# A GPU runs every precision natively at a block of the probe's size, so it measures all in full.
def measure_precisions(time_pass: PassTimer, *, hidden: int, rows: int, precisions: tuple[str, ...] = PRECISIONS,
                       screen: bool = True, screen_pass: PassTimer | None = None) -> PrecisionMeasurement:
    """Each precision's forward and backward matmul rates at a block of `hidden` x `rows` tokens;
    `screen_pass` (default `time_pass`) times the screen's passes, one each."""
    measure = set(precisions)
    screened: dict[str, PrecisionRates] = {}
    if screen and len(precisions) > 1:
        screened = _screen(screen_pass or time_pass, precisions)
        best = max(screened.values(), key=lambda r: r.training_flops_per_s).training_flops_per_s
        measure = {p for p in precisions if screened[p].training_flops_per_s >= SCREEN_DROP_BELOW * best}
    full = {p: _rates(time_pass, p, hidden, rows) for p in precisions if p in measure}
    fastest = max(full, key=lambda p: (full[p].training_flops_per_s, p == REFERENCE_PRECISION))
    rates = dict(full)
    for p in precisions:
        if p not in full:
            rates[p] = PrecisionRates(
                screened[p].matmul_flops_per_s * full[fastest].matmul_flops_per_s / screened[fastest].matmul_flops_per_s,
                screened[p].backward_matmul_flops_per_s * full[fastest].backward_matmul_flops_per_s
                / screened[fastest].backward_matmul_flops_per_s)
    return PrecisionMeasurement(rates, fastest, hidden, rows, tuple(p for p in precisions if p not in full))


def median_time_s(run: Callable[[], None], *, repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def torch_pass_timer(device, *, repeats: int = 1, threads: int = 0) -> PassTimer:  # noqa: ANN001 - torch.device
    """Times passes with torch on `device`: operands made on the device itself (at GPU shapes they
    are GiBs, too slow to build on the host), weights in the compute dtype as the runtime holds them;
    on `threads` CPU threads where nonzero (torch's own number otherwise)."""
    import torch
    import torch.nn.functional as F

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

    def time_pass(p: LinearPass) -> float:
        dtype, shapes = dtypes[p.precision], block_matmul_shapes(p.hidden)
        weights = [torch.randn(fan_out, fan_in, device=device, dtype=dtype, requires_grad=p.backward)
                   for fan_in, fan_out in shapes]
        inputs = [torch.randn(p.rows, fan_in, device=device, dtype=dtype, requires_grad=p.backward)
                  for fan_in, _ in shapes]
        grads = [torch.randn(p.rows, fan_out, device=device, dtype=dtype) for _, fan_out in shapes]

        def run() -> None:
            for x, w, g in zip(inputs, weights, grads, strict=True):
                y = F.linear(x, w)
                if p.backward:
                    x.grad = w.grad = None
                    y.backward(g)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        if not threads:
            return median_time_s(run, repeats=repeats)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return median_time_s(run, repeats=repeats)
        finally:
            torch.set_num_threads(before)

    return time_pass
