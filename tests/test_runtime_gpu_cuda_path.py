"""The runtime's CUDA path, correct by construction (the fixes of what the first run on a GPU found:
docs/notes/2026-11-26-first-gpu-run.md). Tests marked `gpu` state the property they check and skip
without CUDA (tests/conftest.py); the unmarked ones check, on the CPU, the part of each fix that does
not need a device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from planner.specs.memory_terms import MemoryTerm
from runtime import launch
from runtime.optim.loss_scaling import DynamicLossScaler
from runtime.transfer.collectives import Comm
from runtime.transfer.trace import Role

gpu = pytest.mark.gpu


# -- 1. one device per rank ([Note: one device per rank] in runtime/launch.py) ------------------------


def test_bind_device_runs_before_the_process_group(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """`main` binds the device before `init_process_group`: NCCL's first collective otherwise lands on cuda:0."""
    order: list[str] = []
    monkeypatch.setattr(launch, "bind_device", lambda: order.append("bind_device"))
    monkeypatch.setattr(launch, "init_process_group", lambda **_: order.append("init_process_group"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert launch.main([str(tmp_path / "missing-plan.json"), "--steps", "1"]) == launch.EXIT_NOT_EXECUTABLE
    assert order == ["bind_device", "init_process_group"]


def test_bind_device_without_cuda_is_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert launch.bind_device() == torch.device("cpu")


@gpu
def test_bind_device_makes_local_rank_current(monkeypatch: pytest.MonkeyPatch) -> None:
    """Property: after `bind_device`, the current CUDA device (where object collectives stage, what
    `mem_get_info` reports) is cuda:LOCAL_RANK; a LOCAL_RANK past the node's GPUs is one line."""
    last = torch.cuda.device_count() - 1
    monkeypatch.setenv("LOCAL_RANK", str(last))
    try:
        assert launch.bind_device() == torch.device("cuda", last)
        assert torch.cuda.current_device() == last
        assert torch.empty(1, device="cuda").device.index == last
    finally:
        torch.cuda.set_device(0)
    monkeypatch.setenv("LOCAL_RANK", str(last + 1))
    with pytest.raises(launch.PlannerError, match=f"LOCAL_RANK {last + 1} names no GPU"):
        launch.bind_device()


# -- 2. collectives on device tensors ------------------------------------------------------------------


def test_overflow_check_on_one_rank_is_unchanged_on_cpu() -> None:
    scaler = DynamicLossScaler(init_scale=4.0, growth_interval=2)
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0)]
    assert scaler.unscale_and_check(grads, Comm.local())
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [1.0] * 2
    grads = [torch.ones(2), torch.tensor([1.0, float("inf")])]
    assert not scaler.unscale_and_check(grads, Comm.local())
    assert scaler.scale == 2.0 and all(g.abs().sum() == 0 for g in grads)


