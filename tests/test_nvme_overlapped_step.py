"""The after-backward NVMe step overlaps the next forward ([Note: the step overlaps the next forward]
in runtime/optim/step_schedule.py): the same bits as the synchronous step, a unit's read waits for its own
update only, whatever reads the states waits for the whole step, and a failed update fails the next
forward in one line."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from runtime_support import batches, build_model, plan_doc

ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"}
OPTIMIZER_NVME = {"params": "cpu", "gradients": "cpu", "optimizer_states": "nvme", "recompute_inputs": "cpu"}
SMALL_CHUNKS = {"optimizer_chunk_bytes": 16 * 1024, "num_optimizer_buffers": 3}
STEPS = 4
RELEASE_TIMEOUT_S = 60.0
"""Only bounds a failing test: the forward releases the held update long before."""


def _shard(nvme_path: Path, placement: dict[str, str], **knobs: Any) -> tuple[torch.nn.Module, Any]:
    import runtime

    nvme_path.mkdir(parents=True, exist_ok=True)
    plan = plan_doc(placement=placement, nvme_path=str(nvme_path), **{**SMALL_CHUNKS, **knobs})
    model = runtime.shard(build_model("gpt"), plan)
    return model, runtime.AdamW(model, lr=1e-3, weight_decay=0.1)


def _train(nvme_path: Path, placement: dict[str, str], *, save_to: Path | None = None,
           **knobs: Any) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    """Losses, final parameters, and (with `save_to`) the digests of a checkpoint saved right after
    every `optimizer.step()`, while an overlapped step may still run."""
    from runtime.ckpt.rank_state import save_rank
    from runtime.sharding import state_of

    model, opt = _shard(nvme_path, placement, **knobs)
    losses, digests = [], []
    for step, tokens in enumerate(batches(STEPS)):
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        if save_to is not None:
            directory = save_to / str(step)
            directory.mkdir(parents=True)
            torch.manual_seed(step)  # the file holds the RNG state: the same in both runs
            digests += [d.sha256 for d in save_rank(directory, rank=0, step=step, state=state_of(model),
                                                    optimizer=opt, scalars={})]
        opt.zero_grad()
        losses.append(loss.item())
    params = state_of(model).full_parameters()
    opt.close()
    state_of(model).close()
    return losses, params, digests


def _synchronous(monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.optim.streamed_optimizer import StreamedAdamW

    monkeypatch.setattr(StreamedAdamW, "overlaps_forward", property(lambda self: False))


def _assert_bitwise(a: tuple[list[float], dict[str, torch.Tensor], list[str]],
                    b: tuple[list[float], dict[str, torch.Tensor], list[str]]) -> None:
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name
    assert a[2] == b[2]


def test_the_step_on_nvme_after_backward_is_overlapped(tmp_path: Path) -> None:
    from runtime.optim.step_schedule import AfterBackward, OverlappedAfterBackward

    model, opt = _shard(tmp_path, ALL_NVME)
    assert type(opt.schedule) is OverlappedAfterBackward
    opt.close()
    model_cpu, opt_cpu = _shard(tmp_path / "cpu", {**ALL_NVME, "params": "cpu", "gradients": "cpu",
                                                    "optimizer_states": "cpu"})
    assert type(opt_cpu.schedule) is AfterBackward  # in-memory states: unchanged
    opt_cpu.close()


@pytest.mark.parametrize(("placement", "knobs"),
                         [(ALL_NVME, {}), (ALL_NVME, {"prefetch_depth": 3, "num_optimizer_buffers": 5}),
                          (OPTIMIZER_NVME, {}), (ALL_NVME, {"precision": "bf16"})],
                         ids=["all-nvme", "all-nvme-depth3-5-buffers", "optimizer-nvme", "all-nvme-bf16"])
def test_overlapped_step_is_bitwise_the_synchronous_step(placement: dict[str, str], knobs: dict[str, Any],
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Losses, final parameters and checkpoints saved right after `step()` (which must see every update)."""
    overlapped = _train(tmp_path / "a", placement, save_to=tmp_path / "ck-a", **knobs)
    _synchronous(monkeypatch)
    synchronous = _train(tmp_path / "b", placement, save_to=tmp_path / "ck-b", **knobs)
    _assert_bitwise(overlapped, synchronous)
    assert overlapped[0][-1] < overlapped[0][0]


