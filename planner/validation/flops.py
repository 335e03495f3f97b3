"""FLOP accounting: convert a predicted tokens/s into the metric a row measured, the row's own way.

[Note: FLOP accountings] Sources count FLOPs three ways (data/validation/README.md):
- `megatron` (hardware FLOPs; Megatron-LM papers and README, Narayanan et al. 2021 eq. 3):
  `F = 24 k B s l h^2 (1 + s/(6h) + V/(16 l h))` per iteration with `k = 4` passes under full
  recompute (forward, recompute, 2 x backward) and 3 without; per token that is
  `k (2 N_blocks + 4 l h s) + 6 h V` for a GPT block (`N_blocks = 12 l h^2`). We use the model's own
  `N_blocks` (GQA, SwiGLU, any FFN width), so Llama shapes are counted as the same formula would.
- `nemo` (model FLOPs; NeMo 24.07): the same formula with `k = 3` whatever the recompute (checked
  on the corpus: rows p224-p233's TFLOPS / tokens/s reproduce it to 0.1 %);
- `bridge` (model FLOPs; Megatron-Bridge): `nemo` with causal attention, `2 l h s` instead of
  `4 l h s` (rows p246-p259 reproduce it to 0.1 %, except p256 at 2.3 %).
- `6n` (model FLOPs; llm-foundry, torchtitan and FlashAttention-2's Table 1, Dao 2023 Sec. 4.2):
  `6 N + 12 l h s` per token with `N` every
  parameter, embeddings included (the corpus's `params_b` where given, as llm-foundry counts it:
  its learned position embeddings are not in the planner's model).
MFU is model (or hardware) TFLOPS over the GPU's datasheet peak. Sources that do not say how they
count (ZeRO, ZeRO-Offload, OPT, Fuyou, MegaTrain) are read with the Megatron convention, which is
what DeepSpeed's and Megatron's own reports use; BLOOM-176B's figure is Megatron-DeepSpeed's own
throughput log, the Megatron convention with the recompute forward counted.

Because one row's measured and predicted values go through the same conversion, the error
`predicted / measured - 1` does not depend on the accounting; the accounting only makes the
`predicted` column readable in the row's own unit.
"""

from __future__ import annotations

from planner.specs.errors import PlannerError
from planner.specs.model import ModelSpec

ACCOUNTINGS: tuple[str, ...] = ("megatron", "nemo", "bridge", "6n")
METRICS: tuple[str, ...] = ("tokens_per_s_per_gpu", "tflops_per_gpu", "mfu")
SOURCE_ACCOUNTING: dict[str, str] = {
    "llmfoundry_bench": "6n",
    "torchtitan_h200_2506": "6n",
    "torchtitan_perfmd_2408": "6n",
    "torchao_optim": "6n",
    "nemo_2407": "nemo",
    "nemo_longseq_2403": "nemo",
    "megatron_bridge_archive": "bridge",
    "flashattn2_2023": "6n",
}
"""Sources not listed count the Megatron way (see the note)."""


def accounting_for(source_id: str) -> str:
    return SOURCE_ACCOUNTING.get(source_id, "megatron")


def flops_per_token(model: ModelSpec, accounting: str, *, full_recompute: bool, num_params: float | None = None) -> float:
    """FLOPs one trained token costs under `accounting` (`num_params` overrides the 6N count)."""
    layers, hidden, seq = model.num_layers, model.hidden_size, model.seq_len
    if accounting == "6n":
        params = model.num_params if num_params is None else num_params
        return 6 * params + 12 * layers * hidden * seq
    if accounting in ("megatron", "nemo", "bridge"):
        passes = 4 if accounting == "megatron" and full_recompute else 3
        blocks = layers * sum(op.num_params for op in model.block_operators())  # the matmuls' weights: no biases or norms
        attention = (2 if accounting == "bridge" else 4) * layers * hidden * seq
        return passes * (2 * blocks + attention) + 6 * hidden * model.vocab_size
    raise PlannerError(f"unknown FLOP accounting {accounting!r}; use one of {', '.join(ACCOUNTINGS)}")


def from_tokens_per_s(tokens_per_s_per_gpu: float, metric: str, *, flops_per_token_: float, peak_flops_per_s: float) -> float:
    """Tokens/s per GPU -> `metric` (tokens/s per GPU, TFLOPS per GPU, or MFU as a fraction)."""
    if metric == "tokens_per_s_per_gpu":
        return tokens_per_s_per_gpu
    if metric == "tflops_per_gpu":
        return tokens_per_s_per_gpu * flops_per_token_ / 1e12
    if metric == "mfu":
        return tokens_per_s_per_gpu * flops_per_token_ / peak_flops_per_s
    raise PlannerError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")


def to_tokens_per_s(value: float, metric: str, *, flops_per_token_: float, peak_flops_per_s: float) -> float:
    """The inverse of `from_tokens_per_s`."""
    return value / from_tokens_per_s(1.0, metric, flops_per_token_=flops_per_token_, peak_flops_per_s=peak_flops_per_s)
