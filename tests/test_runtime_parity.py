"""Parity: 10 fp32 steps through `runtime.shard` give the losses of plain PyTorch + torch.optim.AdamW.

Placements {device, cpu} x world sizes {1, 2}, plus tiling, recompute with offloaded recompute
inputs, and tiny Hugging Face Llama / GPT-2 models built from a config (nothing downloaded).
"""

from __future__ import annotations

import pytest
from runtime_support import (
    ALL_CPU,
    ALL_DEVICE,
    LLAMA_MODEL,
    plan_doc,
    reference_losses,
    relative_errors,
    run_distributed,
    sharded_losses,
)

TOL = 1e-5
OFFLOAD_RECOMPUTE_INPUTS = {**ALL_DEVICE, "recompute_inputs": "cpu"}
ZERO_OFFLOAD_PARAMS_ON_DEVICE = {**ALL_CPU, "params": "gpu"}

WORLD1_CASES = {
    "device": ("gpt", dict(placement=ALL_DEVICE)),
    "cpu": ("gpt", dict(placement=ALL_CPU)),
    "params-device-optimizer-cpu": ("gpt", dict(placement=ZERO_OFFLOAD_PARAMS_ON_DEVICE)),
    "tiling": ("gpt", dict(placement=ALL_CPU, tiling_factor=3)),
    "recompute-input-offload": ("gpt", dict(placement=OFFLOAD_RECOMPUTE_INPUTS, recompute_interval=1)),
    "recompute-2-blocks": ("gpt", dict(placement=ALL_CPU, recompute_interval=2)),
    "llama": ("llama", dict(placement=ALL_CPU, recompute_interval=1, tiling_factor=2, model=LLAMA_MODEL)),
    "gpt2": ("gpt2", dict(placement=ALL_DEVICE, recompute_interval=2)),
}


@pytest.fixture(scope="module")
def references() -> dict[str, list[float]]:
    return {kind: reference_losses(kind) for kind in ("gpt", "llama", "gpt2")}


@pytest.mark.parametrize("case", list(WORLD1_CASES))
def test_world1_matches_plain_pytorch(case: str, references: dict[str, list[float]]) -> None:
    kind, knobs = WORLD1_CASES[case]
    losses = sharded_losses(kind, plan_doc(**knobs))
    assert max(relative_errors(references[kind], losses)) <= TOL, (references[kind], losses)
    assert losses[-1] < losses[0]  # it actually trains


WORLD2_CASES = {
    "device": ("gpt", plan_doc(world_size=2, placement=ALL_DEVICE)),
    "cpu": ("gpt", plan_doc(world_size=2, placement=ALL_CPU)),
    "tiling+recompute-input-offload": ("gpt", plan_doc(world_size=2, placement=OFFLOAD_RECOMPUTE_INPUTS,
                                                        tiling_factor=2, recompute_interval=1)),
    "prefetch-depth-0": ("gpt", plan_doc(world_size=2, placement=ALL_CPU, prefetch_depth=0)),
    "llama": ("llama", plan_doc(world_size=2, placement=ALL_CPU, recompute_interval=1, model=LLAMA_MODEL)),
    "gpt2": ("gpt2", plan_doc(world_size=2, placement=ALL_DEVICE, tiling_factor=2)),
}


@pytest.mark.slow
def test_world2_matches_plain_pytorch(references: dict[str, list[float]], tmp_path) -> None:  # noqa: ANN001
    results = run_distributed("sharded_losses", list(WORLD2_CASES.values()), tmp_path)
    for (name, (kind, _)), losses in zip(WORLD2_CASES.items(), results, strict=True):
        assert max(relative_errors(references[kind], losses)) <= TOL, (name, references[kind], losses)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_tracks_fp32(precision: str, references: dict[str, list[float]]) -> None:
    """16-bit compute copies, fp32 master weights and Adam states: close to the fp32 run."""
    losses = sharded_losses("gpt", plan_doc(placement=ALL_CPU, precision=precision, recompute_interval=1))
    assert max(relative_errors(references["gpt"], losses)) <= 2e-2, losses


def test_fp16_overflow_skips_the_step_and_halves_the_scale() -> None:
    import torch
    from runtime_support import batches, build_model

    import runtime

    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_CPU, precision="fp16"))
    opt = runtime.AdamW(model, lr=1e-3)
    scaler = runtime.state_of(model).loss_scaler
    scaler.scale = 2.0**40  # fp16 gradients overflow at this scale
    before = {k: v.clone() for k, v in runtime.state_of(model).masters.items()}
    tokens = batches(1)[0]
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    assert opt.step() is False
    assert scaler.scale == 2.0**39 and opt.num_skipped_steps == 1
    assert all(torch.equal(before[k], v) for k, v in runtime.state_of(model).masters.items())
