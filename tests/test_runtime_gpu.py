"""The CUDA paths (device stores, pinned host stores on a copy stream, NCCL-free world 1), marked
`gpu`: skipped without CUDA (tests/conftest.py). Same parity bar as the CPU tests."""

from __future__ import annotations

import pytest
import torch
from runtime_support import (
    ALL_CPU,
    ALL_DEVICE,
    batches,
    build_model,
    plan_doc,
    reference_losses,
    relative_errors,
    run_distributed,
)

import runtime

pytestmark = pytest.mark.gpu


def _cuda_losses(kind: str, plan: dict) -> list[float]:
    model = runtime.shard(build_model(kind), plan)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    out = []
    for tokens in batches():
        tokens = tokens.cuda()
        loss = model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


@pytest.mark.parametrize("placement", [ALL_DEVICE, ALL_CPU, {**ALL_CPU, "params": "gpu"}])
def test_cuda_fp32_matches_cpu_reference(placement: dict) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    ref = reference_losses("gpt")
    losses = _cuda_losses("gpt", plan_doc(placement=placement, recompute_interval=1, tiling_factor=2))
    # CPU vs CUDA kernels differ in summation order: a looser bar than the same-device 1e-5.
    assert max(relative_errors(ref, losses)) <= 1e-4


def test_cuda_bf16_trains_close_to_fp32() -> None:
    ref = reference_losses("gpt")
    losses = _cuda_losses("gpt", plan_doc(placement=ALL_CPU, precision="bf16"))
    assert max(relative_errors(ref, losses)) <= 2e-2


def test_cuda_profile_records_allocator_peak_and_h2d() -> None:
    model = runtime.shard(build_model("gpt"), plan_doc(placement=ALL_CPU))
    opt = runtime.AdamW(model, lr=1e-3)
    tokens = batches(1)[0].cuda()
    model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
    opt.step()
    sample = runtime.state_of(model).profiler.samples[-1]
    assert sample.cuda_max_allocated_bytes > 0
    assert sample.link_bytes["h2d"] > 0 and sample.link_bytes["d2h"] > 0


@pytest.mark.parametrize("placement", [
    {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"},
    {**ALL_CPU, "params": "gpu"},
], ids=["all-nvme", "params-on-gpu"])
def test_cuda_optimizer_step_in_backward_is_bitwise_after_backward(placement: dict, tmp_path) -> None:  # noqa: ANN001
    """[Note: the optimizer step in backward] on CUDA: each unit's gradient goes from the GPU into
    the update (staged into pinned host memory on the copy stream, counted as d2h, with the states
    on NVMe; [Note: the optimizer worker]); the losses are those of the after-backward step on the
    same device, bit for bit."""
    doc = plan_doc(placement=placement, nvme_path=str(tmp_path), prefetch_depth=3,
                   optimizer_chunk_bytes=16 * 1024, num_optimizer_buffers=3)
    after = _cuda_losses("gpt", doc)
    assert _cuda_losses("gpt", {**doc, "optimizer_step": "in_backward"}) == after
    if placement["optimizer_states"] == "nvme":  # the chunk buffers the gradients land in are pinned
        model = runtime.shard(build_model("gpt"), {**doc, "optimizer_step": "in_backward"})
        assert runtime.AdamW(model).chunk_pool.pinned


@pytest.mark.slow
def test_two_ranks_sharing_the_gpu_over_gloo_match_plain_pytorch(tmp_path) -> None:  # noqa: ANN001
    """The reduce paths on CUDA tensors: two gloo ranks on the one GPU ([Note: gloo and device
    tensors]), parameters gathered and gradients reduce-scattered on the device (all on the GPU) and
    staged through host shards (all in host memory), train the reference GPT to plain PyTorch's
    losses on the global batch, within the CPU-vs-CUDA bar of the world-1 test above."""
    cases = [("gpt", plan_doc(world_size=2, placement=ALL_DEVICE)),
             ("gpt", plan_doc(world_size=2, placement=ALL_CPU, recompute_interval=1, tiling_factor=2))]
    results = run_distributed("cuda_shared_losses", cases, tmp_path)
    ref = reference_losses("gpt")
    for (_, plan), losses in zip(cases, results, strict=True):
        assert max(relative_errors(ref, losses)) <= 1e-4, (plan["placement"], ref, losses)
