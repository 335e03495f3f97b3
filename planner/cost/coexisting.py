"""The GPU's worst moment: which of the bill's per-operator and activation terms are live together.

[Note: terms that never meet] Each transient GPU term of the bill is its own worst case over the
iteration (the runtime's ledger checks them term by term: tests/test_runtime_memory.py). Their sum
is not a moment the runtime reaches:
- the per-operator buffers follow the operator order (runtime/units/prefetch.py): while operator i
  computes, i is gathered, i+1 is gathered ahead (depth >= 1), i+2's shard is staged (depth >= 2);
  in backward i's gradient fills its buffer while the reduce-scatter of the operator with gradients
  before it may still run, and between two such operators (a recompute) the last two may. A block's
  two largest linears are neighbours, so the largest unit is never gathered, gathered ahead and
  reduce-scattered at once: a moment holds the largest unit, its neighbour and the next one;
- with recompute the loss's logits are freed by the head's backward, before the first segment is
  recomputed: they never meet a segment's activations (without recompute every block's activations
  are kept until the backward reaches it, and meet the logits at the head). The recompute inputs
  in transit are a segment's business too: the last one is copied off during its segment's forward,
  before the head runs, and the backward fetches them back from its first recompute on.
`buffer_maxima` walks the moments of one period of the trace (planner/sim/workload.py's order: the
embedding, the blocks, the head, then per recompute segment its recompute and its backward); the
bill's `not_at_once` term takes back what the worst of them does not hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from planner.specs.memory_terms import MemoryTerm
from planner.specs.model import ModelSpec
from planner.specs.plan import Plan

MOMENT_TERMS = (MemoryTerm.AWM, MemoryTerm.LOGITS, MemoryTerm.RECOMPUTE_INPUT_OFFLOAD_STAGING, MemoryTerm.MSWM,
                MemoryTerm.PREFETCH_GATHERED_PARAMS, MemoryTerm.PREFETCH_SHARD_STAGING, MemoryTerm.REDUCE_SCATTER_BUFFER,
                MemoryTerm.GRADIENT_OFFLOAD_STAGING)
"""The GPU terms whose worst cases fall at different moments."""
SEGMENT_TERMS = frozenset({MemoryTerm.AWM, MemoryTerm.LOGITS, MemoryTerm.RECOMPUTE_INPUT_OFFLOAD_STAGING})
"""The moment terms that follow the blocks and the head, not the operator order."""


@dataclass(frozen=True, slots=True)
class TraceUnit:
    """One operator (tile) of the trace as the runtime gathers it."""

    elements: float
    """Parameter elements gathered on one GPU (the tile's slice, with its bias for the largest linear)."""
    backward: bool
    has_grads: bool
    at_head: bool
    """The output head's steps: the logits are live."""


# [Note: a walk of distinct moments] A moment's bytes are a function of its unit, the two units after
# it (gathered ahead, staged) and the gradients whose reduce-scatter may still run (`pending`: at
# most the two units before it, reset by every forward unit and kept across a tied head's backward).
# So in a run of more than `KEPT_REPEATS` identical items (a linear's tiles, or a stretch of identical
# blocks) every item from the third to the third-last meets the same moment as the run's middle one,
# and the state after the run is the same as after its first `KEPT_REPEATS`: the walk keeps that many of
# each run (`representative_trace(shape, kept=KEPT_REPEATS)`). What it walks then depends on the tiling
# only through the tiles' sizes. Its moments, each the unit's and its neighbours' elements and the
# pending sums, are the same for every window of one `TraceShape`; `buffer_maxima` prices each
# distinct one with the window's terms, adding the same floats in the same order as the walk over the
# whole trace (tests/test_memory_moments.py compares the two on many layouts).
KEPT_REPEATS = 5
"""Items of a run of identical ones the walk keeps: the two each end's neighbours see and one from
the middle ([Note: a walk of distinct moments])."""


@dataclass(frozen=True, slots=True)
class TraceShape:
    """What sets the trace's units and their sizes (the same for every window of a layout that
    differs only in the batch, the prefetch depth, the terms the bill has or the data parallelism)."""

    model: ModelSpec
    model_parallel: int
    tiling: int
    recompute_interval: int
    largest_bias: float
    """Bias elements the largest linear's unit carries (planner/cost/memory.py `largest_unit_params`)."""


@dataclass(frozen=True, slots=True)
class Window:
    """What sets the per-operator buffers' moments (hashable: the walk is cached per window)."""

    shape: TraceShape
    data_parallel: int
    prefetch_depth: int
    terms: frozenset[MemoryTerm]
    """The per-operator terms the bill has."""
    unit_bytes: float
    """Bytes per element gathered."""
    tied_bytes: float
    """The tied embedding kept gathered from the head's forward to its gradient (0 when it is not)."""

    @classmethod
    def of(cls, plan: Plan, terms: frozenset[MemoryTerm], unit_bytes: float, tied_bytes: float,
           largest_bias: float) -> Window:
        shape = TraceShape(plan.model, plan.model_parallel_degree, plan.tiling_factor, plan.recompute_interval,
                           largest_bias)
        return cls(shape, plan.data_parallel_degree, plan.prefetch_depth, terms, unit_bytes, tied_bytes)


def representative_trace(shape: TraceShape, kept: int | None = None) -> list[TraceUnit]:
    """The operators of the trace's first forward blocks, its head, and its backward over enough
    blocks to repeat: three recompute segments (three blocks without recompute), and the embedding;
    with `kept`, at most that many of each run of identical tiles or blocks."""
    m, mp, tiles, ci, largest_bias = shape.model, shape.model_parallel, shape.tiling, shape.recompute_interval, \
        shape.largest_bias
    largest = m.largest_block_operator_params

    def tiled(num_params: int, bias: float) -> list[float]:
        n = tiles if num_params >= tiles else 1
        return [num_params / (mp * n) + bias] * min(n, kept or n)

    block = [e for op in m.block_operators()
             for e in tiled(op.num_params, largest_bias if op.num_params == largest else 0.0)]
    rows = m.vocab_size * m.hidden_size
    embedding = [rows / mp] if m.vocab_size else []
    head = tiled(rows, 0.0) if m.vocab_size else []
    head_grads = not m.tied_embeddings
    blocks = min(m.num_layers, 3 * max(ci, 1))

    def units(elements: list[float], backward: bool, has_grads: bool, at_head: bool) -> list[TraceUnit]:
        return [TraceUnit(e, backward, has_grads, at_head) for e in elements]

    # Each block's units are made once and repeated (they are immutable).
    forward, recomputed, backward = units(block, False, True, False), units(block, False, False, False), \
        units(block[::-1], True, True, False)
    trace = units(embedding, False, True, False)
    trace += forward * min(blocks, kept or blocks)
    trace += units(head, False, True, True)
    trace += units(head[::-1], True, head_grads, True)
    segment = ci or 1
    for first in range(blocks - segment, -segment, -segment):
        count = segment + min(first, 0)
        count = min(count, kept or count)
        if ci:
            trace += recomputed * count
        trace += backward * count
    trace += units(embedding, True, True, False)
    return trace


@dataclass(frozen=True, slots=True)
class Moment:
    """What one unit's moment is made of, whatever the window's terms."""

    elements: float
    ahead: float
    """The next unit's elements (gathered ahead), 0 at the trace's end."""
    staged: float
    """The unit after next's elements (its shard staged), 0 at the trace's end."""
    grads: bool
    held: bool
    """The tied embedding is held: the head's steps and every backward step."""
    at_head: bool
    last_pending: float
    """The last gradient whose reduce-scatter may still run (`sum(pending[-1:])`)."""
    two_pending: float
    """The last two (`sum(pending[-2:])`)."""


@functools.lru_cache(maxsize=1024)
def distinct_moments(shape: TraceShape) -> tuple[Moment, ...]:
    """The distinct moments of the trace ([Note: a walk of distinct moments])."""
    trace = representative_trace(shape, kept=KEPT_REPEATS)
    after = [unit.elements for unit in trace[1:]] + [0.0, 0.0]  # nothing is gathered past the trace's end
    pending: list[float] = []
    moments = {}
    for i, unit in enumerate(trace):
        grads = unit.backward and unit.has_grads
        last = pending[-1] if pending else 0  # pending holds at most two: sum(pending[-1:]), sum(pending[-2:])
        moments[(unit.elements, after[i], after[i + 1], grads, unit.backward or unit.at_head, unit.at_head,
                 last, pending[0] + last if len(pending) == 2 else last)] = None
        pending = [*pending[-1:], unit.elements] if grads else ([] if not unit.backward else pending)
    return tuple(Moment(*moment) for moment in moments)


@functools.lru_cache(maxsize=4096)
def buffer_maxima(w: Window) -> tuple[float, float]:
    """The most bytes of the per-operator buffers live at once while an operator of the output head
    computes, and while any other does (see [Note: terms that never meet])."""
    dp, depth, terms, unit_bytes, tied_bytes = w.data_parallel, w.prefetch_depth, w.terms, w.unit_bytes, w.tied_bytes
    gathers = MemoryTerm.MSWM in terms
    ahead = MemoryTerm.PREFETCH_GATHERED_PARAMS in terms
    staged = MemoryTerm.PREFETCH_SHARD_STAGING in terms
    own_gradient = dp > 1 and gathers or MemoryTerm.REDUCE_SCATTER_BUFFER in terms
    in_flight = MemoryTerm.REDUCE_SCATTER_BUFFER in terms and dp > 1 and depth > 0
    offloads = MemoryTerm.GRADIENT_OFFLOAD_STAGING in terms
    maxima = [0.0, 0.0]
    for m in distinct_moments(w.shape):
        elements, kept = 0.0, 0.0
        if gathers:
            elements += m.elements
            kept = tied_bytes if m.held else 0.0
            if ahead:
                elements += m.ahead
            if staged:
                elements += m.staged / dp
        if m.grads and own_gradient:
            elements += m.elements
        # While an operator computes its gradients the previous one's reduce-scatter may run and the
        # two before's shards be copied off (at depth 0 each waits); in a recompute the last two's.
        # A segment's recompute outlasts them: the next backward finds them done (the simulator's
        # schedule shows it on every example plan).
        if in_flight:
            elements += m.last_pending if m.grads else m.two_pending
        if offloads:
            elements += m.two_pending / dp if depth > 0 else 0.0
        index = 0 if m.at_head else 1
        maxima[index] = max(maxima[index], elements * unit_bytes + kept)
    return maxima[0], maxima[1]


def worst_moment_bytes(plan: Plan, peaks: dict[MemoryTerm, float], buffers: tuple[float, float]) -> float:
    """The moment terms' bytes at the GPU's worst moment: at the head (the logits, and without
    recompute every block's activations) or elsewhere (a segment's activations and recompute inputs
    in transit)."""
    at_head, elsewhere = buffers
    awm, logits = peaks.get(MemoryTerm.AWM, 0.0), peaks.get(MemoryTerm.LOGITS, 0.0)
    inputs = peaks.get(MemoryTerm.RECOMPUTE_INPUT_OFFLOAD_STAGING, 0.0)
    head = at_head + logits + (0.0 if plan.recompute_interval else awm + inputs) if logits else 0.0
    return max(head, elsewhere + awm + inputs)
