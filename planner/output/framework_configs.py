"""Framework configs beyond DeepSpeed: a plan as a Hugging Face accelerate config (its FSDP2 plugin) or
as a torch FSDP2 `fully_shard` snippet (the DeepSpeed config is deepspeed_config.py).

What FSDP2 can express, and how a plan maps onto its options: [Note: what FSDP2 can express]
and [Note: the FSDP2 mapping], below the imports.
"""

from __future__ import annotations

from typing import Any

import yaml

from planner.specs.errors import PlannerError
from planner.specs.plan import Plan
from planner.specs.tiers import HOST

# [Note: what FSDP2 can express] FSDP2 (`torch.distributed.fsdp.fully_shard`) shards every parameter,
# its gradient and (through the optimizer built on the sharded parameters) its optimizer states
# together, on the GPU or, with `CPUOffloadPolicy`, all three in CPU memory, the optimizer stepping
# there (https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html). So a plan has an
# FSDP2 config when its parameters, gradients and optimizer states share one tier, gpu or cpu; a
# recomputed block's input may sit in CPU memory (`offload_wrapper` around `checkpoint_wrapper`, which is what
# accelerate's `fsdp_activation_checkpointing_offload` does). It cannot place anything on NVMe, split
# the optimizer from the parameters (ZeRO-Offload: optimizer states on CPU, parameters on the GPU),
# tile a linear into pieces gathered one at a time, or shard a block across GPUs (tensor
# parallelism needs a model-specific plan): those are refused in one line naming what it cannot
# express, with the DeepSpeed config as the way out where DeepSpeed can run the plan.
#
# [Note: the FSDP2 mapping] ZeRO-3 placements -> `reshard_after_forward=True` (parameters freed after each block's
# forward, gathered again for backward); ZeRO-2 -> `False` (kept gathered from forward to backward, as
# ZeRO-2 keeps whole parameters); plain data parallel is no sharding at all: accelerate's `MULTI_GPU`
# (DistributedDataParallel), not `fully_shard`. Recompute is per block, the granularity accelerate
# and `fully_shard` wrap at (they call it activation checkpointing): a plan with k > 1 blocks per
# recompute segment is written as one block per segment, which recomputes the same forward once and
# keeps less. Key names follow accelerate 1.15.0 (its
# `accelerate launch` options `--fsdp_version`, `--fsdp_offload_params`, `--fsdp_reshard_after_forward`,
# `--fsdp_activation_checkpointing`, `--fsdp_activation_checkpointing_offload`, ...;
# https://huggingface.co/docs/accelerate/usage_guides/fsdp); without `fsdp_transformer_layer_cls_to_wrap`
# accelerate wraps the model's `_no_split_modules` (every transformers model's decoder layer class).

ACCELERATE_DOCS = "https://huggingface.co/docs/accelerate/usage_guides/fsdp"
FSDP2_DOCS = "https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html"
_MIXED_PRECISION = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


_DEEPSPEED_WAY_OUT = "use --deepspeed-config (DeepSpeed runs every placement)"


def fsdp2_refusal(plan: Plan) -> str:
    """Why FSDP2 cannot run this plan and the way out ([Note: what FSDP2 can express]); empty when it can."""
    placement = plan.placement.to_dict()
    beyond_host = {state: tier for state, tier in placement.items() if tier.staged}
    cpu_pin = "or pin --placement params=cpu,gradients=cpu,optimizer_states=cpu"
    if beyond_host:
        where = " and ".join(dict.fromkeys(tier.label for tier in beyond_host.values()))
        return (f"{where} placement ({', '.join(f'{s}={t}' for s, t in beyond_host.items())}): FSDP2 offloads to "
                f"CPU memory only; {_DEEPSPEED_WAY_OUT} {cpu_pin}")
    states = {state: placement[state] for state in ("params", "gradients", "optimizer_states")}
    if len(set(states.values())) > 1:
        where = ", ".join(f"{s}={t}" for s, t in states.items())
        return (f"{where}: FSDP2 keeps parameters, gradients and optimizer states on one tier "
                f"(CPUOffloadPolicy moves all three), so it cannot split them; {_DEEPSPEED_WAY_OUT} {cpu_pin}")
    if plan.tiling_factor > 1:
        return (f"tiling (tiling_factor {plan.tiling_factor}): FSDP2 gathers each wrapped block whole; "
                "pin --tiling-factor 1")
    if plan.model_parallel_degree > 1:
        return (f"tensor parallelism (model_parallel_degree {plan.model_parallel_degree}): needs a model-specific "
                "tensor-parallel plan beside fully_shard; pin --model-parallel 1")
    return ""


def _refuse(what: str, reason: str) -> None:
    if reason:
        raise PlannerError(f"the {what} cannot express this plan: {reason}")


def _header(plan: Plan, what: str, docs: str) -> list[str]:
    """Comment lines: what the file is for, and what of the plan it does not carry as the plan says."""
    lines = [f"{what} for: {plan.model.name} on {plan.num_gpus} GPU(s) of {plan.node.name}",
             f"placement {plan.placement.label()}, strategy {plan.strategy}, batch/GPU {plan.micro_batch_per_gpu:g}, "
             f"recompute interval {plan.recompute_interval}, {plan.precision}",
             f"Written by `planner fit` (planner/output/framework_configs.py [Note: what FSDP2 can express]); see {docs}"]
    if plan.recompute_interval > 1:
        lines.append(f"Recompute segments of one block (the plan: {plan.recompute_interval} blocks each): "
                     "the same recompute, less kept")
    if plan.optimizer_step == "in_backward":
        lines.append("The plan steps the optimizer in backward; this config steps it after backward")
    return lines


