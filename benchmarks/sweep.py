"""Sweep: the simulator against the real runtime on the machine that runs it, before and after
calibration.

    python benchmarks/sweep.py --write-results

1. `planner probe` (quick: 256 MiB of NVMe traffic) writes this machine's hardware spec, unless
   `--hardware FILE` gives one. Without CUDA the probe calibrates itself on four reference runs of
   the runtime, none of them a configuration below (planner/calibration/probe_reference.py), so the
   "probe spec" predictions are of plans the spec never saw.
2. Every configuration in `CONFIGS` (placements of params / gradients / optimizer states on device,
   cpu and nvme; three model sizes; micro-batch; recompute interval; tiling) is planned with that
   spec, simulated (`planner.sim`), and trained by the real runtime (`planner run`), in `--rounds`
   rounds ([Note: sweep rounds], above `measured_time_s`), at the highest CPU and I/O priority
   allowed (benchmarks/priority.py `take_priority`).
3. `planner calibrate` fits the spec's efficiency parameters on `CALIBRATION` (4 configurations,
   one per term of the calibration model) and the held-out ones are predicted again with the
   calibrated spec.
4. Prints JSON; with `--write-results` writes docs/calibration.md, docs/sweep-scatter.png and the
   "Simulator vs runtime (sweep)" section of benchmarks/RESULTS.md.

A run's wall time is in its RESULTS section; `--reuse` skips configurations whose profile is already
in `--work-dir` (for re-analysis only: timings should come from one run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner.calibration.probe_reference import pinned_plan  # noqa: E402
from planner.sim.report import simulate  # noqa: E402
from planner.specs.hardware import NodeSpec  # noqa: E402
from planner.specs.plan import TIERS, Plan  # noqa: E402
from planner.specs.profile import Profile, load_profile  # noqa: E402
from runtime.launch import WARMUP_STEPS  # noqa: E402
from tierwise.cli.counted import Counted  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import results_md  # noqa: E402
from priority import take_priority  # noqa: E402

SIZES = {"S": (4, 512, 8), "M": (6, 768, 12), "L": (8, 1024, 16)}
SEQ, VOCAB = 256, 256


@dataclass(frozen=True, slots=True)
class Config:
    name: str
    size: str
    params: str
    optimizer: str
    gradients: str
    recompute_inputs: str
    batch: int
    recompute_interval: int
    tiling: int = 1


# gpu = the compute device (host memory on a CPU-only machine), cpu = the host store, nvme = swap files.
CONFIGS = (
    Config("S-cpu-cpu", "S", "cpu", "cpu", "cpu", "cpu", 4, 1),
    Config("S-gpu-cpu", "S", "gpu", "cpu", "cpu", "gpu", 4, 0),
    Config("S-gpu-gpu", "S", "gpu", "gpu", "gpu", "gpu", 8, 2),
    Config("S-nvme-nvme", "S", "nvme", "nvme", "nvme", "cpu", 8, 0),
    Config("S-cpu-gpu-t2", "S", "cpu", "gpu", "gpu", "gpu", 2, 1, 2),
    Config("M-cpu-cpu-t2", "M", "cpu", "cpu", "cpu", "cpu", 4, 1, 2),
    Config("M-nvme-nvme", "M", "nvme", "nvme", "nvme", "cpu", 4, 1),
    Config("M-cpu-nvme", "M", "cpu", "nvme", "cpu", "cpu", 2, 2),
    Config("M-nvme-cpu", "M", "nvme", "cpu", "cpu", "cpu", 4, 1),
    Config("M-gpu-gpu-t4", "M", "gpu", "gpu", "gpu", "gpu", 2, 1, 4),
    Config("M-gpu-nvme", "M", "gpu", "nvme", "nvme", "gpu", 8, 1),
    Config("L-cpu-cpu", "L", "cpu", "cpu", "cpu", "cpu", 2, 1),
    Config("L-gpu-gpu-t2", "L", "gpu", "gpu", "gpu", "gpu", 4, 0, 2),
    Config("L-cpu-nvme", "L", "cpu", "nvme", "cpu", "cpu", 2, 2),
)
# One configuration per term of the calibration model, as in the probe's reference runs: memory-bound
# heavy (all on device, batch 8), NVMe both ways, NVMe optimizer from host parameters, and tiling 4
# (four times the operators for the same flops). Without a tiled configuration the per-operator term
# cannot be told from memory-bound work (docs/notes/2026-11-23-calibration-operator-cost.md).
CALIBRATION = ("S-gpu-gpu", "M-nvme-nvme", "M-gpu-gpu-t4", "M-cpu-nvme")


def plan_for(config: Config, node: NodeSpec, nvme_path: str) -> Plan:
    layers, hidden, heads = SIZES[config.size]
    model = {"name": config.size, "num_layers": layers, "hidden_size": hidden, "num_heads": heads,
             "seq_len": SEQ, "vocab_size": VOCAB}
    placement = {"params": config.params, "gradients": config.gradients, "optimizer_states": config.optimizer,
                 "recompute_inputs": config.recompute_inputs}
    return pinned_plan(node, model, placement, micro_batch_per_gpu=config.batch,
                       recompute_interval=config.recompute_interval, tiling_factor=config.tiling, nvme_path=nvme_path)


def step_times_s(profile: Profile) -> list[float]:
    """The step times after the warm-up steps."""
    steps = profile.samples[profile.warmup_steps:] or profile.samples
    return [s.step_time_s for s in steps]


# [Note: sweep rounds] A shared machine's speed can change several-fold from one minute to the next
# (docs/notes/2026-11-22-benchmark-runs-kept-by-hand.md), so one pass would compare a prediction with
# whatever state the machine was in. The sweep runs in `--rounds` rounds; every round probes the
# machine and then runs every configuration once (two warm-up steps, runtime/launch.py WARMUP_STEPS,
# then `--steps - 2` measured ones), in an order rotated each round. The spec is the median of the
# rounds' probes, a configuration's measurement is the median of all its measured steps over the
# rounds, and the calibration fits every round's profile: prediction and measurement sample the same
# spread of machine states. The measurement runs at the highest CPU and I/O priority, in a scheduler
# group of its own, its runs' workers included, when allowed (benchmarks/priority.py `take_priority`).
def measured_time_s(profiles: list[Profile]) -> float:
    """Median of the measured steps of every round ([Note: sweep rounds])."""
    return statistics.median(t for p in profiles for t in step_times_s(p))


def run_config(plan_path: Path, profile_path: Path, steps: int, store: Path) -> float:
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "tierwise", "run", str(plan_path), "--steps", str(steps),
           "--profile-out", str(profile_path), "--store", str(store)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return time.perf_counter() - start


def probe(path: Path, nvme_path: str) -> None:
    cmd = [sys.executable, "-m", "tierwise", "probe", "--calibrate", "--out", str(path), "--nvme-test-gib", "0.25",
           "--nvme-path", nvme_path]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


MEDIAN_KEYS = ("gpu_peak_tflops", "cpu_adam_gparams_per_s", "nvme_read_gb_per_s", "nvme_write_gb_per_s",
               "host_memory_gb_per_s", "host_to_gpu_gb_per_s", "gpu_to_host_gb_per_s", "gpu_hbm_gb_per_s")


def median_spec(paths: list[Path]) -> dict:
    """The first probe's document with every measured rate replaced by the median over the probes."""
    docs = [json.loads(p.read_text()) for p in paths]
    out = dict(docs[0])
    for key in MEDIAN_KEYS:
        if key in out:
            out[key] = statistics.median(d[key] for d in docs)
    # A categorical measurement: the majority of the probes.
    shares = [d.get("nvme_read_write", "independent") for d in docs]
    out["nvme_read_write"] = max(sorted(set(shares)), key=shares.count)
    out["notes"] = (out.get("notes", "") + f" Rates: medians of {len(docs)} probes taken between the sweep's rounds "
                    "(benchmarks/sweep.py [Note: sweep rounds]).").strip()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, default=Path("/tmp/tierwise-sweep"))
    ap.add_argument("--hardware", type=Path, default=None, help="hardware spec to use instead of probing")
    ap.add_argument("--nvme-path", default="/tmp")
    ap.add_argument("--steps", type=int, default=5, help="training steps per configuration and round (the first two are warm-up)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over every configuration ([Note: sweep rounds])")
    ap.add_argument("--only", default=None, help="comma-separated configuration names")
    ap.add_argument("--reuse", action="store_true", help="keep profiles already in --work-dir")
    ap.add_argument("--write-results", action="store_true")
    ap.add_argument("--collect-only", action="store_true", help="run the configurations, skip the analysis")
    args = ap.parse_args()
    priority = "" if args.reuse else take_priority()
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    facts = results_md.measure_machine(torch=True)
    configs = [c for c in CONFIGS if args.only is None or c.name in args.only.split(",")]
    probes: list[Path] = []
    profiles: dict[str, list[Profile]] = {c.name: [] for c in configs}
    runs = Counted(args.rounds * (len(configs) + (args.hardware is None)), "sweep: probes and training runs")
    for r in range(args.rounds):
        if args.hardware is None:
            path = work / f"probed.r{r}.json"
            if not (args.reuse and path.exists()):
                probe(path, args.nvme_path)
            probes.append(path)
            runs.done(f"round {r}: probed this machine")
        # Any spec will do to run: the runtime uses the plan's placement and sizes, not its rates.
        run_node = NodeSpec.from_dict(json.loads((args.hardware or probes[0]).read_text()), "hardware")
        for config in configs[r % len(configs):] + configs[: r % len(configs)]:
            plan_path, profile_path = work / f"{config.name}.plan.json", work / f"{config.name}.r{r}.profile.json"
            plan_for(config, run_node, args.nvme_path).save(plan_path)
            if not (args.reuse and profile_path.exists()):
                wall = run_config(plan_path, profile_path, args.steps, work / "history.sqlite")
                print(f"round {r}: ran {config.name} in {wall:.1f} s", file=sys.stderr)
            runs.done(f"round {r}: {config.name}")
            profiles[config.name].append(load_profile(profile_path))
    hw_path = args.hardware or work / "probed.json"
    if args.hardware is None:
        hw_path.write_text(json.dumps(median_spec(probes), indent=2))
    node = NodeSpec.from_dict(json.loads(hw_path.read_text()), f"hardware {hw_path}")
    plans = {}
    for config in configs:
        plan = plan_for(config, node, args.nvme_path)
        plans[config.name] = plan.replace(prediction=simulate(plan).prediction)
        plans[config.name].save(work / f"{config.name}.plan.json")
    # The facts of the run that measured the profiles; a --reuse re-analysis reports those, not its own.
    collection = work / "collection.json"
    if args.reuse and collection.exists():
        machine = json.loads(collection.read_text())
        if "facts" not in machine:
            raise SystemExit(f"{collection} was written by an older sweep.py (no machine facts): run without --reuse")
    else:
        machine = {"facts": facts.finish().to_dict(), "steps_per_config": args.steps, "warmup_steps": WARMUP_STEPS,
                   "rounds": args.rounds, "priority": priority}
        collection.write_text(json.dumps(machine))
    if args.collect_only:
        return 0
    report = analyse(plans, profiles, node)
    report["machine"] = {**machine, "hardware": str(hw_path)}
    print(json.dumps(report, indent=2))
    if args.write_results:
        from sweep_report import write_results

        write_results(report, node)
    return 0


