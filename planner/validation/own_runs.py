"""This project's own measured training runs, as rows the fit calibrates on beside the published
corpus ([Note: the project's own runs in the fit]).

A run of the runtime on a GPU (benchmarks/gpu/kit.py) records the plan it ran and what it measured
(benchmarks/gpu/runs/*.json, `planner.chains.<chain>.profile`). Such a run states every setting the
planner needs (it ran the planner's own plan), so it is predicted from that plan as it was, with the
fitted numbers on the preset of its GPU, exactly as `planner probe` gives that GPU its generation's
fit (planner/calibration/fitted_gpus.py): the probed links stay, the compute model is the fit's.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from planner.specs.catalog import hardware_presets
from planner.specs.plan import Plan
from planner.validation.configure import RowPlan
from planner.validation.corpus import CorpusRow, gpu_family
from planner.validation.flash_kernels import FlashKernel

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclasses.dataclass(frozen=True, slots=True)
class OwnRun:
    """One recorded run: its file, the chain whose all-on-GPU step is compared, the GPU as CUDA named
    it and the preset of that GPU."""

    path: Path
    chain: str
    gpu_type: str
    preset: str
    source_id: str
    row_id: str


OWN_RUNS: tuple[OwnRun, ...] = (
    OwnRun(ROOT / "benchmarks" / "gpu" / "runs" / "2026-11-26-h200.json", "searched", "H200 (SXM, 141 GB)", "h200-x1",
           "tierwise_runtime_2611", "own-h200-2611"),
)
"""The recorded runs that calibrate: the first run of the runtime on a GPU (an H200, 1.2 B GPT of 24
blocks of width 2,048 at 1,024 tokens, batch 4, bf16, everything on the GPU; docs/notes/2026-11-26-first-gpu-run.md)."""


# [Note: the project's own runs in the fit] The first GPU run of the runtime is a measured training
# step on an H200, a GPU of the H100 generation the fit covers (planner/validation/fit.py
# GENERATIONS), under a plan that states every setting. It is a row like a published one, of its own
# source: the fit weighs it as one row, and leave-one-source-out predicts it from a fit on the
# published rows alone, which is the check that it is not merely fitted (docs/validation.md). It is the
# generation's only row with small matmuls (34-137 GFLOP, 4,096 tokens of width 2,048); the published
# H100 rows all multiply 240 GFLOP or more, so without it the matmul curve below that size is the
# hand-set prior's. Its attention is the runtime's `F.scaled_dot_product_attention(is_causal=True)`,
# whose CUDA flash backend is FlashAttention-2 (runtime/gpt.py); the plan it recorded says `eager`
# (the probed spec had no fused-attention rate), so the row is predicted with `attention: flash`, the
# kernel that ran.
def own_run_rows(families: tuple[str, ...]) -> list[tuple[CorpusRow, RowPlan]]:
    """The recorded runs on GPUs of `families`, each as a corpus row and its plan ([Note: the
    project's own runs in the fit])."""
    out = []
    for run in OWN_RUNS:
        if gpu_family(run.gpu_type) in families and run.path.exists():
            out.append(_own_row(run))
    return out


def _own_row(run: OwnRun) -> tuple[CorpusRow, RowPlan]:
    profile = json.loads(run.path.read_text())["planner"]["chains"][run.chain]["profile"]
    plan = Plan.from_dict(profile["plan"])
    preset = hardware_presets()[run.preset]
    node = plan.node.replace(gpu_nominal_flops_per_s=preset.gpu_nominal_flops_per_s,
                             gpu_hbm_bytes_per_s=preset.gpu_hbm_bytes_per_s,
                             flash_attention_flops_per_s=preset.flash_attention_flops_per_s)
    plan = plan.replace(node=node, attention="flash", prediction=None)
    model, measured = plan.model, profile["measured"]
    row = CorpusRow(
        row_id=run.row_id, source_id=run.source_id, citation=f"{run.path.relative_to(ROOT)} (chain {run.chain})",
        model_name=model.name, num_layers=model.num_layers, hidden_size=model.hidden_size, num_heads=model.num_heads,
        ffn_hidden_size=model.ffn_hidden_size, seq_len=model.seq_len, vocab_size=model.vocab_size or None,
        params_b=model.num_params / 1e9, gpu_type=run.gpu_type, gpu_family=gpu_family(run.gpu_type),
        gpu_memory_gb=None, num_gpus=plan.num_gpus, gpus_per_node=plan.node.num_gpus_per_node,
        tensor_parallel=1, pipeline_parallel=1, data_parallel=plan.num_gpus, sharding="none", offload="none",
        params_on="gpu", optimizer_on="gpu", micro_batch=int(plan.micro_batch_per_gpu),
        global_batch=int(plan.micro_batch_per_gpu * plan.micro_batches_per_step * plan.num_gpus),
        activation_recompute="none", recompute_block_period=None, attention="flash2", shard_collectives="", precision=plan.precision,
        measured_tflops_per_gpu=None, measured_mfu=None,
        measured_tokens_per_s_per_gpu=measured["tokens_per_s"] / plan.num_gpus,
        flops_accounting_note="tokens per second measured by the runtime's profile", notes="the project's own run")
    return row, RowPlan(plan=plan, grad_accumulation=plan.micro_batches_per_step,
                        flash_kernel=FlashKernel.FLASH_ATTENTION_2)
