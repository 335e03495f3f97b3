"""The optimizer step in backward (`optimizer_step: in_backward`; [Note: the optimizer step in
backward] in runtime/optim/streamed_optimizer.py): each unit is updated as soon as its gradient is final.

For the loop it is meant for (one backward per step, no clipping) it trains bit for bit as the
after-backward step does in host memory, whatever the placement; with the optimizer states on NVMe
the gradient never reaches the gradient store (no gradient swap file, exactly the gradient's bytes
fewer read and written per step); it refuses gradient accumulation and a backward with no optimizer
to take the gradients instead of training wrongly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import (
    ALL_CPU,
    DeferredWrites,
    batches,
    build_model,
    nvme_step_host_memory,
    plan_doc,
    run_distributed,
)
from test_nvme_training import ALL_NVME, OPTIMIZER_NVME, SMALL_CHUNKS, assert_bitwise, train

IN_BACKWARD = {"optimizer_step": "in_backward"}


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The all-cpu, after-backward training every variant must equal bit for bit."""
    return train(ALL_CPU, None)


@pytest.mark.parametrize(("placement", "knobs"), [
    (ALL_NVME, {"prefetch_depth": 3}),
    (ALL_NVME, {"prefetch_depth": 1, "num_optimizer_buffers": 1}),
    (ALL_NVME, {"prefetch_depth": 3, "num_optimizer_buffers": 6}),
    (OPTIMIZER_NVME, {"prefetch_depth": 2}),
    (ALL_CPU, {}),
], ids=["all-nvme", "all-nvme-one-buffer", "all-nvme-six-buffers", "optimizer-nvme", "all-cpu"])
def test_in_backward_training_is_bitwise_after_backward_training(placement: dict[str, str], knobs: dict[str, Any],
                                                                 reference: Any, tmp_path: Path) -> None:
    path = None if placement is ALL_CPU else str(tmp_path)
    assert_bitwise(reference, train(placement, path, **IN_BACKWARD, **knobs))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("ci", [1, 2])
def test_recomputed_in_backward_training_is_bitwise(ci: int, tmp_path: Path) -> None:
    assert_bitwise(train(ALL_CPU, None, recompute_interval=ci),
                   train(ALL_NVME, str(tmp_path), recompute_interval=ci, prefetch_depth=3, **IN_BACKWARD))


def test_bf16_in_backward_training_is_bitwise(tmp_path: Path) -> None:
    assert_bitwise(train(ALL_CPU, None, precision="bf16"),
                   train(ALL_NVME, str(tmp_path), precision="bf16", **IN_BACKWARD))


