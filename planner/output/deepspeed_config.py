"""A framework config: the plan as a DeepSpeed (0.19) config, for users who run DeepSpeed rather than our
runtime (the others are in framework_configs.py).

Mapping (DeepSpeed's ZeRO-3 names): params -> `offload_param`, optimizer states -> `offload_optimizer`
(gradients follow the optimizer in DeepSpeed), recompute inputs on CPU -> `cpu_checkpointing`,
our NVMe request size -> `aio.block_size`. Buffer counts and sizes are sized from the plan's model
so that one gathered operator fits in a swap buffer. DeepSpeed has no tiling knob in its config
(it tiles with `deepspeed.zero.TiledLinear` in the model code), so a tiling factor > 1 is reported in
`tierwise.tiling_factor` for the user to apply. Nor has it an optimizer step in backward: an
`in_backward` plan gets DeepSpeed's after-backward step, noted in `tierwise.optimizer_step`.
"""

from __future__ import annotations

import math
from typing import Any

from planner.cost.memory import BYTES_PER_PARAM
from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.specs.tiers import HOST, NVME

DEEPSPEED_OFFLOAD_TIERS = (HOST, NVME)
"""The tiers DeepSpeed offloads to: its `offload_*.device` values are their names."""
PARAM_SWAP_BUFFER_COUNT = 5  # DeepSpeed's default; we size each buffer to hold one operator
OPTIMIZER_SWAP_BUFFER_COUNT = 4
DEFAULT_NVME_PATH = "/local_nvme"


def _check_offload_tiers(plan: Plan) -> None:
    """Refuse a state on a tier DeepSpeed has no offload device for."""
    for state, tier in plan.placement.to_dict().items():
        if not tier.on_device and tier not in DEEPSPEED_OFFLOAD_TIERS:
            raise PlannerError(f"DeepSpeed cannot place {state} on {tier}: it offloads to "
                               f"{' or '.join(DEEPSPEED_OFFLOAD_TIERS)} only; pin --placement {state}=cpu")


def deepspeed_config(plan: Plan) -> dict[str, Any]:
    if plan.pipeline_parallel_degree > 1:
        raise PlannerError("a pipelined plan has no DeepSpeed config here: DeepSpeed pipelines need the model as a "
                           "PipelineModule; plan with pipeline_parallel_degree 1, or run it with Megatron-LM")
    _check_offload_tiers(plan)
    if plan.strategy == "dp":
        stage = 0
    elif plan.strategy == "3d":
        stage = 1  # optimizer states partitioned (ZeRO-1)
    elif plan.strategy in ("zero2", "zero-offload"):
        stage = 2
    else:
        stage = 3
    nvme_path = plan.nvme_path or DEFAULT_NVME_PATH
    op_params = math.ceil(plan.model.largest_operator_params / (plan.model_parallel_degree * plan.tiling_factor))
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(
            {
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": op_params,
                "stage3_prefetch_bucket_size": op_params * max(1, plan.prefetch_depth),
                "stage3_max_live_parameters": op_params * (1 + min(plan.prefetch_depth, 1)),
                "stage3_param_persistence_threshold": 0,
            }
        )
        if not plan.placement.params.on_device:  # DeepSpeed's offload devices are named as our tiers
            param: dict[str, Any] = {"device": str(plan.placement.params), "pin_memory": True}
            if plan.placement.params == NVME:
                param.update({"nvme_path": nvme_path, "buffer_count": PARAM_SWAP_BUFFER_COUNT, "buffer_size": op_params})
            zero["offload_param"] = param
    if not plan.placement.optimizer_states.on_device:
        if stage == 0:
            raise PlannerError("plain data parallel (strategy dp) cannot offload the optimizer in DeepSpeed")
        opt: dict[str, Any] = {"device": str(plan.placement.optimizer_states), "pin_memory": True}
        if plan.placement.optimizer_states == NVME:
            opt.update({"nvme_path": nvme_path, "buffer_count": OPTIMIZER_SWAP_BUFFER_COUNT, "pipeline_read": True, "pipeline_write": True})
        zero["offload_optimizer"] = opt
    micro = plan.micro_batch_per_gpu * plan.model_parallel_degree
    doc: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": max(1, round(plan.micro_batch_per_gpu)),
        "gradient_accumulation_steps": plan.micro_batches_per_step,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}},
        "gradient_clipping": 1.0,
        "steps_per_print": 100,
        "wall_clock_breakdown": False,
    }
    if plan.precision == "bf16":
        doc["bf16"] = {"enabled": True}
    elif plan.precision == "fp16":
        doc["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if plan.uses_nvme:
        doc["aio"] = {
            "block_size": plan.nvme_block_bytes,
            "queue_depth": 16,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        }
    if plan.recompute_interval:
        doc["activation_checkpointing"] = {
            "partition_activations": plan.model_parallel_degree > 1,
            "cpu_checkpointing": not plan.placement.recompute_inputs.on_device,
            "contiguous_memory_optimization": False,
            "number_checkpoints": math.ceil(plan.model.num_layers / plan.recompute_interval),
        }
    # DeepSpeed ignores keys it does not know only at the top level; ours go in one namespaced block
    # that it tolerates, so the file records what the config cannot express.
    doc["tierwise"] = {
        "tiling_factor": plan.tiling_factor,
        "model_parallel_degree": plan.model_parallel_degree,
        "samples_per_model_replica": micro,
        "bytes_per_param": BYTES_PER_PARAM[plan.precision],
    }
    if plan.optimizer_step == "in_backward":
        # DeepSpeed has no in-backward step: it runs this placement with its own after-backward step.
        doc["tierwise"]["optimizer_step"] = plan.optimizer_step
    return doc
