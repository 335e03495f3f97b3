"""Host memory of NVMe-placement training steps, measured in this process.

`nvme_step_host_memory` trains a GPT with every model state on NVMe and reports the plan's
host-memory budget (the memory bill's `cpu` + `gpu` peaks: without CUDA the compute device is host
memory), the runtime ledger's host peak, the anonymous RSS peak above the level before the model
was built (sampled every 0.5 ms during the steps), and the bytes of model states on NVMe. RSS is
the process's, so run it in a fresh process (tests/test_nvme_training.py does, with glibc's mmap
threshold fixed; benchmarks/nvme_memory_probe.py is its command line).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

import runtime
from planner.cost.memory import memory_bill
from planner.specs.plan import Plan
from runtime.gpt import GPT, GPTConfig
from runtime.sharding import state_of

SEQ, VOCAB, BATCH = 16, 64, 4
ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"}


def anon_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def plan_for(hardware: dict[str, Any], nvme_path: str, layers: int, hidden: int, recompute_interval: int = 1,
             optimizer_step: str = "after_backward") -> Plan:
    return Plan.from_dict({
        "model": {"num_layers": layers, "hidden_size": hidden, "num_heads": 4, "seq_len": SEQ, "vocab_size": VOCAB},
        "hardware": hardware, "num_gpus": 1, "micro_batch_per_gpu": BATCH, "precision": "fp32",
        "recompute_interval": recompute_interval, "placement": ALL_NVME,
        "nvme_path": nvme_path, "optimizer_chunk_bytes": 1 << 20, "num_optimizer_buffers": 3,
        "optimizer_step": optimizer_step,
    })


def train(plan: Plan, steps: int, tokens: torch.Tensor, sample: bool) -> dict[str, int]:
    m = plan.model
    with torch.device("meta"):  # construction-time partitioning: no full model in memory
        model = GPT(GPTConfig(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=4, seq_len=SEQ,
                              vocab_size=VOCAB))
    model = runtime.shard(model, plan)
    opt = runtime.AdamW(model)
    peak, stop = [0], threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon_rss_bytes())
            time.sleep(0.0005)

    thread = threading.Thread(target=sampler)
    if sample:
        thread.start()
    for _ in range(steps):
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss.backward()
        opt.step()
        opt.zero_grad()
    stop.set()
    if sample:
        thread.join()
    ledger = state_of(model).ledger.peak_bytes()
    opt.close()
    state_of(model).close()
    return {"ledger_host_peak_bytes": ledger["cpu"] + ledger["gpu"], "nvme_state_bytes": ledger["nvme"],
            "anon_rss_peak_bytes": peak[0]}


def nvme_step_host_memory(hardware: dict[str, Any], nvme_path: str, layers: int, hidden: int, steps: int,
                          recompute_interval: int = 1, optimizer_step: str = "after_backward") -> dict[str, int]:
    """`steps` training steps of a `layers` x `hidden` GPT with its states on NVMe under `nvme_path`:
    `ledger_host_peak_bytes`, `nvme_state_bytes`, `anon_rss_peak_delta_bytes`, `host_budget_bytes`."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
    # load the code paths before the baseline
    train(plan_for(hardware, nvme_path, 1, 32, optimizer_step=optimizer_step), 2, tokens, sample=False)
    base = anon_rss_bytes()
    plan = plan_for(hardware, nvme_path, layers, hidden, recompute_interval, optimizer_step)
    bill = memory_bill(plan).peak_bytes
    out = train(plan, steps, tokens, sample=True)
    out["anon_rss_peak_delta_bytes"] = out.pop("anon_rss_peak_bytes") - base
    out["host_budget_bytes"] = bill["cpu"] + bill["gpu"]
    return out