@pytest.fixture
def nccl_world1(tmp_path: Path):  # noqa: ANN201
    """A one-rank NCCL process group: enough for NCCL to refuse a CPU tensor, as it does at any size."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@gpu
@pytest.mark.parametrize("grad_device", ["cpu", "cuda"], ids=["cpu-tier-grads", "gpu-tier-grads"])
def test_overflow_check_all_reduces_on_the_device_under_nccl(nccl_world1, grad_device: str) -> None:  # noqa: ANN001
    """Property: the fp16 overflow flag is all-reduced through NCCL (which takes device tensors
    only) whether the gradients live on the GPU or in host memory, and the verdict is the one the
    CPU gives: a clean step unscales, an inf skips it and halves the scale."""
    comm = Comm(nccl_world1, nccl_world1, 1, 0, "native", torch.device("cuda", torch.cuda.current_device()))
    scaler = DynamicLossScaler(init_scale=4.0)
    clean = [torch.full((5,), 8.0, device=grad_device)]
    assert scaler.unscale_and_check(clean, comm)
    assert clean[0].cpu().tolist() == [2.0] * 5
    bad = [torch.ones(4, device=grad_device), torch.tensor([float("nan")], device=grad_device)]
    assert not scaler.unscale_and_check(bad, comm)
    assert scaler.scale == 2.0


# -- 3. no host synchronisation at phase boundaries ([Note: phase times on CUDA]) ----------------------


@gpu
def test_profiler_phase_boundaries_do_not_synchronise_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """Property: on an all-GPU step no phase boundary (several run inside autograd hooks)
    synchronises the host: no `torch.cuda.synchronize`, and one event wait per step, in `end_step`;
    the phases resolved from the CUDA events are positive and lie inside the step."""
    from runtime_support import ALL_DEVICE, batches, build_model, plan_doc

    import runtime
    from runtime import profiler as profiler_module

    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_DEVICE))
    opt = runtime.AdamW(model, lr=1e-3)
    device_syncs: list[str] = []
    event_waits: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: device_syncs.append("synchronize"))
    real_wait = torch.cuda.Event.synchronize

    def wait(event: torch.cuda.Event) -> None:
        import inspect

        event_waits.append(inspect.stack()[2].function)
        real_wait(event)

    monkeypatch.setattr(torch.cuda.Event, "synchronize", wait)
    for tokens in batches(2):
        tokens = tokens.cuda()
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    assert device_syncs == []
    assert event_waits == ["end_step", "end_step"]
    sample = runtime.state_of(model).profiler.samples[-1]
    assert all(sample.phase_time_s[p] > 0 for p in profiler_module.PHASES)
    assert sum(sample.phase_time_s.values()) <= sample.step_time_s


# -- 4. a prefetch does not make the compute stream wait ([Note: a prefetch waits on the copy stream]) --

SLOW_COPY_CYCLES = 200_000_000
"""`torch.cuda._sleep` cycles put ahead of a copy on the copy stream: ~0.1 s at H100 clocks, far
longer than the compute queued after it, so an ordering measured with events is unambiguous."""

# [Note: warm kernels before an overlap is timed]
# CUDA loads a kernel's module on its first launch (lazy loading, the default since CUDA 12.2), and
# that load may synchronise the whole context (CUDA C++ Programming Guide, "Lazy Loading":
# concurrent execution is not guaranteed): a kernel first launched while a long kernel runs on
# another stream then starts only after it, whatever the streams say; the first run on a GPU saw exactly that
# (docs/notes/2026-11-26-first-gpu-run.md). So each test that times an overlap launches its kernels once
# before the timed part.


def _biggest_unit(model: torch.nn.Module):  # noqa: ANN202
    import runtime

    return max(runtime.state_of(model).units, key=lambda u: u.layout.shard_numel)


@gpu
def test_prefetch_leaves_the_compute_stream_free(monkeypatch: pytest.MonkeyPatch) -> None:
    """Property (overlap, measured with CUDA events): kernels queued on the compute stream after a
    prefetch of the next unit was issued finish before that unit's host-to-device copy does, on a
    two-rank unit (the one-rank shortcut of [Note: one rank does not wait ahead] does not apply);
    the compute stream waits for it only at the unit's use, and then sees the shard's bytes."""
    from runtime_support import ALL_CPU, build_model, plan_doc

    import runtime
    from runtime.transfer.collectives import Gathered
    from runtime.units import group as group_module

    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_CPU))
    unit = _biggest_unit(model)
    # A second rank's all-gather stands in as identity: the stream ordering is start_gather's own.
    monkeypatch.setattr(unit, "comm", unit.comm._replace(world_size=2))
    monkeypatch.setattr(group_module, "all_gather_flat", lambda comm, shard, link_bytes: Gathered(shard, None))
    compute, side = torch.cuda.current_stream(), unit.param_store.copier.streams.cuda_stream(Role.H2D)
    x = torch.randn(1024, 1024, device="cuda")
    # Every kernel of the path loaded before the timed part ([Note: warm kernels before an overlap is timed]).
    x @ x
    unit.start_gather(prefetch=True)
    unit.unshard()
    unit.reshard()
    torch.cuda.synchronize()
    events = {name: torch.cuda.Event(enable_timing=True) for name in ("issued", "compute_done", "copy_done")}
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLOW_COPY_CYCLES)
    unit.start_gather(prefetch=True)
    events["copy_done"].record(side)
    events["issued"].record(compute)
    y = x @ x
    events["compute_done"].record(compute)
    unit.unshard()
    gathered = unit.full.clone()
    torch.cuda.synchronize()
    issued = events["issued"]
    assert issued.elapsed_time(events["compute_done"]) < issued.elapsed_time(events["copy_done"])
    host_shard = unit.param_store.resident(unit.key)
    assert torch.equal(gathered.cpu(), host_shard.to(gathered.dtype)[: gathered.numel()])
    assert torch.isfinite(y).all()
    unit.reshard()


# -- 5. NVMe parameter reads: pinned, copied on the copy stream once landed ----------------------------


class _RecordingPinHook:
    def __init__(self) -> None:
        self.pinned: dict[int, int] = {}
        self.calls: list[str] = []

    def pin(self, address: int, nbytes: int) -> None:
        assert address not in self.pinned
        self.pinned[address] = nbytes
        self.calls.append("pin")

    def unpin(self, address: int) -> None:
        del self.pinned[address]
        self.calls.append("unpin")


def test_recycler_pins_each_fresh_buffer_once_and_unpins_before_unmapping() -> None:
    from runtime.nvme.buffers import BufferRecycler

    hook = _RecordingPinHook()
    recycler = BufferRecycler(max_held_bytes=2 * 8192, pin_hook=hook)
    first = recycler.lease(8192)
    assert recycler.pinned_bytes == 8192 and list(hook.pinned.values()) == [8192]
    del first  # kept (within the bound) and reused: pinning is paid once per buffer
    again = recycler.lease(8192)
    assert hook.calls == ["pin"] and recycler.num_reused == 1
    big = recycler.lease(3 * 8192)  # over the bound: freed at give-back, unpinned first
    del big
    assert recycler.pinned_bytes == 8192 and hook.calls == ["pin", "pin", "unpin"]
    del again
    recycler.close()
    assert hook.pinned == {} and recycler.pinned_bytes == 0


NVME_PARAMS = {"params": "nvme", "gradients": "cpu", "optimizer_states": "cpu", "recompute_inputs": "cpu"}


def _slow_kernel_and_events(store):  # noqa: ANN001, ANN202
    """A long kernel on the compute stream, bracketed by timing events (`issued`, `compute_done`),
    and an event the test records on the store's copy stream once its copy is issued."""
    torch.cuda.synchronize()
    compute, side = torch.cuda.current_stream(), store.copier.streams.cuda_stream(Role.H2D)
    issued, compute_done, copy_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
    issued.record(compute)
    torch.cuda._sleep(SLOW_COPY_CYCLES)
    compute_done.record(compute)
    return side, issued, compute_done, copy_done