def test_writes_that_land_late_are_waited_for(reference: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every NVMe write runs only when first waited for: the next forward's reads of parameters the
    update wrote in backward, and the next update's reads of its states, must wait for those writes
    (the store orders a range's traffic), or they would read the old bytes."""
    writes = DeferredWrites()
    writes.install(monkeypatch)
    assert_bitwise(reference, train(ALL_NVME, str(tmp_path), prefetch_depth=3, **IN_BACKWARD))
    assert writes.handles


def _one_step(placement: dict[str, str], path: str | None, **knobs: Any) -> tuple[Any, Any]:
    import runtime
    from runtime.sharding import state_of

    model = runtime.shard(build_model("gpt"), plan_doc(placement=placement, nvme_path=path, **{**SMALL_CHUNKS, **knobs}))
    return model, runtime.AdamW(model, lr=1e-3, weight_decay=0.1), state_of(model)  # as `train`


def _close(opt: Any, state: Any) -> None:
    opt.close()
    state.close()


def test_gradients_never_reach_nvme(tmp_path: Path) -> None:
    """No gradient store and no gradient swap file; per step, exactly the gradient's bytes fewer
    are written (backward) and read (the step) than after backward, and the same parameter and
    state traffic otherwise."""
    moved = {}
    for step in ("after_backward", "in_backward"):
        model, opt, st = _one_step(ALL_NVME, str(tmp_path), prefetch_depth=3, optimizer_step=step)
        (swap_dir,) = tmp_path.iterdir()
        files = sorted(p.name for p in swap_dir.iterdir())
        assert ("gradients.swap" in files) == (step == "after_backward")
        assert (st.grad_store is None) == (step == "in_backward")
        links = st.profiler.link_bytes
        per_step = []
        for tokens in batches(3):
            before = (links.get("nvme_read", 0), links.get("nvme_write", 0))
            model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad()
            st.wait_io()
            per_step.append((links["nvme_read"] - before[0], links["nvme_write"] - before[1]))
        moved[step] = per_step[-1]
        grads = [u for u in st.units if u.num_grad_params]
        gradient_read = sum(u.layout.shard_numel * 4 for u in grads)  # the step reads each chunk's gradient region
        gradient_write = sum(u.layout.numel * 4 for u in grads)  # one write per parameter, all of them
        _close(opt, st)
    assert moved["after_backward"][0] - moved["in_backward"][0] == gradient_read
    assert moved["after_backward"][1] - moved["in_backward"][1] == gradient_write


def test_gradient_accumulation_is_refused(tmp_path: Path) -> None:
    model, opt, st = _one_step(ALL_NVME, str(tmp_path), **IN_BACKWARD)
    tokens = batches(1)[0]
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    with pytest.raises(RuntimeError, match=r"second gradient before optimizer.step\(\).*set optimizer_step to "
                                           "after_backward"):
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    _close(opt, st)


def test_a_backward_without_an_optimizer_is_refused(tmp_path: Path) -> None:
    import runtime
    from runtime.sharding import state_of

    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path), **IN_BACKWARD))
    tokens = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"create runtime.AdamW\(model, ...\) before the first backward"):
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    state_of(model).close()


def test_fp16_in_backward_is_refused_by_the_plan() -> None:
    from planner.specs.errors import PlannerError
    from planner.specs.plan import Plan

    with pytest.raises(PlannerError, match="optimizer_step in_backward cannot run with precision fp16"):
        Plan.from_dict(plan_doc(placement=ALL_CPU, precision="fp16", **IN_BACKWARD))


def test_states_are_read_ahead_in_the_order_of_the_last_step(reference: Any, tmp_path: Path) -> None:
    """From the second step on, the updates find their states read ahead in the order of the last
    step (the first step guesses reversed unit order); a wrong order drops the read-ahead and reads
    on demand, with the same bits."""
    for scramble in (False, True):
        model, opt, st = _one_step(ALL_NVME, str(tmp_path), prefetch_depth=3, num_optimizer_buffers=4, **IN_BACKWARD)
        streamed = opt.engine
        read_ahead = streamed.read_ahead
        claims: list[bool] = []
        claim = read_ahead.claim

        def tracked(chunk: Any, _claim: Any = claim, _ahead: Any = read_ahead, _claims: list = claims) -> Any:
            _claims.append(bool(_ahead.queue) and _ahead.queue[0][0] == chunk)
            return _claim(chunk)

        read_ahead.claim = tracked
        losses = []
        for i, tokens in enumerate(batches(4)):
            if scramble and i >= 1:
                streamed._order = list(reversed(streamed._order))  # the opposite of what backward does
            claims.clear()
            loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        # In order, the updates find their states read ahead (but where every buffer still waited for
        # a write when the read could have started: then read when needed, never out of order).
        assert any(claims) != scramble and claims[0] != scramble
        assert read_ahead.diverged == scramble
        assert_bitwise(reference, (losses, st.full_parameters()))
        _close(opt, st)


