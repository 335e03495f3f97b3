"""Swap directory lifecycle, the extent allocator, the buffer pool and SwapStore round trips."""

from __future__ import annotations

import json
import os
import random
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.nvme import (
    BufferPool,
    BufferRecycler,
    EngineConfig,
    Extent,
    ExtentAllocator,
    IOEngine,
    SwapDirectory,
    SwapFullError,
    SwapStore,
    find_stale_swap_dirs,
    remove_stale_swap_dirs,
)

REPO = Path(__file__).resolve().parents[1]


# -- extent allocator ------------------------------------------------------------------------------
def test_extents_are_aligned_first_fit_and_reused():
    allocator = ExtentAllocator(64 * 4096)
    a = allocator.allocate(1)
    b = allocator.allocate(4096)
    c = allocator.allocate(4097)
    assert (a, b, c) == (
        Extent(offset_bytes=0, nbytes=1, reserved_bytes=4096),
        Extent(offset_bytes=4096, nbytes=4096, reserved_bytes=4096),
        Extent(offset_bytes=8192, nbytes=4097, reserved_bytes=8192),
    )
    assert allocator.used_bytes == 16384
    allocator.free(b)
    assert allocator.allocate(100) == Extent(offset_bytes=4096, nbytes=100, reserved_bytes=4096)  # the hole reused
    assert allocator.num_extents == 3


def test_freed_neighbours_coalesce_into_one_extent():
    allocator = ExtentAllocator(4 * 4096)
    extents = [allocator.allocate(4096) for _ in range(4)]
    with pytest.raises(SwapFullError, match="swap file full: 1 bytes requested, largest free extent 0 of 16384"):
        allocator.allocate(1)
    for index in (1, 3, 2, 0):  # free out of order
        allocator.free(extents[index])
    assert allocator.used_bytes == 0
    assert allocator.largest_free_bytes() == 4 * 4096
    assert allocator.allocate(4 * 4096) == Extent(offset_bytes=0, nbytes=16384, reserved_bytes=16384)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40_000)), max_size=60))
