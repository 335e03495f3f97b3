"""Closing a sharded model frees it ([Note: closing lets the model go] in runtime/sharding.py)."""

from __future__ import annotations

import gc
import weakref

import pytest
from runtime_support import _loss, batches, build_model, plan_doc

import runtime

NVME = {"params": "nvme", "gradients": "cpu", "optimizer_states": "nvme", "recompute_inputs": "gpu"}


def _trained(plan: dict) -> tuple[object, object]:
    model = runtime.shard(build_model("gpt"), plan)
    optimizer = runtime.AdamW(model, lr=1e-3)
    for tokens in batches(2):
        _loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


@pytest.mark.parametrize("placement", ["device", "nvme"])
def test_a_closed_model_and_its_state_are_freed(placement: str, tmp_path) -> None:  # noqa: ANN001
    plan = plan_doc() if placement == "device" else plan_doc(placement=NVME, nvme_path=str(tmp_path))
    model, optimizer = _trained(plan)
    state = weakref.ref(runtime.state_of(model))
    optimizer.close()
    runtime.state_of(model).close()
    del model, optimizer
    gc.collect()
    assert state() is None, "the sharded model's state outlived its model after close()"


def test_without_close_the_state_is_kept_for_the_model() -> None:
    """The control: an open model's state lives as long as the model (its hooks need it)."""
    model, optimizer = _trained(plan_doc())
    state = weakref.ref(runtime.state_of(model))
    del optimizer
    gc.collect()
    assert state() is not None
    _loss(model, batches(1)[0]).backward()  # still trains
    runtime.state_of(model).close()


def test_a_closed_model_refuses_a_forward_in_one_line() -> None:
    model, optimizer = _trained(plan_doc())
    optimizer.close()
    state = runtime.state_of(model)
    state.close()
    state.close()  # a second close is a no-op
    with pytest.raises(RuntimeError, match=r"^this sharded GPT was closed \(its shards are gone\)"):
        _loss(model, batches(1)[0])
    with pytest.raises(ValueError, match="was not sharded"):
        runtime.state_of(model)