def analyse(plans: dict[str, Plan], profiles: dict[str, list[Profile]], node: NodeSpec) -> dict:
    from planner.calibration.calibrate import calibrate, calibration_rows
    from planner.cost.memory import memory_bill, runtime_buffer_peak_bytes

    train = [n for n in plans if n in CALIBRATION]
    fit = calibrate([(plans[n], p) for n in train for p in profiles[n]], node) if train else None
    rows = []
    for name, plan in plans.items():
        runs = profiles[name]
        per_round = [statistics.median(step_times_s(p)) for p in runs]
        row = {"config": name, "calibration": name in CALIBRATION, "measured_s": measured_time_s(runs),
               "round_medians_s": per_round, "predicted_s": plan.prediction.iteration_time_s}
        if fit is not None:
            row["calibrated_s"] = simulate(plan.replace(node=fit.node)).prediction.iteration_time_s
        profile = runs[0]  # peaks are deterministic: the same in every round
        buffers = runtime_buffer_peak_bytes(memory_bill(plan))
        for tier in TIERS:
            row[f"peak_{tier}_predicted"] = buffers[tier]
            row[f"peak_{tier}_measured"] = profile.measured.peak_bytes[tier]
        rows.append(row)
    return {"rows": rows, "calibration": None if fit is None else fit.to_dict(),
            "summary": calibration_rows(rows)}


if __name__ == "__main__":
    sys.exit(main())
