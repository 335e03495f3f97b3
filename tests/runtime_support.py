"""Shared pieces of the runtime tests: tiny plans, tiny models, reference training, 2-rank runs."""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from runtime.process_exit import leave

ROOT = Path(__file__).resolve().parents[1]
HARDWARE = json.loads((ROOT / "data" / "hardware" / "cpu-dev-2core.json").read_text())
STEPS = 10
BATCH = 4
SEQ = 16
VOCAB = 64
ALL_CPU = {"params": "cpu", "gradients": "cpu", "optimizer_states": "cpu", "recompute_inputs": "cpu"}
ALL_DEVICE = {"params": "gpu", "gradients": "gpu", "optimizer_states": "gpu", "recompute_inputs": "gpu"}
LLAMA_MODEL = {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64,
               "gated_mlp": True, "tied_embeddings": False, "norm": "rmsnorm", "seq_len": SEQ, "vocab_size": VOCAB}
"""The shape of `build_model("llama")` (GQA, SwiGLU 64 wide, untied): plans for it say so (runtime.shard
refuses a model that is not its plan's)."""


def mlp_model(blocks: int, hidden: int, ffn: int) -> dict[str, Any]:
    """A plan's model for `blocks` x (Linear(hidden, ffn), Linear(ffn, hidden)): the operators of a
    block whose attention is one head 1 wide (a model spec has no MLP-only block), so the bills
    gather the MLP's own linears and count its weights within 1% (runtime.shard checks the count)."""
    return {"num_layers": blocks, "hidden_size": hidden, "num_heads": 1, "head_dim": 1, "ffn_hidden_size": ffn,
            "seq_len": SEQ, "vocab_size": 0}


def plan_doc(*, world_size: int = 1, placement: dict[str, str] | None = None, **knobs: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "model": {"num_layers": 2, "hidden_size": 32, "num_heads": 4, "seq_len": SEQ, "vocab_size": VOCAB},
        "hardware": HARDWARE,
        "num_gpus": world_size,
        "precision": "fp32",
        "recompute_interval": 0,
        "placement": placement or ALL_DEVICE,
    }
    doc.update(knobs)
    return doc


def build_model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gpt":
        from runtime.gpt import GPT, GPTConfig

        return GPT(GPTConfig(num_layers=2, hidden_size=32, num_heads=4, seq_len=SEQ, vocab_size=VOCAB))
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    raise AssertionError(kind)


