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
WRAPPED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_reduce", "isend", "irecv")
"""Every collective the runtime may hand a tensor to (both names of the flat ones: [Note: flat
collectives across torch versions])."""
NEW_NAMES = ("all_gather_single", "reduce_scatter_single")
"""The flat collectives' names that torch 2.13 added: older torch versions have only the old ones."""


def staged_collectives(method: str, *, rank: int, world_size: int) -> dict[str, Any]:
    """On each rank: one all-gather and one reduce-scatter through a host-staged Comm, recording
    the data pointers of every tensor handed to gloo."""
    import torch.distributed as dist

    from runtime.transfer.collectives import all_gather_flat, make_comm, reduce_scatter_flat

    handed: list[int] = []
    originals = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}

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


def _without_new_collective_names() -> list[str]:
    """Take torch 2.13's flat collective names away from this process (as a torch before 2.13
    has them) and count the calls of the old names: what the runtime calls instead."""
    import torch.distributed as dist

    calls: list[str] = []
    for name in NEW_NAMES:
        if hasattr(dist, name):
            delattr(dist, name)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        old = getattr(dist, name)
        setattr(dist, name, lambda *a, _old=old, _name=name, **k: (calls.append(_name), _old(*a, **k))[1])
    return calls


def staged_losses_on_older_torch(kind: str, plan: dict[str, Any], method: str, *, rank: int,
                                 world_size: int) -> dict[str, Any]:
    """`staged_training_losses` with reduce-scatter `method`, in a process whose torch has only the
    flat collectives' old names."""
    from runtime import sharding
    from runtime.transfer import collectives

    calls = _without_new_collective_names()
    sharding.make_comm = lambda _=None: collectives.make_comm(method)._replace(host_staged=True)
    losses = sharded_losses(kind, plan, rank=rank, world_size=world_size)
    return {"losses": losses, "old_names_called": sorted(set(calls))}


@pytest.mark.slow
def test_two_ranks_train_host_staged_on_a_torch_without_the_new_collective_names(tmp_path: Path) -> None:
    """The host-staged two-rank path on a torch that has only `all_gather_into_tensor` and
    `reduce_scatter_tensor` (torch 2.11, the GPU image's, failed every multi-rank run on 2.13's
    names): the same losses as plain PyTorch, through the old names, for both reduce-scatters that
    call a flat collective (`native`) or none (`pairwise`, gloo's default)."""
    cases = [("gpt", plan_doc(world_size=2, placement=ALL_CPU, recompute_interval=1), method)
             for method in ("native", "pairwise")]
    results = run_distributed("staged_losses_on_older_torch", cases, tmp_path, module="test_collectives_host_staged")
    ref = reference_losses("gpt")
    for (_, _, method), got in zip(cases, results, strict=True):
        assert max(relative_errors(ref, got["losses"])) <= 1e-5, (method, ref, got)
    assert results[0]["old_names_called"] == ["all_gather_into_tensor", "reduce_scatter_tensor"]
    assert results[1]["old_names_called"] == ["all_gather_into_tensor"]


@pytest.mark.filterwarnings("ignore:`torch.distributed.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
def test_flat_collectives_take_the_old_names_where_torch_lacks_the_new(monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """[Note: flat collectives across torch versions], on one gloo rank in this process: with the
    new names taken away the gather and the reduce-scatter run through the old ones, with their
    values; with the new names present (torch 2.13) the old, deprecated ones are never called."""
    import torch.distributed as dist

    from runtime.transfer.collectives import all_gather_into, reduce_scatter_into

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for take_away in (False, True):
            with monkeypatch.context() as patch:
                calls: list[str] = []
                for name in NEW_NAMES:
                    if take_away:
                        patch.delattr(dist, name, raising=False)
                for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                    old = getattr(dist, name)
                    patch.setattr(dist, name, lambda *a, _old=old, _n=name, _calls=calls, **k: (
                        _calls.append(_n), _old(*a, **k))[1])
                gathered, reduced = torch.empty(3), torch.empty(3)
                all_gather_into(gathered, torch.arange(3.0))
                reduce_scatter_into(reduced, torch.arange(3.0) * 2)
                assert gathered.tolist() == [0.0, 1.0, 2.0] and reduced.tolist() == [0.0, 2.0, 4.0]
                has_new = all(hasattr(dist, name) for name in NEW_NAMES)
                assert calls == ([] if has_new else ["all_gather_into_tensor", "reduce_scatter_tensor"]), take_away
    finally:
        dist.destroy_process_group()


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
