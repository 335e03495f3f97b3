"""A full-NVMe training step (params, gradients and optimizer states on NVMe): Tierwise vs DeepSpeed
ZeRO-3 with `offload_param` and `offload_optimizer` on NVMe, and vs the step's I/O roofline.

The DESIGN.md model (8 blocks of LayerNorm + Linear(1024, 4096) + Linear(4096, 1024), fp32, AdamW),
the same as benchmarks/bench_runtime.py, at two batch shapes (CONFIGS): `design` (4 x 128 tokens,
DESIGN.md's; on this 2-core CPU-only machine its compute alone outlasts the I/O) and `io-bound`
(1 x 16 tokens: compute is small next to the NVMe traffic, which does not depend on the batch).
All systems of a config live in one process and alternate step by step (the order flips each
iteration), so that noise from other jobs on the machine hits them alike; `ours-cpu` (everything in
host memory) runs alongside as the compute-only reference.

[Note: the I/O roofline]
The roofline is a lower bound on the step time given the bytes the drive must move: our step's
bytes (the runtime's own link counters `nvme_read`, `nvme_write`) at the bandwidth that `planner
probe`'s measurement (`runtime.probe.measure_nvme`) finds on the same directory in the same run.
Whether reads and writes add up or overlap on the drive is measured, not assumed: `measure_mixed`
moves the step's own read:write mix (R read and W written) once concurrently (all requests in
flight together) and once one after the other. The roofline is the faster way the drive moved
those bytes, scaled to the step's bytes: min(R / read_bw + W / write_bw, concurrent-mix time).
On the project VM the two take about as long (within +-15% either way from run to run: reads and
writes share the virtio disk's bandwidth rather than adding up); the JSON records both.

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
from bench_runtime import BATCH, BLOCKS, FFN, HIDDEN, TOKENS, build_model, deepspeed_step, ours_step  # noqa: E402
from bench_runtime import plan_doc as cpu_plan_doc  # noqa: E402

CONFIGS = {"io-bound": (1, 16), "design": (BATCH, TOKENS)}
"""name -> (batch, tokens per sample)."""
OPTIMIZER_CHUNK_BYTES, OPTIMIZER_BUFFERS = 72 * 1024**2, 6
NVME_PLACEMENT = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "activation_checkpoints": "cpu"}


def plan_doc(system: str, nvme_path: str, batch: int, tokens: int) -> dict:
    doc = cpu_plan_doc("cpu")
    doc["model"]["seq_len"] = tokens
    doc["micro_batch_per_gpu"] = batch
    if system == "ours-nvme":
        # Depth 3: parameter shards are read from NVMe three operators ahead; six 72 MiB optimizer
        # buffers (one 4.2 M-element unit per chunk) read four chunks ahead (docs/nvme.md).
        doc.update(placement=NVME_PLACEMENT, nvme_path=nvme_path, prefetch_depth=3,
                   optimizer_chunk_bytes=OPTIMIZER_CHUNK_BYTES, num_optimizer_buffers=OPTIMIZER_BUFFERS)
    return doc


def make_step(system: str, x, y, nvme_path: str):  # noqa: ANN001, ANN201 - torch tensors; returns (step, io_bytes)
    batch, tokens = x.shape[0], x.shape[1]
    model = build_model()
    if system in ("ours-nvme", "ours-cpu"):
        from runtime.sharding import state_of

        step, model = ours_step(model, plan_doc(system, nvme_path, batch, tokens), x, y)
        links = state_of(model).profiler.link_bytes
        return step, lambda: (links.get("nvme_read", 0), links.get("nvme_write", 0))
    if system == "deepspeed-nvme":
        offload = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": False}
        step = deepspeed_step(model, x, y, batch=batch, port="29613",
                              zero_optimization={"stage": 3, "offload_param": offload, "offload_optimizer": dict(offload)},
                              aio={"block_size": 1 << 20, "queue_depth": 16, "thread_count": 4, "single_submit": False,
                                   "overlap_events": True})
        return step, lambda: (0, 0)
    raise SystemExit(f"unknown system {system}")


def worker(systems: list[str], steps: int, warmup: int, nvme_path: str, config: str) -> dict:
    import torch

    batch, tokens = CONFIGS[config]
    torch.manual_seed(1)
    x = torch.randn(batch, tokens, HIDDEN)
    y = torch.randn(batch, tokens, HIDDEN)
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


def measure_mixed(nvme_path: str, read_bytes: int, write_bytes: int, *, repeats: int = 3) -> dict[str, float]:
    """Seconds to move `read_bytes` read and `write_bytes` written (64 MiB requests, O_DIRECT, through
    the engine the runtime uses): all at once (`concurrent_s`) and reads then writes (`serial_s`),
    median of `repeats` (see [Note: the I/O roofline])."""
    from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, SwapDirectory, SwapStore

    chunk = 64 * 1024**2
    num_read, num_write = max(1, round(read_bytes / chunk)), max(1, round(write_bytes / chunk))
    engine = IOEngine(EngineConfig())
    times: dict[str, list[float]] = {"concurrent_s": [], "serial_s": []}
    with SwapDirectory(nvme_path, needed_bytes=(num_read + num_write) * chunk) as directory, \
            SwapStore(directory, "mixed", capacity_bytes=(num_read + num_write) * chunk, engine=engine) as store:
        source, sinks = AlignedBuffer(chunk), [AlignedBuffer(chunk) for _ in range(2)]
        source.view[:] = os.urandom(chunk)
        reads = [store.allocate(chunk) for _ in range(num_read)]
        writes = [store.allocate(chunk) for _ in range(num_write)]
        for extent in reads + writes:  # lay the file out before timing
            store.write_async(extent, source.view).wait()

        def read(i: int):  # noqa: ANN202 - an engine handle
            return store.read_async(reads[i], sinks[i % 2].view)

        def write(i: int):  # noqa: ANN202
            return store.write_async(writes[i], source.view)

        def submit_reads() -> list:  # noqa: ANN202
            return [read(i) for i in range(num_read)]

        def submit_writes() -> list:  # noqa: ANN202
            return [write(i) for i in range(num_write)]

        for _ in range(repeats):
            start = time.perf_counter()
            # Interleaved in the step's proportion, so that both directions are queued the whole time.
            order = sorted([(i / num_read, 0, i) for i in range(num_read)] + [(i / num_write, 1, i) for i in range(num_write)])
            for handle in [write(i) if kind else read(i) for _, kind, i in order]:
                handle.wait()
            times["concurrent_s"].append(time.perf_counter() - start)
            start = time.perf_counter()
            for handle in submit_reads():
                handle.wait()
            for handle in submit_writes():
                handle.wait()
            times["serial_s"].append(time.perf_counter() - start)
        for buffer in (source, *sinks):
            buffer.close()
    moved = {"read_bytes": num_read * chunk, "write_bytes": num_write * chunk}
    return {**moved, **{k: statistics.median(v) for k, v in times.items()}}


def run_worker(systems: str, steps: int, warmup: int, nvme_path: str, config: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--worker", systems, "--steps", str(steps), "--warmup", str(warmup),
                           "--nvme-path", nvme_path, "--config", config], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=3000)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summarise(runs: list[dict], systems: list[str], roofline_s: float) -> tuple[dict, dict]:
    summary: dict[str, dict] = {}
    for name in systems:
        times = [t for r in runs for t in r["step_time_s"][name]]
        summary[name] = {"median_step_time_s": statistics.median(times), "min_step_time_s": min(times),
                         "step_times_s": times, "first_losses": runs[0]["losses"][name][:3]}

    def paired(a: str, b: str) -> list[float]:
        return [x / y for r in runs for x, y in zip(r["step_time_s"][a], r["step_time_s"][b], strict=True)]

    ours = [t for r in runs for t in r["step_time_s"]["ours-nvme"]]
    ratios = {"ours-nvme step / I/O roofline (median)": statistics.median(t / roofline_s for t in ours),
              "ours-nvme step / I/O roofline (best step)": min(ours) / roofline_s,
              "ours-cpu step (compute alone) / I/O roofline (median)": statistics.median(
                  summary["ours-cpu"]["step_times_s"]) / roofline_s,
              "ours-nvme / ours-cpu step time (median of paired ratios)": statistics.median(paired("ours-nvme", "ours-cpu"))}
    if "deepspeed-nvme" in summary:
        ratios["ours-nvme / deepspeed-nvme step time (median of paired ratios)"] = statistics.median(
            paired("ours-nvme", "deepspeed-nvme"))
    return summary, ratios


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--config", default="io-bound", choices=list(CONFIGS))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker.split(","), args.steps, args.warmup, args.nvme_path, args.config)))
        return
    from runtime.probe import measure_nvme

    configs = args.configs.split(",")
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme_path:
        probe_before = measure_nvme(nvme_path)
        # DeepSpeed's NVMe path needs its async_io op (JIT-built against libaio): try it alone first.
        ds_check = run_worker("deepspeed-nvme", 1, 0, nvme_path, configs[0])
        systems = ["ours-nvme", "ours-cpu"] + ([] if "error" in ds_check else ["deepspeed-nvme"])
        runs = {c: [run_worker(",".join(systems), args.steps, args.warmup, nvme_path, c) for _ in range(args.rounds)]
                for c in configs}
        for config_runs in runs.values():
            for run in config_runs:
                if "error" in run:
                    raise SystemExit(f"{systems} failed:\n{run['error']}")
        # The step's bytes do not depend on the batch: one mix for every config.
        read_bytes, write_bytes = runs[configs[0]][0]["io_bytes"]["ours-nvme"][0]
        mixed = measure_mixed(nvme_path, read_bytes, write_bytes)
        probe_after = measure_nvme(nvme_path)
    read_bw = statistics.median([probe_before.read_bytes_per_s, probe_after.read_bytes_per_s])
    write_bw = statistics.median([probe_before.write_bytes_per_s, probe_after.write_bytes_per_s])
    serial_roofline_s = read_bytes / read_bw + write_bytes / write_bw
    # The mix moved whole 64 MiB requests: scale its time to the step's bytes.
    mix_scale = (read_bytes + write_bytes) / (mixed["read_bytes"] + mixed["write_bytes"])
    concurrent_roofline_s = mixed["concurrent_s"] * mix_scale
    roofline_s = min(serial_roofline_s, concurrent_roofline_s)
    results = {}
    for c in configs:
        summary, ratios = summarise(runs[c], systems, roofline_s)
        batch, tokens = CONFIGS[c]
        results[c] = {"batch": batch, "tokens": tokens, "summary": summary, "ratios": ratios,
                      "io_bytes_per_step": sorted({tuple(b) for r in runs[c] for b in r["io_bytes"]["ours-nvme"]})}
    doc = {"benchmark": "full-NVMe training step vs DeepSpeed ZeRO-3 NVMe offload and the I/O roofline",
           "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, load avg {os.getloadavg()[0]:.1f}",
           "model": f"{BLOCKS} x (LayerNorm + Linear({HIDDEN},{FFN}) + Linear({FFN},{HIDDEN})), fp32, AdamW",
           "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup,
           "probe": {"read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw, "direct": probe_before.direct,
                     "backend": probe_before.backend},
           "mixed_probe": mixed,
           "ours_nvme_io_bytes_per_step": {"read": read_bytes, "write": write_bytes},
           "io_roofline_s": roofline_s, "serial_roofline_s": serial_roofline_s,
           "concurrent_roofline_s": concurrent_roofline_s,
           "configs": results, "deepspeed_nvme_error": ds_check.get("error")}
    print(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc)


def write_results(doc: dict) -> None:
    probe, mixed = doc["probe"], doc["mixed_probe"]
    lines = ["## Full-NVMe training step vs DeepSpeed ZeRO-3 NVMe offload and the I/O roofline", "",
             f"`python benchmarks/bench_nvme_step.py --write-results` on {doc['machine']}; model: {doc['model']}; "
             f"{doc['rounds']} rounds x {doc['steps_per_round']} steps after {doc['warmup_steps']} warm-up per "
             "config, systems alternating step by step in one process. Ours runs at prefetch depth 3 with six "
             "72 MiB optimizer buffers (docs/nvme.md, [Note: NVMe step schedule]).", "",
             f"NVMe probe (same directory, same run, O_DIRECT={probe['direct']}, backend {probe['backend']}): "
             f"read {probe['read_bytes_per_s'] / 1e9:.2f} GB/s, write {probe['write_bytes_per_s'] / 1e9:.2f} GB/s. "
             f"Our step moves {doc['ours_nvme_io_bytes_per_step']['read'] / 1e9:.3f} GB read + "
             f"{doc['ours_nvme_io_bytes_per_step']['write'] / 1e9:.3f} GB written (whatever the batch). "
             f"The same mix ({mixed['read_bytes'] / 1e9:.2f} GB read, {mixed['write_bytes'] / 1e9:.2f} GB written) "
             f"took {mixed['concurrent_s']:.3f} s with reads and writes in flight together and "
             f"{mixed['serial_s']:.3f} s one after the other, so the roofline is "
             + ("the serial sum read/read_bw + write/write_bw" if doc["io_roofline_s"] == doc["serial_roofline_s"]
                else "the concurrent mix's time scaled to the step's bytes")
             + f" (the faster of the two): {doc['io_roofline_s']:.3f} s "
             f"(serial {doc['serial_roofline_s']:.3f} s, concurrent {doc['concurrent_roofline_s']:.3f} s).", ""]
    for name, r in doc["configs"].items():
        lines += [f"**{name}** (batch {r['batch']} x {r['tokens']} tokens):", "",
                  "| system | median step (s) | min step (s) |", "|---|---|---|"]
        lines += [f"| {sys_} | {v['median_step_time_s']:.3f} | {v['min_step_time_s']:.3f} |"
                  for sys_, v in r["summary"].items()]
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in r["ratios"].items()]
        lines += [""]
    lines += ["Targets (issue 5): ours-nvme / deepspeed-nvme <= 0.75 and ours-nvme step / I/O roofline <= 1.2. "
              "The roofline ratio is meaningful on the io-bound config; on the design config the compute of the "
              "step alone (ours-cpu) is longer than the roofline on this 2-core CPU-only machine, which bounds the "
              "ratio from below (the compute-alone row). `ours-nvme` and `ours-cpu` losses agree bit for bit "
              "(also pinned by tests/test_nvme_training.py)."]
    if doc.get("deepspeed_nvme_error"):
        lines += ["", "DeepSpeed's NVMe offload did not run on this machine; its error (last lines):", "", "```",
                  *doc["deepspeed_nvme_error"].strip().splitlines()[-12:], "```"]
    results_md.write_section("nvme-step", "\n".join(lines))


if __name__ == "__main__":
    main()
