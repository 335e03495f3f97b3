"""The optimizer step in backward (`optimizer_step: in_backward`): each unit is updated as soon as
its gradient is final, while the rest of the backward runs.

The simulation follows what the runtime does, per simulated rank and per optimizer tier; the backward
ends when the last unit's update has been computed, and the optimizer phase is the writes still in
flight ([Note: the optimizer step in backward, simulated], above `BackwardUpdates`).
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Protocol

import simpy

from planner.cost.host_work import step_cpu_params_per_param
from planner.cost.memory import optimizer_chunk_buffer_bytes
from planner.sim.optimizer import gpu_step_seconds
from planner.specs.memory_terms import MemoryTerm
from planner.specs.phases import Phase

if TYPE_CHECKING:
    from planner.sim.network import Network
    from planner.sim.resources import NodeResources, RankLinks
    from planner.sim.workload import Workload
    from planner.specs.plan import Plan
    from planner.specs.tiers import Tier

Proc = Generator[Any, Any, Any]
STATE_BYTES_PER_PARAM = 12
"""fp32 master, momentum and variance: what each chunk reads and writes in the optimizer's tier."""
LABEL = Phase.OPTIMIZER


class RankSimulation(Protocol):
    """What the updates use of the simulation they run in (engine.py's `Simulation`)."""

    plan: Plan
    work: Workload

    def cpu_add(self, term: MemoryTerm, nbytes: float) -> None: ...

    def cpu_remove(self, term: MemoryTerm, nbytes: float) -> None: ...


class Rank(Protocol):
    """What the updates use of the simulated rank that runs them (engine.py's `RankProgram`): its
    simulation, links and transfers, and its share of the work."""

    sim: RankSimulation
    env: simpy.Environment
    net: Network
    res: NodeResources
    links: RankLinks
    rank: int
    dp: int
    b: int
    """Bytes per parameter of the compute copy."""
    host_is_device: bool

    def move(self, nbytes: float, hops: Any, category: str, label: str) -> simpy.Event: ...


def unit_params(program: Rank) -> list[float]:
    """Parameters this rank updates for each operator with gradients, in backward order."""
    plan = program.sim.plan
    share = plan.num_gpus if "optimizer_states" in plan.partitioned else plan.model_parallel_degree
    return [s.op.num_params / share for s in program.sim.work.steps if s.phase is Phase.BACKWARD and s.op.has_grads]


def chunk_sizes(params: float, chunk_params: float) -> list[float]:
    """The runtime's chunks of one unit's shard: full ones from its start, then the rest."""
    count = max(1, math.ceil(params / chunk_params))
    return [chunk_params] * (count - 1) + [params - chunk_params * (count - 1)]


