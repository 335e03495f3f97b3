"""Simulator speed against its two targets, measured on the machine that runs it.

1. Simulating one iteration of the paper's 1T configuration (128 layers, hd 25600, batch/GPU 7,
   everything offloaded to NVMe, recompute inputs on the CPU) on 16 GPUs of `dgx2-v100` in under 0.5 s.
2. `planner fit 1T --gpus 16` (default hardware dgx-h100, and with `--hardware dgx2-v100`),
   including the simulated refinement of the analytic search's best candidates, in under 2 s wall
   time (a fresh process, start-up included).

Also, side by side on the same plan: the representative rank vs simulating every GPU of the node
([Note: representative rank] in planner/sim/engine.py), which is what makes target 1 reachable.

Run: `python benchmarks/sim_speed.py [--repeats 5] [--write-results]`; prints JSON, and with
`--write-results` replaces the `sim_speed` section of benchmarks/RESULTS.md. Timings are medians of
`--repeats` runs; the section gives the spread of each series and the load average around the run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

import results_md  # benchmarks/ is on sys.path when a script runs

from planner.sim import fast, samples, simulate
from planner.sim.periodic import simulate_periodic
from planner.specs.catalog import resolve_hardware, resolve_model
from planner.specs.plan import Placement, Plan

SECTION = "## Simulator speed (benchmarks/sim_speed.py)"


def one_t_plan() -> Plan:
    placement = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")
    return Plan(model=resolve_model("1T"), node=resolve_hardware("dgx2-v100"), num_gpus=16, placement=placement,
                micro_batch_per_gpu=7, recompute_interval=1)


def tiled_1t_plan() -> Plan:
    """The dashboard's slowest Timeline: 1T on 32 GPUs of dgx-h100, tiling 8, parameters on NVMe."""
    placement = Placement(params="nvme", gradients="cpu", optimizer_states="cpu", recompute_inputs="cpu")
    return Plan(model=resolve_model("1T"), node=resolve_hardware("dgx-h100"), num_gpus=32, placement=placement,
                micro_batch_per_gpu=19, recompute_interval=4, tiling_factor=8)


def fresh_periodic(plan: Plan) -> None:
    samples.forget_samples()
    simulate_periodic(plan)