def test_states_are_read_ahead_from_the_forwards_tail(tmp_path: Path) -> None:
    """Once the forward's order is recorded, the read-ahead starts when the forward has submitted its
    last parameter read, not when the backward begins; the first step (nothing recorded) starts at
    backward begin; a forward without gradients (evaluation) starts none."""
    model, opt, st = _one_step(ALL_NVME, str(tmp_path), prefetch_depth=1, **IN_BACKWARD)
    streamed = opt.engine
    started: list[str] = []
    start = streamed.begin_updates
    # The forward's tail (through the optimizer's schedule) and the backward's begin call it.
    streamed.begin_updates = lambda: started.append(st.phase.name) or start()
    for i, tokens in enumerate(batches(3)):
        if i:  # (before the first training forward it would record the order: the first step is bare)
            with torch.no_grad():
                model(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    assert started == ["BACKWARD", "FORWARD", "FORWARD"]
    _close(opt, st)


def test_memory_bill_has_no_gradient_terms_and_the_ledger_agrees(tmp_path: Path) -> None:
    """With the states on NVMe the bill holds no gradient shard and no gradient staging (planner
    `stores_gradients`), and neither does the runtime's ledger; the states' terms agree."""
    from planner.cost.memory import memory_bill
    from planner.specs.plan import Plan

    doc = plan_doc(placement=ALL_NVME, nvme_path=str(tmp_path), prefetch_depth=3, **SMALL_CHUNKS, **IN_BACKWARD)
    bill = memory_bill(Plan.from_dict(doc)).terms
    assert "gradients" not in bill["nvme"] and "gradient_swap_buffers" not in bill["cpu"]
    model, opt, st = _one_step(ALL_NVME, str(tmp_path), prefetch_depth=3, **IN_BACKWARD)
    for tokens in batches(2):
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    nvme_terms = st.ledger.usage("nvme").term_peaks
    cpu_terms = st.ledger.usage("cpu").term_peaks
    assert not nvme_terms.get("gradients") and not cpu_terms.get("gradient_swap_buffers")
    assert cpu_terms["optimizer_swap_buffers"] == bill["cpu"]["optimizer_swap_buffers"]
    _close(opt, st)


def test_host_memory_of_an_in_backward_step_stays_within_the_plans_budget(tmp_path: Path) -> None:
    """As tests/test_nvme_training.py's host-memory test, with the update in backward: the states
    that backward reads and writes go through the plan's chunk buffers, so the ledger's host peak and
    the measured anonymous RSS growth stay within the bill, with 9x the budget on disk (no gradients there)."""
    result = nvme_step_host_memory(tmp_path, 16, 256, 3, 1, "in_backward")
    budget = result["host_budget_bytes"]
    assert result["nvme_state_bytes"] >= 9 * budget, result
    assert result["ledger_host_peak_bytes"] <= budget, result
    assert 0 < result["anon_rss_peak_delta_bytes"] <= budget, result
    assert list(tmp_path.iterdir()) == []


def in_backward_worker(path: str, *, rank: int, world_size: int) -> Any:
    """Runs on each of two gloo ranks (runtime_support.run_distributed)."""
    torch.set_num_threads(1)
    cpu = train(ALL_CPU, None, rank=rank, world_size=world_size)
    swap = Path(path, f"r{rank}")
    swap.mkdir()
    in_backward = train(ALL_NVME, str(swap), rank=rank, world_size=world_size, prefetch_depth=3, **IN_BACKWARD)
    resident = train(ALL_CPU, None, rank=rank, world_size=world_size, **IN_BACKWARD)
    same = [a[0] == b[0] and all(torch.equal(a[1][k], b[1][k]) for k in a[1]) for a, b in ((cpu, in_backward),
                                                                                             (cpu, resident))]
    return {"bitwise": same, "losses": cpu[0], "left": sorted(p.name for p in swap.iterdir())}


@pytest.mark.slow
def test_two_ranks_in_backward_training_is_bitwise(tmp_path: Path) -> None:
    """With two ranks a unit is updated once its reduce-scatter is done (one in flight while the next
    unit's backward runs): the same bits as the after-backward step in host memory."""
    (result,) = run_distributed("in_backward_worker", [(str(tmp_path),)], tmp_path, module="test_nvme_in_backward")
    assert result["bitwise"] == [True, True]  # rank 0's view: full parameters are gathered from both
    assert result["losses"][-1] < result["losses"][0]
    assert result["left"] == []