def test_the_forward_takes_updated_shards_from_the_step_instead_of_reading_them_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With fp32 parameters on NVMe (their own master) the step hands the next forward copies of the
    updated shards: the run reads exactly their bytes less from the drive than the synchronous step,
    and stays bitwise (the test above)."""
    from runtime.optim.step_schedule import OverlappedAfterBackward
    from runtime.sharding import state_of

    handed: list[int] = []
    take = OverlappedAfterBackward._take

    def tracked_take(self: OverlappedAfterBackward, unit: Any) -> torch.Tensor | None:
        shard = take(self, unit)
        if shard is not None:
            handed.append(shard.numel() * shard.element_size())
        return shard

    monkeypatch.setattr(OverlappedAfterBackward, "_take", tracked_take)
    read_bytes = {}
    for schedule in ("overlapped", "synchronous"):
        if schedule == "synchronous":
            _synchronous(monkeypatch)
        model, opt = _shard(tmp_path / schedule, ALL_NVME, prefetch_depth=3)
        for tokens in batches(3):
            model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
            opt.step()
            opt.zero_grad()
        opt.close()
        read_bytes[schedule] = state_of(model).profiler.link_bytes["nvme_read"]
        state_of(model).close()
    assert handed
    assert read_bytes["synchronous"] - read_bytes["overlapped"] == sum(handed)


def test_the_forward_of_the_first_unit_runs_before_the_last_update_ends(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The last unit's update is held until the next forward has gathered the first unit: it can only
    be released if that gather does not wait for the whole step. And every unit's shard is read
    after its own update."""
    from runtime.optim.streamed_optimizer import StreamedAdamW
    from runtime.units import group

    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    gathered_first = threading.Event()
    released_by_forward: list[bool] = []
    step_unit, start_gather, stage = StreamedAdamW.step_unit, group.ParamUnit.start_gather, group.ParamUnit.stage
    model, opt = _shard(tmp_path, ALL_NVME)
    first_key, last_key = opt.schedule.units[0].key, opt.schedule.units[-1].key
    held_steps = [0]
    """Steps whose last update is held: those a forward follows."""

    def tracked_step_unit(self: StreamedAdamW, unit: group.ParamUnit, updated: Any = None) -> list[Any]:
        if unit.key == last_key and held_steps[0]:
            held_steps[0] -= 1
            released_by_forward.append(gathered_first.wait(RELEASE_TIMEOUT_S))
        with lock:
            events.append(("update", unit.key))
        return step_unit(self, unit, updated)

    def tracked_stage(self: group.ParamUnit, *, ahead: int = 2, block: bool | None = None) -> None:
        before = self._staged
        stage(self, ahead=ahead, block=block)
        if before is None and self._staged is not None:
            with lock:
                events.append(("read", self.key))

    def tracked_start_gather(self: group.ParamUnit, *, prefetch: bool) -> None:
        start_gather(self, prefetch=prefetch)
        if self.key == first_key and self.state is group.UnitState.GATHERING:
            gathered_first.set()

    monkeypatch.setattr(StreamedAdamW, "step_unit", tracked_step_unit)
    monkeypatch.setattr(group.ParamUnit, "stage", tracked_stage)
    monkeypatch.setattr(group.ParamUnit, "start_gather", tracked_start_gather)
    tokens = batches(3)
    for i, t in enumerate(tokens):
        model(input_ids=t[:, :-1], labels=t[:, 1:]).loss.backward()
        gathered_first.clear()
        held_steps[0] = int(i + 1 < len(tokens))
        with lock:
            events.append(("step", ""))
        opt.step()
        opt.zero_grad()
    opt.close()
    assert released_by_forward == [True, True]
    checked, updated, seen = 0, None, set()
    for kind, key in events:
        if kind == "step":
            updated, seen = set(), set()
        elif updated is None:  # the first forward and backward
            continue
        elif kind == "update":
            updated.add(key)
        elif key not in seen:  # a unit's first read after a step
            seen.add(key)
            assert key in updated, (key, events)
            checked += 1
    assert checked >= 2 * len(opt.schedule.units)


def test_a_failed_update_fails_the_next_forward_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from runtime.optim.streamed_optimizer import StreamedAdamW
    from runtime.sharding import state_of

    step_unit = StreamedAdamW.step_unit
    calls = [0]

    def failing_step_unit(self: StreamedAdamW, unit: Any, updated: Any = None) -> list[Any]:
        calls[0] += 1
        if calls[0] == len(self.keys) + 2:  # the second step's second unit
            raise OSError(5, "Input/output error\nsecond line")
        return step_unit(self, unit, updated)

    monkeypatch.setattr(StreamedAdamW, "step_unit", failing_step_unit)
    model, opt = _shard(tmp_path, ALL_NVME)
    tokens = batches(3)
    for t in tokens[:2]:
        model(input_ids=t[:, :-1], labels=t[:, 1:]).loss.backward()
        assert opt.step()  # hands the updates over and returns
        opt.zero_grad()
    with pytest.raises(RuntimeError, match=r"^the optimizer step overlapping this forward failed .*OSError") as info:
        model(input_ids=tokens[2][:, :-1], labels=tokens[2][:, 1:])
    assert "\n" not in str(info.value)
    with pytest.raises(OSError, match="Input/output error"):  # the optimizer stays failed
        opt.step()
    opt.close()  # joins the worker, raises nothing
    state_of(model).close()
