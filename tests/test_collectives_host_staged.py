"""Host-staged collectives ([Note: gloo and device tensors] in runtime/transfer/collectives.py): ranks sharing
one GPU reduce over gloo, which takes host memory only. On the CPU the staged path runs with
`Comm.host_staged` set by hand: every method gathers and reduce-scatters the right values, and gloo
is only ever handed the collective's own host buffers, never a tensor of the caller."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import (
    ALL_CPU,
    ALL_DEVICE,
    plan_doc,
    reference_losses,
    relative_errors,
    run_distributed,
    sharded_losses,
)

METHODS = ("native", "pairwise", "allreduce")
WRAPPED = ("all_gather_single", "reduce_scatter_single", "all_reduce", "isend", "irecv")


def staged_collectives(method: str, *, rank: int, world_size: int) -> dict[str, Any]:
    """On each rank: one all-gather and one reduce-scatter through a host-staged Comm, recording
    the data pointers of every tensor handed to gloo."""
    import torch.distributed as dist

    from runtime.transfer.collectives import all_gather_flat, make_comm, reduce_scatter_flat

    handed: list[int] = []
    originals = {name: getattr(dist, name) for name in WRAPPED}

    def recording(fn):  # noqa: ANN001, ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            handed.extend(a.data_ptr() for a in args if isinstance(a, torch.Tensor))
            return fn(*args, **kwargs)

        return call

    for name, fn in originals.items():
        setattr(dist, name, recording(fn))
    try:
        comm = make_comm(method)._replace(host_staged=True)
        shard = torch.arange(4.0) + 10 * rank
        gathered = all_gather_flat(comm, shard, {}).wait()
        full = torch.arange(8.0) * (rank + 1)
        before = full.clone()
        reduced = reduce_scatter_flat(comm, full, {}).wait()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    callers = {t.untyped_storage().data_ptr() for t in (shard, gathered, full, reduced)}
    return {"gathered": gathered.tolist(), "reduced": reduced.tolist(), "full_untouched": torch.equal(full, before),
            "handed": len(handed), "caller_memory_handed_to_gloo": sorted(callers & set(handed))}


@pytest.mark.slow
def test_host_staged_collectives_give_the_sums_and_hand_gloo_only_their_own_buffers(tmp_path: Path) -> None:
    results = run_distributed("staged_collectives", [(m,) for m in METHODS], tmp_path,
                              module="test_collectives_host_staged")
    for method, got in zip(METHODS, results, strict=True):
        assert got["gathered"] == [0.0, 1.0, 2.0, 3.0, 10.0, 11.0, 12.0, 13.0], method
        # Rank 0's slice of sum_k arange(8) * (k + 1) over two ranks: arange(4) * 3.
        assert got["reduced"] == [0.0, 3.0, 6.0, 9.0], method
        assert got["full_untouched"], method  # `allreduce` reduced a host copy, not the caller's buffer
        assert got["handed"] >= 2 and got["caller_memory_handed_to_gloo"] == [], method


def staged_training_losses(kind: str, plan: dict[str, Any], *, rank: int, world_size: int) -> list[float]:
    """`sharded_losses` with the model's collectives host-staged (as on ranks sharing a GPU)."""
    from runtime import sharding
    from runtime.transfer import collectives

    plain = collectives.make_comm
    sharding.make_comm = lambda method=None: plain(method)._replace(host_staged=True)
    return sharded_losses(kind, plan, rank=rank, world_size=world_size)


@pytest.mark.slow
def test_two_ranks_train_to_plain_pytorch_with_host_staged_collectives(tmp_path: Path) -> None:
    """The runtime's gathers and reduce-scatters through host copies, end to end: parameters on the
    device tier and in host memory, on two gloo ranks, give plain PyTorch's losses (the world-2
    parity bar, tests/test_runtime_parity.py)."""
    cases = [("gpt", plan_doc(world_size=2, placement=ALL_DEVICE)),
             ("gpt", plan_doc(world_size=2, placement=ALL_CPU, recompute_interval=1, tiling_factor=2))]
    results = run_distributed("staged_training_losses", cases, tmp_path, module="test_collectives_host_staged")
    ref = reference_losses("gpt")
    for (_, plan), losses in zip(cases, results, strict=True):
        assert max(relative_errors(ref, losses)) <= 1e-5, (plan["placement"], ref, losses)


def test_a_local_comm_is_not_host_staged() -> None:
    from runtime.transfer.collectives import Comm, make_comm

    assert Comm.local().host_staged is False
    assert make_comm() == Comm.local()  # no process group: one rank, nothing staged


def test_host_copy_is_a_new_host_tensor_with_the_values() -> None:
    from runtime.transfer.collectives import host_copy

    src = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    out = host_copy(src)
    assert out.device.type == "cpu" and out.dtype == torch.bfloat16 and torch.equal(out, src)
    assert out.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
