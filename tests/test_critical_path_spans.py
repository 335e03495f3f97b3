"""The critical path's interval arithmetic (planner/output/critical_path.py) gives, to the bit, what
one sweep over both span lists gives, on random busy and idle spans of every length."""

from __future__ import annotations

import random

import pytest

from planner.output.critical_path import _clipped, _complement, _merged, _overlap


def merged_reference(spans):
    out = []
    for start, end, *_ in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def overlap_reference(a, b):
    """One sweep over both merged lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def random_spans(rng: random.Random, count: int, total_s: float) -> list[tuple[float, float, str]]:
    """Spans with shared ends, touching neighbours, empty and overlapping ones, as timelines have."""
    grid = sorted(rng.uniform(0.0, total_s) for _ in range(max(2, count)))
    spans = []
    for _ in range(count):
        start = rng.choice(grid) if rng.random() < 0.3 else rng.uniform(0.0, total_s)
        length = 0.0 if rng.random() < 0.05 else rng.expovariate(count / total_s)
        spans.append((start, start + length, rng.choice("abc")))
    return spans


@pytest.mark.parametrize("seed", range(40))
def test_merged_and_overlap_equal_the_sweep(seed):
    rng = random.Random(seed)
    total_s = rng.choice((1.0, 490.0, 3.7e3))
    busy = random_spans(rng, rng.choice((0, 1, 5, 300, 3000)), total_s)
    compute = random_spans(rng, rng.choice((0, 1, 20, 2000)), total_s)
    assert _merged(busy) == merged_reference(busy)
    assert _merged(compute) == merged_reference(compute)
    idle = _complement(_merged(compute), 0.0, total_s)
    end = rng.uniform(0.0, total_s)
    merged_busy = _merged(busy)
    for other in (idle, _clipped(idle, 0.0, end), _clipped(idle, end, total_s), merged_busy):
        assert _overlap(merged_busy, other) == overlap_reference(merged_busy, other)
        assert _overlap(other, merged_busy) == overlap_reference(other, merged_busy)
