"""Host-side passes over large gradients without a gradient-sized temporary: `add_into` (a 16-bit
gradient added into an fp32 host shard in chunks, [Note: a mixed-precision add on the CPU] in
runtime/transfer/mixed_add.py), bitwise torch's `add_`, the stores that use it, and the loss scaler's
overflow check by sum."""

from __future__ import annotations

import pytest
import torch

import runtime.transfer.mixed_add as mixed_add
from planner.cost.memory import PinnedPoolShape
from runtime.ledger import MemoryLedger
from runtime.optim.loss_scaling import not_finite
from runtime.transfer.host_store import HostStore
from runtime.transfer.mixed_add import CHUNK_ELEMENTS, add_into
from runtime.transfer.pinned_pool import StagingPool
from runtime.transfer.stores import CopyEngine, DeviceStore

SIZES = (1, CHUNK_ELEMENTS, CHUNK_ELEMENTS + 1, 2 * CHUNK_ELEMENTS + 12345)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("numel", SIZES)
def test_add_into_is_bitwise_torchs_add(dtype: torch.dtype, numel: int) -> None:
    gen = torch.Generator().manual_seed(numel)
    base = torch.randn(numel, generator=gen) * 1e3
    src = (torch.randn(numel, generator=gen) * 1e-2).to(dtype)
    expected, got = base.clone(), base.clone()
    expected.add_(src)
    add_into(got, src)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


def test_a_large_mixed_add_goes_through_one_chunk_sized_scratch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above a chunk every cast lands in one scratch of CHUNK_ELEMENTS (no temporary the size of the
    gradient); at most a chunk, or with equal dtypes, the add is torch's own."""
    allocated: list[tuple] = []
    real_empty = torch.empty

    def counting_empty(*size, **kwargs):  # noqa: ANN002, ANN003, ANN202
        allocated.append(size)
        return real_empty(*size, **kwargs)

    monkeypatch.setattr(mixed_add.torch, "empty", counting_empty)
    add_into(torch.zeros(3 * CHUNK_ELEMENTS + 7), torch.ones(3 * CHUNK_ELEMENTS + 7, dtype=torch.bfloat16))
    assert allocated == [(CHUNK_ELEMENTS,)]
    allocated.clear()
    add_into(torch.zeros(CHUNK_ELEMENTS), torch.ones(CHUNK_ELEMENTS, dtype=torch.bfloat16))
    add_into(torch.zeros(4 * CHUNK_ELEMENTS), torch.ones(4 * CHUNK_ELEMENTS))
    assert allocated == []


def test_a_bf16_target_adds_as_torch_does() -> None:
    """Only fp32 targets take the chunked cast: a 16-bit target rounds as torch's add rounds it."""
    target = torch.full((CHUNK_ELEMENTS + 3,), 1.0, dtype=torch.bfloat16)
    src = torch.full((CHUNK_ELEMENTS + 3,), 1e-3)
    expected = target.clone().add_(src)
    add_into(target, src)
    assert torch.equal(target, expected)


@pytest.mark.parametrize("store_cls", [HostStore, DeviceStore])
def test_stores_accumulate_large_bf16_gradients_exactly(store_cls: type) -> None:
    """A gradient of more than a chunk, written then accumulated at an offset, as the gradient
    sinks do for accumulation steps and tied weights (runtime/units/gradients.py)."""
    numel, offset = 3 * CHUNK_ELEMENTS, 1000
    store = store_cls(term="gradients", ledger=MemoryLedger(), copier=CopyEngine(torch.device("cpu"), {}))
    store.create("u", numel, torch.float32)
    gen = torch.Generator().manual_seed(0)
    first = torch.randn(numel - offset, generator=gen).to(torch.bfloat16)
    second = torch.randn(numel - offset, generator=gen).to(torch.bfloat16)
    store.write("u", first, offset).wait()
    store.accumulate("u", second, offset).wait()
    expected = torch.zeros(numel)
    expected[offset:] = first.float()
    expected[offset:].add_(second)
    assert torch.equal(store.resident("u"), expected)


def test_a_host_store_lands_staged_pieces_with_the_chunked_add(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA data path (emulated on the CPU): gradients come off the device in pieces through the
    staging pool and each piece is added into the host shard where it lands."""
    monkeypatch.setattr(CopyEngine, "separate_memory_on_cpu", True)
    numel = 5 * CHUNK_ELEMENTS
    pool = StagingPool(PinnedPoolShape(buffer_bytes=4 * CHUNK_ELEMENTS * 2, num_buffers=3))
    store = HostStore(term="gradients", ledger=MemoryLedger(), copier=CopyEngine(torch.device("cpu"), {}, pool))
    store.create("u", numel, torch.float32)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(numel, generator=gen).to(torch.bfloat16) for _ in range(3)]
    store.write("u", grads[0]).wait()
    for grad in grads[1:]:
        store.accumulate("u", grad).wait()
    pool.drain()
    expected = grads[0].float()
    for grad in grads[1:]:
        expected.add_(grad)
    assert torch.equal(store.resident("u"), expected)
    assert pool.num_leases == 3 * 2  # three transfers of two pieces (4 Mi + 1 Mi elements) each


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_overflow_check_by_sum_flags_exactly_the_tensors_with_inf_or_nan(dtype: torch.dtype) -> None:
    """[Note: an overflow check by sum] in runtime/optim/loss_scaling.py: one inf, one -inf, both (their
    sum is NaN), a NaN, anywhere in a large gradient; and no flag for finite values whose 16-bit sum
    would overflow the 16-bit range (the sum is taken in fp32)."""
    n = 3 * CHUNK_ELEMENTS
    finite = torch.full((n,), 60000.0 if dtype == torch.float16 else 1e4).to(dtype)
    assert not not_finite(finite)
    for bad in ([float("inf")], [float("-inf")], [float("inf"), float("-inf")], [float("nan")]):
        grad = finite.clone()
        for k, value in enumerate(bad):
            grad[(k + 1) * n // 3 - 1] = value
        assert not_finite(grad), bad
        assert bool(not_finite(grad)) == (not bool(torch.isfinite(grad).all()))
