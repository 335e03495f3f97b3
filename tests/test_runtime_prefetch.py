"""Prefetch follows the recorded operator order, exactly, and survives a changed order."""

from __future__ import annotations

import pytest
import torch
from runtime_support import ALL_CPU, mlp_model, plan_doc
from torch import nn

import runtime
from runtime.units.prefetch import Phase, Prefetcher


class FakeStore:
    def __init__(self, resident_states: bool) -> None:
        self.resident_states = resident_states


class FakeUnit:
    def __init__(self, index: int, log: list[tuple[str, int]], *, on_nvme: bool = False,
                 full_bytes: int = 4096) -> None:
        self.index, self.log = index, log
        self.param_store = FakeStore(resident_states=not on_nvme)
        self.full_bytes = full_bytes

    def start_gather(self, *, prefetch: bool) -> None:
        assert prefetch
        self.log.append(("gather", self.index))

    def stage(self, *, ahead: int = 2) -> None:
        self.log.append(({0: "stage-now", 1: "stage-next", 2: "stage", 3: "swap-in"}[ahead], self.index))


def _run(prefetcher: Prefetcher, order: list[int], log: list) -> list:
    log.clear()
    for i in order:
        log.append(("use", i))
        prefetcher.on_use(Phase.FORWARD, i)
    prefetcher.end_phase(Phase.FORWARD)
    return list(log)


def test_first_step_records_then_prefetches_at_depth() -> None:
    log: list = []
    p = Prefetcher([FakeUnit(i, log) for i in range(4)], depth=2)
    assert _run(p, [0, 1, 2, 3], log) == [("use", 0), ("use", 1), ("use", 2), ("use", 3)]
    # Nearest first, every transfer started before the gather waits for i+1's shard.
    assert _run(p, [0, 1, 2, 3], log) == [
        ("use", 0), ("stage-now", 0), ("stage-next", 1), ("stage", 2), ("gather", 1),
        ("use", 1), ("stage-now", 1), ("stage-next", 2), ("stage", 3), ("gather", 2),
        ("use", 2), ("stage-now", 2), ("stage-next", 3), ("gather", 3),
        ("use", 3), ("stage-now", 3),
    ]


@pytest.mark.parametrize("on_nvme", [True, False])
def test_depth_three_swaps_in_from_nvme_only(on_nvme: bool) -> None:
    log: list = []
    p = Prefetcher([FakeUnit(i, log, on_nvme=on_nvme) for i in range(5)], depth=3)
    _run(p, [0, 1, 2, 3, 4], log)
    swap_in = [("swap-in", 3)] if on_nvme else []
    assert _run(p, [0, 1, 2, 3, 4], log)[:6 + len(swap_in)] == [
        ("use", 0), ("stage-now", 0), ("stage-next", 1), ("stage", 2), *swap_in, ("gather", 1), ("use", 1)]


def test_norms_ride_along_without_taking_a_place_in_the_window() -> None:
    """[Note: small units ride along]: a LayerNorm-sized unit (1/hidden of a linear) is fetched with
    the operator before it, so depth 3 still holds three linears ahead, as the planner's trace does."""
    log: list = []
    sizes = [4096, 32, 4096, 4096, 32, 4096, 4096]  # linear, norm, linear, linear, norm, linear, linear
    p = Prefetcher([FakeUnit(i, log, on_nvme=True, full_bytes=b) for i, b in enumerate(sizes)], depth=3)
    _run(p, list(range(7)), log)
    assert _run(p, list(range(7)), log)[:10] == [
        ("use", 0), ("stage-now", 0), ("stage-next", 1), ("stage-next", 2), ("stage", 3), ("stage", 4),
        ("swap-in", 5), ("gather", 1), ("gather", 2),  # the norm and the first linear ahead; 6 not yet
        ("use", 1)]


def test_riders_are_bounded() -> None:
    """However many tiny units follow each other, a window holds at most MAX_RIDERS of them."""
    from runtime.units.prefetch import MAX_RIDERS

    log: list = []
    sizes = [4096] + [8] * 10 + [4096]
    p = Prefetcher([FakeUnit(i, log, on_nvme=True, full_bytes=b) for i, b in enumerate(sizes)], depth=3)
    _run(p, list(range(len(sizes))), log)
    log.clear()
    p.on_use(Phase.FORWARD, 0)
    assert sorted(i for what, i in log if what != "gather" and i > 0) == list(range(1, MAX_RIDERS + 1))


