"""Training with model states on NVMe: bitwise the same as with them in CPU memory.

Parameters and optimizer states go to swap files under a temporary `nvme_path`; the losses and the
final parameters must equal those of the all-`cpu` placement bit for bit (the streamed optimizer
runs the same fused AdamW kernel chunk by chunk), with 1 and 2 (gloo) ranks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import (
    ALL_CPU,
    batches,
    build_model,
    free_port,
    mlp_model,
    nvme_step_host_memory,
    plan_doc,
)

from planner.specs.errors import PlannerError
from runtime.process_exit import leave

ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"}
OPTIMIZER_NVME = {**ALL_CPU, "gradients": "cpu", "optimizer_states": "nvme"}
STEPS = 4
SMALL_CHUNKS = {"optimizer_chunk_bytes": 16 * 1024, "num_optimizer_buffers": 3}
"""1024-element chunks: the test model's larger units span several, so the pipeline really runs."""



def train(placement: dict[str, str], nvme_path: str | None, *, rank: int = 0, world_size: int = 1,
          **knobs: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    import runtime
    from runtime.sharding import state_of

    plan = plan_doc(world_size=world_size, placement=placement, nvme_path=nvme_path, **{**SMALL_CHUNKS, **knobs})
    model = runtime.shard(build_model("gpt"), plan)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    losses = []
    for tokens in batches(STEPS):
        tokens = tokens.chunk(world_size)[rank]
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = state_of(model).full_parameters()
    opt.close()
    state_of(model).close()
    return losses, params


def assert_bitwise(a: tuple[list[float], dict[str, torch.Tensor]], b: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize(("placement", "depth", "buffers"),
                         [(ALL_NVME, 2, 3), (ALL_NVME, 3, 5), (OPTIMIZER_NVME, 2, 3)],
                         ids=["all-nvme", "all-nvme-depth3-5-buffers", "optimizer-nvme"])
def test_nvme_training_is_bitwise_cpu_training(placement: dict[str, str], depth: int, buffers: int,
                                               tmp_path: Path) -> None:
    reference = train(ALL_CPU, None)
    on_nvme = train(placement, str(tmp_path), prefetch_depth=depth, num_optimizer_buffers=buffers)
    assert_bitwise(reference, on_nvme)
    assert reference[0][-1] < reference[0][0]
    assert list(tmp_path.iterdir()) == []  # the swap directory is removed on close


@pytest.mark.parametrize("ci", [1, 2])
def test_recomputed_nvme_training_is_bitwise_cpu_training(ci: int, tmp_path: Path) -> None:
    """Recompute gathers each unit, frees its buffer in place after the use and refills it for the
    unit's backward ([Note: recompute releases parameters]): the same bits as in host memory."""
    assert_bitwise(train(ALL_CPU, None, recompute_interval=ci),
                   train(ALL_NVME, str(tmp_path), recompute_interval=ci, prefetch_depth=3))


def test_one_rank_prefetch_never_waits_for_a_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: one rank does not wait ahead]: with every read still in flight when the prefetcher
    wants to gather it (forced here), operator i's use never waits for operator i+1's read, and
    training is still bitwise that in host memory (with recompute too, where units are gathered for
    recompute and backward)."""
    from runtime.nvme import engine
    from runtime.transfer import nvme_store, stores
    from runtime.units import group

    monkeypatch.setattr(stores.Pending, "ready", lambda self: False)
    monkeypatch.setattr(nvme_store._ThenPending, "ready", lambda self: False)
    in_prefetch, waited_ahead = [False], []
    start_gather, wait = group.ParamUnit.start_gather, engine.Handle.wait

    def tracked_start_gather(self: group.ParamUnit, *, prefetch: bool) -> None:
        in_prefetch[0] = prefetch
        try:
            start_gather(self, prefetch=prefetch)
        finally:
            in_prefetch[0] = False

    def tracked_wait(self: engine.Handle) -> None:
        if in_prefetch[0]:
            waited_ahead.append(self.nbytes)
        wait(self)

    monkeypatch.setattr(group.ParamUnit, "start_gather", tracked_start_gather)
    monkeypatch.setattr(engine.Handle, "wait", tracked_wait)
    for ci in (0, 1):
        assert_bitwise(train(ALL_CPU, None, recompute_interval=ci),
                       train(ALL_NVME, str(tmp_path), recompute_interval=ci, prefetch_depth=3))
    assert waited_ahead == []


def test_nvme_training_bf16_is_bitwise_cpu_training(tmp_path: Path) -> None:
    assert_bitwise(train(ALL_CPU, None, precision="bf16"), train(ALL_NVME, str(tmp_path), precision="bf16"))


def test_swap_files_live_in_a_private_directory_while_training(tmp_path: Path) -> None:
    import runtime
    from runtime.sharding import state_of

    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path)))
    (swap_dir,) = tmp_path.iterdir()
    assert swap_dir.stat().st_mode & 0o777 == 0o700
    files = sorted(swap_dir.iterdir())
    assert [p.name for p in files] == ["gradients.swap", "optimizer_states.swap", "owner.json", "params.swap"]
    assert {p.stat().st_mode & 0o777 for p in files} == {0o600}
    state_of(model).close()
    assert not swap_dir.exists()


def test_too_small_nvme_path_is_refused_before_training(tmp_path: Path) -> None:
    import runtime

    # Two 4096 x 4096 Linears need ~0.5 GB of swap (params, gradients, Adam states); the directory's
    # filesystem reports 64 MiB free (statvfs faked for this path only), so the preflight must refuse.
    big = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, device="meta") for _ in range(2)])
    plan = plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path), model=mlp_model(1, 4096, 4096))
    with pytest.raises(PlannerError, match=r"nvme_path .* free but the swap files need"):
        _with_free_bytes(tmp_path, 64 * 1024**2, lambda: runtime.shard(big, plan))
    assert list(tmp_path.iterdir()) == []


def test_nvme_placement_without_nvme_path_swaps_to_the_default_folder(tmp_path, monkeypatch) -> None:
    """No `nvme_path`: the swap files go to `tierwise-swap` in the user's cache (planner/cost/swap.py)."""
    import runtime
    from runtime.sharding import state_of

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_NVME))
    state = state_of(model)
    try:
        assert state.plan.nvme_path == str(tmp_path / "cache" / "tierwise-swap")
        assert any((tmp_path / "cache" / "tierwise-swap").iterdir())  # this rank's private swap directory
    finally:
        state.close()


