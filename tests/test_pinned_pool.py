"""The pinned staging pool ([Note: staged host copies] in runtime/transfer/pinned_pool.py and
[Note: the pinned staging pool] in planner/cost/memory.py): CPU-tier state is pageable, every host<->device
copy of it goes through a few reused buffers, their number and size come from the plan, and the bill
charges exactly what the runtime holds.

On the CPU the tests run the CUDA data path with `CopyEngine.separate_memory_on_cpu` (host-tier
shards staged through the pool into fresh tensors; copies complete in the call) on a plan whose
hardware keeps host and device memory apart; tests marked `gpu` check the asynchronous path on CUDA."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from runtime_support import ALL_CPU, ALL_DEVICE, HARDWARE, batches, build_model, plan_doc, run_distributed

import runtime
from planner.cost.memory import PinnedPoolShape, largest_unit_params, memory_bill, pinned_staging_pool
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.memory_terms import MemoryTerm
from planner.specs.plan import Placement, Plan
from planner.specs.units import round_up_4kib
from runtime.ckpt.rank_state import save_rank
from runtime.transfer.host_store import HostStore
from runtime.transfer.pinned_pool import StagingPool, _StagedCopy
from runtime.transfer.stores import CopyEngine
from runtime.transfer.trace import Role

gpu = pytest.mark.gpu
SEPARATE = {**HARDWARE, "host_is_device": False}
"""The 2-core CPU preset's numbers (`cpu-dev-2core`) with a device memory of its own: the bill charges the pool."""


# -- the plan's pool and its bill ---------------------------------------------------------------------


def _dgx_plan(placement: Placement, **knobs: object) -> Plan:
    return Plan(model=resolve_model("gpt3-1.3b"), node=resolve_hardware("dgx-h100"), num_gpus=8, strategy="custom",
                placement=placement, **knobs)


