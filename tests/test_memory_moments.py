"""The bill's worst-moment walk over distinct moments equals the walk over the whole trace
(planner/cost/coexisting.py [Note: a walk of distinct moments]), to the bit, on many layouts."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.cost.coexisting import (
    KEPT_REPEATS,
    TraceShape,
    TraceUnit,
    Window,
    buffer_maxima,
    representative_trace,
)
from planner.specs.catalog import resolve_model
from planner.specs.memory_terms import MemoryTerm
from planner.specs.model import ModelSpec

PER_OPERATOR_TERMS = (MemoryTerm.MSWM, MemoryTerm.PREFETCH_GATHERED_PARAMS, MemoryTerm.PREFETCH_SHARD_STAGING,
                      MemoryTerm.REDUCE_SCATTER_BUFFER, MemoryTerm.GRADIENT_OFFLOAD_STAGING)

MODELS = (
    resolve_model("1T"),
    ModelSpec(name="tied, vocab", num_layers=7, hidden_size=512, num_heads=8, vocab_size=5000),
    ModelSpec(name="untied, gated, GQA", num_layers=5, hidden_size=384, num_heads=6, num_kv_heads=2, vocab_size=3000,
              ffn_hidden_size=1000, gated_mlp=True, tied_embeddings=False),
    ModelSpec(name="one block", num_layers=1, hidden_size=256, num_heads=4, vocab_size=70000),
    ModelSpec(name="two blocks, no vocab", num_layers=2, hidden_size=256, num_heads=4),
)


def whole_walk(w: Window, trace: list[TraceUnit]) -> tuple[float, float]:
    """The walk over every unit of the window's whole representative trace (the straightforward
    reference)."""
    dp, depth, terms, unit_bytes, tied_bytes = w.data_parallel, w.prefetch_depth, w.terms, w.unit_bytes, w.tied_bytes
    gathers = MemoryTerm.MSWM in terms
    ahead = MemoryTerm.PREFETCH_GATHERED_PARAMS in terms
    staged = MemoryTerm.PREFETCH_SHARD_STAGING in terms
    own_gradient = dp > 1 and gathers or MemoryTerm.REDUCE_SCATTER_BUFFER in terms
    in_flight = MemoryTerm.REDUCE_SCATTER_BUFFER in terms and dp > 1 and depth > 0
    offloads = MemoryTerm.GRADIENT_OFFLOAD_STAGING in terms
    pending: list[float] = []
    maxima = [0.0, 0.0]
    for i, unit in enumerate(trace):
        elements, kept = 0.0, 0.0
        grads = unit.backward and unit.has_grads
        if gathers:
            elements += unit.elements
            kept = tied_bytes if (unit.backward or unit.at_head) else 0.0
            if ahead and i + 1 < len(trace):
                elements += trace[i + 1].elements
            if staged and i + 2 < len(trace):
                elements += trace[i + 2].elements / dp
        if grads and own_gradient:
            elements += unit.elements
        if in_flight:
            elements += sum(pending[-1:] if grads else pending[-2:])
        if offloads:
            elements += sum(pending[-2:]) / dp if depth > 0 else 0.0
        if in_flight or offloads:
            pending = [*pending[-1:], unit.elements] if grads else ([] if not unit.backward else pending)
        index = 0 if unit.at_head else 1
        maxima[index] = max(maxima[index], elements * unit_bytes + kept)
    return maxima[0], maxima[1]


TERM_SETS = [frozenset(c) for r in range(len(PER_OPERATOR_TERMS) + 1)
             for c in itertools.combinations(PER_OPERATOR_TERMS, r)]
WINDOWS_PER_SHAPE = 8


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.name)
def test_the_walk_over_distinct_moments_equals_the_whole_walk(model):
    """Every tiling, recompute interval and model-parallel degree with a sample of the windows'
    terms, data parallelism, prefetch depth and tied embedding (fixed seed)."""
    rng = random.Random(model.name)
    compared = 0
    for mp, tiling, ci in itertools.product((1, 2), (1, 3, 16, 64), (0, 1, 2, 3, 4, 5, 16)):
        shape = TraceShape(model, mp, tiling, ci, rng.choice((0.0, 37.0)))
        trace = representative_trace(shape)
        for _ in range(WINDOWS_PER_SHAPE):
            w = Window(shape, rng.choice((1, 2, 16)), rng.choice((0, 1, 2, 3)), rng.choice(TERM_SETS), 2.0,
                       rng.choice((0.0, 1e6)))
            assert buffer_maxima(w) == whole_walk(w, trace), w
            compared += 1
    assert compared == 2 * 4 * 7 * WINDOWS_PER_SHAPE


def test_runs_are_cut_to_the_kept_repeats():
    shape = TraceShape(resolve_model("1T"), 1, 64, 4, 0.0)
    whole, kept = representative_trace(shape), representative_trace(shape, kept=KEPT_REPEATS)
    # 12 forward blocks of 4 linears x 64 tiles, three segments of 4 blocks recomputed and backward
    assert len(whole) == 12 * 256 + 3 * 2 * 4 * 256
    assert len(kept) == 5 * 20 + 3 * 2 * 4 * 20
    assert set(kept) == set(whole)