def test_changed_order_stops_prefetching_and_is_learned() -> None:
    log: list = []
    p = Prefetcher([FakeUnit(i, log) for i in range(4)], depth=1)
    _run(p, [0, 1, 2, 3], log)
    assert _run(p, [0, 2, 3], log) == [("use", 0), ("stage-now", 0), ("stage-next", 1), ("gather", 1), ("use", 2),
                                       ("use", 3)]
    assert p.num_order_changes == 1
    assert p.recorded(Phase.FORWARD) == [0, 2, 3]
    assert _run(p, [0, 2, 3], log) == [("use", 0), ("stage-now", 0), ("stage-next", 2), ("gather", 2),
                                       ("use", 2), ("stage-now", 2), ("stage-next", 3), ("gather", 3),
                                       ("use", 3), ("stage-now", 3)]


def test_depth_zero_never_prefetches() -> None:
    log: list = []
    p = Prefetcher([FakeUnit(i, log) for i in range(3)], depth=0)
    _run(p, [0, 1, 2], log)
    assert _run(p, [0, 1, 2], log) == [("use", 0), ("use", 1), ("use", 2)]


class Branchy(nn.Module):
    """Takes a data-dependent branch: the operator order changes from step to step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, skip: int) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            if i != skip:
                x = torch.tanh(block(x))
        return x.square().mean()


def test_model_with_changing_order_trains_like_plain_pytorch() -> None:
    torch.manual_seed(0)
    ref = Branchy()
    torch.manual_seed(0)
    # A plan for its four 8 x 8 linears' 256 weights (runtime.shard checks the count).
    model = runtime.shard(Branchy(), plan_doc(placement=ALL_CPU, prefetch_depth=2, model=mlp_model(4, 8, 2)))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = runtime.AdamW(model, lr=1e-2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
    for skip in (1, 1, 2, 2, 0, 3):
        expected = ref(x, skip)
        expected.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        got = model(x, skip)
        got.backward()
        opt.step()
        opt.zero_grad()
        assert got.item() == pytest.approx(expected.item(), rel=1e-5)
    assert runtime.state_of(model).prefetcher.num_order_changes >= 3


def _keeps(p: Prefetcher, forward: list[int]) -> dict[int, int]:
    """Units `keep_distance` keeps gathered at the end of their forward use -> backward distance."""
    kept = {}
    for i in forward:
        p.on_use(Phase.FORWARD, i)
        if (q := p.keep_distance(i)) is not None:
            kept[i] = q
    p.end_phase(Phase.FORWARD)
    return kept


def test_the_forwards_tail_stays_gathered_for_the_backwards_head() -> None:
    """[Note: the forward's tail is the backward's head]: with the backward the forward reversed,
    the last depth + 1 operators stay gathered, each for its distance into the backward's window;
    nothing is kept before both orders are recorded."""
    log: list = []
    p = Prefetcher([FakeUnit(i, log, on_nvme=True) for i in range(8)], depth=3)
    assert _keeps(p, list(range(8))) == {}
    for i in reversed(range(8)):
        p.on_use(Phase.BACKWARD, i)
    p.end_phase(Phase.BACKWARD)
    assert _keeps(p, list(range(8))) == {7: 0, 6: 1, 5: 2, 4: 3}
    p.depth = 1
    assert _keeps(p, list(range(8))) == {7: 0, 6: 1}


def test_a_unit_is_kept_only_where_its_slot_is_free() -> None:
    """Not kept: a unit used again later in the forward (a tied embedding's first use), one whose
    backward use is nearer than its distance from the forward's end (r > q), and one followed by a
    rider's use (which needs the in-use slot the unit still holds)."""
    log: list = []
    sizes = [4096, 4096, 4096, 32, 4096, 4096]  # 3 is a norm, riding with 2
    p = Prefetcher([FakeUnit(i, log, on_nvme=True, full_bytes=b) for i, b in enumerate(sizes)], depth=3)
    forward = [0, 1, 2, 3, 4, 5, 0]  # 0 is used again at the end (tied output head)
    backward = [0, 5, 4, 1, 2, 3]  # 1 before 2 and 3: a changed order in the backward
    for order, phase in ((forward, Phase.FORWARD), (backward, Phase.BACKWARD)):
        for i in order:
            p.on_use(phase, i)
        p.end_phase(phase)
    # Kept: 0's last use (r 0, q 0), 5 (r 1, q 1), 4 (r 2, q 2). Not: 0's first use; 1 (r 4: 2, 4,
    # 5 and 0 follow; q 3); 2 (the rider 3 follows); 3 (not in the backward's first window).
    assert _keeps(p, forward) == {0: 0, 5: 1, 4: 2}
