"""A tiny Llama (GQA) built on the meta device, sharded, trained 2 steps and checkpointed: the run
`tests/test_export.py` exports (importable by `runtime_support.run_distributed`'s workers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from runtime_support import HARDWARE

VOCAB = 128
SEQ = 16
BATCH = 4
STEPS = 2


def llama_config(*, tie: bool = False, bias: bool = False) -> Any:
    """`bias`: attention biases, so that a unit holds two parameters (a weight across both ranks' shards,
    the bias in the second's)."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=VOCAB, intermediate_size=128, max_position_embeddings=32, tie_word_embeddings=tie,
                       attention_bias=bias, dtype=torch.float32)


def plan(placement: dict[str, str], *, world_size: int, nvme_path: str | None = None, **knobs: Any) -> dict[str, Any]:
    """A plan of the tiny Llama's shape for this machine (16 KiB optimizer chunks: units span several)."""
    return {"model": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "seq_len": SEQ, "vocab_size": VOCAB,
                      "num_kv_heads": 2, "ffn_hidden_size": 128, "gated_mlp": True},
            "hardware": HARDWARE, "num_gpus": world_size, "precision": "fp32", "recompute_interval": 0,
            "placement": placement, "micro_batch_per_gpu": BATCH // world_size, "nvme_path": nvme_path,
            "optimizer_chunk_bytes": 16 * 1024, "num_optimizer_buffers": 3, **knobs}


def fixed_batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def train_and_checkpoint(plan_doc: dict[str, Any], checkpoint_dir: str, tie: bool = False, bias: bool = False,
                         save_at: tuple[int, ...] = (STEPS,), *, rank: int = 0, world_size: int = 1) -> list[Any]:
    """Train 2 steps, save checkpoints after the steps `save_at` and return the runtime model's logits on
    `fixed_batch()` after the last step."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    import runtime
    from runtime.ckpt import Checkpointer
    from runtime.plan_io import resolve_plan

    # The plan states the model it was made for (runtime.shard checks it): tied embeddings count once.
    plan_doc = {**plan_doc, "model": {**plan_doc["model"], "tied_embeddings": tie}}
    torch.manual_seed(0)
    config = llama_config(tie=tie, bias=bias)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    # Parameters are materialised unit by unit by `runtime.shard`; the rotary buffers are computed.
    model.model.rotary_emb = LlamaRotaryEmbedding(config=config)
    model = runtime.shard(model, plan_doc)
    optimizer = runtime.AdamW(model, lr=1e-2, weight_decay=0.1)
    checkpointer = Checkpointer(Path(checkpoint_dir), plan=resolve_plan(plan_doc), seed=0, rank=rank,
                                world_size=world_size, resume=False)
    g = torch.Generator().manual_seed(1)
    for step in range(1, STEPS + 1):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).chunk(world_size)[rank]
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step in save_at:
            checkpointer.save(step, runtime.state_of(model), optimizer, scalars={})
    with torch.no_grad():
        logits = model(input_ids=fixed_batch()).logits
    runtime.state_of(model).close()
    return logits.tolist()
