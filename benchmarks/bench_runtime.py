"""Step time and peak RSS: Tierwise runtime vs DeepSpeed ZeRO-3 (CPU offload) vs plain PyTorch.

The DESIGN.md model: 8 blocks of LayerNorm + Linear(1024, 4096) + Linear(4096, 1024), batch 4 x 128
tokens, fp32, Adam. Each system runs in its own fresh process (peak RSS is then its own), and the
processes are interleaved round by round (ours, DeepSpeed, plain, ours, ...) so that machine noise
(other jobs on the 2 cores) hits all of them alike. Reported: median step time over all measured
steps of all rounds, and the ratios.

    python benchmarks/bench_runtime.py --rounds 3 --steps 4 --warmup 2 [--write-results]

Prints one JSON document; `--write-results` also replaces the runtime section of
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, FFN, BLOCKS, BATCH, TOKENS = 1024, 4096, 8, 4, 128
LR = 1e-3


def build_model():  # noqa: ANN201
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln = nn.LayerNorm(HIDDEN)
            self.up = nn.Linear(HIDDEN, FFN)
            self.down = nn.Linear(FFN, HIDDEN)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.relu(self.up(self.ln(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return torch.nn.functional.mse_loss(x, y)

    torch.manual_seed(0)
    return Net()


def plan_doc(placement: str) -> dict:
    hardware = json.loads((ROOT / "data" / "hardware" / "cpu-dev-2core.json").read_text())
    tiers = {"cpu": dict.fromkeys(("params", "gradients", "optimizer_states", "activation_checkpoints"), "cpu"),
             "device": dict.fromkeys(("params", "gradients", "optimizer_states", "activation_checkpoints"), "gpu")}
    return {"model": {"name": "design-md-mlp", "num_layers": BLOCKS, "hidden_size": HIDDEN, "num_heads": 16,
                      "seq_len": TOKENS, "vocab_size": 0, "ffn_hidden_size": FFN},
            "hardware": hardware, "num_gpus": 1, "precision": "fp32", "checkpoint_interval": 0,
            "prefetch_depth": 2, "placement": tiers[placement]}


def worker(system: str, steps: int, warmup: int) -> dict:
    import resource

    import torch

    torch.manual_seed(1)
    x = torch.randn(BATCH, TOKENS, HIDDEN)
    y = torch.randn(BATCH, TOKENS, HIDDEN)
    model = build_model()
    if system in ("ours-cpu", "ours-device"):
        import runtime

        model = runtime.shard(model, plan_doc(system.split("-")[1]))
        opt = runtime.AdamW(model, lr=LR, weight_decay=0.0)

        def step() -> float:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
    elif system == "plain":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)

        def step() -> float:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss.item()
    elif system == "deepspeed":
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("BENCH_PORT", "29611"), DS_ACCELERATOR="cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                  "offload_optimizer": {"device": "cpu"}},
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def step() -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()
    else:
        raise SystemExit(f"unknown system {system}")
    times, cpu_times, losses = [], [], []
    for i in range(warmup + steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        losses.append(step())
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    return {"system": system, "step_time_s": times, "cpu_time_s": cpu_times, "losses": losses,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def run_worker(system: str, steps: int, warmup: int) -> dict:
    env = dict(os.environ, DS_BUILD_OPS="0", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--worker", system, "--steps", str(steps), "--warmup", str(warmup)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{system} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--systems", default="ours-cpu,deepspeed,ours-device,plain")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.steps, args.warmup)))
        return
    systems = args.systems.split(",")
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for _ in range(args.rounds):
        for system in systems:
            runs[system].append(run_worker(system, args.steps, args.warmup))
    summary = {}
    for system, rs in runs.items():
        times = [t for r in rs for t in r["step_time_s"]]
        cpu = [t for r in rs for t in r["cpu_time_s"]]
        summary[system] = {"median_step_time_s": statistics.median(times), "min_step_time_s": min(times),
                           "median_cpu_time_s": statistics.median(cpu), "step_times_s": times,
                           "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rs),
                           "first_losses": rs[0]["losses"][:3]}
    ratios = {}

    def ratio(name: str, a: str, b: str) -> None:
        if a in summary and b in summary:
            for key in ("median_step_time_s", "min_step_time_s", "median_cpu_time_s", "peak_rss_bytes"):
                ratios[f"{name}.{key}"] = summary[a][key] / summary[b][key]

    ratio("ours_cpu_offload_over_deepspeed", "ours-cpu", "deepspeed")
    ratio("ours_device_over_plain_pytorch", "ours-device", "plain")
    doc = {"benchmark": "runtime step time vs DeepSpeed ZeRO-3 CPU offload and plain PyTorch",
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}",
           "model": f"{BLOCKS} x (LayerNorm + Linear({HIDDEN},{FFN}) + Linear({FFN},{HIDDEN})), batch {BATCH}x{TOKENS}, fp32, AdamW",
           "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
           "summary": summary, "ratios": ratios}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc)


def write_results(doc: dict) -> None:
    path = ROOT / "benchmarks" / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    begin, end = "<!-- runtime:begin -->", "<!-- runtime:end -->"
    s = doc["summary"]
    rows = "\n".join(f"| {k} | {v['median_step_time_s']:.3f} | {v['min_step_time_s']:.3f} | {v['median_cpu_time_s']:.3f} | "
                     f"{v['peak_rss_bytes'] / 2**30:.2f} |" for k, v in s.items())
    ratio_lines = "\n".join(f"- `{k}`: **{v:.3f}**" for k, v in doc["ratios"].items())
    section = f"""{begin}
## Runtime vs DeepSpeed ZeRO-3 (CPU offload) and plain PyTorch

`python benchmarks/bench_runtime.py --rounds {doc['rounds']} --steps {doc['steps_per_round']} --warmup {doc['warmup_steps']} --write-results`

Machine: {doc['machine']} (shared with other jobs; systems interleaved round by round, medians).
Model: {doc['model']}. `ours-cpu`: params, gradients, optimizer states on the `cpu` tier;
`ours-device`: everything on the compute device; `deepspeed`: DeepSpeed 0.19.8 ZeRO-3 with
`offload_param` and `offload_optimizer` on CPU (torch Adam, gloo, CPU accelerator); `plain`: the same
model with `torch.optim.AdamW(fused=True)`, no runtime.

Wall time is what a user waits; with other jobs on the machine it is noisy, so the minimum wall
time and the median process CPU time per step (all threads; less sensitive to sharing the cores)
are reported too.

| system | median step (s) | min step (s) | median CPU time/step (s) | peak RSS (GiB) |
|---|---|---|---|---|
{rows}

{ratio_lines}
{end}"""
    if begin in text:
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)


if __name__ == "__main__":
    main()
