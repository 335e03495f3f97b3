"""The DeepSpeed config written for a plan is accepted by DeepSpeed 0.19's own (strict, pydantic) config class."""

import pytest

from planner.output.deepspeed_config import deepspeed_config
from planner.search.search import SearchRequest, search
from planner.specs.catalog import resolve_hardware, resolve_model

deepspeed_runtime_config = pytest.importorskip("deepspeed.runtime.config")


@pytest.mark.parametrize(
    "strategy,precision",
    [("zero-inf-nvme", "bf16"), ("zero-inf-cpu", "fp32"), ("zero3", "bf16"), ("zero-offload", "fp16"), ("zero2", "bf16")],
)
def test_deepspeed_accepts_the_written_config(strategy, precision, tmp_path):
    best = search(SearchRequest(model=resolve_model("10B"), node=resolve_hardware("dgx2-v100"), num_gpus=16,
                                strategy=strategy, precision=precision, nvme_path=str(tmp_path))).best
    assert best is not None
    doc = deepspeed_config(best)
    config = deepspeed_runtime_config.DeepSpeedConfig(doc)
    expected_stage = 2 if strategy in ("zero2", "zero-offload") else 3
    assert config.zero_optimization_stage == expected_stage
    assert config.train_micro_batch_size_per_gpu == best.micro_batch_per_gpu
    zero = config.zero_config
    if best.placement.params == "nvme":
        assert zero.offload_param.device == "nvme" and str(zero.offload_param.nvme_path) == str(tmp_path)
        assert config.aio_config["block_size"] == best.nvme_block_bytes
    if best.placement.optimizer_states != "gpu":
        assert zero.offload_optimizer.device == best.placement.optimizer_states
    assert config.bfloat16_config.enabled == (precision == "bf16")
    assert config.float16_config.enabled == (precision == "fp16")