def test_allocator_never_overlaps_and_accounts_exactly(operations):
    allocator = ExtentAllocator(256 * 4096)
    live: list[Extent] = []
    for allocate, size in operations:
        if allocate or not live:
            try:
                live.append(allocator.allocate(size))
            except SwapFullError:
                assert allocator.largest_free_bytes() < -(-size // 4096) * 4096
        else:
            allocator.free(live.pop(size % len(live)))
        spans = sorted((e.offset_bytes, e.end_bytes) for e in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
        assert all(e.offset_bytes % 4096 == 0 and e.reserved_bytes >= e.nbytes for e in live)
        assert allocator.used_bytes == sum(e.reserved_bytes for e in live)


# -- swap directory --------------------------------------------------------------------------------
def test_swap_directory_is_private_and_removed_on_close(tmp_path):
    with SwapDirectory(tmp_path, rank=3) as directory:
        store = SwapStore(directory, "optimizer_states", capacity_bytes=10_000)
        assert directory.path.parent == tmp_path and directory.path.name.startswith("tierwise-swap-r3-")
        assert stat.S_IMODE(directory.path.stat().st_mode) == 0o700
        assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
        assert store.path.stat().st_size == store.capacity_bytes == 12288  # preallocated, 4 KiB-rounded
        assert store.path.stat().st_blocks * 512 >= 12288  # fallocated, not sparse
        owner = json.loads((directory.path / "owner.json").read_text())
        assert (owner["pid"], owner["rank"]) == (os.getpid(), 3)
        assert stat.S_IMODE((directory.path / "owner.json").stat().st_mode) == 0o600
        store.close()
    assert list(tmp_path.iterdir()) == []
    directory.close()  # idempotent


def _child(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


def test_swap_directory_is_removed_at_interpreter_exit(tmp_path):
    result = _child(
        f"""
        from runtime.nvme import SwapDirectory, SwapStore
        directory = SwapDirectory({str(tmp_path)!r})
        SwapStore(directory, "params", capacity_bytes=1 << 20)
        print(directory.path)
        """
    )
    assert result.returncode == 0, result.stderr
    assert not Path(result.stdout.strip()).exists()
    assert list(tmp_path.iterdir()) == []


def test_crashed_run_leaves_a_detectable_stale_directory(tmp_path):
    result = _child(
        f"""
        import os
        from runtime.nvme import SwapDirectory, SwapStore
        directory = SwapDirectory({str(tmp_path)!r}, rank=1)
        SwapStore(directory, "params", capacity_bytes=1 << 20)
        print(os.getpid(), directory.path, flush=True)
        os._exit(9)  # a crash: no atexit, no cleanup
        """
    )
    assert result.returncode == 9
    pid, path = result.stdout.split()
    with SwapDirectory(tmp_path) as live:  # a running owner is never stale
        [stale] = find_stale_swap_dirs(tmp_path)
        assert (stale.path, stale.pid, stale.rank) == (Path(path), int(pid), 1)
        assert stale.nbytes >= 1 << 20
        assert remove_stale_swap_dirs(tmp_path) == [Path(path)]
        assert list(tmp_path.iterdir()) == [live.path]


# -- buffer pool -----------------------------------------------------------------------------------
class RecordingPinHook:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def pin(self, address: int, nbytes: int) -> None:
        self.calls.append(("pin", address, nbytes))

    def unpin(self, address: int) -> None:
        self.calls.append(("unpin", address, 0))


def test_buffer_pool_pins_once_and_bounds_buffers_in_use():
    hook = RecordingPinHook()
    with BufferPool(buffer_bytes=10_000, num_buffers=2, pin_hook=hook) as pool:
        first, second = pool.acquire(), pool.acquire()
        assert first.address % 4096 == second.address % 4096 == 0
        assert (first.nbytes, first.capacity_bytes, pool.total_bytes, pool.pinned) == (10_000, 12288, 24576, True)
        with pytest.raises(TimeoutError, match="no free buffer in the pool of 2"):
            pool.acquire(timeout_s=0.01)
        pool.release(first)
        assert pool.acquire() is first
        addresses = sorted([first.address, second.address])
    assert sorted(a for kind, a, _ in hook.calls if kind == "pin") == addresses
    assert [n for kind, _, n in hook.calls if kind == "pin"] == [12288, 12288]
    assert sorted(a for kind, a, _ in hook.calls if kind == "unpin") == addresses


def test_recycled_buffer_comes_back_when_the_last_view_is_freed():
    torch = pytest.importorskip("torch")
    recycler = BufferRecycler(max_held_bytes=3 * 12288)
    first = torch.from_numpy(recycler.lease(10_000)).view(torch.float32)
    address = first.data_ptr()
    assert address % 4096 == 0 and first.numel() == 2500
    view = first[100:200]
    del first
    assert recycler.free_bytes == 0  # a view still uses the memory
    del view
    assert recycler.free_bytes == 12288
    again = torch.from_numpy(recycler.lease(10_000))
    other = torch.from_numpy(recycler.lease(5_000))  # another size: a buffer of its own
    assert (again.data_ptr(), recycler.num_reused, recycler.free_bytes) == (address, 1, 0)
    assert other.data_ptr() != address
    extra = [torch.from_numpy(recycler.lease(10_000)) for _ in range(3)]
    assert recycler.leased_bytes == 4 * 12288 + 8192
    del again, extra
    # Kept while leased (`other`, 8192 bytes) and kept add up to at most the bound: two of the four;
    # the rest were unmapped.
    assert (recycler.leased_bytes, recycler.free_bytes) == (8192, 2 * 12288)
    recycler.close()
    assert recycler.free_bytes == 0
    other.fill_(1)  # still valid after close; unmapped when freed
    del other
    assert recycler.free_bytes == 0


def test_a_fresh_lease_unmaps_kept_buffers_of_other_sizes_beyond_the_bound():
    """Leased + kept stays within the bound when a lease of a new size needs a fresh buffer: kept
    buffers of other sizes go first (else they sat beside it, memory no bill holds)."""
    torch = pytest.importorskip("torch")
    recycler = BufferRecycler(max_held_bytes=2 * 12288)
    small = [torch.from_numpy(recycler.lease(10_000)) for _ in range(2)]
    del small
    assert recycler.free_bytes == 2 * 12288
    large = torch.from_numpy(recycler.lease(20_000))  # 20480 bytes: no free buffer of its size
    assert (recycler.leased_bytes, recycler.free_bytes) == (20480, 0)
    del large
    recycler.close()


def test_memory_held_outside_counts_against_the_bound():
    """A recompute copies a read buffer into a torch allocation (runtime/units/group.py `own_buffer`): the
    copy stands in for the buffer, so kept buffers make room for it until it is released."""
    torch = pytest.importorskip("torch")
    recycler = BufferRecycler(max_held_bytes=2 * 12288)
    kept = [torch.from_numpy(recycler.lease(10_000)) for _ in range(2)]
    del kept
    recycler.hold_outside(12288)
    assert recycler.free_bytes == 12288
    back = torch.from_numpy(recycler.lease(10_000))  # reuses the one kept
    del back
    assert recycler.free_bytes == 12288  # 12288 outside + 12288 kept: at the bound
    recycler.release_outside(12288)
    more = [torch.from_numpy(recycler.lease(10_000)) for _ in range(2)]
    del more
    assert recycler.free_bytes == 2 * 12288
    recycler.close()


# -- swap store ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["io_uring", "threads", "python"])
def test_swap_store_round_trips_many_extents_concurrently(tmp_path, backend):
    rng = random.Random(backend)
    engine = IOEngine(EngineConfig(block_size_bytes=64 << 10, backend=backend))
    with SwapDirectory(tmp_path, needed_bytes=8 << 20) as directory, SwapStore(
        directory, "params", capacity_bytes=8 << 20, engine=engine
    ) as store:
        assert store.direct
        sizes = [rng.randrange(1, 200_000) for _ in range(30)]
        extents = [store.allocate(n) for n in sizes]
        payloads = [rng.randbytes(n) for n in sizes]
        handles = [store.write_async(e, p) for e, p in zip(extents, payloads, strict=True)]
        for handle in handles:
            handle.wait()
        for extent in extents[::2]:  # free half, reuse the space for new data
            store.free(extent)
        fresh = [store.allocate(n) for n in sizes[::2]]
        fresh_payloads = [rng.randbytes(n) for n in sizes[::2]]
        for handle in [store.write_async(e, p) for e, p in zip(fresh, fresh_payloads, strict=True)]:
            handle.wait()
        expected = list(zip(extents[1::2] + fresh, payloads[1::2] + fresh_payloads, strict=True))
        targets = [bytearray(len(p)) for _, p in expected]
        for handle in [store.read_async(e, t) for (e, _), t in zip(expected, targets, strict=True)]:
            handle.wait()
        assert [bytes(t) for t in targets] == [p for _, p in expected]
        with pytest.raises(ValueError, match="does not fit extent"):
            store.write_async(fresh[0], bytes(fresh[0].reserved_bytes + 1))


def test_swap_store_moves_pool_buffers_and_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")  # runtime extra; installed in the dev environment
    with SwapDirectory(tmp_path) as directory, SwapStore(
        directory, "optimizer_states", capacity_bytes=4 << 20
    ) as store, BufferPool(buffer_bytes=1 << 20, num_buffers=2) as pool:
        state = torch.randn(1 << 18, dtype=torch.float32)  # 1 MiB
        extent = store.allocate(state.numel() * 4)
        staging = pool.acquire()
        torch.frombuffer(staging.view, dtype=torch.float32).copy_(state)
        store.write_async(extent, staging.view).wait()
        torch.frombuffer(staging.view, dtype=torch.float32).zero_()
        store.read_async(extent, staging.view).wait()
        assert torch.equal(torch.frombuffer(staging.view, dtype=torch.float32), state)
        back = torch.empty_like(state)
        store.read_async(extent, back).wait()  # straight into a tensor, no staging
        assert torch.equal(back, state)
        pool.release(staging)


@pytest.mark.gpu
def test_pinned_pool_buffers_round_trip_nvme_to_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    from runtime.nvme.pinning import TorchCudaPinHook

    with SwapDirectory(tmp_path) as directory, SwapStore(directory, "params", capacity_bytes=8 << 20) as store, BufferPool(
        buffer_bytes=4 << 20, num_buffers=1, pin_hook=TorchCudaPinHook()
    ) as pool:
        staging = pool.acquire()
        host = torch.frombuffer(staging.view, dtype=torch.float32)
        host.copy_(torch.randn(host.numel()))
        expected = host.clone()
        extent = store.allocate(4 << 20)
        store.write_async(extent, staging.view).wait()
        host.zero_()
        store.read_async(extent, staging.view).wait()
        on_gpu = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.cpu(), expected)
        del host
        pool.release(staging)


def test_staged_writes_are_sized_in_the_stored_dtype(tmp_path):
    """A bf16 gradient written into its fp32 shard needs staging of the fp32 size, also when a larger
    shard is created after the first write (the reused staging buffer must be replaced, not
    overrun). Regression: the sweep's bf16 all-NVMe plan failed here."""
    import torch

    from runtime.ledger import MemoryLedger
    from runtime.transfer.nvme_store import NvmeSpace, NvmeStore
    from runtime.transfer.stores import CopyEngine

    space = NvmeSpace(str(tmp_path), rank=0, capacity_bytes={"gradients": 1 << 20}, node_needed_bytes=1 << 20,
                        block_size_bytes=1 << 20)
    store = NvmeStore(term="gradients", ledger=MemoryLedger(), copier=CopyEngine(torch.device("cpu"), {}),
                      name="gradients", swap=space)
    small = torch.arange(1024, dtype=torch.bfloat16)
    store.create("small", small.numel(), torch.float32)
    store.write("small", small)
    store.write("small", small)  # both staging buffers in flight: the next write reuses one
    big = torch.arange(2048, dtype=torch.bfloat16)
    store.create("big", big.numel(), torch.float32)
    store.write("big", big)
    for key, src in (("small", small), ("big", big)):
        out = torch.empty(src.numel(), dtype=torch.float32)
        store.read_into(key, out).wait()
        assert torch.equal(out, src.float())
    store.close()
    space.close()


def _deferred_store(tmp_path, monkeypatch, name: str, **space_kwargs):  # noqa: ANN001, ANN202
    """An NVMe store of `name` whose writes run only when waited for (`DeferredWrites`)."""
    import torch
    from runtime_support import DeferredWrites

    from runtime.ledger import MemoryLedger
    from runtime.transfer.nvme_store import NvmeSpace, NvmeStore
    from runtime.transfer.stores import CopyEngine

    space = NvmeSpace(str(tmp_path), rank=0, capacity_bytes={name: 1 << 20}, node_needed_bytes=1 << 20,
                      block_size_bytes=1 << 20, **space_kwargs)
    ledger = MemoryLedger()
    store = NvmeStore(term=name, ledger=ledger, copier=CopyEngine(torch.device("cpu"), {}), name=name, swap=space)
    writes = DeferredWrites()
    writes.install(monkeypatch)
    return space, store, ledger, writes


def test_gradient_store_keeps_the_bills_writes_in_flight(tmp_path, monkeypatch):
    """The gradient store stages up to `gradient_write_buffers` writes before waiting for one, and
    then waits for the oldest only ([Note: gradient write buffers] in planner/cost/memory.py): writes
    here start only when waited, so what the store waits for is visible."""
    import torch

    space, store, ledger, writes = _deferred_store(tmp_path, monkeypatch, "gradients", gradient_write_buffers=4)
    shards = [torch.full((1024,), float(i)) for i in range(6)]
    for i, shard in enumerate(shards):
        store.create(f"g{i}", shard.numel(), torch.float32)
    for i in range(4):
        store.write(f"g{i}", shards[i])
    assert writes.waited == []  # four staged, none waited for
    assert ledger.usage("cpu").term_peaks["gradient_swap_buffers"] == 4 * 4096
    store.write("g4", shards[4])
    store.write("g5", shards[5])
    assert writes.waited == [0, 1]  # each further write waits for the oldest, reusing its buffer
    assert ledger.usage("cpu").term_peaks["gradient_swap_buffers"] == 4 * 4096
    store.drain()
    for i, shard in enumerate(shards):
        out = torch.empty(1024)
        store.read_into(f"g{i}", out).wait()
        assert torch.equal(out, shard)
    store.close()
    space.close()


def test_reads_and_writes_wait_for_the_writes_in_flight_that_overlap_them(tmp_path, monkeypatch):
    """[Note: ordering of NVMe transfers]: writes of disjoint chunks of a shard stay in flight
    together (the optimizer's), a write or read of a range waits for those overlapping it only, and
    what lands is the order the caller wrote in."""
    import torch

    space, store, _, writes = _deferred_store(tmp_path, monkeypatch, "optimizer_states")
    store.create("a", 3072, torch.float32)
    first, second, across = torch.full((1024,), 1.0), torch.full((1024,), 2.0), torch.full((1024,), 3.0)
    store.write_from("a", first, 0)
    store.write_from("a", second, 1024)
    assert writes.waited == []  # disjoint: both in flight
    store.write_from("a", across, 512)
    assert writes.waited == [0, 1]  # over the halves of both: they land first
    tail = torch.empty(1024)
    store.read_into("a", tail, 2048).wait()
    assert writes.waited == [0, 1] and writes.unrun() == 1  # past the write in flight: not waited for
    assert torch.equal(tail, torch.zeros(1024))
    whole = torch.empty(3072)
    store.read_into("a", whole).wait()
    assert writes.waited == [0, 1, 2]
    expected = torch.cat([first[:512], across, second[512:], torch.zeros(1024)])
    assert torch.equal(whole, expected)
    store.close()
    space.close()
