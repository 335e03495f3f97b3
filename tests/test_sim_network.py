"""Fair sharing of links (planner.sim.network): exact timelines on hand-computable flows."""

import simpy

from planner.sim.network import Link, Network


def _run(flows):
    """flows: (name, start_s, size, hops) -> [(name, finish_s)] in finish order."""
    env = simpy.Environment()
    net = Network(env)
    log = []

    def flow(name, start, size, hops):
        yield env.timeout(start)
        yield net.transfer(size, hops, name)
        log.append((name, env.now))

    for spec in flows:
        env.process(flow(*spec))
    env.run()
    return log


def test_one_flow_takes_size_over_capacity():
    link = Link("pcie", 2.0)
    assert _run([("a", 0, 4.0, ((link, 1.0),))]) == [("a", 2.0)]
    assert link.busy_s == 2.0 and link.amount == 4.0 and link.intervals == [(0.0, 2.0, "a")]


def test_two_flows_sharing_a_link_take_twice_as_long():
    link = Link("pcie", 2.0)
    assert _run([("a", 0, 4.0, ((link, 1.0),)), ("b", 0, 4.0, ((link, 1.0),))]) == [("a", 4.0), ("b", 4.0)]
    assert link.busy_s == 4.0


def test_processor_sharing_not_first_come_first_served():
    # b arrives at 1 s while a has 2 units left: both get 1 unit/s; b (1 unit) finishes first at 2 s,
    # then a runs alone at 2 units/s for its last unit: 2.5 s. FCFS would finish a at 2 s and b at 2.5 s.
    link = Link("nvme", 2.0)
    assert _run([("a", 0, 4.0, ((link, 1.0),)), ("b", 1, 1.0, ((link, 1.0),))]) == [("b", 2.0), ("a", 2.5)]


def test_max_min_fairness_across_two_links():
    # a crosses a 1 unit/s lane and the shared 4 unit/s fabric; b uses only the fabric. a is capped at 1
    # by its lane, so b gets the remaining 3 (max-min), not an equal 2.
    lane, fabric = Link("h2d", 1.0), Link("host_memory", 4.0)
    log = _run([("a", 0, 2.0, ((lane, 1.0), (fabric, 1.0))), ("b", 0, 6.0, ((fabric, 1.0),))])
    assert log == [("a", 2.0), ("b", 2.0)]


def test_weight_stands_for_identical_ranks():
    # One flow of weight 4 on a 8 unit/s link gets what each of 4 identical flows would: 2 units/s.
    link = Link("host_memory", 8.0, scope="per node")
    assert _run([("rep", 0, 4.0, ((link, 4.0),))]) == [("rep", 2.0)]
    link2 = Link("host_memory", 8.0, scope="per node")
    explicit = _run([(f"r{i}", 0, 4.0, ((link2, 1.0),)) for i in range(4)])
    assert explicit == [(f"r{i}", 2.0) for i in range(4)]


def test_shared_device_budget_for_reads_and_writes():
    # Shared NVMe: capacity 1 device-second per second; reading 2 B/s and writing 1 B/s alone.
    nvme = Link("nvme", 1.0, unit="device-s")
    read, write = ((nvme, 1 / 2.0),), ((nvme, 1 / 1.0),)
    # Both at rate r: r/2 + r/1 = 1 -> r = 2/3; the 2 B read finishes at 3 s, the write has 1 B left
    # alone at 1 B/s: 4 s.
    assert _run([("read", 0, 2.0, read), ("write", 0, 3.0, write)]) == [("read", 3.0), ("write", 4.0)]


def test_a_delayed_flow_holds_no_bandwidth_during_its_latency():
    # A collective's latency (planner/cost/collectives.py): b waits 1 s before its 2 units start, so a has
    # the link alone for 1 s (2 of its 4 units), then they share it: a's last 2 units and b's 2 at 1/s.
    env = simpy.Environment()
    net = Network(env)
    link = Link("nvlink", 2.0)
    done = {}

    def flow(name, size, delay):
        yield net.transfer(size, ((link, 1.0),), name, delay_s=delay)
        done[name] = env.now

    env.process(flow("a", 4.0, 0.0))
    env.process(flow("b", 2.0, 1.0))
    env.run()
    assert done == {"a": 3.0, "b": 3.0}
    assert link.intervals == [(0.0, 3.0, "a")]


def test_an_empty_delayed_transfer_ends_after_its_latency():
    env = simpy.Environment()
    net = Network(env)
    event = net.transfer(0.0, ((Link("nvlink", 1.0), 1.0),), "x", delay_s=0.5)
    env.run()
    assert event.triggered and env.now == 0.5


def _contended(link_sets, weights):
    """Flows over the given hops, every one contended (rates -1, links' `active` counted)."""
    from planner.sim.network import Flow

    flows = []
    for links, weight in zip(link_sets, weights, strict=True):
        for link in links:
            link.active += 1
        flows.append(Flow(tuple((link, weight) for link in links), 1.0, 1.0, None, -1.0, 0.0))
    return flows


def test_one_shared_link_gives_the_fillings_rates_to_the_bit():
    # The fast path of `_max_min_rates` (every contended flow on one link alone) must give exactly
    # what progressive filling gives: the same weights summed in the same order, the same quotient.
    import random

    from planner.sim.network import _max_min_rates, _one_shared_link, _progressive_filling

    rng = random.Random(7)
    for _ in range(200):
        count = rng.randint(2, 6)
        weights = [rng.choice([1.0, 8.0, 0.37, rng.uniform(0.01, 16.0)]) for _ in range(count)]
        capacity = rng.uniform(1e6, 5e10)
        fast_link, slow_link = Link("pcie", capacity), Link("pcie", capacity)
        fast = _contended([(fast_link,)] * count, weights)
        slow = _contended([(slow_link,)] * count, weights)
        _max_min_rates(fast)
        _progressive_filling(slow)
        assert [f.rate for f in fast] == [f.rate for f in slow]
    # Flows over two links, or over another link too, are left to the filling.
    a, b = Link("a", 2.0), Link("b", 3.0)
    assert not _one_shared_link(_contended([(a,), (b,), (a,), (b,)], [1.0] * 4))
    assert not _one_shared_link(_contended([(a,), (a, b)], [1.0, 1.0]))
    mixed = _contended([(Link("lane", 1.0), (fabric := Link("fabric", 4.0))), (fabric,)], [1.0, 1.0])
    _max_min_rates(mixed)
    assert [f.rate for f in mixed] == [1.0, 3.0]
