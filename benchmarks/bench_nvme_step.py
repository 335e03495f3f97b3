"""A full-NVMe training step (params, gradients and optimizer states on NVMe): Tierwise vs DeepSpeed
ZeRO-3 with `offload_param` and `offload_optimizer` on NVMe, and vs the step's I/O roofline.

The reference MLP (8 blocks of LayerNorm + Linear(1024, 4096) + Linear(4096, 1024), fp32, AdamW),
the same as benchmarks/bench_runtime.py, at two batch shapes (CONFIGS): `design` (4 x 128 tokens,
bench_runtime.py's; on a machine whose CPU computes the step, its compute alone can outlast the
I/O) and `io-bound` (1 x 16 tokens: compute is small next to the NVMe traffic, which does not
depend on the batch). All systems of a config live in one process and alternate step by step (the
order flips each iteration), so that noise from other processes on the machine hits them alike;
`ours-cpu` (everything in host memory) runs alongside as the compute-only reference. The roofline
is the bytes the drive must move at the rate it delivers them next to each step ([Note: the I/O
roofline], above `MixProbe`); each system is timed in blocks of steps ([Note: blocks of steps],
above `make_step`).

    python benchmarks/bench_nvme_step.py --nvme-path DIR --rounds 2 --steps 3 --warmup 1 [--block 3] [--write-results]
        [--ds-queue-depths 16,64,128 --ds-threads 1,4,8 --sweep-steps 2] [--device cuda] [--json-out FILE]

DeepSpeed runs at its best (`deepspeed_nvme_config`): DeepSpeedCPUAdam, pipelined optimizer swapping,
and the aio setting that was fastest in a sweep run first (`deepspeed_sweep`, DS_QUEUE_DEPTHS x
DS_THREADS), whose every point the JSON and the RESULTS section report.
"""

from __future__ import annotations

import argparse
import json
import os
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

from planner.calibration.phase_budget import phase_budget  # noqa: E402

CONFIGS = {"io-bound": (1, 16), "design": (BATCH, TOKENS)}
"""name -> (batch, tokens per sample)."""
OPTIMIZER_CHUNK_BYTES, OPTIMIZER_BUFFERS = 72 * 1024**2, 6
NVME_SYSTEMS = {"ours-nvme": "after_backward", "ours-nvme-ib": "in_backward"}
"""Our systems with everything on NVMe -> the plan's `optimizer_step` ([Note: the optimizer step in
backward] in runtime/optim/streamed_optimizer.py)."""
NVME_PLACEMENT = {"params": "nvme", "gradients": "nvme", "optimizer_states": "nvme", "recompute_inputs": "cpu"}


DS_QUEUE_DEPTHS, DS_THREADS = (16, 64, 128), (1, 4, 8)
"""DeepSpeed's aio settings swept (queue depth x `intra_op_parallelism`, its I/O threads per
request; 0.19.8 reads no `thread_count` key, so the benchmark does not set one):
the headline run uses the setting whose DeepSpeed step was fastest. Ours runs at its defaults
(`EngineConfig`: queue depth 128, the depth benchmarks/aio_vs_fio.py's sweep supports)."""
GPU_HARDWARE = "h200-x1"
"""The hardware preset of plans on a GPU (one GPU, 16 cores: the machines the GPU kit runs on)."""


def plan_doc(system: str, nvme_path: str, batch: int, tokens: int, device: str = "cpu") -> dict:
    doc = cpu_plan_doc("cpu", "cpu-dev-2core" if device == "cpu" else GPU_HARDWARE)
    doc["model"]["seq_len"] = tokens
    doc["micro_batch_per_gpu"] = batch
    if system in NVME_SYSTEMS:
        doc["optimizer_step"] = NVME_SYSTEMS[system]
        # Depth 3: parameter shards are read from NVMe three operators ahead; six 72 MiB optimizer
        # buffers (one 4.2 M-element unit per chunk) read four chunks ahead (docs/nvme.md).
        doc.update(placement=NVME_PLACEMENT, nvme_path=nvme_path, prefetch_depth=3,
                   optimizer_chunk_bytes=OPTIMIZER_CHUNK_BYTES, num_optimizer_buffers=OPTIMIZER_BUFFERS)
    return doc


