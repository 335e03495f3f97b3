"""The optimizer step: on the GPU (HBM-bound), or streamed through the CPU in chunks (§4.3).

The step starts when every gradient has landed, so the network is idle and every rank starts it at
the same instant: it is simulated on its own, in a fresh environment with links of the same
capacities, and its outcome (duration, busy intervals, bytes, CPU buffer allocations) is merged into
the iteration's simulation at the time the step starts.

[Note: periodic optimizer] A 1T-parameter model streams thousands of identical chunks per rank.
Once the read / update / write pipeline is full it repeats with a fixed period: chunk k+1 sees
exactly what chunk k saw, shifted by the period. We simulate the pipeline with k, k+1 and k+2 full
chunks (k = 2 * buffers + 2, enough to fill it) plus the partial last chunk; when the two
differences in duration agree (to 1e-9 relative) the pipeline is periodic and the full count is an
exact affine extrapolation: duration, busy time, bytes; the Gantt chart's intervals and the CPU
buffer allocations of one period are repeated. When they disagree every chunk is simulated.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any

import simpy

from planner.cost.host_work import step_cpu_params_per_param
from planner.cost.memory import optimizer_chunk_buffer_bytes
from planner.cost.throughput import GPU_ADAM_BYTES_PER_PARAM
from planner.sim.network import Link, Network, collector_paused, scheduled_events
from planner.sim.resources import NodeResources
from planner.sim.workload import Workload
from planner.specs.errors import PlannerError
from planner.specs.memory_terms import MemoryTerm
from planner.specs.phases import Phase
from planner.specs.plan import Plan
from planner.specs.units import COMPUTE_BYTES

Proc = Generator[Any, Any, Any]
_PERIODIC_TOLERANCE = 1e-9


@dataclass(slots=True)
class OptimizerOutcome:
    """What the step did, in times relative to its start."""

    duration_s: float
    busy_s: list[float]
    amount: list[float]
    """Per link, in `NodeResources.links()` order."""
    intervals: list[list[tuple[float, float, str]]]
    link_bytes: dict[str, float]
    cpu_changes: list[tuple[float, MemoryTerm, float]] = field(default_factory=list)
    """(time, term, +/- bytes per node) of the CPU chunk buffers."""
    num_chunks: int = 0
    extrapolated: bool = False
    events: int = 0
    """SimPy events of the chunk pipelines simulated for it (planner/sim/engine.py `scheduled_events`)."""


def gpu_step_seconds(plan: Plan, params: float) -> float:
    hbm = plan.node.gpu_hbm_bytes_per_s
    if hbm <= 0:
        raise PlannerError(f"hardware {plan.node.name!r} has no gpu_hbm_gb_per_s; the simulator needs it to time "
                           "the GPU optimizer step (optimizer_states=gpu)")
    return params * GPU_ADAM_BYTES_PER_PARAM / hbm


def chunked_step(plan: Plan, work: Workload, num_ranks: int, *, detail: bool = True) -> OptimizerOutcome:
    """Simulate the CPU optimizer step of every simulated rank (see [Note: periodic optimizer]).

    `detail=False` skips repeating the period's busy intervals and CPU buffer changes (the Gantt
    chart's material); totals and the CPU peak are the same, since each period frees what it takes.
    """
    params = work.params_per_rank
    # The runtime cuts chunks of `optimizer_chunk_bytes / 16` fp32 elements (master, momentum,
    # variance, gradient: runtime/optim/streamed_optimizer.py), in either precision.
    chunk_params = optimizer_chunk_buffer_bytes(plan) / 16
    num_full = max(0, math.ceil(params / chunk_params) - 1)
    last = params - chunk_params * num_full
    k = 2 * plan.num_optimizer_buffers + 2
    if num_full <= k + 2:
        return _run(plan, work, num_ranks, [chunk_params] * num_full + [last]).outcome()
    runs = [_run(plan, work, num_ranks, [chunk_params] * n + [last]) for n in (k, k + 1, k + 2)]
    runs[2].events_before = runs[0].events()
    d1 = runs[1].duration_s - runs[0].duration_s
    d2 = runs[2].duration_s - runs[1].duration_s
    if abs(d1 - d2) > _PERIODIC_TOLERANCE * runs[2].duration_s:
        return _run(plan, work, num_ranks, [chunk_params] * num_full + [last]).outcome()
    return runs[2].extrapolate(runs[1], repeats=num_full - (k + 2), period_s=d2, window_chunk=k + 1, detail=detail)


class _Pipeline:
    """One stand-alone run of the chunk pipeline for all simulated ranks."""

    def __init__(self, plan: Plan, work: Workload, num_ranks: int, sizes: list[float]) -> None:
        self.plan, self.work, self.sizes = plan, work, sizes
        self.env = simpy.Environment()
        self.net = Network(self.env)
        self.res = NodeResources(plan, num_ranks)
        self._events: int | None = None
        self.events_before = 0
        """Events of runs simulated before this one for the same step (the shortest of three)."""
        self.link_bytes: dict[str, float] = {}
        self.cpu_changes: list[tuple[float, MemoryTerm, float]] = []
        self.chunk_start_s: list[float] = []
        """When rank 0 started reading each chunk."""
        procs = [self.env.process(self._rank(r)) for r in range(num_ranks)]
        with collector_paused():
            self.env.run(simpy.AllOf(self.env, procs))
        self.duration_s = self.env.now

    def _move(self, rank: int, nbytes: float, hops: Any, category: str) -> simpy.Event:
        if rank == 0:
            self.link_bytes[category] = self.link_bytes.get(category, 0.0) + nbytes
        return self.net.transfer(nbytes / self.plan.node.transfer_efficiency.at(nbytes), hops, Phase.OPTIMIZER)

    def _cpu(self, delta: float) -> None:
        self.cpu_changes.append((self.env.now, MemoryTerm.OPTIMIZER_SWAP_BUFFERS, delta * self.res.ranks_weight))

    def _rank(self, rank: int) -> Proc:
        env, res, placement = self.env, self.res, self.plan.placement
        b = COMPUTE_BYTES[self.plan.precision]
        states, grads, params = placement.optimizer_states, placement.gradients, placement.params
        streamed = states.staged  # the states stream through the chunk buffers from their tier's links
        copies = not self.plan.node.host_is_device
        cpu_params = step_cpu_params_per_param(self.plan)  # Adam and its host copies, per parameter
        # Read per parameter: master (unless the fp32 parameter shard is the master and lives
        # elsewhere... it then lives in the same tier), momentum, variance from the optimizer's tier,
        # the fp32 gradient from the gradients' tier; written back: the same minus the gradient,
        # plus the 16-bit compute copy of the parameter (runtime/optim/streamed_optimizer.py).
        state = 12
        separate_params = self.plan.precision != "fp32" or params != states
        buffers = simpy.Container(env, capacity=self.plan.num_optimizer_buffers, init=self.plan.num_optimizer_buffers)
        to_update: simpy.Store = simpy.Store(env)
        to_write: simpy.Store = simpy.Store(env)

        def reader() -> Proc:
            for n in self.sizes:
                yield buffers.get(1)
                if rank == 0:
                    self.chunk_start_s.append(env.now)
                if streamed:
                    self._cpu(n * 16)
                    reads = [self._move(rank, n * state, res.read(states, rank), states.read_link)]
                    if grads.staged:
                        reads.append(self._move(rank, n * 4, res.read(grads, rank), grads.read_link))
                    yield env.all_of(reads)
                yield to_update.put(n)

        def updater() -> Proc:
            for _ in self.sizes:
                n = yield to_update.get()
                yield self.net.transfer(n * cpu_params, res.cpu_adam(), Phase.OPTIMIZER)
                yield to_write.put(n)

        def writer() -> Proc:
            for _ in self.sizes:
                n = yield to_write.get()
                writes = []
                if streamed:
                    writes.append(self._move(rank, n * state, res.write(states, rank), states.write_link))
                if params.staged and separate_params:
                    writes.append(self._move(rank, n * b, res.write(params, rank), params.write_link))
                elif params.on_device and copies:
                    writes.append(self._move(rank, n * b, res.staged_h2d(rank), "h2d"))  # through the pool
                if writes:
                    yield env.all_of(writes)
                if streamed:
                    self._cpu(-n * 16)
                yield buffers.put(1)

        yield env.all_of([env.process(reader()), env.process(updater()), env.process(writer())])

    def links(self) -> list[Link]:
        return self.res.links()

    def outcome(self) -> OptimizerOutcome:
        links = self.links()
        return OptimizerOutcome(
            duration_s=self.duration_s,
            busy_s=[link.busy_s for link in links],
            amount=[link.amount for link in links],
            intervals=[list(link.intervals) for link in links],
            link_bytes=dict(self.link_bytes),
            cpu_changes=list(self.cpu_changes),
            num_chunks=len(self.sizes),
            events=self.events(),
        )

    def events(self) -> int:
        if self._events is None:
            self._events = scheduled_events(self.env)
        return self._events

    def extrapolate(self, shorter: _Pipeline, *, repeats: int, period_s: float, window_chunk: int,
                    detail: bool = True) -> OptimizerOutcome:
        """This run plus `repeats` more periods (see [Note: periodic optimizer])."""
        lo, hi = self.chunk_start_s[window_chunk - 1], self.chunk_start_s[window_chunk]
        shift = repeats * period_s

        def stretch_intervals(intervals: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
            if not detail:
                return []
            before = [(a, min(b, lo), lab) for a, b, lab in intervals if a < lo]
            window = [(max(a, lo), min(b, hi), lab) for a, b, lab in intervals if a < hi and b > lo]
            after = [(max(a, hi) + shift, b + shift, lab) for a, b, lab in intervals if b > hi]
            # Window pieces keep their place; the repeats fill the gap before the shifted tail.
            repeated = [(a + s, b + s, lab) for s in shifts for a, b, lab in window]
            return before + window + repeated + after

        shifts = [m * period_s for m in range(1, repeats + 1)]  # each copy's, once (thousands of copies)
        cpu = [(t, n, d) for t, n, d in self.cpu_changes if t < hi]
        if detail:
            in_window = [(t, n, d) for t, n, d in self.cpu_changes if lo <= t < hi]
            cpu += [(t + s, n, d) for s in shifts for t, n, d in in_window]
        cpu += [(t + shift, n, d) for t, n, d in self.cpu_changes if t >= hi]
        links, short_links = self.links(), shorter.links()
        return OptimizerOutcome(
            duration_s=self.duration_s + shift,
            busy_s=[a.busy_s + repeats * (a.busy_s - b.busy_s) for a, b in zip(links, short_links, strict=True)],
            amount=[a.amount + repeats * (a.amount - b.amount) for a, b in zip(links, short_links, strict=True)],
            intervals=[stretch_intervals(link.intervals) for link in links],
            link_bytes={k: v + repeats * (v - shorter.link_bytes.get(k, 0.0)) for k, v in self.link_bytes.items()},
            cpu_changes=sorted(cpu, key=itemgetter(0)),
            num_chunks=len(self.sizes) + repeats,
            extrapolated=True,
            events=self.events() + shorter.events() + self.events_before,
        )


def _run(plan: Plan, work: Workload, num_ranks: int, sizes: list[float]) -> _Pipeline:
    return _Pipeline(plan, work, num_ranks, sizes)
