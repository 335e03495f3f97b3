"""The schedule of one training iteration as SimPy processes (docs/method.md §4).

[Note: representative rank] Data-parallel ranks run the same program on equal shares, so in
lockstep: every GPU of a node issues the same transfer at the same instant, and every node does what
every other node does. Simulating one rank per cluster whose flows weigh `gpus_per_node` on the
node-wide links (host-memory fabric, NVMe, CPU optimizer) and `mp` on the node's network port gives
the same times as simulating each GPU: max-min fair sharing hands k identical flows k equal shares,
and one flow of weight k receives exactly one of those shares. `Simulation(plan, ranks="explicit")`
simulates every GPU of a node as its own process for the test that checks this equivalence.

Mechanisms, each as the runtime does it:
- prefetch (§4.3): before operator i runs, NVMe->CPU starts for i+3, CPU->GPU for i+2 and the
  all-gather for i+1 (depth 3); stage lookaheads for depth d are (d, max(min(d,2), d-1),
  max(min(d,1), d-2)); depth 0 fetches operator i only when i is next, and waits for its gradients;
- each rank moves 1/dp of each tensor-parallel slice over its own host link and NVMe share (§4.2)
  and the all-gather assembles the slice;
- backward: while operator i computes, the reduce-scatter of the operator before it and the offload
  of the one before that run (at most two gradient buckets in flight, §4.3);
- recompute inputs: one block input saved every `recompute_interval` blocks (eq. 3), copied to
  the CPU when placed there and fetched back one segment ahead of its recompute;
- the optimizer step streams chunks through `num_optimizer_buffers` pinned buffers: read k+1,
  update k, write k-1 at once (§4.3); with `optimizer_step: in_backward` each unit is updated
  during the backward instead, as soon as its gradient is final (in_backward.py).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal

import simpy

from planner.cost.collectives import (
    collectives_per_operator,
    data_parallel_ring,
    latency_s,
    tensor_parallel_ring,
)
from planner.cost.context_parallel import exposed_per_layer_s
from planner.cost.fp8 import linear_speedup, tensor_parallel_byte_share
from planner.cost.host_link import stages_host_shards
from planner.cost.host_work import host_param_read_bytes
from planner.cost.kernels import achievable_hbm_bytes_per_s, fused_attention_flops_per_s
from planner.cost.memory import (
    STORED_GRADIENT_BYTES,
    host_buffers,
    logits_bytes,
    resident_state_terms,
    stores_gradients,
)
from planner.sim.in_backward import BackwardUpdates
from planner.sim.network import Link, Network, collector_paused, scheduled_events
from planner.sim.optimizer import OptimizerOutcome, chunked_step, gpu_step_seconds
from planner.sim.overlapped import OverlappedStep
from planner.sim.resources import NodeResources
from planner.sim.tiers import TierTracker
from planner.sim.workload import (
    Step,
    Workload,
    build_workload,
    forward_tail_kept,
    step_elementwise_bytes,
    step_flops,
    step_fused_flops,
)
from planner.specs.memory_terms import ALLOCATOR_SLACK_FRACTION, MemoryTerm
from planner.specs.phases import Phase
from planner.specs.plan import Plan
from planner.specs.tiers import GPU, HOST, TIERS, Tier
from planner.specs.training_loop import step_overlaps_forward

Ranks = Literal["representative", "explicit"]
Proc = Generator[Any, Any, Any]


def stage_lookahead(depth: int, hops: int) -> int:
    """How many operators ahead a fetch stage starts (see the module docstring): by the hops between
    the tier it reads from and the GPU (`Tier.hops_to_gpu`: 2 from NVMe, 1 from host memory), 0 for
    the all-gather."""
    return max(min(depth, hops + 1), depth - (2 - hops))


@dataclass(frozen=True, slots=True)
class FetchStage:
    """One stage of a rank's prefetch pipeline: a shard's copy out of `source` over its read link,
    or (`source` None) the all-gather of the slice."""

    source: Tier | None
    lookahead: int
    lands_in_host: bool = False
    """The copy lands in a pinned host swap buffer (host memory is not the compute's), not on the GPU."""


class Simulation:
    """One iteration of `plan`; `run()` returns the finished simulation for `report.build_result`."""

    def __init__(self, plan: Plan, *, ranks: Ranks = "representative", workload: Workload | None = None,
                 optimizer: OptimizerOutcome | None = None) -> None:
        """`workload` replaces the plan's operator trace, `optimizer` a precomputed chunked CPU step
        (both for tests and for samples.py, which reuses one optimizer step for several layer counts)."""
        self.plan = plan
        self.work = workload if workload is not None else build_workload(plan)
        self.env = simpy.Environment()
        self.net = Network(self.env)
        num_ranks = 1 if ranks == "representative" else plan.cluster.gpus_per_node
        self.res = NodeResources(plan, num_ranks)
        held = frozenset(host_buffers(plan))  # pinned once by the runtime: placed at time 0 (`resident_terms`)
        self.trackers = {tier: TierTracker(tier, tier.capacity_bytes(plan.node), tier.scope,
                                           held=held if tier is HOST else frozenset(),
                                           slack_fraction=ALLOCATOR_SLACK_FRACTION if tier is GPU else 0.0)
                         for tier in TIERS}
        """Memory in use per tier over time, in the bill's units (`Tier.scope`)."""
        self.gpu, self.cpu = self.trackers[GPU], self.trackers[HOST]
        """The trackers buffers are charged to: the GPU's memory (rank 0's) and host memory (the node's)."""
        self.link_bytes: dict[str, float] = {}
        """Bytes per GPU per link category (`prediction.link_bytes`, docs/plan-format.md), from rank 0."""
        self.phase_end_s: dict[Phase, float] = {}
        self.unit_start_s: dict[tuple[Phase, int], float] = {}
        """When rank 0's compute starts on each repeating unit of blocks (a recompute segment, or a
        block without recompute), keyed (FORWARD | BACKWARD, unit): the marks the periodic
        extrapolation of the timelines cuts at ([Note: periodic timelines] in periodic.py)."""
        self.largest_gpu_allocation_bytes = 0.0
        self.events = 0
        """SimPy events the run scheduled, the optimizer step's included (`scheduled_events`)."""
        self.ranks = [RankProgram(self, r) for r in range(num_ranks)]
        self.optimizer = optimizer
        """Ignored with `optimizer_step: in_backward` (the updates are part of the backward)."""
        self._optimizer_done: simpy.Event | None = None
        self._place_residents()

    def run(self) -> Simulation:
        procs = [self.env.process(rank.iteration()) for rank in self.ranks]
        with collector_paused():
            self.env.run(simpy.AllOf(self.env, procs))
        self.events = scheduled_events(self.env) + (self.optimizer.events if self.optimizer is not None else 0)
        for tracker in self.trackers.values():
            tracker.close_window()
        return self

    @property
    def iteration_time_s(self) -> float:
        return self.phase_end_s[Phase.OPTIMIZER]

    def links(self) -> list[Link]:
        return self.res.links()

    def log(self) -> list[tuple[str, float, float, str]]:
        """Every busy interval of every link as (resource, start, end, label), in time order."""
        entries = [(link.name, a, b, label) for link in self.links() for a, b, label in link.intervals]
        return sorted(entries, key=lambda e: (e[1], e[2], e[0]))

    # -- accounting used by the rank programs ------------------------------------------------
    def count(self, rank: int, category: str, nbytes: float) -> None:
        if rank == 0:
            self.link_bytes[category] = self.link_bytes.get(category, 0.0) + nbytes

    def gpu_add(self, rank: int, term: MemoryTerm, nbytes: float, *, single: bool = False) -> None:
        """GPU memory is tracked for rank 0 (every GPU holds the same)."""
        if rank == 0:
            self.gpu.add(self.env.now, term, nbytes)
            if single:
                self.largest_gpu_allocation_bytes = max(self.largest_gpu_allocation_bytes, nbytes)

    def gpu_remove(self, rank: int, term: MemoryTerm, nbytes: float) -> None:
        if rank == 0:
            self.gpu.remove(self.env.now, term, nbytes)

    def cpu_add(self, term: MemoryTerm, nbytes: float) -> None:
        """`nbytes` for one simulated rank; the node holds it for every GPU the rank stands for."""
        self.cpu.add(self.env.now, term, nbytes * self.res.ranks_weight)

    def cpu_remove(self, term: MemoryTerm, nbytes: float) -> None:
        self.cpu.remove(self.env.now, term, nbytes * self.res.ranks_weight)

    def cpu_optimizer_step(self) -> simpy.Event:
        """The chunked CPU step of all ranks, simulated once and merged (engine runs it in lockstep)."""
        if self._optimizer_done is None:
            start = self.env.now
            if self.optimizer is None:
                self.optimizer = chunked_step(self.plan, self.work, len(self.ranks))
            outcome = self.optimizer
            for link, busy_s, amount, intervals in zip(self.links(), outcome.busy_s, outcome.amount, outcome.intervals,
                                                       strict=True):
                link.busy_s += busy_s
                link.amount += amount
                link.intervals += [(start + a, start + b, label) for a, b, label in intervals]
            for name, nbytes in outcome.link_bytes.items():
                self.count(0, name, nbytes)
            held = self.cpu.held  # the pinned chunk buffers are placed at time 0: their changes add nothing
            for t, term, delta in outcome.cpu_changes:
                if term not in held:
                    self.cpu.add(start + t, term, delta)
            self._optimizer_done = self.env.timeout(outcome.duration_s)
        return self._optimizer_done

    def _place_residents(self) -> None:
        """Partitioned model states live in their tier for the whole iteration (memory.py, eq. 2)."""
        for tier, term, nbytes in resident_terms(self.plan):
            self.trackers[tier].place(term, nbytes)


def run_unwatched(proc: Proc) -> None:
    """Run `proc` as a SimPy process nobody waits for, without the process's own two events.

    [Note: unwatched processes] `env.process(proc)` schedules an event that starts the generator
    later in the same instant and another when it returns; a prefetch runs once per operator and
    stage set, so those two are a tenth of a tiled plan's events. `proc` must begin by waiting for
    an event not yet triggered (asserted): its first step then only adds a callback to that event,
    here at once or there at the start event, and every later step runs from the callbacks of the
    same events in the same order as SimPy's process would run it: the same timeline, fewer events.
    Events of this simulator never fail, so none is thrown into the generator."""
    first = proc.send(None)
    assert not first.triggered, "an unwatched process must begin by waiting"

    def resume(event: simpy.Event) -> None:
        try:
            event = proc.send(event._value)  # noqa: SLF001 - SimPy's own field, as its process reads it
            while event.callbacks is None:  # processed already: SimPy's process resumes at once too
                event = proc.send(event._value)  # noqa: SLF001
        except StopIteration:
            return
        event.callbacks.append(resume)

    first.callbacks.append(resume)


class _Memo(dict):
    """An efficiency curve's values by size: a trace repeats a handful of sizes tens of thousands of
    times, and a dict look-up costs a fifth of the curve's log-interpolation."""

    def __init__(self, curve: Callable[[float], float]) -> None:
        super().__init__()
        self.curve = curve

    def __missing__(self, size: float) -> float:
        value = self[size] = self.curve(size)
        return value

    __call__ = dict.__getitem__


def resident_terms(plan: Plan) -> list[tuple[Tier, MemoryTerm, float]]:
    """(tier, term, bytes per tracker: per GPU, or per node for the per-node tiers) of the resident
    states and the host buffers the runtime holds all iteration (as the bill counts them)."""
    per_node = plan.cluster.gpus_per_node
    held = [(HOST, term, nbytes) for term, nbytes in host_buffers(plan).items()]
    return [(tier, term, per_gpu * (1 if tier.per_gpu else per_node))
            for tier, term, per_gpu in (*resident_state_terms(plan), *held)]


class RankProgram:
    """What one simulated rank does: the forward/backward trace, then the optimizer step."""

    def __init__(self, sim: Simulation, rank: int) -> None:
        self.sim, self.rank = sim, rank
        self.env, self.net, self.res = sim.env, sim.net, sim.res
        plan, work = sim.plan, sim.work
        self.links = self.res.ranks[rank]
        self.dp = plan.data_parallel_degree
        self.mp = plan.model_parallel_degree
        self.spans_nodes = plan.num_nodes > 1 and self.dp > plan.cluster.gpus_per_node // self.mp
        self.b = work.param_bytes
        node = plan.node
        self.transfer_eff = _Memo(node.transfer_efficiency.at)
        self.matmul_eff = _Memo(node.matmul_efficiency.at)
        self.hbm_bytes_per_s = achievable_hbm_bytes_per_s(node)
        self.fused_flops_per_s = fused_attention_flops_per_s(plan)
        self.operator_overhead_s = node.operator_overhead_s
        self.fp8_speedup = linear_speedup(plan.fp8_matmuls, node)
        self.backward_matmul_slowdown = node.backward_matmul_slowdown
        dp_ring = data_parallel_ring(plan)
        per_operator = collectives_per_operator(plan)
        self.latency_s = {kind: latency_s(dp_ring, kind, node) * (1.0 if kind == "all_reduce" else per_operator)
                          for kind in ("all_gather", "reduce_scatter", "all_reduce")}
        """Each data-parallel collective's latency (planner/cost/collectives.py [Note: the alpha-beta collective]);
        an operator's ZeRO-3 gather and reduce-scatter pay it once per parameter where the plan gathers per
        parameter ([Note: per-parameter collectives])."""
        self.tp_latency_s = latency_s(tensor_parallel_ring(plan), "all_reduce", node)
        self.tp_byte_share = {backward: tensor_parallel_byte_share(plan, backward) for backward in (False, True)}
        """fp8's forward gathers move fp8 (planner/cost/fp8.py [Note: fp8 casts]); 1 without fp8."""
        self.ring_exposed_s = exposed_per_layer_s(plan)  # (forward, backward) per layer, context parallel
        """Linears' matmul speed-up in fp8 ([Note: fp8 matmuls] in planner/cost/fp8.py); 1 without."""
        placement = plan.placement
        self.host_is_device = node.host_is_device
        """[Note: the CPU machine] in runtime/transfer/stores.py: host memory is the device's, nothing is copied."""
        depth = plan.prefetch_depth
        self.stages: list[FetchStage] = []
        """A shard's copies over each link between its tier and the memory the compute uses, then the all-gather."""
        if "params" in plan.partitioned:
            route = placement.params.route(node)  # where it lies, then each tier it crosses to the compute's memory
            self.stages = [FetchStage(tier, stage_lookahead(depth, tier.hops_to_gpu), lands_in_host=tier.via in route)
                           for tier in route]
            if self.dp > 1:
                self.stages.append(FetchStage(None, stage_lookahead(depth, 0)))
        self.layers = plan.model.num_layers
        self.logits_bytes = logits_bytes(plan) if plan.model.vocab_size else 0.0
        self.unit = plan.recompute_interval or 1
        """Blocks per repeating unit: a recompute segment, or a block without recompute."""
        self.unit_opening = Phase.RECOMPUTE if plan.recompute_interval else Phase.BACKWARD
        """A unit's work in the backward pass starts with this."""
        self.slice_factor = self.b / self.mp
        """Bytes per parameter of an operator's tensor-parallel slice."""
        self.shard_read_factor = host_param_read_bytes(plan) / self.b
        """A parameter shard's stored width over the compute's: 2 where a mixed-precision plan reads its
        fp32 master and casts it on the device ([Note: the resident step's cast] in planner/cost/host_work.py)."""
        self.synchronous_grads = depth == 0
        self.reduces_shards_only = bool(plan.partitioned & {"gradients", "optimizer_states"})
        """Each rank keeps only its shard of the reduced gradients (a reduce-scatter, not an all-reduce)."""
        self.stores_gradients = stores_gradients(plan)
        self.offloads_gradients = self.stores_gradients and not placement.gradients.is_compute_memory(node)
        """Each gradient shard is stored off the compute's memory (not kept where the compute has it, nor
        handed to the in-backward update)."""
        self.kept = forward_tail_kept(work.steps, depth, self.layers) if self.stages else {}
        """Forward steps whose parameters stay gathered for their backward step ([Note: the forward's
        tail stays gathered, simulated] in workload.py)."""
        self.kept_backward = frozenset(self.kept.values())
        self._triggers: dict[tuple[int, int], simpy.Event] = {}
        self._triggered_upto = [-1] * len(self.stages)
        self._ready: dict[int, simpy.Event] = {}
        self._rs_done: list[simpy.Event] = []
        self._grad_done: list[simpy.Event] = []
        self._inputs_ready: dict[int, simpy.Event] = {}
        self.updates = BackwardUpdates(self) if plan.optimizer_step == "in_backward" else None
        """The optimizer step in backward ([Note: the optimizer step in backward, simulated])."""
        self.overlap = OverlappedStep(self) if step_overlaps_forward(plan) else None
        """The previous step, overlapping this forward ([Note: the overlapped step, simulated])."""

    # -- transfers ---------------------------------------------------------------------------
    def _fetch_route(self, tier: Tier, rank: int) -> Any:
        """A parameter shard's way over `tier`'s link: host shards of a staged plan through the pool's
        memcpy ([Note: staged and pinned host copies] in planner/cost/host_link.py); NVMe reads to a
        device land in pinned slots, so the hop out of host memory is the link's alone."""
        plan = self.sim.plan
        if tier == plan.placement.params and tier.host_memory and stages_host_shards(plan):
            return self.res.staged_h2d(rank)
        return self.res.read(tier, rank)

    def _host_route(self, staged: Any, pinned: Any) -> Any:
        """A recompute input's way between the GPU and host memory: through the pool when staged."""
        return (staged if stages_host_shards(self.sim.plan) else pinned)(self.rank)

    def move(self, nbytes: float, hops: Any, category: str, label: str) -> simpy.Event:
        """Transfer `nbytes` at the link rates scaled by the size's efficiency."""
        self.sim.count(self.rank, category, nbytes)
        if nbytes <= 0:
            return self.net.transfer(0, hops, label)
        return self.net.transfer(nbytes / self.transfer_eff(nbytes), hops, label)

    def _compute(self, flops: float, matmul_flops: float, label: Phase, elementwise_bytes: float = 0.0,
                 op_params: float = 0.0, fused_flops: float = 0.0) -> simpy.Event:
        """`flops` in matmuls of `matmul_flops` each, at the efficiency of that size, then the
        operator's memory-bound work at the achievable memory bandwidth ([Note: elementwise work])
        and its fused attention at that kernel's rate (planner/cost/kernels.py), and the runtime's fixed
        cost per operator (`NodeSpec.operator_overhead_s`). In fp8 the block linears' share of `flops`
        (`op_params` weights; 0 for the output head) runs at the fp8 rate; the attention core does not."""
        if self.fp8_speedup != 1.0 and flops > 0:
            linear = min(flops, (flops / matmul_flops) * 2 * self.sim.work.tokens_per_gpu * op_params)
            flops = flops - linear + linear / self.fp8_speedup
        seconds = flops / (self.links.compute.capacity * self.matmul_eff(matmul_flops)) if flops > 0 else 0.0
        if label is Phase.BACKWARD:
            seconds *= self.backward_matmul_slowdown
        if elementwise_bytes > 0 and self.hbm_bytes_per_s > 0:
            seconds += elementwise_bytes / self.hbm_bytes_per_s
        if fused_flops > 0:
            seconds += fused_flops / self.fused_flops_per_s
            flops += fused_flops
        seconds += self.operator_overhead_s
        now = self.env.now
        if seconds > 0:
            self.links.compute.occupy(now, now + seconds, label, flops)
        return self.env.timeout(seconds)

    def _collective_bytes(self, tensor_bytes: float) -> float:
        """What each rank receives in a ring all-gather / reduce-scatter of `tensor_bytes`."""
        return tensor_bytes * (self.dp - 1) / self.dp

    def _collective(self, nbytes: float, hops: Any, category: str, label: str, latency: float) -> simpy.Event:
        """A collective: its latency, then its bytes at the route's rates. The latency replaces the
        size-keyed transfer efficiency the copies pay (planner/cost/collectives.py)."""
        self.sim.count(self.rank, category, nbytes)
        return self.net.transfer(nbytes, hops, label, delay_s=latency)

    # -- prefetch pipeline ---------------------------------------------------------------------
    def _trigger(self, stage: int, j: int) -> simpy.Event:
        key = (stage, j)
        event = self._triggers.get(key)
        if event is None:
            event = self._triggers[key] = self.env.event()
        return event

    def _advance_triggers(self, i: int, num_steps: int) -> None:
        for index, stage in enumerate(self.stages):
            upto = min(i + stage.lookahead, num_steps - 1)
            for j in range(self._triggered_upto[index] + 1, upto + 1):
                if index == 0:
                    self._ready[j] = self.env.event()
                    if j in self.kept_backward:  # still gathered since its forward: nothing to read
                        self._ready[j].succeed()
                    else:
                        run_unwatched(self._fetch(self.sim.work.steps[j]))  # waits for the trigger made next
                event = self._trigger(index, j)
                if not event.triggered:
                    event.succeed()
            self._triggered_upto[index] = max(self._triggered_upto[index], upto)

    def _fetch(self, step: Step) -> Proc:
        """Bring step's tensor-parallel slice of parameters to the GPU (§4.2, §4.3)."""
        sim, rank, j = self.sim, self.rank, step.index
        slice_bytes = step.op.num_params / self.mp * self.b
        shard_bytes = slice_bytes / self.dp
        read_bytes = shard_bytes * self.shard_read_factor  # over the links, at the stored width
        label = step.phase
        gathers = self.stages[-1].source is None
        in_host_buffer = False  # the shard waits in a pinned host swap buffer
        for index, stage in enumerate(self.stages):
            trigger = self._trigger(index, j)
            if not trigger.processed:
                yield trigger
            del self._triggers[(index, j)]
            if index == 0 and self.overlap is not None and step.phase is Phase.FORWARD:
                yield from self.overlap.wait_for_unit(j)  # nothing reads a shard before its update
            tier = stage.source
            if tier is None:  # the all-gather
                sim.gpu_add(rank, MemoryTerm.MSWM, slice_bytes, single=True)
                yield self._collective(self._collective_bytes(slice_bytes),
                                       self.res.collective(rank, spans_nodes=self.spans_nodes), "all_gather", label,
                                       self.latency_s["all_gather"])
                if index > 0:
                    sim.gpu_remove(rank, MemoryTerm.PREFETCH_SHARD_STAGING, shard_bytes)
                continue
            # The shard lands in host memory on its way (a swap buffer), or in a shard-sized buffer of
            # the compute's memory; without a gather (dp = 1) that buffer is the slice itself.
            if stage.lands_in_host:
                sim.cpu_add(MemoryTerm.PARAM_SWAP_BUFFERS, shard_bytes)
            elif gathers:
                sim.gpu_add(rank, MemoryTerm.PREFETCH_SHARD_STAGING, shard_bytes)
            else:
                sim.gpu_add(rank, MemoryTerm.MSWM, slice_bytes, single=True)
            yield self.move(read_bytes, self._fetch_route(tier, rank), tier.read_link, label)
            if in_host_buffer:
                sim.cpu_remove(MemoryTerm.PARAM_SWAP_BUFFERS, shard_bytes)
            in_host_buffer = stage.lands_in_host
        self._ready.pop(j).succeed()

    # -- the iteration -------------------------------------------------------------------------
    def iteration(self) -> Proc:
        sim, steps, updates = self.sim, self.sim.work.steps, self.updates
        # The runtime starts the in-backward update's read-ahead once the forward has started the
        # fetch of its last operator (runtime/optim/streamed_optimizer.py), else when the backward begins.
        last_forward = max((s.index for s in steps if s.phase is Phase.FORWARD), default=-1)
        depth = sim.plan.prefetch_depth
        backward_begun = False
        if self.overlap is not None:
            self.overlap.begin()
        for step in steps:
            i = step.index
            if step.phase is not Phase.FORWARD and not backward_begun:
                backward_begun = True
                if self.overlap is not None:
                    yield from self.overlap.drain()  # the backward's read-ahead drains the step first
                self._record_phase_end(Phase.FORWARD)
            self._advance_triggers(i, len(steps))
            if updates is not None and not updates.begun and (
                    backward_begun or (depth > 0 and i + depth >= last_forward)):
                updates.begin()
            yield from self._step(step)
        yield simpy.AllOf(self.env, self._grad_done)
        if updates is not None:
            if updates.inline:
                yield from updates.run_ready_inline(wait_all=True)
            yield updates.computed
        self._record_phase_end(Phase.BACKWARD)
        if self.rank == 0:
            for tracker in sim.trackers.values():
                tracker.close_window()
        if updates is not None:
            yield updates.written  # `optimizer.step()` waits for the updates' last writes
            yield from self._gather_updated_params()
        else:
            yield from self._optimizer_step()
        self._record_phase_end(Phase.OPTIMIZER)

    def _step(self, step: Step) -> Proc:
        """One trace step: open its block, wait for its parameters, compute, release them, start
        its gradients' reduction, close its block."""
        sim, steps, i = self.sim, self.sim.work.steps, step.index
        op, blk, phase = step.op, step.block, step.phase
        first_of_block = i == 0 or steps[i - 1].block != blk or steps[i - 1].phase is not phase
        last_of_block = i == len(steps) - 1 or steps[i + 1].block != blk or steps[i + 1].phase is not phase
        in_blocks = 0 <= blk < self.layers
        if in_blocks and first_of_block:
            yield from self._open_block(step)
        if self.overlap is not None and phase is Phase.FORWARD:  # the step's Adam shares the cores
            yield from self.overlap.run_until(i)
        if i in self._ready:
            yield self._ready[i]
        if self.updates is not None and self.updates.inline:  # gradients final by now: the runtime's hooks ran
            yield from self.updates.run_ready_inline()
        head = blk == self.layers
        if head and first_of_block and phase is Phase.FORWARD:  # the loss's logits, until the head's backward ends
            sim.gpu_add(self.rank, MemoryTerm.LOGITS, self.logits_bytes)
        flops = step_flops(step)
        if phase is Phase.BACKWARD and op.has_grads:
            yield from self._open_gradient_bucket(op.num_params * self.slice_factor)
        if (in_blocks and first_of_block and blk % self.unit == 0 and self.rank == 0
                and phase in (Phase.FORWARD, self.unit_opening)):
            sim.unit_start_s[Phase.FORWARD if phase is Phase.FORWARD else Phase.BACKWARD, blk // self.unit] = self.env.now
        yield self._compute(flops, op.flops_per_gpu, phase, step_elementwise_bytes(step),
                            0.0 if head else op.num_params, step_fused_flops(step))  # the head stays 16-bit
        if step_fused_flops(step) and self.ring_exposed_s != (0.0, 0.0):
            # The ring's KV sends beyond the attention core they overlap (planner/cost/context_parallel.py).
            yield self.env.timeout(self.ring_exposed_s[1 if phase is Phase.BACKWARD else 0])
        if op.tp_all_reduce:
            activation = sim.work.tp_all_reduce_bytes * self.tp_byte_share[phase is Phase.BACKWARD]
            yield self._collective(2 * activation * (self.mp - 1) / self.mp, self.res.tensor_parallel(self.rank),
                                   "tensor_parallel", phase, self.tp_latency_s)
        if self.stages and i not in self.kept:
            sim.gpu_remove(self.rank, MemoryTerm.MSWM, op.num_params * self.slice_factor)
        if phase is Phase.BACKWARD and op.has_grads:
            yield from self._start_reduction(op.num_params * self.slice_factor, phase)
        if in_blocks and last_of_block:
            self._close_block(step)
        elif head and last_of_block and phase is Phase.BACKWARD:
            sim.gpu_remove(self.rank, MemoryTerm.LOGITS, self.logits_bytes)

    def _open_block(self, step: Step) -> Proc:
        """A block's forward (saving its recompute input first) or recompute (restoring it first) takes
        the block's activations."""
        ci, work = self.sim.plan.recompute_interval, self.sim.work
        if step.phase is Phase.FORWARD:
            if ci and step.block % ci == 0:
                self._save_recompute_input(step.segment)
            self.sim.gpu_add(self.rank, MemoryTerm.AWM, work.block_activation_bytes)
        elif step.phase is Phase.RECOMPUTE:
            if step.block % ci == 0:
                yield from self._restore_recompute_input(step.segment)
            self.sim.gpu_add(self.rank, MemoryTerm.AWM, work.block_activation_bytes)
        elif step.phase is Phase.BACKWARD and work.recompute_working_bytes:  # what the block recomputes
            self.sim.gpu_add(self.rank, MemoryTerm.AWM, work.recompute_working_bytes)

    def _close_block(self, step: Step) -> None:
        """A block's backward frees its activations and its recompute input; a forward with recompute
        frees the activations (the recompute makes them again)."""
        sim, plan, work = self.sim, self.sim.plan, self.sim.work
        ci = plan.recompute_interval
        if step.phase is Phase.BACKWARD:
            sim.gpu_remove(self.rank, MemoryTerm.AWM, work.block_activation_bytes + work.recompute_working_bytes)
            if ci and step.block % ci == 0:
                if self.host_is_device and not plan.placement.recompute_inputs.on_device:
                    sim.cpu_remove(MemoryTerm.RECOMPUTE_INPUTS, work.recompute_input_bytes)
                else:
                    sim.gpu_remove(self.rank, MemoryTerm.RECOMPUTE_INPUTS, work.recompute_input_bytes)
        elif step.phase is Phase.FORWARD and ci:
            sim.gpu_remove(self.rank, MemoryTerm.AWM, work.block_activation_bytes)

    def _open_gradient_bucket(self, slice_bytes: float) -> Proc:
        """Take the bucket an operator's gradients are computed into."""
        k = len(self._rs_done)  # operators with gradients before this one in the backward
        if not self.synchronous_grads:
            # At most the previous operator's reduce-scatter and the one before's offload may
            # still run while this one computes (§4.3).
            if k >= 2:
                yield self._rs_done[k - 2]
            if k >= 3:
                yield self._grad_done[k - 3]
        self.sim.gpu_add(self.rank, MemoryTerm.REDUCE_SCATTER_BUFFER, slice_bytes, single=True)

    def _start_reduction(self, slice_bytes: float, label: Phase) -> Proc:
        """Reduce the operator's gradients in the background (at depth 0: wait for it)."""
        reduced = self.env.event()
        grads = self.env.process(self._reduce_gradients(slice_bytes, reduced, label))
        if self.updates is not None:
            self.updates.gradient(len(self._rs_done), grads)
        self._rs_done.append(reduced)
        self._grad_done.append(grads)
        if self.synchronous_grads:
            yield grads

    def _record_phase_end(self, phase: Phase) -> None:
        if self.rank == 0 and phase not in self.sim.phase_end_s:
            self.sim.phase_end_s[phase] = self.env.now

    # -- recompute inputs ----------------------------------------------------------------------
    def _save_recompute_input(self, segment: int) -> None:
        sim, nbytes = self.sim, self.sim.work.recompute_input_bytes
        on_device = sim.plan.placement.recompute_inputs.on_device
        if not on_device and self.host_is_device:
            sim.cpu_add(MemoryTerm.RECOMPUTE_INPUTS, nbytes)  # saved where it lies: no copy
            return
        sim.gpu_add(self.rank, MemoryTerm.RECOMPUTE_INPUTS, nbytes)
        if on_device:
            return

        def offload() -> Proc:
            yield self.move(nbytes, self._host_route(self.res.staged_d2h, self.res.d2h), "d2h", Phase.FORWARD)
            sim.gpu_remove(self.rank, MemoryTerm.RECOMPUTE_INPUTS, nbytes)
            sim.cpu_add(MemoryTerm.RECOMPUTE_INPUTS, nbytes)

        self.env.process(offload())

    def _restore_recompute_input(self, segment: int) -> Proc:
        """Wait for this segment's recompute input on the GPU; start fetching the previous segment's."""
        if self.sim.plan.placement.recompute_inputs.on_device or self.host_is_device:
            return
        if segment not in self._inputs_ready:
            self._inputs_ready[segment] = self.env.process(self._fetch_recompute_input())
        if segment > 0:
            self._inputs_ready[segment - 1] = self.env.process(self._fetch_recompute_input())
        yield self._inputs_ready.pop(segment)

    def _fetch_recompute_input(self) -> Proc:
        sim, nbytes = self.sim, self.sim.work.recompute_input_bytes
        sim.gpu_add(self.rank, MemoryTerm.RECOMPUTE_INPUTS, nbytes)
        yield self.move(nbytes, self._host_route(self.res.staged_h2d, self.res.h2d), "h2d", Phase.RECOMPUTE)
        sim.cpu_remove(MemoryTerm.RECOMPUTE_INPUTS, nbytes)

    # -- gradients -----------------------------------------------------------------------------
    def _reduce_gradients(self, slice_bytes: float, reduced: simpy.Event, label: Phase) -> Proc:
        """Reduce-scatter one operator's gradients, then offload this rank's shard (§4.3)."""
        sim, plan, rank = self.sim, self.sim.plan, self.rank
        route = self.res.collective(rank, spans_nodes=self.spans_nodes)
        if self.dp > 1:
            if self.reduces_shards_only:  # ZeRO-1 needs only its shard reduced
                yield self._collective(self._collective_bytes(slice_bytes), route, "reduce_scatter", label,
                                       self.latency_s["reduce_scatter"])
            else:  # plain data parallel: all-reduce = reduce-scatter + all-gather
                yield self._collective(2 * self._collective_bytes(slice_bytes), route, "reduce_scatter", label,
                                       self.latency_s["all_reduce"])
        sim.gpu_remove(rank, MemoryTerm.REDUCE_SCATTER_BUFFER, slice_bytes)
        reduced.succeed()
        if not self.offloads_gradients:
            return  # kept where the compute has it, or not stored (the in-backward update copies it: in_backward.py)
        tier, shard = plan.placement.gradients, slice_bytes / self.dp
        if not self.host_is_device:
            sim.gpu_add(rank, MemoryTerm.GRADIENT_OFFLOAD_STAGING, shard)
            yield self.move(shard, self.res.landed_d2h(rank), "d2h", label)
            sim.gpu_remove(rank, MemoryTerm.GRADIENT_OFFLOAD_STAGING, shard)
        if tier.staged:  # staged and written as the fp32 shard the step reads back
            stored = shard * STORED_GRADIENT_BYTES / self.b
            sim.cpu_add(MemoryTerm.GRADIENT_SWAP_BUFFERS, stored)
            yield self.move(stored, self.res.write(tier, rank), tier.write_link, label)
            sim.cpu_remove(MemoryTerm.GRADIENT_SWAP_BUFFERS, stored)

    # -- optimizer -----------------------------------------------------------------------------
    def _optimizer_step(self) -> Proc:
        plan, work = self.sim.plan, self.sim.work
        if self.overlap is not None:
            pass  # `optimizer.step()` hands the updates to the worker: the next forward runs them
        elif plan.placement.optimizer_states.on_device and not self.host_is_device:
            seconds = gpu_step_seconds(plan, work.params_per_rank)
            if seconds > 0:
                now = self.env.now
                self.links.compute.occupy(now, now + seconds, Phase.OPTIMIZER, 0.0)
                yield self.env.timeout(seconds)
        else:
            yield self.sim.cpu_optimizer_step()
        yield from self._gather_updated_params()

    def _gather_updated_params(self) -> Proc:
        plan = self.sim.plan
        if "params" not in plan.partitioned and "optimizer_states" in plan.partitioned and self.dp > 1:
            # ZeRO-2 / ZeRO-Offload: replicated parameters are re-assembled from the updated shards.
            slice_bytes = self.sim.work.step_model_params / self.mp * self.b
            route = self.res.collective(self.rank, spans_nodes=self.spans_nodes)
            yield self._collective(self._collective_bytes(slice_bytes), route, "all_gather", Phase.OPTIMIZER,
                                   self.latency_s["all_gather"])