def deepspeed_nvme_config(nvme_path: str, queue_depth: int, threads: int, device: str) -> dict:
    """DeepSpeed ZeRO-3 with params and optimizer states on NVMe, at its best: DeepSpeedCPUAdam
    (bench_runtime.DEEPSPEED_OPTIMIZER), optimizer swapping pipelined both ways (`pipeline_read`,
    `pipeline_write`), the given aio queue depth and threads, pinned buffers where there is a GPU."""
    offload = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": device != "cpu"}
    return {"zero_optimization": {"stage": 3, "offload_param": offload,
                                  "offload_optimizer": {**offload, "pipeline_read": True, "pipeline_write": True}},
            "aio": {"block_size": 1 << 20, "queue_depth": queue_depth, "intra_op_parallelism": threads,
                    "single_submit": False, "overlap_events": True}}


# [Note: blocks of steps] A step of ours can leave I/O in flight when it returns (the step's writes,
# or reads submitted ahead for the next step, which in training overlap the next forward). Timed
# alone, such I/O would run on while another system (or a probe) is timed: part of our I/O unpaid.
# Each system therefore runs `--block` consecutive steps (3) as one timed call, which for ours ends by
# waiting for every transfer still in flight (`ShardedModel.wait_io`); the per-step time, bytes and
# phases are the block's divided by its steps.
# A roofline probe sits next to each block, as above, sized to one step's bytes.
#
# Whole-run form (kept for comparison with earlier results): `planner probe`'s measurement
# (`runtime.probe.measure_nvme`, 1 GiB written and read 3 times) before and after the whole run, the
# median of the two, and one `measure_mixed` after the run; every step is divided by that one roofline.
# Whether reads and writes in flight together add up or share the drive's bandwidth is the drive's
# (docs/notes/2026-11-22-nvme-step-roofline.md); the JSON records both forms.
#
#     python benchmarks/bench_nvme_step.py --nvme-path DIR --rounds 2 --steps 3 --warmup 1 [--block 3] [--write-results]
#         [--ds-queue-depths 16,64,128 --ds-threads 1,4,8 --sweep-steps 2] [--device cuda] [--json-out FILE]
#
# DeepSpeed runs at its best (`deepspeed_nvme_config`): DeepSpeedCPUAdam, pipelined optimizer swapping,
# and the aio setting that was fastest in a sweep run first (`deepspeed_sweep`, DS_QUEUE_DEPTHS x
# DS_THREADS), whose every point the JSON and the RESULTS section report.
def make_step(system: str, x, y, nvme_path: str, block: int, ds_aio: tuple[int, int] = (128, 8)):  # noqa: ANN001, ANN201 - torch tensors; returns (steps, io_bytes, phases)
    """`block` consecutive training steps of `system` as one call, ending when all their I/O did
    (see [Note: blocks of steps]); also functions returning the link byte counters and the phase
    times of the block's steps. `ds_aio`: DeepSpeed's (queue depth, threads)."""
    batch, tokens = x.shape[0], x.shape[1]
    device = x.device.type
    model = build_model()
    if system in (*NVME_SYSTEMS, "ours-cpu"):
        from runtime.sharding import state_of

        step, model = ours_step(model, plan_doc(system, nvme_path, batch, tokens, device), x, y)
        state = state_of(model)
        profiler, links = state.profiler, state.profiler.link_bytes

        def steps() -> float:
            losses = [step() for _ in range(block)]
            state.wait_io()  # the optimizer's read-ahead for the next step belongs to this block
            return losses[0]

        return (steps, lambda: (links.get("nvme_read", 0), links.get("nvme_write", 0)),
                lambda: [dict(s.phase_time_s) for s in list(profiler.samples)[-block:]])
    if system == "deepspeed-nvme":
        if device != "cpu":
            model = model.to(device)
        # Its own swap folder per setting: a sweep's engines never share swap files.
        ds_path = os.path.join(nvme_path, f"deepspeed-qd{ds_aio[0]}-t{ds_aio[1]}")
        os.makedirs(ds_path, exist_ok=True)
        step = deepspeed_step(model, x, y, batch=batch, port="29613", device=device,
                              **deepspeed_nvme_config(ds_path, *ds_aio, device))

        def ds_steps() -> float:
            return [step() for _ in range(block)][0]

        ds_steps.optimizer = step.optimizer
        return ds_steps, lambda: (0, 0), list
    raise SystemExit(f"unknown system {system}")


