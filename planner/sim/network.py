"""Bandwidth resources shared fairly among concurrent flows, as a SimPy fluid model.

[Note: fair sharing] A link is not a FCFS queue: PCIe, NVLink, NVMe and the network serve every
outstanding transfer at once, each at a share of the bandwidth (processor sharing). A flow may cross
several links (a host-to-GPU copy uses its GPU's PCIe lane *and* the node's shared host-memory
fabric); rates are then max-min fair (progressive filling): raise every unfrozen flow's rate together
until some link saturates, freeze the flows on it, repeat. Each hop carries a `weight`, the units
the link spends per unit of the flow: a flow standing for k identical ranks weighs k on a node-wide
link (see [Note: representative rank] in engine.py), and on a shared NVMe budget a byte read costs
1/read-rate device-seconds while a byte written costs 1/write-rate.

Rates change only when a flow starts or ends, so the network keeps one pending timer for the next
completion; a newer allocation supersedes older timers (only the latest one acts when it fires).

[Note: a lone flow changes no other rate] A flow that starts on links no other flow crosses, or
ends where it crossed no other flow, leaves every other link's count of flows as it was: the same
flows are contended, in the same order, over the same links, so the filling would give every other
flow the rate it has, to the bit, and the lone flow its narrowest hop's. Such a start or end only
sets the next timer: the same timer, scheduled at the same moment, as a full reallocation's (how
often each case arises: docs/notes/2026-11-28-fit-speed.md).
"""

from __future__ import annotations

import gc
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import simpy

from planner.specs.errors import PlannerError

# A flow this close to done (in seconds at its current rate) is done: float residue of rate * time
# would otherwise leave a remainder too small to move the clock, and the timer would spin.
_DONE_WITHIN_S = 1e-9


