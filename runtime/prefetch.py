"""Operator-order prefetching (METHOD.md §4.3, overlap-centric design).

The first iteration records the order in which units are used, separately for forward and
backward. Later iterations follow the recorded order: on using operator i the prefetcher starts the
transfers of i's and i+1's shards where they are not on their way yet, of i+2's shard to the compute
device (depth >= 2) and, at depth 3, of i+3's shard into a host swap buffer (NVMe -> CPU: stores
with a slower tier behind them), and only then the all-gather of i+1 (depth >= 1), which waits for
i+1's shard to arrive. All are started before that wait, so that with parameters on NVMe the reads
of i+1, i+2 and i+3 queue on the drive together instead of one at a time.

[Note: submission order]
The engine serves requests in the order they were submitted. In the steady state one new transfer
starts per operator (i+3's) and the nearer ones are already in flight; at the start of a phase
none is, and the operator in use must not wait behind the reads of the three after it: transfers
start nearest first (i, i+1, i+2, i+3). Each is charged, until gathered, to the memory-bill term of
the slot it fills (`runtime.group.STAGE_TERMS`), so a phase start holds what the steady state does.

[Note: a changed order]
Models may take data-dependent branches, so the order is a hint, never a contract: when the unit
being used is not the one recorded at this position, the prefetcher stops prefetching for the rest
of the phase, records the new order from the start of the phase, and uses it from the next
iteration on. Correctness never depends on it: a unit that was not prefetched is gathered on demand,
and a prefetched unit that is not used is released at the end of the step.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from runtime.group import ParamUnit


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


class Prefetcher:
    """Decides which units to gather or stage ahead, from the recorded use order."""

    def __init__(self, units: list[ParamUnit], depth: int) -> None:
        self.units = units
        self.depth = depth
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
        ahead = order.recorded[position + 1 : position + 1 + self.depth]
        # Nearest first (see [Note: submission order]); all are submitted before the gather waits.
        self.units[index].stage(ahead=0)
        for distance, i in enumerate(ahead[:2], start=1):
            self.units[i].stage(ahead=distance)
        if len(ahead) >= 3 and not self.units[ahead[2]].param_store.resident_states:
            self.units[ahead[2]].stage(ahead=3)
        if ahead:
            self.units[ahead[0]].start_gather(prefetch=True)

    def end_phase(self, phase: Phase) -> None:
        """The phase is over: keep what it used as the order for the next iteration."""
        order = self._orders[phase]
        if order.current and (order.recorded is None or order.diverged or order.current != order.recorded):
            order.recorded = order.current
        order.current = []
        order.diverged = False

    def recorded(self, phase: Phase) -> list[int] | None:
        return self._orders[phase].recorded
