"""The GPU tests against the runtime as it is, on the CPU ([Note: GPU tests drift without a GPU] in
tests/api_drift.py): CI skips every `gpu` test, so what they call is checked here."""

from __future__ import annotations

import pytest
from api_drift import drift, gpu_test_modules


@pytest.mark.parametrize("path", gpu_test_modules(), ids=lambda p: p.name)
def test_gpu_test_module_uses_the_runtime_as_it_is(path) -> None:  # noqa: ANN001
    assert drift(path.read_text()) == []


def test_there_are_gpu_test_modules_to_check() -> None:
    names = {p.name for p in gpu_test_modules()}
    assert {"test_runtime_gpu_cuda_path.py", "test_pinned_pool.py", "test_optimizer_worker.py"} <= names


# What an H200 run of the GPU tests once failed on, as the tests were then written.
STALE = '''
import torch
from runtime.transfer.stores import CopyEngine


def _slow(store):
    compute, side = torch.cuda.current_stream(), store.copier.stream
    return side, compute


def test_prefetch(unit):
    compute, side = torch.cuda.current_stream(), unit.param_store.copier.stream
    with torch.cuda.stream(side):
        pass
    torch.cuda.Event().record(side)


def test_read(store):
    side, compute = _slow(store)
    torch.cuda.Event().record(side)


def test_staged(copier):
    on_device, event = copier.stage_to_device(torch.ones(1))
    torch.cuda.current_stream().wait_event(event)


def test_transfer_path(tmp_path):
    from test_transfer_path import _doc, no_such_helper

    _doc("cpu", "in_backward", str(tmp_path), 1)
'''


def test_the_check_finds_what_the_gpu_found() -> None:
    problems = drift(STALE)
    role = "passes what runtime/ declares as Role or Role | None, not a torch stream or event"
    assert problems == [
        "line 29: test_transfer_path has no no_such_helper",
        f"line 15: torch.cuda.Event().record(side) {role}",
        f"line 13: torch.cuda.stream(side) {role}",
        f"line 20: torch.cuda.Event().record(side) {role}",
        "line 25: torch.cuda.current_stream().wait_event(event) passes what runtime/ declares as DeviceEvent | None, "
        "not a torch stream or event",
        "line 31: _doc(...) missing a required argument: 'world_size'",
    ], problems


def test_the_fixed_spelling_passes() -> None:
    fixed = STALE.replace("copier.stream", "copier.streams.cuda_stream(Role.H2D)").replace(
        "torch.cuda.current_stream().wait_event(event)", "copier.streams.wait(Role.COMPUTE, event)").replace(
        ", no_such_helper", "").replace('str(tmp_path), 1)', '"staged", str(tmp_path), 1)')
    assert drift(fixed) == []


def test_the_emulated_device_has_no_torch_stream_to_hand_out() -> None:
    """`Streams.cuda_stream`, the GPU tests' way to the torch stream behind a `Role`, is CUDA's only:
    on the emulated device it says so rather than hand out something torch would refuse later."""
    import torch

    from runtime.transfer.streams import EmulatedStreams
    from runtime.transfer.trace import Role

    with pytest.raises(TypeError, match="EmulatedStreams on cpu has no CUDA streams"):
        EmulatedStreams(torch.device("cpu"), separate_memory=True).cuda_stream(Role.H2D)
