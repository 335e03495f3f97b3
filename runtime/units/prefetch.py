"""Operator-order prefetching (docs/method.md §4.3, overlap-centric design).

The first iteration records the order in which units are used, separately for forward and
backward. Later iterations follow the recorded order: on using operator i the prefetcher starts the
transfers of i's and i+1's shards where they are not on their way yet, of i+2's shard to the compute
device (depth >= 2) and, at depth 3, of i+3's shard into a host swap buffer (NVMe -> CPU: stores
with a slower tier behind them), and only then the all-gather of i+1 (depth >= 1), which with
several ranks waits for i+1's shard to arrive ([Note: one rank does not wait ahead]). All are
started before that wait, so that with parameters on NVMe the reads of i+1, i+2 and i+3 queue on
the drive together instead of one at a time. "Operators" are counted as the planner does
([Note: small units ride along]).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from runtime.units.group import ParamUnit


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"

@dataclass(slots=True)
class _PhaseOrder:
    recorded: list[int] | None = None
    """Unit indices in use order from the last complete recording (None before the first)."""
    current: list[int] = field(default_factory=list)
    """What this iteration used so far."""
    diverged: bool = False

RIDER_FRACTION = 64
"""Units below 1/RIDER_FRACTION of the largest unit's bytes ride along ([Note: small units ride along])."""
MAX_RIDERS = 4
"""At most this many riders in a window beyond its `depth` operators."""