def batches(steps: int = STEPS) -> list[torch.Tensor]:
    """Arithmetic sequences mod VOCAB (random start and stride): learnable within a few steps."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        stride = torch.randint(1, 4, (BATCH, 1), generator=g)
        out.append((start + stride * torch.arange(SEQ + 1)) % VOCAB)
    return out


def _loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    # GPT takes shifted labels; Hugging Face models shift inside, so they get the inputs as labels.
    from runtime.gpt import GPT

    if isinstance(model, GPT):
        return model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
    return model(input_ids=tokens[:, :-1], labels=tokens[:, :-1]).loss


def reference_losses(kind: str, steps: int = STEPS) -> list[float]:
    """Plain single-process PyTorch with torch.optim.AdamW on the global batch."""
    model = build_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    out = []
    for tokens in batches(steps):
        loss = _loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def sharded_losses(kind: str, plan: dict[str, Any], steps: int = STEPS, rank: int = 0, world_size: int = 1) -> list[float]:
    import runtime

    model = runtime.shard(build_model(kind), plan)
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    out = []
    for tokens in batches(steps):
        loss = _loss(model, tokens.chunk(world_size)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        if world_size > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
        out.append(value.item() / world_size)
    return out


def cuda_shared_losses(kind: str, plan: dict[str, Any], steps: int = STEPS, rank: int = 0,
                       world_size: int = 1) -> list[float]:
    """`sharded_losses` on CUDA with every rank on the one GPU, cuda:0 (a gloo group: NCCL refuses two
    ranks on one device, and collectives go through host memory, [Note: gloo and device tensors]),
    TF32 off; the loss is averaged over the ranks on the host."""
    import torch.distributed as dist

    import runtime

    os.environ["LOCAL_RANK"] = "0"  # the runtime's compute device: the GPU every rank shares
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = runtime.shard(build_model(kind), plan)
    assert runtime.state_of(model).comm.host_staged
    opt = runtime.AdamW(model, lr=1e-3, weight_decay=0.1)
    out = []
    for tokens in batches(steps):
        loss = _loss(model, tokens.chunk(world_size)[rank].cuda())
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().cpu()
        dist.all_reduce(value)
        out.append(value.item() / world_size)
    opt.close()
    return out


def relative_errors(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b)
    return [abs(x - y) / abs(x) for x, y in zip(a, b, strict=True)]


_MEMORY_PROBE = ("import json, sys; from runtime.memory_probe import nvme_step_host_memory; "
                 "print(json.dumps(nvme_step_host_memory(*json.loads(sys.argv[1]))))")


def nvme_step_host_memory(nvme_path: Path, layers: int, hidden: int, steps: int, recompute_interval: int = 1,
                          optimizer_step: str = "after_backward") -> dict[str, int]:
    """`runtime.memory_probe.nvme_step_host_memory` on this hardware, in its own process (RSS is the
    process's) with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), so that large freed buffers
    go back to the kernel instead of staying in the heap, which RSS would otherwise count."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    args = [HARDWARE, str(nvme_path), layers, hidden, steps, recompute_interval, optimizer_step]
    done = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, json.dumps(args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn_name: str, cases: list[Any], out_dir: str, module: str) -> None:
    import torch.distributed as dist

    faulthandler.enable()  # a rank that dies of a signal prints its threads' Python stacks
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        import importlib

        support = importlib.import_module(module)
        results = [getattr(support, fn_name)(*case, rank=rank, world_size=world_size) for case in cases]
        if rank == 0:
            Path(out_dir, "results.json").write_text(json.dumps(results))
        # Both ranks are done with every collective before either tears its groups down: a rank
        # that destroys gloo's pairs while its peer is still using them can abort the peer.
        dist.barrier()
    except BaseException:
        # Print the cause before anything tears down: destroying the groups while the peer is still
        # in a collective can abort this process (SIGABRT, "terminate called without an active
        # exception") before torch's spawn records the exception, which would hide it. The groups
        # are left to the interpreter's exit, after spawn has written the error file.
        traceback.print_exc()
        sys.stderr.flush()
        raise
    dist.destroy_process_group()
    leave(0)  # not through the interpreter's finalization: [Note: a rank leaves with os._exit]


def run_distributed(fn_name: str, cases: list[tuple[Any, ...]], out_dir: Path, world_size: int = 2,
                    module: str = "runtime_support") -> list[Any]:
    """Run `module.fn_name(*case, rank=, world_size=)` for every case on `world_size` gloo ranks (one spawn)."""
    mp.start_processes(_worker, args=(world_size, free_port(), fn_name, cases, str(out_dir), module), nprocs=world_size,
                       start_method="spawn")
    return json.loads(Path(out_dir, "results.json").read_text())


class DeferredWrites:
    """NVMe engine writes that run only when first waited for (waiting again is a no-op, as for an
    engine `Handle`): what a caller waits for, and when, becomes visible, and a read that did not
    wait for a write of its range would read the old bytes. `install` puts it in place of
    `IOEngine.write_async` for every engine."""

    def __init__(self) -> None:
        self.handles: list[_DeferredWrite] = []
        self.waited: list[int] = []
        """Numbers of the writes in the order they were first waited for (0 is the first submitted)."""

    def install(self, monkeypatch: Any) -> None:
        from runtime.nvme import IOEngine

        submit = IOEngine.write_async

        def write_async(engine: Any, file: Any, **kwargs: Any) -> _DeferredWrite:
            handle = _DeferredWrite(len(self.handles), lambda: submit(engine, file, **kwargs).wait(), self.waited)
            self.handles.append(handle)
            return handle

        monkeypatch.setattr(IOEngine, "write_async", write_async)

    def unrun(self) -> int:
        """Writes submitted and not waited for yet."""
        return sum(not h.ran for h in self.handles)


class _DeferredWrite:
    def __init__(self, number: int, run: Any, waited: list[int]) -> None:
        self.number, self._run, self._waited, self.ran = number, run, waited, False

    def done(self) -> bool:
        return self.ran

    def wait(self) -> None:
        if not self.ran:
            self.ran = True
            self._waited.append(self.number)
            self._run()
