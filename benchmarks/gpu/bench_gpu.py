"""The fp32 MLP on one GPU: parity of the runtime with plain torch, and its step all on the GPU.

    python benchmarks/gpu/bench_gpu.py parity [--size small] [--steps 5] [--out parity.json]
    python benchmarks/gpu/bench_gpu.py device [--size large] [--rounds 3 --steps 5 --warmup 2] [--out device.json]

The model is benchmarks/bench_runtime.py's (LayerNorm + two Linears per block, MSE loss), fp32, AdamW
at the same lr, at a size of SIZES. Systems (all on the one GPU):
- `plain`: the model on the GPU, `torch.optim.AdamW(fused=True)`, no runtime;
- `ours-device`: our runtime, everything on the GPU; `ours-cpu`: params, gradients and optimizer
  states on the cpu tier (the runtime's CPU offload).
The offload tiers against FSDP2 and DeepSpeed are measured on a real transformer in bf16
(benchmarks/gpu/bench_llama.py); this MLP is the kit's small extra. `device` builds its systems in
one process and alternates their steps (order flipped every iteration), `--rounds` fresh processes;
ratios are the median over adjacent step pairs. `parity` trains ours and plain from the same
weights on the same batches (TF32 off) and compares losses. `--device cpu` runs either mode without
a GPU (a check of the script, not a measurement).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from bench_nvme_step import GPU_HARDWARE  # noqa: E402
from bench_runtime import LR, build_model, ours_step, plain_step, plan_doc  # noqa: E402
from kit import emit  # noqa: E402

SIZES = {"tiny": (64, 256, 2, 2, 32), "small": (1024, 4096, 8, 4, 128), "large": (2048, 8192, 8, 8, 512)}
"""name -> (hidden, ffn, blocks, batch, tokens): small is the design document's (67 M params), large
268 M; tiny is the dry run's."""
MODES = {"parity": ["plain", "ours-device", "ours-cpu"], "device": ["ours-device", "plain"]}
"""Mode -> its systems; ours come first: built before any process group exists, as in `planner run`."""
PARITY_REL_TOL = 1e-5
"""Losses of ours vs plain torch, fp32 without TF32: same math, summation order aside."""


def gpu_plan(placement: str, size: str, device: str = "cuda") -> dict:
    hidden, ffn, blocks, batch, tokens = SIZES[size]
    doc = plan_doc(placement, GPU_HARDWARE if device == "cuda" else "cpu-dev-2core")
    doc["model"].update(hidden_size=hidden, ffn_hidden_size=ffn, num_layers=blocks, seq_len=tokens)
    doc["micro_batch_per_gpu"] = batch
    return doc


def make_step(system: str, size: str, x, y):  # noqa: ANN001, ANN201
    hidden, ffn, blocks, _, _ = SIZES[size]
    model = build_model(hidden, ffn, blocks)
    if system in ("ours-device", "ours-cpu"):
        step, _ = ours_step(model, gpu_plan(system.split("-")[1], size, x.device.type), x, y)
        step.optimizer = "runtime.AdamW"
        return step
    if system == "plain":
        return plain_step(model, x, y)
    raise SystemExit(f"unknown system {system!r}: use one of {sorted({s for v in MODES.values() for s in v})}")


def worker(mode: str, size: str, steps: int, warmup: int, device: str = "cuda") -> dict:
    """`device` "cpu" exists to exercise the parity and device modes on a machine without a GPU."""
    import torch

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
    if mode == "parity":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    hidden, _, _, batch, tokens = SIZES[size]
    torch.manual_seed(1)
    x = torch.randn(batch, tokens, hidden, device=device)
    y = torch.randn(batch, tokens, hidden, device=device)
    systems = MODES[mode]
    steppers = {name: make_step(name, size, x, y) for name in systems}
    times: dict[str, list[float]] = {n: [] for n in systems}
    losses: dict[str, list[float]] = {n: [] for n in systems}
    for i in range(warmup + steps):
        for name in systems if i % 2 == 0 else reversed(systems):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            losses[name].append(steppers[name]())  # .item(): the step's GPU work is done
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return {"systems": systems, "step_time_s": times, "losses": losses,
            "optimizers": {n: getattr(s, "optimizer", None) for n, s in steppers.items()},
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else 0}


def run_worker(mode: str, size: str, steps: int, warmup: int, device: str = "cuda") -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, mode, "--worker", "--size", size, "--steps", str(steps),
                           "--warmup", str(warmup), "--device", device], capture_output=True, text=True, env=env, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parity_doc(run: dict) -> dict:
    ref = run["losses"]["plain"]
    out = {}
    for name in ("ours-device", "ours-cpu"):
        ours = run["losses"][name]
        rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours, ref, strict=True))
        out[name] = {"losses": ours, "max_rel_error_vs_plain": rel, "bitwise_equal_to_plain": ours == ref,
                     "within_tolerance": rel <= PARITY_REL_TOL}
    return {"plain_losses": ref, "tolerance": PARITY_REL_TOL, "systems": out,
            "ok": all(v["within_tolerance"] for v in out.values())}


def timing_doc(runs: list[dict], systems: list[str]) -> dict:
    summary = {}
    for name in systems:
        times = [t for r in runs for t in r["step_time_s"][name]]
        summary[name] = {"median_step_time_s": statistics.median(times), "min_step_time_s": min(times),
                         "step_times_s": times, "first_losses": runs[0]["losses"][name][:3],
                         "optimizer": runs[0]["optimizers"][name]}
    ours = systems[0]
    ratios = {}
    for other in systems[1:]:
        paired = [a / b for r in runs for a, b in zip(r["step_time_s"][ours], r["step_time_s"][other], strict=True)]
        ratios[f"{ours}/{other} step time (median of paired ratios)"] = statistics.median(paired)
        ratios[f"{ours}/{other} step time (ratio of minima)"] = summary[ours]["min_step_time_s"] / summary[other]["min_step_time_s"]
    return {"summary": summary, "ratios": ratios,
            "cuda_max_allocated_bytes_per_process": [r["cuda_max_allocated_bytes"] for r in runs]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=list(MODES))
    ap.add_argument("--size", choices=list(SIZES), default=None, help="model size (default: small for parity, else large)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", type=Path, help="write the JSON document here too")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    size = args.size or ("small" if args.mode == "parity" else "large")
    if args.worker:
        print(json.dumps(worker(args.mode, size, args.steps, args.warmup, args.device)))
        return 0
    rounds = 1 if args.mode == "parity" else args.rounds
    runs = [run_worker(args.mode, size, args.steps, 0 if args.mode == "parity" else args.warmup, args.device)
            for _ in range(rounds)]
    hidden, ffn, blocks, batch, tokens = SIZES[size]
    doc = {"benchmark": f"gpu {args.mode}", "mode": args.mode, "size": size,
           "model": f"{blocks} x (LayerNorm + Linear({hidden},{ffn}) + Linear({ffn},{hidden})), batch {batch}x{tokens}, fp32, AdamW",
           "rounds": rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup, "lr": LR}
    errors = [r["error"] for r in runs if "error" in r]
    if errors:
        doc |= {"ok": False, "error": errors[0]}
    elif args.mode == "parity":
        doc |= parity_doc(runs[0])
    else:
        doc |= {"ok": True} | timing_doc(runs, MODES[args.mode])
    return emit(doc, args.out)


if __name__ == "__main__":
    sys.exit(main())
