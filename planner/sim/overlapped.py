"""The after-backward step that overlaps the next forward, in the steady state.

[Note: the overlapped step, simulated] Where the runtime runs it (`step_overlaps_forward`: optimizer
states on NVMe, the CPU computes; runtime/optim/step_schedule.py [Note: the step overlaps the next
forward]) `optimizer.step()` returns at once and the optimizer worker updates the units in the
order the forward gathers them. A simulated iteration is the steady state: iteration k's step runs
during iteration k+1's forward, so the iteration starts with the previous step's updates to do:
- a reader fills the plan's `num_optimizer_buffers` chunk buffers with each chunk's master,
  momentum and variance (12 B per parameter) and, with the gradients on a staged tier, its fp32
  gradient shard (4 B), one read after another, in unit order; the drive serves them beside the
  forward's parameter reads;
- the update runs on the cores the forward computes on, so it is inline (as the in-backward update
  on such a machine, planner/sim/in_backward.py): before each operator of the forward the rank runs
  every update whose chunks have been read, and waits for the updates up to the unit the operator
  uses; the writer then writes each chunk's states (and a separate compute copy of the parameters);
- a unit counts as updated once its writes have landed: the forward's first read of its shard
  waits for that (the prefetch of operator i waits for unit i only, so the forward of unit k
  overlaps the updates of units k+1...);
- the next backward drains the step first (`OverlappedAfterBackward.backward_begin`): the rank
  runs what is left and waits for the last writes before its backward begins.
So the step costs about max(forward + Adam's CPU time, the step's I/O beside the forward's) instead
of forward + step. The drain's wait counts to the forward (the runtime counts the waits to
`optimizer`; calibration fits the two as one row: planner/calibration/calibrate.py [Note: the
overlapped step is one row with the forward]). The updated fp32 shard the runtime hands the forward
instead of a read (fp32 parameters on NVMe that are their own master) is read like any other here.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import simpy

from planner.cost.memory import STORED_GRADIENT_BYTES, optimizer_chunk_buffer_bytes
from planner.sim.in_backward import BackwardUpdates, Rank, chunk_sizes
from planner.specs.phases import Phase

Proc = Generator[Any, Any, Any]


class OverlappedStep(BackwardUpdates):
    """The previous iteration's after-backward step, overlapping this iteration's forward (see
    [Note: the overlapped step, simulated])."""

    def __init__(self, program: Rank) -> None:
        super().__init__(program)
        plan = self.plan
        share = plan.num_gpus if "optimizer_states" in plan.partitioned else plan.model_parallel_degree
        chunk_params = optimizer_chunk_buffer_bytes(plan) / 16
        forward = [s for s in program.sim.work.steps if s.phase is Phase.FORWARD and s.op.has_grads]
        self.unit_of = {s.index: k for k, s in enumerate(forward)}
        """Forward step index -> the unit it gathers, in update order."""
        memo: dict[float, list[float]] = {}
        self.units = [memo.setdefault(s.op.num_params / share, chunk_sizes(s.op.num_params / share, chunk_params))
                      for s in forward]
        self.final = [self.env.timeout(0) for _ in self.units]  # every gradient is stored before the step
        self.updated = [self.env.event() for _ in self.units]
        """Unit k's update ran and its writes landed: the forward may read its shard."""
        self.gradients = plan.placement.gradients
        self.reads_gradients = self.gradients.staged
        self.inline = True
        self._left = [len(sizes) for sizes in self.units]
        """Chunks of each unit whose writes have not landed."""
        self._writing = 0
        """The first unit not written yet."""

    def wait_for_unit(self, step_index: int) -> Proc:
        """Before the forward's first read of a step's shard: its unit's update (written)."""
        k = self.unit_of.get(step_index)
        if k is not None and not self.updated[k].triggered:
            yield self.updated[k]

    def run_until(self, step_index: int) -> Proc:
        """Before a forward operator computes: the updates whose chunks are read, and every update
        up to the unit it uses (waiting for their reads)."""
        k = self.unit_of.get(step_index, -1)
        while self.next_unit < len(self.units):
            if self.next_unit > k and not self._reads_landed(self.next_unit):
                return
            yield from self._update(self.next_unit)

    def drain(self) -> Proc:
        """The next backward's drain: the updates left, then the last writes."""
        yield from self.run_ready_inline(wait_all=True)
        yield self.written

    def _reads_landed(self, k: int) -> bool:
        """Whether every chunk of unit k has been read (its reads are the next ones queued)."""
        items = self.reads.items
        return len(items) >= len(self.units[k]) and all(read.processed for read in items[:len(self.units[k])])

    def _read_chunk(self, n: float) -> simpy.Event:
        """The chunk's states and, from a staged tier, its stored fp32 gradient."""
        states = super()._read_chunk(n)
        if not self.reads_gradients:
            return states
        program = self.program
        gradient = program.move(n * STORED_GRADIENT_BYTES, program.res.read(self.gradients, program.rank),
                                self.gradients.read_link, Phase.OPTIMIZER)
        return self.env.all_of([states, gradient])

    def _chunk_written(self) -> None:
        self._left[self._writing] -= 1
        while self._writing < len(self._left) and self._left[self._writing] == 0:
            self.updated[self._writing].succeed()
            self._writing += 1