def _with_free_bytes(path: Path, free: int, fn: Any) -> Any:
    """Run `fn` with statvfs reporting `free` bytes available under `path` (the preflight's view)."""
    import runtime.nvme.directory as directory

    real = os.statvfs

    class Fake:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_blocks = st.f_frsize, st.f_blocks
            self.f_bavail = free // st.f_frsize

    def fake(p: Any) -> Any:
        st = real(p)
        return Fake(st) if str(p).startswith(str(path)) else st

    directory.os.statvfs = fake  # type: ignore[attr-defined]
    try:
        return fn()
    finally:
        directory.os.statvfs = real  # type: ignore[attr-defined]


# -- two ranks ---------------------------------------------------------------------------------
def _worker(rank: int, world_size: int, port: int, nvme_path: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.set_num_threads(1)
    try:
        results = {"cpu": train(ALL_CPU, None, rank=rank, world_size=world_size),
                   "nvme": train(ALL_NVME, nvme_path, rank=rank, world_size=world_size, prefetch_depth=3)}
        torch.save(results, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()
    leave(0)  # [Note: a rank leaves with os._exit]


@pytest.mark.slow
def test_two_ranks_nvme_training_is_bitwise_cpu_training(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    swap = tmp_path / "swap"
    swap.mkdir()
    out = str(tmp_path / "result")
    mp.spawn(_worker, args=(2, free_port(), str(swap), out), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(f"{out}.{rank}")
        assert_bitwise(results["cpu"], results["nvme"])
    assert list(swap.iterdir()) == []


@pytest.mark.parametrize(("layers", "min_disk_to_budget", "ci"), [(16, 9, 1), (48, 17, 1), (16, 9, 4)],
                         ids=["16-layers", "48-layers", "16-layers-4-block-segments"])
def test_host_memory_of_an_nvme_step_stays_within_the_plans_budget(layers: int, min_disk_to_budget: int, ci: int,
                                                                   tmp_path: Path) -> None:
    """Models whose states on NVMe are many times the plan's host budget (h=256; 16 layers: 9x, 48
    layers: 17x; the budget holds a gathered unit's gradient on one rank): the ledger's host peak and the measured anonymous RSS growth during 3 steps both
    stay within that budget, however deep the model (the bill's `runtime_bookkeeping` is what each
    operator's objects cost; without it RSS outgrew the bill with every layer), and however many
    blocks a recompute segment has (before [Note: recompute releases parameters], a segment's
    parameters stayed gathered from its recompute to their backward, and at 4 blocks per segment the
    ledger's peak was over the budget: docs/notes/2026-11-22-runtime-source-measurements.md).

    The probe (runtime/memory_probe.py) runs in its own process with glibc's mmap threshold fixed
    (runtime_support.nvme_step_host_memory)."""
    result = nvme_step_host_memory(tmp_path, layers, 256, 3, ci)
    budget = result["host_budget_bytes"]
    assert result["nvme_state_bytes"] >= min_disk_to_budget * budget, result
    assert result["ledger_host_peak_bytes"] <= budget, result
    assert 0 < result["anon_rss_peak_delta_bytes"] <= budget, result
    assert list(tmp_path.iterdir()) == []


def test_states_written_between_steps_are_read_afresh(tmp_path: Path) -> None:
    """Backward reads the step's first chunks ahead; writing a master shard in between (as loading
    a training checkpoint does) must make the step use what was written, bit for bit as in host memory."""
    import runtime
    from runtime.sharding import state_of

    results = []
    for placement, path in ((ALL_CPU, None), (ALL_NVME, str(tmp_path))):
        model = runtime.shard(build_model("gpt"), plan_doc(placement=placement, nvme_path=path, **SMALL_CHUNKS))
        opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
        st = state_of(model)
        for i, tokens in enumerate(batches(3)):
            model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
            if i == 2:
                if placement is ALL_NVME:
                    assert opt.engine.read_ahead.queue  # read ahead
                unit = next(u for u in st.units if u.num_grad_params)
                store, key = st.master_at[unit.key]
                store.write_from(key, torch.full((unit.layout.shard_numel,), 0.5)).wait()
            opt.step()
            opt.zero_grad()
        results.append(([], st.full_parameters()))
        opt.close()
        st.close()
    assert_bitwise(results[0], results[1])


@pytest.mark.parametrize("depth", [1, 3])
def test_forward_without_recompute_keeps_no_parameter_reads_for_backward(depth: int, tmp_path: Path) -> None:
    """[Note: saved parameters]: what autograd saves of a weight must not pin the buffer the weight was
    read into. Before, every unit's read buffer stayed alive from its forward to its backward, so at
    the end of forward the whole model's parameters were in host memory."""
    import runtime
    from runtime.gpt import GPT, GPTConfig
    from runtime.sharding import state_of

    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=6, hidden_size=64, num_heads=4, seq_len=16, vocab_size=64))
    plan = plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path), prefetch_depth=depth,
                    model={"num_layers": 6, "hidden_size": 64, "num_heads": 4, "seq_len": 16, "vocab_size": 64})
    model = runtime.shard(model, plan)
    state = state_of(model)
    read_bytes = sorted(-(-u.layout.shard_numel * 4 // 4096) * 4096 for u in state.units)
    tokens = batches(1)[0][:, :17] % 64
    for _ in range(2):  # the second forward follows the recorded order, prefetching `depth` ahead
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        held = state.swap.recycler.leased_bytes
        loss.backward()
    # At most the units from the one in use to the deepest prefetch, and the tied embedding, which
    # stays gathered from its use as the output head until its backward.
    assert held <= (depth + 2) * read_bytes[-1]
    assert held < sum(read_bytes) / 2
    state.close()


@pytest.mark.parametrize("depth", [1, 3])
def test_gradient_write_buffers_are_the_bills(depth: int, tmp_path: Path) -> None:
    """The runtime stages as many gradient writes as the memory bill holds buffers for: 2, or
    min(depth, 3) + 1 with parameters on NVMe ([Note: gradient write buffers])."""
    import runtime
    from planner.cost.memory import gradient_write_buffers, memory_bill
    from planner.specs.plan import Plan
    from runtime.sharding import state_of

    doc = plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path), prefetch_depth=depth, **SMALL_CHUNKS)
    buffers = gradient_write_buffers(depth, params_on_nvme=True)
    assert buffers == {1: 2, 3: 4}[depth]
    model = runtime.shard(build_model("gpt"), doc)
    store = state_of(model).grad_store
    assert store.staging.count == buffers
    bill = memory_bill(Plan.from_dict(doc)).terms["cpu"]["gradient_swap_buffers"]
    assert bill % buffers == 0 and bill // buffers >= store.staging.largest_bytes
    state_of(model).close()


