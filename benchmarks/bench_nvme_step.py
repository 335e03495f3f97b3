"""A full-NVMe training step (params, gradients and optimizer states on NVMe): Tierwise vs DeepSpeed
ZeRO-3 with `offload_param` and `offload_optimizer` on NVMe, and vs the step's I/O roofline.

The DESIGN.md model (8 blocks of LayerNorm + Linear(1024, 4096) + Linear(4096, 1024), batch 4 x 128
tokens, fp32, AdamW), the same as benchmarks/bench_runtime.py. Both systems live in one process
and alternate step by step (the order flips each iteration), so that noise from other jobs on the
machine hits both alike; `ours-cpu` (everything in host memory) runs alongside as the compute-only
reference. The I/O roofline of our step is the bytes it moved (the runtime's own link counters,
`nvme_read` and `nvme_write`) over the NVMe bandwidth that `planner probe`'s measurement
(`runtime.probe.measure_nvme`) finds on the same directory in the same run:
read_bytes / read_bw + write_bytes / write_bw.

    python benchmarks/bench_nvme_step.py --nvme-path DIR --rounds 2 --steps 3 --warmup 1 [--write-results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_runtime import BATCH, BLOCKS, FFN, HIDDEN, LR, TOKENS, build_model  # noqa: E402
from bench_runtime import plan_doc as cpu_plan_doc  # noqa: E402

NVME_PLACEMENT = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "activation_checkpoints": "cpu"}


def plan_doc(system: str, nvme_path: str) -> dict:
    doc = cpu_plan_doc("cpu")
    if system == "ours-nvme":
        doc.update(placement=NVME_PLACEMENT, nvme_path=nvme_path, prefetch_depth=2)
    return doc


def make_step(system: str, x, y, nvme_path: str):  # noqa: ANN001, ANN201 - torch tensors; returns (step, io_bytes)
    model = build_model()
    if system in ("ours-nvme", "ours-cpu"):
        import runtime
        from runtime.sharding import state_of

        model = runtime.shard(model, plan_doc(system, nvme_path))
        opt = runtime.AdamW(model, lr=LR, weight_decay=0.0)
        links = state_of(model).profiler.link_bytes

        def step() -> float:
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()

        return step, lambda: (links.get("nvme_read", 0), links.get("nvme_write", 0))
    if system == "deepspeed-nvme":
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("BENCH_PORT", "29613"), DS_ACCELERATOR="cpu")
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False},
                "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False},
            },
            "aio": {"block_size": 1 << 20, "queue_depth": 16, "thread_count": 4, "single_submit": False,
                    "overlap_events": True},
            "bf16": {"enabled": False}, "fp16": {"enabled": False},
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def ds_step() -> float:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            return loss.item()

        return ds_step, lambda: (0, 0)
    raise SystemExit(f"unknown system {system}")


def worker(systems: list[str], steps: int, warmup: int, nvme_path: str) -> dict:
    import torch

    torch.manual_seed(1)
    x = torch.randn(BATCH, TOKENS, HIDDEN)
    y = torch.randn(BATCH, TOKENS, HIDDEN)
    steppers = {name: make_step(name, x, y, nvme_path) for name in systems}
    times: dict[str, list[float]] = {n: [] for n in systems}
    io: dict[str, list[list[int]]] = {n: [] for n in systems}
    losses: dict[str, list[float]] = {n: [] for n in systems}
    for i in range(warmup + steps):
        for name in systems if i % 2 == 0 else reversed(systems):
            step, io_bytes = steppers[name]
            before = io_bytes()
            start = time.perf_counter()
            losses[name].append(step())
            elapsed = time.perf_counter() - start
            after = io_bytes()
            if i >= warmup:
                times[name].append(elapsed)
                io[name].append([after[0] - before[0], after[1] - before[1]])
    return {"step_time_s": times, "io_bytes": io, "losses": losses}


def run_worker(systems: str, steps: int, warmup: int, nvme_path: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--worker", systems, "--steps", str(steps), "--warmup", str(warmup),
                           "--nvme-path", nvme_path], capture_output=True, text=True, env=env, cwd=ROOT, timeout=3000)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.steps, args.warmup, args.nvme_path)))
        return
    from runtime.probe import measure_nvme

    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme_path:
        probe_before = measure_nvme(nvme_path)
        # DeepSpeed's NVMe path needs its async_io op (JIT-built against libaio): try it alone first.
        ds_check = run_worker("deepspeed-nvme", 1, 0, nvme_path)
        systems = "ours-nvme,ours-cpu" + ("" if "error" in ds_check else ",deepspeed-nvme")
        runs = [run_worker(systems, args.steps, args.warmup, nvme_path) for _ in range(args.rounds)]
        probe_after = measure_nvme(nvme_path)
    for run in runs:
        if "error" in run:
            raise SystemExit(f"{systems} failed:\n{run['error']}")
    read_bw = statistics.median([probe_before.read_bytes_per_s, probe_after.read_bytes_per_s])
    write_bw = statistics.median([probe_before.write_bytes_per_s, probe_after.write_bytes_per_s])
    summary: dict[str, dict] = {}
    for name in systems.split(","):
        times = [t for r in runs for t in r["step_time_s"][name]]
        summary[name] = {"median_step_time_s": statistics.median(times), "min_step_time_s": min(times),
                         "step_times_s": times, "first_losses": runs[0]["losses"][name][:3]}
    ours = [(t, b) for r in runs for t, b in zip(r["step_time_s"]["ours-nvme"], r["io_bytes"]["ours-nvme"], strict=True)]
    read_bytes, write_bytes = ours[0][1]
    roofline_s = read_bytes / read_bw + write_bytes / write_bw
    ratios = {"ours-nvme step / I/O roofline (median)": statistics.median(t / roofline_s for t, _ in ours),
              "ours-nvme / ours-cpu step time (median of paired ratios)": statistics.median(
                  a / b for r in runs for a, b in zip(r["step_time_s"]["ours-nvme"], r["step_time_s"]["ours-cpu"],
                                                      strict=True))}
    # On a CPU-only machine compute alone outlasts the I/O, so the step cannot approach the roofline;
    # the time NVMe adds over the same step in host memory (paired steps) is the exposed I/O.
    exposed = [a - b for r in runs for a, b in zip(r["step_time_s"]["ours-nvme"], r["step_time_s"]["ours-cpu"],
                                                    strict=True)]
    ratios["(ours-nvme - ours-cpu) step time / I/O roofline (median of paired differences)"] = (
        statistics.median(exposed) / roofline_s)
    if "deepspeed-nvme" in summary:
        ratios["ours-nvme / deepspeed-nvme step time (median of paired ratios)"] = statistics.median(
            a / b for r in runs for a, b in zip(r["step_time_s"]["ours-nvme"], r["step_time_s"]["deepspeed-nvme"],
                                                strict=True))
    doc = {"benchmark": "full-NVMe training step vs DeepSpeed ZeRO-3 NVMe offload and the I/O roofline",
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}",
           "model": f"{BLOCKS} x (LayerNorm + Linear({HIDDEN},{FFN}) + Linear({FFN},{HIDDEN})), batch {BATCH}x{TOKENS}, "
                    "fp32, AdamW",
           "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
           "probe": {"read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw, "direct": probe_before.direct,
                     "backend": probe_before.backend},
           "ours_nvme_io_bytes_per_step": {"read": read_bytes, "write": write_bytes}, "io_roofline_s": roofline_s,
           "summary": summary, "ratios": ratios,
           "deepspeed_nvme_error": ds_check.get("error")}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc)


def write_results(doc: dict) -> None:
    s = doc["summary"]
    lines = ["## Full-NVMe training step vs DeepSpeed ZeRO-3 NVMe offload and the I/O roofline", "",
             f"`python benchmarks/bench_nvme_step.py --write-results` on {doc['machine']}; model: {doc['model']}; "
             f"{doc['rounds']} rounds x {doc['steps_per_round']} steps after {doc['warmup_steps']} warm-up, systems "
             "alternating step by step in one process.", "",
             f"NVMe probe (same directory, same run, O_DIRECT={doc['probe']['direct']}, backend "
             f"{doc['probe']['backend']}): read {doc['probe']['read_bytes_per_s'] / 1e9:.2f} GB/s, write "
             f"{doc['probe']['write_bytes_per_s'] / 1e9:.2f} GB/s. Our step moves "
             f"{doc['ours_nvme_io_bytes_per_step']['read'] / 1e9:.3f} GB read + "
             f"{doc['ours_nvme_io_bytes_per_step']['write'] / 1e9:.3f} GB written: I/O roofline "
             f"{doc['io_roofline_s']:.3f} s.", "",
             "| system | median step (s) | min step (s) |", "|---|---|---|"]
    lines += [f"| {name} | {v['median_step_time_s']:.3f} | {v['min_step_time_s']:.3f} |" for name, v in s.items()]
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in doc["ratios"].items()]
    lines += ["", "Targets (issue 5): ours-nvme / deepspeed-nvme <= 0.75 and ours-nvme step / I/O roofline <= 1.2. "
              "On this 2-core CPU-only machine the compute of the step alone (ours-cpu) is longer than the I/O "
              "roofline, so the second ratio is bounded below by ours-cpu / roofline; the exposed-I/O row is the "
              "NVMe cost that overlap could still hide. `ours-nvme` and `ours-cpu` losses agree bit for bit "
              "(also pinned by tests/test_nvme_training.py)."]
    if doc.get("deepspeed_nvme_error"):
        lines += ["", "DeepSpeed's NVMe offload did not run on this machine; its error (last lines):", "", "```",
                  *doc["deepspeed_nvme_error"].strip().splitlines()[-12:], "```"]
    results_md.write_section("nvme-step", "\n".join(lines))


if __name__ == "__main__":
    main()
