"""The transfer path as a GPU program, proven on the CPU ([Note: the transfer path as a GPU program] in
runtime/transfer/streams.py).

Each case trains the test GPT for three steps on the emulated device (`CopyEngine.separate_memory_on_cpu`:
the data path of a device with memory of its own, every stream, event, wait and pin noted in a
trace) on a plan whose hardware keeps host and device memory apart, and reads off the trace, on
every placement (device, cpu, optimizer states on NVMe, all on NVMe) and both optimizer schedules,
on one rank and two (gloo):
- no runtime hook waits on the host;
- the host waits at most once per step, inside `optimizer.step()` (in backward: at its end), never
  between the forward's start and the step;
- host-to-device and device-to-host copies run on their own streams, and no copy stream waits for
  everything queued on another;
- nothing is pinned or unpinned after the first step;
- every pinned byte belongs to a ledger term and equals it, and the bill's term for it;
- the losses are bitwise those of the CPU machine's run of the same plan.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import (
    ALL_CPU,
    ALL_DEVICE,
    BATCH,
    HARDWARE,
    batches,
    build_model,
    plan_doc,
    run_distributed,
)

PLACEMENTS = {
    "device": ALL_DEVICE,
    "cpu": ALL_CPU,
    "opt-on-nvme": {**ALL_CPU, "optimizer_states": "nvme"},
    "all-nvme": {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"},
}
SCHEDULES = ("after_backward", "in_backward")
PINNINGS = ("shards", "staged")
CASES = [(p, s, h) for p in PLACEMENTS for s in SCHEDULES for h in PINNINGS if p != "device" or h == "staged"]
IDS = ["-".join(case) for case in CASES]
SHARD_TERMS = ("params", "gradient_landing_buffers", "recompute_inputs")
"""Pinned terms holding the model's state: the bill counts the model spec's parameters, which leave
out its biases, norms and position embeddings (planner/cost/memory.py), and each pinned buffer rounds to
a page: the rest are sized by the plan, to the byte."""
STEPS = 3
SEPARATE = {**HARDWARE, "host_is_device": False}
"""The test hardware (`HARDWARE`) with a device memory of its own: the bill charges its buffers."""


def _doc(placement: str, schedule: str, pinning: str, nvme_path: str, world_size: int) -> dict[str, Any]:
    return plan_doc(world_size=world_size, placement=PLACEMENTS[placement], precision="bf16", recompute_interval=1,
                    micro_batch_per_gpu=BATCH // world_size, optimizer_step=schedule, host_pinning=pinning,
                    hardware=SEPARATE, nvme_path=nvme_path)


def _train(doc: dict[str, Any], rank: int, world_size: int, trace: Any = None) -> tuple[list[str], Any, Any]:
    import runtime

    model = runtime.shard(build_model("gpt"), doc)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    device = runtime.state_of(model).config.device
    losses = []
    mark = trace.mark if trace is not None else (lambda label: None)
    for step, tokens in enumerate(batches(STEPS), start=1):
        tokens = tokens.chunk(world_size)[rank].to(device)
        mark(f"forward {step}")
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        mark(f"backward {step}")
        loss.backward()
        mark(f"step {step}")
        opt.step()
        opt.zero_grad()
        mark(f"end {step}")
        losses.append(loss.item().hex())
    return losses, model, opt


def _main_thread_waits(trace: Any, first: str, last: str) -> list[list[str]]:
    """The host waits of the threads that issue device work (not the rank's worker threads), bounded
    buffers coming free excepted ([Note: the transfer path as a GPU program])."""
    from runtime.transfer.trace import HostWait, WaitKind

    return [[w.kind.value, w.why, w.hook or ""] for w in trace.of(HostWait, first, last)
            if w.kind is not WaitKind.BACKPRESSURE and not w.thread.startswith("tierwise-")]


def traced_run(placement: str, schedule: str, pinning: str, nvme_path: str, events_at_once: bool = True, *,
               rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """One case on the emulated device, traced, and the same plan on the CPU machine: what the tests
    assert, as JSON (a two-rank case returns it from its rank-0 process). `events_at_once` False: a
    device event polls as not reached until a host waits for it (`EmulatedStreams`)."""
    from runtime.sharding import state_of
    from runtime.transfer.stores import CopyEngine
    from runtime.transfer.streams import EmulatedStreams

    for sub in ("cpu", "dev"):
        (Path(nvme_path) / sub).mkdir(parents=True, exist_ok=True)
    doc = _doc(placement, schedule, pinning, str(Path(nvme_path) / "cpu"), world_size)
    cpu_losses, model, opt = _train(doc, rank, world_size)
    opt.close()
    state_of(model).close()
    CopyEngine.separate_memory_on_cpu = True
    EmulatedStreams.events_complete_at_once = events_at_once
    try:
        result = trained_and_traced(_doc(placement, schedule, pinning, str(Path(nvme_path) / "dev"), world_size),
                                    rank, world_size)
    finally:
        CopyEngine.separate_memory_on_cpu = False
        EmulatedStreams.events_complete_at_once = True
    return {**result, "cpu_losses": cpu_losses}


def trained_and_traced(doc: dict[str, Any], rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """`STEPS` steps of `doc`, traced: the properties the tests assert, as JSON (also on CUDA)."""
    from planner.cost.memory import memory_bill
    from runtime.sharding import state_of
    from runtime.transfer.trace import Copy, HostWait, Pin, StreamWait, WaitKind, tracing

    gc.collect()  # earlier runs' buffers are unpinned now, not in this run's trace
    with tracing() as trace:
        losses, model, opt = _train(doc, rank, world_size, trace)
        state = state_of(model)
        state.wait_io()
    streams, plan = state.copier.streams, state.plan
    bill = memory_bill(plan).terms["cpu"]
    ledger = state.ledger.usage("cpu").terms
    pinned_terms = {p.term for p in trace.of(Pin)}
    pinned = {term: [streams.pinned_bytes(term), ledger.get(term, 0), bill.get(term, 0) // plan.cluster.gpus_per_node]
              for term in sorted(pinned_terms)}
    left_out = sum(u.layout.numel for u in state.units) - plan.model.num_params
    result = {
        "hook_waits": [[w.kind.value, w.why, w.hook] for w in trace.of(HostWait)
                       if w.hook is not None and w.kind is not WaitKind.BACKPRESSURE],
        "before_step": {s: _main_thread_waits(trace, f"forward {s}", f"step {s}") for s in range(1, STEPS + 1)},
        "in_step": {s: _main_thread_waits(trace, f"step {s}", f"end {s}") for s in range(1, STEPS + 1)},
        "misplaced_copies": sorted({f"{c.direction.value} on {c.stream.value}" for c in trace.of(Copy)
                                    if c.stream.value != c.direction.value}),
        "whole_stream_waits": sorted({f"{w.waiter.value} waits for all of {w.on.value}" for w in trace.of(StreamWait)
                                      if w.whole_stream}),
        "pins_after_first_step": [[p.term, p.nbytes, p.pinned] for p in trace.of(Pin, "end 1")],
        "pinned": pinned,
        # Parameters the bill's model spec leaves out, and a page of rounding per pinned buffer.
        "allowance": {"params": -(-left_out // world_size) * 2 + 4096,
                      "gradient_landing_buffers": -(-left_out // world_size) * 2 + 4096,
                      "recompute_inputs": 4096 * len(state.segments)},
        "losses": losses,
    }
    opt.close()
    state.close()
    return result


class _Lazy(dict):
    """Case -> result, each one-rank case run on first use."""

    def __init__(self, factory: pytest.TempPathFactory, events_at_once: bool) -> None:
        super().__init__()
        self.factory, self.events_at_once = factory, events_at_once

    def __missing__(self, case: tuple[str, str, str]) -> dict[str, Any]:
        self[case] = traced_run(*case, str(self.factory.mktemp("-".join(case))), self.events_at_once)
        return self[case]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict[str, Any]]:
    return _Lazy(tmp_path_factory, events_at_once=True)


@pytest.fixture(scope="module")
def one_rank_slow_device(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict[str, Any]]:
    return _Lazy(tmp_path_factory, events_at_once=False)


def _two_rank_runs(factory: pytest.TempPathFactory, events_at_once: bool) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Every two-rank case, in one spawn of two gloo processes."""
    out = factory.mktemp("two-ranks")
    cases = [(*case, str(out / "-".join(case)), events_at_once) for case in CASES]
    results = run_distributed("traced_run", cases, out, module="test_transfer_path")
    return dict(zip(CASES, results, strict=True))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict[str, Any]]:
    return _two_rank_runs(tmp_path_factory, events_at_once=True)