def test_the_backward_reads_no_shard_the_forward_kept(tmp_path: Path) -> None:
    """[Note: the forward's tail is the backward's head] with parameters on NVMe at depth 3 (blocks of
    LayerNorm, Linear, Linear; the norms ride along): from the second step on, the backward reads none of the units the
    forward kept gathered (the last block's linears, and the linear three operators into the
    backward; not the one a norm follows, see the Note) and every other unit once; the host
    ledger stays within the bill, and training is bit for bit that in host memory."""
    from torch import nn

    import runtime
    from runtime.sharding import state_of
    from runtime.units.prefetch import Phase

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[m for _ in range(4) for m in (nn.LayerNorm(256), nn.Linear(256, 512), nn.Linear(512, 256))])

    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2))
    results = []
    for placement, path in ((ALL_CPU, None), (ALL_NVME, str(tmp_path))):
        doc = plan_doc(placement=placement, nvme_path=path, prefetch_depth=3, model=mlp_model(4, 256, 512), **SMALL_CHUNKS)
        model = runtime.shard(mlp(), doc)
        opt = runtime.AdamW(model, lr=1e-3)
        st = state_of(model)
        reads: list[tuple[str, str]] = []
        read = st.param_store.read
        st.param_store.read = (lambda key, dtype, _st=st, _reads=reads, _read=read:  # type: ignore[method-assign]
                               _reads.append((_st.phase.name, key)) or _read(key, dtype))
        losses = []
        for _ in range(3):
            reads.clear()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if placement is ALL_NVME:
            forward = [st.units[i].key for i in st.prefetcher.recorded(Phase.FORWARD)]
            # ... LN3 L1_3 L2_3 | LN4 L1_4 L2_4: kept L2_4 (q 0), L1_4 (q 1) and L1_3 (q 3); not L2_3 (LN4 follows).
            kept = {forward[-1], forward[-2], forward[-5]}
            in_backward = [key for phase, key in reads if phase == "BACKWARD"]
            assert sorted(in_backward) == sorted(set(forward) - kept)
            # The bill's host swap buffers (planner/cost/memory.py, for this model): two of the largest shard.
            largest = -(-max(u.layout.shard_numel for u in st.units) * 4 // 4096) * 4096
            peaks = st.ledger.usage("cpu").term_peaks
            assert largest < peaks["param_swap_buffers"] <= 2 * largest
        del st.param_store.read
        results.append((losses, st.full_parameters()))
        opt.close()
        st.close()
    assert_bitwise(results[0], results[1])