@contextmanager
def collector_paused() -> Iterator[None]:
    """Simulate without Python's cyclic garbage collector, and restore it after (a context or a decorator).

    A run allocates ~10^5 short-lived objects (events, callback lists, interval tuples) that
    reference counting frees as they die; the collector's passes over them, every 700
    allocations, find no garbage and cost a few percent of a simulation. Cycles the run leaves
    behind (a simulation and its rank programs) are collected once it is back on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def scheduled_events(env: simpy.Environment) -> int:
    """Events `env` has scheduled so far: SimPy numbers each one it schedules from 0 (`Environment._eid`),
    so the next number is the count. Read once, at the end of a run (reading takes a number)."""
    return next(env._eid)  # noqa: SLF001 - SimPy's own counter; a wrapper would cost a call per event


@dataclass(eq=False, slots=True)
class Link:
    """One bandwidth resource: capacity in `unit` per second; records when it is busy."""

    name: str
    capacity: float
    unit: str = "bytes"
    scope: str = "per GPU"
    """`per GPU`, `per node` or `per GPU (simulated rank k)`: what one instance serves."""
    active: int = 0
    """Flows crossing it now (Network counts them as flows start and end: a busy interval opens with
    the first, labelled by it, and closes with the last)."""
    busy_since: float = 0.0
    busy_s: float = 0.0
    amount: float = 0.0
    """Units carried so far, counted per instance (weights included)."""
    intervals: list[tuple[float, float, str]] = field(default_factory=list)
    """(start, end, label of the activity that opened the interval), merged while busy."""
    label: str = ""

    def occupy(self, start: float, end: float, label: str, amount: float) -> None:
        """Record exclusive use (compute) that bypasses the fluid model."""
        self.busy_s += end - start
        self.amount += amount
        self.intervals.append((start, end, label))


@dataclass(eq=False, slots=True)
class Flow:
    hops: tuple[tuple[Link, float], ...]
    size: float
    remaining: float
    done: simpy.Event
    rate: float = 0.0
    alone_rate: float = 0.0
    """Its rate with no other flow on its links: its narrowest hop (capacities never change)."""


class Network:
    """All links of one simulation; `transfer` returns an event that fires when the flow is done."""

    def __init__(self, env: simpy.Environment) -> None:
        self.env = env
        self.flows: list[Flow] = []
        self._last_s = 0.0
        self._timer: simpy.Event | None = None
        """The timer of the latest allocation: earlier ones still fire, and do nothing."""

    def transfer(self, size: float, hops: tuple[tuple[Link, float], ...], label: str,
                 delay_s: float = 0.0) -> simpy.Event:
        """Move `size` units through every link in `hops` ((link, weight) pairs) concurrently,
        starting after `delay_s` (a collective's latency: planner/cost/collectives.py), during which
        the flow holds no bandwidth."""
        done = self.env.event()
        if size <= 0 or not hops:
            if delay_s > 0:
                self.env.timeout(delay_s).callbacks.append(lambda _event: done.succeed())
            else:
                done.succeed()
            return done
        if delay_s > 0:
            self.env.timeout(delay_s).callbacks.append(lambda _event: self._start(size, hops, label, done))
        else:
            self._start(size, hops, label, done)
        return done

    def _start(self, size: float, hops: tuple[tuple[Link, float], ...], label: str, done: simpy.Event) -> None:
        now = self._advance()
        alone = math.inf
        lone = True
        for link, weight in hops:
            if link.active == 0:  # the link's busy interval opens with its first flow
                link.busy_since, link.label = now, label
            else:
                lone = False
            link.active += 1
            link.amount += size * weight
            rate = link.capacity / weight
            if rate < alone:
                alone = rate
        self.flows.append(Flow(hops, size, size, done, alone if lone else 0.0, alone))
        if lone:  # [Note: a lone flow changes no other rate]
            self._next_timer()
        else:
            self._reallocate()

    # -- fluid model -------------------------------------------------------------------------
    def _advance(self) -> float:
        """Move every flow on at its rate up to now; returns now."""
        now = self.env.now
        elapsed = now - self._last_s
        if elapsed > 0:
            for flow in self.flows:
                flow.remaining -= flow.rate * elapsed
        self._last_s = now
        return now

    def _reallocate(self) -> None:
        flows = self.flows
        if len(flows) == 1:
            flows[0].rate = flows[0].alone_rate
        else:
            _max_min_rates(flows)
        self._next_timer()

    def _next_timer(self) -> None:
        """The timer of the next completion at the flows' rates (superseding the pending one)."""
        flows = self.flows
        # Loops rather than min() over generators: this runs once per flow start and end (the
        # simulator's hottest path); the values are the same.
        dt = math.inf
        for flow in flows:
            rate = flow.rate
            if rate <= 0:  # a transfer over a link the hardware spec gives no bandwidth would never end
                link = next((lk for lk, _ in flow.hops if lk.capacity <= 0), flow.hops[0][0])
                raise PlannerError(f"the plan moves data over {link.name}, whose bandwidth in the hardware spec is "
                                   f"{link.capacity:g} {link.unit}/s; give it a bandwidth or use hardware that has it")
            left_s = flow.remaining / rate
            if left_s < dt:
                dt = left_s
        timer = self._timer = self.env.timeout(max(dt, 0.0))
        timer.callbacks.append(self._on_timer)

    def _on_timer(self, timer: simpy.Event) -> None:
        if timer is not self._timer:
            return  # superseded by a later allocation
        now = self._advance()
        still: list[Flow] = []
        shared = False
        for flow in self.flows:
            if flow.remaining <= flow.rate * _DONE_WITHIN_S:
                for link, _ in flow.hops:
                    link.active -= 1  # and closes with its last
                    if link.active == 0:
                        link.busy_s += now - link.busy_since
                        link.intervals.append((link.busy_since, now, link.label))
                    else:
                        shared = True
                flow.done.succeed()
            else:
                still.append(flow)
        self.flows = still
        if still:
            if shared:
                self._reallocate()
            else:  # [Note: a lone flow changes no other rate]
                self._next_timer()


def _max_min_rates(flows: list[Flow]) -> None:
    """Progressive filling: the max-min fair rate of every flow (see [Note: fair sharing])."""
    # Fast path: a flow alone on every link it crosses runs at its narrowest hop's rate. A link's
    # `active` is the number of flows crossing it (started with the flow, stopped when it ends), so
    # telling the lone flows apart needs no table of users; most reallocations end here.
    contended: list[Flow] = []
    for flow in flows:
        for link, _ in flow.hops:
            if link.active > 1:
                flow.rate = -1.0  # unfrozen
                contended.append(flow)
                break
        else:
            flow.rate = flow.alone_rate
    if not contended:
        return
    if not _one_shared_link(contended):
        _progressive_filling(contended)


def _one_shared_link(contended: list[Flow]) -> bool:
    """Where every contended flow crosses one and the same link and nothing else (copies sharing
    one lane: most contended reallocations, docs/notes/2026-11-28-fit-speed.md), set their rates
    and say so. `_progressive_filling` would visit that link alone, once, and freeze
    every flow at its capacity over the weights summed in flow order: the same sum and the same
    quotient here, so the same rates to the bit (tests/test_sim_network.py checks)."""
    link = contended[0].hops[0][0]
    demand = 0.0
    for flow in contended:
        hops = flow.hops
        if len(hops) != 1 or hops[0][0] is not link:
            return False
        demand += hops[0][1]
    if demand <= 0:
        return False
    share = link.capacity / demand
    if not share < math.inf:  # the filling finds no share below infinity and fails: so does it here
        return False
    rate = max(share, 0.0)
    for flow in contended:
        flow.rate = rate
    return True


def _progressive_filling(contended: list[Flow]) -> None:
    """The max-min fair rates of `contended` (each crossing some link another crosses; their rates
    set to -1, unfrozen), by progressive filling."""
    # A link crossed by several flows is crossed by contended flows only: its users, in flow order.
    users: dict[Link, list[tuple[Flow, float]]] = {}
    for flow in contended:
        for link, weight in flow.hops:
            on_link = users.get(link)
            if on_link is None:
                users[link] = [(flow, weight)]
            else:
                on_link.append((flow, weight))
    # The links in the order the filling visits them (a tie goes to the first): those several
    # contended flows cross, then those one crosses (which still cap it), each in order of first use.
    shared = [(link, on_link) for link, on_link in users.items() if len(on_link) > 1]
    shared += [(link, on_link) for link, on_link in users.items() if len(on_link) == 1]
    capacity_left = {link: link.capacity for link, _ in shared}
    unfrozen = len(contended)
    while unfrozen:
        best_share, best_users = math.inf, None
        for link, on_link in shared:
            demand = 0.0
            for flow, weight in on_link:
                if flow.rate < 0:
                    demand += weight
            if demand > 0:
                share = capacity_left[link] / demand
                if share < best_share:
                    best_share, best_users = share, on_link
        assert best_users is not None, "unfrozen flows must cross some link"
        for flow, _ in best_users:
            if flow.rate < 0:
                flow.rate = max(best_share, 0.0)
                unfrozen -= 1
                for link, weight in flow.hops:
                    capacity_left[link] -= best_share * weight
