"""The after-backward step overlapping the next forward (the streamed NVMe step on the CPU).

[Note: the overlapped step, simulated] What the runtime does (runtime/step_schedule.py [Note: the
step overlaps the next forward], `OverlappedAfterBackward`; chosen by `StreamedAdamW.overlaps_forward`:
optimizer states on NVMe, the CPU the compute device, `planner.memory.step_overlaps_next_forward`):
`optimizer.step()` submits one job per unit to the optimizer worker and returns, so the step of one
iteration runs during the forward of the next. In steady state every forward runs beside the
previous iteration's step, which is what one simulated iteration shows: the step from time 0, the
forward beside it, the backward after it, nothing after the backward.
- The worker (`OverlappedAfterBackward._update`, `StreamedAdamW.step_unit`): units in the forward's
  order, each unit's chunks as the synchronous step's pipeline (optimizer.py's `_Pipeline`: a reader
  fills the `num_optimizer_buffers` chunk buffers in chunk order across units with the fp32 master,
  momentum and variance and, stored on NVMe, the fp32 gradient; CPU AdamW; the chunk's writes free its
  buffer when they land). Where the update hands the forward its updated shard
  (`planner.memory.hands_updated_shards`: fp32 parameters on NVMe are their own master) and fewer
  than `OVERLAPPED_STEP_HANDED_SHARDS` wait untaken when the unit's update begins, the shard is handed
  over once the unit's chunks are updated. Then the job waits for the previous unit's writes: the
  previous unit counts as updated only then (its ticket is the next job's), the last one when every
  write of the step landed (the job that ends the step).
- The forward (`ParamUnit.stage`, `Prefetcher.on_use`): a unit's use first waits until its update
  is done or its shard handed; that wait is the host's wait for the step and the runtime's profile
  counts it to the `optimizer` phase (`Profiler.waited`), as this simulation does (`step_wait_s`).
  Then the prefetch window is tried again: a unit ahead whose shard was handed takes it and reads
  nothing, one updated is read from the drive, one not updated yet is skipped until the next use
  (on several ranks the prefetch of the next unit is a collective and waits instead). A unit read at
  its use reads there, behind whatever the step has queued on the drive: forward time.
- The cores: the worker's fused AdamW and the forward's operators share the CPU (the compute device
  is the CPU), so they take turns: a chunk's update and an operator never run at once.
- The backward's start drains the worker (`backward_begin`): the wait is counted to the `optimizer`
  phase too. `optimizer.step()` after the backward only submits: the iteration ends with the backward.
Not simulated, as for the synchronous step: the backward's read-ahead of the step's first chunks.
Step traffic is labelled `optimizer` (the Gantt chart shows it under the forward).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import simpy

from planner.memory import (
    COMPUTE_BYTES,
    OVERLAPPED_STEP_HANDED_SHARDS,
    hands_updated_shards,
    optimizer_chunk_buffer_bytes,
)
from planner.memory_terms import MemoryTerm
from planner.phases import Phase
from planner.sim.in_backward import STATE_BYTES_PER_PARAM, chunk_sizes

if TYPE_CHECKING:
    from planner.sim.engine import RankProgram

Proc = Generator[Any, Any, Any]
LABEL = Phase.OPTIMIZER
GRADIENT_BYTES_PER_PARAM = 4
"""The stored fp32 gradient each chunk reads back from NVMe (`STORED_GRADIENT_BYTES`)."""


class OverlappedStep:
    """One rank's overlapped after-backward step (see [Note: the overlapped step, simulated])."""

    def __init__(self, program: RankProgram) -> None:
        self.program, self.sim, self.env = program, program.sim, program.env
        plan = self.plan = program.sim.plan
        place = plan.placement
        share = plan.num_gpus if "optimizer_states" in plan.partitioned else plan.model_parallel_degree
        forward = [s for s in program.sim.work.steps if s.phase is Phase.FORWARD and s.op.has_grads]
        self.unit_of_step = {s.index: k for k, s in enumerate(forward)}
        """Forward trace step -> its unit's place in the step's order (the forward's)."""
        chunk_params = optimizer_chunk_buffer_bytes(plan) / 16
        memo: dict[float, list[float]] = {}
        self.units = [memo.setdefault(s.op.num_params / share, chunk_sizes(s.op.num_params / share, chunk_params))
                      for s in forward]
        self.hands = hands_updated_shards(plan)
        self.reads_gradient = place.gradients == "nvme"
        separate_params = plan.precision != "fp32" or place.params != place.optimizer_states
        self.param_write_bytes = COMPUTE_BYTES[plan.precision] if place.params == "nvme" and separate_params else 0
        """The compute copy of the parameters written to NVMe per parameter (mixed precision)."""
        env = self.env
        self.ready = [env.event() for _ in self.units]
        """Unit k may be used: its shard handed over, or its update done and its writes landed."""
        self.done = [env.event() for _ in self.units]
        self.handed = [False] * len(self.units)
        """Unit k's shard is handed over and not taken yet."""
        self.waiting_handed = 0
        self.written = [env.event() for _ in self.units]
        self.finished = env.event()
        """The worker is idle: every update done and every write landed (what a drain waits for)."""
        self.buffers = simpy.Container(env, capacity=plan.num_optimizer_buffers, init=plan.num_optimizer_buffers)
        self.reads: simpy.Store = simpy.Store(env)
        self.to_write: simpy.Store = simpy.Store(env)
        self.use = env.event()
        """Fires at the forward's next use of a unit (when its prefetch window is tried again)."""
        self.step_wait_s = dict.fromkeys((Phase.FORWARD, Phase.BACKWARD), 0.0)
        """Rank 0's host waits for the step, by the phase of the timeline they fall in."""

    def begin(self) -> None:
        if not self.units:
            self.finished.succeed()
            return
        self.env.process(self._reader())
        self.env.process(self._writer())
        self.env.process(self._worker())

    # -- the host's side ---------------------------------------------------------------------------
    def before_use(self, index: int) -> Proc:
        """The forward is about to use trace step `index` (and, on several ranks, to start the
        collective prefetch of the next): wait for the update of its unit, then try the prefetch
        window again."""
        waits = [index, index + 1] if "gather" in self.program.stages and self.plan.prefetch_depth >= 1 else [index]
        for i in waits:
            k = self.unit_of_step.get(i)
            if k is not None and not self.ready[k].triggered:
                yield from self._waited(Phase.FORWARD, self.ready[k])
        tick, self.use = self.use, self.env.event()
        tick.succeed()

    def drain(self) -> Proc:
        """The backward begins: wait for the whole step."""
        if not self.finished.triggered:
            yield from self._waited(Phase.BACKWARD, self.finished)

    def _waited(self, phase: Phase, event: simpy.Event) -> Proc:
        began = self.env.now
        yield event
        if self.program.rank == 0:
            self.step_wait_s[phase] += self.env.now - began

    def clear_to_read(self, index: int) -> Proc:
        """The fetch of forward trace step `index` may start: returns whether its shard was handed
        over (nothing to read). Retried at each use until the unit is updated or handed."""
        k = self.unit_of_step.get(index)
        if k is None:
            return False
        while not self.ready[k].triggered:
            yield self.use
        if self.handed[k]:
            self.handed[k] = False
            self.waiting_handed -= 1
            return True
        return False

    # -- the worker's side -------------------------------------------------------------------------
    def _worker(self) -> Proc:
        program = self.program
        for k, sizes in enumerate(self.units):
            hand = self.hands and self.waiting_handed < OVERLAPPED_STEP_HANDED_SHARDS
            if hand:  # the room is taken when the update begins; only the forward frees it meanwhile
                self.waiting_handed += 1
            for n in sizes:
                read = yield self.reads.get()
                yield read
                with program.cores.request() as turn:
                    yield turn
                    yield program.net.transfer(n, program.res.cpu_adam(), LABEL)
                yield self.to_write.put((k, n))
            if hand:
                self.handed[k] = True
                self.ready[k].succeed()
            if k > 0:
                yield self.written[k - 1]
                self._done(k - 1)
        yield self.written[-1]  # the step's last job lets its writes land
        self._done(len(self.units) - 1)
        self.finished.succeed()

    def _done(self, k: int) -> None:
        self.done[k].succeed()
        if not self.ready[k].triggered:
            self.ready[k].succeed()

    def _reader(self) -> Proc:
        program, sim = self.program, self.sim
        for sizes in self.units:
            for n in sizes:
                yield self.buffers.get(1)
                sim.cpu_add(MemoryTerm.OPTIMIZER_SWAP_BUFFERS, n * 16)
                reads = [program._move(n * STATE_BYTES_PER_PARAM, program.res.nvme_read(), "nvme_read", LABEL)]
                if self.reads_gradient:
                    reads.append(program._move(n * GRADIENT_BYTES_PER_PARAM, program.res.nvme_read(), "nvme_read", LABEL))
                read = self.env.all_of(reads)
                yield self.reads.put(read)
                yield read

    def _writer(self) -> Proc:
        program, sim, res = self.program, self.sim, self.program.res
        left = [len(sizes) for sizes in self.units]
        for _ in range(sum(left)):
            k, n = yield self.to_write.get()
            writes = [program._move(n * STATE_BYTES_PER_PARAM, res.nvme_write(), "nvme_write", LABEL)]
            if self.param_write_bytes:
                writes.append(program._move(n * self.param_write_bytes, res.nvme_write(), "nvme_write", LABEL))
            yield self.env.all_of(writes)
            sim.cpu_remove(MemoryTerm.OPTIMIZER_SWAP_BUFFERS, n * 16)
            yield self.buffers.put(1)
            left[k] -= 1
            if not left[k]:
                self.written[k].succeed()