def worker(systems: list[str], steps: int, warmup: int, nvme_path: str, config: str, block: int,
           ds_aio: tuple[int, int] = (128, 8), device: str = "cpu") -> dict:
    """`warmup + steps` rounds; in each, every system runs one block of `block` steps (times, bytes
    and phases are reported per step: the block's divided by `block`)."""
    import torch

    from runtime.host_malloc import keep_freed_memory_mapped

    # As `planner run` does for a rank; process-wide, so DeepSpeed's steps in this process get it too.
    keep_freed_memory_mapped()
    batch, tokens = CONFIGS[config]
    torch.manual_seed(1)
    x = torch.randn(batch, tokens, HIDDEN).to(device)
    y = torch.randn(batch, tokens, HIDDEN).to(device)
    steppers = {name: make_step(name, x, y, nvme_path, block, ds_aio) for name in systems}
    optimizers = {name: getattr(stepper[0], "optimizer", None) for name, stepper in steppers.items()}
    nvme_systems = [n for n in systems if n in NVME_SYSTEMS]
    times: dict[str, list[float]] = {n: [] for n in systems}
    io: dict[str, list[list[int]]] = {n: [] for n in systems}
    losses: dict[str, list[float]] = {n: [] for n in systems}
    phases: dict[str, list[dict[str, float]]] = {n: [] for n in nvme_systems}
    adjacent: dict[str, list[dict[str, float]]] = {n: [] for n in nvme_systems}
    probes: dict[str, MixProbe] = {}
    # Each of our NVMe systems has its adjacent roofline probe (of its own mix) right next to every
    # measured block: before it in even iterations, after it in odd ones (the order of the systems
    # flips each iteration).
    order = [entry for n in systems for entry in ([f"roofline:{n}", n] if n in NVME_SYSTEMS else [n])]
    for i in range(warmup + steps):
        measured = i >= warmup
        for name in order if i % 2 == 0 else reversed(order):
            if name.startswith("roofline:"):
                of = name.partition(":")[2]
                if measured and of in probes:
                    adjacent[of].append(probes[of].time())
                continue
            step, io_bytes, last_phases = steppers[name]
            before = io_bytes()
            start = time.perf_counter()
            losses[name].append(step())
            elapsed = (time.perf_counter() - start) / block
            after = io_bytes()
            moved = [(after[0] - before[0]) // block, (after[1] - before[1]) // block]
            if name in NVME_SYSTEMS:
                if name not in probes:  # the step's bytes are known after its first (warm-up) block
                    probes[name] = MixProbe(nvme_path, *moved)
                    if measured:
                        adjacent[name].append(probes[name].time())
                if measured:
                    block_phases = last_phases()
                    phases[name].append({p: statistics.fmean(b[p] for b in block_phases) for p in block_phases[0]})
            if measured:
                times[name].append(elapsed)
                io[name].append(moved)
    out = {"step_time_s": times, "io_bytes": io, "losses": losses, "phase_time_s": phases, "adjacent_rooflines": {},
           "optimizers": optimizers}
    for name, probe in probes.items():
        out["adjacent_rooflines"][name] = [probe.roofline_s(*moved, m) | m
                                           for moved, m in zip(io[name], adjacent[name], strict=True)]
        probe.close()
    return out


# [Note: the I/O roofline] The roofline is a lower bound on the step time given the bytes the drive
# must move: our step's bytes (the runtime's own link counters `nvme_read`, `nvme_write`) at the bandwidth the drive
# delivers through the same engine on the same directory. Whether reads and writes add up or overlap
# on the drive is measured, not assumed: `MixProbe` moves the step's own read:write mix (R read and W
# written, 64 MiB requests) once concurrently (all requests in flight together) and once one after
# the other (reads, then writes, each timed). The roofline is the faster way the drive moved those
# bytes, scaled to the step's bytes: min(R / read_bw + W / write_bw, concurrent-mix time).
#
# Adjacent form (the headline ratio). A drive's bandwidth can drift within minutes (a shared virtual
# disk, docs/notes/2026-11-22-nvme-step-roofline.md), so a bandwidth probed minutes away from a step
# says little about that step. Each measured ours-nvme step therefore gets
# its own probe of the step's mix, run right next to it in the same process: before the step in even
# iterations and after it in odd ones (the systems' order flips each iteration, and the probe sits
# next to ours-nvme in that order). The ratio is per step (step time / its adjacent roofline); the
# JSON reports their median and spread (min, quartiles, max) over every measured step, none dropped.
# The probe also gives each step's read and write bandwidth, against which each phase of the step is
# compared with the ideal disk time of its bytes (`phase_budget`).
class MixProbe:
    """Moves a given number of bytes read and written through the engine the runtime uses (64 MiB
    requests, O_DIRECT, `EngineConfig()`: the plan's block size and queue depth) on a file laid out
    once in `nvme_path`; `time()` is one measurement of both forms of [Note: the I/O roofline]."""

    CHUNK_BYTES = 64 * 1024**2

    def __init__(self, nvme_path: str, read_bytes: int, write_bytes: int) -> None:
        from runtime.nvme import AlignedBuffer, EngineConfig, IOEngine, SwapDirectory, SwapStore

        chunk = self.CHUNK_BYTES
        self.num_read, self.num_write = max(1, round(read_bytes / chunk)), max(1, round(write_bytes / chunk))
        self.read_bytes, self.write_bytes = self.num_read * chunk, self.num_write * chunk
        needed = self.read_bytes + self.write_bytes
        self._directory = SwapDirectory(nvme_path, needed_bytes=needed)
        self._store = SwapStore(self._directory, "mixed", capacity_bytes=needed, engine=IOEngine(EngineConfig()))
        self._source, self._sinks = AlignedBuffer(chunk), [AlignedBuffer(chunk) for _ in range(2)]
        self._source.view[:] = os.urandom(chunk)
        self._reads = [self._store.allocate(chunk) for _ in range(self.num_read)]
        self._writes = [self._store.allocate(chunk) for _ in range(self.num_write)]
        for extent in self._reads + self._writes:  # lay the file out before timing
            self._store.write_async(extent, self._source.view).wait()

    def _read(self, i: int):  # noqa: ANN202 - an engine handle
        return self._store.read_async(self._reads[i], self._sinks[i % 2].view)

    def _write(self, i: int):  # noqa: ANN202
        return self._store.write_async(self._writes[i], self._source.view)

    def time(self) -> dict[str, float]:
        """Seconds for all reads and writes in flight together (`concurrent_s`), and for the reads
        alone then the writes alone (`read_s`, `write_s`; `serial_s` is their sum)."""
        start = time.perf_counter()
        # Interleaved in the step's proportion, so that both directions are queued the whole time.
        order = sorted([(i / self.num_read, 0, i) for i in range(self.num_read)]
                       + [(i / self.num_write, 1, i) for i in range(self.num_write)])
        for handle in [self._write(i) if kind else self._read(i) for _, kind, i in order]:
            handle.wait()
        concurrent_s = time.perf_counter() - start
        start = time.perf_counter()
        for handle in [self._read(i) for i in range(self.num_read)]:
            handle.wait()
        read_s = time.perf_counter() - start
        start = time.perf_counter()
        for handle in [self._write(i) for i in range(self.num_write)]:
            handle.wait()
        write_s = time.perf_counter() - start
        return {"concurrent_s": concurrent_s, "read_s": read_s, "write_s": write_s, "serial_s": read_s + write_s}

    def roofline_s(self, read_bytes: int, write_bytes: int, measured: dict[str, float]) -> dict[str, float]:
        """The roofline of a step moving `read_bytes` and `write_bytes`, from one `time()`: the faster of
        the serial sum at the measured read and write bandwidths and the concurrent mix scaled to the
        step's bytes; also the bandwidths, for per-phase ideal times."""
        read_bw, write_bw = self.read_bytes / measured["read_s"], self.write_bytes / measured["write_s"]
        serial_s = read_bytes / read_bw + write_bytes / write_bw
        concurrent_s = measured["concurrent_s"] * (read_bytes + write_bytes) / (self.read_bytes + self.write_bytes)
        return {"roofline_s": min(serial_s, concurrent_s), "serial_roofline_s": serial_s,
                "concurrent_roofline_s": concurrent_s, "read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw}

    def close(self) -> None:
        for buffer in (self._source, *self._sinks):
            buffer.close()
        self._store.close()
        self._directory.close()


def measure_mixed(nvme_path: str, read_bytes: int, write_bytes: int, *, repeats: int = 3) -> dict[str, float]:
    """Seconds to move `read_bytes` read and `write_bytes` written: all at once (`concurrent_s`) and
    reads then writes (`serial_s`), median of `repeats` (the whole-run form of [Note: the I/O roofline])."""
    probe = MixProbe(nvme_path, read_bytes, write_bytes)
    try:
        times = [probe.time() for _ in range(repeats)]
    finally:
        probe.close()
    moved = {"read_bytes": probe.read_bytes, "write_bytes": probe.write_bytes}
    return {**moved, **{k: statistics.median(t[k] for t in times) for k in ("concurrent_s", "serial_s")}}


def run_worker(systems: str, steps: int, warmup: int, nvme_path: str, config: str, block: int,
               ds_aio: tuple[int, int] = (128, 8), device: str = "cpu") -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__, "--worker", systems, "--steps", str(steps), "--warmup", str(warmup),
                           "--nvme-path", nvme_path, "--config", config, "--block", str(block),
                           "--ds-aio", f"{ds_aio[0]},{ds_aio[1]}", "--device", device], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=3000)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-4000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    quart = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return {"median": statistics.median(ordered), "min": ordered[0], "q1": quart[0], "q3": quart[2], "max": ordered[-1]}


