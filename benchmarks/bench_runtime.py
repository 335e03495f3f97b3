"""Step time and peak RSS: Tierwise runtime vs DeepSpeed ZeRO-3 (CPU offload) vs plain PyTorch.

The reference MLP: 8 blocks of LayerNorm + Linear(1024, 4096) + Linear(4096, 1024), batch 4 x 128
tokens, fp32, Adam. Step times: the two systems of a comparison live in one process and alternate
step by step, so that machine noise (other processes on the same cores) hits both alike. Peak RSS: each
system alone in a fresh process. Reported: median and minimum step times and the ratios.

    python benchmarks/bench_runtime.py --rounds 3 --steps 4 --warmup 2 [--write-results]

The comparisons run in pairs (ours-cpu vs deepspeed, ours-device vs plain), each pair in one
process with alternating steps (see `worker`).

Prints one JSON document; `--write-results` also replaces the runtime section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, FFN, BLOCKS, BATCH, TOKENS = 1024, 4096, 8, 4, 128
LR = 1e-3


def build_model(hidden: int = HIDDEN, ffn: int = FFN, blocks: int = BLOCKS):  # noqa: ANN201
    """The reference MLP (other sizes for the GPU kit, benchmarks/gpu/), seeded: every call
    returns the same weights."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.up = nn.Linear(hidden, ffn)
            self.down = nn.Linear(ffn, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(self.ln(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(blocks))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return torch.nn.functional.mse_loss(x, y)

    torch.manual_seed(0)
    return Net()


def plan_doc(placement: str, hardware: str = "cpu-dev-2core") -> dict:
    """The plan our runtime executes: `placement` "cpu" (the cpu tier) or "device" (everything on the
    compute device); `hardware` a preset of data/hardware/ (the GPU kit passes a GPU machine's)."""
    hardware = json.loads((ROOT / "data" / "hardware" / f"{hardware}.json").read_text())
    tiers = {"cpu": dict.fromkeys(("params", "gradients", "optimizer_states", "recompute_inputs"), "cpu"),
             "device": dict.fromkeys(("params", "gradients", "optimizer_states", "recompute_inputs"), "gpu")}
    # The MLP's blocks as a spec: an attention of one head 1 wide (a spec has no MLP-only block), so the
    # count is the MLP's within 0.1% and runtime.shard takes the plan as this model's (runtime/model_check.py).
    return {"model": {"name": "design-md-mlp", "num_layers": BLOCKS, "hidden_size": HIDDEN, "num_heads": 1,
                      "head_dim": 1, "seq_len": TOKENS, "vocab_size": 0, "ffn_hidden_size": FFN},
            "hardware": hardware, "num_gpus": 1, "precision": "fp32", "recompute_interval": 0,
            "prefetch_depth": 2, "placement": tiers[placement]}


def ours_step(model, plan: dict, x, y):  # noqa: ANN001, ANN201 - torch objects; returns (step, sharded model)
    """One training step of our runtime executing `plan` on `model` (AdamW, the benchmarks' lr)."""
    import runtime

    model = runtime.shard(model, plan)
    opt = runtime.AdamW(model, lr=LR, weight_decay=0.0)

    def step() -> float:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step, model


DEEPSPEED_OPTIMIZER = {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}}
"""DeepSpeed at its best: with `offload_optimizer` and no `torch_adam`, ZeRO-3 steps with
DeepSpeedCPUAdam (its fused AVX C++ Adam, JIT-built with ninja on first use), not torch's single-tensor
Adam, which is several times slower (docs/notes/2026-11-22-reference-measurements.md)."""


def deepspeed_step(model, x, y, *, batch: int, port: str, zero_optimization: dict, device: str = "cpu", **config):  # noqa: ANN001, ANN201
    """One training step of DeepSpeed ZeRO in this single process, fp32, AdamW at the benchmarks' lr
    (DEEPSPEED_OPTIMIZER); `config` adds top-level keys (e.g. `aio`). On `device="cpu"` it runs on
    DeepSpeed's CPU accelerator over gloo; on "cuda" on the GPU (the process group, when this process
    has none yet, is gloo for CPU tensors and NCCL for CUDA ones)."""
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("BENCH_PORT", port))
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "cpu:gloo,cuda:nccl")
    config = {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "optimizer": DEEPSPEED_OPTIMIZER,
        "zero_optimization": zero_optimization,
        "bf16": {"enabled": False}, "fp16": {"enabled": False},
        **config,
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step() -> float:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    # What actually steps (recorded in the results: DeepSpeedCPUAdam, not torch's AdamW).
    step.optimizer = type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__
    return step


def plain_step(model, x, y):  # noqa: ANN001, ANN201 - torch module and tensors; returns a step callable
    """The same model with torch's fused AdamW and no runtime, on the inputs' device."""
    import torch

    model = model.to(x.device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)

    def step() -> float:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    step.optimizer = f"torch AdamW fused ({x.device.type})"
    return step


def make_step(system: str, x, y):  # noqa: ANN001, ANN201 - torch tensors; returns a step callable

    model = build_model()
    if system in ("ours-cpu", "ours-device"):
        step, _ = ours_step(model, plan_doc(system.split("-")[1]), x, y)
    elif system == "plain":
        step = plain_step(model, x, y)
    elif system == "deepspeed":
        step = deepspeed_step(model, x, y, batch=BATCH, port="29611",
                              zero_optimization={"stage": 3, "offload_param": {"device": "cpu"},
                                                 "offload_optimizer": {"device": "cpu"}})
    else:
        raise SystemExit(f"unknown system {system}")
    return step


def worker(systems: list[str], steps: int, warmup: int) -> dict:
    """Build every system in `systems` in this process and alternate their steps (the order flips
    each iteration), so that both see the same machine load; returns per-system times."""
    import resource

    import torch

    torch.manual_seed(1)
    x = torch.randn(BATCH, TOKENS, HIDDEN)
    y = torch.randn(BATCH, TOKENS, HIDDEN)
    steppers = {name: make_step(name, x, y) for name in systems}
    optimizers = {name: getattr(step, "optimizer", None) for name, step in steppers.items()}
    times: dict[str, list[float]] = {n: [] for n in systems}
    cpu_times: dict[str, list[float]] = {n: [] for n in systems}
    losses: dict[str, list[float]] = {n: [] for n in systems}
    for i in range(warmup + steps):
        for name in systems if i % 2 == 0 else reversed(systems):
            start, cpu_start = time.perf_counter(), time.process_time()
            losses[name].append(steppers[name]())
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
                cpu_times[name].append(time.process_time() - cpu_start)
    return {"systems": systems, "step_time_s": times, "cpu_time_s": cpu_times, "losses": losses, "optimizers": optimizers,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_worker(systems: str, steps: int, warmup: int) -> dict:
    env = dict(os.environ, DS_BUILD_OPS="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--worker", systems, "--steps", str(steps), "--warmup", str(warmup)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{systems} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", help="comma-separated systems to alternate in this process")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.steps, args.warmup)))
        return
    pairs = [("ours-cpu", "deepspeed"), ("ours-device", "plain")]
    machine = results_md.measure_machine(torch=True, versions=("deepspeed",))
    # Peak RSS: each system alone in a fresh process (a short run: the peak is reached in step 1).
    alone = {s: run_worker(s, 1, 1) for pair in pairs for s in pair}
    summary: dict[str, dict] = {}
    ratios: dict[str, float] = {}
    for a, b in pairs:
        runs = [run_worker(f"{a},{b}", args.steps, args.warmup) for _ in range(args.rounds)]
        for name in (a, b):
            times = [t for r in runs for t in r["step_time_s"][name]]
            summary[name] = {"median_step_time_s": statistics.median(times), "min_step_time_s": min(times),
                             "step_times_s": times, "peak_rss_bytes": alone[name]["peak_rss_bytes"],
                             "first_losses": runs[0]["losses"][name][:3],
                             "optimizer": runs[0]["optimizers"].get(name)}
        # Adjacent steps of a and b see the same load: the median of their ratios is the robust one.
        paired = [ta / tb for r in runs for ta, tb in zip(r["step_time_s"][a], r["step_time_s"][b], strict=True)]
        key = f"{a}/{b}"
        ratios[f"{key} step time (median of paired ratios)"] = statistics.median(paired)
        ratios[f"{key} step time (ratio of medians)"] = summary[a]["median_step_time_s"] / summary[b]["median_step_time_s"]
        ratios[f"{key} step time (ratio of minima)"] = summary[a]["min_step_time_s"] / summary[b]["min_step_time_s"]
        ratios[f"{key} peak RSS"] = summary[a]["peak_rss_bytes"] / summary[b]["peak_rss_bytes"]
    doc = {"benchmark": "runtime step time vs DeepSpeed ZeRO-3 CPU offload and plain PyTorch",
           "machine": machine.finish().to_dict(),
           "model": f"{BLOCKS} x (LayerNorm + Linear({HIDDEN},{FFN}) + Linear({FFN},{HIDDEN})), batch {BATCH}x{TOKENS}, fp32, AdamW",
           "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
           "summary": summary, "ratios": ratios}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc, machine)


def write_results(doc: dict, machine: results_md.MachineFacts) -> None:
    s = doc["summary"]
    device = ("the compute device is host memory: torch sees no CUDA device, so \"offloading\" to the CPU moves "
              "nothing, for us and for DeepSpeed alike" if machine.gpu is None else
              f"torch sees {machine.gpu}, but the inputs are made on the CPU; read these rows as CPU-only and the "
              "GPU kit's section for the comparison on the GPU")
    rows = "\n".join(f"| {k} | {v['median_step_time_s']:.3f} | {v['min_step_time_s']:.3f} | "
                     f"{v['peak_rss_bytes'] / 2**30:.2f} |" for k, v in s.items())
    ratio_lines = "\n".join(f"- {k}: **{v:.3f}**" for k, v in doc["ratios"].items())
    section = f"""## Runtime vs DeepSpeed ZeRO-3 (CPU offload) and plain PyTorch

`python benchmarks/bench_runtime.py --rounds {doc['rounds']} --steps {doc['steps_per_round']} --warmup {doc['warmup_steps']} --write-results`

{machine.describe()}
Model: {doc['model']}. `ours-cpu`: params, gradients, optimizer states on the `cpu` tier;
`ours-device`: everything on the compute device; `deepspeed`: DeepSpeed {machine.versions['deepspeed']} ZeRO-3 with
`offload_param` and `offload_optimizer` on CPU, stepping with {s['deepspeed'].get('optimizer') or 'its CPU Adam'}
(its fused C++ Adam, JIT-built with ninja; `torch_adam` off), gloo, CPU accelerator; `plain`: the same
model with `torch.optim.AdamW(fused=True)`, no runtime.

**What the CPU-offload ratio measures here.** In this script {device}. The ours-cpu /
deepspeed ratio therefore measures each system's bookkeeping overhead (partitioning, gathers,
copies into fp32 partitions, hooks) and its optimizer, not the cost of host-device copies. The
comparison with copies in it runs on a GPU (`bash benchmarks/gpu/run.sh offload`, which also
measures FSDP2 with `CPUOffloadPolicy`).

The two systems of a comparison are built in one process and their steps alternate (order flipped
every iteration), so both see the same load from other processes; the headline ratio is
the median over step pairs of (ours / theirs). Peak RSS comes from each system alone in a fresh
process.

| system | median step (s) | min step (s) | peak RSS alone (GiB) |
|---|---|---|---|
{rows}

{ratio_lines}"""
    results_md.write_section("runtime", section)


if __name__ == "__main__":
    main()