def accelerate_config(plan: Plan) -> dict[str, Any]:
    """The `accelerate launch --config_file` document for the plan (FSDP2, or DDP for plain data parallel)."""
    _refuse("accelerate config", fsdp2_refusal(plan))
    distributed = "FSDP"
    if plan.strategy == "dp":  # no sharding: DistributedDataParallel, or nothing on one GPU
        distributed = "MULTI_GPU" if plan.num_gpus > 1 else "NO"
    doc: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "debug": False,
        "distributed_type": distributed,
        "downcast_bf16": "no",
        "machine_rank": 0,
        "main_training_function": "main",
        "mixed_precision": _MIXED_PRECISION[plan.precision],
        "num_machines": plan.num_nodes,
        "num_processes": plan.num_gpus,
        "rdzv_backend": "static",
        "same_network": True,
        "use_cpu": False,
    }
    if distributed == "FSDP":
        doc["fsdp_config"] = _fsdp_config(plan)
    return doc


def _fsdp_config(plan: Plan) -> dict[str, Any]:
    recompute = plan.recompute_interval > 0
    fsdp: dict[str, Any] = {
        "fsdp_version": 2,
        "fsdp_offload_params": plan.placement.params == HOST,
        "fsdp_reshard_after_forward": plan.strategy != "zero2",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_cpu_ram_efficient_loading": True,
        "fsdp_activation_checkpointing": recompute,
    }
    if recompute and plan.placement.recompute_inputs == HOST:
        fsdp["fsdp_activation_checkpointing_offload"] = True
    return fsdp


def accelerate_yaml(plan: Plan) -> str:
    doc = accelerate_config(plan)
    header = _header(plan, "accelerate config", ACCELERATE_DOCS)
    if plan.num_nodes > 1:
        header.append("Several machines: set main_process_ip and main_process_port, and machine_rank on each")
    return "".join(f"# {line}\n" for line in header) + yaml.safe_dump(doc, sort_keys=False)


def fsdp2_snippet(plan: Plan) -> str:
    """Python that wraps and shards a model as the plan says with `fully_shard` (torch >= 2.6)."""
    what = "FSDP2 snippet"
    _refuse(what, fsdp2_refusal(plan))
    if plan.strategy == "dp":
        _refuse(what, "plain data parallel replicates every state, which is DistributedDataParallel, not "
                      "fully_shard; use --accelerate-config (it writes the plan as MULTI_GPU)")
    if plan.precision == "fp16":
        _refuse(what, "fp16 needs a loss scaler this snippet does not set up; use --accelerate-config or bf16")
    header = _header(plan, what, FSDP2_DOCS)
    header.append("Run under torchrun, one process per GPU, after init_process_group")
    wrappers = ["checkpoint_wrapper"] + (["offload_wrapper"] if plan.placement.recompute_inputs == HOST else [])
    lines = ["".join(f"# {line}\n" for line in header) + "import torch"]
    if plan.recompute_interval:
        lines.append("from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import " + ", ".join(wrappers))
    policy = "CPUOffloadPolicy" if plan.placement.params == HOST else "OffloadPolicy"
    lines += [f"from torch.distributed.fsdp import {policy}, MixedPrecisionPolicy, fully_shard",
              "", f"MICRO_BATCH_PER_GPU = {max(1, round(plan.micro_batch_per_gpu))}  # the plan's batch per GPU",
              "", "", *_apply_plan_function(plan)]
    return "\n".join(lines) + "\n"


def _apply_plan_function(plan: Plan) -> list[str]:
    if plan.precision == "bf16":
        mixed = "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),"
    else:
        mixed = "MixedPrecisionPolicy(),  # fp32: no casts"
    if plan.placement.params == HOST:  # with gradients and optimizer states ([Note: what FSDP2 can express])
        offload = "CPUOffloadPolicy(pin_memory=torch.cuda.is_available()),  # params, grads, optimizer in CPU memory"
    else:
        offload = "OffloadPolicy(),  # every state on the GPU"
    body = [
        "def apply_plan(model: torch.nn.Module, blocks: torch.nn.ModuleList, mesh=None) -> torch.nn.Module:",
        '    """Wrap and shard `model` in place as the plan says. `blocks` are its transformer blocks',
        "    (`model.model.layers` for Llama); build the optimizer on `model.parameters()` afterwards.\"\"\"",
        "    fsdp = {",
        '        "mesh": mesh,  # None: every rank of the default process group',
        f'        "reshard_after_forward": {plan.strategy != "zero2"},',
        f'        "mp_policy": {mixed}',
        f'        "offload_policy": {offload}',
        "    }",
        "    for index, block in enumerate(blocks):",
    ]
    if plan.recompute_interval:
        body.append("        block = checkpoint_wrapper(block)  # recompute the block's forward in backward")
        if plan.placement.recompute_inputs == HOST:
            body.append("        block = offload_wrapper(block)  # the segment's input waits in CPU memory")
        body.append("        blocks[index] = block")
    body += ["        fully_shard(block, **fsdp)", "    fully_shard(model, **fsdp)", "    return model"]
    return body