def summarise(runs: list[dict], systems: list[str], roofline_s: dict[str, float]) -> tuple[dict, dict, dict]:
    """Per-system step times, the ratios (per NVMe system of ours: to its adjacent and whole-run
    rooflines, to the compute alone and to DeepSpeed), and each NVMe system's per-step spread and
    phase budget."""
    summary: dict[str, dict] = {}
    for name in systems:
        times = [t for r in runs for t in r["step_time_s"][name]]
        summary[name] = {"median_step_time_s": statistics.median(times), "min_step_time_s": min(times),
                         "step_times_s": times, "first_losses": runs[0]["losses"][name][:3]}

    def paired(a: str, b: str) -> list[float]:
        return [x / y for r in runs for x, y in zip(r["step_time_s"][a], r["step_time_s"][b], strict=True)]

    ratios: dict[str, float] = {}
    per_step: dict[str, dict] = {}
    for name in (n for n in systems if n in NVME_SYSTEMS):
        ours = summary[name]["step_times_s"]
        adjacent = [t / a["roofline_s"] for r in runs
                    for t, a in zip(r["step_time_s"][name], r["adjacent_rooflines"][name], strict=True)]
        ratios |= {f"{name} step / adjacent I/O roofline (median of per-step ratios)": statistics.median(adjacent),
                   f"{name} step / whole-run I/O roofline (median)": statistics.median(t / roofline_s[name] for t in ours),
                   f"{name} step / whole-run I/O roofline (best step)": min(ours) / roofline_s[name],
                   f"ours-cpu step (compute alone) / {name}'s whole-run I/O roofline (median)": statistics.median(
                       summary["ours-cpu"]["step_times_s"]) / roofline_s[name],
                   f"{name} / ours-cpu step time (median of paired ratios)": statistics.median(paired(name, "ours-cpu"))}
        if "deepspeed-nvme" in summary:
            ratios[f"{name} / deepspeed-nvme step time (median of paired ratios)"] = statistics.median(
                paired(name, "deepspeed-nvme"))
        per_step[name] = {
            "step_over_adjacent_roofline": adjacent, "spread": spread(adjacent),
            "adjacent_roofline_s": [a["roofline_s"] for r in runs for a in r["adjacent_rooflines"][name]],
            "adjacent_read_gb_per_s": [a["read_bytes_per_s"] / 1e9 for r in runs for a in r["adjacent_rooflines"][name]],
            "adjacent_write_gb_per_s": [a["write_bytes_per_s"] / 1e9 for r in runs for a in r["adjacent_rooflines"][name]],
            "phases": phase_budget(runs, name, NVME_SYSTEMS[name])}
    if "ours-nvme" in summary and "ours-nvme-ib" in summary:
        ratios["ours-nvme-ib / ours-nvme step time (median of paired ratios)"] = statistics.median(
            paired("ours-nvme-ib", "ours-nvme"))
    return summary, ratios, per_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--config", default="io-bound", choices=list(CONFIGS))
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ",".join(CONFIGS))
    ap.add_argument("--nvme-path", default=None)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block", type=int, default=3, help="consecutive steps timed as one ([Note: blocks of steps])")
    ap.add_argument("--systems", default=",".join(NVME_SYSTEMS),
                    help="our NVMe systems to measure: comma-separated subset of " + ",".join(NVME_SYSTEMS))
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="compute device (cuda: the GPU kit)")
    ap.add_argument("--ds-queue-depths", default=",".join(map(str, DS_QUEUE_DEPTHS)),
                    help="DeepSpeed aio queue depths swept")
    ap.add_argument("--ds-threads", default=",".join(map(str, DS_THREADS)),
                    help="DeepSpeed aio intra_op_parallelism values swept")
    ap.add_argument("--sweep-steps", type=int, default=2, help="measured blocks per DeepSpeed setting in the sweep")
    ap.add_argument("--ds-aio", default="128,8", help=argparse.SUPPRESS)  # a worker's DeepSpeed setting
    ap.add_argument("--json-out", type=Path, help="also write the JSON document here")
    ap.add_argument("--write-results", action="store_true")
    args = ap.parse_args()
    if args.worker:
        ds_aio = tuple(int(v) for v in args.ds_aio.split(","))
        print(json.dumps(worker(args.worker.split(","), args.steps, args.warmup, args.nvme_path, args.config,
                                args.block, ds_aio, args.device)))
        return
    from runtime.probe import measure_nvme

    configs = args.configs.split(",")
    nvme_systems = [n for n in args.systems.split(",") if n]
    unknown = sorted(set(nvme_systems) - set(NVME_SYSTEMS))
    if unknown or not nvme_systems:
        raise SystemExit(f"--systems takes a comma-separated subset of {','.join(NVME_SYSTEMS)}, not {args.systems!r}")
    settings = [(int(q), int(t)) for q in args.ds_queue_depths.split(",") for t in args.ds_threads.split(",")]
    machine = results_md.measure_machine(torch=True, versions=("deepspeed",), disk=args.nvme_path or tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme_path:
        probe_before = measure_nvme(nvme_path)
        sweep = deepspeed_sweep(settings, nvme_path, configs[0], args)
        best = min((s for s in sweep if "error" not in s), key=lambda s: s["deepspeed_median_step_time_s"], default=None)
        ds_error = None if best else sweep[0]["error"]
        ds_aio = (best["queue_depth"], best["threads"]) if best else settings[0]
        systems = [*nvme_systems, "ours-cpu"] + (["deepspeed-nvme"] if best else [])
        runs = {c: [run_worker(",".join(systems), args.steps, args.warmup, nvme_path, c, args.block, ds_aio, args.device)
                    for _ in range(args.rounds)]
                for c in configs}
        for config_runs in runs.values():
            for run in config_runs:
                if "error" in run:
                    raise SystemExit(f"{systems} failed:\n{run['error']}")
        # A step's bytes do not depend on the batch: one mix per system for every config.
        step_bytes = {n: runs[configs[0]][0]["io_bytes"][n][0] for n in nvme_systems}
        mixed = {n: measure_mixed(nvme_path, *step_bytes[n]) for n in nvme_systems}
        probe_after = measure_nvme(nvme_path)
    read_bw = statistics.median([probe_before.read_bytes_per_s, probe_after.read_bytes_per_s])
    write_bw = statistics.median([probe_before.write_bytes_per_s, probe_after.write_bytes_per_s])
    rooflines = {}
    for n, (read_bytes, write_bytes) in step_bytes.items():
        serial_s = read_bytes / read_bw + write_bytes / write_bw
        # The mix moved whole 64 MiB requests: scale its time to the step's bytes.
        mix_scale = (read_bytes + write_bytes) / (mixed[n]["read_bytes"] + mixed[n]["write_bytes"])
        concurrent_s = mixed[n]["concurrent_s"] * mix_scale
        rooflines[n] = {"read_bytes": read_bytes, "write_bytes": write_bytes, "io_roofline_s": min(serial_s, concurrent_s),
                        "serial_roofline_s": serial_s, "concurrent_roofline_s": concurrent_s, "mixed_probe": mixed[n]}
    results = {}
    for c in configs:
        summary, ratios, per_step = summarise(runs[c], systems, {n: r["io_roofline_s"] for n, r in rooflines.items()})
        batch, tokens = CONFIGS[c]
        results[c] = {"batch": batch, "tokens": tokens, "summary": summary, "ratios": ratios, "adjacent": per_step,
                      "io_bytes_per_step": {n: sorted({tuple(b) for r in runs[c] for b in r["io_bytes"][n]})
                                            for n in nvme_systems}}
    doc = {"benchmark": "full-NVMe training step vs DeepSpeed ZeRO-3 NVMe offload and the I/O roofline",
           "machine": machine.finish().to_dict(),
           "model": f"{BLOCKS} x (LayerNorm + Linear({HIDDEN},{FFN}) + Linear({FFN},{HIDDEN})), fp32, AdamW",
           "rounds": args.rounds, "steps_per_round": args.steps, "warmup_steps": args.warmup, "block": args.block,
           "probe": {"read_bytes_per_s": read_bw, "write_bytes_per_s": write_bw, "direct": probe_before.direct,
                     "backend": probe_before.backend},
           "rooflines": rooflines, "configs": results, "deepspeed_nvme_error": ds_error, "device": args.device,
           "deepspeed": {"config": deepspeed_nvme_config("NVME_PATH", *ds_aio, args.device),
                         "optimizer": runs[configs[0]][0]["optimizers"].get("deepspeed-nvme"),
                         "best": best, "sweep": sweep, "sweep_config": configs[0], "sweep_blocks": args.sweep_steps}}
    print(json.dumps(doc, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2))
    if args.write_results:
        write_results(doc, machine)


def deepspeed_sweep(settings: list[tuple[int, int]], nvme_path: str, config: str, args: argparse.Namespace) -> list[dict]:
    """DeepSpeed's step at each aio (queue depth, threads) setting, each in its own process next to
    ours-nvme (alternating blocks, as in the headline run): its median step time and ours / its."""
    out = []
    for queue_depth, threads in settings:
        run = run_worker("ours-nvme,deepspeed-nvme", args.sweep_steps, 1, nvme_path, config, args.block,
                         (queue_depth, threads), args.device)
        entry: dict = {"queue_depth": queue_depth, "threads": threads}
        if "error" in run:
            out.append(entry | {"error": run["error"]})
            continue
        ours, theirs = run["step_time_s"]["ours-nvme"], run["step_time_s"]["deepspeed-nvme"]
        out.append(entry | {"deepspeed_median_step_time_s": statistics.median(theirs),
                            "deepspeed_step_times_s": theirs, "ours_median_step_time_s": statistics.median(ours),
                            "ours/deepspeed (median of paired ratios)": statistics.median(
                                a / b for a, b in zip(ours, theirs, strict=True)),
                            "optimizer": run["optimizers"].get("deepspeed-nvme")})
    return out


def _compute_bound(doc: dict) -> str:
    """Which configs' compute alone (ours-cpu) outlasts the first NVMe system's whole-run roofline here."""
    roofline = next(iter(doc["rooflines"].values()))["io_roofline_s"]
    over = {name: r["summary"]["ours-cpu"]["median_step_time_s"] / roofline for name, r in doc["configs"].items()}
    longer = [f"{name} ({x:.2f}x)" for name, x in over.items() if x > 1]
    if not longer:
        return ("On every config here the compute of the step alone (ours-cpu) is shorter than the roofline, so the "
                "roofline ratio measures the I/O schedule.")
    return ("On the " + ", ".join(longer) + " config here the compute of the step alone (ours-cpu) is longer than "
            "the roofline, which bounds the ratio from below (the compute-alone rows); the roofline ratio is "
            "meaningful where it is shorter.")


def write_results(doc: dict, machine: results_md.MachineFacts) -> None:
    probe = doc["probe"]
    lines = ["## Full-NVMe training step vs DeepSpeed ZeRO-3 NVMe offload and the I/O roofline", "",
             f"`python benchmarks/bench_nvme_step.py --write-results`. {machine.describe()} "
             f"Model: {doc['model']}; "
             f"{doc['rounds']} rounds x {doc['steps_per_round']} blocks of {doc['block']} consecutive steps after "
             f"{doc['warmup_steps']} warm-up block per config, systems alternating block by block in one process; "
             "ours' block ends when all its I/O did ([Note: blocks of steps]), and each figure is per step (the "
             "block's divided by its steps). Ours runs at prefetch depth 3 with six 72 MiB optimizer buffers "
             "(docs/nvme.md, [Note: NVMe step schedule]): `ours-nvme` steps the optimizer after backward (the "
             "paper's schedule), `ours-nvme-ib` updates each unit in backward as soon as its gradient is final "
             "(plan `optimizer_step: in_backward`, [Note: the optimizer step in backward] in "
             "runtime/optim/streamed_optimizer.py; exact for this loop: one backward per step, no clipping).", "",
             "**Adjacent roofline** (the headline, [Note: the I/O roofline] in the script): every measured block "
             "of ours is paired with a probe of its own step's read/write mix through the same engine, run right "
             "before or right after it (alternating), and divided by it. **Whole-run roofline** (the earlier form): "
             f"NVMe probe before and after the run (same directory, O_DIRECT={probe['direct']}, backend "
             f"{probe['backend']}): read {probe['read_bytes_per_s'] / 1e9:.2f} GB/s, write "
             f"{probe['write_bytes_per_s'] / 1e9:.2f} GB/s, and one probe of each step's mix after the run; the "
             "roofline is the faster of the serial sum read/read_bw + write/write_bw and the mix's time:", ""]
    for name, r in doc["rooflines"].items():
        mixed = r["mixed_probe"]
        lines.append(f"- `{name}` moves {r['read_bytes'] / 1e9:.3f} GB read + {r['write_bytes'] / 1e9:.3f} GB written "
                     f"per step (whatever the batch); its mix ({mixed['read_bytes'] / 1e9:.2f} GB read, "
                     f"{mixed['write_bytes'] / 1e9:.2f} GB written) took {mixed['concurrent_s']:.3f} s in flight "
                     f"together and {mixed['serial_s']:.3f} s one after the other; roofline "
                     f"{r['io_roofline_s']:.3f} s (serial {r['serial_roofline_s']:.3f} s, concurrent "
                     f"{r['concurrent_roofline_s']:.3f} s).")
    lines.append("")
    for name, r in doc["configs"].items():
        lines += [f"**{name}** (batch {r['batch']} x {r['tokens']} tokens):", "",
                  "| system | median step (s) | min step (s) |", "|---|---|---|"]
        lines += [f"| {sys_} | {v['median_step_time_s']:.3f} | {v['min_step_time_s']:.3f} |"
                  for sys_, v in r["summary"].items()]
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in r["ratios"].items()]
        for system, adj in r["adjacent"].items():
            spread_ = adj["spread"]
            lines += ["", f"`{system}`: per-step ratios to the adjacent roofline "
                      f"({len(adj['step_over_adjacent_roofline'])} steps): median {spread_['median']:.3f}, min "
                      f"{spread_['min']:.3f}, quartiles {spread_['q1']:.3f} / {spread_['q3']:.3f}, max "
                      f"{spread_['max']:.3f}; all: " + ", ".join(f"{v:.2f}" for v in adj["step_over_adjacent_roofline"])
                      + ". Adjacent probes' read bandwidth " + ", ".join(f"{v:.2f}" for v in adj["adjacent_read_gb_per_s"])
                      + " GB/s; write " + ", ".join(f"{v:.2f}" for v in adj["adjacent_write_gb_per_s"]) + " GB/s.", "",
                      f"| phase ({system}) | median time (s) | ideal disk time of its bytes (s) | median ratio |",
                      "|---|---|---|---|"]
            lines += [f"| {ph} | {v['median_s']:.3f} | {v['ideal_disk_s']:.3f} | {v['median_ratio']:.2f} |"
                      for ph, v in adj["phases"].items()]
        lines += [""]
    lines += ["Phase ideal times (P: parameter bytes; at the adjacent probe's read and write bandwidth). After "
              "backward (`ours-nvme`), the optimizer reads 4P and writes 3P, and the forward and the backward "
              "share one row: together they read K (the step's reads less 4P: the forward reads P less the updated "
              "shards the overlapped step handed to it, the backward what the forward did not keep gathered) and "
              "the backward writes P. The overlapped step's optimizer row is the host's wait for the step (its "
              "exposed time), so it can be far below its bytes' ideal; backward also reads the optimizer's first "
              "chunks' states ahead. In backward (`ours-nvme-ib`), the forward reads P, the backward reads K + 3P "
              "and writes 3P and the optimizer phase is the tail of those writes, so the two are one row.", "",
              "Targets: ours / deepspeed-nvme at its best <= 0.6 and ours step / I/O roofline <= 1.2. "
              + _compute_bound(doc) + " The losses of `ours-nvme`, `ours-nvme-ib` and `ours-cpu` "
              "agree bit for bit (also pinned by tests/test_nvme_training.py)."]
    ds = doc.get("deepspeed")
    if ds and ds["sweep"]:
        best = ds["best"]
        lines += ["", f"**DeepSpeed at its best.** `deepspeed-nvme` steps with {ds['optimizer'] or 'DeepSpeedCPUAdam'} "
                  "(its fused C++ Adam, JIT-built; `torch_adam` off), optimizer swapping pipelined "
                  "(`pipeline_read`, `pipeline_write` on), 1 MiB aio blocks; its aio queue depth and "
                  "`intra_op_parallelism` (I/O threads) were swept on the "
                  f"{ds['sweep_config']} config, each setting in its own process next to `ours-nvme` "
                  f"({ds['sweep_blocks']} blocks after 1 warm-up), and the headline rows above use the fastest"
                  + (f": queue depth {best['queue_depth']}, {best['threads']} threads." if best else " (none ran)."),
                  "", "| queue depth | threads | deepspeed median step (s) | ours-nvme median step (s) | ours / deepspeed (paired) |",
                  "|---|---|---|---|---|"]
        for e in ds["sweep"]:
            if "error" in e:
                lines.append(f"| {e['queue_depth']} | {e['threads']} | failed | | |")
            else:
                lines.append(f"| {e['queue_depth']} | {e['threads']} | {e['deepspeed_median_step_time_s']:.3f} | "
                             f"{e['ours_median_step_time_s']:.3f} | {e['ours/deepspeed (median of paired ratios)']:.3f} |")
    if doc.get("deepspeed_nvme_error"):
        lines += ["", "DeepSpeed's NVMe offload did not run on this machine; its error (last lines):", "", "```",
                  *doc["deepspeed_nvme_error"].strip().splitlines()[-12:], "```"]
    results_md.write_section("nvme-step", "\n".join(lines))


if __name__ == "__main__":
    main()