@gpu
def test_nvme_read_copies_to_the_device_on_the_copy_stream_once_landed(tmp_path: Path) -> None:
    """Property (overlap, measured with CUDA events): an NVMe parameter read lands in a pinned
    buffer and its host-to-device copy is issued before anyone waits for it, on the copy stream,
    so it ends while a long kernel queued earlier on the compute stream still runs; `wait()` only
    orders the compute stream after it; the bytes equal those of a read waited for at once."""
    from runtime_support import build_model, plan_doc

    import runtime

    model = runtime.shard(build_model("gpt"), plan_doc(placement=NVME_PARAMS, nvme_path=str(tmp_path)))
    unit = _biggest_unit(model)
    store = unit.param_store
    expected = store.read(unit.key, unit.compute_dtype).wait().clone()
    side, issued, compute_done, copy_done = _slow_kernel_and_events(store)
    pending = store.read(unit.key, unit.compute_dtype)
    while not pending.issue_if_landed():  # the store issues the copy itself once the read lands
        pass
    copy_done.record(side)
    # Reads for a device land in the space's pinned read slots, billed as param_swap_buffers
    # ([Note: pinned read slots]), never in the CPU path's recycler.
    slots_bytes = store.copier.streams.pinned_bytes(MemoryTerm.PARAM_SWAP_BUFFERS)
    assert slots_bytes > 0 and store.recycler.pinned_bytes == 0
    got = pending.wait()
    torch.cuda.synchronize()
    assert issued.elapsed_time(copy_done) < issued.elapsed_time(compute_done)
    assert torch.equal(got, expected)
    store.drain()
    assert store._copies == []


