"""Simulator speed against its two targets, measured on the machine that runs it.

1. Simulating one iteration of the 1T plan `planner fit 1T --gpus 16 --hardware dgx2-v100` wrote
   with the step after backward (128 layers, hd 25600, batch/GPU 15, tiling 8, everything on NVMe,
   recompute inputs on the CPU: 221,000 SimPy events simulated whole) as `planner simulate` does
   (extrapolated over identical blocks, planner/sim/periodic.py) in at most 0.2 s, with the same
   iteration time as the whole simulation (to 1e-9); the events each simulates are reported.
2. `planner fit 1T --gpus 16` (default hardware dgx-h100, and with `--hardware dgx2-v100`),
   including the simulated refinement of the analytic search's best candidates, in at most 0.5 s
   wall time (a fresh process, start-up included, reading compiled bytecode as an installed
   package does: `installed_env`).
On a shared machine wall time includes other processes' turns: the CPU time of the in-process
series is given beside it, and the load average around the run.

3. Where target 2's CPU time goes: start-up, the analytic search, refine, the winner's critical
   path, and each runner-up simulated like the winner (extrapolated, or whole with its events).
Also, side by side on the same plan: the representative rank vs simulating every GPU of the node
([Note: representative rank] in planner/sim/engine.py), which is what makes target 1 reachable.

Run: `python benchmarks/sim_speed.py [--repeats 5] [--write-results]`; prints JSON, and with
`--write-results` replaces the `sim_speed` section of benchmarks/RESULTS.md. Timings are medians of
`--repeats` runs; the section gives the spread of each series and the load average around the run.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import results_md  # benchmarks/ is on sys.path when a script runs

from planner.sim import SimResult, fast, samples, simulate
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


def fit_v100_plan() -> Plan:
    """The 1T plan of `planner fit 1T --gpus 16 --hardware dgx2-v100` with the step after backward."""
    placement = Placement(params="nvme", gradients="nvme", optimizer_states="nvme", recompute_inputs="cpu")
    return Plan(model=resolve_model("1T"), node=resolve_hardware("dgx2-v100"), num_gpus=16, placement=placement,
                strategy="zero-inf-nvme", micro_batch_per_gpu=15, recompute_interval=1, tiling_factor=8)


def as_planner_simulate(plan: Plan) -> SimResult:
    """What `planner simulate PLAN` computes without `--timeline`, from nothing kept."""
    samples.forget_samples()
    return simulate_periodic(plan, intervals=False)


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


def median_cpu_s(fn, repeats: int) -> float:
    """Median CPU time of this process over `repeats` calls (what other processes' turns do not add)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--write-results", action="store_true", help="replace this benchmark's section of RESULTS.md")
    args = parser.parse_args()
    machine = results_md.measure_machine()
    result = {"issue_plan": issue_plan_series(args.repeats), **other_series(args.repeats),
              "fit_breakdown": fit_breakdown(), "fit_after_search": after_search_series(args.repeats)}
    result["machine"] = machine.finish().to_dict()
    print(json.dumps(result, indent=2))
    if args.write_results:
        write_results(result, args.repeats, machine)


def issue_plan_series(repeats: int) -> dict:
    """Target 1: the fit plan simulated as `planner simulate` does, beside the whole simulation."""
    plan = fit_v100_plan()
    whole = simulate(plan)
    periodic = as_planner_simulate(plan)
    if abs(periodic.prediction.iteration_time_s - whole.prediction.iteration_time_s) > 1e-9 * whole.prediction.iteration_time_s:
        raise SystemExit("the extrapolated iteration differs from the whole simulation's")
    wall_s, runs = median_s(lambda: as_planner_simulate(plan), repeats)
    whole_s, whole_runs = median_s(lambda: simulate(plan), max(1, repeats // 2))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plan.json"
        plan.save(path)
        cli = cli_wall_s(["simulate", str(path)], repeats)
    return {"iteration_s": round(whole.prediction.iteration_time_s, 3), "events": periodic.events,
            "events_whole": whole.events, "wall_s": round(wall_s, 4), "runs_s": [round(t, 4) for t in runs],
            "cpu_s": round(median_cpu_s(lambda: as_planner_simulate(plan), repeats), 4),
            "whole_wall_s": round(whole_s, 3), "whole_runs_s": [round(t, 3) for t in whole_runs],
            "cli_wall_s": round(cli[0], 3) if cli else None, "cli_cpu_s": round(cli[2], 3) if cli else None,
            "target_s": 0.2}


def other_series(repeats: int) -> dict:
    plan = one_t_plan()
    simulate(plan)  # warm imports and caches
    sim_s, sim_all = median_s(lambda: simulate(plan), repeats)
    small = plan.replace(model=plan.model.replace(num_layers=16))
    rep_s, _ = median_s(lambda: simulate(small), repeats)
    explicit_s, _ = median_s(lambda: simulate(small, ranks="explicit"), repeats)
    tiled = tiled_1t_plan()
    whole_s, _ = median_s(lambda: simulate(tiled), repeats)
    periodic_s, _ = median_s(lambda: fresh_periodic(tiled), repeats)
    fast.predict(tiled)  # what refine does before the panel opens ([Note: shared samples])
    kept_s, _ = median_s(lambda: simulate_periodic(tiled), repeats)
    fit = fit_wall_s(repeats, [])
    fit_v100 = fit_wall_s(repeats, ["--hardware", "dgx2-v100"])
    return {
        "paper_1t": {"whole_s": round(sim_s, 4), "runs_s": [round(t, 4) for t in sim_all],
                     "events": simulate(plan).events, "iteration_s": round(simulate(plan).prediction.iteration_time_s, 3)},
        "representative_vs_explicit_16_layers": {"representative_s": round(rep_s, 4), "explicit_16_ranks_s": round(explicit_s, 4),
                                                 "speedup": round(explicit_s / rep_s, 1)},
        "timeline_1t_tiled_32gpu": {"whole_s": round(whole_s, 4), "periodic_s": round(periodic_s, 4),
                                    "periodic_after_refine_s": round(kept_s, 4)},
        "fit_1t_16gpu_wall_s": round(fit[0], 3) if fit else None,
        "fit_1t_16gpu_cpu_s": round(fit[2], 3) if fit else None,
        "fit_1t_16gpu_dgx2_cpu_s": round(fit_v100[2], 3) if fit_v100 else None,
        "fit_1t_16gpu_runs_s": [round(t, 3) for t in fit[1]] if fit else None,
        "fit_1t_16gpu_dgx2_wall_s": round(fit_v100[0], 3) if fit_v100 else None,
        "fit_1t_16gpu_dgx2_runs_s": [round(t, 3) for t in fit_v100[1]] if fit_v100 else None,
        "target_fit_s": 0.5,
    }


def breakdown_rows(rows: list[dict]) -> str:
    lines = [f"| {r['stage']} | {r['cpu_s']} | {r.get('how', '')} | {format(r['events'], ',') if 'events' in r else ''} |"
             for r in rows]
    lines.append(f"| total | {round(sum(r['cpu_s'] for r in rows), 3)} | | |")
    return "\n".join(lines)


def fit_breakdown() -> list[dict]:
    """Where `planner fit 1T --gpus 16`'s CPU time goes, stage by stage in one process from nothing
    kept (the CLI's start-up in a fresh process): each simulated plan with how it was simulated
    (extrapolated from two samples, or whole) and its SimPy events."""
    from planner.output.verdict import critical_path, simulated_like
    from planner.search.refine import refine
    from planner.search.search import search

    samples.forget_samples()
    request = fit_request()
    rows = [{"stage": "start-up: `planner fit` to its search (fresh process, `fit 1T --gpus 0`, refused there)",
             "cpu_s": round(startup_cpu_s(), 3)}]

    def timed(stage: str, fn):  # noqa: ANN001, ANN202
        before = time.process_time()
        out = fn()
        rows.append({"stage": stage, "cpu_s": round(time.process_time() - before, 3)})
        return out

    result = timed("analytic search", lambda: search(request))
    result = timed("refine (simulates the best candidates)", lambda: refine(result))
    timed("winner's critical path (its timelines stretched)", lambda: critical_path(result.best))
    for plan in result.runners_up():
        pred = plan.prediction
        if pred is None or not pred.feasible or pred.method != "analytic":
            continue
        where = "/".join(str(tier) for tier in plan.placement.to_dict().values())
        simulated = timed(f"runner-up {where} simulated", lambda p=plan: simulated_like([p], result.best)[0])
        rows[-1].update(how_simulated(simulated))
        timed(f"runner-up {where} critical path", lambda p=simulated: critical_path(p))
    return rows


def fit_request():  # noqa: ANN201 - planner.search is imported where used
    """`planner fit 1T --gpus 16`'s search request (default hardware and options)."""
    from planner.search.search import SearchRequest
    from planner.specs.training_loop import TrainingLoop
    from tierwise.cli import options

    node = options.node(None, None)
    return SearchRequest(model=resolve_model("1T"), node=node, num_gpus=16, precision=options.precision(node, None),
                         pipeline_parallel_degree=1, training=TrainingLoop(optimizer_step=None, clips_grad_norm=False),
                         locked_memory_bytes=options.locked_memory_bytes(None, None))


def after_search_series(repeats: int) -> dict:
    """Wall time of `planner fit 1T --gpus 16` after its search (refine and the verdict, nothing kept),
    in one process and with the runner-ups simulated ahead in a forked worker ([Note: simulated
    ahead] in planner/sim/ahead.py; forked only where a core is idle then: the runs that forked are
    counted), the two interleaved run by run so that both meet the same load."""
    from planner.output.verdict import searcher, verdict
    from planner.search.refine import refine
    from planner.search.search import search
    from planner.sim import ahead

    result = search(fit_request())
    walls: dict[str, list[float]] = {"one_process": [], "worker": []}
    forked = 0
    for _ in range(repeats):
        for name, runners_ahead in (("one_process", False), ("worker", True)):
            samples.forget_samples()
            forked += runners_ahead and ahead.can_fork()  # a core idle now: `refine` forks a worker
            start = time.perf_counter()
            refined = refine(result, runners_ahead=runners_ahead)
            verdict(refined, searcher(refined.request))
            walls[name].append(time.perf_counter() - start)
            ahead.stop()
    return {name: {"wall_s": round(statistics.median(runs), 3), "runs_s": [round(t, 3) for t in runs]}
            for name, runs in walls.items()} | {"runs_with_a_worker": forked}


BYTECODE_CACHE = Path(tempfile.mkdtemp(prefix="sim-speed-pycache-"))
atexit.register(shutil.rmtree, BYTECODE_CACHE, ignore_errors=True)


def installed_env() -> dict[str, str]:
    """The environment of a fresh `planner` process that reads compiled bytecode, as an installed
    package does (pip compiles it at install; Python writes it on first import). Where the caller's
    environment forbids writing bytecode (PYTHONDONTWRITEBYTECODE), every process would otherwise
    compile the ~8,600 lines of source fit imports (about 0.2 s of CPU): the untimed first run of
    each series writes the bytecode into a temporary cache (PYTHONPYCACHEPREFIX) instead."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(BYTECODE_CACHE)
    return env


def startup_cpu_s() -> float:
    """CPU seconds of a fresh `planner fit` up to its search: interpreter, command line and the
    modules fit imports, then `--gpus 0` refused (it checks the options once it has imported them).
    The first, untimed run writes the bytecode (`installed_env`)."""
    cmd = [sys.executable, "-m", "tierwise", "fit", "1T", "--gpus", "0"]
    subprocess.run(cmd, capture_output=True, env=installed_env())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(cmd, capture_output=True, text=True, env=installed_env())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 1 or "--gpus" not in done.stderr:
        raise SystemExit(f"planner fit --gpus 0 was not refused as expected: {done.stderr.strip()[-300:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def how_simulated(plan: Plan) -> dict:
    """Extrapolated from which samples, or whole, and the SimPy events either took."""
    details = plan.prediction.details if plan.prediction else {}
    streams = details.get("two_streams_from_layers")
    if streams:  # [Note: two streams] in planner/sim/streams.py
        return {"how": f"two streams from {streams[0]}, {streams[1]} and {streams[2]} layers",
                "events": sum(s.events for s in samples.simulate_samples(plan, streams))}
    counts = details.get("extrapolated_from_layers")
    if counts:
        return {"how": f"extrapolated from {counts[0]} and {counts[1]} layers",
                "events": sum(s.events for s in samples.simulate_samples(plan, counts))}
    return {"how": f"whole ({plan.model.num_layers} layers)", "events": samples.simulate_whole(plan).events}


def cli_wall_s(args: list[str], repeats: int) -> tuple[float, list[float], float] | None:
    """(median wall s, runs, median CPU s of the child) of `planner ARGS` in a fresh process."""
    exe = shutil.which("planner") or None
    cmd = ([exe] if exe else [sys.executable, "-m", "tierwise"]) + args
    probe = subprocess.run(cmd, capture_output=True, text=True, env=installed_env())  # untimed: writes the bytecode
    if probe.returncode != 0:
        print(f"planner {args[0]} failed ({probe.returncode}): {probe.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    cpu: list[float] = []

    def run() -> None:
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, capture_output=True, check=True, env=installed_env())
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)

    wall, runs = median_s(run, repeats)
    return wall, runs, statistics.median(cpu)


def fit_wall_s(repeats: int, extra: list[str]) -> tuple[float, list[float]] | None:
    return cli_wall_s(["fit", "1T", "--gpus", "16", *extra], repeats)


def write_results(r: dict, repeats: int, machine: results_md.MachineFacts) -> None:
    fit = (f"{r['fit_1t_16gpu_wall_s']} s wall, {r['fit_1t_16gpu_cpu_s']} s CPU (runs {r['fit_1t_16gpu_runs_s']})"
           if r["fit_1t_16gpu_wall_s"] else "not measured (fit failed)")
    fit_v100 = (f"{r['fit_1t_16gpu_dgx2_wall_s']} s wall, {r['fit_1t_16gpu_dgx2_cpu_s']} s CPU "
                f"(runs {r['fit_1t_16gpu_dgx2_runs_s']})" if r["fit_1t_16gpu_dgx2_wall_s"] else "not measured (fit failed)")
    rv, tl, ip, pp = (r["representative_vs_explicit_16_layers"], r["timeline_1t_tiled_32gpu"], r["issue_plan"],
                      r["paper_1t"])
    fa = r["fit_after_search"]
    body = f"""{SECTION}

`python benchmarks/sim_speed.py --repeats {repeats} --write-results`: medians of {repeats} runs (wall time; CPU time of this process where given). {machine.describe()}

| what | median | events | target |
|---|---|---|---|
| simulate one iteration of `fit 1T --gpus 16 --hardware dgx2-v100`'s plan (after backward, batch/GPU 15, tiling 8, all on NVMe) as `planner simulate` does: extrapolated over identical blocks | {ip['wall_s']} s wall, {ip['cpu_s']} s CPU (runs {ip['runs_s']}) | {ip['events']:,} | <= {ip['target_s']} s |
| the same plan simulated whole (the same iteration, {ip['iteration_s']} s) | {ip['whole_wall_s']} s (runs {ip['whole_runs_s']}) | {ip['events_whole']:,} | |
| `planner simulate` of that plan, fresh process (start-up included) | {ip['cli_wall_s']} s wall, {ip['cli_cpu_s']} s CPU | {ip['events']:,} | |
| `planner fit 1T --gpus 16` (dgx-h100) incl. simulated refinement, fresh process | {fit} | | <= {r['target_fit_s']} s |
| `planner fit 1T --gpus 16 --hardware dgx2-v100`, same | {fit_v100} | | <= {r['target_fit_s']} s |
| the paper's 1T (batch/GPU 7, tiling 1) on 16 x dgx2-v100 simulated whole | {pp['whole_s']} s (runs {pp['runs_s']}) | {pp['events']:,} | |
| Timeline panel, 1T tiling 8 on 32 x dgx-h100 (params on NVMe): whole simulation vs periodic timelines ([Note: periodic timelines]) vs periodic after `refine` kept the samples | {tl['whole_s']} s vs {tl['periodic_s']} s vs {tl['periodic_after_refine_s']} s | | same timelines (tests/test_sim_periodic.py) |
| 16-layer variant: representative rank vs every GPU of the node simulated | {rv['representative_s']} s vs {rv['explicit_16_ranks_s']} s ({rv['speedup']}x) | | same times (tested) |

Where `planner fit 1T --gpus 16`'s CPU time goes (one run, stage by stage, nothing kept):

| stage | CPU s | simulated | events |
|---|---|---|---|
{breakdown_rows(r['fit_breakdown'])}

After the search (refine and the verdict, nothing kept), wall time in one process vs with the runner-ups simulated ahead in a forked worker ([Note: simulated ahead] in planner/sim/ahead.py; forked in {fa['runs_with_a_worker']} of {repeats} runs: only where a core is idle at that moment), interleaved: {fa['one_process']['wall_s']} s (runs {fa['one_process']['runs_s']}) vs {fa['worker']['wall_s']} s (runs {fa['worker']['runs_s']}).
"""
    results_md.write_section("sim_speed", body)


if __name__ == "__main__":
    main()