@pytest.fixture(scope="module")
def two_ranks_slow_device(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str, str], dict[str, Any]]:
    return _two_rank_runs(tmp_path_factory, events_at_once=False)


@pytest.fixture(params=[1, 2], ids=["1-rank", "2-ranks"])
def runs(request: pytest.FixtureRequest) -> dict[tuple[str, str, str], dict[str, Any]]:
    return request.getfixturevalue("one_rank" if request.param == 1 else "two_ranks")


@pytest.fixture(params=[(1, True), (2, True), (1, False), (2, False)],
                ids=["1-rank", "2-ranks", "1-rank-slow-device", "2-ranks-slow-device"])
def wait_runs(request: pytest.FixtureRequest) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The runs the wait properties are read off: also on a device whose events a poll never sees
    reached (a wait the code makes only when a copy is still in flight shows there)."""
    ranks, at_once = request.param
    name = ("one_rank" if ranks == 1 else "two_ranks") + ("" if at_once else "_slow_device")
    return request.getfixturevalue(name)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_no_hook_waits_on_the_host(wait_runs: dict, case: tuple[str, str, str]) -> None:
    assert wait_runs[case]["hook_waits"] == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_host_waits_once_per_step_in_the_step_only(wait_runs: dict, case: tuple[str, str, str]) -> None:
    run = wait_runs[case]
    assert all(waits == [] for waits in run["before_step"].values()), run["before_step"]
    assert all(len(waits) <= 1 for waits in run["in_step"].values()), run["in_step"]


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_copy_direction_has_its_own_stream(runs: dict, case: tuple[str, str, str]) -> None:
    run = runs[case]
    assert run["misplaced_copies"] == []
    assert run["whole_stream_waits"] == []


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_nothing_is_pinned_after_the_first_step(runs: dict, case: tuple[str, str, str]) -> None:
    assert runs[case]["pins_after_first_step"] == []


def pinned_bytes_are_billed(run: dict[str, Any]) -> None:
    """Every pinned byte belongs to a ledger term and equals it, and the bill's term for it (shard
    terms: within `allowance`)."""
    for term, (pinned, ledger, bill) in run["pinned"].items():
        assert pinned == ledger, (term, pinned, ledger)
        if term in SHARD_TERMS:
            assert bill <= ledger <= bill + run["allowance"][term], (term, ledger, bill)
        else:
            assert ledger == bill, (term, ledger, bill)


def gpu_program_properties_hold(run: dict[str, Any]) -> None:
    """Every property this module's tests read off one traced run (`trained_and_traced`), losses
    aside: what tests/test_runtime_gpu_cuda_path.py asserts of the same run on CUDA."""
    assert run["hook_waits"] == []
    assert all(waits == [] for waits in run["before_step"].values()), run["before_step"]
    assert all(len(waits) <= 1 for waits in run["in_step"].values()), run["in_step"]
    assert run["misplaced_copies"] == [] and run["whole_stream_waits"] == []
    assert run["pins_after_first_step"] == []
    pinned_bytes_are_billed(run)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_every_pinned_byte_is_in_the_ledger_and_the_bill(runs: dict, case: tuple[str, str, str]) -> None:
    pinned_bytes_are_billed(runs[case])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_gpu_tests_checks_hold_on_the_emulated_device(one_rank: dict, case: tuple[str, str, str]) -> None:
    """The checks tests/test_runtime_gpu_cuda_path.py runs on CUDA, on the emulated device's run of
    the same plan (built by the same `_doc`): a change to either shows here, without a GPU."""
    gpu_program_properties_hold(one_rank[case])


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_losses_are_bitwise_the_cpu_machines(runs: dict, case: tuple[str, str, str]) -> None:
    run = runs[case]
    assert run["losses"] == run["cpu_losses"]
    assert all(torch.isfinite(torch.tensor(float.fromhex(x))) for x in run["losses"])