@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_host_shard_read_does_not_queue_behind_compute(precision: str) -> None:
    """Property (overlap, measured with CUDA events): a host-tier shard's host-to-device copy,
    issued while a long kernel runs on the compute stream, ends before that kernel (the copy is
    allocated and runs on the copy stream: `CopyEngine.to_device`); the compute stream sees the
    shard's bytes (cast on the device where the compute dtype differs)."""
    from runtime_support import ALL_CPU, build_model, plan_doc

    import runtime

    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_CPU, precision=precision))
    unit = _biggest_unit(model)
    store = unit.param_store
    side, issued, compute_done, copy_done = _slow_kernel_and_events(store)
    pending = store.read(unit.key, unit.compute_dtype)
    copy_done.record(side)
    got = pending.wait()
    torch.cuda.synchronize()
    assert issued.elapsed_time(copy_done) < issued.elapsed_time(compute_done)
    assert torch.equal(got.cpu(), store.resident(unit.key).to(unit.compute_dtype))


# -- 6. the transfer path as a GPU program ([Note: the transfer path as a GPU program]) ------------------


@gpu
@pytest.mark.parametrize("pinning", ["shards", "staged"])
@pytest.mark.parametrize("schedule", ["after_backward", "in_backward"])
@pytest.mark.parametrize("placement", ["cpu", "opt-on-nvme", "all-nvme"])
def test_the_transfer_path_waits_on_the_host_only_in_the_step(placement: str, schedule: str, pinning: str,
                                                              tmp_path: Path) -> None:
    """Property, on CUDA, read off the same trace the emulated device's tests read
    (tests/test_transfer_path.py), by the same checks (`gpu_program_properties_hold`): no runtime
    hook waits on the host; between a forward's start and `optimizer.step()` the threads that issue
    device work never wait on the host, and the step waits at most once; host-to-device and
    device-to-host copies run on their own streams and no copy stream waits for all of another;
    nothing is pinned after the first step; every pinned byte is in the ledger and the bill's term
    for it (to the byte, or within a page per buffer and the parameters the bill's model spec
    leaves out, for the shard terms)."""
    from test_transfer_path import _doc, gpu_program_properties_hold, trained_and_traced

    gpu_program_properties_hold(trained_and_traced(_doc(placement, schedule, pinning, str(tmp_path), 1)))


# -- 9. recompute inputs offloaded asynchronously ([Note: asynchronous recompute-input offload]) -------


@gpu
def test_recompute_input_offload_is_asynchronous_with_one_segment_of_prefetch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Property: with recompute inputs in host memory, neither the offload nor the reload
    waits on the host; the reload of the segment recomputed next is issued when the current
    segment's recompute starts (one segment of prefetch); and the losses are bitwise those of the
    same run with the recompute inputs on the GPU (the bytes travel unchanged, the kernels are the same)."""
    from runtime_support import ALL_DEVICE, batches, build_model, plan_doc

    import runtime
    from runtime.transfer.stores import CopyEngine
    from runtime.units import recompute

    def losses(tier: str, log: list[str] | None = None) -> list[float]:
        torch.manual_seed(0)
        placement = {**ALL_DEVICE, "recompute_inputs": tier}
        model = runtime.shard(build_model("gpt"), plan_doc(placement=placement, recompute_interval=1))
        opt = runtime.AdamW(model, lr=1e-3)
        segments = runtime.state_of(model).segments
        if log is not None:
            real_replay, real_back = recompute.RecomputeSegment._replay, CopyEngine.back_to_device
            monkeypatch.setattr(recompute.RecomputeSegment, "_replay",
                                lambda seg, m: (log.append(f"replay {segments.index(seg)}"), real_replay(seg, m))[1])
            monkeypatch.setattr(CopyEngine, "back_to_device", lambda eng, host, saved, link="h2d": (
                log.append("h2d"), real_back(eng, host, saved, link))[1])
            real_wait = torch.cuda.Event.synchronize
            monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda e: (log.append("host wait"), real_wait(e)))
        out = []
        for tokens in batches(2):
            tokens = tokens.cuda()
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            loss.backward()
            if log is not None:
                log.append("step")
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        monkeypatch.undo()
        return out

    log: list[str] = []
    offloaded = losses("cpu", log)
    assert offloaded == losses("gpu")
    first_step = log[: log.index("step")]
    assert "host wait" not in first_step
    # Two segments, recomputed last first: the first segment's reload is issued as the second's
    # recompute starts (after the second's own reload), before the first's recompute.
    assert first_step == ["replay 1", "h2d", "h2d", "replay 0"]