# [Note: submission order]
# The engine serves requests in the order they were submitted. In the steady state one new transfer
# starts per operator (i+3's) and the nearer ones are already in flight; at the start of a phase
# none is, and the operator in use must not wait behind the reads of the three after it: transfers
# start nearest first (i, i+1, i+2, i+3). Each is charged, until gathered, to the memory-bill term of
# the slot it fills (`runtime.units.group.STAGE_TERMS`), so a phase start holds what the steady state does.
#
# [Note: one rank does not wait ahead]
# The all-gather of i+1 needs i+1's shard, so starting it waits for that shard's transfer, and
# operator i's compute waits with it. With several ranks it must: collectives are issued in the same
# order on every rank, and whether a read has landed differs from rank to rank. With one rank the
# "gather" is the shard itself, so a prefetch whose shard is still on its way leaves it staged and
# the unit's use waits for it, as the simulator's schedule has it (planner/sim/engine.py: operator i
# waits for its own fetch only). Waiting ahead on one rank would start each linear's compute only
# once the next one's read had landed, and the drive would idle in forward while it ran.
#
# [Note: small units ride along]
# The depth counts operators as the planner does: its trace (planner/sim/workload.py) has a model's
# linears and embeddings, not its norms, whose parameters are ~1/hidden of a linear's. A unit smaller
# than 1/`RIDER_FRACTION` of the largest one does not take a place in the window: it is fetched with the
# operator before it. Counted as operators, a GPT's two LayerNorms per block would make depth 3 hold
# two linears at times, and the drive would run dry while a linear computed. The riders cost at
# most 1/`RIDER_FRACTION` of a largest shard each, and at most `MAX_RIDERS` of them are in a window.
#
# [Note: the forward's tail is the backward's head]
# The backward's first operators are the forward's last ones, in reverse. Resharding them after
# their forward use would read them straight back at the start of backward, where the first one's
# shard, submitted with the three after it, is waited for with nothing to compute. A unit whose last
# forward use is `r` operators before the forward's end and which is `q` operators into the
# backward's first window stays gathered instead (`keep_distance`) when r <= q and the next use is
# an operator's, not a rider's. From the next operator's use on, such units fill exactly the window
# slots the forward's own prefetch no longer needs (its window reaches r operators ahead of a unit
# r from the end), each charged to the memory-bill term of its backward distance (`ParamUnit.keep`;
# the slots change hands inside `MemoryLedger.relabelling`), so the bill holds them as it holds a
# prefetch. Until then the unit holds the slot of the operator in use, which a rider used in
# between would need too: hence the second condition. FSDP2 makes the same choice by hand
# (torchtitan leaves the last block gathered after forward, `reshard_after_forward=False`). With
# recompute the backward opens with a recompute of the last segment in forward
# order, so few units qualify; whatever is kept and not used is resharded when backward ends.
#
# [Note: a changed order]
# Models may take data-dependent branches, so the order is a hint, never a contract: when the unit
# being used is not the one recorded at this position, the prefetcher stops prefetching for the rest
# of the phase, records the new order from the start of the phase, and uses it from the next
# iteration on. Correctness never depends on it: a unit that was not prefetched is gathered on demand,
# and a prefetched unit that is not used is released at the end of the step.
class Prefetcher:
    """Decides which units to gather or stage ahead, from the recorded use order."""

    def __init__(self, units: list[ParamUnit], depth: int) -> None:
        self.units = units
        self.depth = depth
        largest = max((u.full_bytes for u in units), default=0)
        self._rides = [u.full_bytes * RIDER_FRACTION < largest for u in units]
        self._orders = {phase: _PhaseOrder() for phase in Phase}
        self.num_order_changes = 0
        """How many times a recorded order was found stale (reported in the profile)."""

    def on_use(self, phase: Phase, index: int) -> None:
        """Unit `index` is about to be used in `phase`: follow (or record) the order and prefetch."""
        order = self._orders[phase]
        position = len(order.current)
        order.current.append(index)
        if order.recorded is None or order.diverged or self.depth == 0:
            return
        if position >= len(order.recorded) or order.recorded[position] != index:
            order.diverged = True
            self.num_order_changes += 1
            return
        window = self._window(order.recorded, position)
        # Nearest first (see [Note: submission order]); all are submitted before the gather waits.
        self.units[index].stage(ahead=0)
        for i, distance in window:
            if distance <= 2:
                self.units[i].stage(ahead=distance)
            elif distance == 3 and not self.units[i].param_store.resident_states:
                self.units[i].stage(ahead=3)
        for i, distance in window:
            if distance == 1:
                self.units[i].start_gather(prefetch=True)

    def window_reaches_end(self, phase: Phase) -> bool:
        """Whether the transfers of every unit left in this phase's recorded order have been started
        (the window of the unit in use reaches the phase's last one)."""
        order = self._orders[phase]
        if order.recorded is None or order.diverged or self.depth == 0 or not order.current:
            return False
        position = len(order.current) - 1
        return len(self._window(order.recorded, position)) == len(order.recorded) - position - 1

    def keep_distance(self, index: int) -> int | None:
        """At the end of a forward use of unit `index`: how many operators into the backward's first
        window it is, if it should stay gathered until then ([Note: the forward's tail is the
        backward's head]); None to reshard it."""
        forward, backward = self._orders[Phase.FORWARD], self._orders[Phase.BACKWARD]
        if self.depth == 0 or forward.recorded is None or backward.recorded is None or forward.diverged:
            return None
        position = len(forward.current)
        rest = forward.recorded[position:]
        if forward.recorded[position - 1 : position] != [index] or index in rest:
            return None  # not where the recorded order has it, or used again later in this forward
        if rest and self._rides[rest[0]]:
            return None  # a rider's use comes next, while this unit still holds the in-use slot
        head = [(backward.recorded[0], 0), *self._window(backward.recorded, 0)]
        q = next((distance for i, distance in head if i == index), None)
        if q is None:
            return None
        r = sum(not self._rides[i] for i in rest)  # operators after this use
        return q if r <= q else None

    def _window(self, recorded: list[int], position: int) -> list[tuple[int, int]]:
        """(unit, operators ahead) for the units after `position` up to the `depth`-th operator, with
        the riders among them at the distance of the operator before them (at least 1)."""
        window: list[tuple[int, int]] = []
        distance = riders = 0
        for i in recorded[position + 1 :]:
            if self._rides[i]:
                riders += 1
                if riders > MAX_RIDERS:
                    break
            else:
                distance += 1
                if distance > self.depth:
                    break
            window.append((i, max(distance, 1)))
        return window

    def end_phase(self, phase: Phase) -> None:
        """The phase is over: keep what it used as the order for the next iteration."""
        order = self._orders[phase]
        if order.current and (order.recorded is None or order.diverged or order.current != order.recorded):
            order.recorded = order.current
        order.current = []
        order.diverged = False

    def recorded(self, phase: Phase) -> list[int] | None:
        return self._orders[phase].recorded