def test_bill_charges_the_pool_the_runtime_sizes() -> None:
    plan = _dgx_plan(Placement(params="cpu", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu"),
                     prefetch_depth=2)
    shape = pinned_staging_pool(plan)
    unit_shard_fp32 = largest_unit_params(plan) / plan.data_parallel_degree * 4
    assert shape == PinnedPoolShape(buffer_bytes=round_up_4kib(math.ceil(unit_shard_fp32)), num_buffers=2 + 2)
    per_node = memory_bill(plan).terms["cpu"][MemoryTerm.PINNED_STAGING_POOL]
    assert per_node == shape.num_buffers * shape.buffer_bytes * plan.cluster.gpus_per_node


def test_no_pool_without_host_state_crossing_a_link() -> None:
    on_device = _dgx_plan(Placement(params="gpu", gradients="gpu", optimizer_states="gpu", recompute_inputs="gpu"))
    on_nvme = _dgx_plan(Placement(params="nvme", gradients="nvme", optimizer_states="nvme",
                                  recompute_inputs="gpu"))
    cpu_machine = Plan.from_dict(plan_doc(placement=ALL_CPU))  # the host is the device
    for plan in (on_device, on_nvme, cpu_machine):
        assert MemoryTerm.PINNED_STAGING_POOL not in memory_bill(plan).terms["cpu"]
    only_recompute_inputs = _dgx_plan(Placement(params="gpu", gradients="gpu", optimizer_states="gpu",
                                                recompute_inputs="cpu"), recompute_interval=1)
    assert MemoryTerm.PINNED_STAGING_POOL in memory_bill(only_recompute_inputs).terms["cpu"]


# -- the pool's bound -----------------------------------------------------------------------------------


class _Event:
    """A copy-stream event the test completes by hand (`synchronize` is the host waiting for it)."""

    def __init__(self, log: list[str], name: str) -> None:
        self.done, self.log, self.name = False, log, name
        self.layer = self  # the `Streams` a host waits through

    def query(self) -> bool:
        return self.done

    def host_wait(self, event: _Event, why: str, kind: object = None) -> None:  # noqa: ARG002
        event.synchronize()

    def synchronize(self) -> None:
        if not self.done:  # a completed event returns at once
            self.log.append(f"wait {self.name}")
        self.done = True


def test_a_lease_with_every_buffer_out_finishes_the_oldest_copy_first() -> None:
    pool = StagingPool(PinnedPoolShape(buffer_bytes=4096, num_buffers=2))
    log: list[str] = []
    for name in ("a", "b"):
        pool._track(_StagedCopy(pool, pool.acquire(), _Event(log, name), lambda name=name: log.append(f"land {name}")))
    assert pool.num_leased == 2 and log == []
    third = pool.acquire()  # none free: waits for "a" (queued first), lands it, takes its buffer
    assert log == ["wait a", "land a"] and pool.num_leased == 2
    pool.release(third)
    pool.drain()
    assert log == ["wait a", "land a", "wait b", "land b"]
    assert pool.peak_leased == 2 and pool.num_leases == 3 and pool.num_leased == 0


def test_finished_copies_come_back_without_a_wait() -> None:
    pool = StagingPool(PinnedPoolShape(buffer_bytes=4096, num_buffers=2))
    log: list[str] = []
    event = _Event(log, "a")
    pool._track(_StagedCopy(pool, pool.acquire(), event, lambda: log.append("land a")))
    event.done = True  # the copy stream got there on its own
    pool.release(pool.acquire())
    assert log == ["land a"] and pool.num_leased == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_transfer_larger_than_a_buffer_goes_in_pieces(dtype: torch.dtype) -> None:
    pool = StagingPool(PinnedPoolShape(buffer_bytes=4096, num_buffers=2))
    src = torch.randn(10_000).to(dtype)
    on_device = torch.empty_like(src)
    assert pool.to_device(on_device, src, None) is None
    back = torch.zeros_like(src)
    pool.to_host(on_device, lambda piece, at: back[at : at + piece.numel()].copy_(piece), None).finish()
    assert torch.equal(back, src)
    pieces = math.ceil(src.numel() * src.element_size() / 4096)
    assert pool.num_leases == 2 * pieces and pool.peak_leased == 1 and pool.num_leased == 0


# -- a training step of each placement through the pool -----------------------------------------------

PLACEMENTS = {
    "all-cpu": ALL_CPU,
    "params-on-host": {**ALL_DEVICE, "params": "cpu"},
    "states-on-host": {**ALL_CPU, "params": "gpu", "recompute_inputs": "gpu"},
    "recompute-inputs-on-host": {**ALL_DEVICE, "recompute_inputs": "cpu"},
}


def _train(doc: dict, steps: int = 3) -> tuple[list[str], object, object]:
    model = runtime.shard(build_model("gpt"), doc)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    losses = []
    for tokens in batches(steps):
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return losses, model, opt


def _host_shards(state: object) -> list[torch.Tensor]:
    stores = [store for store in state.stores if isinstance(store, HostStore)]
    return [store.resident(key) for store in stores for key in store.keys()]  # noqa: SIM118 - not a dict


class _PinnedAllocations:
    """Records every torch allocation asking for pinned memory (the old per-call pinned staging)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        for name in ("empty", "zeros", "empty_like", "zeros_like"):
            real = getattr(torch, name)

            def spy(*args, _real=real, _name=name, **kwargs):  # noqa: ANN002, ANN003, ANN202
                if kwargs.get("pin_memory"):
                    self.calls.append(_name)
                return _real(*args, **kwargs)

            monkeypatch.setattr(torch, name, spy)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_a_training_step_stays_within_the_pool_and_is_bitwise_the_cpu_run(
        name: str, precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Staged through the pool, each placement trains to the bits of the CPU machine's run (copies are
    exact); the pool's leases never exceed its buffers, no allocation asks for pinned memory, host
    shards are plain memory, and the ledger charges the pool exactly what the bill does."""
    doc = plan_doc(placement=PLACEMENTS[name], precision=precision, recompute_interval=1, prefetch_depth=2,
                   hardware=SEPARATE)
    direct, plain_model, _ = _train(doc)
    assert runtime.state_of(plain_model).copier.pool is None  # the CPU machine copies nothing
    pinned = _PinnedAllocations(monkeypatch)
    monkeypatch.setattr(CopyEngine, "separate_memory_on_cpu", True)
    staged, model, _ = _train(doc)
    assert staged == direct
    state = runtime.state_of(model)
    pool = state.copier.pool
    shape = pinned_staging_pool(state.plan)
    assert (pool.buffers.num_buffers, pool.buffer_bytes) == (shape.num_buffers, shape.buffer_bytes)
    pool.drain()  # the last write-backs' copies are still in flight, as on a device
    assert pool.num_leases > 0 and 1 <= pool.peak_leased <= pool.buffers.num_buffers and pool.num_leased == 0
    assert pinned.calls == []
    assert not any(shard.is_pinned() for shard in _host_shards(state))
    billed = memory_bill(state.plan).terms["cpu"][MemoryTerm.PINNED_STAGING_POOL] // state.plan.cluster.gpus_per_node
    assert state.ledger.usage("cpu").terms[MemoryTerm.PINNED_STAGING_POOL] == billed == pool.buffers.total_bytes


def two_rank_worker(emulate: bool, *, rank: int, world_size: int) -> dict:  # noqa: ARG001
    """One gloo rank's run of the all-CPU plan, staged through the pool or not (run_distributed)."""
    CopyEngine.separate_memory_on_cpu = emulate
    try:
        doc = plan_doc(world_size=world_size, placement=ALL_CPU, precision="bf16", recompute_interval=1,
                       prefetch_depth=2, hardware=SEPARATE)
        losses, model, _ = _train(doc)
    finally:
        CopyEngine.separate_memory_on_cpu = False
    pool = runtime.state_of(model).copier.pool
    return {"losses": losses, "pool": None if pool is None else [pool.num_leases, pool.peak_leased, pool.buffers.num_buffers]}


def test_two_ranks_through_the_pool_are_bitwise_the_cpu_run(tmp_path: Path) -> None:
    """Reduce-scattered gradient shards are written and accumulated into host shards through the pool."""
    direct, staged = run_distributed("two_rank_worker", [(False,), (True,)], tmp_path, module="test_pinned_pool")
    assert staged["losses"] == direct["losses"] and direct["pool"] is None
    leases, peak, buffers = staged["pool"]
    assert leases > 0 and 1 <= peak <= buffers


def test_a_checkpoint_save_leases_from_the_pool_and_writes_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = plan_doc(placement=ALL_CPU, recompute_interval=1, hardware=SEPARATE)
    files = {}
    for emulate in (False, True):
        monkeypatch.setattr(CopyEngine, "separate_memory_on_cpu", emulate)
        _, model, opt = _train(doc, steps=2)
        state = runtime.state_of(model)
        leases = state.copier.pool.num_leases if emulate else 0
        out = tmp_path / str(emulate)
        out.mkdir()
        save_rank(out, rank=0, step=2, state=state, optimizer=opt, scalars={})
        if emulate:
            assert state.copier.pool.num_leases == leases + 1 and state.copier.pool.num_leased == 0
        files[emulate] = (out / "rank-00000.safetensors").read_bytes()
    assert files[True] == files[False]


# -- CUDA: the asynchronous path ------------------------------------------------------------------------


def _pinned_handouts() -> int:
    """Pinned blocks torch's host allocator has handed out so far (pin_memory tensors)."""
    return torch.cuda.host_memory_stats().get("active_requests.allocated", 0)


@gpu
def test_cuda_pieces_through_two_buffers_round_trip_bitwise() -> None:
    """Property: a transfer of 64 pieces through 2 pinned buffers is exact both ways, so a buffer is
    never reused before the copy reading (or writing) it completed; the buffers are registered with
    CUDA (copies from them are asynchronous) and torch pins nothing else."""
    from runtime.nvme.pinning import TorchCudaPinHook

    pool = StagingPool(PinnedPoolShape(buffer_bytes=64 * 1024, num_buffers=2), TorchCudaPinHook())
    copier = CopyEngine(torch.device("cuda"), {}, pool)
    before = _pinned_handouts()
    src = torch.randn(64 * 16 * 1024)
    on_device, event = copier.stage_to_device(src)
    copier.streams.wait(Role.COMPUTE, event)
    doubled = on_device * 2  # on the compute stream, after the copy
    back = torch.empty_like(src)
    saved = copier.to_host(doubled, lambda piece, at: back[at : at + piece.numel()].copy_(piece))
    again, event = copier.back_to_device(back, saved)  # pieces still in their buffers go from there
    copier.streams.wait(Role.COMPUTE, event)
    saved.finish()
    assert torch.equal(back, src * 2) and torch.equal(again.cpu(), src * 2)
    assert pool.buffers.pinned and torch.frombuffer(pool.acquire().view, dtype=torch.uint8).is_pinned()
    assert pool.peak_leased <= 2 and _pinned_handouts() == before
    pool.close()


@gpu
@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_cuda_cpu_offload_step_pins_only_the_billed_pool(name: str) -> None:
    """Property: during CPU-offload steps on CUDA the only pinned host memory is the staging pool, of
    the size `pinned_staging_pool` gives the plan (what the bill charges on such hardware): torch's
    pinned allocator hands out nothing, host shards are pageable, the pool's bound holds."""
    torch.cuda.synchronize()
    before = _pinned_handouts()
    doc = plan_doc(placement=PLACEMENTS[name], recompute_interval=1, prefetch_depth=2)
    model = runtime.shard(build_model("gpt"), doc)
    opt = runtime.AdamW(model, lr=1e-3)
    for tokens in batches(3):
        tokens = tokens.cuda()
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    state = runtime.state_of(model)
    pool = state.copier.pool
    shape = pinned_staging_pool(state.plan)
    assert pool.buffers.pinned and pool.buffers.total_bytes == shape.num_buffers * shape.buffer_bytes
    assert state.ledger.usage("cpu").terms[MemoryTerm.PINNED_STAGING_POOL] == pool.buffers.total_bytes
    assert 1 <= pool.peak_leased <= pool.buffers.num_buffers
    assert _pinned_handouts() == before
    assert not any(shard.is_pinned() for shard in _host_shards(state))


@gpu
@pytest.mark.parametrize("placement", [{**ALL_DEVICE, "params": "cpu", "recompute_inputs": "cpu"},
                                       {**ALL_DEVICE, "recompute_inputs": "cpu"}],
                         ids=["params-and-recompute-inputs-on-host", "recompute-inputs-on-host"])
def test_cuda_host_params_and_recompute_inputs_train_bitwise_like_the_device(placement: dict) -> None:
    """Property: parameters and recompute inputs staged through the pool on the copy stream (asynchronous,
    buffers reused as soon as their copies complete) reach the compute bit for bit: with the
    gradients and optimizer on the device the math is the device placement's, and so are the losses
    (attention on the math backend: the fused backends' backward may accumulate in any order)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def losses(where: dict) -> list[str]:
        model = runtime.shard(build_model("gpt"), plan_doc(placement=where, recompute_interval=1, prefetch_depth=2))
        opt = runtime.AdamW(model, lr=1e-3)
        out = []
        for tokens in batches(5):
            tokens = tokens.cuda()
            with sdpa_kernel(SDPBackend.MATH):
                loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
                loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item().hex())
        return out

    torch.backends.cuda.matmul.allow_tf32 = False
    assert losses(placement) == losses(ALL_DEVICE)