# [Note: the optimizer step in backward, simulated] What the runtime does (runtime/optim/streamed_optimizer.py
# [Note: the optimizer step in backward]), per simulated rank:
# - optimizer states on NVMe (the streamed update): once the forward has started fetching its last
#   operator (prefetch depth > 0; else when the backward begins), a reader fills the
#   plan's `num_optimizer_buffers` chunk buffers with the fp32 master, momentum and variance (12 B per
#   parameter) of the chunks of the units in backward order, one read after another (the I/O
#   engine serves its queue in order), taking a buffer as soon as one is free; it never holds up the
#   backward. When a unit's gradient is final (its reduce-scatter done; at once with one rank), the
#   updater takes the unit's chunks in order: waits for the chunk's read, copies the gradient chunk
#   into the buffer (GPU -> host, 16-bit, unless the host is the device), runs the CPU AdamW, and
#   queues the chunk's writes (12 B of states, plus the 16-bit compute copy of the parameters to
#   their tier when that is a separate copy), which free the buffer when they land. The gradient is
#   never written to NVMe nor read back (`planner.cost.memory.stores_gradients`).
# - optimizer states in memory (`cpu`): the gradient is offloaded as after backward; once it has
#   landed, the unit's CPU AdamW runs and the updated parameters go back to their tier.
# - optimizer states on the GPU: the unit's HBM-bound Adam (`gpu_step_seconds`) runs on the compute
#   stream.
# Where the update runs on the compute device's own thread (a GPU optimizer, or every optimizer when
# the host is the device: [Note: the CPU machine] in runtime/transfer/stores.py) it is *inline*: the rank's
# backward loop runs it before its next operator, so it competes with compute, as the runtime's
# backward hook does. Elsewhere the CPU optimizer is a process of its own that overlaps GPU compute.
#
# The backward ends when the last unit's update has been computed (and every gradient has been
# reduced); the optimizer phase is what `optimizer.step()` waits for: the writes still in flight.
# Update traffic is labelled `optimizer` (the Gantt chart shows it overlapping the backward);
# planner/calibration/calibrate.py attributes it by time for such plans.
#
# Chunks are the runtime's: each unit's shard is cut into `optimizer_chunk_bytes / 16`-element
# chunks from its own start (a unit smaller than a chunk is one short chunk). Units are the trace's
# operators (their tiles); a block's norms and biases ride along with its linears (the bill and
# `ModelSpec.num_params` count them there too).
class BackwardUpdates:
    """One rank's in-backward updates (see [Note: the optimizer step in backward, simulated])."""

    def __init__(self, program: Rank) -> None:
        self.program, self.sim, self.env = program, program.sim, program.env
        plan = self.plan = program.sim.plan
        place = plan.placement
        self.host_is_device = program.host_is_device
        self.cpu_params = step_cpu_params_per_param(plan)
        """CPU Adam's parameters per parameter updated: Adam and its host copies (planner/cost/host_work.py)."""
        self.on_gpu = place.optimizer_states.on_device and not self.host_is_device
        """HBM-bound Adam on the compute stream (a `gpu` optimizer on a CPU machine is the CPU's)."""
        self.states = place.optimizer_states
        self.streamed = self.states.staged
        self.inline = self.on_gpu or self.host_is_device
        """The update runs on the compute device's thread, between operators."""
        chunk_params = optimizer_chunk_buffer_bytes(plan) / 16
        memo: dict[float, list[float]] = {}
        self.units = [memo.setdefault(p, chunk_sizes(p, chunk_params)) for p in unit_params(program)]
        self.final = [self.env.event() for _ in self.units]
        """Unit k's gradient is final (reduced, and stored where the optimizer reads it)."""
        separate_params = plan.precision != "fp32" or place.params != place.optimizer_states
        self.param_bytes = program.b
        params = place.params
        written = (params.staged and separate_params) or (params.on_device and not self.host_is_device and not self.on_gpu)
        self.write_params_to: Tier | None = params if written else None
        """The tier the updated 16-bit parameters are written into over its link (as the after-backward
        step's writer): a staged tier's own, or the GPU's host link."""
        self.buffers = simpy.Container(self.env, capacity=plan.num_optimizer_buffers, init=plan.num_optimizer_buffers)
        self.reads: simpy.Store = simpy.Store(self.env)
        """Each chunk's read (an event), in chunk order."""
        self.to_write: simpy.Store = simpy.Store(self.env)
        self.computed = self.env.event()
        self.written: simpy.Event | None = None
        self.next_unit = 0
        self.begun = False

    @property
    def num_chunks(self) -> int:
        return sum(len(sizes) for sizes in self.units)

    def begin(self) -> None:
        """Start reading ahead, the writer and (unless inline) the updater."""
        self.begun = True
        if not self.units:
            self.computed.succeed()
            self.written = self.env.timeout(0)
            return
        if self.streamed:
            self.env.process(self._reader())
        self.written = self.env.process(self._writer())
        if not self.inline:
            self.env.process(self._updater())

    def gradient(self, k: int, done: simpy.Event) -> None:
        """Unit k's gradient is final when `done` fires (its reduce, and its offload where the
        optimizer reads it from host memory)."""
        if done.triggered or (self.inline and self.program.dp == 1):
            # Inline updates never wait for an offload, and one rank has nothing to reduce: the
            # gradient is final as the operator's backward ends (before the next one starts).
            self.final[k].succeed()
        else:
            done.callbacks.append(lambda _event: self.final[k].succeed())

    def run_ready_inline(self, *, wait_all: bool = False) -> Proc:
        """Inline updates: those whose gradients are final, in unit order (all of them, waiting for
        each, when `wait_all`: the end of the backward)."""
        while self.next_unit < len(self.units):
            event = self.final[self.next_unit]
            if not event.triggered:
                if not wait_all:
                    return
                yield event
            yield from self._update(self.next_unit)

    # -- processes -------------------------------------------------------------------------------
    def _updater(self) -> Proc:
        while self.next_unit < len(self.units):
            yield self.final[self.next_unit]
            yield from self._update(self.next_unit)

    def _update(self, k: int) -> Proc:
        program = self.program
        if self.on_gpu:
            seconds = gpu_step_seconds(self.plan, sum(self.units[k]))
            if seconds > 0:
                now = self.env.now
                program.links.compute.occupy(now, now + seconds, LABEL, 0.0)
                yield self.env.timeout(seconds)
        else:
            for n in self.units[k]:
                if self.streamed:
                    read = yield self.reads.get()
                    yield read
                    if not self.host_is_device:  # the gradient chunk, into the buffer's gradient region
                        yield program.move(n * self.param_bytes, program.res.d2h(program.rank), "d2h", LABEL)
                yield program.net.transfer(n * self.cpu_params, program.res.cpu_adam(), LABEL)
                yield self.to_write.put(n)
        self.next_unit = k + 1
        if self.next_unit == len(self.units):
            self.computed.succeed()

    def _reader(self) -> Proc:
        sim = self.sim
        for sizes in self.units:
            for n in sizes:
                yield self.buffers.get(1)
                sim.cpu_add(MemoryTerm.OPTIMIZER_SWAP_BUFFERS, n * 16)
                read = self._read_chunk(n)
                yield self.reads.put(read)
                yield read

    def _read_chunk(self, n: float) -> simpy.Event:
        """A chunk's reads into its buffer: the master, momentum and variance of `n` parameters."""
        program = self.program
        return program.move(n * STATE_BYTES_PER_PARAM, program.res.read(self.states, program.rank),
                            self.states.read_link, LABEL)

    def _writer(self) -> Proc:
        program, sim, res = self.program, self.sim, self.program.res
        for _ in range(self.num_chunks if not self.on_gpu else 0):
            n = yield self.to_write.get()
            writes = []
            if self.streamed:
                writes.append(program.move(n * STATE_BYTES_PER_PARAM, res.write(self.states, program.rank),
                                           self.states.write_link, LABEL))
            if self.write_params_to is not None:
                target = self.write_params_to
                route, link = ((res.staged_h2d(program.rank), "h2d") if target.on_device  # through the pool
                               else (res.write(target, program.rank), target.write_link))
                writes.append(program.move(n * self.param_bytes, route, link, LABEL))
            if writes:
                yield self.env.all_of(writes)
            if self.streamed:
                sim.cpu_remove(MemoryTerm.OPTIMIZER_SWAP_BUFFERS, n * 16)
                yield self.buffers.put(1)
            self._chunk_written()

    def _chunk_written(self) -> None:
        """A chunk's writes landed (chunks land in update order)."""