def median_s(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def fit_wall_s(repeats: int, extra: list[str]) -> tuple[float, list[float]] | None:
    exe = shutil.which("planner") or None
    cmd = [exe] if exe else [sys.executable, "-m", "tierwise"]
    args = cmd + ["fit", "1T", "--gpus", "16", *extra]
    probe = subprocess.run(args, capture_output=True, text=True)
    if probe.returncode != 0:
        print(f"planner fit failed ({probe.returncode}): {probe.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return median_s(lambda: subprocess.run(args, capture_output=True, check=True), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-results", action="store_true", help="replace this benchmark's section of RESULTS.md")
    args = parser.parse_args()
    machine = results_md.measure_machine()

    plan = one_t_plan()
    simulate(plan)  # warm imports and caches
    sim_s, sim_all = median_s(lambda: simulate(plan), args.repeats)
    small = plan.replace(model=plan.model.replace(num_layers=16))
    rep_s, rep_all = median_s(lambda: simulate(small), args.repeats)
    explicit_s, explicit_all = median_s(lambda: simulate(small, ranks="explicit"), args.repeats)
    tiled = tiled_1t_plan()
    whole_s, whole_all = median_s(lambda: simulate(tiled), args.repeats)
    periodic_s, periodic_all = median_s(lambda: fresh_periodic(tiled), args.repeats)
    fast.predict(tiled)  # what refine does before the panel opens ([Note: shared samples])
    kept_s, kept_all = median_s(lambda: simulate_periodic(tiled), args.repeats)
    fit = fit_wall_s(args.repeats, [])
    fit_v100 = fit_wall_s(args.repeats, ["--hardware", "dgx2-v100"])
    series = {"simulate 1T": sim_all, "representative rank": rep_all, "every rank": explicit_all,
              "whole timeline": whole_all, "periodic": periodic_all, "periodic after refine": kept_all,
              "fit dgx-h100": fit[1] if fit else [], "fit dgx2-v100": fit_v100[1] if fit_v100 else []}
    result = {
        "machine": machine.finish().to_dict(),
        "spread": {name: round(results_md.spread(runs), 2) for name, runs in series.items() if runs},
        "simulate_1t_16gpu_s": round(sim_s, 4),
        "simulate_1t_16gpu_runs_s": [round(t, 4) for t in sim_all],
        "simulated_iteration_s": round(simulate(plan).prediction.iteration_time_s, 3),
        "target_simulate_s": 0.5,
        "representative_vs_explicit_16_layers": {"representative_s": round(rep_s, 4), "explicit_16_ranks_s": round(explicit_s, 4),
                                                 "speedup": round(explicit_s / rep_s, 1)},
        "timeline_1t_tiled_32gpu": {"whole_s": round(whole_s, 4), "periodic_s": round(periodic_s, 4),
                                    "periodic_after_refine_s": round(kept_s, 4)},
        "fit_1t_16gpu_wall_s": round(fit[0], 3) if fit else None,
        "fit_1t_16gpu_runs_s": [round(t, 3) for t in fit[1]] if fit else None,
        "fit_1t_16gpu_dgx2_wall_s": round(fit_v100[0], 3) if fit_v100 else None,
        "fit_1t_16gpu_dgx2_runs_s": [round(t, 3) for t in fit_v100[1]] if fit_v100 else None,
        "target_fit_s": 2.0,
    }
    print(json.dumps(result, indent=2))
    if args.write_results:
        write_results(result, args.repeats, machine)


def write_results(r: dict, repeats: int, machine: results_md.MachineFacts) -> None:
    fit = f"{r['fit_1t_16gpu_wall_s']} s (runs {r['fit_1t_16gpu_runs_s']})" if r["fit_1t_16gpu_wall_s"] else "not measured (fit failed)"
    fit_v100 = (f"{r['fit_1t_16gpu_dgx2_wall_s']} s (runs {r['fit_1t_16gpu_dgx2_runs_s']})"
                if r["fit_1t_16gpu_dgx2_wall_s"] else "not measured (fit failed)")
    rv = r["representative_vs_explicit_16_layers"]
    tl = r["timeline_1t_tiled_32gpu"]
    spread = ", ".join(f"{name} {x:.2f}x" for name, x in r["spread"].items())
    body = f"""{SECTION}

`python benchmarks/sim_speed.py --repeats {repeats} --write-results`: medians of {repeats} runs. {machine.describe()}

| what | median | target |
|---|---|---|
| simulate one iteration, 1T (128 layers) on 16 x dgx2-v100, all on NVMe | {r['simulate_1t_16gpu_s']} s (runs {r['simulate_1t_16gpu_runs_s']}) | < {r['target_simulate_s']} s |
| `planner fit 1T --gpus 16` (dgx-h100) incl. simulated refinement of the top 8 placements, fresh process | {fit} | < {r['target_fit_s']} s |
| `planner fit 1T --gpus 16 --hardware dgx2-v100`, same | {fit_v100} | < {r['target_fit_s']} s |
| Timeline panel, 1T tiling 8 on 32 x dgx-h100 (params on NVMe): whole simulation vs periodic timelines ([Note: periodic timelines]) vs periodic after `refine` kept the samples | {tl['whole_s']} s vs {tl['periodic_s']} s vs {tl['periodic_after_refine_s']} s | same timelines (tests/test_sim_periodic.py) |
| 16-layer variant: representative rank vs every GPU of the node simulated | {rv['representative_s']} s vs {rv['explicit_16_ranks_s']} s ({rv['speedup']}x) | same times (tested) |

Simulated iteration of that plan: {r['simulated_iteration_s']} s. Spread of each series (slowest / fastest run):
{spread}.
"""
    results_md.write_section("sim_speed", body)


if __name__ == "__main__":
    main()
